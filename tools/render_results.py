"""Render result tables in the README and docs/ from committed bench JSON.

A table in a Markdown page sits between two markers naming its result file
(``docs/results/<name>.json``)::

    <!-- results: four_shape_cpu -->
    ...generated table...
    <!-- /results -->

``python tools/render_results.py`` rewrites every such block from its JSON;
``--check`` changes nothing and exits 1 naming each stale block (the test
suite runs it), so a number in the docs is always one a committed bench
output holds.  Each result file has one renderer here (``RENDERERS``); a block
naming a file without one, or a missing file, is an error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
PAGES = ("README.md", "docs/*.md")
BLOCK = re.compile(r"(<!-- results: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /results -->)", re.S)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def _source(r: dict, name: str) -> str:
    """The provenance line under a table: date, commit, machine, command, file."""
    return (f"*Measured {r['date'][:10]} at `{r['commit']}` on {r['machine']}: "
            f"`{r['command']}` (`docs/results/{name}.json`).*")


def four_shape_cpu(r: dict) -> str:
    """Per region: layout, final plan, wall time, bytes, idle; then real vs emulated."""
    m, e = r["measured"], r["equality"]
    lines = ["| region (GPU profile) | tp/pp/dp | b_i | H_i | rounds, wall s | compute s | "
             "straggler idle s | WAN idle s | sent | received | final val ppl |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in m["regions"]:
        lay = x["layout"]
        lines.append(f"| {x['region']} ({x['gpu']}) | {lay['tp']}/{lay['pp']}/{lay['dp']} | "
                     f"{x['batch_size']} | {x['inner_steps']} | {x['rounds_wall_s']:.1f} | "
                     f"{x['compute_s']:.1f} | {x['straggler_idle_s']:.1f} | "
                     f"{x['wan_idle_s']:.1f} | {_mb(x['bytes_sent'])} | "
                     f"{_mb(x['bytes_received'])} | {x['final_val_ppl']:.2f} |")
    digest = m["regions"][0]["global_weights_sha256"][:12]
    same = "the same in every region" if m["same_digest"] else "NOT the same in every region"
    replans = m["regions"][0]["replans"]
    lines += ["", f"{len(m['regions'])} regions, {m['distinct_layouts']} distinct layouts, "
              f"{len(m.get('rounds', [])) or '?'} rounds, {replans} re-plan(s) from measured step "
              f"times; θ_global's canonical SHA-256 `{digest}…` {same}.  With re-planning off, "
              f"the same cluster emulated (one TP1 process per worker, same plan and data) "
              f"differs from every region by at most {e['max_abs_val_loss_diff']:.1e} nats in "
              f"validation loss and {e['max_abs_loss_diff']:.1e} in training loss over "
              f"{e['rounds']} rounds (TP/PP summation order; the clocks differ).",
              "", _source(r, "four_shape_cpu")]
    return "\n".join(lines) + "\n"


RENDERERS: dict[str, Callable[[dict], str]] = {"four_shape_cpu": four_shape_cpu}


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every result block regenerated, and the names of the blocks.

    Raises:
        ValueError: a block names a result without a renderer or a JSON file.
    """
    names = []

    def one(m: re.Match) -> str:
        name = m["name"]
        if name not in RENDERERS:
            raise ValueError(f"results block '{name}': no renderer in tools/render_results.py")
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"results block '{name}': docs/results/{path.name} is missing")
        names.append(name)
        return m.group(1) + RENDERERS[name](json.loads(path.read_text())) + m.group(4)

    return BLOCK.sub(one, text), names


def pages() -> list[Path]:
    return [p for pattern in PAGES for p in sorted(REPO.glob(pattern))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = ap.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        try:
            new, names = render(text)
        except ValueError as e:
            print(f"error: {page.relative_to(REPO)}: {e}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(f"{page.relative_to(REPO)} ({', '.join(names)})")
            if not args.check:
                tmp = page.with_suffix(page.suffix + ".tmp")
                tmp.write_text(new)
                tmp.replace(page)
    if args.check and stale:
        print("error: stale result tables in " + "; ".join(stale)
              + ": run python tools/render_results.py", file=sys.stderr)
        return 1
    for s in stale:
        print(f"rendered {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
