"""One typed configuration tree for a training job.

A job is described by :class:`JobConfig`, a tree of keyword-only dataclasses
loaded from a YAML preset in ``model_configs/`` and narrowed by command-line
overrides of the form ``section.key=value``.  Unknown keys and values of the
wrong type are errors that name the key and the fix (:class:`ConfigError`).

This module is pure data: the conversion to megatron-core's
``TransformerConfig`` happens in exactly one place,
:func:`jobruntime.model.to_transformer_config`.  GeoMesh and CONA read their
own sections (:class:`GeoMeshConfig`, :class:`ConaConfig`) and never raw
arguments.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

# Where the bundled presets live (``model_configs/`` next to this package).
REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_CONFIGS_DIR = REPO_ROOT / "model_configs"


# The default padding of the vocabulary: a multiple of 128, whatever the layout
# (see jobruntime/vocab.py).
PAD_MULTIPLE = 128


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names it and the fix.

    Always one line: line breaks that user text brings into the message (a key
    or value with a newline) are shown escaped, as ``\\n``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _need(section: object, name: str, ok: bool, key: str, rule: str) -> None:
    """Raise ConfigError ``<name>.<key>=<value> <rule>`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name}.{key}={getattr(section, key)!r} {rule}")


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


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout.  DP is not set: it is ``world_size / (tp * pp)``."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    micro_batch_size: int = 4
    """Sequences per micro-batch per DP rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step across all DP ranks; must be a multiple of
    ``micro_batch_size * dp``.  Gradient accumulation makes up the rest."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs ``tp > 1``)."""

    def validate(self, model: ModelConfig, world_size: int) -> int:
        """Check the layout against the model and world; return the DP size.

        Raises:
            ConfigError: a size does not divide (names the key and the fix).
        """
        for name in ("tp", "pp", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"parallel.{name} must be positive, got {getattr(self, name)}")
        if world_size % (self.tp * self.pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tp*parallel.pp="
                f"{self.tp * self.pp}; launch a multiple of tp*pp processes"
            )
        dp = world_size // (self.tp * self.pp)
        problems = model.split_problems(self.tp, self.pp)
        if problems:
            raise ConfigError(f"parallel.{problems[0]}")
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ConfigError(
                f"parallel.global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size*dp={self.micro_batch_size}*{dp}; change one of them"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
        return dp


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and loop settings."""

    iters: int = 100
    """Optimizer steps to run."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_iters: int = 10
    """Linear warmup steps."""
    lr_decay_iters: int | None = None
    """Cosine decay length in steps; ``None`` means ``iters``."""
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    seed: int = 1234
    """Seed for weights, data order and dropout."""
    precision: Literal["fp32", "bf16", "auto"] = "auto"
    """``auto`` = bf16 on CUDA, fp32 on CPU."""
    check_memory: bool = True
    """Refuse, before the model is built, a job whose estimated peak bytes per device
    (:class:`jobruntime.memory.MemoryModel`: weights, gradients, Adam state, the
    activations of the micro-batches in flight, a fixed overhead) exceed the GPU's memory,
    or on CPU the host's memory (its cgroup limit if lower) divided among the node's
    ranks; ``false`` builds it anyway (the allocator then has the last word)."""
    log_interval: int = 1
    """Steps between metrics records."""
    eval_interval: int = 20
    """Steps between validation evaluations (and at the last step); 0 disables."""
    eval_iters: int = 4
    """Validation batches (of the global batch size) per evaluation."""
    target_ppl: float | None = None
    """Validation perplexity that defines time-to-target-perplexity (TTP)."""
    stop_at_target: bool = False
    """Stop the run once ``target_ppl`` is reached."""
    max_wall_s: float | None = None
    """Stop (after the current step, with a final evaluation) past this many seconds."""
    zero_shot_tasks: list | None = None
    """Local JSONL files in the HellaSwag or PIQA layout scored zero-shot at the
    end of the run (``tools/zero_shot.py``); results go to summary.json."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first out-of-range setting."""
        def need(ok: bool, key: str, rule: str) -> None:
            _need(self, "train", ok, key, rule)

        need(self.iters > 0, "iters", "must be positive")
        need(_finite(self.lr) and self.lr > 0, "lr", "must be a positive number")
        need(_finite(self.min_lr) and 0 <= self.min_lr <= self.lr, "min_lr",
             f"must be between 0 and train.lr={self.lr}")
        need(self.warmup_iters >= 0, "warmup_iters", "must be >= 0")
        need(self.lr_decay_iters is None or self.lr_decay_iters > 0, "lr_decay_iters",
             "must be positive (or null for train.iters)")
        need(_finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be >= 0")
        for key in ("adam_beta1", "adam_beta2"):
            need(0 <= getattr(self, key) < 1, key, "must be in [0, 1)")
        need(_finite(self.adam_eps) and self.adam_eps > 0, "adam_eps", "must be positive")
        need(_finite(self.clip_grad) and self.clip_grad >= 0, "clip_grad", "must be >= 0 (0 disables)")
        need(self.log_interval >= 1, "log_interval", "must be >= 1")
        need(self.eval_interval >= 0, "eval_interval", "must be >= 0 (0 disables evaluation)")
        need(self.eval_iters >= 1, "eval_iters",
             "must be >= 1 (to skip evaluation set train.eval_interval=0)")
        need(self.target_ppl is None or (_finite(self.target_ppl) and self.target_ppl > 1),
             "target_ppl", "must be a perplexity > 1 (or null)")
        need(self.max_wall_s is None or self.max_wall_s > 0, "max_wall_s", "must be positive (or null)")
        need(0 <= self.seed < 2**32, "seed", "must be in [0, 2**32) (numpy's range)")


@dataclass(kw_only=True)
class DataConfig:
    """Corpus, tokenizer and split."""

    path: str = "data/python-docs-3.11.jsonl.xz"
    """JSONL (``text`` field, optionally .xz/.gz), a .txt file or a folder of
    them, a local Hugging Face dataset folder (``save_to_disk``), or a Megatron
    indexed-dataset prefix (``PREFIX.bin``/``PREFIX.idx``).  Relative paths are
    resolved against the working directory, then the repository."""
    tokenizer: str = "auto"
    """``auto`` trains (once, cached) a sentencepiece model of
    ``model.vocab_size`` on the training documents; otherwise a path to a
    sentencepiece ``.model`` or a Hugging Face ``tokenizer.json``."""
    text_key: str = "text"
    """Field holding the document text in JSONL / HF datasets."""
    val_every: int = 20
    """Every ``val_every``-th document (by position) is held out for validation."""
    cache_dir: str = ".cache"
    """Where tokenizers and tokenized indexed datasets are cached."""
    max_documents: int | None = None
    """Read only the first N documents (quick tests)."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first out-of-range setting."""
        _need(self, "data", self.val_every >= 2, "val_every",
              "must be >= 2 (every val_every-th document is held out)")
        _need(self, "data", self.max_documents is None or self.max_documents > 0, "max_documents",
              "must be positive (or null for all)")


@dataclass(kw_only=True)
class CheckpointConfig:
    """dist_checkpointing save/load."""

    save_interval: int = 0
    """Save every N steps (and at the end when > 0); 0 disables saving."""
    load: str | None = None
    """Checkpoint directory to resume from (a run's ``checkpoints/`` folder or
    one ``iter_XXXXXXX`` folder inside it)."""
    load_optimizer: bool = True
    """Resume optimizer, LR schedule, step, data position and clock from
    ``load``; ``false`` loads only the model weights and starts training afresh
    (fine-tuning, e.g. from ``tools/convert_checkpoint.py`` output)."""
    keep_last: int = 2
    """Number of checkpoints kept; older ones are deleted (0 keeps all)."""
    load_exact: bool = True
    """Whether the weights in ``load`` compute the function of the model they came from.
    ``false`` is written by ``tools/convert_checkpoint.py`` for an HF architecture that
    megatron-core does not implement (post-LN ``BertForMaskedLM``): the weights are an
    initialisation to fine-tune, not that model; loading them logs a warning."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first out-of-range setting."""
        _need(self, "checkpoint", self.save_interval >= 0, "save_interval",
              "must be >= 0 (0 disables saving)")
        _need(self, "checkpoint", self.keep_last >= 0, "keep_last", "must be >= 0 (0 keeps all)")


@dataclass(kw_only=True)
class LoggingConfig:
    """Metrics sinks."""

    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline runs can be synced later with ``wandb sync``."""
    project: str = "geocona"
    group: str | None = None
    """wandb group (runs of one comparison share it)."""
    name: str | None = None
    """Run name; ``None`` derives one from the config and time."""
    progress: Literal["auto", "on", "off"] = "auto"
    """Terminal progress bar: ``auto`` shows it on a TTY for runs of > 50 steps
    and otherwise logs a line per evaluation and every 5 % of the steps;
    ``off``: neither."""


@dataclass(kw_only=True)
class GeoMeshConfig:
    """GeoMesh: geo-distributed synchronous training (see ``geomesh/``)."""

    method: Literal["none", "geomesh", "diloco", "ddp", "async"] = "none"
    """``none`` trains one ordinary job; others run the named method."""
    cluster: str | None = None
    """Cluster description YAML (workers, GPUs, regions, WAN, mode)."""
    outer_steps: int = 10
    """Outer steps (rounds) to run."""
    outer_lr: float = 0.7
    """Outer Nesterov SGD learning rate (DiLoCo default)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (DiLoCo default)."""
    outer_momentum_warmup: bool = True
    """Ramp the outer momentum from 0.5 to ``outer_momentum`` as
    ``min(μ, 1 − 3/(t+5))`` over outer steps ``t`` (Nesterov's schedule; not in
    DiLoCo's paper, for every method alike); ``false``: ``outer_momentum`` from
    the first step, DiLoCo's Alg. 1, with which ``method=diloco`` gives torchft's
    ``DiLoCo`` θ bit for bit (``tests/test_geomesh_torchft_diloco.py``).  For
    diloco on the quick bench the ramp gave final val ppl 723.9 against 803.9 at
    its best outer lr without it (``docs/results/diloco_momentum_ramp.json``)."""
    inner_steps: int = 20
    """Inner steps ``H`` per round for uniform methods; GeoMesh's planner
    targets ``inner_steps * global_batch_size`` tokens-worth per round."""
    error_feedback: bool = True
    """Keep the compression residual (in host memory) and add it to the next
    round's pseudo-gradient (error feedback, Karimireddy et al. 2019)."""
    error_feedback_decay: float = 0.5
    """Factor on the error-feedback residual kept for the next round (1: all
    of it, EF-signSGD; 0.5, measured best with top-k: the next round's inner
    steps re-derive much of what was not sent, ``geomesh/feedback.py``)."""
    balance: Literal["steps", "batch"] = "steps"
    """How GeoMesh's planner equalises compute time: faster workers run more
    inner steps ``H_i`` at about the uniform per-worker batch ``G/K``
    (``steps``, default: every step has the batch ``train.lr`` is meant for),
    or larger batches ``b_i`` at about ``inner_steps`` steps (``batch``)."""
    plan_tolerance: float = 0.05
    """GeoMesh's planner: allowed relative spread of the workers' compute time
    per round.  The planner picks the fastest plan per token within it; 0.02
    halves the straggler idle of the four-region cluster (imbalance 0.7 %
    instead of 1.9 %) at 1.9 % more seconds per token (``geomesh/fleet/planner.py``)."""
    inner_lr_scaling: Literal["none", "sqrt", "linear"] = "none"
    """How a worker's inner learning rate follows its batch ``b_i``, relative to
    the uniform per-worker batch ``G/K`` for which ``train.lr`` is meant:
    unchanged (``none``, default: measured better with the outer Nesterov
    step), ``lr · (b_i K / G)^{1/2}`` (``sqrt``) or linear.  Uniform methods
    (DiLoCo, async) are unaffected."""
    compression: Literal["sign_row", "sign_pred", "sign", "topk", "fp32"] = "topk"
    """GeoMesh's pseudo-gradient codec: the ``topk_k`` largest of every 256
    elements of a row, position + 2-bit value (``topk``, default: 32.8x less
    than fp32 on GPT-3 1.3B; ``geomesh/wire/sparse.py``; real-mode workers with
    TP > 1 fall back to ``sign_row``); sign bits with one fp32 magnitude per
    row of every matrix (``sign_row``, 31.6x), the same for the part the
    outer momentum does not predict plus one coefficient per row
    (``sign_pred``, ``geomesh/wire/predict.py``), one magnitude per tensor
    (``sign``), or none (``fp32``, an ablation).  Measured: README, ablation."""
    compress_update: bool = False
    """GeoMesh: compress each worker's momentum-corrected outer update
    ``Δ_i + μ v_i`` (its own momentum ``v_i``, 1-bit Adam's order; every worker
    applies the aggregate directly) instead of the pseudo-gradient ``Δ_i``
    (DiLoCo's order, one global momentum).  Same step without compression;
    with error feedback the parameter error stays bounded by the current
    residual (``geomesh/feedback.py``)."""
    overlap: float | None = None
    """GeoMesh: hide the exchange behind compute: the messages of round ``r`` travel
    while each worker runs the first ``⌈overlap · H_i⌉`` inner steps of round
    ``r+1`` from an estimate of the next θ_global (the eager update: its own
    message at its token share, the last aggregate for the others',
    ``geomesh/eager.py``); then it moves onto the new ``θ_global`` keeping that
    progress (1 = a one-round-delayed outer update).  ``0.1`` covers the
    four-region cluster's exchange (README: WAN idle 275x below DiLoCo's,
    final perplexity +0.7 ± 1.2 % over four seeds of the longer run).
    ``null`` (default): blocking rounds.  Checkpoint rounds and the last round
    are not overlapped (``geomesh/sync.py``).  The baselines (DiLoCo, DDP,
    async) never overlap."""
    topk_k: int = 24
    """``compression=topk``: elements kept of every 256 of a row (with 2-bit
    values: 24 → 32.8x less than fp32 on GPT-3 1.3B, counted from the encoded
    bytes; 7 → 99.7x, 6 → 110.5x, the sparse mode: run it at a larger
    ``outer_lr``, 1.0-1.4, its messages make smaller steps; README)."""
    topk_bits: int = 2
    """``compression=topk``: bits per kept value, 1 (sign, one magnitude per
    row) or 2 (sign and a level bit, two magnitudes per row)."""
    target_model: str | None = None
    """Emulated mode: preset whose FLOPs and bytes set time and traffic."""
    timeout_s: float = 600.0
    """Real mode: seconds to wait for a region before failing with its name."""
    mode: Literal["emulated", "real"] | None = None
    """Override the cluster file's mode (``None`` = the file's)."""
    region: str | None = None
    """Real mode with one ``torchrun`` per region: the region this job plays
    (its processes join the others at the cluster's ``rendezvous``).  ``None``
    = this ``torchrun`` plays every worker of the cluster."""
    wan_bandwidth_scale: float | None = None
    """Multiply every WAN bandwidth of the cluster (``None`` = the file's scale)."""
    replan: bool = True
    """Re-plan ``b_i``, ``H_i`` when measured speeds drift (method ``geomesh``)."""
    eval_interval: int = 1
    """Outer steps between validation evaluations (and at the last one)."""
    on_worker_loss: Literal["continue", "fail"] = "continue"
    """Real mode, one job per region: when a worker is lost (crashed, stalled
    past ``heartbeat_s``, or its message rejected), the others finish the
    round without it and go on (``continue``; it may rejoin at a round
    boundary), or every job stops with one line naming it (``fail``)."""
    heartbeat_s: float = 10.0
    """Real mode, one job per region: seconds without a heartbeat after which
    a worker counts as lost (the lighthouse's heartbeat timeout; give the
    lighthouse the same ``--heartbeat-s``)."""
    secret_file: str | None = None
    """Real mode: file holding the run's secret that authenticates messages
    (HMAC-SHA256); ``None`` = the ``GEOMESH_SECRET`` environment variable.
    Never give the secret itself on the command line."""
    max_norm_ratio: float = 10.0
    """A message whose pseudo-gradient norm exceeds this multiple of the other
    workers' median (or of its own history) is rejected (``geomesh/wire/guard.py``)."""
    token_tolerance: float = 0.05
    """A message whose token count is off the plan's by more than this
    fraction is rejected."""
    robust_aggregation: Literal["none", "sign_majority", "trimmed_mean"] = "none"
    """Aggregate by a token-weighted majority of signs, or with trimmed-mean
    scales, instead of equation (1) (``geomesh/wire/guard.py``)."""


@dataclass(kw_only=True)
class ConaConfig:
    """CONA: online parallelism-strategy chaining (see ``cona/``)."""

    enabled: bool = False
    decision_interval: int = 20
    """Steps between controller decisions (K)."""
    candidates: list | None = None
    """Explicit candidates ``[{dp, tp, pp, micro_batch_size, global_batch_size}]``;
    ``None`` enumerates them."""
    global_batch_sizes: list | None = None
    """Global batch sizes (sequences) the enumeration tries; ``None`` =
    ``parallel.global_batch_size`` times 1, 2, 4 and 8."""
    gpu: str = "A100-80GB"
    """Emulated mode: GPU type whose profile times the target model."""
    num_gpus: int | None = None
    """Emulated mode: device count; ``None`` = world size."""
    target_model: str | None = None
    """Emulated mode: preset that gives FLOPs and memory; ``None`` = this model."""
    batch_ratio: float = 1.0
    """Emulated mode: target sequences one proxy sequence stands for (``cona/mapping.py``;
    ``bench/cona_ttp.py`` fixes it at 8).  ``cona.global_batch_sizes`` are target sequences."""
    step_dilation: float = 1.0
    """Emulated mode: target optimizer steps one proxy step stands for; each proxy step
    charges this many target step times (switch costs unchanged).  ``bench/cona_ttp.py``
    sets it from the noise-scale growth (``cona/targets.py``, Kaplan et al. 2020)."""
    clock: Literal["wall", "emulated"] = "wall"
    min_gain: float = 0.05
    """Switch only if the best candidate scores this fraction above current."""
    horizon_steps: int = 100
    """Steps over which a switch must repay its measured cost."""
    lr_scaling: Literal["sqrt", "linear", "none"] = "sqrt"
    """How the learning rate follows the global batch size when it changes."""
    gns_average: Literal["plain", "scale_free"] = "plain"
    """How the noise-scale estimator averages steps (``cona/grad_stats.py``): ``plain`` is
    McCandlish's ratio of EMAs, which reads a rising noise scale low (~20 steps behind
    early in training); ``scale_free`` divides each step's estimates by its
    ``|G_big|^2`` and tracks it closer (tiny_bert: 113 against 125 measured directly,
    plain 44).  ``plain`` is the default because CONA ranked better with it (GPT-3 bench:
    44.13 s against 47.90 s; Llama and BERT equal): Pollux's efficiency on ``B_simple``
    overrates larger batches there and the lag offsets part of that (README)."""
    gns_preconditioned: bool = False
    """Estimate the noise scale of Adam-preconditioned gradients, ``tr(P Sigma P)/|P G|^2``
    with ``P = 1/(sqrt(v_hat)+eps)``, as Pollux does for adaptive optimizers (Qiao et al.
    OSDI'21, Sec. 3.1; ``cona/probe.py``), instead of ``B_simple``; use it with
    ``gns_average=scale_free`` (``|P G|^2`` falls by orders of magnitude early on).  Off by
    default: on the CONA bench CONA ranked worse with it on all three families (GPT-3 and
    Llama missed the target, BERT 2.07 s against 1.79 s; README)."""
    start_slack: float = 0.02
    """Emulated mode: the start layout may be this fraction slower than the fastest at the
    start batch if it runs the next larger batch faster (``cona.controller.start_strategy``:
    a later batch-only switch instead of a layout switch); 0 = the fastest.  If the noise
    scale never calls for the larger batch, the whole run is this much slower, so keep it
    at the slowdown you accept in that case (2 %, chosen after a 5 % run lost 5.1 % on
    Llama, README).  Must be below ``min_gain``, or the controller undoes the start."""
    switch_timeout_s: float = 600.0
    """Real mode: a layout switch still running after this many seconds means
    a rank stalled or was lost; every rank then exits with one line (resume
    from the last checkpoint at either layout)."""
    schedule: list | None = None
    """GeoMesh, one job per region (``geomesh.region``): layout switches at round
    boundaries, ``[{after_step, region, tp, pp}]`` -- after outer step ``after_step``
    (the metrics' ``step``) region ``region`` moves to TP=``tp``, PP=``pp`` (DP = its
    processes / (tp*pp)) with CONA's in-memory switch (``geomesh/layout_switch.py``).
    Needs ``cona.enabled=true``.  A schedule, because CONA's controller ranks global
    batches and GeoMesh's planner owns each region's batch: the controller does not
    drive GeoMesh regions yet."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad CONA setting."""
        if self.schedule is not None and not self.enabled:
            raise ConfigError("cona.schedule switches GeoMesh regions with CONA's switch; set "
                              "cona.enabled=true (or unset cona.schedule)")
        if not self.enabled:
            return
        for key in ("decision_interval", "horizon_steps"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"cona.{key}={getattr(self, key)} must be positive")
        if not 0 <= self.min_gain < float("inf"):
            raise ConfigError(f"cona.min_gain={self.min_gain} must be >= 0 (0.05 = switch for a "
                              "5 % better score)")
        if not 0 <= self.start_slack < 1:
            raise ConfigError(f"cona.start_slack={self.start_slack} must be in [0, 1) (0.02 = "
                              "start up to 2 % slower for a cheaper later switch; 0 = fastest)")
        if self.clock == "emulated" and self.start_slack > 0 and self.start_slack >= self.min_gain:
            raise ConfigError(f"cona.start_slack={self.start_slack} must be below cona.min_gain="
                              f"{self.min_gain}: the controller would switch back from the "
                              "start layout at its first decision; lower start_slack")
        if not 0 < self.switch_timeout_s < float("inf"):
            raise ConfigError(f"cona.switch_timeout_s={self.switch_timeout_s} must be a positive "
                              "number of seconds (default 600)")
        if self.num_gpus is not None and self.num_gpus <= 0:
            raise ConfigError(f"cona.num_gpus={self.num_gpus} must be positive (or null: the "
                              "world size)")
        if self.candidates is not None and not self.candidates:
            raise ConfigError("cona.candidates=[] lists no candidate; give some, or null to "
                              "enumerate them")
        if not 1 <= self.step_dilation < float("inf"):
            raise ConfigError(f"cona.step_dilation={self.step_dilation} must be a number >= 1 "
                              "(1 = one target step per proxy step)")
        if not 0 < self.batch_ratio < float("inf"):
            raise ConfigError(f"cona.batch_ratio={self.batch_ratio} must be a positive number")
        if self.clock == "wall" and (self.num_gpus is not None or self.target_model is not None
                                     or self.batch_ratio != 1):
            raise ConfigError("cona.num_gpus, cona.target_model and cona.batch_ratio apply to the "
                              "emulated clock; set cona.clock=emulated (or unset them)")
        from .hardware import gpu_profiles

        if self.gpu.lower() not in {k.lower() for k in gpu_profiles()}:
            raise ConfigError(f"cona.gpu={self.gpu!r} is unknown; use one of "
                              f"{sorted(gpu_profiles())} or add it to jobruntime/gpu_profiles.yaml")


@dataclass(kw_only=True)
class JobConfig:
    """The whole job.  Sections are documented in their own classes."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    geomesh: GeoMeshConfig = field(default_factory=GeoMeshConfig)
    cona: ConaConfig = field(default_factory=ConaConfig)
    name: str = "job"
    """Preset name (file stem), used in run names."""

    def validate_sections(self) -> None:
        """Check each section's own settings (everything but the layout, which needs the
        world size; GeoMesh's section is checked by ``geomesh.context``).

        Raises:
            ConfigError: the first out-of-range setting, named.
        """
        self.model.validate()
        self.train.validate()
        self.data.validate()
        self.checkpoint.validate()
        self.cona.validate()

    def validate(self, world_size: int = 1) -> int:
        """Validate every section; return the DP size for ``world_size`` processes."""
        self.validate_sections()
        return self.parallel.validate(self.model, world_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------
# Loading and overrides
# ---------------------------------------------------------------------------


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Return ``value`` coerced to ``hint`` or raise ConfigError naming ``where``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if isinstance(value, bool) and value not in allowed:
            # YAML 1.1 reads on/off/yes/no as booleans; map them back to the words.
            words = ("on", "true", "yes") if value else ("off", "false", "no")
            value = next((w for w in words if w in allowed), value)
        if value not in allowed:
            raise ConfigError(f"{where}={value!r} is not one of {list(allowed)}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}={value!r} must be a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}={value!r} must be a string")
    if hint is list or origin is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{where}={value!r} must be a list")
    return value


def _apply(obj: Any, values: dict, where: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ConfigError(
                f"unknown config key {path!r}; valid keys here: {', '.join(sorted(names))}"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{path!r} is a section; give it a mapping of keys")
            _apply(current, value, path)
        else:
            setattr(obj, key, _check_type(value, hints[key], path))


def resolve_preset(name_or_path: str | Path) -> Path:
    """Map ``tiny_gpt`` or ``model_configs/tiny_gpt.yaml`` or any path to a file.

    Raises:
        ConfigError: no such preset or file.
    """
    p = Path(name_or_path)
    candidates = [p, MODEL_CONFIGS_DIR / p, MODEL_CONFIGS_DIR / f"{p}.yaml", REPO_ROOT / p]
    for c in candidates:
        if c.is_file():
            return c
    known = sorted(x.stem for x in MODEL_CONFIGS_DIR.glob("*.yaml"))
    raise ConfigError(f"config {str(name_or_path)!r} not found; use a YAML file or one of {known}")


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``section.key=value`` into (``[section, key]``, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    if not key:
        raise ConfigError(f"override {text!r} has no key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML "
                          f"({' '.join(str(e).split())})") from None
    return key.split("."), value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> JobConfig:
    """Load a preset YAML and apply ``section.key=value`` overrides.

    Args:
        path: preset name (``tiny_gpt``) or YAML path; ``None`` = defaults.
        overrides: strings ``section.key=value``; values are parsed as YAML.

    Raises:
        ConfigError: unknown key, wrong type, unreadable YAML.
    """
    cfg = JobConfig()
    if path is not None:
        file = resolve_preset(path)
        try:
            values = yaml.safe_load(file.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"{file}: not a readable YAML text file ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{file}: top level must be a mapping of sections")
        values.setdefault("name", file.stem)
        _apply(cfg, values, "")
    for text in overrides:
        keys, value = parse_override(text)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _apply(cfg, nested, "")
    return cfg


def save_config(cfg: JobConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically: temp file, then rename).

    ``model.padded_vocab_size`` is written resolved (the size this run's
    embedding has), so a resume or fine-tune builds the same shapes.
    """
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    values = cfg.to_dict()
    values["model"]["padded_vocab_size"] = cfg.model.padded_vocab
    tmp.write_text(yaml.safe_dump(values, sort_keys=False))
    tmp.replace(path)
