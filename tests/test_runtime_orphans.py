"""A rank killed by SIGKILL leaves no helper process behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.dist_utils import child_env

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import os, signal
if __name__ == "__main__":
    from jobruntime.checkpoint import save_queue_dies_with_rank
    save_queue_dies_with_rank()  # what save_checkpoint does before dist_checkpointing.save
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa
    q = fa._get_write_results_queue()  # what dist_checkpointing.save asks for
    q.put(1)
    assert q.get() == 1
    print(q._manager._process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_checkpoint_queue_server_dies_with_a_killed_rank(tmp_path):
    """Catches megatron-core's dist_checkpointing queue server (a spawned multiprocessing
    manager, started on a rank's first save) outliving a SIGKILLed rank: it stayed for good
    (one ~270 MB process per killed rank, found 36 min after bench/faults.py's CONA switch
    scenario)."""
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out.txt"
    with out.open("w") as f:  # a file, not a pipe: a surviving server would hold a pipe open
        proc = subprocess.run([sys.executable, str(probe)], cwd=REPO, stdout=f,
                              stderr=subprocess.DEVNULL, timeout=300,
                              env={**child_env(), "PYTHONPATH": str(REPO)})
    assert proc.returncode == -9
    pid = int(out.read_text().split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.kill(pid, 9)
    raise AssertionError(f"the checkpoint queue server {pid} outlived its killed rank")
