"""``bench/gpu_check.sh`` on the CPU: what a bare GPU machine (no megatron-core, no
internet) would do with it, shown with a stand-in device (issue 24).

megatron-core is hidden from the script's Python by a package on ``PYTHONPATH``
whose ``megatron/core/__init__.py`` raises ``ModuleNotFoundError`` (megatron is
a namespace package, so the first ``megatron/core`` on the path wins); the
"carried" wheel is the installed megatron-core packed back into a wheel.
``GPU_CHECK_DEVICE=cpu`` runs each bench part on the preset's tiny twin.
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "gpu_check.sh"
# The bound of the default parts: with a machine's start (1-2 minutes) it must leave at least
# the 4 minutes a second start needs of a session's 15 minutes of device time.
NINE_MINUTES_S = 540


def _hide_megatron(root: Path) -> Path:
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'megatron.core\' (hidden by the test)", '
        'name="megatron.core")\n')
    return root


def _repack_megatron_wheel(folder: Path) -> Path:
    """The installed megatron-core as a wheel file in ``folder`` (its own tag)."""
    dist = metadata.distribution("megatron-core")
    root = Path(dist.locate_file(""))
    info = next(root.glob("megatron_core-*.dist-info"))
    tag = next(line.split(": ")[1] for line in (info / "WHEEL").read_text().splitlines()
               if line.startswith("Tag:"))
    folder.mkdir(parents=True)
    wheel = folder / f"megatron_core-{dist.version}-{tag}.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for f in [*(root / "megatron").rglob("*"), *info.rglob("*")]:
            if f.is_file() and "__pycache__" not in f.parts:
                z.write(f, f.relative_to(root))
    return wheel


def _script(out: Path, *parts: str, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPU_CHECK_")}
    return subprocess.run(["bash", str(SCRIPT), str(out), *parts], cwd=REPO, text=True,
                          capture_output=True, timeout=timeout,
                          env={**base, "GPU_CHECK_DEVICE": "cpu", **env})


def test_without_megatron_or_wheel_it_stops_in_one_line_and_fits_nine_minutes(tmp_path):
    """Catches the shipped script's failure on a bare GPU machine (every part dying
    on ModuleNotFoundError): with megatron-core not importable and an empty wheel
    folder, it must stop after the install part with exit 2 and one line naming
    the folder to carry and the command that fills it, before any other part
    runs.  The first line states the bound of the default parts at the default
    limits: their sum must stay within 9 minutes (it was 550 s; 475 s stopped two parts on
    the H200, 2026-12-04)."""
    shadow = _hide_megatron(tmp_path / "shadow")
    (tmp_path / "wheels").mkdir()
    proc = _script(tmp_path / "out", GPU_CHECK_WHEELS=str(tmp_path / "wheels"),
                   GPU_CHECK_PYDEPS=str(tmp_path / "pydeps"), GPU_CHECK_INSTALL_S="300",
                   PYTHONPATH=f"{shadow}:{os.environ.get('PYTHONPATH', '')}")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    first = proc.stdout.splitlines()[0]  # 2 shared cores need a longer install limit
    assert "bound 795 s" in first, first  # the default bound, its install limit 45 s -> 300 s
    bound = int(first.split("part limits; ")[1].split()[0])
    assert "install tests bench:gpt3_1.3b bench:llama3.2_1b bench:bert_large" in first, first
    assert bound <= NINE_MINUTES_S, first
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("gpu_check:")]
    assert len(errors) == 1, proc.stderr
    assert "megatron-core not importable" in errors[0] and f"carry {tmp_path / 'wheels'}/" in errors[0]
    assert "pip download --no-deps --only-binary=:all:" in errors[0] and "megatron-core==0.16.1" in errors[0]
    out = tmp_path / "out"
    assert not (out / "gpu_tests.log").exists() and not list(out.glob("throughput_*")), proc.stdout


def test_tests_part_stopped_at_its_limit_still_leaves_a_junit_report(tmp_path):
    """Catches ``"tests": null`` in the summary when ``timeout`` stops pytest: with
    a 1 s limit pytest is interrupted while it starts, and the summary must still
    count the tests part (one error case saying it was stopped) and say that the
    check is incomplete (exit 1)."""
    proc = _script(tmp_path / "out", "tests", GPU_CHECK_TESTS_S="1")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    # (how many GPU tests pytest skipped on this CPU before the stop depends on the load)
    assert summary["tests"]["passed"] == 0, summary
    assert summary["tests"]["failed"] == ["tests_part_stopped"], summary
    assert not summary["complete"] and "part tests: stopped at its 1 s limit" in summary["problems"]
    assert (tmp_path / "out" / "gpu_tests.xml").is_file()
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary


def _record(**peer) -> dict:
    ours = {"model": "gpt3_1.3b", "device": "cuda", "gpu_name": "NVIDIA H200", "precision": "bfloat16",
            "micro_batch_size": 4, "global_batch_size": 16, "seq_length": 2048,
            "tokens_per_s": 4e4, "mfu": 0.4}
    p = {k: ours[k] for k in ("device", "micro_batch_size", "global_batch_size", "seq_length")}
    return {**ours, "peers_requested": ["peer", "peer_compiled"],
            "peer": {**p, "tokens_per_s": 3e4, **peer}, "ratio_vs_peer": 1.33}


@pytest.mark.parametrize("peer, problem", [
    ({}, "bench gpt3_1.3b: no peer_compiled record (stopped at the part's limit?)"),
    ({"micro_batch_size": 8}, "bench gpt3_1.3b: peer micro_batch_size 8 != ours 4"),
    ({"seq_length": 1024}, "bench gpt3_1.3b: peer seq_length 1024 != ours 2048"),
    ({"device": "cpu"}, "bench gpt3_1.3b: peer device cpu != ours cuda"),
])
def test_summary_names_a_peer_that_did_other_work_or_is_missing(tmp_path, peer, problem):
    """Catches a comparison of unequal work (issue 24: after ``--sweep-mbs`` the
    GPT-3 peer ran at micro-batch 8 while the record said 4) and a record cut
    short by its limit: the summary is then incomplete and says why."""
    from bench.gpu_summary import summarise

    (tmp_path / "install.json").write_text(json.dumps({"device": "cuda", "gpu": "NVIDIA H200"}))
    (tmp_path / "parts.jsonl").write_text(
        json.dumps({"part": "bench:gpt3_1.3b", "exit": 0, "elapsed_s": 90, "limit_s": 120}) + "\n")
    (tmp_path / "throughput_gpt3_1.3b.json").write_text(json.dumps(_record(**peer)) + "\n")
    summary = summarise(tmp_path)
    assert not summary["complete"] and problem in summary["problems"], summary["problems"]


@pytest.mark.slow
def test_gpu_check_runs_end_to_end_on_the_cpu_stand_in(tmp_path):
    """The whole check as shipped, on the CPU stand-in: megatron-core hidden and
    installed by the install part from a carried wheel folder into GPU_CHECK_PYDEPS
    (and imported from there by every part), the tests part (all skipped without
    CUDA, reported), and the three bench parts (tiny twins: ours, the eager and
    the compiled peer, GPT's micro-batch sweep).  The summary must be complete:
    every record holds what was asked, the peers ran ours' micro-batch, global
    batch and sequence after the sweep, and every device is the one the model's
    parameters were on.  Limits are raised: 2 shared cores are slower than one H200."""
    shadow = _hide_megatron(tmp_path / "shadow")
    _repack_megatron_wheel(tmp_path / "wheels")
    out = tmp_path / "out"
    limits = {f"GPU_CHECK_{p}_S": "900" for p in ("INSTALL", "GPT", "LLAMA", "BERT")}
    proc = _script(out, timeout=3000, GPU_CHECK_WHEELS=str(tmp_path / "wheels"),
                   GPU_CHECK_PYDEPS=str(tmp_path / "pydeps"),
                   PYTHONPATH=f"{shadow}:{os.environ.get('PYTHONPATH', '')}", **limits)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["complete"] and summary["problems"] == [], summary["problems"]
    env = summary["environment"]
    assert env["installed"] and env["megatron_core_path"].startswith(str(tmp_path / "pydeps")), env
    assert env["versions"]["megatron-core"] == "0.16.1" and env["device"] == "cpu", env
    assert [p["part"] for p in summary["parts"]] == [
        "install", "tests", "bench:gpt3_1.3b", "bench:llama3.2_1b", "bench:bert_large"]
    assert summary["tests"]["skipped"] >= 9 and not summary["tests"]["failed"], summary["tests"]
    models = {"gpt3_1.3b": "tiny_gpt", "llama3.2_1b": "tiny_llama", "bert_large": "tiny_bert"}
    assert set(summary["throughput"]) == set(models)
    for preset, r in summary["throughput"].items():
        assert r["model"] == models[preset], r
        assert (r["ours"]["device"], r["ours"]["precision"]) == ("cpu", "float32"), r
        for peer in ("peer", "peer_compiled"):
            assert r[peer]["tokens_per_s"] > 0 and r[f"ratio_vs_{peer}"] > 0, r
            assert {k: r[peer][k] for k in ("micro_batch_size", "global_batch_size", "seq_length")} \
                == {"micro_batch_size": 2, "global_batch_size": 4, "seq_length": 64}, r
    sweep = summary["throughput"]["gpt3_1.3b"]["mbs_sweep"]
    assert [s["micro_batch_size"] for s in sweep] == [1, 4], sweep
    # every part imported megatron-core from the installed wheel, not the hidden one
    assert "hidden by the test" not in (out / "throughput.log").read_text()


def _gpu_folder(root: Path, *, gpu: str | None = "NVIDIA H200") -> Path:
    """A GPU check output folder with hand-made numbers: one preset, both peers, a
    two-point sweep, a JUnit file with a pass, a failure and the stop marker."""
    root.mkdir()
    side = {"tokens_per_s": 1000.0, "mfu": 0.3, "peak_memory_gib": 10.0}
    summary = {"complete": False, "problems": ["part tests: stopped at its 1 s limit"],
               "wall_s": 5.0, "bound_s": 9.0, "commit": "stale+dirty", "gpu": gpu,
               "environment": {"python": "3.12", "versions": {"torch": "2.11", "megatron-core": "0.16.1",
                                                             "transformers": "5"}},
               "parts": [{"part": "tests", "exit": 124, "elapsed_s": 1, "limit_s": 1}],
               "throughput": {"tiny_gpt": {
                   "micro_batch_size": 2, "global_batch_size": 4, "seq_length": 64,
                   "ours": side, "peer": {**side, "tokens_per_s": 800.0}, "ratio_vs_peer": 1.25,
                   "peer_compiled": None,
                   "mbs_sweep": [{"micro_batch_size": 1, "tokens_per_micro_batch": 2048, "mfu": 0.3},
                                 {"micro_batch_size": 2, "tokens_per_micro_batch": 6144, "mfu": 0.3}],
                   "efficiency_fit": {"mfu_max": 0.4, "half_sat_tokens": 1000.0}}}}
    (root / "summary.json").write_text(json.dumps(summary))
    (root / "gpu_tests.xml").write_text(
        '<testsuites><testsuite><testcase name="test_a" time="2.0"/>'
        '<testcase name="test_b" time="3.0"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gpu" name="tests_part_stopped"><error message="s"/>'
        '</testcase></testsuite></testsuites>')
    return root


def test_gpu_results_compare_measured_with_the_models_and_render(tmp_path):
    """Catches a results JSON that misstates the run or the models: the H200 profile
    (mfu_max 0.5, half_sat 2048) predicts 0.25 at 2,048 tokens and 0.375 at 6,144, so
    a measured 0.3 is 1.2x and 0.8x of it; the memory error is (model - peak) / peak;
    the summary's stale commit is kept apart from the one given; a peer that did not
    run renders as "not run", a ratio below 1 in bold, the failed test by name."""
    import bench.gpu_results as gr
    from tools import render_gpu

    r = gr.build(_gpu_folder(tmp_path / "run"), commit="abc1234", date="2026-12-04", note="n",
                 profile="H200")
    assert r["commit"] == "abc1234" and r["commit_recorded_by_the_run"] == "stale+dirty"
    pts = r["efficiency_sweeps"]["tiny_gpt"]["points"]
    assert [p["mfu_profile"] for p in pts] == [0.25, 0.375]
    assert [p["measured_over_profile"] for p in pts] == [1.2, 0.8]
    (row,) = r["presets"]
    est = gr.memory_estimate_gib("tiny_gpt", 2, 4)
    assert row["memory_model"]["relative_error_pct"] == round(100 * (est - 10.0) / 10.0, 1)
    assert row["hf_compiled"] is None and row["ours_over_hf_eager"] == 1.25
    assert [t["outcome"] for t in r["tests"]] == ["passed", "failed", "failed"]
    r["file"] = "x.json"
    out = render_gpu.h200_check(r)
    assert "| tiny_gpt | 2 / 4, 64 | 1,000 | 0.300 | 10.0 | 800 | 1.25x | not run | — |" in out
    assert "| 2 | 6,144 | 0.300 | 0.375 | 0.80x |" in out
    assert "1 passed (`test_a`), failed: `test_b`; the part stopped" in out
    row["ours_over_hf_eager"] = 0.9
    assert "| **0.90x** |" in render_gpu.h200_check_headline(r)
    with pytest.raises(ValueError, match="names no GPU"):
        gr.build(_gpu_folder(tmp_path / "cpu", gpu=None), commit="a", date="d", note="", profile="H200")
