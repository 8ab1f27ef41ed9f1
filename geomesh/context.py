"""Everything a GeoMesh method needs, built once per run: cluster, placement,
planner, target-model schema, data and the metrics writer.

The *target* model sets time and bytes (emulated mode: ``geomesh.target_model``,
e.g. ``gpt3_1.3b`` with its global batch ``G_t``); the job's own model is the
*proxy* that is really trained, at global batch ``G_p =
parallel.global_batch_size``.  Without ``target_model`` — and always in real
mode — the target is the job's model and ``G_t = G_p``.  One round processes
``T = H · G_t · s_t`` target tokens (``H = geomesh.inner_steps``), what one
DiLoCo round of ``H`` steps at the global batch would, and ``H · G_p`` proxy
sequences.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from jobruntime.config import JobConfig
from jobruntime.data import GlobalBatchSampler, build_dataset, prepare_corpus
from jobruntime.metrics import MetricsWriter
from jobruntime.model import build_model
from jobruntime.outputs import save_run_inputs
from jobruntime.parallel import initialize_layout, same_run_dir

from .exchange.deploy import Placement, join_region, place_emulated, place_real
from .fleet.cluster import ClusterSpec
from .fleet.job_check import check_job
from .fleet.planner import Planner
from .wire.canonical import CanonicalSchema, layout_map
from .wire.compression import TensorSchema

log = logging.getLogger(__name__)



@dataclass
class RunContext:
    """Shared setup of one run (see the module docstring for target vs proxy)."""

    cfg: JobConfig
    layout_cfg: JobConfig
    """``cfg`` with the workers' TP/PP (real) or TP=PP=1 (emulated): what trainers are built from."""
    method: str
    cluster: ClusterSpec
    placement: Placement
    planner: Planner
    target: JobConfig
    batch_target: int
    """``G_t``: target global batch (sequences)."""
    target_schema: TensorSchema | None
    """Emulated mode: the target model's tensors (bytes on the wire); ``None`` in real mode."""
    train_ds: object
    val_ds: object
    writer: MetricsWriter
    run_dir: Path

    @property
    def emulated(self) -> bool:
        return self.cluster.mode == "emulated"

    @property
    def clock_name(self) -> str:
        return "emulated" if self.emulated else "wall"

    @property
    def inner_steps(self) -> int:
        return self.cfg.geomesh.inner_steps

    @property
    def outer_steps(self) -> int:
        return self.cfg.geomesh.outer_steps

    @property
    def batch_proxy(self) -> int:
        """``G_p``: the proxy's global batch (sequences)."""
        return self.cfg.parallel.global_batch_size

    @property
    def scale(self) -> float:
        """``G_p / G_t``: proxy sequences per target sequence."""
        return self.batch_proxy / self.batch_target

    @property
    def round_samples(self) -> int:
        """``S = H · G_p``: proxy sequences of one round (= ``H`` DDP steps)."""
        return self.inner_steps * self.batch_proxy

    @property
    def reference_batch(self) -> float:
        """``G_p / K``: proxy sequences per worker step of a uniform round (what
        ``train.lr`` is meant for; see ``geomesh.inner_lr_scaling``)."""
        return self.batch_proxy / len(self.cluster.workers)

    @property
    def uniform_batch(self) -> int:
        """Baselines' per-worker batch: ``G_t / K`` target sequences."""
        return max(1, self.batch_target // len(self.cluster.workers))

    def val_batches(self, *, dp: int, dp_rank: int) -> list:
        p = self.cfg.parallel
        sampler = GlobalBatchSampler(self.val_ds, global_batch_size=p.global_batch_size,
                                     micro_batch_size=p.micro_batch_size, dp=dp, dp_rank=dp_rank)
        return [sampler.microbatches_at(i * p.global_batch_size)
                for i in range(max(self.cfg.train.eval_iters, 1))]

    def is_eval_step(self, step: int) -> bool:
        g = self.cfg.geomesh
        return step % g.eval_interval == 0 or step == g.outer_steps

    def log_outer_step(self, record: dict) -> None:
        """Write one outer step's record (metrics.jsonl, wandb) and log a line
        (unless ``logging.progress=off``): emulated runs can take minutes."""
        self.writer.log(record)
        if self.cfg.logging.progress != "off" and self.placement.is_logging_rank:
            ppl = record.get("val_ppl")
            log.info("%s outer step %d/%d  loss %.3f  val ppl %s  %.1f s (%s clock)", self.method,
                     record["step"], self.cfg.geomesh.outer_steps, record["loss"],
                     f"{ppl:.1f}" if ppl is not None else "-", record["time_s"], self.clock_name)

    def close(self) -> None:
        self.writer.close()


def target_schema(target: JobConfig) -> TensorSchema:
    """``(name, shape)`` of the whole target model, built on the meta device (TP=PP=1 layout)."""
    par = dataclasses.replace(target.parallel, tp=1, pp=1)
    model = build_model(target.model, par, meta=True)
    return TensorSchema.from_tensors(dict(model.named_parameters()))


def target_canonical_schema(target: JobConfig) -> CanonicalSchema:
    """The target model's canonical schema (:mod:`geomesh.wire.canonical`), built on the meta
    device: what a message of the target model addresses (emulated bytes on the wire)."""
    par = dataclasses.replace(target.parallel, tp=1, pp=1)
    return CanonicalSchema.gather(layout_map(build_model(target.model, par, meta=True)))


def build_context(cfg: JobConfig, run_dir: Path) -> RunContext:
    """Validate, place this process, plan, and open data and metrics.

    Raises:
        ConfigError / ClusterError: bad settings, cluster file or process count; a
            region shape that does not split the model or fit its GPUs' memory
            (:func:`geomesh.fleet.shapes.check_region_shapes`, before anything is built).
        DataError, TokenizerError: unusable data.
    """
    g = cfg.geomesh
    job = check_job(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # before any process group
    cluster, target, memory = job.cluster, job.target, job.memory
    K = len(cluster.workers)
    emulated = cluster.mode == "emulated"
    if emulated:
        placement = place_emulated()
        placement.workers = list(range(K))
        layout_cfg = copy.deepcopy(cfg)
        layout_cfg.parallel.tp = layout_cfg.parallel.pp = 1
        check = copy.deepcopy(layout_cfg)
        check.parallel.micro_batch_size = check.parallel.global_batch_size = 1
        placement.topology = initialize_layout(check)
    else:
        placement, layout_cfg = place_real(cfg, cluster)
        if g.target_model:
            log.warning("real mode: geomesh.target_model is ignored (time and bytes are measured)")
    run_dir = same_run_dir(run_dir, group=placement.job_group, src=placement.job_src)
    G_t, s_t = target.parallel.global_batch_size, target.model.seq_length
    planner = Planner(cluster, target.model, tokens_per_round=g.inner_steps * G_t * s_t,
                      inner_steps=g.inner_steps, balance=g.balance, tolerance=g.plan_tolerance,
                      memory=memory)
    schema = target_schema(target) if emulated else None
    t = cfg.train
    corpus = prepare_corpus(cfg.data, cfg.model)
    if placement.per_region:  # its messages are bound to the settings and the tokenizer
        join_region(placement, cfg, cluster, corpus.tokenizer)
    # Samples the rounds can read: emulated rounds take exactly H · G_p proxy
    # sequences whatever the plan; real rounds Σ H_i b_i ≤ (1 + plan_tolerance) · H · G_p,
    # the planner's token budget (plan_tolerance < 1; a re-plan never leaves it,
    # Planner.replan): 2x covers both.
    stream = 2 * g.outer_steps * g.inner_steps * cfg.parallel.global_batch_size
    train_ds = build_dataset(corpus, cfg.model, "train", stream, t.seed, cfg.data.cache_dir)
    val_ds = build_dataset(corpus, cfg.model, "valid",
                           max(t.eval_iters, 1) * cfg.parallel.global_batch_size, t.seed,
                           cfg.data.cache_dir)
    writer = MetricsWriter(
        run_dir, clock="emulated" if cluster.mode == "emulated" else "wall", mode="geomesh",
        enabled=placement.is_logging_rank, wandb_mode=cfg.logging.wandb,
        wandb_project=cfg.logging.project,
        wandb_group=cfg.logging.group or f"geomesh-{cluster.name}",
        wandb_name=cfg.logging.name or f"{g.method}-{run_dir.name}", config=cfg.to_dict(),
    )
    if placement.is_logging_rank:
        save_run_inputs(cfg, corpus.tokenizer, run_dir)
    return RunContext(cfg=cfg, layout_cfg=layout_cfg, method=g.method, cluster=cluster,
                      placement=placement, planner=planner, target=target, batch_target=G_t,
                      target_schema=schema, train_ds=train_ds, val_ds=val_ds, writer=writer,
                      run_dir=run_dir)
