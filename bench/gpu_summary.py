"""Summarise a ``bench/gpu_check.sh`` output folder as one JSON object.

Reads ``install.json`` (``bench/gpu_deps.py``), ``parts.jsonl`` (each part's
exit status, seconds and limit), ``gpu_tests.xml`` (pytest's JUnit report) and
``throughput_<preset>.json`` (the last line of each: ``bench/throughput.py``'s
fullest record), writes ``summary.json`` next to them and prints it::

    python bench/gpu_summary.py runs/gpu_check --wall-s 431 --bound-s 475

``complete`` is true when every part ran to its end and every record holds
what was asked of it; otherwise ``problems`` says what is missing or wrong
(a part stopped at its limit, a peer not timed, a peer that did not do ours'
work: another micro-batch, global batch or sequence, or another device).
Test failures are findings, listed under ``tests.failed``.  Exits 0 when the
summary is complete and no test failed, else 1.

``--junit-fallback RC --limit-s L`` (the tests part, after pytest) writes a
JUnit file with one error case when pytest left none, and adds that case to a
partial one when the limit stopped pytest, so that ``tests`` is never null and
a stopped part never reads as clean.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from xml.sax.saxutils import quoteattr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobruntime.metrics import (  # noqa: E402
    json_text,
    provenance,
    write_json_atomic,
    write_text_atomic,
)

KEYS = ("tokens_per_s", "mfu", "achieved_tflops_per_device", "peak_memory_gib", "device",
        "precision")
SAME_WORK = ("micro_batch_size", "global_batch_size", "seq_length", "device")
STOPPED = (124, 137)  # timeout's status when it stopped a command (TERM/INT, then KILL)


def tests_summary(xml: Path) -> dict | None:
    """``{"passed", "failed": [names], "skipped"}`` from a JUnit XML file, or None
    (no file, or one that does not parse)."""
    try:
        cases = list(ET.parse(xml).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        return None
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


def write_junit_fallback(xml: Path, rc: int, limit_s: float) -> bool:
    """Make ``xml`` say what happened to the tests part: unless pytest left a readable
    JUnit file and finished, write or add one error case ``tests_part_stopped``.

    A pytest interrupted at its limit may still write a (partial) report, of zero
    tests when it was stopped while collecting: the stop is then added to it, so a
    stopped part never reads as a clean one.

    Returns:
        True when it wrote or changed the file.
    """
    stopped = rc in STOPPED
    if tests_summary(xml) is not None and not stopped:
        return False
    why = (f"stopped at its {limit_s:g} s limit" if stopped
           else f"pytest exited {rc} without a report (see gpu_tests.log)")
    case = ('<testcase classname="tests.test_gpu" name="tests_part_stopped">'
            f'<error message={quoteattr(why)}/></testcase>')
    if tests_summary(xml) is not None:  # a partial report: add the stop to its first suite
        tree = ET.parse(xml)
        suite = next(tree.getroot().iter("testsuite"), tree.getroot())
        suite.append(ET.fromstring(case))
        write_text_atomic(xml, ET.tostring(tree.getroot(), encoding="unicode") + "\n")
        return True
    text = ('<?xml version="1.0" encoding="utf-8"?>\n<testsuites><testsuite name="gpu_tests" '
            f'tests="1" errors="1" failures="0" skipped="0">{case}</testsuite></testsuites>\n')
    write_text_atomic(xml, text)
    return True


def bench_summary(path: Path, device: str | None) -> tuple[dict | None, list[str]]:
    """The fields that matter from the last JSON line of one throughput run.

    Args:
        device: the device the check expects the models on (None: not checked).

    Returns:
        ``(summary or None, problems)``.
    """
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("{")] if path.is_file() else []
    if not lines:
        return None, ["no record (the part stopped before our run finished; see throughput.log)"]
    r = json.loads(lines[-1])
    problems = []
    ours = {k: r.get(k) for k in (*KEYS, *SAME_WORK)}
    out = {"model": r.get("model"), "gpu": r.get("gpu_name"), "micro_batch_size": r["micro_batch_size"],
           "global_batch_size": r["global_batch_size"], "seq_length": r["seq_length"],
           "precision": r["precision"], "ours": ours}
    if device is not None and r.get("device") != device:
        problems.append(f"ours ran on {r.get('device')}, not {device}")
    for peer in r.get("peers_requested", []):
        if peer not in r:
            problems.append(f"no {peer} record (stopped at the part's limit?)")
            continue
        out[peer] = {k: r[peer].get(k) for k in (*KEYS, *SAME_WORK, "autocast")}
        out[f"ratio_vs_{peer}"] = r[f"ratio_vs_{peer}"]
        problems += [f"{peer} {k} {r[peer].get(k)} != ours {r.get(k)}" for k in SAME_WORK
                     if r[peer].get(k) != r.get(k)]
    if "mbs_sweep" in r:
        out["mbs_sweep"], out["efficiency_fit"] = r["mbs_sweep"], r["efficiency_fit"]
    return out, problems


def summarise(folder: Path, *, wall_s: float | None = None, bound_s: float | None = None) -> dict:
    """The summary of one ``gpu_check.sh`` output folder (module docstring)."""
    env = json.loads((folder / "install.json").read_text()) if (folder / "install.json").is_file() else None
    parts_file = folder / "parts.jsonl"
    parts = [json.loads(ln) for ln in parts_file.read_text().splitlines()] if parts_file.is_file() else []
    problems = [f"part {p['part']}: " + (f"stopped at its {p['limit_s']} s limit" if p["exit"] in STOPPED
                                         else f"exit {p['exit']}")
                for p in parts if p["exit"] != 0]
    if env is None:
        problems.append("no install.json (the install part did not run)")
    summary = {"complete": False, "problems": problems, "wall_s": wall_s, "bound_s": bound_s,
               "commit": provenance()["commit"],
               "gpu": env and env.get("gpu"), "environment": env, "parts": parts,
               "tests": tests_summary(folder / "gpu_tests.xml"), "throughput": {}}
    if summary["tests"] is None and any(p["part"] == "tests" for p in parts):
        problems.append("tests: no JUnit report")
    device = env.get("device") if env else None
    for p in parts:
        if p["part"].startswith("bench:"):
            preset = p["part"].removeprefix("bench:")
            record, issues = bench_summary(folder / f"throughput_{preset}.json", device)
            summary["throughput"][preset] = record
            problems += [f"bench {preset}: {x}" for x in issues]
    summary["complete"] = not problems
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path)
    p.add_argument("--wall-s", type=float, default=None)
    p.add_argument("--bound-s", type=float, default=None, help="the sum of the part limits")
    p.add_argument("--junit-fallback", type=int, default=None, metavar="RC",
                   help="make gpu_tests.xml record a stopped or report-less pytest (exit RC)")
    p.add_argument("--limit-s", type=float, default=0.0, help="the tests part's limit")
    args = p.parse_args()
    if not args.folder.is_dir():
        p.error(f"{args.folder} is not a folder; give the GPU check's output folder")
    if args.junit_fallback is not None:
        write_junit_fallback(args.folder / "gpu_tests.xml", args.junit_fallback, args.limit_s)
        return
    summary = summarise(args.folder, wall_s=args.wall_s, bound_s=args.bound_s)
    write_json_atomic(args.folder / "summary.json", summary)
    print(json_text(summary))
    tests = summary["tests"] or {}
    sys.exit(0 if summary["complete"] and not tests.get("failed") else 1)


if __name__ == "__main__":
    main()
