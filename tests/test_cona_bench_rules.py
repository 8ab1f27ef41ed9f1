"""Rules of ``bench/cona_ttp.py`` that decide what the TTP table compares: the unigram
perplexity and the target, the warm-checkpoint cache, the static_recipe layout and its LR
sweep, the time scale and the dilated clock, the oracle's windows and the ablation rows."""

from __future__ import annotations

import math

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


@pytest.mark.parametrize("bench", ["cona_ttp", "cona_ceiling"])
def test_an_unknown_emulated_gpu_is_a_usage_error_before_any_set_up(bench, capsys):
    """Catches ``--gpu`` checked only inside a worker after the set-up began (a 50-line
    traceback; the bench's own docstring example named ``H100-80GB``, which no profile
    has): argparse's exit 2, naming the known profiles; a known name in any case passes."""
    import importlib

    from jobruntime.hardware import gpu_profile_arg

    main = importlib.import_module(f"bench.{bench}").main
    with pytest.raises(SystemExit) as e:
        main(["--gpu", "H100-80GB"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "unknown GPU type 'H100-80GB'; known: [" in err, err
    assert "'H100'" in err and gpu_profile_arg("h100") == "h100"
