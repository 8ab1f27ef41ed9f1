"""The greedy reference chain of the oracle search: the best strategy at each window.

A second reference beside the oracle chain (:func:`greedy` defines it).  It works on
an :class:`cona.oracle.OracleSearch`'s branch, time model and counters, the way
:mod:`cona.oracle_pruned` does.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

from jobruntime.metrics import crossing_fraction

from .oracle_types import _entry, _past

if TYPE_CHECKING:
    from .oracle import OracleSearch
    from .oracle_types import ChainResult, Node, WindowRun

log = logging.getLogger("cona")


def greedy(search: OracleSearch, known: dict | None = None) -> ChainResult | None:
    """The greedy reference: "the strategy sequence that selects the best strategy at
    each iteration" (the CONA paper's reference sequence, quoted in issue 23; the
    paper reports CONA within 2.6 % of it), made precise on the window grid.

    Definition.  From the greedy chain's state at the start of window ``w`` (the
    initial state for ``w = 0``), every allowed strategy (each batch reachable by
    ``moves`` from the current one, every batch in window 0; each of its layouts)
    trains window ``w`` in full from that same state.  The *common perplexity*
    ``P*`` is the highest of the candidates' lowest evaluated perplexities in the
    window (the level every candidate reached).  Each strategy is scored by its
    time from the window's start to ``P*``: the switch from the current layout
    plus its steps to ``P*`` (log-perplexity interpolated between its evaluations
    in the window, :func:`jobruntime.metrics.crossing_fraction`; the first
    evaluation's step when that one is already at or below ``P*``) times its step
    time.  The least time wins (ties: the current batch, then the smaller), the
    chain continues from that window's end state, and so on until the target.  A
    candidate without an evaluation in the window is not scored; when none has
    one, the chain keeps its batch (the smallest in window 0) at its fastest layout;
    a non-finite perplexity counts as no evaluation.  The last window runs to the
    target: a candidate whose clock passes the least time to the target of the
    candidates before it stops there and is not scored (it cannot reach the target
    first; the rest are scored as above, at a common perplexity at the target).

    It is the best progress per second with the hindsight of one window, never
    of the windows after it.  Its batch sequence is in the searched set (same
    moves), so ``oracle_chain <= greedy`` by construction.  The search's branch
    must be at its initial state.

    Args:
        search: the oracle search whose branch, time model, batches, boundaries and
            moves it uses; its counters and ``best`` are updated.
        known: batch sequence -> (its last window's run, the state after it) of
            windows already trained (the static chains' prefixes); a window run in
            full is reused instead of trained again.

    Returns:
        The greedy chain, on its own layouts and clock (``None``: the budget ended
        first); also kept as ``search.greedy_chain``.  Its window-runs are counted in
        ``greedy_windows`` and ``windows_trained``.
    """
    known = known or {}
    tm = search.tm
    parent, state, chain = None, search.branch.snapshot(), None
    for depth in range(len(search.boundaries) + 1):
        trials, final, reach = {}, depth == len(search.boundaries), math.inf
        for b in search.batches if parent is None else search._children(parent.batches):
            seq = (*(parent.batches if parent else ()), b)
            entries = {lay: _entry(parent, lay, tm) for lay in tm.layouts(b)}
            if seq in known and not known[seq][0].stopped:  # a full window already trained
                trials[b] = known[seq]
            else:
                search.branch.restore(state)
                # the last window runs to the target: a candidate past the least time
                # to it so far cannot win and stops there
                run = search._train(b, depth, _past(entries, tm, reach if final else math.inf))
                ends = final or run.reached_step is not None
                trials[b] = (run, None if ends else search.branch.snapshot())  # to go on
                search.greedy_windows += 1
                if search.prune and not run.stopped:  # the pruned pass reuses it
                    search.greedy_trials[seq] = trials[b]
            if final and trials[b][0].reached_step is not None:
                reach = min(reach, min(t for t, _ in search._node(
                    parent, b, trials[b][0], entries).times.values()))
        if final and any(not run.stopped for run, _ in trials.values()):
            trials = {b: v for b, v in trials.items() if not v[0].stopped}
        b, lay = greedy_pick(search, parent, {b: run for b, (run, _) in trials.items()})
        run, state = trials[b]
        parent = search._node(parent, b, run, {lay: _entry(parent, lay, search.tm)})
        if run.reached_step is not None:
            chain = search._trace(parent)
            break
    search.greedy_chain = chain
    if chain is not None and chain.ttp_s < search.bound:
        search.best = chain
    log.info("oracle: greedy %s: TTP %s (%d windows)", chain and chain.batches,
             chain and chain.ttp_s, search.greedy_windows)
    return chain


def greedy_pick(search: OracleSearch, parent: Node | None,
                runs: dict[int, WindowRun]) -> tuple[int, Any]:
    """The (batch, layout) of :func:`greedy`'s rule among the window ``runs`` per batch."""
    tm = search.tm
    current = parent.batches[-1] if parent is not None else search.batches[0]
    points = {b: [(k, e["val_ppl"]) for k, e in zip(run.eval_steps, run.evals)
                  if math.isfinite(e["val_ppl"])] for b, run in runs.items()}
    points = {b: pts for b, pts in points.items() if pts}  # NaN: no measurement
    if not points:  # nothing to compare: keep the batch, at its fastest layout
        log.warning("oracle: greedy window %d holds no evaluation: it keeps batch %s "
                    "(make windows span evaluations)", len(parent.batches) if parent else 0,
                    current)
        run = runs[current]
        lay = min(tm.layouts(current),
                  key=lambda x: _entry(parent, x, tm)[0] + run.steps * tm.iter_s(x))
        return current, lay
    common = max(min(p for _, p in pts) for pts in points.values())

    def steps_to_common(b: int) -> float:
        pts = points[b]
        i = next(j for j, (_, p) in enumerate(pts) if p <= common)
        if i == 0:
            return pts[0][0]
        (k0, p0), (k1, p1) = pts[i - 1], pts[i]
        return k0 + crossing_fraction(p0, p1, common) * (k1 - k0)

    options = [(_entry(parent, lay, tm)[0] + steps_to_common(b) * tm.iter_s(lay),
                b != current, b, i, lay)
               for b in points for i, lay in enumerate(tm.layouts(b))]
    best = min(options, key=lambda o: o[:4])
    return best[2], best[4]
