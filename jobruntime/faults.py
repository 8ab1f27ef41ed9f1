"""Fault injection for the fault-tolerance tests and ``bench/faults.py`` (test-only).

``GEOCONA_FAULT=<point>@<n>[/<rank>]`` makes the process of global or job
rank ``<rank>`` (default 0) kill itself with SIGKILL — no cleanup, no
``finally``, as a crash or an out-of-memory kill would — the ``n``-th time
(0-based round or step) it passes the named point.  Points:

* ``train``    GeoMesh: after the worker's inner steps of a round;
* ``exchange`` GeoMesh: after the round's quorum, before the all-gather;
* ``commit``   GeoMesh: after the all-gather, before the outer step commits;
* ``save``     a checkpoint save (GeoMesh's ``outer_``, every other job's
  ``iter_``; ``n`` = the step saved), after this rank wrote its file, before the
  folder is committed;
* ``switch``   CONA: inside a layout switch, after the new model is built,
  before resharding.

``GEOCONA_FAULT_REGION=<region>`` makes ``python -m geomesh.launch_local`` give
``GEOCONA_FAULT`` to that region's job only (every job inherits it otherwise).

Unset (the normal case) it costs one dictionary lookup.  The variable is read
once per process: it configures a test harness, not the product.

:class:`RunInterrupted` is the error of a run stopped by a lost peer (not by
bad input): ``train.py`` prints it on one line on every rank and exits with
code 3, keeping the run folder; the line ends with :func:`resume_advice`
(``--config <folder>/config.yaml --run-dir <folder> checkpoint.load=<folder>/checkpoints``
where the run committed a checkpoint, else that it must start again).  A collective that fails
because a peer process died anywhere else (a checkpoint save, a training step,
an evaluation) is recognised by :func:`peer_lost` and reported the same way,
once, in ``train.py``: GeoMesh and CONA map the losses they expect to their own
messages first.

A Ctrl-C is not a fault: :func:`on_sigint` notes it, ``train.py`` reports it
(:func:`exit_ctrl_c`, exit code 130), and a peer lost after it is not reported.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ENV = "GEOCONA_FAULT"
REGION_ENV = "GEOCONA_FAULT_REGION"
POINTS = ("train", "exchange", "commit", "save", "switch")
_spec = os.environ.get(ENV)


def die_with_parent() -> None:
    """Linux: have this process killed (SIGKILL) when the process that started it dies
    (``prctl(PR_SET_PDEATHSIG)``); elsewhere nothing.  A child's initializer: a helper
    process of a rank must not outlive a rank that was SIGKILLed (no exit handler runs)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG


def fault_point(point: str, n: int) -> None:
    """Kill this process here if ``GEOCONA_FAULT`` names this point, count and rank."""
    if not _spec:
        return
    where, _, rest = _spec.partition("@")
    count, _, rank = rest.partition("/")
    if where != point or int(count or 0) != n:
        return
    if int(rank or 0) != int(os.environ.get("RANK", "0")):
        return
    os.kill(os.getpid(), signal.SIGKILL)


class RunInterrupted(RuntimeError):
    """A run stopped by a lost process, region or lighthouse; resume from its last checkpoint."""


class StopRequested(BaseException):
    """A run asked to stop by SIGTERM (a scheduler's limit, preemption, the launcher):
    ``train.py`` reports it as :class:`RunInterrupted` (one line, exit 3).  Not an
    ``Exception``, as :class:`KeyboardInterrupt` is not: an ``except Exception`` around an
    optional import or a fallback (``jobruntime.kernels``) must not swallow a stop."""


# What gloo, NCCL and the c10d store say when the process at the other end of a
# collective is gone (torch 2.13 raises these as a plain RuntimeError from gloo).
PEER_LOST_SIGNS = (
    "Connection reset by peer", "Connection closed by peer", "Broken pipe",
    "NCCL communicator was aborted", "remote process exited",
)


def peer_lost(e: BaseException) -> str | None:
    """Why ``e`` is a collective's failure because a peer process died, else ``None``.

    Matches :class:`torch.distributed.DistNetworkError` (socket errors of the
    c10d layer) and any ``RuntimeError`` whose message carries one of
    :data:`PEER_LOST_SIGNS` (gloo's transport errors are plain ``RuntimeError``).

    Returns:
        A short reason for a one-line message, e.g. ``"Connection reset by peer"``.
    """
    if not isinstance(e, RuntimeError):
        return None
    text = str(e)
    for sign in PEER_LOST_SIGNS:
        if sign in text:
            return sign
    import torch.distributed as dist

    if isinstance(e, dist.DistNetworkError):
        return text.strip().splitlines()[0][:160] if text.strip() else type(e).__name__
    return None


EXIT_INTERRUPTED = 3
_EXIT = threading.Lock()
# This process's run folder (set by note_run_dir): exit_interrupted's advice reads
# what it holds.  Process-wide because the exit it serves is.
_run_dir: Path | None = None


def note_run_dir(run_dir: str | Path) -> None:
    """Remember this process's run folder for :func:`exit_interrupted`'s advice
    (``jobruntime.parallel.same_run_dir`` calls it on every rank)."""
    global _run_dir
    _run_dir = Path(run_dir)


def resume_command(run_dir: str | Path) -> str | None:
    """``resume with --config <run_dir>/config.yaml --run-dir <run_dir>
    checkpoint.load=<run_dir>/checkpoints (last complete checkpoint: <name>)``: the
    ``train.py`` arguments that go on with this run as it was configured (its saved,
    resolved config: preset and overrides; without that file, no ``--config``) in its
    own folder, one ``metrics.jsonl`` history
    (:func:`jobruntime.outputs.claim_run_folder` lets a run resume from its folder's own
    checkpoints).  ``None`` where ``run_dir/checkpoints`` holds no complete checkpoint
    (:func:`jobruntime.outputs.last_checkpoint`)."""
    from .outputs import last_checkpoint

    if (last := last_checkpoint(run_dir)) is None:
        return None
    config = Path(run_dir) / "config.yaml"
    # a run started from a checkpoint's weights alone: its resume loads the optimizer
    full = " checkpoint.load_optimizer=true" if _weights_only(config) else ""
    return (f"resume with {f'--config {config} ' if config.is_file() else ''}--run-dir {run_dir} "
            f"checkpoint.load={Path(run_dir) / 'checkpoints'}{full} (last complete checkpoint: "
            f"{last})")


def _weights_only(config: Path) -> bool:
    """Whether the run's saved ``config.yaml`` set ``checkpoint.load_optimizer: false`` (a
    fine-tune from a checkpoint's weights; its own checkpoints resume with ``true``)."""
    import yaml

    try:
        saved = yaml.safe_load(config.read_text())
    except (OSError, yaml.YAMLError):
        return False
    section = saved.get("checkpoint") if isinstance(saved, dict) else None
    return isinstance(section, dict) and section.get("load_optimizer") is False


def resume_advice(run_dir: str | Path) -> str:
    """What an interrupted run can do next: :func:`resume_command` where
    ``run_dir/checkpoints`` holds a complete checkpoint; else (``checkpoint.save_interval``
    is 0 by default, and the final checkpoint is written only after the last step) that
    the run starts again, and that ``save_interval`` makes the next one resumable."""
    if (command := resume_command(run_dir)) is not None:
        return command
    return (f"no complete checkpoint was committed in {Path(run_dir) / 'checkpoints'}, so the "
            "run cannot resume: start it again (checkpoint.save_interval=N saves every N steps)")


def exit_interrupted(message: str, *, advice: bool = True) -> None:
    """Print ``error: <message>; <resume advice>`` once per process and exit with
    :data:`EXIT_INTERRUPTED`.  The advice (:func:`resume_advice`) is added once the
    run folder is known (:func:`note_run_dir`) unless ``advice`` is false (the run kept
    nothing to resume from).

    Safe from any thread (a watchdog and the main thread may see the same loss
    at once: the second caller blocks until the process is gone).  No teardown:
    collectives with a lost peer would hang; child processes are killed.

    After a Ctrl-C (:func:`on_sigint`) a lost peer is the Ctrl-C's doing, not a
    fault: the main thread raises :class:`KeyboardInterrupt` (``train.py`` reports
    it, :func:`exit_ctrl_c`); another thread gives it :data:`CTRL_C_GRACE_S` to do
    so, then exits quietly with :data:`EXIT_CTRL_C`.
    """
    if _ctrl_c.is_set():  # the peers stopped with this process: report the Ctrl-C instead
        if threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt  # to train.py's handler (exit_ctrl_c)
        time.sleep(CTRL_C_GRACE_S)
        _EXIT.acquire()
        _exit_now(EXIT_CTRL_C)
    _EXIT.acquire()
    if threading.current_thread() is threading.main_thread():
        # the launcher's SIGTERM, arriving while this exits, raised in train.py's handler
        # mid-exit: a traceback and exit 1 instead of this line and exit 3
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if advice and _run_dir is not None:
        message = f"{message}; {resume_advice(_run_dir)}"
    print(f"error: {message}", file=sys.stderr, flush=True)
    _exit_now(EXIT_INTERRUPTED)


def _exit_now(code: int) -> None:
    # os._exit skips multiprocessing's exit handlers: child processes (megatron's
    # dist_checkpointing starts a Manager server on the first save) would outlive the
    # job, holding its stdout and stderr open, and a launcher reading them would hang.
    for child in multiprocessing.active_children():
        child.kill()
    os._exit(code)


EXIT_CTRL_C = 130  # the shell's code for a process stopped by SIGINT (128 + 2)
CTRL_C_GRACE_S = 5.0
_ctrl_c = threading.Event()


def on_sigint(signum, frame) -> None:
    """SIGINT handler (``train.py``): note that the user stopped the run, then raise
    :class:`KeyboardInterrupt` as Python's own handler does.  The note tells a
    collective that fails next (its peers stopped too) from a lost peer."""
    _ctrl_c.set()
    raise KeyboardInterrupt


def ctrl_c_pressed() -> bool:
    """Whether this process got a SIGINT through :func:`on_sigint`."""
    return _ctrl_c.is_set()


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the block runs, then call the handler in place
    before for the first that came (SIGINT first: a Ctrl-C is the user's), as if it
    arrived then; its exception (``KeyboardInterrupt``, :class:`StopRequested`) leaves
    the block.  A stop waits for the block's end: keep it to imports.

    For imports: an exception that a handler raises inside ``import torch`` can be
    caught by the importing module's own ``try``/``except`` and leave a half-initialised
    module (``numpy`` without ``matrix``, a traceback and exit 1), or cross C++ code and
    abort the process (``pybind11::error_already_set``, exit -6).  A signal that is
    ignored stays ignored; outside the main thread (no signal handlers there) nothing is
    held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    held: dict[int, Any] = {}
    try:
        for s in (signal.SIGINT, signal.SIGTERM):
            if (handler := signal.getsignal(s)) not in (signal.SIG_IGN, None):
                held[s] = handler
                signal.signal(s, lambda signum, frame: got.append(signum))
        yield
    finally:
        for s, handler in held.items():
            signal.signal(s, handler)
        if got:
            s = min(got)
            if callable(held[s]):
                held[s](s, None)
            else:  # SIG_DFL: the default action, now
                os.kill(os.getpid(), s)


def exit_ctrl_c(report: Callable[[], None] | None = None) -> None:
    """Exit with :data:`EXIT_CTRL_C` after a Ctrl-C, once per process: ``report`` (the
    partial summary and one line of rank 0, train.py) runs first, while other threads
    that would exit (:func:`exit_interrupted`) wait.  No teardown, as there: peers
    stopped mid-collective would make it hang."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the report
    _ctrl_c.set()
    _EXIT.acquire()
    try:
        if report is not None:
            report()
    finally:
        sys.stdout.flush()
        _exit_now(EXIT_CTRL_C)
