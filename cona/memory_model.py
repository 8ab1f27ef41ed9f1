"""Per-device memory of a strategy: model state + activations + fixed overhead.

Model state (bytes per parameter, Megatron-LM ``docs/distrib_optimizer.md``):

============================  ==========  ================================
precision                      plain       distributed optimizer (over dp)
============================  ==========  ================================
``mixed`` (bf16 params,        18          6 + 12/dp
fp32 main grads, fp32 master
params + Adam m, v)
``mixed_bf16_grads``           16          4 + 12/dp
``fp32`` (CPU runs: fp32       16          8 + 8/dp
params, grads, Adam m, v)
============================  ==========  ================================

Parameters are split across TP (layer weights and the word embedding; norms
and biases that megatron replicates are counted as split, a < 0.1 % error for
the presets) and across PP stages (``num_layers / pp`` layers per stage).
The first stage also holds the word and position embeddings; the last stage
holds the final norm, BERT's LM head and the output layer: its own weight when
embeddings are untied, and a copy of the word embedding when they are tied and
``pp > 1`` (megatron keeps one on each end and all-reduces their gradients).
The vocabulary is padded to a multiple of ``128 * tp`` as megatron does.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", Sec. 4, eq. 1-2), bytes per layer per micro-batch
with 16-bit activations and 1-byte dropout masks, ``s`` sequence, ``b``
micro-batch, ``h`` hidden, ``a`` heads, ``t`` TP size::

    no parallelism          s*b*h * (34 + 5*a*s/h)
    TP, no sequence par.    s*b*h * (10 + 24/t + 5*a*s/(h*t))
    TP + sequence par.      s*b*h * (34 + 5*a*s/h) / t

The 24 (TP-split part) is generalised here to grouped-query attention and
other MLPs: Q and the output-projection input ``4sbh``, K and V ``4sb*kv``
(``kv = kv_heads * head_dim``), the MLP ``4sbf`` for GELU (its input and
output) or ``6sbf`` for SwiGLU (the fused gate/up output ``4sbf`` plus the
product ``2sbf``).  For MHA, GELU and ``f = 4h`` this is exactly 24.  With
``flash_attention`` the ``5as/h`` score term is dropped (FlashAttention keeps
no ``s x s`` matrix).  Dropout masks are counted even at dropout 0, which
overestimates by at most 4/34.

Pipeline: with the 1F1B schedule (Narayanan et al. 2021) stage ``i`` of
``pp`` keeps up to ``min(pp - i, m)`` micro-batches in flight, so the first
stage holds ``min(pp, m)`` micro-batches of ``L/pp`` layers each.  The first
stage adds the embedding dropout mask ``sbh`` per micro-batch in flight; the
last stage adds the final-norm input and output ``4sbh`` and fp32 logits for
the cross-entropy ``4sbV/t`` for one micro-batch (Korthikanti Sec. 4.3).

``fp32`` precision doubles the activation bytes (4-byte elements).
Activation recomputation is not modelled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import KW_ONLY, dataclass
from typing import Literal

from jobruntime.config import ModelConfig
from jobruntime.flops import num_params

from .strategy import Strategy

# (weights, grads, optimizer state) bytes per parameter; the last part is what
# the distributed optimizer shards over dp (Megatron docs, table above).
STATE_BYTES: dict[str, tuple[float, float, float]] = {
    "mixed": (2.0, 4.0, 12.0),
    "mixed_bf16_grads": (2.0, 2.0, 12.0),
    "fp32": (4.0, 4.0, 8.0),
}
# Activation bytes relative to the 16-bit formula.
ACTIVATION_SCALE: dict[str, float] = {"mixed": 1.0, "mixed_bf16_grads": 1.0, "fp32": 2.0}

Precision = Literal["mixed", "mixed_bf16_grads", "fp32"]


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's vocabulary padding to a multiple of ``divisible_by * tp``.

    Mirrors ``jobruntime.model.padded_vocab_size`` without importing torch.
    """
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device of one pipeline stage.

    Attributes:
        stage: pipeline stage index (0 = first).
        params: parameters held by one device of that stage.
        state_bytes: weights + grads + optimizer state.
        activation_bytes: activations of all micro-batches in flight.
        overhead_bytes: fixed allowance (context, buffers, fragmentation).
    """

    stage: int
    params: float
    state_bytes: float
    activation_bytes: float
    overhead_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes + self.overhead_bytes

    @property
    def total_gib(self) -> float:
        return self.total_bytes / 2**30


@dataclass(frozen=True)
class MemoryModel:
    """Analytic per-device memory model (see the module docstring for the math).

    Args:
        model: architecture (``ModelConfig``).
        precision: ``mixed`` (GPU bf16 + fp32 grads, 18 B/param),
            ``mixed_bf16_grads`` (16 B/param) or ``fp32`` (CPU, 16 B/param).
        distributed_optimizer: shard the optimizer state over dp (ZeRO-1).
        sequence_parallel: megatron sequence parallelism (splits the non-TP
            activations by ``tp`` too).
        flash_attention: drop the ``s x s`` attention-score activations.
        overhead_bytes: fixed per-device allowance; default 2 GiB (CUDA context
            ~0.5 GiB, NCCL buffers and allocator fragmentation; an assumption,
            not a measurement).
        seq_length: sequence length override; ``None`` = ``model.seq_length``.

    Raises:
        ValueError: unknown ``precision``.
    """

    model: ModelConfig
    _: KW_ONLY
    precision: Precision = "mixed"
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    flash_attention: bool = False
    overhead_bytes: float = 2.0 * 2**30
    seq_length: int | None = None

    def __post_init__(self) -> None:
        if self.precision not in STATE_BYTES:
            raise ValueError(f"precision={self.precision!r} is not one of {sorted(STATE_BYTES)}")

    # -- parameters ---------------------------------------------------------

    @property
    def _s(self) -> int:
        return self.seq_length or self.model.seq_length

    def _param_split(self, tp: int) -> tuple[float, float, float, float]:
        """(per-layer, word embedding, position + token-type, last-stage head) params, unsplit."""
        m = self.model
        v = padded_vocab_size(m.vocab_size, tp)
        total = num_params(m, padded_vocab=v)
        no_layers = num_params(dataclasses.replace(m, num_layers=0), padded_vocab=v)
        per_layer = (total - no_layers) / m.num_layers
        word = v * m.hidden_size
        pos = m.max_positions * m.hidden_size if m.position_embedding == "learned_absolute" else 0
        if m.family == "bert":
            pos += 2 * m.hidden_size  # token-type embedding
        untied_out = 0 if m.tie_embeddings else word
        head = no_layers - word - pos - untied_out  # final norm, BERT LM head
        return per_layer, word, pos, head + untied_out

    def stage_params(self, strategy: Strategy) -> list[float]:
        """Parameters held by one device of each pipeline stage (list of length pp)."""
        m = self.model
        tp, pp = strategy.tp, strategy.pp
        per_layer, word, pos, head = self._param_split(tp)
        layers = per_layer * (m.num_layers // pp) / tp
        out = []
        for i in range(pp):
            p = layers
            if i == 0:
                p += word / tp + pos
            if i == pp - 1:
                p += head / tp
                if pp > 1 and m.tie_embeddings:
                    p += word / tp  # copy of the tied embedding on the last stage
            out.append(p)
        return out

    def state_bytes_per_param(self, dp: int) -> float:
        """Weights + grads + optimizer bytes per parameter on one device."""
        w, g, opt = STATE_BYTES[self.precision]
        return w + g + (opt / dp if self.distributed_optimizer else opt)

    # -- activations --------------------------------------------------------

    def activation_bytes_per_layer(self, micro_batch_size: int, tp: int) -> float:
        """Bytes of one transformer layer's saved activations for one micro-batch on one device.

        Korthikanti et al. 2022 eq. 2, generalised to GQA and SwiGLU (module docstring).
        """
        m = self.model
        s, b, h, a, f = self._s, micro_batch_size, m.hidden_size, m.num_attention_heads, m.ffn
        kv = m.kv_heads * (h // a)
        sb = s * b
        replicated = 10.0 * sb * h  # norm inputs, QKV and MLP inputs, two dropout masks
        split = sb * (4.0 * h + 4.0 * kv)  # Q, out-proj input, K, V
        split += sb * f * (6.0 if m.activation == "swiglu" else 4.0)
        if not self.flash_attention:
            split += 5.0 * a * s * s * b  # scores, softmax output, its dropout mask
        if self.sequence_parallel:
            replicated /= tp
        return (replicated + split / tp) * ACTIVATION_SCALE[self.precision]

    def stage_activation_bytes(self, strategy: Strategy) -> list[float]:
        """Activation bytes on one device of each stage under 1F1B (length pp)."""
        m = self.model
        tp, pp, n_mb = strategy.tp, strategy.pp, strategy.num_microbatches
        sbh = self._s * strategy.micro_batch_size * m.hidden_size
        per_layer = self.activation_bytes_per_layer(strategy.micro_batch_size, tp)
        sp_div = tp if self.sequence_parallel else 1
        scale = ACTIVATION_SCALE[self.precision]
        v = padded_vocab_size(m.vocab_size, tp)
        out = []
        for i in range(pp):
            in_flight = min(pp - i, n_mb)
            act = in_flight * per_layer * (m.num_layers // pp)
            if i == 0:
                act += in_flight * sbh / sp_div * scale  # embedding dropout mask
            if i == pp - 1:
                act += 4.0 * sbh / sp_div * scale  # final norm input + output
                act += 4.0 * self._s * strategy.micro_batch_size * v / tp  # fp32 logits
            out.append(act)
        return out

    # -- totals -------------------------------------------------------------

    def stage_estimates(self, strategy: Strategy) -> list[MemoryEstimate]:
        """One :class:`MemoryEstimate` per pipeline stage."""
        bpp = self.state_bytes_per_param(strategy.dp)
        acts = self.stage_activation_bytes(strategy)
        return [
            MemoryEstimate(i, p, p * bpp, acts[i], self.overhead_bytes)
            for i, p in enumerate(self.stage_params(strategy))
        ]

    def estimate(self, strategy: Strategy) -> MemoryEstimate:
        """The stage with the most bytes (what must fit on every device)."""
        return max(self.stage_estimates(strategy), key=lambda e: e.total_bytes)

    def peak_bytes(self, strategy: Strategy) -> float:
        """Peak bytes per device over stages."""
        return self.estimate(strategy).total_bytes

    def fits(self, strategy: Strategy, limit_bytes: float) -> bool:
        """True if :meth:`peak_bytes` is at most ``limit_bytes``."""
        return self.peak_bytes(strategy) <= limit_bytes
