"""TP=2, PP=2 and DP=2 against the single-process reference, on real gloo processes.

All layouts start from the same step-0 checkpoint (dist_checkpointing
reshards it on load) and see the same global batches, so their losses must
agree up to floating-point reduction order.
"""

from __future__ import annotations

import pytest

from tests.dist_utils import launch

STEPS = 5


def _cfg(name, cache_dir, *overrides):
    from jobruntime.config import load_config

    return load_config(name, [f"data.cache_dir={cache_dir}", "logging.wandb=disabled",
                              "train.eval_interval=0", *overrides])


def _reference(cache_dir, ckpt_root):
    """Rank 0 of a world of 1: save the step-0 checkpoint, return 5 losses."""
    from pathlib import Path

    from jobruntime.checkpoint import save_checkpoint
    from jobruntime.loop import build_data
    from jobruntime.parallel import initialize_layout, set_seed
    from jobruntime.trainer import Trainer

    cfg = _cfg("tiny_gpt", cache_dir, f"train.iters={STEPS}")
    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer = Trainer(cfg)
    save_checkpoint(Path(ckpt_root), trainer, consumed_samples=0)
    data = build_data(cfg, topo)
    return [trainer.train_step(data.train.next()).loss for _ in range(STEPS)]


def _layouts(cache_dir, ckpt_root):
    """On 2 ranks: losses of TP=2, PP=2, DP=2 from the reference's step-0 state,
    then tiny_llama and tiny_bert trained 30 steps at TP=2."""
    from jobruntime.checkpoint import load_checkpoint
    from jobruntime.loop import build_data
    from jobruntime.parallel import initialize_layout, set_seed
    from jobruntime.trainer import Trainer

    out = {}
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2), ("dp2", 1, 1)):
        cfg = _cfg("tiny_gpt", cache_dir, f"train.iters={STEPS}", f"parallel.tp={tp}",
                   f"parallel.pp={pp}")
        topo = initialize_layout(cfg)
        set_seed(cfg.train.seed)
        trainer = Trainer(cfg)
        load_checkpoint(ckpt_root, trainer, load_optimizer=False)
        data = build_data(cfg, topo)
        out[name] = [trainer.train_step(data.train.next()).loss for _ in range(STEPS)]
    for preset in ("tiny_llama", "tiny_bert"):
        cfg = _cfg(preset, cache_dir, "train.iters=30", "parallel.tp=2", "train.warmup_iters=5")
        topo = initialize_layout(cfg)
        set_seed(cfg.train.seed)
        trainer = Trainer(cfg)
        data = build_data(cfg, topo)
        out[preset] = [trainer.train_step(data.train.next()).loss for _ in range(30)]
    return out


@pytest.fixture(scope="module")
def results(cache_dir, tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("init_ckpt"))
    (ref,) = launch(_reference, 1, cache_dir, ckpt)
    per_rank = launch(_layouts, 2, cache_dir, ckpt)
    return ref, per_rank


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_layout_matches_single_process(results, layout):
    """Catches wrong TP/PP/DP splits of weights, gradients or batches (any would
    change the loss by far more than 1e-4); 1e-4 leaves room for fp32
    reduction-order differences (~1e-6)."""
    ref, per_rank = results
    for rank_out in per_rank:  # every rank reports the same loss
        assert rank_out[layout] == pytest.approx(ref, abs=1e-4), (layout, ref, rank_out[layout])
    assert ref[-1] < ref[0]  # and training is actually happening


@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_bert"])
def test_tp2_training_reduces_loss(results, preset):
    """Catches a model that builds at TP=2 but does not learn (broken gradients
    in GQA/SwiGLU/RoPE or BERT's masked-LM head): the loss of the last 5 steps
    must be clearly below the first 5."""
    _, per_rank = results
    losses = per_rank[0][preset]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, losses
