"""Plot of one CONA benchmark family: perplexity against emulated time, switches marked,
gradient noise scale beneath (``bench/cona_ttp.py --out``)."""

from __future__ import annotations

from pathlib import Path

STYLES = {"static_throughput": ("tab:gray", ":"), "static_throughput_long": ("tab:gray", "-"),
          "static_oracle": ("tab:blue", "--"),
          "oracle_chain": ("tab:green", "-."), "cona": ("tab:red", "-"),
          "cona_scale_free_gns": ("tab:orange", "-"),
          "cona_preconditioned_gns": ("tab:purple", "-")}


def plot_family(name: str, result: dict, path: Path) -> Path:
    """Write ``path`` (PNG): top, validation perplexity vs emulated seconds per method with
    its switch times as markers and the target as a line; bottom, the noise scale (target
    sequences) at each evaluation on the same time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 7),
                                      gridspec_kw={"height_ratios": [2, 1]})
    for method, m in result["methods"].items():
        if not m or not m.get("evals"):
            continue
        color, ls = STYLES.get(method, ("black", "-"))
        ev = m["evals"]
        t = [e["time_s"] for e in ev]
        top.plot(t, [e["val_ppl"] for e in ev], color=color, ls=ls, label=method)
        g = [(e["time_s"], e["gns"]) for e in ev if e.get("gns") is not None]
        if g:
            bottom.plot(*zip(*g), color=color, ls=ls, label=method)
        for ts in m.get("switch_times_s") or []:
            top.axvline(ts, color=color, ls=ls, lw=0.6, alpha=0.6)
            bottom.axvline(ts, color=color, ls=ls, lw=0.6, alpha=0.6)
    top.axhline(result["target_ppl"], color="black", lw=0.8)
    top.set_yscale("log")
    top.set_ylabel("validation perplexity")
    top.set_title(f"{name} timing, {result['proxy']} trained (emulated clock); "
                  "vertical lines: switches")
    top.legend()
    bottom.set_yscale("log")
    bottom.set_ylabel("noise scale (target seq.)")
    bottom.set_xlabel("emulated seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
