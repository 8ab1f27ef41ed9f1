"""Adam's ``beta2`` following the global batch (``cona.adam_beta2_batch``): its memory in
samples held at the anchor's, its moments' bias-corrected values kept through every change
(a batch switch, a layout switch), and a setting that cannot hold refused up front."""

from __future__ import annotations

import pytest
import torch

from jobruntime.config import ConfigError, load_config


def _overrides(cache_dir: str, *extra: str) -> list[str]:
    return [f"data.cache_dir={cache_dir}", "model.seq_length=64", "logging.wandb=disabled",
            "cona.enabled=true", "cona.clock=emulated", "cona.target_model=gpt3_1.3b",
            "cona.num_gpus=8", "cona.batch_ratio=8", "cona.global_batch_sizes=[64,128]",
            "train.iters=16", "train.warmup_iters=3", *extra]


def _unbiased_v(trainer) -> dict[str, float]:
    """Each parameter's bias-corrected second moment, summed: ``v / (1 - beta2^t)``."""
    from cona import state as cstate

    beta2 = cstate.adam_hyperparameters(trainer)[1]
    return {n: float((s.state["exp_avg_sq"] / (1 - beta2 ** s.step)).sum())
            for n, s in cstate.optimizer_state_by_name(trainer).items()}


def _follow(cache_dir: str) -> dict:
    from cona import state as cstate
    from cona.baselines import fastest_per_batch
    from cona.context import build_context
    from cona.run import Loop

    out = {}
    for anchor in ("128", "null"):
        ctx = build_context(load_config("tiny_gpt", _overrides(
            cache_dir, f"cona.adam_beta2_batch={anchor}", "train.adam_beta2=0.95")))
        per = fastest_per_batch(ctx.candidates, ctx.cluster.iter_s)
        job = ctx.make_job(per[64])
        loop = Loop(job, ctx.cfg, budget_samples=ctx.budget_samples,
                    eval_samples=ctx.eval_samples, keep_records=False)
        rec = {"rule": (job.adam_beta2_for(per[64]), job.adam_beta2_for(per[128]))}
        for _ in range(3):
            loop.step()
        rec["beta2_at_64"] = cstate.adam_hyperparameters(job.trainer)[1]
        before = _unbiased_v(job.trainer)
        job.set_strategy(per[128])  # a batch switch (the oracle's; apply() calls it too)
        loop.follow_adam()
        rec["beta2_at_128"] = cstate.adam_hyperparameters(job.trainer)[1]
        rec["unbiased"] = {n: (v, before[n]) for n, v in _unbiased_v(job.trainer).items()}
        if anchor == "128":  # a snapshot (the oracle's branches) restored under other betas
            snap = cstate.snapshot(job.trainer)
            cstate.set_adam_betas(job.trainer, (0.9, 0.5))
            cstate.restore(job.trainer, snap)
            rec["restored"] = (cstate.adam_hyperparameters(job.trainer), all(
                torch.equal(st.state[k], snap["opt"][n][k])
                for n, st in cstate.optimizer_state_by_name(job.trainer).items()
                for k in ("exp_avg", "exp_avg_sq")))
            states = cstate.optimizer_state_by_name(job.trainer).values()
            for s in states:  # as Transformer Engine's FusedAdam keeps it: in the param group
                s.group["step"] = int(s.state.pop("step"))
            snap = cstate.snapshot(job.trainer)
            for s in states:
                s.group["step"] = 99
            cstate.restore(job.trainer, snap)
            rec["group_steps"] = sorted({s.step for s in
                                         cstate.optimizer_state_by_name(job.trainer).values()})
        out[anchor] = rec
    return out


def test_beta2_follows_the_global_batch_and_keeps_the_second_moment(cache_dir):
    """Catches a ``beta2`` that stays at the anchor's value at another batch (memory in
    steps: the larger batch averages over more samples), one scaled the wrong way, a change
    that leaves the moments' bias correction to the new ``beta2`` (Adam's step would jump),
    a rule applied while it is off, and a snapshot restored under the trainer's betas of
    the moment instead of its own (not bit for bit), or without Adam's step count where
    the optimizer keeps it in the param group (Transformer Engine's FusedAdam).  Anchor 128 at 0.95: batch 64 runs
    1 - 0.05/2 = 0.975 from its first step; after a switch to 128, 0.95, with every
    parameter's bias-corrected second moment unchanged by the switch; a snapshot at 0.95
    restored into the trainer at 0.5 comes back at 0.95 with its moments bit for bit, and
    one taken with the step in the group at step 3 comes back at 3."""
    from tests.dist_utils import launch

    (out,) = launch(_follow, 1, cache_dir)
    on, off = out["128"], out["null"]
    assert on["rule"] == pytest.approx((0.975, 0.95))
    assert on["beta2_at_64"] == pytest.approx(0.975) and on["beta2_at_128"] == pytest.approx(0.95)
    for name, (after, before) in on["unbiased"].items():
        assert after == pytest.approx(before, rel=1e-6), name
    (b1, b2, _), bitwise = on["restored"]
    assert (b1, b2) == pytest.approx((0.9, 0.95)) and bitwise
    assert on["group_steps"] == [3.0]
    assert off["rule"] == pytest.approx((0.95, 0.95))
    assert off["beta2_at_64"] == off["beta2_at_128"] == pytest.approx(0.95)


def _layout(cache_dir: str, group_step: bool) -> dict:
    from cona import state as cstate
    from cona.switch import switch_layout
    from jobruntime.data import synthetic_microbatch
    from jobruntime.parallel import initialize_layout

    cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", "model.seq_length=64",
                                   "logging.wandb=disabled", "train.adam_beta2=0.975"])
    initialize_layout(cfg)

    class Owner:
        trainer = cstate.build_trainer(cfg, cfg.parallel.global_batch_size)

    owner = Owner()
    g = torch.Generator().manual_seed(0)
    p = cfg.parallel
    for _ in range(3):
        owner.trainer.train_step([synthetic_microbatch(cfg.model, p.micro_batch_size, g)
                                  for _ in range(p.global_batch_size // p.micro_batch_size)])
    if group_step:  # as Transformer Engine's FusedAdam keeps it: in the param group
        for s in cstate.optimizer_state_by_name(owner.trainer).values():
            s.group["step"] = int(s.state.pop("step"))
    before = _unbiased_v(owner.trainer)
    new_cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", "model.seq_length=64",
                                       "logging.wandb=disabled", "train.adam_beta2=0.95"])
    switch_layout(owner, new_cfg, reference_batch=cfg.parallel.global_batch_size, seed=0)
    states = cstate.optimizer_state_by_name(owner.trainer).values()
    return {"beta2": cstate.adam_hyperparameters(owner.trainer)[1],
            "steps": sorted({s.step for s in states}),
            "unbiased": {n: (v, before[n]) for n, v in _unbiased_v(owner.trainer).items()}}


@pytest.mark.parametrize("group_step", [False, True], ids=["torch", "step-in-group"])
def test_layout_switch_keeps_the_moments_under_the_new_layouts_beta2(cache_dir, group_step):
    """Catches a layout switch that copies Adam's moments into a trainer built with another
    ``beta2`` (the next layout's batch) without rescaling them: its bias correction would
    then divide moments built under 0.975 by 0.95's.  And, where the optimizer keeps its
    step count in the param group (Transformer Engine's FusedAdam, megatron-core's Adam
    where TE is installed), a switch that reads no step, drops the moments as if before
    the first step, or rescales with t = 0.  Three steps at 0.975, a layout switch to a
    trainer at 0.95: step 3, every bias-corrected second moment the same."""
    from tests.dist_utils import launch

    (out,) = launch(_layout, 1, cache_dir, group_step)
    assert out["beta2"] == pytest.approx(0.95) and out["steps"] == [3.0]
    for name, (after, before) in out["unbiased"].items():
        assert after == pytest.approx(before, rel=1e-6), name


def test_beta2_rule_that_cannot_hold_is_refused_before_training(cache_dir):
    """Catches an anchor that would give a candidate a negative ``beta2`` (training would
    start and fail at the first switch) and a non-positive anchor: both are refused with the
    setting's name and the fix."""
    from cona.context import build_context

    with pytest.raises(ConfigError, match="adam_beta2_batch=0 must be a global batch from 1"):
        load_config("tiny_gpt", _overrides(cache_dir, "cona.adam_beta2_batch=0")).validate()
    # beta2 0.95 anchored at 2 sequences holds up to 40: the candidates 64 and 128 do not
    cfg = load_config("tiny_gpt", _overrides(cache_dir, "cona.adam_beta2_batch=2"))
    with pytest.raises(ConfigError, match=r"adam_beta2_batch=2 .*anchor the rule at a larger"):
        build_context(cfg)
