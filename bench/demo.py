"""How long the README's demo takes: ``python train.py`` as the quick start runs it.

Two runs of the demo (the default preset, ``tiny_gpt`` on the bundled corpus, every
setting at its default), one after the other, each in its own run folder:

1. **first use**: with an empty ``data.cache_dir``, so the run also trains the
   tokenizer and tokenises the corpus, as on a fresh machine;
2. **again**: the same cache, now filled (what every later run pays).

Each is timed from the command's start to its exit (wall seconds, the imports of torch
and megatron-core included), with the seconds of each phase the run logs (``<phase>:
done in X s``: imports, tokenizer, tokenising, model build, checkpoint save) and what its
``summary.json`` says (TTP, final validation perplexity, tokens, the training loop's
wall seconds).  Wall time on a shared or loaded machine is longer: the JSON names the
machine (:func:`jobruntime.metrics.provenance`).

Usage::

    python bench/demo.py --out runs/demo     # ~8 min on 2 cores

Prints one JSON object ``{"date", "commit", "machine", "command", "runs": [{"name",
"exit_code", "wall_s", "phases_s": {phase: seconds}, "summary": {...}}]}`` and writes
it to ``OUT/demo_cpu.json`` with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
# "<time> jobruntime: <phase>: done in 12.3 s" (jobruntime.logging_utils.phase)
PHASE = re.compile(r"\] [\w.]+: (?P<phase>.+?): done in (?P<s>[\d.]+) s")
SUMMARY_KEYS = ("ttp_s", "target_ppl", "final_val_ppl", "tokens", "steps", "wall_s")


def phases(log: str) -> dict[str, float]:
    """Seconds per phase from a run's log lines (``<phase>: done in X s``); a phase
    logged more than once (e.g. a checkpoint save) is summed."""
    out: dict[str, float] = {}
    for m in PHASE.finditer(log):
        out[m["phase"]] = round(out.get(m["phase"], 0.0) + float(m["s"]), 1)
    return out


def run_demo(name: str, run_dir: Path, cache_dir: Path) -> dict:
    """One ``python train.py`` with the demo's defaults (only the run folder and the
    cache named); its wall seconds, phases and summary.

    Raises:
        SystemExit: the demo failed (its exit code and the end of its output)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "train.py", "--run-dir", str(run_dir),
                           f"data.cache_dir={cache_dir}"], cwd=REPO, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"the demo ({name}) exited {proc.returncode}:\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"name": name, "exit_code": proc.returncode, "wall_s": round(wall, 1),
            "phases_s": phases(proc.stdout + proc.stderr),
            "summary": {k: summary.get(k) for k in SUMMARY_KEYS}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write demo_cpu.json here")
    args = p.parse_args(argv)
    from bench.seeded_units import write_report
    from jobruntime.metrics import provenance
    from jobruntime.outputs import refuse_output_folder

    refuse_output_folder(p, args.out)
    report = provenance(argv)
    with tempfile.TemporaryDirectory(prefix="geocona-demo-") as tmp:
        cache = Path(tmp) / "cache"  # empty: the first run trains the tokenizer
        report["runs"] = [run_demo(name, Path(tmp) / name, cache)
                          for name in ("first use", "again")]
    write_report(report, args.out, "demo_cpu.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
