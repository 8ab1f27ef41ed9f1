"""Candidates and the emulated cluster: where CONA's time comes from in emulated mode.

**Candidates** (:func:`build_candidates`): ``cona.candidates`` if given, else
every valid strategy for the device count with global batch sizes
``cona.global_batch_sizes`` (default: the configured global batch times 1, 2,
4, 8) and micro-batch sizes 1, 2, 4, 8, filtered by per-device memory
(:class:`cona.memory_model.MemoryModel`) when a limit is known.

**Emulated clock** (:class:`EmulatedCluster`): the small proxy model really
trains on the real corpus in ONE process; time comes from the analytic cost
model (:class:`cona.cost_model.CostModel`, uncalibrated) of the *target* model
(``cona.target_model``, e.g. ``gpt3_1.3b``) on ``cona.num_gpus`` devices of
type ``cona.gpu``.  The proxy trains with the strategy's *global batch size*
(in sequences of the proxy's own length), which is what changes convergence;
DP, TP, PP and the micro-batch size only change the modelled step time (the
proxy's own micro-batch size is :func:`proxy_micro_batch_size`, which does not
change the mathematics of a step).  Evaluations are not charged to the clock.

Switch costs on the emulated clock (assumptions, not measurements):

- layout switch (DP/TP/PP change): :data:`LAYOUT_SWITCH_FIXED_S` (new NCCL
  communicators, model build, reshard plan) plus moving the model state a
  device needs (bf16 weights + fp32 master and Adam moments, 14 bytes per
  parameter of its new shard) over the intra-node (or inter-node) link;
- batch switch (same layout, new micro/global batch): no resharding, only a
  new data iterator and micro-batch schedule; modelled as
  :data:`BATCH_SWITCH_STEPS` lost step of the new strategy (the CPU runtime
  measures milliseconds for it).
"""

from __future__ import annotations

import math
from functools import reduce

from jobruntime.config import JobConfig, ModelConfig, load_config

from .controller import switch_kind
from .cost_model import CostModel
from .memory_model import MemoryModel
from .strategy import Strategy, enumerate_strategies, strategies_from_dicts

LAYOUT_SWITCH_FIXED_S = 10.0
BATCH_SWITCH_STEPS = 1.0
MOVED_BYTES_PER_PARAM = 14.0  # bf16 weight (2) + fp32 master weight and Adam m, v (12)
AUTO_MICRO_BATCH_SIZES = (1, 2, 4, 8)


def global_batch_sizes(cfg: JobConfig) -> list[int]:
    """``cona.global_batch_sizes`` or the configured global batch times 1, 2, 4, 8."""
    if cfg.cona.global_batch_sizes:
        return sorted({int(b) for b in cfg.cona.global_batch_sizes})
    gb = cfg.parallel.global_batch_size
    return [gb * k for k in (1, 2, 4, 8)]


def build_candidates(
    cfg: JobConfig,
    model: ModelConfig,
    world_size: int,
    *,
    memory_limit_bytes: float | None = None,
    precision: str = "mixed",
) -> list[Strategy]:
    """Candidate strategies for ``model`` on ``world_size`` devices (module docstring).

    Raises:
        ValueError: an explicit candidate is invalid, or none is left.
    """
    if cfg.cona.candidates:
        cands = strategies_from_dicts(cfg.cona.candidates, model, world_size)
    else:
        mem = MemoryModel(model, precision=precision) if memory_limit_bytes else None
        cands = enumerate_strategies(
            model,
            world_size,
            global_batch_sizes=global_batch_sizes(cfg),
            micro_batch_sizes=AUTO_MICRO_BATCH_SIZES,
            memory_limit_bytes=memory_limit_bytes,
            memory_model=mem,
        )
    if not cands:
        raise ValueError(
            f"no valid CONA candidate strategy for {world_size} devices; list "
            "cona.candidates or change cona.global_batch_sizes"
        )
    return cands


def target_model_config(cfg: JobConfig) -> ModelConfig:
    """The model whose FLOPs and bytes time the run (``cona.target_model`` or this one)."""
    return load_config(cfg.cona.target_model).model if cfg.cona.target_model else cfg.model


def proxy_micro_batch_size(global_batch_size: int, configured: int) -> int:
    """The proxy's micro-batch: near ``global/4`` but >= ``configured``, and <= ``global/2``.

    At least two micro-batches per step keep the gradient noise scale
    measurable in one process (:mod:`cona.probe`, ``"microbatch"`` mode); a
    divisor of the global batch is returned.
    """
    if global_batch_size < 2:
        return 1
    mb = min(max(configured, global_batch_size // 4), global_batch_size // 2)
    while global_batch_size % mb:
        mb -= 1
    return max(mb, 1)


def lcm_of(values) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), values, 1)


class EmulatedCluster:
    """Modelled step and switch times of the target model on ``num_gpus`` x ``gpu``.

    Args:
        target: the target model (e.g. GPT-3 1.3B).
        gpu: GPU profile name (``jobruntime/gpu_profiles.yaml``).
        num_gpus: devices of the emulated job.
    """

    def __init__(self, target: ModelConfig, gpu: str, num_gpus: int):
        self.target, self.num_gpus = target, num_gpus
        self.cost_model = CostModel(target, gpu)
        self._memory = MemoryModel(target)

    @property
    def memory_limit_bytes(self) -> float:
        return float(self.cost_model.gpu.memory_bytes)

    def iter_s(self, strategy: Strategy) -> float:
        """Seconds per optimizer step (analytic, uncalibrated)."""
        return self.cost_model.analytic(strategy).iter_s

    def switch_s(self, old: Strategy, new: Strategy) -> float:
        """Seconds the job stalls to switch from ``old`` to ``new`` (module docstring)."""
        if old == new:
            return 0.0
        if switch_kind(old, new) == "batch":
            return BATCH_SWITCH_STEPS * self.iter_s(new)
        params = max(self._memory.stage_params(new))  # parameters of one device's shard
        gbs, _ = self.cost_model._bw(new.world_size)
        return LAYOUT_SWITCH_FIXED_S + params * MOVED_BYTES_PER_PARAM / (gbs * 1e9)

    def switch_cost_priors(self, current: Strategy) -> dict[str, float]:
        """Priors for :class:`cona.controller.Controller`: the modelled costs (layout
        switch into a DP-only layout, i.e. a full replica per device: the upper end;
        batch switch: one step of ``current``)."""
        replica = Strategy(self.num_gpus, 1, 1, 1, self.num_gpus)
        params = max(self._memory.stage_params(replica))
        gbs, _ = self.cost_model._bw(self.num_gpus)
        layout = LAYOUT_SWITCH_FIXED_S + params * MOVED_BYTES_PER_PARAM / (gbs * 1e9)
        return {"layout": layout, "batch": BATCH_SWITCH_STEPS * self.iter_s(current)}
