"""What the planner (:mod:`geomesh.fleet.planner`) knows of a worker: its tokens/s per
micro-batch size (from the GPU profile in emulated mode, measured in real mode) and its
per-GPU memory (the project's :class:`jobruntime.memory.MemoryModel` at the worker's
layout); and :class:`PlanError`, what planning raises when no plan fits.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from jobruntime.config import ModelConfig
from jobruntime.memory import ExtraState, MemoryEstimate, PipelineLayout
from jobruntime.memory import MemoryModel as RuntimeMemoryModel

from .clock import worker_tokens_per_s
from .cluster import ClusterError, WorkerSpec

OUTER_STATE_BYTES = 8.0 + 0.25
"""Bytes per parameter GeoMesh keeps on each worker's devices beside the inner job's
state: ``θ_global`` and the outer Nesterov momentum (fp32, 4 each) and the packed
pseudo-gradient message (sign bits, scales and header: under 0.25); what a run holds is
measured and reported (:func:`geomesh.report.memory_overhead`).  Counted by the job's
region-shape check (:func:`geomesh.fleet.job_check.check_job`) and by each worker's
launch check (:class:`geomesh.worker.InnerWorker`, as :data:`OUTER_STATE`)."""

OUTER_STATE = ExtraState("GeoMesh's outer state (θ_global, outer momentum, message)",
                         OUTER_STATE_BYTES)
""":data:`OUTER_STATE_BYTES` for the trainer's launch check
(:func:`jobruntime.memory.check_job_fits`)."""


class PlanError(ClusterError):
    """No feasible plan; the message names the worker and the fix (a
    :class:`~geomesh.fleet.cluster.ClusterError`, so ``train.py`` prints it on one line)."""


class ThroughputModel(Protocol):
    """Tokens/s of a whole worker (bubble-free) as a function of micro-batch size."""

    def micro_batch_sizes(self, worker: WorkerSpec) -> list[int] | None:
        """Allowed micro-batch sizes (``None`` = any)."""

    def tokens_per_s(self, worker: WorkerSpec, micro_batch_size: int) -> float: ...

    def group_key(self, worker: WorkerSpec) -> object:
        """What besides the worker's spec (minus name and region) the throughput
        depends on; workers with equal specs and keys are planned as one."""


class ProfileThroughput:
    """Emulated mode: GPU profile efficiency curve × target model FLOPs per token."""

    def __init__(self, model: ModelConfig, *, seq_length: int | None = None) -> None:
        self.model = model
        self.seq_length = seq_length or model.seq_length

    def micro_batch_sizes(self, worker: WorkerSpec) -> list[int] | None:
        return None

    def tokens_per_s(self, worker: WorkerSpec, micro_batch_size: int) -> float:
        return worker_tokens_per_s(worker, self.model, micro_batch_size, seq_length=self.seq_length)

    def group_key(self, worker: WorkerSpec) -> object:
        return None  # the GPU profile is part of the spec


class MeasuredThroughput:
    """Real mode: measured tokens/s per worker and micro-batch size.

    Args:
        table: ``{worker_name: {micro_batch_size: tokens_per_s}}`` (whole worker,
            all its GPUs, without pipeline bubble).
    """

    def __init__(self, table: Mapping[str, Mapping[int, float]]) -> None:
        self.table = {w: {int(k): float(v) for k, v in t.items()} for w, t in table.items()}

    def micro_batch_sizes(self, worker: WorkerSpec) -> list[int] | None:
        if worker.name not in self.table:
            raise PlanError(
                f"no measured throughput for worker '{worker.name}'; measure it "
                "(tokens/s per micro-batch size) before planning"
            )
        return sorted(self.table[worker.name])

    def tokens_per_s(self, worker: WorkerSpec, micro_batch_size: int) -> float:
        return self.table[worker.name][micro_batch_size]

    def group_key(self, worker: WorkerSpec) -> object:
        t = self.table.get(worker.name)
        return tuple(sorted(t.items())) if t is not None else worker.name


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Per-GPU training memory of the target model on a worker: the project's model
    (:class:`jobruntime.memory.MemoryModel`, mixed precision) at the worker's TP/PP,
    with ``pp`` micro-batches in flight (1F1B's most, whatever the accumulation)."""

    model: ModelConfig
    seq_length: int | None = None
    extra_bytes_per_param: float = 0.0

    @property
    def runtime(self) -> RuntimeMemoryModel:
        """The project's memory model that this one evaluates at each worker's layout."""
        return RuntimeMemoryModel(self.model, seq_length=self.seq_length,
                                  extra_bytes_per_param=self.extra_bytes_per_param)

    def estimate(self, worker: WorkerSpec, micro_batch_size: int) -> MemoryEstimate:
        """The worker's fullest pipeline stage at ``micro_batch_size`` (bytes per GPU:
        parameters, state, activations, allowance)."""
        return self.runtime.estimate(PipelineLayout(tp=worker.tp, pp=worker.pp, dp=worker.dp,
                                                    micro_batch_size=micro_batch_size,
                                                    num_microbatches=worker.pp))

    def bytes_per_gpu(self, worker: WorkerSpec, micro_batch_size: int) -> float:
        """Peak bytes on the worker's fullest GPU at ``micro_batch_size``."""
        return self.estimate(worker, micro_batch_size).total_bytes

    def limit_bytes(self, worker: WorkerSpec) -> float:
        return float(worker.memory_bytes_per_gpu)

    def fits(self, worker: WorkerSpec, micro_batch_size: int) -> bool:
        return self.bytes_per_gpu(worker, micro_batch_size) <= self.limit_bytes(worker)
