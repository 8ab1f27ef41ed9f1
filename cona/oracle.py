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
- every chain whose batch, at each window boundary, stays or moves to the next
  larger batch of the option list (monotone, one step per boundary, as the
  noise scale grows; Pollux/McCandlish: the efficient batch grows with it);
- for each batch sequence, every sequence of layouts (DP, TP, PP,
  micro-batch) with that global batch, by dynamic programming over layouts
  (the proxy's trajectory depends on the batch only, so a batch sequence is
  trained once and its layouts are timed analytically, Viterbi-style, with
  the cluster's switch costs).

A batch sequence is trained for real from restored in-memory states: the
tree of sequences shares prefixes, every node's state (weights, optimizer,
schedule, data position, RNG, GNS) is a snapshot of its parent's plus one
window.  Branch and bound keeps it affordable and exact: a node (or a window
still running) whose cheapest time at its latest evaluation already reaches
the best time to target found so far cannot lead to a better chain (its
interpolated TTP lies after that evaluation) and is cut; a running window is
cut at an evaluation.  Constant chains are searched first (they are the static baselines, and give the first
bound); the constant chain of ``unpruned`` (the throughput baseline) runs on
until ``unpruned_factor`` times the bound (its time to target, or a lower
bound on it).  Since every static chain is in the searched set,
``oracle <= best static`` holds by construction.

The search talks to training only through a :class:`Branch` (snapshot,
restore, run a window) and to time through a :class:`TimeModel`, so it can be
tested on a synthetic problem with a known answer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("cona")


@dataclass(frozen=True)
class WindowRun:
    """What training one window produced.

    Attributes:
        steps: optimizer steps trained in the window.
        reached_step: steps into the window of the first evaluation at or below
            the target (``None``: not reached).
        stopped: the window was cut by the time limit (neither end nor target).
        evals: evaluation records of the window (for traces).
        eval_steps: steps into the window of each of its evaluations, ascending
            (the last is ``reached_step`` when reached).
        crossing: when reached, the fraction of the way from the previous
            evaluation (in this window or an earlier one) to ``reached_step``'s
            at which the target was crossed (``TTPTracker.crossing``; 1.0: no
            earlier evaluation).
    """

    steps: int
    reached_step: int | None = None
    stopped: bool = False
    evals: list = field(default_factory=list)
    eval_steps: tuple = ()
    crossing: float = 1.0


class Branch(Protocol):
    """Training that can be saved and resumed (the emulated proxy job)."""

    def snapshot(self) -> Any: ...

    def restore(self, snap: Any) -> None: ...

    def run_window(
        self, batch: int, end_samples: int | None, stop: Callable[[int], bool]
    ) -> WindowRun:
        """Train at global batch ``batch`` until ``end_samples`` (``None``: the budget) or the
        target; after each evaluation above the target, stop early (``stopped``) if
        ``stop(steps into the window)`` is true."""
        ...


class TimeModel(Protocol):
    def layouts(self, batch: int) -> Sequence[Any]: ...

    def iter_s(self, layout: Any) -> float: ...

    def switch_s(self, old: Any, new: Any) -> float: ...


@dataclass
class Node:
    """A batch-sequence prefix and, per layout of its last batch, the best elapsed time.

    ``times``: layout -> (seconds at the window's end, or the interpolated time to
    target if the window reached it; parent layout or ``None``).  ``paths``: for a
    window that reached the target with its previous evaluation in an earlier
    window, layout -> the layouts of the windows from that one to the parent (the
    crossing's own minimum, :meth:`OracleSearch._reach_times`).  ``eval_lb``: the
    least time over layouts at the latest evaluation so far (a lower bound on the
    time to target of every extension)."""

    batches: tuple
    times: dict
    parent: Node | None
    run: WindowRun
    start_step: int
    paths: dict = field(default_factory=dict)
    eval_lb: float = 0.0


@dataclass
class ChainResult:
    """A chain: its time to target (or its clock at the end), layouts and traces.

    Attributes:
        ttp_s: clock seconds to the target, interpolated at the crossing (the clock
            at the end if not reached).
        batches: global batch per window.
        layouts: the layout of each segment (one entry per change).
        switch_steps: the step at which each segment starts.
        switch_times_s: the clock at which each segment starts (after its switch).
        evals: evaluation records with ``time_s`` on this chain's clock.
    """

    ttp_s: float
    batches: tuple
    layouts: list
    switch_steps: list
    switch_times_s: list
    evals: list

    def to_dict(self, label=str) -> dict:
        return {
            "ttp_s": self.ttp_s,
            "batches": list(self.batches),
            "chain": [{"strategy": label(lay), "start_step": s}
                      for lay, s in zip(self.layouts, self.switch_steps)],
        }


def _entry(parent: Node | None, layout, tm: TimeModel) -> tuple[float, Any]:
    """Cheapest time to start a window at ``layout`` after ``parent``, and from which layout."""
    if parent is None:
        return 0.0, None
    return min(((t + tm.switch_s(p, layout), p) for p, (t, _) in parent.times.items()),
               key=lambda x: x[0])


class OracleSearch:
    """Branch-and-bound search (module docstring).

    Args:
        branch: the trainable state, at its initial point now.
        time_model: layouts and their clock.
        batches: the global batch options, ascending.
        boundaries: window ends in samples ``S_1 < ... < S_{D-1}``.
        unpruned: the batch whose constant chain runs on past the bound.
        unpruned_factor: ... until this multiple of the bound (``inf``: to the end).
    """

    def __init__(self, branch: Branch, time_model: TimeModel, batches: Sequence[int],
                 boundaries: Sequence[int], *, unpruned: int | None = None,
                 unpruned_factor: float = math.inf):
        if list(batches) != sorted(set(batches)) or not batches:
            raise ValueError(f"batches must be ascending and distinct, got {list(batches)}")
        if list(boundaries) != sorted(set(boundaries)) or any(b <= 0 for b in boundaries):
            raise ValueError(f"boundaries must be ascending positive samples, got {boundaries}")
        self.branch, self.tm = branch, time_model
        self.batches, self.boundaries = list(batches), list(boundaries)
        self.unpruned, self.unpruned_factor = unpruned, unpruned_factor
        self.best: ChainResult | None = None
        self.static: dict[int, dict] = {}
        self.windows_trained = 0
        self.nodes_cut = 0

    @property
    def bound(self) -> float:
        return self.best.ttp_s if self.best is not None else math.inf

    def _end(self, depth: int) -> int | None:
        return self.boundaries[depth] if depth < len(self.boundaries) else None

    def _expand(self, parent: Node | None, batch: int, depth: int, *, cut: bool) -> Node:
        """Train one window at ``batch`` from the branch's current state; ``cut=False``
        (the unpruned chain) cuts at ``unpruned_factor`` times the bound instead."""
        entries = {lay: _entry(parent, lay, self.tm) for lay in self.tm.layouts(batch)}
        factor = 1.0 if cut else self.unpruned_factor

        def stop(steps: int) -> bool:
            cheapest = min(t + steps * self.tm.iter_s(lay) for lay, (t, _) in entries.items())
            return cheapest >= factor * self.bound

        run = self.branch.run_window(batch, self._end(depth), stop)
        self.windows_trained += 1
        start = parent.start_step + parent.run.steps if parent is not None else 0
        batches = (*(parent.batches if parent else ()), batch)
        if run.reached_step is not None:
            times, paths = self._reach_times(parent, run, entries)
            node = Node(batches, times, parent, run, start, paths)
            self._finish(node)
            return node
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
        return True

    def _children(self, batch: int) -> list[int]:
        i = self.batches.index(batch)
        return self.batches[i:i + 2]  # stay, or the next larger batch

    def run(self) -> ChainResult | None:
        """Search; return the best chain (``None`` if none reached the target)."""
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
                if b != self.batches[-1]:
                    prefixes.append((node, self.branch.snapshot(), depth))
            if b not in self.static:  # not reached: cut by the bound, or out of budget
                chain = self._trace(node)
                self.static[b] = {"ttp_s": None, "cut": bool(node.run.stopped),
                                  "clock_s": chain.ttp_s, "evals": chain.evals}
            log.info("oracle: static batch %s: TTP %s (%d windows trained)", b,
                     self.static[b]["ttp_s"], self.windows_trained)
        for node, snap, depth in prefixes:  # phase 2: leave the constant chain once
            if self._worth(node):
                b_next = self._children(node.batches[-1])[-1]
                self._dfs(node, snap, b_next, depth + 1, D)
            log.info("oracle: after prefix %s: best %.1f s %s (%d windows, %d cut)",
                     node.batches, self.bound, self.best.batches if self.best else None,
                     self.windows_trained, self.nodes_cut)
        return self.best

    def _dfs(self, parent: Node, snap: Any, batch: int, depth: int, D: int) -> None:
        self.branch.restore(snap)
        self._descend(parent, batch, depth, D)

    def _descend(self, parent: Node, batch: int, depth: int, D: int) -> None:
        """Train ``batch`` from the branch's current state (``parent``'s end), then the
        children: stay (from the state just reached), then the next batch (restored)."""
        node = self._expand(parent, batch, depth, cut=True)
        if depth == D - 1 or not self._worth(node):
            return
        children = self._children(batch)
        state = self.branch.snapshot() if len(children) > 1 else None
        for i, b in enumerate(children):
            if i == 0:
                self._descend(node, b, depth + 1, D)
            elif self._worth(node):
                self._dfs(node, state, b, depth + 1, D)
