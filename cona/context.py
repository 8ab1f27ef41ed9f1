"""Everything a CONA run needs, built once: the clock, the target, candidates, data.

This is the one place that decides the clock (``cona.clock``):

- **wall** (real mode): the strategies' layouts run on the launched
  processes; the model that trains is the model that is timed; time is the
  wall clock; switch costs are measured (:class:`cona.job.RealJob`).
- **emulated**: the job's model is a *proxy* that really trains (in one
  process, or data-parallel over torchrun's processes); the *target*
  (``cona.target_model``) on ``cona.num_gpus`` x ``cona.gpu`` gives step and
  switch times (:class:`cona.emulated.EmulatedCluster`).  A proxy step of
  ``B_p`` sequences stands for a target step of ``B_t = r * B_p`` sequences,
  ``r = cona.batch_ratio`` (:mod:`cona.mapping`, the one proxy-to-target rule).

Units: strategies, the controller's noise scale and its reference batch are
in *target* sequences (in real mode target = proxy, ``r = 1``); the training
budget, the sample-based LR schedule, evaluations and the data position are
in *proxy* samples: ``train.iters * parallel.global_batch_size`` samples,
evaluations every ``train.eval_interval * parallel.global_batch_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from jobruntime import cpu_compat
from jobruntime.config import ConfigError, JobConfig, ModelConfig, load_config
from jobruntime.memory import device_memory_limit, trainer_memory_model
from jobruntime.parallel import init_distributed
from jobruntime.trainer import resolve_dtype

from .candidates import build_candidates
from .controller import Controller
from .cost_model import CostModel
from .emulated import EmulatedCluster
from .job import (
    Datasets,
    EmulatedJob,
    Job,
    RealJob,
    build_datasets,
    proxy_micro_batch_size,
    val_set_size,
)
from .lr_rule import scale_beta
from .mapping import ProxyMapping, TargetNoiseScale
from .picks import start_strategy
from .strategy import Strategy


@dataclass
class ConaContext:
    """A CONA run's setup (module docstring); build it with :func:`build_context`.

    Attributes:
        cfg: the job's config (the proxy's, in emulated mode).
        target: the timed model (``cfg.model`` in real mode).
        mapping: proxy -> target batches and noise scale.
        candidates: strategies to choose from (target sequences).
        cost_model: the controller's throughput model (calibrated by measured steps).
        cluster: the emulated cluster, ``None`` in real mode.
        data: tokenised corpus and datasets.
        budget_samples: training budget (proxy samples).
        eval_samples: proxy samples between evaluations.
        val_micro_batch: the proxy's validation micro-batch (emulated mode): the largest
            divisor of a process's share of the validation set up to
            :data:`EVAL_MICRO_BATCH` (forward only, so no training micro-batch binds it;
            64 sequences ran the Llama proxy's 256 in 0.83x the time of micro-batches of 4).
        warm: the warm state every emulated job starts from (:mod:`cona.warm`;
            ``None``: initial weights, data position 0).
    """

    cfg: JobConfig
    target: ModelConfig
    mapping: ProxyMapping
    candidates: list[Strategy]
    cost_model: CostModel
    cluster: EmulatedCluster | None
    data: Datasets
    budget_samples: int
    eval_samples: int
    val_micro_batch: int
    warm: dict | None = None

    @property
    def emulated(self) -> bool:
        return self.cluster is not None

    @property
    def clock(self) -> str:
        """``"emulated"`` or ``"wall"``: the label every record and report carries."""
        return "emulated" if self.emulated else "wall"

    @property
    def reference_batch(self) -> int:
        """``M0``: the target batch the base LR was tuned for (``r * parallel.global_batch_size``)."""
        return self.mapping.target_batch(self.cfg.parallel.global_batch_size)

    @property
    def eval_every_s(self) -> float | None:
        """Clock seconds between the cadence's evaluations with ``cona.eval_clock`` (emulated
        mode): ``train.eval_interval`` steps of :meth:`reference_strategy`; ``None``: the
        cadence is :attr:`eval_samples` samples."""
        if not (self.emulated and self.cfg.cona.eval_clock):
            return None
        return max(self.cfg.train.eval_interval, 1) * self.cluster.iter_s(self.reference_strategy())

    def reference_strategy(self) -> Strategy:
        """The fastest candidate at :attr:`reference_batch` (the preset's batch; what the
        warm checkpoint trains at, :mod:`cona.warm`).

        Raises:
            ConfigError: no candidate has the reference batch.
        """
        at = [s for s in self.candidates if s.global_batch_size == self.reference_batch]
        if not at:
            raise ConfigError(f"no candidate at the reference batch {self.reference_batch}; add "
                              "it to cona.global_batch_sizes")
        return min(at, key=lambda s: (self.cluster.iter_s(s) if self.emulated else 0, s.label))

    def start_strategy(self) -> Strategy:
        """Real mode: ``cfg.parallel``.  Emulated: at the reference batch (else the smallest
        candidate batch), the layout chosen one switch ahead by
        :func:`cona.picks.start_strategy` (``cona.start_slack``; the premium over the
        whole budget below the switch cost it saves, on the emulated cluster's model)."""
        if not self.emulated:
            p, world = self.cfg.parallel, dist.get_world_size()
            dp = world // (p.tp * p.pp)
            return Strategy(dp, p.tp, p.pp, p.micro_batch_size, p.global_batch_size)
        batches = {s.global_batch_size for s in self.candidates}
        batch = self.reference_batch if self.reference_batch in batches else min(batches)
        return start_strategy(self.candidates, self.cost_model, batch, self.cfg.cona.start_slack,
                              budget_samples=self.mapping.target_batch(self.budget_samples),
                              switch_s=self.cluster.switch_s)

    def make_job(self, start: Strategy | None = None, lr_factor: float = 1.0,
                 track_gns: bool = True) -> Job:
        """A fresh job at ``start``, clock 0: from :attr:`warm` where set (emulated mode),
        else from the initial weights at data position 0; ``lr_factor`` multiplies every
        strategy's LR (:attr:`cona.job.Job.lr_factor`); ``track_gns=False`` (emulated
        only) skips the online noise-scale estimate (:meth:`EmulatedJob._attach_probe`)."""
        start = start or self.start_strategy()
        if self.emulated:
            return EmulatedJob(self, start, lr_factor, track_gns)
        if lr_factor != 1.0 or not track_gns:
            raise ConfigError("lr_factor and track_gns apply to emulated jobs (the bench)")
        return RealJob(self, start)

    def make_controller(self, job: Job) -> Controller:
        """The controller for ``job``: emulated switch costs are the cluster's model (what
        the clock charges); real ones are measured (:attr:`RealJob.measured_costs`)."""
        kw = {}
        if self.emulated:
            kw["switch_cost_model"] = self.cluster.switch_s
        else:
            kw["switch_cost_priors_s"] = job.measured_costs
        return Controller(
            self.candidates,
            self.cost_model,
            TargetNoiseScale(job.gns, self.mapping),
            self.cfg.cona,
            current=job.strategy,
            base_lr=self.cfg.train.lr,
            reference_batch=self.reference_batch,
            **kw,
        )


EVAL_MICRO_BATCH = 64  # sequences per validation forward in emulated mode, at most


def eval_micro_batch(sequences: int) -> int:
    """The largest divisor of ``sequences`` (a process's validation share) that is at most
    :data:`EVAL_MICRO_BATCH`."""
    return max(d for d in range(1, min(sequences, EVAL_MICRO_BATCH) + 1) if sequences % d == 0)


def _emulated(cfg: JobConfig, world: int):
    c = cfg.cona
    target = load_config(c.target_model).model if c.target_model else cfg.model
    mapping = ProxyMapping(c.batch_ratio, cfg.model.seq_length, target.seq_length)
    cluster = EmulatedCluster(target, c.gpu, c.num_gpus or world, c.step_dilation)
    cands = build_candidates(
        cfg, target, cluster.num_gpus, mapping=mapping, memory_limit_bytes=cluster.memory_limit_bytes
    )
    cands = [s for s in cands if mapping.proxy_batch(s.global_batch_size) % world == 0]
    if not cands:
        raise ValueError(f"no candidate's proxy global batch is divisible by {world} processes")
    val_mb = proxy_micro_batch_size(
        max(cfg.parallel.global_batch_size // world, 1), cfg.parallel.micro_batch_size
    )
    return target, mapping, cluster, cands, cluster.cost_model, [world * val_mb]


def _real(cfg: JobConfig, world: int):
    if cfg.cona.batch_ratio != 1:
        raise ValueError("cona.batch_ratio applies to the emulated clock; set cona.clock=emulated")
    cfg.validate(world)
    gpu = torch.cuda.is_available()
    precision = "mixed" if gpu else "fp32"
    # every candidate must fit this device as the trainer's launch check counts it
    # (jobruntime.memory.check_job_fits): a GPU's memory, on CPU the host's over the
    # node's ranks; the smallest over the ranks, so that every rank has the same list
    device = cpu_compat.device()
    limit, what = device_memory_limit(device)
    if dist.is_initialized():
        t = torch.tensor([limit], dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        limit = float(t.item())
    dtype_name = str(resolve_dtype(cfg.train.precision)).split(".")[-1]
    cands = build_candidates(cfg, cfg.model, world, memory_limit_bytes=limit,
                             memory_limit_what=what,
                             memory_model=trainer_memory_model(cfg, device=device,
                                                               dtype_name=dtype_name),
                             check_explicit=cfg.train.check_memory)
    cost_model = CostModel(cfg.model, cfg.cona.gpu, precision=precision)
    p = cfg.parallel
    units = [s.dp * s.micro_batch_size for s in cands]
    units.append(world // (p.tp * p.pp) * p.micro_batch_size)
    mapping = ProxyMapping(1.0, cfg.model.seq_length, cfg.model.seq_length)
    return cfg.model, mapping, None, cands, cost_model, units


def build_context(
    cfg: JobConfig, *, data: Datasets | None = None, min_train_samples: int = 0
) -> ConaContext:
    """Decide the clock and build candidates, cost model and data for ``cfg`` (collective).

    Args:
        data: datasets of an earlier context of the same config, to reuse.
        min_train_samples: build at least this many training samples (for a
            later context that reuses the data with larger batches).

    Raises:
        ConfigError: invalid layout, candidates or batch ratio, or a candidate batch
            that ``cona.adam_beta2_batch``'s rule would give a negative ``beta2``.
    """
    init_distributed()
    world = dist.get_world_size()
    ref = cfg.parallel.global_batch_size
    budget = max(cfg.train.iters, 1) * ref
    try:
        build = _emulated if cfg.cona.clock == "emulated" else _real
        target, mapping, cluster, cands, cost_model, val_units = build(cfg, world)
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None
    if cfg.cona.adam_beta2_batch is not None:  # Job.adam_beta2_for at every candidate batch
        try:
            for batch in sorted({s.global_batch_size for s in cands}):
                scale_beta(cfg.train.adam_beta2, batch, cfg.cona.adam_beta2_batch)
        except ValueError as e:
            raise ConfigError(f"cona.adam_beta2_batch={cfg.cona.adam_beta2_batch} with "
                              f"train.adam_beta2={cfg.train.adam_beta2}: {e}") from None
    if data is None:
        largest = max(mapping.proxy_batch(s.global_batch_size) for s in cands)
        train = max(budget + max(largest, ref), min_train_samples)
        data = build_datasets(
            cfg, train_samples=train, val_samples=val_set_size(cfg, val_units, ref)
        )
    eval_samples = max(cfg.train.eval_interval, 1) * ref
    return ConaContext(
        cfg=cfg,
        target=target,
        mapping=mapping,
        candidates=cands,
        cost_model=cost_model,
        cluster=cluster,
        data=data,
        budget_samples=budget,
        eval_samples=eval_samples,
        val_micro_batch=eval_micro_batch(data.val_samples // world) if cluster is not None
        else 0,
    )
