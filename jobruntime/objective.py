"""The training objective: each model family's forward of one micro-batch and
megatron-core's per-token loss, as :class:`jobruntime.trainer.Trainer`'s schedule
calls them (``forward_step_func`` and its loss function).

The objective is megatron-core's per-token loss
(``TransformerConfig.calculate_per_token_loss``, set in
:func:`jobruntime.model.to_transformer_config`): the loss function returns the
*sum* of the per-token losses of a micro-batch and its loss-token count; the
schedule adds up the counts, DDP *sums* the gradients over the DP group, and
``finalize_model_grads`` all-reduces the count over that group and scales the
gradients by ``1 / N`` (``N`` = loss tokens of the global batch).  The gradient
is therefore that of the mean loss over the global batch's tokens, whatever the
micro-batch size, the number of micro-batches and the DP size (which CONA
changes mid-run); a mean of micro-batch means would weigh a token of a
micro-batch with few loss tokens (BERT's MLM masks) more.  The logged training
and validation losses are token-weighted the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def gpt_forward(batch: dict, model: torch.nn.Module) -> torch.Tensor:
    """GPT / Llama: ``model(tokens, position_ids, None, labels)`` of a megatron
    ``GPTModel`` chunk; per-token losses ``[b, s]`` (nats) on the last pipeline stage,
    hidden states ``[s, b, h]`` before it."""
    return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])


def bert_forward(batch: dict, model: torch.nn.Module) -> torch.Tensor:
    """BERT (masked LM, no binary head): ``model(text, padding_mask, tokentype_ids,
    lm_labels)`` of a megatron ``BertModel`` chunk; per-token losses ``[b, s]`` (nats) on
    the last pipeline stage, hidden states ``[s, b, h]`` before it."""
    # no padding in the micro-batch (checked on the host): no mask, flash attention
    mask = None if batch.get("unpadded") else batch["padding_mask"]
    out = model(batch["text"], mask, tokentype_ids=batch["types"], lm_labels=batch["labels"])
    # last stage: (per-token loss, binary logits); earlier pipeline stages: hidden states
    return out[0] if isinstance(out, tuple) else out


def token_sum_loss(loss_mask: torch.Tensor,
                   output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """megatron-core's per-token loss contract (``calculate_per_token_loss``).

    Args:
        loss_mask: ``[b, s]``, 1 where a token's loss counts.
        output: ``[b, s]`` per-token losses (nats) from the model.

    Returns:
        ``(loss_sum, num_tokens, {"lm loss": [loss_sum, num_tokens]})``: the
        summed loss (scalar, fp32, backpropagated), the loss-token count (int
        scalar, which the schedule accumulates and ``finalize_model_grads``
        divides the gradients by), and both as a float64 pair for logging.
    """
    mask = loss_mask.float()
    loss_sum = (output.float() * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().double(), num_tokens.double()])
    return loss_sum, num_tokens, {"lm loss": report}


def forward_fn(family: str) -> Callable[[dict, torch.nn.Module], torch.Tensor]:
    """The forward of one micro-batch for a model ``family`` (``gpt``, ``llama``: causal
    LM; ``bert``: masked LM).

    Raises:
        ValueError: another family.
    """
    if family not in ("gpt", "llama", "bert"):
        raise ValueError(f"model family {family!r} has no forward: gpt, llama or bert")
    return bert_forward if family == "bert" else gpt_forward
