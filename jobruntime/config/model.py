"""The ``model`` section: the architecture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import (
    PAD_MULTIPLE,
    ConfigError,
    _finite,
    _need,
)


@dataclass(kw_only=True)
class ModelConfig:
    """Architecture of the model (one of the GPT-3, Llama or BERT families)."""

    family: Literal["gpt", "llama", "bert"] = "gpt"
    """Model family: ``gpt`` and ``llama`` build megatron-core ``GPTModel``;
    ``bert`` builds ``BertModel`` trained with masked LM."""
    num_layers: int = 4
    """Number of transformer layers; must be divisible by ``parallel.pp``."""
    hidden_size: int = 256
    """Model width ``h``."""
    num_attention_heads: int = 4
    """Query heads ``a``; must be divisible by ``parallel.tp``."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; ``None`` means ``a`` (MHA)."""
    ffn_hidden_size: int | None = None
    """MLP inner width; ``None`` means ``4 * hidden_size``."""
    vocab_size: int = 8192
    """Tokenizer vocabulary size: the ids the model predicts (at least the
    tokenizer's size)."""
    padded_vocab_size: int | None = None
    """Rows of the word embedding and output layer, one size for every layout
    of a run (TP must divide it); the logits of the padding ids are masked out
    of the softmax (:mod:`jobruntime.vocab`).  ``None`` = ``vocab_size``
    rounded up to a multiple of 128; runs write the resolved size to their
    ``config.yaml`` and checkpoints."""
    seq_length: int = 256
    """Training sequence length in tokens."""
    max_position_embeddings: int | None = None
    """Learned position table size; ``None`` means ``seq_length``."""
    position_embedding: Literal["learned_absolute", "rope"] = "learned_absolute"
    """Position encoding."""
    rotary_base: int = 10000
    """RoPE base ``theta``."""
    rope_scaling: bool = False
    """Llama-3 frequency scaling of RoPE (low/high frequency factors 1 and 4)."""
    rope_scaling_factor: float = 8.0
    """Llama-3 RoPE scaling factor (32 for Llama-3.2)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalization layer."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP activation; ``swiglu`` uses a fused gate/up projection."""
    add_bias_linear: bool = True
    """Biases in the linear layers (GPT-3 and BERT yes, Llama no)."""
    tie_embeddings: bool = True
    """Share the input embedding with the output layer."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    dropout: float = 0.0
    """Hidden and attention dropout probability (0 keeps runs deterministic)."""
    mask_prob: float = 0.15
    """BERT only: fraction of tokens masked for masked LM."""
    attention_backend: Literal["auto", "sdpa", "local", "te"] = "auto"
    """Core-attention kernel (not part of the architecture: checkpoints load
    under any): ``te`` Transformer Engine's layer specs; ``sdpa`` megatron's
    local specs with torch ``scaled_dot_product_attention`` (flash / cuDNN /
    memory-efficient kernels); ``local`` megatron's ``DotProductAttention``
    (materialises the score matrix); ``auto`` = ``te`` where it imports,
    else ``sdpa``."""
    kernel_fusions: Literal["auto", "off"] = "auto"
    """Fused kernels (bias+GeLU/SwiGLU, bias+dropout+add, cross entropy, apex
    LayerNorm, masked softmax, RoPE): ``auto`` = each where its kernel imports
    (:mod:`jobruntime.kernels`); ``off`` = none (same math, unfused)."""

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and output layer: ``padded_vocab_size``, or
        ``vocab_size`` rounded up to a multiple of :data:`PAD_MULTIPLE`."""
        if self.padded_vocab_size is not None:
            return self.padded_vocab_size
        return -(-self.vocab_size // PAD_MULTIPLE) * PAD_MULTIPLE

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad model setting."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")
        # 0 is not "unset" for these: null is (so a 0 is an error, not the default)
        for name in ("num_query_groups", "ffn_hidden_size", "max_position_embeddings"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be positive (or null "
                                  "for the default)")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}; pick sizes that divide"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not divisible by "
                f"model.num_query_groups={self.kv_heads}"
            )
        if self.padded_vocab_size is not None and self.padded_vocab_size < self.vocab_size:
            raise ConfigError(
                f"model.padded_vocab_size={self.padded_vocab_size} is smaller than "
                f"model.vocab_size={self.vocab_size}; raise it or set it to null (a multiple of "
                f"{PAD_MULTIPLE} is chosen)"
            )
        if self.family == "bert" and self.position_embedding != "learned_absolute":
            raise ConfigError("model.position_embedding must be learned_absolute for bert")
        if self.seq_length > self.max_positions:
            raise ConfigError(
                f"model.seq_length={self.seq_length} exceeds model.max_position_embeddings="
                f"{self.max_position_embeddings}; shorten the sequence or raise the maximum"
            )

        def need(ok: bool, key: str, rule: str) -> None:
            _need(self, "model", ok, key, rule)

        need(self.rotary_base > 0, "rotary_base", "must be positive")
        need(_finite(self.rope_scaling_factor) and self.rope_scaling_factor > 0,
             "rope_scaling_factor", "must be a positive number")
        need(_finite(self.init_method_std) and self.init_method_std > 0, "init_method_std",
             "must be a positive number")
        need(_finite(self.layernorm_epsilon) and self.layernorm_epsilon > 0, "layernorm_epsilon",
             "must be a positive number")
        need(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        need(0 < self.mask_prob < 1, "mask_prob", "must be in (0, 1)")

    def split_problems(self, tp: int, pp: int) -> list[str]:
        """Why megatron-core cannot split this model over ``tp`` x ``pp``: one line per
        broken rule, each with its numbers (empty: it splits).

        The rules, as megatron-core 0.16 asserts them while building (an
        ``AssertionError`` or ``ValueError`` from deep inside the build otherwise):

        * ``tp`` divides the attention heads (``TransformerConfig.__post_init__``);
        * ``tp`` divides the query groups (``num_query_groups``; megatron also takes a
          ``tp`` that is a multiple of them and replicates K/V, which this project's
          memory model and canonical shards do not);
        * ``tp`` divides the FFN hidden size (``divide(ffn, tp)`` in
          ``ColumnParallelLinear`` / ``RowParallelLinear``);
        * ``tp`` divides the padded vocabulary (``VocabUtility``; :mod:`jobruntime.vocab`);
        * ``pp`` divides the layers (``get_num_layers_to_build``: ``num_layers // pp``
          per stage).

        The one copy of these rules: :meth:`ParallelConfig.validate` (the job's own
        layout), CONA's ``check_strategy`` (candidate strategies) and GeoMesh's region
        shapes (:mod:`geomesh.fleet.shapes`) call it.
        """
        out = []
        if self.num_attention_heads % tp:
            out.append(f"tp={tp} does not divide the attention heads "
                       f"(model.num_attention_heads={self.num_attention_heads})")
        if self.kv_heads % tp and self.kv_heads != self.num_attention_heads:  # MHA: said above
            out.append(f"tp={tp} does not divide the query groups "
                       f"(kv heads, model.num_query_groups={self.kv_heads})")
        if self.ffn % tp:
            out.append(f"tp={tp} does not divide the FFN hidden size "
                       f"(model.ffn_hidden_size={self.ffn})")
        if self.padded_vocab % tp:
            fit = -(-self.vocab_size // (PAD_MULTIPLE * tp)) * PAD_MULTIPLE * tp
            out.append(f"tp={tp} does not divide the padded vocabulary ({self.padded_vocab}); "
                       f"set model.padded_vocab_size to a multiple of the TP sizes this run "
                       f"uses, e.g. {fit}")
        if self.num_layers % pp:
            out.append(f"pp={pp} does not divide the layers (model.num_layers={self.num_layers})")
        return out
