"""Run a function on N real gloo processes and collect each rank's return value.

Importing megatron-core costs ~5 s per process, so tests group several
checks into one launch.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.spawn(_entry, args=(world_size, free_port(), out, fn, args), nprocs=world_size,
                       join=False)
        deadline = time.monotonic() + timeout_s
        # join() returns when any one rank exits; loop until all have.
        while not ctx.join(max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for proc in ctx.processes:
                    proc.kill()
                raise RuntimeError(f"ranks did not finish within {timeout_s} s")
        results = []
        for r in range(world_size):
            f = Path(out) / f"rank{r}.pkl"
            if not f.is_file():
                raise RuntimeError(f"rank {r} produced no result")
            status, value = pickle.loads(f.read_bytes())
            if status != "ok":
                raise RuntimeError(f"rank {r} failed: {value}")
            results.append(value)
        return results
