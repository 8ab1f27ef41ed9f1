"""Turn one ``bench/gpu_check.sh`` output folder into the committed results JSON.

The GPU check measures; this script, run anywhere afterwards (no GPU needed), adds what
the project's own models predicted for the same work, so that a page can show both:

- per preset: ours against the Hugging Face eager and compiled peers (tokens/s, MFU,
  peak memory), and the peak memory that ``jobruntime/memory.py`` estimates for the same
  layout, without its fixed allowance for the CUDA context and NCCL buffers (which
  ``torch.cuda.max_memory_allocated`` does not see);
- the micro-batch sweep against the GPU profile's efficiency curve
  (``jobruntime/gpu_profiles.yaml``: ``mfu = mfu_max * t / (t + half_sat_tokens)``, t =
  tokens per micro-batch), the curve by which the emulated clocks of CONA and GeoMesh time
  compute: measured MFU over predicted, per point;
- every test of ``tests/test_gpu.py`` with its outcome and seconds (the JUnit file), and
  each part's exit status, seconds and limit.

    python bench/gpu_results.py runs/gpu_check --commit babdd60 --date 2026-12-04 \\
        --note "what the run's failures were" --out docs/results/h200_2026-12-04.json

``--commit`` names the code that ran: the tree sent to a GPU machine may carry a stale
``.git`` (the summary's own ``commit`` is then wrong) or none.

Raises (exits 2 with one line): the folder has no ``summary.json`` (run
``bench/gpu_summary.py`` on it first) or names no GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobruntime.metrics import json_text, write_json_atomic  # noqa: E402

NAMES = {"gpt3_1.3b": "GPT-3 1.3B", "llama3.2_1b": "Llama-3.2-1B", "bert_large": "BERT-Large"}
PEERS = (("peer", "hf_eager"), ("peer_compiled", "hf_compiled"))


def test_outcomes(xml: Path) -> list[dict]:
    """``[{"name", "outcome": passed|failed|skipped, "seconds"}]`` from a JUnit file, in
    its order; the check's own stop marker (``tests_part_stopped``) included."""
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        if not case.get("name"):
            continue
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
        seconds = case.get("time")
        out.append({"name": case.get("name").split("@")[0],  # without an xdist group
                    "outcome": outcome,
                    "seconds": round(float(seconds), 1) if seconds else None})
    return out


def memory_estimate_gib(preset: str, micro_batch_size: int, global_batch_size: int) -> float:
    """``jobruntime/memory.py``'s peak per device (GiB) for ``preset`` on one GPU in bf16 at
    this micro and global batch, without the fixed allowance (``overhead_bytes=0``)."""
    from jobruntime.config import load_config
    from jobruntime.memory import MemoryModel, PipelineLayout

    cfg = load_config(preset)
    layout = PipelineLayout(tp=1, pp=1, dp=1, micro_batch_size=micro_batch_size,
                            num_microbatches=global_batch_size // micro_batch_size)
    return MemoryModel(cfg.model, precision="mixed", overhead_bytes=0).estimate(layout).total_gib


def _side(record: dict) -> dict:
    return {"tokens_per_s": round(record["tokens_per_s"]), "mfu": record["mfu"],
            "peak_gib": round(record["peak_memory_gib"], 2)}


def preset_result(preset: str, t: dict) -> dict:
    """One preset's row: ours, the peers that ran (None where not), ratios, memory model."""
    est = memory_estimate_gib(preset, t["micro_batch_size"], t["global_batch_size"])
    peak = t["ours"]["peak_memory_gib"]
    row = {"preset": preset, "name": NAMES.get(preset, preset),
           "micro_batch_size": t["micro_batch_size"], "global_batch_size": t["global_batch_size"],
           "seq_length": t["seq_length"], "ours": _side(t["ours"]),
           "memory_model": {"estimated_gib": round(est, 2),
                            "relative_error_pct": round(100 * (est - peak) / peak, 1)}}
    for key, name in PEERS:
        row[name] = _side(t[key]) if t.get(key) else None
        row[f"ours_over_{name}"] = t.get(f"ratio_vs_{key}")
    return row


def sweep_against_profile(sweep: list[dict], gpu: str) -> dict:
    """The micro-batch sweep's measured MFU against the GPU profile's curve, per point."""
    from jobruntime.hardware import get_gpu_profile

    prof = get_gpu_profile(gpu)
    points = []
    for p in sweep:
        predicted = prof.efficiency(p["tokens_per_micro_batch"])
        points.append({**p, "mfu_profile": round(predicted, 4),
                       "measured_over_profile": round(p["mfu"] / predicted, 3)})
    return {"profile": gpu, "profile_mfu_max": prof.mfu_max,
            "profile_half_sat_tokens": prof.half_sat_tokens, "points": points}


def build(folder: Path, *, commit: str, date: str, note: str, profile: str,
          command: str = "bash bench/gpu_check.sh runs/gpu_check") -> dict:
    """The results JSON of one GPU check folder (module docstring).

    Raises:
        ValueError: the summary names no GPU.
    """
    summary = json.loads((folder / "summary.json").read_text())
    env = summary.get("environment") or {}
    if not summary.get("gpu"):
        raise ValueError(f"{folder}/summary.json names no GPU: it is not a GPU run")
    versions = env.get("versions", {})
    out = {"what": "bench/gpu_check.sh on one GPU: tests/test_gpu.py, then per preset our trainer "
                   "against the same model shape in plain Hugging Face transformers, eager and "
                   "torch.compile, at the same micro-batch, global batch and sequence "
                   "(bench/throughput.py --peer --peer-compile, random tokens, bf16)",
           "date": date, "gpu": summary["gpu"], "commit": commit,
           "commit_recorded_by_the_run": summary.get("commit"),
           "software": f"Python {env.get('python')}, torch {versions.get('torch')}, megatron-core "
                       f"{versions.get('megatron-core')}, transformers {versions.get('transformers')}; "
                       "no Transformer Engine, no apex",
           "command": command, "note": note,
           "complete": summary["complete"], "problems": summary["problems"],
           "wall_s": summary.get("wall_s"), "bound_s": summary.get("bound_s"),
           "parts": summary["parts"],
           "tests": test_outcomes(folder / "gpu_tests.xml") if (folder / "gpu_tests.xml").is_file() else [],
           "presets": [preset_result(k, t) for k, t in summary["throughput"].items() if t],
           "efficiency_sweeps": {k: {**sweep_against_profile(t["mbs_sweep"], profile),
                                     "fit": t.get("efficiency_fit")}
                                 for k, t in summary["throughput"].items() if t and t.get("mbs_sweep")}}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="the GPU check's output folder")
    p.add_argument("--commit", required=True, help="the commit of the code that ran there")
    p.add_argument("--date", required=True, help="the run's date, YYYY-MM-DD")
    p.add_argument("--note", default="", help="what the failures were, found by reading the logs")
    p.add_argument("--profile", default="H200", help="the GPU profile the sweep is compared with")
    p.add_argument("--command", default="bash bench/gpu_check.sh runs/gpu_check",
                   help="the command that ran there (with any limits it overrode)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not (args.folder / "summary.json").is_file():
        print(f"error: {args.folder}/summary.json is missing: run python bench/gpu_summary.py "
              f"{args.folder} first", file=sys.stderr)
        return 2
    try:
        result = build(args.folder, commit=args.commit, date=args.date, note=args.note,
                       profile=args.profile, command=args.command)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["file"] = args.out.name
    write_json_atomic(args.out, result)
    print(json_text({k: result[k] for k in ("gpu", "commit", "complete", "problems")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
