"""Pure logic of CONA's runtime: candidates, emulated clock, proxy batches, sample schedule."""

from __future__ import annotations

import types

import pytest
import torch

from cona.candidates import build_candidates, global_batch_sizes
from cona.emulated import BATCH_SWITCH_STEPS, LAYOUT_SWITCH_FIXED_S, EmulatedCluster
from cona.job import proxy_micro_batch_size, val_set_size
from cona.mapping import ProxyMapping
from cona.state import SampleScheduler, set_peak_lr, strategy_config
from cona.strategy import Strategy
from jobruntime.config import ConfigError, load_config


def _cfg(*overrides):
    return load_config("tiny_gpt", ["cona.target_model=gpt3_1.3b", *overrides])


def target_model_config(cfg):
    return load_config(cfg.cona.target_model).model


def test_candidates_auto_and_explicit():
    """Catches enumeration that ignores the batch list, memory or the device count, and
    explicit candidates that bypass validation."""
    cfg = _cfg()
    assert global_batch_sizes(cfg) == [8, 16, 32, 64]
    target = target_model_config(cfg)
    assert target.num_layers == 24
    cluster = EmulatedCluster(target, "A100-80GB", 8)
    cands = build_candidates(cfg, target, 8, memory_limit_bytes=cluster.memory_limit_bytes)
    assert {c.global_batch_size for c in cands} == {8, 16, 32, 64}
    assert all(c.world_size == 8 for c in cands)
    small = build_candidates(cfg, target, 8, memory_limit_bytes=8 * 2**30)  # 8 GiB GPUs
    assert 0 < len(small) < len(cands) and all(c.model_parallel_size > 1 for c in small)
    cfg2 = _cfg(
        "cona.candidates=[{dp: 8, tp: 1, pp: 1, micro_batch_size: 1, global_batch_size: 8}]"
    )
    assert build_candidates(cfg2, target, 8) == [Strategy(8, 1, 1, 1, 8)]
    with pytest.raises(ValueError, match="pp=5"):
        build_candidates(
            _cfg(
                "cona.candidates=[{dp: 1, tp: 1, pp: 5, micro_batch_size: 1, global_batch_size: 8}]"
            ),
            target,
            5,
        )
    with pytest.raises(ConfigError):
        _cfg("cona.global_batch_sizes=8")


def test_emulated_switch_costs():
    """Catches a clock that charges resharding for a batch-only change (or nothing for a
    layout change): batch switches cost one step of the new strategy, layout switches
    the fixed cost plus moving a shard's 14 bytes/parameter (GPT-3 1.3B over 300 GB/s
    NVLink: ms)."""
    cluster = EmulatedCluster(target_model_config(_cfg()), "A100-80GB", 8)
    a, b, c = Strategy(8, 1, 1, 1, 8), Strategy(8, 1, 1, 2, 16), Strategy(4, 2, 1, 2, 16)
    assert cluster.switch_s(a, a) == 0.0
    assert cluster.switch_s(a, b) == BATCH_SWITCH_STEPS * cluster.iter_s(b)
    assert LAYOUT_SWITCH_FIXED_S < cluster.switch_s(a, c) < LAYOUT_SWITCH_FIXED_S + 1.0
    assert cluster.iter_s(b) > cluster.iter_s(a) > 0


@pytest.mark.parametrize(
    "gb,mb,want", [(8, 4, 4), (16, 4, 4), (32, 4, 8), (64, 4, 16), (2, 4, 1), (12, 4, 4), (6, 8, 3)]
)
def test_proxy_micro_batch_size_gives_two_or_more_microbatches(gb, mb, want):
    """Catches a proxy micro-batch that leaves one micro-batch per step (no GNS estimate
    in one process) or does not divide the global batch."""
    got = proxy_micro_batch_size(gb, mb)
    assert got == want and gb % got == 0 and gb // got >= 2


def test_val_set_size_fits_every_layout():
    """Catches a validation set that some layout cannot split evenly (then layouts
    would evaluate different sequences and their perplexities would not compare)."""
    cfg = _cfg("train.eval_iters=4")
    n = val_set_size(cfg, [8, 4, 2, 16], 8)
    assert n == 32 and all(n % u == 0 for u in (8, 4, 2, 16))
    assert val_set_size(cfg, [24], 8) == 48


def test_sample_schedule_and_lr_scaling():
    """Catches a schedule that counts steps instead of samples (warmup would end 8x later
    in samples at an 8x larger batch), an LR change that megatron's per-group max_lr
    silently overrides, and a checkpoint's schedule that loads ``global_batch_size``
    times further on than it was saved (a resumed run's LR deep in its decay)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([{"params": [p], "max_lr": 1e-3, "min_lr": 1e-4}], lr=0.0)
    sched = SampleScheduler(
        opt,
        global_batch_size=8,
        init_lr=0.0,
        max_lr=1e-3,
        min_lr=1e-4,
        lr_warmup_steps=64,
        lr_decay_steps=640,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=640,
        wd_incr_style="constant",
    )
    sched.step(1)
    assert sched.num_steps == 8 and opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 8 / 64)
    sched.global_batch_size = 32
    set_peak_lr(types.SimpleNamespace(optimizer=opt), sched, 2e-3, 2e-4)
    sched.step(1)
    assert sched.num_steps == 40
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * 40 / 64)
    # a checkpoint's schedule loads where it was saved, in samples (megatron's
    # load_state_dict re-applies the count through step(), which multiplied it again)
    fresh = SampleScheduler(
        opt, global_batch_size=32, init_lr=0.0, max_lr=2e-3, min_lr=2e-4,
        lr_warmup_steps=64, lr_decay_steps=640, lr_decay_style="cosine", start_wd=0.0,
        end_wd=0.0, wd_incr_steps=640, wd_incr_style="constant")
    fresh.load_state_dict(sched.state_dict())
    assert fresh.num_steps == 40 and fresh.global_batch_size == 32
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * 40 / 64)
    fresh.step(1)
    assert fresh.num_steps == 72
    # the run's own settings stay (a layout switch rebuilds them from the config): a
    # state saved under a shorter decay and another peak moves only the position
    saved = dict(sched.state_dict(), lr_decay_steps=320, max_lr=9e-3)
    opt.param_groups[0].update(max_lr=9e-3, min_lr=9e-4)  # as a loaded optimizer holds them
    fresh.load_state_dict(saved)
    assert (fresh.num_steps, fresh.lr_decay_steps, fresh.max_lr) == (40, 640, 2e-3)
    assert (opt.param_groups[0]["max_lr"], opt.param_groups[0]["min_lr"]) == (2e-3, 2e-4)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3 * 40 / 64)
    cfg = strategy_config(_cfg(), Strategy(2, 2, 1, 2, 16), lr=5e-3, min_lr=5e-4)
    assert (
        cfg.parallel.tp,
        cfg.parallel.pp,
        cfg.parallel.micro_batch_size,
        cfg.parallel.global_batch_size,
        cfg.train.lr,
    ) == (2, 1, 2, 16, 5e-3)


def test_proxy_mapping_is_one_rule():
    """Catches a mapping applied in one direction only or rounded silently, or a batch
    ratio that depends on a measurement: the ratio is the fixed 8 for every family, the
    recipe batches are the published ones (GPT-3 XL 1M tokens = 512 x 2048, BERT-Large
    256 x 512), batches must map both ways exactly, a target batch that is not a whole
    number of proxy sequences must be an error naming cona.batch_ratio, and the
    controller's noise-scale view must be r times the proxy's."""
    from cona.grad_stats import GradientNoiseScale
    from cona.mapping import BATCH_RATIO, TargetNoiseScale, recipe_batch

    assert BATCH_RATIO == 8
    assert recipe_batch("gpt3_1.3b") * 2048 == 2**20 and recipe_batch("bert_large") == 256
    with pytest.raises(KeyError, match="no published batch"):
        recipe_batch("gpt2")
    m = ProxyMapping(8, 64, 2048)
    assert m.target_batch(16) == 128 and m.proxy_batch(128) == 16
    with pytest.raises(ValueError, match="cona.batch_ratio"):
        m.proxy_batch(100)
    est = GradientNoiseScale()
    est.update(2.0 + 10 / 4, 4, 2.0 + 10 / 32, 32)
    assert TargetNoiseScale(est, m).noise_scale == pytest.approx(8 * est.noise_scale)
    cfg = _cfg("cona.batch_ratio=8")
    assert global_batch_sizes(cfg, m) == [64, 128, 256, 512]  # preset batch 8 -> 64 target seqs
    with pytest.raises(ValueError, match="cona.batch_ratio"):
        build_candidates(_cfg("cona.global_batch_sizes=[64,100]"), target_model_config(cfg), 8,
                         mapping=m)
    bad = _cfg("cona.enabled=true", "cona.clock=emulated", "cona.batch_ratio=0")
    with pytest.raises(ConfigError, match="batch_ratio"):
        bad.cona.validate()


@pytest.mark.parametrize("sizes, why", [
    ("[]", "at least one"), ("[0, 64]", r"\(0 is not\)"), ("[8.5]", r"\(8.5 is not\)"),
    ("[true]", r"\(True is not\)"), ("[" + "9" * 40 + "]", "from 1 to 16777216"), ("[64, 100]", r"multiples of cona.batch_ratio=8 .*100 is not")])
def test_global_batch_sizes_are_checked_at_validation(sizes, why):
    """Catches batch sizes that passed validation: ``[]`` fell back to the default grid,
    ``8.5`` ran as 8, ``0`` failed at enumeration with 'no valid candidate', and 100 at
    ratio 8 (12.5 proxy sequences) only when the candidates were built; a 40-digit size
    overflowed a float (traceback) or, below that, hung in megatron's dataset index."""
    cfg = _cfg("cona.enabled=true", "cona.clock=emulated", "cona.batch_ratio=8",
               f"cona.global_batch_sizes={sizes}")
    with pytest.raises(ConfigError, match=f"cona.global_batch_sizes.*{why}"):
        cfg.cona.validate()
    load_config("tiny_gpt", ["cona.enabled=true", "cona.global_batch_sizes=[64, 100]"]  # wall clock
                ).cona.validate()


def test_emulated_context_starts_one_switch_ahead():
    """Catches a context that ignores the look-ahead (the fastest layout at batch 64,
    dp8-tp8, from which batch 128 is a layout switch) or the budget: on the GPT-3 grid of
    ``bench/cona_ttp.py`` (64 A100, batches 64-1024, ratio 8) the emulated start is
    dp16-tp4 at batch 64; with cona.start_slack=0, or a budget long enough that the 1.5 %
    premium outweighs the 10 s layout switch it saves, it is dp8-tp8."""
    from cona.context import ConaContext
    from cona.picks import start_strategy

    def ctx(*overrides, iters=375):
        cfg = _cfg("cona.enabled=true", "cona.clock=emulated", "cona.num_gpus=64",
                   "cona.batch_ratio=8", "cona.global_batch_sizes=[64,128,256,512,1024]",
                   "model.seq_length=64", f"train.iters={iters}", *overrides)
        target = target_model_config(cfg)
        cluster = EmulatedCluster(target, "A100-80GB", 64)
        mapping = ProxyMapping(8, 64, target.seq_length)
        cands = build_candidates(cfg, target, 64, mapping=mapping,
                                 memory_limit_bytes=cluster.memory_limit_bytes)
        return ConaContext(cfg=cfg, target=target, mapping=mapping, candidates=cands,
                           cost_model=cluster.cost_model, cluster=cluster, data=None,
                           budget_samples=iters * 8, eval_samples=64, val_micro_batch=1)

    c = ctx()
    assert c.reference_batch == 64
    assert c.start_strategy() == Strategy(16, 4, 1, 4, 64)
    assert ctx("cona.start_slack=0").start_strategy() == Strategy(8, 8, 1, 8, 64)
    assert ctx(iters=20_000).start_strategy() == Strategy(8, 8, 1, 8, 64)
    assert c.start_strategy() == start_strategy(c.candidates, c.cost_model, 64, 0.02)
