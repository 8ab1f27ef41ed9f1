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
"""

from __future__ import annotations

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
