"""Summarise a ``bench/gpu_check.sh`` output folder as one JSON object.

Reads ``gpu_tests.xml`` (pytest's JUnit report) and ``throughput_<preset>.json``
(the last line of each: ``bench/throughput.py``'s fullest record), writes
``summary.json`` next to them and prints it::

    python bench/gpu_summary.py runs/gpu_check --wall-s 431
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from pathlib import Path

KEYS = ("tokens_per_s", "mfu", "achieved_tflops_per_device", "peak_memory_gib")


def tests_summary(xml: Path) -> dict | None:
    """``{"passed", "failed": [names], "skipped"}`` from a JUnit XML file, or None."""
    if not xml.is_file():
        return None
    cases = ET.parse(xml).getroot().iter("testcase")
    out = {"passed": 0, "failed": [], "skipped": 0}
    for case in cases:
        name = case.get("name")
        if case.find("failure") is not None or case.find("error") is not None:
            out["failed"].append(name)
        elif case.find("skipped") is not None:
            out["skipped"] += 1
        else:
            out["passed"] += 1
    return out


def bench_summary(path: Path) -> dict | None:
    """The fields that matter from the last JSON line of one throughput run."""
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("{")]
    if not lines:
        return None
    r = json.loads(lines[-1])
    out = {"gpu": r.get("gpu_name"), "micro_batch_size": r["micro_batch_size"],
           "global_batch_size": r["global_batch_size"], "seq_length": r["seq_length"],
           "precision": r["precision"], "ours": {k: r.get(k) for k in KEYS}}
    for peer in ("peer", "peer_compiled"):
        if peer in r:
            out[peer] = {k: r[peer].get(k) for k in KEYS}
            out[f"ratio_vs_{peer}"] = r[f"ratio_vs_{peer}"]
    if "mbs_sweep" in r:
        out["mbs_sweep"], out["efficiency_fit"] = r["mbs_sweep"], r["efficiency_fit"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("folder", type=Path)
    p.add_argument("--wall-s", type=float, default=None)
    args = p.parse_args()
    summary = {"wall_s": args.wall_s, "tests": tests_summary(args.folder / "gpu_tests.xml"),
               "throughput": {}}
    for f in sorted(args.folder.glob("throughput_*.json")):
        summary["throughput"][f.stem.removeprefix("throughput_")] = bench_summary(f)
    text = json.dumps(summary)
    (args.folder / "summary.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
