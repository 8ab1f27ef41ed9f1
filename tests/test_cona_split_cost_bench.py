"""``bench/cona_split_cost.py`` (what a split step of CONA's probe costs at DP = 1) and its
rendered table."""

from __future__ import annotations

import pytest


def test_renderer_states_each_layout_from_its_json():
    """Catches a table that misstates its JSON: per layout how its step splits (parts of
    one micro-batch, or micro-batches into schedule calls), the medians, the ratio and
    the overhead at every 4th step, worked out by hand here."""
    from tools import render_results  # noqa: F401 - puts tools/ on the path its renderers use
    from tools.render_cona_probes import cona_split_cost

    r = {"preset": "tiny_gpt", "global_batch_size": 8, "steps": 40, "warmup": 4,
         "layouts": {"dp1-pp1-mb8": {"processes": 1, "mode": "split", "micro_batch_size": 8,
                                     "plain_step_s": 0.5, "split_step_s": 0.6,
                                     "split_over_plain": 1.2, "overhead_at_every_4": 0.05},
                     "dp1-pp2-mb2": {"processes": 2, "mode": "calls", "micro_batch_size": 2,
                                     "plain_step_s": 0.4, "split_step_s": 0.5,
                                     "split_over_plain": 1.25, "overhead_at_every_4": 0.0625}},
         "date": "2026-12-07T08:00:00Z", "commit": "abc1234", "machine": "2 CPU cores",
         "command": "python bench/cona_split_cost.py"}
    out = cona_split_cost(r)
    assert ("| `dp1-pp1-mb8` | 1 | 8 sequences into 2 parts | 0.500 s | 0.600 s | 1.20x "
            "| +5.0 % |") in out
    assert ("| `dp1-pp2-mb2` | 2 | 4 micro-batches of 2 into 2 schedule calls | 0.400 s "
            "| 0.500 s | 1.25x | +6.2 % |") in out
    r["layouts"]["dp1-pp2-mb2"]["micro_batch_size"] = 8  # one micro-batch: its two parts
    assert "| 1 micro-batch of 8 as 2 parts, one schedule call each |" in cona_split_cost(r)
    assert "40 steps per layout (the first 4 not counted)" in out
    assert "docs/results/cona_split_cost.json" in out


def test_bench_times_both_kinds_of_step(cache_dir):
    """Catches a bench that times nothing split: in one process at one micro-batch of 8,
    every other step is split (3 estimates in 6 steps), both medians are positive and
    the overhead follows from them; a layout that splits no step is refused."""
    from bench.cona_split_cost import time_steps

    over = [f"data.cache_dir={cache_dir}", "model.num_layers=2", "model.seq_length=64"]
    x = time_steps(1, 8, steps=6, warmup=0, overrides=over)
    assert x["mode"] == "split" and x["estimates"] == 3 and x["processes"] == 1
    assert x["plain_step_s"] > 0 and x["split_step_s"] > 0
    assert x["split_over_plain"] == pytest.approx(x["split_step_s"] / x["plain_step_s"])
    assert x["overhead_at_every_4"] == pytest.approx((x["split_over_plain"] - 1) / 4)
    with pytest.raises(ValueError, match="splits no step"):
        time_steps(1, 2, steps=6, warmup=0, overrides=over)  # 4 micro-batches: none to split
