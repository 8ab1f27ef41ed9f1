"""Balancing planner: per-worker micro-batch, accumulation and inner steps.

Objective.  Worker ``i`` runs ``H_i`` inner steps of ``b_i = mb_i · a_i · dp_i``
sequences (micro-batch ``mb_i``, ``a_i`` gradient-accumulation steps, ``dp_i``
replicas), i.e. ``n_i = H_i · b_i · s`` tokens in ``C_i = H_i · t_i`` seconds.
Choose ``(mb_i, a_i, H_i)`` for all workers such that

* every worker fits in memory: ``mem_i(mb_i) ≤ usable · memory_per_gpu_i``;
* total tokens ``N = Σ n_i`` within ``tolerance`` of the target ``T``
  (default ``inner_steps · global_batch_size · seq_length``, what a uniform
  DiLoCo round would process) — a constraint: the LR schedules, the data
  stream and the token counts of a run are sized by ``T``, so no plan or
  re-plan trades the budget for balance (:attr:`Plan.within_budget`);
* compute time per round is equal within ``tolerance``:
  ``(max_i C_i − min_i C_i) / max_i C_i ≤ tolerance`` (no straggler idle),
  when the budget allows it (a straggler whose smallest step outlasts the
  others' share of ``T`` leaves them idle instead of inflating the round);
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
Identical workers are planned once and each worker's candidates are scored
as numpy arrays: ~0.02-0.05 s per plan for 4 GPU types, whether 4 or 1,000
workers (``python bench/geomesh_plan.py``; the per-worker Python loop this
replaced took 1.8 s at 16 workers and 110 s at 1,000).

Memory model (:mod:`geomesh.fleet.worker_models`, with the throughput models): the
project's one model, :class:`jobruntime.memory.MemoryModel`
(bf16 weights with fp32 gradient buffers, master weights and Adam moments, 18
bytes per parameter, plus ``extra_bytes_per_param`` — θ_global and the outer
momentum; activations after Korthikanti et al. 2022 as megatron's layers keep
them, 1F1B with ``pp`` micro-batches in flight, logits, a 2 GiB allowance
for the CUDA context) against the whole device memory.

Errors: :class:`PlanError` (a ``ValueError``) when a worker cannot fit even its
smallest micro-batch, naming the worker, the GiB needed by kind and the fixes
(:func:`geomesh.fleet.shapes.memory_refusal`; a run refuses micro-batch 1 earlier, in
:func:`geomesh.fleet.shapes.check_region_shapes`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Literal

import numpy as np

from jobruntime.config import JobConfig, ModelConfig, load_config

from .clock import pipeline_bubble_factor
from .cluster import ClusterSpec, WorkerSpec
from .plan import Plan, WorkerPlan
from .shapes import memory_refusal
from .speed import SpeedModel
from .worker_models import (
    MemoryModel,
    PlanError,
    ProfileThroughput,
    ThroughputModel,
)

log = logging.getLogger(__name__)


class _Group:
    """Workers the planner cannot tell apart — same GPU type and count, layout,
    memory, throughput and speed correction — so they get the same choice.

    Candidates are all ``(mb, a)`` pairs, ``mb`` in the fitting micro-batch
    order and ``a = 1 .. max_grad_accum``; arrays are ``[C]``, C = candidates.
    """

    def __init__(self, planner: Planner, worker: WorkerSpec, members: list[int]) -> None:
        self.worker = worker
        self.members = members
        self.mbs = planner._micro_batches(worker)
        A = planner.max_grad_accum
        a = np.arange(1, A + 1, dtype=np.int64)
        rates = [planner._rate(worker, mb) for mb in self.mbs]
        self.mb = np.repeat(np.asarray(self.mbs, dtype=np.int64), A)
        self.a = np.tile(a, len(self.mbs))
        rate = np.repeat(np.asarray(rates, dtype=np.float64), A)
        s = planner.seq_length
        # Same float operations, in the same order, as Planner._step_time.
        self.step = (self.mb * self.a * worker.dp * s) / rate * ((self.a + worker.pp - 1) / self.a)
        o = planner.fit.overhead.get(worker.name, 0.0)  # measured seconds per micro-batch
        if o:
            self.step = self.step + o * self.a
        self.eff = -(self.mb * self.a) / self.step  # −sequences/s: lower is faster
        self.bucket = None
        if planner.balance == "steps":  # b within ~25 % of the reference batch
            ref, log125 = planner.reference_batch, math.log(1.25)
            self.bucket = np.array([int(abs(math.log(int(b) / ref)) / log125)
                                    for b in self.mb * self.a * worker.dp], dtype=np.int64)


class Planner:
    """Plans (and re-plans) balanced rounds for a cluster; algorithm in the module docstring.

    Identical workers (same GPU type and count, TP/PP, memory, throughput and
    speed correction) form one group and are planned once; each group's
    candidates ``(mb, a)`` are scored with numpy.  A plan for 1,000 workers of
    4 GPU types then costs what 4 workers cost (``bench/geomesh_plan.py``).

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
        self.fit = SpeedModel(w.name for w in cluster.workers)
        """Measured corrections of the profile (:mod:`geomesh.fleet.speed`), from :meth:`replan`."""
        self.current: Plan | None = None
        self._h_bucket: dict[int, int] = {}

    @property
    def speed(self) -> dict[str, float]:
        """Correction factor on modelled throughput per worker (``self.fit.speed``)."""
        return self.fit.speed

    @speed.setter
    def speed(self, value: Mapping[str, float]) -> None:
        self.fit.speed = dict(value)

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
    def _memory(self, w: WorkerSpec, mb: int) -> tuple[float, float]:
        """``(bytes needed, bytes usable)`` per GPU of ``w`` at micro-batch ``mb``:
        the planner's only call into the memory model."""
        return self.memory.bytes_per_gpu(w, mb), self.memory.limit_bytes(w)

    def _fits(self, w: WorkerSpec, mb: int) -> bool:
        need, usable = self._memory(w, mb)
        return need <= usable

    def _micro_batches(self, w: WorkerSpec) -> list[int]:
        allowed = self.throughput.micro_batch_sizes(w)
        cands = allowed if allowed is not None else range(1, self.max_micro_batch_size + 1)
        fit = [mb for mb in cands if self._fits(w, mb)]
        if not fit:  # build_context refuses micro-batch 1 earlier; measured sizes may start above
            first = min(cands) if cands else 1
            raise PlanError(memory_refusal(w, self.memory, "the model", micro_batch_size=first))
        return fit

    def _rate(self, w: WorkerSpec, mb: int) -> float:
        return self.throughput.tokens_per_s(w, mb) * self.speed[w.name]

    def _step_time(self, w: WorkerSpec, mb: int, a: int, *, profile: bool = False) -> float:
        """Seconds per inner step; ``profile``: the profile's, without the measured
        correction (:mod:`geomesh.fleet.speed`)."""
        rate = self.throughput.tokens_per_s(w, mb) if profile else self._rate(w, mb)
        t = mb * a * w.dp * self.seq_length / rate * pipeline_bubble_factor(w.pp, a)
        o = 0.0 if profile else self.fit.overhead.get(w.name, 0.0)
        return t + o * a if o else t

    def _groups(self) -> list[_Group]:
        """Workers grouped by everything a choice depends on (cluster order of first members)."""
        key_of = getattr(self.throughput, "group_key", lambda w: w.name)
        groups: dict[tuple, list[int]] = {}
        for i, w in enumerate(self.cluster.workers):
            key = (dataclasses.replace(w, name="", region=""), self.speed[w.name],
                   self.fit.overhead.get(w.name, 0.0), key_of(w))
            groups.setdefault(key, []).append(i)
        return [_Group(self, self.cluster.workers[m[0]], m) for m in groups.values()]

    def _choose(self, g: _Group, R: float) -> tuple[int, int]:
        """``(candidate index, H)`` for round time ``R``: the key of the module docstring,
        ``(|H·t − R|/R > e_max, that error if so, bucket, −sequences/s, error)``,
        lowest first; ties go to the first candidate (small ``mb``, then ``a``)."""
        e_max = self.tolerance / 2.5
        idx = np.flatnonzero((g.a == 1) | (g.step <= R * (1 + e_max)))  # larger a only slower
        step = g.step[idx]
        H = np.maximum(1.0, np.rint(R / step))  # round half to even, like round()
        err = np.abs(H * step - R) / R
        bad = err > e_max
        if g.bucket is not None:
            bucket = g.bucket[idx]
        else:  # H within ~25 % of the configured inner steps
            hs, inv = np.unique(H, return_inverse=True)
            bucket = np.array([self._bucket_h(int(h)) for h in hs], dtype=np.int64)[inv]
        best = np.lexsort((idx, err, g.eff[idx], bucket, np.where(bad, err, 0.0), bad))[0]
        return int(idx[best]), int(H[best])

    def _bucket_h(self, H: int) -> int:
        b = self._h_bucket.get(H)
        if b is None:
            b = self._h_bucket[H] = int(abs(math.log(H / self.inner_steps)) / math.log(1.25))
        return b

    def _worker_plan(self, w: WorkerSpec, mb: int, a: int, H: int, step: float) -> WorkerPlan:
        batch = mb * a * w.dp
        need, usable = self._memory(w, mb)
        return WorkerPlan(
            worker=w.name, micro_batch_size=mb, grad_accum=a, dp=w.dp, batch_size=batch,
            inner_steps=H, seq_length=self.seq_length, tokens=H * batch * self.seq_length,
            step_time_s=step, compute_s=H * step, memory_bytes=need, memory_limit_bytes=usable,
        )

    # -- public --------------------------------------------------------------
    def plan(self) -> Plan:
        """Compute a balanced plan with the current speed estimates (stored in :attr:`current`).

        Raises:
            PlanError: a worker cannot fit the model in memory.
        """
        groups = self._groups()
        T = self.target_tokens
        R = T / sum(len(g.members) * self._rate(g.worker, max(g.mbs)) for g in groups)
        best: dict = {}

        def consider(R: float) -> tuple[bool, float]:
            picks = [self._choose(g, R) for g in groups]
            times = [H * float(g.step[c]) for g, (c, H) in zip(groups, picks)]
            total = sum(len(g.members) * H * int(g.mb[c] * g.a[c]) * g.worker.dp * self.seq_length
                        for g, (c, H) in zip(groups, picks))
            slowest = max(times)
            balanced = (slowest - min(times)) / slowest <= self.tolerance
            dev = abs(total - T) / T
            # The token budget is a constraint: a plan within ``tolerance`` of T
            # always beats one outside it (ranking balance first let one re-plan
            # after a 10x straggler put 8.7 T into a round: the fast worker was
            # given all the steps that fill the slow one's smallest step).  Then
            # balanced; then the fastest (seconds per token of the round); then
            # the closest to T.
            key = (dev > self.tolerance, not balanced,
                   slowest / total if dev <= self.tolerance else dev, dev)
            if not best or key < best["key"]:
                best.update(key=key, picks=picks, R=R, balanced=balanced, total=total)
            return balanced, total

        for _ in range(30):  # fixed point R <- R * T / N
            balanced, total = consider(R)
            if balanced and abs(total - T) / T < self.tolerance / 5:
                break
            R *= T / total
        # Discrete choices make N(R) a step function and the fixed point may
        # cycle between two steps far apart (small models, whose step time
        # hardly grows with the micro-batch): then scan R geometrically over
        # a wide range first.  A scan of R around the best also finds faster
        # balanced choices.
        if not best["balanced"] or abs(best["total"] - T) > self.tolerance * T:
            R0 = best["R"]
            for k in range(-48, 49):
                consider(R0 * 1.1**k)
        R0 = best["R"]
        for k in range(-40, 41):
            consider(R0 * (1 + k * 0.005))
        if not best["balanced"]:
            self._scan_bottleneck(groups, best, consider)
        chosen: dict[int, WorkerPlan] = {}
        for g, (c, H) in zip(groups, best["picks"]):
            mb, a, step = int(g.mb[c]), int(g.a[c]), float(g.step[c])
            for i in g.members:
                chosen[i] = self._worker_plan(self.cluster.workers[i], mb, a, H, step)
        plan = Plan(workers=tuple(chosen[i] for i in range(len(self.cluster.workers))),
                    target_tokens=T, tolerance=self.tolerance)
        if not plan.within_budget:
            log.warning(
                "GeoMesh plan: %d tokens per round, %.1f%% off the budget of %d (tolerance "
                "%.1f%%): no choice of batch sizes and inner steps comes closer; raise the "
                "tokens per round or max_grad_accum", plan.total_tokens,
                100 * plan.token_deviation, T, 100 * self.tolerance)
        if not plan.balanced:
            log.warning(
                "GeoMesh plan imbalance %.1f%% exceeds tolerance %.1f%% within the token "
                "budget; raise max_grad_accum or tokens per round",
                100 * plan.imbalance,
                100 * self.tolerance,
            )
        self.current = plan
        return plan

    def _scan_bottleneck(self, groups: list[_Group], best: dict, consider) -> None:
        """Within the budget but unbalanced: the slowest worker's choices are
        coarse (one step of a small batch may outlast the others' share of T),
        so balanced rounds exist only at ``R`` within ``tolerance / 2.5`` of one of
        its compute times ``H · t(mb, a)`` — a window the scans above can step
        over.  Try those ``R`` (``H`` up to one above its current choice, within
        4x of the best ``R``, the 200 nearest)."""
        R0 = best["R"]
        slow = max(range(len(groups)), key=lambda j: best["picks"][j][1]
                   * float(groups[j].step[best["picks"][j][0]]))
        g, H0 = groups[slow], best["picks"][slow][1]
        times = np.concatenate([h * g.step for h in range(1, H0 + 2)])
        times = np.unique(times[(times >= R0 / 4) & (times <= 4 * R0)])
        for R in times[np.argsort(np.abs(np.log(times / R0)))[:200]]:
            consider(float(R))

    def uniform(self, batch_size: int, inner_steps: int | None = None) -> Plan:
        """The unbalanced plan of the baselines: every worker ``batch_size``
        sequences per step and ``inner_steps`` steps (DiLoCo, DDP, async).

        Per worker, the largest fitting micro-batch that divides its per-replica
        share (``batch_size / dp``, rounded up to whole sequences per replica),
        the rest by gradient accumulation.  Not stored in :attr:`current`.
        """
        H = inner_steps or self.inner_steps
        out: dict[int, WorkerPlan] = {}
        for g in self._groups():
            w = g.worker
            per_replica = max(1, -(-batch_size // w.dp))
            mb = max([mb for mb in g.mbs if per_replica % mb == 0] or [1])
            a = per_replica // mb
            step = self._step_time(w, mb, a)
            for i in g.members:
                out[i] = self._worker_plan(self.cluster.workers[i], mb, a, H, step)
        return Plan(workers=tuple(out[i] for i in range(len(self.cluster.workers))),
                    target_tokens=self.target_tokens, tolerance=self.tolerance)

    def replan(self, measured_step_times: Mapping[str, float]) -> Plan:
        """Re-plan after workers' speeds drift (e.g. a GPU throttles mid-run).

        Args:
            measured_step_times: seconds per inner step measured at the current
                plan's ``(micro_batch_size, grad_accum)``, by worker name (a
                subset is fine: others keep their estimate).

        Each measurement refits the worker's correction of the profile
        (:class:`geomesh.fleet.speed.SpeedModel`: a speed factor, and a fixed cost per
        micro-batch once two configurations were measured), which every
        candidate of that worker then uses.  Until then it is an extrapolation;
        what bounds the cost of a wrong one is the token budget: the new plan,
        like every plan, keeps ``Σ n_i`` within ``tolerance`` of ``T``.

        Returns:
            A new plan if the current plan, at the measured speeds, would leave
            the round imbalanced by more than ``2 · tolerance`` (relative spread
            of the workers' compute times) and the planner finds different
            choices within the token budget, else the current plan (the same
            object).  The factor
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
        current = {wp.worker: wp for wp in self.current.workers}
        compute = {name: wp.compute_s for name, wp in current.items()}
        for name, measured in measured_step_times.items():
            if name not in self.speed:
                raise ValueError(f"replan: unknown worker '{name}'")
            if not (measured > 0 and math.isfinite(measured)):
                raise ValueError(
                    f"replan: step time of '{name}' must be a positive number, got {measured}"
                )
            wp = current[name]
            profile = self._step_time(self.cluster.worker(name), wp.micro_batch_size,
                                      wp.grad_accum, profile=True)
            self.fit.observe(name, wp.micro_batch_size, wp.grad_accum, profile, measured)
            compute[name] = wp.inner_steps * measured
        imbalance = (max(compute.values()) - min(compute.values())) / max(compute.values())
        if imbalance <= 2 * self.tolerance:
            return self.current
        old, new = self.current, self.plan()
        if new.same_choices(old) or (old.within_budget and not new.within_budget):
            self.current = new = old  # nothing better within the budget: no re-plan
        return new
