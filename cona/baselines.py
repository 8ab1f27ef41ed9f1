"""CONA and its baselines in emulated mode: static strategies and the oracle chain.

All methods start from the same initial model, see the same data order and
use the same LR rule and sample-based schedule; only the chain of strategies
differs.  In emulated mode the proxy's trajectory depends only on the global
batch (DP/TP/PP and the micro-batch only change the modelled time), so:

- **static** strategies are the constant chains of :class:`cona.oracle.OracleSearch`
  (one proxy run per distinct global batch, timed at its fastest layout);
- **static_throughput**: the candidate with the highest modelled tokens/s (what
  an offline planner that ignores statistical efficiency picks), run to the
  target, the budget, or 2x the best static time (then its clock there is a
  lower bound on its time to target);
- **static_recipe**: the target's published global batch (:data:`cona.mapping.PUBLISHED_BATCH`)
  at the layout an offline planner picks for it, the lowest modelled per-iteration time
  (:func:`recipe_strategy`; Alpa, Galvatron and Megatron's recommended configurations
  take the batch as given and search the layout), run to the target without a cap, at
  the best of ``LR_FACTORS`` x the scaling rule's LR (:func:`run_lr_sweep`: a published
  recipe comes with an LR tuned for its batch; the proxy's is not, so it gets the same
  choice as ``static_oracle``);
- **static_oracle**: the best time to target over all static candidates, each batch at
  its fastest layout and at the best of ``LR_FACTORS`` x the scaling rule's LR
  (:func:`run_static`, hindsight);
- **oracle_chain**: the best chain of the search (every static chain is one of
  its chains, so ``oracle_chain <= static_oracle``);
- **cona**: the online controller (:func:`run_cona`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging

from .context import ConaContext
from .job import EmulatedJob
from .oracle import OracleSearch, WindowRun
from .picks import best_throughput_strategy
from .run import Loop
from .strategy import Strategy, switch_kind

log = logging.getLogger("cona")


def method_result(loop: Loop) -> dict:
    """A method's record: ``ttp_s``, ``final_val_ppl``, ``switches``, ``chain`` with switch
    times, the ``evals`` trace (perplexity and noise scale over time)."""
    p = loop.progress
    return {
        "ttp_s": p.ttp.ttp_s,
        "final_val_ppl": p.last_val_ppl,
        "switches": len(p.switches),
        "chain": p.chain,
        "switch_times_s": [s["time_s"] for s in p.switches],
        "ttp_step": p.ttp.ttp_step,
        "samples": loop.job.consumed_samples,
        "clock_s": loop.job.clock_s,
        "evals": p.evals,
    }


def run_cona(ctx: ConaContext, **cona_overrides) -> tuple[dict, Loop]:
    """CONA itself, records buffered in the loop (``loop.progress.records``);
    ``cona_overrides``: ``cona.*`` settings for this run only (an ablation, e.g.
    ``gns_definition="simple"``), ``ctx.cfg`` left as it was."""
    saved = ctx.cfg.cona
    ctx.cfg.cona = dataclasses.replace(saved, **cona_overrides)
    try:
        job = ctx.make_job()
        controller = ctx.make_controller(job)
        loop = Loop(job, ctx.cfg, controller=controller, budget_samples=ctx.budget_samples,
                    eval_samples=ctx.eval_samples)
        loop.run()
        loop.finish()
    finally:
        ctx.cfg.cona = saved
    out = method_result(loop)
    out["decisions"] = [
        {k: d[k] for k in ("step", "current", "best", "switch", "reason", "noise_scale",
                           "top_ranked", "noise_scale_factor", "progress_fit") if k in d}
        for d in controller.decisions
    ]
    return out, loop


def fastest_per_batch(candidates: list[Strategy], iter_s) -> dict[int, Strategy]:
    """The fastest candidate for each global batch size."""
    best: dict[int, Strategy] = {}
    for c in sorted(candidates, key=lambda s: s.label):
        gb = c.global_batch_size
        if gb not in best or iter_s(c) < iter_s(best[gb]):
            best[gb] = c
    return dict(sorted(best.items()))


def recipe_strategy(candidates: list[Strategy], iter_s, batch: int) -> Strategy:
    """The offline planner's pick for global batch ``batch``: the candidate with the lowest
    per-iteration time ``iter_s(strategy)`` (seconds) among those at that batch (ties by
    label).

    Raises:
        ValueError: no candidate has global batch ``batch``.
    """
    at = [c for c in candidates if c.global_batch_size == batch]
    if not at:
        have = sorted({c.global_batch_size for c in candidates})
        raise ValueError(f"no candidate at global batch {batch} (candidates: {have}); add it "
                         "to cona.global_batch_sizes")
    return min(at, key=lambda c: (iter_s(c), c.label))


def layout_switches(chain: list[dict]) -> int:
    """Layout switches (DP/TP/PP change) in a ``chain`` of ``{"strategy": label}`` entries."""
    labels = [Strategy.from_label(c["strategy"]) for c in chain]
    return sum(switch_kind(a, b) == "layout" for a, b in zip(labels, labels[1:]))


LR_FACTORS = (0.5, 1.0, 2.0)  # static_oracle's LR choices, x the scaling rule's LR


def past_bound(evals: list[dict], bound_s: float) -> bool:
    """Whether a run that has not reached its target yet can stop: its last evaluation
    (``{"time_s", ...}``, emulated seconds) is past ``bound_s``.  Exact for a minimum:
    TTP is interpolated between the last evaluation above the target and the first at
    or below it, so a run whose TTP is below ``bound_s`` has every evaluation before
    its crossing at a time below ``bound_s`` and is never stopped; one stopped here has
    its TTP (if any) above ``bound_s``.  (A cut on the clock between evaluations is
    not exact: the crossing's evaluation may come after the bound although the
    interpolated TTP lies before it.)"""
    return bool(evals) and evals[-1]["time_s"] > bound_s


def run_static(ctx: ConaContext, strategy: Strategy, lr_factor: float = 1.0,
               budget_samples: int | None = None, bound_s: float | None = None) -> dict:
    """One static run at ``strategy`` with ``lr_factor`` x the rule's LR, from ``ctx``'s
    warm state, to the target or ``budget_samples`` (default the context's budget), or
    stopped at :func:`past_bound` of ``bound_s`` (emulated seconds; then ``ttp_s`` is
    ``None`` and ``ttp_lower_bound_s`` its clock there: the run's TTP, had it gone on,
    exceeds ``bound_s``).  Returns a method record (:func:`method_result`) with
    ``lr_factor``."""
    job = ctx.make_job(strategy, lr_factor=lr_factor, track_gns=False)
    loop = Loop(job, ctx.cfg, budget_samples=budget_samples or ctx.budget_samples,
                eval_samples=ctx.eval_samples, keep_records=False)
    loop.run(until=None if bound_s is None else lambda: past_bound(loop.progress.evals, bound_s))
    out = method_result(loop)
    out["lr_factor"] = lr_factor
    if out["ttp_s"] is None:
        out["ttp_lower_bound_s"] = job.clock_s
    return out


def run_lr_sweep(ctx: ConaContext, strategy: Strategy, lr_factors, *,
                 budget_samples: int | None = None,
                 known: dict[float, dict] | None = None) -> tuple[dict, list[dict]]:
    """``strategy`` at each of ``lr_factors`` x the scaling rule's LR (:func:`run_static`),
    each run to the target or ``budget_samples`` and stopped past the best TTP so far
    (:func:`past_bound`: exact for the minimum; a reached ``known`` run bounds from the
    start).  ``known``: records already run at some factors (reached runs of the same
    strategy and start: the trajectory is the same).

    Returns:
        ``(best, runs)``: the record with the lowest ``ttp_s`` (if none reached, the one
        with the lowest ``ttp_lower_bound_s``: the only bound valid for the best TTP over
        factors), with ``lr_sweep``
        (``[{lr_factor, ttp_s, ttp_lower_bound_s}]``); and every factor's record.

    Raises:
        ValueError: ``lr_factors`` empty.
    """
    if not lr_factors:
        raise ValueError("lr_factors must not be empty")
    known, runs = known or {}, []
    best_s = min((r["ttp_s"] for r in known.values() if r["ttp_s"] is not None), default=None)
    for f in lr_factors:
        run = dict(known[f], lr_factor=f) if f in known else run_static(
            ctx, strategy, f, budget_samples=budget_samples, bound_s=best_s)
        runs.append(run)
        if run["ttp_s"] is not None and (best_s is None or run["ttp_s"] < best_s):
            best_s = run["ttp_s"]
    reached = [r for r in runs if r["ttp_s"] is not None]
    best = dict(min(reached, key=lambda r: r["ttp_s"]) if reached else
                min(runs, key=lambda r: r.get("ttp_lower_bound_s") or 0.0))
    best["lr_sweep"] = [{k: r.get(k) for k in ("lr_factor", "ttp_s", "ttp_lower_bound_s")}
                        for r in runs]
    return best, runs


def fastest_rates(candidates: list[Strategy], iter_s) -> dict[int, float]:
    """Sequences per second of :func:`fastest_per_batch`'s candidate at each global batch
    (``iter_s``: seconds per optimizer step of a strategy)."""
    return {b: b / iter_s(s) for b, s in fastest_per_batch(candidates, iter_s).items()}


class ProxyBranch:
    """:class:`cona.oracle.Branch` over an emulated job: windows trained for real,
    states snapshot and restored in memory (the oracle computes the clock itself)."""

    def __init__(self, ctx: ConaContext, job: EmulatedJob, loop: Loop):
        self.ctx, self.job, self.loop = ctx, job, loop
        self.per_batch = fastest_per_batch(ctx.candidates, ctx.cluster.iter_s)
        # the search counts steps from its root; a job from a warm state starts past 0
        self.step0 = job.trainer.step

    def snapshot(self):
        return self.job.snapshot(), copy.deepcopy(self.loop.progress)

    def restore(self, snap) -> None:
        self.job.restore(snap[0])
        self.loop.progress = copy.deepcopy(snap[1])

    def run_window(self, batch, end_samples, stop) -> WindowRun:
        job, loop = self.job, self.loop
        job.set_strategy(self.per_batch[batch])
        evals, first_eval, steps, at = loop.progress.evals, len(loop.progress.evals), 0, []

        def window_ends() -> bool:
            return end_samples is not None and job.consumed_samples >= end_samples

        while not loop.done and not window_ends():
            n = len(evals)
            loop.step()
            steps += 1
            if len(evals := loop.progress.evals) == n:  # no evaluation at this step
                if not window_ends() or loop.done:
                    continue
                # a window ends on an evaluation: the greedy rule and the bound read it,
                # and a large batch's clock cadence may leave a window without one
                loop.evaluate()
                evals = loop.progress.evals
            at.append(steps)
            ttp = loop.progress.ttp
            if ttp.reached or stop(steps):
                return WindowRun(steps, steps if ttp.reached else None, stopped=not ttp.reached,
                                 evals=self._from_root(evals[first_eval:]), eval_steps=tuple(at),
                                 crossing=ttp.crossing if ttp.reached else 1.0)
        return WindowRun(steps, evals=self._from_root(evals[first_eval:]), eval_steps=tuple(at))

    def _from_root(self, evals: list[dict]) -> list[dict]:
        """Copies of ``evals`` with ``step`` counted from the search's root (the oracle
        times an evaluation by its step within the chain)."""
        return [dict(copy.deepcopy(e), step=e["step"] - self.step0) for e in evals]


class ClusterTime:
    """:class:`cona.oracle.TimeModel` of the emulated cluster over the candidates."""

    def __init__(self, ctx: ConaContext):
        self.cluster = ctx.cluster
        self._by_batch: dict[int, list[Strategy]] = {}
        for c in ctx.candidates:
            self._by_batch.setdefault(c.global_batch_size, []).append(c)

    def layouts(self, batch: int) -> list[Strategy]:
        return self._by_batch[batch]

    def iter_s(self, layout: Strategy) -> float:
        return self.cluster.iter_s(layout)

    def switch_s(self, old: Strategy, new: Strategy) -> float:
        return self.cluster.switch_s(old, new)


def run_search(ctx: ConaContext, boundaries: list[int], **options) -> dict:
    """Static baselines and the oracle chain from one search (module docstring).

    Args:
        boundaries: the oracle's window ends, in proxy samples.
        options: passed to :class:`cona.oracle.OracleSearch` (``moves``, ``max_changes``,
            ``max_windows``, ``greedy``; ``prune="dominated"`` and ``beam``: the cheap,
            non-exact search of :mod:`cona.oracle_pruned`; default the exact search).

    Returns:
        ``{"static_throughput", "static_oracle", "oracle_chain", "oracle_greedy": method
        records, "per_batch": {batch: {ttp_s, cut}}, "static_chains": {batch: method
        record}, "search": boundaries and :meth:`cona.oracle.OracleSearch.summary`
        (oracle_changes, chain_over_static, greedy_over_oracle, costs)}``.
    """
    job = ctx.make_job(min(ctx.candidates, key=lambda s: s.global_batch_size), track_gns=False)
    loop = Loop(job, ctx.cfg, budget_samples=ctx.budget_samples, eval_samples=ctx.eval_samples,
                keep_records=False)
    fastest = best_throughput_strategy(ctx.candidates, ctx.cost_model)
    time_model = ClusterTime(ctx)
    batches = sorted(time_model._by_batch)
    search = OracleSearch(ProxyBranch(ctx, job, loop), time_model, batches, boundaries,
                          unpruned=fastest.global_batch_size, unpruned_factor=2.0, **options)
    best = search.run()

    def record(chain) -> dict:
        if chain is None:
            return {"ttp_s": None, "chain": [], "switches": 0, "evals": []}
        d = chain.to_dict(label=lambda s: s.label)
        d.update(switches=len(d["chain"]) - 1, evals=chain.evals,
                 switch_times_s=chain.switch_times_s[1:])
        return d

    per_batch = {b: {"ttp_s": v["ttp_s"], "cut": v.get("cut", False)}
                 for b, v in search.static.items()}
    layout = fastest_per_batch(ctx.candidates, ctx.cluster.iter_s)
    static_chains = {  # every batch's constant chain (a lower bound where it was cut)
        b: record(v["chain"]) if v["ttp_s"] is not None else
        {"ttp_s": None, "chain": [{"strategy": layout[b].label, "start_step": 0}],
         "switches": 0, "ttp_lower_bound_s": v.get("clock_s"), "evals": v.get("evals", []),
         "cut": v.get("cut", False)}
        for b, v in search.static.items()}
    reached = {b: v for b, v in search.static.items() if v["ttp_s"] is not None}
    thr = search.static[fastest.global_batch_size]
    if thr["ttp_s"] is None:  # not reached within the budget: its clock there bounds its TTP
        throughput = {"ttp_s": None, "chain": [{"strategy": fastest.label, "start_step": 0}],
                      "switches": 0, "ttp_lower_bound_s": thr.get("clock_s"), "evals": thr["evals"]}
    else:
        throughput = record(thr["chain"])
    oracle = record(min(reached.values(), key=lambda v: v["ttp_s"])["chain"]) if reached else None
    return {
        "static_throughput": throughput,
        "static_oracle": oracle,
        "oracle_chain": record(best),
        "oracle_greedy": record(search.greedy_chain),
        "per_batch": per_batch,
        "static_chains": static_chains,
        "search": {"boundaries": boundaries, **search.summary()},
    }
