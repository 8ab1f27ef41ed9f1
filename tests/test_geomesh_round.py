"""One emulated GeoMesh round end to end, as a training worker will wire it.

Workers: linear regression models (real AdamW inner steps); time: the planner's
compute times for GPT-3 1.3B on the two_worker cluster, WAN from the clock.
"""

from __future__ import annotations

import json

import pytest
import torch

from geomesh.canonical import CanonicalSchema, whole_layout
from geomesh.canonical_codec import CanonicalCodec, join_parts
from geomesh.clock import EmulatedClock
from geomesh.cluster import load_cluster
from geomesh.compression import ErrorFeedback
from geomesh.outer import OuterNesterov
from geomesh.planner import Planner
from geomesh.transport import InProcessTransport
from jobruntime.config import load_config


def test_emulated_rounds_train_and_charge_time():
    """Catches wiring bugs between the modules (sign of Δ = θ_global − θ_i, token
    counts, schema order, clock charging): six rounds of two workers must lower
    the loss of θ_global, the aggregate that went through compression, the wire
    and the transport must equal equation (1) computed here from the fp32
    pseudo-gradients — ``Σ (n_i/N) · mean|x_i| · sign(x_i)`` with ``x_i = Δ_i +
    e_i`` and the error-feedback residual ``e_i ← x_i − mean|x_i| · sign(x_i)``
    kept by this test (fp32 tolerance: the codec rounds the scale to fp32), WAN
    idle must cover the target model's message over the link, and every
    emulated second must be compute, straggler idle or WAN idle."""
    torch.manual_seed(0)
    cluster = load_cluster("two_worker")
    cfg = load_config("tiny_gpt", ["geomesh.target_model=gpt3_1.3b", "geomesh.inner_steps=4"])
    planner = Planner.from_job_config(cfg, cluster)
    plan = planner.plan()
    json.dumps(plan.to_dict())  # loggable
    target_bytes = 163_000_000  # ~GPT-3 1.3B sign message (see test_geomesh_compression)

    w_true = torch.randn(8, 1)
    data_x = torch.randn(512, 8)
    data_y = data_x @ w_true
    theta = {"w": torch.zeros(8, 1), "b": torch.zeros(1)}
    schema = CanonicalSchema.from_shapes((k, v.shape) for k, v in theta.items())
    codec = CanonicalCodec("sign", whole_layout(schema), schema)  # one scale per tensor
    outer = OuterNesterov(theta, lr=0.7, momentum=0.9)
    feedback = [ErrorFeedback() for _ in cluster.workers]
    clock = EmulatedClock(cluster)
    transport = InProcessTransport(cluster, clock=clock, charged_bytes=target_bytes)

    def loss(p):
        return torch.mean((data_x @ p["w"] + p["b"] - data_y) ** 2).item()

    start_loss = loss(theta)
    rounds = 6
    residual = [{k: torch.zeros_like(v) for k, v in theta.items()} for _ in cluster.workers]
    for rnd in range(rounds):
        messages = {}
        reference = {k: torch.zeros_like(v) for k, v in theta.items()}  # equation (1), by hand
        for i, wp in enumerate(plan.workers):
            local = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
            opt = torch.optim.AdamW(local.values(), lr=0.05, weight_decay=0.0)
            batch = max(1, wp.batch_size // 16)  # proxy batch, proportional to b_i
            for _ in range(wp.inner_steps):
                idx = torch.randint(0, 512, (batch,))
                opt.zero_grad()
                torch.mean((data_x[idx] @ local["w"] + local["b"] - data_y[idx]) ** 2).backward()
                opt.step()
            clock.compute(wp.worker, wp.compute_s)
            delta = {k: theta[k] - local[k].detach() for k in theta}  # Δ_i = θ_global − θ_i
            for k in theta:
                x = delta[k] + residual[i][k]
                c = x.abs().mean() * torch.where(x >= 0, 1.0, -1.0)
                residual[i][k] = x - c
                reference[k] += wp.tokens / plan.total_tokens * c
            messages[i] = join_parts([codec.encode(delta, wp.tokens, worker=i, round=rnd,
                                                   feedback=feedback[i])])
        agg, tokens = codec.aggregate(transport.exchange(messages), round=rnd,
                                      senders=range(len(plan.workers)))
        assert tokens == [wp.tokens for wp in plan.workers]
        for k in theta:
            torch.testing.assert_close(agg[k], reference[k], rtol=1e-6, atol=1e-7)
        outer.step(agg)
    assert loss(theta) < 0.5 * start_loss
    per_round = transport.last_schedule
    wan = per_round.workers["t4-westeurope"].wan_idle_s
    assert wan > target_bytes / cluster.link("East US", "West Europe").bandwidth_bytes_per_s
    for t in clock.totals.values():  # every emulated second is compute or idle
        assert t.compute_s + t.straggler_idle_s + t.wan_idle_s == pytest.approx(t.end_s)
        assert t.compute_s == pytest.approx(rounds * plan.round_time_s, rel=0.05)
    assert clock.now_s == max(t.end_s for t in clock.totals.values())
