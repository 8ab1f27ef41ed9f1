"""A CONA job's trainer state: sample-based LR schedule, named optimizer state, snapshots.

CONA changes the global batch size during training, so the learning-rate
schedule counts *samples*, not optimizer steps (Megatron-LM's sample-based
schedule, ``--lr-warmup-samples`` / ``--lr-decay-samples``): warmup and decay
then end after the same amount of data whatever batch sizes were used.  The
peak LR follows the global batch by the controller's rule
(:func:`cona.lr_rule.scale_lr`), applied with :func:`set_peak_lr`.

:func:`jobruntime.optimizer_state.optimizer_state_by_name` (re-exported here with
Adam's betas helpers) exposes the megatron optimizer's per-parameter state keyed by
the model's parameter names, which is what resharding (:mod:`cona.switch`) and
in-memory snapshots (:func:`snapshot` / :func:`restore`, used by the oracle-chain
baseline) need.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from jobruntime.config import JobConfig
from jobruntime.optimizer_state import ParamState as ParamState
from jobruntime.optimizer_state import adam_hyperparameters as adam_hyperparameters
from jobruntime.optimizer_state import optimizer_state_by_name as optimizer_state_by_name
from jobruntime.optimizer_state import rebias_adam_moments as rebias_adam_moments
from jobruntime.optimizer_state import set_adam_betas as set_adam_betas
from jobruntime.optimizer_state import torch_optimizers
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
                       for opt in torch_optimizers(trainer.optimizer)],
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
    for opt, steps in zip(torch_optimizers(trainer.optimizer), saved or [], strict=bool(saved)):
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
