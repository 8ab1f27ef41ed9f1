"""One training job's state and step: model chunks in megatron DDP, the
megatron optimizer (AdamW), the LR schedule, and the forward/backward schedule.

:class:`Trainer` is what GeoMesh workers and CONA layouts hold: build it for
the current ``parallel_state`` layout, call :meth:`Trainer.train_step` with
this rank's micro-batches, :meth:`Trainer.evaluate` for validation loss.

Wraps, in megatron's own order (``megatron.training.get_model``): the model
chunk (built on the compute device), ``megatron.core.transformer.module.Float16Module``
for bf16/fp16 (casts first-stage inputs to the model dtype and last-stage
outputs to fp32, exactly as on GPU — also on CPU),
``megatron.core.distributed.DistributedDataParallel``,
``megatron.core.optimizer.get_megatron_optimizer`` (torch's fused AdamW
kernel, and ``torch._foreach_*`` gradient norm and clipping
(:func:`jobruntime.kernels.install_multi_tensor_ops`), where neither apex nor
Transformer Engine provides one),
``megatron.core.optimizer_param_scheduler.OptimizerParamScheduler`` and
``megatron.core.pipeline_parallel.get_forward_backward_func`` (no pipelining
or 1F1B, chosen by the PP size).

The objective (each family's forward and megatron-core's per-token loss) is
:mod:`jobruntime.objective`.
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module

from . import cpu_compat
from .config import JobConfig, TrainConfig
from .devices import check_module_devices
from .kernels import install_multi_tensor_ops
from .logging_utils import phase
from .memory import ExtraState, check_job_fits
from .model import build_model
from .objective import forward_fn, token_sum_loss
from .optimizer_state import set_adam_betas, torch_optimizers

log = logging.getLogger("jobruntime")


@dataclass
class StepResult:
    """Outcome of one optimizer step (identical on every rank).

    Attributes:
        loss: mean training loss over the loss tokens of the global batch (nats
            per token; token-weighted, not a mean of micro-batch means).
        grad_norm: global L2 norm of the gradient before clipping.
        lr: learning rate used for this step.
        tokens: tokens in the global batch (``samples x seq_length``, padding
            included), counted from the micro-batches trained.
        samples: sequences in the global batch.
        loss_tokens: tokens the loss is averaged over (``loss_mask`` ones).
    """

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    samples: int = 0
    loss_tokens: int = 0


def mean_loss(results: list[StepResult]) -> float:
    """Loss per loss token over several steps (each weighted by its ``loss_tokens``,
    so steps of different batch sizes or mask counts count per token); ``nan`` for
    no steps."""
    tokens = sum(r.loss_tokens for r in results)
    if tokens <= 0:
        return sum(r.loss for r in results) / len(results) if results else math.nan
    return sum(r.loss * r.loss_tokens for r in results) / tokens


def resolve_dtype(precision: str) -> torch.dtype:
    """``auto`` → bf16 on CUDA, fp32 on CPU."""
    if precision == "bf16" or (precision == "auto" and torch.cuda.is_available()):
        return torch.bfloat16
    return torch.float32


def _use_fused_adamw(optimizer) -> None:
    """Switch megatron's torch ``AdamW`` fallback to torch's fused kernel.

    Without apex or Transformer Engine, ``get_megatron_optimizer`` builds
    ``torch.optim.AdamW`` with its defaults (the multi-tensor ``foreach``
    path); ``fused=True`` runs one kernel per parameter group on CUDA and on
    CPU (torch >= 2.4).  Same update rule; apex/TE optimizers are left alone.
    """
    inner = getattr(optimizer, "optimizer", None)
    if type(inner) is not torch.optim.AdamW:
        return
    for group in inner.param_groups:
        group["fused"], group["foreach"] = True, False
    inner.defaults.update(fused=True, foreach=False)


def call_bounds(n: int, calls: int) -> list[int]:
    """Where ``n`` micro-batches split into ``calls`` consecutive schedule calls
    (:meth:`Trainer.train_step`'s ``schedule_calls``): ``calls + 1`` indices, group sizes
    as ``numpy.array_split``'s (the first ``n % calls`` one larger)."""
    bounds = [0]
    for i in range(calls):
        bounds.append(bounds[-1] + n // calls + (i < n % calls))
    return bounds


def _finalize_with(finalize, earlier: list, model, num_tokens=None, *args, **kwargs):
    """``finalize`` (megatron's ``finalize_model_grads`` signature) after the last of a
    step's schedule calls, with the loss-token count of all of them."""
    if num_tokens is not None:
        num_tokens = num_tokens + sum(earlier)
    return finalize(model, num_tokens, *args, **kwargs)


def _host_count(mask: torch.Tensor) -> int:
    """Number of ones in a micro-batch's mask, read from host memory where the batch
    still sits there (NumPy: no device sync, no torch op); a device tensor is synced."""
    return int(mask.numpy().sum()) if mask.device.type == "cpu" else int(mask.sum())


def lr_scheduler(optimizer, t: TrainConfig) -> OptimizerParamScheduler:
    """megatron's ``OptimizerParamScheduler`` for ``t``: linear warmup from 0 over
    ``t.warmup_iters`` steps, cosine decay to ``t.min_lr`` at ``t.lr_decay_iters``
    (default ``t.iters``), constant weight decay.  Step ``s`` (0-based) trains at
    ``get_lr`` with ``num_steps = s``, so the first step's lr is 0 when warming up
    (megatron's convention).  ``optimizer`` may be any object with a
    ``param_groups`` list (an empty one to evaluate the schedule alone)."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_iters,
        # megatron needs warmup < decay; short runs simply stay in warmup
        lr_decay_steps=max(t.lr_decay_iters or t.iters, t.warmup_iters + 1),
        lr_decay_style="cosine",
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.iters,
        wd_incr_style="constant",
    )


def schedule_in_steps(scheduler: OptimizerParamScheduler, global_batch_size: int) -> None:
    """Count a loaded schedule that counted samples (a CONA run's,
    :class:`cona.state.SampleScheduler`: its position, warmup and decay in samples) in
    steps of ``global_batch_size`` samples, as :func:`lr_scheduler` counts them: an
    ordinary run that resumes a CONA checkpoint trained on a schedule stretched by its
    batch (one step moved it one sample), and ``config.yaml`` recorded samples as steps.

    Args:
        scheduler: megatron's scheduler, after ``load_state_dict`` of the CONA state.
        global_batch_size: the resuming run's (``parallel.global_batch_size``; CONA's
            reference batch is its launch batch, so the same one gives the same steps).
    """
    g = global_batch_size
    scheduler.lr_warmup_steps = round(scheduler.lr_warmup_steps / g)
    scheduler.lr_decay_steps = max(round(scheduler.lr_decay_steps / g),
                                   scheduler.lr_warmup_steps + 1)
    scheduler.wd_incr_steps = max(round(scheduler.wd_incr_steps / g), 1)
    scheduler.num_steps = scheduler.num_steps // g
    scheduler.step(0)


_SCHEDULE = (("max_lr", "train.lr"), ("min_lr", "train.min_lr"),
             ("lr_warmup_steps", "train.warmup_iters"),
             ("lr_decay_steps", "train.lr_decay_iters (default train.iters)"))
_LENGTHS = ("lr_warmup_steps", "lr_decay_steps")


def optimizer_settings(scheduler: OptimizerParamScheduler, *, lr: bool = True,
                       lengths: bool = True) -> dict[str, float]:
    """The optimizer settings a resume can carry over: config key -> value.

    With ``lr``, the schedule's peak and floor (``train.lr``, ``train.min_lr``) and the
    weight decay, and with ``lengths`` its warmup and decay (steps), are megatron's
    ``OptimizerParamScheduler``'s; Adam's ``betas`` and ``eps`` are read from the first
    param group that holds them (all groups share them).  ``scheduler.optimizer`` may
    have no param groups (a schedule alone, as :func:`lr_scheduler` builds one to
    compare with): then Adam's are not in the dict.
    """
    out = {name: getattr(scheduler, attr) for attr, name in _SCHEDULE
           if (lengths if attr in _LENGTHS else lr)}
    if lr:
        out["train.weight_decay"] = scheduler.start_wd
    group = next((g for g in scheduler.optimizer.param_groups if "betas" in g), None)
    if group is not None:
        out["train.adam_beta1"], out["train.adam_beta2"] = (float(b) for b in group["betas"])
        out["train.adam_eps"] = group["eps"]
    return out


def reconcile_optimizer_settings(trainer: Trainer, t: TrainConfig, how: str, source: str, *,
                                 lr: bool = True, lengths: bool = True,
                                 can_keep: bool = True) -> None:
    """A resumed run's optimizer settings against those its config asks for.

    Loading a checkpoint brings the saved settings with the state: megatron-core's
    ``OptimizerParamScheduler.load_state_dict`` takes the saved peak, floor, warmup,
    decay and weight decay (``use_checkpoint_opt_param_scheduler``) and
    ``torch.optim.Optimizer.load_state_dict`` the saved param groups (Adam's ``betas``
    and ``eps``), so a resume with another ``train.lr``, ``train.iters``,
    ``train.weight_decay`` or ``train.adam_beta2`` trained on the old value while its
    ``config.yaml`` recorded the new one.  ``how`` (``checkpoint.optimizer_settings``):
    ``same`` refuses a difference; ``config`` sets the config's (the LR of the next step
    is the new schedule's at the resumed step; Adam's moments are rescaled to keep their
    bias-corrected values under the new betas,
    :func:`jobruntime.optimizer_state.set_adam_betas`); ``checkpoint`` keeps the checkpoint's and
    writes them into ``t`` (what ``config.yaml`` then records).  ``lengths=False``
    leaves the warmup and decay lengths out (GeoMesh sizes each worker's schedule
    itself); ``lr=False`` the peak, floor and weight decay too (CONA scales the LR with
    its global batch and rebuilds the schedule from the config).

    Args:
        trainer: the trainer (its optimizer and scheduler), after the checkpoint's load
            (:func:`jobruntime.checkpoint.load_checkpoint`).
        t: the run's train config (written to with ``how="checkpoint"``).
        how: ``same``, ``config`` or ``checkpoint``.
        source: the checkpoint's path, for the messages.
        can_keep: the job accepts ``how="checkpoint"`` (GeoMesh does not: the refusal
            then offers ``config`` only).

    Raises:
        CheckpointError: ``how == "same"`` and they differ (each field, both values, the fix).
    """
    from .checkpoint import CheckpointError

    scheduler = trainer.scheduler
    fresh_sched = lr_scheduler(types.SimpleNamespace(param_groups=[]), t)
    want = {**optimizer_settings(fresh_sched, lr=lr, lengths=lengths),
            "train.adam_beta1": t.adam_beta1, "train.adam_beta2": t.adam_beta2,
            "train.adam_eps": t.adam_eps}
    have = optimizer_settings(scheduler, lr=lr, lengths=lengths)
    diff = {k: (have[k], want[k]) for k in have if have[k] != want[k]}
    if not diff:
        return
    # every digit (repr: the shortest that reads back the same): the values compare exactly
    told = "; ".join(f"{k}: checkpoint {old!r}, config {new!r}" for k, (old, new) in diff.items())
    if how == "same":
        longer = (f" (a longer run: train.lr_decay_iters={scheduler.lr_decay_steps} keeps "
                  "its decay)" if _SCHEDULE[3][1] in diff else "")
        keep = " (=checkpoint keeps the checkpoint's)" if can_keep else ""
        raise CheckpointError(
            f"{source} was trained with other optimizer settings ({told}); resume with the "
            f"checkpoint's values{longer}, or set checkpoint.optimizer_settings=config to "
            f"train on with this config's{keep}")
    if how == "config":
        for group in scheduler.optimizer.param_groups:  # megatron's groups carry their own
            for key in ("max_lr", "min_lr") if lr else ():  # (the checkpoint's), lr_mult
                old, cur = getattr(scheduler, key), group.get(key)
                if cur is not None:
                    group[key] = getattr(fresh_sched, key) * (cur / old if old else 1.0)
        for attr, _ in _SCHEDULE:
            if lengths if attr in _LENGTHS else lr:
                setattr(scheduler, attr, getattr(fresh_sched, attr))
        if lr:
            scheduler.start_wd = scheduler.end_wd = t.weight_decay
        if "train.adam_beta1" in have:
            set_adam_betas(trainer, (t.adam_beta1, t.adam_beta2))
            for opt in torch_optimizers(trainer.optimizer):
                for group in opt.param_groups:
                    group["eps"] = t.adam_eps
        scheduler.step(0)  # the param groups' lr and weight decay at the resumed step
        log.warning("training on with this config's optimizer settings, not those of %s: %s",
                    source, told)
        return
    if lr:
        t.lr, t.min_lr, t.weight_decay = scheduler.max_lr, scheduler.min_lr, scheduler.start_wd
    if lengths:
        t.warmup_iters, t.lr_decay_iters = scheduler.lr_warmup_steps, scheduler.lr_decay_steps
    if "train.adam_beta1" in have:
        t.adam_beta1, t.adam_beta2 = have["train.adam_beta1"], have["train.adam_beta2"]
        t.adam_eps = have["train.adam_eps"]
    log.info("training on with the optimizer settings of %s (config.yaml records them): %s",
             source, told)


class Trainer:
    """Model, optimizer and LR schedule of one job on the current layout.

    Args:
        cfg: the job config (model, parallel, train sections are read).
        model: wrap this model chunk instead of building a fresh one.
        dp_group: data-parallel group of this job's gradient sum, loss-token
            count and loss; ``None`` = megatron's DP group.  GeoMesh passes the
            group of one worker's replicas, so that workers sharing one
            ``parallel_state`` world do not all-reduce each other's gradients
            or count each other's tokens.
        extra_state: state the caller keeps on the device beside the trainer's
            (:class:`jobruntime.memory.ExtraState`), counted by the launch memory check.

    Raises:
        ConfigError: via the config's validation, or (``model`` None) the launch memory
            check refuses the layout (:func:`jobruntime.memory.check_job_fits`).
        ValueError: ``model``'s config lacks ``calculate_per_token_loss``.
    """

    def __init__(self, cfg: JobConfig, model: torch.nn.Module | None = None, *,
                 dp_group: dist.ProcessGroup | None = None,
                 extra_state: ExtraState | None = None):
        self.cfg = cfg
        self.dtype = resolve_dtype(cfg.train.precision)
        self.device = cpu_compat.device()
        if model is None:  # refuse what cannot fit before allocating it
            dp = (dist.get_world_size(dp_group) if dp_group is not None
                  else parallel_state.get_data_parallel_world_size())
            check_job_fits(cfg, dp=dp, device=self.device, dtype_name=str(self.dtype).split(".")[-1],
                           extra=extra_state)
        if model is None:
            m = cfg.model
            with phase(log, "building the %s model (%d layers, hidden %d, %s)", m.family,
                       m.num_layers, m.hidden_size, str(self.dtype).split(".")[-1]) as done:
                model = build_model(cfg.model, cfg.parallel, params_dtype=self.dtype)
                done["result"] = f"{sum(p.numel() for p in model.parameters()):,} parameters on this rank"
        module = model
        # build_model builds on the compute device; a model passed in may sit elsewhere
        self.module = module.to(self.device)
        """The unwrapped megatron model chunk (``GPTModel`` / ``BertModel``)."""
        check_module_devices(self.module, self.device, "model")
        self.tcfg = module.config
        chunk = Float16Module(self.tcfg, module) if self.tcfg.bf16 or self.tcfg.fp16 else module
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        if not self.tcfg.calculate_per_token_loss:  # DDP reads it when built: before the wrap
            raise ValueError("Trainer needs a model built with calculate_per_token_loss=True "
                             "(jobruntime.model.to_transformer_config sets it)")
        self.dp_group = dp_group
        pgs = None
        if dp_group is not None:
            pgs = ProcessGroupCollection(
                tp=parallel_state.get_tensor_model_parallel_group(),
                pp=parallel_state.get_pipeline_model_parallel_group(),
                ep=parallel_state.get_expert_model_parallel_group(),
                dp=dp_group, dp_cp=dp_group, expt_dp=dp_group,
            )
        self.model = [DistributedDataParallel(config=self.tcfg, ddp_config=ddp_cfg, module=chunk,
                                              pg_collection=pgs)]
        self.grad_dp_group = dp_group or parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        """The DP group whose gradients are summed and whose loss tokens are counted
        (``dp_group``, or megatron's)."""
        # The schedule's groups, as megatron builds them when given none, but with
        # this job's DP group: finalize_model_grads all-reduces the loss-token count
        # over pg_collection.dp_cp (megatron's DP group by default, which spans
        # several GeoMesh workers).
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        self._schedule_pgs = ProcessGroupCollection(
            tp=parallel_state.get_tensor_model_parallel_group(),
            cp=parallel_state.get_context_parallel_group(),
            pp=pp_group,
            embd=parallel_state.get_embedding_group(check_initialized=False),
            pos_embd=parallel_state.get_position_embedding_group(check_initialized=False),
            dp_cp=self.grad_dp_group,
        )
        self._p2p = (P2PCommunicator(pp_group=pp_group, config=self.tcfg)
                     if dist.get_world_size(pp_group) > 1 else None)
        t = cfg.train
        # clip_grad=0 disables clipping; an infinite threshold keeps megatron
        # computing (and returning) the gradient norm without ever clipping.
        clip = t.clip_grad if t.clip_grad > 0 else math.inf
        opt_cfg = OptimizerConfig(
            optimizer="adam",
            lr=t.lr,
            min_lr=t.min_lr,
            weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1,
            adam_beta2=t.adam_beta2,
            adam_eps=t.adam_eps,
            clip_grad=clip,
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            use_distributed_optimizer=False,
        )
        install_multi_tensor_ops()  # no per-parameter host sync in the grad norm (no apex/TE)
        self.optimizer = get_megatron_optimizer(opt_cfg, self.model)
        _use_fused_adamw(self.optimizer)
        self.scheduler = lr_scheduler(self.optimizer, t)
        self.tcfg.finalize_model_grads_func = finalize_model_grads
        self.tcfg.no_sync_func = self.model[0].no_sync
        self.tcfg.grad_scale_func = self.optimizer.scale_loss
        self._forward = forward_fn(cfg.model.family)
        self.step = 0
        self.consumed_tokens = 0
        """Tokens of every global batch trained so far (sequences x their length, padding
        included), accumulated by :meth:`train_step` from the batches themselves, so it
        stays right when the global batch or the sequence length changes (CONA switches,
        a resume at another batch); checkpointed with :attr:`step`."""
        self.lr_scale = 1.0
        """Multiplies the scheduled learning rate of the next steps (GeoMesh scales a
        worker's LR with its batch size); the schedule itself is unchanged."""
        self.microbatch_hook: Callable[[int, int], None] | None = None
        """Called with the micro-batch index and its loss-token count before each forward
        (after the previous backward) of a schedule with backward passes; evaluations
        (forward only) do not call it."""
        self.schedule_call_hook: Callable[[], None] | None = None
        """Called between the schedule calls of a step run as several
        (:meth:`train_step`'s ``schedule_calls``): after one call's last backward,
        before the next call's first forward, the gradients not yet finalised."""
        self._backward = False  # the running schedule has backward passes

    # -- schedule ---------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        index, batch = next(data_iterator)
        pad = batch.get("padding_mask")
        unpadded = pad is not None and pad.device.type == "cpu" and bool(pad.all())  # no GPU sync
        if self.microbatch_hook is not None and self._backward:
            self.microbatch_hook(index, _host_count(batch["loss_mask"]))
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        batch["unpadded"] = unpadded
        output = self._forward(batch, model)
        return output, partial(token_sum_loss, batch["loss_mask"])

    def _run_schedule(self, microbatches: list[dict], forward_only: bool,
                      calls: int = 1) -> list[dict]:
        """megatron's schedule over ``microbatches``; with ``calls > 1`` over ``calls``
        consecutive groups of them (sizes as ``numpy.array_split``'s: the first
        ``len % calls`` one larger), one schedule call each: the gradients accumulate in
        the buffers, and ``finalize_model_grads`` runs once, after the last call, with
        the loss-token count of all of them (the same step as one call: the loss is a
        sum over tokens).  Within a call the micro-batches must be of one size."""
        self._backward = not forward_only
        n = len(microbatches)
        if not 1 <= calls <= n:
            raise ValueError(f"{n} micro-batches cannot run as {calls} schedule calls "
                             f"(1 to {n})")
        bounds = call_bounds(n, calls)
        finalize = self.tcfg.finalize_model_grads_func
        earlier: list = []  # the loss-token counts of the calls before the last
        losses: list[dict] = []
        try:
            for i in range(calls):
                if calls > 1:
                    self.tcfg.finalize_model_grads_func = (
                        partial(_finalize_with, finalize, earlier) if i == calls - 1
                        else partial(self._between_calls, earlier))
                chunk = microbatches[bounds[i]:bounds[i + 1]]
                losses += get_forward_backward_func()(
                    forward_step_func=self._forward_step,
                    data_iterator=iter(enumerate(chunk, start=bounds[i])),
                    model=self.model,
                    num_microbatches=len(chunk),
                    seq_length=self.cfg.model.seq_length,
                    micro_batch_size=int(chunk[0]["loss_mask"].shape[0]),
                    forward_only=forward_only,
                    pg_collection=self._schedule_pgs,
                    p2p_communicator=self._p2p,
                )
        finally:
            self.tcfg.finalize_model_grads_func = finalize
        return losses

    def _between_calls(self, earlier: list, model, num_tokens=None, *args, **kwargs) -> None:
        """Stands in for ``finalize_model_grads`` after a schedule call that is not the
        step's last: keeps its loss-token count, finalises nothing."""
        earlier.append(num_tokens)
        if self.schedule_call_hook is not None:
            self.schedule_call_hook()

    def _loss_sums(self, losses: list[dict]) -> torch.Tensor:
        """``[loss_sum, loss_tokens]`` (float64) of this rank's micro-batches; zeros
        off the last pipeline stage."""
        value = torch.zeros(2, dtype=torch.float64, device=self.device)
        if parallel_state.is_pipeline_last_stage() and losses:
            value += torch.stack([d["lm loss"] for d in losses]).sum(dim=0)
        return value

    def _token_mean(self, local: torch.Tensor) -> tuple[float, int]:
        """``(loss per token, loss tokens)`` over the DP group from :meth:`_loss_sums`:
        summed over DP on the last stage, then sent to the other stages."""
        value = local.clone()
        if parallel_state.is_pipeline_last_stage():
            dist.all_reduce(value, group=self.grad_dp_group)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            last = parallel_state.get_pipeline_model_parallel_last_rank()
            dist.broadcast(value, src=last, group=parallel_state.get_pipeline_model_parallel_group())
        total, tokens = float(value[0]), int(value[1])
        return total / max(tokens, 1), tokens

    # -- public -----------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero megatron's gradient buffers (``main_grad``) and drop ``param.grad``; models
        in train mode.  Needed before the first backward after an optimizer step:
        megatron's fp32 optimizer leaves ``param.grad`` aliasing ``main_grad``, and the
        DDP hook (``main_grad += param.grad``) then counts that backward's gradient twice."""
        for m in self.model:
            m.train()
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def train_step(self, microbatches: list[dict], schedule_calls: int = 1) -> StepResult:
        """One optimizer step on this rank's micro-batches of a global batch.

        Args:
            microbatches: ``global_batch / (dp * micro_batch)`` dicts of
                ``[micro_batch, seq]`` tensors from :class:`GlobalBatchSampler`.
            schedule_calls: run them as this many consecutive groups (sizes
                differing by at most one), one schedule call each, the gradients
                finalised once after the last (the same step; :attr:`schedule_call_hook`
                runs between calls: CONA's noise-scale probe reads the gradient there at
                DP = 1 with PP > 1, :mod:`cona.probe`).  Each extra call costs a
                pipeline fill and drain.

        Raises:
            ValueError: ``schedule_calls`` is not between 1 and the number of
                micro-batches.
        """
        self.zero_grad()
        losses = self._run_schedule(microbatches, forward_only=False, calls=schedule_calls)
        samples = sum(int(mb["loss_mask"].shape[0]) for mb in microbatches)
        samples *= dist.get_world_size(self.grad_dp_group)
        if self.lr_scale != 1.0:  # the scheduler resets every group's lr after each step
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * self.lr_scale
        _, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step(increment=1)
        self.step += 1
        tokens = samples * int(microbatches[0]["loss_mask"].shape[1])
        self.consumed_tokens += tokens
        loss, loss_tokens = self._token_mean(self._loss_sums(losses))
        return StepResult(
            loss=loss,
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=lr,
            tokens=tokens,
            samples=samples,
            loss_tokens=loss_tokens,
        )

    @torch.no_grad()
    def evaluate(self, batches: list[list[dict]]) -> float:
        """Validation loss per token (nats) over all loss tokens of ``batches`` (each one
        global batch's micro-batches): one token-weighted mean, not a mean of batch means."""
        for m in self.model:
            m.eval()
        local = torch.zeros(2, dtype=torch.float64, device=self.device)
        for microbatches in batches:
            local += self._loss_sums(self._run_schedule(microbatches, forward_only=True))
        for m in self.model:
            m.train()
        return self._token_mean(local)[0]

    def set_batch_size(self, global_batch_size: int, micro_batch_size: int) -> None:
        """Change the batch of later steps (sequences per step over this job's DP
        group, and per micro-batch); optimizer and LR schedule are kept."""
        self.cfg.parallel.global_batch_size = global_batch_size
        self.cfg.parallel.micro_batch_size = micro_batch_size

    def _main_params(self) -> dict[int, torch.Tensor]:
        """id(model param) -> fp32 main copy kept by a mixed-precision optimizer.

        megatron's ``Float16OptimizerWithFloat16Params`` sets ``param.main_param``
        (it sits inside a ``ChainedOptimizer``, so its own groups are not at
        hand here); fp32 training has no main copies.
        """
        return {id(p): p.main_param for p in self.module.parameters()
                if getattr(p, "main_param", None) is not None}

    @torch.no_grad()
    def get_params(self) -> dict[str, torch.Tensor]:
        """fp32 copies of this rank's parameters (its TP/PP shard), by name.

        With bf16 training the optimizer's fp32 main parameters are returned,
        so no precision is lost.
        """
        main = self._main_params()
        return {name: main.get(id(p), p).detach().float().clone()
                for name, p in self.module.named_parameters()}

    @torch.no_grad()
    def load_weights(self, state_dict: dict) -> None:
        """Load model weights without optimizer state, keeping the optimizer in step.

        Every write of weights that bypasses the optimizer must come through here
        (or :meth:`set_params`): a mixed-precision optimizer keeps fp32 main copies
        of the bf16/fp16 parameters, steps those and copies them back, so weights
        written only into the model would be replaced by the old main copies (the
        fresh initialisation, for a fine-tune from a converted checkpoint) at the
        first optimizer step.  As megatron-core's own ``load_checkpoint`` does
        without the optimizer, the main copies are then refreshed from the model
        (``MegatronOptimizer.reload_model_params``; a no-op for fp32 training).

        Args:
            state_dict: ``self.module``'s keys (this rank's TP/PP shard), e.g. the
                ``"model"`` entry that ``dist_checkpointing.load`` returns.

        Raises:
            RuntimeError: missing or unexpected keys, or shapes that differ
                (``torch.nn.Module.load_state_dict``).
        """
        self.module.load_state_dict(state_dict)
        self.optimizer.reload_model_params()

    @torch.no_grad()
    def set_params(self, params: dict[str, torch.Tensor]) -> None:
        """Overwrite this rank's parameters (and fp32 main copies) with ``params``.

        Raises:
            KeyError: a parameter of the model is missing from ``params``.
        """
        main = self._main_params()
        for name, p in self.module.named_parameters():
            p.copy_(params[name])
            if id(p) in main:
                main[id(p)].copy_(params[name])

    def tp_partition_dims(self) -> dict[str, int]:
        """``{name: dim}`` of the parameters split across the tensor-parallel
        ranks along ``dim`` (the others are replicated on every TP rank)."""
        return {name: int(getattr(p, "partition_dim", 0)) for name, p in self.module.named_parameters()
                if getattr(p, "tensor_model_parallel", False)}

