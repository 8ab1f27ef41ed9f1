"""Baselines: synchronous DDP over the WAN, and asynchronous local SGD.

**ddp** — data parallelism across all workers: every step all-reduces the
fp32 gradients over the WAN, and fast workers wait for the slowest each step.
Convergence is that of one job at the global batch, so one
:class:`~jobruntime.trainer.Trainer` at the proxy global batch ``G_p`` trains
it (emulated mode), or megatron's DDP over the whole real world (real mode,
where megatron's DP group spans the workers).  Emulated time: per step the
slowest worker's compute of ``G_t / K`` target sequences plus a hierarchical
ring all-reduce of ``4 · P`` bytes (:func:`geomesh.fleet.clock.ddp_schedule`).
An "outer step" is ``H`` steps, the tokens of one GeoMesh round.

**async** — asynchronous local SGD / DiLoCo (emulated only): every worker runs
``H`` steps of ``G_t / K`` sequences from the weights it last pulled, pushes
its fp32 pseudo-gradient to a parameter server in worker 0's region, which
applies it on arrival with the outer Nesterov optimizer, scaled by the
worker's share of a synchronous round, ``n_i / (K · n)`` (so ``K`` arrivals
move the weights as much as one synchronous round); the worker then pulls
the new weights and starts again.  Arrival times and staleness come from
:func:`geomesh.fleet.clock.async_schedule`; the proxy replays its events in order
(a worker trains when it pulls, from the weights of that moment).  An outer
step is ``K`` arrivals (the tokens of one synchronous round).  Checkpoints
and injected slowdowns are not supported for this baseline.
"""

from __future__ import annotations

import logging
import math
import time

from jobruntime.checkpoint import CheckpointError
from jobruntime.config import ConfigError
from jobruntime.data import GlobalBatchSampler
from jobruntime.metrics import perplexity, target_reached_line
from jobruntime.parallel import rng_state, set_rng_state, set_seed
from jobruntime.trainer import Trainer, mean_loss, reconcile_optimizer_settings

from .context import RunContext
from .fleet.clock import async_schedule, ddp_schedule, inner_step_time_s
from .outer import OuterNesterov
from .report import RunStats, not_finite
from .state import (
    check_rounds_left,
    check_warmup,
    check_workers,
    load_state,
    save_state,
    worker_identity,
)
from .wire.codec import DenseCodec
from .wire.compression import TensorSchema
from .worker import InnerWorker, proxy_steps

log = logging.getLogger(__name__)


def _eval(ctx: RunContext, stats: RunStats, trainer: Trainer, val, record: dict, step: int) -> None:
    val_loss = trainer.evaluate(val)
    record.update(val_loss=val_loss, val_ppl=perplexity(val_loss))
    if stats.evaluated(val_loss, record["val_ppl"], step):
        log.info(target_reached_line(ctx.cfg.train.target_ppl, f"outer step {step}",
                                     stats.time_s, ctx.clock_name))


def run_ddp(ctx: RunContext) -> dict:
    """Synchronous DDP baseline (module docstring)."""
    cfg, g, cl, pl = ctx.cfg, ctx.cfg.geomesh, ctx.cluster, ctx.placement
    K, H = len(cl.workers), g.inner_steps
    tcfg = ctx.layout_cfg
    tcfg.train.iters = g.outer_steps * H
    tcfg.train.lr_decay_iters = None
    topo = pl.topology
    dp, dp_rank = (topo.dp, topo.dp_rank) if not ctx.emulated else (1, 0)
    tcfg.validate(topo.world_size if not ctx.emulated else 1)
    set_seed(cfg.train.seed)
    trainer = Trainer(tcfg)
    p = tcfg.parallel
    sampler = GlobalBatchSampler(ctx.train_ds, global_batch_size=p.global_batch_size,
                                 micro_batch_size=p.micro_batch_size, dp=dp, dp_rank=dp_rank)
    val = ctx.val_batches(dp=dp, dp_rank=dp_rank)
    plan = ctx.planner.uniform(ctx.uniform_batch, H)
    grad_bytes = 4 * ctx.target_schema.numel if ctx.emulated else 0
    stats = RunStats.for_cluster(cl, cfg.train.target_ppl)
    start = 0
    if cfg.checkpoint.load:
        st = load_state(cfg.checkpoint.load, rank=pl.rank)
        if st["method"] != "ddp":
            raise CheckpointError(f"checkpoint is from method {st['method']}, not ddp")
        check_workers(st, cl)
        check_rounds_left(st, g.outer_steps)
        check_warmup(st["scheduler"].get("lr_warmup_steps"), cfg.train, str(cfg.checkpoint.load))
        trainer.set_params(st["params"])
        trainer.optimizer.load_state_dict(st["optimizer"])
        trainer.scheduler.load_state_dict(st["scheduler"])
        reconcile_optimizer_settings(trainer, cfg.train,
                                     cfg.checkpoint.optimizer_settings, str(cfg.checkpoint.load),
                                     lengths=False, can_keep=False)
        trainer.step = st["step"]
        sampler.consumed_samples, start = st["position"], st["round"]
        stats.load_state_dict(st["stats"])
        if "rng" in st:  # saved before it was: the generators as they are
            set_rng_state(st["rng"])
    t0 = time.perf_counter() - stats.time_s
    wall0 = time.perf_counter()
    for r in range(start, g.outer_steps):
        step = r + 1
        results = [trainer.train_step(sampler.next()) for _ in range(H)]
        ntok = H * p.global_batch_size * cfg.model.seq_length
        if ctx.emulated:
            step_compute = {}
            for wp in plan.workers:
                w = cl.worker(wp.worker)
                step_compute[w.name] = inner_step_time_s(
                    w, ctx.target.model, wp.micro_batch_size, wp.grad_accum,
                    seq_length=wp.seq_length) * cl.slowdown_factor(w.name, r)
            sched = ddp_schedule(cl, step_compute, grad_bytes, H)
            for w in cl.workers:
                t = sched.workers[w.name]
                stats.add_worker(w.name, compute_s=t.compute_s, straggler_idle_s=t.straggler_idle_s,
                                 wan_idle_s=t.wan_idle_s, sent_bytes=t.sent_bytes, tokens=ntok // K)
            stats.time_s += sched.end_s
            round_bytes = sum(t.sent_bytes for t in sched.workers.values())
            stats.bytes_total += round_bytes
            stats.fp32_bytes_total += round_bytes
        else:  # wall clock; compute and all-reduce are not separated here
            stats.time_s = time.perf_counter() - t0
            round_bytes = 0
        stats.tokens += ntok
        stats.outer_steps = step
        record = dict(step=step, tokens=stats.tokens, time_s=stats.time_s,
                      loss=mean_loss(results), bytes=round_bytes)
        # one trainer over the job's processes: its loss is the same on each
        bad = [] if math.isfinite(record["loss"]) else ["the DDP job"]
        if not bad and ctx.is_eval_step(step):
            _eval(ctx, stats, trainer, val, record, step)
        ctx.log_outer_step(record)
        if stats.diverged(bad, step) or stats.diverged_at_step is not None:
            break  # nothing of this step is saved (train.py exits 1)
        stop = cfg.train.stop_at_target and stats.reached_here
        every = cfg.checkpoint.save_interval
        if every and (step % every == 0 or step == g.outer_steps or stop):
            state = {"method": "ddp", "round": step, "position": sampler.consumed_samples,
                     "cluster": worker_identity(cl),
                     "params": trainer.get_params(), "optimizer": trainer.optimizer.state_dict(),
                     "scheduler": trainer.scheduler.state_dict(), "step": trainer.step,
                     "stats": stats.state_dict(), "rng": rng_state()}
            save_state(ctx.run_dir / "checkpoints", step, state, rank=pl.rank,
                       job_leader=pl.is_logging_rank, keep_last=cfg.checkpoint.keep_last)
        if stop:
            break
    info = {wp.worker: {"batch_size": wp.batch_size, "inner_steps": 1} for wp in plan.workers}
    extra = {"codec": "fp32", "wall_s": time.perf_counter() - wall0, "world_size": pl.world,
             "inner_steps": H, "steps_per_outer_step": H}
    return stats.summary(method="ddp", clock=ctx.clock_name, cluster=cl, model=trainer.module,
                         extra=extra, worker_info=info)


def run_async(ctx: RunContext) -> dict:
    """Asynchronous local-SGD baseline, emulated (module docstring)."""
    cfg, g, cl = ctx.cfg, ctx.cfg.geomesh, ctx.cluster
    if cfg.checkpoint.load or cfg.checkpoint.save_interval:
        raise ConfigError("geomesh.method=async does not support checkpoints; set "
                          "checkpoint.save_interval=0 and no checkpoint.load")
    K, H = len(cl.workers), g.inner_steps
    plan = ctx.planner.uniform(ctx.uniform_batch, H)
    steps = proxy_steps(plan, ctx.scale, round_samples=ctx.round_samples,
                        max_micro_batch=cfg.parallel.micro_batch_size)
    warm = cfg.train.warmup_iters
    workers = [InnerWorker(ctx.layout_cfg, i, ctx.train_ds, inner_iters=g.outer_steps * H,
                           warmup_iters=warm, reference_batch=ctx.reference_batch)
               for i in range(K)]
    theta = workers[0].trainer.get_params()
    codec = DenseCodec(TensorSchema.from_tensors(theta))
    outer = OuterNesterov(theta, lr=g.outer_lr, momentum=g.outer_momentum,
                          momentum_warmup=g.outer_momentum_warmup)
    val = ctx.val_batches(dp=1, dp_rank=0)
    update_bytes = DenseCodec.encoded_bytes(ctx.target_schema)
    model_bytes = 4 * ctx.target_schema.numel
    round_compute = {wp.worker: wp.compute_s for wp in plan.workers}
    server = cl.workers[0].region
    cycle = max(round_compute[w.name] + cl.link(w.region, server).transfer_s(update_bytes)
                + cl.link(server, w.region).transfer_s(model_bytes) for w in cl.workers)
    n_events = g.outer_steps * K
    events = async_schedule(cl, round_compute, update_bytes, model_bytes,
                            horizon_s=1.01 * g.outer_steps * cycle + 1.0,
                            server_region=server).events[:n_events]
    horizon = events[-1].time_s
    sched = async_schedule(cl, round_compute, update_bytes, model_bytes, horizon_s=horizon,
                           server_region=server)
    stats = RunStats.for_cluster(cl, cfg.train.target_ppl)
    round_tokens = sum(s.samples for s in steps) * cfg.model.seq_length
    position = 0
    pending: dict[int, tuple[bytes, float]] = {}
    wall0 = time.perf_counter()

    def pull_and_train(i: int, step: int) -> None:  # worker i reads θ_global, trains H steps
        nonlocal position
        res = workers[i].train_round(theta, steps[i], position)
        position += steps[i].samples
        if stats.diverged(not_finite(res.loss, res.delta.values(),
                                     who=repr(cl.workers[i].name)), step):
            return  # nothing to encode: the loop stops at this outer step
        pending[i] = (codec.encode(res.delta, res.tokens, worker=i, round=0), res.loss)

    for i in range(K):
        if stats.diverged_at_step is None:
            pull_and_train(i, 1)
    index = {w.name: i for i, w in enumerate(cl.workers)}
    staleness, window = [], []
    for e, ev in enumerate(events):
        if stats.diverged_at_step is not None:  # a worker's round, or θ's validation
            if stats.diverged_at_step > stats.outer_steps:  # that step is not logged yet
                ctx.log_outer_step(dict(step=stats.diverged_at_step, tokens=stats.tokens,
                                        time_s=stats.time_s, loss=float("nan")))
            break
        i = index[ev.worker]
        msg, loss = pending.pop(i)
        delta, (n_i,) = codec.aggregate([msg], senders=[i])  # one message: its own fp32 Δ_i
        outer.step({k: v * (n_i / round_tokens) for k, v in delta.items()})
        staleness.append(ev.staleness)
        window.append(loss)
        stats.tokens += n_i
        stats.time_s = ev.time_s
        if e + 1 < len(events):
            pull_and_train(i, e // K + 2)  # pulls the new weights, starts its next round
        if (e + 1) % K == 0:
            step = (e + 1) // K
            stats.outer_steps = step
            record = dict(step=step, tokens=stats.tokens, time_s=stats.time_s,
                          loss=sum(window) / len(window), mean_staleness=sum(staleness[-K:]) / K)
            window = []
            if ctx.is_eval_step(step):
                workers[0].trainer.set_params(theta)
                workers[0].trainer.set_batch_size(cfg.parallel.global_batch_size,
                                                  cfg.parallel.micro_batch_size)
                _eval(ctx, stats, workers[0].trainer, val, record, step)
            ctx.log_outer_step(record)
            if cfg.train.stop_at_target and stats.reached_here:
                break
    for w in cl.workers:
        t = sched.workers[w.name]
        stats.add_worker(w.name, compute_s=t.compute_s, wan_idle_s=t.wan_idle_s,
                         sent_bytes=t.sent_bytes,
                         tokens=sum(1 for ev in events if ev.worker == w.name)
                         * steps[index[w.name]].samples * cfg.model.seq_length)
    n = len(events)
    stats.bytes_total = n * (update_bytes + model_bytes)
    stats.fp32_bytes_total = n * (4 * ctx.target_schema.numel) * 2
    info = {wp.worker: {"batch_size": wp.batch_size, "proxy_batches": list(s.batches),
                        "inner_steps": H, "updates": sum(1 for ev in events if ev.worker == wp.worker)}
            for wp, s in zip(plan.workers, steps)}
    extra = {"codec": "fp32", "wall_s": time.perf_counter() - wall0, "world_size": 1,
             "inner_steps": H, "mean_staleness": sum(staleness) / max(len(staleness), 1),
             "server_region": server}
    return stats.summary(method="async", clock=ctx.clock_name, cluster=cl,
                         model=workers[0].trainer.module, extra=extra, worker_info=info)
