"""Cluster descriptions: shipped examples load, mistakes are named (pure logic)."""

from __future__ import annotations

import pytest

from geomesh.fleet.cluster import ClusterError, cluster_from_dict, load_cluster


def test_shipped_examples_load():
    """Catches example YAMLs that drift from the schema or name regions missing
    from the bundled Azure CSV (every pair of regions must get both directed links)."""
    c = load_cluster("four_region")
    assert [w.gpu for w in c.workers] == ["H100", "A100-80GB", "V100", "T4"]
    assert [r.name for r in c.regions] == ["East US", "West Europe", "Japan East", "Australia East"]
    assert len(c.links) == 12
    eu_jp = c.link("West Europe", "Japan East")
    assert eu_jp.rtt_s == pytest.approx(0.240) and eu_jp.bandwidth_bytes_per_s == pytest.approx(
        4.19e9 / 8
    )
    two = load_cluster("two_worker", wan_bandwidth_scale=0.1)
    assert two.link("East US", "West Europe").bandwidth_bytes_per_s == pytest.approx(
        13.38e9 / 8 * 0.1
    )
    real = load_cluster("two_worker_real")
    assert real.mode == "real" and real.rendezvous_host_port == ("127.0.0.1", 29511)


BASE = {
    "workers": [
        {"name": "a", "gpu": "H100", "region": "East US"},
        {"name": "b", "gpu": "T4", "num_gpus": 4, "tp": 4, "region": "West Europe"},
    ]
}


def _with(**changes):
    raw = {"workers": [dict(w) for w in BASE["workers"]]}
    for path, value in changes.items():
        if path.startswith("w1_"):
            raw["workers"][1][path[3:]] = value
        else:
            raw[path] = value
    return raw


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"w1_gpu": "RTX9000"}, r"workers\[1\]\.gpu='RTX9000' is unknown"),
        ({"w1_region": "Mars"}, r"no WAN link .*'Mars'.* add .* under wan_links"),
        ({"w1_num_gpus": 6}, r"workers\[1\]\.num_gpus=6 is not a multiple of tp\*pp=4 \(worker "
                             r"'b': tp=4, pp=1; replicas = num_gpus / \(tp\*pp\)\)"),
        ({"w1_speed": 3}, r"workers\[1\]: unknown key\(s\) \['speed'\]"),
        ({"w1_name": "a"}, r"duplicate name"),
        ({"mode": "real"}, r"mode=real needs rendezvous"),
        ({"mode": "real", "rendezvous": "host"}, r"rendezvous='host' must look like host:port"),
        ({"wan_bandwidth_scale": 0}, r"wan_bandwidth_scale=0 must be a positive number"),
        ({"w1_name": 7}, r"workers\[1\]\.name=7 must be a string"),
        ({"slowdown": {"worker": "a", "factor": 2, "from_round": 3, "until_round": 2}},
         r"until_round=2 must be greater than from_round=3"),
        (
            {"regions": [{"name": "East US", "id": 0}, {"name": "West Europe", "id": 2}]},
            r"must be 0\.\.1",
        ),
    ],
)
def test_validation_names_field_and_fix(changes, message):
    """Catches vague or missing validation: each mistake raises ClusterError (a
    ValueError) whose message names the field and the way out."""
    with pytest.raises(ClusterError, match=message):
        cluster_from_dict(_with(**changes))
    assert issubclass(ClusterError, ValueError)


def test_custom_links_and_scale():
    """Catches wan_links overrides being ignored or the scale applied twice / to
    intra-region links: Gbit/s -> bytes/s, ms -> s, scale only on WAN."""
    raw = {
        "wan_bandwidth_scale": 0.5,
        "wan_links": [
            {"src": "A", "dst": "B", "rtt_ms": 100, "gbps": 8},
            {"src": "B", "dst": "A", "rtt_ms": 200, "gbps": 4},
        ],
        "regions": [
            {"name": "A", "id": 0, "intra_gbps": 16, "intra_rtt_ms": 2},
            {"name": "B", "id": 1},
        ],
        "workers": [
            {"name": "x", "gpu": "V100", "region": "A"},
            {"name": "y", "gpu": "V100", "region": "B"},
        ],
    }
    c = cluster_from_dict(raw)
    assert c.link("A", "B").bandwidth_bytes_per_s == pytest.approx(0.5e9)
    assert c.link("B", "A").rtt_s == pytest.approx(0.2)
    assert c.link("A", "A").bandwidth_bytes_per_s == pytest.approx(2e9)
    assert c.link("A", "B").transfer_s(5e8) == pytest.approx(0.05 + 1.0)


def test_resume_matches_workers_by_identity_not_position():
    """Catches a resume that trusts worker positions (issue 25): a checkpoint of
    the two-worker cluster is accepted only by the same workers in the same order;
    a renamed worker, a changed GPU or layout, reordered or missing workers are
    refused in one line naming the worker and the fix.  A state saved before the
    identity was recorded is checked by its plan's worker names."""
    import dataclasses
    import re

    from geomesh.fleet.plan import Plan, WorkerPlan
    from geomesh.state import check_workers, worker_identity
    from jobruntime.checkpoint import CheckpointError

    c = load_cluster("two_worker")
    state = {"cluster": worker_identity(c)}
    check_workers(state, c)
    h100, t4 = c.workers
    cases = {
        "renamed": ((h100, dataclasses.replace(t4, name="t4-b")),
                    "worker 1 is 't4-westeurope' (T4 x4, tp=4, pp=1), the cluster file's is "
                    "'t4-b' (T4 x4, tp=4, pp=1): resume with the cluster file"),
        "other gpu": ((h100, dataclasses.replace(t4, gpu="V100")), "'t4-westeurope' (V100 x4"),
        "other layout": ((h100, dataclasses.replace(t4, tp=2, pp=2)), "tp=2, pp=2"),
        "reordered": ((t4, h100), "order ['h100-eastus', 't4-westeurope'], the cluster file "
                                  "lists ['t4-westeurope', 'h100-eastus']"),
        "missing": ((h100,), "holds 2 workers"),
    }
    for name, (workers, match) in cases.items():
        other = dataclasses.replace(c, workers=workers)
        with pytest.raises(CheckpointError, match=re.escape(match)) as e:
            check_workers(state, other)
        assert "\n" not in str(e.value), name

    def wp(name):
        return WorkerPlan(worker=name, micro_batch_size=1, grad_accum=1, dp=1, batch_size=1,
                          inner_steps=1, seq_length=1, tokens=1, step_time_s=1.0, compute_s=1.0,
                          memory_bytes=0.0, memory_limit_bytes=1.0)

    legacy = {"plan": Plan(workers=(wp("h100-eastus"), wp("t4-westeurope")), target_tokens=2,
                           tolerance=0.05)}
    check_workers(legacy, c)
    with pytest.raises(CheckpointError, match="order"):
        check_workers(legacy, dataclasses.replace(c, workers=(t4, h100)))


# -- region shapes against the model (geomesh/fleet/shapes.py) ----------------------

# The model each shipped cluster file is meant for; files not listed (e.g. the
# CPU cluster four_shape_cpu.yaml) are run with tiny_gpt.
SHIPPED_MODELS = {"four_region": "gpt3_1.3b", "two_worker": "gpt3_1.3b",
                  "two_worker_real": "tiny_gpt"}
OUTER = 8.0 + 0.25  # θ_global + outer momentum + message, bytes/param (geomesh.context)


def _memory(model):
    from geomesh.fleet.worker_models import MemoryModel

    return MemoryModel(model=model, extra_bytes_per_param=OUTER)


def test_shipped_clusters_hold_their_models():
    """Catches a shape refusal that rejects the shipped clusters: four_region's TP2
    V100 and TP4 T4 workers split GPT-3 1.3B and hold its state with the outer state
    (the TP1 V100 and TP2 T4 would not: test_shape_that_does_not_fit_...), and every
    other file (the CPU four-shape cluster among them) holds tiny_gpt."""
    from geomesh.fleet.cluster import CLUSTERS_DIR
    from geomesh.fleet.shapes import check_region_shapes
    from jobruntime.config import load_config

    files = sorted(CLUSTERS_DIR.glob("*.yaml"))
    assert {f.stem for f in files} >= set(SHIPPED_MODELS)
    for f in files:
        name = SHIPPED_MODELS.get(f.stem, "tiny_gpt")
        model = load_config(name).model
        check_region_shapes(load_cluster(f), model, _memory(model), model_name=name)
    four = load_cluster("four_region")
    assert [(w.tp, w.pp, w.dp) for w in four.workers] == [(1, 1, 8), (1, 1, 8), (2, 1, 4),
                                                          (4, 1, 2)]


# A model (12 heads, FFN 3072, vocabulary 8192, 8 layers) that worker 'a' (TP1,
# PP2) splits in every case; each case breaks exactly one rule at worker 'b'.
SPLIT = dict(num_layers=8, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072,
             vocab_size=8192, seq_length=128)


@pytest.mark.parametrize("change, shape, rule", [
    ({}, {"tp": 8, "num_gpus": 8},
     "tp=8 does not divide the attention heads (model.num_attention_heads=12)"),
    ({"num_query_groups": 3}, {"tp": 2, "num_gpus": 2},
     "tp=2 does not divide the query groups (kv heads, model.num_query_groups=3)"),
    ({"ffn_hidden_size": 3070}, {"tp": 4, "num_gpus": 4},
     "tp=4 does not divide the FFN hidden size (model.ffn_hidden_size=3070)"),
    ({"padded_vocab_size": 8194}, {"tp": 4, "num_gpus": 4},
     "tp=4 does not divide the padded vocabulary (8194)"),
    ({}, {"pp": 3, "num_gpus": 3}, "pp=3 does not divide the layers (model.num_layers=8)"),
])
def test_shape_that_does_not_split_the_model_is_refused(change, shape, rule):
    """Catches a region shape that megatron-core cannot build reaching the build (an
    AssertionError or ValueError from inside megatron, per region, after the run
    started) or, in emulated mode, never being built and silently timed: the refusal
    names the worker, the one rule broken with its numbers, and the shapes of its
    GPUs that split the model."""
    from geomesh.fleet.shapes import check_region_shapes
    from jobruntime.config import ModelConfig

    model = ModelConfig(**{**SPLIT, **change})
    model.validate()
    cluster = cluster_from_dict({"workers": [
        {"name": "a", "gpu": "A100-80GB", "region": "East US", "pp": 2, "num_gpus": 2},
        {"name": "b", "gpu": "A100-80GB", "region": "West Europe", **shape}]})
    with pytest.raises(ClusterError) as e:
        check_region_shapes(cluster, model, _memory(model), model_name="the model m")
    msg = str(e.value)
    assert msg.startswith("worker 'b' (A100-80GB x") and "cannot split the model m" in msg, msg
    assert rule in msg and msg.count("does not divide") == 1 and "\n" not in msg, msg
    assert "with tp*pp dividing num_gpus=" in msg


def test_build_context_checks_the_model_each_mode_builds(tmp_path):
    """Catches the shape check running on the wrong model, or after the setup: in
    emulated mode the target model (geomesh.target_model) sets time and memory, so a
    T4 at TP1 cannot hold GPT-3 1.3B although the tiny proxy would fit; in real mode
    the job's own model is built, so TP8 cannot split tiny_gpt's 4 heads although
    GPT-3 1.3B's 16 would split.  Both are refused by build_context before any process
    group or data exists (no run folder)."""
    import yaml

    from geomesh.context import build_context
    from jobruntime.config import load_config

    def run(mode: str, worker: dict) -> str:
        f = tmp_path / f"{mode}.yaml"
        f.write_text(yaml.safe_dump({
            "mode": mode, "rendezvous": "127.0.0.1:29599",
            "workers": [{"name": "h100", "gpu": "H100", "region": "East US"},
                        {"name": "t4", "gpu": "T4", "region": "West Europe", **worker}]}))
        cfg = load_config("tiny_gpt", [f"geomesh.cluster={f}", "geomesh.method=geomesh",
                                       "geomesh.target_model=gpt3_1.3b",
                                       "logging.wandb=disabled"])
        with pytest.raises(ClusterError) as e:
            build_context(cfg, tmp_path / "run")
        assert not (tmp_path / "run").exists()
        return str(e.value)

    msg = run("emulated", {})
    assert msg.startswith("worker 't4' (T4 x1, tp=1, pp=1) cannot fit the target model "
                          "gpt3_1.3b (geomesh.target_model) in 16.0 GiB per GPU"), msg
    msg = run("real", {"num_gpus": 8, "tp": 8})
    assert msg.startswith("worker 't4' (T4 x8, tp=8, pp=1) cannot split the model tiny_gpt: "
                          "tp=8 does not divide the attention heads "
                          "(model.num_attention_heads=4)"), msg
