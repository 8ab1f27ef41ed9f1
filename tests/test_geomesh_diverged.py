"""A GeoMesh run whose training diverges stops as an ordinary run does (exit 1).

With ``train.lr=1e6`` a worker's inner loss or pseudo-gradient becomes NaN within a few
rounds.  GeoMesh crashed with a traceback from its codec ("pseudo-gradient ... has
NaN/Inf", exit 1 without a summary), and the baselines went on with NaN weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import child_env

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.seq_length=32", "parallel.global_batch_size=8", "parallel.micro_batch_size=4",
         "geomesh.inner_steps=2", "train.eval_iters=1", "train.warmup_iters=0",
         "geomesh.cluster=two_worker", "geomesh.outer_steps=4", "logging.wandb=disabled"]


@pytest.mark.parametrize("method", ["geomesh", "ddp", "async", "streaming_diloco"])
def test_a_diverged_geomesh_run_exits_1_and_saves_nothing_of_it(method, cache_dir, tmp_path):
    """Exit 1 with the one divergence line, ``diverged_at_step`` in a strict-JSON
    summary, no checkpoint of that outer step or later, and its step in metrics.jsonl."""
    run = tmp_path / method
    saves = ["checkpoint.save_interval=1"] if method in ("geomesh", "ddp") else []
    fragments = ["geomesh.inner_steps=4"] if method == "streaming_diloco" else []
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "tiny_gpt", "--run-dir", str(run),
         f"data.cache_dir={cache_dir}", f"geomesh.method={method}", *SMALL, *saves, *fragments,
         "train.lr=1e6", "train.min_lr=0", "train.clip_grad=0"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env=child_env(OMP_NUM_THREADS="1"))
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "not finite" in errors[0], \
        proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in JSON"))

    summary = strict((run / "summary.json").read_text())
    step = summary["diverged_at_step"]
    assert 1 <= step <= 4
    records = [strict(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == step
    saved = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("outer_*")) \
        if (run / "checkpoints").is_dir() else []
    assert all(s < step for s in saved), (saved, step)
