"""The oracle chain's cheap mode: a beam search window by window with dominance pruning.

``OracleSearch(..., prune="dominated", beam=K)`` replaces the exact search's
depth-first phase (:mod:`cona.oracle`; its static chains and greedy reference
still run first, unchanged) by a pass window by window: every node of one
window boundary is trained before any node of the next, so nodes at the *same*
boundary can be compared, which the depth-first order cannot do (it holds one
node per depth).

**Dominance.**  At each boundary a node is dropped when another node there with
the same current batch has

- a validation perplexity at its last evaluation no higher, AND
- for every layout of that batch, a reach time (the per-layout time the search
  keeps by dynamic programming, :class:`cona.oracle.Node`'s ``times``) no later.

Both stand at the same sample position with the same batch, so they have the
same future chains (same moves, layouts and switch costs out of each layout);
on each of them the dominated node starts no earlier and no further along.
This is dominance pruning of states as in multi-objective dynamic programming
(a label worse in every criterion is discarded: Martins 1984, multicriteria
shortest paths).  **It is not exact**: a training state is not its perplexity
(weights, optimizer moments, schedule and noise scale differ between two runs
of equal perplexity), so a dropped node could have trained faster afterwards.
Where progress is the whole state (the synthetic problems of
``tests/test_cona_oracle.py``, searched in ``tests/test_cona_oracle_pruned.py``) it loses
nothing but for the perplexity being read at the last evaluation rather than at the
boundary.

**Beam.**  Dominance alone keeps a Pareto front of time against perplexity per
batch: hundreds of nodes per boundary on the bench's grid (6 windows, 5
batches, moves of up to two steps), ~4x cheaper than exact only.  ``beam`` keeps
the ``K`` nodes with the least *rollout estimate* of their time to target
(Bertsekas, Tsitsiklis & Wu 1997, rollout algorithms: the cost-to-go of a base
policy): the cheapest time at the node's last evaluation plus the least time
any static chain that reached the target took from that same perplexity to its
TTP (:class:`CostToGo`: the base policy is "finish on one strategy", measured
on the static runs at that perplexity; it assumes, like dominance, that the
perplexity stands for the state).  Nodes are expanded in that order.  The
greedy reference's prefixes are kept besides the beam and the windows it
trained are reused, so it costs no training twice.  Every static chain is
still searched in full: ``oracle <= best static`` holds by construction; the
search reports ``exact`` False.

Measured on synthetic problems (``tests/test_cona_oracle.py``'s model) on the
bench's grid, noise scale growing 2-30x, 27 problems: the exact search trains
90-3,700 segment-equivalents of samples (a segment: what batch 8 needs to the
target); ``beam=2`` trains 11-29 (the static chains alone 5.5-11), found the
exact optimum in 26 and came within 0.25 % on the other; ``beam=1`` within
0.5 % for ~4 segments less; ``beam=4`` found it in all for ~9 more.  On the
exact tests' problems (noise scale falling or jumping, 2-6 windows, 23
problems) ``beam=2`` came within 1.1 %, ``beam=4`` found every optimum.  The
greedy reference's windows are reused: with it the pass trains at most 12
window-runs more than without.

**Memory.**  Each kept node holds one snapshot of the training state (tens of
MB for the proxies).  The peak, ``max_snapshots``, is at the start of the
pass: the constant prefixes of the static phase (at most ``len(batches) * (D -
1)``) and the greedy reference's windows that go on (at most ``(1 + len(moves))
* (D - 2)``); then the prefixes of dropped nodes are freed, and the pass holds
the ``K`` (+1 greedy) nodes of a boundary and their kept children (at most
``(K + 1) * (1 + len(moves))``).  On the bench's grid: 43 states for ``K <= 2``
(27 without the greedy reference), 50 for ``K = 4``, ~270 without a beam (the
exact search: ~30).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from jobruntime.metrics import crossing_fraction

if TYPE_CHECKING:
    from .oracle import OracleSearch
    from .oracle_types import Node, TimeModel


def last_eval(node: Node | None, tm: TimeModel) -> tuple[float, float] | None:
    """The latest finite evaluation along ``node``'s chain as (validation perplexity,
    cheapest time at it over the layout paths into its window: the window's end time
    at a layout less its remaining steps there, as :class:`cona.oracle.Node`'s
    ``eval_lb``); ``None`` if there is none."""
    while node is not None:
        run = node.run
        for k, e in zip(reversed(run.eval_steps), reversed(run.evals)):
            p = e.get("val_ppl")
            if p is not None and math.isfinite(p):
                return p, min(t - (run.steps - k) * tm.iter_s(lay)
                              for lay, (t, _) in node.times.items())
        node = node.parent
    return None


def dominates(a: Node, b: Node, tm: TimeModel) -> bool:
    """``a`` is no worse than ``b`` at their common boundary and batch: perplexity at the
    last evaluation no higher AND, at every layout, reach time no later (module
    docstring).  Nodes without an evaluated perplexity are never compared."""
    ea, eb = last_eval(a, tm), last_eval(b, tm)
    if ea is None or eb is None or a.batches[-1] != b.batches[-1]:
        return False
    return ea[0] <= eb[0] and all(a.times[lay][0] <= t for lay, (t, _) in b.times.items())


class CostToGo:
    """The rollout cost-to-go of a perplexity: the least time a static chain that reached
    the target took from that perplexity to its time to target (module docstring;
    seconds, 0 where no static chain reached the target).

    Args:
        static: :attr:`cona.oracle.OracleSearch.static` (batch -> ``ttp_s`` and, when
            reached, ``chain`` whose ``evals`` carry ``val_ppl`` and ``time_s``).
    """

    def __init__(self, static: dict):
        self.curves = [(v["ttp_s"], [(e["val_ppl"], e["time_s"]) for e in v["chain"].evals
                                     if math.isfinite(e.get("val_ppl", math.nan))])
                       for v in static.values() if v["ttp_s"] is not None]

    def __call__(self, ppl: float) -> float:
        """Seconds from ``ppl`` to the target, 0 with no static chain that reached it."""
        return min((ttp - _first_time_at(pts, ppl, ttp) for ttp, pts in self.curves), default=0.0)


def _first_time_at(pts: list, ppl: float, end: float) -> float:
    """The clock at which the evaluations ``pts`` ((perplexity, seconds), in time order)
    first reach ``ppl``, log-interpolated between two (as the TTP); the first evaluation's
    time if it is already below; ``end`` if none reaches it."""
    prev = None
    for q, t in pts:
        if q <= ppl:
            return t if prev is None else prev[1] + crossing_fraction(prev[0], q, ppl) * (t - prev[1])
        prev = (q, t)
    return end


def predicted_s(node: Node, tm: TimeModel, togo: CostToGo) -> float:
    """The rollout estimate of the time to target through ``node``: the time at its last
    evaluation (:func:`last_eval`) plus the cost-to-go of its perplexity there
    (``inf``: nothing evaluated)."""
    last = last_eval(node, tm)
    return math.inf if last is None else last[1] + togo(last[0])


class Frontier:
    """The kept nodes of one boundary (with their snapshots), per current batch the
    non-dominated ones; the ``protected`` batch sequences (the greedy reference's
    prefixes) are always kept.  ``dropped`` counts the nodes dominance removed."""

    def __init__(self, tm: TimeModel, togo: CostToGo, protected: set):
        self.by_batch: dict[int, list[tuple[Node, Any]]] = {}
        self.tm, self.togo, self.protected, self.dropped = tm, togo, protected, 0

    def __len__(self) -> int:
        return sum(map(len, self.by_batch.values()))

    def dominated(self, node: Node) -> bool:
        """``node`` is not protected and some kept node dominates it (counted as dropped)."""
        kept = self.by_batch.get(node.batches[-1], [])
        if node.batches not in self.protected and any(dominates(k, node, self.tm)
                                                      for k, _ in kept):
            self.dropped += 1
            return True
        return False

    def add(self, node: Node, snap: Any) -> None:
        """Keep ``node`` (not dominated), dropping the unprotected kept nodes it dominates."""
        kept = self.by_batch.setdefault(node.batches[-1], [])
        keep = [(k, s) for k, s in kept
                if k.batches in self.protected or not dominates(node, k, self.tm)]
        self.dropped += len(kept) - len(keep)
        self.by_batch[node.batches[-1]] = [*keep, (node, snap)]

    def best(self, beam: int | None) -> list[tuple[Node, Any]]:
        """The kept nodes, least predicted time first: the first ``beam`` of them and the
        protected ones."""
        items = [x for kept in self.by_batch.values() for x in kept]
        items.sort(key=lambda x: predicted_s(x[0], self.tm, self.togo))
        if beam is None:
            return items
        return [x for i, x in enumerate(items) if i < beam or x[0].batches in self.protected]


def breadth_first(search: OracleSearch, prefixes: list, D: int, beam: int | None) -> None:
    """The pruned phase of ``search`` (module docstring): from the constant prefixes of
    the static phase (``(node, state, depth)``, emptied: the pass frees the states it
    will not use) and the windows the greedy reference trained
    (``search.greedy_trials``, emptied likewise), window by window to depth ``D - 1``.
    Updates ``search``'s best chain and counters (``pruned_dominated``,
    ``pruned_beam``, ``max_snapshots``)."""
    known = {node.batches: (node, snap) for node, snap, _ in prefixes}
    greedy, search.greedy_trials = search.greedy_trials, {}
    prefixes.clear()  # the pass owns the states now: it frees those it will not use
    # the peak so far, at the greedy reference's last window: the root, the states kept
    # by the static phase and by the greedy reference, and its state then
    search.max_snapshots = 2 + len(known) + sum(state is not None for _, state in greedy.values())
    togo = CostToGo(search.static)
    children = Frontier(search.tm, togo, {seq[:-1] for seq in greedy})  # the greedy's prefixes
    for seq in [seq for seq in known if len(seq) == 1]:
        children.add(*known.pop(seq))
    for depth in range(1, D):
        frontier = children.best(beam)
        search.pruned_beam += len(children) - len(frontier)
        search.pruned_dominated += children.dropped
        children = Frontier(search.tm, togo, children.protected)
        alive = {node.batches for node, _ in frontier if search._worth(node)}
        known = {seq: v for seq, v in known.items() if seq[:depth] in alive}  # free the rest
        greedy = {seq: v for seq, v in greedy.items() if seq[:depth] in alive}
        for node, snap in frontier:
            if node.batches not in alive or not search._worth(node):  # the bound fell
                continue
            for b in search._children(node.batches):
                seq = (*node.batches, b)
                if seq in known:  # a constant prefix: trained in the static phase
                    child, state = known.pop(seq)
                elif seq in greedy:  # trained by the greedy reference
                    run, state = greedy.pop(seq)
                    child = search._expand(node, b, depth, cut=True, run=run)
                else:
                    search.branch.restore(snap)
                    child, state = search._expand(node, b, depth, cut=True), None
                if depth == D - 1 or not search._worth(child) or children.dominated(child):
                    continue
                children.add(child, state if state is not None else search.branch.snapshot())
                held = 1 + len(known) + len(greedy) + len(frontier) + len(children)
                search.max_snapshots = max(search.max_snapshots, held)
