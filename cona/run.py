"""CONA's training run: train, measure, rank candidates every K steps, switch when worth it.

``run(cfg, run_dir)`` is what ``train.py`` calls with ``cona.enabled=true``::

    # real mode: the layouts run on the launched processes, wall clock
    torchrun --nproc-per-node 4 train.py --config tiny_gpt cona.enabled=true
    # emulated mode: the proxy trains (one process, or data-parallel over torchrun's
    # processes), time from the cost model of the target on num_gpus x gpu
    python train.py --config tiny_gpt cona.enabled=true cona.clock=emulated \\
        cona.target_model=gpt3_1.3b cona.gpu=A100-80GB cona.num_gpus=8

The clock, the target, the candidates and the data are decided once, by
:func:`cona.context.build_context`; this module only steps the job it makes,
with :class:`cona.loop.Loop` (importable from here too, like :class:`cona.loop.Progress`).
Per step the loop records the loss, the step's clock time (wall: max over
ranks; emulated: the target's modelled step time) and the gradient noise scale
(:mod:`cona.probe`; ``gns`` in proxy, ``gns_target`` in target sequences).  Every ``cona.decision_interval`` steps the
:class:`cona.controller.Controller` ranks the candidates (goodput = calibrated
throughput x Pollux efficiency) and, if the best one repays its switch cost,
the job switches (:meth:`cona.job.Job.apply`); the LR follows the global batch
(``cona.lr_scaling``, ramped up over ``cona.lr_ramp_steps`` steps after a switch
that raises it, :func:`cona.lr_rule.ramp_lr`; a start from a warm state above the
LR it trained at is such a switch, for every method alike) and every decision is logged
(``metrics.jsonl`` and one line on the ``cona`` logger: what it does, the scores
of the chosen and the current strategy, why).  A start decision comes as soon
as the noise scale has ``cona.start_probe_updates`` estimates (the steps before
it are the probe, on the clock); at DP = 1 with one micro-batch per step or with
PP > 1 the probe splits every ``cona.gns_split_every``-th step (its micro-batch into
parts, or its micro-batches into schedule calls) to measure it
(:meth:`cona.probe.GNSProbe.prepare`); where the current layout allows no estimate
(one micro-batch of one sequence at DP = 1; splitting off), the controller is
told why
(:attr:`cona.probe.GNSProbe.no_estimate`) and falls back to ranking the current global
batch by throughput.

Budget and schedule are in (proxy) samples (the strategies' global batches
differ): ``train.iters * B_ref`` samples with ``B_ref = parallel.global_batch_size``;
warmup and decay likewise (:mod:`cona.state`).  Validation runs every
``train.eval_interval * B_ref`` samples on a fixed validation set, and more
often as the perplexity nears ``train.target_ppl`` when ``cona.ttp_resolution``
is set (:func:`jobruntime.metrics.dense_eval_gap`);
time-to-target-perplexity (TTP) is the clock time at which validation
perplexity crossed ``train.target_ppl``, interpolated between the evaluations
either side (:class:`jobruntime.metrics.TTPTracker`).  In real mode the clock is the wall time since
the start of training (switches and evaluations included); in emulated mode
it is step and switch time only.

Outputs (logging rank): ``metrics.jsonl`` (``event``: ``step``, ``decision``,
``switch``), ``summary.json`` with ``switches``, ``chain`` (``[{strategy,
start_step}]``), ``switch_log`` (with the time and cost of each switch),
``evals`` (perplexity and noise-scale trace), ``ttp_s``, ``final_val_ppl``,
``clock``, ``device``/``precision`` (read from the model's parameters;
emulated mode's ``gpu`` is the emulated profile), and wandb.  Real mode also saves a
checkpoint every ``checkpoint.save_interval`` steps and, with ``checkpoint.save_final``
(default on, as an ordinary run), after the last, each with :meth:`Loop.state_dict`; a
run resumed from it (``checkpoint.load``) goes on with its clock, progress and controller.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch.distributed as dist

from jobruntime.config import JobConfig
from jobruntime.devices import device_summary
from jobruntime.logging_utils import StepProgress
from jobruntime.metrics import MetricsWriter
from jobruntime.outputs import save_run_inputs
from jobruntime.parallel import same_run_dir

from .context import build_context
from .job import RealJob
from .loop import Loop, Progress, check_resume_state  # noqa: F401 - Progress: importable from here as before

log = logging.getLogger("cona")


def run(cfg: JobConfig, run_dir: Path) -> dict:
    """Train ``cfg`` with CONA; write metrics and ``summary.json`` under ``run_dir``.

    Returns:
        The summary dict (see module docstring), the same on every rank.

    Raises:
        ConfigError, DataError, TokenizerError: bad input.
    """
    ctx = build_context(cfg)
    job = ctx.make_job()
    if getattr(job, "resume_state", None):  # refused before anything is written
        check_resume_state(job.resume_state, job)
    controller = ctx.make_controller(job)
    run_dir = same_run_dir(run_dir)
    writer = MetricsWriter(
        run_dir,
        clock=ctx.clock,
        mode="cona",
        enabled=job.is_logging_rank,
        wandb_mode=cfg.logging.wandb,
        wandb_project=cfg.logging.project,
        wandb_group=cfg.logging.group,
        wandb_name=cfg.logging.name or run_dir.name,
        config=cfg.to_dict(),
    )
    if job.is_logging_rank:
        save_run_inputs(cfg, ctx.data.corpus.tokenizer, run_dir)
    log.info("CONA (%s clock): %d candidates, start %s", ctx.clock, len(ctx.candidates),
             job.strategy.label)
    loop = Loop(job, cfg, controller=controller, writer=writer,
                budget_samples=ctx.budget_samples, eval_samples=ctx.eval_samples,
                checkpoint_dir=run_dir / "checkpoints" if isinstance(job, RealJob) else None)
    if getattr(job, "resume_state", None):
        loop.load_state_dict(job.resume_state)
        log.info("resumed CONA at step %d: clock %.1f s, %d decisions, %d switches, at %s",
                 job.trainer.step, job.clock_s, controller.decisions_before,
                 len(loop.progress.switches), job.strategy.label)
    elif (cfg.checkpoint.load and cfg.checkpoint.load_optimizer and isinstance(job, RealJob)
          and job.is_logging_rank):
        log.warning("%s holds no CONA state (saved without CONA, or by a version that did "
                    "not save it): the clock, the evaluations and the controller start "
                    "afresh", cfg.checkpoint.load)
    if job.consumed_samples >= ctx.budget_samples and job.is_logging_rank:
        log.warning("nothing to train: the checkpoint %s has trained %d samples, the budget "
                    "(train.iters x parallel.global_batch_size) is %d; raise train.iters to "
                    "train on", cfg.checkpoint.load, job.consumed_samples, ctx.budget_samples)
    loop.reporter = StepProgress(cfg.logging.progress, enabled=job.is_logging_rank,
                                 total=ctx.budget_samples, unit="sample", logger=log,
                                 initial=job.consumed_samples)
    loop.run()
    loop.reporter.close()
    loop.finish()
    if cfg.checkpoint.save_final:  # as an ordinary run: ready for evaluation or conversion
        loop.save()
    summary = loop.summary()
    summary.update(
        model=cfg.name,
        candidates=len(ctx.candidates),
        decisions=controller.decisions,  # this run's (the earlier ones: their metrics.jsonl)
        decisions_before_resume=controller.decisions_before,
        switch_costs_charged=controller.switch_costs,
        switch_costs_at_start=getattr(job, "measured_costs", None),
        world_size=dist.get_world_size(),
        **device_summary(job.trainer.module),  # where the model really ran (GPU tests check it)
    )
    if ctx.emulated:
        summary.update(
            target_model=cfg.cona.target_model or cfg.name,
            gpu=cfg.cona.gpu,
            num_gpus=ctx.cluster.num_gpus,
            mapping=ctx.mapping.to_dict(),
        )
    writer.summary(copy.deepcopy(summary))
    summary["wandb_dir"] = writer.wandb_dir
    writer.close()
    return summary
