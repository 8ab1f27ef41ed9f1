"""A GeoMesh run stopped at its target trains on when resumed, as an ordinary run does.

``train.stop_at_target`` stops after the outer step whose evaluation first crossed
``train.target_ppl``.  The crossing is saved with the run's statistics, and a resume
read it as "reached": the resumed run trained one round and stopped again, whatever
``geomesh.outer_steps`` it was given (break-test helper).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.dist_utils import child_env
from tests.test_geomesh_diverged import REPO, SMALL


def _train(run, cache_dir, *extra):
    return subprocess.run(
        [sys.executable, "train.py", "--config", "tiny_gpt", "--run-dir", str(run),
         f"data.cache_dir={cache_dir}", "geomesh.method=geomesh", *SMALL,
         "train.target_ppl=1e9", "train.stop_at_target=true", "checkpoint.save_interval=1",
         *extra], cwd=REPO, capture_output=True, text=True, timeout=600,
        env=child_env(OMP_NUM_THREADS="1"))


def test_a_run_resumed_past_its_target_trains_on(cache_dir, tmp_path):
    first = _train(tmp_path / "a", cache_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1]  # the target (ppl 1e9) is crossed by the first evaluation
    again = _train(tmp_path / "b", cache_dir,
                   f"checkpoint.load={tmp_path / 'a' / 'checkpoints'}")
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [2, 3, 4]  # SMALL's geomesh.outer_steps=4
