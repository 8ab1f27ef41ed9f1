"""train.py end to end: outputs, resume, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tests.dist_utils import child_env

REPO = Path(__file__).resolve().parent.parent


def train(*args, cwd=REPO, timeout=600):
    env = {**child_env(), "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, str(REPO / "train.py"), *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def base_run(cache_dir, tmp_path_factory):
    """8 steps of tiny_gpt with evaluation and checkpoints every 4 steps."""
    run_dir = tmp_path_factory.mktemp("runs") / "base"
    proc = train("--run-dir", run_dir, "train.iters=8", "train.eval_interval=4",
                 "train.eval_iters=2", "checkpoint.save_interval=4", f"data.cache_dir={cache_dir}",
                 "train.target_ppl=100000",
                 f"train.zero_shot_tasks=[{REPO / 'tools/samples/piqa_synthetic.jsonl'}]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_run_writes_metrics_summary_and_wandb(base_run):
    """Catches a run that trains but loses its outputs: every field the issue
    lists must be in metrics.jsonl and summary.json, and an offline wandb run
    must exist."""
    run_dir, proc = base_run
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, 9))
    for r in records:
        assert {"step", "tokens", "time_s", "loss", "lr", "grad_norm", "tokens_per_s"} <= r.keys()
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [4, 8] and all("val_ppl" in r for r in evals)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["mode"] == "single" and summary["clock"] == "wall"
    assert summary["ttp_s"] is not None and summary["ttp_s"] == evals[0]["time_s"]
    assert summary["ttp_tokens"] == evals[0]["tokens"]
    assert summary["final_val_ppl"] == pytest.approx(evals[-1]["val_ppl"])
    assert summary["tokens"] == 8 * 8 * 256
    assert (run_dir / "config.yaml").is_file()
    assert list((run_dir / "wandb").glob("offline-run-*")), "no offline wandb run"
    assert str(run_dir.resolve()) in proc.stdout
    (zs,) = summary["zero_shot"]  # end-of-run zero-shot evaluation ran
    assert zs["task"] == "piqa_synthetic" and zs["n"] == 8 and 0 <= zs["accuracy"] <= 1


def test_resume_reproduces_uninterrupted_run(base_run, cache_dir, tmp_path):
    """Catches a resume that loses optimizer moments, LR schedule, RNG or data
    position: any of these changes the next losses by far more than 1e-5."""
    run_dir, _ = base_run
    resumed = tmp_path / "resumed"
    proc = train("--run-dir", resumed, "train.iters=8", "train.eval_interval=4",
                 "train.eval_iters=2", f"data.cache_dir={cache_dir}",
                 f"checkpoint.load={run_dir / 'checkpoints' / 'iter_0000004'}",
                 "train.target_ppl=100000")
    assert proc.returncode == 0, proc.stderr[-3000:]
    full = {r["step"]: r for r in read_metrics(run_dir)}
    again = read_metrics(resumed)
    assert [r["step"] for r in again] == [5, 6, 7, 8]
    for r in again:
        assert r["loss"] == pytest.approx(full[r["step"]]["loss"], abs=1e-5)
        assert r["lr"] == pytest.approx(full[r["step"]]["lr"], rel=1e-9)
    assert again[-1]["val_loss"] == pytest.approx(full[8]["val_loss"], abs=1e-5)


def test_a_resume_with_another_lr_schedule_is_refused_or_follows_the_choice(base_run, cache_dir,
                                                                           tmp_path):
    """Catches a resume that trained on the checkpoint's LR schedule while its config.yaml
    recorded another (megatron's scheduler takes the checkpoint's peak, warmup and decay:
    train.lr=0.001 on a 0.002 run trained at 0.00138 and 0.0011, break-test helper).
    Refused by default, naming the setting; ``checkpoint.optimizer_settings=config`` trains
    steps 5-8 on the new schedule; ``=checkpoint`` on the old one, which config.yaml
    then records."""
    from jobruntime.config import load_config
    from jobruntime.trainer import lr_scheduler

    run_dir, _ = base_run
    common = ["train.iters=8", "train.eval_interval=0", f"data.cache_dir={cache_dir}",
              f"checkpoint.load={run_dir / 'checkpoints' / 'iter_0000004'}", "train.lr=0.0007"]
    proc = train("--run-dir", tmp_path / "same", *common)
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert "train.lr: checkpoint 0.002, config 0.0007" in errors[0], errors
    assert "checkpoint.optimizer_settings=config" in errors[0], errors
    full = {r["step"]: r["lr"] for r in read_metrics(run_dir)}
    for how in ("config", "checkpoint"):
        proc = train("--run-dir", tmp_path / how, *common, f"checkpoint.optimizer_settings={how}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        lrs = {r["step"]: r["lr"] for r in read_metrics(tmp_path / how)}
        # no evaluation of its own: the final val ppl is the checkpoint's, at its step
        # (it was printed as this run's, break-test helper)
        summary = json.loads((tmp_path / how / "summary.json").read_text())
        assert summary["final_val_step"] == 4 and "(at step 4)" in proc.stdout, proc.stdout
        saved = load_config(str(tmp_path / how / "config.yaml"))
        if how == "config":
            sched = lr_scheduler(types.SimpleNamespace(param_groups=[]), saved.train)
            want = {}
            for step in range(5, 9):  # the step numbered s trains at num_steps = s - 1
                sched.num_steps = step - 1
                want[step] = sched.get_lr({})
            assert saved.train.lr == 0.0007
        else:
            want = {s: full[s] for s in range(5, 9)}
            assert saved.train.lr == 0.002
        assert lrs == pytest.approx(want, rel=1e-9), (lrs, want)


def test_a_run_whose_loss_becomes_nan_fails_and_saves_no_nan_checkpoint(base_run, cache_dir,
                                                                        tmp_path):
    """Catches a diverged run reported as done: with train.lr=1e6 the loss is NaN at step 2,
    the run stopped there but exited 0, its summary did not say so and it saved the NaN
    weights as the ``latest`` checkpoint that the resume advice loads (break-test helper).
    Now: exit 1 with one error line, ``diverged_at_step`` in summary.json, and the last
    checkpoint is the one before (step 4 of the base run, resumed here)."""
    run_dir, _ = base_run
    run = tmp_path / "nan"
    proc = train("--run-dir", run, "train.iters=8", "train.eval_interval=0", "train.lr=1e6",
                 "train.min_lr=0", "train.clip_grad=0", "checkpoint.save_interval=1",
                 "checkpoint.optimizer_settings=config", f"data.cache_dir={cache_dir}",
                 f"checkpoint.load={run_dir / 'checkpoints' / 'iter_0000004'}")
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 1 and len(errors) == 1 and "not finite" in errors[0], \
        proc.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    step = summary["diverged_at_step"]
    assert summary["steps"] == step and step < 8
    saved = sorted(p.name for p in (run / "checkpoints").glob("iter_*"))
    assert f"iter_{step:07d}" not in saved and all(int(n[5:]) < step for n in saved), saved


@pytest.mark.parametrize(
    "args, needle",
    [
        (["train.foo=1"], "unknown config key 'train.foo'"),
        (["train.iters=abc"], "train.iters"),
        (["data.path=no/such/file.jsonl"], "no/such/file.jsonl"),
        (["train.eval_iters=0"], "train.eval_iters"),
        (["data.path={tmp}/latin1.txt"], "not UTF-8"),
        (["data.path={tmp}/cut.jsonl.xz"], "cut.jsonl.xz could not be read"),
        (["data.path={tmp}/tiny.txt"], "lower the vocabulary size"),
        (["train.iters=2", "--run-dir", "{tmp}/tiny.txt"], "is a file"),  # intermixed
        (["--run-dir", "{tmp}/tiny.txt/sub"], "lies under"),  # was NotADirectoryError, exit 1
    ],
    ids=["bad-key", "bad-type", "missing-data", "no-eval", "not-utf8", "truncated-xz",
         "vocab-too-large", "run-dir-is-file", "run-dir-under-file"],
)
def test_bad_input_is_one_line_exit_2(args, needle, cache_dir, tmp_path):
    """Catches tracebacks or wrong exit codes on user errors."""
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 50)
    (tmp_path / "tiny.txt").write_text("hello world\nthis corpus is tiny\n")
    xz = (REPO / "data" / "python-docs-3.11.jsonl.xz").read_bytes()
    (tmp_path / "cut.jsonl.xz").write_bytes(xz[:5000])
    args = [a.format(tmp=tmp_path) for a in args]
    proc = train(*args, f"data.cache_dir={cache_dir}", "logging.wandb=disabled")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr


def test_model_too_large_for_the_machine_is_refused_before_the_build(cache_dir, tmp_path):
    """Catches a model that cannot fit reaching the build: ``model.hidden_size=131072`` on
    CPU printed 126 lines of megatron/torch traceback (DefaultCPUAllocator) and exited 1.
    It must be one line, exit 2, naming the estimated peak and the host's memory.  A lower
    bound that does not use the memory model: the layers' weights alone (12·L·h²
    parameters at 16 bytes with fp32 Adam) exceed the printed estimate's floor.  Then the
    limit is shared by the node's ranks (LOCAL_WORLD_SIZE, as torchrun sets it): at 10^5
    ranks even tiny_gpt is refused, and ``train.check_memory=false`` builds and trains it."""
    import re

    from jobruntime.memory import GIB, host_memory_bytes

    proc = train("model.hidden_size=131072", f"data.cache_dir={cache_dir}", "logging.wandb=disabled",
                 "--run-dir", tmp_path / "huge")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "does not fit" in lines[0], proc.stderr[-2000:]
    peak, limit = map(lambda x: float(x.replace(",", "")),
                      re.search(r"estimated peak ([\d,.]+) GiB .* > ([\d,.]+) GiB \(host memory\)",
                                lines[0]).groups())
    assert peak >= 16 * 12 * 4 * 131072**2 / GIB  # tiny_gpt: 4 layers
    assert limit == pytest.approx(host_memory_bytes() / GIB, abs=0.06)
    assert "train.check_memory=false" in lines[0] and not (tmp_path / "huge").exists()

    env = {**child_env(), "LOCAL_WORLD_SIZE": "100000"}
    small = ["train.iters=1", "train.eval_interval=0", f"data.cache_dir={cache_dir}",
             "logging.wandb=disabled"]
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *small, "--run-dir",
                           str(tmp_path / "shared")], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 2 and "/ 100000 ranks on this node" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *small, "train.check_memory=false",
                           "--run-dir", str(tmp_path / "allowed")], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [r["step"] for r in read_metrics(tmp_path / "allowed")] == [1]


def test_checkpoint_of_another_model_is_one_line_exit_2(base_run, cache_dir):
    """Catches loading a GPT checkpoint into a Llama model (shape errors deep in
    megatron, or worse, a partial load)."""
    run_dir, _ = base_run
    proc = train("--config", "tiny_llama", f"checkpoint.load={run_dir / 'checkpoints'}",
                 f"data.cache_dir={cache_dir}", "logging.wandb=disabled", "train.iters=1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "another model" in lines[0], proc.stderr


@pytest.mark.parametrize("damage", ["truncated-shard", "no-common", "no-metadata", "marker-only",
                                    "geomesh"])
def test_damaged_checkpoint_is_one_line_exit_2(base_run, cache_dir, tmp_path, damage):
    """Catches megatron tracebacks (or a partial load) from a checkpoint whose
    files were cut short or lost after its COMPLETE marker was written."""
    import shutil

    src = base_run[0] / "checkpoints" / "iter_0000004"
    ckpt = tmp_path / "iter_0000004"
    if damage == "geomesh":  # a GeoMesh outer-step checkpoint given to an ordinary run
        ckpt = tmp_path / "outer_0000002"
        ckpt.mkdir()
        (ckpt / "COMPLETE").write_text("step 2\n")
    elif damage == "marker-only":
        ckpt.mkdir()
        (ckpt / "COMPLETE").write_text("step 4\n")
    else:
        shutil.copytree(src, ckpt)
        if damage == "no-common":
            (ckpt / "common.pt").unlink()
        elif damage == "no-metadata":
            (ckpt / ".metadata").unlink()
        else:
            shard = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
            shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    proc = train(f"checkpoint.load={ckpt}", f"data.cache_dir={cache_dir}",
                 "logging.wandb=disabled", "train.iters=5", "--run-dir", tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    needle = "is a GeoMesh checkpoint" if damage == "geomesh" else "damaged or incomplete"
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    if damage == "geomesh":
        return
    # the converter reads checkpoints through the same guard (it raised megatron's
    # CheckpointingException on each of these four, exit 1, before jobruntime.checkpoint.reading)
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"),
                           "mcore-to-hf", "--model", "gpt", "--input", str(ckpt), "--output",
                           str(tmp_path / "hf"), "--config", str(base_run[0] / "config.yaml")],
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and "damaged or incomplete" in lines[-1], proc.stderr[-2000:]
    assert not (tmp_path / "hf").exists()


def test_full_size_presets_build_on_meta_with_published_sizes():
    """Catches architecture mistakes in the presets (a missing bias, an untied
    output layer, wrong FFN or KV heads): the counts are exact, not within a band (BERT-Large
    without its linear biases, 221,184 fewer, passed the old +-1.5 %).  References:
    Llama-3.2-1B as meta-llama/Llama-3.2-1B's safetensors hold it; BERT-Large as HF
    BertForMaskedLM of bert-large-uncased (335,141,888 of BertModel, less the pooler, plus
    the MLM head's transform and output bias; megatron's final norm stands in for the
    embedding norm); GPT-3 XL (Brown et al. 2020, Table 2.1: 24 layers, d 2048, context
    2048) with GPT-2's 50,257-token vocabulary and biases, as Cerebras-GPT 1.3B (GPT-Neo
    1.3B, without QKV biases, has 24 * 3 * 2048 fewer: 1,315,575,808)."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "model_sizes.py")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    models = json.loads(proc.stdout)["models"]
    assert models["llama3.2_1b"]["params"] == 1_235_814_400
    assert models["gpt3_1.3b"]["params"] == 1_315_723_264
    assert models["bert_large"]["params"] == 335_174_458
    for m in models.values():
        assert m["params"] == m["analytic_params"]


def test_run_folder_keeps_its_tokenizer_and_exports_to_hf(base_run, tmp_path):
    """Catches a run whose auto-trained tokenizer stays hidden in the data
    cache: the HF export then had no tokenizer and GPT-2's ids 50256 for
    bos/eos, outside this model's 4096-token vocabulary."""
    import sentencepiece as spm

    run_dir, _ = base_run
    sp = spm.SentencePieceProcessor(model_file=str(run_dir / "tokenizer.model"))
    assert sp.get_piece_size() == 4096
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"),
                           "mcore-to-hf", "--model", "gpt", "--input", str(run_dir / "checkpoints"),
                           "--output", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "tokenizer.model").read_bytes() == (run_dir / "tokenizer.model").read_bytes()
    hf = json.loads((out / "config.json").read_text())
    assert hf["eos_token_id"] == sp.eos_id() == hf["bos_token_id"]
    assert hf["pad_token_id"] == sp.pad_id() and hf["vocab_size"] >= 4096


@pytest.mark.slow  # ~80-140 s: 48 steps of the demo preset
def test_demo_preset_trains_without_loss_spikes(cache_dir, tmp_path):
    """Catches a demo preset at the edge of stability: at lr 2e-3 (warmup 100)
    one ordinary Adam step at step 35 (grad-norm 0.8, every weight moved by
    < 7e-4) lifted the loss of every sequence from 6.7 to 10.8 at step 36,
    grad-norm 18 then 48.  The demo's own settings, its first 48 steps: no
    loss more than 1.0 above the best of the 5 steps before it, and no
    gradient norm above 10 once past the first steps."""
    run_dir = tmp_path / "demo"
    proc = train("--run-dir", run_dir, "train.iters=48", "train.eval_interval=0",
                 f"data.cache_dir={cache_dir}", "logging.wandb=disabled")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(run_dir)
    loss = [r["loss"] for r in rows]
    assert len(loss) == 48
    jumps = {r["step"]: loss[i] - min(loss[max(i - 5, 0):i]) for i, r in enumerate(rows) if i}
    worst = max(jumps, key=jumps.get)
    assert jumps[worst] < 1.0, f"loss spike at step {worst}: +{jumps[worst]:.2f}"
    assert max(r["grad_norm"] for r in rows[10:]) < 10.0
