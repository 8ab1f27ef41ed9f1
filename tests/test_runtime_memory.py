"""Per-device memory model (Korthikanti et al. 2022 activations, Megatron state bytes)."""

from __future__ import annotations

import pytest

from cona.memory_model import MemoryModel, padded_vocab_size
from cona.strategy import Strategy
from jobruntime.config import load_config
from jobruntime.flops import num_params

GPT3 = load_config("gpt3_1.3b").model
LLAMA = load_config("llama3.2_1b").model


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_activation_formula_matches_paper(tp):
    """Catches drift from Korthikanti et al. eq. 2: for GPT-3 (MHA, GELU, f = 4h) one
    layer must hold exactly s*b*h*(10 + 24/t + 5as/(ht)) bytes.  Exact up to float rounding
    (rel 1e-12)."""
    s, b, h, a = GPT3.seq_length, 2, GPT3.hidden_size, GPT3.num_attention_heads
    expected = s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
    got = MemoryModel(GPT3).activation_bytes_per_layer(b, tp)
    assert got == pytest.approx(expected, rel=1e-12)
    if tp == 1:
        assert got == pytest.approx(s * b * h * (34 + 5 * a * s / h), rel=1e-12)
    sp = MemoryModel(GPT3, sequence_parallel=True).activation_bytes_per_layer(b, tp)
    assert sp == pytest.approx(s * b * h * (34 + 5 * a * s / h) / tp, rel=1e-12)


def test_state_bytes_per_param():
    """Catches wrong optimizer-state accounting: Megatron's table gives 18 B/param (bf16 +
    fp32 grads + fp32 Adam), 6 + 12/dp with the distributed optimizer, 16 for fp32 (CPU)."""
    assert MemoryModel(GPT3).state_bytes_per_param(8) == 18
    assert MemoryModel(GPT3, distributed_optimizer=True).state_bytes_per_param(8) == 6 + 12 / 8
    assert MemoryModel(GPT3, precision="fp32").state_bytes_per_param(4) == 16
    assert MemoryModel(GPT3, precision="mixed_bf16_grads").state_bytes_per_param(1) == 16
    with pytest.raises(ValueError, match="precision"):
        MemoryModel(GPT3, precision="fp8")


@pytest.mark.parametrize("model", [GPT3, LLAMA], ids=["gpt3", "llama"])
def test_params_partition_matches_num_params(model):
    """Catches double- or under-counting embeddings across stages: at pp=1 the device holds
    exactly num_params (padded vocab); at pp>1 with tied embeddings the last stage adds one
    copy of the word embedding (megatron keeps one on each end)."""
    mm = MemoryModel(model)
    v = padded_vocab_size(model.vocab_size, 1)
    total = num_params(model, padded_vocab=v)
    assert mm.stage_params(Strategy(8, 1, 1, 1, 64)) == [pytest.approx(total, rel=1e-12)]
    stages = mm.stage_params(Strategy(2, 1, 4, 1, 64))
    assert sum(stages) == pytest.approx(total + v * model.hidden_size, rel=1e-12)
    assert stages[0] > stages[1] and stages[3] > stages[1]


def test_memory_monotonic_in_micro_batch():
    """Catches activations not scaling with the micro-batch (a feasibility filter that would
    accept any micro-batch size).  Strict increase for every layout."""
    for model in (GPT3, LLAMA):
        mm = MemoryModel(model)
        for dp, tp, pp in [(8, 1, 1), (4, 2, 1), (2, 2, 2), (1, 1, 8)]:
            peaks = [mm.peak_bytes(Strategy(dp, tp, pp, mb, 128)) for mb in (1, 2, 4, 8, 16)]
            assert all(x < y for x, y in zip(peaks, peaks[1:])), (dp, tp, pp, peaks)


def test_memory_decreasing_in_tp():
    """Catches TP not sharding weights or activations: at a fixed micro-batch, peak memory
    must strictly fall as tp goes 1 -> 2 -> 4 -> 8 (dp shrinking to keep 8 GPUs)."""
    for model in (GPT3, LLAMA):
        mm = MemoryModel(model)
        peaks = [mm.peak_bytes(Strategy(8 // tp, tp, 1, 2, 64)) for tp in (1, 2, 4, 8)]
        assert all(x > y for x, y in zip(peaks, peaks[1:])), peaks


def test_1f1b_first_stage_holds_pp_microbatches():
    """Catches a pipeline model that stores one micro-batch per stage: under 1F1B the first
    stage keeps min(pp, m) micro-batches, so with m >= pp its layer activations equal those
    of the whole model for one micro-batch (Korthikanti Sec. 4.2.3), and with m = 1 only
    one micro-batch is in flight."""
    mm = MemoryModel(GPT3)
    per_layer = mm.activation_bytes_per_layer(1, 1)
    sbh = GPT3.seq_length * GPT3.hidden_size
    first = mm.stage_activation_bytes(Strategy(1, 1, 4, 1, 8))[0]  # m = 8 >= pp
    assert first == pytest.approx(per_layer * GPT3.num_layers + 4 * sbh)  # + embedding masks
    single = mm.stage_activation_bytes(Strategy(1, 1, 4, 1, 1))[0]  # m = 1
    assert single == pytest.approx(per_layer * GPT3.num_layers / 4 + sbh)


def test_flash_attention_and_fp32_options():
    """Catches the options being no-ops: FlashAttention removes the 5as/h score term
    (80 of 114 per sbh for GPT-3 at s=2048), fp32 doubles activation bytes."""
    base = MemoryModel(GPT3).activation_bytes_per_layer(1, 1)
    flash = MemoryModel(GPT3, flash_attention=True).activation_bytes_per_layer(1, 1)
    fp32 = MemoryModel(GPT3, precision="fp32").activation_bytes_per_layer(1, 1)
    assert flash / base == pytest.approx(34 / 114)
    assert fp32 == pytest.approx(2 * base)
