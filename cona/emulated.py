"""The emulated cluster: modelled step and switch times of the target model.

The small proxy model really trains on the real corpus (:class:`cona.job.EmulatedJob`);
time comes from the analytic cost model (:class:`cona.cost_model.CostModel`,
uncalibrated) of the *target* model (``cona.target_model``, e.g. ``gpt3_1.3b``,
at its own sequence length) on ``cona.num_gpus`` devices of type ``cona.gpu``,
at the target global batch the proxy's batch stands for (:mod:`cona.mapping`).
DP, TP, PP and the micro-batch size only change the modelled time.
Evaluations are not charged to the clock.

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

from jobruntime.config import ModelConfig

from .controller import switch_kind
from .cost_model import CostModel
from .memory_model import MemoryModel
from .strategy import Strategy

LAYOUT_SWITCH_FIXED_S = 10.0
BATCH_SWITCH_STEPS = 1.0
MOVED_BYTES_PER_PARAM = 14.0  # bf16 weight (2) + fp32 master weight and Adam m, v (12)


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
