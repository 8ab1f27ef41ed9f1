"""The synchronous outer loop: GeoMesh and DiLoCo, emulated or real.

Per round ``r`` (Douillard et al. 2023, "DiLoCo", Alg. 1, with GeoMesh's
balancing and compression):

1. every worker ``i`` sets ``θ_i ← θ_global`` and runs ``H_i`` inner AdamW
   steps of ``b_i`` sequences (:class:`geomesh.worker.InnerWorker`);
2. ``Δ_i = θ_global − θ_i`` (fp32) is encoded — GeoMesh: sign bits + an fp32
   scale per row (``sign_row``) or per tensor (``sign``), error feedback
   optional (:class:`geomesh.codec.SignCodec`); DiLoCo: fp32
   (:class:`geomesh.codec.DenseCodec`) — with the worker's token count ``n_i``;
3. the messages are all-gathered (:mod:`geomesh.transport`), decoded and
   aggregated, ``Δ = Σ (n_i/N) D(msg_i)``;
4. the outer Nesterov step updates ``θ_global`` (:class:`geomesh.outer.OuterNesterov`);
   every worker applies it to the same messages, so all copies stay equal.

GeoMesh plans ``b_i, H_i`` with :class:`geomesh.planner.Planner` so that all
workers finish their compute together, and re-plans when measured step times
drift (real: wall-clock per inner step; emulated: the injected
``slowdown`` of the cluster file).  DiLoCo uses the same ``b = G_t/K`` and
``H`` everywhere, so fast workers wait for the slowest (straggler idle).

Measured choices (emulated four-region cluster, GPT-3 1.3B target, tiny_gpt
proxy at sequence 64, ``G_p = 16``, ``H = 8``, outer lr 0.35, validation
perplexity after 12 outer steps = 98k tokens; ``bench/geomesh_ttp.py --quick``):

* one scale per *tensor* diverged (val ppl ~2200 at outer lr 0.7): embedding
  rows of tokens unseen in a round received the magnitude of the seen rows.
  One scale per *row* (``geomesh.compression=sign_row``; compression ratio
  31.6 on the target instead of 32.0) fixed it;
* error feedback on: 672, off: 671 (at 16 steps without the momentum ramp
  and with ``balance=batch``: 809 vs 760), so ``geomesh.error_feedback``
  defaults to off (it also saves 4 bytes per parameter);
* balancing by steps (``geomesh.balance=steps``: every step at the uniform
  batch, faster workers take more steps) beat balancing by batch (784 vs 819
  without the momentum ramp); scaling a worker's inner LR with its batch
  (``inner_lr_scaling=sqrt``) made the batch variant worse (1236 vs 1111);
* ramping the outer momentum in (``outer_momentum_warmup``, for every method)
  removed a loss spike around round 4 (GeoMesh 819 → 671, DiLoCo 895 → 765);
* for reference: GeoMesh's plan with fp32 pseudo-gradients 606, fp32 DiLoCo
  765, DDP 664.

These were measured before the planner's memory model counted GeoMesh's own
state (θ_global and momentum on the GPUs, 8 bytes per parameter); with it the
A100's plan moves from 8 steps of 128 to 7 of 144 sequences and GeoMesh ends
at 715 (DiLoCo 765) — differences of this size between nearby plans are the
noise level of a 98k-token proxy run.  With that plan: error feedback on 713
(TTP 158 s vs 130 s off), fp32 pseudo-gradients 608 (TTP 166 s), outer lr 0.5
738 and 0.7 788.

Time.  Emulated: worker ``i``'s compute is the GPU-profile time of its plan on
the target model (:func:`geomesh.clock.inner_step_time_s`) times any injected
slowdown, charged to an :class:`~geomesh.clock.EmulatedClock`; the exchange is
charged with the target model's message size.  Real: wall-clock; a worker's
straggler idle is ``max_j compute_j − compute_i`` and its WAN idle the rest
of its time in the exchange.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from jobruntime.checkpoint import CheckpointError
from jobruntime.faults import fault_point
from jobruntime.metrics import perplexity

from .clock import EmulatedClock, inner_step_time_s
from .codec import DenseCodec, SignCodec
from .compression import ErrorFeedback, TensorSchema
from .context import RunContext
from .guard import Guard
from .membership_plan import plan_for_members, plan_from_dict
from .outer import OuterNesterov
from .planner import Plan
from .report import RunStats, memory_overhead
from .state import load_state, save_state
from .transport import InProcessTransport
from .worker import InnerWorker, ProxyStep, proxy_steps

log = logging.getLogger(__name__)


def _true_step_s(ctx: RunContext, step: ProxyStep, round_: int) -> float:
    """Emulated physics: profile time of one inner step on the target, times the slowdown."""
    w = ctx.cluster.worker(step.target.worker)
    t = inner_step_time_s(w, ctx.target.model, step.target.micro_batch_size,
                          step.target.grad_accum, seq_length=step.target.seq_length)
    return t * ctx.cluster.slowdown_factor(w.name, round_)


def _proxy(ctx: RunContext, plan: Plan) -> list[ProxyStep]:
    return proxy_steps(plan, ctx.scale, round_samples=ctx.round_samples,
                       dp_in=ctx.placement.dp_in, max_micro_batch=ctx.cfg.parallel.micro_batch_size)


def run_sync(ctx: RunContext) -> dict:
    """Train ``geomesh.outer_steps`` rounds; return the summary (also written to disk)."""
    cfg, g, cl, pl = ctx.cfg, ctx.cfg.geomesh, ctx.cluster, ctx.placement
    geomesh = ctx.method == "geomesh"
    K = len(cl.workers)
    plan = ctx.planner.plan() if geomesh else ctx.planner.uniform(ctx.uniform_batch)
    steps = _proxy(ctx, plan)
    workers: dict[int, InnerWorker] = {}
    for i in pl.workers:
        h = steps[i].inner_steps
        warm = round(cfg.train.warmup_iters * h / g.inner_steps)
        workers[i] = InnerWorker(ctx.layout_cfg, i, ctx.train_ds, inner_iters=g.outer_steps * h,
                                 warmup_iters=warm, reference_batch=ctx.reference_batch,
                                 dp_group=pl.dp_group, dp_in=pl.dp_in,
                                 dp_in_rank=pl.dp_in_rank)
    first = workers[pl.workers[0]]
    theta = first.trainer.get_params()  # θ_global, fp32, this rank's shard
    sign = geomesh and g.compression != "fp32"
    row_scales = sign and g.compression == "sign_row"
    schema = dataclasses.replace(TensorSchema.from_tensors(theta), row_scales=row_scales)
    if sign:
        codec = SignCodec(schema, tp_group=pl.tp_group,
                          tp_partition=first.trainer.tp_partition_dims())
    else:
        codec = DenseCodec(schema)
    outer = OuterNesterov(theta, lr=g.outer_lr, momentum=g.outer_momentum,
                          momentum_warmup=g.outer_momentum_warmup)
    feedback = {i: ErrorFeedback() for i in pl.workers} if sign and g.error_feedback else {}
    guard = Guard.from_config(g, cl)  # checks every message before aggregation
    clock = transport = None
    if ctx.emulated:
        clock = EmulatedClock(cl)
        target = dataclasses.replace(ctx.target_schema, row_scales=row_scales)
        charged = codec.encoded_bytes(target)
        transport = InProcessTransport(cl, clock=clock, charged_bytes=charged)
    val = ctx.val_batches(dp=pl.dp_in, dp_rank=pl.dp_in_rank)
    stats = RunStats.for_cluster(cl, cfg.train.target_ppl)
    position, start, replans = 0, 0, 0
    history: dict[str, list[float]] = {}  # measured seconds per inner step since the last plan
    if cfg.checkpoint.load:
        st = load_state(cfg.checkpoint.load, rank=pl.rank)
        if st["method"] != ctx.method:
            raise CheckpointError(f"checkpoint is from method {st['method']}, not {ctx.method}; "
                                  f"resume it with geomesh.method={st['method']}")
        if set(st["workers"]) != set(workers) or set(st["feedback"]) != set(feedback):
            raise CheckpointError(
                f"checkpoint holds workers {sorted(st['workers'])} with error feedback "
                f"{'on' if st['feedback'] else 'off'}; this run has workers {sorted(workers)} "
                f"with it {'on' if feedback else 'off'}: resume with the cluster file and "
                "geomesh.error_feedback it was saved with"
            )
        if st["round"] >= g.outer_steps:
            raise CheckpointError(
                f"checkpoint is at outer step {st['round']}, geomesh.outer_steps={g.outer_steps}: "
                "nothing left to run; raise geomesh.outer_steps"
            )
        outer.load_state_dict(st["outer"])  # copies into theta
        for i, fb in feedback.items():
            fb.load_state_dict(st["feedback"][i])
        for i, w in workers.items():
            w.load_state_dict(st["workers"][i])
        ctx.planner.speed = dict(st["planner_speed"])
        ctx.planner.current = plan = st["plan"]
        steps = _proxy(ctx, plan)
        if clock is not None:
            clock.load_state_dict(st["clock"])
        stats.load_state_dict(st["stats"])
        position, start, replans = st["position"], st["round"], st["replans"]
        history = st["history"]
        guard.load_state_dict(st.get("guard", {}))
        torch.set_rng_state(st["rng"])
        log.info("resumed %s at outer step %d", ctx.method, start)
    t0 = time.perf_counter() - stats.time_s
    wall0 = time.perf_counter()
    overhead = None
    r, joining, members = start, False, list(range(K))
    ft = pl.membership
    if ft is not None:  # one job per region: torchft quorum, healing (geomesh.membership)
        def save_heal() -> dict:
            return {"round": r, "position": position, "replans": replans, "members": members,
                    "plan": plan.to_dict(), "speed": dict(ctx.planner.speed),
                    "outer": outer.state_dict(), "guard": guard.state_dict()}

        def load_heal(st: dict) -> None:
            nonlocal r, position, replans, plan, steps, history, members
            r, position, replans = int(st["round"]), int(st["position"]), int(st["replans"])
            members = [int(k) for k in st["members"]]
            outer.load_state_dict(st["outer"])
            guard.load_state_dict(st["guard"])
            ctx.planner.speed = {k: float(v) for k, v in st["speed"].items()}
            plan = plan_from_dict(st["plan"], ctx.planner.tolerance)
            steps, history = _proxy(ctx, plan), {}
            for w in workers.values():  # the inner LR schedule where the others' is
                w.trainer.scheduler.step(increment=max(r * steps[w.index].inner_steps
                                                       - w.trainer.step, 0))
                w.trainer.step = max(w.trainer.step, r * steps[w.index].inner_steps)
            log.info("healed from a live peer: round %d", r)

        ft.set_state_fns(save_heal, load_heal)
        joining = ft.join(start)
        if not joining:  # else the healed state says who trained this round
            members = list(ft.members)
    while r < g.outer_steps:
        step = r + 1
        offsets = [sum(steps[j].samples for j in members if j < i) for i in range(K)]
        msgs, done = {}, {}
        for i in ([] if joining else pl.workers):
            name = cl.workers[i].name
            w0 = time.perf_counter()
            res = workers[i].train_round(theta, steps[i], position + offsets[i])
            fault_point("train", r)
            if ctx.emulated:
                compute = _true_step_s(ctx, steps[i], r) * steps[i].target.inner_steps
                clock.compute(name, compute)
            else:
                wall = time.perf_counter() - w0
                factor = cl.slowdown_factor(name, r)
                if factor != 1.0:  # injected slowdown: sleep the extra time
                    time.sleep((factor - 1.0) * wall)
                compute = wall * factor
            msgs[i] = codec.encode(res.delta, res.tokens, worker=i, round=r,
                                   feedback=feedback.get(i))
            done[i] = (res, compute)
        x0 = time.perf_counter()
        if ctx.emulated:
            received = transport.exchange(msgs)
        else:
            me = pl.workers[0]
            received = pl.exchange(msgs, quorum_done=joining,
                                   stats=(done[me][0].loss, done[me][1]) if me in done else (0, 0))
        exchange_s = time.perf_counter() - x0
        if pl.healed or joining:  # this worker sent nothing: the others' round r, from their state
            step, joining, done = r + 1, False, {}
        guard.expect({i: steps[i].samples * cfg.model.seq_length for i in range(K)})
        agg, tokens = codec.aggregate(received, guard=guard)
        if ft is not None and guard.last_rejected:  # like lost workers (fail: stop, named)
            ft.lost(r, sorted(guard.last_rejected), "message rejected by the checks")
        if agg is not None:
            outer.step(agg)
        position += sum(steps[j].samples for j in members)
        if overhead is None and msgs:  # every outer buffer exists after the first step
            overhead = memory_overhead(
                theta, outer.momentum_buffer, [fb.residuals for fb in feedback.values()],
                [len(msgs[i]) for i in pl.workers],
                target_params=ctx.target_schema.numel if ctx.emulated else None)

        # -- round statistics --------------------------------------------------
        per: dict[str, dict] = {}
        if ctx.emulated:
            for w in cl.workers:
                t = transport.last_schedule.workers[w.name]
                per[w.name] = dict(compute_s=t.compute_s, straggler_idle_s=t.straggler_idle_s,
                                   wan_idle_s=t.wan_idle_s, sent_bytes=t.sent_bytes)
            losses = {i: done[i][0].loss for i in done}
            round_bytes = charged * K
            present = list(range(K))
            round_fp32 = 4 * ctx.target_schema.numel * K
            stats.time_s = clock.now_s
        else:
            me = pl.workers[0]
            sent = len(msgs[me]) if pl.transport is not None and me in msgs else 0
            rows = pl.gather_rows([me, done[me][0].loss if me in done else 0.0,
                                   done[me][1] if me in done else 0.0, exchange_s, sent,
                                   4 * schema.numel if sent else 0], 4 * schema.numel)
            present = sorted({int(x[0]) for x in rows})
            compute = {k: max(x[2] for x in rows if int(x[0]) == k) for k in present}
            slowest = max(compute.values())
            losses = {}
            for k in present:
                w = cl.workers[k]
                mine = [x for x in rows if int(x[0]) == k]
                straggler = slowest - compute[k]
                losses[k] = mine[0][1]
                per[w.name] = dict(compute_s=compute[k], straggler_idle_s=straggler,
                                   wan_idle_s=max(max(x[3] for x in mine) - straggler, 0.0),
                                   sent_bytes=int(sum(x[4] for x in mine)))
            round_bytes = int(sum(x[4] for x in rows))
            round_fp32 = int(sum(x[5] for x in rows))
            stats.time_s = time.perf_counter() - t0
        for k in present:
            stats.add_worker(cl.workers[k].name, tokens=tokens[k], **per[cl.workers[k].name])
        ntok = sum(tokens)
        stats.tokens += ntok
        stats.outer_steps = step
        stats.bytes_total += round_bytes
        stats.fp32_bytes_total += round_fp32
        times = [per[cl.workers[k].name]["compute_s"] for k in present]
        record = dict(
            step=step, tokens=stats.tokens, time_s=stats.time_s,
            loss=sum(tokens[k] * losses[k] for k in present) / max(ntok, 1),
            compute_s=max(times), imbalance=(max(times) - min(times)) / max(times),
            straggler_idle_s=sum(p["straggler_idle_s"] for p in per.values()),
            wan_idle_s=sum(p["wan_idle_s"] for p in per.values()), bytes=round_bytes,
            batch_sizes=[s.batch_size for s in steps],
            target_batch_sizes=[s.target.batch_size for s in steps],
            inner_steps=[s.target.inner_steps for s in steps],
            proxy_samples=[s.samples for s in steps],
        )
        if len(present) < K or guard.last_rejected:
            record["workers_present"] = [cl.workers[k].name for k in present
                                         if k not in guard.last_rejected]
        if ctx.is_eval_step(step):
            first.trainer.set_params(theta)
            first.trainer.set_batch_size(cfg.parallel.global_batch_size,
                                         cfg.parallel.micro_batch_size)
            val_loss = first.trainer.evaluate(val)
            record.update(val_loss=val_loss, val_ppl=perplexity(val_loss))
            if stats.evaluated(val_loss, record["val_ppl"], step):
                log.info("target perplexity %s reached at outer step %d (%.1f s, %s clock)",
                         cfg.train.target_ppl, step, stats.time_s, ctx.clock_name)
        # -- re-plan on drift (GeoMesh) ------------------------------------------
        # Emulated measurements are exact: the last one is used.  Wall-clock
        # ones are noisy: real mode averages the last two rounds since the plan
        # last changed (and waits for two).
        for k in present:
            history.setdefault(cl.workers[k].name, []).append(
                per[cl.workers[k].name]["compute_s"] / steps[k].target.inner_steps)
        need = 1 if ctx.emulated else 2
        full = len(members) == K and len(present) == K  # drift re-plans need everyone measured
        if geomesh and g.replan and full and step < g.outer_steps and \
                min(len(v) for v in history.values()) >= need:
            measured = {n: sum(v[-need:]) / need for n, v in history.items()}
            new = ctx.planner.replan(measured)
            if new is not plan:
                plan, steps, replans, history = new, _proxy(ctx, new), replans + 1, {}
                record["replanned"] = True
                log.info("outer step %d: re-planned b_i=%s H_i=%s", step,
                         [s.target.batch_size for s in steps], [s.target.inner_steps for s in steps])
        ctx.log_outer_step(record)
        reached_stop = cfg.train.stop_at_target and stats.ttp.reached
        save_every = cfg.checkpoint.save_interval
        if save_every and (step % save_every == 0 or step == g.outer_steps or reached_stop):
            state = {
                "method": ctx.method, "round": step, "position": position, "replans": replans,
                "outer": outer.state_dict(),
                "feedback": {i: fb.state_dict() for i, fb in feedback.items()},
                "workers": {i: w.state_dict() for i, w in workers.items()},
                "planner_speed": dict(ctx.planner.speed), "plan": plan,
                "clock": clock.state_dict() if clock is not None else None,
                "stats": stats.state_dict(), "rng": torch.get_rng_state(), "history": history,
                "guard": guard.state_dict(),
            }
            save_state(ctx.run_dir / "checkpoints", step, state, rank=pl.rank,
                       job_leader=pl.is_logging_rank, keep_last=cfg.checkpoint.keep_last)
        if reached_stop:
            break
        if ft is not None and members != ft.members:  # re-plan for the next round's workers
            members = list(ft.members)
            plan = plan_for_members(ctx.planner, plan, [cl.workers[k].name for k in members])
            steps, history = _proxy(ctx, plan), {}
            log.info("outer step %d: %d worker(s), re-planned b_i=%s H_i=%s", step, len(members),
                     [steps[k].target.batch_size for k in members],
                     [steps[k].target.inner_steps for k in members])
        r += 1
    if ft is not None:
        ft.close()
    info = {w.name: {"batch_size": s.target.batch_size, "inner_steps": s.target.inner_steps,
                     "proxy_batches": list(s.batches)}
            for w, s in zip(cl.workers, steps)}
    extra = {"codec": codec.kind + ("-row" if row_scales else ""), "error_feedback": bool(feedback),
             "replans": replans,
             "plan": plan.to_dict(), "wall_s": time.perf_counter() - wall0,
             "world_size": pl.world, "inner_steps": g.inner_steps, "memory_overhead": overhead}
    return stats.summary(method=ctx.method, clock=ctx.clock_name, cluster=cl, extra=extra,
                         worker_info=info)
