"""The oracle chain's search on synthetic problems whose answer is known.

The synthetic "training" gains Pollux-efficient progress per sample,
``dp/ds = (phi + 1) / (phi + B)`` (Qiao et al. OSDI'21, eq. 5, reference batch 1),
with a noise scale ``phi`` that grows with progress, as measured on the proxies;
the target is a progress level checked at evaluations every few samples.
Layouts differ only in step time (``overhead + per_sample * B``) and switching
costs a fixed time, so the best chain can be found by brute force over every
chain of the grid and every layout sequence.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest

from cona.oracle import OracleSearch, WindowRun
from jobruntime.metrics import TTPTracker


class Synthetic:
    """A :class:`cona.oracle.Branch` whose state is (progress, samples, steps, TTP tracker).

    Validation perplexity is ``exp(10 - progress / 100)``: log-perplexity linear in
    progress, so the interpolated crossing of the target is known in closed form."""

    def __init__(self, phi, *, target=60.0, eval_every=16, budget=4096):
        self.phi, self.target, self.eval_every, self.budget = phi, target, eval_every, budget
        self.p, self.s, self.n = 0.0, 0, 0
        self.ttp = TTPTracker(ppl(target))
        self.trained_samples = 0

    def snapshot(self):
        return (self.p, self.s, self.n, copy.deepcopy(self.ttp))

    def restore(self, snap):
        self.p, self.s, self.n, ttp = snap
        self.ttp = copy.deepcopy(ttp)

    def step(self, batch):
        """One step; the validation perplexity if it ended at an evaluation, else None."""
        phi = self.phi(self.p)
        self.p += batch * (phi + 1.0) / (phi + batch)
        self.s += batch
        self.n += 1
        self.trained_samples += batch
        crossed = self.s // self.eval_every != (self.s - batch) // self.eval_every
        return ppl(self.p) if crossed else None

    def run_window(self, batch, end, stop):
        steps, at, evals = 0, [], []
        while not (end is not None and self.s >= end) and self.s < self.budget:
            steps += 1
            val = self.step(batch)
            if val is None:
                continue
            at.append(steps)
            evals.append({"step": self.n, "val_ppl": val})
            if self.ttp.update(val, 0.0, 0, steps):  # the oracle times it; only the crossing
                return WindowRun(steps, reached_step=steps, eval_steps=tuple(at),
                                 crossing=self.ttp.crossing, evals=evals)
            if stop(steps):
                return WindowRun(steps, stopped=True, eval_steps=tuple(at), evals=evals)
        return WindowRun(steps, eval_steps=tuple(at), evals=evals)


def ppl(progress):
    return math.exp(10.0 - progress / 100.0)


class Layouts:
    """Two layouts per batch: "dp" (overhead 1.0 s) and "tp" (overhead 0.3 s, slower per sample)."""

    switch = 0.5

    def layouts(self, batch):
        return [("dp", batch), ("tp", batch)]

    def iter_s(self, layout):
        kind, batch = layout
        return (1.0 + 0.010 * batch) if kind == "dp" else (0.3 + 0.016 * batch)

    def switch_s(self, old, new):
        return 0.0 if old == new else self.switch


def brute_force(make, batches, boundaries, tm):
    """Minimum TTP over every chain of the grid (constant, or stay/next-larger at each
    boundary) and every layout sequence, simulated from scratch."""
    D = len(boundaries) + 1
    seqs = {tuple([b] * D) for b in batches}
    for start in range(len(batches)):
        for ups in itertools.product((0, 1), repeat=D - 1):
            idx = [start]
            for u in ups:
                idx.append(idx[-1] + u)
            if idx[-1] < len(batches):
                seqs.add(tuple(batches[i] for i in idx))
    best = math.inf
    for seq in seqs:
        for lay_kinds in itertools.product(("dp", "tp"), repeat=D):
            sim, t, prev = make(), 0.0, None
            ttp = TTPTracker(sim.ttp.target_ppl)  # fed the chain's own clock
            for w, (b, k) in enumerate(zip(seq, lay_kinds)):
                lay = (k, b)
                t += 0.0 if prev is None else tm.switch_s(prev, lay)
                prev = lay
                run = sim.run_window(b, boundaries[w] if w < D - 1 else None, lambda s: False)
                for at, e in zip(run.eval_steps, run.evals):
                    ttp.update(e["val_ppl"], t + at * tm.iter_s(lay), 0, at)
                t += run.steps * tm.iter_s(lay)
                if run.reached_step is not None:
                    best = min(best, ttp.ttp_s)
                    break
    return best


def test_oracle_equals_brute_force_and_beats_every_static():
    """Catches a search that is not an oracle over its grid (the greedy per-window rule it
    replaces was slower than the best static strategy): on a problem where the noise
    scale grows ~100x, the branch-and-bound result must equal the brute-force minimum over
    every chain and layout sequence (same arithmetic: 1e-12), be no slower than every
    static chain and switch batch at least once (6 % faster here), and the bound must
    have cut something."""
    def make():
        return Synthetic(lambda p: 1.0 + 0.2 * p, target=800.0, budget=20000)

    batches, boundaries, tm = [4, 8, 16, 32, 64], [266, 533], Layouts()
    sim = make()
    search = OracleSearch(sim, tm, batches, boundaries, unpruned=64)
    best = search.run()
    want = brute_force(make, batches, boundaries, tm)
    assert best.ttp_s == pytest.approx(want, rel=1e-12)
    statics = [v["ttp_s"] for v in search.static.values() if v["ttp_s"] is not None]
    assert search.static[64]["ttp_s"] is not None  # the unpruned static ran to the target
    assert best.ttp_s <= min(statics)
    assert len(set(best.batches)) > 1 and best.batches == tuple(sorted(best.batches))
    assert best.ttp_s < min(statics) * 0.97  # chaining pays on this problem
    assert search.nodes_cut > 0


class Recording:
    """Wraps a branch; counts reaching windows whose previous evaluation lies in an earlier
    window (the crossing spans a window boundary, and layout switches)."""

    def __init__(self, branch):
        self.branch, self.spanning = branch, 0

    def snapshot(self):
        return self.branch.snapshot()

    def restore(self, snap):
        self.branch.restore(snap)

    def run_window(self, batch, end, stop):
        run = self.branch.run_window(batch, end, stop)
        if run.reached_step is not None and run.eval_steps == (run.reached_step,) \
                and run.crossing < 1.0:
            self.spanning += 1
        return run


class TradeOff(Layouts):
    """"dp" faster at batch 4, "tp" at batch 8: a chain chooses when to pay the switch."""

    def iter_s(self, layout):
        kind, batch = layout
        return (0.2 + 0.05 * batch) if kind == "dp" else (0.5 + 0.01 * batch)


def test_oracle_interpolates_crossings_that_span_windows():
    """Catches a time to target taken at the reaching evaluation instead of interpolated
    at the crossing, and a crossing whose earlier evaluation lies in an earlier window
    timed on the wrong layout path: with evaluations sparser than the windows (every 40
    samples, windows of 12), the reaching window often holds no earlier evaluation, and
    the crossing ``(1 - f) t_prev + f t_reach`` weighs the layouts before and after the
    earlier evaluation differently from the end time.  Over many targets the search must
    equal the brute-force minimum over every chain and layout sequence, each fed to a
    fresh :class:`TTPTracker` on its own clock (1e-9: same sums in another order)."""
    batches, boundaries, tm = [4, 8], [12, 24, 36, 48, 60], TradeOff()
    spanning = 0
    for target in range(40, 130, 3):
        def make(target=target):
            return Synthetic(lambda p: 2.0 + 0.1 * p, target=float(target), eval_every=40,
                             budget=400)

        rec = Recording(make())
        best = OracleSearch(rec, tm, batches, boundaries, unpruned=8).run()
        assert best is not None
        assert best.ttp_s == pytest.approx(brute_force(make, batches, boundaries, tm), rel=1e-9)
        spanning += rec.spanning
    assert spanning >= 5


class Scripted:
    """A :class:`cona.oracle.Branch` replaying fixed windows per batch sequence."""

    def __init__(self, runs):
        self.runs, self.prefix = runs, ()

    def snapshot(self):
        return self.prefix

    def restore(self, snap):
        self.prefix = snap

    def run_window(self, batch, end, stop):
        self.prefix = (*self.prefix, batch)
        return self.runs[self.prefix]


def test_oracle_crossing_after_a_switch_takes_its_own_layout_path():
    """Catches a crossing spanning window boundaries timed along the path that is fastest
    to the *reaching* evaluation, or traced along it: TTP = t_prev + f (t_reach - t_prev)
    weighs the time after the earlier evaluation by f, so with f = 0.1 it pays to run
    batch 4 at its fastest layout up to the evaluation and switch kinds (0.5 s; a batch
    change within a kind is free) afterwards.  Chain (4, 8, 8): the evaluation ends window
    1 (3 steps), window 2 (1 step) has none, window 3 reaches after 2 steps.  By hand over
    every layout path: dp4 (1.5 s to the evaluation), switch, tp8 for 3 steps (0.9 s):
    1.5 + 0.1 x 1.4 = 1.64 s.  The path fastest to the reaching evaluation (tp4, no
    switch) gives 1.65 + 0.1 x 0.9 = 1.74 s, staying on dp 1.5 + 0.1 x 4.5 = 1.95 s; the
    other chains need >= 2.7 s."""
    class Costs(Layouts):
        t = {("dp", 4): 0.5, ("tp", 4): 0.55, ("dp", 8): 1.5, ("tp", 8): 0.3}

        def iter_s(self, layout):
            return self.t[layout]

        def switch_s(self, old, new):  # a batch change within one layout kind is free
            return 0.0 if old[0] == new[0] else self.switch

    runs = {
        (4,): WindowRun(3, eval_steps=(3,), evals=[{"step": 3}]),
        (4, 4): WindowRun(1),
        (4, 4, 4): WindowRun(3, 3, eval_steps=(3,), crossing=0.9, evals=[{"step": 7}]),
        (4, 4, 8): WindowRun(2, 2, eval_steps=(2,), crossing=0.9, evals=[{"step": 6}]),
        (4, 8): WindowRun(1),
        (4, 8, 8): WindowRun(2, 2, eval_steps=(2,), crossing=0.1, evals=[{"step": 6}]),
        (8,): WindowRun(2, eval_steps=(2,), evals=[{"step": 2}]),
        (8, 8): WindowRun(1),
        (8, 8, 8): WindowRun(6, 6, eval_steps=(2, 4, 6), crossing=1.0,
                             evals=[{"step": 5}, {"step": 7}, {"step": 9}]),
    }
    best = OracleSearch(Scripted(runs), Costs(), [4, 8], [12, 16], unpruned=8).run()
    assert best.batches == (4, 8, 8)
    assert best.ttp_s == pytest.approx(1.5 + 0.1 * (0.5 + 3 * 0.3), rel=1e-12)
    assert best.layouts == [("dp", 4), ("tp", 8)] and best.switch_times_s == [0.0, 2.0]
    assert [e["time_s"] for e in best.evals] == pytest.approx([1.5, 2.9])


def test_oracle_known_answer_two_windows():
    """Catches wrong time accounting (switch costs, layout DP, the step at which the target
    is reached): with a constant noise scale of 1000 the largest batch is most efficient
    per second from the start, so the known answer is the constant chain of batch 32 at
    its faster layout; its time is computed here by hand."""
    sim = Synthetic(lambda p: 1000.0, target=200.0)
    tm = Layouts()
    best = OracleSearch(sim, tm, [4, 32], [128], unpruned=32).run()
    # batch 32: progress per step 32 * 1001/1032; reached at the first eval (every 16
    # samples) with progress >= 200: step 7 (7 * 31.04 = 217.3 >= 200; 6 steps: 186.2);
    # log-perplexity is linear in progress, so the crossing is at step 6 + (200 - 186.2) / 31.04.
    assert best.batches == (32, 32)
    per_step = min(tm.iter_s(("dp", 32)), tm.iter_s(("tp", 32)))
    gain = 32 * 1001 / 1032
    assert best.ttp_s == pytest.approx((6 + (200 - 6 * gain) / gain) * per_step, rel=1e-9)
    assert best.layouts == [("tp", 32)]


def test_oracle_rejects_bad_grid():
    """Catches silently searching a malformed grid (unsorted batches or boundaries)."""
    with pytest.raises(ValueError, match="ascending"):
        OracleSearch(Synthetic(lambda p: 1.0), Layouts(), [8, 4], [10])
    with pytest.raises(ValueError, match="ascending"):
        OracleSearch(Synthetic(lambda p: 1.0), Layouts(), [4, 8], [20, 10])
