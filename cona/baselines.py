"""Baselines for CONA in emulated mode (one process): static strategies and the oracle chain.

All methods start from the same initial model, see the same data order and
use the same LR rule and sample-based schedule; only the clock differs by
strategy (:class:`cona.emulated.EmulatedCluster`).  In emulated mode the
proxy's trajectory depends only on the global batch size (DP/TP/PP and the
micro-batch only change the modelled time), which the baselines use:

- **static runs**: one proxy run per distinct global batch ``B`` (at the
  fastest candidate with that ``B``).  A candidate ``c`` with batch ``B``
  then reaches the target at step ``n_B``, i.e. at ``n_B * iter_s(c)``
  seconds: every static candidate's TTP is known exactly.
- **static_throughput**: the candidate with the highest tokens/s (what an
  offline planner that ignores statistical efficiency picks).
- **static_oracle**: the candidate with the best TTP (trying each static
  candidate).
- **oracle_chain**: at each decision window, branch from the same in-memory
  state (model, optimizer, schedule, data position, GNS, clock) into every
  global batch (each at the candidate that trains most steps in the window,
  switch cost included), run every branch for the same clock time
  ``T_w = K * iter_s(start)``, and keep the branch with the best perplexity
  progress per second (``(ppl_before - ppl_after) / seconds``); a branch that
  reaches the target wins by its TTP.  Equal-time windows keep short branches
  from looking better merely because perplexity falls fastest early.
"""

from __future__ import annotations

import copy
import logging

from jobruntime.config import JobConfig
from jobruntime.metrics import perplexity

from .controller import best_throughput_strategy
from .run import Loop, emulated_plan, setup
from .strategy import Strategy

log = logging.getLogger("cona")


def method_result(loop: Loop) -> dict:
    """The benchmark's record of one method: ``ttp_s``, ``final_val_ppl``, ``switches``, ``chain``."""
    p = loop.progress
    return {
        "ttp_s": p.ttp.ttp_s,
        "final_val_ppl": p.last_val_ppl,
        "switches": len(p.switches),
        "chain": p.chain,
        "ttp_step": p.ttp.ttp_step,
        "samples": loop.job.consumed_samples,
        "clock_s": loop.job.clock_s,
    }


def run_cona(cfg: JobConfig) -> tuple[dict, Loop]:
    """CONA itself (emulated), records buffered in the loop."""
    s = setup(cfg)
    loop = Loop(
        s.job,
        cfg,
        controller=s.controller,
        budget_samples=s.budget_samples,
        eval_samples=s.eval_samples,
    )
    loop.run()
    loop.finish()
    out = method_result(loop)
    out["decisions"] = len(s.controller.decisions)
    return out, loop


def fastest_per_batch(candidates: list[Strategy], iter_s) -> dict[int, Strategy]:
    """The fastest candidate for each global batch size."""
    best: dict[int, Strategy] = {}
    for c in sorted(candidates, key=lambda s: s.label):
        gb = c.global_batch_size
        if gb not in best or iter_s(c) < iter_s(best[gb]):
            best[gb] = c
    return dict(sorted(best.items()))


def run_static(cfg: JobConfig) -> dict:
    """Static runs per global batch; returns ``static_throughput``, ``static_oracle``, ``per_batch``.

    Runs go in increasing global batch.  A run other than the throughput
    candidate's stops early ("pruned") once its clock passes the best TTP
    found so far without reaching the target: no candidate with that batch
    can then be the oracle (they all share its step count and none is faster
    than the fastest one it ran with), so this changes no result.
    """
    cluster, cands = emulated_plan(cfg)
    per_gb = fastest_per_batch(cands, cluster.iter_s)
    fastest = best_throughput_strategy(cands, cluster.cost_model)
    runs, best_ttp, data = {}, None, None
    for gb, strategy in per_gb.items():
        s = setup(cfg, start=strategy, data=data)
        data = s.job.data
        loop = Loop(s.job, cfg, budget_samples=s.budget_samples, eval_samples=s.eval_samples)
        limit = best_ttp if gb != fastest.global_batch_size else None
        loop.run(until=lambda job=s.job, limit=limit: limit is not None and job.clock_s > limit)
        pruned = not loop.progress.ttp.reached and not loop.done
        if not pruned:
            loop.finish()
        p = loop.progress
        if p.ttp.reached:
            best_ttp = min(best_ttp or p.ttp.ttp_s, p.ttp.ttp_s)
        runs[gb] = {
            "strategy": strategy.label,
            "ttp_step": p.ttp.ttp_step,
            "pruned": pruned,
            "final_val_ppl": p.last_val_ppl,
            "samples": s.job.consumed_samples,
            "steps": s.job.trainer.step,
            "clock_s": s.job.clock_s,
        }
        log.info(
            "static gb=%d (%s): ttp_step %s%s, last ppl %.1f",
            gb,
            strategy.label,
            p.ttp.ttp_step,
            " (pruned)" if pruned else "",
            p.last_val_ppl or float("nan"),
        )

    def result(c: Strategy) -> dict:
        r = runs[c.global_batch_size]
        ttp = r["ttp_step"] * cluster.iter_s(c) if r["ttp_step"] is not None else None
        return {
            "ttp_s": ttp,
            "final_val_ppl": r["final_val_ppl"],
            "switches": 0,
            "chain": [{"strategy": c.label, "start_step": 0}],
            "ttp_step": r["ttp_step"],
        }

    reached = [c for c in cands if runs[c.global_batch_size]["ttp_step"] is not None]
    oracle = min(reached, key=lambda c: (result(c)["ttp_s"], c.label)) if reached else fastest
    return {
        "static_throughput": result(fastest),
        "static_oracle": result(oracle),
        "per_batch": runs,
    }


def run_oracle_chain(cfg: JobConfig) -> dict:
    """The greedy per-window best sequence (module docstring)."""
    s = setup(cfg)
    job, cluster = s.job, s.cluster
    loop = Loop(job, cfg, budget_samples=s.budget_samples, eval_samples=s.eval_samples)
    window_s = cfg.cona.decision_interval * cluster.iter_s(job.strategy)
    gbs = sorted({c.global_batch_size for c in s.candidates})
    windows, ppl0 = [], None
    while not loop.done:
        base, base_progress = job.snapshot(), copy.deepcopy(loop.progress)
        if ppl0 is None:
            ppl0 = perplexity(job.evaluate())
        best, rates = None, {}
        for gb in gbs:
            job.restore(base)
            loop.progress = copy.deepcopy(base_progress)
            cur, t0 = job.strategy, job.clock_s
            same_b = [c for c in s.candidates if c.global_batch_size == gb]
            cand = max(
                same_b,
                key=lambda c: ((window_s - cluster.switch_s(cur, c)) / cluster.iter_s(c), c.label),
            )
            rec = job.apply(cand)
            if rec is not None:
                rec.update(event="switch", step=job.trainer.step, time_s=job.clock_s)
                loop.progress.switches.append(rec)
                loop.progress.chain.append({"strategy": cand.label, "start_step": job.trainer.step})
            end = t0 + window_s
            loop.step()  # at least one step, even if the switch ate the window
            loop.run(until=lambda end=end: job.clock_s >= end - 1e-9)
            ttp = loop.progress.ttp.ttp_s
            ppl1 = perplexity(job.evaluate())
            if ttp is not None:
                key = (1, -ttp)  # reached the target: earliest wins
            else:
                key = (0, (ppl0 - ppl1) / (job.clock_s - t0))
            rates[gb] = key[1] if key[0] == 0 else f"ttp {ttp:.2f}"
            if best is None or key > best[0]:
                best = (key, job.snapshot(), copy.deepcopy(loop.progress), ppl1)
        job.restore(best[1])
        loop.progress, ppl0 = best[2], best[3]
        windows.append(
            {
                "step": base["trainer"]["step"],
                "ppl_after": ppl0,
                "rates": rates,
                "kept": job.strategy.global_batch_size,
            }
        )
    loop.finish()
    out = method_result(loop)
    out["windows"] = len(windows)
    out["window_log"] = windows
    return out
