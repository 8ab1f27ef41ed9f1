"""One padded vocabulary per run, and padding ids kept out of the softmax.

Megatron-LM pads the vocabulary to a multiple of ``128 * tp`` (its
``make_vocab_size_divisible_by``).  That makes the shapes of the word
embedding and the output layer depend on the layout — vocabulary 4100 is 4224
rows at TP=1 and 4352 at TP=2 — and the padding rows take part in the softmax
(their logits are ``h · 0`` or ``h · w_random``), so one run is a different
model at each layout: step-1 losses differ (8.4203 vs 8.3974 measured at
vocabulary 4100), a checkpoint resumed at another TP jumps, and CONA cannot
reshard the embedding between TP sizes.

Here the padded size is chosen once per run, independent of the layout:
``model.padded_vocab_size`` (:attr:`jobruntime.config.ModelConfig.padded_vocab`),
by default the vocabulary rounded up to a multiple of
:data:`jobruntime.config.PAD_MULTIPLE` = 128, which every power-of-two TP up to 128 divides (Megatron's own choice
at TP=1: GPT-2's 50,257 → 50,304, BERT's 30,522 → 30,592).  It is recorded in
``config.yaml`` and in every checkpoint.  A layout whose TP does not divide it
is a config error naming ``model.padded_vocab_size``.

:func:`mask_padded_logits` sets the logits of the padding ids to ``-inf`` on
every rank's vocabulary shard, so the softmax, the cross-entropy (megatron's
vocab-parallel one included), its gradient and every consumer of the logits
(evaluation, zero-shot scoring) see exactly ``vocab_size`` classes whatever
the padding and the TP size.
"""

from __future__ import annotations

import torch


def _padding_mask_hook(vocab_size: int):
    def hook(layer, _args, output):
        logits, bias = output  # ColumnParallelLinear returns (output, bias); logits [s, b, v_local]
        width = logits.shape[-1]
        if width == layer.output_size:  # gathered: the whole (padded) vocabulary
            start = 0
        else:
            group = getattr(layer, "tp_group", None)
            start = (group.rank() if group is not None and group.size() > 1 else 0) * width
        first_pad = vocab_size - start  # local index of the first padding id
        if first_pad >= width:
            return None  # this shard holds no padding id
        keep = torch.arange(width, device=logits.device) < first_pad
        return logits.masked_fill(~keep, float("-inf")), bias

    return hook


def mask_padded_logits(module: torch.nn.Module, vocab_size: int) -> None:
    """Make the logits of ids ``>= vocab_size`` ``-inf`` in ``module``'s output layer.

    Registers a forward hook on ``module.output_layer`` (megatron's
    ``ColumnParallelLinear``; present on the last pipeline stage only —
    other stages are left alone).  Works on the TP-local shard
    ``[s, b, padded/tp]`` (the shard's first id is ``tp_rank * padded/tp``,
    read from the layer's own TP group, so a model kept across a CONA switch
    still masks its own shard) and on gathered logits ``[s, b, padded]``.
    ``masked_fill`` is out of place: the padding columns get no gradient.
    """
    layer = getattr(module, "output_layer", None)
    if layer is None or vocab_size >= getattr(layer, "output_size", vocab_size):
        return
    layer.register_forward_hook(_padding_mask_hook(vocab_size))
