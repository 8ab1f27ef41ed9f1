"""Renderers of the CONA bench's noise-scale probe studies for ``tools/render_results.py``:
``bench/cona_growth.py`` (where a run's noise-scale growth happens: along the reference's
segment or at its start), ``bench/cona_probe_precision.py`` (how many micro-batches a
probe needs), ``bench/cona_consecutive.py`` (the noise scale from consecutive steps
against the within-step one), ``bench/cona_split_cost.py`` (what a split step costs) and
``bench/cona_calibrate.py`` (the noise-scale growth against the target's depth)."""

from __future__ import annotations

from results_source import source_line as _source


def _interval(v: list[float] | None) -> str:
    return f"{v[0]:.2f}-{v[1]:.2f}x" if v else "too few probes"


def cona_growth(r: dict, file: str = "cona_growth") -> str:
    """bench/cona_growth.py: per family the direct growth (the bar's) with its pairs and
    moving-block intervals, the growth along the segment's own probes with its interval,
    the trend's exponent against Kaplan's and Kaplan's growth over the same losses, and
    the warm probe beside the segment's first probes (the step, where there is one)."""
    src = r["from"]
    rows = ["| family | probes (segment, proxy samples) | warm probe → first probes "
            "(proxy sequences) | growth, warm probe to the trend at the target (the bar's) "
            "| 95 % interval: pairs / moving blocks | growth along the segment's trend "
            "| its 95 % interval | trend's exponent in the loss (Kaplan's) "
            "| Kaplan's growth over the same losses |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, f in r["families"].items():
        first = ", ".join("—" if p is None else f"{p:.0f}" for p in f["first_probes"])
        rows.append(
            f"| {name} | {f['probes']} ({f['segment_samples']:,}) | {f['warm_probe']:.1f} → "
            f"{first} | {f['direct']:.2f}x | {_interval(f['direct_interval_pairs'])} / "
            f"{_interval(f['direct_interval'])} (blocks of {f['bootstrap_block']}) | "
            f"{f['along']:.2f}x | {_interval(f['along_interval'])} | {f['slope']:+.2f} "
            f"({f['kaplan_slope']:+.2f}) | {f['kaplan']:.2f}x |")
    rows += ["", f"From `{src['file']}` (measured {src['date'][:10]} at `{src['commit']}` on "
             f"{src['machine']}), its stored probes read again; no training.", "",
             _source(r, file)]
    return "\n".join(rows) + "\n"


def cona_probe_precision(r: dict, file: str = "cona_probe_precision") -> str:
    """bench/cona_probe_precision.py: per family and probe size, the repeated probes at
    the warm state, the standard deviation of their ``log phi`` and its share of a
    probe's variance beside the scatter between states along the committed run."""
    rows = ["| family | micro-batches per probe (sequences) | noise scale, each probe "
            "(proxy sequences) | sd of log, within the state | sd of log, between states "
            "along the run | within-state share of a probe's variance |",
            "|---|---:|---|---:|---:|---:|"]
    for name, f in r["families"].items():
        between = f["between_states_log_sd"]
        for m, x in f["sizes"].items():
            phis = ", ".join("—" if v is None else f"{v:.1f}" for v in x["noise_scale_proxy"])
            share = x["share_of_variance"]
            sd = x["log_sd"]
            rows.append(f"| {name} | {m} ({int(m) * f['microbatch_sequences']:,}) | {phis} | "
                        f"{'—' if sd is None else f'{sd:.3f}'} | "
                        f"{'—' if between is None else f'{between:.3f}'} | "
                        f"{'—' if share is None else f'{100 * share:.1f} %'} |")
    src, pw = r["from"], r.get("paired_with")
    pairs = [(name, f["paired"]) for name, f in r["families"].items() if f.get("paired")]
    if pw and pairs:
        rows += ["", f"Along the segment, the same states probed by two runs (`{src['file']}` "
                 f"at `{src['commit']}` and `{pw['file']}` at `{pw['commit']}`):", "",
                 "| family | states | micro-batches per probe (this run, the other) | sd of "
                 "the difference of log phi (robust) | scatter about each run's trend, sd of "
                 "log |", "|---|---:|---|---:|---:|"]
        for name, x in pairs:
            a, b = x["microbatches"]
            ta, tb = x["trend_log_sd"]
            rows.append(f"| {name} | {x['probes']} | {a}, {b} | {x['log_diff_sd']:.3f} "
                        f"({x['log_diff_robust_sd']:.3f}) | {ta:.2f}, {tb:.2f} |")
    rows += ["", f"{r['repeats']} probes of each size at each family's warm state, every "
             "probe on micro-batches of its own; the scatter between states from "
             f"`{src['file']}` (measured {src['date'][:10]} at `{src['commit']}`: 1.4826 x "
             "the median absolute deviation of its reference probes' log noise scale about "
             "their trend)."
             + (" The difference of two probes at one state sharing their first micro-batches "
                "has an sd at most the smaller probe's own." if pairs else ""),
             "", _source(r, file)]
    return "\n".join(rows) + "\n"


def cona_consecutive(r: dict, file: str = "cona_consecutive", rows: int = 5) -> str:
    """bench/cona_consecutive.py: along one run, the noise scale from within each step
    and from consecutive steps, at ``rows`` evenly spaced recorded points (every point is
    in the JSON), and the median ratio over the run and by phase of the schedule."""
    pts = r["points"]
    n = len(pts)
    shown = [pts[round((i + 1) * n / rows) - 1] for i in range(rows)] if n >= rows else pts

    def ratio(x: float | None) -> str:
        return "—" if x is None else f"{x:.2f}x"

    avg = f" ({r['gns_average'].replace('_', '-')} average)" if r.get("gns_average") else ""
    out = [f"`{r['config']}`, global batch {r['global_batch_size']} in micro-batches of "
           f"{r['micro_batch_size']}, {r['steps']} steps in one process; both estimates "
           f"averaged as the controller averages them{avg}:", "",
           "| step | learning rate | training loss | noise scale within the step (sequences) "
           "| from consecutive steps | ratio |", "|---:|---:|---:|---:|---:|---:|"]
    for x in shown:
        w, c = x["within_step"], x["consecutive"]
        out.append(f"| {x['step']} | {x['lr']:.2e} | {x['loss']:.2f} | "
                   f"{'—' if w is None else f'{w:.1f}'} | {'—' if c is None else f'{c:.1f}'} | "
                   f"{ratio(c / w if c and w else None)} |")
    phase = r["median_ratio_by_phase"]
    out += ["", f"Median ratio over the {len(pts)} recorded points: "
            f"{ratio(r['median_ratio'])} (warmup {ratio(phase['warmup'])}, after it "
            f"{ratio(phase['after'])}).", "", _source(r, file)]
    return "\n".join(out) + "\n"


def cona_split_cost(r: dict, file: str = "cona_split_cost") -> str:
    """bench/cona_split_cost.py: per DP = 1 layout the median plain and split step, their
    ratio and the mean step's overhead when every 4th step is split (the default)."""
    out = [f"`{r['preset']}` at global batch {r['global_batch_size']}, {r['steps']} steps per "
           f"layout (the first {r['warmup']} not counted), split and plain steps alternating; "
           "wall clock on CPU processes (gloo), max over ranks:", "",
           "| layout | processes | how a step splits | plain step (median) "
           "| split step (median) | split over plain | mean step, every 4th split |",
           "|---|---:|---|---:|---:|---:|---:|"]
    for name, x in r["layouts"].items():
        m = r["global_batch_size"] // x["micro_batch_size"]  # micro-batches per step (DP = 1)
        how = (f"{x['micro_batch_size']} sequences into 2 parts" if x["mode"] == "split" else
               f"{m} micro-batches of {x['micro_batch_size']} into 2 schedule calls" if m > 1
               else f"1 micro-batch of {x['micro_batch_size']} as 2 parts, one schedule "
               "call each")
        out.append(f"| `{name}` | {x['processes']} | {how} | {x['plain_step_s']:.3f} s "
                   f"| {x['split_step_s']:.3f} s | {x['split_over_plain']:.2f}x "
                   f"| +{100 * x['overhead_at_every_4']:.1f} % |")
    load = r.get("load_average_1min") or {}
    if load.get("other_cpu_share") is not None:
        out += ["", f"Other processes used {100 * load['other_cpu_share']:.0f} % of the "
                "machine's CPU time while it ran."]
    return "\n".join([*out, "", _source(r, file)]) + "\n"


def cona_calibrate(r: dict, file: str) -> str:
    """bench/cona_calibrate.py: per target fraction of ``min(unigram, warm ppl)`` the
    target perplexity, the reference's proxy samples from the warm state to it (and
    over the shallowest fraction's: what a bench at that target would train, roughly),
    the direct noise-scale growth as the bench reads it, and the probes behind it."""
    precision = r.get("precision", "fp32")  # files before the field: fp32, before rule 0
    rows = [f"**{r['family']}** (`{r['proxy']}`, {precision}, probes "
            + (f"{r['probe_density']} per evaluation interval" if r.get("probe_density")
               else "one per evaluation") + f"): unigram ppl {r['unigram_ppl']:.1f}, warm "
            f"state {r['warm_ppl']:.1f}.", "",
            "| target fraction | target val ppl | reference's proxy samples to it "
            "| samples over the shallowest fraction's | noise-scale growth (the bar's) "
            "| probes |",
            "|---:|---:|---:|---:|---:|---:|"]
    base = next((x["samples"] for x in r["rows"] if x["reached"]), None)
    for x in r["rows"]:
        if not x["reached"]:
            rows.append(f"| {x['fraction']:g} | {x['target_ppl']:.1f} | not reached | | | |")
            continue
        rows.append(f"| {x['fraction']:g} | {x['target_ppl']:.1f} | {x['samples']:,} | "
                    f"{x['samples'] / base:.2f}x | {x['growth']:.2f}x | {x['probes']} |")
    return "\n".join(rows + ["", _source(r, file)]) + "\n"
