"""Bad input to the tools and to CONA settings: one clear error, never a silent
wrong result (found by a fresh-user pass)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jobruntime.config import ConfigError, load_config
from jobruntime.data import DataError, read_documents
from tests.dist_utils import child_env

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("line, needle", [
    ({"ctx": "a", "endings": ["x", ""], "label": 1}, "non-empty string"),
    ({"ctx": "a", "endings": ["x", "y"]}, "'label'"),
    ({"ctx": "a", "endings": [], "label": 0}, "at least 2 endings"),
    ({"goal": "g", "sol1": "a", "sol2": "b", "label": 2}, "out of range"),
    ("garbage", "not valid JSON"),
], ids=["empty-ending", "no-label", "no-endings", "label-range", "not-json"])
def test_zero_shot_task_lines_are_checked(tmp_path, line, needle):
    """Catches an empty ending (log-likelihood 0: it always won, accuracy 1.0)
    and KeyError/JSON tracebacks; the message names file and line."""
    from tools.zero_shot import load_task

    f = tmp_path / "task.jsonl"
    good = {"ctx": "c", "endings": ["p", "q"], "label": 0}
    f.write_text(json.dumps(good) + "\n" + (line if isinstance(line, str) else json.dumps(line)))
    with pytest.raises(ValueError, match=needle) as err:
        load_task(f)
    assert f"{f}:2" in str(err.value)
    with pytest.raises(ValueError, match="not found"):
        load_task(tmp_path / "missing.jsonl")


def test_compare_runs_rejects_non_object_files_and_labels_cona(tmp_path):
    """Catches AttributeError on a summary.json that is a list and a JSON error
    that does not name the run; CONA runs (no 'method') show their mode."""
    from tools.compare_runs import format_row, load_run

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold an object"):
        load_run(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "summary.json").write_text("{bad")
    with pytest.raises(ValueError, match=f"{tmp_path / 'b'}: .*not valid JSON"):
        load_run(tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "summary.json").write_text(json.dumps({"mode": "cona", "clock": "wall"}))
    (tmp_path / "c" / "metrics.jsonl").write_text(json.dumps({"step": 1, "val_ppl": 9.0}) + "\n")
    assert format_row(load_run(tmp_path / "c"))["method"] == "cona"


def test_compare_runs_rejects_non_numbers_it_formats(tmp_path):
    """Catches ``ValueError: Unknown format code 'f' for object of type 'str'`` from the
    table on a summary value that is not a number: refused at load, naming file and key."""
    from tools.compare_runs import load_run

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "summary.json").write_text(json.dumps({"ttp_s": "x"}))
    with pytest.raises(ValueError, match=r"summary.json: ttp_s='x' is not a number"):
        load_run(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text(json.dumps({"step": 1, "val_ppl": [2]}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: val_ppl=\[2\] is not a number"):
        load_run(tmp_path / "b")


@pytest.mark.parametrize("tool, args", [
    ("compare_runs.py", ["{run}", "--out", "{file}"]),
    ("compare_runs.py", ["{run}", "--out", "{file}/sub"]),
    ("prepare_data.py", ["--input", "{run}/summary.json", "--output", "{file}/sub/prefix"]),
    ("convert_checkpoint.py", ["mcore-to-hf", "--model", "gpt", "--input", "{run}",
                               "--output", "{file}/sub"]),
], ids=["compare-out-is-file", "compare-out-under-file", "prepare-under-file",
        "convert-under-file"])
def test_output_folder_that_cannot_exist_is_one_line_exit_2(tmp_path, tool, args):
    """Catches FileExistsError / NotADirectoryError tracebacks (exit 1) when an output
    folder is, or lies under, a file (compare_runs printed its table first): one line
    naming the flag, before any work, nothing written."""
    (tmp_path / "afile").write_text("x")
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"ttp_s": 1.0}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "val_ppl": 9.0}) + "\n")
    args = [a.format(run=run, file=tmp_path / "afile") for a in args]
    proc = subprocess.run([sys.executable, str(REPO / "tools" / tool), *args],
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: --out") and "file" in lines[0], lines
    assert proc.stdout == ""  # no table, no summary before the error


def test_prepare_data_refuses_zero_max_documents(tmp_path):
    """Catches ``--max-documents 0`` silently meaning "no limit" (``docs[:0] if 0``)."""
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_data.py"), "--input",
                           str(REPO / "data" / "python-docs-3.11.jsonl.xz"), "--output",
                           str(tmp_path / "p"), "--max-documents", "0"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--max-documents 0 must be at least 1" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_non_string_text_fields_are_data_errors(tmp_path):
    """Catches 5, null or a list in the text field counted as documents."""
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": 5}) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2: 'text' is int, not a string"):
        read_documents(f)


@pytest.mark.parametrize("override, needle", [
    ("cona.decision_interval=0", "decision_interval"), ("cona.horizon_steps=0", "horizon_steps"),
    ("cona.min_gain=-1", "min_gain"), ("cona.num_gpus=0", "num_gpus"),
    ("cona.candidates=[]", "no candidate"), ("cona.gpu=FOO", "cona.gpu='FOO' is unknown"),
    ("cona.num_gpus=8", "cona.clock=emulated"), ("cona.start_slack=1", "start_slack"),
    ("cona.adam_beta2_batch=0", "adam_beta2_batch=0 must be a global batch from 1"),
])
def test_cona_settings_are_validated(override, needle):
    """Catches ValueError/KeyError tracebacks from the controller and GPU table,
    and options that were silently ignored (num_gpus=0, candidates=[], emulated
    settings on the wall clock)."""
    cfg = load_config("tiny_gpt", ["cona.enabled=true", override])
    with pytest.raises(ConfigError, match=needle):
        cfg.validate()
    load_config("tiny_gpt", ["cona.enabled=true"]).validate()


@pytest.mark.parametrize("overrides", [
    ["cona.enabled=true", "cona.clock=emulated", "cona.target_model=gpt3_13b"],
    ["geomesh.method=geomesh", "geomesh.cluster=geomesh/clusters/four_region.yaml",
     "geomesh.target_model=gpt3_13b"],
])
def test_a_target_model_that_names_no_preset_fails_at_validation(overrides, tmp_path):
    """Caught only when the emulated run built its target, after the data was prepared."""
    section = overrides[-1].split(".")[0]

    def validate(cfg):  # the job's sections, and GeoMesh's (geomesh.context calls it)
        cfg.validate()
        cfg.geomesh.validate()

    with pytest.raises(ConfigError, match=rf"{section}\.target_model='gpt3_13b' must name a "
                                          r"preset .*: config 'gpt3_13b' not found; did you mean"):
        validate(load_config("tiny_gpt", overrides))
    # a file that is there but is no job config (a cluster YAML) fails here too, named
    cluster = f"{section}.target_model=geomesh/clusters/four_region.yaml"
    with pytest.raises(ConfigError, match=rf"{section}\.target_model='geomesh/clusters/"
                                          r"four_region.yaml' must name a preset .*unknown config key"):
        validate(load_config("tiny_gpt", [*overrides[:-1], cluster]))
    # a job config whose model is invalid (it would divide by zero heads after the data)
    bad = tmp_path / "bad_model.yaml"
    bad.write_text("model:\n  num_attention_heads: 0\n")
    with pytest.raises(ConfigError, match=rf"{section}\.target_model='.*bad_model.yaml' must "
                                          r"name a preset .*num_attention_heads"):
        validate(load_config("tiny_gpt", [*overrides[:-1], f"{section}.target_model={bad}"]))
    validate(load_config("tiny_gpt", [*overrides[:-1], f"{section}.target_model=gpt3_1.3b"]))


def test_convert_rejects_missing_input_and_file_output(tmp_path):
    """Catches FileExistsError when --output is a file and a 'pass --config'
    hint for an input that does not exist; no warnings around the error line."""
    (tmp_path / "out.txt").write_text("x")
    for args, needle in [(["--input", tmp_path / "nope", "--output", tmp_path / "o"], "does not exist"),
                         (["--input", tmp_path, "--output", tmp_path / "out.txt"], "is a file")]:
        proc = subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"),
                               "mcore-to-hf", "--model", "gpt", *map(str, args)],
                              capture_output=True, text=True, timeout=300)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def _convert(*args, env=None):

    return subprocess.run([sys.executable, str(REPO / "tools" / "convert_checkpoint.py"),
                           *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**child_env(), **(env or {})})


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff"], ids=["broken", "list", "binary"])
def test_convert_rejects_unreadable_config_json(tmp_path, text):
    """Catches a JSONDecodeError traceback (exit 1) from an HF folder whose
    config.json is not a JSON object: a one-line error naming the file, exit 2."""
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_bytes(text.encode("latin-1"))
    proc = _convert("hf-to-mcore", "--model", "gpt", "--input", hf, "--output", tmp_path / "o")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "config.json" in lines[0], proc.stderr
    assert not (tmp_path / "o").exists()


def test_export_without_transformers_is_one_line_and_writes_nothing(tmp_path):
    """Catches a ModuleNotFoundError traceback after a half-written output (only
    tokenizer.model) when transformers is missing: one line naming the fix,
    exit 2, no output folder and no staging folder left."""
    fake = tmp_path / "site"
    (fake / "transformers").mkdir(parents=True)
    (fake / "transformers" / "__init__.py").write_text("raise ImportError('not installed')\n")
    out = tmp_path / "hf_out"
    proc = _convert("mcore-to-hf", "--model", "gpt", "--input", tmp_path, "--output", out,
                    env={"PYTHONPATH": f"{fake}:{REPO}"})
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "pip install transformers" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


def test_prepare_data_refuses_a_corpus_without_validation_documents(tmp_path, capsys):
    """Catches ``prepare_data`` writing a corpus that ``train.py`` then refuses: 3
    documents with ``--val-every 20`` hold out none (every 20th is held out), and the
    tool wrote ``OUT.bin/.idx/.json`` and exited 0.  Now: exit 2 before anything is
    written, one line naming the counts and the option to change; with ``--val-every 3``
    the same corpus is prepared (document 3 held out)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tools import prepare_data

    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n"
                                              for d in ("alpha beta", "beta gamma", "gamma")))
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "alpha": 2, "beta": 3, "gamma": 4},
                                     unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    out = tmp_path / "out" / "corpus"
    args = ["--input", str(tmp_path / "c.jsonl"), "--output", str(out), "--tokenizer",
            str(tmp_path / "tokenizer.json"), "--no-progress"]
    assert prepare_data.main([*args, "--val-every", "20"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "3 document(s) with --val-every=20 leave 3 for training and 0 for validation" in err
    assert "lower --val-every" in err
    assert not (tmp_path / "out").exists()  # nothing written, not even the folder
    assert prepare_data.main([*args, "--val-every", "3", "--max-documents", "2"]) == 2
    assert "(raise --max-documents)" in capsys.readouterr().err  # the cap is named too
    assert not (tmp_path / "out").exists()
    assert prepare_data.main([*args, "--val-every", "3"]) == 0
    summary = json.loads(out.with_suffix(".json").read_text())
    assert (summary["train_documents"], summary["val_documents"]) == (2, 1)


def test_compare_runs_marks_runs_that_did_not_finish(tmp_path, capsys):
    """Catches an interrupted or diverged run shown in the table like a finished one: a run
    killed without ``summary.json``, one with train.py's partial summary
    (``"interrupted": true``), one that diverged (``diverged_at_step``) and one whose
    summary stops before ``train.iters`` are marked after their name; a finished run,
    and one stopped early at its target with ``train.stop_at_target``, are not."""
    import yaml

    from tools import compare_runs

    def run(name, summary, steps, **train):
        d = tmp_path / name
        d.mkdir()
        (d / "config.yaml").write_text(yaml.safe_dump({"train": {"iters": 8, **train}}))
        (d / "metrics.jsonl").write_text("".join(
            json.dumps({"clock": "wall", "step": s, "tokens": 64 * s, "time_s": float(s),
                        "loss": 5.0}) + "\n" for s in range(1, steps + 1)))
        if summary is not None:
            (d / "summary.json").write_text(json.dumps(
                {"clock": "wall", "mode": "single", "steps": steps, "tokens": 64 * steps,
                 **summary}))
        return str(d)

    paths = [run("killed", None, 3), run("ctrl-c", {"interrupted": True}, 5),
             run("nan", {"diverged_at_step": 2}, 2), run("short", {}, 6),
             run("done", {}, 8), run("at-target", {"ttp_step": 4}, 4, stop_at_target=True)]
    assert compare_runs.main([*paths, "--out", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    names = [line.split("  ")[0] for line in table.splitlines()[2:8]]
    assert names == ["killed (interrupted at step 3)", "ctrl-c (interrupted at step 5)",
                     "nan (diverged at step 2)", "short (interrupted at step 6 of 8)",
                     "done", "at-target"], table
    csv_rows = (tmp_path / "out" / "runs.csv").read_text().splitlines()
    assert csv_rows[1].startswith("killed (interrupted at step 3),")
