"""Where ``python -m geomesh.launch_local --resume`` goes on from, and what a stopped run is told.

A synchronous GeoMesh run's regions hold the same ``θ_global`` after every round, so a
resumed run must start every region from the *same* round.  Each region saves its own
``checkpoints/outer_XXXXXXX`` folder (:mod:`geomesh.state`), and a run stopped while they
save (one region's save done, another's cut short or not begun) holds different last rounds
in different regions.  Each region going on from its own newest checkpoint then trains from
another round: measured before this module, two regions one round apart each rejected the
other's messages and finished alone, exit 0, on different weights.  So every region goes on
from the newest round that *all* of them hold complete (``checkpoint.keep_last``, 2 by
default, keeps the round before the last), loaded by name; where no round is common the
resume is refused, naming each region's rounds.  A region's rounds after that one are set
aside (:func:`set_aside_newer`): the run trains them again, and a later resume must not find
an abandoned round beside a retrained one under the same name.  Inside the jobs, a peer at
another round is refused too (:class:`geomesh.wire.codec.OtherRoundError`), for regions
started by hand.

Light on purpose: imports no torch (the launcher starts in a second).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from jobruntime.outputs import round_folder, saved_rounds


class LaunchError(ValueError):
    """Bad input to the launcher; the message names the problem and the fix (exit 2)."""


class _Region(Protocol):  # geomesh.launch_local.RegionJob
    region: str
    run_dir: Path


def resume_round(jobs: Sequence[_Region], outer_steps: int) -> int:
    """The round every region of a ``--resume`` goes on from: the newest one that every
    region's ``run_dir/checkpoints`` holds complete (module docstring).

    Args:
        jobs: the regions (``region`` name, ``run_dir`` folder), in region-id order.
        outer_steps: the run's ``geomesh.outer_steps`` (with a resume's overrides).

    Returns:
        the round (outer steps done), ``< outer_steps``.

    Raises:
        LaunchError: a region without a complete checkpoint (the first such, named), no
            round common to every region (each region's rounds named), or the round at
            ``outer_steps`` already (nothing left to run).
    """
    rounds = {j.region: saved_rounds(j.run_dir) for j in jobs}
    for j in jobs:
        if not rounds[j.region]:
            raise LaunchError(f"--resume: {j.run_dir} holds no complete checkpoint, so region "
                              f"{j.region!r} cannot go on (checkpoint.save_interval=N saves "
                              "every N outer steps); start the run again with a new --run-dir")
    common = set.intersection(*(set(r) for r in rounds.values()))
    if not common:
        held = "; ".join(f"{name!r} {', '.join(map(str, r))}" for name, r in rounds.items())
        raise LaunchError(f"--resume: the regions hold no outer step in common ({held}), and "
                          "every region must go on from the same one (a later run keeps more "
                          "with checkpoint.keep_last=0 or a larger one); start the run again "
                          "with a new --run-dir")
    step = max(common)
    if step >= outer_steps:
        raise LaunchError(f"--resume: every region saved outer step {step} of "
                          f"geomesh.outer_steps={outer_steps}: nothing left to run; raise "
                          "geomesh.outer_steps to train further")
    return step


def resume_load(job: _Region, step: int) -> str:
    """The ``checkpoint.load=...`` override that resumes ``job`` at round ``step``."""
    return f"checkpoint.load={job.run_dir / 'checkpoints' / round_folder(step)}"


def set_aside_newer(jobs: Sequence[_Region], step: int) -> str | None:
    """Before a resume at ``step``: move each region's complete rounds after ``step`` into
    ``checkpoints/superseded/`` (kept, out of every search for a checkpoint: those look at
    ``checkpoints/`` itself) and point its ``latest`` at ``step``'s folder.

    Returns:
        one line naming what moved, or ``None`` where every region's newest is ``step``.
    """
    moved = []
    for j in jobs:
        root = j.run_dir / "checkpoints"
        newer = [n for n in saved_rounds(j.run_dir) if n > step]
        for n in newer:
            aside, k = root / "superseded" / round_folder(n), 1
            while aside.exists():  # an earlier resume set aside the same round
                aside, k = aside.with_name(f"{round_folder(n)}.{k}"), k + 1
            aside.parent.mkdir(exist_ok=True)
            (root / round_folder(n)).rename(aside)
        if newer:
            tmp = root / ".latest.tmp"
            tmp.write_text(round_folder(step) + "\n")
            tmp.replace(root / "latest")
            moved.append(f"{j.region!r} saved {max(newer)}")
    if not moved:
        return None
    return (f"resuming every region at outer step {step}, the newest all of them saved ("
            + ", ".join(moved) + "; the later rounds are trained again, their checkpoints "
            "moved to checkpoints/superseded/)")


def resume_hint(jobs: Sequence[_Region], cluster: str, run_dir: Path, outer_steps: int,
                overrides: Sequence[str] = ()) -> str:
    """What a failed or stopped run can do next, one line: this launcher's ``--resume``
    command where the regions can go on (:func:`resume_round`), else why not (no region
    saved; else the reason :func:`resume_round` gives).  A region's own ``train.py``
    advice names its torchrun job alone.

    Args:
        cluster: ``--cluster`` as given; run_dir: the run's folder; outer_steps: the run's
            ``geomesh.outer_steps``.
        overrides: repeated in the command: a ``--resume``'s own (``geomesh.outer_steps=6``
            of a finished run is in no region's ``config.yaml`` until it saves again).
    """
    if not any(saved_rounds(j.run_dir) for j in jobs):
        return ("cannot resume: no region saved a complete checkpoint "
                "(checkpoint.save_interval=N saves every N outer steps); start the run again "
                "with a new --run-dir")
    try:
        resume_round(jobs, outer_steps)
    except LaunchError as e:
        return f"cannot resume: {str(e).removeprefix('--resume: ')}"
    command = ["python", "-m", "geomesh.launch_local", "--cluster", cluster,
               "--run-dir", str(run_dir), "--resume", *overrides]
    return f"go on with: {shlex.join(command)}"
