"""A resumed multi-process run draws what the uninterrupted one draws (dropout on).

Each rank's generators differ: a PP stage advances past the earlier stages' draws
when it builds its layers.  Checkpoints kept the RNG in common state, which
``dist_checkpointing`` saves from rank 0 alone, so every rank resumed with rank 0's
generators (and each save logged, from every other rank, a "common state dict
differs" warning several kilobytes long).
"""

from __future__ import annotations

import pytest

from tests.dist_utils import launch
from tests.test_runtime_parallel import SMALL, _cfg, _train

STEPS, SAVE_AT = 4, 2


def _runs(cache_dir, ckpt):
    """On 2 ranks at PP=2 with dropout 0.1: the losses of an uninterrupted run, and of
    a run resumed from its step-``SAVE_AT`` checkpoint."""
    import torch

    torch.set_num_threads(1)
    cfg = lambda: _cfg("tiny_gpt", cache_dir, f"train.iters={STEPS}", *SMALL,  # noqa: E731
                       "parallel.pp=2", "model.dropout=0.1")
    whole = _train(cfg(), STEPS, save_at=SAVE_AT, save_to=ckpt)[0]
    resumed = _train(cfg(), STEPS, load=ckpt)[0]
    return whole, resumed


def test_resume_draws_each_ranks_own_dropout(cache_dir, tmp_path):
    """Catches every rank resumed with rank 0's generators: the last stage's dropout
    masks then differ from the uninterrupted run's and the loss after the resume moves
    (by ~1e-2 here); with each rank's own generators it is the same loss (reduction
    order alike: the same layout)."""
    per_rank = launch(_runs, 2, cache_dir, str(tmp_path / "ckpt"))
    for whole, resumed in per_rank:
        assert len(resumed) == STEPS - SAVE_AT
        assert resumed == pytest.approx(whole[SAVE_AT:], abs=1e-6), (whole, resumed)
