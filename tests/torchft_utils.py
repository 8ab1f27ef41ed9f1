"""Shared pieces of the tests that run torchft's DiLoCo next to ours: a replica group's
``Manager``, the inner worker it trains, and the lighthouses between the groups."""

from __future__ import annotations

import contextlib
import logging
import os
from datetime import timedelta
from pathlib import Path


def quiet_torchft() -> None:
    """torchft's Rust side and loggers report every quorum at info: warnings only."""
    os.environ.setdefault("RUST_LOG", "error")
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft.local_sgd"):
        logging.getLogger(name).setLevel(logging.WARNING)


def replica_manager(lighthouse: str, replica_id: str):
    """A one-process torchft replica group: its own TCPStore and gloo process group, a
    synchronous quorum of 2 replicas at ``lighthouse``, no initial weight sync (every
    group builds the same weights from the same seed)."""
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tout = timedelta(seconds=300)
    manager = Manager(pg=ProcessGroupGloo(timeout=tout), load_state_dict=None,
                      state_dict=None, min_replica_size=2, use_async_quorum=False,
                      timeout=tout, quorum_timeout=tout, connect_timeout=tout, rank=0,
                      world_size=1, store_addr="127.0.0.1", store_port=store.port,
                      lighthouse_addr=lighthouse, replica_id=replica_id, init_sync=False)
    manager.test_store = store  # keep the store alive with the manager
    return manager


def uniform_worker(cfg, run_dir: Path, job: int):
    """Worker ``job`` of the uniform plan as :mod:`geomesh.sync` derives it for the DiLoCo
    methods: ``(ctx, proxy steps of every worker, its InnerWorker)``; ``ctx`` to close."""
    from geomesh.context import build_context
    from geomesh.worker import InnerWorker, proxy_steps

    g = cfg.geomesh
    ctx = build_context(cfg, run_dir)
    steps = proxy_steps(ctx.planner.uniform(ctx.uniform_batch), ctx.scale,
                        round_samples=ctx.round_samples,
                        max_micro_batch=cfg.parallel.micro_batch_size)
    H = steps[job].inner_steps
    worker = InnerWorker(ctx.layout_cfg, job, ctx.train_ds, inner_iters=g.outer_steps * H,
                         warmup_iters=round(cfg.train.warmup_iters * H / g.inner_steps),
                         reference_batch=ctx.reference_batch)
    return ctx, steps, worker


@contextlib.contextmanager
def lighthouses(names):
    """One torchft ``LighthouseServer`` (2 replicas) per name: ``{name: address}``."""
    os.environ.setdefault("RUST_LOG", "error")
    from torchft.coordination import LighthouseServer

    servers = {n: LighthouseServer(bind="[::]:0", min_replicas=2) for n in names}
    try:
        yield {n: lh.address() for n, lh in servers.items()}
    finally:
        for lh in servers.values():
            lh.shutdown()


def train_round(worker, steps, job: int, r: int) -> None:
    """Round ``r`` of worker ``job``: its ``H`` steps on its slice of the round's samples
    (after the workers before it; every round reads ``Σ_i S_i`` samples)."""
    start = r * sum(s.samples for s in steps) + sum(s.samples for s in steps[:job])
    worker.train_steps(steps[job], start, 0, steps[job].inner_steps)


def ramped(optimizers, momentum: float, r: int) -> None:
    """Our outer-momentum ramp ``min(μ, 1 − 3/(t + 5))`` for the ``t = r+1``-th outer step,
    set on torch SGD optimizers (:class:`geomesh.outer.OuterNesterov`)."""
    for opt in optimizers:
        opt.param_groups[0]["momentum"] = min(momentum, 1 - 3 / (r + 1 + 5))


def max_abs_diff(a: dict, b: dict) -> float:
    """``max |a − b|`` over the tensors of two name -> tensor dicts with the same names."""
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)
