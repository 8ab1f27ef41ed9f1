"""Goodput surrogate: throughput x statistical efficiency of the global batch.

Statistical efficiency (Qiao et al., "Pollux: Co-adaptive Cluster Scheduling
for Goodput-Optimized Deep Learning", OSDI 2021, Sec. 3.1, eq. 5)::

    E(M) = (phi + M0) / (phi + M)

with ``M`` the global batch size, ``M0`` the reference batch size (the one the
learning rate was tuned for; ``E(M0) = 1``) and ``phi`` the gradient noise
scale.  It follows from McCandlish's ``E_examples = E_min (1 + B/B_noise)``: a
sample trained at batch ``M`` is worth ``E(M)`` samples at batch ``M0``.

Which noise scale, for Adam.  On a locally quadratic loss (Hessian ``H``,
per-sample gradient covariance ``Sigma``, true gradient ``G``), a step
``-eps P g_B`` with a fixed preconditioner ``P`` (Adam: ``1/(sqrt(v_hat)+eps)``)
lowers the loss in expectation by ``eps G'PG - eps^2/2 (G'PHPG + tr(PHP Sigma)/B)``;
at the best ``eps`` that is ``dL_max / (1 + B_noise/B)`` with
``B_noise = tr(PHP Sigma) / (G'PHPG)`` (McCandlish et al. 2018, eq. 2.7-2.8,
for the preconditioned step), so ``phi = B_noise`` makes ``E(M)`` exact.  It
needs the curvature, which the in-run probe does not measure (:mod:`cona.curvature`
measures it, a check: docs/cona.md, "The curvature, measured"); the three definitions of
``cona.gns_definition`` (:data:`cona.probe.DEFINITIONS`: the norms of ``P^a g``) each
assume one:

- ``simple``, ``B_simple = tr(Sigma)/|G|^2`` (:mod:`cona.grad_stats`), is exact when
  ``PHP ~ I``, i.e. when Adam's ``v`` follows the curvature (``v ~ diag Fisher ~ diag
  H``, the Gauss-Newton view of cross-entropy once gradient noise dominates ``v``);
- ``newton``, ``tr(P Sigma)/(G'PG)``, is exact when ``P ~ H^-1``: Adam's step is then a
  diagonal Newton step, the premise of a preconditioner;
- ``pollux``, ``tr(P Sigma P)/|PG|^2`` (Qiao et al. 2021, Sec. 3.1), is exact when the
  raw Hessian is isotropic (``H ~ I``).

``tests/test_cona_controller.py`` checks each on a quadratic where the efficiency is
computed from the best step size at each batch.  Which holds for a model is measured:
``bench/cona_efficiency.py`` trains every grid batch to the target and compares the
efficiency each definition predicts with the measured one (docs/cona.md, "Which noise
scale"); the default is the definition with the lowest error over the families measured.
:mod:`cona.adam_efficiency` drops the fixed preconditioner (Adam's second moment at each
batch, the curvature cancelling); the same bench measures it, and it ranks nothing.

Score (Pollux's GOODPUT, eq. 4)::

    score = samples_per_s(M) * E(M)

in *reference-batch samples per second*: the rate of training progress
measured as samples at the reference batch.  Ranking by it is ranking by
"perplexity progress per second" to first order.  ``M``, ``M0`` and ``phi``
must share a unit (sequences here).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .cost_model import CostModel
from .strategy import Strategy


def statistical_efficiency(
    batch_size: float, noise_scale: float | None, reference_batch: float
) -> float:
    """Pollux ``E(M) = (phi + M0)/(phi + M)``; 1.0 when ``noise_scale`` is ``None``.

    ``None`` (no estimate yet) returns 1.0: callers must then compare only
    strategies with the same global batch (see :class:`cona.controller.Controller`).

    Raises:
        ValueError: a batch size is not positive, or ``noise_scale`` is negative.
    """
    if batch_size <= 0 or reference_batch <= 0:
        raise ValueError(
            f"batch sizes must be positive, got batch {batch_size}, reference {reference_batch}"
        )
    if noise_scale is None:
        return 1.0
    if noise_scale < 0:
        raise ValueError(f"noise_scale must be >= 0, got {noise_scale}")
    return (noise_scale + reference_batch) / (noise_scale + batch_size)


def goodput(
    samples_per_s: float, batch_size: float, noise_scale: float | None, reference_batch: float
) -> float:
    """Throughput (samples/s) x :func:`statistical_efficiency`, in reference-batch samples/s."""
    return samples_per_s * statistical_efficiency(batch_size, noise_scale, reference_batch)


@dataclass(frozen=True)
class Score:
    """One strategy's surrogate.

    Attributes:
        strategy: the strategy scored.
        iter_s: predicted (calibrated) seconds per optimizer step.
        samples_per_s: sequences per second.
        efficiency: Pollux statistical efficiency of its global batch.
        score: ``samples_per_s * efficiency`` (reference-batch samples/s).
    """

    strategy: Strategy
    iter_s: float
    samples_per_s: float
    efficiency: float
    score: float


def score_strategy(
    strategy: Strategy,
    cost_model: CostModel,
    noise_scale: float | None,
    reference_batch: float,
) -> Score:
    """Score one strategy with the cost model's calibrated prediction."""
    est = cost_model.predict(strategy)
    eff = statistical_efficiency(strategy.global_batch_size, noise_scale, reference_batch)
    return Score(strategy, est.iter_s, est.samples_per_s, eff, est.samples_per_s * eff)


def rank_strategies(
    candidates: Iterable[Strategy],
    cost_model: CostModel,
    noise_scale: float | None,
    reference_batch: float,
) -> list[Score]:
    """Scores of ``candidates``, best first (ties broken by label for determinism)."""
    scores = [score_strategy(s, cost_model, noise_scale, reference_batch) for s in candidates]
    return sorted(scores, key=lambda x: (-x.score, x.strategy.label))


def chaining_ceiling(
    samples_per_s: dict[int, float],
    noise_scale_start: float,
    noise_scale_end: float,
    reference_batch: float,
    steps: int = 2000,
) -> tuple[int, float]:
    """What an ideal chain of global batches gains over the best static one, in this model.

    Progress (reference-batch samples, eq. 4) runs from 0 to 1 while the noise scale grows
    log-linearly in progress from ``noise_scale_start`` to ``noise_scale_end``; the ideal
    chain runs every moment at the batch of the highest goodput, with no switch cost, and
    each static batch at its own.  A model estimate (Pollux, Qiao et al. OSDI'21, eq. 4-5),
    not a measurement: it bounds what any chain over these batches can win when the cost
    model and the efficiency rule hold.

    Args:
        samples_per_s: sequences per second of the fastest layout at each global batch.
        noise_scale_start, noise_scale_end: noise scale (sequences) at the start and end.
        reference_batch: ``M0`` (sequences).
        steps: midpoint-rule steps over progress.

    Returns:
        ``(best static batch, time of the best static / time of the ideal chain)`` (>= 1).

    Raises:
        ValueError: no batches, a rate that is not positive and finite, a noise scale or
            ``reference_batch`` <= 0, or ``steps`` < 1.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not samples_per_s or not all(0 < x < math.inf for x in samples_per_s.values()):
        raise ValueError(f"need positive samples/s per batch, got {samples_per_s}")
    if noise_scale_start <= 0 or noise_scale_end <= 0:
        raise ValueError(f"noise scales must be positive, got {noise_scale_start}, "
                         f"{noise_scale_end}")
    static = dict.fromkeys(samples_per_s, 0.0)
    ideal = 0.0
    growth = noise_scale_end / noise_scale_start
    for i in range(steps):
        phi = noise_scale_start * growth ** ((i + 0.5) / steps)
        rate = {b: x * statistical_efficiency(b, phi, reference_batch)
                for b, x in samples_per_s.items()}
        for b in static:
            static[b] += 1.0 / rate[b]
        ideal += 1.0 / max(rate.values())
    best = min(static, key=lambda b: (static[b], b))
    return best, static[best] / ideal
