"""Rules of ``bench/cona_ttp.py`` that decide what the TTP table compares."""

from __future__ import annotations

import pytest

from bench.cona_ttp import ctx_budget, rebase
from jobruntime.config import load_config


def test_rebased_reference_keeps_the_sample_budget_and_follows_the_lr_rule():
    """Catches a reference moved into the grid that trains a different number of samples
    (iters kept instead of samples) or keeps the preset's LR at twice the batch: tiny_llama
    at batch 8 and 375 iterations moved to batch 16 must train 3,000 samples in 188 steps
    at sqrt(2) x the LRs with half the warmup steps (same warmup samples), and leave the
    original config untouched."""
    cfg = load_config("tiny_llama", ["cona.enabled=true", "cona.clock=emulated",
                                     "train.iters=375"])
    moved = rebase(cfg, 16)
    assert moved.parallel.global_batch_size == 16 and moved.train.iters == 188
    assert ctx_budget(moved) >= ctx_budget(cfg) == 3000
    assert ctx_budget(moved) - ctx_budget(cfg) < 16
    assert moved.train.lr == pytest.approx(cfg.train.lr * 2 ** 0.5)
    assert moved.train.min_lr == pytest.approx(cfg.train.min_lr * 2 ** 0.5)
    assert cfg.parallel.global_batch_size == 8 and cfg.train.iters == 375
    # warmup and decay keep their length in samples (20 steps of 8 = 10 steps of 16)
    assert moved.train.warmup_iters * 16 == cfg.train.warmup_iters * 8 == 160
    moved.validate()


def test_rebased_micro_batch_divides_the_new_batch():
    """Catches min(micro, batch) when it does not divide the batch: micro-batch 4 at a
    global batch of 6 must become 3 (a pipeline of 6/4 micro-batches does not exist)."""
    cfg = load_config("tiny_llama", ["train.iters=300", "train.lr_decay_iters=300"])
    moved = rebase(cfg, 6)
    assert moved.parallel.micro_batch_size == 3 and moved.parallel.global_batch_size == 6
    assert moved.train.lr_decay_iters == 400
    moved.validate()


def test_efficiency_bench_prediction_integrates_pollux_over_the_trajectory():
    """Catches a wrong prediction in ``bench/cona_efficiency.py`` (noise scale left in proxy
    units, efficiency inverted, an interval dropped): at a constant noise scale the
    predicted samples at batch M are the reference's times (r phi + M)/(r phi + M0)
    exactly; an interval without an estimate takes its nearest neighbour's."""
    from bench.cona_efficiency import predicted_samples

    traj = [{"samples": s, "simple": 50.0, "other": None} for s in (100, 200, 300)]
    want = 300 * (2 * 50 + 256) / (2 * 50 + 64)
    assert predicted_samples(traj, 256, 64, 2, "simple") == pytest.approx(want)
    assert predicted_samples(traj, 64, 64, 2, "simple") == pytest.approx(300)
    assert predicted_samples(traj, 256, 64, 2, "other") is None
    traj[0]["simple"], traj[2]["simple"] = None, -1.0  # both take the middle point's 50
    assert predicted_samples(traj, 256, 64, 2, "simple") == pytest.approx(want)
