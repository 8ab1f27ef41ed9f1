"""Hugging Face ↔ megatron-core weight and config mapping, on full (global) tensors.

Pure tensor code: no process groups, no files.  The megatron side is the
*unsharded, unpadded* state dict of a TP=1, PP=1 model built by
:func:`jobruntime.model.build_model` with megatron-core's local layer specs
(``decoder.layers.N.self_attention.linear_qkv.weight`` …; ``encoder.`` for
BERT), with ``vocab_size`` embedding rows.  Vocabulary padding and TP/PP
resharding happen in :mod:`tools.convert_checkpoint` (dist_checkpointing
reshards global tensors on load, so nothing here depends on the layout).

What is more than a rename:

* **Fused QKV.**  megatron-core's ``linear_qkv`` rows are grouped per query
  group: ``[q (a/g · d rows), k (d), v (d)]`` repeated ``g`` times (``a``
  query heads, ``g`` KV groups, ``d`` head dim).  TP rank ``r`` then holds
  whole groups, so the global tensor does not depend on TP.
* **SwiGLU.**  ``linear_fc1 = cat([gate, up])`` in the global (TP=1) tensor;
  megatron's sharded state dict stores gate and up as separate chunks, so
  each TP rank's ``[gate_r; up_r]`` is resharded correctly on load.
* **GPT-2 Conv1D** stores weights as ``[in, out]``: transposed here.
* **Tied embeddings**: the output layer shares ``embedding.word_embeddings``;
  an HF ``lm_head.weight`` must then equal the embedding.
* **BERT.**  megatron-core's ``BertModel`` with ``bert_layer_local_spec`` is
  *pre-LN*: no LayerNorm after the embeddings, ``input_layernorm`` before
  attention and ``pre_mlp_layernorm`` before the MLP inside each residual
  branch, and a ``final_layernorm``.  HF ``BertForMaskedLM`` /
  ``BertForPreTraining`` is *post-LN* (LayerNorm after each residual sum, and
  after the embeddings).  The two compute different functions for the same
  weights, and no re-parameterisation turns one into the other (post-LN
  normalises the residual stream itself).  HF's ``MegatronBertForMaskedLM``
  (``model_type: megatron-bert``) *is* the megatron architecture, so:

  - ``megatron-bert`` ↔ megatron: exact, logits equal;
  - ``bert`` ↔ megatron: LayerNorms mapped by position (embeddings LN →
    layer 0 ``input_layernorm``, attention-output LN of layer i →
    ``pre_mlp_layernorm`` of layer i, output LN of layer i → next layer's
    ``input_layernorm`` or ``final_layernorm``).  Bijective, so round trips
    are bit-exact, but the converted model is *not* function-equivalent:
    fine-tune it.  Both directions log this in one warning line
    (:data:`NOT_FUNCTION_PRESERVING`), and ``hf-to-mcore`` records it in the
    written config (``checkpoint.load_exact: false``).  The pooler and NSP head (``BertForPreTraining``) are
    dropped: the project's BERT has no binary head.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from jobruntime.config import ModelConfig

log = logging.getLogger("tools.convert")

HfArch = Literal["llama", "gpt2", "megatron-bert", "bert"]
# transformers config class and model class written on export, per HF arch
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "megatron-bert": ("MegatronBertConfig", "MegatronBertForMaskedLM"),
    "bert": ("BertConfig", "BertForMaskedLM"),
}
FAMILY_ARCHS = {"llama": ("llama",), "gpt": ("gpt2",), "bert": ("megatron-bert", "bert")}
# model classes (config.json "architectures") whose weights each HF arch maps from
READABLE_CLASSES = {
    "llama": ("LlamaForCausalLM",),
    "gpt2": ("GPT2LMHeadModel",),
    "megatron-bert": ("MegatronBertForMaskedLM", "MegatronBertForPreTraining"),
    "bert": ("BertForMaskedLM", "BertForPreTraining"),
}
# HF architectures whose mapping keeps every weight (bit-exact round trips) but not the
# function: a converted model is an initialisation, not the HF model (module docstring).
# Every other arch converts exactly (test_tools_convert: logits equal within 1e-4).
NOT_FUNCTION_PRESERVING = {
    "bert": "HF BertForMaskedLM/BertForPreTraining is post-LN and megatron-core's BertModel is "
            "pre-LN: the weights map one to one but the converted model computes a different "
            "function, an initialisation to fine-tune, not the same model (MegatronBertForMaskedLM "
            "converts exactly)",
}
# GELU approximations HF GPT-2 configs use; megatron here uses the exact (erf) GELU
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
# Llama-3 RoPE scaling constants megatron-core hard-codes (rotary_pos_embedding._apply_scaling)
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


class ConversionError(ValueError):
    """The checkpoint or config cannot be mapped; the message says what differs."""


# ---------------------------------------------------------------------------
# Fused QKV
# ---------------------------------------------------------------------------


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """``q [a·d, …]``, ``k``/``v [g·d, …]`` → megatron ``linear_qkv [(a + 2g)·d, …]``.

    Rows grouped per KV group: ``[q of the group's a/g heads; k; v]`` × g.
    Works for weights (``[…, h]``) and biases (no trailing dims).
    """
    rest = q.shape[1:]
    parts = [t.reshape(groups, -1, *rest) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *rest)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    rest = qkv.shape[1:]
    d = qkv.shape[0] // (heads + 2 * groups)
    per = heads // groups
    x = qkv.reshape(groups, (per + 2) * d, *rest)
    q, k, v = x.split([per * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------


def hf_arch_of(hcfg: dict, *, family: str | None = None, hf_arch: str | None = None) -> str:
    """The HF architecture of a ``config.json`` (``llama``, ``gpt2``, ``bert``,
    ``megatron-bert``), checked against what the caller asked for.

    Both fields of ``config.json`` count: ``model_type`` selects the weight
    mapping, and ``architectures`` (when present) must name a class of that
    type with the weights the mapping reads (an LM head; e.g. ``BertModel``
    or ``BertForSequenceClassification`` have none).

    Args:
        family: ``--model``; the input must be one of its architectures.
        hf_arch: ``--hf-arch``; the input must be exactly this architecture.

    Raises:
        ConversionError: unknown or inconsistent fields, or a mismatch with
            ``family`` / ``hf_arch`` (the message names what the input is and
            the flag that fits it).
    """
    arch = hcfg.get("model_type")
    if arch not in HF_CLASSES:
        raise ConversionError(f"config.json model_type {arch!r} is not supported; "
                              f"use one of {sorted(HF_CLASSES)}")
    names = hcfg.get("architectures") or []
    what = f"{names[0] if names else 'a model'} (model_type {arch!r})"
    if names and not set(names) & set(READABLE_CLASSES[arch]):
        raise ConversionError(
            f"config.json says architectures {names} with model_type {arch!r}; convertible are "
            f"{', '.join(c for cs in READABLE_CLASSES.values() for c in cs)} (a model with its "
            "LM head)")
    if family is not None and arch not in FAMILY_ARCHS[family]:
        fits = next(f for f, archs in FAMILY_ARCHS.items() if arch in archs)
        raise ConversionError(f"--model {family} but the input is {what}; use --model {fits}")
    if hf_arch is not None and arch != hf_arch:
        raise ConversionError(f"--hf-arch {hf_arch} but the input is {what}; use --hf-arch {arch} "
                              "(or leave it out)")
    return arch


def default_hf_arch(family: str) -> str:
    """HF architecture written for a family: BERT exports as ``megatron-bert``
    (the function-equivalent class, see the module docstring)."""
    return FAMILY_ARCHS[family][0]


def _rope_from_hf(hcfg: dict) -> tuple[int, bool, float]:
    """(rotary_base, rope_scaling, factor) from ``rope_parameters`` (transformers 5)
    or the older top-level ``rope_theta`` / ``rope_scaling``."""
    params = {**(hcfg.get("rope_scaling") or {}), **(hcfg.get("rope_parameters") or {})}
    theta = float(params.get("rope_theta", hcfg.get("rope_theta", 10000.0)))
    if theta != int(theta):
        raise ConversionError(f"rope_theta={theta} is not an integer (model.rotary_base is)")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return int(theta), False, 8.0
    if kind == "llama3":
        for key, want in _LLAMA3_ROPE.items():
            if float(params.get(key, want)) != want:
                raise ConversionError(f"llama3 RoPE {key}={params[key]}: megatron-core fixes it to {want}")
        return int(theta), True, float(params["factor"])
    raise ConversionError(f"RoPE type {kind!r} has no equivalent here (only default and llama3)")


def _normalised(**kw) -> ModelConfig:
    """ModelConfig with derived fields left at ``None`` when they equal their default
    (so the checkpoint's arch record matches a preset written the same way)."""
    if kw.get("num_query_groups") == kw["num_attention_heads"]:
        kw["num_query_groups"] = None
    if kw.get("ffn_hidden_size") == 4 * kw["hidden_size"]:
        kw["ffn_hidden_size"] = None
    if kw.get("max_position_embeddings") == kw["seq_length"]:
        kw["max_position_embeddings"] = None
    cfg = ModelConfig(**kw)
    cfg.validate()
    return cfg


def model_config_from_hf(family: str, hcfg: dict, *, seq_length: int | None = None) -> ModelConfig:
    """Map an HF ``config.json`` (dict) to the project's :class:`ModelConfig`.

    Args:
        seq_length: training sequence length; default ``min(max positions, 2048)``.

    Raises:
        ConversionError: wrong family, or a feature megatron cannot express here.
    """
    arch = hf_arch_of(hcfg, family=family)
    g = hcfg.get
    if arch == "llama":
        heads, hidden = g("num_attention_heads"), g("hidden_size")
        if (g("head_dim") or hidden // heads) != hidden // heads:
            raise ConversionError(f"head_dim={g('head_dim')} != hidden_size/heads; not supported")
        if g("hidden_act", "silu") != "silu":
            raise ConversionError(f"hidden_act={g('hidden_act')!r}: Llama needs silu (SwiGLU)")
        if bool(g("attention_bias", False)) != bool(g("mlp_bias", False)):
            raise ConversionError("attention_bias != mlp_bias: model.add_bias_linear sets both")
        base, scaling, factor = _rope_from_hf(hcfg)
        max_pos = g("max_position_embeddings", 2048)
        return _normalised(
            family="llama", num_layers=g("num_hidden_layers"), hidden_size=hidden,
            num_attention_heads=heads, num_query_groups=g("num_key_value_heads") or heads,
            ffn_hidden_size=g("intermediate_size"), vocab_size=g("vocab_size"),
            seq_length=seq_length or min(max_pos, 2048), max_position_embeddings=max_pos,
            position_embedding="rope", rotary_base=base, rope_scaling=scaling,
            rope_scaling_factor=factor, normalization="RMSNorm", activation="swiglu",
            add_bias_linear=bool(g("attention_bias", False)),
            tie_embeddings=bool(g("tie_word_embeddings", False)),
            init_method_std=g("initializer_range", 0.02), layernorm_epsilon=g("rms_norm_eps", 1e-6),
            dropout=float(g("attention_dropout", 0.0)),
        )
    if arch == "gpt2":
        act = g("activation_function", "gelu_new")
        if act in _TANH_GELUS:
            log.warning("activation_function=%s is a tanh GELU approximation; megatron uses the "
                        "exact GELU, so logits will differ slightly (~1e-3)", act)
        elif act != "gelu":
            raise ConversionError(f"activation_function={act!r} is not a GELU")
        if g("scale_attn_by_inverse_layer_idx", False) or not g("scale_attn_weights", True):
            raise ConversionError("GPT-2 attention scaling variants are not supported")
        n_pos = g("n_positions", 1024)
        return _normalised(
            family="gpt", num_layers=g("n_layer"), hidden_size=g("n_embd"),
            num_attention_heads=g("n_head"), ffn_hidden_size=g("n_inner") or 4 * g("n_embd"),
            vocab_size=g("vocab_size"), seq_length=seq_length or min(n_pos, 2048),
            max_position_embeddings=n_pos, position_embedding="learned_absolute",
            normalization="LayerNorm", activation="gelu", add_bias_linear=True,
            tie_embeddings=bool(g("tie_word_embeddings", True)),
            init_method_std=g("initializer_range", 0.02),
            layernorm_epsilon=g("layer_norm_epsilon", 1e-5), dropout=float(g("resid_pdrop", 0.1)),
        )
    # bert / megatron-bert
    if g("hidden_act", "gelu") != "gelu":
        raise ConversionError(f"hidden_act={g('hidden_act')!r}: megatron BERT uses exact gelu")
    if g("type_vocab_size", 2) != 2:
        raise ConversionError(f"type_vocab_size={g('type_vocab_size')}: megatron BERT has 2 types")
    if g("position_embedding_type", "absolute") != "absolute":
        raise ConversionError("only absolute position embeddings are supported for BERT")
    max_pos = g("max_position_embeddings", 512)
    return _normalised(
        family="bert", num_layers=g("num_hidden_layers"), hidden_size=g("hidden_size"),
        num_attention_heads=g("num_attention_heads"), ffn_hidden_size=g("intermediate_size"),
        vocab_size=g("vocab_size"), seq_length=seq_length or min(max_pos, 512),
        max_position_embeddings=max_pos, position_embedding="learned_absolute",
        normalization="LayerNorm", activation="gelu", add_bias_linear=True,
        tie_embeddings=bool(g("tie_word_embeddings", True)),
        init_method_std=g("initializer_range", 0.02), layernorm_epsilon=g("layer_norm_eps", 1e-12),
        dropout=float(g("hidden_dropout_prob", 0.1)),
    )


def _require(model: ModelConfig, arch: str, **want) -> None:
    bad = {k: getattr(model, k) for k, v in want.items() if getattr(model, k) != v}
    if bad:
        raise ConversionError(f"model {bad} cannot be written as HF {arch} (needs {want})")


def hf_config_from_model(model: ModelConfig, arch: str) -> tuple[str, dict]:
    """(transformers config class name, its kwargs) describing ``model`` as ``arch``.

    Raises:
        ConversionError: ``model`` uses a feature ``arch`` cannot express.
    """
    if arch not in FAMILY_ARCHS[model.family]:
        raise ConversionError(f"family {model.family} cannot be exported as {arch!r}; "
                              f"use one of {FAMILY_ARCHS[model.family]}")
    m = model
    if arch == "llama":
        _require(m, arch, position_embedding="rope", normalization="RMSNorm", activation="swiglu")
        rope = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
        if m.rope_scaling:
            rope.update(rope_type="llama3", factor=m.rope_scaling_factor, **_LLAMA3_ROPE)
        kw = dict(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.ffn,
            num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
            num_key_value_heads=m.kv_heads, head_dim=m.hidden_size // m.num_attention_heads,
            max_position_embeddings=m.max_positions, rms_norm_eps=m.layernorm_epsilon,
            tie_word_embeddings=m.tie_embeddings, rope_parameters=rope, hidden_act="silu",
            attention_bias=m.add_bias_linear, mlp_bias=m.add_bias_linear,
            initializer_range=m.init_method_std, attention_dropout=m.dropout,
        )
    elif arch == "gpt2":
        _require(m, arch, position_embedding="learned_absolute", normalization="LayerNorm",
                 activation="gelu", add_bias_linear=True, kv_heads=m.num_attention_heads)
        kw = dict(
            vocab_size=m.vocab_size, n_positions=m.max_positions, n_embd=m.hidden_size,
            n_layer=m.num_layers, n_head=m.num_attention_heads,
            n_inner=None if m.ffn == 4 * m.hidden_size else m.ffn, activation_function="gelu",
            resid_pdrop=m.dropout, embd_pdrop=m.dropout, attn_pdrop=m.dropout,
            layer_norm_epsilon=m.layernorm_epsilon, initializer_range=m.init_method_std,
            tie_word_embeddings=m.tie_embeddings,
        )
    else:
        _require(m, arch, position_embedding="learned_absolute", normalization="LayerNorm",
                 activation="gelu", add_bias_linear=True, kv_heads=m.num_attention_heads)
        kw = dict(
            vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_attention_heads, intermediate_size=m.ffn,
            hidden_act="gelu", hidden_dropout_prob=m.dropout,
            attention_probs_dropout_prob=m.dropout, max_position_embeddings=m.max_positions,
            type_vocab_size=2, initializer_range=m.init_method_std,
            layer_norm_eps=m.layernorm_epsilon, tie_word_embeddings=m.tie_embeddings,
        )
    return HF_CLASSES[arch][0], kw


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


class _Source:
    """An HF state dict whose keys are consumed; leftovers are an error."""

    def __init__(self, state: dict, prefix: str, ignore: tuple[str, ...]):
        self.state, self.prefix, self.ignore = dict(state), prefix, ignore

    def has(self, key: str) -> bool:
        return self.prefix + key in self.state

    def take(self, key: str) -> torch.Tensor:
        try:
            return self.state.pop(self.prefix + key)
        except KeyError:
            raise ConversionError(f"HF checkpoint has no tensor '{self.prefix + key}'") from None

    def finish(self) -> None:
        left = [k for k in self.state if not any(s in k for s in self.ignore)]
        if left:
            raise ConversionError(f"HF tensors not mapped (unsupported variant?): {sorted(left)[:8]}")


def _prefix(state: dict, prefix: str) -> str:
    return prefix if any(k.startswith(prefix) for k in state) else ""


def _tied_output(src: _Source, model: ModelConfig, key: str, emb: torch.Tensor, out: dict) -> None:
    """Map the HF output projection ``key`` to ``output_layer.weight`` unless tied."""
    if model.tie_embeddings:
        if src.has(key) and not torch.equal(src.take(key), emb):
            raise ConversionError(f"tie_word_embeddings is true but '{key}' differs from the embedding")
    else:
        out["output_layer.weight"] = src.take(key)


def hf_to_mcore_state(family: str, hcfg: dict, hf_state: dict, *, seq_length: int | None = None,
                      hf_arch: str | None = None) -> tuple[ModelConfig, dict]:
    """HF checkpoint (config dict + tensors) → (ModelConfig, megatron TP=1 state, unpadded).

    The weight mapping is the input's own architecture (:func:`hf_arch_of`);
    ``hf_arch``, when given, must be that one.

    Raises:
        ConversionError: unsupported or mismatched config, or missing / unmapped tensors.
    """
    arch = hf_arch_of(hcfg, family=family, hf_arch=hf_arch)
    model = model_config_from_hf(family, hcfg, seq_length=seq_length)
    if arch in NOT_FUNCTION_PRESERVING:
        log.warning("converting HF %s: %s", arch, NOT_FUNCTION_PRESERVING[arch])
    a, g, bias = model.num_attention_heads, model.kv_heads, model.add_bias_linear
    out: dict[str, torch.Tensor] = {}
    if arch == "llama":
        src = _Source(hf_state, _prefix(hf_state, "model."), ("rotary_emb.inv_freq",))
        out["embedding.word_embeddings.weight"] = emb = src.take("embed_tokens.weight")
        for i in range(model.num_layers):
            h, m = f"layers.{i}.", f"decoder.layers.{i}."
            out[m + "input_layernorm.weight"] = src.take(h + "input_layernorm.weight")
            for suffix in ("weight", "bias") if bias else ("weight",):
                q, k, v = (src.take(f"{h}self_attn.{p}_proj.{suffix}") for p in "qkv")
                out[f"{m}self_attention.linear_qkv.{suffix}"] = fuse_qkv(q, k, v, a, g)
                out[f"{m}self_attention.linear_proj.{suffix}"] = src.take(f"{h}self_attn.o_proj.{suffix}")
                gate, up = src.take(f"{h}mlp.gate_proj.{suffix}"), src.take(f"{h}mlp.up_proj.{suffix}")
                out[f"{m}mlp.linear_fc1.{suffix}"] = torch.cat([gate, up], dim=0)
                out[f"{m}mlp.linear_fc2.{suffix}"] = src.take(f"{h}mlp.down_proj.{suffix}")
            out[m + "pre_mlp_layernorm.weight"] = src.take(h + "post_attention_layernorm.weight")
        out["decoder.final_layernorm.weight"] = src.take("norm.weight")
        src.prefix = ""
        _tied_output(src, model, "lm_head.weight", emb, out)
    elif arch == "gpt2":
        src = _Source(hf_state, _prefix(hf_state, "transformer."), (".attn.bias", ".attn.masked_bias"))
        out["embedding.word_embeddings.weight"] = emb = src.take("wte.weight")
        out["embedding.position_embeddings.weight"] = src.take("wpe.weight")
        for i in range(model.num_layers):
            h, m = f"h.{i}.", f"decoder.layers.{i}."
            for s in ("weight", "bias"):
                out[f"{m}input_layernorm.{s}"] = src.take(f"{h}ln_1.{s}")
                out[f"{m}pre_mlp_layernorm.{s}"] = src.take(f"{h}ln_2.{s}")
            # Conv1D weights are [in, out]; .t() gives the Linear [out, in] layout
            q, k, v = src.take(h + "attn.c_attn.weight").t().chunk(3, dim=0)
            out[m + "self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, a, g)
            q, k, v = src.take(h + "attn.c_attn.bias").chunk(3, dim=0)
            out[m + "self_attention.linear_qkv.bias"] = fuse_qkv(q, k, v, a, g)
            out[m + "self_attention.linear_proj.weight"] = src.take(h + "attn.c_proj.weight").t().contiguous()
            out[m + "self_attention.linear_proj.bias"] = src.take(h + "attn.c_proj.bias")
            out[m + "mlp.linear_fc1.weight"] = src.take(h + "mlp.c_fc.weight").t().contiguous()
            out[m + "mlp.linear_fc1.bias"] = src.take(h + "mlp.c_fc.bias")
            out[m + "mlp.linear_fc2.weight"] = src.take(h + "mlp.c_proj.weight").t().contiguous()
            out[m + "mlp.linear_fc2.bias"] = src.take(h + "mlp.c_proj.bias")
        for s in ("weight", "bias"):
            out[f"decoder.final_layernorm.{s}"] = src.take(f"ln_f.{s}")
        src.prefix = ""
        _tied_output(src, model, "lm_head.weight", emb, out)
    else:
        src = _Source(hf_state, _prefix(hf_state, "bert."),
                      ("pooler.", "cls.seq_relationship.", "embeddings.position_ids",
                       "embeddings.token_type_ids"))
        out["embedding.word_embeddings.weight"] = emb = src.take("embeddings.word_embeddings.weight")
        out["embedding.position_embeddings.weight"] = src.take("embeddings.position_embeddings.weight")
        out["embedding.tokentype_embeddings.weight"] = src.take("embeddings.token_type_embeddings.weight")
        for (hf_ln, m_ln) in _bert_layernorms(model.num_layers, arch):
            for s in ("weight", "bias"):
                out[f"{m_ln}.{s}"] = src.take(f"{hf_ln}.{s}")
        for i in range(model.num_layers):
            h, m = f"encoder.layer.{i}.", f"encoder.layers.{i}."
            for s in ("weight", "bias"):
                q, k, v = (src.take(f"{h}attention.self.{p}.{s}") for p in ("query", "key", "value"))
                out[f"{m}self_attention.linear_qkv.{s}"] = fuse_qkv(q, k, v, a, g)
                out[f"{m}self_attention.linear_proj.{s}"] = src.take(f"{h}attention.output.dense.{s}")
                out[f"{m}mlp.linear_fc1.{s}"] = src.take(f"{h}intermediate.dense.{s}")
                out[f"{m}mlp.linear_fc2.{s}"] = src.take(f"{h}output.dense.{s}")
        src.prefix = ""
        for s in ("weight", "bias"):
            out[f"lm_head.dense.{s}"] = src.take(f"cls.predictions.transform.dense.{s}")
            out[f"lm_head.layer_norm.{s}"] = src.take(f"cls.predictions.transform.LayerNorm.{s}")
        # decoder.bias is tied to predictions.bias in HF; either may be stored
        biases = [src.take(k) for k in ("cls.predictions.bias", "cls.predictions.decoder.bias") if src.has(k)]
        if not biases or any(not torch.equal(b, biases[0]) for b in biases):
            raise ConversionError("need one cls.predictions.bias (or equal decoder.bias)")
        out["output_layer.bias"] = biases[0]
        _tied_output(src, model, "cls.predictions.decoder.weight", emb, out)
    src.finish()
    return model, out


def _bert_layernorms(num_layers: int, arch: str) -> list[tuple[str, str]]:
    """(HF LayerNorm, megatron LayerNorm) pairs; see the module docstring for ``bert``."""
    if arch == "megatron-bert":
        pairs = []
        for i in range(num_layers):
            pairs.append((f"encoder.layer.{i}.attention.ln", f"encoder.layers.{i}.input_layernorm"))
            pairs.append((f"encoder.layer.{i}.ln", f"encoder.layers.{i}.pre_mlp_layernorm"))
        return pairs + [("encoder.ln", "encoder.final_layernorm")]
    hf = ["embeddings.LayerNorm"]
    mc = []
    for i in range(num_layers):
        hf += [f"encoder.layer.{i}.attention.output.LayerNorm", f"encoder.layer.{i}.output.LayerNorm"]
        mc += [f"encoder.layers.{i}.input_layernorm", f"encoder.layers.{i}.pre_mlp_layernorm"]
    return list(zip(hf, mc + ["encoder.final_layernorm"]))


def mcore_to_hf_state(model: ModelConfig, state: dict, arch: str) -> dict:
    """Megatron TP=1 state (unpadded) → HF tensors for ``arch`` (tied outputs omitted).

    Raises:
        ConversionError: ``model`` cannot be written as ``arch``, or tensors are missing.
    """
    hf_config_from_model(model, arch)  # validates the architecture
    if arch in NOT_FUNCTION_PRESERVING:
        log.warning("writing HF %s: %s (export as megatron-bert for the same model)", arch,
                    NOT_FUNCTION_PRESERVING[arch])
    a, g, bias = model.num_attention_heads, model.kv_heads, model.add_bias_linear
    src = _Source({k: v for k, v in state.items() if not k.endswith("_extra_state")}, "", ())
    out: dict[str, torch.Tensor] = {}
    if arch == "llama":
        out["model.embed_tokens.weight"] = src.take("embedding.word_embeddings.weight")
        for i in range(model.num_layers):
            h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
            out[h + "input_layernorm.weight"] = src.take(m + "input_layernorm.weight")
            for suffix in ("weight", "bias") if bias else ("weight",):
                q, k, v = split_qkv(src.take(f"{m}self_attention.linear_qkv.{suffix}"), a, g)
                out.update({f"{h}self_attn.{p}_proj.{suffix}": t for p, t in zip("qkv", (q, k, v))})
                out[f"{h}self_attn.o_proj.{suffix}"] = src.take(f"{m}self_attention.linear_proj.{suffix}")
                gate, up = src.take(f"{m}mlp.linear_fc1.{suffix}").chunk(2, dim=0)
                out[f"{h}mlp.gate_proj.{suffix}"], out[f"{h}mlp.up_proj.{suffix}"] = gate, up
                out[f"{h}mlp.down_proj.{suffix}"] = src.take(f"{m}mlp.linear_fc2.{suffix}")
            out[h + "post_attention_layernorm.weight"] = src.take(m + "pre_mlp_layernorm.weight")
        out["model.norm.weight"] = src.take("decoder.final_layernorm.weight")
        if not model.tie_embeddings:
            out["lm_head.weight"] = src.take("output_layer.weight")
    elif arch == "gpt2":
        out["transformer.wte.weight"] = src.take("embedding.word_embeddings.weight")
        out["transformer.wpe.weight"] = src.take("embedding.position_embeddings.weight")
        for i in range(model.num_layers):
            h, m = f"transformer.h.{i}.", f"decoder.layers.{i}."
            for s in ("weight", "bias"):
                out[f"{h}ln_1.{s}"] = src.take(f"{m}input_layernorm.{s}")
                out[f"{h}ln_2.{s}"] = src.take(f"{m}pre_mlp_layernorm.{s}")
            q, k, v = split_qkv(src.take(m + "self_attention.linear_qkv.weight"), a, g)
            out[h + "attn.c_attn.weight"] = torch.cat([q, k, v], dim=0).t().contiguous()
            out[h + "attn.c_attn.bias"] = torch.cat(split_qkv(src.take(m + "self_attention.linear_qkv.bias"), a, g))
            out[h + "attn.c_proj.weight"] = src.take(m + "self_attention.linear_proj.weight").t().contiguous()
            out[h + "attn.c_proj.bias"] = src.take(m + "self_attention.linear_proj.bias")
            out[h + "mlp.c_fc.weight"] = src.take(m + "mlp.linear_fc1.weight").t().contiguous()
            out[h + "mlp.c_fc.bias"] = src.take(m + "mlp.linear_fc1.bias")
            out[h + "mlp.c_proj.weight"] = src.take(m + "mlp.linear_fc2.weight").t().contiguous()
            out[h + "mlp.c_proj.bias"] = src.take(m + "mlp.linear_fc2.bias")
        for s in ("weight", "bias"):
            out[f"transformer.ln_f.{s}"] = src.take(f"decoder.final_layernorm.{s}")
        if not model.tie_embeddings:
            out["lm_head.weight"] = src.take("output_layer.weight")
    else:
        out["bert.embeddings.word_embeddings.weight"] = src.take("embedding.word_embeddings.weight")
        out["bert.embeddings.position_embeddings.weight"] = src.take("embedding.position_embeddings.weight")
        out["bert.embeddings.token_type_embeddings.weight"] = src.take("embedding.tokentype_embeddings.weight")
        for hf_ln, m_ln in _bert_layernorms(model.num_layers, arch):
            for s in ("weight", "bias"):
                out[f"bert.{hf_ln}.{s}"] = src.take(f"{m_ln}.{s}")
        for i in range(model.num_layers):
            h, m = f"bert.encoder.layer.{i}.", f"encoder.layers.{i}."
            for s in ("weight", "bias"):
                q, k, v = split_qkv(src.take(f"{m}self_attention.linear_qkv.{s}"), a, g)
                for p, t in zip(("query", "key", "value"), (q, k, v)):
                    out[f"{h}attention.self.{p}.{s}"] = t
                out[f"{h}attention.output.dense.{s}"] = src.take(f"{m}self_attention.linear_proj.{s}")
                out[f"{h}intermediate.dense.{s}"] = src.take(f"{m}mlp.linear_fc1.{s}")
                out[f"{h}output.dense.{s}"] = src.take(f"{m}mlp.linear_fc2.{s}")
        for s in ("weight", "bias"):
            out[f"cls.predictions.transform.dense.{s}"] = src.take(f"lm_head.dense.{s}")
            out[f"cls.predictions.transform.LayerNorm.{s}"] = src.take(f"lm_head.layer_norm.{s}")
        out["cls.predictions.bias"] = src.take("output_layer.bias")
        if not model.tie_embeddings:
            out["cls.predictions.decoder.weight"] = src.take("output_layer.weight")
    src.finish()
    return out
