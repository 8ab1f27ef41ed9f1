"""What the oracle search (:mod:`cona.oracle`) works with: the :class:`Branch` and
:class:`TimeModel` it talks to, the :class:`WindowRun` a branch returns, the
:class:`Node` of its tree of batch sequences and the :class:`ChainResult` it reports,
and the helpers its phases share (batch changes along a sequence; a window's entry
time at a layout and its stop rule at a bound).

Re-exported by :mod:`cona.oracle`; pure logic, no training.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class WindowRun:
    """What training one window produced.

    Attributes:
        steps: optimizer steps trained in the window.
        reached_step: steps into the window of the first evaluation at or below
            the target (``None``: not reached).
        stopped: the window was cut by the time limit (neither end nor target).
        evals: evaluation records of the window, one per ``eval_steps`` entry, each a
            dict with ``step`` (the run's step) and ``val_ppl`` (read by the greedy
            reference).
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
    crossing's own minimum, :meth:`cona.oracle.OracleSearch._reach_times`).
    ``eval_lb``: the least time over layouts at the latest evaluation so far (a lower
    bound on the time to target of every extension)."""

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


def _changes(seq: Sequence) -> int:
    """Batch changes along a batch sequence."""
    return sum(x != y for x, y in zip(seq, seq[1:]))


def _entry(parent: Node | None, layout, tm: TimeModel) -> tuple[float, Any]:
    """Cheapest time to start a window at ``layout`` after ``parent``, and from which layout."""
    if parent is None:
        return 0.0, None
    return min(((t + tm.switch_s(p, layout), p) for p, (t, _) in parent.times.items()),
               key=lambda x: x[0])


def _past(entries: dict, tm: TimeModel, bound: float) -> Callable[[int], bool]:
    """The stop rule of a window started at ``entries`` (layout -> (entry time, parent
    layout)): true once its cheapest clock ``steps`` into it reaches ``bound`` seconds."""
    return lambda steps: min(t + steps * tm.iter_s(lay) for lay, (t, _) in entries.items()) >= bound
