"""The oracle search's greedy reference chain (``cona/oracle_greedy.py``) on scripted windows:
myopic by its definition, beaten by the oracle, and its last window stopped once past the
least time to target."""

from __future__ import annotations

import pytest

from cona.oracle import OracleSearch, WindowRun
from tests.test_cona_oracle import Linear, Scripted


def _myopic_runs() -> dict:
    """The windows of the myopic problem (:func:`test_greedy_reference_is_myopic_and_the_
    oracle_beats_it`): window-runs per batch sequence, evaluations evenly spread."""
    def w(steps, ppls, reached=False):
        at = tuple(steps * (i + 1) // len(ppls) for i in range(len(ppls)))
        return WindowRun(steps, steps if reached else None, eval_steps=at,
                         evals=[{"step": k, "val_ppl": p} for k, p in zip(at, ppls)])

    return {(4,): w(4, [100.0, 80.0]), (8,): w(5, [90.0, 70.0]),
            (4, 4): w(2, [60.0, 50.0], True), (4, 8): w(1, [50.0], True),
            (8, 8): w(6, [60.0, 50.0], True), (8, 4): w(12, [55.0, 50.0], True)}


def test_greedy_reference_is_myopic_and_the_oracle_beats_it():
    """Catches a greedy reference that looks past its window or scores something else than
    the time to the window's common perplexity, and an oracle no better than it.  Window 1
    (1 s per step): batch 4 evaluates 100 at step 2 and 80 at step 4; batch 8 90 at step 2
    and 70 at step 5.  The common perplexity is 80 (the higher of the two lowest); batch 8
    reaches it after 2 + 3 ln(90/80)/ln(90/70) = 3.41 s (log-interpolated), batch 4 after
    4 s, so the greedy takes batch 8, although its window ends later (5 s against 4: a
    rule on the window's end, or on the first evaluation at or below 80 without
    interpolation, would take batch 4).  From there batch 8 needs 6 more steps (batch 4:
    12): greedy TTP 5 + 6 = 11 s.  Starting at batch 4 (4 s) and taking batch 8 (1 step)
    reaches at 5 s; the best static, (4, 4), at 6 s.  By hand: oracle 5 s with one change,
    6/5 = 1.2x the best static; the greedy 11/5 = 2.2x the oracle."""
    runs = _myopic_runs()
    search = OracleSearch(Scripted(runs), Linear(1.0, 0.0), [4, 8], [10])
    best = search.run()
    assert search.greedy_chain.batches == (8, 8) and search.greedy_chain.ttp_s == 11.0
    assert best.batches == (4, 8) and best.ttp_s == 5.0
    s = search.summary()
    assert (s["oracle_changes"], s["oracle_batch_changes"], s["greedy_changes"]) == (1, 1, 0)
    assert s["static_best_batch"] == 4 and s["chain_over_static"] == pytest.approx(1.2)
    assert s["greedy_over_oracle"] == pytest.approx(2.2)
    assert s["greedy_windows"] == 2  # window 2 at 8 and 4 (window 1: the static chains' own)


class StopScripted(Scripted):
    """:class:`Scripted` that honours ``stop`` at each evaluation, as training does, and
    records the steps each batch sequence trained (its last run)."""

    def __init__(self, runs):
        super().__init__(runs)
        self.trained = {}

    def run_window(self, batch, end, stop):
        run = super().run_window(batch, end, stop)
        for i, k in enumerate(run.eval_steps):
            if k != run.reached_step and stop(k):
                run = WindowRun(k, stopped=True, eval_steps=run.eval_steps[:i + 1],
                                evals=run.evals[:i + 1])
                break
        self.trained[self.prefix] = run.steps
        return run


def test_greedy_last_window_stops_a_candidate_past_the_least_time_to_target():
    """Catches the greedy reference's last window run out to the target for every
    candidate (on the bench, batch 1024 from late in the segment trained thousands of
    samples to lose): on the myopic problem above the greedy chain is at batch 8 after
    window 1 (5 s); in window 2, staying at 8 reaches the target after 6 steps (11 s), so
    batch 4, whose run would reach only after 12 steps (17 s), is stopped at its
    evaluation at step 6 (5 + 6 = 11 s, not before the least time) and not scored: the
    greedy chain is unchanged, (8, 8) at 11 s."""
    runs = _myopic_runs()
    branch = StopScripted(runs)
    chain = OracleSearch(branch, Linear(1.0, 0.0), [4, 8], [10]).greedy()
    assert chain.batches == (8, 8) and chain.ttp_s == 11.0
    assert branch.trained[(8, 8)] == 6 and branch.trained[(8, 4)] == 6
