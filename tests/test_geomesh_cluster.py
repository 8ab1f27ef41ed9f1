"""Cluster descriptions: shipped examples load, mistakes are named (pure logic)."""

from __future__ import annotations

import pytest

from geomesh.cluster import ClusterError, cluster_from_dict, load_cluster


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
        ({"w1_num_gpus": 6}, r"workers\[1\]\.num_gpus=6 is not a multiple of tp\*pp=4"),
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

    from geomesh.planner import Plan, WorkerPlan
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
