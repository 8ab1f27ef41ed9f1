"""What a new user meets in the first hour (issue 26): a run that says what it is
doing, a final checkpoint, honest resume advice, help text, typo suggestions.

One real 2-rank job (TP=2, gloo, output to pipes, a fresh cache and a 300-document
corpus so that the tokenizer is trained) is the shared fixture; the rest is pure logic.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from tests.dist_utils import child_env, popen_ranks

REPO = Path(__file__).resolve().parent.parent
PIQA = REPO / "tools" / "samples" / "piqa_synthetic.jsonl"
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
         "model.seq_length=32", "model.vocab_size=512", "parallel.global_batch_size=8",
         "parallel.micro_batch_size=2", "train.warmup_iters=1", "train.eval_iters=1",
         "train.target_ppl=1e9", "logging.wandb=disabled"]


@pytest.fixture(scope="module")
def piped_run(tmp_path_factory):
    """``train.py`` on 2 ranks (TP=2) as torchrun starts its workers, stdout and stderr
    to pipes: 4 steps, an evaluation every 2, zero-shot at the end, default checkpoint
    settings (``save_interval=0``), a fresh data cache (tokenizer training and
    tokenising run) on the corpus's first 300 documents."""
    root = tmp_path_factory.mktemp("first_hour")
    run_dir = root / "run"
    cmd = [sys.executable, str(REPO / "train.py"), "--run-dir", str(run_dir), *SMALL,
           f"data.cache_dir={root / 'cache'}", "data.max_documents=300", "parallel.tp=2",
           "train.iters=4", "train.eval_interval=2", f"train.zero_shot_tasks=[{PIQA}]"]
    ranks = popen_ranks(cmd, 2, REPO)
    try:
        outs = [p.communicate(timeout=600) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(ranks, outs):
        assert p.returncode == 0, err[-3000:]
    return run_dir, outs


def test_every_long_phase_logs_its_start_and_end_without_a_terminal(piped_run):
    """Catches the silent first minutes: with output to a file, tokenizer training,
    tokenising, the imports, the model build, the checkpoint save and the end-of-run
    evaluation printed nothing (2.5-3 min on a fresh clone), and progress showed only
    as a bar on a terminal.  Each phase must log a start line and a ``done in X s``
    line, and the steps a line every 5 % (here every step) and at each evaluation."""
    run_dir, outs = piped_run
    out = outs[0][0]  # stdout: stderr is for warnings and the one-line errors
    for what in ("loading torch and megatron-core", "training a 512-token SentencePiece "
                 "tokenizer on python-docs", "tokenising python-docs", "preparing the data",
                 "building the gpt model (2 layers, hidden 64, float32)",
                 f"saving checkpoint {run_dir / 'checkpoints' / 'iter_0000004'}",
                 "zero-shot evaluation on piqa_synthetic.jsonl"):
        start = [i for i, ln in enumerate(out.splitlines()) if what in ln and ln.endswith(" ...")]
        end = [i for i, ln in enumerate(out.splitlines())
               if what in ln and re.search(r": done in \d+\.\d s", ln)]
        assert len(start) == 1 and len(end) == 1 and start[0] < end[0], (what, out[-4000:])
    steps = re.findall(r"step (\d)/4  loss [\d.]+  val ppl (\S+)", out)
    assert [s for s, _ in steps] == ["1", "2", "3", "4"], out[-4000:]
    assert steps[0][1] == "-" and steps[1][1] != "-", steps  # evaluated at step 2
    assert "checkpoints/" in out  # the results line names the final checkpoint
    assert outs[0][1].strip() == "", outs[0][1][-3000:]  # nothing on stderr: no warnings


def test_cpu_run_prints_no_cuda_advice_or_common_state_notice(piped_run):
    """Catches megatron's noise on every CPU torchrun: the ``CUDA_DEVICE_MAX_CONNECTIONS``
    advice of its TP layers (no CUDA streams on CPU) on each rank, and rank 1's
    "common state dict differs from rank 0" warning at each save, caused by each rank
    saving its own clock (``extra.time_s``) in state that only rank 0 writes."""
    _, outs = piped_run
    for _, err in outs:
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in err, err[-3000:]
        assert "common state dict differs" not in err, err[-3000:]


def test_a_finished_run_has_a_final_checkpoint_for_zero_shot_at_another_layout(piped_run):
    """Catches a run that saves nothing by default (``checkpoint.save_interval=0``): the
    demo's zero-shot evaluation needed a rerun.  The final checkpoint (committed, at
    step 4) must hold the final weights: ``tools/zero_shot.py`` on it, in one process
    at ``parallel.tp=1`` (the TP=2 run's config overridden), scores the task as the
    run's own end-of-run evaluation did."""
    run_dir, _ = piped_run
    assert (run_dir / "checkpoints" / "iter_0000004" / "COMPLETE").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter_0000004"
    (ran,) = json.loads((run_dir / "summary.json").read_text())["zero_shot"]
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "zero_shot.py"), "--config",
                           str(run_dir / "config.yaml"), "--checkpoint", str(run_dir / "checkpoints"),
                           "--task", str(PIQA), "parallel.tp=1"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**child_env(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loading checkpoint" in proc.stderr and ": done in" in proc.stderr
    tool = json.loads(proc.stdout)
    assert (tool["n"], tool["accuracy"]) == (ran["n"], ran["accuracy"])
    assert tool["accuracy_norm"] == pytest.approx(ran["accuracy_norm"])


def test_one_process_at_a_tp2_layout_is_told_the_override():
    """Catches a one-line error that leaves the user to guess: a converted or saved
    TP=2 config on one process must name ``parallel.tp=1`` (checkpoints load at any
    layout)."""
    from jobruntime.config import ConfigError, load_config

    cfg = load_config("tiny_gpt", ["parallel.tp=2"])
    with pytest.raises(ConfigError, match=r"parallel\.tp=1 parallel\.pp=1"):
        cfg.validate(world_size=1)
    cfg = load_config("tiny_gpt", ["parallel.tp=4"])
    with pytest.raises(ConfigError, match=r"parallel\.tp=2 parallel\.pp=1"):
        cfg.validate(world_size=2)


def test_resume_advice_says_what_the_run_folder_holds(tmp_path):
    """Catches "resume with checkpoint.load" printed for a run that committed no
    checkpoint (``save_interval`` is 0 by default; a save cut short leaves only a
    ``.tmp`` folder): the advice must say the run starts again, and name the folder to
    load only where a complete checkpoint is there."""
    from jobruntime.faults import resume_advice

    ckpts = tmp_path / "checkpoints"
    for holds in ([], ["iter_0000004.tmp"]):
        for name in holds:
            (ckpts / name).mkdir(parents=True)
            (ckpts / name / "COMPLETE").write_text("step 4\n")  # written, not yet renamed
        advice = resume_advice(tmp_path)
        assert "cannot resume" in advice and "checkpoint.load" not in advice, advice
    for name in ("iter_0000002", "iter_0000004", "outer_0000001"):
        (ckpts / name).mkdir()
    (ckpts / "iter_0000002" / "COMPLETE").write_text("step 2\n")
    assert resume_advice(tmp_path) == (f"resume with --run-dir {tmp_path} checkpoint.load="
                                       f"{ckpts} (last complete checkpoint: iter_0000002)")
    (tmp_path / "config.yaml").write_text("name: x\n")  # the run's: the advice loads it
    assert resume_advice(tmp_path).startswith(f"resume with --config {tmp_path / 'config.yaml'} "
                                              f"--run-dir {tmp_path} checkpoint.load=")
    # a fine-tune started from a checkpoint's weights: its config says load_optimizer:
    # false, which the advised command refused (exit 2, break-test helper)
    (tmp_path / "config.yaml").write_text("checkpoint:\n  load_optimizer: false\n")
    assert f"checkpoint.load={ckpts} checkpoint.load_optimizer=true (" in resume_advice(tmp_path)


def test_the_resume_advice_goes_on_in_the_same_run_folder_as_configured(tmp_path):
    """Catches advice that named ``checkpoint.load`` alone: a user who followed it resumed
    into a new default folder (metrics.jsonl from the resumed step on, the old folder
    left ``"interrupted": true``) and with the default preset's settings (500 steps
    instead of 60, no periodic saves, config.yaml overwritten; another preset's
    checkpoint refused).  The advised arguments, parsed as ``train.py`` parses them,
    must claim the interrupted run's own folder, load from its checkpoints, and give the
    run's own settings (its saved config.yaml)."""
    import shlex

    from jobruntime.config import load_config, save_config
    from jobruntime.faults import resume_advice
    from jobruntime.outputs import claim_run_folder
    from train import parse_args

    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000010").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000010" / "COMPLETE").write_text("step 10\n")
    (run / "metrics.jsonl").write_text('{"step": 10}\n')
    original = load_config("tiny_llama", ["train.iters=60", "checkpoint.save_interval=10"])
    save_config(original, run / "config.yaml")
    words = shlex.split(resume_advice(run).removeprefix("resume with ").split(" (")[0])
    args = parse_args(words)
    load = dict(o.split("=", 1) for o in args.overrides)["checkpoint.load"]
    assert Path(args.run_dir) == run and Path(load) == run / "checkpoints"
    cfg = load_config(args.config, args.overrides)
    assert (cfg.name, cfg.model.family, cfg.train.iters, cfg.checkpoint.save_interval) == (
        "tiny_llama", "llama", 60, 10)
    folder = claim_run_folder(args.run_dir, tmp_path / "default", resume_from=load)
    try:
        assert folder.path == run and not folder.created
    finally:
        folder.release()


def test_interrupted_exit_adds_the_advice_once_the_run_folder_is_known(tmp_path):
    """Catches the exit path (exit code 3, one line) not giving the advice."""
    code = ("from jobruntime.faults import exit_interrupted, note_run_dir; "
            f"note_run_dir({str(tmp_path)!r}); exit_interrupted('[rank 0] lost a peer')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines() == [
        f"error: [rank 0] lost a peer; no complete checkpoint was committed in {tmp_path / 'checkpoints'}, "
        "so the run cannot resume: start it again (checkpoint.save_interval=N saves every N "
        "steps)"]


def test_progress_lines_without_a_terminal(caplog):
    """Catches progress that only a terminal sees, and CONA's units: without a TTY,
    one log line per 5 % of the run (steps, or samples where the batch changes) and
    one per evaluation; ``off`` says nothing.  The clock shows tenths below 10 s (an
    emulated CONA run's first lines said ``0 s``)."""
    from jobruntime.logging_utils import StepProgress

    log = logging.getLogger("test.progress")

    def lines(mode, total, done, unit="step", evaluated=(), time_s=0.0):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="test.progress"):
            p = StepProgress(mode, enabled=True, total=total, unit=unit, logger=log)
            for i, d in enumerate(done, 1):
                p.update(d, step=i, loss=1.0, val_ppl=None, tokens_per_s=None,
                         time_s=time_s * i, evaluated=i in evaluated)
            p.close()
        return [r.getMessage() for r in caplog.records]

    got = lines("auto", 40, range(1, 41), evaluated={5}, time_s=0.12)
    assert [int(m.split()[1].split("/")[0]) for m in got] == [2, 4, 5, *range(6, 41, 2)]
    assert got[0] == "step 2/40  loss 1.000  val ppl -  0.2 s"  # an emulated clock: was "0 s"
    assert lines("auto", 40, range(1, 41), time_s=151.0)[-1].endswith("  6,040 s")
    assert lines("auto", 40, range(1, 41), time_s=9.96 / 40)[-1].endswith("  10 s")  # not 10.0
    # CONA: samples, batches of 24 then 48; a line at each 5 % (50 samples) crossed
    done = [24 * i for i in range(1, 11)] + [240 + 48 * i for i in range(1, 17)]
    got = lines("auto", 1000, done, unit="sample")
    crossed = [i for i, (a, b) in enumerate(zip([0, *done], done), 1) if b // 50 > a // 50]
    assert [int(m.split()[1]) for m in got] == crossed and crossed[:3] == [3, 5, 7]
    assert got[0] == "step 3 (72/1000 samples)  loss 1.000  val ppl -  0.0 s"
    assert got[-1].startswith("step 26 (1008/1000 samples)")
    assert lines("off", 40, range(1, 41)) == []


def test_unknown_key_suggests_the_near_miss():
    """Catches an unknown-key error that lists every valid key but suggests none: a
    misspelt key or value, a key given in the wrong section, a misspelt preset name
    get a "did you mean"; a key like nothing gets none; valid keys are still listed."""
    from jobruntime.config import ConfigError, load_config

    def error(*overrides, preset="tiny_gpt"):
        with pytest.raises(ConfigError) as e:
            load_config(preset, list(overrides)).validate_sections()
        return str(e.value)

    msg = error("train.itres=3")
    assert "did you mean 'train.iters'?" in msg and "valid keys here: adam_beta1" in msg
    assert "did you mean 'checkpoint.save_interval'" in error("train.save_interval=5")
    assert "did you mean 'train'?" in error("trian.iters=3")
    assert "did you mean 'logging.progress'?" in error("logging.progres=on")
    assert "did you mean 'gpt'?" in error("model.family=gtp")
    assert "did you mean 'tiny_gpt'" in error(preset="tiny_gtp")
    msg = error("train.foo=1")
    assert "did you mean" not in msg and "valid keys here:" in msg


def test_help_has_no_broken_line_continuation():
    """Catches ``train.py --help`` printing a shell command joined into one line: the
    module docstring's ``\\`` at a line end was a Python line continuation (the
    docstring was not raw), so the help showed ``c10d        --rdzv-endpoint``.  Every
    backslash in the help must end a line that the next, indented, line continues; and
    no string literal in the project may end a line with an unescaped backslash.  The
    help names the page that lists every override key (it named none), in plain text
    (it showed the docstring's ``Usage::`` and double backticks)."""
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.split("positional arguments:")[0].splitlines()  # the description
    for i, line in enumerate(lines):
        assert "\\" not in line.rstrip()[:-1], line
        if line.rstrip().endswith("\\"):
            assert lines[i + 1].startswith(" " * (len(line) - len(line.lstrip()) + 1)), lines[i + 1]
        assert not re.search(r"\S {4,}\S", line.strip()), f"a joined line: {line!r}"
    assert any("--rdzv-backend c10d \\" in ln for ln in lines)
    reference = re.search(r"docs/configuration\.md", " ".join(proc.stdout.split()))  # the keys
    assert reference and (REPO / reference.group(0)).is_file(), proc.stdout
    assert "``" not in proc.stdout and "::" not in proc.stdout, "reStructuredText markup"
    for path in [*REPO.glob("*.py"), *REPO.glob("*/**/*.py")]:
        if path.relative_to(REPO).parts[0] in {".git", "build", ".venv", "runs"}:
            continue
        with path.open() as f:
            for tok in tokenize.generate_tokens(f.readline):
                body = tok.string.lstrip("rbuRBUfF")
                if tok.type != tokenize.STRING or "r" in tok.string[:len(tok.string) - len(body)].lower():
                    continue
                odd = [m for m in re.finditer(r"(\\+)\n", tok.string) if len(m.group(1)) % 2]
                assert not odd, f"{path}:{tok.start[0]}: a string ends a line with a backslash"


def test_run_folder_refusal_suggests_a_resume_only_from_a_checkpoint(tmp_path):
    """Catches ``--run-dir`` of an interrupted run without a checkpoint being refused
    with "resume that run with checkpoint.load=DIR/checkpoints", a folder that does not
    exist: it must say there is nothing to resume from and to give a new folder; with a
    complete checkpoint (not a ``.tmp`` one) it names checkpoint.load."""
    from jobruntime.outputs import RunFolderError, claim_run_folder

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoints" / "iter_0000004.tmp").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000004.tmp" / "COMPLETE").write_text("step 4\n")
    with pytest.raises(RunFolderError) as e:
        claim_run_folder(run, "unused")
    assert "nothing to resume from; give a new folder" in str(e.value), e.value
    assert "checkpoint.load" not in str(e.value)
    (run / "checkpoints" / "iter_0000002").mkdir()
    (run / "checkpoints" / "iter_0000002" / "COMPLETE").write_text("step 2\n")
    with pytest.raises(RunFolderError, match=f"checkpoint.load={run / 'checkpoints'} and"):
        claim_run_folder(run, "unused")


def test_no_message_advises_checkpoint_load_without_looking():
    """Catches resume advice written into messages ("restart all regions from the last
    checkpoint (checkpoint.load)", CONA's "resume from the last checkpoint
    (checkpoint.load) at either layout"): printed whether or not a checkpoint exists,
    and followed by exit_interrupted's own advice, which may say the opposite.  Only
    :func:`jobruntime.faults.resume_advice` and the run-folder check may suggest it."""
    offenders = []
    for path in [*REPO.glob("*.py"), *REPO.glob("*/**/*.py")]:
        if path.relative_to(REPO).parts[0] in {"tests", ".git", "build", ".venv", "runs"}:
            continue
        with path.open() as f:
            for tok in tokenize.generate_tokens(f.readline):
                if tok.type == tokenize.STRING and re.search(r"(last|a) checkpoint \(checkpoint\.load\)|"
                                                             r"resume from the last checkpoint",
                                                             tok.string):
                    offenders.append(f"{path.relative_to(REPO)}:{tok.start[0]}")
    assert not offenders, offenders


@pytest.mark.parametrize("cmd, needle", [
    (["train.py", "parallel.global_batch_size=7"],
     "error: parallel.global_batch_size=7 is not a multiple of micro_batch_size*dp=4*1"),
    (["train.py", "parallel.global_batch_size=33554432"],  # hung in megatron's dataset index
     "error: parallel.global_batch_size=33554432 must be at most 16777216 sequences"),
    (["train.py", "data.path=data/missing.jsonl"],  # was told after megatron's import
     "error: data file 'data/missing.jsonl' not found"),
    (["train.py", "geomesh.method=geomesh", "geomesh.cluster=four_regoin"],
     "error: cluster 'four_regoin' not found; did you mean 'four_region'?"),
    (["train.py", "geomesh.method=geomesh", "geomesh.cluster=four_region", "geomesh.outer_lr=0"],
     "error: geomesh.outer_lr must be a positive number"),
    (["train.py", "cona.efficiency_correction=progress"],  # trained without CONA, exit 0
     "error: override 'cona.efficiency_correction=progress' has no effect: cona is off"),
    (["train.py", "geomesh.outer_steps=3"],  # trained one ordinary job, exit 0
     "error: override 'geomesh.outer_steps=3' has no effect: geomesh is off"),
    (["train.py", "geomesh={outer_steps: 3}"],  # a section given whole: was not checked
     "error: override 'geomesh={outer_steps: 3}' has no effect: geomesh is off"),
    (["train.py", "geomesh.method=diloco", "geomesh.cluster=four_region", "parallel.tp=2"],
     "error: override 'parallel.tp=2' has no effect: a GeoMesh run takes each region's layout"),
    (["train.py", "geomesh.method=geomesh", "geomesh.cluster=four_region", "train.iters=4"],
     "error: override 'train.iters=4' has no effect: a GeoMesh run does not read it"),  # 10 rounds
    (["train.py", "geomesh.method=ddp", "geomesh.cluster=four_region", "geomesh.outer_lr=0.5"],
     "error: override 'geomesh.outer_lr=0.5' has no effect: geomesh.method=ddp does not read it"),
    (["train.py", "cona.enabled=true", "cona.clock=emulated", "parallel.tp=2"],
     "error: override 'parallel.tp=2' has no effect: CONA's emulated clock picks the start"),
    (["train.py", "geomesh.method=diloco", "geomesh.cluster=four_region", "geomesh.overlap=0.1"],
     "error: override 'geomesh.overlap=0.1' has no effect: geomesh.method=diloco does not read"),
    (["train.py", "geomesh.method=geomesh", "geomesh.cluster=four_region", "geomesh.fragments=4"],
     "error: override 'geomesh.fragments=4' has no effect: geomesh.method=geomesh does not read"),
    (["train.py", "geomesh.method=geomesh", "geomesh.cluster=four_region", "geomesh.heartbeat_s=3"],
     "error: override 'geomesh.heartbeat_s=3' has no effect: the cluster runs in emulated mode"),
    (["train.py", "cona.enabled=true", "cona.step_dilation=4"],  # ignored on the wall clock
     "error: cona.step_dilation applies to the emulated clock"),
    (["train.py", "cona.enabled=true", "cona.schedule=[{after_step: 2, region: a, tp: 2, pp: 1}]"],
     "error: cona.schedule switches the layouts of GeoMesh regions; it needs a GeoMesh run"),
    (["train.py", "cona.enabled=true", "train.zero_shot_tasks=[tools/samples/piqa_synthetic.jsonl]"],
     "error: train.zero_shot_tasks scores the model after an ordinary job"),
    # it trained nothing (a real-mode checkpoint's budget used up) or went on at time 0
    (["train.py", "cona.enabled=true", "cona.clock=emulated", "checkpoint.load=runs/x/checkpoints"],
     "error: CONA's emulated clock cannot resume a run"),
    # GeoMesh resumed the whole state anyway (it has no weights-only start)
    (["train.py", "geomesh.method=diloco", "geomesh.cluster=four_region", "checkpoint.load=x",
      "checkpoint.load_optimizer=false"], "error: geomesh.method=diloco resumes a run's whole"),
    (["tools/convert_checkpoint.py", "hf-to-mcore", "--model", "llama", "--input", "hf/missing",
      "--output", "unused"], "error: --input hf/missing does not exist"),
    (["tools/zero_shot.py", "--config", "tiny_gpt", "--checkpoint", "runs/missing/checkpoints",
      "--task", str(PIQA)], "error: --checkpoint runs/missing/checkpoints does not exist"),
])
def test_config_and_path_errors_come_before_megatron_is_imported(cmd, needle, tmp_path):
    """Catches errors that need only the config, the cluster file name or a path, told
    after 40 s of megatron-core import and data preparation: an indivisible global batch,
    a misspelt cluster (with a "did you mean" as config keys have), a bad GeoMesh
    setting, an override the job would ignore (a CONA or GeoMesh key with the feature off,
    a layout or CONA key in a GeoMesh run, an emulated-clock key on the wall clock,
    ``cona.schedule`` without GeoMesh, zero-shot tasks after a CONA run: each trained
    without it and exited 0), a missing conversion input or zero-shot checkpoint.  ``-X importtime``
    lists every module imported: megatron must not be among them."""
    run = tmp_path / "run"
    args = [*cmd, "--run-dir", str(run)] if cmd[0] == "train.py" else cmd
    proc = subprocess.run([sys.executable, "-X", "importtime", str(REPO / args[0]), *args[1:]],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "RANK"})
    errors = [ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1 and errors[0].startswith(needle), errors
    assert " megatron" not in proc.stderr, "megatron-core was imported before the error"
    assert not run.exists()


def test_progress_lines_show_val_ppl_only_where_it_was_evaluated(caplog):
    """Catches the every-5 % lines repeating the last validation perplexity on steps that
    ran no evaluation (steps 25, 30, 35 all showed step 20's value, read as three
    evaluations): the value appears on the evaluating step's line only."""
    from jobruntime.logging_utils import StepProgress

    log = logging.getLogger("test.progress")
    with caplog.at_level(logging.INFO, logger="test.progress"):
        p = StepProgress("auto", enabled=True, total=40, logger=log)
        for step in range(1, 41):
            p.update(step, step=step, loss=1.0, val_ppl=None if step < 5 else 350.6,
                     tokens_per_s=None, time_s=0.0, evaluated=step == 5)
    shown = {int(m.split()[1].split("/")[0]): m.split("val ppl ")[1].split()[0]
             for m in (r.getMessage() for r in caplog.records)}
    assert shown[5] == "350.6" and {s: v for s, v in shown.items() if v != "-"} == {5: "350.6"}
    assert {2, 4, 6, 40} <= shown.keys()


def test_results_line_of_a_run_without_a_target(monkeypatch, tmp_path, capsys):
    """Catches ``target None`` (and a TTP "not reached" that no target could be) on the
    results line of a run without ``train.target_ppl``: it says ``no target``; a run
    with one keeps ``target 300, TTP ...``; thousands are grouped as in the progress lines
    (``1024000 tokens``).  The log line at the target names its evaluation's time, which
    a user read against the results line's interpolated TTP."""
    import signal as signal_module

    import jobruntime.loop
    import train

    summary = {"final_val_ppl": 350.64, "target_ppl": None, "ttp_s": None, "tokens": 512}
    monkeypatch.setattr(jobruntime.loop, "run", lambda cfg, run_dir: dict(summary))
    monkeypatch.setattr(signal_module, "signal", lambda *a: None)  # keep pytest's handlers
    monkeypatch.delenv("RANK", raising=False)
    assert train.main(["--run-dir", str(tmp_path / "a")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == "final val ppl 350.6, no target, 512 tokens", line
    summary.update(target_ppl=300.0, ttp_s=12.34, clock="wall")
    assert train.main(["--run-dir", str(tmp_path / "b")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == "final val ppl 350.6, target 300, time to target (TTP) 12.3 s (wall clock), 512 tokens", line
    summary.update(ttp_s=4515.34, tokens=1024000)  # grouped as the progress lines are
    assert train.main(["--run-dir", str(tmp_path / "c")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.endswith("(TTP) 4,515.3 s (wall clock), 1,024,000 tokens"), line
    from jobruntime.metrics import target_reached_line  # the log line says which is which

    assert target_reached_line(300.0, "step 125", 99.94, "wall") == (
        "target perplexity 300 reached at the evaluation of step 125 (99.9 s, wall clock; "
        "TTP is interpolated between evaluations)")


def test_a_data_path_that_cannot_be_read_is_refused_by_its_resolution(tmp_path, monkeypatch):
    """Catches what ``train.check_config`` passed and data preparation then crashed on
    with a traceback (``FileNotFoundError`` from ``stat``): an indexed-dataset prefix with
    its ``.bin`` but not its ``.idx``; a ``data.path`` naming the ``.bin`` itself (read as
    text after a tokenizer trained on it); and an empty ``data.path``, which resolved to
    the working folder."""
    from jobruntime.documents import DataError, resolve_data_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.bin").write_bytes(b"\0")
    with pytest.raises(DataError, match=r"corpus\.bin has no .*corpus\.idx beside it"):
        resolve_data_path("corpus")
    (tmp_path / "corpus.idx").write_bytes(b"\0")
    assert resolve_data_path("corpus") == tmp_path / "corpus"
    # the .bin named itself: read as text after a tokenizer trained on it, "unknown format"
    with pytest.raises(DataError, match=r"names one file of an indexed dataset; give its "
                                        r"prefix, data.path=.*corpus"):
        resolve_data_path("corpus.bin")
    with pytest.raises(DataError, match="data.path is empty"):
        resolve_data_path(" ")


def test_a_missing_absolute_data_path_names_no_folder_it_was_not_looked_in(tmp_path,
                                                                          monkeypatch):
    """Catches a missing absolute ``data.path`` reported as "(looked in <cwd>)", a folder
    an absolute path is never read from; it names the missing folder, or the file that
    stands where a folder should, where that is the problem."""
    from jobruntime.documents import DataError, resolve_data_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    for missing, where in [(tmp_path / "none.jsonl", r"not found; set"),
                           (tmp_path / "no_dir" / "x.jsonl", r"\(no folder .*no_dir\)"),
                           (tmp_path / "file" / "x.jsonl", r"\(.*file is not a folder\)")]:
        with pytest.raises(DataError, match=rf"'{missing}' not found") as e:
            resolve_data_path(str(missing))
        assert "looked in" not in str(e.value) and re.search(where, str(e.value)), e.value
    with pytest.raises(DataError, match=r"looked in .*" + re.escape(str(tmp_path))):
        resolve_data_path("none.jsonl")  # a relative path: where it was looked for


def test_a_home_folder_in_an_override_is_expanded(tmp_path, monkeypatch):
    """Catches ``data.cache_dir=~/cache`` making a folder named ``~`` in the working
    directory and ``data.tokenizer=~/tok.model`` "not found": the shell expands no ``~``
    after ``section.key=``, so the config loader does, in every key that names a path
    (list items and a section given whole too), and in no other key."""
    from jobruntime.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config("tiny_gpt", ["data.path=~/corpus.jsonl", "data={cache_dir: ~/cache}",
                                   "checkpoint.load=~/ckpt", "train.zero_shot_tasks=[~/p.jsonl]",
                                   "logging.name=~run"])
    assert (cfg.data.path, cfg.data.cache_dir, cfg.checkpoint.load) == (
        f"{tmp_path}/corpus.jsonl", f"{tmp_path}/cache", f"{tmp_path}/ckpt")
    assert cfg.train.zero_shot_tasks == [f"{tmp_path}/p.jsonl"]
    assert cfg.logging.name == "~run"  # a name, not a path


def test_a_geomesh_run_reads_only_the_cona_keys_of_a_layout_switch():
    """Catches a ``cona.*`` override that a GeoMesh run with a layout schedule ignores
    (its regions switch on ``cona.schedule``; CONA's controller does not run) accepted,
    or ``cona.switch_timeout_s``, which a region's switch does read, refused."""
    from jobruntime.config import ConfigError, check_overrides_used, load_config

    base = ["geomesh.method=geomesh", "geomesh.cluster=four_region", "cona.enabled=true",
            "cona.schedule=[{after_step: 1, region: West Europe, tp: 2, pp: 1}]"]
    for key, read in [("cona.switch_timeout_s=60", True), ("cona.min_gain=0.1", False),
                      ("cona.clock=emulated", False)]:
        cfg = load_config("tiny_gpt", [*base, key])
        if read:
            check_overrides_used(cfg, [*base, key])
        else:
            with pytest.raises(ConfigError, match=rf"'{key}' has no effect: a GeoMesh run "
                                                  "reads only cona.schedule"):
                check_overrides_used(cfg, [*base, key])


@pytest.mark.parametrize("job, key", [
    (["geomesh.method=geomesh", "geomesh.cluster=two_worker"], "checkpoint.save_final=true"),
    (["cona.enabled=true", "cona.clock=emulated"], "checkpoint.save_interval=10"),
    (["cona.enabled=true", "cona.clock=emulated"], "checkpoint.save_final=true"),
    (["cona.enabled=true", "cona.clock=emulated"], "checkpoint.keep_last=2"),
    (["cona.enabled=true", "cona.clock=emulated"], "cona.switch_timeout_s=60"),
    (["geomesh.method=async", "geomesh.cluster=two_worker"], "checkpoint.save_final=true"),
    (["geomesh.method=streaming_diloco", "geomesh.cluster=two_worker"], "checkpoint.keep_last=2"),
])
def test_saving_and_switch_keys_a_job_does_not_read_are_refused(job, key):
    """Catches overrides accepted and ignored: ``checkpoint.save_final`` in a GeoMesh run
    (it saves by ``save_interval``), the saving keys on CONA's emulated clock (its proxy
    saves nothing) and ``cona.switch_timeout_s`` there (no real switch runs); any
    checkpoint key with async or Streaming DiLoCo, whose message must not send the user
    to ``save_interval`` (those methods refuse it).  The same keys where they are read
    (an ordinary run, CONA's wall clock) stay accepted."""
    from jobruntime.config import ConfigError, check_overrides_used, load_config

    cfg = load_config("tiny_gpt", [*job, key])
    with pytest.raises(ConfigError, match=rf"'{key}' has no effect") as e:
        check_overrides_used(cfg, [*job, key])
    if job[0] in ("geomesh.method=async", "geomesh.method=streaming_diloco"):
        # not "set checkpoint.save_interval": these methods refuse it (a circle)
        assert "saves and loads no checkpoints" in str(e.value), e.value
    for reads in ([], ["cona.enabled=true"]):
        if key.startswith("cona.") and not reads:
            continue
        check_overrides_used(load_config("tiny_gpt", [*reads, key]), [*reads, key])


def test_checkpoint_optimizer_settings_is_refused_where_no_resume_reads_it():
    """Catches ``checkpoint.optimizer_settings`` accepted and ignored by CONA, which trains
    with its config's settings on a resume (review helper), by the GeoMesh methods that
    load no checkpoint, and by a run that resumes nothing (break-test helper); an
    ordinary run's and a GeoMesh run's resume read it."""
    from jobruntime.config import ConfigError, check_overrides_used, load_config

    key = "checkpoint.optimizer_settings=config"
    for job, why in ((["cona.enabled=true"], "CONA trains with its config's"),
                     (["geomesh.method=async", "geomesh.cluster=two_worker"],
                      "saves and loads no checkpoints")):
        with pytest.raises(ConfigError, match=why):
            check_overrides_used(load_config("tiny_gpt", [*job, key]), [*job, key])
    for job in ([], ["geomesh.method=geomesh", "geomesh.cluster=two_worker"]):
        given = [*job, key, "checkpoint.load=/runs/a/checkpoints"]
        check_overrides_used(load_config("tiny_gpt", given), given)
        with pytest.raises(ConfigError, match="this run resumes nothing"):  # no resume
            check_overrides_used(load_config("tiny_gpt", [*job, key]), [*job, key])


@pytest.mark.parametrize("job", [["cona.enabled=true", "cona.clock=emulated"],
                                 ["geomesh.method=async", "geomesh.cluster=two_worker"],
                                 ["geomesh.method=streaming_diloco", "geomesh.cluster=two_worker"]])
def test_asking_a_job_that_saves_nothing_to_save_nothing_is_accepted(job):
    """Catches a script that always passes ``checkpoint.save_interval=0`` (or
    ``save_final=false``, ``load=null``) refused by a job that saves and loads nothing:
    that is what the job does.  A value that asks for saving stays refused, and in a
    GeoMesh run, which saves by ``save_interval``, ``save_final`` is refused either way."""
    from jobruntime.config import ConfigError, check_overrides_used, load_config

    for off in (["checkpoint.save_interval=0"], ["checkpoint.save_final=false"],
                ["checkpoint.load=null"], ["checkpoint={save_interval: 0, save_final: false}"]):
        check_overrides_used(load_config("tiny_gpt", [*job, *off]), [*job, *off])
    for on in ("checkpoint.save_interval=5", "checkpoint={save_interval: 0, save_final: true}"):
        with pytest.raises(ConfigError, match="has no effect"):
            check_overrides_used(load_config("tiny_gpt", [*job, on]), [*job, on])
    sync = ["geomesh.method=geomesh", "geomesh.cluster=two_worker", "checkpoint.save_final=false"]
    with pytest.raises(ConfigError, match="saves every checkpoint.save_interval"):
        check_overrides_used(load_config("tiny_gpt", sync), sync)


def test_a_home_folder_in_the_run_folder_and_config_options(tmp_path, monkeypatch):
    """Catches ``--run-dir=~/rd`` (the shell expands no ``~`` after ``=``) making a folder
    named ``~`` that held a whole run, and ``--config=~/job.yaml`` "not found"."""
    import train
    from jobruntime.config import resolve_preset

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "job.yaml").write_text("train: {iters: 3}\n")
    assert resolve_preset("~/job.yaml") == tmp_path / "job.yaml"
    assert train.parse_args(["--run-dir=~/rd"]).run_dir == str(tmp_path / "rd")
