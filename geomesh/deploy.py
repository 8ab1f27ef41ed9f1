"""Where a process sits in a GeoMesh run: its worker(s), its shard, its groups.

Emulated mode: one process (world size 1) plays every worker, one after the
other; all workers are TP=PP=1 proxies.

Real mode: every worker is ``num_gpus`` processes (``tp · pp · dp_in``), and
all workers' processes form one ``torch.distributed`` world — either one
``torchrun`` for the whole cluster, or one ``torchrun`` per region whose
processes join a common world at the cluster's ``rendezvous`` (a TCPStore
served by global rank 0; ``geomesh.region`` names the region a job plays).

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
import logging
import os
import secrets
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from jobruntime import cpu_compat
from jobruntime.config import JobConfig
from jobruntime.parallel import Topology, init_distributed, initialize_layout

from .cluster import ClusterError, ClusterSpec
from .transport import (
    TorchDistributedTransport,
    TransportGroups,
    build_transport_groups,
    decode_bundle,
    encode_bundle,
)

log = logging.getLogger(__name__)


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

    @property
    def is_logging_rank(self) -> bool:
        """Writes metrics: the first process of every job (all hold the same numbers)."""
        return self.job_rank == 0

    def exchange(self, messages: dict[int, bytes]) -> list[bytes]:
        """Real mode: this shard's all-gather over workers, shared with replicas."""
        return self.share(self.gather(messages))

    def gather(self, messages: dict[int, bytes]) -> bytes | None:
        """The all-gather over workers (replicas ``d > 0``: nothing); may run in a
        background thread (overlapped rounds) — it uses only the transport's groups."""
        return encode_bundle(self.transport.exchange(messages)) if self.transport is not None else None

    def share(self, data: bytes | None) -> list[bytes]:
        """Give :meth:`gather`'s result to this worker's replicas (over ``dp_group``); decode."""
        if self.dp_in > 1:
            box = [data]
            src = dist.get_global_rank(self.dp_group, 0)
            dist.broadcast_object_list(box, src=src, group=self.dp_group)
            data = box[0]
        return decode_bundle(data)


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


def _join_rendezvous(cfg: JobConfig, cluster: ClusterSpec, tp: int, pp: int, dp_in: int):
    """One ``torchrun`` per region: join the world at ``cluster.rendezvous``.

    Returns:
        ``(store, global_rank, world_size, job_rank)``.

    Raises:
        ClusterError: wrong region or process count, or regions that did not
            join within ``geomesh.timeout_s`` (named).
    """
    region = cfg.geomesh.region
    try:
        cluster.region(region)
    except KeyError:
        raise ClusterError(
            f"geomesh.region={region!r} is not a region of cluster '{cluster.name}'; use one of "
            f"{[r.name for r in cluster.regions]}"
        ) from None
    host, port = cluster.rendezvous_host_port
    per_worker = tp * pp * dp_in
    members = [cluster.worker_index(w.name) for w in cluster.workers_in(region)]
    job_world = int(os.environ.get("WORLD_SIZE", "1"))
    job_rank = int(os.environ.get("RANK", "0"))
    if job_world != len(members) * per_worker:
        raise ClusterError(
            f"region {region!r} has {len(members)} worker(s) of {per_worker} process(es); launch "
            f"torchrun with {len(members) * per_worker} processes there, not {job_world}"
        )
    k = members[job_rank // per_worker]
    local = job_rank % per_worker
    t, d, p = local % tp, (local // tp) % dp_in, local // (tp * dp_in)
    K = len(cluster.workers)
    rank = global_rank(k, t, d, p, tp=tp, dp_in=dp_in, num_workers=K)
    world = K * per_worker
    timeout = timedelta(seconds=cfg.geomesh.timeout_s)
    first_region = cluster.workers[0].region
    try:
        store = dist.TCPStore(host, port, None, rank == 0, timeout=timeout, wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - connect/bind errors differ by torch version
        raise ClusterError(
            f"GeoMesh rendezvous {host}:{port} did not answer within {cfg.geomesh.timeout_s:g} s "
            f"({type(e).__name__}); it is served by region {first_region!r} (worker "
            f"{cluster.workers[0].name}): start that region's torchrun, check host/port, or raise "
            "geomesh.timeout_s"
        ) from None
    store.set(f"join/{rank}", region)
    keys = [f"join/{r}" for r in range(world)]
    try:
        store.wait(keys, timeout)
    except Exception:  # noqa: BLE001
        missing = [r for r in range(world) if not store.check([f"join/{r}"])]
        if missing:
            per = tp * dp_in  # ranks of one worker per stage
            lost = sorted({(r % (tp * K * dp_in)) // per for r in missing})
            names = [cluster.workers[i].name for i in lost]
            regions = list(dict.fromkeys(cluster.workers[i].region for i in lost))
            raise ClusterError(
                f"GeoMesh: region(s) {regions} (workers {names}) did not join at {host}:{port} "
                f"within {cfg.geomesh.timeout_s:g} s; start their torchrun with "
                "geomesh.region=<name>, check that they can reach the rendezvous, or raise "
                "geomesh.timeout_s"
            ) from None
    return store, rank, world, job_rank


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
        cpu_compat.enable()
        store, rank, world, job_rank = _join_rendezvous(cfg, cluster, tp, pp, dp_in)
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group(
                backend=cpu_compat.backend(), store=dist.PrefixStore("world", store), rank=rank,
                world_size=world, timeout=timedelta(seconds=cfg.geomesh.timeout_s),
            )
    else:
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
    if cfg.geomesh.region is not None:  # one torchrun per region: its ranks form a job group
        for reg in cluster.regions:
            ks = [cluster.worker_index(w.name) for w in cluster.workers_in(reg.name)]
            if not ks:
                continue
            ranks = sorted(g(kk, t, dd, p) for kk in ks for t in range(tp)
                           for dd in range(dp_in) for p in range(pp))
            grp = dist.new_group(ranks, timeout=tout)
            if k in ks:
                pl.job_group, pl.job_src = grp, g(ks[0], 0, 0, 0)
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
    t = torch.tensor(values, dtype=torch.float64)
    if cpu_compat.backend() == "nccl":
        t = t.cuda()
    out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.cpu().tolist() for o in out]
