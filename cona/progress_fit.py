"""Correct the noise scale online from the progress observed either side of a batch switch.

The Pollux efficiency ``E(M) = (phi + M0)/(phi + M)`` (:mod:`cona.surrogate`) is exact
only at the right ``phi``; the gradient statistics measure one of three definitions
(``cona.gns_definition``), each exact under its own assumption about Adam's
preconditioner and the curvature, and none holds for every model
(``docs/results/cona_efficiency.json``: on the GPT-3 proxy ``simple`` is off by 60 %
and ``newton`` by 11 %; on the Llama proxy the reverse).  This module measures the
missing factor ``k`` in ``phi_true = k * phi_measured`` from the run itself.

Mechanism.  If the efficiency is right, a sample trained at batch ``M`` is worth
``E(M)`` reference samples, so the training loss is one smooth curve of the
*effective* samples ``u = sum_i ds_i E(M_i)`` (McCandlish et al. 2018, eq. 2.11:
``E/E_min = 1 + B/B_noise`` makes progress a function of effective samples alone),
whatever batches made them.  A wrong ``phi`` gives the wrong slope to each
constant-batch segment of ``u``, so the loss shows a kink at the switch.  For each
``k`` of a grid the fit maps samples to ``u`` (counted from the model's initialisation,
the samples before the window at the efficiency of its first batch), fits the loss with
one line in ``log u`` over the two segments next to the latest batch change (the ramp
of the learning rate after a switch left out) and finds the ``k`` of the smallest
residual.  Deep in training the loss is a power law of the samples with a small exponent
(Kaplan et al. 2020, eq. 1.2: ``L(D) ~ D^-0.095``), close to a line in ``log u`` over a
window that adds at most :data:`MAX_WINDOW_GROWTH` to the samples before it (earlier in
training there is no fit); a line is rigid enough that a kink cannot hide in it, as it
does in a quadratic or cubic in ``u``.  What it returns is conservative: of the 95 %
profile-likelihood interval of ``k`` (Gaussian residuals, one parameter: the ``k`` with
``n log(RSS_k/RSS_min) <= 3.84``), the end nearest to 1, and 1 where the interval holds
it or the minimum sits at the grid's edge (not identified).  The controller tests each
batch change once, when the whole window after it is in (a test repeated at every
decision until it passes would reject ``k = 1`` far more often than 5 %).
Without a batch change ``k`` is not identifiable and nothing is fitted.

``tests/test_cona_progress_fit.py`` draws loss curves from a known law of effective
samples (a power law), with a known ``k``, and checks the fit recovers it, that noise
five times larger hides it, and that a history at another batch is not read as a kink.
Its power is the weak point: the kink is a small part of a slow loss curve, and per-step
losses of small batches are noisy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .surrogate import statistical_efficiency

FACTORS = tuple(2.0 ** (i / 4) for i in range(-12, 21))  # 1/8 .. 32, quarter octaves
CHI2_1DOF_95 = 3.84
# The window's samples at most this share of those before it: over more, a line in log u
# misreads the bend of a power law (L ~ u^-0.3) as a kink (test_cona_progress_fit.py: k = 1
# rejected on 7 draws in 10 at 0.48, on none at 0.29).
MAX_WINDOW_GROWTH = 0.3


@dataclass(frozen=True)
class ProgressFit:
    """One fit of the noise-scale factor.

    Attributes:
        factor: the ``k`` to use: the end of the 95 % interval of ``k`` nearest to 1 (1.0
            where the interval holds 1, or where the best ``k`` is at the grid's edge and
            so not identified).
        best_factor: the grid's ``k`` of the smallest residual.
        evidence: ``n log(RSS(k=1) / RSS(best))``, the likelihood-ratio statistic.
        points: losses fitted.
        batches: the two global batches either side of the change (old, new).
    """

    factor: float
    best_factor: float
    evidence: float
    points: int
    batches: tuple[int, int]

    def to_dict(self) -> dict:
        return {"factor": self.factor, "best_factor": self.best_factor,
                "evidence": self.evidence, "points": self.points,
                "batches": list(self.batches)}

    @classmethod
    def from_dict(cls, d: dict) -> ProgressFit:
        """Inverse of :meth:`to_dict` (a checkpoint's controller state)."""
        return cls(factor=float(d["factor"]), best_factor=float(d["best_factor"]),
                   evidence=float(d["evidence"]), points=int(d["points"]),
                   batches=(int(d["batches"][0]), int(d["batches"][1])))


def _segments(batches: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, end)`` index ranges of constant batch, in order."""
    out, start = [], 0
    for i in range(1, len(batches) + 1):
        if i == len(batches) or batches[i] != batches[start]:
            out.append((start, i))
            start = i
    return out


def fit_noise_scale_factor(
    samples: Sequence[float],
    losses: Sequence[float],
    batches: Sequence[int],
    noise_scales: Sequence[float],
    reference_batch: float,
    *,
    skip_after_change: int = 0,
    window: int = 100,
    min_points: int = 20,
    min_after: int | None = None,
    factors: Sequence[float] = FACTORS,
) -> ProgressFit | None:
    """Fit ``k`` in ``phi_true = k * phi`` from per-step training losses (module docstring).

    Args:
        samples: consumed samples after each step (any unit proportional to sequences).
        losses: the step's training loss (nats), before its update.
        batches: the step's global batch (the unit of ``reference_batch``).
        noise_scales: the noise scale the controller used at that step (same unit).
        reference_batch: ``M0`` of the efficiency.
        skip_after_change: steps after the batch change left out of the fit (the learning
            rate's ramp), though their samples still count in ``u``.
        window: steps used on each side of the change, at most.
        min_points: fewer fitted losses on either side: no fit.
        min_after: fewer steps after the change and its ramp: no fit (default
            ``min_points``; the controller asks for the whole ``window``, so that each
            change is tested once, not at every decision until it passes).  Non-finite
            losses are left out of the fit, not waited for.
        factors: the grid of ``k``.

    Returns:
        ``None`` where the records hold no batch change with enough points either side,
        or where the window trains more than :data:`MAX_WINDOW_GROWTH` times the samples
        before it (early in training a line in ``log u`` does not hold over the window).

    Raises:
        ValueError: sequences of different lengths, or a non-positive noise scale.
    """
    n = len(samples)
    if not n == len(losses) == len(batches) == len(noise_scales):
        raise ValueError("samples, losses, batches and noise_scales need one entry per step")
    segs = _segments(batches)
    if len(segs) < 2:
        return None
    (a0, a1), (b0, b1) = segs[-2], segs[-1]
    lo, hi = max(a0, a1 - window), min(b1, b0 + skip_after_change + window)
    if hi - (b0 + skip_after_change) < (min_points if min_after is None else min_after):
        return None  # the window after the change is not in yet
    fitted = [i for i in range(lo, hi) if not b0 <= i < b0 + skip_after_change
              and math.isfinite(losses[i])]  # a non-finite loss is left out, not waited for
    before = sum(1 for i in fitted if i < a1)
    if before < min_points or len(fitted) - before < min_points:
        return None
    if any(not phi > 0 for phi in noise_scales[lo:hi]):
        raise ValueError("noise scales must be positive to fit their factor")
    ds = np.diff(np.asarray(samples, dtype=float), prepend=float(samples[0]))
    if lo == 0:  # the first record's own step: as the next one's (the same batch)
        ds[0] = ds[1] if n > 1 else 0.0
    ds = ds[lo:hi]
    y = np.asarray([losses[i] for i in fitted])
    origin = float(samples[lo]) - ds[0]  # samples before the window
    if not origin > 0:
        raise ValueError("samples must count from the model's initialisation (positive)")
    if float(samples[hi - 1]) - origin > MAX_WINDOW_GROWTH * origin:
        return None  # too early in training for a line in log u over the window
    keep = np.asarray(fitted) - lo

    def rss(k: float) -> float:
        eff = np.asarray([statistical_efficiency(batches[i], k * noise_scales[i],
                                                 reference_batch) for i in range(lo, hi)])
        step_u = ds * eff
        # a step's loss is taken before its update; the samples before the window count
        # at the efficiency of the window's first batch (exact where it ran that batch
        # since the start; a batch change further back is not seen)
        u = origin * eff[0] + (np.cumsum(step_u) - step_u)[keep]
        x = np.stack([np.ones_like(u), np.log(u)], axis=1)
        resid = y - x @ np.linalg.lstsq(x, y, rcond=None)[0]
        return float(resid @ resid)

    by_factor = {k: rss(k) for k in factors}
    if 1.0 not in by_factor:
        by_factor[1.0] = rss(1.0)
    best = min(by_factor, key=lambda k: (by_factor[k], abs(math.log(k))))

    def lr_stat(k: float) -> float:  # n log(RSS_k / RSS_best): chi^2 with 1 dof at the truth
        return len(y) * math.log(max(by_factor[k], 1e-300) / max(by_factor[best], 1e-300))

    # the 95 % profile-likelihood interval of k; its end nearest 1 (1 itself if inside)
    inside = [k for k in by_factor if lr_stat(k) <= CHI2_1DOF_95]
    conservative = min(inside, key=lambda k: abs(math.log(k)))
    edge = best in (min(factors), max(factors))  # the optimum is off the grid: not identified
    return ProgressFit(factor=1.0 if edge else conservative, best_factor=best,
                       evidence=lr_stat(1.0), points=len(y),
                       batches=(int(batches[a0]), int(batches[b0])))
