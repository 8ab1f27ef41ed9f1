"""Analytic FLOPs and parameter counts of the transformer models in this project.

Used for MFU, for the emulated clock (GeoMesh) and for the throughput and
memory models (CONA).  Counts follow Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
Appendix (eq. 3): a matmul of ``m x k`` by ``k x n`` costs ``2mkn`` FLOPs,
the backward pass costs twice the forward, and attention scores are counted
over the full (uncausal) ``s x s`` matrix as Megatron does.  Activation
recomputation is not counted.
"""

from __future__ import annotations

from .config import ModelConfig


def num_params(model: ModelConfig, *, padded_vocab: int | None = None) -> int:
    """Number of parameters of the (unsharded) model, embeddings included.

    Matches what megatron-core builds for the local layer spec: biases when
    ``add_bias_linear``, two norms per layer plus a final norm, learned
    positions for ``learned_absolute``, an untied output layer when
    ``tie_embeddings`` is false, and BERT's token-type embedding and LM-head
    transform (no binary NSP head: this project trains masked LM only).

    Args:
        padded_vocab: vocabulary size after megatron padding; ``None`` uses
            ``model.vocab_size``.
    """
    h, f, L = model.hidden_size, model.ffn, model.num_layers
    v = padded_vocab or model.vocab_size
    head_dim = h // model.num_attention_heads
    kv = model.kv_heads * head_dim
    bias = model.add_bias_linear
    norm = 2 * h if model.normalization == "LayerNorm" else h
    attn = h * (h + 2 * kv) + h * h + (bias * ((h + 2 * kv) + h))
    gate = 2 if model.activation == "swiglu" else 1
    mlp = h * f * gate + f * h + (bias * (f * gate + h))
    per_layer = attn + mlp + 2 * norm
    total = L * per_layer + norm + v * h
    if model.position_embedding == "learned_absolute":
        total += model.max_positions * h
    if not model.tie_embeddings:
        total += v * h
    if model.family == "bert":
        total += 2 * h  # token-type embedding (2 types)
        total += h * h + h + norm + v  # LM head: dense + bias, layernorm, output bias
    return total


def flops_per_token(model: ModelConfig, *, seq_length: int | None = None) -> float:
    """Training FLOPs per token (forward + backward = 3x forward).

    Per layer and token, forward: QKV ``2h(h + 2kv)``, attention scores and
    weighted values ``4sh``, output projection ``2h^2``, MLP ``2hf`` per
    projection (3 projections for SwiGLU, 2 for GELU); plus logits ``2hV``.

    Returns:
        FLOPs (not FLOP/s) per trained token.
    """
    h, f, L = model.hidden_size, model.ffn, model.num_layers
    s = seq_length or model.seq_length
    head_dim = h // model.num_attention_heads
    kv = model.kv_heads * head_dim
    gate = 3 if model.activation == "swiglu" else 2
    per_layer = 2 * h * (h + 2 * kv) + 4 * s * h + 2 * h * h + 2 * h * f * gate
    forward = L * per_layer + 2 * h * model.vocab_size
    return 3.0 * forward
