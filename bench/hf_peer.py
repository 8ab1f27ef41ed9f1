"""The plain-PyTorch peer of a preset: the same model shape as a Hugging Face
``transformers`` model, trained the way a careful PyTorch user would.

``GPT2LMHeadModel`` for the ``gpt`` family, ``LlamaForCausalLM`` for
``llama``, ``BertForMaskedLM`` for ``bert``, all with SDPA attention; fp32
weights under ``torch.autocast(bf16)``, torch's fused AdamW, gradient clipping
at the preset's norm, gradient accumulation over micro-batches.  Built once,
on the device; timed eager and, optionally, under ``torch.compile``.  Used by
``bench/throughput.py --peer`` for the side-by-side tokens/s ratio (issue 9's
baseline: the numbers to beat).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch


def hf_config(model):
    """The ``transformers`` config of the same shape as ``model`` (a ``ModelConfig``).

    Raises:
        ValueError: a family or feature without a Hugging Face twin here.
    """
    import transformers as tf

    common = dict(vocab_size=model.vocab_size, tie_word_embeddings=model.tie_embeddings)
    if model.family == "gpt":
        return tf.GPT2Config(n_positions=model.max_positions, n_embd=model.hidden_size,
                             n_layer=model.num_layers, n_head=model.num_attention_heads,
                             n_inner=model.ffn, activation_function="gelu",
                             resid_pdrop=model.dropout, embd_pdrop=model.dropout,
                             attn_pdrop=model.dropout, layer_norm_epsilon=model.layernorm_epsilon,
                             bos_token_id=model.vocab_size - 1, eos_token_id=model.vocab_size - 1,
                             **common)
    if model.family == "llama":
        scaling = None
        if model.rope_scaling:
            scaling = {"rope_type": "llama3", "factor": model.rope_scaling_factor,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
        return tf.LlamaConfig(hidden_size=model.hidden_size, intermediate_size=model.ffn,
                              num_hidden_layers=model.num_layers,
                              num_attention_heads=model.num_attention_heads,
                              num_key_value_heads=model.kv_heads, rms_norm_eps=model.layernorm_epsilon,
                              rope_theta=float(model.rotary_base), rope_scaling=scaling,
                              max_position_embeddings=model.max_positions,
                              attention_dropout=model.dropout, **common)
    if model.family == "bert":
        return tf.BertConfig(hidden_size=model.hidden_size, num_hidden_layers=model.num_layers,
                             num_attention_heads=model.num_attention_heads,
                             intermediate_size=model.ffn, max_position_embeddings=model.max_positions,
                             hidden_dropout_prob=model.dropout,
                             attention_probs_dropout_prob=model.dropout,
                             layer_norm_eps=model.layernorm_epsilon, hidden_act="gelu", **common)
    raise ValueError(f"no Hugging Face peer for family {model.family!r}")


def build_peer(model, device: torch.device) -> torch.nn.Module:
    """The HF model for ``model``'s shape, built on ``device`` (fp32 weights, SDPA attention).

    Constructed under ``torch.device(device)``, so the weights are allocated and
    initialised there: a 1B-class model built on the host and moved took 34-43 s
    (issue 24), on the GPU it takes seconds.
    """
    import transformers as tf

    cfg = hf_config(model)
    cls = {"gpt": tf.GPT2LMHeadModel, "llama": tf.LlamaForCausalLM, "bert": tf.BertForMaskedLM}
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        return cls[model.family](cfg)


def _batch(model, mbs: int, device, g: torch.Generator) -> dict:
    s, v = model.seq_length, model.vocab_size
    ids = torch.randint(0, v, (mbs, s), generator=g).to(device)  # host draw, then moved
    if model.family == "bert":  # masked LM: 15 % of positions carry labels
        draw = torch.rand(mbs, s, generator=g).to(device)  # host draw, then moved
        labels = torch.where(draw < model.mask_prob, ids, -100)
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids}  # HF shifts causal-LM labels itself


def time_peers(model, train, *, micro_batch_size: int, global_batch_size: int, steps: int,
               warmup: int, device: torch.device, variants: Iterable[str] = ("peer", "peer_compiled")
               ) -> Iterator[tuple[str, dict]]:
    """Build the peer once on ``device``, then time each variant: ``warmup + steps``
    steps on random tokens, the last ``steps`` timed.

    ``peer`` is the eager model, ``peer_compiled`` the same model under
    ``torch.compile`` (it continues from the eager run's weights and optimizer
    state: the speed of a step does not depend on them, and one build saves a
    1B-class model's construction and a second copy in memory).

    Args:
        model: the preset's ``ModelConfig`` (sequence ``model.seq_length``);
            train: its ``TrainConfig`` (lr, betas, weight decay, clipping, seed).
        micro_batch_size / global_batch_size: sequences per micro-batch / step.

    Yields:
        ``(variant, result)`` after each variant, ``result`` = ``{"tokens_per_s",
        "step_s", "peak_memory_gib", "last_loss", "compiled", "device",
        "precision", "autocast", "micro_batch_size", "global_batch_size",
        "seq_length"}``: peak memory in GiB over the timed steps (CUDA only);
        ``device``/``precision`` read from the parameters; ``autocast`` the
        compute dtype (bfloat16 on CUDA, None on the CPU, where bf16 autocast is slow).
    """
    torch.manual_seed(train.seed)
    net = build_peer(model, device)
    opt = torch.optim.AdamW(net.parameters(), lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                            eps=train.adam_eps, weight_decay=train.weight_decay, fused=True)
    n_micro = global_batch_size // micro_batch_size
    g = torch.Generator().manual_seed(train.seed)
    param = next(net.parameters())
    cuda = param.device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    where = {"device": param.device.type, "precision": str(param.dtype).replace("torch.", ""),
             "autocast": str(dtype).replace("torch.", "") if cuda else None,
             "micro_batch_size": micro_batch_size, "global_batch_size": global_batch_size,
             "seq_length": model.seq_length}

    def step(fwd) -> float:
        total = torch.zeros((), device=device)
        for _ in range(n_micro):
            with torch.autocast(device.type, dtype=dtype, enabled=cuda):
                loss = fwd(**_batch(model, micro_batch_size, device, g)).loss / n_micro
            loss.backward()
            total += loss.detach()  # one host sync per step, as the trainer does
        if train.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(net.parameters(), train.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    for variant in variants:
        compiled = variant == "peer_compiled"
        fwd = torch.compile(net) if compiled else net
        for _ in range(warmup):
            step(fwd)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = step(fwd)
        if cuda:
            torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / steps
        yield variant, {"tokens_per_s": global_batch_size * model.seq_length / step_s,
                        "step_s": step_s, "last_loss": loss, "compiled": compiled,
                        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                        **where}
