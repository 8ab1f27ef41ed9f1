"""Codecs of the training loop: the exchange's sign codec with row scales (GeoMesh)
and the async baseline's fp32 codec."""

from __future__ import annotations

import pytest
import torch

from geomesh.canonical import CanonicalSchema, whole_layout
from geomesh.canonical_codec import CanonicalCodec
from geomesh.codec import DenseCodec
from geomesh.compression import ErrorFeedback, MessageError, TensorSchema
from geomesh.worker import proxy_steps
from tests.test_geomesh_trust import _codec, encode


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(6, 8, generator=g) * 1e-3
    emb[:2] *= 1000  # two "seen" rows, four nearly untouched ones
    return {"emb": emb, "w": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g)}


def test_row_scales_are_row_means_and_feedback_is_exact():
    """Catches row scales taken over the wrong axis (or over the tensor), and an
    error-feedback residual that is not x − D(C(x)): each row of a matrix is sent
    as mean|row| · sign(row), vectors keep one scale, and Δ + e_old = D(msg) + e_new."""
    named = _tensors()
    codec, fb = _codec("sign_row", named), ErrorFeedback()
    fb.residuals = {k: torch.full_like(v, 0.01) for k, v in named.items()}
    old = {k: v.clone() for k, v in fb.residuals.items()}
    data = codec.encode(named, 100, worker=0, round=0, feedback=fb)
    agg, tokens = codec.aggregate([data])
    assert tokens == [100]
    for k, v in named.items():
        x = v + old[k]
        if v.dim() == 2:
            expect = x.abs().mean(dim=1, keepdim=True) * torch.where(x >= 0, 1.0, -1.0)
        else:
            expect = x.abs().mean() * torch.where(x >= 0, 1.0, -1.0)
        assert torch.allclose(agg[k], expect, rtol=1e-6, atol=0), k
        assert torch.allclose(agg[k] + fb.residuals[k], x, atol=1e-6), k
    # Untouched rows get their own small magnitude, not the tensor's mean one.
    x_emb = named["emb"] + old["emb"]
    assert agg["emb"][2:].abs().max() < 0.1 * x_emb.abs().mean()


def test_row_scales_cost_about_one_percent_on_gpt3_sized_matrices():
    """Catches a wire format that sends more than one scale per row: for matrices
    of GPT-3 1.3B's widths (2048 or 8192 columns) the compression ratio of a
    whole-model message stays above 31 (32 at most: one bit per fp32 element)."""
    shapes = [("emb", (50304, 2048)), ("qkv", (6144, 2048)), ("fc2", (2048, 8192)), ("ln", (2048,))]
    schema = CanonicalSchema.from_shapes(shapes)
    fp32 = 4 * sum(torch.Size(s).numel() for _, s in shapes)
    ratio = {kind: fp32 / CanonicalCodec(kind, whole_layout(schema), schema).message_bytes()
             for kind in ("sign", "sign_row")}
    assert 31 < ratio["sign_row"] < ratio["sign"] <= 32


def test_aggregate_weights_by_tokens_and_dense_roundtrip():
    """Catches the async baseline's fp32 codec losing precision or ignoring n_i, and
    a sign aggregate that is not Σ (n_i/N) m_i sign(Δ_i) with row scales."""
    a, b = _tensors(1), _tensors(2)
    dense = DenseCodec(TensorSchema.from_tensors(a))
    agg, tokens = dense.aggregate([dense.encode(a, 1, worker=0, round=3),
                                   dense.encode(b, 3, worker=1, round=3)])
    assert tokens == [1, 3]
    for k in a:
        assert torch.allclose(agg[k], 0.25 * a[k] + 0.75 * b[k], atol=1e-7)
    with pytest.raises(MessageError):
        dense.aggregate([dense.encode(a, 1, worker=0, round=0)[:-1]])
    sign = _codec("sign_row", a)
    msgs = [encode(sign, a, 1, worker=0), encode(sign, b, 3, worker=1)]
    agg, _ = sign.aggregate(msgs)
    one_a, _ = sign.aggregate(msgs[:1])
    one_b, _ = sign.aggregate(msgs[1:])
    for k in a:
        assert torch.allclose(agg[k], 0.25 * one_a[k] + 0.75 * one_b[k], atol=1e-7)


def test_proxy_batches_keep_shares_and_round_tokens():
    """Catches the target→proxy batch mapping inflating slow workers (a share
    below one sequence per step rounded up to one every step) or changing the
    round's tokens: on the four-region GPT-3 1.3B plan, a proxy round holds
    exactly H·G_p sequences, split like the planned target tokens (±1)."""
    from geomesh.cluster import load_cluster
    from geomesh.planner import Planner
    from jobruntime.config import load_config

    target = load_config("gpt3_1.3b")
    plan = Planner(load_cluster("four_region"), target.model, tokens_per_round=8 * 512 * 2048,
                   inner_steps=8).plan()
    steps = proxy_steps(plan, 16 / 512, round_samples=8 * 16)
    assert sum(s.samples for s in steps) == 128
    total = sum(wp.tokens for wp in plan.workers)
    for s, wp in zip(steps, plan.workers):
        assert abs(s.samples - 128 * wp.tokens / total) <= 1
        assert max(s.batches) - min(s.batches) <= 1 and s.inner_steps <= wp.inner_steps
    same = proxy_steps(plan, 1.0)
    assert [s.batches for s in same] == [(wp.batch_size,) * wp.inner_steps for wp in plan.workers]
