"""The oracle chain: exact search over chains of global batches on a window grid.

A *chain* assigns a global batch to each window of a sample grid
``0 < S_1 < ... < S_{D-1}`` (the last window runs until the target or the
budget); its time to target is the emulated clock of that sequence of
batches, each run at its best layout, switch costs included.  Like every
TTP of the project (:class:`jobruntime.metrics.TTPTracker`), it is
interpolated at the crossing of the target between the last evaluation above
it and the first at or below it, on the chain's own clock.

**What is searched** (all exactly; nothing extrapolated):

- every *constant* chain (one batch for the whole run: each static strategy
  is one of them, at its fastest layout or any other);
- every chain whose batch, at each window boundary, stays or moves by one of
  ``moves`` grid steps of the option list (default: up to two steps, either
  way; ``moves=(1,)`` is the monotone one-step-up grid of the first version:
  Pollux/McCandlish, the efficient batch grows with the noise scale, but the
  oracle must not assume it);
- for each batch sequence, every sequence of layouts (DP, TP, PP,
  micro-batch) with that global batch, by dynamic programming over layouts
  (the proxy's trajectory depends on the batch only, so a batch sequence is
  trained once and its layouts are timed analytically, Viterbi-style, with
  the cluster's switch costs charged at every change of layout or batch).

A batch sequence is trained for real from restored in-memory states: the
tree of sequences shares prefixes, every node's state (weights, optimizer,
schedule, data position, RNG, GNS) is a snapshot of its parent's plus one
window.  Branch and bound keeps it affordable and exact: a node (or a window
still running) whose cheapest time at its latest evaluation already reaches
the best time to target found so far cannot lead to a better chain (its
interpolated TTP lies after that evaluation) and is cut; a running window is
cut at an evaluation.  Constant chains are searched first (they are the
static baselines, and give the first bound), then the greedy reference
(:mod:`cona.oracle_greedy`, whose chain is in the searched set and
tightens the bound); the constant chain of ``unpruned`` (the throughput
baseline) runs on until ``unpruned_factor`` times the bound (its time to
target, or a lower bound on it).  Since every static chain is in the searched
set, ``oracle <= best static`` holds by construction; :meth:`OracleSearch.run`
checks it.  The bound is the only cut, so the search stays exact whatever the
problem.  It cuts late: the time at a node's latest evaluation is about
``d / D`` of a chain's time to target at depth ``d``, so nearly every prefix
of the first ``D - 2`` windows is trained and the savings come from the last
windows (measured on random synthetic problems with 6 windows and moves of
up to two steps: 6.8 % of the window-runs of brute force, 4-42x the samples
of the static chains alone; ``tests/test_cona_oracle.py``).  Where that is
too dear, ``max_changes`` makes the set smaller (still exact over it),
``max_windows`` stops the search (then ``exact`` is False), and
``prune="dominated"`` with a ``beam`` replaces the exhaustive phase by a beam
search with dominance pruning (:mod:`cona.oracle_pruned`: not exact; on the
bench's grid, ``beam=2`` trains ~1/70 of the exact search's window-runs and
came within 0.25 % of its optimum on synthetic problems); :meth:`summary` reports the costs next to the findings.

The search talks to training only through a :class:`Branch` (snapshot,
restore, run a window) and to time through a :class:`TimeModel`, so it can be
tested on a synthetic problem with a known answer.  Those two, the window runs,
nodes and chains are defined in :mod:`cona.oracle_types` and importable from here.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

from .oracle_greedy import greedy
from .oracle_pruned import breadth_first
from .oracle_types import (
    Branch,
    ChainResult,
    Node,
    TimeModel,
    WindowRun,
    _changes,
    _entry,
    _past,
)

log = logging.getLogger("cona")


class OracleSearch:
    """Branch-and-bound search (module docstring).

    Args:
        branch: the trainable state, at its initial point now.
        time_model: layouts and their clock.
        batches: the global batch options, ascending.
        boundaries: window ends in samples ``S_1 < ... < S_{D-1}`` (``D`` windows).
        unpruned: the batch whose constant chain runs on past the bound.
        unpruned_factor: ... until this multiple of the bound (``inf``: to the end).
        moves: the batch moves allowed at a window boundary, in grid steps of
            ``batches`` (staying is always allowed): default up to two steps either
            way; ``(1,)`` is the monotone one-step-up grid.
        greedy: also build the greedy reference (:meth:`greedy`) before the search.
        max_changes: search only chains with at most this many batch changes (exact
            over that smaller set; ``None``: no limit).
        max_windows: stop the exhaustive phase after this many window-runs (the
            result is then the best found, ``exact`` False); ``None``: no limit.
        prune: ``None`` (the exact search) or ``"dominated"``: after the static chains
            and the greedy reference, a breadth-first pass that drops dominated nodes
            at each boundary (not exact: :mod:`cona.oracle_pruned`).
        beam: with ``prune``, keep at most this many nodes per boundary (least rollout
            estimate of the time to target first); ``None``: every non-dominated node.

    Raises:
        ValueError: batches or boundaries not ascending and distinct, a zero move, an
            unknown ``prune`` or a ``beam`` below 1 or without ``prune``.
    """

    def __init__(self, branch: Branch, time_model: TimeModel, batches: Sequence[int],
                 boundaries: Sequence[int], *, unpruned: int | None = None,
                 unpruned_factor: float = math.inf, moves: Sequence[int] = (-2, -1, 1, 2),
                 greedy: bool = True, max_windows: int | None = None,
                 max_changes: int | None = None, prune: str | None = None,
                 beam: int | None = None):
        if list(batches) != sorted(set(batches)) or not batches:
            raise ValueError(f"batches must be ascending and distinct, got {list(batches)}")
        if list(boundaries) != sorted(set(boundaries)) or any(b <= 0 for b in boundaries):
            raise ValueError(f"boundaries must be ascending positive samples, got {boundaries}")
        if 0 in moves or len(set(moves)) != len(moves):
            raise ValueError(f"moves must be distinct non-zero grid steps, got {list(moves)}")
        if prune not in (None, "dominated") or (beam is not None and (prune is None or beam < 1)):
            raise ValueError(f"prune={prune!r}, beam={beam!r}: prune is None or 'dominated'; "
                             "beam a positive int, with prune only")
        self.branch, self.tm = branch, time_model
        self.batches, self.boundaries = list(batches), list(boundaries)
        self.unpruned, self.unpruned_factor = unpruned, unpruned_factor
        self.moves = sorted(moves, key=lambda d: (abs(d), d))  # nearest first
        self.with_greedy, self.max_windows = greedy, max_windows
        self.max_changes, self.prune, self.beam = max_changes, prune, beam
        self.best: ChainResult | None = None
        self.greedy_chain: ChainResult | None = None
        self.static: dict[int, dict] = {}
        self.windows_trained = 0
        self.samples_trained = 0  # samples of every window-run (the search's training cost)
        self.static_samples = 0  # ... of the static chains alone (what the baselines cost)
        self.static_windows = 0
        self.greedy_windows = 0
        self.nodes_cut = 0
        self.pruned_dominated = self.pruned_beam = self.max_snapshots = 0  # prune mode
        self.greedy_trials: dict = {}  # prune mode: batch sequence -> (run, state) of greedy
        self.exact = prune is None

    @property
    def bound(self) -> float:
        return self.best.ttp_s if self.best is not None else math.inf

    def _end(self, depth: int) -> int | None:
        return self.boundaries[depth] if depth < len(self.boundaries) else None

    def _train(self, batch: int, depth: int, stop: Callable[[int], bool]) -> WindowRun:
        run = self.branch.run_window(batch, self._end(depth), stop)
        self.windows_trained += 1
        self.samples_trained += run.steps * batch
        return run

    def _expand(self, parent: Node | None, batch: int, depth: int, *, cut: bool,
                run: WindowRun | None = None) -> Node:
        """Train one window at ``batch`` from the branch's current state; ``cut=False``
        (the unpruned chain) cuts at ``unpruned_factor`` times the bound instead;
        ``run``: that window, already trained (by :meth:`greedy`), is not trained again."""
        entries = {lay: _entry(parent, lay, self.tm) for lay in self.tm.layouts(batch)}
        factor = 1.0 if cut else self.unpruned_factor
        if run is None:
            run = self._train(batch, depth, _past(entries, self.tm, factor * self.bound))
        node = self._node(parent, batch, run, entries)
        if node.run.reached_step is not None:
            self._finish(node)
        return node

    def _node(self, parent: Node | None, batch: int, run: WindowRun, entries: dict) -> Node:
        """The node of window ``run`` at ``batch`` after ``parent``, timed at the layouts of
        ``entries`` (layout -> cheapest entry time and the parent layout it comes from)."""
        start = parent.start_step + parent.run.steps if parent is not None else 0
        batches = (*(parent.batches if parent else ()), batch)
        if run.reached_step is not None:
            times, paths = self._reach_times(parent, run, entries)
            return Node(batches, times, parent, run, start, paths)
        times = {lay: (t + run.steps * self.tm.iter_s(lay), p) for lay, (t, p) in entries.items()}
        if run.eval_steps:
            k = run.eval_steps[-1]
            lb = min(t + k * self.tm.iter_s(lay) for lay, (t, _) in entries.items())
        else:
            lb = parent.eval_lb if parent is not None else 0.0
        return Node(batches, times, parent, run, start, eval_lb=lb)

    def _reach_times(self, parent: Node | None, run: WindowRun, entries: dict) -> tuple[dict, dict]:
        """Per layout of a window that reached the target: the least interpolated time to
        target ``(1 - f) t_prev + f t_reach`` over the layout paths into it (``f``:
        ``run.crossing``), with the parent layout, and the ``paths`` of :class:`Node`.

        With the previous evaluation in this window (or none), both times lie in it at
        one layout, so the crossing is ``entry + (k0 + f (k - k0)) iter_s``.  Otherwise
        it lies in an earlier window ``A``: ``t_prev`` is fixed by ``A``'s layout and
        everything after it counts with weight ``f``, so the windows from ``A`` on are
        searched again (the same dynamic programming with those weights)."""
        tm, f, k = self.tm, run.crossing, run.reached_step
        earlier = [s for s in run.eval_steps if s < k]
        anc, between = parent, []
        while anc is not None and not anc.run.eval_steps:
            between.append(anc)
            anc = anc.parent
        if earlier or anc is None or f >= 1.0:
            k0 = earlier[-1] if earlier else k
            x = k0 + f * (k - k0)
            return {lay: (t + x * tm.iter_s(lay), p) for lay, (t, p) in entries.items()}, {}
        rem = anc.run.steps - anc.run.eval_steps[-1]  # A's steps after its last evaluation
        # val: t_prev + f * (time since A's last evaluation), and the layouts from A on
        val = {lay: (t - (1 - f) * rem * tm.iter_s(lay), (lay,)) for lay, (t, _) in anc.times.items()}

        def extend(layouts, steps: int) -> dict:
            out = {}
            for lay in layouts:
                v, path = min(((v + f * tm.switch_s(path[-1], lay), path)
                               for v, path in val.values()), key=lambda x: x[0])
                out[lay] = (v + f * steps * tm.iter_s(lay), (*path, lay))
            return out

        for m in reversed(between):
            val = extend(list(m.times), m.run.steps)
        reach = extend(list(entries), k)
        return ({lay: (v, path[-2]) for lay, (v, path) in reach.items()},
                {lay: path[:-1] for lay, (_, path) in reach.items()})

    def _trace(self, node: Node) -> ChainResult:
        """The chain ending at ``node``, at its cheapest layouts, with its clock."""
        layout, (end_s, _) = min(node.times.items(), key=lambda kv: kv[1][0])
        fixed = list(node.paths.get(layout, ()))  # the crossing's layouts back to its window
        path, n = [], node
        while n is not None:  # back-pointers: (node, its layout), last first
            path.append((n, layout))
            back = n.times[layout][1]
            n = n.parent
            layout = fixed.pop() if fixed else back
        path.reverse()
        layouts, starts, times, evals = [], [], [], []
        t, prev = 0.0, None
        for n, lay in path:
            t += 0.0 if prev is None else self.tm.switch_s(prev, lay)
            if prev != lay:
                layouts.append(lay)
                starts.append(n.start_step)
                times.append(t)
            for e in n.run.evals:
                evals.append(dict(e, time_s=t + (e["step"] - n.start_step) * self.tm.iter_s(lay)))
            steps = n.run.reached_step if n.run.reached_step is not None else n.run.steps
            t += steps * self.tm.iter_s(lay)
            prev = lay
        return ChainResult(end_s, node.batches, layouts, starts, times, evals)

    def _finish(self, node: Node) -> None:
        """Record a chain that reached the target (keeps the best)."""
        chain = self._trace(node)
        if len(set(node.batches)) == 1:
            self.static[node.batches[0]] = {"ttp_s": chain.ttp_s, "chain": chain}
        if self.best is None or chain.ttp_s < self.best.ttp_s:
            self.best = chain

    def _worth(self, node: Node) -> bool:
        """A node may lead to a better chain: not reached, not cut, under the bound."""
        if node.run.reached_step is not None or node.run.stopped:
            return False
        if node.eval_lb >= self.bound:
            self.nodes_cut += 1
            return False
        if self.max_windows is not None and self.windows_trained >= self.max_windows:
            self.exact = False
            return False
        return True

    def _children(self, seq: tuple) -> list[int]:
        """Batches that may follow the batch sequence ``seq`` at a boundary: stay first,
        then the moves (none once ``seq`` holds ``max_changes`` batch changes)."""
        batch = seq[-1]
        if self.max_changes is not None and _changes(seq) >= self.max_changes:
            return [batch]
        i, n = self.batches.index(batch), len(self.batches)
        return [batch] + [self.batches[i + d] for d in self.moves if 0 <= i + d < n]

    def run(self) -> ChainResult | None:
        """Search; return the best chain (``None`` if none reached the target).

        Raises:
            RuntimeError: the best chain is slower than a static chain (cannot happen:
                every static chain is searched; a broken Branch or TimeModel).
        """
        root = self.branch.snapshot()
        D = len(self.boundaries) + 1
        prefixes: list[tuple[Node, Any, int]] = []  # constant prefixes with their state
        for b in self.batches:  # phase 1: static chains (the baselines; the first bound)
            self.branch.restore(root)
            node = None
            for depth in range(D):
                node = self._expand(node, b, depth, cut=b != self.unpruned)
                if not (node.run.reached_step is None and not node.run.stopped and depth < D - 1):
                    break
                if len(self._children(node.batches)) > 1:
                    prefixes.append((node, self.branch.snapshot(), depth))
            if b not in self.static:  # not reached: cut by the bound, or out of budget
                chain = self._trace(node)
                self.static[b] = {"ttp_s": None, "cut": bool(node.run.stopped),
                                  "clock_s": chain.ttp_s, "evals": chain.evals}
            self.static_samples, self.static_windows = self.samples_trained, self.windows_trained
            log.info("oracle: static batch %s: TTP %s (%d windows trained)", b,
                     self.static[b]["ttp_s"], self.windows_trained)
        if self.with_greedy:  # phase 2: the greedy reference (a chain of the set: a bound)
            self.branch.restore(root)
            self.greedy({node.batches: (node.run, snap) for node, snap, _ in prefixes})
        if self.prune:  # phase 3, pruned: window by window (cona/oracle_pruned.py)
            breadth_first(self, prefixes, D, self.beam)  # empties prefixes
        for node, snap, depth in prefixes:  # phase 3: leave the constant chain once
            for b_next in self._children(node.batches)[1:]:
                if not self._worth(node):  # the bound only falls: no later move can pass
                    break
                self._dfs(node, snap, b_next, depth + 1, D)
            log.info("oracle: after prefix %s: best %.1f s %s (%d windows, %d cut)",
                     node.batches, self.bound, self.best.batches if self.best else None,
                     self.windows_trained, self.nodes_cut)
        statics = [v["ttp_s"] for v in self.static.values() if v["ttp_s"] is not None]
        if statics and not self.best.ttp_s <= min(statics):
            raise RuntimeError(f"oracle chain {self.best.ttp_s} s slower than the best static "
                               f"{min(statics)} s: the search lost a static chain")
        return self.best

    def _dfs(self, parent: Node, snap: Any, batch: int, depth: int, D: int) -> None:
        self.branch.restore(snap)
        self._descend(parent, batch, depth, D)

    def _descend(self, parent: Node, batch: int, depth: int, D: int) -> None:
        """Train ``batch`` from the branch's current state (``parent``'s end), then the
        children: stay (from the state just reached), then each move (restored)."""
        node = self._expand(parent, batch, depth, cut=True)
        if depth == D - 1 or not self._worth(node):
            return
        children = self._children(node.batches)
        state = self.branch.snapshot() if len(children) > 1 else None
        self._descend(node, children[0], depth + 1, D)
        for b in children[1:]:
            if not self._worth(node):
                break
            self._dfs(node, state, b, depth + 1, D)

    def greedy(self, known: dict | None = None) -> ChainResult | None:
        """The greedy reference chain (:func:`cona.oracle_greedy.greedy`): the best strategy
        per window with one window's hindsight; also kept as ``greedy_chain``."""
        return greedy(self, known)

    def summary(self) -> dict:
        """The search's findings and costs, for a bench's JSON.

        Returns:
            ``windows`` (D), ``moves``, ``max_changes``, ``exact`` (False when
            ``max_windows`` stopped the search or ``prune`` is on); ``prune``, ``beam``
            and, when pruned, ``pruned_dominated``, ``pruned_beam`` (nodes dropped by
            each rule) and ``max_snapshots`` (a bound on the training states held at
            once, counted by the search: static and greedy phases included); ``oracle_ttp_s``, ``oracle_batches`` (per window),
            ``oracle_changes`` (strategy changes along the best chain: batch or layout),
            ``oracle_batch_changes``; ``static_best_ttp_s``, ``static_best_batch``,
            ``chain_over_static`` (best static TTP / oracle TTP, >= 1: how many times
            faster the best chain is than the best single strategy); ``greedy_ttp_s``,
            ``greedy_batches``, ``greedy_changes``, ``greedy_over_oracle`` (greedy TTP /
            oracle TTP, >= 1); costs in window-runs: ``windows_trained`` (all, greedy
            included), ``static_windows``, ``greedy_windows``, ``nodes_cut``; in samples, ``samples_trained``
            (all) and ``static_samples`` (the static chains alone); and what exhaustive search
            over the same set would train without the bound: ``tree_windows`` (every
            prefix once, states shared) and ``brute_force_windows`` (every chain from
            scratch, D windows each; both upper bounds: a chain that reaches the target
            early trains fewer).  ``None`` where a chain did not reach the target.
        """
        D = len(self.boundaries) + 1
        level, tree = [(b,) for b in self.batches], len(self.batches)
        for _ in range(D - 1):  # every prefix of the searched set, level by level
            level = [(*seq, b) for seq in level for b in self._children(seq)]
            tree += len(level)
        statics = {b: v["ttp_s"] for b, v in self.static.items() if v["ttp_s"] is not None}
        best_b = min(statics, key=statics.get) if statics else None
        o, g = self.best, self.greedy_chain

        def ratio(num, den):
            return num / den if num is not None and den else None

        return {
            "windows": D, "moves": list(self.moves), "max_changes": self.max_changes,
            "exact": self.exact, "prune": self.prune, "beam": self.beam,
            "pruned_dominated": self.pruned_dominated, "pruned_beam": self.pruned_beam,
            "max_snapshots": self.max_snapshots,
            "oracle_ttp_s": o and o.ttp_s, "oracle_batches": o and list(o.batches),
            "oracle_changes": o and len(o.layouts) - 1, "oracle_batch_changes": o and _changes(o.batches),
            "static_best_ttp_s": statics.get(best_b), "static_best_batch": best_b,
            "chain_over_static": ratio(statics.get(best_b), o and o.ttp_s),
            "greedy_ttp_s": g and g.ttp_s, "greedy_batches": g and list(g.batches),
            "greedy_changes": g and len(g.layouts) - 1,
            "greedy_over_oracle": ratio(g and g.ttp_s, o and o.ttp_s),
            "windows_trained": self.windows_trained, "static_windows": self.static_windows,
            "greedy_windows": self.greedy_windows,
            "nodes_cut": self.nodes_cut, "tree_windows": tree,
            "samples_trained": self.samples_trained, "static_samples": self.static_samples,
            "brute_force_windows": D * len(level),
        }
