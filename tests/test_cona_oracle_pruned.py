"""The oracle search's pruned mode (``cona/oracle_pruned.py``): dominance between nodes by
hand, and on the bench's grid the exact optimum for a fiftieth of the training with a
bounded number of training states held."""

from __future__ import annotations

import gc
import weakref

import pytest

from cona.oracle import Node, OracleSearch, WindowRun
from cona.oracle_pruned import dominates
from tests.test_cona_oracle import Layouts, Linear, Scripted, Synthetic


class LiveStates(Synthetic):
    """:class:`Synthetic` whose snapshots are tracked: ``peak`` is the most alive at the
    start of any window (a state the search still references)."""

    class State:
        def __init__(self, inner):
            self.inner = inner

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.alive, self.peak = weakref.WeakSet(), 0

    def snapshot(self):
        state = self.State(super().snapshot())
        self.alive.add(state)
        return state

    def restore(self, snap):
        super().restore(snap.inner)

    def run_window(self, batch, end, stop):
        gc.collect()
        self.peak = max(self.peak, len(self.alive))
        return super().run_window(batch, end, stop)


def bench_grid(growth):
    """The CONA bench's search grid on a synthetic problem: 5 batches, 6 windows over the
    samples batch 8 needs, evaluations every 160 samples, a noise scale growing
    ``growth`` times over that segment (measured on the proxies: 2.4-4x)."""
    def make(cls=Synthetic):
        return cls(lambda p: 40.0 * (1 + (growth - 1) * p / 4000.0), target=4000.0,
                   eval_every=160, budget=400_000)

    ref = make()
    ref.run_window(8, None, lambda s: False)
    return make, ref.s, [8, 16, 32, 64, 128], [round(ref.s * k / 6) for k in range(1, 6)]


@pytest.mark.slow  # ~100-175 s: the exact search it is compared with
def test_pruned_search_finds_the_exact_optimum_for_a_fiftieth_of_the_training():
    """Catches a pruned mode that is not cheaper, loses the optimum or holds more training
    states than it reports: on the bench's grid (noise scale growing 2.4, 4 and 10x),
    ``prune="dominated", beam=2`` must return the exact search's best chain (1e-12: the
    same chain, timed the same way) while training at most 1/50 of its window-runs (here
    1.2-1.7 %: 70-81 against 4,700-5,850) and at most 3x the static chains' samples (the
    exact search: 150-260x); report ``exact`` False; and hold no more training states at
    once than ``max_snapshots`` says (counted here by weak references), itself far below
    what dominance alone keeps (~250 states without a beam)."""
    for growth in (2.4, 4.0, 10.0):
        make, seg, batches, bounds = bench_grid(growth)
        exact = OracleSearch(make(), Layouts(), batches, bounds, unpruned=128)
        want = exact.run()
        sim = make(LiveStates)
        pruned = OracleSearch(sim, Layouts(), batches, bounds, unpruned=128, prune="dominated",
                              beam=2)
        best = pruned.run()
        s = pruned.summary()
        print(f"\ngrowth {growth}: exact {exact.windows_trained} window-runs "
              f"{exact.samples_trained / seg:.0f} segments, pruned {pruned.windows_trained} "
              f"{pruned.samples_trained / seg:.1f} (statics {pruned.static_samples / seg:.1f}), "
              f"TTP ratio {best.ttp_s / want.ttp_s:.6f}, states {sim.peak} <= {s['max_snapshots']}")
        assert best.ttp_s == pytest.approx(want.ttp_s, rel=1e-12) and best.batches == want.batches
        assert pruned.windows_trained * 50 <= exact.windows_trained
        assert pruned.samples_trained <= 3 * pruned.static_samples
        assert not s["exact"] and s["prune"] == "dominated" and s["beam"] == 2
        assert s["pruned_beam"] > 0
        assert sim.peak <= s["max_snapshots"] <= 50


def test_dominated_node_dropped_and_a_trade_off_kept():
    """Catches a dominance test that drops a node which is better in one criterion, or
    keeps one that is worse in all.  By hand (1 s per step, one layout, no switch cost),
    at the first boundary with batch 8: (8, 8) has perplexity 70 at 4 s, (4, 8) 80 at 6 s:
    dominated, so its children are never trained (the scripted branch has no window for
    them: training one raises).  With batch 4: (4, 4) has 60 at 8 s, (8, 4) 75 at 6 s:
    better perplexity but later, so both are kept, their children trained, and the best
    chain, (8, 4, 4) at 8 s, found.  With two layouts, a node later at one layout and
    earlier at the other is not dominated either, nor one of another batch."""
    def w(steps, ppl, reached=False):
        return WindowRun(steps, steps if reached else None, eval_steps=(steps,),
                         evals=[{"step": steps, "val_ppl": ppl}])

    runs = {(4,): w(4, 100.0), (8,): w(2, 120.0),
            (4, 4): w(4, 60.0), (4, 8): w(2, 80.0), (8, 4): w(4, 75.0), (8, 8): w(2, 70.0),
            (4, 4, 4): w(10, 50.0, True), (4, 4, 8): w(3, 50.0, True),
            (8, 4, 4): w(2, 50.0, True), (8, 4, 8): w(6, 50.0, True),
            (8, 8, 8): w(10, 50.0, True), (8, 8, 4): w(8, 50.0, True)}
    trained = []

    class Tracing(Scripted):
        def run_window(self, batch, end, stop):
            trained.append((*self.prefix, batch))
            return super().run_window(batch, end, stop)

    search = OracleSearch(Tracing(runs), Linear(1.0, 0.0), [4, 8], [10, 20], greedy=False,
                          prune="dominated")
    best = search.run()
    assert best.batches == (8, 4, 4) and best.ttp_s == 8.0
    assert {(4, 4, 8), (8, 4, 4), (8, 4, 8), (8, 8, 4)} <= set(trained)
    assert search.summary()["pruned_dominated"] == 1

    def node(batch, ppl, dp, tp):
        run = WindowRun(1, eval_steps=(1,), evals=[{"step": 1, "val_ppl": ppl}])
        return Node((batch,), {("dp", batch): (dp, None), ("tp", batch): (tp, None)}, None,
                    run, 0)

    tm, a = Layouts(), node(8, 100.0, 10.0, 12.0)
    assert dominates(a, node(8, 100.0, 10.0, 13.0), tm)  # equal but one: dominated
    assert not dominates(a, node(8, 100.0, 9.0, 13.0), tm)  # earlier at "dp"
    assert not dominates(a, node(8, 90.0, 12.0, 13.0), tm)  # better perplexity
    assert not dominates(a, node(16, 100.0, 10.0, 13.0), tm)  # another batch
