"""Output folders: refuse, with the flag and the fix, a path that can never be a folder,
before anything is computed or written; and give every run a folder of its own.

A run folder is created exclusively (``mkdir`` without ``exist_ok``) and locked for the
life of the process (``flock`` on the folder), so two runs started in the same second, or
given the same ``--run-dir``, never write into one folder.
"""

from __future__ import annotations

import fcntl
import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path

# What a run writes from its first logged step on: a folder holding any of them holds a
# run's results (train.py keeps such a folder on every error path).
RUN_OUTPUTS = ("metrics.jsonl", "summary.json", "checkpoints")


def saved_checkpoints(root: str | Path, prefix: str = "*") -> list[Path]:
    """The complete checkpoint folders ``root/<prefix>_*`` in the order they were saved,
    oldest first.

    Complete: holding its ``COMPLETE`` marker (:mod:`jobruntime.checkpoint`); a ``.tmp``
    folder of a save cut short is not.  Saved: the time the marker records
    (``saved_ns``, written at the commit; a copy of the folder keeps it), else, for a
    marker from before it, the marker's modification time; folder names break ties.
    Not by name alone: a run resumed from an older checkpoint of its folder
    (``iter_0000004`` while ``iter_0000008`` exists) saves ``iter_0000005`` after
    ``iter_0000008``.

    Args:
        root: a ``checkpoints/`` folder (it need not exist: then ``[]``).
        prefix: ``iter`` (ordinary and CONA runs), ``outer`` (GeoMesh), ``*`` both.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    marks = [m for m in root.glob(f"{prefix}_*/COMPLETE") if not m.parent.name.endswith(".tmp")]
    stamped = []
    for m in marks:
        try:
            text, mtime = m.read_text(errors="replace"), m.stat().st_mtime_ns
        except FileNotFoundError:  # removed meanwhile (another process's rotation)
            continue
        saved = [int(w[1]) for w in (ln.split() for ln in text.splitlines())
                 if len(w) == 2 and w[0] == "saved_ns" and w[1].isdigit()]
        stamped.append((saved[0] if saved else mtime, m.parent.name, m.parent))
    return [p for _, _, p in sorted(stamped)]


def last_checkpoint(run_dir: str | Path) -> str | None:
    """The newest complete checkpoint in ``run_dir/checkpoints``, else ``None``.

    Newest: the one ``checkpoints/latest`` names (the last save), else the last saved
    (:func:`saved_checkpoints`).  Complete: an ``iter_*`` (or GeoMesh ``outer_*``) folder
    holding its ``COMPLETE`` marker (:mod:`jobruntime.checkpoint`).  What every piece of
    resume advice asks before it suggests ``checkpoint.load``: with
    ``checkpoint.save_interval=0`` (the default) a run interrupted before its last step
    has none.

    Returns:
        The folder's name, e.g. ``"iter_0000020"``.
    """
    root = Path(run_dir) / "checkpoints"
    try:
        named = (root / "latest").read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = ""
    if named and "/" not in named and (root / named / "COMPLETE").is_file():
        return named
    done = saved_checkpoints(root)
    return done[-1].name if done else None


def round_folder(step: int) -> str:
    """A GeoMesh checkpoint's folder name after ``step`` outer steps, ``outer_XXXXXXX``
    (:func:`geomesh.state.save_state`)."""
    return f"outer_{step:07d}"


def saved_rounds(run_dir: str | Path) -> list[int]:
    """The outer steps of the complete GeoMesh checkpoints in ``run_dir/checkpoints``
    (:func:`round_folder` folders holding their ``COMPLETE`` marker), ascending."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = (re.fullmatch(r"outer_([0-9]{7,})", p.parent.name, re.ASCII)
             for p in root.glob("outer_*/COMPLETE"))
    return sorted(int(m.group(1)) for m in found
                  if m is not None and m.group(0) == round_folder(int(m.group(1))))


def save_run_inputs(cfg, tokenizer, run_dir: Path) -> None:
    """What makes a run folder self-contained, written by the logging rank of every job
    kind (plain, CONA, GeoMesh): ``config.yaml`` (the resolved config,
    :func:`jobruntime.config.save_config`; ``--config`` of a resume) and the tokenizer
    file (:func:`jobruntime.tokenizer.save_tokenizer_file`; for the tools' conversion
    and evaluation), each written to a temporary name and renamed."""
    from .config import save_config
    from .tokenizer import save_tokenizer_file

    save_config(cfg, run_dir / "config.yaml")
    save_tokenizer_file(tokenizer, run_dir)


def output_folder_error(path: str | Path, flag: str) -> str | None:
    """Why ``path`` cannot be used (or created) as a folder, else ``None``.

    A folder cannot be created where the path, or the nearest existing folder above it,
    is a file (``mkdir`` would raise ``FileExistsError`` / ``NotADirectoryError`` only
    after the work was done).

    Args:
        path: the folder (it need not exist).
        flag: the command-line flag or config key that named it, for the message.
    """
    path = Path(path)
    for q in (path, *path.absolute().parents):
        if not q.exists():
            continue
        if q.is_dir():
            return None
        if q == path:
            return f"{flag} {path} is a file; give a folder (it is created if missing)"
        return f"{flag} {path} lies under {q}, which is a file; give a folder path"
    return None


def refuse_output_folder(parser, path: str | Path | None, flag: str = "--out") -> None:
    """``parser.error`` (exit 2, usage and one line) if ``path`` cannot be a folder
    (:func:`output_folder_error`): for benches, before a run whose report would be lost."""
    if path is not None and (problem := output_folder_error(path, flag)):
        parser.error(problem)


def new_folder(stem: str | Path) -> Path:
    """Create and return a folder that did not exist: ``stem``, else ``stem-2``, ``stem-3``, ….

    For default output names such as ``runs/<preset>-<YYYYmmdd-HHMMSS>``, whose one-second
    resolution gives runs started together the same name.  ``mkdir`` without ``exist_ok``
    is atomic, so of two processes racing for one name exactly one gets it.
    """
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = stem if n == 1 else stem.with_name(f"{stem.name}-{n}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


class RunFolderError(ValueError):
    """A run folder that another run holds or already used; the message names the fix."""


@dataclass
class RunFolder:
    """The folder of one run, created or checked by :func:`claim_run_folder`.

    Attributes:
        path: the folder.
        created: whether this claim created it (an error before any training output
            may then remove it whole).
        fd: an open descriptor of the folder holding an exclusive ``flock`` until the
            process exits (also on SIGKILL: the kernel drops the lock).
    """

    path: Path
    created: bool
    fd: int

    def release(self) -> None:
        """Drop the lock (at the end of the run; process exit drops it too)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def claim_run_folder(run_dir: str | Path | None, default: str | Path, *,
                     resume_from: str | Path | None = None, flag: str = "--run-dir") -> RunFolder:
    """Create or take the folder of one run, exclusively.

    Without ``run_dir`` a new folder is made from ``default`` (:func:`new_folder`).  A
    named ``run_dir`` is created if missing; if it exists it must hold no run's results
    (:data:`RUN_OUTPUTS`), unless this run resumes from a checkpoint inside it
    (``resume_from``: ``checkpoint.load`` when ``checkpoint.load_optimizer`` is true).
    Either way the folder is locked for the life of the process.

    Raises:
        RunFolderError: the folder is in use by a running process, or holds the results
            of a run that this one does not resume.
    """
    if run_dir is None:
        path, created = new_folder(default), True
    else:
        path = Path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
            created = True
        except FileExistsError:
            created = False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunFolderError(f"{flag} {path} is in use by another running job; give another "
                             f"folder (or omit {flag} for a new one)") from None
    held = [name for name in RUN_OUTPUTS if (path / name).exists()]
    resumes = resume_from is not None and Path(resume_from).resolve().is_relative_to(path.resolve())
    if held and not resumes:
        os.close(fd)
        if last_checkpoint(path) is None:  # an interrupted run that saved nothing
            raise RunFolderError(
                f"{flag} {path} already holds a run's results ({', '.join(held)}) but no "
                "complete checkpoint, so there is nothing to resume from; give a new folder")
        raise RunFolderError(
            f"{flag} {path} already holds a run's results ({', '.join(held)}); give a new "
            f"folder, or resume that run with checkpoint.load={path / 'checkpoints'} and "
            "checkpoint.load_optimizer=true (a weights-only load starts a new run)")
    return RunFolder(path=path, created=created, fd=fd)
