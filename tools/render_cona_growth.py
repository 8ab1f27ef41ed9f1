"""Renderer of ``bench/cona_growth.py`` for ``tools/render_results.py``: where a CONA
bench run's noise-scale growth happens (along the reference's segment or at its start)."""

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
