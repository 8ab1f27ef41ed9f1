"""Throughput model and its calibration."""

from __future__ import annotations

import pytest

from cona.cost_model import CostModel, Interconnect, default_interconnect, ring_allreduce_s
from cona.strategy import Strategy
from jobruntime.config import load_config
from jobruntime.flops import flops_per_token
from jobruntime.hardware import get_gpu_profile

GPT3 = load_config("gpt3_1.3b").model


def test_compute_term_is_flops_over_achieved_rate():
    """Catches a wrong compute term (e.g. efficiency taken at global-batch tokens or devices
    not counted): at tp=pp=1 it must equal flops_per_token*tokens/(peak*eff(mb tokens)*N)
    exactly (rel 1e-12), and at tp=4 the efficiency is that of a quarter of the tokens
    (TP shrinks each device's matrix multiplications)."""
    cm = CostModel(GPT3, "A100-80GB")
    s = Strategy(8, 1, 1, 2, 64)
    gpu = get_gpu_profile("A100-80GB")
    tokens = s.global_batch_size * GPT3.seq_length
    mb_tokens = s.micro_batch_size * GPT3.seq_length
    expected = (
        flops_per_token(GPT3) * tokens / (gpu.peak_tflops * 1e12 * gpu.efficiency(mb_tokens) * 8)
    )
    est = cm.analytic(s)
    assert est.compute_s == pytest.approx(expected, rel=1e-12)
    assert est.bubble_s == 0 and est.tp_comm_s == 0 and est.pp_comm_s == 0
    assert est.tokens_per_s == pytest.approx(tokens / est.iter_s)
    # TP: each rank's GEMMs are 1/tp as wide, so the efficiency is taken at mb tokens / tp
    tp4 = cm.analytic(Strategy(2, 4, 1, 2, 64))
    want = expected * gpu.efficiency(mb_tokens) / gpu.efficiency(mb_tokens / 4)
    assert tp4.compute_s == pytest.approx(want, rel=1e-12) and tp4.compute_s > est.compute_s


@pytest.mark.parametrize("pp,gb", [(2, 16), (4, 16), (4, 64), (8, 64)])
def test_pipeline_bubble_fraction(pp, gb):
    """Catches a wrong 1F1B bubble: the pipeline part of the step must be idle for exactly
    (pp-1)/(m+pp-1) of its time (Narayanan et al. 2021); more micro-batches shrink it."""
    cm = CostModel(GPT3, "A100-80GB")
    s = Strategy(8 // pp, 1, pp, 1, gb)
    e = cm.analytic(s)
    pipeline = e.compute_s + e.tp_comm_s + e.pp_comm_s + e.bubble_s
    m = s.num_microbatches
    assert e.bubble_s / pipeline == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-12)
    more = cm.analytic(Strategy(8 // pp, 1, pp, 1, gb * 4))
    assert more.bubble_s / (more.compute_s + more.bubble_s) < e.bubble_s / (
        e.compute_s + e.bubble_s
    )


def test_communication_terms():
    """Catches collectives charged to the wrong axis: TP traffic only with tp>1 and growing
    with tp (ring factor 2(k-1)/k over more layers' worth of shards), DP only with dp>1,
    and the ring all-reduce formula itself (no latency: 2*(4-1)/4 * 1 GB / 100 GB/s)."""
    assert ring_allreduce_s(1e9, 4, 100.0, 0.0) == pytest.approx(0.015)
    assert ring_allreduce_s(1e9, 1, 100.0, 1.0) == 0.0
    cm = CostModel(GPT3, "A100-80GB")
    tp_comm = [cm.analytic(Strategy(8 // tp, tp, 1, 1, 64)).tp_comm_s for tp in (1, 2, 4, 8)]
    assert tp_comm[0] == 0 and all(x < y for x, y in zip(tp_comm, tp_comm[1:]))
    assert cm.analytic(Strategy(1, 8, 1, 1, 64)).dp_comm_s == 0
    no_overlap = CostModel(GPT3, "A100-80GB", dp_overlap=0.0)
    assert (
        no_overlap.analytic(Strategy(8, 1, 1, 1, 64)).dp_comm_s
        > cm.analytic(Strategy(8, 1, 1, 1, 64)).dp_comm_s
        > 0
    )
    # TP over 16 GPUs crosses nodes: the slower inter-node link must be used
    slow = CostModel(
        GPT3,
        "A100-80GB",
        interconnect=Interconnect(intra_node_gbs=300, inter_node_gbs=25, gpus_per_node=4),
    )
    assert (
        slow.analytic(Strategy(1, 8, 1, 1, 64)).tp_comm_s
        > 5 * cm.analytic(Strategy(1, 8, 1, 1, 64)).tp_comm_s
    )
    assert default_interconnect("A100-40GB").intra_node_gbs == 300
    with pytest.raises(KeyError, match="interconnect"):
        default_interconnect("TPUv4")


def test_calibrate_changes_predictions():
    """Catches calibration that is stored but not applied, applied to the wrong strategies,
    or replaced outright by one noisy sample: a measured strategy gets measured/analytic;
    a same-(tp, pp) neighbour inherits it; another layout gets the global mean; ``exact``
    mode leaves neighbours alone; a second measurement moves the factor by the EMA weight."""
    cm = CostModel(GPT3, "A100-80GB")
    a, same_layout, other = (
        Strategy(8, 1, 1, 1, 64),
        Strategy(8, 1, 1, 2, 128),
        Strategy(4, 2, 1, 1, 64),
    )
    base = {s: cm.iteration_time(s) for s in (a, same_layout, other)}
    assert cm.correction(a) == 1.0
    assert cm.calibrate(a, 2.0 * base[a]) == pytest.approx(2.0)
    assert cm.iteration_time(a) == pytest.approx(2.0 * base[a])
    assert cm.iteration_time(same_layout) == pytest.approx(2.0 * base[same_layout])
    assert cm.iteration_time(other) == pytest.approx(2.0 * base[other])  # global factor
    cm.calibrate(other, 0.5 * base[other])
    assert cm.correction(other) == pytest.approx(0.5)
    assert cm.correction(same_layout) == pytest.approx(2.0)  # layout beats global
    assert cm.correction(Strategy(2, 2, 2, 1, 64)) == pytest.approx(1.0)  # geo-mean of 2, 0.5
    # EMA in log space with weight 0.5: 2.0 then 8.0 -> 4.0
    cm.calibrate(a, 8.0 * base[a])
    assert cm.correction(a) == pytest.approx(4.0)
    exact = CostModel(GPT3, "A100-80GB", calibration="exact")
    exact.calibrate(a, 3.0 * base[a])
    assert exact.correction(same_layout) == 1.0
    restored = CostModel(GPT3, "A100-80GB")
    restored.load_state_dict(cm.state_dict())
    assert restored.measured == pytest.approx(cm.measured)
    with pytest.raises(ValueError, match="positive"):
        cm.calibrate(a, 0.0)
