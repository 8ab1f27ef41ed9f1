"""Zero-shot multiple-choice evaluation scored by log-likelihood (HellaSwag, PIQA layouts).

Each example has a context and candidate continuations.  A continuation is
scored by its log-likelihood under the model,
``score = Σ_t log softmax(logits_t)[y_t]`` over the continuation's tokens
``y_t`` given everything before them; the prediction is the best-scoring
choice.  ``accuracy`` uses the sum; ``accuracy_norm`` divides each score by
the continuation's length in UTF-8 bytes (``acc_norm`` of
lm-evaluation-harness), which removes the bias toward short endings.

Task files are local JSONL, one example per line:

* HellaSwag: ``{"ctx": str, "endings": [str, ...], "label": int}``
  (optional ``"activity_label"`` is prefixed as ``"label: ctx"``);
* PIQA: ``{"goal": str, "sol1": str, "sol2": str, "label": int}``
  (context ``"Question: goal\\nAnswer:"``).

Sequence of one choice: ``[eod] + context + " " + choice`` (``eod`` stands for
"start of document", as in training), cut from the left to
``model.seq_length + 1`` tokens and right-padded.  Logits of megatron's
vocabulary padding rows are masked out.  Works at any TP/PP/DP layout
(forward-only pipeline schedule; DP ranks split the choices); GPT and Llama
families only (BERT is not a left-to-right LM).

Usage::

    python tools/zero_shot.py --config runs/my-run/config.yaml \\
        --checkpoint runs/my-run/checkpoints --task tools/samples/hellaswag_synthetic.jsonl
    torchrun --nproc-per-node 2 tools/zero_shot.py --config ... --task ... parallel.tp=2

From the training loop (every rank, after the last step)::

    from tools.zero_shot import evaluate_zero_shot
    result = evaluate_zero_shot(trainer, data.corpus.tokenizer, "hellaswag.jsonl")
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from jobruntime.config import ConfigError

_MASKED_LOGIT = -1e30


@dataclass
class Example:
    """One multiple-choice question: context, candidate continuations, correct index."""

    context: str
    choices: list[str]
    label: int


def _hellaswag_clean(text: str) -> str:
    # lm-evaluation-harness's HellaSwag preprocessing (WikiHow artefacts)
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def load_task(path: str | Path, limit: int | None = None) -> list[Example]:
    """Read a HellaSwag- or PIQA-layout JSONL file.

    Raises:
        ValueError: a line is in neither layout (names the file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"task file '{path}' not found; give a HellaSwag- or PIQA-layout JSONL")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                ex = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(ex, dict):
                raise ValueError(f"{where}: each line must be a JSON object")
            if "endings" in ex and "ctx" in ex:
                ctx = _hellaswag_clean(ex["ctx"])
                if ex.get("activity_label"):
                    ctx = f"{ex['activity_label']}: {ctx}"
                choices = [_hellaswag_clean(e) if isinstance(e, str) else e for e in ex["endings"]]
            elif "goal" in ex and "sol1" in ex and "sol2" in ex:
                ctx, choices = f"Question: {ex['goal']}\nAnswer:", [ex["sol1"], ex["sol2"]]
            else:
                raise ValueError(f"{where}: neither HellaSwag (ctx, endings, label) "
                                 "nor PIQA (goal, sol1, sol2, label) layout")
            if len(choices) < 2:
                raise ValueError(f"{where}: needs at least 2 endings, got {len(choices)}")
            if not all(isinstance(c, str) and c.strip() for c in choices):
                # an empty ending has log-likelihood 0 and would always win
                raise ValueError(f"{where}: every ending must be a non-empty string")
            if not isinstance(ex.get("label"), int) or isinstance(ex["label"], bool):
                raise ValueError(f"{where}: 'label' (the index of the right ending) is missing "
                                 "or not an integer")
            out.append(Example(ctx, choices, ex["label"]))
            if not 0 <= out[-1].label < len(out[-1].choices):
                raise ValueError(f"{where}: label {out[-1].label} out of range for "
                                 f"{len(choices)} endings")
            if limit and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no examples")
    return out


def build_requests(examples: list[Example], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(context ids, continuation ids) per choice, examples in order; context starts with eod."""
    contexts = tokenizer.encode([e.context for e in examples])
    conts = tokenizer.encode([" " + c for e in examples for c in e.choices])
    out, j = [], 0
    for e, ctx in zip(examples, contexts):
        for _ in e.choices:
            out.append(([tokenizer.eod] + ctx, conts[j]))
            j += 1
    return out


def _to_batch(requests: list[tuple[list[int], list[int]]], seq_length: int, pad: int) -> dict:
    """``[b, seq_length]`` tokens, position ids, targets and continuation mask."""
    b = len(requests)
    # host tensors: the forward step moves the batch to the compute device
    tokens = torch.full((b, seq_length), pad, dtype=torch.long)  # host
    targets = torch.full((b, seq_length), pad, dtype=torch.long)  # host
    mask = torch.zeros((b, seq_length))  # host
    for i, (ctx, cont) in enumerate(requests):
        full = (ctx + cont)[-(seq_length + 1):]
        n, c = len(full) - 1, min(len(cont), len(full) - 1)
        tokens[i, :n] = torch.tensor(full[:-1])  # host
        targets[i, :n] = torch.tensor(full[1:])  # host
        mask[i, n - c:n] = 1.0
    positions = torch.arange(seq_length).expand(b, seq_length)  # host
    return {"tokens": tokens, "position_ids": positions, "targets": targets, "mask": mask}


def _continuation_logprob(batch: dict, vocab_size: int, output: torch.Tensor, non_loss_data=True):
    """Sum of continuation log-probs per sequence from this TP rank's logits ``[b, s, v/tp]``."""
    from megatron.core import parallel_state, tensor_parallel

    logits = output.float()
    v_local = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * v_local
    padding = torch.arange(start, start + v_local, device=logits.device) >= vocab_size
    logits = logits.masked_fill(padding, _MASKED_LOGIT)  # padded vocab rows are no tokens
    nll = tensor_parallel.vocab_parallel_cross_entropy(
        logits.transpose(0, 1).contiguous(), batch["targets"].t().contiguous())  # [s, b]
    return -(nll.t() * batch["mask"]).sum(dim=1)  # [b]


def _forward_step(vocab_size, data_iterator, model):
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in next(data_iterator).items()}
    logits = model(batch["tokens"], batch["position_ids"], None)
    return logits, partial(_continuation_logprob, batch, vocab_size)


@torch.no_grad()
def score_requests(trainer, requests: list[tuple[list[int], list[int]]],
                   chunk_microbatches: int = 32) -> list[float]:
    """Log-likelihood of each continuation; collective over the trainer's layout.

    DP ranks score interleaved subsets; results are summed over DP and sent
    from the last pipeline stage, so every rank returns the full list.
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    cfg = trainer.cfg
    if cfg.model.family == "bert":
        raise ValueError("zero-shot log-likelihood needs a left-to-right LM (gpt or llama family)")
    mb, seq = cfg.parallel.micro_batch_size, cfg.model.seq_length
    dp, dp_rank = (parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank())
    mine = list(range(dp_rank, len(requests), dp))
    scores = torch.zeros(len(requests), dtype=torch.float64, device=trainer.device)
    pad = requests[0][0][0]  # eod; padded positions are masked anyway
    for m in trainer.model:
        m.eval()
    fwd_bwd = get_forward_backward_func()
    step = mb * chunk_microbatches
    for lo in range(0, len(mine), step):
        idx = mine[lo:lo + step]
        # fixed [mb, seq] shapes for the pipeline's p2p: pad the last micro-batch with copies
        batches = [_to_batch([requests[i] for i in (idx[j:j + mb] + [idx[0]] * mb)[:mb]], seq, pad)
                   for j in range(0, len(idx), mb)]
        out = fwd_bwd(forward_step_func=partial(_forward_step, cfg.model.vocab_size),
                      data_iterator=iter(batches), model=trainer.model, num_microbatches=len(batches),
                      seq_length=seq, micro_batch_size=mb, forward_only=True,
                      collect_non_loss_data=True)
        if parallel_state.is_pipeline_last_stage():
            values = torch.cat(out)[:len(idx)].double()
            scores[idx] = values
    for m in trainer.model:
        m.train()
    if dist.is_initialized():
        if parallel_state.is_pipeline_last_stage():
            dist.all_reduce(scores, group=parallel_state.get_data_parallel_group())
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(scores, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
    return scores.tolist()


def accuracy(examples: list[Example], scores: list[float]) -> dict:
    """``accuracy`` (sum), ``accuracy_norm`` (per UTF-8 byte) and ``n`` from choice scores."""
    correct = correct_norm = j = 0
    for e in examples:
        s = scores[j:j + len(e.choices)]
        j += len(e.choices)
        norm = [x / max(len((" " + c).encode()), 1) for x, c in zip(s, e.choices)]
        correct += int(max(range(len(s)), key=s.__getitem__) == e.label)
        correct_norm += int(max(range(len(norm)), key=norm.__getitem__) == e.label)
    n = len(examples)
    return {"accuracy": correct / n, "accuracy_norm": correct_norm / n, "n": n}


def evaluate_zero_shot(trainer, tokenizer, task_file: str | Path, *, limit: int | None = None,
                       return_scores: bool = False) -> dict:
    """Zero-shot accuracy of ``trainer``'s model on a HellaSwag/PIQA-layout file.

    Call on every rank (collective).  Returns the same dict everywhere:
    ``{"accuracy", "accuracy_norm", "n", "task", "device", "precision"}``
    (where the model's parameters are, and their dtype) (+ ``"scores"``, the
    log-likelihood of every choice in file order, with ``return_scores``).
    """
    from jobruntime.devices import device_summary

    examples = load_task(task_file, limit)
    scores = score_requests(trainer, build_requests(examples, tokenizer))
    ran = device_summary(trainer.module)
    result = {**accuracy(examples, scores), "task": Path(task_file).stem,
              "device": ran["device"], "precision": ran["precision"]}
    return {**result, "scores": scores} if return_scores else result


def end_of_run_hook(task_files: list[str], family: str = "gpt"):
    """A ``jobruntime.loop.run`` ``end_of_run`` callback scoring ``task_files``.

    Returns ``{"zero_shot": [result per task]}`` for the run's summary.

    Raises:
        ConfigError: a task file does not exist, or ``family`` is ``bert``
            (checked now, before training, not after it).
    """
    if family == "bert":
        raise ConfigError("train.zero_shot_tasks needs a left-to-right LM (gpt or llama); "
                          "unset it for bert")
    missing = [f for f in task_files if not Path(f).is_file()]
    if missing:
        raise ConfigError(f"train.zero_shot_tasks: no such file(s) {missing}; give local JSONL "
                          "files in the HellaSwag or PIQA layout")

    def hook(trainer, corpus) -> dict:
        from jobruntime.logging_utils import phase

        results = []
        for f in task_files:
            with phase(logging.getLogger("jobruntime"), "zero-shot evaluation on %s",
                       Path(f).name) as done:
                results.append(evaluate_zero_shot(trainer, corpus.tokenizer, f))
                done["result"] = f"accuracy {results[-1]['accuracy']:.3f}"
        return {"zero_shot": results}

    return hook


def _tokenizer_for(cfg, path: str | None):
    from jobruntime.tokenizer import check_specials, load_tokenizer

    if path or cfg.data.tokenizer != "auto":
        tok = load_tokenizer(path or cfg.data.tokenizer)
        check_specials(tok, cfg.model.family)  # contexts start with eod
        return tok
    from jobruntime.data import prepare_corpus  # the cached tokenizer trained for this corpus

    return prepare_corpus(cfg.data, cfg.model).tokenizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the checkpoint's config (e.g. RUN/config.yaml)")
    p.add_argument("--checkpoint", required=True, help="checkpoints/ folder or iter_* folder")
    p.add_argument("--task", required=True, action="append", help="task JSONL (repeatable)")
    p.add_argument("--tokenizer", default=None, help="default: the config's data.tokenizer")
    p.add_argument("--limit", type=int, default=None, help="first N examples only")
    p.add_argument("--scores", action="store_true",
                   help="also print each choice's log-likelihood (nats), in file order")
    p.add_argument("overrides", nargs="*", help="section.key=value (e.g. parallel.tp=2)")
    args = p.parse_args(argv)
    for flag, path in [("--checkpoint", args.checkpoint), *(("--task", t) for t in args.task)]:
        if not Path(path).exists():  # told at once, not after megatron's import and the build
            print(f"error: {flag} {path} does not exist", file=sys.stderr)
            return 2
    from jobruntime.checkpoint import CheckpointError, load_checkpoint
    from jobruntime.config import ConfigError, load_config
    from jobruntime.logging_utils import setup_logging
    from jobruntime.metrics import json_text
    from jobruntime.parallel import initialize_layout, set_seed, shutdown
    from jobruntime.tokenizer import TokenizerError
    from jobruntime.trainer import Trainer

    setup_logging()
    try:
        cfg = load_config(args.config, ["logging.wandb=disabled", *args.overrides])
        initialize_layout(cfg)
        set_seed(cfg.train.seed)
        trainer = Trainer(cfg)
        load_checkpoint(args.checkpoint, trainer, load_optimizer=False)
        tokenizer = _tokenizer_for(cfg, args.tokenizer)
        results = [evaluate_zero_shot(trainer, tokenizer, t, limit=args.limit, return_scores=args.scores)
                   for t in args.task]
    except (ConfigError, CheckpointError, TokenizerError, ValueError, OSError) as e:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        rank = dist.get_rank() if dist.is_initialized() else 0
        shutdown()
    if rank == 0:
        print(json_text(results if len(results) > 1 else results[0], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
