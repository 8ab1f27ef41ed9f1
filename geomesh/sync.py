"""The synchronous outer loop: GeoMesh and DiLoCo, emulated or real.

Per round ``r`` (Douillard et al. 2023, "DiLoCo", Alg. 1, with GeoMesh's
balancing and compression):

1. every worker ``i`` sets ``θ_i ← θ_global`` and runs ``H_i`` inner AdamW
   steps of ``b_i`` sequences (:class:`geomesh.worker.InnerWorker`);
2. ``Δ_i = θ_global − θ_i`` (fp32) is encoded in canonical form, whatever the
   worker's TP/PP/DP layout (:class:`geomesh.wire.canonical_codec.CanonicalCodec`) —
   GeoMesh: ``geomesh.compression`` (top-k, or sign bits + an fp32 scale per
   global row), error feedback optional; DiLoCo: fp32 — with the worker's token
   count ``n_i``; a worker's ranks join their parts into its message
   (:meth:`geomesh.exchange.deploy.Placement.collect`);
3. the messages are all-gathered (:mod:`geomesh.exchange.transport`, or the region
   leaders' torchft exchange, :mod:`geomesh.exchange.region`); every rank decodes the
   part of each message that overlaps its own shard and aggregates,
   ``Δ = Σ (n_i/N) D(msg_i)``;
4. the outer Nesterov step updates ``θ_global`` (:class:`geomesh.outer.OuterNesterov`);
   every worker applies it to the same messages, so all copies stay equal.

GeoMesh plans ``b_i, H_i`` with :class:`geomesh.fleet.planner.Planner` so that all
workers finish their compute together, and re-plans when measured step times
drift (real: wall-clock per inner step; emulated: the injected
``slowdown`` of the cluster file).  Every plan keeps the round's tokens within
the planner's tolerance of ``T`` (a constraint, :mod:`geomesh.fleet.planner`), and each
worker's LR schedule follows a re-plan: the rounds left run the new ``H_i``
(:func:`geomesh.worker.follow_replan`; saved with checkpoints and healing
state).  DiLoCo uses the same ``b = G_t/K`` and
``H`` everywhere, so fast workers wait for the slowest (straggler idle).

Overlapped rounds (``geomesh.overlap = f``; the exchange hidden behind compute,
as Streaming DiLoCo overlaps fragments, Douillard et al. 2025).  After its
``H_i`` steps of round ``r`` a worker sends ``Δ_i`` and does not wait: it moves
to the *eager start* (Kale et al. 2025, "Eager updates for overlapped
communication and computation in DiLoCo"; :mod:`geomesh.eager`) — the outer
step of its own decoded message at its token share mixed with the last
aggregate for the others' share — and runs the first ``τ_i = ⌈f·H_i⌉`` steps
of round ``r+1`` from there while the messages travel.  Then it takes
the real outer step (all messages of round ``r``) and moves its weights onto
the new ``θ_global``, keeping the ``τ_i`` steps' progress:
``θ_i ← θ_global + (θ_i − eager start)``; the rest of round ``r+1`` follows,
and ``Δ_i`` is measured from ``θ_global``.  With ``f = 0`` this is exactly the
blocking round (tested bit for bit); ``f = 1`` delays the outer update by
one round.  The last round and checkpoint rounds are not overlapped (a
checkpoint then holds no messages in flight); a re-plan decided while round
``r+1`` is under way applies from round ``r+2``.  The snapshot of the eager
start is kept in host memory.  Real mode runs the all-gather in a background
thread (it uses only the transport's process groups); the emulated clock
charges the wait at step ``τ_i`` (:class:`geomesh.fleet.clock.EmulatedClock`).

The measured choices behind the defaults (one scale per row, balancing by
steps, the outer-momentum ramp, overlap 0.1 with the eager update) are measured by
``bench/geomesh_ttp.py --ablation``.

Time.  Emulated: worker ``i``'s compute is the GPU-profile time of its plan on
the target model (:func:`geomesh.fleet.clock.inner_step_time_s`) times any injected
slowdown, charged to an :class:`~geomesh.fleet.clock.EmulatedClock`; the exchange is
charged with the target model's message size.  Real: wall-clock; a worker's
straggler idle is ``max_j compute_j − compute_i`` and its WAN idle the rest
of its time in the exchange.

Every round's messages pass :class:`geomesh.wire.guard.Guard` before aggregation
(every codec: ``codec.aggregate(received, guard=guard)``); a rejected message
drops its worker from the round, except that a peer's message of another run (other
settings) or another round in a job's first round stops the job
(:meth:`OuterLoop.refuse_other_start`).  One job per
region (``geomesh.region``): each round's exchange is a torchft quorum
(:mod:`geomesh.exchange.membership`), lost workers drop out (the plan is redone for the
members left, :mod:`geomesh.fleet.membership_plan`), a joining worker heals from a live
peer at a round boundary.  Those rounds are blocking: ``geomesh.overlap`` with
``geomesh.region`` is refused (:meth:`jobruntime.config.GeoMeshConfig.validate`).

Stopping at the target (``train.stop_at_target``).  One job for the run stops after
the round whose evaluation reached ``train.target_ppl``.  With one job per region,
each region evaluates at its own cadence, size and precision, so their verdicts may
differ by a round; a region that stopped on its own would leave the others to report
it lost and train on alone.  So the stop is the run's decision, carried in the
exchange: a region whose evaluation reached the target flags it in its next round's
message (:data:`geomesh.exchange.deploy.STOP`), and every region stops after the first
round whose messages carry a flag — all see the same messages — with the same
``θ_global``, evaluated there.  The price is one more round after the target.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from jobruntime.checkpoint import CheckpointError
from jobruntime.config import ConfigError
from jobruntime.faults import fault_point

from .context import RunContext, target_canonical_schema
from .eager import EagerStart
from .exchange.region import RegionMembership
from .exchange.transport import InProcessTransport
from .feedback import LocalMomentum
from .figures import RoundFigures
from .fleet.clock import EmulatedClock, inner_step_time_s
from .fleet.membership_plan import plan_for_members
from .fleet.schedule import max_tp
from .layout_switch import RegionSwitch
from .outer import OuterNesterov
from .report import RunStats, memory_overhead, not_finite
from .state import checkpoint_state, heal_state, load_heal, load_state, resume, save_state
from .state import proxy_steps_for as _proxy
from .wire.canonical import CanonicalSchema, layout_map
from .wire.canonical_codec import CanonicalCodec
from .wire.compression import ErrorFeedback
from .wire.guard import Guard
from .worker import InnerWorker, LrScale, ProxyStep, follow_replan, schedule_position

log = logging.getLogger(__name__)


def _true_step_s(ctx: RunContext, k: int, step: ProxyStep, round_: int) -> float:
    """Emulated physics: profile time of one inner step on the target, times the slowdown."""
    w = ctx.cluster.workers[k]
    t = inner_step_time_s(w, ctx.target.model, step.target.micro_batch_size,
                          step.target.grad_accum, seq_length=step.target.seq_length)
    return t * ctx.cluster.slowdown_factor(w.name, round_)


def _codec_kind(ctx: RunContext) -> str:
    """GeoMesh's codec for the whole run (every region reads the same config and
    cluster file, so all choose alike): ``geomesh.compression``, except that top-k
    falls back to ``sign_row`` in real mode when a TP worker would split a row
    inside a 256-column chunk (:meth:`CanonicalCodec._topk_shard
    <geomesh.wire.canonical_codec.CanonicalCodec._topk_shard>`)."""
    kind = ctx.cfg.geomesh.compression
    tp = max_tp(ctx.cfg, ctx.cluster)  # a region's scheduled TP counts (cona.schedule)
    m = ctx.cfg.model
    widths = (m.hidden_size // tp, m.ffn // tp)
    if kind == "topk" and not ctx.emulated and tp > 1 and any(w % 256 for w in widths):
        log.warning("geomesh.compression=topk: a TP=%d worker splits rows of %s columns "
                    "inside 256-column chunks; this run uses sign_row", tp, list(widths))
        return "sign_row"
    return kind


class _Diverged(Exception):
    """A round's loss or pseudo-gradient was not finite (:meth:`OuterLoop.train`)."""


@dataclass
class _Round:
    """A round whose compute is done: its messages are exchanged or in flight."""

    r: int
    steps: list[ProxyStep]
    msgs: dict[int, bytes] = field(default_factory=dict)
    losses: dict[int, float] = field(default_factory=dict)
    compute: dict[int, float] = field(default_factory=dict)
    received: list[bytes | None] | None = None
    shared: bool = False  # ``received`` is already decoded and shared (one job per region)
    future: Future | None = None  # real mode, overlapped: the background all-gather
    wait_s: float = 0.0  # real mode: wall seconds spent waiting for the exchange


class OuterLoop(RoundFigures):
    """One run of the synchronous outer loop: its state, and the phases of a round.

    A round (:meth:`run`) is :meth:`train` (each local worker's ``H_i`` inner
    steps from ``θ_global``, the first ``τ_i`` of them behind the previous
    exchange when overlapped, each ``Δ_i`` encoded in canonical form and joined
    over the worker's ranks: :meth:`encode`), :meth:`exchange` (the emulated
    transport, the region leaders' torchft exchange, or the one-world
    all-gather, in the background when overlapped) and :meth:`finish`:
    :meth:`receive`, :meth:`aggregate` (guard, ``Δ``, outer step),
    :meth:`figures` (compute, idle and bytes per worker: from the emulated
    clock, or from wall time), :meth:`record` (metrics, evaluation),
    :meth:`replan`, :meth:`checkpoint` and :meth:`follow_members`.  The
    emulated and the real clock run the same methods; only where time and
    bytes come from differs.  What is saved, resumed and healed:
    :mod:`geomesh.state`.
    """

    def __init__(self, ctx: RunContext) -> None:
        self.ctx, self.cfg, self.g = ctx, ctx.cfg, ctx.cfg.geomesh
        self.cl, self.pl = ctx.cluster, ctx.placement
        cfg, g, pl = self.cfg, self.g, self.pl
        self.geomesh = ctx.method == "geomesh"
        self.K = len(self.cl.workers)
        self.plan = ctx.planner.plan() if self.geomesh else ctx.planner.uniform(ctx.uniform_batch)
        self.steps = _proxy(ctx, self.plan)
        # each worker's LR schedule: its own length, warmup scaled by H_i / H; a re-plan
        # resizes the rest of it (follow_replan), a resume and a heal restore it
        # the round the schedules end with: outer_steps, or the saved run's where a resume
        # raised outer_steps (its schedules were sized for that; geomesh.state.resume)
        self.schedule_rounds = g.outer_steps
        self.schedules = [(g.outer_steps * s.inner_steps,
                           round(cfg.train.warmup_iters * s.inner_steps / g.inner_steps))
                          for s in self.steps]
        self.workers = {i: InnerWorker(ctx.layout_cfg, i, ctx.train_ds,
                                       inner_iters=self.schedules[i][0],
                                       warmup_iters=self.schedules[i][1],
                                       reference_batch=ctx.reference_batch, dp_group=pl.dp_group,
                                       dp_in=pl.dp_in, dp_in_rank=pl.dp_in_rank)
                        for i in pl.workers}
        self.lr_scales = LrScale(ctx.layout_cfg, self.schedules, ctx.reference_batch,
                                 g.inner_lr_rule)
        self.first = self.workers[pl.workers[0]]
        self.theta = self.first.trainer.get_params()  # θ_global, fp32, this rank's shard
        self.layout = layout_map(self.first.trainer.module)  # this rank's shards, canonical
        self.cschema = CanonicalSchema.gather(self.layout, pl.mp_group)
        kind = _codec_kind(ctx) if self.geomesh else "fp32"
        self.codec = CanonicalCodec(kind, self.layout, self.cschema, tp_group=pl.tp_group,
                                    mp_group=pl.mp_group, k=g.topk_k, bits=g.topk_bits)
        self.canon_numel = sum(math.prod(shape) for _, shape in self.cschema.entries)
        self.outer = OuterNesterov(self.theta, lr=g.outer_lr, momentum=g.outer_momentum,
                                   momentum_warmup=g.outer_momentum_warmup)
        # sign_pred: the outer momentum predicts Δ_i
        self.pred = {"predictor": self.outer.momentum_buffer} if kind == "sign_pred" else {}
        self.feedback = ({i: ErrorFeedback(g.error_feedback_decay) for i in pl.workers}
                         if kind != "fp32" and g.error_feedback else {})
        # compress_update: each worker's own momentum, workers send Δ_i + μ v_i (feedback.py)
        self.local_mom = ({i: LocalMomentum() for i in pl.workers}
                          if self.geomesh and g.compress_update else {})
        self.overlap = g.overlap if self.geomesh else None  # the baselines never overlap
        self.guard = Guard.from_config(g, self.cl)  # checks every message before aggregation
        if pl.per_region:  # the region's ranks follow its leader's torchft membership
            pl.membership = RegionMembership(pl.ft_leader, self.layout,
                                             contributes=pl.dp_in_rank == 0, cluster=self.cl,
                                             worker=pl.workers[0], policy=g.on_worker_loss)
        self.layouts = RegionSwitch.for_run(ctx)  # cona.schedule: this region's layout switches
        self.ft = pl.membership  # one job per region: quorum, healing (geomesh.region)
        if self.ft is not None and self.overlap is not None:  # GeoMeshConfig.validate refuses it
            raise ValueError("geomesh.overlap does not combine with one job per region")
        self.clock = self.transport = None
        self.charged = 0
        if ctx.emulated:
            self.clock = EmulatedClock(self.cl, overlap=self.overlap is not None)
            self.charged = self.codec.message_bytes(target_canonical_schema(ctx.target))
            self.transport = InProcessTransport(self.cl, clock=self.clock,
                                                charged_bytes=self.charged)
        overlapped = self.overlap is not None
        self.pool = ThreadPoolExecutor(1) if overlapped and not ctx.emulated else None
        self.eager = EagerStart() if overlapped else None  # host: the last aggregate
        self.val = ctx.val_batches(dp=pl.dp_in, dp_rank=pl.dp_in_rank)
        self.stats = RunStats.for_cluster(self.cl, cfg.train.target_ppl)
        self.position = self.start = self.replans = 0
        self.history: dict[str, list[float]] = {}  # seconds per inner step since the last plan
        self.next_steps: list[ProxyStep] | None = None  # a re-plan for the next round
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}  # overlap: weights Δ_i left
        self.overhead = None
        if cfg.checkpoint.load:
            resume(self, load_state(cfg.checkpoint.load, rank=pl.rank))
        self.t0 = time.perf_counter() - self.stats.time_s
        self.wall0 = time.perf_counter()
        self.r, self.joining, self.members = self.start, False, list(range(self.K))
        if self.ft is not None:
            self.ft.set_state_fns(lambda: heal_state(self), lambda st: load_heal(self, st))
            self.joining = self.ft.join(self.start)
            if not self.joining:  # else the healed state says who trained this round
                self.members = list(self.ft.members)

    # -- helpers -----------------------------------------------------------------------
    @property
    def keeps_local_weights(self) -> bool:
        """Whether workers go on from local weights that differ from ``θ_global`` after a
        round (overlapped rounds), so that evaluating ``θ_global`` must restore them."""
        return self.overlap is not None

    def save_round(self, step: int) -> bool:
        every = self.cfg.checkpoint.save_interval
        return bool(every) and (step % every == 0 or step == self.g.outer_steps)

    def saved_schedules(self, rnd: int) -> list[list[int]]:
        """The LR schedules that go with the current ``plan``: a re-plan not yet
        adopted (it starts at round ``rnd``) is followed here, as :meth:`adopt` will."""
        if self.next_steps is None:
            return [list(x) for x in self.schedules]
        return [list(x) for x in follow_replan(self.schedules, self.steps, self.next_steps, rnd,
                                               self.schedule_rounds)]

    def adopt(self, rnd: int) -> None:
        """The pending re-plan's steps from round ``rnd`` on; every LR schedule follows it."""
        self.set_schedules(follow_replan(self.schedules, self.steps, self.next_steps, rnd,
                                         self.schedule_rounds))
        self.steps, self.next_steps = self.next_steps, None

    def set_schedules(self, schedules: list[tuple[int, int]]) -> None:
        self.schedules = schedules
        self.lr_scales.set_schedules(schedules)
        for w in self.workers.values():
            w.set_schedule(*schedules[w.index])

    def charge(self, k: int, rnd: _Round, seconds: float, wall0: float) -> None:
        """Compute time of worker ``k``: emulated profile seconds, or wall seconds
        since ``wall0`` (with an injected slowdown slept off)."""
        name = self.cl.workers[k].name
        if self.ctx.emulated:
            self.clock.compute(name, seconds)
        else:
            wall = time.perf_counter() - wall0
            factor = self.cl.slowdown_factor(name, rnd.r)
            if factor != 1.0:  # injected slowdown: sleep the extra time
                time.sleep((factor - 1.0) * wall)
            seconds = wall * factor
        rnd.compute[k] = rnd.compute.get(k, 0.0) + seconds

    def offsets(self) -> list[int]:
        """Each worker's place in the token stream: after the round's members before it."""
        return [sum(self.steps[j].samples for j in self.members if j < i)
                for i in range(self.K + 1)]

    # -- a round -----------------------------------------------------------------------
    def run(self) -> dict:
        """Train ``geomesh.outer_steps`` rounds (:meth:`rounds`); return the summary (with
        ``diverged_at_step`` where a round was not finite: the run stopped there)."""
        try:
            self.rounds()
        except _Diverged:  # stats.diverged_at_step holds it; nothing of the round is saved
            pass
        if self.pool is not None:
            self.pool.shutdown()
        if self.ft is not None:
            self.ft.close()
        return self.summary()

    def rounds(self) -> None:
        """The outer loop: train, exchange and finish rounds to ``outer_steps`` (or the
        stop); raises :class:`_Diverged` from :meth:`train` (a worker's round) and
        :meth:`finish` (θ_global's validation)."""
        pl, overlap = self.pl, self.overlap
        inflight: _Round | None = None
        stop = False
        while self.r < self.g.outer_steps:
            if self.next_steps is not None:  # a re-plan: from this round on
                self.adopt(self.r)
            if self.layouts is not None:  # a round boundary: the region's scheduled TP/PP/DP
                self.layouts.at_boundary(self)
            rnd = _Round(r=self.r, steps=self.steps)
            # Overlapped: the first τ_i = ⌈overlap · H_i⌉ steps run while round r−1's
            # messages travel.
            taus = {i: math.ceil(overlap * self.steps[i].inner_steps) if inflight is not None
                    else 0 for i in pl.workers}
            done: dict[int, list] = {i: [] for i in pl.workers}  # StepResults of round r
            offsets = self.offsets()
            if any(taus.values()):
                for i in pl.workers:
                    s, w0 = self.steps[i], time.perf_counter()
                    done[i] = self.workers[i].train_steps(s, self.position + offsets[i], 0, taus[i])
                    self.charge(i, rnd, self._true_s(i, s) * taus[i] / s.inner_steps, w0)
            if inflight is not None:
                stop = self.finish(inflight)
                inflight = None
                if self.next_steps is not None and not any(taus.values()):  # none of r ran yet
                    self.adopt(self.r)
                    rnd.steps, offsets = self.steps, self.offsets()
                if stop:
                    break
                for i in pl.workers:  # onto the new θ_global, keeping the progress since
                    self.workers[i].rebase(self.theta, self.snapshots[i])  # the snapshot
            elif overlap is not None:
                for i in pl.workers:
                    self.workers[i].trainer.set_params(self.theta)
            shares = self.train(rnd, taus, done, offsets)
            drain = overlap is None or self.r + 1 == self.g.outer_steps or \
                self.save_round(self.r + 1)
            rnd = self.exchange(rnd, drain)
            if not drain:
                self.eager_start(rnd, shares)
            # the token stream moves on by what the round's members trained (after a
            # heal: from the healed round's position, with its plan)
            self.position += sum(rnd.steps[j].samples for j in self.members)
            if drain:
                stop = self.finish(rnd)
                if stop:
                    break
            else:
                inflight = rnd
            self.r += 1
        if inflight is not None and not stop:
            self.finish(inflight)

    def _true_s(self, i: int, s: ProxyStep) -> float:
        """Emulated: the profile seconds of worker ``i``'s round; real: 0 (wall time)."""
        return _true_step_s(self.ctx, i, s, self.r) * s.target.inner_steps \
            if self.ctx.emulated else 0.0

    def train(self, rnd: _Round, taus: dict[int, int], done: dict[int, list],
              offsets: list[int]) -> dict[int, float]:
        """Each local worker's (rest of its) ``H_i`` steps and its message; returns each
        worker's token share ``w_i`` of the round.  A joining worker heals instead."""
        round_tokens = sum(self.steps[j].samples for j in self.members) * self.cfg.model.seq_length
        shares: dict[int, float] = {}
        for i in ([] if self.joining else self.pl.workers):
            w0, s = time.perf_counter(), self.steps[i]
            start = self.position + offsets[i]
            if self.overlap is None:
                res = self.workers[i].train_round(self.theta, s, start)
            else:
                done[i] += self.workers[i].train_steps(s, start, taus[i], s.inner_steps)
                res = self.workers[i].result(self.theta, s, done[i])
            fault_point("train", self.r)
            # the round's profile seconds less what its overlapped steps were charged
            # (at tau = H_i that is all of it: 0, or a rounding error below 0)
            self.charge(i, rnd, max(self._true_s(i, s) - rnd.compute.get(i, 0.0), 0.0)
                        if self.ctx.emulated else 0.0, w0)
            if self.stats.diverged(not_finite(res.loss, res.delta.values(),
                                              who=repr(self.cl.workers[i].name),
                                              **self._agreeing()), self.r + 1):
                self.ctx.log_outer_step(dict(step=self.r + 1, tokens=self.stats.tokens,
                                             time_s=self.stats.time_s, loss=res.loss))
                raise _Diverged  # before its encode: every process of the job stops here
            rnd.msgs[i] = self.encode(i, res)
            rnd.losses[i] = res.loss
            shares[i] = res.tokens / round_tokens
        return shares

    def _agreeing(self) -> dict:
        """Who must agree on a worker's divergence before its message is encoded: the job
        (one job per region, emulated: the default group), or with one ``torchrun`` for
        the whole cluster only the worker's own ranks (a cluster-wide agreement would
        hold every worker at the slowest one's finish before encoding: overlapped rounds
        lost their overlap, and the wait moved out of the measured WAN idle).  There a
        diverged worker stops alone, and the others see it lost."""
        if self.ft is not None or self.ctx.emulated:
            return {}
        group = self.pl.worker_group
        if group is None or dist.get_world_size(group) == 1:
            return {"local": True}
        return {"group": group}

    def encode(self, i: int, res) -> bytes:
        """Worker ``i``'s message: ``Δ_i`` (+ μ v_i with compress_update) in canonical form;
        its ranks' parts joined (a DP replica's repeat DP rank 0's and are left out)."""
        delta = self.local_mom[i].update(res.delta, self.outer.current_momentum) \
            if self.local_mom else res.delta
        part = self.codec.encode(delta, res.tokens, worker=i, round=self.r,
                                 feedback=self.feedback.get(i), **self.pred)
        return self.pl.collect(part if self.pl.dp_in_rank == 0 else None)

    def exchange(self, rnd: _Round, drain: bool) -> _Round:
        """Start or run round ``rnd``'s exchange; returns the round (after a heal: the
        others' round, at the healed position, with nothing of this worker's in it)."""
        pl = self.pl
        if self.ctx.emulated:
            rnd.received = self.transport.exchange(rnd.msgs)
        elif self.ft is not None:  # one job per region: torchft quorum, then the all-gather
            me = pl.workers[0]
            x0 = time.perf_counter()
            rnd.received = pl.exchange(rnd.msgs.get(me, b""), quorum_done=self.joining,
                                       stats=(rnd.losses[me], rnd.compute[me])
                                       if me in rnd.msgs else (0.0, 0.0),
                                       stop=self.target_reached)
            rnd.wait_s, rnd.shared = time.perf_counter() - x0, True
            if pl.healed or self.joining:  # sent nothing: the others' round r, from their state
                rnd = dataclasses.replace(rnd, r=self.r, steps=self.steps, msgs={}, losses={},
                                          compute={})
                self.joining = False
        elif self.pool is not None and not drain:
            rnd.future = self.pool.submit(pl.gather, rnd.msgs)
        else:
            x0 = time.perf_counter()
            rnd.received = pl.gather(rnd.msgs)
            rnd.wait_s = time.perf_counter() - x0
        return rnd

    def eager_start(self, rnd: _Round, shares: dict[int, float]) -> None:
        """Until round ``rnd``'s aggregate arrives: the eager start (:mod:`geomesh.eager`),
        after the send so that it overlaps the exchange."""
        for i, w_i in shares.items():  # D(msg_i), as the others decode it
            own, _ = self.codec.aggregate([rnd.msgs[i]], senders=[i], **self.pred)
            start = self.eager.start(self.outer, own, w_i, corrected=bool(self.local_mom))
            self.workers[i].trainer.set_params(start)
            self.snapshots[i] = {k: v.cpu() for k, v in start.items()}

    @property
    def target_reached(self) -> bool:
        """``train.stop_at_target`` and this job's evaluations reached ``train.target_ppl``."""
        return self.cfg.train.stop_at_target and self.stats.reached_here

    def stop_agreed(self, step: int) -> bool:
        """One job per region: whether this round's messages carry a region's stop flag
        (module docstring), the same verdict in every region; ``False`` otherwise."""
        by = self.pl.stop_requests if self.ft is not None and self.cfg.train.stop_at_target \
            else []
        if by and self.pl.is_logging_rank:
            log.info("outer step %d: %s reached train.target_ppl; every region stops after "
                     "this round (train.stop_at_target)", step,
                     ", ".join(repr(self.cl.workers[k].region) for k in by))
        return bool(by)

    def finish(self, rnd: _Round) -> bool:
        """Check and aggregate round ``rnd``, take the outer step, record, re-plan,
        checkpoint.  Returns whether the run should stop (``stop_at_target``: the target
        reached by this job's evaluation, or with one job per region by any region's,
        flagged in this round's messages: :meth:`stop_agreed`)."""
        step = rnd.r + 1
        received, per = self.receive(rnd)
        tokens = self.aggregate(rnd, received)
        present, counted, losses, nbytes = self.figures(rnd, per)
        agreed = self.stop_agreed(step)
        if self.ft is not None and (agreed or step == self.g.outer_steps):
            self.ft.stop_watching()  # no exchange follows: a peer that ends first is not lost
        record = self.record(rnd, per, tokens, present, counted, losses, nbytes, final=agreed)
        self.replan(record, per, counted, rnd.steps)
        self.ctx.log_outer_step(record)
        if self.stats.diverged_at_step is not None:  # θ_global's validation: nothing saved
            raise _Diverged
        # one job per region never stops on its own evaluation: the others would lose it
        reached = agreed if self.ft is not None else self.target_reached
        if self.save_round(step) or reached:
            save_state(self.ctx.run_dir / "checkpoints", step, checkpoint_state(self, step),
                       rank=self.pl.rank, job_leader=self.pl.is_logging_rank,
                       keep_last=self.cfg.checkpoint.keep_last)
        if not reached:
            self.follow_members(step)
        return reached

    def receive(self, rnd: _Round) -> tuple[list, dict[str, dict]]:
        """The round's messages (waited for, and shared with this worker's ranks);
        overlapped emulated rounds: each worker's idle while it waits for them."""
        per: dict[str, dict] = {}
        if self.ctx.emulated:
            if self.overlap is not None:  # each worker waits for the messages now
                for k, w in enumerate(self.cl.workers):
                    strag, wan = self.clock.wait(w.name)
                    per[w.name] = dict(compute_s=rnd.compute[k], straggler_idle_s=strag,
                                       wan_idle_s=wan, sent_bytes=self.charged)
            return rnd.received, per
        if rnd.shared:
            return rnd.received, per
        x0 = time.perf_counter()
        received = self.pl.share(rnd.future.result() if rnd.future is not None else rnd.received)
        rnd.wait_s += time.perf_counter() - x0
        return received, per

    def refuse_other_start(self, r: int) -> None:
        """Stop the job where round ``r`` is its first and a peer's message is of another
        run or another round.  Another run: the regions were started with other
        settings (model, recipe, tokenizer, GeoMesh settings, cluster file, batch:
        :mod:`geomesh.exchange.run_identity`), and each would drop the others and train
        alone to a different model.  Another round: the regions started from
        checkpoints of different outer steps (:mod:`geomesh.launch_resume`).  Later
        in the run, a peer of another run is a lost worker of the round
        (``geomesh.on_worker_loss`` decides, on every rank of the job), and an older
        round's message is a replay, dropped by the guard.

        Raises:
            ConfigError: another run, naming the peers, the parts that differ and the fix.
            CheckpointError: another round, naming the peers and the fix (exit 2 both).
        """
        name = self.ctx.cluster.workers
        other_run = self.ft.other_run if self.ft is not None else {}
        if other_run and r != self.start:  # lost for this round (on_worker_loss decides)
            self.ft.lost(r, sorted(other_run), {
                k: f"message sealed for another run (settings differ: {', '.join(ps)})"
                for k, ps in other_run.items()})
        if r != self.start:
            return
        if other_run:
            parts = sorted({p for ps in other_run.values() for p in ps})
            hint = (" (the tokenizer differs: copy one region's tokenizer file from its run "
                    "folder to the others and set data.tokenizer=FILE)"
                    if "tokenizer" in parts else "")
            peers = [repr(name[k].region) for k in sorted(other_run)]
            raise ConfigError(
                f"{', '.join(peers)} {'runs' if len(peers) == 1 else 'run'} with other settings "
                f"than this region (part(s) that differ: {', '.join(parts)}){hint}.  Every region "
                "must be started with the same model, train, data, geomesh settings, cluster "
                "file and parallel.global_batch_size (geomesh.exchange.run_identity lists "
                "them); compare the regions' config.yaml and start them with the same "
                "overrides")
        other = [k for k, why in self.guard.last_rejected.items() if why == "round"]
        if other:
            raise CheckpointError(
                f"{', '.join(repr(name[k].region) for k in sorted(other))} sent messages of "
                f"another round in this job's first round ({r}): the regions started from "
                "checkpoints of different outer steps; resume all from one (launch_local "
                "--resume takes the newest that all saved)")

    def aggregate(self, rnd: _Round, received: list) -> list[int]:
        """Guard, decode and aggregate ``Δ`` on this rank's shards, take the outer step;
        returns each worker's accepted tokens (0: absent or rejected)."""
        rsteps, lr = rnd.steps, self.lr_scales
        if self.ft is not None:  # a worker that joined healed its schedule to the others'
            for i in self.members:
                lr.done[i] = max(lr.done[i], schedule_position(
                    self.schedules[i][0], rsteps[i].inner_steps, rnd.r, self.schedule_rounds))
        self.guard.expect({i: rsteps[i].samples * self.cfg.model.seq_length
                           for i in range(self.K)},
                          {i: lr.round(i, rsteps[i]) for i in range(self.K)})
        agg, tokens = self.codec.aggregate(received, guard=self.guard, round=rnd.r, **self.pred)
        self.refuse_other_start(rnd.r)
        for i in self.members:  # the round's workers trained its inner steps
            lr.advance(i, rsteps[i])
        if self.ft is not None and self.guard.last_rejected:  # like lost workers
            self.ft.lost(rnd.r, sorted(self.guard.last_rejected), "message rejected by the checks")
        if agg is not None:
            if self.eager is not None:
                self.eager.remember(agg)
            if self.local_mom:
                self.outer.apply_update(agg)
            else:
                self.outer.step(agg)
        if self.overhead is None and rnd.msgs:  # every outer buffer exists after the first step
            i0 = self.pl.workers[0]
            self.overhead = memory_overhead(
                self.theta,
                self.local_mom[i0].buffers if self.local_mom else self.outer.momentum_buffer,
                [fb.residuals for fb in self.feedback.values()],
                [len(rnd.msgs[i]) for i in self.pl.workers],
                target_params=self.ctx.target_schema.numel if self.ctx.emulated else None,
                snapshots=list(self.snapshots.values()),
                eager_bytes=self.eager.nbytes() if self.eager is not None else 0)
        return tokens

    def replan(self, record: dict, per: dict[str, dict], counted: list[int],
               rsteps: list[ProxyStep]) -> None:
        """GeoMesh: re-plan on drift of the measured seconds per inner step.

        Emulated measurements are exact: the last one is used.  Wall-clock ones
        are noisy: real mode re-plans after the first round measured since the
        plan last changed and then averages the last two (the planner's
        hysteresis, :meth:`Planner.replan <geomesh.fleet.planner.Planner.replan>`,
        absorbs the rest).  Overlapped rounds: a new plan starts with the round
        after the one already under way.
        """
        cl, g, step = self.cl, self.g, record["step"]
        for k in counted:
            self.history.setdefault(cl.workers[k].name, []).append(
                per[cl.workers[k].name]["compute_s"] / rsteps[k].target.inner_steps)
        window = 1 if self.ctx.emulated else 2
        full = len(self.members) == self.K and len(counted) == self.K  # everyone measured
        if not (self.geomesh and g.replan and full and step < g.outer_steps and self.history):
            return
        measured = {n: sum(v[-window:]) / len(v[-window:]) for n, v in self.history.items()}
        new = self.ctx.planner.replan(measured)
        if new is not self.plan:
            self.plan, self.next_steps = new, _proxy(self.ctx, new)
            self.replans, self.history = self.replans + 1, {}
            record["replanned"] = True
            log.info("outer step %d: re-planned b_i=%s H_i=%s", step,
                     [s.target.batch_size for s in self.next_steps],
                     [s.target.inner_steps for s in self.next_steps])

    def follow_members(self, step: int) -> None:
        """One job per region: re-plan for the next round's workers (lost or joined).
        GeoMesh balances the present workers; a uniform method (DiLoCo) keeps every
        worker's share ``G/K`` (it took GeoMesh's balanced plan after a loss)."""
        if self.ft is None or self.members == self.ft.members:
            return
        self.members = list(self.ft.members)
        if not self.geomesh:
            log.info("outer step %d: %d worker(s), each at its uniform share", step,
                     len(self.members))
            return
        self.plan = plan_for_members(self.ctx.planner, self.plan,
                                     [self.cl.workers[k].name for k in self.members])
        self.next_steps, self.history = _proxy(self.ctx, self.plan), {}
        log.info("outer step %d: %d worker(s), re-planned b_i=%s H_i=%s", step, len(self.members),
                 [self.next_steps[k].target.batch_size for k in self.members],
                 [self.next_steps[k].target.inner_steps for k in self.members])



def run_sync(ctx: RunContext) -> dict:
    """Train ``geomesh.outer_steps`` rounds (:class:`OuterLoop`); return the summary."""
    return OuterLoop(ctx).run()
