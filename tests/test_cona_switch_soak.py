"""A long CONA run switches layout many times: nothing may pile up across switches.

A CONA run lasts hours and may switch layout at every decision; each layout switch
builds new process groups (megatron's ``initialize_model_parallel``), a new model and a
new optimizer, and must release the old ones (``cona/switch.py`` destroys the old
groups).  One launch of 4 gloo ranks cycles tiny_gpt through four layouts
(DP2-TP2, DP2-PP2, DP4, TP2-PP2) four times, two training steps after each switch, and
reads on every rank after each switch the open file descriptors (gloo's sockets), the
threads and the resident memory.  Measured when written, in a longer run of the same
loop (80 switches): each layout's threads repeat exactly from the first cycle on, its
descriptors within 2 (sockets closing late), and the resident set, after rising ~100 MiB
over the first cycle (the allocator warming up), stays within ~70 MiB (its noise).
Megatron builds over ten process groups per layout, so a leak of one group's sockets per
switch, or of a model copy (~16 MiB here), shows.
"""

from __future__ import annotations

import math

import pytest

from tests.dist_utils import launch

pytestmark = pytest.mark.slow

GB = 16
CYCLES = 4
OVERRIDES = [
    "model.seq_length=64",
    "parallel.micro_batch_size=2",
    f"parallel.global_batch_size={GB}",
    "train.warmup_iters=2",
    "train.iters=1000",
    "train.eval_interval=0",
    "logging.wandb=disabled",
]


def _resources() -> tuple[int, int, float]:
    """(open file descriptors, threads, resident MiB) of this process (Linux /proc)."""
    import os

    fds = len(os.listdir("/proc/self/fd"))
    threads = len(os.listdir("/proc/self/task"))
    with open("/proc/self/statm") as f:
        rss_mib = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    return fds, threads, rss_mib


def _worker(cache_dir):
    import gc
    import types

    import torch

    torch.set_num_threads(1)  # 4 ranks share 2 cores
    from cona.state import build_trainer, strategy_config
    from cona.strategy import Strategy
    from cona.switch import switch_layout
    from jobruntime.config import load_config
    from jobruntime.data import GlobalBatchSampler, build_dataset, prepare_corpus
    from jobruntime.parallel import initialize_layout, set_seed

    cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", *OVERRIDES])
    topo = initialize_layout(cfg)
    corpus = prepare_corpus(cfg.data, cfg.model)
    ds = build_dataset(corpus, cfg.model, "train", 100 * GB, cfg.train.seed, cache_dir)

    def sampler(c, topo, consumed):
        p = c.parallel
        return GlobalBatchSampler(ds, global_batch_size=p.global_batch_size,
                                  micro_batch_size=p.micro_batch_size, dp=topo.dp,
                                  dp_rank=topo.dp_rank, consumed_samples=consumed)

    set_seed(cfg.train.seed)
    job = types.SimpleNamespace(trainer=build_trainer(cfg, GB))
    s = sampler(cfg, topo, 0)
    job.trainer.train_step(s.next())
    layouts = [Strategy(2, 2, 1, 2, GB), Strategy(2, 1, 2, 2, GB), Strategy(4, 1, 1, 2, GB),
               Strategy(1, 2, 2, 2, GB)]
    rows, losses = [], []
    for strategy in layouts * CYCLES:
        new_cfg = strategy_config(cfg, strategy, lr=cfg.train.lr, min_lr=cfg.train.min_lr)
        topo, _ = switch_layout(job, new_cfg, reference_batch=GB, seed=cfg.train.seed)
        s = sampler(new_cfg, topo, s.consumed_samples)
        losses += [job.trainer.train_step(s.next()).loss for _ in range(2)]
        gc.collect()
        rows.append((strategy.label, *_resources()))
    return {"rows": rows, "losses": losses}


@pytest.fixture(scope="module")
def results(cache_dir):
    return launch(_worker, 4, cache_dir, timeout_s=900)


def test_repeated_layout_switches_hold_sockets_threads_and_memory_flat(results):
    """Catches a layout switch that leaks process groups (sockets, gloo threads) or a
    model/optimizer copy: on every rank, each layout's thread count in cycles 2 to 4
    equals cycle 1's and its descriptors stay within 3 of it (a leak of one socket a
    switch exceeds that by the next cycle; measured drift at most 2), and the mean
    resident memory of cycle 4 is within 80 MiB of cycle 2's (after the allocator's
    first-cycle warm-up; a full model and optimizer copy leaked a switch, ~16 MiB of
    weights alone, adds 130 MiB over the 8 switches between: a coarse check, the
    descriptor and thread checks are the sharp ones)."""
    n = len(results[0]["rows"]) // CYCLES
    for rank, r in enumerate(results):
        rows = r["rows"]
        first, later = rows[:n], rows[n:]
        for i, (label, fds, threads, _rss) in enumerate(later):
            ref = first[i % n]
            assert label == ref[0]
            assert threads == ref[2] and fds <= ref[1] + 3, (
                f"rank {rank}, switch {n + i + 1} to {label}: {fds} descriptors and {threads} "
                f"threads, {ref[1]} and {ref[2]} at the same layout a cycle before")
        second, last = [x[3] for x in rows[n:2 * n]], [x[3] for x in rows[-n:]]
        assert sum(last) / n - sum(second) / n < 80, (rank, second, last)
        assert all(math.isfinite(x) for x in r["losses"])  # the switched model still trains
