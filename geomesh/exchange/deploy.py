"""Where a process sits in a GeoMesh run: its worker(s), its shard, its groups.

Emulated mode: one process (world size 1) plays every worker, one after the
other; all workers are TP=PP=1 proxies.

Real mode: every worker is ``num_gpus`` processes (``tp · pp · dp_in``).  Either
each region runs its own job (``geomesh.region`` names it) as a torchft replica
group whose only link to the others is its leader's membership
(:mod:`geomesh.exchange.region`: quorum, healing, the exchange), with the torchft
lighthouse at the cluster's ``rendezvous`` (:func:`place_region`, :func:`join_region`); regions may
then differ in ``tp``, ``pp`` and replicas, since messages are canonical
(:mod:`geomesh.wire.canonical_codec`).  Or one ``torchrun`` runs the whole cluster as
one ``torch.distributed`` world (one failure domain: a lost process stops the
run; workers of one shape).  The rest of this docstring is about the second.

Ranks follow megatron's default order (TP fastest, then DP, then PP), with the
DP axis split into ``workers × dp_in``::

    rank(k, t, d, p) = t + tp·(k·dp_in + d) + tp·(K·dp_in)·p

so megatron's ``parallel_state`` with ``tp`` and ``pp`` sees DP = ``K · dp_in``
and each worker is a contiguous slice of its DP axis.  Groups built here (every
rank creates every group, in one fixed order, as ``torch.distributed`` needs):

* ``dp_group`` — a worker's own replicas (same t, p; its ``dp_in`` ranks): the
  inner trainer's DDP all-reduces gradients over this group only, never across
  workers (megatron's DP group would average the workers into one model);
* ``tp_group`` — a worker's TP ranks (for the layout-independent sign scale);
* ``worker_group`` — all ranks of a worker: its ranks all-gather their
  canonical parts into the worker's message (:meth:`Placement.collect`), and
  its leader ``(t, d, p) = 0`` broadcasts the round's messages to them
  (:meth:`Placement.share`);
* ``exchange group`` — the leaders of all workers, in worker order: the outer
  exchange (:mod:`geomesh.exchange.transport`, hierarchical over regions) carries whole
  worker messages.

One world needs equal ``(tp, pp, num_gpus)`` across workers (one job per
region does not).
"""

from __future__ import annotations

import copy
import logging
import os
import secrets
import struct
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from jobruntime import cpu_compat
from jobruntime.config import JobConfig
from jobruntime.parallel import Topology, init_distributed, initialize_layout

from ..fleet.cluster import ClusterError, ClusterSpec
from ..fleet.job_check import check_world, job_worker_shape
from ..wire.canonical_codec import join_parts
from ..wire.envelope import Opener, load_secret
from .transport import (
    TorchDistributedTransport,
    TransportGroups,
    build_transport_groups,
    decode_bundle,
    encode_bundle,
)

log = logging.getLogger(__name__)
# before a region's message: its worker's mean loss and compute seconds, and flags
_STATS = struct.Struct("<ddB")
STOP = 1
"""Flag: the sender's evaluation reached ``train.target_ppl`` under ``train.stop_at_target``;
every region stops after the round whose messages carry it (:meth:`geomesh.sync.OuterLoop.finish`)."""

if TYPE_CHECKING:
    from .membership import Membership
    from .region import RegionMembership


@dataclass
class Placement:
    """This process's part of the run.

    Attributes:
        workers: indices of the workers this process trains (emulated: all).
        rank / world: global rank and size (emulated: 0 / 1).
        job_rank: rank inside this process's own ``torchrun`` (0 = job leader).
        tp_rank, pp_rank, dp_in_rank: shard position inside the worker.
        dp_in: replicas per worker.
        dp_group, tp_group: see the module docstring (``None`` in emulated mode).
        transport: the outer exchange of this shard (``None`` for replicas
            ``dp_in_rank > 0`` and in emulated mode).
        job_group, job_src: the ranks of this process's own ``torchrun`` and
            the global rank of its first process (``None`` / 0: one job spans
            the world).
    """

    mode: str
    workers: list[int]
    rank: int = 0
    world: int = 1
    job_rank: int = 0
    tp_rank: int = 0
    pp_rank: int = 0
    dp_in_rank: int = 0
    dp_in: int = 1
    topology: Topology | None = None
    dp_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    transport: TorchDistributedTransport | None = None
    store: dist.Store | None = field(default=None, repr=False)
    job_group: dist.ProcessGroup | None = None
    job_src: int = 0
    membership: RegionMembership | None = field(default=None, repr=False)
    """One job per region: the region's torchft membership (:mod:`geomesh.exchange.region`)."""
    worker_group: dist.ProcessGroup | None = None
    """All ranks of this worker (``None``: one rank, or emulated)."""
    leader_rank: int = 0
    """Global rank of this worker's leader (``t = d = p = 0``)."""
    mp_group: dist.ProcessGroup | None = None
    """This replica's model-parallel ranks (TP x PP; megatron's model-parallel group)."""
    layout_shape: tuple[int, int, int] = (1, 1, 1)
    """``(tp, pp, dp)`` of this worker."""
    per_region: bool = False
    """One job per region (:func:`place_region`)."""
    ft_leader: Membership | None = field(default=None, repr=False)
    """One job per region, rank 0: the torchft membership that :attr:`membership` wraps."""
    rows: list[list[float]] = field(default_factory=list, repr=False)
    healed: bool = False
    """The last exchange healed this worker from a live peer (its message was not sent)."""
    stop_requests: list[int] = field(default_factory=list)
    """One job per region: the workers whose message of the last exchange carried
    :data:`STOP` (the same on every rank of every region: all see the same messages)."""

    @property
    def is_logging_rank(self) -> bool:
        """Writes metrics: the first process of every job (all hold the same numbers)."""
        return self.job_rank == 0

    def collect(self, part: bytes | None) -> bytes:
        """The worker's message from its ranks' canonical parts (``None``: a DP
        replica's, which repeats DP rank 0's): an all-gather over ``worker_group``, so
        every rank holds its own worker's message (:func:`~geomesh.wire.canonical_codec.join_parts`)."""
        if self.worker_group is None or dist.get_world_size(self.worker_group) == 1:
            return join_parts([part])
        parts: list = [None] * dist.get_world_size(self.worker_group)
        dist.all_gather_object(parts, part, group=self.worker_group)
        return join_parts([p for p in parts if p is not None])

    def exchange(self, message: bytes, *, stats: tuple[float, float] = (0.0, 0.0),
                 stop: bool = False, quorum_done: bool = False) -> list[bytes | None]:
        """One job per region: the round's messages of every worker, over torchft.

        ``None`` for workers absent from the round (lost, joining, or whose
        message was rejected); ``stats`` (the worker's mean loss and compute
        seconds) ride along for :meth:`gather_rows`, ``stop`` as :data:`STOP`
        (read back into :attr:`stop_requests`), and :attr:`healed` tells
        whether this worker healed instead of sending.
        """
        x0 = time.perf_counter()
        body = None if quorum_done else _STATS.pack(*stats, STOP if stop else 0) + message
        out = self.membership.exchange(body, quorum_done=quorum_done)
        self.healed = self.membership.healed
        self._ft_rows(out, time.perf_counter() - x0)
        return [None if m is None else m[_STATS.size:] for m in out]

    def gather(self, messages: dict[int, bytes]) -> bytes | None:
        """The leaders' all-gather of worker messages (other ranks: nothing); may run in
        a background thread (overlapped rounds): it uses only the transport's groups.
        Not for one job per region (its exchange is :meth:`exchange`)."""
        return encode_bundle(self.transport.exchange(messages)) if self.transport is not None else None

    def share(self, data: bytes | None) -> list[bytes]:
        """Give :meth:`gather`'s result to this worker's ranks (over ``worker_group``); decode."""
        if self.worker_group is not None and dist.get_world_size(self.worker_group) > 1:
            box = [data]
            dist.broadcast_object_list(box, src=self.leader_rank, group=self.worker_group)
            data = box[0]
        return decode_bundle(data)

    def _ft_rows(self, out: list[bytes | None], exchange_s: float) -> None:
        """Rows of :meth:`gather_rows` and :attr:`stop_requests` from the messages' stats."""
        rows, self.stop_requests = [], []
        for k, m in enumerate(out):
            if m is not None and len(m) >= _STATS.size:
                loss, compute, flags = _STATS.unpack_from(m)
                rows.append([k, loss, compute, exchange_s, len(m) - _STATS.size, 0.0])
                if flags & STOP:
                    self.stop_requests.append(k)
        self.rows = rows

    def gather_rows(self, row: list[float], fp32_bytes: int) -> list[list[float]]:
        """Per-rank round statistics ``[worker, loss, compute_s, exchange_s, sent, fp32]``.

        One world: an all-gather of every rank's ``row``.  One job per region:
        the rows of the workers present this round, from their messages' stats
        (every rank of the job decoded the same messages; another worker's
        exchange time is not sent: this worker's own stands in for it).
        """
        if self.membership is None:
            return world_gather(row)
        return [r[:5] + [fp32_bytes if r[4] else 0] for r in self.rows]


def global_rank(k: int, t: int, d: int, p: int, *, tp: int, dp_in: int, num_workers: int) -> int:
    """Global rank of worker ``k``'s process at TP rank ``t``, replica ``d``, stage ``p``."""
    return t + tp * (k * dp_in + d) + tp * (num_workers * dp_in) * p


def place_region(cfg: JobConfig, cluster: ClusterSpec) -> tuple[Placement, JobConfig]:
    """One job per region: this job's own world and megatron's layout (its torchft
    membership follows, :func:`join_region`).

    The region's worker runs at its own ``(tp, pp, dp)`` (the cluster file's
    ``tp``, ``pp`` and ``num_gpus``), whatever the other regions run
    (:mod:`geomesh.exchange.region`).

    Returns:
        ``(placement, layout_cfg)`` as :func:`place_real`.

    The region, its one worker, the secret and the process count were checked before
    (:func:`geomesh.fleet.job_check.check_job`).
    """
    g = cfg.geomesh
    tp, pp, dp_in = job_worker_shape(cluster, g.region)  # checked: geomesh.fleet.job_check
    worker = cluster.workers_in(g.region)[0]
    k = cluster.worker_index(worker.name)
    init_distributed(g.timeout_s)
    check_world(cluster, g.region, dist.get_world_size())  # the group's own size
    layout = copy.deepcopy(cfg)
    layout.parallel.tp, layout.parallel.pp = tp, pp
    check = copy.deepcopy(layout)
    check.parallel.micro_batch_size, check.parallel.global_batch_size = 1, dp_in
    topo = initialize_layout(check)
    from megatron.core import parallel_state as ps

    pl = Placement(mode="real", workers=[k], rank=dist.get_rank(), world=dist.get_world_size(),
                   job_rank=dist.get_rank(), tp_rank=topo.tp_rank, pp_rank=topo.pp_rank,
                   dp_in_rank=topo.dp_rank, dp_in=dp_in, topology=topo,
                   dp_group=ps.get_data_parallel_group(),
                   tp_group=ps.get_tensor_model_parallel_group(),
                   mp_group=ps.get_model_parallel_group(),
                   worker_group=dist.group.WORLD if dist.get_world_size() > 1 else None,
                   leader_rank=0, layout_shape=(tp, pp, dp_in), per_region=True)
    return pl, layout


def join_region(pl: Placement, cfg: JobConfig, cluster: ClusterSpec, tokenizer) -> None:
    """The region's leader joins the run's torchft membership (``pl.ft_leader``).

    Called once the job's tokenizer exists: its messages are bound to the run
    identity (:mod:`geomesh.exchange.run_identity`), which covers the tokenizer, so a
    region whose settings differ from the others' is told which ones
    (:meth:`geomesh.sync.OuterLoop.refuse_other_start`) instead of training alone.

    Raises:
        ClusterError / ConfigError: no lighthouse at the cluster's ``rendezvous``.
    """
    if pl.job_rank != 0:
        return
    from .membership import Membership
    from .run_identity import PARTS, run_identity, shared_settings

    g = cfg.geomesh
    host, port = cluster.rendezvous_host_port
    run = run_identity(shared_settings(cfg, cluster, tokenizer))
    log.info("GeoMesh run identity %016x (one byte per part: %s)", run, ", ".join(PARTS))
    pl.ft_leader = Membership(
        cluster, pl.workers[0], shard=0, num_shards=1, lighthouse=f"http://{host}:{port}",
        store_addr=os.environ["MASTER_ADDR"], store_port=int(os.environ["MASTER_PORT"]),
        opener=Opener(load_secret(g.secret_file), run), timeout_s=g.timeout_s,
        heartbeat_s=g.heartbeat_s, on_worker_loss=g.on_worker_loss, report=True)


def place_emulated() -> Placement:
    """World of one process that plays every worker (callers build the layout)."""
    init_distributed()
    if dist.get_world_size() != 1:
        raise ClusterError(
            f"emulated mode plays every worker in one process, but {dist.get_world_size()} were "
            "launched; run it without torchrun (or with --nproc-per-node 1)"
        )
    return Placement(mode="emulated", workers=[])


def place_real(cfg: JobConfig, cluster: ClusterSpec) -> tuple[Placement, JobConfig]:
    """Join (or start) the real-mode world, build megatron's layout and GeoMesh's groups.

    Returns:
        ``(placement, layout_cfg)``: ``layout_cfg`` is ``cfg`` with the workers'
        ``tp``/``pp`` (the config each worker's trainer is built from).

    Raises:
        ClusterError: a region did not join in time (the layout and the process count
            were checked before: :func:`geomesh.fleet.job_check.check_job`).
    """
    if cfg.geomesh.region is not None:
        return place_region(cfg, cluster)
    tp, pp, dp_in = job_worker_shape(cluster, None)
    K = len(cluster.workers)
    init_distributed(cfg.geomesh.timeout_s)
    rank, world, job_rank = dist.get_rank(), dist.get_world_size(), dist.get_rank()
    check_world(cluster, None, world)  # the group's own size (WORLD_SIZE was checked before)
    layout = copy.deepcopy(cfg)
    layout.parallel.tp, layout.parallel.pp = tp, pp
    # initialize_layout validates the batch against megatron's DP (= K·dp_in);
    # workers set their own batch sizes later, so validate with a neutral one.
    check = copy.deepcopy(layout)
    check.parallel.micro_batch_size, check.parallel.global_batch_size = 1, K * dp_in
    topo = initialize_layout(check)
    k, d = divmod(topo.dp_rank, dp_in)
    if rank != global_rank(k, topo.tp_rank, d, topo.pp_rank, tp=tp, dp_in=dp_in, num_workers=K):
        raise RuntimeError("megatron's rank order is not TP-DP-PP; GeoMesh's groups would be wrong")
    from megatron.core import parallel_state as ps

    g = lambda k_, t_, d_, p_: global_rank(k_, t_, d_, p_, tp=tp, dp_in=dp_in, num_workers=K)  # noqa: E731
    pl = Placement(mode="real", workers=[k], rank=rank, world=world, job_rank=job_rank,
                   tp_rank=topo.tp_rank, pp_rank=topo.pp_rank, dp_in_rank=d, dp_in=dp_in,
                   topology=topo, mp_group=ps.get_model_parallel_group(),
                   leader_rank=g(k, 0, 0, 0), layout_shape=(tp, pp, dp_in))
    tout = timedelta(seconds=cfg.geomesh.timeout_s)
    for kk in range(K):  # every rank creates every group, in this order
        for p in range(pp):
            for t in range(tp):
                grp = dist.new_group([g(kk, t, dd, p) for dd in range(dp_in)], timeout=tout)
                if (kk, t, p) == (k, topo.tp_rank, topo.pp_rank):
                    pl.dp_group = grp
            for dd in range(dp_in):
                grp = dist.new_group([g(kk, t, dd, p) for t in range(tp)], timeout=tout)
                if (kk, dd, p) == (k, d, topo.pp_rank):
                    pl.tp_group = grp
        grp = dist.new_group(sorted(g(kk, t, dd, p) for t in range(tp) for dd in range(dp_in)
                                    for p in range(pp)), timeout=tout)
        if kk == k and tp * pp * dp_in > 1:
            pl.worker_group = grp
    # A nonce shared by all ranks keeps store keys of successive runs apart.
    box = [secrets.token_hex(4) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    leaders = [g(kk, 0, 0, 0) for kk in range(K)]
    grp = dist.new_group(leaders, timeout=tout)
    sub = build_transport_groups(cluster, leaders, timeout_s=cfg.geomesh.timeout_s)
    if rank == pl.leader_rank:
        pl.transport = TorchDistributedTransport(
            cluster, grp, store=None, timeout_s=cfg.geomesh.timeout_s,
            groups=sub if isinstance(sub, TransportGroups) else None, prefix=f"geomesh/{box[0]}")
    return pl, layout


def world_gather(values: list[float]) -> list[list[float]]:
    """All-gather a short float64 vector from every rank (rank order)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64, device=cpu_compat.device())
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]
