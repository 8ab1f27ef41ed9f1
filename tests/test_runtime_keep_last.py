"""``checkpoint.keep_last`` keeps the checkpoints saved last, not the highest steps.

A run folder holds ``iter_0000004`` and ``iter_0000008`` (saved by an earlier run); the run is resumed from
``iter_0000004`` in the same folder and saves steps 5, 6, 7.  Checkpoint folders here are
committed by :func:`jobruntime.checkpoint.committed_folder` itself (what every save,
ordinary, CONA and GeoMesh, goes through) without a model: the rotation does not look
inside them.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def _save(root: Path, step: int, keep_last: int) -> None:
    from jobruntime.checkpoint import committed_folder

    with committed_folder(root, f"iter_{step:07d}", keep_last=keep_last) as tmp:
        (tmp / "common.pt").write_text(str(step))


def _kept(root: Path) -> list[str]:
    return sorted(p.name for p in root.glob("iter_*"))


def _earlier_run(root: Path) -> None:
    _save(root, 4, 0)
    _save(root, 8, 0)


def test_keep_last_1_never_deletes_the_checkpoint_just_saved(tmp_path):
    """Catches rotation by folder name: with ``keep_last=1`` the save of step 5 deleted
    ``iter_0000005`` itself (``iter_0000008`` sorts after it), ``latest`` named a folder
    that no longer existed and ``find_checkpoint`` fell back to the abandoned step 8.
    Now the one just saved is kept, the two older saves deleted, and loading the folder
    resumes at step 5; the resume advice names it too."""
    from jobruntime.checkpoint import find_checkpoint
    from jobruntime.outputs import last_checkpoint

    root = tmp_path / "checkpoints"
    _earlier_run(root)
    _save(root, 5, 1)
    assert _kept(root) == ["iter_0000005"]
    assert find_checkpoint(root).name == "iter_0000005"
    assert last_checkpoint(tmp_path) == "iter_0000005"


def test_keep_last_2_keeps_the_last_saves_and_drops_stale_higher_steps(tmp_path):
    """Catches stale checkpoints kept for good: by name, ``keep_last=2`` after a resume
    from step 4 kept ``iter_0000008`` (the abandoned run's) through every later save
    and rotated the new ones away.  Now each save keeps itself and the one saved just
    before: {8, 5}, then {5, 6}, then {6, 7}."""
    root = tmp_path / "checkpoints"
    _earlier_run(root)
    seen = []
    for step in (5, 6, 7):
        _save(root, step, 2)
        seen.append(_kept(root))
    assert seen == [["iter_0000005", "iter_0000008"], ["iter_0000005", "iter_0000006"],
                    ["iter_0000006", "iter_0000007"]]


@pytest.mark.parametrize("keep_last, kept", [(0, 4), (2, 2), (3, 3)])
def test_keep_last_in_an_uninterrupted_run(tmp_path, keep_last, kept):
    """The ordinary case is unchanged: saves of steps 1..4 keep the last ``keep_last``
    (0 keeps all), even when the saves come faster than the file system's clock
    resolution (equal times: ties go by name)."""
    root = tmp_path / "checkpoints"
    for step in range(1, 5):
        _save(root, step, keep_last)
    assert _kept(root) == [f"iter_{s:07d}" for s in range(5 - kept, 5)]


def test_a_copied_run_folder_keeps_its_save_order(tmp_path):
    """Catches the order read from the markers' modification times alone: a copy of the
    run folder (``cp -r``, another disk) dates each marker by when it was copied, here
    ``iter_0000004`` last, and a resume from the latest (step 8) saving step 12 with
    ``keep_last=2`` then kept {4, 12} and deleted step 8.  The marker records its save
    time (``saved_ns``), which a copy keeps."""
    import shutil

    from jobruntime.checkpoint import COMPLETE

    src, root = tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints"
    _earlier_run(src)
    root.mkdir(parents=True)
    shutil.copy2(src / "latest", root / "latest")
    for step, age in ((8, 50), (4, 10)):  # copied 8 first: 4's marker is the newer file
        shutil.copytree(src / f"iter_{step:07d}", root / f"iter_{step:07d}")
        t = time.time() - age
        os.utime(root / f"iter_{step:07d}" / COMPLETE, (t, t))
    _save(root, 12, 2)
    assert _kept(root) == ["iter_0000008", "iter_0000012"]


def test_a_geomesh_resume_without_latest_takes_the_checkpoint_saved_last(tmp_path):
    """Catches ``geomesh.state.find_state`` taking the highest name when ``latest`` is
    missing (the abandoned ``outer_0000003`` of a run resumed from round 1, break-test
    helper); the resume advice (``last_checkpoint``) already named the last save."""
    from geomesh.state import find_state
    from jobruntime.checkpoint import committed_folder
    from jobruntime.outputs import last_checkpoint

    root = tmp_path / "checkpoints"
    for step in (1, 3, 2):  # round 3 of the first run, then round 2 of the resumed one
        with committed_folder(root, f"outer_{step:07d}", keep_last=0) as tmp:
            (tmp / "rank00000.pt").write_text(str(step))
    (root / "latest").unlink()
    assert find_state(root).name == "outer_0000002"
    assert last_checkpoint(tmp_path) == "outer_0000002"
