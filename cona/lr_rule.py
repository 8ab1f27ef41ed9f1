"""The learning rate across a change of global batch size.

Learning rate follows the global batch ``B`` from the reference batch ``B_ref``
(where ``base_lr`` was tuned): ``lr = base_lr * (B/B_ref)^k`` with ``k = 0.5``
(``sqrt``, Krizhevsky 2014 / Hoffer et al. 2017, matched to Adam by Malladi et
al. 2022), ``1`` (``linear``, Goyal et al. 2017) or ``0`` (``none``).  After a
switch that *raises* it, the LR ramps linearly to the new value over
``cona.lr_ramp_steps`` optimizer steps (:func:`ramp_lr`; Goyal et al. 2017,
Sec. 2.2, "gradual warmup": a jump to the scaled LR destabilises the first
steps, while the optimizer's moments still describe the smaller batch); a
lower LR applies at once.

Adam's other hyperparameters at another batch (:func:`scale_adam`, :func:`scale_beta`):
Malladi et al. 2022's square-root scaling rule scales them too, so that Adam's moments
keep their memory in *samples*; with fixed ``beta1``, ``beta2`` a larger batch averages
its moments over proportionally more samples (what that does to the samples a batch
needs is measured by ``bench/cona_adam_memory.py``).  CONA applies the rule to ``beta2``
where ``cona.adam_beta2_batch`` names the batch it was set for
(:meth:`cona.job.Job.adam_beta2_for`).
"""

from __future__ import annotations

import math

LR_EXPONENTS = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}


def scale_lr(base_lr: float, batch: float, reference_batch: float, rule: str) -> float:
    """``base_lr * (batch / reference_batch) ** k``, ``k`` from ``rule`` (sqrt/linear/none).

    Raises:
        ValueError: unknown rule or non-positive batch sizes.
    """
    if rule not in LR_EXPONENTS:
        raise ValueError(f"lr_scaling={rule!r} is not one of {sorted(LR_EXPONENTS)}")
    if batch <= 0 or reference_batch <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch}, {reference_batch}")
    return base_lr * (batch / reference_batch) ** LR_EXPONENTS[rule]


def scale_beta(beta: float, batch: float, anchor_batch: float) -> float:
    """One Adam ``beta`` at ``batch`` by the square-root scaling rule, from the value set
    for ``anchor_batch``: ``1 - beta -> kappa (1 - beta)``, ``kappa = batch /
    anchor_batch``.  The EMA then forgets over the same number of *samples*,
    ``anchor_batch / (1 - beta)`` (in the batches' unit, any: only their ratio counts).

    Source: Malladi, Lyu, Panigrahi, Arora 2022, "On the SDEs and Scaling Rules for
    Adaptive Gradient Algorithms" (NeurIPS), the square-root scaling rule for Adam.

    Raises:
        ValueError: non-positive batches, ``beta`` outside ``[0, 1)``, or a ``kappa`` so
            large that ``kappa (1 - beta) > 1`` (a negative beta: the rule holds only
            where the scaled beta stays in ``[0, 1)``; the message names the largest batch).
    """
    if batch <= 0 or anchor_batch <= 0:
        raise ValueError(f"batch sizes must be positive, got {batch}, {anchor_batch}")
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"Adam's betas must be in [0, 1), got {beta}")
    kappa = batch / anchor_batch
    if kappa * (1.0 - beta) > 1.0 + 1e-12:  # at the edge itself, rounding: clamped below
        raise ValueError(
            f"the square-root scaling rule gives beta {1.0 - kappa * (1.0 - beta):g} at "
            f"batch {batch} from {beta} at {anchor_batch}: a batch at most "
            f"{anchor_batch / (1 - beta):g} keeps it in [0, 1); anchor the rule at a larger batch")
    # at kappa = 1/(1 - beta) exactly, 1 - kappa (1 - beta) may round below 0
    return max(1.0 - kappa * (1.0 - beta), 0.0)


def scale_adam(betas: tuple[float, float], eps: float, batch: float,
               anchor_batch: float) -> tuple[tuple[float, float], float]:
    """Adam's ``(beta1, beta2), eps`` at ``batch`` by the square-root scaling rule, from
    the values set for ``anchor_batch``: each beta by :func:`scale_beta` and ``eps ->
    eps / sqrt(kappa)`` (the learning rate goes with ``sqrt(kappa)``, :func:`scale_lr`'s
    ``sqrt``).  Each moment's EMA then forgets over the same number of samples at every
    batch.  AdamW's decoupled weight decay is left as it is (the rule is stated for Adam).

    Source: Malladi et al. 2022 (:func:`scale_beta`; the SDE that both batches
    approximate is the same).

    Raises:
        ValueError: as :func:`scale_beta`, for either beta.
    """
    b1, b2 = (scale_beta(b, batch, anchor_batch) for b in betas)
    return (b1, b2), eps / math.sqrt(batch / anchor_batch)


def ramp_lr(old: float, new: float, steps: int, ramp_steps: int) -> float:
    """The learning rate ``steps`` optimizer steps after a switch moved the scaled LR
    from ``old`` to ``new``: linear from ``old`` to ``new`` over ``ramp_steps`` steps
    when ``new > old`` (step ``k`` trains at ``old + (new - old) k / ramp_steps``),
    ``new`` at once when it is lower or ``ramp_steps`` is 0.

    Source: Goyal et al. 2017, "Accurate, Large Minibatch SGD", Sec. 2.2 (gradual
    warmup from the small-batch LR to the scaled one); Smith et al. 2018 ("Don't
    decay the learning rate, increase the batch size") raise the batch mid-run
    with the LR scaled the same way.

    Raises:
        ValueError: ``steps`` or ``ramp_steps`` negative.
    """
    if steps < 0 or ramp_steps < 0:
        raise ValueError(f"steps and ramp_steps must be >= 0, got {steps}, {ramp_steps}")
    if new <= old or steps >= ramp_steps:
        return new
    return old + (new - old) * steps / ramp_steps
