"""The emulated cluster: modelled step and switch times of the target model.

The small proxy model really trains on the real corpus (:class:`cona.job.EmulatedJob`);
time comes from the analytic cost model (:class:`cona.cost_model.CostModel`,
uncalibrated) of the *target* model (``cona.target_model``, e.g. ``gpt3_1.3b``,
at its own sequence length) on ``cona.num_gpus`` devices of type ``cona.gpu``,
at the target global batch the proxy's batch stands for (:mod:`cona.mapping`).
DP, TP, PP and the micro-batch size only change the modelled time.
One proxy step stands for ``step_dilation`` target steps at its batch
(``cona.step_dilation``, :func:`cona.targets.time_scale`): the proxy covers in a
few thousand steps the loss range the target covers in many more, so each proxy
step is charged ``step_dilation`` target step times.  Switch costs are real
seconds of the target's cluster and are not dilated.

Evaluations (``eval_steps``; 0 by default, ``bench/cona_ttp.py`` sets it so that
they are charged to every method it compares) are amortised per step: validating ``V``
proxy sequences every ``E`` proxy samples costs the forward pass of ``r * V``
target sequences (a third of a training step's FLOPs per token: ``2N`` of
``6N``, Kaplan et al. 2020, Sec. 2.1) every ``E / B_p`` proxy steps, i.e.
``eval_steps = V / (3 E)`` target steps per proxy step at any batch
(:func:`eval_steps_per_step`).  It is added to the dilation, so the static
runs, the oracle and CONA pay the same evaluation share.  The evaluations that
``cona.ttp_resolution`` adds near the target are not charged: they locate the
crossing for the measurement, and a run that evaluates at the cadence pays the
charge above.

Switch costs on the emulated clock (assumptions, not measurements):

- layout switch (DP/TP/PP change): :data:`LAYOUT_SWITCH_FIXED_S` (new NCCL
  communicators, model build, reshard plan) plus moving the model state a
  device needs (bf16 weights + fp32 master and Adam moments, 14 bytes per
  parameter of its new shard) over the intra-node (or inter-node) link;
- batch switch (same layout, new micro/global batch): no resharding, only a
  new data iterator and micro-batch schedule; modelled as
  :data:`BATCH_SWITCH_STEPS` lost (undilated) target step of the new strategy (the CPU runtime
  measures milliseconds for it).
"""

from __future__ import annotations

from jobruntime.config import ModelConfig

from .cost_model import CostModel
from .memory_model import MemoryModel
from .strategy import Strategy, switch_kind

LAYOUT_SWITCH_FIXED_S = 10.0
BATCH_SWITCH_STEPS = 1.0
MOVED_BYTES_PER_PARAM = 14.0  # bf16 weight (2) + fp32 master weight and Adam m, v (12)


def eval_steps_per_step(val_samples: int, eval_samples: int) -> float:
    """``V / (3 E)``: target training steps of evaluation per proxy step (module docstring).

    Args:
        val_samples: validation sequences ``V`` per evaluation (proxy).
        eval_samples: proxy samples ``E`` between evaluations.
    """
    return val_samples / (3.0 * eval_samples)


class EmulatedCluster:
    """Modelled step and switch times of the target model on ``num_gpus`` x ``gpu``.

    Args:
        target: the target model (e.g. GPT-3 1.3B).
        gpu: GPU profile name (``jobruntime/gpu_profiles.yaml``).
        num_gpus: devices of the emulated job.
        step_dilation: target steps per proxy step (>= 1).
        eval_steps: target steps of evaluation per proxy step (:func:`eval_steps_per_step`).

    Raises:
        ValueError: ``step_dilation`` below 1 or not finite.
    """

    def __init__(self, target: ModelConfig, gpu: str, num_gpus: int, step_dilation: float = 1.0,
                 eval_steps: float = 0.0):
        if not 1 <= step_dilation < float("inf"):
            raise ValueError(f"step_dilation={step_dilation} must be a number >= 1")
        if not 0 <= eval_steps < float("inf"):
            raise ValueError(f"eval_steps={eval_steps} must be a number >= 0")
        self.target, self.num_gpus, self.step_dilation = target, num_gpus, float(step_dilation)
        self.eval_steps = float(eval_steps)
        self.cost_model = CostModel(target, gpu)
        self._memory = MemoryModel(target)

    @property
    def memory_limit_bytes(self) -> float:
        return float(self.cost_model.gpu.memory_bytes)

    def target_step_s(self, strategy: Strategy) -> float:
        """Seconds per target optimizer step (analytic, uncalibrated)."""
        return self.cost_model.analytic(strategy).iter_s

    def iter_s(self, strategy: Strategy) -> float:
        """Emulated seconds per proxy step: ``step_dilation`` target steps plus the
        amortised evaluation (``eval_steps`` target steps)."""
        return (self.step_dilation + self.eval_steps) * self.target_step_s(strategy)

    def switch_s(self, old: Strategy, new: Strategy) -> float:
        """Seconds the job stalls to switch from ``old`` to ``new`` (module docstring)."""
        if old == new:
            return 0.0
        if switch_kind(old, new) == "batch":
            return BATCH_SWITCH_STEPS * self.target_step_s(new)
        params = max(self._memory.stage_params(new))  # parameters of one device's shard
        gbs, _ = self.cost_model._bw(new.world_size)
        return LAYOUT_SWITCH_FIXED_S + params * MOVED_BYTES_PER_PARAM / (gbs * 1e9)
