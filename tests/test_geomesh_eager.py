"""The eager start of overlapped rounds (geomesh/eager.py), on tensors with known answers."""

import pytest
import torch

from geomesh.eager import EagerStart
from geomesh.outer import OuterNesterov


def _outer(lr=0.5):
    theta = {"w": torch.tensor([1.0, -2.0, 3.0]), "b": torch.tensor([0.5])}
    outer = OuterNesterov(theta, lr=lr, momentum=0.9, momentum_warmup=True)
    outer.step({"w": torch.tensor([0.2, 0.1, -0.3]), "b": torch.tensor([0.05])})  # a momentum exists
    return outer


def test_estimate_mixes_own_message_and_last_aggregate():
    """Catches a mix with the weights swapped or the last aggregate ignored:
    Δ̂ = w·own + (1 − w)·last, and own alone before any aggregate exists."""
    e = EagerStart()
    own = {"w": torch.tensor([2.0, 0.0]), "b": torch.tensor([1.0])}
    assert torch.equal(e.estimate(own, 0.25)["w"], own["w"])  # no aggregate yet
    e.remember({"w": torch.tensor([4.0, 8.0]), "b": torch.tensor([-1.0])})
    est = e.estimate(own, 0.25)
    assert torch.allclose(est["w"], torch.tensor([3.5, 6.0]))
    assert torch.allclose(est["b"], torch.tensor([-0.5]))
    assert torch.equal(e.estimate(own, 1.0)["w"], own["w"])


def test_start_equals_real_outer_step_when_rounds_repeat():
    """Catches an eager start that is not the outer step of the estimate (wrong
    momentum, lr or Nesterov term): when every worker's message equals the last
    aggregate, the estimate is exact and the eager start is the weights the
    real outer step then gives, to float rounding (the rebase moves nothing)."""
    outer = _outer()
    delta = {"w": torch.tensor([0.3, -0.2, 0.1]), "b": torch.tensor([0.02])}
    e = EagerStart()
    e.remember(delta)
    start = e.start(outer, delta, 0.4)
    outer.step(delta)
    for k in outer.params:
        assert torch.allclose(start[k], outer.params[k], rtol=0, atol=1e-7), k


def test_start_for_momentum_corrected_messages_is_plain_step():
    """Catches the outer momentum applied twice with geomesh.compress_update (the
    messages already carry it): θ − lr·Δ̂."""
    outer = _outer(lr=0.5)
    e = EagerStart()
    e.remember({"w": torch.ones(3), "b": torch.ones(1)})
    start = e.start(outer, {"w": torch.zeros(3), "b": torch.zeros(1)}, 0.5, corrected=True)
    assert torch.allclose(start["w"], outer.params["w"] - 0.25)
    assert torch.allclose(start["b"], outer.params["b"] - 0.25)


def test_bad_input_and_state_round_trip():
    """Catches a token share outside [0, 1] or a message of another model taken
    silently, and a checkpoint that loses the last aggregate (a resumed run would
    start its first overlapped round from the worker's message alone)."""
    e = EagerStart()
    e.remember({"w": torch.ones(2)})
    with pytest.raises(ValueError, match="token share"):
        e.estimate({"w": torch.ones(2)}, 1.5)
    with pytest.raises(ValueError, match="differ"):
        e.estimate({"v": torch.ones(2)}, 0.5)
    assert e.nbytes() == 8
    f = EagerStart()
    f.load_state_dict(e.state_dict())
    assert torch.equal(f.last["w"], e.last["w"])
    g = EagerStart()
    g.load_state_dict(EagerStart().state_dict())
    assert g.last is None
