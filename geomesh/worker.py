"""One worker's inner loop, and the mapping of a target-model plan to the proxy.

A worker is an ordinary job of the runtime (:class:`jobruntime.trainer.Trainer`,
its own AdamW state, LR schedule and — in real mode — TP/PP/DP ranks).  Per
round it starts from ``θ_global``, runs ``H_i`` optimizer steps of ``b_i``
sequences and returns ``Δ_i = θ_global − θ_i`` (fp32).  The inner optimizer
state stays with the worker across rounds (DiLoCo, Douillard et al. 2023).

Data.  All methods read one global stream of training samples (megatron's
``GPTDataset`` of the run's seed).  Round ``r`` takes the next ``Σ_i H_i b_i``
samples; worker ``i`` gets the contiguous slice after workers ``0..i-1``,
and its step ``h`` the ``b_i`` samples at ``start_i + h·b_i`` (split over the
worker's ``dp_in`` replicas as in :class:`jobruntime.data.GlobalBatchSampler`).
Workers thus see different data, and every method consumes the same tokens
in the same order, which makes "equal tokens" comparisons exact.

Proxy batches.  In emulated mode the planner sizes ``b_i`` for the *target*
model (e.g. GPT-3 1.3B, global batch ``G_t = 512`` sequences) while a small
proxy model is trained at global batch ``G_p`` (``parallel.global_batch_size``).
A proxy round processes exactly ``S = H · G_p`` sequences, like a uniform
DiLoCo round and ``H`` DDP steps, so all methods see equal tokens.  ``S`` is
split over the workers in proportion to their planned target tokens
``n_i = H_i b_i s`` (largest remainders), and worker ``i`` spreads its
``S_i`` sequences over its ``H_i`` steps (batches ``⌊S_i/H_i⌋`` or one more).
A worker whose share is below one sequence per step (a slow GPU with a small
``b_i`` and large ``H_i``) runs ``S_i`` steps of one sequence instead, the
only place where the proxy's ``H_i`` departs from the plan.  Micro-batch: the
largest divisor of the step's batch (per replica) not above
``parallel.micro_batch_size``.  Time and bytes always come from the target
plan; tokens reported are proxy tokens.  In real mode the trained model is
the target (``G_t = G_p``) and the plan is followed as is: ``S_i = H_i b_i``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from jobruntime.config import JobConfig
from jobruntime.data import GlobalBatchSampler
from jobruntime.optimizer_state import optimizer_state_by_name
from jobruntime.parallel import set_seed
from jobruntime.trainer import StepResult, Trainer, lr_scheduler, mean_loss

from .fleet.plan import Plan, WorkerPlan
from .fleet.worker_models import OUTER_STATE


@dataclass(frozen=True)
class ProxyStep:
    """What a worker trains per round on the proxy (sizes in proxy sequences).

    Attributes:
        target: the planner's choice for the target model (time, target batch).
        batches: proxy sequences of each inner step (all replicas); ``H_i`` entries.
        max_micro_batch: upper bound of the micro-batch per replica.
        dp_in: replicas of the worker (a step's batch is split over them).
    """

    target: WorkerPlan
    batches: tuple[int, ...]
    max_micro_batch: int = 4
    dp_in: int = 1

    @property
    def inner_steps(self) -> int:
        return len(self.batches)

    @property
    def samples(self) -> int:
        """Proxy sequences per round."""
        return sum(self.batches)

    @property
    def batch_size(self) -> int:
        """Largest step batch (for reports)."""
        return max(self.batches)

    @property
    def micro_batch_size(self) -> int:
        return self.micro_batch_for(self.batch_size)

    def micro_batch_for(self, batch: int) -> int:
        return largest_divisor_at_most(batch // self.dp_in, self.max_micro_batch)


def largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _apportion(total: int, weights: list[float]) -> list[int]:
    """Integers summing to ``total`` proportional to ``weights`` (largest remainders)."""
    raw = [total * w / sum(weights) for w in weights]
    out = [int(x) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: (out[i] - raw[i], i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def proxy_steps(plan: Plan, scale: float, *, round_samples: int | None = None, dp_in: int = 1,
                max_micro_batch: int = 4) -> list[ProxyStep]:
    """Map a target plan to proxy step batches (module docstring), worker order.

    Args:
        scale: ``G_p / G_t``; 1 follows the plan as is.
        round_samples: ``S`` (proxy sequences per round) when ``scale != 1``.
    """
    if scale == 1 or round_samples is None:
        return [ProxyStep(target=wp, batches=(wp.batch_size,) * wp.inner_steps,
                          max_micro_batch=max_micro_batch, dp_in=dp_in) for wp in plan.workers]
    units = _apportion(round_samples // dp_in, [wp.tokens for wp in plan.workers])
    out = []
    for wp, u in zip(plan.workers, units):
        u = max(u, 1)
        H = min(wp.inner_steps, u)
        batches = [dp_in * (u // H + (1 if h < u % H else 0)) for h in range(H)]
        out.append(ProxyStep(target=wp, batches=tuple(batches), max_micro_batch=max_micro_batch,
                             dp_in=dp_in))
    return out


@dataclass
class RoundResult:
    """One worker's round: pseudo-gradient, tokens, training loss per loss token, steps."""

    delta: dict[str, torch.Tensor]
    tokens: int
    loss: float
    steps: int


def worker_schedule(cfg: JobConfig, inner_iters: int, warmup_iters: int):
    """A worker's ``TrainConfig``: ``cfg.train`` with the worker's own schedule
    length (``inner_iters`` optimizer steps) and warmup."""
    return dataclasses.replace(copy.deepcopy(cfg.train), iters=max(inner_iters, 1),
                               warmup_iters=warmup_iters, lr_decay_iters=None)


def set_schedule(sched, inner_iters: int, warmup_iters: int) -> None:
    """Give a worker's LR schedule (megatron's ``OptimizerParamScheduler``) a new
    length, as ``lr_scheduler(worker_schedule(cfg, inner_iters, warmup_iters))``
    builds it; its position (``num_steps``) is kept and every param group's LR is
    recomputed there (megatron sets it only in ``step``: the next inner step would
    train at the old schedule's LR)."""
    iters = max(inner_iters, 1)
    sched.lr_warmup_steps = warmup_iters
    sched.lr_decay_steps = max(iters, warmup_iters + 1)  # megatron needs warmup < decay
    sched.wd_incr_steps = iters
    sched.step(0)


def schedule_position(inner_iters: int, inner_steps: int, round_: int, outer_steps: int) -> int:
    """The inner steps a worker's LR schedule stands at when round ``round_`` (0-based:
    the rounds before it done) starts: its length less the rounds left at its current
    ``H_i`` (``inner_steps``).  Every schedule ends with the run (:func:`follow_replan`
    keeps that across re-plans), so this holds after any re-plan; ``round_ · H_i``, what
    a joining worker and the guard's expected scale were set to, holds only while
    ``H_i`` never changed (after one that raised it, it stood rounds ahead)."""
    return inner_iters - (outer_steps - round_) * inner_steps


def follow_replan(schedules: list[tuple[int, int]], old: list[ProxyStep], new: list[ProxyStep],
                  round_: int, outer_steps: int) -> list[tuple[int, int]]:
    """Every worker's ``(inner_iters, warmup_iters)`` after a re-plan that takes
    effect at round ``round_``: the remaining ``outer_steps − round_`` rounds run
    ``H_i'`` inner steps instead of ``H_i``, so the schedule ends with the run
    (it was sized from the first plan: a worker whose ``H_i`` grew ran out of
    schedule early, one whose ``H_i`` shrank never decayed).  A warmup not yet
    over keeps ending at the same round.  Deterministic from the plans alone,
    so every worker computes every other worker's schedule (:class:`LrScale`).

    Args:
        schedules: per worker ``(inner_iters, warmup_iters)`` of the plan so far.
        old, new: the plan so far and the new plan, as proxy steps, cluster order.
    """
    left = outer_steps - round_
    out = []
    for (total, warmup), a, b in zip(schedules, old, new):
        h, h2 = a.inner_steps, b.inner_steps
        done = total - left * h  # steps trained before round_ (h per round since the last change)
        if warmup > done:
            warmup = done + round((warmup - done) * h2 / h)
        out.append((done + left * h2, warmup))
    return out


def lr_scale(batch: int, reference_batch: float, scaling: str) -> float:
    """Inner LR multiplier of a step of ``batch`` sequences against the batch
    ``train.lr`` is meant for: ``sqrt`` (ratio ** 0.5), ``linear`` or ``none``."""
    ratio = batch / reference_batch
    return {"sqrt": ratio**0.5, "linear": ratio, "none": 1.0}[scaling]


class LrScale:
    """Every worker's expected pseudo-gradient scale of a round, from the plan alone.

    ``Δ_i`` is the sum of ``H_i`` AdamW updates, each moving a coordinate by
    about its step's learning rate ``η_h = lr_i(s_i + h) · scale(b_h)``
    (absolute lrs, ``train.lr`` units included).  While the updates point the
    same way (early training) ``‖Δ_i‖`` grows like ``Σ η_h``; once they are
    mostly noise, like ``sqrt(Σ η_h²)``.  :meth:`round` returns the geometric
    mean of the two, ``sqrt(Σ η_h · sqrt(Σ η_h²))``, so that honest workers of
    very different ``H_i`` stay within ``(H_max / H_min) ** 0.25`` of each
    other in either regime, and :class:`geomesh.wire.guard.Guard` divides norms by
    it.  Measured on the four-region plan's round 1 (warmup 62 / 22 / 5 / 2
    steps for ``H_i`` = 25 / 9 / 2 / 1; megatron's first step runs at lr 0):
    raw norms differ 13x between the H100 and the V100, this scale 11.7x.
    Every receiver computes it for every worker (each worker's schedule is
    its :func:`worker_schedule`, its position the plan's inner steps of the
    rounds it trained), so no worker's claim enters it.

    Args:
        cfg: the job config.
        schedules: per worker ``(inner_iters, warmup_iters)``, cluster order.
        reference_batch, scaling: as :func:`lr_scale`.
    """

    def __init__(self, cfg: JobConfig, schedules: list[tuple[int, int]], reference_batch: float,
                 scaling: str) -> None:
        self.schedulers = [lr_scheduler(_NoGroups(), worker_schedule(cfg, n, w)) for n, w in schedules]
        self.reference_batch, self.scaling = reference_batch, scaling
        self.done = [0] * len(schedules)
        """Inner steps each worker has trained (its schedule position)."""

    def lrs(self, i: int, step: ProxyStep) -> list[float]:
        """Worker ``i``'s ``η_h`` over ``step``'s batches, from its current position."""
        sched, out = self.schedulers[i], []
        for h, b in enumerate(step.batches):
            sched.num_steps = self.done[i] + h
            out.append(sched.get_lr({}) * lr_scale(b, self.reference_batch, self.scaling))
        return out

    def round(self, i: int, step: ProxyStep) -> float:
        """``sqrt(Σ η_h · sqrt(Σ η_h²))`` of worker ``i``'s next round."""
        eta = self.lrs(i, step)
        return math.sqrt(sum(eta) * math.sqrt(sum(e * e for e in eta)))

    def set_schedules(self, schedules: list[tuple[int, int]]) -> None:
        """New ``(inner_iters, warmup_iters)`` per worker (:func:`follow_replan`)."""
        for sched, (n, w) in zip(self.schedulers, schedules):
            set_schedule(sched, n, w)

    def advance(self, i: int, step: ProxyStep) -> None:
        """Worker ``i`` trained ``step`` (one round)."""
        self.done[i] += step.inner_steps

    def state_dict(self) -> dict:
        return {"done": list(self.done)}

    def load_state_dict(self, state: dict) -> None:
        self.done = [int(x) for x in state["done"]]


class _NoGroups:
    param_groups: list = []


class InnerWorker:
    """A worker's trainer and data access.

    Args:
        cfg: the job config; copied, its batch sizes then belong to this worker.
        index: worker index in the cluster.
        dataset: the run's training dataset (the global stream).
        inner_iters: inner optimizer steps of the whole run (LR schedule length).
        warmup_iters: LR warmup steps.
        reference_batch: the batch ``train.lr`` is meant for (the uniform
            per-worker batch ``G/K``); steps of other sizes scale the LR by
            ``geomesh.inner_lr_scaling``.
        dp_group, dp_in, dp_in_rank: the worker's replicas (real mode).

    Raises:
        ConfigError: the worker's layout does not fit its device with GeoMesh's outer
            state (:data:`geomesh.fleet.worker_models.OUTER_STATE`) beside the
            inner job's (:func:`jobruntime.memory.check_job_fits`).
    """

    def __init__(self, cfg: JobConfig, index: int, dataset, *, inner_iters: int,
                 warmup_iters: int, reference_batch: float, dp_group: dist.ProcessGroup | None = None,
                 dp_in: int = 1, dp_in_rank: int = 0) -> None:
        self.cfg = copy.deepcopy(cfg)
        self.cfg.train = worker_schedule(cfg, inner_iters, warmup_iters)
        self.index = index
        self.dataset = dataset
        self.reference_batch = reference_batch
        self.lr_scaling = cfg.geomesh.inner_lr_rule
        self.dp_in, self.dp_in_rank = dp_in, dp_in_rank
        set_seed(cfg.train.seed)  # every worker builds the same initial model
        self.trainer = Trainer(self.cfg, dp_group=dp_group, extra_state=OUTER_STATE)

    def lr_scale(self, batch: int) -> float:
        """Inner LR multiplier for a step of ``batch`` sequences (``geomesh.inner_lr_scaling``)."""
        return lr_scale(batch, self.reference_batch, self.lr_scaling)

    def microbatches(self, start: int, batch_size: int, micro_batch_size: int) -> list[dict]:
        """This rank's micro-batches of the ``batch_size`` samples at stream position ``start``."""
        sampler = GlobalBatchSampler(self.dataset, global_batch_size=batch_size,
                                     micro_batch_size=micro_batch_size, dp=self.dp_in,
                                     dp_rank=self.dp_in_rank)
        return sampler.microbatches_at(start)

    def train_round(self, theta: dict[str, torch.Tensor], step: ProxyStep, start: int) -> RoundResult:
        """``H_i`` steps from ``θ_global`` on samples ``[start, start + S_i)``."""
        self.trainer.set_params(theta)
        losses = self.train_steps(step, start, 0, step.inner_steps)
        return self.result(theta, step, losses)

    def train_steps(self, step: ProxyStep, start: int, first: int, last: int) -> list[StepResult]:
        """Steps ``first .. last-1`` of a round from the current local weights (the
        round's samples start at ``start``); returns their results."""
        tr = self.trainer
        start += sum(step.batches[:first])
        losses = []
        for b in step.batches[first:last]:
            mb = step.micro_batch_for(b)
            tr.set_batch_size(b, mb)
            tr.lr_scale = self.lr_scale(b)
            losses.append(tr.train_step(self.microbatches(start, b, mb)))
            start += b
        return losses

    def result(self, anchor: dict[str, torch.Tensor], step: ProxyStep,
               losses: list[StepResult]) -> RoundResult:
        """The round's ``Δ_i = anchor − θ_i`` (fp32; ``anchor`` = the θ_global the
        round started from) with its tokens and its loss per loss token (the steps'
        batches differ in size)."""
        local = self.trainer.get_params()
        delta = {k: anchor[k] - local[k] for k in anchor}  # Δ_i = θ_global − θ_i (fp32)
        tokens = step.samples * self.cfg.model.seq_length
        return RoundResult(delta=delta, tokens=tokens, loss=mean_loss(losses) if losses else 0.0,
                           steps=step.inner_steps)

    @torch.no_grad()
    def rebase(self, theta: dict[str, torch.Tensor], snapshot: dict[str, torch.Tensor]) -> None:
        """Overlapped rounds: ``θ_i ← θ_global + (θ_i − snapshot)`` — the new global
        weights plus the local progress since ``snapshot`` (the weights whose
        pseudo-gradient was sent); with no progress, exactly ``θ_global``."""
        local = self.trainer.get_params()
        self.trainer.set_params({k: theta[k] + (local[k] - snapshot[k].to(local[k].device))
                                 for k in theta})

    def state_dict(self) -> dict:
        """Inner optimizer moments, LR schedule and step.  The weights are not
        needed: every round starts from ``θ_global`` (saved with the outer state)."""
        tr = self.trainer
        return {"optimizer": tr.optimizer.state_dict(), "scheduler": tr.scheduler.state_dict(),
                "step": tr.step}

    def set_schedule(self, inner_iters: int, warmup_iters: int) -> None:
        """A new length of this worker's LR schedule, position kept (:func:`follow_replan`)."""
        set_schedule(self.trainer.scheduler, inner_iters, warmup_iters)

    def load_state_dict(self, state: dict) -> None:
        tr = self.trainer
        tr.optimizer.load_state_dict(state["optimizer"])
        tr.scheduler.load_state_dict(state["scheduler"])
        tr.step = int(state["step"])

    def adam_moments(self) -> dict:
        """This rank's AdamW moments by local parameter name, in bf16 (what a heal sends
        a joining worker: :func:`geomesh.state.heal_state`), with Adam's step count ``t``;
        empty before the first inner step.

        bf16 keeps fp32's exponent range (``exp_avg_sq`` reaches 1e-12 and below) at a
        relative error of 2^-9, far below how much the moments of one worker differ
        from another's (other data, other batch); the payload grows by 4 bytes per
        parameter instead of 8.
        """
        states = optimizer_state_by_name(self.trainer)
        if not states or any("exp_avg" not in s.state for s in states.values()):
            return {"step": 0.0, "exp_avg": {}, "exp_avg_sq": {}}
        return {"step": max(s.step for s in states.values()),
                **{kind: {n: s.state[kind].detach().to("cpu", torch.bfloat16)
                          for n, s in states.items()} for kind in ("exp_avg", "exp_avg_sq")}}

    @torch.no_grad()
    def load_adam_moments(self, moments: dict) -> None:
        """Take :meth:`adam_moments` of another worker (cut to this rank's shards): every
        parameter's ``exp_avg``, ``exp_avg_sq`` and step count ``t``, replacing this
        worker's own (none, when it joins new).  The LR schedule is not touched.

        Raises:
            KeyError: a parameter of this rank is missing from ``moments``.
        """
        t = float(moments["step"])
        for name, s in optimizer_state_by_name(self.trainer).items():
            for kind in ("exp_avg", "exp_avg_sq"):
                dtype = s.state[kind].dtype if kind in s.state else s.main.dtype
                s.state[kind] = moments[kind][name].to(s.main.device, dtype).clone()
            if "step" in s.group or "transformer_engine" in type(s.holder).__module__:
                s.group["step"] = int(t)  # TE's FusedAdam counts steps per param group
            else:  # as torch's AdamW creates it: on the device when fused or capturable
                on_device = s.group.get("fused") or s.group.get("capturable")
                s.state["step"] = torch.tensor(t, dtype=torch.float32,
                                               device=s.main.device if on_device else "cpu")
