"""Strategies picked without the online loop: the fastest, the start strategy, the best goodput.

The static baselines (:mod:`cona.baselines`) and the start of an emulated run
(:meth:`cona.context.ConaContext.start_strategy`) use them; the controller
(:mod:`cona.controller`) ranks with the same surrogate (:mod:`cona.surrogate`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .cost_model import CostModel
from .strategy import Strategy
from .surrogate import rank_strategies


def best_throughput_strategy(candidates: Iterable[Strategy], cost_model: CostModel) -> Strategy:
    """Oracle baseline: the highest-tokens/s candidate (ignores statistical efficiency).

    Raises:
        ValueError: no candidates.
    """
    cands = list(candidates)
    if not cands:
        raise ValueError("no candidates")
    return max(cands, key=lambda s: (cost_model.tokens_per_second(s), s.label))


def start_strategy(
    candidates: Iterable[Strategy],
    cost_model: CostModel,
    batch: int,
    slack: float,
    *,
    budget_samples: float | None = None,
    switch_s: Callable[[Strategy, Strategy], float] | None = None,
) -> Strategy:
    """The start strategy at global batch ``batch``, chosen one switch ahead.

    A batch-only switch costs about one step, a layout switch (DP/TP/PP change)
    a process-group rebuild and resharding (seconds to minutes), so the layout
    the job starts in decides which later batch moves are cheap.  Let ``A`` be
    the fastest candidate at ``batch`` (samples/s).  A candidate ``B`` at ``batch``
    may replace it if

    1. it is within ``slack`` of ``A`` (a relative premium, paid in full when the
       noise scale never calls for a larger batch), and
    2. given ``budget_samples`` and ``switch_s`` (seconds of a switch ``old ->
       new``): the premium over the whole budget, ``budget_samples * (1/x_B -
       1/x_A)`` seconds at samples/s ``x``, is below what it insures, the cost
       of moving from ``A`` to the next batch's best candidate in ``B``'s layout
       minus that of moving from ``B`` there;

    of those, it returns the one whose *layout* runs the next larger candidate
    batch fastest (the move a growing noise scale asks for first, Pollux, Qiao
    et al. OSDI'21 sec. 3.1); ties, and a grid with no larger batch, go to the
    faster one now.  ``slack = 0`` is ``A``.  On the GPT-3 1.3B grid of
    ``bench/cona_ttp.py`` it starts in ``dp16-tp4`` at batch 64 (1.5 % slower
    than ``dp8-tp8``), from which batch 128 is a batch-only switch, as the
    quick bench's oracle chain does (docs/cona.md#benches).

    Raises:
        ValueError: no candidate at ``batch``, or ``slack`` not in ``[0, 1)``.
    """
    if not 0 <= slack < 1:
        raise ValueError(f"start slack must be in [0, 1), got {slack}")
    cands = list(candidates)
    here = [s for s in cands if s.global_batch_size == batch]
    if not here:
        raise ValueError(f"no candidate at global batch {batch}")
    rate = cost_model.samples_per_second  # one sequence length: the order of tokens/s
    fastest = max(here, key=lambda s: (rate(s), s.label))
    larger = [s.global_batch_size for s in cands if s.global_batch_size > batch]
    if not larger:
        return fastest
    nxt = min(larger)
    ahead: dict[tuple[int, int, int], Strategy] = {}  # layout -> its fastest at nxt
    for s in sorted(cands, key=lambda s: s.label):
        key = (s.dp, s.tp, s.pp)
        if s.global_batch_size == nxt and (key not in ahead or rate(s) > rate(ahead[key])):
            ahead[key] = s

    def insured(s: Strategy) -> bool:
        if s == fastest:
            return True
        if rate(s) < (1.0 - slack) * rate(fastest):
            return False
        later = ahead.get((s.dp, s.tp, s.pp))
        if later is None or budget_samples is None or switch_s is None:
            return later is not None
        premium = budget_samples * (1.0 / rate(s) - 1.0 / rate(fastest))
        return premium < switch_s(fastest, later) - switch_s(s, later)

    def later_rate(s: Strategy) -> float:
        later = ahead.get((s.dp, s.tp, s.pp))
        return rate(later) if later is not None else 0.0

    return max(filter(insured, here), key=lambda s: (later_rate(s), rate(s), s.label))


def best_goodput_strategy(
    candidates: Iterable[Strategy],
    cost_model: CostModel,
    noise_scale: float | None,
    reference_batch: float,
) -> Strategy:
    """Oracle baseline: the best surrogate score at a given noise scale.

    Raises:
        ValueError: no candidates.
    """
    ranked = rank_strategies(candidates, cost_model, noise_scale, reference_batch)
    if not ranked:
        raise ValueError("no candidates")
    return ranked[0].strategy
