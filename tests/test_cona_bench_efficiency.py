"""The CONA bench's batch-efficiency comparison (``bench/cona_efficiency.py``) and its Adam
memory variants (``bench/cona_adam_memory.py``), on hand-computed numbers."""

from __future__ import annotations

import math

import pytest


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
