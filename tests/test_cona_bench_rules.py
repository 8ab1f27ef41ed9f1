"""Rules of ``bench/cona_ttp.py`` that decide what the TTP table compares: the unigram
perplexity and the target, the warm-checkpoint cache, the static_recipe layout and the
time scale."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from jobruntime.config import load_config


def test_unigram_perplexity_of_a_hand_computed_corpus(tmp_path):
    """Catches counts taken from the wrong split, an unsmoothed zero for an unseen token
    (infinite perplexity), or a mean over types instead of tokens.  Training documents
    [1 2 2] and [2 3] (N = 5, V = 5 ids 0-4): p = (c + 1) / 10, so p(1) = 0.2, p(2) = 0.4,
    p(4) = 0.1 (unseen).  Validation [2 1 4]: ppl = (0.4 * 0.2 * 0.1)^(-1/3)."""
    from cona.targets import TARGET_FRACTION, target_ppl, token_counts, unigram_perplexity
    from jobruntime.data import write_indexed

    prefix = tmp_path / "tiny"
    write_indexed([[[1, 2, 2]], [[2, 3]], [[2, 1], [4]]], prefix, vocab_size=5)
    train = token_counts(prefix, np.array([0, 1]), 5)
    val = token_counts(prefix, np.array([2]), 5)
    assert train.tolist() == [0, 1, 3, 1, 0] and val.tolist() == [0, 1, 1, 0, 1]
    want = (0.4 * 0.2 * 0.1) ** (-1 / 3)
    assert unigram_perplexity(train, val) == pytest.approx(want, rel=1e-12)
    f = TARGET_FRACTION
    assert 0 < f <= 0.5  # at most half the unigram perplexity (issue 23's bar)
    assert target_ppl(want) == pytest.approx(f * want)
    assert target_ppl(800.0, 348.0) == pytest.approx(f * 348.0)
    assert target_ppl(800.0, 1500.0) == pytest.approx(f * 800.0)
    with pytest.raises(ValueError, match="validation tokens"):
        unigram_perplexity(train, np.zeros(5))


def test_warm_checkpoint_is_reused_invalidated_by_its_key_and_never_half_written(
        tmp_path, monkeypatch):
    """Catches a warm checkpoint trained again when cached, reused after a change to what
    determines it (LR, seed, warm steps, training-set size), invalidated by what does not
    (evaluation settings), or left half-written by a run killed inside the save (then
    loaded by the next run)."""
    import torch

    import cona.warm as warm

    trained = []

    def fake_train(ctx, steps, measure=None):
        trained.append(steps)
        return {"trainer": {"w": torch.full((3,), float(len(trained)))},
                "consumed_samples": 8 * steps, "steps": steps, "extra": {}}

    monkeypatch.setattr(warm, "train_warm", fake_train)

    class Ctx:
        def __init__(self, *overrides, samples=1000):
            self.cfg = load_config("tiny_gpt", [f"data.cache_dir={tmp_path}", *overrides])
            self.data = type("D", (), {"train": range(samples)})()

    state, cached = warm.load_or_train_warm(Ctx(), 20)
    assert not cached and trained == [20]
    again, cached = warm.load_or_train_warm(Ctx("train.eval_iters=32", "train.eval_interval=5"),
                                            20)
    assert cached and trained == [20] and torch.equal(again["trainer"]["w"], state["trainer"]["w"])
    for ctx, steps in ((Ctx("train.lr=0.001"), 20), (Ctx("train.seed=7"), 20), (Ctx(), 21),
                       (Ctx(samples=2000), 20)):
        _, cached = warm.load_or_train_warm(ctx, steps)
        assert not cached
    assert len(trained) == 5 and len(list(tmp_path.glob("cona-warm-*.pt"))) == 5

    def killed(obj, f):
        f.write(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(warm.torch, "save", killed)
    with pytest.raises(KeyboardInterrupt):
        warm.load_or_train_warm(Ctx("train.lr=0.003"), 20)
    assert not warm.warm_path(Ctx("train.lr=0.003").cfg, 20, 1000).exists()
    assert sorted(p.name for p in tmp_path.iterdir() if "cona-warm" in p.name
                  and not p.name.endswith(".pt")) == []


def test_static_recipe_takes_the_lowest_per_iteration_time_at_the_recipe_batch():
    """Catches a recipe layout picked by tokens/s over all batches (that is
    static_throughput), the first layout listed, or another batch: among GPT-3 1.3B's
    candidates on 64 A100s at the published 512 x 2048, the pick is the layout with the
    smallest modelled step time, compared here against every candidate at that batch."""
    from cona.baselines import recipe_strategy
    from cona.candidates import build_candidates
    from cona.emulated import EmulatedCluster
    from cona.mapping import ProxyMapping, recipe_batch
    from cona.strategy import Strategy

    cfg = load_config("tiny_gpt", ["cona.target_model=gpt3_1.3b", "model.seq_length=64",
                                   "cona.global_batch_sizes=[64,128,256,512,1024]"])
    target = load_config("gpt3_1.3b").model
    cluster = EmulatedCluster(target, "A100-80GB", 64)
    cands = build_candidates(cfg, target, 64, mapping=ProxyMapping(8, 64, 2048),
                             memory_limit_bytes=cluster.memory_limit_bytes)
    pick = recipe_strategy(cands, cluster.iter_s, recipe_batch("gpt3_1.3b"))
    at = [c for c in cands if c.global_batch_size == 512]
    assert len(at) > 3 and pick in at
    assert cluster.iter_s(pick) == min(cluster.iter_s(c) for c in at)
    fake = [Strategy(4, 1, 1, 1, 64), Strategy(2, 2, 1, 1, 64), Strategy(4, 1, 1, 1, 128)]
    times = {fake[0]: 2.0, fake[1]: 1.0, fake[2]: 0.1}
    assert recipe_strategy(fake, times.__getitem__, 64) == fake[1]
    with pytest.raises(ValueError, match="no candidate at global batch 256"):
        recipe_strategy(fake, times.__getitem__, 256)


def test_time_scale_on_known_numbers():
    """Catches a wrong exponent, a missing factor 2 (training at B_crit takes 2 E_min
    tokens), the ratio or sequence length left out, or a dilation not continuous in the
    measurement.  Kaplan et al. 2020: B_crit(L) = 2e8 / L^(1/0.21) tokens, so B = 2e8
    tokens is L = 1 and L = 2 is 2e8 / 2^4.762 = 7.36e6 tokens; with the noise scale
    20 -> 80 proxy sequences at r = 8, s_t = 2048: L = 3.846 -> 2.874.  The tokens are
    checked against an independent integral over S (midpoint rule, linear grid)."""
    from cona.targets import (
        critical_batch_tokens,
        loss_at_critical_batch,
        steps_to_loss,
        time_scale,
    )

    assert loss_at_critical_batch(2e8) == pytest.approx(1.0)
    assert critical_batch_tokens(2.0) == pytest.approx(2e8 / 2 ** (1 / 0.21))
    n = 1.21e9
    ts = time_scale(20, 80, ratio=8, target_seq=2048, params=n, segment_proxy_samples=3000)
    l0, l1 = ts["target_loss_range"]
    assert l0 == pytest.approx((2e8 / (8 * 20 * 2048)) ** 0.21) == pytest.approx(3.846, abs=1e-3)
    assert l1 == pytest.approx(2.874, abs=1e-3)
    floor = (6.5e13 / n) ** 0.077
    s0, s1 = steps_to_loss(l0, n), steps_to_loss(l1, n)
    assert (floor + (2.1e3 / s0) ** 0.76) == pytest.approx(l0)
    edges = np.linspace(s0, s1, 400_001)
    mid = (edges[1:] + edges[:-1]) / 2
    want = 2 * float(np.sum(2e8 / (floor + (2.1e3 / mid) ** 0.76) ** (1 / 0.21))
                     * (edges[1] - edges[0]))
    assert ts["target_tokens_per_run"] == pytest.approx(want, rel=1e-4)
    assert ts["step_dilation"] == pytest.approx(want / (8 * 3000 * 2048), rel=1e-4)
    near = time_scale(20, 80 * (1 + 1e-6), ratio=8, target_seq=2048, params=n,
                      segment_proxy_samples=3000)
    assert near["step_dilation"] == pytest.approx(ts["step_dilation"], rel=1e-4)
    with pytest.raises(ValueError, match="grow"):
        time_scale(80, 20, ratio=8, target_seq=2048, params=n, segment_proxy_samples=3000)
    with pytest.raises(ValueError, match="converged loss"):  # B_crit beyond the model's floor
        time_scale(20, 2000, ratio=8, target_seq=2048, params=n, segment_proxy_samples=3000)
    assert math.isfinite(ts["target_tokens_per_run"])


def test_noise_scale_trend_is_robust_to_a_loss_spike():
    """Catches the segment's ends read from single probes again, or a least-squares fit
    (which follows a spike's points): on exact power-law data ``phi = 3 L^-4`` the fit
    returns the law at any loss; with 2 of 12 probes in a spike (``tr`` 100x and
    ``|G|^2`` 3x: ``phi`` 33x, as measured on the Llama proxy after its warmup) it still
    returns the law exactly (Theil-Sen: over half the pairwise slopes are the law's),
    where least squares in ``log phi`` is more than 20 % off at the segment's end; a
    probe without a positive ``|G|^2`` is dropped."""
    from cona.targets import fit_noise_scale

    losses = np.linspace(7.6, 6.1, 12)
    g = losses ** 3.0  # any |G|^2: only the ratio matters
    t = 3.0 * losses ** -4.0 * g
    fit = fit_noise_scale(losses, g, t, [7.6, 6.1, 5.0])
    assert fit["slope"] == pytest.approx(-4.0) and fit["points"] == 12
    assert fit["at"] == pytest.approx([3.0 * v ** -4.0 for v in (7.6, 6.1, 5.0)])
    spiked_g, spiked_t = g.copy(), t.copy()
    spiked_g[[2, 3]] *= 3.0
    spiked_t[[2, 3]] *= 100.0
    robust = fit_noise_scale(losses, spiked_g, spiked_t, [6.1])["at"][0]
    assert robust == pytest.approx(3.0 * 6.1 ** -4.0)
    c, a = np.polyfit(np.log(losses), np.log(spiked_t / spiked_g), 1)
    assert math.exp(a + c * math.log(6.1)) / (3.0 * 6.1 ** -4.0) < 0.8
    assert fit_noise_scale([*losses, 6.0], [*g, -1.0], [*t, 1.0], [6.1])["points"] == 12
    with pytest.raises(ValueError, match="at least 3"):
        fit_noise_scale([7.0, 6.0], [1.0, 1.0], [1.0, 2.0], [6.5])
    with pytest.raises(ValueError, match="same loss"):
        fit_noise_scale([7.0, 7.0, 7.0], [1.0] * 3, [1.0, 2.0, 3.0], [6.5])


def test_trend_interval_covers_the_law_and_narrows_with_probes():
    """Catches a growth reported without its precision, or an interval that does not
    mean what it says: probes drawn from ``phi = 3 L^-4`` with a log scatter of sd 0.4
    (median absolute deviation 0.27; the Llama proxy's probes: 0.52) along a segment; over 20 draws the 95 % bootstrap
    interval at the segment's end holds the law on at least 16 (a fixed interval that
    missed would fail), and with 32 probes it is in log at most 0.7x as wide as with 8
    (about ``1/sqrt(4)``: the reason the bench probes 4x per evaluation).  Deterministic
    in its seed; bad arguments are named."""
    from cona.targets import trend_interval

    truth = 3.0 * 6.1 ** -4.0

    def draw(n, seed):
        rng = np.random.default_rng(seed)
        losses = np.linspace(7.6, 6.1, n)
        g = np.ones(n)
        return losses, g, 3.0 * losses ** -4.0 * np.exp(rng.normal(0.0, 0.4, n))

    widths = {8: [], 32: []}
    covered = 0
    for seed in range(20):
        for n in widths:
            lo, hi = trend_interval(*draw(n, seed), 6.1, draws=300, seed=seed)
            assert lo < hi
            widths[n].append(math.log(hi / lo))
            covered += n == 32 and lo <= truth <= hi
    assert covered >= 16
    assert np.mean(widths[32]) < 0.7 * np.mean(widths[8])
    data = draw(12, 0)
    assert trend_interval(*data, 6.1, draws=200) == trend_interval(*data, 6.1, draws=200)
    with pytest.raises(ValueError, match="level"):
        trend_interval(*data, 6.1, level=1.0)
    with pytest.raises(ValueError, match="draws"):
        trend_interval(*data, 6.1, draws=10)
    with pytest.raises(ValueError, match="at least 3"):
        trend_interval([7.0, 6.0], [1.0, 1.0], [1.0, 2.0], 6.5)
    with pytest.raises(ValueError, match="too few to bootstrap"):  # 3 probes: most draws
        trend_interval(*draw(3, 0), 6.1, draws=200)  # repeat one and have no slope


def _ar1_probes(n: int, seed: int, rho: float):
    """Probes of ``phi = 3 L^-4`` along a segment whose log scatter (sd 0.4) is an AR(1)
    in the probes' order with lag-1 correlation ``rho`` (neighbouring probes share a
    loss spike): ``(losses, grad_sq, trace)``."""
    rng = np.random.default_rng(seed)
    losses = np.linspace(7.6, 6.1, n)
    z = rng.normal(0.0, 0.4, n)
    e = np.empty(n)
    e[0] = z[0]
    for k in range(1, n):
        e[k] = rho * e[k - 1] + math.sqrt(1.0 - rho * rho) * z[k]
    return losses, np.ones(n), 3.0 * losses ** -4.0 * np.exp(e)


def test_block_bootstrap_widens_only_for_correlated_probes():
    """Catches an interval that counts correlated probes as independent: with an AR(1)
    scatter of lag-1 correlation 0.8 (60 probes, about 7 independent), the pairs
    bootstrap's 95 % interval held the law on 13 of 20 draws; the moving-block one, with
    :func:`cona.targets.bootstrap_block`'s length (Politis & White), is on average over
    twice as wide in log and holds it on at least 15 (measured 16).  With uncorrelated
    scatter the block stays short and the width within 1.3x of the pairs'."""
    from cona.targets import bootstrap_block, trend_interval

    truth = 3.0 * 6.1 ** -4.0
    for rho in (0.0, 0.8):
        covered, widths, blocks = {1: 0, "b": 0}, {1: [], "b": []}, []
        for seed in range(20):
            data = _ar1_probes(60, seed, rho)
            blocks.append(bootstrap_block(*data))
            for key, block in ((1, 1), ("b", blocks[-1])):
                lo, hi = trend_interval(*data, 6.1, block=block, draws=300, seed=seed)
                covered[key] += lo <= truth <= hi
                widths[key].append(math.log(hi / lo))
        ratio = np.mean(widths["b"]) / np.mean(widths[1])
        if rho == 0.0:
            assert np.median(blocks) <= 3 and ratio < 1.3
        else:
            assert np.median(blocks) >= 4 and ratio > 2.0
            assert covered["b"] >= 15 and covered["b"] > covered[1]
    with pytest.raises(ValueError, match="block"):
        trend_interval(*_ar1_probes(10, 0, 0.0), 6.1, block=11, draws=100)


def test_segment_growth_tells_a_step_from_a_rise():
    """Catches a growth bar met by one low probe at the start: a warm state probed at
    phi 5 and a segment whose noise scale is flat at ~20 (no trend) reads a direct
    growth of ~4x, but its growth along the segment is ~1x, with 1 inside its interval;
    probes on Kaplan's law ``phi ~ L^(-1/alpha_B)`` (the warm probe on it too) give the
    same growth both ways, and Kaplan's over the loss range inside the interval."""
    from bench.cona_reference import segment_growth
    from cona.targets import ALPHA_B

    rng = np.random.default_rng(0)
    losses = np.linspace(7.4, 6.2, 40)

    def probes(warm_phi, phis):
        return ([{"samples": 0, "val_loss": 7.6, "grad_sq": 1.0, "grad_trace": warm_phi}]
                + [{"samples": 40 * (i + 1), "val_loss": float(x), "grad_sq": 1.0,
                    "grad_trace": float(p)} for i, (x, p) in enumerate(zip(losses, phis))])

    noise = np.exp(rng.normal(0.0, 0.3, len(losses)))
    step = segment_growth(probes(5.0, 20.0 * noise), 6.2, 5.0)
    assert 3.0 < step["direct"] < 5.5
    assert 0.6 < step["along"] < 1.6
    assert step["along_interval"][0] < 1.0 < step["along_interval"][1]
    law = 20.0 * (losses / 7.6) ** (-1.0 / ALPHA_B) * noise
    rise = segment_growth(probes(20.0, law), 6.2, 20.0)
    assert rise["kaplan"] == pytest.approx((7.6 / 6.2) ** (1.0 / ALPHA_B))
    assert rise["along_interval"][0] < rise["kaplan"] < rise["along_interval"][1]
    assert rise["direct"] == pytest.approx(rise["along"], rel=0.3)
    assert rise["bootstrap_block"] <= 3 and rise["points"] == 40  # uncorrelated scatter
    # a segment too short to bootstrap (a quick run's): the growths, no intervals, no error
    short = segment_growth(probes(5.0, 20.0 * noise)[:6], 6.2, 5.0)
    assert short["direct"] > 0 and short["bootstrap_block"] == 1
    assert short["direct_interval"] is None or short["direct_interval"][0] > 0


def test_growth_bench_reads_a_results_probes_and_names_one_without_them():
    """Catches ``bench/cona_growth.py`` reading anything but the run's own probes, or
    failing obscurely on a result from before the bench stored them: the direct growth
    is the trend at the target over the warm probe (flat ~20 over 5: ~4x), the first
    probes are the segment's, and a reference without probes is named."""
    from bench.cona_growth import growth_from

    rng = np.random.default_rng(1)
    probes = [{"samples": 0, "val_loss": 7.6, "grad_sq": 1.0, "grad_trace": 5.0}] + [
        {"samples": 40 * (i + 1), "val_loss": float(x), "grad_sq": 2.0,
         "grad_trace": float(40.0 * math.exp(rng.normal(0.0, 0.2)))}
        for i, x in enumerate(np.linspace(7.4, 6.2, 30))]
    result = {"models": {"fam": {"target_ppl": math.exp(6.2), "reference": {
        "noise_scale_probes": probes, "noise_scale_warm_proxy": 5.0,
        "segment_samples": 1200}}}}
    f = growth_from(result)["fam"]
    assert f["probes"] == 30 and f["warm_probe"] == 5.0
    assert f["first_probes"] == pytest.approx([p["grad_trace"] / 2.0 for p in probes[1:5]])
    assert 3.0 < f["direct"] < 5.5 and f["direct_interval_pairs"][0] < f["direct"]
    assert f["along_interval"][0] < 1.0 < f["along_interval"][1]
    del result["models"]["fam"]["reference"]["noise_scale_probes"]
    with pytest.raises(ValueError, match="stores no noise-scale probes"):
        growth_from(result)


def test_dilated_clock_charges_steps_not_switches():
    """Catches a dilation applied to switch costs (a batch switch is one real target step,
    a layout switch real seconds) or evaluations left uncharged: with k = 50 and an
    evaluation share of 256 / (3 x 64) target steps per proxy step, a proxy step costs
    (50 + 4/3) target steps; a batch switch costs one target step."""
    from cona.emulated import EmulatedCluster, eval_steps_per_step
    from cona.strategy import Strategy

    target = load_config("gpt3_1.3b").model
    plain = EmulatedCluster(target, "A100-80GB", 64)
    e = eval_steps_per_step(256, 64)
    assert e == pytest.approx(4 / 3)
    dil = EmulatedCluster(target, "A100-80GB", 64, step_dilation=50, eval_steps=e)
    a, b, c = Strategy(16, 4, 1, 4, 64), Strategy(16, 4, 1, 4, 128), Strategy(8, 8, 1, 8, 64)
    assert dil.iter_s(a) == pytest.approx((50 + 4 / 3) * plain.iter_s(a))
    assert dil.switch_s(a, b) == pytest.approx(plain.iter_s(b)) == dil.target_step_s(b)
    assert dil.switch_s(a, c) == pytest.approx(plain.switch_s(a, c))
    with pytest.raises(ValueError, match="step_dilation"):
        EmulatedCluster(target, "A100-80GB", 64, step_dilation=0.5)


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


def test_seeds_aggregate_to_a_mean_with_misses_as_null_and_layout_switches_counted():
    """Catches a mean that skips a seed that missed the target (a biased ``ttp_s``), a
    missed seed not reported as null, or batch switches counted as layout switches: seeds
    at 10 s and 14 s give 12 s; one missed gives ``ttp_s`` null with the miss in
    ``ttp_s_by_seed``; a chain dp8-tp8 gb64 -> dp8-tp8 gb128 -> dp16-tp4 gb128 has two
    switches, one of them a layout switch (also the plot's marker kinds)."""
    from bench.cona_aggregate import aggregate
    from bench.cona_plot import switch_points

    chain = [{"strategy": "dp8-tp8-pp1-mb8-gb64"}, {"strategy": "dp8-tp8-pp1-mb8-gb128"},
             {"strategy": "dp16-tp4-pp1-mb8-gb128"}]
    a = {"cona": {"ttp_s": 10.0, "chain": chain, "switches": 2, "switch_times_s": [1.0, 2.0]}}
    b = {"cona": {"ttp_s": 14.0, "chain": chain[:1], "switches": 0, "lr_factor": 0.5}}
    miss = {"cona": {"ttp_s": None, "chain": chain[:1], "switches": 0}}
    out = aggregate([a, b])["cona"]
    assert out["ttp_s"] == pytest.approx(12.0) and out["ttp_s_by_seed"] == [10.0, 14.0]
    assert out["layout_switches"] == 1 and out["layout_switches_by_seed"] == [1, 0]
    assert out["switches"] == 2 and out["switches_by_seed"] == [2, 0]
    assert out["lr_factor_by_seed"] == [None, 0.5]  # each seed's own, not the first's
    assert out["chain_by_seed"] == [[c["strategy"] for c in chain], [chain[0]["strategy"]]]
    missed = aggregate([a, miss])["cona"]
    assert missed["ttp_s"] is None and missed["ttp_s_by_seed"] == [10.0, None]
    assert switch_points(a["cona"]) == [(1.0, "batch"), (2.0, "layout")]


def test_probe_plot_marks_the_warm_state_only_where_its_probe_read_a_signal():
    """Catches the plot's warm-state marker put on the segment's first probe when the warm
    state's own probe read no positive signal (it was filtered out and the next probe took
    its place), and probes scaled other than by the batch ratio (target sequences)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.cona_plot import plot_probes

    def probe(loss, g, t):
        return {"val_loss": loss, "grad_sq": g, "grad_trace": t}

    result = {"mapping": {"ratio": 8.0}, "target_ppl": 100.0,
              "reference": {"noise_scale_probes": [probe(5.0, -1.0, 3.0), probe(4.9, 1.0, 2.0),
                                                   probe(4.8, 1.0, 4.0)]}}
    fig, ax = plt.subplots()
    plot_probes(ax, result)
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert "warm state" not in labels
    seg = ax.get_lines()[labels.index("reference, direct probes")]
    assert list(seg.get_ydata()) == [16.0, 32.0]
    result["reference"]["noise_scale_probes"][0] = probe(5.0, 1.0, 1.0)
    ax.clear()
    plot_probes(ax, result)
    warm = [ln for ln in ax.get_lines() if ln.get_label() == "warm state"]
    assert [list(w.get_ydata()) for w in warm] == [[8.0]]
    plt.close(fig)


def test_best_static_chosen_once_is_the_lowest_mean_and_sizes_the_selection(monkeypatch):
    """Catches a "best static chosen once" that is each seed's own best again (no
    selection sized), a mean over seeds taken from one seed, or a cut run's lower bound
    reported as a TTP.  Three settings on two seeds, ``static_oracle`` each seed's best:
    A reaches at 10 and 14 s (mean 12), B at 9 and 17 (13), C is cut at 12 on the first
    seed and reaches 11 on the second (its mean 11.5 is a bound, below A's).  So the
    winner is C with ``ttp_s`` null and bound 11.5; without C, A at 12 s exact; the
    selection is the mean of the seeds' best (9 and 11, or 9 and 14) over that."""
    from bench.cona_aggregate import static_fixed

    def seed(runs):
        best = min((r[2] for r in runs if r[2] is not None), default=None)
        keys = ("strategy", "lr_factor", "ttp_s", "ttp_lower_bound_s")
        return {"static_oracle": {"ttp_s": best, "runs": [dict(zip(keys, r)) for r in runs]}}

    a, b, c = ("gb256", 1.0), ("gb128", 1.0), ("gb256", 0.5)
    seeds = [[(*a, 10.0, None), (*b, 9.0, None), (*c, None, 12.0)],
             [(*a, 14.0, None), (*b, 17.0, None), (*c, 11.0, None)]]
    out = static_fixed([seed(r) for r in seeds])
    assert (out["strategy"], out["lr_factor"], out["ttp_s"]) == ("gb256", 0.5, None)
    assert out["ttp_lower_bound_s"] == pytest.approx(11.5)
    assert out["ttp_s_by_seed"] == [None, 11.0]
    assert out["selection"] == pytest.approx(10.0 / 11.5)
    exact = static_fixed([seed(r[:2]) for r in seeds])
    assert (exact["strategy"], exact["ttp_s"], exact["ttp_s_by_seed"]) == ("gb256", 12.0, [10.0, 14.0])
    assert exact["selection"] == pytest.approx(11.5 / 12.0)
    assert static_fixed([{"static_oracle": {"ttp_s": 3.0}}]) is None  # an older JSON
    # the recipe's 1x run is in the sweep twice (the search's own, reused): counted once
    twice = [r[:1] + r for r in seeds]
    assert static_fixed([seed(r) for r in twice]) == static_fixed([seed(r) for r in seeds])
    assert static_fixed([seed(r[:1] * 2) for r in seeds])["ttp_s"] == pytest.approx(12.0)
    longer = [[(*c, None, 12.0), (*c, None, 13.0)], [(*c, 11.0, None)]]  # cut twice: 13 holds
    assert static_fixed([seed(r) for r in longer])["ttp_lower_bound_s"] == pytest.approx(12.0)
    assert static_fixed([seed(r) for r in longer])["selection"] is None  # a seed with no best
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    from render_cona import _static_fixed  # its line: a bound read as a bound

    assert "≥ 12 s" in _static_fixed(out, 6.0) and "1.92x (at least" in _static_fixed(out, 6.0)
    assert "at most 0.87x" in _static_fixed(out, 6.0)
    assert "12 s mean" in _static_fixed(exact, 6.0) and "at least" not in _static_fixed(exact, 6.0)
    assert _static_fixed(None, 6.0) == ""


def test_oracle_windows_count_steps_from_the_search_root_after_a_warm_start():
    """Catches evaluation steps passed to the oracle as the trainer's absolute step: from a
    warm state at step 200 the oracle timed every evaluation 200 steps late (its chain's
    curve started 200 x iter_s after its own clock's zero).  A window of 4 steps evaluated
    at steps 2 and 4 from a job at trainer step 200 must report steps 2 and 4; then one of
    3 steps (evaluated at its second) must end on an evaluation of its own."""
    from types import SimpleNamespace

    from cona.baselines import ProxyBranch
    from cona.strategy import Strategy

    s = Strategy(8, 8, 1, 8, 64)
    job = SimpleNamespace(trainer=SimpleNamespace(step=200), consumed_samples=1600,
                          set_strategy=lambda strategy: None)
    ttp = SimpleNamespace(reached=False, crossing=None)
    progress = SimpleNamespace(evals=[], ttp=ttp)

    def step():
        job.trainer.step += 1
        job.consumed_samples += 8
        if job.trainer.step % 2 == 0:
            progress.evals = [*progress.evals, {"step": job.trainer.step, "val_ppl": 9.0}]

    loop = SimpleNamespace(done=False, progress=progress, step=step)
    ctx = SimpleNamespace(candidates=[s], cluster=SimpleNamespace(iter_s=lambda c: 1.0))
    run = ProxyBranch(ctx, job, loop).run_window(64, 1600 + 4 * 8, stop=lambda steps: False)
    assert run.steps == 4 and [e["step"] for e in run.evals] == [2, 4]
    # a window that ends between evaluations ends on one (the greedy rule and the bound
    # read it; a large batch on the clock cadence may have none in its window)
    loop.evaluate = lambda: setattr(progress, "evals", [
        *progress.evals, {"step": job.trainer.step, "val_ppl": 8.0}])
    run = ProxyBranch(ctx, job, loop).run_window(64, job.consumed_samples + 3 * 8,
                                                 stop=lambda steps: False)
    assert run.steps == 3 and run.eval_steps == (2, 3) and run.evals[-1]["val_ppl"] == 8.0


def test_lr_sweep_cut_is_exact_for_the_minimum():
    """Catches a sweep cut that drops a run which would have beaten the best so far:
    ``static_oracle`` is a minimum, so a swept run may stop only once its TTP is
    certain to exceed the bound.  Random perplexity curves evaluated every 10 emulated
    s, TTP interpolated (:class:`TTPTracker`): a run cut by :func:`past_bound` never
    has an uncut TTP below the bound, and an uncut TTP below the bound is found
    unchanged.  The hand-made case is the one a cut on the clock between evaluations
    gets wrong: TTP 107.1 s < bound 108 s, but the crossing's evaluation is at 110 s."""
    from cona.baselines import past_bound
    from jobruntime.metrics import TTPTracker

    def run(ppls, bound, cut):
        t, evals = TTPTracker(100.0), []
        for j, ppl in enumerate(ppls):
            time_s = 10.0 * (j + 1)
            evals.append({"time_s": time_s, "val_ppl": ppl})
            if t.update(ppl, time_s, j, j):
                return t.ttp_s
            if cut and past_bound(evals, bound):
                return "cut"
        return None

    crossing = [400.0] * 9 + [130.0, 90.0]  # above at 100 s, below at 110 s
    assert run(crossing, 1e9, cut=False) == pytest.approx(100 + 10 * math.log(1.3) / math.log(130 / 90))
    assert run(crossing, 108.0, cut=True) == run(crossing, 108.0, cut=False) < 108.0
    rng = np.random.default_rng(0)
    cuts = 0
    for _ in range(500):
        ppls = list(300.0 * np.exp(-np.cumsum(rng.uniform(0.0, 0.3, size=40))))
        bound = float(rng.uniform(20.0, 200.0))
        full, cut = run(ppls, bound, cut=False), run(ppls, bound, cut=True)
        if cut == "cut":
            cuts += 1
            assert full is None or full > bound
        else:
            assert cut == full
    assert cuts > 50  # the cut does fire


def test_recipe_lr_sweep_takes_the_best_factor_and_cuts_the_rest_at_it(monkeypatch):
    """Catches a static_recipe that keeps the scaling rule's LR where another factor of the
    sweep reaches the target sooner, a later factor run without the bound of the best so
    far or the known run's (cost) or with a bound when none reached yet, a known run
    trained again, and a missed sweep that reports a bound other than the lowest of its
    runs' (the only valid one): factors 0.5, 1, 2 reach at 300 s (run under the known
    run's bound 500 s), (known) 500 s and never (cut at the bound 300 s)."""
    import cona.baselines as baselines

    calls = []

    def fake_static(ctx, strategy, f, budget_samples=None, bound_s=None):
        calls.append((f, bound_s))
        ttp = {0.5: 300.0, 2.0: None}[f]
        return {"ttp_s": ttp, "lr_factor": f, **({} if ttp else {"ttp_lower_bound_s": 310.0})}

    monkeypatch.setattr(baselines, "run_static", fake_static)
    best, runs = baselines.run_lr_sweep(None, "s", (0.5, 1.0, 2.0), budget_samples=10,
                                        known={1.0: {"ttp_s": 500.0}})
    assert calls == [(0.5, 500.0), (2.0, 300.0)]
    assert best["ttp_s"] == 300.0 and best["lr_factor"] == 0.5
    assert [r["lr_factor"] for r in runs] == [0.5, 1.0, 2.0]
    assert [x["ttp_s"] for x in best["lr_sweep"]] == [300.0, 500.0, None]

    def missed(ctx, strategy, f, budget_samples=None, bound_s=None):
        return {"ttp_s": None, "lr_factor": f, "ttp_lower_bound_s": {0.5: 900.0, 1.0: 700.0}[f]}

    monkeypatch.setattr(baselines, "run_static", missed)
    best, _ = baselines.run_lr_sweep(None, "s", (0.5, 1.0))
    assert best["ttp_s"] is None and best["ttp_lower_bound_s"] == 700.0
    with pytest.raises(ValueError, match="lr_factors"):
        baselines.run_lr_sweep(None, "s", ())


def test_bench_runs_each_seed_of_a_family_after_its_setup_and_reuses_only_its_own(
        tmp_path):
    """Catches a scheduler that gives every seed the same seed index, hands a seed another
    family's setup, drops a seed's result or writes it nowhere, or a reuse that reads back
    a seed made under another set-up: two families of three seeds (in-process executor)
    must each get seeds 0, 1, 2 with their own setup, every seed's result must reach its
    family's report and ``out/NAME/seed_K.json``; a second run with ``reuse`` and no
    training reports the same seeds from disk, except one whose set-up key changed."""
    import json

    from bench.seeded_units import run_units

    calls = []

    def seed(name, spec, setup, i):
        calls.append((name, setup["of"], i))
        return {"seed": i, "of": setup["of"]}

    fns = dict(setup=lambda name, spec: {"of": name}, seed=seed,
               key=lambda setup, i: f"{setup['of']}{i}",
               finish=lambda name, spec, setup, seeds: {"seeds": seeds})
    models = {"a": {}, "b": {}}
    report = run_units(models, 1, 3, str(tmp_path), **fns)
    assert sorted(calls) == [(f, f, i) for f in "ab" for i in range(3)]
    for f in "ab":
        assert [(x["seed"], x["of"], x["seed_index"]) for x in report[f]["seeds"]] == \
            [(i, f, i) for i in range(3)]
        assert json.loads((tmp_path / f / "seed_2.json").read_text())["setup_key"] == f"{f}2"
    fns["key"] = lambda setup, i: "changed" if (setup["of"], i) == ("b", 1) else \
        f"{setup['of']}{i}"
    calls.clear()
    again = run_units(models, 1, 3, str(tmp_path), reuse=True, train=False, **fns)
    assert calls == []
    assert [x["seed_index"] for x in again["a"]["seeds"]] == [0, 1, 2]
    assert [x["seed_index"] for x in again["b"]["seeds"]] == [0, 2]
    assert all(x["reused"] for f in "ab" for x in again[f]["seeds"])


def test_a_seed_file_is_written_as_soon_as_its_seed_ends(monkeypatch, tmp_path):
    """Catches seed files written in seed order: a run stopped while seed 0 was still
    training lost seed 1, which had ended an hour earlier.  Seed 0 here ends only after it
    sees seed 1's file (or after 5 s: then the file was not written in time)."""
    import concurrent.futures as cf
    import time

    import bench.seeded_units as units

    seen = []

    def seed(name, spec, setup, i):
        if i == 0:
            t0 = time.monotonic()
            while not (tmp_path / name / "seed_1.json").exists() and time.monotonic() - t0 < 5:
                time.sleep(0.02)
            seen.append((tmp_path / name / "seed_1.json").exists())
        return {"seed": i}

    monkeypatch.setattr(units, "executor", lambda jobs: cf.ThreadPoolExecutor(max_workers=2))
    units.run_units({"a": {}}, 2, 2, str(tmp_path), setup=lambda name, spec: {}, seed=seed,
                    key=lambda setup, i: f"k{i}", finish=lambda *a: {})
    assert seen == [True]


def test_efficiency_prediction_error_is_in_ratios_between_batches():
    """Catches an error measure anchored at the reference batch (a definition that predicts
    every batch at 1 would look good where the reference's LR makes batch 128 measure above
    1): the error is the mean over pairs of batches that reached of |ln(predicted ratio /
    measured ratio)|.  By hand: measured 1.0, 1.2, 0.6 at 64, 128, 256 (the 512 run missed);
    a prediction of 1.0, 0.9, 0.5 is off by ln(1.2/0.9) = 0.288 on 64/128, ln(0.6/0.5) =
    0.182 on 64/256 and |ln(0.5/0.9) - ln(0.6/1.2)| = 0.105 on 128/256: mean 0.192."""
    from bench.cona_efficiency import DEFINITIONS, prediction_error

    def row(measured, predicted, reached=True):
        label = "efficiency" if reached else "efficiency_at_most"
        return {"measured": {label: measured},
                "predicted": {k: {"efficiency": predicted} for k in DEFINITIONS}}

    batches = {64: row(1.0, 1.0), 128: row(1.2, 0.9), 256: row(0.6, 0.5),
               512: row(0.1, 0.4, reached=False)}
    err = prediction_error(batches)
    want = (math.log(1.2 / 0.9) + math.log(0.6 / 0.5) + abs(math.log(0.5 / 0.9) - math.log(0.5))) / 3
    assert err["simple"] == pytest.approx(want) and want == pytest.approx(0.192, abs=1e-3)
    batches[128]["predicted"]["newton"] = None
    batches[256]["predicted"]["newton"] = None
    assert prediction_error(batches)["newton"] is None  # one batch left: no pair


def test_efficiency_at_the_best_lr_takes_each_batch_and_the_reference_at_its_own_best():
    """Catches an efficiency "at the best LR" that keeps the reference at the rule's LR,
    takes a run cut short (not reached) as a batch's best, or drops the rule's row.  By
    hand: the reference 64 needs 1,500 samples at 1x and 1,200 at 2x, so its best is
    2x; 128 is best at 2x (1,300), 256 at 0.5x (1,800; its 2x run was cut at 2,100);
    512 reached at no factor.  At the best LR the efficiencies are 1,200 / 1,300 = 0.923,
    1,200 / 1,800 = 0.667 and at most 1,200 / 3,000 (missed); at the rule's LR they stay
    1,500 / 1,400 and 1,500 / 2,000, and with one factor no best-LR error is reported."""
    from bench.cona_efficiency import ADAM, DEFINITIONS, compare

    def rec(samples, factor=1.0, reached=True):
        return {"samples": samples, "reached": reached, "lr_factor": factor}

    by_lr = {64: {1.0: rec(1500), 0.5: rec(1600, 0.5, False), 2.0: rec(1200, 2.0)},
             128: {1.0: rec(1400), 0.5: rec(1500, 0.5, False), 2.0: rec(1300, 2.0)},
             256: {1.0: rec(2000), 0.5: rec(1800, 0.5), 2.0: rec(2100, 2.0, False)},
             512: {1.0: rec(3000, reached=False), 2.0: rec(2500, 2.0, False)}}
    trajectory = [{"samples": s, **dict.fromkeys(DEFINITIONS, 40.0), ADAM: None}
                  for s in (600, 1200)]
    out = compare(by_lr, trajectory, 64, 8)
    rows = out["batches"]
    assert [rows[b]["measured_best_lr"]["lr_factor"] for b in (64, 128, 256, 512)] == [2.0, 2.0,
                                                                                      0.5, 1.0]
    assert rows[128]["measured_best_lr"]["efficiency"] == pytest.approx(1200 / 1300)
    assert rows[256]["measured_best_lr"]["efficiency"] == pytest.approx(1200 / 1800)
    assert rows[512]["measured_best_lr"]["efficiency_at_most"] == pytest.approx(1200 / 3000)
    assert rows[256]["measured"]["efficiency"] == pytest.approx(1500 / 2000)
    assert rows[256]["measured_best_lr"]["by_lr"]["2.0"] == {"samples": 2100, "reached": False}
    assert out["prediction_error_best_lr"]["simple"] is not None
    one = compare({b: {1.0: runs[1.0]} for b, runs in by_lr.items()}, trajectory, 64, 8)
    assert one["prediction_error_best_lr"] is None
    assert "measured_best_lr" not in one["batches"][128]
    assert one["prediction_error"] == out["prediction_error"]
    assert "curvature" not in out["prediction_error"]  # not measured: not reported
    # --curvature: its noise scales are predicted from and scored like the others'
    curved = [{**p, "curvature": 4000.0, "curvature_sgd": None} for p in trajectory]
    with_curv = compare({b: {1.0: runs[1.0]} for b, runs in by_lr.items()}, curved, 64, 8)
    assert with_curv["prediction_error"]["curvature"] is not None
    assert with_curv["prediction_error"]["curvature_sgd"] is None  # never positive
    assert with_curv["batches"][128]["predicted"]["curvature"]["efficiency"] > \
        with_curv["batches"][128]["predicted"]["simple"]["efficiency"]  # larger phi


def test_adam_prediction_integrates_each_points_efficiency_curve():
    """Catches the Adam-consistent prediction (cona/adam_efficiency.py) read as a noise scale
    or at the wrong batch: each trajectory interval's samples over that point's progress
    ratio.  By hand: 600 samples at progress 1.0 / 2.0 (batch 128 / reference 64) and 600
    at 1.5 / 2.0 need 600 / 0.5 + 600 / 0.75 = 2,000 samples at 128; a point without the
    curve gives no prediction."""
    from bench.cona_efficiency import ADAM, predicted_samples

    trajectory = [{"samples": 600, ADAM: {"64": 2.0, "128": 1.0}},
                  {"samples": 1200, ADAM: {"64": 2.0, "128": 1.5}}]
    assert predicted_samples(trajectory, 128, 64, 8, ADAM) == pytest.approx(2000)
    assert predicted_samples(trajectory, 64, 64, 8, ADAM) == pytest.approx(1200)
    trajectory[1][ADAM] = {"64": 2.0}  # 128 above the probe's sequences there
    assert predicted_samples(trajectory, 128, 64, 8, ADAM) is None


def test_cona_ablation_runs_with_its_override_and_leaves_the_config_as_it_was():
    """Catches an ablation row that runs the default controller (the override not seen by
    the job it builds) or leaks into the runs after it (ctx.cfg left changed, also when
    the run fails); and the table's rows: the default's row names its definition, each
    ablation row its own."""
    import dataclasses
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from cona.baselines import run_cona

    cfg = load_config("tiny_gpt")
    seen = []

    def make_job():
        seen.append(ctx.cfg.cona.gns_definition)
        raise RuntimeError("stop here")

    ctx = SimpleNamespace(cfg=cfg, make_job=make_job)
    before = dataclasses.asdict(cfg.cona)
    with pytest.raises(RuntimeError, match="stop here"):
        run_cona(ctx, gns_definition="newton")
    assert seen == ["newton"] and dataclasses.asdict(cfg.cona) == before

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from render_cona import _methods

    rows = dict(_methods({"cona_gns_definition": "simple",
                          "methods": {"cona": {}, "cona_gns_newton": {}, "static_recipe": {}}}))
    assert rows["cona"] == "CONA (`simple` noise scale)"
    assert rows["cona_gns_newton"] == "CONA, `newton` noise scale (ablation)"


def test_setup_key_names_what_a_seed_depends_on_and_not_how_many_seeds_run():
    """Catches a key over the seed count (a one-seed run's seed 0 could then not be
    reused by a three-seed run of the same set-up) or one that misses a setting a seed
    does depend on (its reuse would report another bench's result)."""
    from bench.cona_ttp import FULL, setup_key
    from jobruntime.config import load_config

    setup = {"cfg": load_config("tiny_gpt", []), "boundaries": [10, 20]}
    key = setup_key(setup, 0, dict(FULL, time_scale="calibrated"))
    assert setup_key(setup, 0, dict(FULL, seeds=1, time_scale="measured")) == key
    assert setup_key(setup, 1, dict(FULL)) != key
    assert setup_key(setup, 0, dict(FULL, windows=3)) != key
    assert setup_key(dict(setup, boundaries=[10, 21]), 0, dict(FULL)) != key


def test_adam_memory_variants_scale_only_their_moment():
    """Catches bench/cona_adam_memory.py scaling the wrong hyperparameter: ``beta1`` and
    ``beta2`` scale only their own beta by the square-root rule from the anchor, ``sde``
    all three (eps by 1/sqrt(kappa)), ``preset`` none, and the anchor batch itself is
    unchanged by every variant."""
    from bench.cona_adam_memory import adam_variant

    preset = (0.9, 0.95, 1e-8)
    assert adam_variant(preset, "preset", 64, 256) == preset
    assert adam_variant(preset, "beta1", 64, 256) == pytest.approx((0.975, 0.95, 1e-8))
    assert adam_variant(preset, "beta2", 64, 256) == pytest.approx((0.9, 0.9875, 1e-8))
    assert adam_variant(preset, "sde", 64, 256) == pytest.approx((0.975, 0.9875, 2e-8))
    for variant in ("beta1", "beta2", "sde"):
        assert adam_variant(preset, variant, 256, 256) == pytest.approx(preset)


def test_adam_memory_family_runs_each_variant_with_its_betas(monkeypatch):
    """Catches bench/cona_adam_memory.py running a variant at the wrong betas, running the
    anchor batch under a rule, leaving a variant's betas set for the next run or seed, or
    a per-seed efficiency paired with another seed's anchor: with a fake set-up and static
    run whose samples encode the seed, batch and beta2, every run's betas and every ratio
    are checked against hand-computed values."""
    import types

    import bench.cona_adam_memory as bench
    import cona.baselines

    train = types.SimpleNamespace(adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, seed=0)
    cfg = types.SimpleNamespace(train=train, cona=types.SimpleNamespace(lr_scaling="sqrt"))
    cfg.train.target_ppl = 100.0
    seen = []

    def fake_context(cfg_, ctx0, k, probes):
        return types.SimpleNamespace(cfg=cfg, candidates=None, seed=k,
                                     cluster=types.SimpleNamespace(iter_s=None))

    def fake_run(ctx, strategy):
        t = ctx.cfg.train
        seen.append((ctx.seed, strategy, t.adam_beta1, t.adam_beta2, t.adam_eps))
        samples = 1000 * (ctx.seed + 1) + strategy + (500 if t.adam_beta2 > 0.95 else 0)
        return {"samples": samples, "reached": True}, []

    monkeypatch.setattr(bench.ttp, "worker_setup", lambda proxy: None)
    monkeypatch.setattr(bench.ttp, "family_setup", lambda *a: (cfg, None, None, None, None))
    monkeypatch.setattr(bench, "_seed_context", fake_context)
    monkeypatch.setattr(bench, "static_run", fake_run)
    monkeypatch.setattr(cona.baselines, "fastest_per_batch", lambda c, f: {64: 64, 256: 256})
    out = bench.memory_family("gpt3_1.3b", {"proxy": "tiny_gpt"}, (64, 256), ("beta2",), 2,
                              None)
    assert [(k, b) for k, b, *_ in seen] == [(0, 64), (0, 256), (0, 64), (1, 64), (1, 256),
                                             (1, 64)]
    assert seen[0][2:] == seen[1][2:] == (0.9, 0.95, 1e-8)  # preset, anchor included
    assert seen[2][2:] == pytest.approx((0.9, 0.9875, 1e-8))  # beta2 by the rule at 64
    assert seen[3][2:] == (0.9, 0.95, 1e-8)  # the next seed starts at the preset again
    assert (train.adam_beta1, train.adam_beta2) == (0.9, 0.95)
    assert out["runs"]["beta2"][64]["samples_by_seed"] == [1564, 2564]
    assert out["efficiency_by_seed"]["beta2"][64] == pytest.approx([1564 / 1256, 2564 / 2256])
    assert out["efficiency"]["preset"][64] == pytest.approx(((1064 + 2064) / 2) / ((1256 + 2256) / 2))
    assert 256 not in out["runs"]["beta2"]


_PARENT = """
import sys, time
sys.path.insert(0, {root!r})
from bench.seeded_units import executor
from tests.test_cona_bench_rules import _report_pid_and_sleep

pool = executor(2)
futures = [pool.submit(_report_pid_and_sleep, {out!r}, i) for i in range(2)]
time.sleep(600)
"""


def _report_pid_and_sleep(folder: str, i: int) -> None:
    import os
    import time

    Path(folder, f"{i}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_bench_workers_end_when_the_bench_is_killed(tmp_path):
    """Catches a bench's spawned workers outliving it: killed with SIGKILL (as ``kill -9
    PID`` of the bench alone, not its process group), its two workers, each in a task of
    10 minutes, are gone within 20 s (they ran on for an hour beside the next run before
    ``bench.seeded_units._die_with_parent``)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = str(Path(__file__).resolve().parent.parent)
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(root=root, out=str(tmp_path))],
                              cwd=root, start_new_session=True)
    try:
        deadline = time.time() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 2, "the workers did not start"
        parent.send_signal(signal.SIGKILL)
        parent.wait()

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            state = Path(f"/proc/{pid}/stat").read_text().split()[2] \
                if Path(f"/proc/{pid}/stat").exists() else "X"
            return state != "Z"  # a zombie has ended

        deadline = time.time() + 20
        while any(alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids)
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in tmp_path.glob("*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
