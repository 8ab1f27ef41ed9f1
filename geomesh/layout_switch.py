"""A region changes its layout (TP/PP/DP) at a round boundary; the exchange does not notice.

CONA inside GeoMesh (issue 22).  One job per region (``geomesh.region``) may
move its worker to another ``(tp, pp)`` between two rounds; ``dp`` follows
from its processes (``num_gpus / (tp·pp)``).  The user asks for it with
``cona.enabled=true`` and a schedule in ``cona.schedule``::

    cona.enabled=true
    cona.schedule=[{after_step: 1, region: West Europe, tp: 2, pp: 1}]

after outer step 1 (the metrics' ``step``) the region "West Europe" runs TP=2.
Every region reads the same config; only the named region switches, the
others keep decoding its messages, which are canonical
(:mod:`geomesh.wire.canonical_codec`) whatever layout sent them.

A *schedule*, not CONA's controller: the controller ranks (layout, global
batch) pairs by throughput x statistical efficiency, while in GeoMesh the
planner owns each region's batch ``b_i`` and steps ``H_i``; joining the two
is left for later.

On every rank of the region, at the boundary before round ``after_step``
(:meth:`RegionSwitch.apply`):

1. GeoMesh's per-shard state -- ``θ_global``, the outer Nesterov momentum, the
   error-feedback residuals and the workers' local momentum
   (``geomesh.compress_update``), all by local parameter name -- is turned
   into canonical pieces (:func:`geomesh.wire.canonical.main_pieces`; the DP rank 0
   replica contributes) and all-gathered over the region's job;
2. CONA's in-memory switch (:func:`cona.switch.switch_layout`): megatron's
   process groups rebuilt, a new model at the new layout, weights and the
   inner AdamW state resharded with megatron-core's
   ``resharding.swap_model_weights``; the trainer is GeoMesh's own (its LR
   schedule continues where it was, :func:`_geomesh_trainer`);
3. the placement's groups and ranks (``tp_group``, ``mp_group``,
   ``dp_group``, ``dp_in``, ``dp_in_rank``, ``layout_shape``), the layout map,
   the codec and the region membership's layout are rebuilt; each rank cuts
   its new shards out of the gathered pieces (:func:`geomesh.wire.canonical.assemble`).

The job's rank 0 stays rank 0, so the torchft member (and the leader of the
region's exchange) does not change; the world process group is kept.

Costs, stated: during the switch every rank of the region holds the whole
``θ_global`` and outer momentum (8 bytes per parameter) plus the residuals
(4 more with error feedback) on the host, as a healing leader does
(:mod:`geomesh.exchange.region`), and the old and new models coexist (CONA's switch).

Not supported (refused by :func:`geomesh.fleet.schedule.check_schedule`): a schedule in emulated mode
(every emulated worker is a TP1 proxy in one process) or with one torchrun for
the whole cluster; ``checkpoint.load`` with a schedule (a checkpoint holds
per-rank state of one layout).  A region that is relaunched after its switch
starts from the cluster file's layout.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from jobruntime import cpu_compat
from jobruntime.config import JobConfig
from jobruntime.trainer import Trainer

from .fleet.schedule import Switch, parse_schedule
from .outer import OuterNesterov
from .wire.canonical import Piece, Shard, assemble, layout_map, main_pieces
from .wire.canonical_codec import CanonicalCodec

log = logging.getLogger(__name__)


def _geomesh_trainer(cfg: JobConfig, module: torch.nn.Module, old: Trainer) -> Trainer:
    """A GeoMesh worker's trainer for ``module`` (the new layout): the worker's own
    step-counting LR schedule (:func:`geomesh.worker.worker_schedule`), continued at
    the old one's position and lengths (a re-plan may have resized them), its DDP
    over megatron's new DP group (the region's replicas)."""
    from megatron.core import parallel_state as ps

    new = Trainer(cfg, model=module, dp_group=ps.get_data_parallel_group())
    for k, v in old.scheduler.state_dict().items():
        setattr(new.scheduler, k, v)
    new.scheduler.step(0)  # recompute every param group's LR at that position
    new.lr_scale = old.lr_scale
    return new


def _pieces(layout: Mapping[str, Shard], named: Mapping[str, torch.Tensor],
            contributes: bool) -> list[Piece]:
    if not contributes or not named:
        return []
    return [(k, o, t.detach().float().cpu()) for k, o, t in main_pieces(layout, named)]


def gather_state(layout: Mapping[str, Shard], state: Mapping[str, Mapping[str, torch.Tensor]],
                 *, contributes: bool) -> dict[str, list[Piece]]:
    """Every rank's main pieces of each named tensor dict in ``state``, all-gathered
    over the job's world (a collective: every rank of the region calls it).

    Args:
        layout: this rank's ``{local name: Shard}``.
        state: ``{part: {local name: tensor}}`` (e.g. ``"theta"``, ``"momentum"``); an
            empty dict (a buffer not yet created) stays empty.
        contributes: this rank's shards go in (DP rank 0; replicas hold equal copies).

    Returns:
        ``{part: pieces}`` of the whole region, on the host.
    """
    mine = {part: _pieces(layout, named, contributes) for part, named in state.items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, mine)
    return {part: [p for other in parts for p in other[part]] for part in state}


def cut(layout: Mapping[str, Shard], pieces: list[Piece], what: str, device=None
        ) -> dict[str, torch.Tensor]:
    """This rank's shards of ``layout`` from the region's pieces (empty: empty)."""
    if not pieces:
        return {}
    out = assemble(layout, pieces, what=f"layout switch ({what})")
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


class RegionSwitch:
    """This region's scheduled layout switches (module docstring).

    Args:
        ctx: the run (:class:`geomesh.context.RunContext`) of one job per region.
        switches: this region's :class:`Switch` entries.
    """

    def __init__(self, ctx, switches: list[Switch]) -> None:
        self.ctx = ctx
        self.by_step = {s.after_step: s for s in switches}
        self.reports: list[dict] = []
        """Measured cost of each switch done (wall seconds of the whole switch, CONA's
        resharding seconds and peak RSS in MiB; max over the region's ranks)."""

    @classmethod
    def for_run(cls, ctx) -> RegionSwitch | None:
        """The switches of this job's region, or ``None`` (no schedule, or none for it)."""
        region = ctx.cfg.geomesh.region
        mine = [s for s in parse_schedule(ctx.cfg) if s.region == region]
        return cls(ctx, mine) if mine and ctx.placement.per_region else None

    def at_boundary(self, loop) -> None:
        """Before round ``loop.r`` (0-based: after outer step ``loop.r``): switch if one
        is scheduled (:meth:`apply`), else nothing.  Every rank of the region calls it."""
        sw = self.by_step.get(loop.r)
        if sw is not None:
            self.apply(sw, loop)

    def apply(self, sw: Switch, loop) -> None:
        """Switch this region to ``sw``'s layout (a collective over the region's job).

        Args:
            sw: the switch.
            loop: the :class:`geomesh.sync.OuterLoop`; its ``theta`` (θ_global),
                ``outer``, ``layout``, ``codec``, ``val``, ``pred`` and ``steps`` are
                replaced by the new layout's; its workers' trainers (CONA's switch),
                error-feedback residuals and local momentum are moved in place.

        Raises:
            RuntimeError: a collective failed (a rank of the region was lost).
            ValueError: the gathered pieces do not cover the new shards (a bug).
        """
        from megatron.core import parallel_state as ps

        from cona.switch import max_over_ranks, switch_layout

        ctx, pl, cfg = self.ctx, self.ctx.placement, self.ctx.cfg
        t0 = time.perf_counter()
        old_shape = pl.layout_shape
        outer = loop.outer
        state = {"theta": outer.params, "momentum": outer.momentum_buffer}
        for i, fb in loop.feedback.items():
            state[f"feedback{i}"] = fb.residuals
        for i, m in loop.local_mom.items():
            state[f"local_momentum{i}"] = m.buffers
        pieces = gather_state(loop.layout, state, contributes=pl.dp_in_rank == 0)
        dp = pl.world // (sw.tp * sw.pp)
        topo = rep = None
        for w in loop.workers.values():
            new_cfg = copy.deepcopy(w.cfg)
            new_cfg.parallel.tp, new_cfg.parallel.pp = sw.tp, sw.pp
            # megatron's layout check needs a batch its DP divides; the worker sets
            # its own batch before every step
            new_cfg.parallel.micro_batch_size, new_cfg.parallel.global_batch_size = 1, dp
            topo, rep = switch_layout(w, new_cfg, seed=cfg.train.seed, build=_geomesh_trainer)
            w.cfg.parallel.tp, w.cfg.parallel.pp = sw.tp, sw.pp
            w.dp_in, w.dp_in_rank = topo.dp, topo.dp_rank
        pl.tp_rank, pl.pp_rank, pl.dp_in_rank, pl.dp_in = (topo.tp_rank, topo.pp_rank,
                                                            topo.dp_rank, topo.dp)
        pl.topology, pl.layout_shape = topo, (sw.tp, sw.pp, topo.dp)
        pl.dp_group = ps.get_data_parallel_group()
        pl.tp_group = ps.get_tensor_model_parallel_group()
        pl.mp_group = ps.get_model_parallel_group()
        ctx.layout_cfg.parallel.tp, ctx.layout_cfg.parallel.pp = sw.tp, sw.pp
        layout = layout_map(loop.first.trainer.module)
        device = cpu_compat.device()
        theta = cut(layout, pieces["theta"], "θ_global", device)
        new_outer = OuterNesterov(theta, lr=outer.lr, momentum=outer.momentum,
                                  nesterov=outer.nesterov, momentum_warmup=outer.momentum_warmup)
        new_outer.step_count = outer.step_count
        new_outer.momentum_buffer.update(cut(layout, pieces["momentum"], "outer momentum", device))
        for i, fb in loop.feedback.items():  # host memory, as ErrorFeedback keeps them
            fb.residuals = cut(layout, pieces[f"feedback{i}"], "error feedback")
        for i, m in loop.local_mom.items():
            m.buffers = cut(layout, pieces[f"local_momentum{i}"], "local momentum", device)
        g = cfg.geomesh
        loop.codec = CanonicalCodec(loop.codec.kind, layout, loop.codec.schema,
                                    tp_group=pl.tp_group, mp_group=pl.mp_group, k=g.topk_k,
                                    bits=g.topk_bits)
        if pl.membership is not None:  # healing state is cut from this layout from now on
            pl.membership.layout = dict(layout)
            pl.membership.contributes = pl.dp_in_rank == 0
        loop.theta, loop.outer, loop.layout = theta, new_outer, layout
        if "predictor" in loop.pred:  # sign_pred predicts from the outer momentum
            loop.pred = {"predictor": new_outer.momentum_buffer}
        loop.val = ctx.val_batches(dp=pl.dp_in, dp_rank=pl.dp_in_rank)
        # the round's batches (all replicas) are kept; micro-batches follow the new DP
        loop.steps = [dataclasses.replace(s, dp_in=pl.dp_in) for s in loop.steps]
        seconds = max_over_ranks([time.perf_counter() - t0])[0]
        self.reports.append({"after_step": sw.after_step,
                             "from": dict(zip(("tp", "pp", "dp"), old_shape)),
                             "to": {"tp": sw.tp, "pp": sw.pp, "dp": topo.dp}, "seconds": seconds,
                             "reshard_s": rep.seconds, "peak_rss_mib": rep.peak_rss_mib})
        log.info("after outer step %d: region %s switched (tp, pp, dp) %s -> %s in %.2f s",
                 sw.after_step, sw.region, old_shape, pl.layout_shape, seconds)
