"""GeoMesh against its strongest peers, several seeds: DiLoCo swept over ``H``, DiLoCo
at its published setting, Streaming DiLoCo in fp32 and low-bit, GeoMesh with fp32
messages (its balancing without its compression), all on
:mod:`bench.geomesh_ttp`'s emulated four-region cluster, proxy and token budget.

Each run (row x seed) is one child ``python bench/geomesh_ttp.py --<mode>
--methods M --jobs 1 --out <runs>/<mode>/<row>/seed<seed> --set ...`` (its
folder ``<runs>/<mode>/<row>/seed<seed>/<method>/``), ``--jobs`` at a time;
with ``--reuse`` a finished run whose ``config.yaml`` is the run's config is
read back instead (``bench/geomesh_ttp.py --reuse``).

Rows are named ``<method>[_h<H>][_lr<lr>][_ramp|_const][_fp32|_8bit|_4bit]``
(``method``: ``diloco``, ``streaming_diloco``, ``geomesh``; defaults: ``H`` of
the mode (8), the bench's outer lr (``OUTER_LR``), the momentum ramp
(``geomesh.outer_momentum_warmup``), the method's codec: GeoMesh top-k,
the DiLoCos fp32).  ``const``: DiLoCo's published outer momentum, 0.9 from the
first step.  ``geomesh_fp32``: GeoMesh's planner-balanced rounds with fp32
messages (the balancing-vs-compression ablation).  ``_8bit``/``_4bit``:
Streaming DiLoCo's ``geomesh.fragment_bits``.  ``PRESET`` is the sweep of
issue 27.

Every row trains the mode's token budget: ``outer_steps = inner steps of the
mode / H`` (full: 104 x 8 = 832 inner steps, so that every ``H`` of
{8, 16, 32, 64} divides it; quick: 12 x 8 = 96), evaluated every
``max(1, --eval-every / H)`` outer steps (default: every 16 inner steps on the
full run, 8 on the quick one, as ``bench/geomesh_ttp.py`` does at ``H = 8``).
``--tune-lr`` runs each row at every outer lr of ``LR_GRID`` (GeoMesh's grid)
and reports the best by mean final val ppl (how ``OUTER_LR`` was chosen).

Writes one JSON (stdout; ``--out-json FILE`` too): per row ``method, H,
outer_lr, ramp, codec, ttp_s_by_seed`` (null: target missed), ``ttp_s_mean``
(over the seeds that reached it), ``ttp_s_min/max/std``, ``reached``,
``final_val_ppl_by_seed``, ``final_val_ppl_mean``, ``bytes_per_outer_step``,
``straggler_idle_frac``, ``wan_idle_frac`` (seed means); ``settings``, and
``date, commit, machine, command`` (:func:`jobruntime.metrics.provenance`).

    python bench/geomesh_peers.py --full --runs /work/runs_peers --reuse --jobs 2 \\
        --out-json docs/results/geomesh_peers.json
    python bench/geomesh_peers.py --quick --rows diloco_h8 --tune-lr --seeds 1234
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from geomesh_ttp import OUTER_LR, SETTINGS  # noqa: E402  (the runs' settings, one source)

TTP = Path(__file__).resolve().parent / "geomesh_ttp.py"
SEEDS = (1234, 1235, 1236)
LR_GRID = (0.15, 0.25, 0.35, 0.5, 0.7)
PRESET = (
    *(f"diloco_h{h}_lr0.15_ramp" for h in (8, 16, 32, 64)),
    "diloco_h32_lr0.7_const", "diloco_h64_lr0.7_const",  # DiLoCo's published outer step
    "geomesh", "geomesh_fp32",
    "streaming_diloco_fp32", "streaming_diloco_4bit",
)
ROW = re.compile(r"^(?P<method>streaming_diloco|diloco|geomesh)(?:_h(?P<h>\d+))?"
                 r"(?:_lr(?P<lr>\d+(?:\.\d+)?))?(?:_(?P<mom>ramp|const))?"
                 r"(?:_(?P<codec>fp32|8bit|4bit))?$")
BITS = {"fp32": 32, "8bit": 8, "4bit": 4}


class RowError(ValueError):
    """A row name this bench cannot run (the message names the fix)."""


def parse_row(name: str, mode: str) -> dict:
    """A row name's run: ``{row, method, H, outer_lr, ramp, codec, overrides}``.

    Raises:
        RowError: an unknown pattern, a codec the method does not have, or an ``H``
            that does not divide the mode's inner steps.
    """
    m = ROW.match(name)
    if not m:
        raise RowError(f"row {name!r}: use <method>[_h<H>][_lr<lr>][_ramp|_const]"
                       "[_fp32|_8bit|_4bit] with method diloco, streaming_diloco or geomesh")
    method, s = m["method"], SETTINGS[mode]
    H = int(m["h"] or s["inner_steps"])
    total = s["inner_steps"] * s["outer_steps"]
    if H <= 0 or total % H:
        raise RowError(f"row {name!r}: H={H} does not divide the {mode} run's {total} inner steps")
    lr = float(m["lr"]) if m["lr"] else OUTER_LR[method]
    ramp = m["mom"] != "const"
    codec = m["codec"]
    over = [f"geomesh.inner_steps={H}", f"geomesh.outer_steps={total // H}",
            f"geomesh.outer_lr={lr}", f"geomesh.outer_momentum_warmup={str(ramp).lower()}"]
    if method == "diloco":
        if codec not in (None, "fp32"):
            raise RowError(f"row {name!r}: diloco sends fp32 only (low-bit: streaming_diloco)")
        codec = "fp32"
    elif method == "streaming_diloco":
        codec = codec or "fp32"
        over.append(f"geomesh.fragment_bits={BITS[codec]}")
    else:
        if codec not in (None, "fp32"):
            raise RowError(f"row {name!r}: geomesh rows are geomesh (its codec) or geomesh_fp32")
        if codec == "fp32":
            over.append("geomesh.compression=fp32")
        codec = codec or "topk"
    return dict(row=name, method=method, H=H, outer_lr=lr, ramp=ramp, codec=codec,
                overrides=over)


def eval_interval(H: int, every: int) -> int:
    """Outer steps between evaluations: every ``every`` inner steps where ``H`` allows."""
    return max(1, every // H)


def _child(args, spec: dict, seed: int) -> dict:
    """One run: ``bench/geomesh_ttp.py`` in a child process; its row of the report."""
    out = Path(args.runs) / args.mode / spec["row"] / f"seed{seed}"
    cmd = [sys.executable, str(TTP), f"--{args.mode}", "--methods", spec["method"], "--jobs", "1",
           "--wandb", args.wandb, "--threads", str(args.threads), "--out", str(out)]
    if args.reuse:
        cmd.append("--reuse")
    cmd += ["--set", *spec["overrides"],
            f"geomesh.eval_interval={eval_interval(spec['H'], args.eval_every)}",
            f"train.seed={seed}", *args.overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"run {spec['row']} seed {seed} failed ({' '.join(cmd)}):\n"
                           f"{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout)["methods"][spec["method"]]
    print(f"{spec['row']} seed {seed}: ttp_s={row['ttp_s']} final_val_ppl="
          f"{row['final_val_ppl']:.1f} reused={row.get('reused')}", file=sys.stderr, flush=True)
    return row


def _finished(args, spec: dict, seed: int) -> dict | None:
    """``--no-train``: the run's row if it finished under ``--runs`` with this run's
    config (``bench/geomesh_ttp.py``'s reuse rule), else ``None``; trains nothing."""
    import geomesh_ttp as ttp

    from jobruntime.config import load_config

    cfg = load_config("tiny_gpt", ttp.overrides(args.mode, spec["method"], args.wandb, "peers")
                      + [*spec["overrides"],
                         f"geomesh.eval_interval={eval_interval(spec['H'], args.eval_every)}",
                         f"train.seed={seed}", *args.overrides])
    folder = Path(args.runs) / args.mode / spec["row"] / f"seed{seed}" / spec["method"]
    summary = ttp._reused(cfg, folder)
    return None if summary is None else {**ttp._row(summary, summary.get("wall_s", 0.0)),
                                         "reused": True}


def summarise(spec: dict, seeds: list[int], rows: list[dict | None]) -> dict:
    """A row of the JSON from its runs (one per seed, same order; ``None``: that seed was
    not run, ``--no-train``, and is left out)."""
    seeds = [s for s, r in zip(seeds, rows) if r is not None]
    rows = [r for r in rows if r is not None]
    ttp = [r["ttp_s"] for r in rows]
    hit = [t for t in ttp if t is not None]
    ppl = [r["final_val_ppl"] for r in rows]

    def mean(key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(vals) if vals else None

    return {
        **{k: spec[k] for k in ("row", "method", "H", "outer_lr", "ramp", "codec")},
        "seeds": seeds, "ttp_s_by_seed": ttp, "reached": len(hit),
        "ttp_s_mean": statistics.fmean(hit) if hit else None,
        "ttp_s_min": min(hit) if hit else None, "ttp_s_max": max(hit) if hit else None,
        "ttp_s_std": statistics.stdev(hit) if len(hit) > 1 else None,
        "final_val_ppl_by_seed": ppl, "final_val_ppl_mean": statistics.fmean(ppl),
        "bytes_per_outer_step": mean("bytes_per_outer_step"),
        "straggler_idle_frac": mean("straggler_idle_frac"),
        "wan_idle_frac": mean("wan_idle_frac"),
        "tokens": rows[0].get("tokens"),
        "reused_by_seed": [bool(r.get("reused")) for r in rows],
    }


def _with_lr(name: str, lr: float) -> str:
    """``name`` at outer lr ``lr`` (its ``_lr`` part replaced or added after ``_h``)."""
    m = ROW.match(name)
    head = m["method"] + (f"_h{m['h']}" if m["h"] else "")
    tail = "".join(f"_{x}" for x in (m["mom"], m["codec"]) if x)
    return f"{head}_lr{lr:g}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="12 x 8 inner steps per run")
    size.add_argument("--full", action="store_true", help="104 x 8 inner steps per run (default)")
    p.add_argument("--rows", nargs="+", default=None,
                   help=f"row names (default: the preset {list(PRESET)})")
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS),
                   help=f"train.seed of each run (default {list(SEEDS)})")
    p.add_argument("--runs", default="runs/geomesh_peers",
                   help="root of the run folders: <runs>/<mode>/<row>/seed<seed>/<method>/")
    p.add_argument("--reuse", action="store_true", help="read back finished runs of the same config")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (child processes)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per run")
    p.add_argument("--wandb", default="disabled", choices=["offline", "online", "disabled"])
    p.add_argument("--eval-every", type=int, default=None,
                   help="inner steps between evaluations (default 16 full, 8 quick)")
    p.add_argument("--tune-lr", action="store_true",
                   help=f"run every row at each outer lr of {list(LR_GRID)}; report the best")
    p.add_argument("--set", nargs="+", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="extra overrides for every run (after the row's)")
    p.add_argument("--out-json", default=None, help="also write the JSON here (atomically)")
    p.add_argument("--note", default=None,
                   help="a sentence stored in the JSON and printed under its table (e.g. the "
                        "commits the reused runs were made at)")
    p.add_argument("--no-train", action="store_true",
                   help="report only the runs already finished under --runs (same config); "
                        "a seed not run is left out of its row, a row with none is dropped")
    args = p.parse_args(argv)
    args.mode = "quick" if args.quick else "full"
    if args.eval_every is None:
        s = SETTINGS[args.mode]
        args.eval_every = s["inner_steps"] * s["eval_interval"]
    if args.jobs < 1 or args.eval_every < 1 or not args.seeds:
        p.error("--jobs and --eval-every must be >= 1, and --seeds not empty")
    names = list(args.rows or PRESET)
    try:
        for n in names:
            parse_row(n, args.mode)
        if args.tune_lr:
            names = [_with_lr(n, lr) for n in names for lr in LR_GRID]
        specs = [parse_row(n, args.mode) for n in dict.fromkeys(names)]
    except RowError as e:
        p.error(str(e))
    from jobruntime.metrics import json_text, provenance, write_json_atomic

    work = [(spec, seed) for spec in specs for seed in args.seeds]
    if args.no_train:
        done = [_finished(args, *x) for x in work]
    else:
        with ThreadPoolExecutor(args.jobs) as pool:
            done = list(pool.map(lambda x: _child(args, *x), work))
    rows, k = [], 0
    for spec in specs:
        runs = done[k:k + len(args.seeds)]
        k += len(args.seeds)
        if any(r is not None for r in runs):
            rows.append(summarise(spec, args.seeds, runs))
        else:
            print(f"{spec['row']}: no finished run, left out", file=sys.stderr)
    report = {"clock": "emulated", "rows": rows,
              "settings": {"mode": args.mode, **SETTINGS[args.mode],
                           "inner_steps_per_run": SETTINGS[args.mode]["inner_steps"]
                           * SETTINGS[args.mode]["outer_steps"],
                           "eval_every_inner_steps": args.eval_every, "seeds": args.seeds,
                           "runs": str(Path(args.runs) / args.mode), "cluster": "four_region",
                           "target_model": "gpt3_1.3b", "proxy": "tiny_gpt",
                           "extra": args.overrides, "tune_lr": args.tune_lr,
                           "no_train": args.no_train},
              "note": args.note,
              **provenance(None if argv is None else ["bench/geomesh_peers.py", *argv])}
    if args.tune_lr:  # best outer lr per row by mean final val ppl (how OUTER_LR was chosen)
        best: dict[str, dict] = {}
        for row in rows:
            base = re.sub(r"_lr\d+(?:\.\d+)?", "", row["row"])
            if base not in best or row["final_val_ppl_mean"] < best[base]["final_val_ppl_mean"]:
                best[base] = row
        report["best_lr"] = {b: r["outer_lr"] for b, r in best.items()}
    if args.out_json:
        write_json_atomic(Path(args.out_json), report)
    print(json_text(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
