"""Four regions of four shapes for real on this machine, and the same cluster emulated.

Runs ``python -m geomesh.launch_local`` on ``geomesh/clusters/four_shape_cpu.yaml``
(regions at TP1, DP2, TP2 and PP2: 7 processes, one torchrun per region, torchft
between them) twice, and the same cluster once in ``mode: emulated``:

* ``measured``: re-planning on (the default): after the first round each
  region's measured step time replaces its GPU profile in the planner.  Per
  region: layout, final ``b_i`` and ``H_i``, wall seconds of its rounds, bytes
  sent and received as its transport counted them, straggler and WAN idle
  (wall clock), final validation perplexity, the canonical digest of θ_global.
* ``equality``: re-planning off in the real and the emulated run, so that both
  train the same plan on the same data; the largest difference of any
  region's training and validation loss from the emulated run's, per round
  (the two modes may differ only in the clock and in TP/PP summation order).

Prints one JSON object (with :func:`jobruntime.metrics.provenance`); ``--out``
also writes it (``docs/results/four_shape_cpu.json`` is the committed one).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))
CLUSTER = REPO / "geomesh" / "clusters" / "four_shape_cpu.yaml"


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _launch(cluster: Path, run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "geomesh.launch_local", "--cluster", str(cluster),
                           "--run-dir", str(run_dir), *overrides], cwd=REPO, capture_output=True,
                          text=True, timeout=3600)


def _region_dirs(run_dir: Path) -> list[Path]:
    return sorted(p.parent for p in run_dir.glob("*/summary.json"))


def _region_row(summary: dict) -> dict:
    """One region's figures from its own summary (its worker's entry of ``workers``)."""
    mine = next(w for w in summary["workers"] if w["region"] == summary["region"])
    return {"region": summary["region"], "worker": mine["worker"], "gpu": mine["gpu"],
            "layout": summary["layout"], "batch_size": mine["batch_size"],
            "inner_steps": mine["inner_steps"], "rounds_wall_s": round(summary["wall_s"], 2),
            "compute_s": round(mine["compute_s"], 2),
            "straggler_idle_s": round(mine["straggler_idle_s"], 2),
            "wan_idle_s": round(mine["wan_idle_s"], 2), "bytes_sent": summary["bytes_sent"],
            "bytes_received": summary["bytes_received"],
            "final_val_ppl": round(summary["final_val_ppl"], 3),
            "global_weights_sha256": summary["global_weights_sha256"],
            "replans": summary["replans"]}


def measured(root: Path, cluster: Path, common: list[str]) -> dict:
    proc = _launch(cluster, root / "measured", common)
    if proc.returncode != 0:
        raise SystemExit(f"four_shape: the measured run failed (exit {proc.returncode}):\n"
                         + proc.stdout[-2000:] + proc.stderr[-2000:])
    sums = [json.loads((d / "summary.json").read_text()) for d in _region_dirs(root / "measured")]
    rows = [_region_row(s) for s in sums]
    first = _records(_region_dirs(root / "measured")[0])
    rounds = [{"step": r["step"], "batch_sizes": r["batch_sizes"], "inner_steps": r["inner_steps"],
               "imbalance": round(r["imbalance"], 3), "replanned": bool(r.get("replanned"))}
              for r in first]  # every region logs the same plan per round
    return {"exit_code": proc.returncode, "regions": rows, "rounds": rounds,
            "same_digest": len({r["global_weights_sha256"] for r in rows}) == 1,
            "distinct_layouts": len({tuple(r["layout"].values()) for r in rows})}


def equality(root: Path, cluster: Path, common: list[str]) -> dict:
    fixed = [*common, "geomesh.replan=false"]
    real = _launch(cluster, root / "real", fixed)
    emu = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", "tiny_gpt",
                          "--run-dir", str(root / "emulated"), f"geomesh.cluster={cluster}",
                          "geomesh.mode=emulated", "geomesh.method=geomesh", *fixed],
                         cwd=REPO, capture_output=True, text=True, timeout=3600)
    if real.returncode or emu.returncode:
        raise SystemExit(f"four_shape: equality runs failed (real {real.returncode}, emulated "
                         f"{emu.returncode}):\n{real.stdout[-1500:]}{emu.stderr[-1500:]}")
    ref = _records(root / "emulated")
    dirs = _region_dirs(root / "real")
    worst = {"loss": 0.0, "val_loss": 0.0}
    for d in dirs:
        for a, b in zip(_records(d), ref, strict=True):
            if a["tokens"] != b["tokens"]:
                raise SystemExit(f"four_shape: {d.name} trained {a['tokens']} tokens at step "
                                 f"{a['step']}, the emulated run {b['tokens']}")
            for k in worst:
                worst[k] = max(worst[k], abs(a[k] - b[k]))
    digests = {json.loads((d / "summary.json").read_text())["global_weights_sha256"] for d in dirs}
    return {"rounds": len(ref), "max_abs_loss_diff": worst["loss"],
            "max_abs_val_loss_diff": worst["val_loss"], "same_digest": len(digests) == 1,
            "val_loss": [r["val_loss"] for r in ref]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=4, help="outer steps of every run")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("overrides", nargs="*", help="section.key=value for every run")
    args = p.parse_args(argv)
    from jobruntime.metrics import json_text, provenance, write_json_atomic
    from jobruntime.ports import free_port

    with tempfile.TemporaryDirectory(prefix="four_shape_") as tmp:
        root = Path(tmp)
        raw = yaml.safe_load(CLUSTER.read_text())
        raw["rendezvous"] = f"127.0.0.1:{free_port()}"  # the shipped port may be taken
        cluster = root / "four_shape_cpu.yaml"
        cluster.write_text(yaml.safe_dump(raw))
        # sign_row in both modes: top-k falls back to it in real mode (TP2 row shards of 128
        # columns split its 256-column chunks), the emulated run would keep top-k
        common = [f"geomesh.outer_steps={args.rounds}", "geomesh.compression=sign_row",
                  "logging.wandb=disabled", *args.overrides]
        report = {"cluster": CLUSTER.relative_to(REPO).as_posix(), "config": "tiny_gpt",
                  "overrides": common, "clock": "wall (real), emulated (reference)",
                  "measured": measured(root, cluster, common),
                  "equality": equality(root, cluster, common), **provenance(argv)}
    print(json_text(report, indent=1))
    if args.out:
        write_json_atomic(Path(args.out), report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
