"""Reference values computed with Hugging Face ``transformers`` models: independent of
megatron-core and of this project's model, checkpoint and scoring code, so a test that
compares against them catches weights that were not loaded (or not kept)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss(model, microbatches: list[dict]) -> float:
    """Token-weighted mean cross-entropy (nats per token) of a causal HF LM over one
    global batch: the project's micro-batch dicts (``tokens``, ``labels``,
    ``loss_mask``, each ``[micro_batch, seq]``; labels are the next tokens).
    Computed in float64 from the model's logits."""
    total = count = 0.0
    with torch.no_grad():
        for mb in microbatches:
            logits = model(mb["tokens"]).logits.double()  # [b, s, vocab]
            ce = F.cross_entropy(logits.flatten(0, 1), mb["labels"].flatten(), reduction="none")
            mask = mb["loss_mask"].flatten().double()
            total += float((ce * mask).sum())
            count += float(mask.sum())
    return total / count


def choice_scores(model, requests: list[tuple[list[int], list[int]]], seq_length: int) -> list[float]:
    """Log-likelihood (nats) of each ``(context, continuation)`` request's continuation
    under a causal HF LM: plain log_softmax over the vocabulary, the last
    ``seq_length + 1`` tokens kept (as ``tools.zero_shot`` truncates).  One right-padded
    batch; padding after a sequence cannot change a causal LM's logits."""
    seqs = [torch.tensor((ctx + cont)[-(seq_length + 1):]) for ctx, cont in requests]
    batch = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    with torch.no_grad():
        logp = torch.log_softmax(model(batch[:, :-1]).logits.double(), dim=-1)
    out = []
    for i, ((_, cont), seq) in enumerate(zip(requests, seqs)):
        n, end = len(cont), len(seq) - 1  # predictions for seq[1:] sit at positions 0..end-1
        out.append(logp[i, end - n:end].gather(1, seq[-n:, None]).sum().item())
    return out
