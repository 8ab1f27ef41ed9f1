"""Gradient noise scale (GNS) from gradient norms at two batch sizes.

McCandlish et al. 2018, "An Empirical Model of Large-Batch Training",
Sec. 2.2 and Appendix A.1.  For a batch of ``B`` i.i.d. samples the mean
gradient ``G_B`` satisfies ``E|G_B|^2 = |G|^2 + tr(Sigma)/B``, with ``G`` the
true gradient and ``Sigma`` the per-sample gradient covariance.  Two batch
sizes ``B_small < B_big`` give unbiased estimates::

    |G|^2     ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

and the simple noise scale ``B_simple = tr(Sigma) / |G|^2`` (in the units of
the batch sizes passed: sequences in this project; times ``seq_length`` for
tokens).  Each estimate is noisy (``|G|^2`` may come out negative), so, as
in the paper, exponential moving averages of both are kept and their ratio is
reported.

In training, ``G_small`` is a micro-batch gradient or one DP replica's local
gradient (before the DP all-reduce) and ``G_big`` the averaged gradient of the
whole global batch, so no extra backward pass is needed.  Gradients must be of
the *mean* loss over their batch (not the sum), before clipping, in fp32.

Scale-free averaging (``normalize=True``; ``cona.gns_average``): each step's two estimates
are divided by that step's ``|G_big|^2 ~ |G|^2 (1 + phi/B_big)`` before they enter
the EMAs, so the ratio is a mean of the steps' noise scales ``phi_k`` weighted by
``decay^age / (B_big + phi_k)``: free of the gradient's scale, though steps with a
smaller noise scale still weigh more (a rising noise scale is still read low).
Without it the ratio of the EMAs weights each step by ``decay^age |G_k|^2``; early
in training ``|G|^2`` falls several-fold within the EMA's window, the old, large
steps dominate both EMAs, and the ratio reads the noise scale of ~20 steps ago.
Measured on the CONA bench (``bench/cona_efficiency.py``, tiny_bert, 48 steps
to the target; direct measurement from 64 micro-batches 125 sequences at the
target): 44 with the plain EMA, 113 scale-free, at the same decay 0.95.  ``|G_big|^2 = |G|^2 +
tr(Sigma)/B_big`` is a norm, never a small difference, so the weights are stable.
The EMAs of ``|G|^2`` and ``tr(Sigma)`` in their own units are kept for reporting.

Outlier steps: the estimates are linear in the squared norms, so one step on a
freak batch (measured on the bundled corpus: a loss spike from 6.7 to 12 with a
17x gradient norm) swings the EMA of ``|G|^2`` negative for over a hundred
steps.  A step whose ``|G_big|^2`` exceeds ``outlier_factor`` times the running
mean of ``|G_big|^2`` is therefore not added (counted in ``num_skipped``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is only needed by the helpers; keep the import cheap
    import torch


def two_batch_estimate(
    small_value: float, small_batch: float, big_value: float, big_batch: float
) -> tuple[float, float]:
    """Unbiased ``(signal, noise)`` from a quadratic form of batch-mean gradients at two
    batch sizes (McCandlish et al. 2018, App. A.1).

    For any fixed quadratic form ``Q`` (``|.|^2`` here; ``v' H v`` in
    :mod:`cona.curvature`) of the mean gradient of ``B`` samples,
    ``E[Q(g_B)] = Q(G) + tr(Q Sigma) / B``; two batch sizes give both terms.  No sign
    check: a quadratic form that is not positive definite (a Hessian) may give negative
    values; :func:`estimate_from_norms` checks norms.

    Args:
        small_value: ``Q(G_small)`` (mean over several small batches is fine).
        small_batch: ``B_small`` (samples per small batch).
        big_value: ``Q(G_big)``.
        big_batch: ``B_big``, larger than ``B_small``.

    Returns:
        ``(Q(G), tr(Q Sigma))``; ``Sigma`` is one sample's gradient covariance.

    Raises:
        ValueError: batch sizes not ``0 < B_small < B_big``, or a value not finite.
    """
    if not 0 < small_batch < big_batch:
        raise ValueError(f"need 0 < small_batch < big_batch, got {small_batch}, {big_batch}")
    for name, v in (("small_value", small_value), ("big_value", big_value)):
        if not math.isfinite(v):
            raise ValueError(f"{name} must be finite, got {v}")
    signal = (big_batch * big_value - small_batch * small_value) / (big_batch - small_batch)
    noise = (small_value - big_value) / (1.0 / small_batch - 1.0 / big_batch)
    return signal, noise


def estimate_from_norms(
    small_sq_norm: float, small_batch: float, big_sq_norm: float, big_batch: float
) -> tuple[float, float]:
    """One-step unbiased estimates ``(|G|^2, tr(Sigma))`` (McCandlish App. A.1):
    :func:`two_batch_estimate` of squared norms.

    Args:
        small_sq_norm: ``|G_small|^2`` (mean over several small batches is fine).
        small_batch: ``B_small`` (samples per small batch).
        big_sq_norm: ``|G_big|^2``.
        big_batch: ``B_big``, larger than ``B_small``.

    Raises:
        ValueError: batch sizes not ``0 < B_small < B_big``, or a norm negative
            or not finite.
    """
    for name, v in (("small_sq_norm", small_sq_norm), ("big_sq_norm", big_sq_norm)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite non-negative number, got {v}")
    return two_batch_estimate(small_sq_norm, small_batch, big_sq_norm, big_batch)


class GradientNoiseScale:
    """Running (EMA) estimate of ``|G|^2``, ``tr(Sigma)`` and ``B_simple``.

    Args:
        ema_decay: weight of the past in each EMA (0 <= decay < 1); the EMAs
            are bias-corrected like Adam's moments so early values are usable.
            0.95 averages over ~20 steps.
        outlier_factor: skip a step whose ``|G_big|^2`` is above this multiple
            of the running mean of ``|G_big|^2`` (module docstring); ``None``
            keeps every step.
        normalize: average the noise scale scale-free (module docstring); ``False``
            is the plain ratio of the EMAs (McCandlish et al.).

    Raises:
        ValueError: ``ema_decay`` outside [0, 1) or ``outlier_factor`` <= 1.
    """

    def __init__(self, ema_decay: float = 0.95, outlier_factor: float | None = 10.0,
                 normalize: bool = False) -> None:
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay={ema_decay} must be in [0, 1)")
        if outlier_factor is not None and outlier_factor <= 1.0:
            raise ValueError(f"outlier_factor={outlier_factor} must be > 1 (or None)")
        self.ema_decay = ema_decay
        self.outlier_factor = outlier_factor
        self.normalize = normalize
        self._g_sq = 0.0
        self._trace = 0.0
        self._g_rel = 0.0  # EMA of |G|^2 / |G_big|^2 (the scale-free average)
        self._trace_rel = 0.0  # the same for tr(Sigma)
        self._big = 0.0  # EMA of |G_big|^2 (outlier test)
        self._weight = 0.0  # 1 - decay^n, the bias correction
        self.num_updates = 0
        self.num_skipped = 0

    @classmethod
    def from_config(cls, cona_cfg) -> GradientNoiseScale:
        """The estimator a CONA job uses: averaging by ``cona.gns_average``
        (:class:`jobruntime.config.ConaConfig`), the other settings at their defaults."""
        return cls(normalize=cona_cfg.gns_average == "scale_free")

    def update(
        self,
        small_sq_norms: Sequence[float] | float,
        small_batch: int,
        big_sq_norm: float,
        big_batch: int,
    ) -> tuple[float, float]:
        """Add one step's norms; return this step's raw ``(|G|^2, tr(Sigma))`` estimates.

        An outlier step (class docstring) is not added; its raw estimates are
        still returned.

        Args:
            small_sq_norms: squared L2 norms of the small-batch gradients
                (one per micro-batch or per DP replica), or their mean.
            small_batch: samples in each small batch.
            big_sq_norm: squared L2 norm of the averaged global-batch gradient.
            big_batch: samples in the global batch.

        Raises:
            ValueError: as :func:`estimate_from_norms`, or an empty list.
        """
        if isinstance(small_sq_norms, int | float):
            small = float(small_sq_norms)
        else:
            vals = [float(v) for v in small_sq_norms]
            if not vals:
                raise ValueError("small_sq_norms is empty")
            small = sum(vals) / len(vals)
        g_sq, trace = estimate_from_norms(small, small_batch, big_sq_norm, big_batch)
        if (self.outlier_factor is not None and self.num_updates
                and big_sq_norm > self.outlier_factor * self._big / self._weight):
            self.num_skipped += 1
            return g_sq, trace
        if big_sq_norm <= 0:  # an all-zero gradient carries no scale
            self.num_skipped += 1
            return g_sq, trace
        d = self.ema_decay
        w = 1.0 / big_sq_norm
        self._g_sq = d * self._g_sq + (1 - d) * g_sq
        self._trace = d * self._trace + (1 - d) * trace
        self._g_rel = d * self._g_rel + (1 - d) * g_sq * w
        self._trace_rel = d * self._trace_rel + (1 - d) * trace * w
        self._big = d * self._big + (1 - d) * big_sq_norm
        self._weight = d * self._weight + (1 - d)
        self.num_updates += 1
        return g_sq, trace

    @property
    def g_sq(self) -> float | None:
        """Bias-corrected EMA of ``|G|^2``; ``None`` before the first update."""
        return self._g_sq / self._weight if self.num_updates else None

    @property
    def trace_sigma(self) -> float | None:
        """Bias-corrected EMA of ``tr(Sigma)`` (per-sample); ``None`` before the first update."""
        return self._trace / self._weight if self.num_updates else None

    @property
    def noise_scale(self) -> float | None:
        """``B_simple = tr(Sigma)/|G|^2`` in samples, averaged as ``normalize`` says
        (:attr:`noise_scale_plain` or :attr:`noise_scale_scale_free`)."""
        return self.noise_scale_scale_free if self.normalize else self.noise_scale_plain

    @property
    def noise_scale_plain(self) -> float | None:
        """The ratio of the plain EMAs; ``None`` until both are positive."""
        if not self.num_updates or self._g_sq <= 0 or self._trace <= 0:
            return None
        return self._trace / self._g_sq

    @property
    def noise_scale_scale_free(self) -> float | None:
        """The ratio of the scale-free EMAs (module docstring); ``None`` until both are
        positive."""
        if not self.num_updates or self._g_rel <= 0 or self._trace_rel <= 0:
            return None
        return self._trace_rel / self._g_rel

    def to_dict(self) -> dict[str, Any]:
        """Metrics record: ``gns``, ``gns_g_sq``, ``gns_trace``, ``gns_updates``."""
        return {
            "gns": self.noise_scale,
            "gns_g_sq": self.g_sq,
            "gns_trace": self.trace_sigma,
            "gns_updates": self.num_updates,
            "gns_skipped": self.num_skipped,
        }

    def state_dict(self) -> dict[str, float]:
        return {
            "ema_decay": self.ema_decay,
            "outlier_factor": self.outlier_factor,
            "normalize": self.normalize,
            "g_sq": self._g_sq,
            "trace": self._trace,
            "g_rel": self._g_rel,
            "trace_rel": self._trace_rel,
            "big": self._big,
            "weight": self._weight,
            "num_updates": self.num_updates,
            "num_skipped": self.num_skipped,
        }

    def load_state_dict(self, state: dict) -> None:
        self.ema_decay = float(state["ema_decay"])
        self.outlier_factor = state.get("outlier_factor", self.outlier_factor)
        self._g_sq = float(state["g_sq"])
        self._trace = float(state["trace"])
        # a state saved before scale-free averaging existed continues as the plain ratio
        # (its scale-free average starts from the plain one)
        self.normalize = bool(state.get("normalize", False))
        self._g_rel = float(state.get("g_rel", self._g_sq))
        self._trace_rel = float(state.get("trace_rel", self._trace))
        self._big = float(state.get("big", 0.0))
        self._weight = float(state["weight"])
        self.num_updates = int(state["num_updates"])
        self.num_skipped = int(state.get("num_skipped", 0))


def noise_scale_growth(values: Iterable[float | None]) -> float | None:
    """Growth of the noise scale over a run: the last over the first positive value of
    ``values`` (e.g. the estimate at each controller decision); ``None`` with fewer
    than two."""
    vals = [v for v in values if v is not None and v > 0]
    return vals[-1] / vals[0] if len(vals) >= 2 else None


# ---------------------------------------------------------------------------
# Pure-torch helpers (plain nn.Module, single process; for tests and demos)
# ---------------------------------------------------------------------------


def grad_sq_norm(params: Iterable[torch.Tensor]) -> float:
    """Sum of squared L2 norms of ``p.grad`` over ``params`` (fp32; missing grads skipped)."""

    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return total


def microbatch_grad_sq_norms(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    microbatches: Sequence[Any],
) -> tuple[list[float], float]:
    """Squared norms of each micro-batch gradient and of their average.

    Runs one backward per micro-batch (as gradient accumulation does) and
    leaves the averaged gradient in ``p.grad``, so an optimizer step may
    follow.  Micro-batches must have equal sizes (the average of their mean
    gradients is then the mean gradient of the global batch).

    Args:
        model: parameters with ``requires_grad`` are measured.
        loss_fn: ``loss_fn(model, microbatch) -> scalar`` mean loss over the micro-batch.
        microbatches: at least two micro-batches.

    Returns:
        ``([|G_mb_i|^2 for each micro-batch], |mean_i G_mb_i|^2)``.

    Raises:
        ValueError: fewer than two micro-batches.
    """
    import torch

    if len(microbatches) < 2:
        raise ValueError("need at least two micro-batches to separate noise from signal")
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    small = []
    for mb in microbatches:
        for p in params:
            p.grad = None
        loss_fn(model, mb).backward()
        small.append(grad_sq_norm(params))
        for acc, p in zip(total, params):
            if p.grad is not None:
                acc += p.grad.detach().double()
    n = len(microbatches)
    big = 0.0
    for acc, p in zip(total, params):
        acc /= n
        big += float(acc.pow(2).sum())
        p.grad = acc.to(p.dtype)
    return small, big
