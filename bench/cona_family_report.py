"""A family's entry in the CONA bench's report (:mod:`bench.cona_ttp`): what its set-up
measured (:func:`setup_summary`) and, with its seeds' results, the whole entry
(:func:`finish_family`; with an output folder also its ``result.json`` and plot).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.cona_aggregate import aggregate, oracle_finding, ratios, static_fixed


def setup_summary(target: str, spec: dict, setup: dict, settings: dict) -> dict:
    """What a family's set-up (rules 1-5, :func:`bench.cona_ttp.setup_task`) measured,
    JSON-ready: proxy, unigram and target perplexity, the direct noise-scale growth, the
    time scale and the span of the target's training one run stands for, the reference
    and the set-up's cost (wall and CPU seconds)."""
    from cona.mapping import PUBLISHED_BATCH, recipe_batch
    from cona.targets import TARGET_FRACTION

    cfg, ref, ts = setup["cfg"], setup["ref"], setup["ts"]
    return {
        "proxy": spec["proxy"],
        "proxy_overrides": spec.get("overrides", []),
        "unigram_ppl": setup["unigram"],
        "target_ppl": cfg.train.target_ppl,
        "cona_gns_definition": cfg.cona.gns_definition,
        "target_rule": "quick: the reference's perplexity after a short segment"
        if settings.get("quick_segment") else
        f"{TARGET_FRACTION} x min(unigram_ppl, warm_ppl) (cona/targets.py)",
        "noise_scale_growth_direct": ref["noise_scale_target_proxy"]
        / ref["noise_scale_warm_proxy"],
        # the trend's 95 % bootstrap interval at the target over the warm state's probe
        "noise_scale_growth_direct_interval": ref["noise_scale_growth"]["direct_interval"],
        # the growth along the segment's own probes, Kaplan's over its loss range beside it
        "noise_scale_growth_along": {k: ref["noise_scale_growth"][k] for k in (
            "along", "along_interval", "kaplan", "slope", "kaplan_slope", "bootstrap_block")},
        # the same run's trend through one probe per evaluation interval (the cadence before
        # PROBE_DENSITY), side by side: what the denser probes buy
        "noise_scale_growth_one_per_eval": _growth_one_per_eval(ref),
        "target_tokens_per_run": ts["target_tokens_per_run"],
        "time_scale": ts,
        "layout_switch_s_median": statistics.median(setup["layout_s"])
        if setup["layout_s"] else None,
        "recipe": {"batch": recipe_batch(target), "source": PUBLISHED_BATCH[target][1],
                   "adam_beta2": cfg.train.adam_beta2,
                   "adam_beta2_batch": cfg.cona.adam_beta2_batch},
        "reference": {**ref, "warm_steps": cfg.train.warmup_iters,
                      "probe_microbatches": settings.get("probe_microbatches", 64)},
        "mapping": {**setup["mapping"], "step_dilation": cfg.cona.step_dilation},
        "candidates": setup["candidates"],
        "wall_s": {"setup": setup["wall_s"]},
        "cpu_s": setup["cpu_s"],
    }


def _growth_one_per_eval(ref: dict) -> dict | None:
    """The reference's growth (and its 95 % interval) through one probe per evaluation
    interval (:func:`bench.cona_reference.reference`'s side-by-side subset), or ``None``."""
    sub = ref.get("noise_scale_target_one_per_eval_proxy")
    if not sub or not sub["interval"]:
        return None
    phi0 = ref["noise_scale_warm_proxy"]
    return {"growth": sub["value"] / phi0, "interval": [v / phi0 for v in sub["interval"]],
            "points": sub["points"]}


def finish_family(target: str, spec: dict, setup: dict, seeds: list[dict], settings: dict,
                  out: str | None) -> dict:
    """A family's report entry from its setup (:func:`setup_summary`) and its seeds'
    results (:mod:`bench.cona_ttp`'s docstring); with ``out`` also
    ``out/target/result.json`` and its plot."""
    per_seed = [s["methods"] for s in seeds]
    methods = aggregate(per_seed)
    if methods.get("static_oracle"):  # the sweeps stay in the seed files (static_fixed)
        methods["static_oracle"].pop("runs", None)
    recipe_ttp = methods["static_recipe"]["ttp_s"]
    result = setup_summary(target, spec, setup, settings)
    layout_s = result["layout_switch_s_median"]
    result["reference"]["warm"] = [s["warm"] for s in seeds]
    result.update({
        # what a layout switch costs against a run (the bar: a few percent at most)
        "layout_switch_share_of_recipe_ttp": layout_s / recipe_ttp
        if layout_s is not None and recipe_ttp else None,
        "oracle": oracle_finding(per_seed),
        "static_fixed": (fixed := static_fixed(per_seed)),
        # a lower bound where static_fixed's ttp_s is null (a cut run)
        "ratios": {**ratios(methods), "static_fixed_over_cona":
                   fixed["ttp_lower_bound_s"] / methods["cona"]["ttp_s"]
                   if fixed and methods["cona"]["ttp_s"] else None},
        "methods": methods,
        "wall_s": {"setup": setup["wall_s"], "seeds": [s["wall_s"] for s in seeds]},
        "cpu_s": setup["cpu_s"] + sum(s["cpu_s"] for s in seeds),
        "seeds_done": len(seeds),
        "seed_runs": [{k: s.get(k) for k in ("seed_index", "setup_key", "reused", "wall_s",
                                              "cpu_s", "phase_wall_s")} for s in seeds],
    })
    if out is not None:
        d = Path(out) / target
        d.mkdir(parents=True, exist_ok=True)
        from bench.cona_plot import plot_family
        from jobruntime.metrics import write_json_atomic

        write_json_atomic(d / "result.json", result)
        plot_family(target, result, d / "ppl_vs_time.png")
    return result
