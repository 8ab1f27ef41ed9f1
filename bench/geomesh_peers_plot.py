"""Plot of a ``bench/geomesh_peers.py`` JSON: each row's time to target (emulated
seconds, log scale), its mean as a bar and each seed as a dot, missed rows marked at
the right edge, with the row's straggler idle beside it — from the same committed JSON
as the tables of ``tools/render_results.py``.

    python bench/geomesh_peers_plot.py docs/results/geomesh_peers.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COLORS = {"geomesh": "tab:red", "diloco": "tab:blue", "streaming_diloco": "tab:green"}


def plot_peers(report: dict, path: Path) -> Path:
    """Write ``path`` (PNG): one horizontal bar per row of ``report["rows"]`` (top to
    bottom in the JSON's order) at its mean TTP over the seeds that reached the target,
    one dot per such seed, an ``x`` at the axis' right edge per seed that missed it;
    the label gives the row and its straggler idle (percent of worker time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    reached = [t for x in rows for t in x["ttp_s_by_seed"] if t is not None]
    right = 2 * max(reached)
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.5))
    for i, x in enumerate(rows):
        y = len(rows) - 1 - i
        color = COLORS.get(x["method"], "tab:gray")
        if x["ttp_s_mean"] is not None:
            ax.barh(y, x["ttp_s_mean"], color=color, alpha=0.35)
        for t in x["ttp_s_by_seed"]:
            ax.plot([t if t is not None else right], [y], ls="none", color=color,
                    marker="o" if t is not None else "x", ms=5)
    labels = [f"{x['row']} ({100 * x['straggler_idle_frac']:.0f} % straggler idle)"
              for x in rows]
    ax.set_yticks(range(len(rows)), labels[::-1], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlim(right=right * 1.2)
    ax.set_xlabel("time to target perplexity, emulated seconds (x: target missed)")
    s = report["settings"]
    ax.set_title(f"{s['mode']} run, {s['inner_steps_per_run']} inner steps per run, "
                 f"seeds {', '.join(map(str, s['seeds']))} ({report['commit']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("result", type=Path, help="a bench/geomesh_peers.py JSON")
    ap.add_argument("--out", type=Path, default=None,
                    help="PNG path (default: the JSON's path with .png)")
    args = ap.parse_args(argv)
    print(plot_peers(json.loads(args.result.read_text()), args.out or
                     args.result.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
