"""A diverged run's outputs are strict JSON, and its diverged step is not evaluated.

``tiny_gpt`` (2 layers, width 64) at ``train.lr=1e6`` without warmup or clipping: step 1's
loss (before its update) is finite, its Adam update breaks the weights, and from then on
every loss is NaN: step 2's training loss, or step 1's validation loss where step 1 is
evaluated.  Python's ``json`` writes such values as the bare token ``NaN``, which strict
parsers (``jq``, JavaScript) reject: every file is parsed here with ``parse_constant``
raising on ``NaN``/``Infinity``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.dist_utils import launch

TINY = ["model.num_layers=2", "model.hidden_size=64", "model.seq_length=64",
        "logging.wandb=disabled", "logging.progress=off", "train.iters=6", "train.eval_iters=1",
        "train.lr=1e6", "train.min_lr=0", "train.clip_grad=0", "train.warmup_iters=0",
        "train.log_interval=100"]


def _strict(text: str):
    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def _strict_lines(path: Path) -> list[dict]:
    return [_strict(line) for line in path.read_text().splitlines()]


def test_metrics_writer_and_json_files_write_non_finite_numbers_as_null(tmp_path):
    """Catches ``NaN``/``Infinity`` written into metrics.jsonl and summary.json (and every
    file written with ``write_json_atomic``): non-finite floats, numpy scalars and 0-d
    tensors become ``null``; finite ones are kept exactly."""
    import numpy as np
    import torch

    from jobruntime.metrics import MetricsWriter, json_text, write_json_atomic

    w = MetricsWriter(tmp_path, wandb_mode="disabled")
    w.log({"step": 1, "loss": math.nan, "grad_norm": math.inf, "lr": 1e-3,
           "val_loss": np.float32("nan"), "tokens_per_s": torch.tensor(-math.inf)})
    w.summary({"final_val_ppl": math.nan, "evals": [{"val_ppl": math.inf}, (1.5, math.nan)]})
    w.close()
    (rec,) = _strict_lines(tmp_path / "metrics.jsonl")
    assert rec == {"clock": "wall", "step": 1, "loss": None, "grad_norm": None, "lr": 1e-3,
                   "val_loss": None, "tokens_per_s": None}
    summary = _strict((tmp_path / "summary.json").read_text())
    assert summary["final_val_ppl"] is None
    assert summary["evals"] == [{"val_ppl": None}, [1.5, None]]
    write_json_atomic(tmp_path / "r.json", {"x": np.float64("inf"), "y": np.int64(3)})
    assert _strict((tmp_path / "r.json").read_text()) == {"x": None, "y": 3}
    assert _strict(json_text([torch.tensor(2.5), math.pi])) == [2.5, math.pi]
    with pytest.raises(TypeError, match="not JSON serializable"):
        json_text({"x": object()})


def _diverge(cache_dir: str, root: str) -> dict:
    """Two diverging runs through ``train.main``; returns their exit codes."""
    import torch

    torch.set_num_threads(1)
    import train

    data = f"data.cache_dir={cache_dir}"
    return {
        # step 1 not evaluated; step 2's training loss is NaN and step 2 is an eval step
        "train_nan": train.main(["--config", "tiny_gpt", "--run-dir", f"{root}/train_nan",
                                 *TINY, data, "train.eval_interval=2"]),
        # step 1 evaluated on the weights its update broke: validation loss NaN
        "val_nan": train.main(["--config", "tiny_gpt", "--run-dir", f"{root}/val_nan", *TINY,
                               data, "train.eval_interval=1", "checkpoint.save_interval=1"]),
        # the same in a real-mode CONA run (its own loop)
        "cona_val_nan": train.main(["--config", "tiny_gpt", "--run-dir", f"{root}/cona_val_nan",
                                    *TINY, data, "train.eval_interval=1",
                                    "checkpoint.save_interval=1", "cona.enabled=true",
                                    "cona.decision_interval=4"]),
    }


@pytest.fixture(scope="module")
def diverged(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("diverged")
    (codes,) = launch(_diverge, 1, cache_dir, str(root))
    return root, codes


def test_a_nan_training_loss_is_not_evaluated_and_its_files_are_strict_json(diverged):
    """Catches the evaluation of the weights of a step whose training loss is NaN (it
    ran before the NaN check: wasted, and ``final_val_ppl: NaN`` in summary.json) and the
    bare ``NaN`` loss in metrics.jsonl.  Now: exit 1, ``diverged_at_step`` 2, step 2
    logged (although ``train.log_interval`` is 100) with ``loss: null`` and no
    ``val_loss``, ``final_val_ppl: null`` (no evaluation ran), both files strict JSON."""
    root, codes = diverged
    run = root / "train_nan"
    assert codes["train_nan"] == 1
    summary = _strict((run / "summary.json").read_text())
    records = _strict_lines(run / "metrics.jsonl")
    assert summary["diverged_at_step"] == summary["steps"] == 2
    assert [r["step"] for r in records] == [2]
    assert records[0]["loss"] is None and "val_loss" not in records[0]
    assert summary["final_val_ppl"] is None and summary["final_val_step"] is None


def test_a_nan_validation_loss_stops_the_run_without_saving(diverged):
    """Catches a run that went on, and saved the broken weights as its latest checkpoint,
    after a NaN validation loss (its training loss, taken before the update, was finite):
    ``final_val_ppl: NaN`` in summary.json, ``iter_0000001`` saved.  Now the NaN
    validation loss is divergence: exit 1, ``diverged_at_step`` 1, no checkpoint, the
    record with ``val_loss: null``, the summary's ``final_val_ppl`` null."""
    root, codes = diverged
    run = root / "val_nan"
    assert codes["val_nan"] == 1
    summary = _strict((run / "summary.json").read_text())
    records = _strict_lines(run / "metrics.jsonl")
    assert summary["diverged_at_step"] == summary["steps"] == 1
    assert [r["step"] for r in records] == [1]
    assert math.isfinite(records[0]["loss"]) and records[0]["val_loss"] is None
    assert summary["final_val_ppl"] is None
    assert not list((run / "checkpoints").glob("iter_*"))  # (no folder: none either)


def test_a_nan_validation_loss_ends_a_cona_run_too(diverged):
    """Catches CONA's loop, which checked the training loss only: with step 1's validation
    loss NaN it saved ``iter_0000001`` and went on (exit 0 at ``train.iters=1``, "final
    val ppl nan"; or ``diverged_at_step`` 2 a step later, break-test helper).  Now as an
    ordinary run: exit 1 at step 1, nothing saved."""
    root, codes = diverged
    run = root / "cona_val_nan"
    assert codes["cona_val_nan"] == 1
    summary = _strict((run / "summary.json").read_text())
    assert summary["diverged_at_step"] == 1
    assert summary["final_val_ppl"] is None
    assert not list((run / "checkpoints").glob("iter_*"))
