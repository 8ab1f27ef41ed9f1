"""Process trees of a local launcher: start, stop, and leave no orphans (Linux).

``torchrun`` starts each worker in a session of its own, so a process-group
signal to torchrun never reaches its workers; what reaches them is torchrun's
own handling of SIGTERM (it stops its workers, then exits), or a signal to each
descendant found in ``/proc``.  A worker whose torchrun died without stopping
it (SIGKILL, out of memory) would be re-parented to init and lost; with
:func:`become_subreaper` it is re-parented to the launcher instead, and
:func:`sweep_orphans` ends it.  Used by :mod:`geomesh.launch_local`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> bool:
    """Make orphaned descendants children of this process (``prctl(PR_SET_CHILD_SUBREAPER)``).

    Returns:
        ``False`` where the call is not available (not Linux); then an orphan
        of a dead torchrun is not found by :func:`sweep_orphans`.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def start_tree(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own, stdout and stderr appended to ``log``.

    Its own session keeps a terminal's Ctrl-C from reaching it directly: the
    launcher stops its children in order (:func:`stop_trees`).
    """
    with open(log, "ab") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)


def _parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every process now in ``/proc``."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = Path(f"/proc/{name}/stat").read_text()
            except OSError:  # exited while listing
                continue
            out[int(name)] = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold ")"
    return out


def descendants(pid: int) -> list[int]:
    """Pids of every living descendant of ``pid`` (children first)."""
    kids: dict[int, list[int]] = {}
    for p, parent in _parents().items():
        kids.setdefault(parent, []).append(p)
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(0), []):
            out.append(c)
            todo.append(c)
    return out


def _kill(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def stop_trees(procs: list[subprocess.Popen], grace_s: float) -> list[int]:
    """Stop process trees: SIGTERM to each root, SIGKILL to every tree still alive after ``grace_s`` s.

    torchrun forwards SIGTERM to its workers and waits for them; ``train.py``
    stops on it with exit code 3.  The roots share one grace period, so stopping
    four regions takes ``grace_s`` at most, not four times it.

    Returns:
        Each root's exit code (negative: the signal that ended it).
    """
    _kill([p.pid for p in procs if p.poll() is None], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            _kill([*descendants(p.pid), p.pid], signal.SIGKILL)
    return [p.wait() for p in procs]


def sweep_orphans(roots: set[int]) -> list[int]:
    """Kill and reap every child of this process that is not one of ``roots``.

    With :func:`become_subreaper`, such a child is an orphan of a tree whose
    root exited (a torchrun worker, a checkpoint writer).  Reaping only these
    pids leaves the roots to their ``Popen`` objects.

    Returns:
        The pids killed.
    """
    me = os.getpid()
    orphans = [p for p, parent in _parents().items() if parent == me and p not in roots]
    for p in orphans:
        _kill([*descendants(p), p], signal.SIGKILL)
        try:
            os.waitpid(p, 0)
        except ChildProcessError:
            pass
    return orphans
