"""Adam's state and hyperparameters by parameter name, inside megatron-core's optimizer.

megatron-core wraps torch optimizers (``ChainedOptimizer`` of ``FP32Optimizer`` or
``Float16OptimizerWithFloat16Params``, fp32 master copies under bf16); a resume, a
layout switch and a snapshot need each parameter's Adam state (``exp_avg``,
``exp_avg_sq``, ``step``) by the model's parameter names, and a change of Adam's betas
must keep the moments' bias-corrected values (Kingma & Ba 2015, Alg. 1).  Used by
:mod:`jobruntime.trainer` (a resume's optimizer settings) and by CONA
(:mod:`cona.state`, :mod:`cona.switch`: ``beta2`` following the global batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .trainer import Trainer


@dataclass
class ParamState:
    """One model parameter with its optimizer view.

    Attributes:
        param: the model parameter (bf16 or fp32).
        main: the parameter the optimizer updates (fp32 master copy under
            bf16, else ``param`` itself).
        state: the torch optimizer's state dict of ``main`` (``exp_avg``,
            ``exp_avg_sq``, ``step``); empty before the first step.
        holder: the torch optimizer owning ``main``.
        group: ``holder``'s param group holding ``main`` (its ``betas``, ``eps``, and
            Transformer Engine's ``FusedAdam``'s ``step``).
    """

    param: torch.nn.Parameter
    main: torch.Tensor
    state: dict
    holder: torch.optim.Optimizer
    group: dict

    @property
    def step(self) -> float:
        """Adam's step count ``t`` for ``main``: torch's per-parameter ``state["step"]``, or
        the param group's ``"step"`` where the optimizer keeps it there (Transformer
        Engine's ``FusedAdam``, which megatron-core uses where TE is installed); 0 before
        the first step."""
        return float(self.state.get("step", self.group.get("step", 0)))


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron-core's optimizer wrapper (a
    ``ChainedOptimizer``'s each, or the one of a ``FP32Optimizer`` /
    ``Float16OptimizerWithFloat16Params``): they hold the param groups and the state."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in inner if getattr(o, "optimizer", None) is not None]


def optimizer_state_by_name(trainer: Trainer) -> dict[str, ParamState]:
    """Map every parameter name of ``trainer.module`` to its optimizer state.

    Raises:
        KeyError: a parameter is not in the optimizer (never expected).
    """
    owners = {}
    for opt in torch_optimizers(trainer.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                owners[id(p)] = (opt, group)
    out = {}
    for name, p in trainer.module.named_parameters():
        main = getattr(p, "main_param", p)
        if id(main) not in owners:
            raise KeyError(f"parameter {name} is not held by the optimizer")
        opt, group = owners[id(main)]
        out[name] = ParamState(p, main, opt.state[main], opt, group)
    return out


def adam_hyperparameters(trainer: Trainer) -> tuple[float, float, float]:
    """``(beta1, beta2, eps)`` of ``trainer``'s Adam (the same in every param group).

    Raises:
        ValueError: the param groups disagree (a per-group betas rule is not modelled),
            or there are none.
        KeyError: an optimizer without ``betas`` (not Adam).
    """
    found = {(float(g["betas"][0]), float(g["betas"][1]), float(g["eps"]))
             for opt in torch_optimizers(trainer.optimizer) for g in opt.param_groups}
    if len(found) != 1:
        raise ValueError(f"Adam's betas and eps differ between param groups: {sorted(found)}"
                         if found else "the optimizer has no param groups")
    return found.pop()


@torch.no_grad()
def rebias_adam_moments(trainer: Trainer, built_with: tuple[float, float, float]) -> None:
    """Rescale every parameter's Adam moments, accumulated under ``built_with``'s betas,
    so that their bias-corrected values are unchanged under ``trainer``'s betas.

    Adam divides its moments by ``1 - beta^t`` (``t``: the parameter's step count;
    Kingma & Ba 2015, Alg. 1).  Moments restored into an optimizer with other betas
    would be divided by the other betas' correction: after a 20-step warm state, a
    ``beta1`` of 0.975 instead of 0.9 makes the first step 2.1x too large.  So
    ``exp_avg *= (1 - b1_new^t) / (1 - b1_old^t)`` and ``exp_avg_sq`` likewise with
    ``beta2``.  ``eps`` needs nothing.  A no-op where the betas agree.

    Raises:
        ValueError, KeyError: as :func:`adam_hyperparameters`.
    """
    b1, b2, _ = adam_hyperparameters(trainer)
    o1, o2 = built_with[0], built_with[1]
    if (b1, b2) == (o1, o2):
        return
    for s in optimizer_state_by_name(trainer).values():
        t = s.step
        if t <= 0:
            continue
        if "exp_avg" in s.state:
            s.state["exp_avg"].mul_((1 - b1**t) / (1 - o1**t))
        if "exp_avg_sq" in s.state:
            s.state["exp_avg_sq"].mul_((1 - b2**t) / (1 - o2**t))


def set_adam_betas(trainer: Trainer, betas: tuple[float, float], *,
                   rescale: bool = True) -> None:
    """Run ``trainer``'s Adam at ``betas = (beta1, beta2)`` from its next step.

    ``rescale``: the moments were built under the current betas and are rescaled so that
    their bias-corrected values are unchanged (:func:`rebias_adam_moments`): the
    estimates carry over, only how fast they forget changes (``beta2`` following the
    global batch, ``cona.adam_beta2_batch``; a warm state's moments in a trainer
    configured with other betas).  ``False``: the moments already belong to ``betas``
    (a :func:`snapshot` restored).  A no-op at the current betas.

    Raises:
        ValueError: a beta outside ``[0, 1)``; as :func:`adam_hyperparameters`.
        KeyError: as :func:`adam_hyperparameters`.
    """
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Adam's betas must be in [0, 1), got {tuple(betas)}")
    before = adam_hyperparameters(trainer)
    if before[:2] == tuple(float(b) for b in betas):
        return
    for opt in torch_optimizers(trainer.optimizer):
        for g in opt.param_groups:
            g["betas"] = (float(betas[0]), float(betas[1]))
    if rescale:
        rebias_adam_moments(trainer, before)
