"""A CONA job: trainer, data position, gradient statistics and clock on one strategy.

Built by :meth:`cona.context.ConaContext.make_job`, which decides the clock.
:class:`RealJob` (``cona.clock=wall``) runs the strategy's layout on the
launched processes (torchrun / gloo or NCCL), times steps with the wall
clock (max over ranks) and switches with :mod:`cona.switch`; the cost of a
switch is the wall time :meth:`RealJob.apply` took, which is what the clock
advanced by and what the controller is told.  :class:`EmulatedJob`
(``cona.clock=emulated``) trains the proxy at the proxy batch the strategy's
global batch stands for (:mod:`cona.mapping`) and takes step and switch times
from :class:`cona.emulated.EmulatedCluster`.  Both expose the same interface
to the loop in :mod:`cona.loop`: :meth:`Job.train_step`, :meth:`Job.evaluate`,
:meth:`Job.apply` (switch), ``clock_s``, ``consumed_samples``.

Validation uses one fixed set of sequences whatever the strategy (its size
is a multiple of every candidate's ``dp * micro_batch``), so perplexities of
different strategies are comparable.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from functools import reduce
from typing import TYPE_CHECKING

import torch.distributed as dist

from jobruntime.checkpoint import load_checkpoint
from jobruntime.config import JobConfig
from jobruntime.data import Corpus, GlobalBatchSampler, build_dataset, prepare_corpus
from jobruntime.parallel import (
    Topology,
    initialize_layout,
    set_seed,
)
from jobruntime.trainer import StepResult, reconcile_optimizer_settings

from . import state as cstate
from .direct_probes import DirectProbes
from .grad_stats import GradientNoiseScale
from .lr_rule import scale_beta, scale_lr
from .probe import GNSProbe
from .strategy import Strategy, switch_kind
from .switch import PeakRSS, SwitchInterrupted, max_over_ranks, switch_batch, switch_layout

if TYPE_CHECKING:
    from .context import ConaContext

log = logging.getLogger("cona")


def lcm_of(values) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), values, 1)


def proxy_micro_batch_size(global_batch_size: int, configured: int) -> int:
    """The proxy's micro-batch: near ``global/4`` but >= ``configured``, and <= ``global/2``.

    At least two micro-batches per step keep the gradient noise scale
    measurable in one process (:mod:`cona.probe`, ``"microbatch"`` mode); a
    divisor of the global batch is returned.
    """
    if global_batch_size < 2:
        return 1
    mb = min(max(configured, global_batch_size // 4), global_batch_size // 2)
    while global_batch_size % mb:
        mb -= 1
    return max(mb, 1)


@dataclass
class Datasets:
    """Tokenised corpus and the train / validation datasets (built once per run)."""

    corpus: Corpus
    train: object
    val: object
    val_samples: int


def build_datasets(cfg: JobConfig, *, train_samples: int, val_samples: int) -> Datasets:
    """Tokenise (cached) and build megatron datasets of the given sizes (collective)."""
    corpus = prepare_corpus(cfg.data, cfg.model)
    train = build_dataset(
        corpus, cfg.model, "train", train_samples, cfg.train.seed, cfg.data.cache_dir
    )
    val = build_dataset(corpus, cfg.model, "valid", val_samples, cfg.train.seed, cfg.data.cache_dir)
    return Datasets(corpus, train, val, val_samples)


def val_set_size(cfg: JobConfig, batch_units: list[int], reference_batch: int) -> int:
    """Validation sequences: ``eval_iters * reference_batch`` rounded up to a multiple of
    every ``dp * micro_batch`` in ``batch_units``."""
    unit = lcm_of(batch_units)
    want = max(cfg.train.eval_iters, 1) * reference_batch
    return -(-want // unit) * unit


def load_start(cfg: JobConfig, trainer) -> tuple[int, dict]:
    """Load ``cfg.checkpoint.load`` (an ``iter_`` checkpoint of any layout, e.g. one saved
    before a switch) into ``trainer`` and return where the job starts: ``(consumed
    samples, CONA state)``.  A resume (``checkpoint.load_optimizer``) goes on at the
    checkpoint's data position with the CONA state saved under its ``extra["cona"]``
    (:meth:`cona.run.Loop.state_dict`; ``{}`` where it holds none: an ordinary run's,
    whose LR schedule counted steps, so the sample schedule's position is set to the
    samples it trained); a weights-only load starts both afresh, as
    :func:`jobruntime.loop.run` does.  ``(0, {})`` without ``checkpoint.load``.

    Raises:
        CheckpointError: as :func:`jobruntime.checkpoint.load_checkpoint`.
    """
    c = cfg.checkpoint
    if not c.load:
        return 0, {}
    state = load_checkpoint(c.load, trainer, load_optimizer=c.load_optimizer)
    if not c.load_optimizer:
        return 0, {}
    # the run's own Adam betas and eps, as a layout switch's optimizer has them (torch's
    # load brought the checkpoint's); its LR and weight decay: build_scheduler
    reconcile_optimizer_settings(trainer, cfg.train, "config", c.load, lr=False,
                                 lengths=False)
    consumed, cona = state["consumed_samples"], state["extra"].get("cona") or {}
    if not cona:  # an ordinary run's schedule: num_steps came in steps, not samples
        trainer.scheduler.num_steps = consumed
        trainer.scheduler.step(0)
    return consumed, cona


class Job:
    """Shared state and interface of real and emulated jobs (see module docstring).

    Attributes:
        strategy: the strategy in use (for emulated jobs: the modelled one).
        trainer: the :class:`~jobruntime.trainer.Trainer` of the current layout.
        gns: gradient-noise-scale estimator fed by :attr:`probe` every step
            (proxy sequences).
        reference_batch: proxy global batch the base LR was tuned for (``B_ref``).
        lr_factor: multiplies the LR of every strategy (1 = the scaling rule's; the
            bench's ``static_oracle`` tries 0.5 and 2 as well).
        start_lr: the (peak, final) LR the state this job started from last trained at
            (a warm state: the preset's, :mod:`cona.warm`), or ``None`` (fresh weights
            or an unknown schedule).  A start at a higher LR is a switch that raises it:
            :class:`cona.run.Loop` ramps from here (``cona.lr_ramp_steps``).
    """

    strategy: Strategy
    is_logging_rank: bool = True
    start_lr: tuple[float, float] | None = None

    def __init__(self, ctx: ConaContext, lr_factor: float = 1.0):
        self.ctx, self.cfg, self.data = ctx, ctx.cfg, ctx.data
        self.lr_factor = lr_factor
        self.reference_batch = ctx.cfg.parallel.global_batch_size
        self.gns = GradientNoiseScale.from_config(ctx.cfg.cona)
        self.probe = GNSProbe(self.gns, definition=ctx.cfg.cona.gns_definition,
                              split_every=ctx.cfg.cona.gns_split_every)

    # -- helpers ------------------------------------------------------------
    def proxy_batch(self, strategy: Strategy) -> int:
        """Proxy sequences per step of ``strategy`` (its global batch in real mode)."""
        return self.ctx.mapping.proxy_batch(strategy.global_batch_size)

    def lr_for(self, strategy: Strategy) -> tuple[float, float]:
        """(peak, final) LR for ``strategy``'s global batch by ``cona.lr_scaling``, times
        :attr:`lr_factor`."""
        t, rule = self.cfg.train, self.cfg.cona.lr_scaling
        gb, f = self.proxy_batch(strategy), self.lr_factor
        return (
            f * scale_lr(t.lr, gb, self.reference_batch, rule),
            f * scale_lr(t.min_lr, gb, self.reference_batch, rule),
        )

    def adam_beta2_for(self, strategy: Strategy) -> float:
        """Adam's ``beta2`` at ``strategy``'s global batch: ``train.adam_beta2`` scaled from
        ``cona.adam_beta2_batch`` (same unit: target sequences in emulated mode) by
        :func:`cona.lr_rule.scale_beta`, so its memory in samples is the anchor's;
        ``train.adam_beta2`` itself where that setting is off.

        Raises:
            ValueError: as :func:`cona.lr_rule.scale_beta` (:func:`cona.context.build_context`
                checks every candidate first).
        """
        anchor, beta2 = self.cfg.cona.adam_beta2_batch, self.cfg.train.adam_beta2
        if anchor is None:
            return beta2
        return scale_beta(beta2, strategy.global_batch_size, anchor)

    def _sampler(self, topo: Topology, consumed: int) -> GlobalBatchSampler:
        p = self.trainer.cfg.parallel
        return GlobalBatchSampler(
            self.data.train,
            global_batch_size=p.global_batch_size,
            micro_batch_size=p.micro_batch_size,
            dp=topo.dp,
            dp_rank=topo.dp_rank,
            consumed_samples=consumed,
        )

    def _val_batches(self, topo: Topology, micro_batch_size: int) -> list:
        val = GlobalBatchSampler(
            self.data.val,
            global_batch_size=self.data.val_samples,
            micro_batch_size=micro_batch_size,
            dp=topo.dp,
            dp_rank=topo.dp_rank,
        )
        return [val.microbatches_at(0)]

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def evaluate(self) -> float:
        """Mean validation loss (nats/token) on the fixed validation set."""
        return self.trainer.evaluate(self.val_batches)

    # -- interface ----------------------------------------------------------
    @property
    def clock_s(self) -> float:
        raise NotImplementedError

    def train_step(self) -> tuple[StepResult, float]:
        """One optimizer step; returns the result and the step's clock seconds."""
        raise NotImplementedError

    def apply(self, strategy: Strategy) -> dict | None:
        """Switch to ``strategy``; return the switch record (``None`` if unchanged)."""
        raise NotImplementedError


class RealJob(Job):
    """The strategy's layout on the launched processes; wall clock (see module docstring).

    Attributes:
        measured_costs: the controller's switch-cost estimates before any switch,
            measured at start-up (max over ranks): ``"layout"``, the seconds to
            build this layout (process groups, model, DDP, optimizer), which is
            what a layout switch repeats before resharding; ``"batch"``, the
            seconds of a no-op batch switch.  Measured switches replace them.
    """

    def __init__(self, ctx: ConaContext, start: Strategy):
        super().__init__(ctx)
        cfg = ctx.cfg
        self.strategy = start
        lr, min_lr = self.lr_for(start)
        run_cfg = cstate.strategy_config(cfg, start, lr=lr, min_lr=min_lr)
        t0 = time.perf_counter()
        self.topo = initialize_layout(run_cfg)
        set_seed(cfg.train.seed)
        self.trainer = cstate.build_trainer(run_cfg, self.reference_batch)
        build_s = max_over_ranks([time.perf_counter() - t0])[0]
        batch_s = switch_batch(self.trainer, run_cfg).seconds
        self.measured_costs = {"layout": build_s, "batch": batch_s}
        # a resume's CONA state (:meth:`cona.run.Loop.state_dict`, saved under the
        # checkpoint's ``extra["cona"]``); empty on a fresh start or a fine-tune
        consumed, self.resume_state = load_start(cfg, self.trainer)
        self.probe.attach(self.trainer)
        self.sampler = self._sampler(self.topo, consumed)
        self.val_batches = self._val_batches(self.topo, start.micro_batch_size)
        self._t0 = time.perf_counter()
        self.fresh = True  # the first step after a (re)build is not a representative timing

    @property
    def is_logging_rank(self) -> bool:
        return self.topo.is_logging_rank

    @property
    def clock_s(self) -> float:
        return time.perf_counter() - self._t0

    def resume_clock(self, seconds: float) -> None:
        """Go on from a resumed run's clock: ``clock_s`` reads ``seconds`` now (the
        restart itself is not counted, as in :func:`jobruntime.loop.run`)."""
        self._t0 = time.perf_counter() - seconds

    def train_step(self) -> tuple[StepResult, float]:
        t0 = time.perf_counter()
        microbatches = self.probe.prepare(self.sampler.next())
        result = self.trainer.train_step(microbatches, self.probe.schedule_calls)
        dt = max_over_ranks([time.perf_counter() - t0])[0]  # identical controller inputs on all ranks
        self.fresh = False
        return result, dt

    def apply(self, strategy: Strategy) -> dict | None:
        """Switch in memory; ``cost_s`` is the wall time of this whole call (max over ranks)."""
        if strategy == self.strategy:
            return None
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        old, kind = self.strategy, switch_kind(self.strategy, strategy)
        lr, min_lr = self.lr_for(strategy)
        new_cfg = cstate.strategy_config(self.cfg, strategy, lr=lr, min_lr=min_lr)
        consumed = self.consumed_samples
        self.probe.detach()
        if kind == "layout":
            try:
                self.topo, report = switch_layout(
                    self, new_cfg, reference_batch=self.reference_batch, seed=self.cfg.train.seed
                )
            except RuntimeError as e:  # gloo/NCCL: a rank died or stalled inside the switch
                raise SwitchInterrupted(
                    f"CONA switch {old.label} -> {strategy.label} interrupted: "
                    f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__}"
                    "; a rank was lost") from None  # train.py adds whether it can resume
        else:
            report = switch_batch(self.trainer, new_cfg)
        self.probe.attach(self.trainer)
        self.sampler = self._sampler(self.topo, consumed)
        self.val_batches = self._val_batches(self.topo, strategy.micro_batch_size)
        self.strategy, self.fresh = strategy, True
        cost = max_over_ranks([time.perf_counter() - t0])[0]
        return {
            **report.to_dict(),
            "from": old.label,
            "to": strategy.label,
            "cost_s": cost,
            "switch_s": cost,
            "reshard_s": report.seconds,
            "lr": lr,
        }


class EmulatedJob(DirectProbes, Job):
    """The proxy at the proxy batch the strategy's global batch stands for; modelled clock.

    ``track_gns=False``: no online noise-scale estimate (:meth:`_attach_probe`).

    Normally one process.  Launched on ``W`` processes (torchrun), the proxy
    runs data-parallel over them (DP = ``W``, each proxy batch must be a
    multiple of ``W``): only the wall time changes, not the trajectory's
    mathematics or the clock.
    """

    def __init__(self, ctx: ConaContext, start: Strategy, lr_factor: float = 1.0,
                 track_gns: bool = True):
        super().__init__(ctx, lr_factor)
        self.track_gns = track_gns
        self.cluster = ctx.cluster
        self.strategy = start
        self._clock = 0.0
        self.world = dist.get_world_size()
        run_cfg = self._proxy_cfg(start)
        self.topo = initialize_layout(run_cfg)
        set_seed(ctx.cfg.train.seed)
        self.trainer = cstate.build_trainer(run_cfg, self.reference_batch)
        consumed = 0
        if ctx.warm is not None:  # every method from the same warm state (cona/warm.py)
            cstate.restore(self.trainer, ctx.warm["trainer"])
            # under this config's betas, the warm moments' estimates carried over
            t = run_cfg.train
            cstate.set_adam_betas(self.trainer, (t.adam_beta1, t.adam_beta2))
            # the warm run's schedule position, at this strategy's peak LR
            cstate.set_peak_lr(self.trainer, self.trainer.scheduler, run_cfg.train.lr,
                               run_cfg.train.min_lr)
            consumed = ctx.warm["consumed_samples"]
            # the warm run trained at the preset's batch and LR (cona/warm.py)
            self.start_lr = (ctx.cfg.train.lr, ctx.cfg.train.min_lr)
        else:  # a checkpoint's weights, if given (JobConfig refuses a resume here)
            consumed, _ = load_start(ctx.cfg, self.trainer)
        self._attach_probe()
        self.sampler = self._sampler(self.topo, consumed)
        self.val_batches = self._val_batches(self.topo, ctx.val_micro_batch)

    def _attach_probe(self) -> None:
        """Feed :attr:`gns` from every step, unless ``track_gns`` is off: a run nothing
        reads the online estimate of (static baselines, the oracle's branches) skips
        the per-micro-batch gradient copies and norms (~30 % of a proxy step)."""
        if self.track_gns:
            self.probe.attach(self.trainer)

    def _proxy_cfg(self, strategy: Strategy) -> JobConfig:
        lr, min_lr = self.lr_for(strategy)
        gb, w = self.proxy_batch(strategy), self.world
        if gb % w:
            raise ValueError(
                f"emulated CONA on {w} processes needs proxy global batches divisible by {w}; "
                f"{strategy.label} (proxy batch {gb}) is not (launch fewer processes or set "
                "cona.global_batch_sizes)"
            )
        mb = proxy_micro_batch_size(gb // w, self.cfg.parallel.micro_batch_size)
        proxy = Strategy(w, 1, 1, mb, gb)
        return cstate.strategy_config(self.cfg, proxy, lr=lr, min_lr=min_lr)

    @property
    def clock_s(self) -> float:
        return self._clock

    @property
    def is_logging_rank(self) -> bool:
        return self.topo.is_logging_rank

    def train_step(self) -> tuple[StepResult, float]:
        microbatches = self.probe.prepare(self.sampler.next())
        result = self.trainer.train_step(microbatches, self.probe.schedule_calls)
        dt = self.cluster.iter_s(self.strategy)
        self._clock += dt
        return result, dt

    def set_strategy(self, strategy: Strategy) -> None:
        """Train the proxy at ``strategy``'s batch from now on, without charging the clock
        (the oracle chain charges its own modelled costs)."""
        if strategy == self.strategy:
            return
        consumed = self.consumed_samples
        self.probe.detach()
        switch_batch(self.trainer, self._proxy_cfg(strategy))
        self._attach_probe()
        self.sampler = self._sampler(self.topo, consumed)
        self.strategy = strategy

    def apply(self, strategy: Strategy) -> dict | None:
        """Switch; the clock is charged the cluster's modelled cost (what the controller
        was told it would cost)."""
        if strategy == self.strategy:
            return None
        old = self.strategy
        cost = self.cluster.switch_s(old, strategy)
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            self.set_strategy(strategy)
            measured = time.perf_counter() - t0
        self._clock += cost
        return {
            "from": old.label,
            "to": strategy.label,
            "kind": switch_kind(old, strategy),
            "cost_s": cost,
            "switch_s": cost,
            "proxy_switch_s": measured,
            "peak_rss_mib": rss.peak / 2**20,
            "lr": self.trainer.scheduler.max_lr,
        }

    # -- in-memory branching (oracle chain) ---------------------------------
    def snapshot(self) -> dict:
        """Everything needed to resume from here: model, optimizer, schedule, data, clock, GNS."""
        return {
            "trainer": cstate.snapshot(self.trainer),
            "strategy": self.strategy,
            "consumed": self.consumed_samples,
            "clock": self._clock,
            "gns": self.gns.state_dict(),
        }

    def restore(self, snap: dict) -> None:
        """Go back to a :meth:`snapshot` (bit-for-bit continuation)."""
        self.probe.detach()
        if snap["strategy"] != self.strategy:
            switch_batch(self.trainer, self._proxy_cfg(snap["strategy"]))
            self.strategy = snap["strategy"]
        cstate.restore(self.trainer, snap["trainer"])
        self.trainer.scheduler.global_batch_size = self.proxy_batch(self.strategy)
        self._attach_probe()
        self.sampler = self._sampler(self.topo, snap["consumed"])
        self._clock = snap["clock"]
        self.gns.load_state_dict(snap["gns"])
