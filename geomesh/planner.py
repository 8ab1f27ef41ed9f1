"""Balancing planner: per-worker micro-batch, accumulation and inner steps.

Objective.  Worker ``i`` runs ``H_i`` inner steps of ``b_i = mb_i · a_i · dp_i``
sequences (micro-batch ``mb_i``, ``a_i`` gradient-accumulation steps, ``dp_i``
replicas), i.e. ``n_i = H_i · b_i · s`` tokens in ``C_i = H_i · t_i`` seconds.
Choose ``(mb_i, a_i, H_i)`` for all workers such that

* every worker fits in memory: ``mem_i(mb_i) ≤ usable · memory_per_gpu_i``;
* compute time per round is equal within ``tolerance``:
  ``(max_i C_i − min_i C_i) / max_i C_i ≤ tolerance`` (no straggler idle);
* total tokens ``N = Σ n_i`` within ``tolerance`` of the target ``T``
  (default ``inner_steps · global_batch_size · seq_length``, what a uniform
  DiLoCo round would process);
* among such plans, the shortest round per token (the fastest choices);
* per worker (``balance="batch"``, default): ``H_i`` within ~25 % of the
  configured ``inner_steps`` (every worker's pseudo-gradient spans a similar
  number of optimizer steps, as in DiLoCo; speed differences go into the
  batch size ``b_i``), then the configuration with the highest tokens/s
  (large micro-batches are more efficient; the 1F1B bubble favours more
  accumulation).  With ``balance="steps"`` the roles swap: ``b_i`` within
  ~25 % of the uniform per-worker batch ``T/(H·s·K)`` and speed differences
  go into the number of steps ``H_i`` (a worker too slow for one such step
  per round gets a smaller batch).

Algorithm.  (1) For each worker list the micro-batch sizes that fit (memory
model below; in real mode only the measured ones).  (2) Start from the
common round time ``R = T / Σ_i r_i`` (``r_i`` = the worker's tokens/s at its
largest fitting micro-batch) — the time at which every worker working at full
speed produces ``T`` tokens together.  (3) For each worker enumerate
``mb`` and ``a ≤ max_grad_accum``, set ``H = round(R / t(mb, a))`` and keep
the candidate with ``|H·t − R| / R ≤ tolerance / 2.5`` (so any two workers
differ by < ``tolerance``) that is best in the per-worker order above (if none
is, the one closest to ``R``).  (4) Rescale ``R ← R · T / N`` and repeat (a
fixed-point iteration, ≤ 30 passes); since the choices are discrete, ``N(R)``
is a step function, so finally scan ``R`` over ±20 % of the best in 0.5 %
steps (first over ×/÷ 100 in 10 % steps if the fixed point missed the
token tolerance).  Return the best plan seen (balanced, tokens within tolerance, fastest).
Cost: ~0.5 s for 4 workers on one CPU core; call it once per run and on
:meth:`Planner.replan`.

Memory model: the project's one model, :class:`jobruntime.memory.MemoryModel`
(bf16 weights with fp32 gradient buffers, master weights and Adam moments, 18
bytes per parameter, plus ``extra_bytes_per_param`` — θ_global and the outer
momentum; activations after Korthikanti et al. 2022 as megatron's layers keep
them, 1F1B with ``pp`` micro-batches in flight, logits, a 2 GiB allowance
for the CUDA context) against the whole device memory.

Errors: :class:`PlanError` (a ``ValueError``) when a worker cannot fit even
micro-batch 1, naming the worker, the bytes needed and the fixes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

from jobruntime.config import JobConfig, ModelConfig, load_config
from jobruntime.memory import MemoryModel as RuntimeMemoryModel
from jobruntime.memory import PipelineLayout

from .clock import pipeline_bubble_factor, worker_tokens_per_s
from .cluster import ClusterError, ClusterSpec, WorkerSpec

log = logging.getLogger(__name__)


class PlanError(ClusterError):
    """No feasible plan; the message names the worker and the fix (a
    :class:`~geomesh.cluster.ClusterError`, so ``train.py`` prints it on one line)."""


# ---------------------------------------------------------------------------
# Throughput and memory models
# ---------------------------------------------------------------------------


class ThroughputModel(Protocol):
    """Tokens/s of a whole worker (bubble-free) as a function of micro-batch size."""

    def micro_batch_sizes(self, worker: WorkerSpec) -> list[int] | None:
        """Allowed micro-batch sizes (``None`` = any)."""

    def tokens_per_s(self, worker: WorkerSpec, micro_batch_size: int) -> float: ...


class ProfileThroughput:
    """Emulated mode: GPU profile efficiency curve × target model FLOPs per token."""

    def __init__(self, model: ModelConfig, *, seq_length: int | None = None) -> None:
        self.model = model
        self.seq_length = seq_length or model.seq_length

    def micro_batch_sizes(self, worker: WorkerSpec) -> list[int] | None:
        return None

    def tokens_per_s(self, worker: WorkerSpec, micro_batch_size: int) -> float:
        return worker_tokens_per_s(worker, self.model, micro_batch_size, seq_length=self.seq_length)


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


@dataclass(frozen=True, kw_only=True)
class MemoryModel:
    """Per-GPU training memory of the target model on a worker: the project's model
    (:class:`jobruntime.memory.MemoryModel`, mixed precision) at the worker's TP/PP,
    with ``pp`` micro-batches in flight (1F1B's most, whatever the accumulation)."""

    model: ModelConfig
    seq_length: int | None = None
    extra_bytes_per_param: float = 0.0

    def bytes_per_gpu(self, worker: WorkerSpec, micro_batch_size: int) -> float:
        """Peak bytes on the worker's fullest GPU at ``micro_batch_size``."""
        memory = RuntimeMemoryModel(self.model, seq_length=self.seq_length,
                                    extra_bytes_per_param=self.extra_bytes_per_param)
        return memory.peak_bytes(PipelineLayout(tp=worker.tp, pp=worker.pp, dp=worker.dp,
                                                micro_batch_size=micro_batch_size,
                                                num_microbatches=worker.pp))

    def limit_bytes(self, worker: WorkerSpec) -> float:
        return float(worker.memory_bytes_per_gpu)

    def fits(self, worker: WorkerSpec, micro_batch_size: int) -> bool:
        return self.bytes_per_gpu(worker, micro_batch_size) <= self.limit_bytes(worker)


# ---------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class WorkerPlan:
    """One worker's share of a round.

    Attributes:
        batch_size: sequences per inner step, ``micro_batch_size · grad_accum · dp``.
        tokens: tokens per round, ``inner_steps · batch_size · seq_length``.
        step_time_s: predicted seconds per inner step.
        compute_s: predicted seconds of compute per round (``inner_steps · step_time_s``).
        memory_bytes / memory_limit_bytes: predicted need and usable memory per GPU.
    """

    worker: str
    micro_batch_size: int
    grad_accum: int
    dp: int
    batch_size: int
    inner_steps: int
    seq_length: int
    tokens: int
    step_time_s: float
    compute_s: float
    memory_bytes: float
    memory_limit_bytes: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A balanced round: one :class:`WorkerPlan` per worker, cluster order."""

    workers: tuple[WorkerPlan, ...]
    target_tokens: int
    tolerance: float

    @property
    def total_tokens(self) -> int:
        return sum(w.tokens for w in self.workers)

    @property
    def round_time_s(self) -> float:
        """Compute time of the slowest worker."""
        return max(w.compute_s for w in self.workers)

    @property
    def imbalance(self) -> float:
        """``(max C_i − min C_i) / max C_i``."""
        times = [w.compute_s for w in self.workers]
        return (max(times) - min(times)) / max(times)

    @property
    def balanced(self) -> bool:
        return self.imbalance <= self.tolerance

    def for_worker(self, name: str) -> WorkerPlan:
        for w in self.workers:
            if w.worker == name:
                return w
        raise KeyError(f"no worker '{name}' in plan")

    def to_dict(self) -> dict:
        return {
            "target_tokens": self.target_tokens,
            "total_tokens": self.total_tokens,
            "round_time_s": self.round_time_s,
            "imbalance": self.imbalance,
            "workers": [asdict(w) for w in self.workers],
        }


class Planner:
    """Plans (and re-plans) balanced rounds for a cluster; algorithm in the module docstring.

    Args:
        cluster: validated cluster.
        model: target model (FLOPs and memory).
        tokens_per_round: target ``T`` (tokens per round over all workers).
        inner_steps: preferred ``H`` (DiLoCo's inner steps).
        seq_length: sequence length ``s`` (default the model's).
        tolerance: allowed relative spread of per-worker compute time.
        throughput: tokens/s model (default :class:`ProfileThroughput`).
        memory: memory model (default :class:`MemoryModel` of ``model``).
        max_micro_batch_size, max_grad_accum: search bounds.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        model: ModelConfig,
        *,
        tokens_per_round: int,
        inner_steps: int = 20,
        seq_length: int | None = None,
        tolerance: float = 0.05,
        throughput: ThroughputModel | None = None,
        memory: MemoryModel | None = None,
        max_micro_batch_size: int = 16,
        max_grad_accum: int = 256,
        balance: Literal["batch", "steps"] = "batch",
        reference_batch: float | None = None,
    ) -> None:
        if tokens_per_round <= 0 or inner_steps <= 0 or not 0 < tolerance < 1:
            raise PlanError("need tokens_per_round > 0, inner_steps > 0 and 0 < tolerance < 1")
        self.cluster = cluster
        self.model = model
        self.seq_length = seq_length or model.seq_length
        self.target_tokens = int(tokens_per_round)
        self.inner_steps = inner_steps
        self.tolerance = tolerance
        self.throughput = throughput or ProfileThroughput(model, seq_length=self.seq_length)
        self.memory = memory or MemoryModel(model=model, seq_length=self.seq_length)
        self.max_micro_batch_size = max_micro_batch_size
        self.max_grad_accum = max_grad_accum
        self.balance = balance
        self.reference_batch = reference_batch or (
            self.target_tokens / (inner_steps * self.seq_length * len(cluster.workers))
        )
        """Balancing by steps: the per-step batch every worker keeps (default
        ``T / (H · s · K)``, the uniform per-worker batch)."""
        self.speed: dict[str, float] = {w.name: 1.0 for w in cluster.workers}
        """Correction factor on modelled throughput, from :meth:`replan`."""
        self.current: Plan | None = None

    @classmethod
    def from_job_config(cls, cfg: JobConfig, cluster: ClusterSpec, **kwargs) -> Planner:
        """Planner for a job: target model ``geomesh.target_model`` (else the job's
        model), ``T = geomesh.inner_steps · parallel.global_batch_size · seq_length``."""
        model = (
            load_config(cfg.geomesh.target_model).model if cfg.geomesh.target_model else cfg.model
        )
        tokens = cfg.geomesh.inner_steps * cfg.parallel.global_batch_size * model.seq_length
        return cls(
            cluster, model, tokens_per_round=tokens, inner_steps=cfg.geomesh.inner_steps, **kwargs
        )

    # -- building blocks -----------------------------------------------------
    def _micro_batches(self, w: WorkerSpec) -> list[int]:
        allowed = self.throughput.micro_batch_sizes(w)
        cands = allowed if allowed is not None else range(1, self.max_micro_batch_size + 1)
        fit = [mb for mb in cands if self.memory.fits(w, mb)]
        if not fit:
            need = self.memory.bytes_per_gpu(w, min(cands) if cands else 1)
            raise PlanError(
                f"worker '{w.name}' ({w.gpu}, tp={w.tp}, pp={w.pp}) cannot fit the target model: "
                f"{need / 2**30:.1f} GiB per GPU needed at micro-batch {min(cands) if cands else 1}, "
                f"{self.memory.limit_bytes(w) / 2**30:.1f} GiB usable; raise tp or pp for this worker, "
                "use activation recompute, or drop the worker"
            )
        return fit

    def _rate(self, w: WorkerSpec, mb: int) -> float:
        return self.throughput.tokens_per_s(w, mb) * self.speed[w.name]

    def _step_time(self, w: WorkerSpec, mb: int, a: int) -> float:
        return mb * a * w.dp * self.seq_length / self._rate(w, mb) * pipeline_bubble_factor(w.pp, a)

    def _choose(self, w: WorkerSpec, mbs: list[int], R: float) -> WorkerPlan:
        e_max = self.tolerance / 2.5
        best_key, best = None, None
        for mb in mbs:
            for a in range(1, self.max_grad_accum + 1):
                step = self._step_time(w, mb, a)
                if a > 1 and step > R * (1 + e_max):
                    break  # larger a only gets slower
                H = max(1, round(R / step))
                err = abs(H * step - R) / R
                ok = err <= e_max
                # H (or, balancing by steps, b) within ~25 % of the target counts
                # as equal; then the fastest configuration (tokens/s incl.
                # pipeline bubble), then accuracy.
                if self.balance == "steps":
                    ratio = mb * a * w.dp / self.reference_batch
                else:
                    ratio = H / self.inner_steps
                bucket = int(abs(math.log(ratio)) / math.log(1.25))
                key = (not ok, err if not ok else 0.0, bucket, -mb * a / step, err)
                if best_key is None or key < best_key:
                    best_key, best = key, (mb, a, H, step)
        mb, a, H, step = best
        batch = mb * a * w.dp
        return WorkerPlan(
            worker=w.name,
            micro_batch_size=mb,
            grad_accum=a,
            dp=w.dp,
            batch_size=batch,
            inner_steps=H,
            seq_length=self.seq_length,
            tokens=H * batch * self.seq_length,
            step_time_s=step,
            compute_s=H * step,
            memory_bytes=self.memory.bytes_per_gpu(w, mb),
            memory_limit_bytes=self.memory.limit_bytes(w),
        )

    # -- public --------------------------------------------------------------
    def plan(self) -> Plan:
        """Compute a balanced plan with the current speed estimates (stored in :attr:`current`).

        Raises:
            PlanError: a worker cannot fit the model in memory.
        """
        workers = self.cluster.workers
        mbs = {w.name: self._micro_batches(w) for w in workers}
        R = self.target_tokens / sum(self._rate(w, max(mbs[w.name])) for w in workers)
        best_key, best, best_R = None, None, R

        def consider(R: float) -> tuple:
            nonlocal best_key, best, best_R
            plan = Plan(
                workers=tuple(self._choose(w, mbs[w.name], R) for w in workers),
                target_tokens=self.target_tokens,
                tolerance=self.tolerance,
            )
            dev = abs(plan.total_tokens - self.target_tokens) / self.target_tokens
            # Balanced first; within the token tolerance the fastest plan
            # (seconds per token of the round), then the closest to T.
            key = (
                not plan.balanced,
                dev > self.tolerance,
                plan.round_time_s / plan.total_tokens if dev <= self.tolerance else dev,
                dev,
            )
            if best_key is None or key < best_key:
                best_key, best, best_R = key, plan, R
            return plan, dev

        for _ in range(30):  # fixed point R <- R * T / N
            plan, dev = consider(R)
            if plan.balanced and dev < self.tolerance / 5:
                break
            R *= self.target_tokens / plan.total_tokens
        # Discrete choices make N(R) a step function and the fixed point may
        # cycle between two steps far apart (small models, whose step time
        # hardly grows with the micro-batch): then scan R geometrically over
        # a wide range first.  A scan of R around the best also finds faster
        # balanced choices.
        if not best.balanced or abs(best.total_tokens - self.target_tokens) > (
            self.tolerance * self.target_tokens
        ):
            R0 = best_R
            for k in range(-48, 49):
                consider(R0 * 1.1**k)
        R0 = best_R
        for k in range(-40, 41):
            consider(R0 * (1 + k * 0.005))
        if not best.balanced:
            log.warning(
                "GeoMesh plan imbalance %.1f%% exceeds tolerance %.1f%%; "
                "raise max_grad_accum or tokens per round",
                100 * best.imbalance,
                100 * self.tolerance,
            )
        self.current = best
        return best

    def uniform(self, batch_size: int, inner_steps: int | None = None) -> Plan:
        """The unbalanced plan of the baselines: every worker ``batch_size``
        sequences per step and ``inner_steps`` steps (DiLoCo, DDP, async).

        Per worker, the largest fitting micro-batch that divides its per-replica
        share (``batch_size / dp``, rounded up to whole sequences per replica),
        the rest by gradient accumulation.  Not stored in :attr:`current`.
        """
        H = inner_steps or self.inner_steps
        out = []
        for w in self.cluster.workers:
            per_replica = max(1, -(-batch_size // w.dp))
            fit = [mb for mb in self._micro_batches(w) if per_replica % mb == 0] or [1]
            mb = max(fit)
            a = per_replica // mb
            step = self._step_time(w, mb, a)
            batch = mb * a * w.dp
            out.append(WorkerPlan(
                worker=w.name, micro_batch_size=mb, grad_accum=a, dp=w.dp, batch_size=batch,
                inner_steps=H, seq_length=self.seq_length, tokens=H * batch * self.seq_length,
                step_time_s=step, compute_s=H * step, memory_bytes=self.memory.bytes_per_gpu(w, mb),
                memory_limit_bytes=self.memory.limit_bytes(w),
            ))
        return Plan(workers=tuple(out), target_tokens=self.target_tokens, tolerance=self.tolerance)

    def replan(self, measured_step_times: Mapping[str, float]) -> Plan:
        """Re-plan after workers' speeds drift (e.g. a GPU throttles mid-run).

        Args:
            measured_step_times: seconds per inner step measured at the current
                plan's ``(micro_batch_size, grad_accum)``, by worker name (a
                subset is fine: others keep their estimate).

        Returns:
            A new plan if the current plan, at the measured speeds, would leave
            the round imbalanced by more than ``2 · tolerance`` (relative spread
            of the workers' compute times), else the current plan.  The factor
            2 is hysteresis: wall-clock step times on shared machines vary by
            several per cent, and re-planning on such noise swapped batch
            sizes back and forth (measured in real mode: imbalance 0.05 before
            re-planning, 0.11-0.28 after).  Speed corrections persist either way.

        Raises:
            RuntimeError: :meth:`plan` was never called.
            ValueError: unknown worker or a non-positive time.
        """
        if self.current is None:
            raise RuntimeError("Planner.replan: call plan() first")
        compute = {wp.worker: wp.compute_s for wp in self.current.workers}
        for name, measured in measured_step_times.items():
            if name not in self.speed:
                raise ValueError(f"replan: unknown worker '{name}'")
            if not (measured > 0 and math.isfinite(measured)):
                raise ValueError(
                    f"replan: step time of '{name}' must be a positive number, got {measured}"
                )
            wp = self.current.for_worker(name)
            self.speed[name] *= wp.step_time_s / measured
            compute[name] = wp.inner_steps * measured
        imbalance = (max(compute.values()) - min(compute.values())) / max(compute.values())
        return self.plan() if imbalance > 2 * self.tolerance else self.current
