"""A statistical efficiency consistent with Adam, from per-coordinate gradient statistics.

Pollux's ``E(M) = (phi + M0)/(phi + M)`` (:mod:`cona.surrogate`) takes Adam's
preconditioner as fixed, the same at every batch; the three noise-scale definitions then
differ only in the curvature they assume.  Adam's preconditioner is not fixed: its second
moment at batch ``B`` is, per coordinate ``i``, ``v_i(B) = G_i^2 + sigma_i^2 / B``
(``G_i`` the true gradient, ``sigma_i^2`` one sequence's gradient variance), so a larger
batch makes Adam take larger steps on the coordinates where noise dominates.

Model (one Adam step without momentum, ``v`` at its steady state at batch ``B``, a
diagonal Hessian ``h``, the best step size ``eta`` at each batch, as Pollux assumes)::

    E[dL] = -eta * sum_i G_i^2 / sqrt(v_i) + eta^2/2 * sum_i h_i * E[g_i^2] / v_i
          = -eta * S(B) + eta^2/2 * sum_i h_i,        S(B) = sum_i G_i^2 / sqrt(v_i(B))

since ``E[g_i^2] = v_i``: the curvature term does not depend on ``B``.  At the best
``eta`` the progress per step is ``S(B)^2 / (2 sum h)`` and per sequence ``S(B)^2 / B``:
the curvature cancels from every ratio between batches, so the efficiency at ``M``
against ``M0`` is ``(S(M)^2 / M) / (S(M0)^2 / M0)``, from gradient statistics alone.
Where every coordinate has the same ``rho = sigma^2 / G^2`` it is Pollux's ``E(M)`` with
``phi = rho = B_simple``; it differs through the spread of ``rho_i`` over coordinates.

Estimates (:func:`progress_per_sample`): from ``n`` micro-batch gradients of ``b``
sequences each, per coordinate the mean ``gbar`` and the unbiased variance ``s^2`` of the
micro-batch gradients: ``sigma^2 = b s^2``, ``G^2 = gbar^2 - s^2/n`` (unbiased) and
``v(B) = G^2 + sigma^2 / B``, positive for ``B <= n b``.  ``bench/cona_efficiency.py``
compares it with the measured efficiency (definition ``adam``; docs/cona.md, "Which
noise scale").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from jobruntime.trainer import Trainer

from .probe import _grad, _is_counted


def progress_per_sample(trainer: Trainer, microbatches: list, batches: Sequence[float],
                        eps: float = 1e-8) -> dict[float, float]:
    """``S(B)^2 / B`` (module docstring) at each proxy batch of ``batches``: Adam's best
    progress per sequence, up to a factor common to every batch, at the trainer's current
    weights, from one forward and backward per micro-batch (no optimizer step; the
    gradient buffers are left zeroed).

    Args:
        microbatches: ``n >= 2`` micro-batches of ``b`` sequences each.
        batches: proxy global batches (sequences), each at most ``n * b``.
        eps: Adam's epsilon, added to ``sqrt(v)`` as Adam does.

    Returns:
        ``{B: progress per sequence}`` (arbitrary unit: use only ratios between batches).

    Raises:
        ValueError: fewer than two micro-batches, more than one process, or a batch above
            ``n * b`` (where ``v(B)`` is not positive).
    """
    n = len(microbatches)
    if n < 2:
        raise ValueError("need at least two micro-batches")
    if dist.get_world_size() != 1:
        raise ValueError("progress_per_sample runs in one process (the emulated proxy)")
    b = int(next(iter(microbatches[0].values())).shape[0])
    _check_batches(batches, n, b)  # before the passes
    params = [p for p in trainer.module.parameters() if _is_counted(p)]
    first = [torch.zeros(p.numel(), dtype=torch.float64, device=p.device) for p in params]
    second = [torch.zeros(p.numel(), dtype=torch.float64, device=p.device) for p in params]
    for mb in microbatches:
        trainer.zero_grad()
        trainer._run_schedule([mb], forward_only=False)
        for s1, s2, p in zip(first, second, params):
            g = _grad(p).detach().reshape(-1).double()
            s1 += g
            s2 += g * g
    trainer.zero_grad()
    gbar = torch.cat(first) / n
    var = ((torch.cat(second) - n * gbar * gbar) / (n - 1)).clamp_min(0.0)
    return progress_from_moments(gbar, var, n, b, batches, eps)


def progress_from_moments(mean: torch.Tensor, var: torch.Tensor, n: int, b: int,
                          batches: Sequence[float], eps: float = 1e-8) -> dict[float, float]:
    """``S(B)^2 / B`` (module docstring) from per-coordinate statistics of ``n``
    micro-batch gradients of ``b`` sequences each.

    Args:
        mean: ``[d]`` the micro-batch gradients' mean per coordinate (``gbar``).
        var: ``[d]`` their unbiased variance per coordinate (``s^2``, non-negative).
        batches: proxy global batches (sequences), each in ``(0, n * b]``.

    Returns:
        ``{B: progress per sequence}``, up to a factor common to every batch.

    Raises:
        ValueError: a batch outside ``(0, n * b]``, or ``mean`` and ``var`` of other shapes.
    """
    if mean.shape != var.shape:
        raise ValueError(f"mean {tuple(mean.shape)} and var {tuple(var.shape)} differ in shape")
    _check_batches(batches, n, b)
    signal = mean * mean - var / n  # G^2, unbiased
    out = {}
    for B in batches:
        v = (signal + b * var / B).clamp_min(0.0)  # = gbar^2 + s^2 (b/B - 1/n) >= gbar^2
        out[B] = float((signal / (v.sqrt() + eps)).sum()) ** 2 / B
    return out


def _check_batches(batches: Sequence[float], n: int, b: int) -> None:
    if any(not 0 < B <= n * b for B in batches):
        raise ValueError(f"batches {list(batches)} must be in (0, {n * b}] (micro-batches x "
                         "their size): v(B) has no unbiased estimate above")
