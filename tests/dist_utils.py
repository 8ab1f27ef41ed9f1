"""Run a function on N real gloo processes and collect each rank's return value.

Importing megatron-core costs ~5 s per process, so tests group several
checks into one launch.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp

from jobruntime.ports import free_port

__all__ = ["child_env", "free_port", "launch", "launch_jobs", "popen_ranks"]

PROCESS_GROUP_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE",
                     "LOCAL_WORLD_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    """This test process's environment for a child (``train.py``, a launcher), less the
    process-group variables: an in-process test of this pytest worker initialised
    ``torch.distributed`` (:func:`jobruntime.parallel.init_distributed` sets them) and
    its store still listens on that ``MASTER_PORT``, so a child that inherited them
    failed with EADDRINUSE (clean-clone CI, under xdist).  ``extra`` is added."""
    return {**{k: v for k, v in os.environ.items() if k not in PROCESS_GROUP_ENV}, **extra}


def popen_ranks(cmd: list[str], world_size: int, cwd: Path, **env: str) -> list:
    """Start ``cmd`` as ``world_size`` processes with the environment torchrun gives its
    workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, a free ``MASTER_PORT``), stdout and
    stderr to pipes (text), one thread each; ``env`` is added to every process's.  SIGINT
    starts at its default, as in a terminal's foreground job: a test session run in the
    background (``&``) has it ignored, and ``train.py`` keeps an ignored SIGINT ignored."""
    import signal
    import subprocess

    port = free_port()
    return [subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env={**child_env(), "MASTER_ADDR": "127.0.0.1",
                                             "MASTER_PORT": str(port), "RANK": str(r),
                                             "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size),
                                             "OMP_NUM_THREADS": "1", **env},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            for r in range(world_size)]


def _entry(rank, world_size, port, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    from jobruntime.logging_utils import setup_logging

    setup_logging()
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # report to the parent instead of hanging
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        from jobruntime.parallel import shutdown

        try:
            shutdown()
        except Exception:
            pass
    (Path(out_dir) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def launch(fn, world_size: int, *args, timeout_s: float = 600):
    """Run ``fn(*args)`` on ``world_size`` spawned ranks; return their results by rank.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message) or died.
    """
    return _spawn(_entry, world_size, lambda out: (world_size, free_port(), out, fn, args),
                  timeout_s)


def _job_entry(job, ports, out_dir, fn, args):
    _entry(0, 1, ports[job], str(Path(out_dir) / f"job{job}"), fn, (job, *args))
    (Path(out_dir) / f"job{job}" / "rank0.pkl").rename(Path(out_dir) / f"rank{job}.pkl")


def launch_jobs(fn, num_jobs: int, *args, timeout_s: float = 600):
    """Run ``fn(job, *args)`` in ``num_jobs`` independent one-process jobs, each its
    own world of size 1 (its own ``MASTER_PORT``): separate torchft replica groups,
    whose only link is what ``fn`` builds (a Manager and a lighthouse).

    Raises:
        RuntimeError: a job raised (its traceback is in the message) or died.
    """
    def entry_args(out):
        for j in range(num_jobs):
            (Path(out) / f"job{j}").mkdir()
        return ([free_port() for _ in range(num_jobs)], out, fn, args)

    return _spawn(_job_entry, num_jobs, entry_args, timeout_s)


def _spawn(entry, nprocs: int, entry_args, timeout_s: float) -> list:
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.spawn(entry, args=entry_args(out), nprocs=nprocs, join=False)
        deadline = time.monotonic() + timeout_s
        # join() returns when any one rank exits; loop until all have.
        while not ctx.join(max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise RuntimeError(f"ranks did not finish within {timeout_s} s")
        results = []
        for r in range(nprocs):
            f = Path(out) / f"rank{r}.pkl"
            if not f.is_file():
                raise RuntimeError(f"rank {r} produced no result")
            status, value = pickle.loads(f.read_bytes())
            if status != "ok":
                raise RuntimeError(f"rank {r} failed: {value}")
            results.append(value)
        return results
