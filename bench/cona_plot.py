"""Plot of one CONA benchmark family: perplexity against emulated time for CONA, the oracle
chain and the best static strategy (first seed), switch points marked (batch switches
as circles, layout switches as triangles), the gradient noise scale beneath (CONA's
online estimate against time; the reference's direct probes and their trend against
perplexity) (``bench/cona_ttp.py --out``)."""

from __future__ import annotations

from pathlib import Path

# the three curves the README compares; the other statics are in the JSON
SHOWN = {"static_oracle": ("tab:blue", "--", "best static"),
         "oracle_chain": ("tab:green", "-.", "oracle chain"),
         "cona": ("tab:red", "-", "CONA"),
         "static_recipe": ("tab:gray", ":", "static recipe")}


def switch_points(method: dict) -> list[tuple[float, str]]:
    """``(time_s, kind)`` of each switch of a method record: ``kind`` is ``"layout"`` (DP,
    TP or PP changed) or ``"batch"``, from its chain (``chain[i]["strategy"]`` labels)
    and ``switch_times_s`` (one per switch, in order)."""
    from cona.strategy import Strategy, switch_kind

    chain = [Strategy.from_label(c["strategy"]) for c in method.get("chain") or []]
    times = method.get("switch_times_s") or []
    return [(t, switch_kind(a, b)) for t, a, b in zip(times, chain, chain[1:])]


def plot_family(name: str, result: dict, path: Path) -> Path:
    """Write ``path`` (PNG): top, validation perplexity vs emulated seconds for the methods
    of :data:`SHOWN` (first seed), switches marked on the curve, the target as a line;
    bottom, the noise scale (target sequences) at each evaluation on the same axis."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    probes = (result.get("reference") or {}).get("noise_scale_probes")
    fig = plt.figure(figsize=(8, 10 if probes else 7))
    grid = fig.add_gridspec(3 if probes else 2, 1, height_ratios=[2, 1, 1.2][:3 if probes else 2])
    top = fig.add_subplot(grid[0])
    bottom = fig.add_subplot(grid[1], sharex=top)
    for method, (color, ls, label) in SHOWN.items():
        m = result["methods"].get(method)
        if not m or not m.get("evals"):
            continue
        ev = m["evals"]
        t = [e["time_s"] for e in ev]
        ppl = [e["val_ppl"] for e in ev]
        ttp = m.get("ttp_s")
        top.plot(t, ppl, color=color, ls=ls,
                 label=f"{label}: {ttp:.0f} s" if ttp else f"{label}: missed")
        g = [(e["time_s"], e["gns"]) for e in ev if e.get("gns")]
        if g:
            bottom.plot(*zip(*g), color=color, ls=ls)
        for ts, kind in switch_points(m):
            # log-perplexity at the switch, interpolated between the evaluations either side
            y = math.exp(_interp(ts, t, [math.log(p) for p in ppl]))
            top.plot([ts], [y], marker="^" if kind == "layout" else "o", color=color,
                     ms=7 if kind == "layout" else 5, ls="none")
            bottom.axvline(ts, color=color, ls=ls, lw=0.6, alpha=0.6)
    top.axhline(result["target_ppl"], color="black", lw=0.8, label="target")
    top.set_yscale("log")
    top.set_ylabel("validation perplexity")
    tokens = result.get("target_tokens_per_run")
    span = f", a run stands for {tokens / 1e9:.2f}B target tokens" if tokens else ""
    top.set_title(f"{name} timing, {result['proxy']} trained (emulated clock{span})\n"
                  "markers: switches (triangle: layout, circle: batch)", fontsize=9)
    top.legend(fontsize=8)
    bottom.set_yscale("log")
    bottom.set_ylabel("noise scale (target seq.),\nonline estimate")
    bottom.set_xlabel("emulated seconds")
    if probes:
        plot_probes(fig.add_subplot(grid[2]), result)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_probes(ax, result: dict) -> None:
    """The reference's direct noise-scale probes (target sequences: x the batch ratio)
    against its validation perplexity, the warm state's marked, and the trend the time
    scale reads at the target (``bench/cona_ttp.py``'s ``segment_trend``)."""
    import math
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.cona_reference import probe_noise_scale

    ref, r = result["reference"], result["mapping"]["ratio"]
    # (val ppl, target sequences) per probe, None where it read no positive signal or noise
    pts = [(math.exp(p["val_loss"]), r * phi) if (phi := probe_noise_scale(p)) else None
           for p in ref["noise_scale_probes"]]
    ax.plot(*zip(*(x for x in pts[1:] if x)), "o", color="tab:purple", ms=3,
            label="reference, direct probes")
    warm_ppl = math.exp(ref["noise_scale_probes"][0]["val_loss"])
    if pts[0]:  # the first probe is the warm state's (bench.cona_reference)
        ax.plot(*pts[0], "s", color="black", ms=5, label="warm state")
    fit = ref.get("noise_scale_fit") or {}
    if "slope" in fit:
        xs = [warm_ppl, result["target_ppl"]]
        ax.plot(xs, [r * math.exp(fit["intercept"] + fit["slope"] * math.log(math.log(x)))
                     for x in xs], color="tab:purple", lw=1, label="trend (Theil-Sen)")
    ax.axvline(result["target_ppl"], color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.invert_xaxis()  # training runs to the right
    ax.set_xlabel("validation perplexity (reference run)")
    ax.set_ylabel("noise scale (target seq.),\ndirect")
    ax.legend(fontsize=7)


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Piecewise-linear ``y(x)`` through ``(xs, ys)`` (``xs`` ascending), clamped at the ends."""
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
    return ys[-1]


def main(argv: list[str] | None = None) -> int:
    """Plot every family of a committed ``bench/cona_ttp.py`` JSON: one PNG per family,
    ``<out>/<json stem>_<family>.png`` (how the docs' plots are made from the same data
    as their tables)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("result", type=Path, help="a bench/cona_ttp.py JSON (docs/results/...)")
    ap.add_argument("--out", type=Path, default=None, help="folder (default: the JSON's)")
    args = ap.parse_args(argv)
    report = json.loads(args.result.read_text())
    out = args.out or args.result.parent
    for name, result in report["models"].items():
        print(plot_family(name, result, out / f"{args.result.stem}_{name}.png"))
    return 0


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script
    sys.exit(main())
