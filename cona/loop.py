"""CONA's training loop (:class:`Loop`): steps a job, evaluates, decides and records;
:class:`Progress` is what a run has recorded so far.  What a run does per step, when it
evaluates and what it writes: :mod:`cona.run`'s docstring (:func:`cona.run.run` builds
the job and runs this loop over it; the oracle's branches and the bench's static runs
run it too, :mod:`cona.baselines`).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch.distributed as dist

from jobruntime.checkpoint import save_checkpoint
from jobruntime.config import JobConfig
from jobruntime.logging_utils import StepProgress
from jobruntime.metrics import (
    MetricsWriter,
    TTPTracker,
    dense_eval_gap,
    perplexity,
    target_reached_line,
)

from .controller import Controller
from .job import Job
from .lr_rule import ramp_lr
from .state import adam_hyperparameters, set_adam_betas, set_peak_lr

log = logging.getLogger("cona")
_RESUMED = ("next_eval", "next_eval_s", "chain", "switches", "evals", "last_val_ppl",
            "lr_strategy", "lr_now", "lr_ramp")
"""The :class:`Progress` fields a resumed run goes on from (with ``ttp``; ``records``
are the in-memory buffer of a run without a writer, ``nan`` ends a run)."""


@dataclass
class Progress:
    """What a run has recorded so far (copied as a whole when the oracle chain branches)."""

    ttp: TTPTracker
    next_eval: float  # samples (the sample cadence, or a dense evaluation near the target)
    next_eval_s: float | None = None  # clock seconds (the clock cadence, cona.eval_clock)
    chain: list = field(default_factory=list)
    switches: list = field(default_factory=list)
    evals: list = field(default_factory=list)
    records: list = field(default_factory=list)
    last_val_ppl: float | None = None
    nan: bool = False
    # LR ramp after a switch (cona.lr_ramp_steps): the strategy whose LR is in effect,
    # the (peak, final) LR the last step trained at, and the ramp (from, to, steps done)
    lr_strategy: str | None = None
    lr_now: tuple | None = None
    lr_ramp: tuple | None = None


def check_resume_state(state: dict, job) -> None:
    """Refuse a CONA state that ``job`` cannot go on from, before the run writes
    anything (:func:`cona.run.run` calls it right after the job loaded its checkpoint).

    Raises:
        CheckpointError: ``state`` is not a CONA state (names the missing part), or the
            run was launched with another ``parallel.global_batch_size`` than ``job``'s
            (its budget and the learning-rate rule's reference batch: names the saved one).
    """
    from jobruntime.checkpoint import CheckpointError

    missing = [k for k in ("clock_s", "samples0", "progress", "controller")
               if k not in state] + [k for k in ("ttp", *_RESUMED)
                                     if k not in state.get("progress", {})]
    if missing:
        raise CheckpointError(
            f"the checkpoint's CONA state lacks {', '.join(missing)}: it was not saved "
            f"by this version of CONA; resume with checkpoint.load_optimizer=false to "
            f"start CONA afresh from its weights")
    saved, now = state.get("reference_batch"), getattr(job, "reference_batch", None)
    if saved is not None and now is not None and saved != now:
        raise CheckpointError(
            f"the checkpoint's CONA run was launched with parallel.global_batch_size="
            f"{saved}, which sets its budget (train.iters of it) and the learning-rate "
            f"rule's reference batch; this resume has {now}: resume with "
            f"parallel.global_batch_size={saved} (the launch layout's other settings are "
            f"free), or start CONA afresh from its weights with "
            f"checkpoint.load_optimizer=false")


class Loop:
    """Steps a :class:`~cona.job.Job`, evaluates, decides and records (:mod:`cona.run`'s
    docstring).

    Args:
        job: the job (real or emulated).
        controller: ``None`` trains the current strategy only (static runs).
        writer: metrics sink; ``None`` buffers records in ``progress.records``
            (unless ``keep_records`` is false: the oracle's branches drop them).
        budget_samples: stop after this many training samples.
        eval_samples: samples between evaluations.
    """

    def __init__(
        self,
        job: Job,
        cfg: JobConfig,
        *,
        controller: Controller | None = None,
        writer: MetricsWriter | None = None,
        budget_samples: int,
        eval_samples: int,
        checkpoint_dir: Path | None = None,
        keep_records: bool = True,
    ):
        self.job, self.cfg, self.controller, self.writer = job, cfg, controller, writer
        self.checkpoint_dir = checkpoint_dir
        self._saved_step: int | None = None  # the step of the last save (save: once a step)
        self.keep_records = keep_records
        self.budget_samples, self.eval_samples = budget_samples, max(eval_samples, 1)
        # the cadence: every eval_samples samples, or every eval_every_s seconds of the
        # clock (cona.eval_clock: ConaContext.eval_every_s; test doubles have no context)
        self.eval_every_s = getattr(getattr(job, "ctx", None), "eval_every_s", None)
        self.progress = Progress(
            ttp=TTPTracker(cfg.train.target_ppl),
            next_eval=math.inf if self.eval_every_s else eval_samples,
            next_eval_s=self.eval_every_s)
        self.samples0 = job.consumed_samples  # cona.ttp_resolution counts from here
        self.progress.chain.append({"strategy": job.strategy.label, "start_step": 0})
        start_lr = getattr(job, "start_lr", None)  # Job.start_lr (test doubles may lack it)
        if start_lr is not None:  # the start is a switch from the state's own LR
            self.progress.lr_strategy, self.progress.lr_now = "start", tuple(start_lr)
        self._wall0 = time.perf_counter()
        self.reporter: StepProgress | None = None  # run() reports; the oracle's branches do not

    def emit(self, record: dict) -> None:
        if self.writer is not None:
            self.writer.log(record)
        elif self.keep_records:
            self.progress.records.append(record)

    # -- resuming -----------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed run goes on from (real mode saves it in every checkpoint,
        ``extra["cona"]``): the clock (seconds), the progress (TTP tracker, evaluations,
        chain, switches, the next evaluation, the LR ramp) and the controller's state
        (noise-scale estimator, calibrated cost model, measured switch costs, the number
        of decisions; :meth:`cona.controller.Controller.state_dict`).  Plain Python
        values only; it grows with the evaluations and switches, not with the
        decisions made."""
        p = self.progress
        progress = {k: copy.deepcopy(getattr(p, k)) for k in _RESUMED}
        progress["ttp"] = asdict(p.ttp)
        return {"clock_s": self.job.clock_s, "samples0": self.samples0, "progress": progress,
                "reference_batch": getattr(self.job, "reference_batch", None),
                "controller": None if self.controller is None else self.controller.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Go on from :meth:`state_dict` of the run that saved the checkpoint the job
        loaded.  The job may have resumed at another layout than the one saved (the
        launch layout is the user's): the controller's current strategy is the job's, the
        chain records the change at the resume step, and the learning rate follows it as
        after a switch (:meth:`follow_lr`).

        Raises:
            CheckpointError: as :func:`check_resume_state`.
        """
        job, p = self.job, self.progress
        check_resume_state(state, job)
        for k in _RESUMED:
            setattr(p, k, copy.deepcopy(state["progress"][k]))
        p.ttp = TTPTracker.from_state(state["progress"]["ttp"], self.cfg.train.target_ppl)
        self.samples0 = state["samples0"]
        job.resume_clock(state["clock_s"])
        if self.controller is not None and state["controller"] is not None:
            self.controller.load_state_dict(state["controller"])
            self.controller.current = job.strategy
        if p.chain and p.chain[-1]["strategy"] != job.strategy.label:
            p.chain.append({"strategy": job.strategy.label, "start_step": job.trainer.step,
                            "resumed": True})

    # -- stopping -----------------------------------------------------------
    @property
    def done(self) -> bool:
        t, p = self.cfg.train, self.progress
        if p.nan or self.job.consumed_samples >= self.budget_samples:
            return True
        if t.stop_at_target and p.ttp.reached:
            return True
        if t.max_wall_s is None:
            return False
        # the wall clock of a real run goes on across a resume (as train.py's loop); an
        # emulated run's clock is no wall time, so its limit counts this process's
        wall = self.job.clock_s if self.job.ctx.clock == "wall" else time.perf_counter() - self._wall0
        return wall >= t.max_wall_s

    @property
    def target_gns(self) -> float | None:
        """The noise scale now, in target sequences (:mod:`cona.mapping`)."""
        return self.job.ctx.mapping.target_noise_scale(self.job.gns.noise_scale)

    # -- one step -----------------------------------------------------------
    def follow_lr(self) -> None:
        """Before a step: set the (peak, final) LR of the job's strategy, ramped after a
        switch that raised it (:func:`cona.lr_rule.ramp_lr`).  Whoever switched (the
        controller, or the oracle through :meth:`EmulatedJob.set_strategy`), the ramp
        is the same; its state lives in :attr:`progress` (copied with a branch)."""
        job, p = self.job, self.progress
        sched = getattr(job.trainer, "scheduler", None)
        if sched is None:  # a job without a sample schedule (test doubles)
            return
        label, target = job.strategy.label, tuple(job.lr_for(job.strategy))
        if p.lr_strategy != label:
            if p.lr_strategy is not None and p.lr_now is not None and target[0] > p.lr_now[0]:
                p.lr_ramp = (p.lr_now, target, 0)
            else:
                p.lr_ramp = None
            p.lr_strategy = label
        lr = target
        if p.lr_ramp is not None:
            old, new, done = p.lr_ramp
            done += 1
            n = self.cfg.cona.lr_ramp_steps
            lr = tuple(ramp_lr(a, b, done, n) for a, b in zip(old, new))
            p.lr_ramp = (old, new, done) if done < n else None
        if (sched.max_lr, sched.min_lr) != lr:
            set_peak_lr(job.trainer, sched, *lr)
        p.lr_now = lr

    def follow_adam(self) -> None:
        """Before a step: run Adam at the ``beta2`` of the job's global batch
        (:meth:`cona.job.Job.adam_beta2_for`: by ``cona.adam_beta2_batch``'s rule, else
        ``train.adam_beta2``), its moments rescaled to keep their bias-corrected values
        (:func:`cona.state.set_adam_betas`).  Stateless: whatever set the strategy or
        restored a state (a switch, the oracle's branches, a resume from a checkpoint
        saved at another batch), the optimizer's ``beta2`` is the strategy's from the next
        step on."""
        job = self.job
        beta2_for = getattr(job, "adam_beta2_for", None)  # test doubles may lack it
        if beta2_for is None:
            return
        beta1 = adam_hyperparameters(job.trainer)[0]
        set_adam_betas(job.trainer, (beta1, beta2_for(job.strategy)))

    def evaluate(self, cadence: bool = False) -> float:
        """Evaluate now, record it (and TTP; ``cadence``: an evaluation of the cadence, not
        a dense one near the target or an extra one); return the validation loss.  A
        loss that is not finite is not recorded: it ends the run (``progress.nan``)."""
        job, p = self.job, self.progress
        val_loss = job.evaluate()
        if not math.isfinite(val_loss):  # the step's update broke the weights: divergence
            log.error("validation loss is %s at step %d; stopping", val_loss, job.trainer.step)
            p.nan = True  # ends the run, saves nothing of it (as jobruntime.loop.run)
            return val_loss
        ppl = perplexity(val_loss)
        p.last_val_ppl = ppl
        samples, step = job.consumed_samples, job.trainer.step
        tokens = job.trainer.consumed_tokens
        p.evals.append({"step": step, "samples": samples, "time_s": job.clock_s, "val_ppl": ppl,
                        "gns": self.target_gns, "global_batch_size": job.strategy.global_batch_size,
                        "cadence": cadence})
        if p.ttp.update(ppl, job.clock_s, tokens, step):
            log.info(target_reached_line(self.cfg.train.target_ppl, f"step {step}", job.clock_s,
                                         job.ctx.clock))
        return val_loss

    def step(self) -> None:
        job, p = self.job, self.progress
        fresh = getattr(job, "fresh", False)
        self.follow_lr()
        self.follow_adam()
        result, step_s = job.train_step()
        samples = job.consumed_samples
        if self.controller is not None and not fresh:
            self.controller.record_iteration(step_s, job.strategy)
            self.controller.record_progress(samples, result.loss)
        # as train.py's step records; the emulated clock's step_s times the target model,
        # not the proxy's tokens
        tokens_per_s = result.tokens / step_s if job.ctx.clock == "wall" and step_s > 0 else None
        record = {
            "event": "step",
            "step": job.trainer.step,
            "samples": samples,
            "tokens": job.trainer.consumed_tokens,
            "time_s": job.clock_s,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "step_s": step_s,
            **({"tokens_per_s": tokens_per_s} if tokens_per_s is not None else {}),
            "strategy": job.strategy.label,
            "global_batch_size": job.strategy.global_batch_size,
            **job.gns.to_dict(),
            "gns_target": self.target_gns,
        }
        if not math.isfinite(result.loss):  # ends the run: its weights are not evaluated
            log.error("loss is %s at step %d; stopping", result.loss, job.trainer.step)
            p.nan = True
        on_clock = p.next_eval_s is not None and job.clock_s >= p.next_eval_s * (1 - 1e-9)
        if not p.nan and (on_clock or samples >= p.next_eval or samples >= self.budget_samples):
            if self.eval_every_s:  # the next multiple of the clock cadence
                k = math.floor(job.clock_s / self.eval_every_s + 1e-9)  # cadence points passed
                p.next_eval_s = (k + 1) * self.eval_every_s
                p.next_eval = math.inf
            else:
                p.next_eval = (samples // self.eval_samples + 1) * self.eval_samples
            prev = p.evals[-1]["samples"] if p.evals else self.samples0
            cadence = on_clock if self.eval_every_s else (
                samples // self.eval_samples > prev // self.eval_samples)  # passed a multiple
            val_loss = self.evaluate(cadence=cadence)
            record.update(val_loss=val_loss, val_ppl=perplexity(val_loss))
            gap = dense_eval_gap([(e["samples"], e["val_ppl"]) for e in p.evals],
                                 self.cfg.train.target_ppl, self.cfg.cona.ttp_resolution,
                                 start=self.samples0)
            if gap is not None:  # near the target: earlier than the fixed cadence
                p.next_eval = min(p.next_eval, samples + math.ceil(gap))
        self.emit(record)
        if self.reporter is not None:
            self.reporter.update(samples, step=job.trainer.step, loss=result.loss,
                                 val_ppl=p.last_val_ppl, time_s=job.clock_s,
                                 tokens_per_s=tokens_per_s,
                                 evaluated="val_loss" in record,
                                 note=f"{job.strategy.label} ({job.ctx.clock} clock)")
        self.maybe_decide()
        # after the step's decision (and its switch): a checkpoint holds every record
        # that metrics.jsonl keeps up to its step (a resume replaces only later ones)
        every = self.cfg.checkpoint.save_interval
        if every and job.trainer.step % every == 0:
            self.save()

    def maybe_decide(self) -> None:
        """After a step: the start decision once the probe is over, else a decision every
        ``cona.decision_interval`` steps.  No decision when less than one decision
        interval of training remains: a switch could not run (let alone repay its cost)
        before the end.  Both sides in proxy samples: the budget and consumed samples are
        proxy sequences, and one interval is ``decision_interval`` steps of the proxy
        batch (the strategy's global batch is in target sequences, r x larger)."""
        job, ctl = self.job, self.controller
        if ctl is None:
            return
        left = self.budget_samples - job.consumed_samples
        step = job.trainer.step
        if ctl.wants_start_decision(step, job.gns.num_updates):
            self.decide(start=True)  # the probe is over: rank the start strategy
        elif (ctl.should_decide(step)
                and left >= ctl.cfg.decision_interval * job.proxy_batch(job.strategy)):
            self.decide()

    def decide(self, start: bool = False) -> None:
        job, ctl = self.job, self.controller
        left = job.ctx.mapping.target_samples(self.budget_samples - job.consumed_samples)
        probe = getattr(job, "probe", None)
        d = ctl.decide(job.trainer.step, remaining_samples=left, start=start,
                       no_estimate=getattr(probe, "no_estimate", None))
        log.info("%s", d.describe())
        target = d.best if d.switch else None
        if dist.is_initialized() and dist.get_world_size() > 1:  # one decision for all ranks
            obj = [target]
            dist.broadcast_object_list(obj, src=0)
            target = obj[0]
        self.emit({"event": "decision", "time_s": job.clock_s, **d.to_dict()})
        if target is None or self.done:
            return
        before = job.clock_s
        rec = job.apply(target)
        rec["clock_before_s"] = before
        lr = ctl.commit_switch(target, rec["cost_s"])  # what the switch took is what it costs
        rec.update(event="switch", step=job.trainer.step, time_s=job.clock_s, controller_lr=lr)
        self.progress.switches.append(rec)
        self.progress.chain.append({"strategy": target.label, "start_step": job.trainer.step})
        log.info(
            "switched %s -> %s at step %d (%s, %.2f s)",
            rec["from"],
            rec["to"],
            job.trainer.step,
            rec.get("kind"),
            rec["cost_s"],
        )
        self.emit(rec)

    def save(self) -> None:
        """A checkpoint of the current step in ``checkpoint_dir`` (real mode; nothing where
        it is ``None``, the emulated clock's proxy): megatron-core ``dist_checkpointing``,
        loadable at the current layout or any other (the last one before an interrupted
        switch resumes at either), with ``"cona"``, what the run goes on from
        (:meth:`load_state_dict`).  Once per step: a second call at the same step (the
        final save after a periodic one) writes nothing; nor after a step whose loss was not
        finite (weights that diverged are never a checkpoint to resume from)."""
        job = self.job
        if (self.checkpoint_dir is None or self._saved_step == job.trainer.step
                or self.progress.nan):
            return
        save_checkpoint(self.checkpoint_dir, job.trainer, consumed_samples=job.consumed_samples,
                        extra={"strategy": job.strategy.label, "time_s": job.clock_s,
                               "cona": self.state_dict()},
                        keep_last=self.cfg.checkpoint.keep_last)
        self._saved_step = job.trainer.step

    def run(self, until=None) -> None:
        """Step until done (or ``until()`` is true); evaluate at the end if not just done."""
        while not self.done and not (until is not None and until()):
            self.step()

    def finish(self) -> None:
        """Final evaluation unless the last step was just evaluated or its loss was not
        finite (the weights diverged)."""
        p = self.progress
        if p.nan:
            return
        if not p.evals or p.evals[-1]["samples"] != self.job.consumed_samples:
            val_loss = self.evaluate()
            self.emit(
                {
                    "event": "eval",
                    "step": self.job.trainer.step,
                    "time_s": self.job.clock_s,
                    "samples": self.job.consumed_samples,
                    "val_loss": val_loss,
                    "val_ppl": perplexity(val_loss),  # not finite: null, the run diverged
                }
            )

    def summary(self) -> dict:
        """The run's ``summary.json`` fields that the loop knows (clock, TTP, the final
        validation perplexity, switches, counters, evaluations), with ``diverged_at_step``
        where a step's loss was not finite (the run stopped there)."""
        p, job = self.progress, self.job
        return {
            "clock": job.ctx.clock,
            "target_ppl": self.cfg.train.target_ppl,
            **p.ttp.summary(),
            "final_val_ppl": p.last_val_ppl,
            "switches": len(p.switches),
            "chain": p.chain,
            "switch_log": [{k: v for k, v in s.items() if k != "event"} for s in p.switches],
            "steps": job.trainer.step,
            "samples": job.consumed_samples,
            "tokens": job.trainer.consumed_tokens,
            "clock_s": job.clock_s,
            "wall_s": time.perf_counter() - self._wall0,
            "final_strategy": job.strategy.label,
            "evals": p.evals,
            # the step whose loss was not finite, where the run stopped (train.py exits 1)
            **({"diverged_at_step": job.trainer.step} if p.nan else {}),
        }

