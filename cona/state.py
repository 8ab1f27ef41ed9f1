"""A CONA job's trainer state: sample-based LR schedule, named optimizer state, snapshots.

CONA changes the global batch size during training, so the learning-rate
schedule counts *samples*, not optimizer steps (Megatron-LM's sample-based
schedule, ``--lr-warmup-samples`` / ``--lr-decay-samples``): warmup and decay
then end after the same amount of data whatever batch sizes were used.  The
peak LR follows the global batch by the controller's rule
(:func:`cona.lr_rule.scale_lr`), applied with :func:`set_peak_lr`.

:func:`optimizer_state_by_name` exposes the megatron optimizer's per-parameter
state (AdamW ``exp_avg``, ``exp_avg_sq``, ``step``; fp32 master weights under
bf16) keyed by the model's parameter names, which is what resharding
(:mod:`cona.switch`) and in-memory snapshots (:func:`snapshot` /
:func:`restore`, used by the oracle-chain baseline) need.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from jobruntime.config import JobConfig
from jobruntime.parallel import rng_state, set_rng_state
from jobruntime.trainer import Trainer

from .probe import probe_state
from .strategy import Strategy


class SampleScheduler(OptimizerParamScheduler):
    """Megatron's scheduler counting samples instead of steps.

    ``Trainer.train_step`` calls ``step(increment=1)`` once per optimizer step;
    this class turns that into ``+global_batch_size`` samples, so warmup and
    cosine decay (given in samples) are independent of the batch size.
    :attr:`global_batch_size` must follow the current strategy.

    The schedule's settings (peak and final LR, warmup, decay) are the run's own, a
    checkpoint's are not taken (megatron's ``override_opt_param_scheduler``, on by
    default here): a layout switch rebuilds the scheduler from the config
    (:func:`build_scheduler`), so a schedule read from a checkpoint would hold only until
    the next layout switch (a run resumed with a larger ``train.iters`` trained at the
    final LR, then jumped back up at its first layout switch).
    """

    def __init__(self, optimizer, *, global_batch_size: int, **kwargs):
        self.global_batch_size = global_batch_size
        kwargs.setdefault("override_opt_param_scheduler", True)
        kwargs.setdefault("use_checkpoint_opt_param_scheduler", False)  # megatron: not both
        super().__init__(optimizer, **kwargs)

    def step(self, increment: int) -> None:
        super().step(increment=increment * self.global_batch_size)

    def load_state_dict(self, state_dict: dict) -> None:
        """The position of a :class:`SampleScheduler`'s ``state_dict`` (samples), set, not
        added: it replaces whatever this scheduler was built at; the settings stay this
        run's (class docstring).  megatron's ``load_state_dict`` re-applies the position
        as ``self.step(increment=num_steps)``, which :meth:`step` would multiply by the
        global batch (a resumed run then stood ``global_batch_size`` times further into
        its warmup and decay).  A step-counted schedule (an ordinary run's) is not this
        class's: :func:`cona.job.load_start` sets its position from the samples."""
        batch, self.global_batch_size, self.num_steps = self.global_batch_size, 1, 0
        try:
            super().load_state_dict(state_dict)
        finally:
            self.global_batch_size = batch
        # megatron reads the peak and final LR per param group, and an optimizer loaded
        # before this (jobruntime.checkpoint) brought the checkpoint's: the run's again
        for group in self.optimizer.param_groups:
            group["max_lr"], group["min_lr"] = self.max_lr, self.min_lr
        self.step(0)


def build_scheduler(
    trainer: Trainer, cfg: JobConfig, reference_batch: int, num_samples: int = 0
) -> SampleScheduler:
    """A :class:`SampleScheduler` for ``trainer`` from ``cfg.train`` (steps x reference batch).

    ``cfg.train.lr`` / ``min_lr`` are the peak and final LR of this strategy
    (already scaled); ``num_samples`` restores the position in the schedule.
    """
    t = cfg.train
    warmup = t.warmup_iters * reference_batch
    decay = max((t.lr_decay_iters or t.iters) * reference_batch, warmup + 1)
    sched = SampleScheduler(
        trainer.optimizer,
        global_batch_size=cfg.parallel.global_batch_size,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style="cosine",
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )
    sched.num_steps = num_samples
    set_peak_lr(trainer, sched, t.lr, t.min_lr)
    return sched


def set_peak_lr(
    trainer: Trainer, scheduler: OptimizerParamScheduler, lr: float, min_lr: float
) -> None:
    """Set the schedule's peak and final LR (megatron keeps them per param group too)."""
    scheduler.max_lr, scheduler.min_lr = float(lr), float(min_lr)
    for group in trainer.optimizer.param_groups:
        group["max_lr"], group["min_lr"] = float(lr), float(min_lr)
    scheduler.step(0)  # recompute the current LR of every group


def build_trainer(
    cfg: JobConfig,
    reference_batch: int,
    *,
    model: torch.nn.Module | None = None,
    num_samples: int = 0,
) -> Trainer:
    """A :class:`Trainer` for ``cfg`` with a :class:`SampleScheduler` at ``num_samples``.

    Without ``model`` (a run's start layout) the trainer's launch memory check counts
    what CONA's noise-scale probe holds (:func:`cona.probe.probe_state`); a switch passes
    the resharded model and checks nothing here: the layouts it can reach passed CONA's
    candidate filter (:func:`cona.candidates.build_candidates`).

    Raises:
        ConfigError: (``model`` None) the layout does not fit the device
            (:func:`jobruntime.memory.check_job_fits`).
    """
    trainer = Trainer(cfg, model=model, extra_state=probe_state(cfg.cona.gns_definition))
    trainer.scheduler = build_scheduler(trainer, cfg, reference_batch, num_samples)
    return trainer


def strategy_config(
    cfg: JobConfig,
    strategy: Strategy,
    *,
    lr: float,
    min_lr: float,
    micro_batch_size: int | None = None,
) -> JobConfig:
    """A copy of ``cfg`` whose parallel section is ``strategy`` and whose LR is ``lr``.

    ``micro_batch_size`` overrides the strategy's (the emulated proxy runs
    its own micro-batch size in one process).
    """
    new = copy.deepcopy(cfg)
    p = new.parallel
    p.tp, p.pp = strategy.tp, strategy.pp
    p.micro_batch_size = micro_batch_size or strategy.micro_batch_size
    p.global_batch_size = strategy.global_batch_size
    new.train.lr, new.train.min_lr = lr, min_lr
    return new


# ---------------------------------------------------------------------------
# Optimizer state by parameter name
# ---------------------------------------------------------------------------


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


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in inner if getattr(o, "optimizer", None) is not None]


def optimizer_state_by_name(trainer: Trainer) -> dict[str, ParamState]:
    """Map every parameter name of ``trainer.module`` to its optimizer state.

    Raises:
        KeyError: a parameter is not in the optimizer (never expected).
    """
    owners = {}
    for opt in _torch_optimizers(trainer.optimizer):
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
             for opt in _torch_optimizers(trainer.optimizer) for g in opt.param_groups}
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
    for opt in _torch_optimizers(trainer.optimizer):
        for g in opt.param_groups:
            g["betas"] = (float(betas[0]), float(betas[1]))
    if rescale:
        rebias_adam_moments(trainer, before)


# ---------------------------------------------------------------------------
# Single-process snapshots (oracle chain branches)
# ---------------------------------------------------------------------------


def _clone(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


@torch.no_grad()
def snapshot(trainer: Trainer) -> dict:
    """Copy of model weights, optimizer state, schedule position, step, token count and RNG.

    Restoring it into the *same* trainer (same layout) with :func:`restore`
    continues bit-for-bit as if nothing happened in between.  Adam's step count is
    copied where the optimizer keeps it: per parameter (torch's AdamW) or per param group
    (Transformer Engine's ``FusedAdam``, megatron-core's Adam where TE is installed).

    Raises:
        ValueError, KeyError: as :func:`adam_hyperparameters` (an optimizer whose param
            groups disagree on Adam's betas, or not Adam).
    """
    states = optimizer_state_by_name(trainer)
    return {
        "params": {n: s.param.detach().clone() for n, s in states.items()},
        "main": {n: s.main.detach().clone() for n, s in states.items() if s.main is not s.param},
        "opt": {n: {k: _clone(v) for k, v in s.state.items()} for n, s in states.items()},
        "sched": (trainer.scheduler.num_steps, trainer.scheduler.max_lr, trainer.scheduler.min_lr),
        "step": trainer.step,
        "consumed_tokens": trainer.consumed_tokens,
        "rng": rng_state(),
        "adam": adam_hyperparameters(trainer),
        "group_step": [[_clone(g["step"]) if "step" in g else None for g in opt.param_groups]
                       for opt in _torch_optimizers(trainer.optimizer)],
    }


@torch.no_grad()
def restore(trainer: Trainer, snap: dict) -> None:
    """Load a :func:`snapshot` back in place (parameter objects are kept), Adam's betas
    included (``snap["adam"]``, with the moments built under them), and Adam's step count
    where the optimizer keeps it: the trainer then continues bit for bit as the snapshot's
    would.  To go on under other betas, call :func:`set_adam_betas` after it (the warm
    start does).

    Raises:
        ValueError, KeyError: as :func:`adam_hyperparameters`, where the snapshot holds
            Adam's betas.
    """
    states = optimizer_state_by_name(trainer)
    for n, s in states.items():
        s.param.copy_(snap["params"][n])
        if n in snap["main"]:
            s.main.copy_(snap["main"][n])
        s.holder.state[s.main] = {k: _clone(v) for k, v in snap["opt"][n].items()}
    saved = snap.get("group_step")  # None: a warm state cached before group steps were kept
    for opt, steps in zip(_torch_optimizers(trainer.optimizer), saved or [], strict=bool(saved)):
        for group, step in zip(opt.param_groups, steps, strict=True):
            if step is None:
                group.pop("step", None)
            else:
                group["step"] = _clone(step)
    if snap.get("adam") is not None:  # the betas its moments were built under
        set_adam_betas(trainer, snap["adam"][:2], rescale=False)
    num, max_lr, min_lr = snap["sched"]
    trainer.scheduler.num_steps = num
    set_peak_lr(trainer, trainer.scheduler, max_lr, min_lr)
    trainer.step, trainer.consumed_tokens = snap["step"], snap["consumed_tokens"]
    set_rng_state(snap["rng"])
