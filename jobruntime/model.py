"""Build megatron-core ``GPTModel`` / ``BertModel`` from a :class:`ModelConfig`.

The one place where this project's config becomes megatron-core's
``TransformerConfig`` (:func:`to_transformer_config`).  Layer specs
(:func:`jobruntime.attention.layer_spec`): Transformer Engine's where it
imports, otherwise megatron-core's local specs with torch SDPA as the core
attention.  Fused kernels are switched on only where they import
(:mod:`jobruntime.kernels`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import TransformerConfig

from . import cpu_compat
from .attention import allow_unmasked, layer_spec, resolve_attention_backend, swap_in_sdpa
from .config import ConfigError, ModelConfig, ParallelConfig
from .kernels import Kernels, available_kernels
from .vocab import mask_padded_logits


def to_transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    perform_initialization: bool = True,
) -> TransformerConfig:
    """Map the project's config to megatron-core's ``TransformerConfig``.

    Weights are initialised from the full (unsharded) tensor and then split
    (megatron's ``use_cpu_initialization`` path, which allocates without a
    ``device=``: :func:`build_model` runs it under the compute device), so with
    the same seed a TP=2 model holds the same weights as a TP=1 model.  Each
    kernel fusion is on only where its kernel imports
    (:func:`jobruntime.kernels.available_kernels`), and only where it computes
    what the unfused path computes:

    * bias+activation fusion for SwiGLU only: megatron's fused bias-GeLU
      (``fused_bias_gelu.bias_gelu``) is the tanh approximation, while the
      unfused path and the Hugging Face export (``activation_function`` /
      ``hidden_act`` ``"gelu"``, :func:`tools.hf_mapping.hf_config_from_model`)
      use the exact (erf) GeLU;
    * the fused cross entropy under bf16 only: its backward casts the logit
      gradients to bf16 (``fused_cross_entropy.calculate_gradients``), which
      under fp32 would round every logit gradient to 8 mantissa bits.
    ``calculate_per_token_loss`` is on: the loss function
    (:func:`jobruntime.objective.token_sum_loss`) returns token sums.
    """
    k = available_kernels() if model.kernel_fusions == "auto" else Kernels.none()
    swiglu = model.activation == "swiglu"
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.kv_heads,
        ffn_hidden_size=model.ffn,
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        sequence_parallel=parallel.sequence_parallel,
        normalization=model.normalization,
        layernorm_epsilon=model.layernorm_epsilon,
        activation_func=F.silu if swiglu else F.gelu,
        gated_linear_unit=swiglu,
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=model.dropout,
        attention_dropout=model.dropout,
        init_method_std=model.init_method_std,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=perform_initialization,
        bias_activation_fusion=k.jit and swiglu,
        bias_dropout_fusion=k.jit,
        cross_entropy_loss_fusion=k.jit and params_dtype == torch.bfloat16,
        cross_entropy_fusion_impl="native",
        masked_softmax_fusion=k.masked_softmax,
        apply_rope_fusion=k.rope and model.position_embedding == "rope",
        gradient_accumulation_fusion=k.grad_accumulation,
        persist_layer_norm=k.persist_layer_norm,
        # the loss is a sum over tokens, normalised once per global batch
        # (jobruntime.objective: independent of the micro-batch and DP split)
        calculate_per_token_loss=True,
    )


def _check_sequence_parallel(parallel: ParallelConfig, backend: str) -> None:
    """Refuse sequence parallelism where the layer specs' norm cannot run it.

    The Transformer Engine specs (``TENorm``) and apex's ``FusedLayerNorm`` split the norm
    over the sequence; without either, megatron-core's local specs use
    ``WrappedTorchNorm``, which asserts ``not config.sequence_parallel`` deep in the build.
    megatron's own ``HAVE_APEX`` decides which norm the local specs take.

    Raises:
        ConfigError: ``parallel.sequence_parallel`` without a norm that supports it.
    """
    if not parallel.sequence_parallel or backend == "te":
        return
    from megatron.core.models.gpt import gpt_layer_specs

    if not gpt_layer_specs.HAVE_APEX:
        raise ConfigError(
            "parallel.sequence_parallel=true needs Transformer Engine or apex (megatron-core's "
            "torch LayerNorm cannot split the sequence); install one, or set "
            "parallel.sequence_parallel=false")


def build_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    params_dtype: torch.dtype = torch.float32,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    meta: bool = False,
    local_spec: bool = False,
    device: torch.device | None = None,
) -> torch.nn.Module:
    """Build this rank's model chunk for the current ``parallel_state`` layout.

    The chunk is built directly on ``device``: megatron's initialisation runs
    under ``with device:`` (torch's device context), so every weight, the
    full-size initial draws included, is allocated there and nothing is made
    on the host and moved (1B-class models took 23-28 s to build on the CPU and
    move; CONA paid it at every layout switch).  The draws come from
    ``device``'s default generator, which :func:`jobruntime.parallel.set_seed`
    seeds alike on every rank, in the same order at every layout: the same
    seed gives the same model at every TP and PP size on a given device type
    (the CPU and CUDA generators draw different numbers).

    Args:
        pre_process / post_process: embedding / output-layer stage flags;
            ``None`` derives them from the pipeline rank.
        meta: build on the meta device (no memory; for sizes and parameter counts).
        local_spec: megatron-core's local layer specs (with SDPA attention
            unless ``model.attention_backend=local``) even where Transformer
            Engine is available: plain state-dict names such as
            ``input_layernorm``, used by checkpoint conversion.
        device: where to build; ``None`` = the compute device
            (:func:`jobruntime.cpu_compat.device`).  Ignored when ``meta``.

    Returns:
        A ``GPTModel`` (families ``gpt``, ``llama``) or ``BertModel`` (``bert``)
        on the compute device (built there, not moved: a 1B-class model took
        23-28 s to build on the host and move to an H200), holding this rank's shard: ``num_layers / pp`` layers, TP-split weights,
        ``model.padded_vocab`` embedding rows (the same at every layout) whose
        padding ids' logits are ``-inf`` (:mod:`jobruntime.vocab`).  With the
        same torch seed every layout holds the same weights (see
        :func:`_draw_earlier_stages` for PP).
    """
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.gpt.gpt_model import GPTModel

    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    tcfg = to_transformer_config(
        model, parallel, params_dtype=params_dtype, perform_initialization=not meta
    )
    vocab = model.padded_vocab
    backend = resolve_attention_backend(model)
    if local_spec and backend == "te":
        backend = "sdpa"
    _check_sequence_parallel(parallel, backend)
    spec = layer_spec(model, backend)
    device = torch.device("meta") if meta else device or cpu_compat.device()
    if not meta and parallel.pp > 1:
        _draw_earlier_stages(model, parallel, params_dtype, local_spec, device)
    common = dict(config=tcfg, transformer_layer_spec=spec, vocab_size=vocab,
                  max_sequence_length=model.max_positions, pre_process=pre_process,
                  post_process=post_process,
                  share_embeddings_and_output_weights=model.tie_embeddings)
    with device:  # factory calls without device= (megatron's CPU-init path) land here
        if model.family == "bert":
            module = BertModel(**common, num_tokentypes=2, add_binary_head=False)
            allow_unmasked(module)
            if backend == "sdpa":
                module = swap_in_sdpa(module)
        else:
            module = GPTModel(
                **common,
                position_embedding_type=model.position_embedding,
                rotary_base=model.rotary_base,
                rope_scaling=model.rope_scaling,
                rope_scaling_factor=model.rope_scaling_factor,
            )
    mask_padded_logits(module, model.vocab_size)
    return module


def _draw_earlier_stages(model: ModelConfig, parallel: ParallelConfig, params_dtype: torch.dtype,
                         local_spec: bool, device: torch.device) -> None:
    """Advance torch's default generator past the initial draws of the pipeline
    stages before this rank's, so that every PP layout holds the PP=1 model.

    Weights are drawn from ``device``'s default generator in construction order
    (``use_cpu_initialization``: embedding, then layer 0, 1, …).  A stage-``k``
    chunk alone would draw its layers with the numbers the PP=1 model used for
    layers 0, 1, …; building and dropping the chunks of stages ``0..k-1`` first
    (one at a time, as PP=1 models of ``L/pp`` layers: the draws depend only on
    the tensor sizes) leaves the generator where the PP=1 model draws layer
    ``k·L/pp``.  Costs the initialisation time of those stages, and the memory
    of one of them while it exists.
    """
    stage_model = dataclasses.replace(model, num_layers=model.num_layers // parallel.pp)
    single = dataclasses.replace(parallel, pp=1)
    for stage in range(parallel_state.get_pipeline_model_parallel_rank()):
        chunk = build_model(stage_model, single, params_dtype=params_dtype,
                            pre_process=stage == 0, post_process=False, local_spec=local_spec,
                            device=device)
        del chunk


def count_parameters(module: torch.nn.Module, *, vocab_size: int | None = None,
                     padded_vocab: int | None = None) -> int:
    """Number of parameters of ``module`` (shared tensors counted once).

    When ``vocab_size`` and ``padded_vocab`` are given, the rows megatron adds
    to pad the vocabulary are subtracted, so the count matches the
    architecture's published size.
    """
    seen, total = set(), 0
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
    if vocab_size is not None and padded_vocab is not None:
        pad = padded_vocab - vocab_size
        for name, p in module.named_parameters():
            if name.endswith("word_embeddings.weight") or name.endswith("output_layer.weight"):
                total -= pad * p.shape[1]
            elif name.endswith("output_layer.bias") or name.endswith("lm_head.bias") or name == "output_layer.bias":
                total -= pad
    return total


def meta_parameter_count(cfg) -> dict:
    """Build ``cfg``'s model on the meta device (no weight memory) and count it.

    Needs an initialised layout (:func:`jobruntime.parallel.initialize_layout`);
    counts this rank's shard, so call it at TP=PP=1 for the whole model.

    Returns:
        ``{"params": N, "params_padded": N_with_vocab_padding}``.
    """
    module = build_model(cfg.model, cfg.parallel, meta=True)
    padded = cfg.model.padded_vocab
    assert all(p.device.type == "meta" for p in module.parameters())
    return {
        "params": count_parameters(module, vocab_size=cfg.model.vocab_size, padded_vocab=padded),
        "params_padded": count_parameters(module),
    }
