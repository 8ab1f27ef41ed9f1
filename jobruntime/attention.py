"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the ``[b, np, sq,
sk]`` score matrix (two batched matmuls and a softmax in between); without
Transformer Engine that is the slow path and the memory hog.
:class:`SDPAttention` is a drop-in ``core_attention`` submodule for
megatron-core's ``SelfAttention`` (same constructor and ``forward`` as
``DotProductAttention``, no parameters), so layer specs swap it in with
:func:`layer_spec` and checkpoints keep their keys and TP/PP sharding.  Torch
picks the kernel: flash or cuDNN attention on Hopper/Ampere GPUs,
memory-efficient attention elsewhere, a fused C++ kernel on CPU.

Masks (megatron's convention: ``True`` = masked out):

* causal (GPT, Llama): ``attention_mask`` is ``None`` → ``is_causal=True``;
* padding (BERT): ``[b, 1, 1, sk]`` or ``[b, 1, sq, sk]`` booleans, passed to
  SDPA inverted (SDPA's ``True`` = attend);
* grouped-query attention (Llama): ``enable_gqa=True``, keys and values keep
  their ``ng`` heads (no ``repeat_interleave`` copy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

from .config import ModelConfig


class SDPAttention(MegatronModule):
    """Megatron-core ``core_attention`` over torch SDPA.

    Args (as megatron-core's ``DotProductAttention``):
        config: the transformer config (heads, ``kv_channels``, dropout).
        layer_number: 1-based layer index (unused: no query-key layer
            scaling is needed, SDPA computes the softmax in fp32).
        attn_mask_type: ``causal`` or ``padding`` (from the layer spec).
        attention_type: ``"self"`` (cross attention is not used here).
        attention_dropout: overrides ``config.attention_dropout``.
        softmax_scale: overrides ``1 / sqrt(head_dim)``.
        cp_comm_type: must be ``None`` (no context parallelism).
        pg_collection: process groups; ``tp`` sets the heads per partition.

    Raises:
        ValueError: a config feature this kernel does not implement
            (context parallelism, sliding windows, softmax offsets).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None):
        super().__init__(config=config)
        if config.context_parallel_size != 1 or config.window_size is not None \
                or config.softmax_type != "vanilla":
            raise ValueError("SDPAttention supports neither context parallelism, sliding-window "
                             "attention nor softmax offsets; use attention_backend=local or te")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.heads_per_partition = divide(config.num_attention_heads, tp)
        self.groups_per_partition = divide(config.num_query_groups, tp)
        self.hidden_size_per_partition = self.heads_per_partition * config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None \
            else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params=None) -> torch.Tensor:
        """Attention of one layer's TP shard.

        Args:
            query: ``[sq, b, np, hn]``; key, value: ``[sk, b, ng, hn]``.
            attention_mask: ``None`` (causal) or a boolean mask broadcastable
                to ``[b, np, sq, sk]``, ``True`` where attention is masked out.
            attn_mask_type: overrides the layer's mask type for this call.

        Returns:
            ``[sq, b, np * hn]``, the context before the output projection.
        """
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes no attention bias and no packed sequences")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal
        sq, b = query.shape[0], query.shape[1]
        # [s, b, heads, hn] -> [b, heads, s, hn]: a view; SDPA only needs hn contiguous.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask.to(torch.bool)  # SDPA: True = attend
            if causal:
                keep = torch.ones(sq, k.shape[2], dtype=torch.bool, device=q.device).tril_()
                mask = mask & keep
                causal = False
        dropout_p = self.dropout_p if self.training else 0.0
        gqa = self.heads_per_partition != self.groups_per_partition
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            # the same dropout pattern on every TP rank's heads, as megatron does
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                     is_causal=causal, scale=self.softmax_scale,
                                                     enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                                 is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=gqa)
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)


def resolve_attention_backend(model: ModelConfig) -> str:
    """``te``, ``sdpa`` or ``local`` for ``model.attention_backend``.

    ``auto`` takes Transformer Engine's layer specs where it imports (with
    CUDA), torch SDPA otherwise.

    Raises:
        ValueError: ``te`` asked for where Transformer Engine does not import.
    """
    from .kernels import available_kernels

    te = available_kernels().transformer_engine
    choice = model.attention_backend
    if choice == "auto":
        return "te" if te else "sdpa"
    if choice == "te" and not te:
        raise ValueError("model.attention_backend=te needs CUDA and transformer_engine; "
                         "use auto, sdpa or local")
    return choice


def layer_spec(model: ModelConfig, backend: str):
    """megatron-core ``ModuleSpec`` of one transformer layer for ``backend``.

    ``te``: ``get_gpt_layer_with_transformer_engine_spec`` /
    ``get_bert_layer_with_transformer_engine_spec``; ``local``: megatron's
    local specs (``DotProductAttention``); ``sdpa``: the local specs with
    :class:`SDPAttention` as ``core_attention`` (same parameters and keys).
    BERT is the exception: ``BertModel`` takes any core attention other than
    ``DotProductAttention`` for Transformer Engine's and asks for its version,
    so BERT is built with the local spec and :func:`swap_in_sdpa` replaces the
    attention modules afterwards.
    """
    from dataclasses import replace

    if model.family == "bert":
        from megatron.core.models.bert import bert_layer_specs

        if backend == "te":
            return bert_layer_specs.get_bert_layer_with_transformer_engine_spec()
        return bert_layer_specs.bert_layer_local_spec
    else:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        if backend == "te":
            return get_gpt_layer_with_transformer_engine_spec()
        spec = get_gpt_layer_local_spec(normalization=model.normalization)
    if backend == "local":
        return spec
    attn = spec.submodules.self_attention
    attn = replace(attn, submodules=replace(attn.submodules, core_attention=SDPAttention))
    return replace(spec, submodules=replace(spec.submodules, self_attention=attn))


def allow_unmasked(bert: torch.nn.Module) -> torch.nn.Module:
    """Let a megatron ``BertModel`` take ``attention_mask=None``: a batch without
    padding needs no mask, and without a mask SDPA can use flash attention
    (Hugging Face's SDPA path drops an all-ones mask the same way).  Masked
    batches are unchanged."""
    extend = bert.bert_extended_attention_mask
    bert.bert_extended_attention_mask = lambda mask: None if mask is None else extend(mask)
    return bert


def swap_in_sdpa(model: torch.nn.Module) -> torch.nn.Module:
    """Replace every megatron ``DotProductAttention`` in ``model`` by :class:`SDPAttention`.

    Neither module has parameters, so state-dict keys are unchanged.  A
    ``BertModel`` is switched to ``[b, 1, 1, s]`` padding masks (megatron's
    TE layout) instead of the ``[b, 1, s, s]`` its local attention needs.
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is DotProductAttention:
                setattr(parent, name, SDPAttention(
                    child.config, child.layer_number, child.attn_mask_type, child.attention_type,
                    attention_dropout=child.attention_dropout.p,
                    pg_collection=child.pg_collection))
    if hasattr(model, "attn_mask_dimensions"):
        model.attn_mask_dimensions = "b11s"
    return model
