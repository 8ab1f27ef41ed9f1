"""The synchronous outer loop: GeoMesh and DiLoCo, emulated or real.

Per round ``r`` (Douillard et al. 2023, "DiLoCo", Alg. 1, with GeoMesh's
balancing and compression):

1. every worker ``i`` sets ``θ_i ← θ_global`` and runs ``H_i`` inner AdamW
   steps of ``b_i`` sequences (:class:`geomesh.worker.InnerWorker`);
2. ``Δ_i = θ_global − θ_i`` (fp32) is encoded in canonical form, whatever the
   worker's TP/PP/DP layout (:class:`geomesh.canonical_codec.CanonicalCodec`) —
   GeoMesh: ``geomesh.compression`` (top-k, or sign bits + an fp32 scale per
   global row), error feedback optional; DiLoCo: fp32 — with the worker's token
   count ``n_i``; a worker's ranks join their parts into its message
   (:meth:`geomesh.deploy.Placement.collect`);
3. the messages are all-gathered (:mod:`geomesh.transport`, or the region
   leaders' torchft exchange, :mod:`geomesh.region`); every rank decodes the
   part of each message that overlaps its own shard and aggregates,
   ``Δ = Σ (n_i/N) D(msg_i)``;
4. the outer Nesterov step updates ``θ_global`` (:class:`geomesh.outer.OuterNesterov`);
   every worker applies it to the same messages, so all copies stay equal.

GeoMesh plans ``b_i, H_i`` with :class:`geomesh.planner.Planner` so that all
workers finish their compute together, and re-plans when measured step times
drift (real: wall-clock per inner step; emulated: the injected
``slowdown`` of the cluster file).  Every plan keeps the round's tokens within
the planner's tolerance of ``T`` (a constraint, :mod:`geomesh.planner`), and each
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
charges the wait at step ``τ_i`` (:class:`geomesh.clock.EmulatedClock`).

Measured choices (emulated four-region cluster, GPT-3 1.3B target, tiny_gpt
proxy at sequence 64, ``G_p = 16``, ``H = 8``, validation perplexity after 12
outer steps = 98k tokens, all at the same plan; ``bench/geomesh_ttp.py
--quick``; the README's ablation table has the final numbers):

* one scale per *tensor* diverged at outer lr 0.7 (embedding rows of tokens
  unseen in a round received the magnitude of the seen rows); one scale per
  *row* (``sign_row``, 31.6x instead of 32.0x on the target) fixed it;
* error feedback: see :mod:`geomesh.feedback` for why it seemed to give
  nothing (the plan changed with it) and where the residual goes;
* balancing by steps beat balancing by batch (784 vs 819 without the
  momentum ramp); ramping the outer momentum in removed a loss spike around
  round 4 (GeoMesh 819 → 671, DiLoCo 895 → 765);
* overlap: the exchange (0.4-1.3 s) needs only the fewest steps that cover
  it: ``f = 0.1`` gives ``τ_i`` = 3, 1, 1, 1 on the four-region plan (the
  H100's step takes 0.5 s, the others' ≥ 1.3 s); with the eager update of
  :mod:`geomesh.eager` at outer lr 0.5 it ends at 497.9 vs 500.2 blocking,
  the target at 66.3 vs 68.0 s, sync share 0.97 %; ``f = 0.25`` (``τ_i`` =
  7, 3, 1, 1) runs more steps from the estimate than the exchange needs
  (542.4).  The previous eager start (the worker's own dense ``Δ_i`` alone)
  cost +8.7 % on the 100-round run (README).

Time.  Emulated: worker ``i``'s compute is the GPU-profile time of its plan on
the target model (:func:`geomesh.clock.inner_step_time_s`) times any injected
slowdown, charged to an :class:`~geomesh.clock.EmulatedClock`; the exchange is
charged with the target model's message size.  Real: wall-clock; a worker's
straggler idle is ``max_j compute_j − compute_i`` and its WAN idle the rest
of its time in the exchange.

Every round's messages pass :class:`geomesh.guard.Guard` before aggregation
(every codec: ``codec.aggregate(received, guard=guard)``); a rejected message
drops its worker from the round.  One job per region (``geomesh.region``):
each round's exchange is a torchft quorum (:mod:`geomesh.membership`), lost
workers drop out (the plan is redone for the members left,
:mod:`geomesh.membership_plan`), a joining worker heals from a live peer at a
round boundary.  Those rounds are blocking: ``geomesh.overlap`` with
``geomesh.region`` is refused (:func:`geomesh.context._validate`).
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
from jobruntime.faults import fault_point
from jobruntime.metrics import perplexity

from .canonical import CanonicalSchema, canonical_digest, layout_map, main_pieces
from .canonical_codec import CanonicalCodec
from .clock import EmulatedClock, inner_step_time_s
from .compression import ErrorFeedback
from .context import RunContext, target_canonical_schema
from .eager import EagerStart
from .feedback import LocalMomentum
from .guard import Guard
from .membership_plan import plan_for_members, plan_from_dict
from .outer import OuterNesterov
from .planner import Plan
from .region import RegionMembership
from .report import RunStats, memory_overhead
from .state import check_workers, load_state, save_state, worker_identity
from .transport import InProcessTransport
from .worker import InnerWorker, LrScale, ProxyStep, follow_replan, proxy_steps

log = logging.getLogger(__name__)


def _true_step_s(ctx: RunContext, k: int, step: ProxyStep, round_: int) -> float:
    """Emulated physics: profile time of one inner step on the target, times the slowdown."""
    w = ctx.cluster.workers[k]
    t = inner_step_time_s(w, ctx.target.model, step.target.micro_batch_size,
                          step.target.grad_accum, seq_length=step.target.seq_length)
    return t * ctx.cluster.slowdown_factor(w.name, round_)


def _proxy(ctx: RunContext, plan: Plan) -> list[ProxyStep]:
    return proxy_steps(plan, ctx.scale, round_samples=ctx.round_samples,
                       dp_in=ctx.placement.dp_in, max_micro_batch=ctx.cfg.parallel.micro_batch_size)


def _weights_digest(pl, layout, schema: CanonicalSchema, theta: dict) -> str | None:
    """SHA-256 of ``θ_global`` in canonical form (:func:`geomesh.canonical.canonical_digest`):
    the same in every region after the same round, whatever their layouts.  The
    worker's main shards are gathered to its leader (``None`` on the other ranks)."""
    mine = [(k, o, t.cpu()) for k, o, t in main_pieces(layout, theta)] if pl.dp_in_rank == 0 else []
    if pl.worker_group is None or dist.get_world_size(pl.worker_group) == 1:
        return canonical_digest(schema, mine)
    lead = dist.get_rank() == pl.leader_rank
    parts: list | None = [None] * dist.get_world_size(pl.worker_group) if lead else None
    dist.gather_object(mine, parts, dst=pl.leader_rank, group=pl.worker_group)
    return canonical_digest(schema, [x for part in parts for x in part]) if lead else None


def _wire_bytes(pl, transport) -> dict:
    """This job's exchange bytes as its transport counted them (emulated: the proxy's
    real messages, not the target's charged bytes): ``bytes_sent``, ``bytes_received``."""
    counter = (transport or pl.transport or pl.ft_leader)
    wire = getattr(counter, "wire", None)
    return {"bytes_sent": wire.sent, "bytes_received": wire.received} if wire is not None else {}


def _codec_kind(ctx: RunContext) -> str:
    """GeoMesh's codec for the whole run (every region reads the same config and
    cluster file, so all choose alike): ``geomesh.compression``, except that top-k
    falls back to ``sign_row`` in real mode when a TP worker would split a row
    inside a 256-column chunk (:meth:`CanonicalCodec._topk_shard
    <geomesh.canonical_codec.CanonicalCodec._topk_shard>`)."""
    kind = ctx.cfg.geomesh.compression
    tp = max(w.tp for w in ctx.cluster.workers)
    m = ctx.cfg.model
    widths = (m.hidden_size // tp, m.ffn // tp)
    if kind == "topk" and not ctx.emulated and tp > 1 and any(w % 256 for w in widths):
        log.warning("geomesh.compression=topk: a TP=%d worker splits rows of %s columns "
                    "inside 256-column chunks; this run uses sign_row", tp, list(widths))
        return "sign_row"
    return kind


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


def run_sync(ctx: RunContext) -> dict:
    """Train ``geomesh.outer_steps`` rounds; return the summary (also written to disk)."""
    cfg, g, cl, pl = ctx.cfg, ctx.cfg.geomesh, ctx.cluster, ctx.placement
    geomesh = ctx.method == "geomesh"
    K = len(cl.workers)
    plan = ctx.planner.plan() if geomesh else ctx.planner.uniform(ctx.uniform_batch)
    steps = _proxy(ctx, plan)
    # each worker's LR schedule: its own length, warmup scaled by H_i / H; a re-plan
    # resizes the rest of it (follow_replan), a resume and a heal restore it
    schedules = [(g.outer_steps * s.inner_steps,
                  round(cfg.train.warmup_iters * s.inner_steps / g.inner_steps)) for s in steps]
    workers: dict[int, InnerWorker] = {}
    for i in pl.workers:
        workers[i] = InnerWorker(ctx.layout_cfg, i, ctx.train_ds, inner_iters=schedules[i][0],
                                 warmup_iters=schedules[i][1], reference_batch=ctx.reference_batch,
                                 dp_group=pl.dp_group, dp_in=pl.dp_in,
                                 dp_in_rank=pl.dp_in_rank)
    lr_scales = LrScale(ctx.layout_cfg, schedules, ctx.reference_batch, g.inner_lr_scaling)
    first = workers[pl.workers[0]]
    theta = first.trainer.get_params()  # θ_global, fp32, this rank's shard
    layout = layout_map(first.trainer.module)  # this rank's shards in canonical coordinates
    cschema = CanonicalSchema.gather(layout, pl.mp_group)
    kind = _codec_kind(ctx) if geomesh else "fp32"
    predictive = kind == "sign_pred"  # the outer momentum predicts Δ_i
    codec = CanonicalCodec(kind, layout, cschema, tp_group=pl.tp_group, mp_group=pl.mp_group,
                           k=g.topk_k, bits=g.topk_bits)
    lossy = codec.kind != "fp32"
    canon_numel = sum(math.prod(shape) for _, shape in cschema.entries)
    outer = OuterNesterov(theta, lr=g.outer_lr, momentum=g.outer_momentum,
                          momentum_warmup=g.outer_momentum_warmup)
    pred = {"predictor": outer.momentum_buffer} if predictive else {}
    feedback = ({i: ErrorFeedback(g.error_feedback_decay) for i in pl.workers}
                if lossy and g.error_feedback else {})
    # compress_update: each worker's own momentum, the workers send Δ_i + μ v_i (feedback.py)
    local_mom = {i: LocalMomentum() for i in pl.workers} if geomesh and g.compress_update else {}
    overlap = g.overlap if geomesh else None  # the baselines never overlap
    guard = Guard.from_config(g, cl)  # checks every message before aggregation
    if pl.per_region:  # the region's ranks follow its leader's torchft membership
        pl.membership = RegionMembership(pl.ft_leader, layout, contributes=pl.dp_in_rank == 0,
                                         cluster=cl, worker=pl.workers[0],
                                         policy=g.on_worker_loss)
    ft = pl.membership  # one job per region: torchft quorum, healing (geomesh.membership)
    if ft is not None and overlap is not None:  # _validate refuses it; a guard for direct callers
        raise ValueError("geomesh.overlap does not combine with one job per region")
    clock = transport = None
    if ctx.emulated:
        clock = EmulatedClock(cl, overlap=overlap is not None)
        charged = codec.message_bytes(target_canonical_schema(ctx.target))
        transport = InProcessTransport(cl, clock=clock, charged_bytes=charged)
    pool = ThreadPoolExecutor(1) if overlap is not None and not ctx.emulated else None
    eager = EagerStart() if overlap is not None else None  # host: the last aggregate
    val = ctx.val_batches(dp=pl.dp_in, dp_rank=pl.dp_in_rank)
    stats = RunStats.for_cluster(cl, cfg.train.target_ppl)
    position, start, replans = 0, 0, 0
    history: dict[str, list[float]] = {}  # measured seconds per inner step since the last plan
    if cfg.checkpoint.load:
        st = load_state(cfg.checkpoint.load, rank=pl.rank)
        if st["method"] != ctx.method:
            raise CheckpointError(f"checkpoint is from method {st['method']}, not {ctx.method}; "
                                  f"resume it with geomesh.method={st['method']}")
        check_workers(st, cl)  # before any per-worker state is matched by position
        if set(st["workers"]) != set(workers) or set(st["feedback"]) != set(feedback) or \
                set(st.get("local_momentum", {})) != set(local_mom):
            raise CheckpointError(
                f"checkpoint holds workers {sorted(st['workers'])} with error feedback "
                f"{'on' if st['feedback'] else 'off'} and compress_update "
                f"{'on' if st.get('local_momentum') else 'off'}; this run has workers "
                f"{sorted(workers)} with them {'on' if feedback else 'off'} and "
                f"{'on' if local_mom else 'off'}: resume with the cluster file, "
                "geomesh.error_feedback and geomesh.compress_update it was saved with"
            )
        if st["round"] >= g.outer_steps:
            raise CheckpointError(
                f"checkpoint is at outer step {st['round']}, geomesh.outer_steps={g.outer_steps}: "
                "nothing left to run; raise geomesh.outer_steps"
            )
        outer.load_state_dict(st["outer"])  # copies into theta
        for i, fb in feedback.items():
            fb.load_state_dict(st["feedback"][i])
        for i, lm in local_mom.items():
            lm.load_state_dict(st["local_momentum"][i])
        if "schedules" in st:  # the schedules as re-plans resized them, a pending one included
            schedules = [(int(n), int(w)) for n, w in st["schedules"]]
            lr_scales.set_schedules(schedules)
        for i, w in workers.items():
            w.load_state_dict(st["workers"][i])  # megatron takes the saved scheduler's lengths:
            w.set_schedule(*schedules[i])  # a re-plan pending at the save is not in them
        ctx.planner.speed = dict(st["planner_speed"])
        ctx.planner.fit.load_state_dict(st.get("planner_fit", {}))
        ctx.planner.current = plan = st["plan"]
        steps = _proxy(ctx, plan)
        if clock is not None:
            clock.load_state_dict(st["clock"])
        stats.load_state_dict(st["stats"])
        position, start, replans = st["position"], st["round"], st["replans"]
        history = st["history"]
        guard.load_state_dict(st.get("guard", {}))
        if eager is not None and st.get("eager") is not None:
            eager.load_state_dict(st["eager"])
        if "lr_scale" in st:
            lr_scales.load_state_dict(st["lr_scale"])
        else:  # saved before it existed: the same position on every rank
            lr_scales.done = [start * s.inner_steps for s in steps]
        torch.set_rng_state(st["rng"])
        log.info("resumed %s at outer step %d", ctx.method, start)
    t0 = time.perf_counter() - stats.time_s
    wall0 = time.perf_counter()
    overhead = None
    snapshots: dict[int, dict[str, torch.Tensor]] = {}  # overlap: weights whose Δ_i was sent
    next_steps: list[ProxyStep] | None = None  # overlap: a re-plan for the next round

    r, joining, members = start, False, list(range(K))

    def saved_schedules(rnd: int) -> list[list[int]]:
        """The LR schedules that go with the saved ``plan``: a re-plan not yet
        adopted (it starts at round ``rnd``) is followed here, as adopt() will."""
        if next_steps is None:
            return [list(x) for x in schedules]
        return [list(x) for x in follow_replan(schedules, steps, next_steps, rnd, g.outer_steps)]
    if ft is not None:
        def save_heal() -> dict:
            return {"round": r, "position": position, "replans": replans, "members": members,
                    "plan": plan.to_dict(), "speed": dict(ctx.planner.speed),
                    "fit": ctx.planner.fit.state_dict(),
                    "schedules": saved_schedules(r),
                    "outer": outer.state_dict(), "guard": guard.state_dict(),
                    "lr_scale": lr_scales.state_dict()}

        def load_heal(st: dict) -> None:
            nonlocal r, position, replans, plan, steps, next_steps, history, members, schedules
            r, position, replans = int(st["round"]), int(st["position"]), int(st["replans"])
            if "schedules" in st:
                schedules = [(int(n), int(w)) for n, w in st["schedules"]]
                lr_scales.set_schedules(schedules)
                for w in workers.values():
                    w.set_schedule(*schedules[w.index])
            members = [int(k) for k in st["members"]]
            outer.load_state_dict(st["outer"])
            guard.load_state_dict(st["guard"])
            lr_scales.load_state_dict(st.get("lr_scale", {"done": [r * s.inner_steps for s in steps]}))
            ctx.planner.speed = {k: float(v) for k, v in st["speed"].items()}
            ctx.planner.fit.load_state_dict(st.get("fit", {}))
            plan = plan_from_dict(st["plan"], ctx.planner.tolerance)
            steps, next_steps, history = _proxy(ctx, plan), None, {}
            for w in workers.values():  # the inner LR schedule where the others' is
                w.trainer.scheduler.step(increment=max(r * steps[w.index].inner_steps
                                                       - w.trainer.step, 0))
                w.trainer.step = max(w.trainer.step, r * steps[w.index].inner_steps)
            log.info("healed from a live peer: round %d", r)

        ft.set_state_fns(save_heal, load_heal)
        joining = ft.join(start)
        if not joining:  # else the healed state says who trained this round
            members = list(ft.members)

    def finish(rnd: _Round) -> bool:
        """Check and aggregate round ``rnd``, take the outer step, record, re-plan,
        checkpoint.  Returns whether the run should stop (target reached with
        ``stop_at_target``)."""
        nonlocal plan, next_steps, replans, history, overhead, members
        step, rsteps = rnd.r + 1, rnd.steps
        per: dict[str, dict] = {}
        if ctx.emulated:
            received = rnd.received
            if overlap is not None:  # each worker waits for the messages now
                for k, w in enumerate(cl.workers):
                    strag, wan = clock.wait(w.name)
                    per[w.name] = dict(compute_s=rnd.compute[k], straggler_idle_s=strag,
                                       wan_idle_s=wan, sent_bytes=charged)
        elif rnd.shared:
            received = rnd.received
        else:
            x0 = time.perf_counter()
            received = pl.share(rnd.future.result() if rnd.future is not None else rnd.received)
            rnd.wait_s += time.perf_counter() - x0
        if ft is not None:  # a worker that joined healed its schedule to at least r·H_i
            for i in members:
                lr_scales.done[i] = max(lr_scales.done[i], rnd.r * rsteps[i].inner_steps)
        guard.expect({i: rsteps[i].samples * cfg.model.seq_length for i in range(K)},
                     {i: lr_scales.round(i, rsteps[i]) for i in range(K)})
        agg, tokens = codec.aggregate(received, guard=guard, round=rnd.r, **pred)
        for i in members:  # the round's workers trained its inner steps
            lr_scales.advance(i, rsteps[i])
        if ft is not None and guard.last_rejected:  # like lost workers (fail: stop, named)
            ft.lost(rnd.r, sorted(guard.last_rejected), "message rejected by the checks")
        if agg is not None:
            if eager is not None:
                eager.remember(agg)
            if local_mom:
                outer.apply_update(agg)
            else:
                outer.step(agg)
        if overhead is None and rnd.msgs:  # every outer buffer exists after the first step
            i0 = pl.workers[0]
            overhead = memory_overhead(
                theta, local_mom[i0].buffers if local_mom else outer.momentum_buffer,
                [fb.residuals for fb in feedback.values()],
                [len(rnd.msgs[i]) for i in pl.workers],
                target_params=ctx.target_schema.numel if ctx.emulated else None,
                snapshots=[s for s in snapshots.values()],
                eager_bytes=eager.nbytes() if eager is not None else 0)
        if ctx.emulated:
            if overlap is None:
                for w in cl.workers:
                    t = transport.last_schedule.workers[w.name]
                    per[w.name] = dict(compute_s=t.compute_s, straggler_idle_s=t.straggler_idle_s,
                                       wan_idle_s=t.wan_idle_s, sent_bytes=t.sent_bytes)
            losses = {i: rnd.losses[i] for i in rnd.losses}
            present = counted = list(range(K))
            round_bytes = charged * K
            round_fp32 = 4 * ctx.target_schema.numel * K
            stats.time_s = clock.last_exchange_end_s  # when θ_global of this round exists
        else:
            me = pl.workers[0]
            sent = len(rnd.msgs[me]) if pl.transport is not None and me in rnd.msgs else 0
            rows = pl.gather_rows([me, rnd.losses.get(me, 0.0), rnd.compute.get(me, 0.0),
                                   rnd.wait_s, sent, 4 * canon_numel if sent else 0],
                                  4 * canon_numel)
            present = sorted({int(x[0]) for x in rows})
            compute = {k: max(x[2] for x in rows if int(x[0]) == k) for k in present}
            # the loss and compute seconds a worker reports steer the log, the idle
            # statistics and re-planning: out-of-bounds ones are left out (Guard.screen_figures)
            counted = guard.screen_figures(
                present, [next(x[1] for x in rows if int(x[0]) == k) for k in present],
                [compute[k] for k in present])
            slowest = max((compute[k] for k in counted), default=0.0)
            losses = {}
            for k in counted:
                w = cl.workers[k]
                mine = [x for x in rows if int(x[0]) == k]
                waited = max(x[3] for x in mine)
                straggler = slowest - compute[k]
                if overlap is not None:  # only the waiting after compute is idle
                    straggler = min(straggler, waited)
                losses[k] = mine[0][1]
                per[w.name] = dict(compute_s=compute[k], straggler_idle_s=straggler,
                                   wan_idle_s=max(waited - straggler, 0.0),
                                   sent_bytes=int(sum(x[4] for x in mine)))
            round_bytes = int(sum(x[4] for x in rows))
            round_fp32 = int(sum(x[5] for x in rows))
            stats.time_s = time.perf_counter() - t0
        for k in counted:
            stats.add_worker(cl.workers[k].name, tokens=tokens[k], **per[cl.workers[k].name])
        ntok = sum(tokens)
        weighed = sum(tokens[k] for k in losses)
        # token-weighted over the accepted figures; with none, this job's own (local) loss
        loss = sum(tokens[k] * losses[k] for k in losses) / weighed if weighed else \
            sum(rnd.losses.values()) / max(len(rnd.losses), 1)
        stats.tokens += ntok
        stats.outer_steps = step
        stats.bytes_total += round_bytes
        stats.fp32_bytes_total += round_fp32
        times = [per[cl.workers[k].name]["compute_s"] for k in counted] or [0.0]
        record = dict(
            step=step, tokens=stats.tokens, time_s=stats.time_s, loss=loss,
            compute_s=max(times), imbalance=(max(times) - min(times)) / max(max(times), 1e-12),
            straggler_idle_s=sum(p["straggler_idle_s"] for p in per.values()),
            wan_idle_s=sum(p["wan_idle_s"] for p in per.values()), bytes=round_bytes,
            batch_sizes=[s.batch_size for s in rsteps],
            target_batch_sizes=[s.target.batch_size for s in rsteps],
            inner_steps=[s.target.inner_steps for s in rsteps],
            proxy_samples=[s.samples for s in rsteps],
        )
        if len(present) < K or guard.last_rejected:
            record["workers_present"] = [cl.workers[k].name for k in present
                                         if k not in guard.last_rejected]
        if ctx.is_eval_step(step):
            keep = first.trainer.get_params() if overlap is not None else None
            first.trainer.set_params(theta)
            first.trainer.set_batch_size(cfg.parallel.global_batch_size,
                                         cfg.parallel.micro_batch_size)
            val_loss = first.trainer.evaluate(val)
            if keep is not None:  # overlapped rounds continue from the local weights
                first.trainer.set_params(keep)
            record.update(val_loss=val_loss, val_ppl=perplexity(val_loss))
            if stats.evaluated(val_loss, record["val_ppl"], step):
                log.info("target perplexity %s reached at outer step %d (%.1f s, %s clock)",
                         cfg.train.target_ppl, step, stats.time_s, ctx.clock_name)
        # -- re-plan on drift (GeoMesh) ------------------------------------------
        # Emulated measurements are exact: the last one is used.  Wall-clock
        # ones are noisy: real mode re-plans after the first round measured since
        # the plan last changed and then averages the last two (the planner's
        # hysteresis, Planner.replan, absorbs the rest).  Overlapped rounds: a new
        # plan starts with the round after the one already under way.
        for k in counted:
            history.setdefault(cl.workers[k].name, []).append(
                per[cl.workers[k].name]["compute_s"] / rsteps[k].target.inner_steps)
        window = 1 if ctx.emulated else 2
        full = len(members) == K and len(counted) == K  # drift re-plans need everyone measured
        if geomesh and g.replan and full and step < g.outer_steps and history and \
                min(len(v) for v in history.values()) >= 1:
            measured = {n: sum(v[-window:]) / len(v[-window:]) for n, v in history.items()}
            new = ctx.planner.replan(measured)
            if new is not plan:
                plan, next_steps, replans, history = new, _proxy(ctx, new), replans + 1, {}
                record["replanned"] = True
                log.info("outer step %d: re-planned b_i=%s H_i=%s", step,
                         [s.target.batch_size for s in next_steps],
                         [s.target.inner_steps for s in next_steps])
        ctx.log_outer_step(record)
        reached_stop = cfg.train.stop_at_target and stats.ttp.reached
        if save_round(step) or reached_stop:
            state = {
                "method": ctx.method, "round": step, "position": position, "replans": replans,
                "cluster": worker_identity(cl), "outer": outer.state_dict(),
                "feedback": {i: fb.state_dict() for i, fb in feedback.items()},
                "local_momentum": {i: m.state_dict() for i, m in local_mom.items()},
                "workers": {i: w.state_dict() for i, w in workers.items()},
                "planner_speed": dict(ctx.planner.speed), "planner_fit": ctx.planner.fit.state_dict(),
                "plan": plan,
                "clock": clock.state_dict() if clock is not None else None,
                "stats": stats.state_dict(), "rng": torch.get_rng_state(), "history": history,
                "guard": guard.state_dict(), "lr_scale": lr_scales.state_dict(),
                "eager": eager.state_dict() if eager is not None else None,
                "schedules": saved_schedules(step),
            }
            save_state(ctx.run_dir / "checkpoints", step, state, rank=pl.rank,
                       job_leader=pl.is_logging_rank, keep_last=cfg.checkpoint.keep_last)
        if not reached_stop and ft is not None and members != ft.members:
            # re-plan for the next round's workers (lost or joined)
            members = list(ft.members)
            plan = plan_for_members(ctx.planner, plan, [cl.workers[k].name for k in members])
            next_steps, history = _proxy(ctx, plan), {}
            log.info("outer step %d: %d worker(s), re-planned b_i=%s H_i=%s", step, len(members),
                     [next_steps[k].target.batch_size for k in members],
                     [next_steps[k].target.inner_steps for k in members])
        return reached_stop

    def save_round(step: int) -> bool:
        every = cfg.checkpoint.save_interval
        return bool(every) and (step % every == 0 or step == g.outer_steps)

    def charge(k: int, rnd: _Round, seconds: float, wall0: float) -> None:
        """Compute time of worker ``k``: emulated profile seconds, or wall seconds
        since ``wall0`` (with an injected slowdown slept off)."""
        name = cl.workers[k].name
        if ctx.emulated:
            clock.compute(name, seconds)
        else:
            wall = time.perf_counter() - wall0
            factor = cl.slowdown_factor(name, rnd.r)
            if factor != 1.0:  # injected slowdown: sleep the extra time
                time.sleep((factor - 1.0) * wall)
            seconds = wall * factor
        rnd.compute[k] = rnd.compute.get(k, 0.0) + seconds

    def adopt(new: list[ProxyStep], rnd: int) -> list[ProxyStep]:
        """A new plan's steps from round ``rnd`` on; every LR schedule follows it."""
        nonlocal schedules
        schedules = follow_replan(schedules, steps, new, rnd, g.outer_steps)
        lr_scales.set_schedules(schedules)
        for w in workers.values():
            w.set_schedule(*schedules[w.index])
        return new

    inflight: _Round | None = None
    stop = False
    while r < g.outer_steps:
        if next_steps is not None:  # a re-plan: from this round on
            steps, next_steps = adopt(next_steps, r), None
        rnd = _Round(r=r, steps=steps)
        # Overlapped: the first τ_i = ⌈overlap · H_i⌉ steps run while round r−1's messages travel.
        taus = {i: math.ceil(overlap * steps[i].inner_steps) if inflight is not None else 0
                for i in pl.workers}
        losses: dict[int, list] = {i: [] for i in pl.workers}  # StepResults of round r
        # each worker's place in the token stream: after the members before it
        offsets = [sum(steps[j].samples for j in members if j < i) for i in range(K + 1)]
        if any(taus.values()):
            for i in pl.workers:
                w0 = time.perf_counter()
                losses[i] = workers[i].train_steps(steps[i], position + offsets[i], 0, taus[i])
                frac = taus[i] / steps[i].inner_steps
                charge(i, rnd, _true_step_s(ctx, i, steps[i], r) * steps[i].target.inner_steps
                       * frac if ctx.emulated else 0.0, w0)
        if inflight is not None:
            stop = finish(inflight)
            inflight = None
            if next_steps is not None and not any(taus.values()):  # nothing of round r ran yet
                steps, next_steps = adopt(next_steps, r), None
                rnd.steps = steps
                offsets = [sum(steps[j].samples for j in members if j < i) for i in range(K + 1)]
            if stop:
                break
            for i in pl.workers:  # onto the new θ_global, keeping the progress since the snapshot
                workers[i].rebase(theta, snapshots[i])
        elif overlap is not None:
            for i in pl.workers:
                workers[i].trainer.set_params(theta)
        round_tokens = sum(steps[j].samples for j in members) * cfg.model.seq_length
        shares: dict[int, float] = {}  # each local worker's token share w_i of the round
        for i in ([] if joining else pl.workers):  # a joining worker heals instead of training
            w0 = time.perf_counter()
            s = steps[i]
            if overlap is None:
                res = workers[i].train_round(theta, s, position + offsets[i])
            else:
                losses[i] += workers[i].train_steps(s, position + offsets[i], taus[i], s.inner_steps)
                res = workers[i].result(theta, s, losses[i])
            fault_point("train", r)
            total = _true_step_s(ctx, i, s, r) * s.target.inner_steps if ctx.emulated else 0.0
            charge(i, rnd, total - rnd.compute.get(i, 0.0) if ctx.emulated else 0.0, w0)
            delta = local_mom[i].update(res.delta, outer.current_momentum) if local_mom \
                else res.delta
            part = codec.encode(delta, res.tokens, worker=i, round=r,
                                feedback=feedback.get(i), **pred)
            # the worker's message: its ranks' canonical parts (a DP replica's repeat DP rank 0's)
            rnd.msgs[i] = pl.collect(part if pl.dp_in_rank == 0 else None)
            rnd.losses[i] = res.loss
            shares[i] = res.tokens / round_tokens
        drain = overlap is None or r + 1 == g.outer_steps or save_round(r + 1)
        if ctx.emulated:
            rnd.received = transport.exchange(rnd.msgs)
        elif ft is not None:  # one job per region: torchft quorum, then the all-gather
            me = pl.workers[0]
            x0 = time.perf_counter()
            rnd.received = pl.exchange(rnd.msgs.get(me, b""), quorum_done=joining,
                                       stats=(rnd.losses[me], rnd.compute[me])
                                       if me in rnd.msgs else (0.0, 0.0))
            rnd.wait_s, rnd.shared = time.perf_counter() - x0, True
            if pl.healed or joining:  # sent nothing: the others' round r, from their state
                rnd = dataclasses.replace(rnd, r=r, steps=steps, msgs={}, losses={}, compute={})
                joining = False
        elif pool is not None and not drain:
            rnd.future = pool.submit(pl.gather, rnd.msgs)
        else:
            x0 = time.perf_counter()
            rnd.received = pl.gather(rnd.msgs)
            rnd.wait_s = time.perf_counter() - x0
        if not drain:  # until round r's aggregate arrives: the eager start (geomesh.eager),
            for i, w_i in shares.items():  # after the send so that it overlaps the exchange
                own, _ = codec.aggregate([rnd.msgs[i]], senders=[i], **pred)  # D(msg_i), as the others decode it
                start = eager.start(outer, own, w_i, corrected=bool(local_mom))
                workers[i].trainer.set_params(start)
                snapshots[i] = {k: v.cpu() for k, v in start.items()}
        # the token stream moves on by what the round's members trained (after a heal:
        # from the healed round's position, with its plan)
        position += sum(rnd.steps[j].samples for j in members)
        if drain:
            stop = finish(rnd)
            if stop:
                break
        else:
            inflight = rnd
        r += 1
    if inflight is not None and not stop:
        finish(inflight)
    if pool is not None:
        pool.shutdown()
    if ft is not None:
        ft.close()
    info = {w.name: {"batch_size": s.target.batch_size, "inner_steps": s.target.inner_steps,
                     "proxy_batches": list(s.batches)}
            for w, s in zip(cl.workers, steps)}
    tp, pp, dp = pl.layout_shape
    names = {"sign_row": "sign-row", "sign_pred": "sign-pred-row"}  # the summaries' names
    extra = {"codec": names.get(codec.kind, codec.kind), "error_feedback": bool(feedback),
             "layout": {"tp": tp, "pp": pp, "dp": dp}, **_wire_bytes(pl, transport),
             "region": cfg.geomesh.region,
             "global_weights_sha256": _weights_digest(pl, layout, cschema, theta),
             "compress_update": bool(local_mom), "overlap": overlap, "replans": replans,
             "plan": plan.to_dict(), "wall_s": time.perf_counter() - wall0,
             "world_size": pl.world, "inner_steps": g.inner_steps, "memory_overhead": overhead,
             "outer_device": next(iter(theta.values())).device.type}  # where θ_global lives
    return stats.summary(method=ctx.method, clock=ctx.clock_name, cluster=cl,
                         model=first.trainer.module, extra=extra,
                         worker_info=info)
