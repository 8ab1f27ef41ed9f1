"""Token counters are accumulated and checkpointed, not ``step x current batch x seq``.

A tiny_gpt run trains 4 steps at global batch 8 (sequence 64) and saves; it is
resumed at global batch 16 for steps 5..12.  The true token count after step
``k > 4`` is ``4 x 8 x 64 + (k - 4) x 16 x 64``: 3,072 at step 5 and 10,240 at
step 12 (the old code: 5,120 and 12,288).  The same resume from a copy of the
checkpoint with the counter deleted (a checkpoint from before it) derives
``consumed_samples x seq_length``.  TTP's token count is the accumulated one:
with a target every evaluation meets, it is reached at the resumed run's first
evaluation (step 6: 4,096 tokens, not 6,144).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.dist_utils import launch

SEQ, B0, B1, SAVED, ITERS = 64, 8, 16, 4, 12
COMMON = ["model.num_layers=2", "model.hidden_size=64", f"model.seq_length={SEQ}",
          "logging.wandb=disabled", "logging.progress=off", "train.warmup_iters=1",
          "train.log_interval=1"]


def _true_tokens(step: int) -> int:
    return step * B0 * SEQ if step <= SAVED else (SAVED * B0 + (step - SAVED) * B1) * SEQ


def _runs(cache_dir, root):
    """Train at batch 8, save at step 4; resume at 16 from it and from a copy without the
    token counter.  Returns the resumed runs' summaries."""
    import shutil

    import torch

    from jobruntime.config import load_config
    from jobruntime.loop import run

    torch.set_num_threads(1)
    root = Path(root)
    first = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", *COMMON,
                                     f"parallel.global_batch_size={B0}", "parallel.micro_batch_size=4",
                                     f"train.iters={SAVED}", "train.eval_interval=0",
                                     f"checkpoint.save_interval={SAVED}"])
    run(first, root / "first")
    ckpt = root / "first" / "checkpoints" / f"iter_{SAVED:07d}"
    old = root / "old_checkpoint"
    shutil.copytree(ckpt, old)
    common = torch.load(old / "common.pt", weights_only=False)
    common.pop("consumed_tokens", None)  # absent before the counter existed
    torch.save(common, old / "common.pt")
    out = {}
    for name, load in (("resumed", ckpt), ("resumed_old", old)):
        cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", *COMMON,
                                       f"parallel.global_batch_size={B1}",
                                       "parallel.micro_batch_size=4", f"train.iters={ITERS}",
                                       "train.eval_interval=6", "train.target_ppl=1e9",
                                       f"checkpoint.load={load}",
                                       # a longer run on the saved schedule (its decay ended)
                                       "checkpoint.optimizer_settings=checkpoint"])
        out[name] = run(cfg, root / name)
    return out


@pytest.fixture(scope="module")
def resumed(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("counters")
    return launch(_runs, 1, cache_dir, str(root))[0], root


@pytest.mark.parametrize("name", ["resumed", "resumed_old"])
def test_tokens_survive_a_batch_change_on_resume(resumed, name):
    """Every step's ``tokens`` in metrics.jsonl and the summary's ``tokens`` and
    ``ttp_tokens`` are the accumulated counts (module docstring)."""
    summaries, root = resumed
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "step" in r}
    assert sorted(steps) == list(range(SAVED + 1, ITERS + 1))
    assert steps[5]["tokens"] == 3072
    for k, r in steps.items():
        assert r["tokens"] == _true_tokens(k), k
        assert r["samples"] * SEQ == r["tokens"], k
    summary = json.loads((root / name / "summary.json").read_text())
    assert summary["tokens"] == summaries[name]["tokens"] == 10240
    assert summary["samples"] == SAVED * B0 + (ITERS - SAVED) * B1
    assert summary["ttp_step"] == 6 and summary["ttp_tokens"] == _true_tokens(6) == 4096
