"""Renderers of ``bench/cona_ttp.py``'s JSON for ``tools/render_results.py``: the full
table per family, the README's headline and the issue's bars, measured against their
thresholds."""

from __future__ import annotations

import math
import re

from results_source import source_line as _source

GNS_DEFINITIONS = ("simple", "newton", "pollux")  # cona.probe.DEFINITIONS
CONA_METHODS = (("static_recipe", "static recipe"), ("static_throughput", "static throughput"),
                ("static_oracle", "best static (hindsight)"), ("oracle_greedy", "oracle greedy"),
                ("oracle_chain", "oracle chain"), ("cona", "CONA"))


def _methods(m: dict) -> list[tuple[str, str]]:
    """A family's method rows: :data:`CONA_METHODS`, then CONA with each other noise-scale
    definition where the run made that ablation (``cona_gns_<definition>``)."""
    own = m.get("cona_gns_definition")
    rows = [(k, f"CONA (`{own}` noise scale)" if k == "cona" and own else label)
            for k, label in CONA_METHODS]
    return rows + [(k, f"CONA, `{k.removeprefix('cona_gns_')}` noise scale (ablation)")
                   for k in m["methods"] if k.startswith("cona_gns_")]


def _mean_lower_bound(m: dict) -> float | None:
    """A lower bound on a method's mean TTP where a seed missed the target: the mean of
    each seed's TTP or, where it missed, the clock it stopped at (``None`` where a missed
    seed has no bound)."""
    by_seed = m.get("ttp_s_by_seed") or []
    lows = m.get("ttp_lower_bound_s_by_seed") or [None] * len(by_seed)
    vals = [t if t is not None else b for t, b in zip(by_seed, lows)]
    return sum(vals) / len(vals) if vals and None not in vals else None


def _seeds_ttp(m: dict | None) -> str:
    """``mean ± sd s`` over the seeds (``missed (k/n)`` where a seed missed the target)."""
    if not m:
        return "—"
    by_seed = m.get("ttp_s_by_seed") or [m.get("ttp_s")]
    if None in by_seed:
        low = _mean_lower_bound(m)
        bound = f"; mean > {low:,.0f} s" if low else ""
        return f"missed ({by_seed.count(None)}/{len(by_seed)}{bound})"
    sd = m.get("ttp_s_sd")
    return f"{m['ttp_s']:,.0f} ± {sd:,.0f} s" if sd else f"{m['ttp_s']:,.0f} s"


def _speedup(m: dict | None, cona_s: float | None) -> str:
    """``m``'s mean TTP over CONA's (``—`` where either missed the target)."""
    t = (m or {}).get("ttp_s")
    return f"{t / cona_s:.2f}x" if t and cona_s else "—"


def _cona_settings(r: dict) -> str:
    seeds = {len((m["methods"]["cona"] or {}).get("ttp_s_by_seed") or [0])
             for m in r["models"].values()}
    mode = ("Quick (CI-sized) run: one family, a short segment, 3 batches, 2 oracle windows"
            if r.get("quick") else "Full run")
    return (f"{mode}; {'/'.join(map(str, sorted(seeds)))} seed(s); "
            f"emulated clock, {r['num_gpus']} x {r['gpu']}; TTP interpolated at the crossing of "
            "the target, mean ± sd over the seeds.")


def _crossing_gap(evals: list[dict], target: float) -> float | None:
    """Emulated seconds between the two evaluations either side of the first crossing of
    ``target`` (``evals``: ``{"time_s", "val_ppl"}`` in order), ``None`` if none crosses:
    how finely an interpolated TTP is pinned down."""
    for a, b in zip(evals, evals[1:]):
        if a["val_ppl"] > target >= b["val_ppl"]:
            return b["time_s"] - a["time_s"]
    return None


def _resolution(m: dict) -> str:
    """One line: per method (first seed), the evaluation gap at the target's crossing as a
    share of its TTP."""
    parts = []
    for key, label in _methods(m):
        x = m["methods"].get(key) or {}
        by_seed = x.get("ttp_s_by_seed") or [x.get("ttp_s")]
        gap = _crossing_gap(x.get("evals") or [], m["target_ppl"])
        if gap is not None and by_seed[0]:
            parts.append(f"{label} {100 * gap / by_seed[0]:.1f} %")
    if not parts:
        return ""
    return ("Evaluations either side of the target's crossing lie apart by (first seed, share "
            "of its TTP; TTP is interpolated between them): " + ", ".join(parts) + ".")


def _cost(m: dict) -> str:
    """One line: what the family cost the bench, its set-up and each seed (wall seconds of
    one process, one torch thread)."""
    w = m.get("wall_s") or {}
    seeds = w.get("seeds") or []
    if not seeds:
        return ""
    line = (f"Bench cost: set-up {w.get('setup', 0):,.0f} s, seeds "
            f"{' / '.join(f'{x:,.0f}' for x in seeds)} s (wall, one process each)")
    phases = [r.get("phase_wall_s") for r in m.get("seed_runs") or []]
    if phases and all(phases):  # where each seed's time went, summed over the seeds
        total = {k: sum(p.get(k, 0.0) for p in phases) for k in phases[0]}
        line += "; of the seeds' time: " + ", ".join(
            f"{k.replace('_', ' ')} {100 * v / sum(total.values()):.0f} %"
            for k, v in total.items())
    return line + "."


def _oracle_finding(oracle: dict) -> str:
    """One line: per seed, how often the oracle's best strategy changes and its chain's
    TTP over the best static's, and whether the search was exact."""
    rows = oracle.get("by_seed") or []
    if not rows:
        return ""
    per = "; ".join(f"{x.get('switches', 0)} switch(es), "
                    f"{_fmt(x.get('chain_over_static_oracle'), '.3f')}" for x in rows)
    exact = "exact search" if all(x.get("exact") for x in rows) else \
        "pruned search (not exact: dominance + beam)"
    return (f"Oracle chain per seed (its switches, its TTP over the best static's): {per}; "
            f"{exact}.")


def _static_fixed(fixed: dict | None, cona_s: float | None) -> str:
    """One line: the best static chosen once for every seed
    (:func:`bench.cona_aggregate.static_fixed`), CONA against it, and the selection it
    sizes; empty for a JSON from before it was recorded."""
    if not fixed:
        return ""
    exact = fixed["ttp_s"] is not None
    t = fixed["ttp_lower_bound_s"]
    return (f"Best static chosen once (the same setting on every seed): "
            f"`{fixed['strategy']}` at {fixed['lr_factor']:g}x the rule's LR, "
            f"{'' if exact else '≥ '}{t:,.0f} s mean; CONA's speed-up over it "
            f"{_fmt(_ratio(t, cona_s))}{'' if exact else ' (at least: a run was cut)'}; "
            "each seed's own hindsight best (best static) takes on average "
            f"{'' if exact else 'at most '}{_fmt(fixed['selection'])} its time (below 1x: "
            "the lead that picking per seed after the fact wins on noise).")


def _time_scale_origin(ts: dict) -> str:
    """Where a family's step dilation came from: the committed calibration (and what this
    run measured beside it) or this run's own measurement (``bench/cona_time_scale.py``);
    empty for results made before the calibration existed."""
    cal, own = ts.get("calibration"), (ts.get("measured") or {}).get("step_dilation")
    if cal:
        return (f" (step dilation {ts['step_dilation']:.1f}, calibrated at "
                f"`{cal['from']['commit']}`; this run measured {_fmt(own, '.1f', '')})")
    if "calibration_miss" in ts:
        return f" (step dilation {ts['step_dilation']:.1f}, measured in this run)"
    return ""


WITHIN = {True: "yes", False: "**no**", None: "—"}  # None: a run missed, or no seed spread


def cona_repro(r: dict, file: str = "cona_repro") -> str:
    """bench/cona_repro.py: per family the dilation each run charged and measured, and per
    method both runs' TTP (mean ± sd over seeds), their ratio, the ratio at equal
    dilation, and whether the difference lies within the larger seed sd."""
    a, b = r["a"], r["b"]
    across = (" Two set-ups compared on purpose (`--across-setups`): their digests differ."
              if r.get("across_setups") else "")
    lines = [f"Run a: `{a['commit']}` on {a['machine']} (`{a['file']}`); run b: "
             f"`{b['commit']}` on {b['machine']} (`{b['file']}`).{across}", ""]
    for name, m in r["models"].items():
        k, km = m["step_dilation"], m["step_dilation_measured"]
        lines += [f"**{name}**: step dilation charged {_fmt(k['a'], '.1f', '')} / "
                  f"{_fmt(k['b'], '.1f', '')} (a / b), measured {_fmt(km['a'], '.1f', '')} / "
                  f"{_fmt(km['b'], '.1f', '')}.", "",
                  "| method | TTP a, emulated | TTP b, emulated | b / a | b / a at a's "
                  "dilation | difference / larger seed sd | within the seed spread |",
                  "|---|---:|---:|---:|---:|---:|---|"]
        labels = dict(_methods({"methods": m["methods"]}))
        for key, x in m["methods"].items():
            ta, tb = x["ttp_s"]["a"], x["ttp_s"]["b"]
            sa, sb = x["sd_s"]["a"], x["sd_s"]["b"]
            cell = [f"{t:,.0f} ± {sd or 0:,.0f} s" if t else "missed"
                    for t, sd in ((ta, sa), (tb, sb))]
            lines.append(f"| {labels.get(key, key)} | {cell[0]} | {cell[1]} | "
                         f"{_fmt(x['b_over_a'], '.3f')} | "
                         f"{_fmt(x['b_over_a_at_equal_dilation'], '.3f')} | "
                         f"{_fmt(x['diff_over_spread'], '.1f', '')} | "
                         f"{WITHIN[x['within_seed_spread']]} |")
        lines.append("")
    w = r["within_seed_spread"]
    lines += [f"Within the seed spread: {w['methods']} of {w['of']} methods.", "",
              _source(r, file)]
    return "\n".join(lines) + "\n"


def _file(r: dict, file: str | None) -> str:
    """The result file's name: ``file`` where given, else the bench's own default."""
    return file or ("cona_ttp_quick" if r.get("quick") else "cona_ttp")


def _interval_note(m: dict) -> str:
    """`` (95 % interval lo-hi, n probes)`` for a family's growth where the run measured it."""
    interval = m.get("noise_scale_growth_direct_interval")
    if not interval:
        return _along(m)
    n = ((m.get("reference") or {}).get("noise_scale_fit") or {}).get("points")
    probes = f", {n} probes" if n else ""
    sparse = m.get("noise_scale_growth_one_per_eval")
    before = (f"; through one probe per evaluation interval of the same run, as before, "
              f"{sparse['growth']:.2f}x, 95 % interval {sparse['interval'][0]:.2f}-"
              f"{sparse['interval'][1]:.2f}x, {sparse['points']} probes") if sparse else ""
    return f" (95 % interval {interval[0]:.2f}-{interval[1]:.2f}x{probes}{before}){_along(m)}"


def _along(m: dict) -> str:
    """``; along the segment's own probes ...`` where the run measured the growth along
    the segment (``noise_scale_growth_along``, :func:`bench.cona_reference.segment_growth`)."""
    a = m.get("noise_scale_growth_along")
    if not a:
        return ""
    spread = (f" (95 % interval {a['along_interval'][0]:.2f}-{a['along_interval'][1]:.2f}x, "
              f"moving blocks of {a['bootstrap_block']})" if a.get("along_interval") else "")
    return (f"; along the segment's own probes {a['along']:.2f}x{spread}, where Kaplan's "
            f"B_crit(L) gives {a['kaplan']:.2f}x over its losses")


def cona_ttp(r: dict, file: str | None = None) -> str:
    """bench/cona_ttp.py: per family its target (and the corpus's unigram perplexity),
    what one run stands for, and every method's TTP over the seeds with its switches
    (all / layout) and its first seed's chain."""
    lines = []
    for name, m in r["models"].items():
        tokens, share = m.get("target_tokens_per_run"), m.get("layout_switch_share_of_recipe_ttp")
        narrowed = ", ".join(o.removeprefix("model.") for o in m.get("proxy_overrides") or [])
        proxy = f"`{m['proxy']}` ({narrowed})" if narrowed else f"`{m['proxy']}`"
        head = (f"**{name}** timed, {proxy} trained: target val ppl {m['target_ppl']:.1f} "
                f"(unigram {m['unigram_ppl']:.1f}); noise scale grew "
                f"{m['noise_scale_growth_direct']:.2f}x over the reference's segment"
                f"{_interval_note(m)}")
        if tokens:
            head += f"; one run stands for {tokens / 1e9:.2f}B target tokens"
            head += _time_scale_origin(m.get("time_scale") or {})
        if share:
            head += f"; a layout switch costs {100 * share:.2f} % of the recipe's TTP"
        lines += [head + ".", "",
                  "| method | TTP, emulated | CONA's speed-up over it | switches (layout) | "
                  "chain (first seed) |", "|---|---:|---:|---:|---|"]
        cona = (m["methods"].get("cona") or {}).get("ttp_s")
        for key, label in _methods(m):
            x = m["methods"].get(key)
            if x is None:
                continue
            speed = _speedup(x, cona) if key != "cona" else "—"
            chain = " → ".join(f"`{c['strategy']}`" for c in x.get("chain") or [])
            lines.append(f"| {label} | {_seeds_ttp(x)} | {speed} | {x.get('switches', 0)} "
                         f"({x.get('layout_switches', 0)}) | {chain} |")
        lines += ["", *filter(None, [_static_fixed(m.get("static_fixed"), cona),
                                     _oracle_finding(m.get("oracle") or {}), _resolution(m),
                                     _cost(m)]), ""]
    lines += [_cona_settings(r), "", _source(r, _file(r, file))]
    return "\n".join(lines) + "\n"


def cona_ttp_headline(r: dict) -> str:
    """The README's short form: per family, the target, the static recipe, the hindsight
    best static, the oracle chain and CONA, and CONA's speed-up over the first two."""
    lines = ["| timed (trained) | target ppl (unigram) | static recipe | best static "
             "(hindsight) | oracle chain | CONA | CONA vs recipe | CONA vs best static |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, m in r["models"].items():
        meth = m["methods"]
        cona = (meth.get("cona") or {}).get("ttp_s")
        lines.append(f"| {name} (`{m['proxy']}`) | {m['target_ppl']:.0f} ({m['unigram_ppl']:.0f}) "
                     f"| {_seeds_ttp(meth.get('static_recipe'))} | "
                     f"{_seeds_ttp(meth.get('static_oracle'))} | "
                     f"{_seeds_ttp(meth.get('oracle_chain'))} | {_seeds_ttp(meth.get('cona'))} | "
                     f"{_speedup(meth.get('static_recipe'), cona)} | "
                     f"{_speedup(meth.get('static_oracle'), cona)} |")
    lines += ["", _cona_settings(r) + " Above 1x: CONA is faster.  Every method, switch and "
              "chain: [docs/cona.md](docs/cona.md#results).", *_stands_for(r),
              "", _source(r, _file(r, None))]
    return "\n".join(lines) + "\n"


def _stands_for(r: dict) -> list[str]:
    """One sentence: the span of the target's training one run stands for, per family:
    target tokens (the time scale, ``target_tokens_per_run``) and hours (the static
    recipe's mean TTP on the emulated clock)."""
    parts = []
    for name, m in r["models"].items():
        tokens = m.get("target_tokens_per_run")
        recipe = (m["methods"].get("static_recipe") or {}).get("ttp_s")
        if tokens and recipe:
            parts.append(f"{tokens / 1e9:.2f}B tokens of {name}'s training, "
                         f"{recipe / 3600:.1f} h of its recipe")
    if not parts:
        return []
    return ["", f"One run stands for {'; '.join(parts)} (emulated hours, on "
                f"{r['num_gpus']} x {r['gpu']})."]


def cona_setup(r: dict, file: str = "cona_setup") -> str:
    """bench/cona_ttp.py --setup-only: per family what its set-up measured (target and
    unigram perplexity, the reference's segment, the direct noise-scale growth, the span of
    the target's training one run stands for) and what it cost, no method run."""
    lines = []
    for name, m in r["models"].items():
        ref, ts = m["reference"], m.get("time_scale") or {}
        narrowed = ", ".join(o.removeprefix("model.") for o in m.get("proxy_overrides") or [])
        warm_ppl = math.exp(ref["noise_scale_probes"][0]["val_loss"])
        tokens = m.get("target_tokens_per_run")
        stands = (f"; one run would stand for {tokens / 1e9:.2f}B target tokens"
                  f"{_time_scale_origin(ts)}" if tokens else "")
        proxy = f"`{m['proxy']}` ({narrowed})" if narrowed else f"`{m['proxy']}`"
        lines += [f"**{name}**, set-up only, {proxy}: target val ppl "
                  f"{m['target_ppl']:.1f} (unigram {m['unigram_ppl']:.1f}, warm state "
                  f"{warm_ppl:.1f}); the reference "
                  f"{'reached it' if ref['reached'] else '**did not reach it**'} after "
                  f"{ref['segment_samples']:,} proxy samples from the warm state; the noise "
                  f"scale grew {m['noise_scale_growth_direct']:.2f}x over that segment"
                  f"{_interval_note(m)}"
                  f"{stands}; the set-up took {m['wall_s']['setup']:,.0f} s (wall, one "
                  f"process).", ""]
    lines.append(_source(r, file))
    return "\n".join(lines) + "\n"


def _by_seed(ttps: list[float | None]) -> str:
    """Each seed's TTP in seconds, ``a / b / c`` (``missed`` where a seed missed)."""
    return " / ".join("missed" if t is None else f"{t:,.0f}" for t in ttps)


def cona_rerun(r: dict, file: str = "cona_rerun") -> str:
    """bench/cona_rerun.py: per family CONA's TTP by seed, re-run, beside the earlier
    run's, whether every seed's TTP and chain are the same, and CONA's ratios against
    the earlier run's other methods (labelled: they mix two commits); the ``cona.*``
    settings the re-run gave CONA (``--cona``), if any."""
    then = r["rerun"]["others_from"]
    settings = r["rerun"].get("cona_settings") or {}
    what = "CONA re-run" + (" with " + ", ".join(f"`cona.{k}={v}`" for k, v in settings.items())
                            if settings else "")
    lines = []
    for name, m in r["models"].items():
        cona, old = m["methods"]["cona"], m["cona_earlier"]
        same = ("the same on every seed (TTP and chain)" if old["equal"] else
                "**not the same** (a changed controller, or a set-up that differs)")
        ratios = m.get("ratios") or {}
        lines += [f"**{name}**: {what}, TTP by seed {_by_seed(cona['ttp_s_by_seed'])} s "
                  f"(emulated); `{then['commit']}`'s run {_by_seed(old['ttp_s_by_seed'])} s: "
                  f"{same}.  Against that run's other methods (two commits): best static "
                  f"{_fmt(ratios.get('static_oracle_over_cona'))}, recipe "
                  f"{_fmt(ratios.get('static_recipe_over_cona'))}, oracle chain "
                  f"{_fmt(ratios.get('oracle_chain_over_cona'))} (above 1x: CONA is "
                  f"faster).", ""]
    lines += [f"The re-run took {r['wall_s']:,.0f} s (wall) for {len(r['models'])} "
              f"famil{'y' if len(r['models']) == 1 else 'ies'}; the other methods: "
              f"`{then['file']}`.", "", _source(r, file)]
    return "\n".join(lines) + "\n"


# issue 23's bars (the CONA paper's claims, on the emulated clock)
RECIPE_BAR, RECIPE_FAMILIES = 1.4, 2  # CONA >= 1.4x static_recipe on >= 2 families
ORACLE_BAR = 0.97  # CONA >= 0.97x static_oracle, every family and seed
CHAIN_BAR = 0.95  # CONA within 5 % of the oracle chain, every family
GROWTH_BAR = 4.0  # the noise scale grows >= 4x over the segment, every family
WALL_BAR_S = 90 * 60  # the full bench on 2 cores
OTHER_CPU_SHARE = 0.02  # other processes' CPU over all cores' time: a run below is alone


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def _fmt(x: float | None, spec: str = ".2f", unit: str = "x") -> str:
    return "—" if x is None else f"{x:{spec}}{unit}"


def _mark(ok: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "not measured"}[ok]


def _bench_wall(r: dict) -> tuple[float | None, str]:
    """The full bench's wall seconds and a note on how they were read.

    A run in one piece reports its own ``wall_s``.  A resumed run (``--reuse``) was not
    timed in one piece: its work units' wall times (each family's set-up and seeds, one
    process each, measured while ``--jobs`` of them shared the cores) are summed and
    divided by ``--jobs`` from its command, an estimate labelled as one."""
    if r.get("wall_s") is not None:
        return r["wall_s"], ""
    units = [w for m in r["models"].values() if isinstance(m.get("wall_s"), dict)
             for w in [m["wall_s"].get("setup"), *m["wall_s"].get("seeds", [])]]
    if not units or None in units:
        return None, ""
    found = re.search(r"--jobs[ =](\d+)", r.get("command", ""))
    jobs = int(found.group(1)) if found else 2  # the bench's default
    return sum(units) / jobs, (f", estimated: a resumed run, its work units' wall times "
                               f"summed over {jobs} jobs")


def _load_note(r: dict) -> str:
    """Whether the bench ran alone, from what it measured of the machine while it ran
    (``load_average_1min``, :mod:`bench.machine_load`): the CPU seconds other processes
    used, "alone" where they are under :data:`OTHER_CPU_SHARE` of all cores' time over
    the run; the 1-minute load average beside it (it counts the bench's own threads, so
    it alone decides nothing).  Empty for a report from before the samples."""
    load = r.get("load_average_1min")
    if not isinstance(load, dict) or load.get("max") is None:
        return ""
    note = (f"; 1-minute load average through the run at most {load['max']:.1f}, "
            f"mean {load['mean']:.1f}, with {load.get('jobs', 2)} jobs")
    share = load.get("other_cpu_share")
    if share is None:
        return note
    alone = "alone" if share < OTHER_CPU_SHARE else "not alone"
    return (f"; other processes used {load['other_cpu_s']:,.0f} CPU-s, {100 * share:.1f} % "
            f"of the cores' time: {alone}{note}")


def cona_ttp_bars(r: dict, families: tuple[str, ...] = ("gpt3_1.3b", "llama3.2_1b",
                                                         "bert_large")) -> str:
    """Issue 23's bars against a full run: per family the measured value of each bar,
    then whether each bar holds over the families (a family not in the run counts as
    not measured, so a bar over every family is not met without it)."""
    models = r["models"]
    rows = ["| family | CONA vs recipe | oracle chain vs recipe | CONA vs best static, worst seed "
            "| CONA vs oracle chain | CONA's layout switches | noise-scale growth "
            "| target / unigram ppl |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    recipe, oracle, chain, layout, growth = {}, {}, {}, {}, {}
    for f in families:
        m = models.get(f)
        if m is None:
            rows.append(f"| {f} | not run | | | | | | |")
            continue
        meth = m["methods"]
        cona = meth["cona"]
        rec = meth.get("static_recipe") or {}
        recipe_s = rec.get("ttp_s") or _mean_lower_bound(rec)
        recipe[f] = _ratio(recipe_s, cona["ttp_s"])
        above = "> " if rec.get("ttp_s") is None and recipe[f] else ""
        so = (meth.get("static_oracle") or {}).get("ttp_s_by_seed") or []
        per_seed = [_ratio(a, b) for a, b in zip(so, cona.get("ttp_s_by_seed") or [])]
        oracle[f] = None if not per_seed or None in per_seed else min(per_seed)
        chain_s = (meth.get("oracle_chain") or {}).get("ttp_s")
        chain[f] = _ratio(chain_s, cona["ttp_s"])
        ceiling = _ratio(recipe_s, chain_s)
        layout[f] = sum(cona.get("layout_switches_by_seed") or [cona.get("layout_switches", 0)])
        growth[f] = m.get("noise_scale_growth_direct")
        interval = m.get("noise_scale_growth_direct_interval")
        spread = f" ({interval[0]:.2g}-{interval[1]:.2g})" if interval else ""
        along = m.get("noise_scale_growth_along")
        spread += f"; along {along['along']:.2f}x" if along else ""
        rows.append(f"| {f} | {above}{_fmt(recipe[f])} | {above if ceiling else ''}"
                    f"{_fmt(ceiling)} | "
                    f"{_fmt(oracle[f])} | {_fmt(chain[f])} | "
                    f"{layout[f]} | {_fmt(growth[f])}{spread} | "
                    f"{m['target_ppl']:.0f} / {m['unigram_ppl']:.0f} |")
    run = [f for f in families if f in models]

    def every(values: dict, ok) -> bool | None:
        if any(values.get(f) is None for f in run):
            return False
        return all(ok(values[f]) for f in run) if len(run) == len(families) else False

    wall, wall_note = _bench_wall(r)
    bars = [
        (f"CONA >= {RECIPE_BAR}x static recipe on >= {RECIPE_FAMILIES} families",
         sum((recipe.get(f) or 0) >= RECIPE_BAR for f in run) >= RECIPE_FAMILIES),
        (f"CONA >= {ORACLE_BAR}x best static on every family and seed",
         every(oracle, lambda x: x >= ORACLE_BAR)),
        (f"CONA within {100 * (1 - CHAIN_BAR):.0f} % of the oracle chain on every family",
         every(chain, lambda x: x >= CHAIN_BAR)),
        ("CONA makes a layout switch on >= 1 family", any(layout.get(f) for f in run)),
        (f"noise scale grows >= {GROWTH_BAR:g}x on every family",
         every(growth, lambda x: x >= GROWTH_BAR)),
        (f"the full bench takes <= {WALL_BAR_S // 60} min on 2 cores ({len(run)} of "
         f"{len(families)} families took {_fmt(wall and wall / 60, '.0f', ' min')}{wall_note}"
         f"{_load_note(r)})",
         None if wall is None else (wall <= WALL_BAR_S and len(run) == len(families))),
    ]
    rows += ["", "| bar | |", "|---|---|"] + [f"| {b} | {_mark(ok)} |" for b, ok in bars]
    rows += ["", "Ratios: the other method's mean TTP over CONA's (above 1x: CONA is faster); "
             "best static per seed, its worst seed shown; `>`: the recipe missed the target "
             "on a seed within 4x the budget, its clock there is a lower bound.  Oracle chain "
             "vs recipe: the recipe's mean TTP over the best chain the search found, what a "
             "controller on this grid can expect against the recipe (an estimate, not a "
             "bound: the search is pruned and runs at the scaling rule's learning rate).  "
             "Noise-scale growth: the reference's trend at the target over the warm state's "
             "probe, in brackets its 95 % bootstrap interval where the run measured it "
             "(the bar reads the growth itself); `along`: the growth of the trend itself "
             "from the warm state's loss to the target's, where the run measured it.", "",
             _source(r, _file(r, None))]
    return "\n".join(rows) + "\n"
