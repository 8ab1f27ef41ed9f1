"""No error path deletes what a run wrote once it started training.

A GeoMesh real-mode job (one torchft job per region) whose peer region dies
after the first outer step, under ``geomesh.on_worker_loss=fail``, exits with a
one-line error (exit 3, interrupted by a lost peer) — and keeps its run
folder: metrics, config and the checkpoints it saved (train.py used to remove
every folder it had created on any bad-input error, this one included).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.dist_utils import child_env, free_port
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
                            env={**child_env(), **SECRET_ENV})


@pytest.mark.slow  # ~70-85 s; a lost region's one line: test_geomesh_launch (fast tier)
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


def _fake_runs(monkeypatch, tmp_path):
    """``train.main`` with the training replaced by a stub that writes a run's results
    (metrics.jsonl, summary.json naming the run) into the folder it was given, and a
    clock frozen inside one second, as for runs of a sweep started together."""
    import time as time_module

    import jobruntime.loop
    import train

    seen = []

    def fake_run(cfg, run_dir):
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        seen.append(run_dir)
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        (run_dir / "summary.json").write_text(f'{{"lr": {cfg.train.lr}}}')
        return {}

    monkeypatch.setattr(jobruntime.loop, "run", fake_run)
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # keep pytest's SIGTERM handler
    monkeypatch.setattr(time_module, "strftime", lambda fmt, *a: "20260101-000000")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RANK", raising=False)
    return train.main, seen


def test_runs_started_in_one_second_get_folders_of_their_own(monkeypatch, tmp_path, capsys):
    """Catches the default ``runs/<preset>-<YYYYmmdd-HHMMSS>`` folder being reused: three
    runs of a learning-rate sweep started in the same second wrote into one folder, and
    only the last run's summary survived.  Each run must get a new folder (mkdir without
    exist_ok, a -2, -3 suffix on collision), holding its own results."""
    main, seen = _fake_runs(monkeypatch, tmp_path)
    for lr in ("1e-3", "2e-3", "3e-3"):
        assert main(["--config", "tiny_gpt", f"train.lr={lr}"]) == 0, capsys.readouterr().err
    assert len(set(seen)) == 3, seen
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [
        "tiny_gpt-20260101-000000", "tiny_gpt-20260101-000000-2", "tiny_gpt-20260101-000000-3"]
    lrs = sorted(json.loads((p / "summary.json").read_text())["lr"] for p in seen)
    assert lrs == [1e-3, 2e-3, 3e-3]


def test_a_named_run_folder_is_never_shared(monkeypatch, tmp_path, capsys):
    """Catches an explicit ``--run-dir`` reused by a second run: one that holds a run's
    results is refused in one line (exit 2) unless the run resumes from a checkpoint
    inside it; one held by a running job is refused even while still empty."""
    from jobruntime.outputs import claim_run_folder

    main, seen = _fake_runs(monkeypatch, tmp_path)
    run = tmp_path / "sweep"
    assert main(["--config", "tiny_gpt", "--run-dir", str(run)]) == 0
    before = (run / "summary.json").read_text()

    def refused(*args, needle):
        assert main(["--config", "tiny_gpt", *args]) == 2
        lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines

    capsys.readouterr()
    refused("--run-dir", str(run), "train.lr=5e-3", needle="already holds a run's results")
    # a fine-tune from its weights is a new run, not a resume
    refused("--run-dir", str(run), f"checkpoint.load={run / 'checkpoints'}",
            "checkpoint.load_optimizer=false", needle="already holds")
    # a resume of another run's checkpoint is not this folder's run either
    refused("--run-dir", str(run), f"checkpoint.load={tmp_path / 'other' / 'checkpoints'}",
            needle="already holds")
    assert (run / "summary.json").read_text() == before and len(seen) == 1
    assert main(["--config", "tiny_gpt", "--run-dir", str(run),
                 f"checkpoint.load={run / 'checkpoints'}"]) == 0  # resuming its own run
    held = claim_run_folder(tmp_path / "busy", "unused")  # a job running in it, no output yet
    try:
        refused("--run-dir", str(tmp_path / "busy"), needle="in use by another running job")
    finally:
        held.release()
    assert main(["--config", "tiny_gpt", "--run-dir", str(tmp_path / "busy")]) == 0


def test_a_rank_lost_in_a_checkpoint_save_is_one_line_exit_3(tmp_path, cache_dir):
    """Catches an ordinary (not GeoMesh, not CONA) job whose peer dies: rank 1 is killed
    (SIGKILL) inside the checkpoint save of step 2, after writing its shard and before the
    commit; rank 0's next collective fails in gloo ("Connection reset by peer").  Rank 0
    printed that traceback and exited 1; it must print one line and exit 3, like a GeoMesh
    or CONA job, keeping the run folder and the committed checkpoints only, and say that
    no checkpoint can be resumed (none was committed).  The two ranks
    are started as torchrun starts its workers (RANK, WORLD_SIZE, MASTER_*), without
    torchrun, whose SIGTERM to the survivor would race the gloo error."""
    run_dir = tmp_path / "run"
    port = free_port()
    cmd = [sys.executable, str(REPO / "train.py"), "--config", "tiny_gpt", "--run-dir", str(run_dir),
           f"data.cache_dir={cache_dir}", "model.num_layers=2", "model.hidden_size=64",
           "model.num_attention_heads=2", "model.seq_length=32", "parallel.global_batch_size=8",
           "parallel.micro_batch_size=2", "train.iters=4", "train.eval_interval=0",
           "train.warmup_iters=1", "logging.wandb=disabled", "checkpoint.save_interval=2",
           "checkpoint.keep_last=0", "logging.progress=off"]
    ranks = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**child_env(), "GEOCONA_FAULT": "save@2/1", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port), "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    try:
        err = ranks[0].communicate(timeout=600)[1]
        ranks[1].wait(timeout=60)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert ranks[1].returncode == -signal.SIGKILL, "the fault was not injected"
    assert ranks[0].returncode == 3, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and "[rank 0]" in errors[0] and "lost" in errors[0], err[-3000:]
    # no checkpoint was committed (the save of step 2 was the first): the line must not
    # send the user to checkpoint.load (it did, "resume from the last checkpoint")
    assert "no complete checkpoint was committed" in errors[0] and "checkpoint.load" not in errors[0]
    assert "Traceback" not in err, err[-3000:]
    assert (run_dir / "metrics.jsonl").is_file()  # the run folder is kept
    assert not (run_dir / "checkpoints" / "iter_0000002").exists()  # never committed
