"""Regions of four shapes train one model for real: TP1, DP2, TP2 and PP2 jobs.

``python -m geomesh.launch_local`` runs ``geomesh/clusters/four_shape_cpu.yaml``
(7 processes, one torchrun per region, torchft between them) at test size; the
same cluster in ``mode: emulated`` (every worker one TP1 process) is the
reference.  Messages are canonical (:mod:`geomesh.wire.canonical_codec`), so a
region decodes the others' whatever their layouts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobruntime.config.unused import REAL_MODE_ONLY
from tests.dist_utils import free_port
from tests.test_geomesh_launch import SMALL, _env, _launch

REPO = Path(__file__).resolve().parent.parent
# ~100-145 s of one module fixture (four real multi-process runs); real = emulated
# stays in the fast tier (test_geomesh_real.py)
pytestmark = pytest.mark.slow
FOUR = REPO / "geomesh" / "clusters" / "four_shape_cpu.yaml"
SLUGS = ("east-us", "west-europe", "japan-east", "australia-east")
# sign_row in both modes: top-k falls back to it in real mode, where the TP2 region's
# 32-column row shards would split top-k's 256-column chunks (geomesh.sync._codec_kind)
COMMON = [*SMALL, "geomesh.compression=sign_row"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def four(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("four_shape")
    raw = yaml.safe_load(FOUR.read_text())
    raw["rendezvous"] = f"127.0.0.1:{free_port()}"  # the shipped port may be taken here
    cluster = root / "four_shape.yaml"
    cluster.write_text(yaml.safe_dump(raw))
    common = [f"data.cache_dir={cache_dir}", *COMMON]
    real = _launch(cluster, root / "real", *common, timeout=900)
    real_only = tuple(f"geomesh.{k}=" for k in REAL_MODE_ONLY)  # train.py refuses them here
    emu = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--config", "tiny_gpt", "--run-dir",
         str(root / "emulated"), f"geomesh.cluster={cluster}", "geomesh.mode=emulated",
         "geomesh.method=geomesh", *(o for o in common if not o.startswith(real_only))],
        cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
    return root, real, emu


def test_four_shapes_hold_one_global_model(four):
    """Catches messages addressed by local shards (a TP2 or PP2 region could not
    decode a TP1 region's), replicas that send twice, and regions whose outer steps
    drift apart: the launcher exits 0, the four regions ran three distinct layouts,
    and after the last round every region's θ_global has the same canonical
    SHA-256 (bit-identical), with bytes counted by the transport both ways (what
    the regions sent, they received)."""
    root, real, _ = four
    assert real.returncode == 0, real.stdout[-3000:] + real.stderr[-3000:]
    sums = [json.loads((root / "real" / s / "summary.json").read_text()) for s in SLUGS]
    layouts = [(s["layout"]["tp"], s["layout"]["pp"], s["layout"]["dp"]) for s in sums]
    assert layouts == [(1, 1, 1), (1, 1, 2), (2, 1, 1), (1, 2, 1)]
    digests = {s["global_weights_sha256"] for s in sums}
    assert len(digests) == 1 and len(digests.pop()) == 64
    for s in sums:
        assert s["mode"] == "real" and s["clock"] == "wall" and s["codec"] == "sign-row"
        assert s["bytes_sent"] > 0 and s["bytes_received"] > 0
    # what one region's transport sent, the others' received (all-gathers of payloads)
    assert sum(s["bytes_sent"] for s in sums) == sum(s["bytes_received"] for s in sums)
    # the plan gives the regions different work (b_i, H_i); all ran every round
    plans = {(w["batch_size"], w["inner_steps"]) for w in sums[0]["workers"]}
    assert len(plans) > 1, sums[0]["workers"]


def test_four_shapes_equal_the_emulated_run(four):
    """Catches a layout that trains other math than one TP1 process (a PP2 stage
    or a DP2 replica with the wrong data slice, a TP2 scale per shard): every
    region's training and validation losses after each round equal the emulated
    run's (all workers TP1 in one process) within 1e-4 — TP/PP reduction order
    differs at ~1e-6."""
    root, real, emu = four
    assert real.returncode == 0 and emu.returncode == 0, emu.stderr[-3000:]
    ref = _records(root / "emulated")
    assert [r["step"] for r in ref] == list(range(1, len(ref) + 1)) and len(ref) >= 2
    for slug in SLUGS:
        got = _records(root / "real" / slug)
        assert [r["step"] for r in got] == [r["step"] for r in ref], slug
        for a, b in zip(got, ref):
            assert a["tokens"] == b["tokens"] and a["batch_sizes"] == b["batch_sizes"], slug
            assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-4), (slug, a, b)
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-4), (slug, a, b)
