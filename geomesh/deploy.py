"""Where a process sits in a GeoMesh run: its worker(s), its shard, its groups.

Emulated mode: one process (world size 1) plays every worker, one after the
other; all workers are TP=PP=1 proxies.

Real mode: every worker is ``num_gpus`` processes (``tp · pp · dp_in``).  Either
one ``torchrun`` runs the whole cluster as one ``torch.distributed`` world
(one failure domain: a lost process stops the run), or each region runs its
own job (``geomesh.region`` names it) as a torchft replica group whose only
link to the others is :mod:`geomesh.membership` (quorum, healing, the
exchange), with the torchft lighthouse at the cluster's ``rendezvous``
(:func:`place_region`).  The rest of this docstring is about the first.

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
* ``exchange group`` — the same shard ``(t, p, d=0)`` of every worker, one rank
  per worker in worker order: the outer exchange runs per shard, each TP/PP
  rank sending its own shard's pseudo-gradient.  Replicas ``d > 0`` receive
  the round's messages from ``d = 0`` by a broadcast over ``dp_group``.

Only equal ``(tp, pp, num_gpus)`` across workers are supported in real mode.
"""

from __future__ import annotations

import copy
import dataclasses
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

from .cluster import ClusterError, ClusterSpec
from .envelope import Opener, load_secret, run_id
from .transport import (
    TorchDistributedTransport,
    TransportGroups,
    build_transport_groups,
    decode_bundle,
    encode_bundle,
)

log = logging.getLogger(__name__)
_STATS = struct.Struct("<dd")  # a worker's mean loss and compute seconds, before its message

if TYPE_CHECKING:
    from .membership import Membership


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
    membership: Membership | None = field(default=None, repr=False)
    """One job per region: this rank's torchft membership (:mod:`geomesh.membership`)."""
    rows: list[list[float]] = field(default_factory=list, repr=False)
    healed: bool = False
    """The last exchange healed this worker from a live peer (its message was not sent)."""

    @property
    def is_logging_rank(self) -> bool:
        """Writes metrics: the first process of every job (all hold the same numbers)."""
        return self.job_rank == 0

    def exchange(self, messages: dict[int, bytes], *, stats: tuple[float, float] = (0.0, 0.0),
                 quorum_done: bool = False) -> list[bytes | None]:
        """Real mode: this shard's all-gather over workers, shared with replicas.

        One job per region: ``None`` for workers absent from the round (lost,
        joining, or whose message was rejected); ``stats`` (the worker's mean
        loss and compute seconds) ride along for :meth:`gather_rows`, and
        :attr:`healed` tells whether this worker healed instead of sending.
        """
        if self.membership is not None:
            me = self.workers[0]
            body = None if quorum_done else _STATS.pack(*stats) + messages[me]
            x0 = time.perf_counter()
            out, self.healed = self.membership.exchange(self.membership.step, body,
                                                        quorum_done=quorum_done)
            self._ft_rows(out, time.perf_counter() - x0)
            return [None if m is None else m[_STATS.size:] for m in out]
        return self.share(self.gather(messages))

    def gather(self, messages: dict[int, bytes]) -> bytes | None:
        """The all-gather over workers (replicas ``d > 0``: nothing); may run in a
        background thread (overlapped rounds) — it uses only the transport's groups.
        Not for one job per region (its exchange is :meth:`exchange`)."""
        return encode_bundle(self.transport.exchange(messages)) if self.transport is not None else None

    def share(self, data: bytes | None) -> list[bytes]:
        """Give :meth:`gather`'s result to this worker's replicas (over ``dp_group``); decode."""
        if self.dp_in > 1:
            box = [data]
            src = dist.get_global_rank(self.dp_group, 0)
            dist.broadcast_object_list(box, src=src, group=self.dp_group)
            data = box[0]
        return decode_bundle(data)

    def _ft_rows(self, out: list[bytes | None], exchange_s: float) -> None:
        """Rows of :meth:`gather_rows` from the stats in the messages (padded to K per rank)."""
        rows = []
        for k, m in enumerate(out):
            if m is not None and len(m) >= _STATS.size:
                loss, compute = _STATS.unpack_from(m)
                n = len(m) - _STATS.size
                rows.append([k, loss, compute, exchange_s, n, 0.0])
            else:
                rows.append([-1.0] * 6)
        self.rows = rows

    def gather_rows(self, row: list[float], fp32_bytes: int) -> list[list[float]]:
        """Per-rank round statistics ``[worker, loss, compute_s, exchange_s, sent, fp32]``.

        One world: an all-gather of every rank's ``row``.  One job per region:
        the rows of the workers present this round, from their messages'
        stats, gathered over this job's shards (another worker's exchange time
        is not sent: this worker's own stands in for it).
        """
        if self.membership is None:
            return world_gather(row)
        mine = [list(r) for r in self.rows]
        for r in mine:
            if r[0] >= 0:
                r[5] = fp32_bytes if r[4] else 0
        flat = world_gather([x for r in mine for x in r])
        return [v[i:i + 6] for v in flat for i in range(0, len(v), 6) if v[i] >= 0]


def global_rank(k: int, t: int, d: int, p: int, *, tp: int, dp_in: int, num_workers: int) -> int:
    """Global rank of worker ``k``'s process at TP rank ``t``, replica ``d``, stage ``p``."""
    return t + tp * (k * dp_in + d) + tp * (num_workers * dp_in) * p


def _worker_shape(cluster: ClusterSpec) -> tuple[int, int, int]:
    shapes = {(w.tp, w.pp, w.num_gpus) for w in cluster.workers}
    if len(shapes) != 1:
        raise ClusterError(
            f"real mode needs the same tp, pp and num_gpus on every worker, cluster "
            f"'{cluster.name}' has {sorted(shapes)}; make the workers alike or use mode: emulated"
        )
    tp, pp, n = shapes.pop()
    return tp, pp, n // (tp * pp)


def place_region(cfg: JobConfig, cluster: ClusterSpec) -> tuple[Placement, JobConfig]:
    """One job per region: this job's own world, megatron's layout, and its torchft membership.

    Returns:
        ``(placement, layout_cfg)`` as :func:`place_real`.

    Raises:
        ClusterError / ConfigError: wrong region or process count, a region of
            several workers or replicas (not supported here), no secret, or no
            lighthouse at the cluster's ``rendezvous``.
    """
    g = cfg.geomesh
    try:
        cluster.region(g.region)
    except KeyError:
        raise ClusterError(
            f"geomesh.region={g.region!r} is not a region of cluster '{cluster.name}'; use one of "
            f"{[r.name for r in cluster.regions]}") from None
    members = cluster.workers_in(g.region)
    tp, pp, dp_in = _worker_shape(cluster)
    if len(members) != 1 or dp_in != 1:
        raise ClusterError(
            f"one job per region runs one worker without replicas (num_gpus = tp * pp); region "
            f"{g.region!r} of cluster '{cluster.name}' has {len(members)} worker(s) of "
            f"{dp_in} replica(s): split it into regions of one worker, or run the whole cluster "
            "with one torchrun (no geomesh.region)")
    secret = load_secret(g.secret_file)
    host, port = cluster.rendezvous_host_port
    k = cluster.worker_index(members[0].name)
    per_worker = tp * pp
    job_world = int(os.environ.get("WORLD_SIZE", "1"))
    if job_world != per_worker:
        raise ClusterError(
            f"region {g.region!r} has 1 worker of {per_worker} process(es); launch its torchrun "
            f"with {per_worker} processes, not {job_world}")
    init_distributed(g.timeout_s)
    layout = copy.deepcopy(cfg)
    layout.parallel.tp, layout.parallel.pp = tp, pp
    check = copy.deepcopy(layout)
    check.parallel.micro_batch_size, check.parallel.global_batch_size = 1, 1
    topo = initialize_layout(check)
    from megatron.core import parallel_state as ps

    pl = Placement(mode="real", workers=[k], rank=dist.get_rank(), world=dist.get_world_size(),
                   job_rank=dist.get_rank(), tp_rank=topo.tp_rank, pp_rank=topo.pp_rank,
                   dp_in=1, topology=topo, dp_group=ps.get_data_parallel_group(),
                   tp_group=ps.get_tensor_model_parallel_group())
    run = run_id(cluster.name, [w.name for w in cluster.workers], g.method, cfg.train.seed,
                 sorted(dataclasses.asdict(cfg.model).items()))
    from .membership import Membership

    pl.membership = Membership(
        cluster, k, shard=topo.tp_rank + tp * topo.pp_rank, num_shards=per_worker,
        lighthouse=f"http://{host}:{port}", store_addr=os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]), opener=Opener(secret, run),
        timeout_s=g.timeout_s, heartbeat_s=g.heartbeat_s, on_worker_loss=g.on_worker_loss,
        report=pl.is_logging_rank)
    return pl, layout


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
        ClusterError: layout or process count does not match the cluster, or a
            region did not join in time.
    """
    tp, pp, dp_in = _worker_shape(cluster)
    K = len(cluster.workers)
    store = None
    if cfg.geomesh.region is not None:
        return place_region(cfg, cluster)
    init_distributed(cfg.geomesh.timeout_s)
    rank, world, job_rank = dist.get_rank(), dist.get_world_size(), dist.get_rank()
    if world != K * tp * pp * dp_in:
        raise ClusterError(
            f"cluster '{cluster.name}' has {K} workers of {tp * pp * dp_in} process(es) = "
            f"{K * tp * pp * dp_in} ranks, but the world has {world}; launch that many processes"
        )
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
    pl = Placement(mode="real", workers=[k], rank=rank, world=world, job_rank=job_rank,
                   tp_rank=topo.tp_rank, pp_rank=topo.pp_rank, dp_in_rank=d, dp_in=dp_in,
                   topology=topo, store=store)
    g = lambda k_, t_, d_, p_: global_rank(k_, t_, d_, p_, tp=tp, dp_in=dp_in, num_workers=K)  # noqa: E731
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
    # A nonce shared by all ranks keeps store keys of successive runs apart.
    box = [secrets.token_hex(4) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    for p in range(pp):
        for t in range(tp):
            ranks = [g(kk, t, 0, p) for kk in range(K)]
            grp = dist.new_group(ranks, timeout=tout)
            sub = build_transport_groups(cluster, ranks, timeout_s=cfg.geomesh.timeout_s)
            if (t, p) == (topo.tp_rank, topo.pp_rank) and d == 0:
                pl.transport = TorchDistributedTransport(
                    cluster, grp, store=store, timeout_s=cfg.geomesh.timeout_s,
                    groups=sub if isinstance(sub, TransportGroups) else None,
                    prefix=f"geomesh/{box[0]}/t{t}p{p}",
                )
    return pl, layout


def world_gather(values: list[float]) -> list[list[float]]:
    """All-gather a short float64 vector from every rank (rank order)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64, device=cpu_compat.device())
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]
