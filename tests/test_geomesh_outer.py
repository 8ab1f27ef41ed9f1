"""Token-weighted aggregation and the outer Nesterov optimizer (pure logic)."""

from __future__ import annotations

import pytest
import torch

from geomesh.outer import OuterNesterov, aggregate


def test_token_weighted_aggregation_by_hand():
    """Catches a plain (unweighted) mean or weights not normalised by N: with
    n = (1, 3) tokens, Δ = 1/4 Δ_0 + 3/4 Δ_1, checked on numbers done by hand
    (exact in fp32: all values are dyadic)."""
    d0 = {"w": torch.tensor([4.0, -8.0]), "b": torch.tensor(2.0)}
    d1 = {"w": torch.tensor([0.0, 4.0]), "b": torch.tensor(-2.0)}
    out = aggregate([d0, d1], [1000, 3000])
    assert torch.equal(out["w"], torch.tensor([1.0, 1.0]))  # [4/4 + 0, -8/4 + 12/4]
    assert torch.equal(out["b"], torch.tensor(-1.0))  # 2/4 - 6/4
    with pytest.raises(ValueError, match="0 tokens"):
        aggregate([d0, d1], [0, 0])


@pytest.mark.parametrize("warmup", [False, True])
def test_outer_nesterov_step_by_hand_and_matches_torch_sgd(warmup):
    """Catches a wrong Nesterov form (e.g. θ -= lr·v, or momentum applied before
    the first buffer exists): step 1 and 2 by hand with lr=0.5, μ=0.5, and eight
    steps equal torch.optim.SGD(nesterov=True) fed Δ as the gradient, bit for bit
    (the same fp32 operations in the same order: what torchft's DiLoCo runs as its
    outer step, tests/test_geomesh_torchft_diloco.py).  With ``momentum_warmup``
    torch's SGD gets ``μ_t`` before step ``t``: the ramp is a momentum schedule of
    the same optimizer, nothing else."""
    theta = {"w": torch.tensor([1.0, 2.0])}
    opt = OuterNesterov(theta, lr=0.5, momentum=0.5)
    opt.step({"w": torch.tensor([1.0, -2.0])})  # v=[1,-2]; θ -= 0.5*([1,-2]+0.5*[1,-2])
    assert torch.equal(theta["w"], torch.tensor([0.25, 3.5]))
    opt.step({"w": torch.tensor([2.0, 0.0])})  # v=[2.5,-1]; θ -= 0.5*([2,0]+[1.25,-0.5])
    assert torch.equal(theta["w"], torch.tensor([-1.375, 3.75]))

    g = torch.Generator().manual_seed(0)
    start = torch.randn(64, 33, generator=g)
    deltas = [torch.randn(64, 33, generator=g) * 10.0 ** (t % 5 - 2) for t in range(8)]
    ours = {"p": start.clone()}
    outer = OuterNesterov(ours, lr=0.7, momentum=0.9, momentum_warmup=warmup)
    ref = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for d in deltas:
        sgd.param_groups[0]["momentum"] = outer.current_momentum
        outer.step({"p": d})
        ref.grad = d.clone()
        sgd.step()
        assert torch.equal(ours["p"], ref.detach())


def test_outer_state_dict_round_trip():
    """Catches resume bugs: momentum or global weights not saved, or state_dict
    returning live references (later steps would mutate the 'saved' copy).  A
    restored optimizer must continue exactly (bitwise) like the original."""
    g = torch.Generator().manual_seed(0)
    theta = {"a": torch.randn(3, 2, generator=g), "b": torch.randn(4, generator=g)}
    deltas = [{k: torch.randn(v.shape, generator=g) for k, v in theta.items()} for _ in range(4)]
    opt = OuterNesterov(theta)
    for d in deltas[:2]:
        opt.step(d)
    state = opt.state_dict()
    for d in deltas[2:]:
        opt.step(d)
    fresh = {k: torch.zeros_like(v) for k, v in theta.items()}
    opt2 = OuterNesterov(fresh, lr=0.1, momentum=0.0)
    opt2.load_state_dict(state)
    assert opt2.step_count == 2 and opt2.lr == 0.7 and opt2.momentum == 0.9
    for d in deltas[2:]:
        opt2.step(d)
    for k in theta:
        assert torch.equal(fresh[k], theta[k])
        assert torch.equal(opt2.momentum_buffer[k], opt.momentum_buffer[k])
    with pytest.raises(ValueError, match="other names"):
        OuterNesterov({"c": torch.zeros(1)}).load_state_dict(state)


def test_momentum_warmup_follows_nesterov_schedule_by_hand():
    """Catches a ramp that is off by one step or never reaches ``μ``: with
    ``momentum_warmup`` the t-th step (t = 1, 2, ...) uses
    ``μ_t = min(μ, 1 − 3/(t + 5))`` = 0.5, 4/7, ..., then 0.9 from t = 25 on,
    and the update is Nesterov's with that μ_t."""
    opt = OuterNesterov({"w": torch.zeros(1)}, lr=1.0, momentum=0.9, momentum_warmup=True)
    seen, buf, w = [], None, 0.0
    for t in range(1, 31):
        mu = min(0.9, 1 - 3 / (t + 5))
        seen.append(opt.current_momentum)
        opt.step({"w": torch.ones(1)})
        buf = 1.0 if buf is None else mu * buf + 1.0
        w -= 1.0 + mu * buf
        assert opt.params["w"].item() == pytest.approx(w, rel=1e-6)
    assert seen[0] == pytest.approx(0.5) and seen[1] == pytest.approx(4 / 7)
    assert seen[23] < 0.9 and seen[24] == pytest.approx(0.9) and seen[-1] == pytest.approx(0.9)
    assert OuterNesterov({"w": torch.zeros(1)}, momentum=0.9).current_momentum == 0.9


def test_load_state_dict_fills_the_momentum_dict_callers_hold():
    """Catches a loaded momentum that replaces the dict: the predictive codec holds
    ``outer.momentum_buffer`` from before the resume (geomesh/sync.py), so a new
    dict would leave it empty and a resumed sign_pred run silently predicting 0."""
    theta = {"w": torch.zeros(3)}
    a = OuterNesterov(theta, lr=0.5)
    a.step({"w": torch.tensor([1.0, 2.0, 3.0])})
    b = OuterNesterov({"w": torch.zeros(3)}, lr=0.5)
    held = b.momentum_buffer
    b.load_state_dict(a.state_dict())
    assert held is b.momentum_buffer and torch.equal(held["w"], torch.tensor([1.0, 2.0, 3.0]))
