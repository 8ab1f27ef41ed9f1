"""Checkpoints of a GeoMesh run: outer state plus every worker's inner state.

What a resumed run needs to continue bit for bit: ``θ_global`` and the outer
momentum (:class:`geomesh.outer.OuterNesterov`), the error-feedback residuals,
each worker's AdamW moments and LR-schedule position, the data-stream
position, the plan and the planner's speed corrections, the emulated clock,
and the run statistics (TTP, idle time, bytes).

Layout (one file per process, each written atomically; the folder becomes
visible only when complete)::

    checkpoints/outer_0000002/rank00000.pt   torch.save of that rank's state
    checkpoints/outer_0000002/COMPLETE
    checkpoints/latest                       name of the newest complete one

A checkpoint belongs to one layout (same cluster, same ranks): state is
per-rank shards of ``θ_global`` and per-worker optimizer states.  When several
``torchrun`` jobs (regions) run, each writes under its own run directory.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from geomesh.fleet.cluster import ClusterSpec
from geomesh.fleet.plan import Plan, WorkerPlan
from jobruntime.checkpoint import COMPLETE, CheckpointError, committed_folder
from jobruntime.faults import fault_point
from jobruntime.outputs import round_folder, saved_checkpoints
from jobruntime.parallel import rng_state, set_rng_state
from jobruntime.trainer import reconcile_optimizer_settings

log = logging.getLogger(__name__)
# Modules that held the plan classes when older checkpoints pickled them: the planner's
# before geomesh.fleet existed, then before the plan had a module of its own.
_OLD_PLAN_MODULES = ("geomesh.planner", "geomesh.fleet.planner")


def save_state(root: Path, step: int, state: dict, *, rank: int, job_leader: bool,
               keep_last: int = 2) -> Path:
    """Write this rank's ``state`` into ``root/outer_<step>`` (collective over the world)."""
    name = round_folder(step)
    with committed_folder(root, name, leader=job_leader, keep_last=keep_last,
                          marker=f"outer step {step}") as tmp:
        part = tmp / f".rank{rank:05d}.pt.tmp"
        torch.save(state, part)
        os.replace(part, tmp / f"rank{rank:05d}.pt")
        fault_point("save", step)
    return root / name


def worker_identity(cluster: ClusterSpec) -> list[dict]:
    """What a checkpoint's per-worker state belongs to, cluster order: each
    worker's name, GPU type and layout (GPUs, TP, PP).  Saved as ``state["cluster"]``."""
    return [{"name": w.name, "gpu": w.gpu, "num_gpus": w.num_gpus, "tp": w.tp, "pp": w.pp}
            for w in cluster.workers]


def _describe(w: dict) -> str:
    if set(w) == {"name"}:
        return f"'{w['name']}'"
    return f"'{w['name']}' ({w['gpu']} x{w['num_gpus']}, tp={w['tp']}, pp={w['pp']})"


def check_workers(state: dict, cluster: ClusterSpec) -> None:
    """Refuse to resume ``state`` on a cluster whose workers are not the saved ones.

    A checkpoint's per-worker state (plan, inner optimizer, error feedback, guard
    history, clock) is stored by worker position and name; a renamed worker made
    the resume crash with a raw ``KeyError`` in the clock, and reordered workers
    were accepted silently (the T4 then ran the H100's saved plan: 332 s of
    straggler idle per round instead of 0.37 s).  The workers must match by
    identity (:func:`worker_identity`), in the saved order.  States saved before
    the identity was recorded are checked by the worker names of their plan.

    Raises:
        CheckpointError: one line naming the first mismatch and the fix.
    """
    saved = state.get("cluster")
    now = worker_identity(cluster)
    if saved is None:  # older checkpoint: the plan's worker names, cluster order
        plan = state.get("plan")
        if plan is None:
            return
        saved = [{"name": wp.worker} for wp in plan.workers]
        now = [{"name": w["name"]} for w in now]
    fix = ("resume with the cluster file the run was saved with (geomesh.cluster), or start a "
           "new run without checkpoint.load")
    if saved == now:
        return
    key = [sorted(w.items()) for w in saved]
    if len(saved) == len(now) and sorted(key) == sorted(sorted(w.items()) for w in now):
        raise CheckpointError(
            f"checkpoint's workers are in the order {[w['name'] for w in saved]}, the cluster "
            f"file lists {[w['name'] for w in now]}: list the workers in the saved order (each "
            "worker's saved plan and optimizer state belong to its position)")
    if len(saved) != len(now):
        raise CheckpointError(
            f"checkpoint holds {len(saved)} workers {[w['name'] for w in saved]}, the cluster "
            f"file has {len(now)} {[w['name'] for w in now]}: {fix}")
    k = next(i for i, (a, b) in enumerate(zip(saved, now)) if a != b)
    raise CheckpointError(
        f"checkpoint's worker {k} is {_describe(saved[k])}, the cluster file's is "
        f"{_describe(now[k])}: {fix}")


def find_state(path: str | Path) -> Path:
    """A run's ``checkpoints/`` folder (via ``latest``) or one ``outer_*`` folder.

    Raises:
        CheckpointError: no complete GeoMesh checkpoint there.
    """
    path = Path(path)
    if (path / COMPLETE).is_file() and path.name.startswith("outer_"):
        return path
    latest = path / "latest"
    if latest.is_file() and (path / latest.read_text().strip() / COMPLETE).is_file():
        return path / latest.read_text().strip()
    # no (valid) latest, e.g. a kill after COMPLETE, before it moved: the one saved last
    done = saved_checkpoints(path, "outer")
    if done:
        return done[-1]
    if path.name.startswith("iter_") or list(path.glob("iter_*")):
        raise CheckpointError(
            f"'{path}' is a checkpoint of an ordinary train.py run, not of a GeoMesh run; start "
            "GeoMesh from scratch (GeoMesh resumes only its own outer_XXXXXXX checkpoints)"
        )
    raise CheckpointError(
        f"no complete GeoMesh checkpoint in '{path}'; point checkpoint.load at a GeoMesh run's "
        "checkpoints/ folder or an outer_XXXXXXX folder with a COMPLETE marker"
    )


# what a method's state must hold to resume: the outer loop's (checkpoint_state), or the
# DDP baseline's one job (geomesh.baselines.run_ddp: no outer step, no workers)
_STATE_KEYS = {None: {"method", "round", "outer"},
               "ddp": {"method", "round", "position", "params", "optimizer", "scheduler",
                       "step", "stats"}}


def check_rounds_left(st: dict, outer_steps: int) -> None:
    """Refuse a resume with no round left to train.

    Raises:
        CheckpointError: the state's round is at or past ``outer_steps``, naming the fix.
    """
    if st["round"] >= outer_steps:
        raise CheckpointError(
            f"checkpoint is at outer step {st['round']}, geomesh.outer_steps={outer_steps}: "
            "nothing left to run; raise geomesh.outer_steps")


def load_state(path: str | Path, *, rank: int) -> dict:
    """This rank's state from a checkpoint.

    Loaded with ``torch.load(weights_only=True)`` (PyTorch's safe unpickler:
    tensors, plain containers and the two plan dataclasses), so a checkpoint
    file cannot run code when it is read.

    Raises:
        CheckpointError: not found, saved with another layout (no file for this
            rank), damaged, or holding objects other than those.
    """
    folder = find_state(path)
    f = folder / f"rank{rank:05d}.pt"
    if not f.is_file():
        raise CheckpointError(
            f"'{folder}' has no state for rank {rank}; a GeoMesh checkpoint resumes only with the "
            "cluster and process layout it was saved with"
        )
    try:  # tensors, plain containers and the plan only: a pickle that runs code is refused
        # older checkpoints name the plan classes by an old module: allowed under it too
        old = [(cls, f"{m}.{cls.__name__}") for m in _OLD_PLAN_MODULES for cls in (Plan, WorkerPlan)]
        with torch.serialization.safe_globals([Plan, WorkerPlan, *old]):
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated zip, unpickling errors, disallowed globals
        raise CheckpointError(
            f"'{f}' is damaged ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}); "
            "resume from "
            "an earlier outer_XXXXXXX folder or start without checkpoint.load"
        ) from None
    method = state.get("method") if isinstance(state, dict) else None
    need = _STATE_KEYS.get(method, _STATE_KEYS[None])
    if not isinstance(state, dict) or not need <= set(state):
        raise CheckpointError(f"'{f}' is not a GeoMesh state (it needs {', '.join(sorted(need))}); "
                              "resume from an earlier outer_XXXXXXX folder")
    return state


# ---------------------------------------------------------------------------
# What of a running outer loop (geomesh.sync.OuterLoop) is saved, resumed and healed
# ---------------------------------------------------------------------------


def check_warmup(saved: int | None, t, source: str) -> None:
    """Refuse a resume whose ``train.warmup_iters`` is not the one that sized the saved LR
    schedules (``saved``; ``None``: a checkpoint from before it was recorded, not checked).

    GeoMesh scales the warmup into each worker's inner steps and keeps re-planned
    schedules in its checkpoint, so a new value cannot be applied mid-run, and was
    ignored while ``config.yaml`` recorded it (break-test helper); the LR, weight decay
    and Adam's are :func:`jobruntime.trainer.reconcile_optimizer_settings`'s.

    Raises:
        CheckpointError: they differ (both values, the fix).
    """
    if saved is not None and int(saved) != t.warmup_iters:
        raise CheckpointError(
            f"{source} was trained with train.warmup_iters={saved}, this config has "
            f"{t.warmup_iters}: the workers' LR schedules were sized with it and go on as "
            f"saved; resume with train.warmup_iters={saved}")


_OUTER = (("lr", "geomesh.outer_lr"), ("momentum", "geomesh.outer_momentum"),
          ("momentum_warmup", "geomesh.outer_momentum_warmup"))


def outer_settings(outer) -> dict:
    """:data:`_OUTER`'s settings of an :class:`~geomesh.outer.OuterNesterov`, by attribute."""
    return {attr: getattr(outer, attr) for attr, _ in _OUTER}


def reconcile_outer(outer, config: dict, how: str, source: str) -> None:
    """The outer optimizer's settings after a resume against the config's (``config``:
    what ``outer`` held before the load).  ``OuterNesterov.load_state_dict`` takes the
    checkpoint's learning rate and momentum: a resume with another ``geomesh.outer_lr``
    trained at the saved one while ``config.yaml`` and the run identity recorded the new
    one (review helper).  ``same`` refuses a difference; ``config`` sets the config's
    (``checkpoint.optimizer_settings``, as for the inner optimizer,
    :func:`jobruntime.trainer.reconcile_optimizer_settings`).

    Raises:
        CheckpointError: ``how == "same"`` and they differ (each setting, both values).
    """
    diff = [(attr, name) for attr, name in _OUTER if getattr(outer, attr) != config[attr]]
    if not diff:
        return
    told = "; ".join(f"{name}: checkpoint {getattr(outer, attr)!r}, config {config[attr]!r}"
                     for attr, name in diff)
    if how == "same":
        raise CheckpointError(f"{source} was trained with other outer optimizer settings "
                              f"({told}); resume with the checkpoint's values, or set "
                              "checkpoint.optimizer_settings=config to train on with this "
                              "config's")
    for attr, _ in diff:
        setattr(outer, attr, config[attr])
    log.warning("training on with this config's outer optimizer settings, not those of %s: "
                "%s", source, told)


def checkpoint_state(loop, step: int) -> dict:
    """This rank's checkpoint after outer step ``step`` (everything :func:`resume` needs)."""
    ctx = loop.ctx
    return {
        "method": ctx.method, "round": step, "position": loop.position, "replans": loop.replans,
        "cluster": worker_identity(loop.cl), "outer": loop.outer.state_dict(),
        "feedback": {i: fb.state_dict() for i, fb in loop.feedback.items()},
        "local_momentum": {i: m.state_dict() for i, m in loop.local_mom.items()},
        "workers": {i: w.state_dict() for i, w in loop.workers.items()},
        "planner_speed": dict(ctx.planner.speed), "planner_fit": ctx.planner.fit.state_dict(),
        "plan": loop.plan,
        "clock": loop.clock.state_dict() if loop.clock is not None else None,
        "stats": loop.stats.state_dict(), "rng": rng_state(), "history": loop.history,
        "guard": loop.guard.state_dict(), "lr_scale": loop.lr_scales.state_dict(),
        "eager": loop.eager.state_dict() if loop.eager is not None else None,
        "schedules": loop.saved_schedules(step), "schedule_rounds": loop.schedule_rounds,
        "warmup_iters": loop.cfg.train.warmup_iters,  # what sized the schedules
    }


def resume(loop, st: dict) -> None:
    """Continue ``loop`` from a :func:`checkpoint_state` (``checkpoint.load``).

    Raises:
        CheckpointError: another method, cluster, worker set, error-feedback or
            compress_update setting, or no rounds left (each names the fix).
    """
    ctx, g = loop.ctx, loop.g
    if st["method"] != ctx.method:
        raise CheckpointError(f"checkpoint is from method {st['method']}, not {ctx.method}; "
                              f"resume it with geomesh.method={st['method']}")
    check_workers(st, loop.cl)  # before any per-worker state is matched by position
    if set(st["workers"]) != set(loop.workers) or set(st["feedback"]) != set(loop.feedback) or \
            set(st.get("local_momentum", {})) != set(loop.local_mom):
        raise CheckpointError(
            f"checkpoint holds workers {sorted(st['workers'])} with error feedback "
            f"{'on' if st['feedback'] else 'off'} and compress_update "
            f"{'on' if st.get('local_momentum') else 'off'}; this run has workers "
            f"{sorted(loop.workers)} with them {'on' if loop.feedback else 'off'} and "
            f"{'on' if loop.local_mom else 'off'}: resume with the cluster file, "
            "geomesh.error_feedback and geomesh.compress_update it was saved with"
        )
    check_rounds_left(st, g.outer_steps)
    check_warmup(st.get("warmup_iters"), loop.cfg.train, str(loop.cfg.checkpoint.load))
    config = outer_settings(loop.outer)
    loop.outer.load_state_dict(st["outer"])  # copies into θ_global, and the saved settings
    reconcile_outer(loop.outer, config, loop.cfg.checkpoint.optimizer_settings,
                    str(loop.cfg.checkpoint.load))
    for i, fb in loop.feedback.items():
        fb.load_state_dict(st["feedback"][i])
    for i, lm in loop.local_mom.items():
        lm.load_state_dict(st["local_momentum"][i])
    if "schedules" in st:  # the schedules as re-plans resized them, a pending one included
        loop.schedules = [(int(n), int(w)) for n, w in st["schedules"]]
        loop.lr_scales.set_schedules(loop.schedules)
        # they end with the saved run's outer_steps (a resume may raise it); states
        # before the field: this run's, as then
        loop.schedule_rounds = int(st.get("schedule_rounds", g.outer_steps))
    for i, w in loop.workers.items():
        w.load_state_dict(st["workers"][i])  # megatron takes the saved scheduler's lengths:
        w.set_schedule(*loop.schedules[i])  # a re-plan pending at the save is not in them
        # and its peak LR and weight decay, torch the saved Adam betas: the config's or none
        reconcile_optimizer_settings(w.trainer, loop.cfg.train,
                                     loop.cfg.checkpoint.optimizer_settings,
                                     str(loop.cfg.checkpoint.load), lengths=False, can_keep=False)
    take_plan(loop, st["plan"], st["planner_speed"], st.get("planner_fit", {}), st["history"])
    if loop.clock is not None:
        loop.clock.load_state_dict(st["clock"])
    loop.stats.load_state_dict(st["stats"])
    loop.position, loop.start, loop.replans = st["position"], st["round"], st["replans"]
    loop.guard.load_state_dict(st.get("guard", {}))
    if loop.eager is not None and st.get("eager") is not None:
        loop.eager.load_state_dict(st["eager"])
    if "lr_scale" in st:
        loop.lr_scales.load_state_dict(st["lr_scale"])
    else:  # saved before it existed: the same position on every rank
        loop.lr_scales.done = [loop.start * s.inner_steps for s in loop.steps]
    set_rng_state(st["rng"])
    log.info("resumed %s at outer step %d", ctx.method, loop.start)


def heal_state(loop) -> dict:
    """What a live worker hands one that (re)joins (:mod:`geomesh.exchange.region` makes its
    outer tensors and inner moments canonical, so any layout can load it).

    ``inner``: the serving worker's AdamW moments (bf16, :meth:`InnerWorker.adam_moments
    <geomesh.worker.InnerWorker.adam_moments>`), as torchft's DiLoCo heals a replica
    with the inner optimizer's state beside the model's.  Without them a joining
    worker trained its first rounds with zero moments at the others' LR: Adam's first
    step moves every coordinate by the full LR (``m̂/sqrt(v̂) = ±1``), its next ones
    divide by a ``v̂`` of a few samples (RAdam, Liu et al. 2020, §3): its ``Δ_i``
    was 2.4x the live worker's in a real two-region run, and in process at peak LR
    one inner step sent its loss from 6.8 to 9.2.  Re-warming that worker's LR instead would cost
    no bytes, but its ``Δ_i`` would stay small (weighted at its full ``n_i``) for the
    preset's warmup, 10 rounds of ``tiny_gpt`` at ``H = 20``.  Cost: 4 bytes per
    parameter more on the WAN, once per heal (12 instead of 8 with the outer
    momentum)."""
    ctx = loop.ctx
    stats = loop.stats.state_dict()  # the run's totals (tokens, TTP) and its clock, now
    if not ctx.emulated:  # the wall clock runs on between rounds (emulated: the round's)
        stats["scalars"]["time_s"] = time.perf_counter() - loop.t0
    return {"round": loop.r, "position": loop.position, "replans": loop.replans, "stats": stats,
            "members": loop.members, "plan": loop.plan.to_dict(),
            "speed": dict(ctx.planner.speed), "fit": ctx.planner.fit.state_dict(),
            "schedules": loop.saved_schedules(loop.r), "schedule_rounds": loop.schedule_rounds,
            "history": loop.history, "outer": loop.outer.state_dict(),
            "guard": loop.guard.state_dict(), "lr_scale": loop.lr_scales.state_dict(),
            "inner": loop.first.adam_moments()}


def load_heal(loop, st: dict) -> None:
    """Take a live worker's :func:`heal_state`: the round, data position, plan (the
    planner's too) and the step times it re-plans from, outer state, the run's
    statistics (tokens, TTP, its clock), each inner LR schedule where the others'
    is once they trained the round (the state is served in its exchange:
    ``schedule_position`` of round ``r + 1``), and the peer's inner AdamW moments
    (:func:`heal_state`), which replace this worker's own: none when it joins new,
    those of an older point of the run when its restart loaded a checkpoint (a peer
    that has not trained yet sends none: the worker keeps its own).  This worker's
    error-feedback residuals and local outer momentum start afresh."""
    from geomesh.fleet.membership_plan import plan_from_dict
    from geomesh.worker import schedule_position

    ctx = loop.ctx
    loop.r, loop.position, loop.replans = int(st["round"]), int(st["position"]), int(st["replans"])
    if "schedules" in st:
        loop.set_schedules([(int(n), int(w)) for n, w in st["schedules"]])
        loop.schedule_rounds = int(st.get("schedule_rounds", loop.g.outer_steps))
    loop.members = [int(k) for k in st["members"]]
    if "stats" in st:  # the run's tokens, TTP and clock go on from the peer's, not from 0
        loop.stats.load_state_dict(st["stats"])
        loop.t0 = time.perf_counter() - loop.stats.time_s
    loop.outer.load_state_dict(st["outer"])
    loop.guard.load_state_dict(st["guard"])
    # this worker's own exchange state (error-feedback residuals, compress_update's
    # momentum) is of another point of the run, e.g. a checkpoint its restart loaded:
    # start both afresh, as a worker that joins new does
    for fb in loop.feedback.values():
        fb.residuals = {}
    for lm in loop.local_mom.values():
        lm.buffers = {}
    take_plan(loop, plan_from_dict(st["plan"], ctx.planner.tolerance), st["speed"],
              st.get("fit", {}), st.get("history", {}))
    loop.lr_scales.load_state_dict(st.get("lr_scale", {"done": [  # a peer without it
        schedule_position(n, s.inner_steps, loop.r, loop.schedule_rounds)
        for (n, _), s in zip(loop.schedules, loop.steps)]}))
    # the inner LR schedule where the others' is: a heal comes in round r's exchange,
    # after the others trained round r (this worker trains from round r + 1 on)
    for w in loop.workers.values():
        at = schedule_position(loop.schedules[w.index][0], loop.steps[w.index].inner_steps,
                               loop.r + 1, loop.schedule_rounds)
        w.trainer.scheduler.step(increment=max(at - w.trainer.step, 0))
        w.trainer.step = max(w.trainer.step, at)
        if st.get("inner", {}).get("exp_avg"):  # none from a peer yet to train
            w.load_adam_moments(st["inner"])
    log.info("healed from a live peer: round %d", loop.r)


def take_plan(loop, plan: Plan, speed: dict, fit: dict, history: dict) -> None:
    """The plan ``loop`` goes on with and what its planner re-plans from (a resume's or a
    live peer's): the speed corrections and fit, the plan as the planner's current one
    (the same object: a re-plan that keeps it is no re-plan), its proxy steps, and the
    step times measured since it changed.  Regions that take these re-plan alike."""
    ctx = loop.ctx
    ctx.planner.speed = {k: float(v) for k, v in speed.items()}
    ctx.planner.fit.load_state_dict(fit)
    ctx.planner.current = loop.plan = plan
    loop.steps, loop.next_steps = proxy_steps_for(ctx, plan), None
    loop.history = {str(n): [float(x) for x in v] for n, v in history.items()}


def proxy_steps_for(ctx, plan) -> list:
    """Each worker's proxy steps of ``plan`` (:func:`geomesh.worker.proxy_steps`)."""
    from geomesh.worker import proxy_steps

    return proxy_steps(plan, ctx.scale, round_samples=ctx.round_samples,
                       dp_in=ctx.placement.dp_in, max_micro_batch=ctx.cfg.parallel.micro_batch_size)
