"""No error path deletes what a run wrote once it started training.

A GeoMesh real-mode job (one torchft job per region) whose peer region dies
after the first outer step, under ``geomesh.on_worker_loss=fail``, exits with a
one-line error (exit 3, interrupted by a lost peer) — and keeps its run
folder: metrics, config and the checkpoints it saved (train.py used to remove
every folder it had created on any bad-input error, this one included).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.dist_utils import free_port
from tests.test_geomesh_real import SECRET_ENV, _lighthouse

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
    "model.seq_length=32", "parallel.global_batch_size=8", "parallel.micro_batch_size=2",
    "geomesh.inner_steps=2", "geomesh.outer_steps=50", "geomesh.replan=false",
    "train.eval_iters=1", "train.warmup_iters=2", "logging.wandb=disabled",
    "checkpoint.save_interval=1", "geomesh.timeout_s=30", "geomesh.on_worker_loss=fail",
    # keep every checkpoint: on a fast machine both regions finish outer steps 2 and 3
    # within the 0.5 s poll below, and keep_last=2 would rotate outer step 1 out (a
    # deletion the run means, not the error path this test is about)
    "checkpoint.keep_last=0",
]


def _region_job(cluster: Path, region: str, run_dir: Path, cache_dir: str) -> subprocess.Popen:
    # one process per region (a world of 1 each, as `torchrun --nproc-per-node 1` would
    # start), joined at the cluster's rendezvous; exit code and stderr are train.py's own
    cmd = [sys.executable, str(REPO / "train.py"), "--config", "tiny_gpt", "--run-dir", str(run_dir),
           f"data.cache_dir={cache_dir}", f"geomesh.cluster={cluster}", "geomesh.method=geomesh",
           f"geomesh.region={region}", *OVERRIDES]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            env={**os.environ, **SECRET_ENV})


def test_geomesh_job_that_loses_a_region_keeps_its_run_folder(tmp_path, cache_dir):
    """Catches train.py deleting a started run (metrics.jsonl, config.yaml,
    checkpoints/outer_*) because the mid-run loss of a region is reported as a
    bad-input error: the West Europe job is killed once East US has saved outer
    step 1; East US exits with 3 and one error line, and its folder is intact."""
    regions = [{"name": "East US", "id": 0}, {"name": "West Europe", "id": 1}]
    workers = [{"name": "w0", "gpu": "A100-80GB", "region": "East US"},
               {"name": "w1", "gpu": "A100-80GB", "region": "West Europe"}]
    cluster = tmp_path / "two_regions.yaml"
    cluster.write_text(yaml.safe_dump({"name": "lose_one", "mode": "real", "regions": regions,
                                       "workers": workers,
                                       "rendezvous": f"127.0.0.1:{free_port()}"}))
    east, west = tmp_path / "east", tmp_path / "west"
    lighthouse = _lighthouse(cluster)
    jobs = [_region_job(cluster, "East US", east, cache_dir),
            _region_job(cluster, "West Europe", west, cache_dir)]
    try:
        saved = east / "checkpoints" / "outer_0000001" / "COMPLETE"
        deadline = time.monotonic() + 600
        while not saved.is_file():
            assert time.monotonic() < deadline and jobs[0].poll() is None, "no outer step saved"
            time.sleep(0.5)
        os.killpg(jobs[1].pid, signal.SIGKILL)  # the West Europe region dies mid-run
        _, err = jobs[0].communicate(timeout=600)
    finally:
        for job in jobs:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
        lighthouse.kill()
    assert jobs[0].returncode == 3, err[-3000:]
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, err[-3000:]
    assert (east / "config.yaml").is_file() and (east / "metrics.jsonl").read_text().strip()
    assert saved.is_file(), "the checkpoint of outer step 1 was deleted"
