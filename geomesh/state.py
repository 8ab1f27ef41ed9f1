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
