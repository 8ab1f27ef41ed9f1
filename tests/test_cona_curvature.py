"""Known answers for the curvature-measured noise scale (cona/curvature.py)."""

from __future__ import annotations

import pytest
import torch

from cona.curvature import CurvatureProbe, curvature_stats
from cona.grad_stats import estimate_from_norms, two_batch_estimate


def test_second_difference_matches_autograd_hessian_vector_product():
    """Catches a wrong step or sign in the second difference: ``v' H v`` of a small
    network's cross-entropy must equal autograd's Hessian-vector product along ``v``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (64,), generator=g)
    w1 = torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.5
    w2 = torch.randn(7, 3, generator=g, dtype=torch.float64) * 0.5

    def f(a, b):
        return torch.nn.functional.cross_entropy(torch.tanh(x @ a) @ b, y)

    params = {"w1": w1.clone(), "w2": w2.clone()}
    probe = CurvatureProbe(params, lambda: float(f(params["w1"], params["w2"])), delta=1e-4)
    for seed in range(3):
        gv = torch.Generator().manual_seed(10 + seed)
        v = {"w1": torch.randn(5, 7, generator=gv, dtype=torch.float64),
             "w2": torch.randn(7, 3, generator=gv, dtype=torch.float64)}
        _, hv = torch.autograd.functional.hvp(f, (w1, w2), (v["w1"], v["w2"]))
        want = float((hv[0] * v["w1"]).sum() + (hv[1] * v["w2"]).sum())
        assert probe.quadratic_form(v) == pytest.approx(want, rel=1e-5)
    assert torch.equal(params["w1"], w1) and torch.equal(params["w2"], w2)  # restored
    with pytest.raises(ValueError, match="direction norm"):
        probe.quadratic_form({"w1": torch.zeros(5, 7, dtype=torch.float64)})


def _least_squares(seed: int, weights: torch.Tensor | None):
    """A population whose gradient noise sits where the curvature is low: ``H`` and
    ``Sigma`` are known, and ``tr(P H P Sigma) / (G' P H P G)`` differs from
    ``B_simple`` 2-7 times over."""
    g = torch.Generator().manual_seed(seed)
    d, n = 6, 200_000
    scales = torch.tensor([3.0, 2.0, 1.0, 0.3, 0.1, 0.03], dtype=torch.float64)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) * scales
    w_star = torch.ones(d, dtype=torch.float64)
    y = x @ w_star + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
    w = w_star + torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    per_sample = x * (x @ w - y)[:, None]  # gradients of (x.w - y)^2 / 2
    p = torch.ones(d, dtype=torch.float64) if weights is None else weights
    hess = x.T @ x / n
    grad, cov = per_sample.mean(0), torch.cov(per_sample.T, correction=0)
    php = p[:, None] * hess * p[None, :]
    want = float(torch.trace(php @ cov) / ((p * grad) @ hess @ (p * grad)))
    simple = float(torch.trace(p[:, None] * cov * p[None, :]) / (p * grad).pow(2).sum())
    return x, y, w, per_sample, p, want, simple, g


@pytest.mark.parametrize("preconditioned", [False, True])
def test_recovers_the_noise_scale_of_a_known_quadratic(preconditioned):
    """Catches an estimator that drops the curvature or mixes the two batch sizes: on least
    squares (``H`` and ``Sigma`` known) it must recover ``tr(P H P Sigma) / (G' P H P G)``
    (McCandlish et al. 2018, eq. 2.7-2.8), here 2-7 times off ``B_simple``, with and
    without a diagonal preconditioner ``P``."""
    weights = torch.tensor([0.2, 0.3, 1.0, 2.0, 3.0, 5.0], dtype=torch.float64) \
        if preconditioned else None
    x, y, w, per_sample, p, want, simple, g = _least_squares(1, weights)
    assert max(simple / want, want / simple) > 2  # the curvature matters here
    got = []
    for _ in range(5):
        cur = torch.randint(0, len(x), (8192,), generator=g)
        param = {"w": w.clone()}
        probe = CurvatureProbe(
            param, lambda cur=cur, param=param: float(
                ((x[cur] @ param["w"] - y[cur]) ** 2).mean() / 2), delta=1e-3)
        b, m = 4, 512
        draws = torch.randint(0, len(x), (m, b), generator=g)
        grads = ([per_sample[i].mean(0) * p] for i in draws)
        signal, noise = curvature_stats(grads, ["w"], b, probe, directions=256)
        got.append(noise / signal)
    assert sum(got) / len(got) == pytest.approx(want, rel=0.15)


def test_two_batch_estimate_takes_any_quadratic_form_and_norms_stay_checked():
    """Catches the shared algebra drifting from McCandlish's App. A.1: the signal and
    noise terms of ``E[Q(g_B)] = Q(G) + tr(Q Sigma) / B`` come back exactly, negative
    values included (an indefinite Hessian), while squared norms must stay >= 0."""
    signal, noise = 2.0, -12.0
    small, big = signal + noise / 4, signal + noise / 64
    assert two_batch_estimate(small, 4, big, 64) == pytest.approx((signal, noise))
    with pytest.raises(ValueError, match="non-negative"):
        estimate_from_norms(-1.0, 4, 1.0, 64)
    with pytest.raises(ValueError, match="small_batch < big_batch"):
        two_batch_estimate(1.0, 64, 1.0, 4)


def test_identity_curvature_gives_the_simple_noise_scale_exactly():
    """Catches batch sizes wired wrongly into the estimate (``B_big`` not ``n x B_small``,
    or directions not the first micro-batches): with ``H = I`` the curvature's terms are
    ``B_simple``'s, ``|G|^2`` and ``tr(Sigma)`` of the same gradients
    (:func:`cona.grad_stats.estimate_from_norms`), to rounding, here with 3 directions of
    8 micro-batches of 4."""

    class Identity:  # v' I v
        def quadratic_form(self, v):
            return float(sum(t.pow(2).sum() for t in v.values()))

    g = torch.Generator().manual_seed(3)
    grads = [[torch.randn(5, generator=g, dtype=torch.float64) + 1.0] for _ in range(8)]
    got = curvature_stats(iter([[t.clone() for t in x] for x in grads]), ["w"], 4, Identity(),
                          directions=3)
    small = sum(float(x[0].pow(2).sum()) for x in grads[:3]) / 3
    big = float(torch.stack([x[0] for x in grads]).mean(0).pow(2).sum())
    assert got == pytest.approx(estimate_from_norms(small, 4, big, 32), rel=1e-12)
