"""The online noise-scale correction (cona/progress_fit.py) on loss curves with a known answer."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from cona.progress_fit import fit_noise_scale_factor
from cona.surrogate import statistical_efficiency

M0, PHI = 64, 100.0
U0 = 16000.0  # samples trained before the records (a warm start)


def _curve(true_factor, batches, seed=0, sigma=0.002, history_batch=M0, u0=U0):
    """Per-step records whose loss is a function of effective samples at phi_true =
    true_factor * PHI, while the controller's measured noise scale is PHI; the ``u0``
    samples before the records ran at ``history_batch``.  The curve bends as deep in
    training (the samples grow by ~25 % over the window)."""
    rng = np.random.default_rng(seed)
    start = u0 * statistical_efficiency(history_batch, true_factor * PHI, M0)
    samples, losses, u = [], [], start
    consumed = u0
    for m in batches:
        losses.append(2.0 + 10.0 * u ** -0.3 + sigma * rng.standard_normal())
        consumed += m / 8  # proxy samples: the target batch / an 8x ratio
        u += m / 8 * statistical_efficiency(m, true_factor * PHI, M0)
        samples.append(consumed)
    return samples, losses, list(batches), [PHI] * len(batches)


@pytest.mark.parametrize("true_factor", [0.25, 1.0, 4.0])
def test_the_factor_of_a_known_law_is_recovered(true_factor):
    batches = [64] * 150 + [256] * 150
    fit = fit_noise_scale_factor(*_curve(true_factor, batches), M0)
    assert fit is not None and fit.batches == (64, 256)
    assert abs(math.log2(fit.best_factor / true_factor)) <= 0.5, fit
    # what decisions would use at the best fit: the new batch's efficiency over the old one's
    ratio = [statistical_efficiency(256, k * PHI, M0) for k in (fit.best_factor, true_factor)]
    assert abs(math.log(ratio[0] / ratio[1])) < 0.1
    _assert_conservative(fit, true_factor)
    if true_factor != 1.0:
        assert fit.evidence > 3.84


def _assert_conservative(fit, true_factor):
    """The factor used lies between 1 and the best fit, on the truth's side of 1."""
    if true_factor == 1.0:
        assert fit.factor == 1.0, fit
    else:
        lo, hi = sorted((1.0, fit.best_factor))
        assert lo <= fit.factor <= hi and fit.factor != 1.0, fit
        assert (fit.factor > 1) == (true_factor > 1), fit


def test_a_large_factor_is_read_as_near_perfect_scaling():
    """At k = 16 both batches are far below phi: E(256)/E(64) = 0.90 and k is weakly
    identified; the fit must still see that the new batch lost little (k >= 4)."""
    fit = fit_noise_scale_factor(*_curve(16.0, [64] * 150 + [256] * 150), M0)
    assert fit.best_factor >= 4.0 and fit.factor > 1.0 and fit.evidence > 3.84, fit


def test_a_factor_off_the_grid_is_not_identified():
    """The truth (k = 16) beyond a grid that ends at 4: the minimum sits at the edge, and
    an edge is not an estimate, so the factor used stays 1."""
    records = _curve(16.0, [64] * 150 + [256] * 150)
    fit = fit_noise_scale_factor(*records, M0, factors=(1.0, 2.0, 4.0))
    assert fit.best_factor == 4.0 and fit.factor == 1.0 and fit.evidence > 3.84, fit
    assert fit_noise_scale_factor(*records, M0).factor > 1.0  # the full grid holds it


def test_noise_hides_the_factor():
    """Five times the per-step noise: the same kink is no longer evidence enough."""
    fit = fit_noise_scale_factor(*_curve(4.0, [64] * 150 + [256] * 150, sigma=0.01), M0)
    assert fit.factor == 1.0 and fit.evidence < 3.84, fit


def test_a_decrease_of_the_batch_is_read_the_same_way():
    fit = fit_noise_scale_factor(*_curve(4.0, [256] * 150 + [128] * 150), M0)
    assert fit is not None and abs(math.log2(fit.best_factor / 4.0)) <= 0.5, fit
    _assert_conservative(fit, 4.0)


def test_pure_noise_is_not_evidence():
    """A flat loss with noise holds no information on k: the fit stays at 1."""
    rng = np.random.default_rng(3)
    n = 300
    batches = [64] * 150 + [256] * 150
    samples = list(U0 + np.cumsum([b / 8 for b in batches]))
    losses = list(3.0 + 0.05 * rng.standard_normal(n))
    fit = fit_noise_scale_factor(samples, losses, batches, [PHI] * n, M0)
    assert fit.factor == 1.0 and fit.evidence < 3.84, fit


def test_a_history_at_another_batch_is_not_read_as_a_kink():
    """Catches the samples before the window counted at efficiency 1 whatever batch trained
    them: after a run at 512, a change 512 -> 256 with k = 1 true read k = 4 on every
    draw (a review helper's reproduction)."""
    batches = [512] * 150 + [256] * 150  # the window: 29 % of the samples before it
    fits = [fit_noise_scale_factor(*_curve(1.0, batches, seed=s, history_batch=512,
                                           u0=30000.0), M0) for s in range(10)]
    assert sum(f.factor != 1.0 for f in fits) <= 1, [f.best_factor for f in fits]


def test_a_window_that_doubles_the_samples_is_not_fitted():
    """Early in training (the window trains more than half the samples before it) a line
    in log effective samples does not hold: no fit, rather than a kink read from the
    curve's bend."""
    assert fit_noise_scale_factor(*_curve(1.0, [64] * 150 + [256] * 150, u0=4000.0),
                                  M0) is None


def test_no_batch_change_or_too_few_points_gives_no_fit():
    assert fit_noise_scale_factor(*_curve(4.0, [64] * 200), M0) is None
    assert fit_noise_scale_factor(*_curve(4.0, [64] * 200 + [256] * 10), M0) is None
    # the ramp is left out: 30 steps after the change, 15 skipped, 15 < min_points
    assert fit_noise_scale_factor(*_curve(4.0, [64] * 200 + [256] * 30), M0,
                                  skip_after_change=15) is None


def test_the_ramp_is_left_out_of_the_fit():
    """A transient right after the switch (the optimizer's moments adapting) would read
    as a kink; skipped, the factor is still recovered."""
    samples, losses, batches, phis = _curve(4.0, [64] * 150 + [256] * 150)
    for i in range(150, 160):
        losses[i] += 0.3  # a bump over the ramp
    bumped = fit_noise_scale_factor(samples, losses, batches, phis, M0)
    skipped = fit_noise_scale_factor(samples, losses, batches, phis, M0, skip_after_change=10)
    assert abs(math.log2(skipped.best_factor / 4.0)) <= 0.5, skipped
    assert bumped.best_factor != skipped.best_factor


def test_bad_records_are_refused():
    samples, losses, batches, phis = _curve(1.0, [64] * 50 + [256] * 50)
    with pytest.raises(ValueError, match="one entry per step"):
        fit_noise_scale_factor(samples[:-1], losses, batches, phis, M0)
    with pytest.raises(ValueError, match="positive"):
        fit_noise_scale_factor(samples, losses, batches, [0.0] * 100, M0)


@pytest.mark.parametrize("mode", ["progress", "off"])
def test_the_controller_ranks_at_the_corrected_noise_scale(mode):
    """After 64 -> 512 with the loss following phi_true = 4 phi, the controller ranks at
    the fit's conservative factor (between 1 and ~4) times the estimator's noise scale with
    ``progress``, at 1x with ``off``; it tests the change once, when the window after it
    (``horizon_steps`` = 100 steps past the 10-step ramp) is in."""
    from tests.test_cona_controller import BIG_GB, SMALL_GB, _controller

    ctl = _controller([SMALL_GB, BIG_GB], SMALL_GB, noise_scale=PHI,
                      efficiency_correction=mode)
    assert ctl.gns.noise_scale == pytest.approx(PHI)
    samples, losses, batches, _ = _curve(4.0, [64] * 150 + [512] * 150, u0=2 * U0)
    for i, (s, loss, b) in enumerate(zip(samples, losses, batches, strict=True)):
        if i == 150:
            ctl.commit_switch(BIG_GB)
        assert ctl.current.global_batch_size == b
        ctl.record_progress(s, loss)
        if i == 150 + 10 + 98:  # one step short of the window: no test yet
            ctl.decide(i)
            assert ctl.last_fit is None
    d = ctl.decide(300)
    if mode == "off":
        assert ctl.noise_scale_factor == 1.0 and d.noise_scale == pytest.approx(PHI)
        assert "noise_scale_factor" not in d.extra and not ctl._progress
        return
    assert abs(math.log2(ctl.last_fit.best_factor / 4.0)) <= 0.5 + 1e-9, ctl.last_fit
    assert ctl.noise_scale_factor == ctl.last_fit.factor
    _assert_conservative(ctl.last_fit, 4.0)
    tested = ctl.last_fit
    ctl.record_progress(samples[-1] + 64, losses[-1])
    ctl.decide(310)
    assert ctl.last_fit is tested  # the same change is not tested again
    assert d.noise_scale == pytest.approx(PHI * ctl.noise_scale_factor)
    assert d.extra["progress_fit"]["batches"] == [64, 512]
    state = json.loads(json.dumps(ctl.state_dict()))  # as a checkpoint holds it
    restored = _controller([SMALL_GB, BIG_GB], SMALL_GB, noise_scale=PHI,
                           efficiency_correction=mode)
    restored.load_state_dict(state)
    assert restored.noise_scale_factor == ctl.noise_scale_factor
    assert list(restored._progress) == list(ctl._progress)
    assert restored.last_fit == ctl.last_fit  # its decisions still log the fit they use
    assert restored.decide(320).extra["progress_fit"] == ctl.last_fit.to_dict()
    # resumed with the correction off: the saved factor is not applied
    off = _controller([SMALL_GB, BIG_GB], SMALL_GB, noise_scale=PHI)
    off.load_state_dict(state)
    assert off.noise_scale_factor == 1.0 and off.decide(320).noise_scale == pytest.approx(PHI)
