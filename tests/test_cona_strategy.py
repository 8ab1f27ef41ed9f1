"""Strategy validity and enumeration (pure logic, no process groups)."""

from __future__ import annotations

import pytest

from cona.memory_model import MemoryModel
from cona.strategy import (
    Strategy,
    check_strategy,
    enumerate_strategies,
    strategies_from_dicts,
)
from jobruntime.config import load_config
from jobruntime.hardware import get_gpu_profile

GPT3 = load_config("gpt3_1.3b").model
LLAMA = load_config("llama3.2_1b").model
A100_80 = get_gpu_profile("A100-80GB").memory_bytes


def _valid(s: Strategy, model, world: int) -> bool:
    return (
        s.dp * s.tp * s.pp == world
        and model.num_attention_heads % s.tp == 0
        and model.kv_heads % s.tp == 0
        and model.num_layers % s.pp == 0
        and s.global_batch_size % (s.dp * s.micro_batch_size) == 0
    )


def test_strategy_fields_label_roundtrip():
    """Catches a wrong ``num_microbatches`` (gradient-accumulation steps) or a label that
    does not parse back (labels are the keys of logged scores and checkpointed calibration)."""
    s = Strategy(4, 2, 1, 2, 64)
    assert s.num_microbatches == 8
    assert s.world_size == 8
    assert s.label == "dp4-tp2-pp1-mb2-gb64"
    assert Strategy.from_label(s.label) == s
    assert Strategy.from_dict(s.to_dict()) == s
    with pytest.raises(ValueError, match="multiple of dp\\*micro_batch_size"):
        Strategy(4, 2, 1, 3, 64)
    with pytest.raises(ValueError, match="positive int"):
        Strategy(0, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="unknown keys"):
        Strategy.from_dict({**s.to_dict(), "sp": True})


def test_gpt3_tp3_excluded_by_heads():
    """Catches enumerating a TP size that does not divide GPT-3 1.3B's 16 heads: on 12 GPUs
    tp=3 and tp=6 satisfy dp*tp*pp == world but megatron cannot split the attention."""
    ss = enumerate_strategies(GPT3, 12, global_batch_sizes=[48, 96], micro_batch_sizes=[1, 2])
    assert ss
    assert {s.tp for s in ss} == {1, 2, 4}
    assert all(_valid(s, GPT3, 12) for s in ss)
    assert any(
        "num_attention_heads" in r for r in check_strategy(Strategy(4, 3, 1, 1, 48), GPT3, 12)
    )


def test_gpt3_8xa100_valid_and_memory_feasible():
    """Catches the memory filter being ignored (GPT-3 1.3B at micro-batch 16 without TP
    needs ~127 GiB with megatron's local attention, far over 80 GiB; 79 GiB with a fused
    kernel) or feasible layouts being dropped."""
    kw = dict(global_batch_sizes=[64, 128, 512], micro_batch_sizes=[1, 2, 4, 8, 16])
    unlimited = enumerate_strategies(GPT3, 8, **kw)
    mm = MemoryModel(GPT3, flash_attention=False)
    feasible = enumerate_strategies(GPT3, 8, memory_limit_bytes=A100_80, memory_model=mm, **kw)
    assert all(_valid(s, GPT3, 8) for s in unlimited)
    assert {s.tp for s in unlimited} == {1, 2, 4, 8}
    assert Strategy(8, 1, 1, 16, 128) in unlimited
    assert Strategy(8, 1, 1, 16, 128) not in feasible
    assert Strategy(8, 1, 1, 8, 64) in feasible
    assert Strategy(4, 2, 1, 16, 128) in feasible  # TP halves activations and weights
    assert set(feasible) < set(unlimited)
    assert all(mm.peak_bytes(s) <= A100_80 for s in feasible)
    assert all(mm.peak_bytes(s) > A100_80 for s in set(unlimited) - set(feasible))
    # a plain callable works as the memory model too
    assert (
        enumerate_strategies(GPT3, 8, memory_limit_bytes=A100_80, memory_model=mm.peak_bytes, **kw)
        == feasible
    )


def test_llama_kv_heads_constrain_tp():
    """Catches checking only the 32 query heads: Llama-3.2-1B has 8 KV heads, so tp=16
    must be excluded on 16 GPUs while tp=8 stays."""
    ss = enumerate_strategies(LLAMA, 16, global_batch_sizes=[64], micro_batch_sizes=[1])
    tps = {s.tp for s in ss}
    assert 8 in tps and 16 not in tps
    reasons = check_strategy(Strategy(1, 16, 1, 1, 64), LLAMA, 16)
    assert any("kv heads" in r for r in reasons)


def test_pp_must_divide_layers_and_batch_must_divide():
    """Catches uneven pipeline stages (24 layers on pp=16) and global batches that are not
    a multiple of dp*micro-batch being enumerated."""
    ss = enumerate_strategies(GPT3, 16, global_batch_sizes=[24, 64], micro_batch_sizes=[1, 2])
    assert 16 not in {s.pp for s in ss}
    assert 8 in {s.pp for s in ss}
    assert all(s.global_batch_size % (s.dp * s.micro_batch_size) == 0 for s in ss)
    assert not any(s.dp == 16 and s.global_batch_size == 24 for s in ss)


def test_strategies_from_dicts_names_the_bad_entry():
    """Catches explicit ``cona.candidates`` being accepted unchecked (a tp=3 candidate would
    only fail later inside megatron, mid-run)."""
    good = {"dp": 8, "tp": 1, "pp": 1, "micro_batch_size": 1, "global_batch_size": 64}
    bad = {"dp": 4, "tp": 1, "pp": 1, "micro_batch_size": 1, "global_batch_size": 64}
    assert strategies_from_dicts([good], GPT3, 8) == [Strategy(8, 1, 1, 1, 64)]
    with pytest.raises(ValueError, match=r"candidates\[1\].*world size"):
        strategies_from_dicts([good, bad], GPT3, 8)
    with pytest.raises(ValueError, match=r"candidates\[0\].*multiple"):
        strategies_from_dicts([{**good, "micro_batch_size": 3}], GPT3, 8)
