"""Gradient noise scale: estimator algebra and agreement with a brute-force computation."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from cona.grad_stats import (
    GradientNoiseScale,
    estimate_from_norms,
    grad_sq_norm,
    microbatch_grad_sq_norms,
)


def test_estimator_recovers_exact_expectations():
    """Catches a swapped or mis-signed term in McCandlish App. A.1: fed the exact
    expectations E|G_B|^2 = |G|^2 + tr(Sigma)/B it must return |G|^2 and tr(Sigma)
    exactly (float rounding only)."""
    g_sq, trace = 2.0, 10.0
    small, big = g_sq + trace / 4, g_sq + trace / 32
    assert estimate_from_norms(small, 4, big, 32) == pytest.approx((g_sq, trace), rel=1e-12)
    est = GradientNoiseScale(ema_decay=0.9)
    assert est.noise_scale is None and est.g_sq is None
    for _ in range(3):
        est.update([small, small], 4, big, 32)
    # bias-corrected EMAs of a constant are that constant
    assert est.g_sq == pytest.approx(g_sq) and est.trace_sigma == pytest.approx(trace)
    assert est.noise_scale == pytest.approx(trace / g_sq)
    with pytest.raises(ValueError, match="small_batch < big_batch"):
        est.update(small, 32, big, 32)
    with pytest.raises(ValueError, match="non-negative"):
        est.update(-1.0, 4, big, 32)


def test_noise_scale_none_when_signal_estimate_not_positive():
    """Catches reporting a negative or infinite noise scale when |G|^2's estimate is <= 0
    (pure-noise steps): the controller must then see None, not rank on garbage."""
    est = GradientNoiseScale()
    est.update(1.0, 4, 0.05, 64)  # 64*0.05 - 4*1 < 0
    assert est.g_sq < 0 and est.noise_scale is None


def test_outlier_step_is_skipped():
    """Catches one freak batch wrecking the estimate: on the bundled corpus a loss spike
    with a 17x gradient norm drove the EMA of |G|^2 negative (noise scale None) for over
    a hundred steps.  A step whose |G_big|^2 is 300x the running mean must be skipped and
    counted, leaving the estimate unchanged; ordinary steps are still added."""
    g_sq, trace = 2.0, 10.0
    small, big = g_sq + trace / 4, g_sq + trace / 32
    est = GradientNoiseScale(ema_decay=0.9)
    for _ in range(5):
        est.update(small, 4, big, 32)
    before = est.noise_scale
    est.update(small * 300, 4, big * 300 - 60, 32)  # raw |G|^2 estimate hugely off
    assert est.num_skipped == 1 and est.noise_scale == before
    est.update(small, 4, big, 32)
    assert est.num_updates == 6 and est.to_dict()["gns_skipped"] == 1
    keep_all = GradientNoiseScale(ema_decay=0.9, outlier_factor=None)
    for _ in range(5):
        keep_all.update(small, 4, big, 32)
    keep_all.update(small * 300, 4, big * 300 - 60, 32)
    assert keep_all.num_skipped == 0 and keep_all.noise_scale != before
    with pytest.raises(ValueError, match="outlier_factor"):
        GradientNoiseScale(outlier_factor=1.0)


def _problem():
    torch.manual_seed(0)
    n, d, c = 2048, 16, 4
    x = torch.randn(n, d)
    y = (x @ torch.randn(d, c) + 1.5 * torch.randn(n, c)).argmax(1)
    model = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, c))
    return model, x, y


def _loss(model, mb):
    x, y = mb
    return nn.functional.cross_entropy(model(x), y)


def test_microbatch_helper_leaves_full_batch_gradient():
    """Catches summing instead of averaging micro-batch gradients (a factor m error in
    |G_big|^2 that would wreck the noise scale): after the helper, p.grad equals one
    backward on the concatenated batch, and the big norm is its squared norm (rel 1e-5,
    float32 summation order)."""
    model, x, y = _problem()
    mbs = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 32, 8)]
    small, big = microbatch_grad_sq_norms(model, _loss, mbs)
    helper_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _loss(model, (x[:32], y[:32])).backward()
    for g, p in zip(helper_grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    assert big == pytest.approx(grad_sq_norm(model.parameters()), rel=1e-5)
    assert len(small) == 4 and min(small) > big  # small batches are noisier


def test_gns_matches_brute_force_within_20_percent():
    """Catches any bias in the two-batch estimator or in how norms are fed (per-sample vs
    per-batch mean, wrong batch sizes).  Brute force on a fixed 2-layer MLP over 2048
    synthetic examples: per-example gradients by vmap, G = their mean, tr(Sigma) = mean
    squared deviation (population covariance, matching i.i.d. sampling with replacement),
    B_simple = tr(Sigma)/|G|^2 (~40 samples here).  The estimator sees 200 steps of 8
    micro-batches of 8 drawn with replacement; a micro-batch gradient is the mean of its
    examples' gradients (the helper's equivalence to backward() is tested above), which
    keeps the test well under a second even on a loaded 2-core machine.  Over seeds 1-6
    the error was 0.4-2.5 %; 20 % leaves a wide margin for platform float differences
    while a factor-of-m bug (8x) or the naive |G_small|^2/|G_big|^2 ratio fails it."""
    model, x, y = _problem()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss1(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss1), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(x), -1) for g in per.values()], 1).double()  # (N, P)
    g_full = flat.mean(0)
    trace = ((flat - g_full) ** 2).sum(1).mean().item()
    brute = trace / g_full.pow(2).sum().item()

    gen = torch.Generator().manual_seed(1)
    est = GradientNoiseScale(ema_decay=0.99)
    mb, n_mb, steps = 8, 8, 200
    idx = torch.randint(0, len(x), (steps, n_mb, mb), generator=gen)
    g_mb = flat[idx].mean(2)  # (steps, n_mb, P) micro-batch gradients
    small = g_mb.pow(2).sum(-1)  # (steps, n_mb)
    big = g_mb.mean(1).pow(2).sum(-1)  # (steps,) global-batch gradient
    for t in range(steps):
        est.update(small[t].tolist(), mb, big[t].item(), mb * n_mb)
    assert 10 < brute < 200  # the regime the tolerance was sized for
    assert est.noise_scale == pytest.approx(brute, rel=0.20)
    assert est.trace_sigma == pytest.approx(trace, rel=0.20)

    restored = GradientNoiseScale()
    restored.load_state_dict(est.state_dict())
    assert restored.noise_scale == est.noise_scale
    # a state saved before scale-free averaging continues as the plain ratio of its EMAs
    old = {k: v for k, v in est.state_dict().items()
           if k not in ("normalize", "g_rel", "trace_rel")}
    restored.load_state_dict(old)
    assert not restored.normalize
    assert restored.noise_scale == pytest.approx(est.trace_sigma / est.g_sq)


def _linear_regression_run(seed, *, d=20, sigma=1.0, batch=256, mb=16, lr=0.003, steps=900,
                           every=90, normalize=True):
    """SGD on least squares with x ~ N(0, I_d), y = x.w* + N(0, sigma^2): the per-sample
    gradient g = x (x.delta - eps), delta = w - w*, has mean G = delta and
    tr(Sigma) = (d + 1)|delta|^2 + sigma^2 d (Gaussian fourth moment), so the true
    noise scale B = tr(Sigma)/|G|^2 grows as w converges.  Returns (true, estimated)
    noise scales every ``every`` steps (the controller's decision points)."""
    gen = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=gen, dtype=torch.float64)
    w = torch.zeros(d, dtype=torch.float64)
    est = GradientNoiseScale(normalize=normalize)
    true, seen = [], []
    for t in range(1, steps + 1):
        x = torch.randn(batch, d, generator=gen, dtype=torch.float64)
        eps = sigma * torch.randn(batch, generator=gen, dtype=torch.float64)
        g = x * (x @ (w - w_star) - eps)[:, None]  # (batch, d) per-sample gradients
        g_mb = g.reshape(batch // mb, mb, d).mean(1)
        est.update(g_mb.pow(2).sum(1).tolist(), mb, g.mean(0).pow(2).sum().item(), batch)
        if t % every == 0:
            delta_sq = (w - w_star).pow(2).sum().item()
            true.append(((d + 1) * delta_sq + sigma**2 * d) / delta_sq)
            seen.append(est.noise_scale)
        w -= lr * g.mean(0)
    return true, seen


def test_gns_growth_detected_where_true_noise_scale_is_known():
    """Catches an estimator (or growth report) that misses the rise of the noise scale the
    controller chains on: on least squares, where the true noise scale is known in closed
    form and grows ~12x over 900 SGD steps, the growth between the first and last decision
    point reported by ``noise_scale_growth`` must be >= 4x and within 35 % of the true
    growth, and every decision-point estimate within 35 % of the truth.  Measured over
    seeds 0-9 with the scale-free average (the default): growth error at most 24 %, point
    error at most 24 % (plain ratio of EMAs: 21 % and 29 %; |G|^2 is a small difference
    of noisy norms late in the run); 35 % still fails an estimator off by the micro-batch
    factor (16x) or one that does not grow."""
    from cona.grad_stats import noise_scale_growth

    true, seen = _linear_regression_run(seed=0)
    assert noise_scale_growth(true) > 10
    got = noise_scale_growth(seen)
    assert got >= 4 and got == pytest.approx(noise_scale_growth(true), rel=0.35)
    for t, s in zip(true, seen):
        assert s == pytest.approx(t, rel=0.35)
    assert noise_scale_growth([None, 2.0, 8.0]) == 4.0 and noise_scale_growth([5.0]) is None


def test_scale_free_average_follows_a_fast_rise():
    """Catches the lag of the plain ratio of EMAs (seen on the CONA bench: 44 where a direct
    measurement gave 125 on tiny_bert): when |G|^2 falls several-fold within the EMA's
    window, old large-gradient steps dominate both EMAs.  On least squares at lr 0.01 the
    true noise scale grows 27x in 300 steps; over seeds 0-4 and the last four decision
    points (every 30 steps) the scale-free estimate must read >= 0.78 of the truth on
    average (measured 0.85), where the plain ratio reads 0.66 (asserted <= 0.72, so the
    problem is one where the lag shows)."""
    def mean_ratio(normalize):
        ratios = []
        for seed in range(5):
            true, seen = _linear_regression_run(seed, lr=0.01, steps=300, every=30,
                                                normalize=normalize)
            ratios += [s / t for t, s in zip(true[-4:], seen[-4:])]
        return sum(ratios) / len(ratios)

    assert mean_ratio(True) >= 0.78
    assert mean_ratio(False) <= 0.72
