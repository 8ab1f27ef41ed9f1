"""Emulated clock: compute time, hierarchical GeoMesh round, DDP and async baselines."""

from __future__ import annotations

import pytest

from geomesh.fleet.clock import (
    EmulatedClock,
    async_schedule,
    ddp_schedule,
    geomesh_round,
    inner_step_time_s,
)
from geomesh.fleet.cluster import cluster_from_dict, load_cluster
from jobruntime.config import load_config
from jobruntime.flops import flops_per_token

# A -> B: 100 ms RTT, 8 Gbit/s = 1e9 B/s;  B -> A: 200 ms RTT, 4 Gbit/s = 5e8 B/s.
LINKS = [
    {"src": "A", "dst": "B", "rtt_ms": 100, "gbps": 8},
    {"src": "B", "dst": "A", "rtt_ms": 200, "gbps": 4},
]
REGIONS = [{"name": "A", "id": 0, "intra_gbps": 8, "intra_rtt_ms": 2}, {"name": "B", "id": 1}]


def _cluster(workers):
    return cluster_from_dict({"wan_links": LINKS, "regions": REGIONS, "workers": workers})


def test_inner_step_time_formula():
    """Catches a wrong unit or factor in compute time (e.g. per-GPU instead of
    per-worker FLOP/s, or the micro-batch instead of the step's tokens):
    t = flops_per_token * tokens / (achieved FLOP/s * gpus), by hand for an H100
    at micro-batch 1 (2048 tokens: efficiency 0.5*2048/4096 = 0.25)."""
    m = load_config("gpt3_1.3b").model
    w = load_cluster("two_worker").worker("h100-eastus")
    expect = flops_per_token(m) * (1 * 4 * 1 * 2048) / (989e12 * 0.25 * 1)
    assert inner_step_time_s(w, m, 1, 4) == pytest.approx(expect, rel=1e-12)


def test_two_worker_round_by_hand():
    """Catches a wrong schedule (latency = full RTT, bytes/bandwidth missing, the
    two link directions swapped, or idle time mis-split).  Worker x (region A)
    computes 10 s, y (B) 9 s, both send 1e9 bytes:
      x has y's message at 9 + 0.1 + 1e9/5e8 = 11.1  -> straggler 0, WAN 1.1
      y has x's message at 10 + 0.05 + 1e9/1e9 = 11.05 -> straggler 1, WAN 1.05."""
    c = _cluster(
        [{"name": "x", "gpu": "H100", "region": "A"}, {"name": "y", "gpu": "T4", "region": "B"}]
    )
    s = geomesh_round(c, {"x": 10.0, "y": 9.0}, 10**9)
    x, y = s.workers["x"], s.workers["y"]
    assert (x.compute_s, x.straggler_idle_s, x.end_s) == (10.0, 0.0, pytest.approx(11.1))
    assert x.wan_idle_s == pytest.approx(1.1)
    assert (y.compute_s, y.straggler_idle_s) == (9.0, 1.0)
    assert y.wan_idle_s == pytest.approx(1.05) and y.end_s == pytest.approx(11.05)
    assert s.wan_bytes == 2 * 10**9 and s.intra_bytes == 0


def test_hierarchical_round_by_hand_and_clock_accumulates():
    """Catches skipping the intra-region gather/broadcast or sending per-worker
    instead of per-region over the WAN.  w0, w1 in A (intra 1e9 B/s, 1 ms one-way),
    w2 in B; 1e8-byte messages, all compute 10 s:
      bundle A ready 10.101 (w1 -> w0), A has B's at 10 + 0.1 + 0.2 = 10.3,
      B has A's bundle (2e8 B) at 10.101 + 0.05 + 0.2 = 10.351,
      w1 gets the 2e8 bytes it lacks at 10.3 + 0.001 + 0.2 = 10.501.
    A second round starts from each worker's own end time."""
    c = _cluster(
        [
            {"name": "w0", "gpu": "H100", "region": "A"},
            {"name": "w1", "gpu": "H100", "region": "A"},
            {"name": "w2", "gpu": "H100", "region": "B"},
        ]
    )
    clock = EmulatedClock(c)
    for w in ("w0", "w1", "w2"):
        clock.compute(w, 10.0)
    s = clock.exchange({"w0": 10**8, "w1": 10**8, "w2": 10**8})
    assert s.workers["w0"].end_s == pytest.approx(10.3)
    assert s.workers["w1"].end_s == pytest.approx(10.501)
    assert s.workers["w2"].end_s == pytest.approx(10.351)
    assert s.wan_bytes == 3 * 10**8 and s.intra_bytes == 3 * 10**8
    for t in s.workers.values():
        assert t.start_s + t.compute_s + t.straggler_idle_s + t.wan_idle_s == pytest.approx(t.end_s)
    clock.compute("w0", 1.0)
    clock.compute("w1", 1.0)
    clock.compute("w2", 1.0)
    s2 = clock.exchange({"w0": 0, "w1": 0, "w2": 0})
    assert s2.workers["w1"].start_s == pytest.approx(10.501)
    assert s2.workers["w0"].straggler_idle_s == pytest.approx(10.501 - 10.3)
    assert clock.totals["w0"].compute_s == 11.0 and clock.now_s == pytest.approx(s2.end_s)


def test_ddp_and_async_baselines_by_hand():
    """Catches DDP charged without per-step all-reduce or straggler waits, and
    async staleness counted wrongly.  DDP: 1e9 B ring all-reduce over 2 regions =
    2 steps of max(0.05 + 0.5, 0.1 + 1.0) = 2.2 s; 10 steps of (1 s, 0.5 s) compute
    end at 10 * 3.2 s.  Async (server in A): y's first update, computed on version
    0, lands after x's first one -> staleness 1."""
    c = _cluster(
        [{"name": "x", "gpu": "H100", "region": "A"}, {"name": "y", "gpu": "T4", "region": "B"}]
    )
    d = ddp_schedule(c, {"x": 1.0, "y": 0.5}, 10**9, 10)
    assert d.end_s == pytest.approx(32.0)
    assert d.workers["y"].straggler_idle_s == pytest.approx(5.0)
    assert d.workers["x"].wan_idle_s == pytest.approx(22.0) and d.wan_bytes == 2 * 10**9 * 10
    a = async_schedule(c, {"x": 1.0, "y": 1.0}, 0, 0, horizon_s=2.5)
    ev = [(e.worker, round(e.time_s, 6), e.staleness) for e in a.events]
    # x: 1 s + 1 ms push (intra-region, 2 ms RTT), pull 1 ms; y: 1 s + 100 ms, pull 50 ms.
    assert ev == [("x", 1.001, 0), ("y", 1.1, 1), ("x", 2.003, 1), ("y", 2.25, 1)]


def _xy():
    return _cluster(
        [{"name": "x", "gpu": "H100", "region": "A"}, {"name": "y", "gpu": "T4", "region": "B"}]
    )


def test_overlap_clock_without_delay_equals_blocking_rounds():
    """Catches an overlapped schedule that charges different time when nothing
    overlaps (waits at the wrong moment, transfers counted twice, the last
    exchange lost): compute, exchange, wait before the next compute gives every
    worker the blocking clock's times and the same total idle over 4 rounds."""
    c = _xy()
    ref, ovl = EmulatedClock(c), EmulatedClock(c, overlap=True)
    for r in range(4):
        for clock in (ref, ovl):
            if clock is ovl and r:
                for w in ("x", "y"):
                    clock.wait(w)
            clock.compute("x", 10.0 + r)
            clock.compute("y", 9.0 - r)
            clock.exchange({"x": 10**9, "y": 10**9})
    for w in ("x", "y"):
        ovl.wait(w)
    assert ovl.time_s == ref.time_s
    for w in ("x", "y"):
        a, b = ref.totals[w], ovl.totals[w]
        assert a.compute_s == b.compute_s
        assert a.straggler_idle_s + a.wan_idle_s == pytest.approx(b.straggler_idle_s + b.wan_idle_s)
        assert b.straggler_idle_s + b.wan_idle_s + b.compute_s == pytest.approx(b.end_s)


def test_one_round_delay_hides_the_wan_but_not_the_straggler():
    """Catches overlap that hides straggler idle too (impossible: a round needs the
    slowest worker's previous message) or still charges WAN time that runs behind
    compute.  x computes 10 s, y 9 s per round, exchanges take ~2.1 s < 9 s; with a
    one-round delay (wait after the next round's compute) y may run ahead by up to
    a round, then (steady state) idles 1 s per round, all of it straggler idle,
    and x never idles: 20 rounds take 200 s."""
    c = _xy()
    clock = EmulatedClock(c, overlap=True)
    waits = []
    for r in range(20):
        clock.compute("x", 10.0)
        clock.compute("y", 9.0)
        if r:
            waits.append({w: clock.wait(w) for w in ("x", "y")})
        clock.exchange({"x": 10**9, "y": 10**9})
    assert all(w["x"] == (0.0, 0.0) for w in waits)
    for w in waits[12:]:  # steady state
        assert w["y"][0] == pytest.approx(1.0) and w["y"][1] == pytest.approx(0.0, abs=1e-9)
    assert clock.time_s["x"] == pytest.approx(200.0)
    assert clock.totals["y"].wan_idle_s < 1.1  # the catching-up round, once


def test_exchanges_longer_than_a_round_queue_on_the_link():
    """Catches overlapped exchanges that share a link at full bandwidth each:
    1e10-byte messages take 20 s on B -> A (5e8 B/s) but rounds compute 1 s, so
    with a one-round delay the rounds are paced by the link (~20 s each), and
    that waiting is WAN idle, not straggler idle."""
    c = _xy()
    clock = EmulatedClock(c, overlap=True)
    for r in range(5):
        for w in ("x", "y"):
            clock.compute(w, 1.0)
        if r:
            for w in ("x", "y"):
                clock.wait(w)
        clock.exchange({"x": 10**10, "y": 10**10})
    for w in ("x", "y"):
        clock.wait(w)
    assert clock.time_s["x"] > 5 * 20.0
    assert clock.totals["x"].straggler_idle_s == 0.0 and clock.totals["x"].wan_idle_s > 90.0
