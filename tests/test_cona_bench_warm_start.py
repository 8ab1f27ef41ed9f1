"""The CONA bench's runs from a warm state, on tiny_gpt in one launched process: every method
starts from the warm state (weights, data position, LR, Adam moments), and the reference
probes its noise scale on its own grid, each probe at an evaluated state."""

from __future__ import annotations

import math

import pytest

from jobruntime.config import load_config


def _warm_start(cache_dir, warm_dir):
    """One process: a warm state of 3 steps at the preset batch, then two jobs at another
    batch started from it, one measured by a direct noise-scale probe."""
    import torch

    from cona import state as cstate
    from cona.baselines import fastest_per_batch
    from cona.context import build_context
    from cona.warm import load_or_train_warm

    cfg_overrides = [
        f"data.cache_dir={cache_dir}", "model.seq_length=64", "logging.wandb=disabled",
        "cona.enabled=true", "cona.clock=emulated", "cona.target_model=gpt3_1.3b",
        "cona.num_gpus=8", "cona.batch_ratio=8", "cona.global_batch_sizes=[64,128]",
        "train.iters=16", "train.warmup_iters=3"]
    cfg = load_config("tiny_gpt", cfg_overrides)
    ctx = build_context(cfg)
    ctx.cfg.data.cache_dir = warm_dir  # the warm checkpoint in this test's own folder
    own = ctx.make_job(ctx.reference_strategy())  # the warm run's own job, measured directly
    for _ in range(3):
        own.train_step()
    own_val_loss = own.evaluate()  # before the next job rebuilds the layout
    measure = lambda job: {"val_loss": job.evaluate()}  # noqa: E731
    warm, cached = load_or_train_warm(ctx, 3, measure)
    ctx.warm = warm
    # the same state loaded for a run with another validation set: measured on that set
    other = build_context(load_config("tiny_gpt", [*cfg_overrides, "train.eval_iters=2"]))
    other.cfg.data.cache_dir = warm_dir
    again, again_cached = load_or_train_warm(other, 3, measure)
    s128 = fastest_per_batch(ctx.candidates, ctx.cluster.iter_s)[128]
    # one job at a time: building a job rebuilds the layout, which destroys the process
    # groups the job before it trains on (jobruntime.parallel.initialize_layout)
    a = ctx.make_job(s128)
    params = cstate.snapshot(a.trainer)["params"]
    out = {"cached": (cached, load_or_train_warm(ctx, 3)[1], again_cached),
           "val_loss": (warm["extra"]["val_loss"], own_val_loss, again["extra"]["val_loss"]),
           "val_samples": (ctx.data.val_samples, other.data.val_samples),
           "reference": ctx.reference_strategy().global_batch_size,
           "consumed": (a.consumed_samples, warm["consumed_samples"]),
           "same_weights": all(torch.equal(p, warm["trainer"]["params"][n])
                               for n, p in params.items()),
           "max_lr": (a.trainer.scheduler.max_lr, cfg.train.lr * 2 ** 0.5),
           "start_lr": (a.start_lr, (cfg.train.lr, cfg.train.min_lr)),
           "sched": (a.trainer.scheduler.num_steps, warm["trainer"]["sched"][0]),
           "clock": a.clock_s}
    loss_a = a.train_step()[0].loss
    before = a.clock_s
    a.measure_noise_scale(microbatches=4)
    mb = a.trainer.cfg.parallel.micro_batch_size
    out["probe_charge"] = (a.clock_s - before, ctx.cluster.target_step_s(s128) * 4 * mb / 16)
    out["curvature"] = _direct_curvature(a)
    b = ctx.make_job(s128)  # a second job from the same warm state: the same first loss
    out["losses"] = (loss_a, b.train_step()[0].loss)
    # a job under other betas: the warm moments keep their bias-corrected values
    t = ctx.cfg.train
    t.adam_beta1, t.adam_beta2 = 0.975, 0.9875
    c = ctx.make_job(s128)
    t.adam_beta1, t.adam_beta2 = warm["trainer"]["adam"][:2]
    unbiased = {}
    for name, st in cstate.optimizer_state_by_name(c.trainer).items():
        old, k = warm["trainer"]["opt"][name], float(st.state["step"])
        unbiased[name] = (
            float((st.state["exp_avg"] / (1 - 0.975**k)).norm()),
            float((old["exp_avg"] / (1 - 0.9**k)).norm()),
            float((st.state["exp_avg_sq"] / (1 - 0.9875**k)).sum()),
            float((old["exp_avg_sq"] / (1 - 0.95**k)).sum()))
    d = ctx.make_job(s128)  # the warm state's own betas again
    out["rebias"] = {"adam": (warm["trainer"]["adam"], cstate.adam_hyperparameters(c.trainer)),
                     "unbiased": unbiased,
                     "same_betas_bitwise": all(
                         torch.equal(st.state[k], warm["trainer"]["opt"][n][k])
                         for n, st in cstate.optimizer_state_by_name(d.trainer).items()
                         for k in ("exp_avg", "exp_avg_sq"))}
    return out


def _direct_curvature(job):
    """The emulated job's curvature measurement (DirectProbes.measure_curvature_stats) as
    cona.curvature sees it: which micro-batches (tokens) go to the gradients and which to
    the curvature, the preconditioner and step passed, and the job's data position, RNG,
    clock and weights before and after."""
    import torch

    import cona.curvature as curv
    from cona import state as cstate

    calls, real = [], curv.measure_curvature_stats

    def spy(trainer, mbs, held_out, weights, delta):
        calls.append({"grad_rows": {tuple(r.tolist()) for m in mbs for r in m["tokens"]},
                      "held_rows": {tuple(r.tolist()) for m in held_out for r in m["tokens"]},
                      "first": tuple(mbs[0]["tokens"][0].tolist()),
                      "sizes": (len(mbs), len(held_out)), "p": weights is not None,
                      "delta": delta})
        return real(trainer, mbs, held_out, weights, delta=delta)

    before = (job.consumed_samples, torch.get_rng_state(), job.clock_s,
              cstate.snapshot(job.trainer)["params"])
    curv.measure_curvature_stats = spy
    try:
        stats = [job.measure_curvature_stats(3, 2, preconditioned=False, delta=1e-3),
                 job.measure_curvature_stats(3, 2)]
    finally:
        curv.measure_curvature_stats = real
    after = (job.consumed_samples, torch.get_rng_state(), job.clock_s,
             cstate.snapshot(job.trainer)["params"])
    same = (before[0] == after[0] and torch.equal(before[1], after[1]) and before[2] == after[2]
            and all(torch.equal(before[3][n], after[3][n]) for n in before[3]))
    return {"calls": calls, "stats": stats, "unchanged": same, "default_delta": curv.DELTA,
            "next_first": tuple(job.sampler.next()[0]["tokens"][0].tolist())}


def test_every_method_starts_from_the_warm_state(cache_dir, tmp_path):
    """Catches a method that starts from the initial weights, at data position 0, with the
    warm run's LR instead of its own batch's, or at another schedule position; a warm
    state trained again though cached; a measurement at the warm state read from the
    cache (made on another validation set) instead of taken again; and a direct
    noise-scale probe not charged to the clock; and Adam's moments restored under other
    betas without their bias correction carried over.  tiny_gpt, 3 warm steps at the preset batch 8 (24 samples); a job at batch 128
    (proxy 16) must hold the warm weights, continue at sample 24 with sqrt(2) x the LR as
    its peak (a Loop ramps to it from the warm run's LR, which the job records), and two
    such jobs take the same first step; a probe of 4 micro-batches costs the target
    the forward-backward of 4 x mb proxy sequences (target_step_s x 4 mb / 16).  The
    direct curvature measurement (cona/direct_probes.py) must draw its held-out
    micro-batches apart from the gradients', pass the preconditioner and step asked for,
    and leave data position, RNG, clock and weights as they were (_direct_curvature)."""
    from tests.dist_utils import launch

    (out,) = launch(_warm_start, 1, cache_dir, str(tmp_path))
    assert out["cached"] == (False, True, True) and out["reference"] == 64
    # measured at the state, not read from the cache: the warm run's own job gives the same
    # loss; a run on another validation set gets that set's loss (a cached one was stale)
    assert out["val_samples"][0] != out["val_samples"][1]
    assert out["val_loss"][0] == out["val_loss"][1] != out["val_loss"][2]
    assert out["consumed"] == (24, 24) and out["same_weights"]
    assert out["max_lr"][0] == pytest.approx(out["max_lr"][1])
    assert out["start_lr"][0] == pytest.approx(out["start_lr"][1])  # the Loop ramps from it
    assert out["sched"][0] == out["sched"][1] == 24 and out["clock"] == 0.0
    assert out["losses"][0] == out["losses"][1]
    assert out["probe_charge"][0] == pytest.approx(out["probe_charge"][1]) and out["probe_charge"][0] > 0
    # the direct curvature measurement: gradient and held-out micro-batches disjoint, the
    # preconditioner and step as asked, nothing of the job's state moved, not charged
    cv = out["curvature"]
    plain, adam = cv["calls"]
    assert plain["sizes"] == adam["sizes"] == (3, 2)
    assert not plain["grad_rows"] & plain["held_rows"]
    assert (plain["p"], adam["p"]) == (False, True)
    assert (plain["delta"], adam["delta"]) == (1e-3, cv["default_delta"])
    assert plain["grad_rows"] | plain["held_rows"] == adam["grad_rows"] | adam["held_rows"]
    assert cv["unchanged"] and all(len(x) == 2 for x in cv["stats"])
    # the data position came back: training goes on with the probe's first sequence
    assert cv["next_first"] == plain["first"] == adam["first"]
    # a job under other betas (0.975, 0.9875) from the warm state's (0.9, 0.95): its moments
    # are rescaled so that Adam's bias-corrected estimates are the warm state's (without
    # it, after 3 steps the first moment would read 0.9/0.975 x 2.4 = 2.2x its value)
    rb = out["rebias"]
    assert rb["adam"][0][:2] == pytest.approx((0.9, 0.95))
    assert rb["adam"][1][:2] == pytest.approx((0.975, 0.9875))
    for name, (m_new, m_old, v_new, v_old) in rb["unbiased"].items():
        assert m_new == pytest.approx(m_old, rel=1e-5), name
        assert v_new == pytest.approx(v_old, rel=1e-5), name
    assert rb["same_betas_bitwise"]  # the same betas: restored bit for bit


def _dense_reference(cache_dir, warm_dir):
    """One process: a warm state of 3 steps, then the reference for 16 steps at batch 64
    (proxy 8, evaluated every 2 steps) probed every 8 samples (2 micro-batches a
    probe)."""
    from bench.cona_reference import reference
    from cona.context import build_context
    from cona.warm import load_or_train_warm

    cfg = load_config("tiny_gpt", [
        f"data.cache_dir={cache_dir}", "model.seq_length=64", "logging.wandb=disabled",
        "cona.enabled=true", "cona.clock=emulated", "cona.target_model=gpt3_1.3b",
        "cona.num_gpus=8", "cona.batch_ratio=8", "cona.global_batch_sizes=[64,128]",
        "train.iters=24", "train.warmup_iters=3", "train.eval_iters=1",
        "train.eval_interval=2"])
    ctx = build_context(cfg)
    ctx.cfg.data.cache_dir = warm_dir

    def measure(job):
        g_sq, trace = job.measure_gradient_stats(2)
        return {"val_ppl": math.exp(job.evaluate()), "grad_sq": g_sq, "grad_trace": trace,
                "noise_scale_proxy": trace / g_sq if g_sq > 0 else None}

    ctx.warm, _ = load_or_train_warm(ctx, 3, measure)
    ref = reference(ctx, quick_segment=16, probe_microbatches=2, probe_every_samples=8)
    evals = {e["samples"]: math.log(e["val_ppl"]) for e in ref["evals"]}
    from bench.cona_probe_precision import probe_spread

    return {"w0": ctx.warm["consumed_samples"], "probes": ref["noise_scale_probes"],
            "evals": evals, "interval": ref["noise_scale_target_interval_proxy"],
            "every": ref["probe_every_samples"], "eval_samples": ctx.eval_samples,
            "sparse": ref["noise_scale_target_one_per_eval_proxy"],
            "growth": ref["noise_scale_growth"], "warm_phi": ctx.warm["extra"]["noise_scale_proxy"],
            "spread": probe_spread(ctx, (2, 4), 2)}


def test_reference_probes_on_its_own_grid_each_at_an_evaluated_state(cache_dir, tmp_path):
    """Catches the reference's probes tied to its evaluation cadence again (one probe per
    evaluation: the 8 probes Llama's trend rested on), a probe whose loss is an older
    evaluation's, or the end's state probed twice: probed every 8 samples from the warm
    state (24 samples), 16 steps of 8 samples give probes at 32, 40, ..., 152, each
    with the loss of an evaluation at that very state, the warm state's first; the
    trend's interval is reported, and beside it the same run's trend through one probe
    per evaluation interval (16 samples: 40, 56, ..., 136 and the end's 152)."""
    from tests.dist_utils import launch

    (out,) = launch(_dense_reference, 1, cache_dir, str(tmp_path))
    w0, probes = out["w0"], out["probes"]
    assert w0 == 24 and out["every"] == 8
    assert [p["samples"] for p in probes] == list(range(24, 153, 8))
    for p in probes[1:]:
        assert p["val_loss"] == pytest.approx(out["evals"][p["samples"]])
    lo, hi = out["interval"]
    assert 0 < lo <= hi
    # side by side, the same run's probes one per evaluation interval (and the end's)
    sparse = out["sparse"]
    assert out["eval_samples"] == 16 and sparse["every_samples"] == 16
    assert sparse["points"] == 8 and 0 < sparse["interval"][0] <= sparse["interval"][1]
    # the growth record: fewer than MIN_BLOCK_PROBES probes are resampled one at a time
    # (a block length estimated from 14 points is noise: white noise mostly returns the cap)
    g = out["growth"]
    assert g["points"] <= len(probes) - 1 and g["bootstrap_block"] == 1
    # bench/cona_probe_precision.py: repeated probes at the warm state draw micro-batches of
    # their own (the same ones would read the same noise scale: no spread measured)
    phis = [v for m in (2, 4) for v in out["spread"]["phis"][m]]
    assert len(phis) == 4 and len(set(phis)) == 4
