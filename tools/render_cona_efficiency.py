"""Renderers of the CONA efficiency benches for ``tools/render_results.py``:
``bench/cona_efficiency.py`` (measured efficiency against each noise-scale definition's
prediction) and ``bench/cona_adam_memory.py`` (the efficiency with Adam's memory held in
samples)."""

from __future__ import annotations

import math
import statistics

from render_cona import GNS_DEFINITIONS, _fmt
from results_source import source_line as _source

CURVATURE = ("curvature", "curvature_sgd")  # bench/cona_efficiency.py --curvature


def cona_efficiency(r: dict, file: str = "cona_efficiency") -> str:
    """bench/cona_efficiency.py: per family, each grid batch's measured efficiency (proxy
    samples to the target at the reference batch over at this batch, the scaling rule's
    LR) against what Pollux's ``E(M)`` predicts with each noise-scale definition measured
    directly along the reference, then each definition's error in ratios between batches
    and the one that ranks best over the families; where the run swept LR factors
    (``--lr-factors``), each batch's best factor, its samples and efficiency, and the
    errors there; and the Adam-consistent efficiency (``adam``, a measurement, not one of
    the controller's definitions) and the noise scales with the curvature measured
    (``--curvature``, with the check of the second difference's step) where the run holds
    them.  ``file``: the result's name in docs/results (its source line)."""
    def held(key: str) -> bool:
        return any((x["predicted"].get(key) or {}) for m in r["models"].values()
                   for x in m["batches"].values())

    adam = held("adam")
    curv = tuple(d for d in CURVATURE if held(d))
    defs = GNS_DEFINITIONS + ("adam",) * adam + curv  # adam: cona/adam_efficiency.py, a curve
    lines = []
    for name, m in r["models"].items():
        med = {d: sorted(t[d] for t in m["trajectory"] if t.get(d))
               for d in GNS_DEFINITIONS + curv}
        medians = ", ".join(f"`{d}` {v[len(v) // 2]:,.0f}" for d, v in med.items() if v)
        swept = m.get("prediction_error_best_lr") is not None
        extra = (" | best LR factor | samples there | efficiency at the best LR" if swept else "")
        lines += [f"**{name}** (`{m['proxy']}`, reference batch {m['reference_batch']} target "
                  f"sequences, target val ppl {m['target_ppl']:.1f}); median noise scale along "
                  f"the reference, proxy sequences: {medians}.", "",
                  "| global batch | proxy samples to target | measured efficiency | "
                  + " | ".join(f"`{d}` predicts" for d in defs) + extra + " |",
                  "|---:|---:|---:|" + "---:|" * len(defs) + "---:|---:|---:|" * swept]
        for b, x in sorted(m["batches"].items(), key=lambda kv: int(kv[0])):
            meas = x["measured"]
            pred = " | ".join(_fmt((x["predicted"].get(d) or {}).get("efficiency"), ".2f", "")
                              for d in defs)
            row = f"| {b} | {meas['samples']:,} | {_efficiency(meas)} | {pred} |"
            if swept:
                best = x["measured_best_lr"]
                row += f" {best['lr_factor']:g}x | {best['samples']:,} | {_efficiency(best)} |"
            lines.append(row)
        if curv:
            lines += ["", _curvature_spread(m["trajectory"], curv)]
        if check := m.get("curvature_delta_check"):
            lines += ["", "At the warm state, the curvature noise scales at the second "
                      "difference's step and at a tenth of it: " + "; ".join(
                          f"`{d}` " + " and ".join(_fmt(v.get(d), ",.1f", "")
                                                   for v in check.values())
                          for d in curv) + "."]
        err = m.get("prediction_error") or {}
        lines += ["", "Error in ratios between batches (mean |ln(predicted / measured)| over "
                  "pairs of batches): " + ", ".join(f"`{d}` {_fmt(err.get(d), '.2f', '')}"
                                                    for d in defs) + ".", ""]
        if swept:
            err = m["prediction_error_best_lr"]
            lines += [f"The same error with every batch (the reference too) at its best LR of "
                      f"{', '.join(f'{f:g}x' for f in m['lr_factors'])} the scaling rule's: "
                      + ", ".join(f"`{d}` {_fmt(err.get(d), '.2f', '')}" for d in defs) + ".",
                      ""]
    lowest = "lowest" if not adam else "lowest of the controller's noise scales"
    mean = _mean_errors(r, defs=defs)
    if mean:
        lines += ["Mean over the families: " + ", ".join(
            f"`{d}` {v:.2f}" for d, v in mean.items()) + f"; {lowest}: "
            f"`{best_gns_definition(r)}`.", ""]
    if mean := _mean_errors(r, "prediction_error_best_lr", defs):
        best = min((d for d in GNS_DEFINITIONS if d in mean), key=mean.get)
        lines += ["At the best LR, mean over the families: " + ", ".join(
            f"`{d}` {v:.2f}" for d, v in mean.items()) + f"; {lowest}: `{best}`.", ""]
    lines.append(_source(r, file))
    return "\n".join(lines) + "\n"


def _curvature_spread(trajectory: list[dict], curv: tuple[str, ...]) -> str:
    """Along the reference: the median of ``curvature / simple`` at the same point, and
    each noise scale's scatter (1.4826 x the median absolute deviation of ``log phi``, a
    robust standard deviation)."""
    def robust_sd(values: list[float]) -> float | None:
        if len(values) < 2:
            return None
        logs = sorted(math.log(v) for v in values)
        med = statistics.median(logs)
        return 1.4826 * statistics.median(abs(x - med) for x in logs)

    ratios = [t[curv[0]] / t["simple"] for t in trajectory if t.get(curv[0]) and t.get("simple")]
    spread = ", ".join(f"`{d}` {_fmt(robust_sd([t[d] for t in trajectory if t.get(d)]), '.2f', '')}"
                       for d in ("simple", *curv))
    return (f"Along the reference, `{curv[0]}` over `simple` at the same point: median "
            f"{_fmt(statistics.median(ratios) if ratios else None)} ({len(ratios)} points); "
            f"robust standard deviation of `log phi`: {spread}.")


def _efficiency(measured: dict) -> str:
    """A measured efficiency, or its upper bound where the run missed the target."""
    if "efficiency" in measured:
        return f"{measured['efficiency']:.2f}"
    return f"≤ {measured['efficiency_at_most']:.2f} (missed)"


def _mean_errors(r: dict, key: str = "prediction_error",
                 defs: tuple[str, ...] = GNS_DEFINITIONS) -> dict[str, float]:
    """Per definition of ``defs`` measured on every family, its mean error (``key``: at
    the scaling rule's LR, or ``prediction_error_best_lr``) over them."""
    errs = {d: [(m.get(key) or {}).get(d) for m in r["models"].values()] for d in defs}
    return {d: sum(v) / len(v) for d, v in errs.items() if v and None not in v}


def best_gns_definition(r: dict) -> str | None:
    """The noise-scale definition with the lowest mean error over the families of a
    ``bench/cona_efficiency.py`` result (``None`` where none was measured on every one)."""
    mean = _mean_errors(r)
    return min(mean, key=mean.get) if mean else None


ADAM_VARIANTS = {  # bench/cona_adam_memory.py's variants, as the table names them
    "preset": "the preset's",
    "beta1": "`beta1` by the rule",
    "beta2": "`beta2` by the rule",
    "sde": "the whole rule (`sde`)",
}


def cona_adam_memory(r: dict) -> str:
    """bench/cona_adam_memory.py: per family, each batch's proxy samples to the target at
    the preset's Adam hyperparameters and, for the smaller batches, with Adam's memory in
    samples set to the anchor batch's by the square-root scaling rule (one moment or
    all), and the anchor batch's efficiency over each (their samples over its: above 1
    the larger batch is the more sample-efficient); with several seeds the means, each
    seed's samples and the range of the per-seed efficiencies.  A variant not run is
    left out; one that missed the target shows a dash."""
    lines = []
    for name, m in r["models"].items():
        anchor, p = m["anchor_batch"], m["preset"]
        n = m.get("seeds", 1)
        per_seed = f", mean of {n} seeds (each)" if n > 1 else ""
        per_seed_range = " (ratio of the means; seeds' range)" if n > 1 else ""
        lines += [f"**{name}** (`{m['proxy']}`, target val ppl {m['target_ppl']:.1f}; the "
                  f"preset's Adam: beta1 {p['adam_beta1']:g}, beta2 {p['adam_beta2']:g}, eps "
                  f"{p['adam_eps']:g}; the rule anchored at batch {anchor}; batches in target "
                  "sequences, samples in proxy sequences).", "",
                  "| global batch | Adam's hyperparameters | beta1, beta2, eps | proxy samples "
                  f"to target{per_seed} | batch {anchor}'s efficiency over it{per_seed_range} |",
                  "|---:|---|---|---:|---:|"]
        for b in sorted({int(b) for v in m["runs"].values() for b in v}):
            for variant, label in ADAM_VARIANTS.items():
                run = m["runs"].get(variant, {}).get(str(b))
                if run is None:
                    continue
                eff = "(the anchor)" if b == anchor else _fmt(
                    (m["efficiency"].get(variant) or {}).get(str(b)), ".2f", "")
                seeds = run.get("samples_by_seed") or []
                samples = f"{run['samples']:,.0f}" + (
                    f" ({' / '.join(f'{x:,}' for x in seeds)})" if len(seeds) > 1 else "") + (
                    "" if run["reached"] else " (missed)")
                by_seed = (m.get("efficiency_by_seed", {}).get(variant) or {}).get(str(b)) or []
                if len(by_seed) > 1:
                    eff += f" ({min(by_seed):.2f}-{max(by_seed):.2f})"
                lines.append(f"| {b} | {label} | {run['adam_beta1']:.4g}, {run['adam_beta2']:.4g}"
                             f", {run['adam_eps']:.2g} | {samples} | {eff} |")
        lines.append("")
        for b in sorted({int(b) for v in m["efficiency"].values() for b in v}):
            effs = [(label, (m["efficiency"].get(v) or {}).get(str(b)))
                    for v, label in ADAM_VARIANTS.items() if str(b) in m["runs"].get(v, {})]
            lines.append(f"- Batch {anchor}'s efficiency over batch {b}, by Adam at {b}: "
                         + ", ".join(f"{_fmt(e, '.2f', '')} ({label})" for label, e in effs)
                         + ".")
        lines.append("")
    lines.append(_source(r, "cona_adam_memory"))
    return "\n".join(lines) + "\n"
