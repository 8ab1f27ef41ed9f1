"""Ctrl-C in ``train.py`` (issue 26): one line on rank 0, quiet other ranks, exit code 130,
and a ``summary.json`` marked ``"interrupted": true`` with what the run knew.

One real 2-rank job (gloo, the ranks started as torchrun starts them, each sent SIGINT
as torchrun forwards a Ctrl-C) once the target perplexity was reached; the rest is pure
logic on records.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.dist_utils import popen_ranks

REPO = Path(__file__).resolve().parent.parent
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
         "model.seq_length=32", "model.vocab_size=512", "parallel.global_batch_size=8",
         "parallel.micro_batch_size=2", "train.warmup_iters=1", "train.eval_iters=1",
         "logging.wandb=disabled", "data.max_documents=300"]


def _records(path: Path) -> list[dict]:
    try:
        return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    except (OSError, ValueError):
        return []


def test_ctrl_c_on_two_ranks_is_one_line_exit_130_and_a_partial_summary(tmp_path, cache_dir):
    """Catches 184-307 lines of tracebacks and no ``summary.json`` on Ctrl-C, even after
    the target was reached: SIGINT to both ranks of a TP=1 DP=2 job (torchrun forwards a
    Ctrl-C to every worker) once two evaluations are recorded.  Both exit 130; rank 0
    prints one line naming the step and the folder and no resume advice (no checkpoint
    was saved); rank 1 prints nothing on stderr; no traceback anywhere.  The summary's
    TTP, steps and final perplexity must equal what the records say (the reference is
    computed here from metrics.jsonl, by hand)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train.py"), "--run-dir", str(run_dir), *SMALL,
           f"data.cache_dir={cache_dir}", "train.iters=100000", "train.eval_interval=2",
           "train.target_ppl=1e9", "checkpoint.save_final=false"]
    ranks = popen_ranks(cmd, 2, REPO)
    try:
        deadline = time.monotonic() + 600
        while sum("val_ppl" in r for r in _records(run_dir / "metrics.jsonl")) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks)
            time.sleep(0.5)
        for p in ranks:
            p.send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in ranks] == [130, 130], outs[0][1][-3000:] + outs[1][1][-3000:]
    for out, err in outs:
        assert "Traceback" not in out + err, err[-3000:]
    assert outs[1][1].strip() == "", outs[1][1][-3000:]
    records = [r for r in _records(run_dir / "metrics.jsonl")]
    steps = records[-1]["step"]
    assert outs[0][1].strip().splitlines() == [
        f"interrupted at step {steps}; partial results in {run_dir} "
        "(metrics.jsonl, summary.json, config.yaml)"]
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [r for r in records if "val_ppl" in r]
    assert summary["interrupted"] is True and summary["steps"] == steps
    assert summary["final_val_ppl"] == evals[-1]["val_ppl"]
    # target 1e9 is below the first evaluation: TTP is that evaluation's time (no crossing)
    assert (summary["ttp_step"], summary["ttp_s"]) == (2, evals[0]["time_s"])
    assert summary["method"] == "single" and summary["tokens"] == records[-1]["tokens"]


def test_sigterm_exits_3_with_a_partial_summary(tmp_path, cache_dir):
    """Catches a run stopped by SIGTERM (a scheduler's time limit or preemption: SLURM
    sends it first) that left metrics.jsonl but no ``summary.json``, unlike a Ctrl-C:
    exit 3, one ``error:`` line, and the summary of what the records say."""
    import subprocess

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), "--run-dir", str(run_dir), *SMALL,
         f"data.cache_dir={cache_dir}", "train.iters=100000", "train.eval_interval=2",
         "checkpoint.save_final=false"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not any("val_ppl" in r for r in _records(run_dir / "metrics.jsonl")):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [x for x in err.splitlines() if x.strip()]
    assert proc.returncode == 3 and len(lines) == 1 and "stopped by signal 15" in lines[0], err
    summary = json.loads((run_dir / "summary.json").read_text())
    records = _records(run_dir / "metrics.jsonl")
    assert summary["interrupted"] is True and summary["steps"] >= records[-1]["step"] >= 2
    assert summary["mode"] == "single" and summary["final_val_ppl"] is not None


@pytest.mark.parametrize("sig, code, made", [(signal.SIGTERM, 3, True), (signal.SIGINT, 130, True),
                                            (signal.SIGTERM, 3, False)])
def test_a_stop_while_torch_imports_is_one_line_and_keeps_no_folder_it_made(tmp_path, sig,
                                                                            code, made):
    """Catches a stop in the first seconds, torch and megatron-core still importing: a
    SIGTERM (the handler was installed after the imports) exited by the signal (-15, 143
    from a shell) with no line and left the folder it had created, empty; a Ctrl-C gave
    two tracebacks and exit 1 (the teardown imported half-initialised torch again); a
    stop raised inside the import broke it (numpy without ``matrix``: exit 1; a C++ frame:
    abort, exit -6), so it is held until the imports end.  Now one line and exit 3 or
    130; a folder the run made is removed, one that was there (empty) is kept, and the
    line says nothing was trained rather than how to resume."""
    import subprocess

    run_dir = tmp_path / "run"
    if not made:
        run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, str(REPO / "train.py"), "--run-dir", str(run_dir),
                             *SMALL], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,  # SIGINT as in a terminal
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:  # the phase's first line: the imports start now
            if "loading torch and megatron-core ..." in line:
                time.sleep(0.3)  # inside the import, not before it
                proc.send_signal(sig)
                break
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [x for x in err.splitlines() if x.strip()]
    assert proc.returncode == code and len(lines) == 1, (proc.returncode, err)
    assert "nothing to keep" in lines[0] and "resume" not in lines[0], err
    assert (f"removed {run_dir}" in lines[0]) == made and run_dir.exists() != made, err
    if sig == signal.SIGTERM:
        assert "stopped by signal 15" in lines[0], err


def test_a_finished_summary_is_not_replaced_by_a_partial_one(tmp_path):
    """Catches a stop in the seconds between the run writing its summary.json and
    returning (wandb closing) that replaced the full summary (zero-shot scores, device)
    with a partial one; a summary older than the run (a resumed folder's) is replaced."""
    import train
    from jobruntime.config import load_config

    cfg = load_config("tiny_gpt")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "tokens": 9, "time_s": 1.0})
                                            + "\n")
    outcome = {"started": time.time() - 60}
    (tmp_path / "summary.json").write_text(json.dumps({"mode": "single", "zero_shot": []}))
    assert train._write_partial_summary(cfg, tmp_path, outcome)["steps"] == 3
    assert "interrupted" not in json.loads((tmp_path / "summary.json").read_text())
    outcome["started"] = time.time() + 60  # the summary is older: an earlier run's
    train._write_partial_summary(cfg, tmp_path, outcome)
    assert json.loads((tmp_path / "summary.json").read_text())["interrupted"] is True


def test_a_sigterm_while_exiting_interrupted_is_ignored():
    """Catches the launcher's SIGTERM, arriving while a rank exits after a lost peer
    (bench/faults.py's cona_switch_killed: it came while exit_interrupted killed the
    rank's child processes), raising in train.py's SIGTERM handler: a traceback and exit 1
    instead of one line and exit 3."""
    import subprocess

    script = (
        "import os, signal\n"
        "from jobruntime import faults\n"
        "def handler(signum, frame):\n"
        "    raise RuntimeError('the SIGTERM handler ran mid-exit')\n"
        "signal.signal(signal.SIGTERM, handler)\n"
        "real = faults._exit_now\n"
        "def exit_now(code):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    real(code)\n"
        "faults._exit_now = exit_now\n"
        "faults.exit_interrupted('a peer was lost')\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3 and proc.stderr.strip() == "error: a peer was lost", proc.stderr


def test_summary_from_records_interpolates_ttp_and_counts_cona_switches():
    """Catches a partial summary (an interrupted run; compare_runs without summary.json)
    that leaves TTP, method or switches empty: TTP is interpolated in log perplexity
    between the evaluations either side of the target (by hand here), tokens of an
    evaluation record without them are the last seen, and CONA's switch and decision
    events are counted."""
    from jobruntime.metrics import summary_from_records

    config = {"train": {"target_ppl": 300.0}, "cona": {"enabled": True},
              "geomesh": {"method": "none"}}
    records = [
        {"clock": "wall", "event": "step", "step": 10, "samples": 16, "tokens": 1000,
         "time_s": 2.0, "val_ppl": 500.0},
        {"event": "decision", "step": 10, "time_s": 2.0, "switch": True, "best": "mb8"},
        {"event": "switch", "step": 10, "time_s": 2.5, "from": "mb4", "to": "mb8"},
        {"event": "step", "step": 20, "samples": 48, "tokens": 3000, "time_s": 4.0,
         "val_ppl": 400.0},
        {"event": "eval", "step": 25, "time_s": 6.0, "val_ppl": 200.0},
    ]
    s = summary_from_records(records, config)
    f = (math.log(400) - math.log(300)) / (math.log(400) - math.log(200))
    assert math.isclose(s["ttp_s"], 4.0 + f * 2.0) and s["ttp_step"] == 25
    assert s["ttp_tokens"] == 3000  # no tokens in the eval record: the last seen
    assert (s["method"], s["clock"], s["switches"], s["steps"]) == ("cona", "wall", 1, 25)
    # the keys a finished run's summary.json has beside them (it said "method" alone)
    assert (s["mode"], s["samples"], s["tokens"]) == ("cona", 48, 3000)
    assert s["final_val_ppl"] == 200.0 and len(s["decisions"]) == 1
    plain = summary_from_records(records[:1], {"train": {"target_ppl": None}})
    assert plain["method"] == plain["mode"] == "single" and plain["ttp_s"] is None
    assert "switches" not in plain
    geo = {"geomesh": {"method": "diloco"}, "cona": {"enabled": False}, "train": {}}
    assert summary_from_records([], geo)["method"] == "diloco"
    emulated = summary_from_records([{"clock": "emulated", "step": 1}], geo)
    assert (emulated["mode"], emulated["samples"]) == ("emulated", None)  # the cluster's mode
    assert emulated["outer_steps"] == emulated["steps"] == 1 and "outer_steps" not in plain
