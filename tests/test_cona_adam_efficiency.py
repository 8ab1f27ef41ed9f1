"""cona/adam_efficiency.py against known answers: Pollux's E(M) where every coordinate has
the same noise-to-signal ratio, and the best step of Adam at each batch on quadratics of
three curvatures."""

from __future__ import annotations

import pytest
import torch

from cona.adam_efficiency import progress_from_moments
from cona.surrogate import statistical_efficiency

N, B_MICRO = 64, 4  # micro-batches and their size: batches up to 256


def _exact_moments(grad: torch.Tensor, sigma2: torch.Tensor):
    """The moments of N micro-batch gradients in expectation: ``gbar^2 = G^2 + s^2/N``,
    ``s^2 = sigma^2 / b``."""
    var = sigma2 / B_MICRO
    return (grad**2 + var / N).sqrt(), var


def _efficiency(pps: dict, m: float, m0: float) -> float:
    return pps[m] / pps[m0]


def test_equal_noise_to_signal_ratios_give_pollux_efficiency():
    """Known answer (module docstring): with ``sigma_i^2 = rho G_i^2`` for every coordinate
    the efficiency is ``(rho + M0)/(rho + M)``, Pollux's with ``phi = rho = B_simple``,
    whatever the gradients' spread.  Catches a missing ``/ B`` or a square in the wrong
    place (either changes the curve's shape, not only its scale)."""
    grad = torch.logspace(-4, 0, 500, dtype=torch.float64)
    for rho in (5.0, 60.0, 400.0):
        mean, var = _exact_moments(grad, rho * grad**2)
        pps = progress_from_moments(mean, var, N, B_MICRO, [16, 32, 128, 256], eps=0.0)
        for m in (32, 128, 256):
            assert _efficiency(pps, m, 16) == pytest.approx(
                statistical_efficiency(m, rho, 16), rel=1e-9), (rho, m)


@pytest.mark.parametrize("curvature", ["follows_v", "isotropic", "inverse_precond"])
def test_best_adam_step_at_each_batch_on_a_quadratic(curvature):
    """Known answer: on a quadratic with a diagonal Hessian, Adam's step ``-eta g/sqrt(v)``
    with ``v = G^2 + Sigma/B`` at each batch, its best ``eta`` found on a grid (the
    expected loss drop, no formula of the module used): the progress per sample over the
    reference's equals the module's ``S(M)^2/M`` ratio for every curvature (it cancels),
    while the spread of noise-to-signal ratios makes it fall faster than Pollux's
    ``E(M)`` at ``B_simple`` (0.42 against 0.63 at ``M = 128``).  Catches an efficiency that depends on the curvature or misreads the
    spread."""
    d = 256
    h = torch.logspace(-3, 0, d, dtype=torch.float64)
    grad, sigma2 = h, torch.full((d,), 10.0, dtype=torch.float64)  # ratio 10/h^2: 10 to 1e7
    hess = {"follows_v": h, "isotropic": torch.ones(d, dtype=torch.float64),
            "inverse_precond": (grad**2 + sigma2 / 32).sqrt()}[curvature]

    def best_drop(batch):
        v = grad**2 + sigma2 / batch
        eta = torch.logspace(-8, 4, 48001, dtype=torch.float64)
        first = (grad**2 / v.sqrt()).sum()
        second = (hess * (grad**2 + sigma2 / batch) / v).sum()
        return float((eta * first - eta**2 / 2 * second).max())

    mean, var = _exact_moments(grad, sigma2)
    pps = progress_from_moments(mean, var, N, B_MICRO, [32, 128, 256], eps=0.0)
    b_simple = float(sigma2.sum() / (grad**2).sum())
    for m in (128, 256):
        truth = best_drop(m) / m / (best_drop(32) / 32)
        assert _efficiency(pps, m, 32) == pytest.approx(truth, rel=1e-3), m
        assert statistical_efficiency(m, b_simple, 32) > 1.3 * truth  # Adam's falls faster


def test_batches_outside_the_probe_are_refused():
    """A batch above ``n * b`` sequences has no unbiased ``v(B)``: a clear error, not a
    number."""
    mean, var = _exact_moments(torch.ones(4, dtype=torch.float64), torch.ones(4))
    with pytest.raises(ValueError, match=r"must be in \(0, 256\]"):
        progress_from_moments(mean, var, N, B_MICRO, [512])
