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

import os
from pathlib import Path

import torch

from geomesh.cluster import ClusterSpec
from geomesh.planner import Plan, WorkerPlan
from jobruntime.checkpoint import COMPLETE, CheckpointError, committed_folder
from jobruntime.faults import fault_point


def save_state(root: Path, step: int, state: dict, *, rank: int, job_leader: bool,
               keep_last: int = 2) -> Path:
    """Write this rank's ``state`` into ``root/outer_<step>`` (collective over the world)."""
    name = f"outer_{step:07d}"
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
    done = sorted(p for p in path.glob("outer_*") if (p / COMPLETE).is_file())
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
        with torch.serialization.safe_globals([Plan, WorkerPlan]):
            state = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - truncated zip, unpickling errors, disallowed globals
        raise CheckpointError(
            f"'{f}' is damaged ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}); "
            "resume from "
            "an earlier outer_XXXXXXX folder or start without checkpoint.load"
        ) from None
    if not isinstance(state, dict) or not {"method", "round", "outer"} <= set(state):
        raise CheckpointError(f"'{f}' is not a GeoMesh state (no method, round and outer state); "
                              "resume from an earlier outer_XXXXXXX folder")
    return state
