"""The gradient noise scale measured directly at a state, from many fresh micro-batches
and no optimizer step (McCandlish et al. 2018, App. A.1): each micro-batch's gradient
alone against their mean.  A measurement for calibration and the benches (the bench's
reference, :mod:`cona.direct_probes`, :mod:`cona.curvature`), not the per-step estimate
of :mod:`cona.probe`.  One process with ``dp = pp = 1`` (the emulated proxy).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from jobruntime.trainer import Trainer

from .probe import _grad, _is_counted


def microbatch_gradients(trainer: Trainer, microbatches: list,
                         weights: list[torch.Tensor] | None = None):
    """Each micro-batch's own mean gradient at the trainer's current weights, one at a
    time: yields, per micro-batch, a list of new fp64 tensors (one per counted parameter
    of ``trainer.module``, in its order), each times ``weights``' tensor where given (e.g.
    :func:`adam_preconditioner`).  No optimizer step; the gradient buffers are left
    zeroed once the generator is exhausted.  One process with ``dp = pp = 1`` (the
    emulated proxy).

    Raises:
        ValueError: not one process, or ``weights`` not one per counted parameter.
    """
    if dist.get_world_size() != 1:
        raise ValueError("direct gradient probes run in one process (the emulated proxy)")
    params = [p for p in trainer.module.parameters() if _is_counted(p)]
    if weights is None:
        weights = [None] * len(params)
    elif len(weights) != len(params):
        raise ValueError(f"{len(weights)} weights for {len(params)} counted parameters")
    for mb in microbatches:
        trainer.zero_grad()  # not only the buffers: see Trainer.zero_grad
        trainer._run_schedule([mb], forward_only=False)
        grads = []
        for p, w in zip(params, weights):
            g = _grad(p).detach().to(torch.float64, copy=True)  # not a view of the buffer
            grads.append(g * w if w is not None else g)
        yield grads
    trainer.zero_grad()


def measure_gradient_stats(trainer: Trainer, microbatches: list,
                           weights: list[torch.Tensor] | None = None) -> tuple[float, float]:
    """Unbiased estimates ``(|G|^2, tr(Sigma))`` at the trainer's current weights from many
    micro-batches (per sequence: ``tr(Sigma)`` of one sequence's gradient).

    A direct measurement for calibration, not the per-step estimate: each
    micro-batch's gradient alone (``G_small``, ``B_small`` = its size) and their
    mean (``G_big`` over all of them), McCandlish et al. 2018 App. A.1, with no
    optimizer step (:func:`microbatch_gradients`); the gradient buffers are left
    zeroed.  One process with ``dp = pp = 1`` (the emulated proxy).  Their ratio is
    ``B_simple`` (:func:`measure_noise_scale`); kept apart, several measurements pool
    as a ratio of sums (:func:`cona.targets.fit_noise_scale`).

    Args:
        weights: multiply each counted parameter's gradient by this before its norm
            (e.g. :func:`adam_preconditioner`: Pollux's preconditioned noise scale
            ``tr(P Sigma P) / |P G|^2``); ``None`` measures the plain gradient.

    Raises:
        ValueError: fewer than two micro-batches, not ``dp = pp = 1``, or ``weights``
            not one per counted parameter.
    """
    from .grad_stats import estimate_from_norms

    if len(microbatches) < 2:
        raise ValueError("need at least two micro-batches")
    total, small = None, []
    for grads in microbatch_gradients(trainer, microbatches, weights):
        # a device scalar per tensor, one host sync per micro-batch
        small.append(float(sum(g.pow(2).sum() for g in grads)))
        total = grads if total is None else [a.add_(g) for a, g in zip(total, grads)]
    n = len(microbatches)
    big = float(sum((acc / n).pow(2).sum() for acc in total))
    b = int(next(iter(microbatches[0].values())).shape[0])
    return estimate_from_norms(sum(small) / n, b, big, n * b)


def measure_noise_scale(trainer: Trainer, microbatches: list,
                        weights: list[torch.Tensor] | None = None) -> float | None:
    """``B_simple = tr(Sigma) / |G|^2`` (sequences) of :func:`measure_gradient_stats`
    (same arguments and errors); ``None`` if the signal estimate is not positive."""
    g_sq, trace = measure_gradient_stats(trainer, microbatches, weights)
    return trace / g_sq if g_sq > 0 else None
