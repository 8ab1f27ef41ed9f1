"""Per-device training memory of a layout: model state + activations + fixed overhead.

The one memory model of the project: GeoMesh's planner (which micro-batch
fits on a worker) and CONA (which strategies fit) both use it.  It describes
what :class:`jobruntime.trainer.Trainer` really holds.

Model state (bytes per parameter; Megatron-LM ``docs/distrib_optimizer.md``):

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

The trainer keeps fp32 gradient buffers (``grad_reduce_in_fp32``), so its
bf16 runs are ``mixed`` and its CPU runs ``fp32``.  ``extra_bytes_per_param``
adds state kept next to the shard (GeoMesh: θ_global and the outer momentum,
fp32 each); ``extra_bytes_per_param_at_dp1`` state kept only where ``dp = 1``
(CONA's noise-scale probe keeps one fp32 copy of the gradients there between
the parts of a step it reads, :data:`cona.probe.GRADIENT_COPY_BYTES`).

Parameters are split across TP (layer weights and the word embedding; norms
and biases that megatron replicates are counted as split, a < 0.1 % error for
the presets) and across PP stages (``num_layers / pp`` layers per stage).
The first stage also holds the word and position embeddings; the last stage
holds the final norm, BERT's LM head and the output layer: its own weight when
embeddings are untied, and a copy of the word embedding when they are tied and
``pp > 1`` (megatron keeps one on each end).  The word embedding has
``model.padded_vocab`` rows (:mod:`jobruntime.vocab`).

Activations saved for the backward pass (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", Sec. 4, eq. 1-2),
per layer and micro-batch on one device, ``s`` sequence, ``b`` micro-batch,
``h`` hidden, ``a`` heads, ``t`` TP size, ``e`` bytes per activation element
(2 for bf16, 4 for fp32), with dropout (a 1-byte mask per dropout)::

    not split by TP   s*b*h * (4e + 2)         norm inputs, QKV and MLP inputs, 2 masks
    split by TP       s*b * e * (2h + 2kv)     Q, output-projection input, K, V
                    + s*b*f * 2e               GELU input, fc2 input
                    + a*s*s*b * (2e + 1)       softmax output, its dropout output and mask

which for ``e = 2``, MHA, GELU and ``f = 4h`` is the paper's
``s*b*h * (10 + 24/t + 5*a*s/(h*t))``.  At dropout 0 (the presets) megatron
keeps no masks and no dropout outputs: ``4e`` and ``e * a*s*s*b``.  With
fused attention (``flash_attention``: torch SDPA's flash / memory-efficient
kernels or Transformer Engine, what ``model.attention_backend`` other than
``local`` runs) the ``s x s`` term is dropped, K and V are not repeated for
GQA and the kernel keeps its fp32 log-sum-exp (``4*a*s*b`` bytes; its output
is the projection's input, counted once).  Sequence parallelism
divides the first line by ``t`` too.  What megatron-core's local layers keep
beyond the paper's GPT (found by counting the tensors autograd saves): RMSNorm
(torch's) keeps ``x * rsqrt`` too (``+e*s*b*h`` per norm); RoPE keeps rotated
copies of Q and K, GQA copies of K and V repeated to all heads
(:meth:`MemoryModel._qkv_saved`); SwiGLU keeps ``5f`` elements per token, not
``3f``.

Pipeline: with the 1F1B schedule (Narayanan et al. 2021) stage ``i`` of
``pp`` keeps up to ``min(pp - i, m)`` micro-batches in flight.  The first
stage adds the embedding dropout mask ``s*b*h`` per micro-batch in flight
(with dropout); the last stage adds the final-norm input and output
``2e * s*b*h`` and the logits ``4 * s*b*V/t`` (fp32: the cross-entropy keeps
its softmax in their place) for one micro-batch.

The last stage also holds, for a moment, the output layer's weight gradient
(``V/t x h`` in the weights' dtype) before it is added to the fp32 gradient
buffer (megatron's gradient-accumulation fusion is off here) or, for BERT,
a second logits tensor while the output bias is added, whichever is larger.

Overhead: a fixed allowance per device: :data:`GPU_OVERHEAD_BYTES` (2 GiB:
CUDA context, NCCL buffers, allocator fragmentation; an assumption, not a
measurement) or :data:`CPU_OVERHEAD_BYTES` (measured).

Checked against measurement: ``tests/test_runtime_memory.py`` trains tiny
GPT, Llama and BERT models on CPU, each in a fresh subprocess, and compares
the growth of the peak resident memory (``VmHWM``) from just before the model
is built with :meth:`MemoryModel.peak_bytes` (CPU overhead): within 10 %.
glibc's malloc is run with a fixed mmap threshold there, so freed tensors go
back to the OS and the resident memory follows the live tensors (as
``torch.cuda.max_memory_allocated`` does on GPU); with its default dynamic
threshold the same runs peak 1.3-1.8x higher on retained free blocks.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Literal, Protocol

from .config import ConfigError, JobConfig, ModelConfig
from .flops import num_params

# (weights, grads, optimizer state) bytes per parameter; the last part is what
# the distributed optimizer shards over dp (Megatron docs, table above).
STATE_BYTES: dict[str, tuple[float, float, float]] = {
    "mixed": (2.0, 4.0, 12.0),
    "mixed_bf16_grads": (2.0, 2.0, 12.0),
    "fp32": (4.0, 4.0, 8.0),
}
# Bytes of one activation element.
ELEMENT_BYTES: dict[str, float] = {"mixed": 2.0, "mixed_bf16_grads": 2.0, "fp32": 4.0}
GIB = 2.0**30
# Fixed per-device allowances (MemoryModel.overhead_bytes).  GPU: CUDA context,
# NCCL buffers, allocator fragmentation: an assumption, not a measurement.  CPU:
# what a training process holds beyond its tensors once the first step ran
# (malloc arenas, oneDNN/OpenMP scratch): measured 18-25 MiB for the tiny
# presets (tests/test_runtime_memory.py).
GPU_OVERHEAD_BYTES = 2.0 * GIB
CPU_OVERHEAD_BYTES = 24.0 * 2**20

Precision = Literal["mixed", "mixed_bf16_grads", "fp32"]


@dataclass(frozen=True)
class ExtraState:
    """State a caller keeps on the device beside the trainer's, in bytes per parameter of
    the device's shard, for the trainer's launch check (:func:`check_job_fits`):
    CONA's noise-scale probe (:func:`cona.probe.probe_state`), GeoMesh's outer state
    (:data:`geomesh.fleet.worker_models.OUTER_STATE`).

    Attributes:
        what: what holds it, named when the check refuses a layout.
        bytes_per_param: at any DP (:class:`MemoryModel`'s ``extra_bytes_per_param``).
        bytes_per_param_at_dp1: more where DP = 1 only (``extra_bytes_per_param_at_dp1``).
        fix, fix_at_dp1: how to run without each part, added to a refusal's fixes where
            that part is held ("" for none).
    """

    what: str
    bytes_per_param: float = 0.0
    bytes_per_param_at_dp1: float = 0.0
    fix: str = ""
    fix_at_dp1: str = ""

    def fixes(self, dp: int) -> list[str]:
        """The fixes of the parts held at data-parallel size ``dp``."""
        held = [(self.bytes_per_param, self.fix),
                (self.bytes_per_param_at_dp1 if dp == 1 else 0.0, self.fix_at_dp1)]
        return [fix for nbytes, fix in held if nbytes and fix]


class Layout(Protocol):
    """What the model needs to know of a layout (``cona.strategy.Strategy`` is one)."""

    tp: int
    pp: int
    dp: int
    micro_batch_size: int
    num_microbatches: int


@dataclass(frozen=True)
class PipelineLayout:
    """A plain :class:`Layout`: TP, PP and DP sizes, micro-batch size and the number of
    micro-batches per step (1F1B keeps ``min(pp - stage, num_microbatches)`` in flight)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch_size: int = 1
    num_microbatches: int = 1


def precision_of(dtype_name: str) -> Precision:
    """The state precision of the trainer for a parameter dtype name (``bfloat16`` /
    ``float16`` → ``mixed``: fp32 grads and master weights; ``float32`` → ``fp32``)."""
    return "fp32" if dtype_name in ("float32", "fp32") else "mixed"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes on one device of one pipeline stage.

    Attributes:
        stage: pipeline stage index (0 = first).
        params: parameters held by one device of that stage.
        state_bytes: weights + grads + optimizer state (+ extra state).
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
        return self.total_bytes / GIB


@dataclass(frozen=True)
class MemoryModel:
    """Analytic per-device memory model (see the module docstring for the math).

    Args:
        model: architecture (``ModelConfig``; ``dropout`` decides the masks).
        precision: ``mixed`` (GPU bf16 + fp32 grads, 18 B/param),
            ``mixed_bf16_grads`` (16 B/param) or ``fp32`` (CPU, 16 B/param).
        distributed_optimizer: shard the optimizer state over dp (ZeRO-1).
        sequence_parallel: megatron sequence parallelism (splits the non-TP
            activations by ``tp`` too).
        flash_attention: a fused attention kernel (no ``s x s`` scores, no
            repeated K/V, a log-sum-exp per head and token); ``None`` (default):
            what ``model.attention_backend`` runs (``local``: False, else True).
        overhead_bytes: fixed per-device allowance: :data:`GPU_OVERHEAD_BYTES`
            (default) or :data:`CPU_OVERHEAD_BYTES`.
        seq_length: sequence length override; ``None`` = ``model.seq_length``.
        extra_bytes_per_param: more state per parameter of the shard (e.g.
            GeoMesh's θ_global and outer momentum, 8).
        extra_bytes_per_param_at_dp1: more state per parameter where ``dp = 1`` only
            (CONA's noise-scale probe's gradient copy, 4).

    Raises:
        ValueError: unknown ``precision``.
    """

    model: ModelConfig
    _: KW_ONLY
    precision: Precision = "mixed"
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    flash_attention: bool | None = None
    overhead_bytes: float = GPU_OVERHEAD_BYTES
    seq_length: int | None = None
    extra_bytes_per_param: float = 0.0
    extra_bytes_per_param_at_dp1: float = 0.0

    def __post_init__(self) -> None:
        if self.flash_attention is None:
            object.__setattr__(self, "flash_attention", self.model.attention_backend != "local")
        if self.precision not in STATE_BYTES:
            raise ValueError(f"precision={self.precision!r} is not one of {sorted(STATE_BYTES)}")

    # -- parameters ---------------------------------------------------------

    @property
    def _s(self) -> int:
        return self.seq_length if self.seq_length is not None else self.model.seq_length

    def _param_split(self) -> tuple[float, float, float, float]:
        """(per-layer, word embedding, position + token-type, last-stage head) params, unsplit."""
        m = self.model
        v = m.padded_vocab
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

    def stage_params(self, layout: Layout) -> list[float]:
        """Parameters held by one device of each pipeline stage (list of length pp)."""
        m = self.model
        tp, pp = layout.tp, layout.pp
        per_layer, word, pos, head = self._param_split()
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

    def state_bytes_parts(self, dp: int) -> dict[str, float]:
        """Bytes per parameter on one device by kind: ``weights``, ``grads``,
        ``optimizer`` (fp32 master weights and Adam moments; over ``dp`` with the
        distributed optimizer) and ``extra`` (``extra_bytes_per_param``, and
        ``extra_bytes_per_param_at_dp1`` at ``dp = 1``)."""
        w, g, opt = STATE_BYTES[self.precision]
        return {"weights": w, "grads": g,
                "optimizer": opt / dp if self.distributed_optimizer else opt,
                "extra": self.extra_bytes_per_param
                + (self.extra_bytes_per_param_at_dp1 if dp == 1 else 0.0)}

    def state_bytes_per_param(self, dp: int) -> float:
        """Weights + grads + optimizer (+ extra) bytes per parameter on one device."""
        return sum(self.state_bytes_parts(dp).values())

    # -- activations --------------------------------------------------------

    def activation_bytes_per_layer(self, micro_batch_size: int, tp: int) -> float:
        """Bytes of one transformer layer's saved activations for one micro-batch on one device.

        Korthikanti et al. 2022 eq. 2, generalised to the element size,
        dropout 0, RMSNorm, RoPE, GQA and SwiGLU as megatron-core's local layers
        compute them (module docstring).
        """
        m = self.model
        s, b, h, a, f = self._s, micro_batch_size, m.hidden_size, m.num_attention_heads, m.ffn
        e = ELEMENT_BYTES[self.precision]
        masks = m.dropout > 0
        sb = s * b
        # norm inputs, QKV and fc1 inputs (+ RMSNorm's x*rsqrt per norm) (+ 2 masks)
        norm_extra = 2.0 if m.normalization == "RMSNorm" else 0.0
        replicated = sb * h * ((4.0 + norm_extra) * e + (2.0 if masks else 0.0))
        split = sb * e * (self._qkv_saved() + h)  # Q, K, V as attention keeps them; proj input
        split += sb * f * e * (5.0 if m.activation == "swiglu" else 2.0)
        if self.flash_attention:
            split += a * sb * 4.0  # the kernel's fp32 log-sum-exp
        else:
            split += a * s * s * b * ((2.0 * e + 1.0) if masks else e)
        if self.sequence_parallel:
            replicated /= tp
        return replicated + split / tp

    def _qkv_saved(self) -> float:
        """Elements per token of Q, K and V kept for the attention's backward.

        Without RoPE or GQA they are views of the fused QKV output (``h + 2kv``).
        RoPE makes rotated copies of Q (``h``) and K (``kv``); GQA repeats K and V
        to all heads (``h`` each); the fused output stays alive while any view of
        it is kept.  A fused kernel (``flash_attention``) takes Q, K and V as they
        are: the fused output (V is always a view of it) plus RoPE's copies.  SwiGLU (``5f``, in :meth:`activation_bytes_per_layer`):
        fc1's output ``2f``, SiLU's output ``f``, megatron's ``x_linear +
        offset`` copy ``f`` and their product ``f``.
        """
        m = self.model
        h = m.hidden_size
        kv = m.kv_heads * (h // m.num_attention_heads)
        rope, gqa = m.position_embedding == "rope", kv < h
        if self.flash_attention:  # views of the fused output or their rotated copies
            return (h + kv if rope else 0.0) + h + 2.0 * kv
        q = h if rope else 0.0
        k = h if gqa else (kv if rope else 0.0)
        v = h if gqa else 0.0
        fused_alive = not rope or not gqa
        return q + k + v + ((h + 2.0 * kv) if fused_alive else 0.0)

    def stage_activation_bytes(self, layout: Layout) -> list[float]:
        """Activation bytes on one device of each stage under 1F1B (length pp)."""
        m = self.model
        tp, pp, n_mb = layout.tp, layout.pp, layout.num_microbatches
        sbh = self._s * layout.micro_batch_size * m.hidden_size
        per_layer = self.activation_bytes_per_layer(layout.micro_batch_size, tp)
        sp_div = tp if self.sequence_parallel else 1
        e = ELEMENT_BYTES[self.precision]
        out = []
        for i in range(pp):
            in_flight = min(pp - i, n_mb)
            act = in_flight * per_layer * (m.num_layers // pp)
            if i == 0 and m.dropout > 0:
                act += in_flight * sbh / sp_div  # embedding dropout mask
            if i == pp - 1:
                # final norm input + output (+ RMSNorm's x*rsqrt)
                act += (3.0 if m.normalization == "RMSNorm" else 2.0) * e * sbh / sp_div
                if m.family == "bert":  # LM head: dense output, GELU input, norm input
                    act += 3.0 * e * sbh / sp_div
                logits = 4.0 * self._s * layout.micro_batch_size * m.padded_vocab / tp  # fp32
                # For a moment also: the output layer's weight gradient in the weights'
                # dtype, before it is added to the gradient buffer (no gradient-
                # accumulation fusion), or a second logits tensor while the output
                # bias (BERT) is added.
                wgrad = STATE_BYTES[self.precision][0] * m.padded_vocab * m.hidden_size / tp
                act += logits + max(wgrad, logits if m.family == "bert" else 0.0)
            out.append(act)
        return out

    # -- totals -------------------------------------------------------------

    def stage_estimates(self, layout: Layout) -> list[MemoryEstimate]:
        """One :class:`MemoryEstimate` per pipeline stage."""
        bpp = self.state_bytes_per_param(layout.dp)
        acts = self.stage_activation_bytes(layout)
        return [
            MemoryEstimate(i, p, p * bpp, acts[i], self.overhead_bytes)
            for i, p in enumerate(self.stage_params(layout))
        ]

    def estimate(self, layout: Layout) -> MemoryEstimate:
        """The stage with the most bytes (what must fit on every device)."""
        return max(self.stage_estimates(layout), key=lambda e: e.total_bytes)

    def peak_bytes(self, layout: Layout) -> float:
        """Peak bytes per device over stages."""
        return self.estimate(layout).total_bytes

    def fits(self, layout: Layout, limit_bytes: float) -> bool:
        """True if :meth:`peak_bytes` is at most ``limit_bytes``."""
        return self.peak_bytes(layout) <= limit_bytes


# -- the check before a build ------------------------------------------------

_CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_memory_bytes() -> int:
    """Physical memory of this host (``MemTotal``), or its cgroup's limit if lower (bytes)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in _CGROUP_LIMITS:
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit():  # "max" (v2) means no limit
            total = min(total, int(raw))
    return total


def device_memory_limit(device) -> tuple[float, str]:
    """Bytes one process may hold on ``device`` (a ``torch.device``), and what they are.

    GPU: the device's total memory.  CPU: :func:`host_memory_bytes` divided by the ranks
    on this node (``LOCAL_WORLD_SIZE``, set by torchrun; 1 otherwise).
    """
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"the memory of {props.name}"
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
    what = "host memory" + (f" / {local} ranks on this node" if local > 1 else "")
    return host_memory_bytes() / local, what


def format_bytes(nbytes: float) -> str:
    """``nbytes`` as GiB, or MiB under one GiB (a refusal's numbers stay distinct)."""
    return f"{nbytes / GIB:,.1f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:,.1f} MiB"


def trainer_memory_model(cfg: JobConfig, *, device, dtype_name: str,
                         extra: ExtraState | None = None) -> MemoryModel:
    """The memory model of :class:`jobruntime.trainer.Trainer` for ``cfg`` on ``device``:
    its state precision (:func:`precision_of` the parameters' dtype), sequence
    parallelism, :data:`CPU_OVERHEAD_BYTES` or :data:`GPU_OVERHEAD_BYTES`, and ``extra``
    beside it; what the launch check (:func:`check_job_fits`) and CONA's real-mode
    candidate filter estimate every layout with."""
    extra = extra or ExtraState("")
    return MemoryModel(cfg.model, precision=precision_of(dtype_name),
                       sequence_parallel=cfg.parallel.sequence_parallel,
                       overhead_bytes=GPU_OVERHEAD_BYTES if device.type == "cuda"
                       else CPU_OVERHEAD_BYTES,
                       extra_bytes_per_param=extra.bytes_per_param,
                       extra_bytes_per_param_at_dp1=extra.bytes_per_param_at_dp1)


def check_job_fits(cfg: JobConfig, *, dp: int, device, dtype_name: str,
                   extra: ExtraState | None = None) -> MemoryEstimate:
    """Refuse a job whose estimated peak per device exceeds the device's memory.

    Called before the model is built, so that a model too large for the machine is one
    line, not an allocator's traceback from inside the build.  Uses the trainer's state
    precision (fp32 gradient buffers, no distributed optimizer) and
    :data:`CPU_OVERHEAD_BYTES` or :data:`GPU_OVERHEAD_BYTES`.

    Args:
        dp: data-parallel size (sets the micro-batches per step).
        device: the compute device (``torch.device``).
        dtype_name: the parameters' dtype, e.g. ``"float32"``, ``"bfloat16"``.
        extra: state a caller keeps beside the trainer's (counted, and named in the
            refusal with its fix).

    Returns:
        The estimate of the largest pipeline stage.

    Raises:
        ConfigError: the estimate exceeds :func:`device_memory_limit` and
            ``train.check_memory`` is true; names both numbers and the fixes.
    """
    par = cfg.parallel
    extra = extra or ExtraState("")
    mem = trainer_memory_model(cfg, device=device, dtype_name=dtype_name, extra=extra)
    layout = PipelineLayout(tp=par.tp, pp=par.pp, dp=dp, micro_batch_size=par.micro_batch_size,
                            num_microbatches=max(par.global_batch_size // (par.micro_batch_size * dp), 1))
    est = mem.estimate(layout)
    if not cfg.train.check_memory:
        return est
    limit, what = device_memory_limit(device)
    if est.total_bytes > limit:
        beside = est.params * mem.state_bytes_parts(dp)["extra"]
        of_which = f", of which {format_bytes(beside)} {extra.what}" if beside else ""
        fix = "".join(f"{f}, " for f in extra.fixes(dp))
        raise ConfigError(
            f"the job does not fit: estimated peak {format_bytes(est.total_bytes)} per device "
            f"(stage {est.stage}: {est.params / 1e9:,.2f} B parameters, state "
            f"{format_bytes(est.state_bytes)}{of_which}, activations "
            f"{format_bytes(est.activation_bytes)}) > {format_bytes(limit)} ({what}); "
            f"{fix}shrink the model or parallel.micro_batch_size, "
            "raise parallel.tp/pp, or set train.check_memory=false to build it anyway")
    return est
