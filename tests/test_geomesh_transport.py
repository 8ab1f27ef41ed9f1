"""Transports: in-process (emulated) vs torch.distributed gloo (real), and timeouts.

One launch of 3 gloo processes runs every distributed check (process starts
cost ~2 s each on this 2-core machine); 3 is the fewest that has a region with
two workers (intra-region phase) and a second region (WAN phase).
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from geomesh.exchange.transport import (
    InProcessTransport,
    RegionTimeoutError,
    TorchDistributedTransport,
    TransportError,
    decode_bundle,
    encode_bundle,
)
from geomesh.fleet.clock import EmulatedClock, geomesh_round
from geomesh.fleet.cluster import cluster_from_dict
from geomesh.wire.canonical import CanonicalSchema, whole_layout
from geomesh.wire.canonical_codec import CanonicalCodec
from jobruntime.ports import free_port

# East US holds workers 0 and 2 (non-contiguous); region ids differ from worker order.
CLUSTER = {
    "regions": [{"name": "West Europe", "id": 0}, {"name": "East US", "id": 1}],
    "workers": [
        {"name": "w0", "gpu": "H100", "region": "East US"},
        {"name": "w1", "gpu": "T4", "region": "West Europe"},
        {"name": "w2", "gpu": "V100", "region": "East US"},
    ],
}
WORLD = 3


def _payloads() -> list[list[bytes]]:
    """Round 0: real GeoMesh messages; round 1: odd lengths, one empty."""
    g = torch.Generator().manual_seed(0)
    named = {"a": torch.randn(33, 5, generator=g), "b": torch.randn(7, generator=g)}
    schema = CanonicalSchema.from_shapes((k, v.shape) for k, v in named.items())
    codec = CanonicalCodec("sign_row", whole_layout(schema), schema)
    round0 = [
        codec.encode({k: v * (i + 1) - i for k, v in named.items()}, 100 * (i + 1), worker=i,
                     round=0)
        for i in range(WORLD)
    ]
    round1 = [bytes(i % 251 for i in range(n)) for n in (1001, 0, 17)]
    return [round0, round1]


def _worker(rank: int, world: int, port: int, outdir: str, payloads) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    cluster = cluster_from_dict(CLUSTER)
    result: dict = {}
    try:
        hier = TorchDistributedTransport(cluster, store=store, timeout_s=30, prefix="hier")
        flat = TorchDistributedTransport(
            cluster, store=store, timeout_s=30, prefix="flat", hierarchical=False
        )
        for r, msgs in enumerate(payloads):
            result[f"hier{r}"] = hier.exchange({rank: msgs[rank]})
            as_tensor = (
                torch.frombuffer(bytearray(msgs[rank]), dtype=torch.uint8)
                if msgs[rank]
                else torch.empty(0, dtype=torch.uint8)
            )
            result[f"flat{r}"] = flat.exchange({rank: as_tensor})
        hier.timeout_s = 1.0
        if rank != 1:  # worker 1 (West Europe) never arrives
            try:
                hier.exchange({rank: b"x"})
                result["timeout"] = None
            except RegionTimeoutError as e:
                result["timeout"] = (str(e), e.regions, e.workers)
        dist.barrier()
    except Exception as e:  # report instead of dying silently
        result["error"] = repr(e)
    finally:
        (Path(outdir) / f"{rank}.pkl").write_bytes(pickle.dumps(result))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo")
    world = WORLD
    ctx = mp.start_processes(
        _worker,
        args=(world, free_port(), str(out), _payloads()),
        nprocs=world,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 90
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("gloo workers hung for 90 s")
    return [pickle.loads((out / f"{r}.pkl").read_bytes()) for r in range(world)]


def test_distributed_exchange_equals_in_process(gloo_results):
    """Catches lost/reordered messages, padding left on variable-length messages,
    and wrong worker order after the region detour (non-contiguous region members,
    region ids unlike worker order): on every rank, hierarchical and flat gloo
    all-gathers over two rounds return byte-for-byte InProcessTransport's list."""
    cluster = cluster_from_dict(CLUSTER)
    local = InProcessTransport(cluster)
    for r, msgs in enumerate(_payloads()):
        expect = local.exchange(dict(enumerate(msgs)))
        assert expect == msgs
        for rank, res in enumerate(gloo_results):
            assert "error" not in res, res.get("error")
            assert res[f"hier{r}"] == expect, f"rank {rank} hierarchical round {r}"
            assert res[f"flat{r}"] == expect, f"rank {rank} flat round {r}"


def test_missing_region_times_out_with_its_name(gloo_results):
    """Catches a hang or an anonymous error when a region is down: every live
    worker raises RegionTimeoutError naming 'West Europe' and worker w1 (1 s timeout)."""
    for rank in (0, 2):
        msg, regions, workers = gloo_results[rank]["timeout"]
        assert regions == ["West Europe"] and workers == ["w1"]
        assert "West Europe" in msg and "timeout_s" in msg


def test_in_process_transport_charges_clock():
    """Catches an in-process transport that skips the clock or charges the proxy's
    bytes instead of the target model's: the charged round equals geomesh_round."""
    cluster = cluster_from_dict(CLUSTER)
    clock = EmulatedClock(cluster)
    for w, sec in zip(cluster.workers, (1.0, 2.0, 3.0)):
        clock.compute(w.name, sec)
    t = InProcessTransport(cluster, clock=clock, charged_bytes=5 * 10**8)
    t.exchange({i: b"tiny" for i in range(WORLD)})
    ref = geomesh_round(cluster, {"w0": 1.0, "w1": 2.0, "w2": 3.0}, 5 * 10**8)
    assert t.last_schedule.workers == ref.workers and clock.wan_bytes == ref.wan_bytes
    with pytest.raises(ValueError, match="plays"):
        t.exchange({0: b"x"})


def test_bundle_round_trip_and_corruption():
    """Catches a leader bundle that loses empty messages or accepts bad lengths."""
    msgs = [b"", b"abc", bytes(1000)]
    assert decode_bundle(encode_bundle(msgs)) == msgs
    with pytest.raises(TransportError, match="corrupted"):
        decode_bundle(encode_bundle(msgs)[:-1])
