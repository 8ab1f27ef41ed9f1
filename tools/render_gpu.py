"""Render the GPU check's results (``bench/gpu_results.py``'s JSON) for the README and
docs/gpu.md (``tools/render_results.py`` calls these)."""

from __future__ import annotations


def ratio(x: float | None) -> str:
    """A speed ratio ours / peer, in bold where ours is the slower one; ``—`` if not measured."""
    if x is None:
        return "—"
    return f"{x:.2f}x" if x >= 1 else f"**{x:.2f}x**"


def _peer(side: dict | None) -> str:
    return f"{side['tokens_per_s']:,}" if side else "not run"


def _table(r: dict) -> list[str]:
    """Ours against the eager and compiled Hugging Face peers of the same run, per preset."""
    lines = ["| preset | micro / global batch, seq | ours tokens/s | MFU | peak GiB | "
             "HF eager tokens/s | ours / eager | HF compiled tokens/s | ours / compiled |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["presets"]:
        o = x["ours"]
        lines.append(f"| {x['name']} | {x['micro_batch_size']} / {x['global_batch_size']}, "
                     f"{x['seq_length']} | {o['tokens_per_s']:,} | {o['mfu']:.3f} | "
                     f"{o['peak_gib']:.1f} | {_peer(x['hf_eager'])} | "
                     f"{ratio(x['ours_over_hf_eager'])} | {_peer(x['hf_compiled'])} | "
                     f"{ratio(x['ours_over_hf_compiled'])} |")
    return lines


def _tests(r: dict, *, names: bool = False) -> str:
    """One sentence: how many of tests/test_gpu.py passed (``names``: which), and which did not."""
    tests = [t for t in r["tests"] if t["name"] != "tests_part_stopped"]
    passed = [t["name"] for t in tests if t["outcome"] == "passed"]
    failed = [t["name"] for t in tests if t["outcome"] == "failed"]
    stopped = any(t["name"] == "tests_part_stopped" for t in r["tests"])
    text = f"`tests/test_gpu.py`: {len(passed)} passed"
    if names:
        text += " (" + ", ".join(f"`{n}`" for n in passed) + ")"
    if failed:
        text += ", failed: " + ", ".join(f"`{n}`" for n in failed)
    if stopped:
        text += "; the part stopped at its limit with tests still to run"
    return text + "."


def _where(r: dict) -> str:
    return (f"*Measured {r['date']} at `{r['commit']}` on one {r['gpu']}, {r['software']}: "
            f"`{r['command']}` (`docs/results/{r['file']}`).*")


def h200_check(r: dict) -> str:
    """docs/gpu.md: throughput against both peers, the tests, the memory model, the
    efficiency curve against the GPU profile, and what went wrong in the run."""
    lines = _table(r) + ["", "MFU: model FLOPs per token (6N + attention, `jobruntime/flops.py`) "
                         "x tokens/s over the GPU profile's bf16 dense peak; peak: "
                         "`torch.cuda.max_memory_allocated`.", "", _tests(r, names=True), "",
                         "| preset | memory model (GiB) | measured peak (GiB) | error |",
                         "|---|---:|---:|---:|"]
    for x in r["presets"]:
        m = x["memory_model"]
        lines.append(f"| {x['name']} | {m['estimated_gib']:.1f} | {x['ours']['peak_gib']:.1f} | "
                     f"{m['relative_error_pct']:+.1f} % |")
    lines += ["", "Memory model: `jobruntime/memory.py` at the same layout, without its fixed "
              "allowance for the CUDA context and NCCL buffers (which `max_memory_allocated` "
              "does not see)."]
    for preset, s in r["efficiency_sweeps"].items():
        name = next((x["name"] for x in r["presets"] if x["preset"] == preset), preset)
        lines += ["", f"| {name}, micro-batch | tokens per micro-batch | measured MFU | "
                  f"{s['profile']} profile's MFU | measured / profile |", "|---:|---:|---:|---:|---:|"]
        lines += [f"| {p['micro_batch_size']} | {p['tokens_per_micro_batch']:,} | {p['mfu']:.3f} | "
                  f"{p['mfu_profile']:.3f} | {p['measured_over_profile']:.2f}x |" for p in s["points"]]
        fit = s.get("fit") or {}
        lines += ["", f"The emulated clocks time compute by the profile's curve "
                  f"(mfu_max {s['profile_mfu_max']}, half_sat_tokens {s['profile_half_sat_tokens']:g}; "
                  f"`jobruntime/gpu_profiles.yaml`); fitted to these points: mfu_max "
                  f"{fit.get('mfu_max')}, half_sat_tokens {fit.get('half_sat_tokens')} "
                  "(`bench/throughput.py --sweep-mbs`, ours' micro-batch re-timed at the same "
                  "global batch)."]
    if r["problems"]:
        lines += ["", "The run was not complete: " + "; ".join(r["problems"]) + ".  " + r["note"]]
    elif r["note"]:
        lines += ["", r["note"]]
    lines += ["", _where(r)]
    return "\n".join(lines) + "\n"


def h200_check_headline(r: dict) -> str:
    """The README's short form: the throughput table, the tests, the source."""
    return "\n".join(_table(r) + ["", _tests(r) + "  Memory, the efficiency curve and what "
                                  "went wrong in the run: [docs/gpu.md](docs/gpu.md#measured-on-one-nvidia-h200).",
                                  "", _where(r)]) + "\n"
