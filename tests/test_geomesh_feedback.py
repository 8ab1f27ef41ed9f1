"""Codec statistics with known answers, error feedback over many rounds, and where
the compression error goes relative to the outer momentum (pure logic)."""

from __future__ import annotations

import math

import pytest
import torch

from geomesh.canonical_codec import join_parts
from geomesh.compression import ErrorFeedback
from geomesh.feedback import LocalMomentum
from geomesh.outer import OuterNesterov
from tests.test_geomesh_trust import KINDS, _codec


def _decode(codec, named, feedback=None):
    agg, _ = codec.aggregate([codec.encode(named, 1, worker=0, round=0, feedback=feedback)])
    return agg


def _phi(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def test_sign_codec_error_and_bias_match_gaussian_theory():
    """Catches a scale that is not the least-squares mean|x| of its row, or rows
    mixed up: for Gaussian rows of different widths σ_r the row scale is
    σ_r·√(2/π) and the relative squared error 1 − 2/π = 0.363 (its minimum for
    one scale per row); and the bias of the aggregate of K workers that see
    g + noise (g = c everywhere, noise σ): each sends m·sign, so the aggregate
    is E|x|·(2Φ(c/σ) − 1) per element, 0.686·c at c/σ = 0.5 — not c: sign
    compression shrinks low-SNR coordinates (what error feedback must repay)."""
    g = torch.Generator().manual_seed(0)
    sigma = torch.tensor([0.01, 1.0, 30.0]).unsqueeze(1)
    x = torch.randn(3, 200_000, generator=g) * sigma
    d = _decode(_codec("sign_row", {"w": x}), {"w": x})["w"]
    scale = d.abs()[:, 0]
    assert torch.allclose(scale, sigma.squeeze(1) * math.sqrt(2 / math.pi), rtol=0.01)
    err = ((x - d) ** 2).sum(dim=1) / (x**2).sum(dim=1)
    assert torch.allclose(err, torch.full((3,), 1 - 2 / math.pi), atol=0.005)
    c, s, K = 0.5, 1.0, 64
    workers = [{"w": c + s * torch.randn(1, 20_000, generator=g)} for _ in range(K)]
    codec = _codec("sign_row", workers[0])
    agg, _ = codec.aggregate([codec.encode(w, 1, worker=i, round=0) for i, w in enumerate(workers)])
    z = c / s
    e_abs = s * math.sqrt(2 / math.pi) * math.exp(-z * z / 2) + c * (2 * _phi(z) - 1)
    expect = e_abs * (2 * _phi(z) - 1)
    assert agg["w"].mean().item() == pytest.approx(expect, rel=0.02)
    assert expect / c == pytest.approx(0.686, abs=0.005)


@pytest.mark.parametrize("make", ["sign_row", "topk"])
def test_error_feedback_residual_stays_bounded_over_many_rounds(make):
    """Catches a residual that is not x − D(C(x)) (it would then drift or grow
    without bound): 1,000 rounds of fresh Gaussian pseudo-gradients with error
    feedback keep ‖e‖ bounded and flat — the last 200 rounds' mean within 10 %
    of rounds 200-400's, below 1.5‖Δ‖ for signs (error 0.6‖x‖ per round, so
    ‖e‖² ≈ 0.36(‖Δ‖² + ‖e‖²) at equilibrium: 0.75‖Δ‖), below √(chunk/k)·‖Δ‖
    = 5.7‖Δ‖ for top-8 of 256 (each element waits ~chunk/k rounds)."""
    g = torch.Generator().manual_seed(1)
    shape = (8, 512)
    codec = _codec(make, {"w": torch.zeros(shape)}, chunk=256, k=8)
    fb, norms, dnorm = ErrorFeedback(), [], math.sqrt(math.prod(shape))
    for t in range(1000):
        codec.encode({"w": torch.randn(shape, generator=g)}, 1, worker=0, round=t, feedback=fb)
        norms.append(fb.residuals["w"].norm().item() / dnorm)
    late, mid = sum(norms[-200:]) / 200, sum(norms[200:400]) / 200
    assert abs(late / mid - 1) < 0.1
    assert max(norms) < (1.5 if make == "sign_row" else math.sqrt(256 / 8))


def test_compressing_the_update_bounds_the_parameter_error_by_the_residual():
    """Catches momentum applied twice or the residual added at the wrong place:
    with each worker's own momentum and error feedback on its update
    (geomesh.compress_update), θ after 40 rounds equals fp32 DiLoCo's θ (global
    Nesterov on the fp32 aggregate of the same pseudo-gradients) plus
    lr·Σ w_i e_i — the current residuals, nothing older.  Error feedback on the
    pseudo-gradient (before the global momentum) has no such identity: the
    momentum re-weights late repayments, leaving a distance to fp32 several
    times lr·Σ w_i e_i (geomesh/feedback.py)."""
    g = torch.Generator().manual_seed(2)
    shape, K, lr, T = (16, 64), 3, 0.35, 40
    tokens = [1, 2, 3]
    w = [n / sum(tokens) for n in tokens]
    base = {"w": torch.zeros(shape)}
    codec = _codec("sign_row", base)
    ref = OuterNesterov({"w": base["w"].clone()}, lr=lr, momentum=0.9, momentum_warmup=True)
    upd = OuterNesterov({"w": base["w"].clone()}, lr=lr, momentum=0.9, momentum_warmup=True)
    dlt = OuterNesterov({"w": base["w"].clone()}, lr=lr, momentum=0.9, momentum_warmup=True)
    fb_u = [ErrorFeedback() for _ in range(K)]
    fb_d = [ErrorFeedback() for _ in range(K)]
    mom = [LocalMomentum() for _ in range(K)]
    dense = _codec("fp32", base)
    drift = torch.randn(shape, generator=g)
    for t in range(T):
        deltas = [{"w": 0.1 * drift + torch.randn(shape, generator=g) / (1 + t)} for _ in range(K)]
        agg, _ = dense.aggregate([dense.encode(d, n, worker=i, round=t)
                                  for i, (d, n) in enumerate(zip(deltas, tokens))])
        ref.step(agg)
        mu = upd.current_momentum
        msgs = [codec.encode(mom[i].update(d, mu), n, worker=i, round=t, feedback=fb_u[i])
                for i, (d, n) in enumerate(zip(deltas, tokens))]
        upd.apply_update(codec.aggregate(msgs)[0])
        msgs = [codec.encode(d, n, worker=i, round=t, feedback=fb_d[i])
                for i, (d, n) in enumerate(zip(deltas, tokens))]
        dlt.step(codec.aggregate(msgs)[0])
    resid = sum(wi * fb.residuals["w"] for wi, fb in zip(w, fb_u))
    assert torch.allclose(upd.params["w"], ref.params["w"] + lr * resid, atol=1e-4)
    err_dlt = (dlt.params["w"] - ref.params["w"]).norm()
    resid_d = sum(wi * fb.residuals["w"] for wi, fb in zip(w, fb_d)).norm()
    assert err_dlt > 3 * lr * resid_d


@pytest.mark.parametrize("kind", KINDS)
def test_message_bytes_are_the_encoded_bytes(kind):
    """Catches a size formula that drifts from the wire format (framing, padding of
    odd sizes, scales, coefficients, top-k chunks), which the emulated clock charges
    for the target model: for shapes of odd sizes (a 0-dim and an empty tensor
    among them), one worker's message is exactly ``message_bytes`` long and
    decodes to every tensor."""
    shapes = [("emb", (37, 300)), ("w", (5, 3, 7)), ("b", (9,)), ("s", ()), ("z", (0, 4))]
    g = torch.Generator().manual_seed(3)
    named = {k: torch.randn(s, generator=g) for k, s in shapes}
    codec = _codec(kind, named, chunk=256, k=8)
    v = {k: torch.randn(s, generator=g) for k, s in shapes}
    msg = join_parts([codec.encode(named, 5, worker=0, round=0, predictor=v)])
    assert len(msg) == codec.message_bytes()
    agg, tokens = codec.aggregate([msg], predictor=v)
    assert tokens == [5] and set(agg) == set(named)
