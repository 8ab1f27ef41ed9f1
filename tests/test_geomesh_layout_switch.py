"""A region switches its layout between rounds (``cona.schedule``), and the exchange
does not notice.

Two regions on torchft (``python -m geomesh.launch_local``): East US, one process
at TP1; West Europe, two processes that run TP1·DP2 for rounds 1-2, then switch to
TP2 -- or, in a second run, PP2 -- (CONA's in-memory switch,
:mod:`geomesh.layout_switch`) for rounds 3 and 4.
The reference is the same run without the switch.  TP2 sums in another order,
so the two runs agree within TP numerics (losses within 1e-4), and inside each
run the two regions hold one bit-identical ``θ_global``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.dist_utils import free_port
from tests.test_geomesh_launch import SMALL, _launch
from tests.test_geomesh_launch import _cluster as two_regions

SLUGS = ("east-us", "west-europe")
# 4 rounds; round 1 moves nothing (megatron's first inner step runs at LR 0), so the
# switch after round 2 carries a nonzero outer momentum, residuals and AdamW state
COMMON = [*SMALL, "geomesh.compression=sign_row", "geomesh.error_feedback=true",
          "geomesh.outer_steps=4"]
SWITCH = ["cona.enabled=true",
          "cona.schedule=[{after_step: 2, region: West Europe, tp: 2, pp: 1}]"]
# West Europe's (tp, pp) after the switch in each switched run (dp = 2 / (tp·pp) = 1)
TARGETS = {"tp2": (2, 1), "pp2": (1, 2)}

def _cluster(root: Path, name: str, mode: str = "real") -> Path:
    """test_geomesh_launch's two regions, West Europe with two processes (DP2)."""
    (root / name).mkdir(parents=True, exist_ok=True)
    path = two_regions(root / name, free_port(), mode)
    raw = yaml.safe_load(path.read_text())
    raw["workers"][1]["num_gpus"] = 2
    path.write_text(yaml.safe_dump(raw))
    return path


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _summaries(run_dir: Path) -> list[dict]:
    return [json.loads((run_dir / s / "summary.json").read_text()) for s in SLUGS]


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("layout_switch")
    common = [f"data.cache_dir={cache_dir}", *COMMON]
    out = {"fixed": _launch(_cluster(root, "fixed"), root / "fixed", *common, timeout=900)}
    for name, (tp, pp) in TARGETS.items():
        sched = f"cona.schedule=[{{after_step: 2, region: West Europe, tp: {tp}, pp: {pp}}}]"
        out[name] = _launch(_cluster(root, name), root / name, *common, "cona.enabled=true",
                            sched, timeout=900)
    for name, res in out.items():
        assert res.returncode == 0, (name, res.stdout[-3000:] + res.stderr[-3000:])
    return root


@pytest.mark.slow  # three launches: 81 s here unloaded
def test_switching_region_keeps_one_global_model(runs):
    """Catches a switch that loses GeoMesh's per-shard state (θ_global, outer momentum,
    error-feedback residuals left at the old layout or reset), a codec or layout map
    left at the old shards (the TP2 region would decode the others' messages into the
    wrong slices, a PP stage its renumbered layers), or replicas that both send after
    the switch: West Europe ends at TP2 (PP2) having switched once, and both regions
    of each run hold the same canonical θ_global bit for bit."""
    root = runs
    for name in ("fixed", *TARGETS):
        sums = _summaries(root / name)
        digests = {s["global_weights_sha256"] for s in sums}
        assert len(digests) == 1 and len(digests.pop()) == 64, name
    assert _summaries(root / "fixed")[1]["layout"] == {"tp": 1, "pp": 1, "dp": 2}
    for name, (tp, pp) in TARGETS.items():
        east, west = _summaries(root / name)
        assert east["layout"] == {"tp": 1, "pp": 1, "dp": 1} and east["layout_switches"] == []
        assert west["layout"] == {"tp": tp, "pp": pp, "dp": 1}, name
        (sw,) = west["layout_switches"]
        assert sw["after_step"] == 2 and sw["from"] == {"tp": 1, "pp": 1, "dp": 2}
        assert sw["to"] == {"tp": tp, "pp": pp, "dp": 1} and sw["seconds"] > 0


@pytest.mark.slow  # three launches: 81 s here unloaded
def test_switch_trains_the_run_without_it(runs):
    """Catches a switch that changes the math (inner AdamW state not resharded, the LR
    schedule restarted, a replica's data slice kept after DP2 became DP1, θ_global or
    the outer momentum cut from the wrong pieces): every region's training and
    validation losses after each round equal the run without the switch within 1e-4
    (TP2's reduction order differs at ~1e-6); rounds 1-2, before the switch, bit for bit."""
    root = runs
    for name, slug in ((n, s) for n in TARGETS for s in SLUGS):
        ref, got = _records(root / "fixed" / slug), _records(root / name / slug)
        assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4], slug
        assert [r["val_loss"] for r in got[:2]] == [r["val_loss"] for r in ref[:2]], slug
        for a, b in zip(got, ref):
            assert a["tokens"] == b["tokens"], (name, slug)
            assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-4), (name, slug, a, b)
            assert a["loss"] == pytest.approx(b["loss"], abs=1e-4), (name, slug, a, b)
        assert got[3]["val_loss"] < got[1]["val_loss"], (name, slug)  # it trained after the switch


def _check(tmp_path: Path, *overrides: str, mode: str = "real", region: str | None = "East US"):
    from geomesh.fleet.cluster import load_cluster
    from geomesh.fleet.schedule import check_schedule
    from geomesh.fleet.worker_models import MemoryModel
    from jobruntime.config import load_config

    path = _cluster(tmp_path, "c", mode)
    cfg = load_config("tiny_gpt", [*SMALL, "geomesh.method=geomesh", f"geomesh.cluster={path}",
                                   *([f"geomesh.region={region}"] if region else []), *overrides])
    cluster = load_cluster(str(path))
    memory = MemoryModel(model=cfg.model, seq_length=cfg.model.seq_length)
    check_schedule(cfg, cluster, memory, model_name="the model tiny_gpt")


def test_bad_schedules_are_refused_with_the_fix(tmp_path):
    """Catches a schedule the run cannot follow reaching the round boundary (a hang or a
    crash mid-run): each refusal is one line naming the setting and the fix."""
    from geomesh.fleet.cluster import ClusterError
    from jobruntime.config import ConfigError

    ok = "cona.schedule=[{after_step: 1, region: West Europe, tp: 2}]"
    _check(tmp_path, "cona.enabled=true", ok)  # accepted
    _check(tmp_path)  # no CONA, no schedule: nothing to check
    cases = [
        (["cona.enabled=true"], "CONA's controller does not drive GeoMesh regions yet"),
        (["cona.enabled=true", "cona.schedule=[{after_step: 1, region: Mars, tp: 2}]"],
         "region 'Mars' is not in cluster"),
        (["cona.enabled=true", "cona.schedule=[{after_step: 4, region: West Europe, tp: 2}]"],
         "after_step=4 must be in [1, geomesh.outer_steps=4)"),
        (["cona.enabled=true", "cona.schedule=[{after_step: 1, region: West Europe, tp: 4}]"],
         "has 2 process(es), not a multiple of tp*pp=4"),
        (["cona.enabled=true", "cona.schedule=[{after_step: 1, region: West Europe}]"],
         "must be {after_step: N, region: NAME, tp: T, pp: P}"),
        (["cona.enabled=true", "cona.schedule=[{after_step: 0, region: West Europe, tp: 2}]"],
         "must be positive integers"),
        (["cona.enabled=true", ok, "checkpoint.load=/nowhere"], "checkpoint.load"),
    ]
    for overrides, words in cases:
        with pytest.raises(ConfigError) as e:
            _check(tmp_path, *overrides, "geomesh.outer_steps=4")
        assert words in str(e.value) and "\n" not in str(e.value), (overrides, str(e.value))
    with pytest.raises(ConfigError, match="needs mode: real with one job per region"):
        _check(tmp_path, "cona.enabled=true", ok, region=None)
    with pytest.raises(ConfigError, match="needs mode: real with one job per region"):
        _check(tmp_path, "cona.enabled=true", ok, mode="emulated", region=None)
    with pytest.raises(ConfigError, match="set cona.enabled=true"):
        _check(tmp_path, ok)
    # a new shape must split the model (the planner's rule, geomesh.shapes)
    with pytest.raises(ClusterError, match=r"cona.schedule after step 1: .*pp=2 does not divide "
                                           r"the layers \(model.num_layers=3\)"):
        _check(tmp_path, "cona.enabled=true", "model.num_layers=3",
               "cona.schedule=[{after_step: 1, region: West Europe, tp: 1, pp: 2}]")


def test_codec_counts_a_scheduled_tp(tmp_path):
    """Catches a codec chosen from the cluster file's TP alone: top-k's 256-column chunks
    would be split by the region that switches to TP2 (hidden 64: 32-column shards) and
    that region would fail at its first message; every region falls back to sign_row."""
    from types import SimpleNamespace

    from geomesh.fleet.cluster import load_cluster
    from geomesh.sync import _codec_kind
    from jobruntime.config import load_config

    path = _cluster(tmp_path, "c")
    cluster = load_cluster(str(path))
    for extra, kind in (([], "topk"), (SWITCH, "sign_row")):
        cfg = load_config("tiny_gpt", [*SMALL, "geomesh.compression=topk", *extra])
        assert _codec_kind(SimpleNamespace(cfg=cfg, cluster=cluster, emulated=False)) == kind
