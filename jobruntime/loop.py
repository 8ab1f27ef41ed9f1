"""The training loop of one job: data, steps, evaluation, checkpoints, metrics.

``run(cfg, run_dir)`` is what ``train.py`` calls for an ordinary job (GeoMesh
and CONA wrap the same pieces).  Time is wall-clock seconds since the loop
started; on resume it continues from the checkpoint's recorded time.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from .checkpoint import load_checkpoint, save_checkpoint
from .config import JobConfig
from .data import Corpus, GlobalBatchSampler, build_dataset, prepare_corpus
from .devices import device_summary
from .logging_utils import StepProgress, phase
from .metrics import MetricsWriter, TTPTracker, perplexity, target_reached_line
from .outputs import save_run_inputs
from .parallel import Topology, initialize_layout, same_run_dir, set_seed
from .trainer import Trainer, reconcile_optimizer_settings, schedule_in_steps

log = logging.getLogger("jobruntime")


@dataclass
class DataPipes:
    """Training sampler and the fixed validation batches of one job."""

    corpus: Corpus
    train: GlobalBatchSampler
    val_batches: list


def build_data(cfg: JobConfig, topo: Topology, consumed_samples: int = 0) -> DataPipes:
    """Tokenise (cached), build megatron datasets and this rank's samplers."""
    p, t = cfg.parallel, cfg.train
    corpus = prepare_corpus(cfg.data, cfg.model)
    train_ds = build_dataset(corpus, cfg.model, "train", max(t.iters, 1) * p.global_batch_size,
                             t.seed, cfg.data.cache_dir)
    val_ds = build_dataset(corpus, cfg.model, "valid", max(t.eval_iters, 1) * p.global_batch_size,
                           t.seed, cfg.data.cache_dir)
    kw = dict(global_batch_size=p.global_batch_size, micro_batch_size=p.micro_batch_size,
              dp=topo.dp, dp_rank=topo.dp_rank)
    train = GlobalBatchSampler(train_ds, consumed_samples=consumed_samples, **kw)
    val = GlobalBatchSampler(val_ds, **kw)
    val_batches = [val.microbatches_at(i * p.global_batch_size) for i in range(t.eval_iters)]
    return DataPipes(corpus, train, val_batches)


def run(cfg: JobConfig, run_dir: Path,
        end_of_run: Callable[[Trainer, Corpus], dict] | None = None) -> dict:
    """Train ``cfg`` and write metrics, summary and checkpoints under ``run_dir``.

    Returns:
        The summary dict (also written to ``run_dir/summary.json`` on the
        logging rank): ``target_ppl``, ``ttp_s``, ``ttp_tokens``,
        ``final_val_ppl``, ``tokens``, ``wall_s`` and more.

    Args:
        end_of_run: called on every rank after training with the trainer and
            corpus; its dict is merged into the summary (e.g. zero-shot scores).

    Raises:
        ConfigError, DataError, TokenizerError, CheckpointError: bad input.
    """
    topo = initialize_layout(cfg)
    run_dir = same_run_dir(run_dir)
    set_seed(cfg.train.seed)
    trainer = Trainer(cfg)
    consumed, start_time, extra = 0, 0.0, {}
    if cfg.checkpoint.load:
        state = load_checkpoint(cfg.checkpoint.load, trainer,
                                load_optimizer=cfg.checkpoint.load_optimizer)
        if cfg.checkpoint.load_optimizer:  # resume; else fine-tune from the weights only
            consumed, extra = state["consumed_samples"], state["extra"]
            if extra.get("cona"):  # a CONA run's: its schedule and steps counted samples
                schedule_in_steps(trainer.scheduler, cfg.parallel.global_batch_size)
                trainer.step = consumed // cfg.parallel.global_batch_size
            reconcile_optimizer_settings(trainer, cfg.train,
                                         cfg.checkpoint.optimizer_settings, cfg.checkpoint.load)
            start_time = float(extra.get("time_s", 0.0))
            log.info("resumed from %s at step %d", cfg.checkpoint.load, trainer.step)
        else:
            log.info("loaded weights from %s (optimizer and schedule start fresh)",
                     cfg.checkpoint.load)
    with phase(log, "preparing the data (%s)", cfg.data.path):
        data = build_data(cfg, topo, consumed)
    t = cfg.train
    writer = MetricsWriter(
        run_dir, clock="wall", mode="single", enabled=topo.is_logging_rank,
        wandb_mode=cfg.logging.wandb, wandb_project=cfg.logging.project,
        wandb_group=cfg.logging.group, wandb_name=cfg.logging.name or run_dir.name,
        config=cfg.to_dict(),
    )
    if topo.is_logging_rank:
        save_run_inputs(cfg, data.corpus.tokenizer, run_dir)
    # "ttp": the tracker's state (with the last evaluation above the target, so a
    # resumed run interpolates its crossing); older checkpoints hold only ttp_s/_tokens/_step
    ttp = TTPTracker.from_state(extra.get("ttp") or {k: extra.get(k) for k in (
        "ttp_s", "ttp_tokens", "ttp_step")}, t.target_ppl)
    progress = StepProgress(cfg.logging.progress, enabled=topo.is_logging_rank, total=t.iters,
                            initial=trainer.step, logger=log)
    t0 = time.perf_counter() - start_time
    # the last evaluation and its step (a resumed run's, until it evaluates: the checkpoint's)
    last_val_ppl, last_val_step = extra.get("final_val_ppl"), extra.get("final_val_step")
    stop, diverged = False, None
    if trainer.step >= t.iters and topo.is_logging_rank:
        log.warning("nothing to train: the checkpoint %s is at step %d, train.iters=%d; raise "
                    "train.iters to train on (with train.lr_decay_iters=%d to keep its LR "
                    "schedule, or checkpoint.optimizer_settings=config for a new one)",
                    cfg.checkpoint.load, trainer.step, t.iters, trainer.scheduler.lr_decay_steps)
    while trainer.step < t.iters and not stop:
        step_t0 = time.perf_counter()
        result = trainer.train_step(data.train.next())
        step_s = time.perf_counter() - step_t0
        now = time.perf_counter() - t0
        tokens = trainer.consumed_tokens  # accumulated: right across batch changes and resumes
        record = dict(step=trainer.step, tokens=tokens, samples=data.train.consumed_samples,
                      time_s=now, loss=result.loss,
                      lr=result.lr, grad_norm=result.grad_norm,
                      tokens_per_s=result.tokens / step_s)
        last = trainer.step == t.iters
        if t.max_wall_s is not None and now >= t.max_wall_s:
            stop = last = True
        # A non-finite loss, training or validation, is divergence: the run stops at this
        # step (train.py exits 1), whose weights are neither saved nor (training loss)
        # evaluated, and whose record is always logged (non-finite values as null).
        if not math.isfinite(result.loss):
            log.error("loss is %s at step %d; stopping", result.loss, trainer.step)
            stop, diverged = True, trainer.step
        elif t.eval_interval and (trainer.step % t.eval_interval == 0 or last):
            val_loss = trainer.evaluate(data.val_batches)
            record.update(val_loss=val_loss, val_ppl=perplexity(val_loss))
            if not math.isfinite(val_loss):  # this step's update broke the weights
                log.error("validation loss is %s at step %d; stopping", val_loss, trainer.step)
                stop, diverged = True, trainer.step
            else:
                last_val_ppl, last_val_step = record["val_ppl"], trainer.step
                if ttp.update(last_val_ppl, now, tokens, trainer.step):
                    log.info(target_reached_line(t.target_ppl, f"step {trainer.step}", now,
                                                 "wall"))
                    stop = stop or t.stop_at_target
        if trainer.step % t.log_interval == 0 or "val_loss" in record or diverged is not None:
            writer.log(record)  # a non-finite loss is written as null (metrics.json_text)
        progress.update(trainer.step, step=trainer.step, loss=result.loss, val_ppl=last_val_ppl,
                        tokens_per_s=record["tokens_per_s"], time_s=now,
                        evaluated="val_loss" in record)
        end, every = trainer.step == t.iters or stop, cfg.checkpoint.save_interval
        saves = (every and (trainer.step % every == 0 or end)) or (end and cfg.checkpoint.save_final)
        if saves and diverged is None:
            save_checkpoint(run_dir / "checkpoints", trainer,
                            consumed_samples=data.train.consumed_samples,
                            keep_last=cfg.checkpoint.keep_last,
                            extra={"time_s": now, "ttp": asdict(ttp), "final_val_ppl": last_val_ppl,
                                   "final_val_step": last_val_step})
    progress.close()
    wall = time.perf_counter() - t0
    summary = dict(
        target_ppl=t.target_ppl, **ttp.summary(),
        final_val_ppl=last_val_ppl, final_val_step=last_val_step, tokens=trainer.consumed_tokens,
        samples=data.train.consumed_samples, steps=trainer.step,
        wall_s=wall, world_size=topo.world_size, dp=topo.dp, tp=topo.tp, pp=topo.pp,
        model=cfg.name, **device_summary(trainer.module),
        **({"diverged_at_step": diverged} if diverged is not None else {}),
    )
    if end_of_run is not None and diverged is None:
        summary.update(end_of_run(trainer, data.corpus))
    writer.summary(summary)
    summary["wandb_dir"] = writer.wandb_dir
    writer.close()
    return summary
