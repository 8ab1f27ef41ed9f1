"""Surrogate (Pollux goodput) and the online controller's decisions."""

from __future__ import annotations

import math

import pytest

from cona.controller import Controller
from cona.cost_model import CostModel
from cona.grad_stats import GradientNoiseScale
from cona.lr_rule import ramp_lr, scale_adam, scale_beta, scale_lr
from cona.picks import best_goodput_strategy, best_throughput_strategy, start_strategy
from cona.strategy import Strategy
from cona.surrogate import chaining_ceiling, goodput, rank_strategies, statistical_efficiency
from jobruntime.config import ConaConfig, load_config

GPT3 = load_config("gpt3_1.3b").model
SLOW = Strategy(1, 1, 8, 1, 64)  # ~30 samples/s on 8x A100 (pipeline bubble)
FAST = Strategy(8, 1, 1, 4, 64)  # ~63 samples/s, same global batch
SMALL_GB = Strategy(8, 1, 1, 1, 64)  # ~48 samples/s
BIG_GB = Strategy(8, 1, 1, 4, 512)  # ~65 samples/s, 8x the batch


def _gns(noise_scale: float | None) -> GradientNoiseScale:
    """An estimator holding exactly ``noise_scale`` (fed exact expectations, |G|^2 = 1)."""
    est = GradientNoiseScale()
    if noise_scale is not None:
        est.update(1 + noise_scale / 8, 8, 1 + noise_scale / 64, 64)
    return est


def _controller(candidates, current, noise_scale=None, **cfg):
    cfg = ConaConfig(**{"decision_interval": 10, "min_gain": 0.05, "horizon_steps": 100, **cfg})
    return Controller(
        candidates,
        CostModel(GPT3, "A100-80GB"),
        _gns(noise_scale),
        cfg,
        current=current,
        base_lr=2e-4,
    )


def test_statistical_efficiency_pollux():
    """Catches an inverted Pollux ratio: E(M0) = 1, E falls with M, large noise scales make
    big batches nearly free (E -> 1), and goodput = throughput * E.  Exact arithmetic."""
    assert statistical_efficiency(64, 100.0, 64) == 1.0
    assert statistical_efficiency(512, 100.0, 64) == pytest.approx(164 / 612)
    assert statistical_efficiency(512, 1e9, 64) == pytest.approx(1.0, abs=1e-6)
    assert statistical_efficiency(512, None, 64) == 1.0
    assert goodput(10.0, 512, 100.0, 64) == pytest.approx(10 * 164 / 612)
    with pytest.raises(ValueError):
        statistical_efficiency(0, 1.0, 64)


def test_noise_scale_decides_batch_size():
    """Catches a surrogate that ignores statistical efficiency (it would always pick the
    bigger, faster batch): at a noise scale of 10 samples the 64-sequence batch must win;
    at 10^4 (late training) the 512-sequence batch must win."""
    cm = CostModel(GPT3, "A100-80GB")
    assert best_throughput_strategy([SMALL_GB, BIG_GB], cm) == BIG_GB
    assert best_goodput_strategy([SMALL_GB, BIG_GB], cm, 10.0, 64) == SMALL_GB
    assert best_goodput_strategy([SMALL_GB, BIG_GB], cm, 1e4, 64) == BIG_GB
    ranked = rank_strategies([SMALL_GB, BIG_GB], cm, 10.0, 64)
    assert ranked[0].score >= ranked[1].score

    ctrl = _controller([SMALL_GB, BIG_GB], SMALL_GB, noise_scale=10.0)
    assert not ctrl.decide(10).switch
    ctrl.gns = _gns(1e4)
    d = ctrl.decide(20)
    assert d.switch and d.best == BIG_GB


def test_a_transient_noise_scale_does_not_switch_a_sustained_one_does():
    """Catches decisions that follow a loss spike's noise scale (on the Llama proxy the
    online estimate rose 6-8x for ~30 steps; CONA moved to 4x its batch and back, 25 %
    slower than staying): at 10 samples the 64-batch wins, at 10^4 the 512-batch.  With
    the default window of 5 decisions, two decisions in a spike to 10^4 leave it at 64
    (median 10); a rise that lasts switches at its third decision (median 10^4).  With a
    window of 1 (the latest estimate alone) the spike's first decision switches."""
    def run(levels, window):
        ctrl = _controller([SMALL_GB, BIG_GB], SMALL_GB, gns_decision_window=window)
        for k, phi in enumerate(levels, 1):
            ctrl.gns = _gns(phi)
            if ctrl.decide(10 * k).switch:
                return k
        return None

    spike = [10.0, 10.0, 10.0, 1e4, 1e4, 10.0, 10.0, 10.0]
    assert run(spike, 5) is None
    assert run([10.0, 10.0, 10.0, 1e4, 1e4, 1e4, 1e4], 5) == 6
    assert run(spike, 1) == 4


def test_switches_when_clearly_better_candidate_appears():
    """Catches a controller that never switches, or ranks on the model while ignoring
    measurements.  (1) Start on SLOW: FAST scores ~2x and saves ~110 s over 100 steps,
    more than the 30 s prior switch cost -> switch, logged with step/current/best/scores.
    (2) Start on FAST, the model's favourite, but measure it 3x slower than modelled while
    SLOW measures as modelled -> SLOW is now clearly better -> switch; the measured switch
    cost then replaces the prior."""
    ctrl = _controller([SLOW, FAST], SLOW)
    assert [ctrl.should_decide(s) for s in (0, 5, 10, 20)] == [False, False, True, True]
    d = ctrl.decide(10)
    assert d.switch and d.best == FAST and d.gain > 0.5
    assert d.time_saved_s > d.switch_cost_s == 30.0
    log = ctrl.decisions[-1]
    assert {"step", "current", "best", "scores", "reason"} <= set(log)
    assert log["current"] == SLOW.label and log["best"] == FAST.label
    assert set(log["scores"]) == {SLOW.label, FAST.label}

    # a candidate that only measurements reveal as better: start on FAST, measure it 3x
    # slower than modelled -> SLOW becomes clearly better
    ctrl = _controller([SLOW, FAST], FAST)
    assert not ctrl.decide(10).switch
    predicted = ctrl.cost_model.iteration_time(FAST)
    ctrl.record_iteration(3.0 * predicted)
    ctrl.record_iteration(ctrl.cost_model.analytic(SLOW).analytic_s, SLOW)  # as modelled
    d = ctrl.decide(20)
    assert d.switch and d.best == SLOW
    assert ctrl.commit_switch(SLOW, measured_cost_s=12.0) == pytest.approx(2e-4)
    assert ctrl.current == SLOW and ctrl.switch_cost_s(FAST) == 12.0


def test_no_switch_when_switch_cost_cannot_be_repaid():
    """Catches ignoring the switch cost: with a 10-step horizon FAST saves ~11 s < 30 s
    prior; with the default horizon but a measured 500 s switch cost it saves ~110 s
    < 500 s; with 640 samples left in the budget the horizon is ~20 s.  None may switch."""
    ctrl = _controller([SLOW, FAST], SLOW, horizon_steps=10)
    d = ctrl.decide(10)
    assert not d.switch and d.best == FAST and "switch cost" in d.reason
    ctrl = _controller([SLOW, FAST], SLOW)
    ctrl.record_switch_cost("layout", 500.0)
    d = ctrl.decide(10)
    assert not d.switch and d.switch_cost_s == 500.0
    # the horizon never reaches past the end of the budget: with 640 samples left
    # (~20 s at SLOW's ~30 samples/s) no 30 s switch can pay back, whatever the horizon
    ctrl = _controller([SLOW, FAST], SLOW)
    assert ctrl.decide(10).switch
    ctrl = _controller([SLOW, FAST], SLOW)
    d = ctrl.decide(10, remaining_samples=640)
    assert not d.switch and "switch cost" in d.reason


def test_no_switch_below_min_gain():
    """Catches flapping between near-equal strategies: FAST vs dp8-mb2 differ by ~11 %;
    with min_gain 0.2 the controller must stay, with 0.05 it may go."""
    other = Strategy(8, 1, 1, 2, 64)
    ctrl = _controller([FAST, other], other, min_gain=0.2)
    d = ctrl.decide(10)
    assert not d.switch and "min_gain" in d.reason
    assert _controller([FAST, other], other, min_gain=0.05).decide(10).switch


def test_without_noise_scale_only_same_global_batch():
    """Catches switching to a larger global batch before the GNS is known (efficiency 1 for
    every batch would make the biggest, fastest batch win blindly)."""
    ctrl = _controller([SMALL_GB, BIG_GB, FAST], SMALL_GB, noise_scale=None)
    d = ctrl.decide(10)
    assert BIG_GB.label not in d.scores
    assert d.best == FAST and d.switch


def test_lr_scaling_rules():
    """Catches wrong exponents in lr = lr_ref * (B/B_ref)^k: 4x the batch gives 2x (sqrt),
    4x (linear), 1x (none); and the controller applies it from the reference batch."""
    assert scale_lr(1e-3, 256, 64, "sqrt") == pytest.approx(2e-3)
    assert scale_lr(1e-3, 256, 64, "linear") == pytest.approx(4e-3)
    assert scale_lr(1e-3, 256, 64, "none") == pytest.approx(1e-3)
    assert scale_lr(1e-3, 16, 64, "sqrt") == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="lr_scaling"):
        scale_lr(1e-3, 256, 64, "cubic")
    ctrl = _controller([SMALL_GB, BIG_GB], SMALL_GB, lr_scaling="linear")
    assert ctrl.lr() == pytest.approx(2e-4)
    assert ctrl.commit_switch(BIG_GB) == pytest.approx(2e-4 * 8)


def test_adam_square_root_scaling_rule():
    """Catches a wrong square-root scaling rule for Adam's betas and eps (Malladi et al.
    2022, Sec. 5): at 4x the batch ``1 - beta`` is 4x and eps halves, so each moment's
    time constant in samples, ``batch / (1 - beta)``, is the same at every batch; a batch
    whose betas would leave [0, 1) is refused, naming the largest that works."""
    (b1, b2), eps = scale_adam((0.9, 0.95), 1e-8, 256, 64)
    assert (b1, b2, eps) == pytest.approx((0.6, 0.8, 5e-9))
    (c1, c2), ceps = scale_adam((0.9, 0.95), 1e-8, 16, 64)
    assert (c1, c2, ceps) == pytest.approx((0.975, 0.9875, 2e-8))
    for batch, (x1, x2) in ((256, (b1, b2)), (16, (c1, c2))):
        assert batch / (1 - x1) == pytest.approx(64 / 0.1)
        assert batch / (1 - x2) == pytest.approx(64 / 0.05)
    assert scale_adam((0.9, 0.95), 1e-8, 64, 64) == ((0.9, 0.95), 1e-8)
    assert scale_adam((0.0, 0.95), 1e-8, 64, 64)[0] == (0.0, 0.95)  # beta 0 is an EMA too
    assert scale_adam((0.9, 0.95), 1e-8, 640, 64)[0][0] == pytest.approx(0.0, abs=1e-12)  # the edge
    assert scale_beta(0.95, 10240, 512) == 0.0  # the edge, where 20 x 0.05 rounds above 1
    with pytest.raises(ValueError, match="at most 640"):
        scale_adam((0.9, 0.95), 1e-8, 1024, 64)  # 1 - 16 * 0.1 < 0
    with pytest.raises(ValueError, match="betas must be in"):
        scale_adam((0.9, 1.0), 1e-8, 128, 64)


def test_state_dict_roundtrip():
    """Catches losing controller state across a checkpoint or a switch restart (current
    strategy, measured switch costs, GNS EMAs, calibration)."""
    ctrl = _controller([SLOW, FAST], SLOW, noise_scale=50.0)
    ctrl.record_iteration(5.0)
    ctrl.commit_switch(FAST, measured_cost_s=7.0)
    ctrl.decide(10)
    other = _controller([SLOW, FAST], SLOW)
    other.load_state_dict(ctrl.state_dict())
    assert other.current == FAST and other.gns.noise_scale == pytest.approx(50.0)
    assert other.cost_model.iteration_time(SLOW) == pytest.approx(5.0)
    assert other.switch_cost_s(SLOW) == 7.0  # a layout switch, priced as measured
    # the decision count and the window of noise scales carry over, not the records
    assert other.decisions == [] and other.decisions_before == len(ctrl.decisions) == 1
    assert other.decision_noise_scale() == ctrl.decision_noise_scale()
    assert not other.wants_start_decision(11, 10)  # no second start decision
    # a checkpoint saved right after a switch: the switch's prediction is scored at the
    # resumed run's first step (it was lost, and with it that prediction's error)
    ctrl.commit_switch(SLOW)
    resumed = _controller([SLOW, FAST], SLOW)
    resumed.load_state_dict(ctrl.state_dict())
    for c in (ctrl, resumed):
        c.record_iteration(6.0, SLOW)
    assert resumed.state_dict()["prediction_errors"] == ctrl.state_dict()["prediction_errors"]


def test_wrong_extrapolation_discounts_unmeasured_layouts():
    """Catches flapping on a poor cost model (real mode on CPU with an A100 model): after a
    switch to FAST that turns out hardly faster than SLOW (the prediction was off by ~2x),
    another never-measured layout that the (now globally calibrated) model still predicts
    ~1.3x faster must not trigger a switch; a same-layout batch change, whose prediction
    rests on FAST's own measurement, is not discounted."""
    tp2 = Strategy(4, 2, 1, 4, 64)
    ctrl = _controller([SLOW, FAST, tp2, BIG_GB], SLOW, noise_scale=None)
    cm = ctrl.cost_model
    slow_s = cm.analytic(SLOW).analytic_s
    ctrl.record_iteration(slow_s)
    d = ctrl.decide(10)
    assert d.switch and d.best == FAST
    ctrl.commit_switch(FAST, measured_cost_s=1.0)
    ctrl.record_iteration(0.95 * slow_s)  # FAST measured: hardly faster than SLOW
    assert ctrl.prediction_error("global") == pytest.approx(
        math.log(0.95 * slow_s / cm.analytic(FAST).analytic_s), rel=0.01
    )
    assert cm.calibration_source(tp2) == "global"
    undiscounted = rank_strategies([FAST, tp2], cm, None, 64)
    assert undiscounted[0].strategy == tp2 and undiscounted[0].score > 1.2 * undiscounted[1].score
    d = ctrl.decide(20)
    assert not d.switch and d.best == FAST and "prediction_error" in ctrl.decisions[-1]
    ctrl.gns = _gns(1e4)  # a batch change on FAST's layout rests on FAST's own measurement
    assert cm.calibration_source(BIG_GB) == "layout"
    ranked = {sc.strategy: sc.score for sc in ctrl.rank()}
    plain = {sc.strategy: sc.score for sc in rank_strategies([BIG_GB, tp2], cm, 1e4, 64)}
    assert ranked[BIG_GB] == plain[BIG_GB] and ranked[tp2] < 0.6 * plain[tp2]


def test_cheap_batch_switch_beats_top_candidate_behind_costly_layout_switch():
    """Catches a controller that tests only the top-ranked candidate against its
    switch cost (what kept CONA in its start layout on the GPT-3 grid): from
    dp4-tp2 at micro-batch 1, the top candidate is the dp8 layout, whose 500 s
    switch cannot repay, while dp4-tp2 at micro-batch 8 (a batch-only switch,
    1 s) saves time -> switch to it; with the batch switch as dear as the layout
    switch, nothing repays and the controller stays."""
    cur = Strategy(4, 2, 1, 1, 64)
    same_layout = Strategy(4, 2, 1, 8, 64)
    layout = Strategy(8, 1, 1, 8, 64)
    ctrl = _controller([cur, same_layout, layout], cur, noise_scale=4096.0)
    ranked = [sc.strategy for sc in ctrl.rank()]
    assert ranked == [layout, same_layout, cur], "the test needs the dp8 layout on top"
    ctrl.record_switch_cost("layout", 500.0)
    d = ctrl.decide(10)
    assert d.switch and d.best == same_layout and d.switch_cost_s == 1.0
    assert ctrl.decisions[-1]["top_ranked"] == layout.label
    ctrl = _controller([cur, same_layout, layout], cur, noise_scale=4096.0)
    ctrl.record_switch_cost("layout", 500.0)
    ctrl.record_switch_cost("batch", 500.0)
    assert not ctrl.decide(10).switch


def test_candidate_below_min_gain_does_not_block_one_above():
    """Catches a net-saving choice made before the min_gain test: from dp4-tp2 at
    micro-batch 1, the batch-only switch gains ~0.75 and the dp8 layout ~0.89;
    with min_gain 0.8 only the layout qualifies, and it repays its 30 s prior
    -> switch to it (not: pick the batch switch on net saving, then refuse it)."""
    cur, same_layout, layout = Strategy(4, 2, 1, 1, 64), Strategy(4, 2, 1, 8, 64), \
        Strategy(8, 1, 1, 8, 64)
    ctrl = _controller([cur, same_layout, layout], cur, noise_scale=4096.0, min_gain=0.8)
    scores = {sc.strategy: sc.score for sc in ctrl.rank()}
    assert scores[same_layout] / scores[cur] - 1 < 0.8 < scores[layout] / scores[cur] - 1
    d = ctrl.decide(10)
    assert d.switch and d.best == layout and d.switch_cost_s == 30.0


class _Rates:
    """A cost model stub: samples/s per strategy label."""

    def __init__(self, rates: dict[str, float]):
        self.rates = rates

    def samples_per_second(self, s: Strategy) -> float:
        return self.rates[s.label]


def test_start_strategy_plans_one_switch_ahead():
    """Known answer: at batch 64, layout A is fastest (100) but runs batch 128 at only 110;
    layout B is 2 % slower at 64 and runs batch 128 at 150 (a batch-only switch later).
    Slack 5 % starts in B, slack 0 (or 1 %) in A; a grid without a larger batch, or a
    larger batch B cannot run, keeps the fastest; so does a budget over which B's premium
    exceeds the switch cost it would save.  Catches a start rule that ignores the next
    batch (always A), the slack, or the budget (B at any cost)."""
    a64, a128 = Strategy(8, 8, 1, 8, 64), Strategy(8, 8, 1, 8, 128)
    b64, b128 = Strategy(16, 4, 1, 4, 64), Strategy(16, 4, 1, 8, 128)
    c64 = Strategy(32, 2, 1, 2, 64)  # far slower now, fastest later: outside the slack
    c128 = Strategy(32, 2, 1, 4, 128)
    cm = _Rates({a64.label: 100.0, a128.label: 110.0, b64.label: 98.0, b128.label: 150.0,
               c64.label: 80.0, c128.label: 200.0})
    grid = [a64, a128, b64, b128, c64, c128]
    assert start_strategy(grid, cm, 64, 0.05) == b64
    assert start_strategy(grid, cm, 64, 0.25) == c64
    assert start_strategy(grid, cm, 64, 0.0) == a64
    assert start_strategy(grid, cm, 64, 0.01) == a64
    assert start_strategy([a64, b64, c64], cm, 64, 0.05) == a64
    assert start_strategy([a64, a128, b64, c128], cm, 64, 0.05) == a64
    assert start_strategy(grid, cm, 128, 0.05) == c128
    # The premium over the budget (samples * (1/98 - 1/100) s = 0.204 s per 1,000
    # samples) must stay below the switch cost it saves: 10 s layout against 1 s batch.
    def switch_s(old, new):
        return 1.0 if (old.dp, old.tp) == (new.dp, new.tp) else 10.0

    assert start_strategy(grid, cm, 64, 0.05, budget_samples=40_000, switch_s=switch_s) == b64
    assert start_strategy(grid, cm, 64, 0.05, budget_samples=50_000, switch_s=switch_s) == a64
    with pytest.raises(ValueError, match="no candidate at global batch 256"):
        start_strategy(grid, cm, 256, 0.05)
    with pytest.raises(ValueError, match="slack"):
        start_strategy(grid, cm, 64, 1.0)


def test_chaining_ceiling_known_answer():
    """Two batches, M0 = 1 at 1 sample/s and M = 3 at 2 samples/s: goodputs cross at a
    noise scale of 1, which a noise scale growing 16-fold from 1/2 meets a quarter of the
    way.  Closed form: static M takes int (1/2 + 1/(1+phi(u))) du over [0, 1], the ideal
    chain 1/4 + the same integral over [1/4, 1], with int du/(1+phi) = u - ln(1+phi)/ln 16.
    Catches an inverted efficiency, a chain that may pick a slower batch, and a ceiling
    when nothing changes (growth 1 -> 1.0)."""
    def f(u):  # antiderivative of 1/(1 + 0.5 * 16**u)
        return u - math.log(1 + 0.5 * 16 ** u) / math.log(16)

    ideal = 0.25 + 0.375 + (f(1.0) - f(0.25))
    static_m = 0.5 + (f(1.0) - f(0.0))
    best, c = chaining_ceiling({1: 1.0, 3: 2.0}, 0.5, 8.0, 1, steps=20000)
    assert static_m < 1.0 and best == 3
    assert c == pytest.approx(static_m / ideal, rel=1e-6)
    assert c > 1.02
    assert chaining_ceiling({1: 1.0, 3: 2.0}, 4.0, 4.0, 1) == (3, pytest.approx(1.0))
    with pytest.raises(ValueError):
        chaining_ceiling({1: 1.0}, 0.0, 1.0, 1)


def _adam_quadratic(curvature):
    """A quadratic with d = 256 coordinates whose per-sample gradient statistics are fixed:
    true gradient ``G_i = 0.1 h_i``, per-sample variance ``Sigma_ii = h_i`` with ``h``
    log-spaced over [1e-3, 1]; Adam's preconditioner at the reference batch ``M0 = 32``
    is ``P = 1/sqrt(v)``, ``v = G^2 + Sigma/M0`` (its EMA's expectation).  ``curvature(h,
    P)`` gives the Hessian's diagonal.  Returns ``(true efficiency at M = 128 and 512,
    estimator readings by name)``: the true efficiency is the progress per sample at the
    best step size of ``-eps P g_M`` over that at ``M0`` (expected loss drop of the
    quadratic, maximised over a grid of 24001 step sizes: no noise-scale formula used);
    the readings are the default estimator (:class:`ConaConfig`) fed the expected squared
    norms of 8- and 32-sample gradients times ``P^a`` for each definition's power ``a``
    (:data:`cona.probe.DEFINITIONS`: 0, 1/2, 1)."""
    import torch

    from cona.grad_stats import GradientNoiseScale

    d, m0 = 256, 32
    h = torch.logspace(-3, 0, d, dtype=torch.float64)
    grad, sigma2 = 0.1 * h, h
    precond = 1 / (grad**2 + sigma2 / m0).sqrt()
    hess = curvature(h, precond)

    def best_drop(batch):  # max over eps of E[L(x) - L(x - eps P g_batch)]
        eps = torch.logspace(-8, 4, 24001, dtype=torch.float64)
        first = (grad * precond * grad).sum()
        second = ((precond * grad) ** 2 * hess).sum() + (precond**2 * hess * sigma2).sum() / batch
        return float((eps * first - eps**2 / 2 * second).max())

    true = {m: best_drop(m) / m / (best_drop(m0) / m0) for m in (128, 512)}
    readings = {}
    for name, w in (("B_simple", 1.0), ("newton", precond.sqrt()), ("pollux", precond)):
        est = GradientNoiseScale.from_config(ConaConfig())
        g_sq, trace = float(((w * grad) ** 2).sum()), float((w * w * sigma2).sum())
        est.update(g_sq + trace / 8, 8, g_sq + trace / 32, 32)
        readings[name] = est.noise_scale
    return true, readings


def test_each_noise_scale_definition_is_exact_for_its_curvature_on_a_quadratic():
    """Known answer (cona/surrogate.py): for Adam's step ``-eps P g`` the noise scale that
    makes Pollux's ``E(M) = (phi + M0)/(phi + M)`` exact is ``tr(PHP Sigma)/(G'PHPG)``; it
    depends on the curvature, which three problems with the *same* gradient statistics
    (G, Sigma, P) but different Hessians show: true efficiency at M = 512 is 0.33 where
    the Hessian follows Adam's ``v`` (``H = diag Sigma``, ``P H P ~ I``), 0.62 where it is
    isotropic and 0.41 where ``P`` is the inverse curvature (``H = 1/P``: Adam's
    step is a diagonal Newton step).  Each definition of ``cona.gns_definition`` must
    match its own case within 5 % (``simple``, ``pollux``, ``newton``) and miss the
    others: no one estimate can be right for every curvature, so the default is a
    measured choice (``bench/cona_efficiency.py``).  Catches an efficiency formula that
    does not reduce to the true one, or a definition whose preconditioner power is off."""
    adam, est = _adam_quadratic(lambda h, p: h)
    iso, _ = _adam_quadratic(lambda h, p: h * 0 + 1)
    newton, _ = _adam_quadratic(lambda h, p: 1 / p)
    assert adam[512] == pytest.approx(0.332, abs=0.01) and iso[512] == pytest.approx(0.622, abs=0.01)
    assert adam[512] + 0.05 < newton[512] < iso[512] - 0.05, (adam, newton, iso)
    for m in (128, 512):
        for name, truth in (("B_simple", adam), ("newton", newton), ("pollux", iso)):
            assert statistical_efficiency(m, est[name], 32) == pytest.approx(truth[m], rel=0.05), name
    assert statistical_efficiency(512, est["B_simple"], 32) < 0.9 * newton[512]
    assert statistical_efficiency(512, est["pollux"], 32) > 1.1 * newton[512]


def test_default_noise_scale_definition_is_the_measured_best():
    """Catches a default noise scale chosen by assumption or by a TTP win: the quadratic
    above shows each definition exact for one curvature, so the default must be the one
    whose predicted efficiencies are closest to the measured ones over the families
    (``docs/results/cona_efficiency.json``, ``bench/cona_efficiency.py``)."""
    import json
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "tools"))
    from render_cona_efficiency import best_gns_definition

    measured = json.loads((root / "docs" / "results" / "cona_efficiency.json").read_text())
    assert len(measured["models"]) >= 2
    assert ConaConfig().gns_definition == best_gns_definition(measured)


def test_default_noise_scale_average_is_scale_free():
    """Catches a default chosen on a bench rather than by mechanism: the estimator a CONA
    job builds from the default config must average scale-free (the plain ratio of EMAs
    weights each step by |G|^2 and reads a rising noise scale low: 0.66 of the truth on
    least squares against 0.85, tests/test_cona_grad_stats.py)."""
    from cona.grad_stats import GradientNoiseScale

    est = GradientNoiseScale.from_config(ConaConfig())
    assert est.normalize
    # two steps with equal noise scale 10 but |G|^2 falling 100-fold, then one at 40:
    # scale-free reads between 10 and 40 weighted by recency, plain stays near 10
    for g_sq, phi in ((100.0, 10.0), (1.0, 10.0), (1.0, 40.0)):
        est.update(g_sq * (1 + phi / 8), 8, g_sq * (1 + phi / 32), 32)
    assert est.noise_scale > 1.5 * est.noise_scale_plain


def test_ramp_lr_after_batch_increase():
    """Known answer (Goyal et al. 2017 Sec. 2.2, linear gradual warmup): from 1e-3 to
    2e-3 over 4 steps the steps train at 1.25, 1.5, 1.75, 2 (x 1e-3), then 2e-3; a lower
    LR, or a ramp of 0 steps, applies at once.  Catches a jump, a ramp that overshoots,
    or one that also delays a decrease."""
    got = [ramp_lr(1e-3, 2e-3, k, 4) for k in range(1, 7)]
    assert got == pytest.approx([1.25e-3, 1.5e-3, 1.75e-3, 2e-3, 2e-3, 2e-3])
    assert ramp_lr(2e-3, 1e-3, 1, 4) == 1e-3 and ramp_lr(1e-3, 2e-3, 1, 0) == 2e-3
    with pytest.raises(ValueError):
        ramp_lr(1e-3, 2e-3, -1, 4)


def test_no_estimate_falls_back_to_same_batch_and_says_so():
    """Catches the dp=1 flapping of issue 26: where no noise scale can be measured at the
    current strategy (one process, one micro-batch per step), a value left in the
    estimator from an earlier strategy (here 1e4, at which BIG_GB wins) must not be used;
    the controller ranks only its own global batch, by throughput, and the decision says
    so and why, with the scores of the chosen and the current strategy in its one-line
    form.  With an estimate, between SMALL_GB and BIG_GB it moves to BIG_GB; without,
    it stays."""
    ctrl = _controller([SMALL_GB, BIG_GB, FAST], SMALL_GB, noise_scale=1e4)
    why = "dp=1 with 1 micro-batch per step; for one, run >= 2 data-parallel processes"
    d = ctrl.decide(10, no_estimate=why)
    assert BIG_GB.label not in d.scores and d.best == FAST and d.switch
    assert d.noise_scale is None and "fallback rule: only global batch 64" in d.reason
    assert why in d.reason and ctrl.decisions[-1]["no_estimate"] == why
    line = d.describe()
    assert line.startswith(f"CONA decision at step 10: switch {SMALL_GB.label} -> {FAST.label}")
    assert f"{d.scores[FAST.label]:.4g} against current {d.scores[SMALL_GB.label]:.4g}" in line
    d = _controller([SMALL_GB, BIG_GB], SMALL_GB, noise_scale=1e4).decide(10)
    assert d.switch and d.best == BIG_GB
    d = _controller([SMALL_GB, BIG_GB], SMALL_GB, noise_scale=1e4).decide(10, no_estimate=why)
    assert not d.switch and d.best == SMALL_GB and "stay on" in d.describe()
