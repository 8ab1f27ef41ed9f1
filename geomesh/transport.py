"""Moving workers' messages: an all-gather of variable-length byte strings.

:meth:`Transport.exchange` takes the messages of the workers this process
plays (``{worker_index: bytes}``) and returns every worker's message, in
cluster worker order.  Emulated mode plays all workers in one process
(:class:`InProcessTransport`, which charges an :class:`EmulatedClock`); real
mode has one process per worker leader (:class:`TorchDistributedTransport`).
Only these classes and the clock differ between the modes.

Hierarchical collective (real mode, as modelled by :mod:`geomesh.clock`):

1. all-gather inside each region (intra-region group; skipped for a region
   with one worker);
2. all-gather of region bundles among the region leaders (first worker of
   each region) over the WAN;
3. broadcast of all messages from each leader to its region's members.

Variable lengths go over torch.distributed as: all-gather of the int64
lengths, then all-gather of uint8 buffers padded to the longest (CPU tensors
for gloo, CUDA tensors for NCCL).

Timeouts.  Before each exchange every worker sets an arrival key
``<prefix>/<round>/<worker>`` in a ``torch.distributed.Store`` and waits for
all others' keys with ``timeout_s``.  On timeout it checks which keys are
missing and raises :class:`RegionTimeoutError` naming those regions and
workers (a crashed, partitioned or hopelessly slow region), on every live
worker, with any backend.  Failures *during* the collectives fall under the
process group's own timeout (give ``init_process_group(timeout=...)`` about
``geomesh.timeout_s``); they are re-raised as :class:`TransportError` naming
the phase and region.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .clock import EmulatedClock, RoundSchedule
from .cluster import ClusterSpec

MessageLike = bytes | bytearray | memoryview | torch.Tensor

_BUNDLE_MAGIC = b"GMBD"


class TransportError(RuntimeError):
    """An exchange failed; the message names the phase and region."""


class RegionTimeoutError(TransportError, TimeoutError):
    """Some regions did not arrive at an exchange within the timeout.

    Attributes:
        regions: names of the regions with missing workers.
        workers: names of the missing workers.
    """

    def __init__(self, message: str, regions: list[str], workers: list[str]) -> None:
        super().__init__(message)
        self.regions = regions
        self.workers = workers


def as_bytes(msg: MessageLike) -> bytes:
    """bytes-like or 1-D uint8 tensor -> bytes."""
    if isinstance(msg, torch.Tensor):
        if msg.dtype != torch.uint8:
            raise TypeError(f"message tensors must be uint8, got {msg.dtype}")
        return msg.detach().reshape(-1).cpu().numpy().tobytes()
    return bytes(msg)


@dataclass
class WireBytes:
    """Payload bytes this process put on and took off the network, counted by the
    transport (the all-gather's padding to the longest message and its 8-byte
    lengths not included)."""

    sent: int = 0
    received: int = 0

    def gathered(self, mine: int, lengths: list[int]) -> None:
        """An all-gather: ``mine`` went to each of the others, their ``lengths`` came here."""
        self.sent += mine * (len(lengths) - 1)
        self.received += sum(lengths) - mine


def encode_bundle(messages: list[bytes]) -> bytes:
    """Concatenate messages: ``"GMBD" | count u32 | lengths u64[count] | payloads``."""
    head = _BUNDLE_MAGIC + struct.pack(f"<I{len(messages)}Q", len(messages), *map(len, messages))
    return head + b"".join(messages)


def decode_bundle(data: bytes) -> list[bytes]:
    """Inverse of :func:`encode_bundle`.

    Raises:
        TransportError: bad magic or lengths (a corrupted bundle).
    """
    if len(data) < 8 or data[:4] != _BUNDLE_MAGIC:
        raise TransportError("corrupted message bundle from a region leader (bad header)")
    (count,) = struct.unpack_from("<I", data, 4)
    off = 8 + 8 * count
    if len(data) < off:
        raise TransportError(
            f"corrupted message bundle: {count} lengths announced, {len(data)} bytes"
        )
    lengths = struct.unpack_from(f"<{count}Q", data, 8)
    if off + sum(lengths) != len(data):
        raise TransportError(
            f"corrupted message bundle: lengths sum to {sum(lengths)}, "
            f"payload has {len(data) - off} bytes"
        )
    out = []
    for n in lengths:
        out.append(bytes(data[off : off + n]))
        off += n
    return out


class Transport(ABC):
    """All-gather of one byte message per worker.

    Attributes:
        cluster: the cluster (worker order = message order).
        local_workers: worker indices this process sends for.
    """

    cluster: ClusterSpec
    local_workers: list[int]

    @abstractmethod
    def exchange(self, messages: Mapping[int, MessageLike]) -> list[bytes]:
        """Send this process's workers' messages; return all workers' messages.

        Args:
            messages: ``{worker_index: message}`` for exactly :attr:`local_workers`.

        Returns:
            ``len(cluster.workers)`` byte strings in worker order.

        Raises:
            ValueError: ``messages`` keys differ from :attr:`local_workers`.
            RegionTimeoutError / TransportError: see the module docstring.
        """

    def _check_local(self, messages: Mapping[int, MessageLike]) -> None:
        if sorted(messages) != sorted(self.local_workers):
            raise ValueError(
                f"exchange: got messages for workers {sorted(messages)}, "
                f"this process plays {sorted(self.local_workers)}"
            )


class InProcessTransport(Transport):
    """Emulated mode: all workers live in this process.

    Args:
        clock: charged for each exchange (:meth:`EmulatedClock.exchange`) if given.
        charged_bytes: bytes charged per message; ``None`` = actual lengths.  In
            emulated mode pass the *target* model's message size
            (:meth:`CanonicalCodec.message_bytes` of the target), since the proxy
            model's messages are much smaller.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        *,
        clock: EmulatedClock | None = None,
        charged_bytes: int | None = None,
    ) -> None:
        self.cluster = cluster
        self.local_workers = list(range(len(cluster.workers)))
        self.clock = clock
        self.charged_bytes = charged_bytes
        self.last_schedule: RoundSchedule | None = None
        self.bytes_sent = 0
        """Actual message bytes passed through (sum over workers and rounds)."""

    def exchange(self, messages: Mapping[int, MessageLike]) -> list[bytes]:
        self._check_local(messages)
        out = [as_bytes(messages[i]) for i in self.local_workers]
        self.bytes_sent += sum(map(len, out))
        if self.clock is not None:
            sizes = {
                w.name: (self.charged_bytes if self.charged_bytes is not None else len(m))
                for w, m in zip(self.cluster.workers, out)
            }
            self.last_schedule = self.clock.exchange(sizes)
        return out


@dataclass
class TransportGroups:
    """Sub-groups of the hierarchical exchange, as seen by one rank.

    Attributes:
        region: the intra-region group of this rank's region (``None`` for a
            one-worker region or a rank outside every group).
        leaders: the group of region leaders (``None`` if this rank is not a
            leader or there is one region).
    """

    region: dist.ProcessGroup | None = None
    leaders: dist.ProcessGroup | None = None


def build_transport_groups(
    cluster: ClusterSpec, leader_ranks: Sequence[int] | None = None, *, timeout_s: float = 600.0
) -> TransportGroups:
    """Create the intra-region groups and the region-leader group.

    Like megatron's ``initialize_model_parallel``, *every* rank of the default
    (world) group must call this, in the same order and with the same
    arguments: ``torch.distributed.new_group`` needs all ranks (its
    ``use_local_synchronization`` mode derives group names from a per-process
    group count, which differs between ranks that belong to different groups).

    Args:
        leader_ranks: global rank of each worker's leader process, in worker
            order (default ``0 .. len(workers) - 1``).

    Returns:
        The groups this rank belongs to.
    """
    ranks = list(leader_ranks) if leader_ranks is not None else list(range(len(cluster.workers)))
    if len(ranks) != len(cluster.workers):
        raise TransportError(f"{len(ranks)} leader ranks for {len(cluster.workers)} workers")
    me = dist.get_rank()
    tout = timedelta(seconds=timeout_s)
    out = TransportGroups()
    index = {w.name: i for i, w in enumerate(cluster.workers)}
    for r in cluster.regions:  # same order on every rank
        members = [ranks[index[w.name]] for w in cluster.workers_in(r.name)]
        if len(members) > 1:
            g = dist.new_group(members, timeout=tout)
            if me in members:
                out.region = g
    if len(cluster.regions) > 1:
        leaders = [ranks[index[cluster.leader_of(r.name).name]] for r in cluster.regions]
        g = dist.new_group(leaders, timeout=tout)
        if me in leaders:
            out.leaders = g
    return out


class TorchDistributedTransport(Transport):
    """Real mode: one process per worker (its leader rank) in ``group``.

    Group rank ``i`` plays worker ``i`` of the cluster.  The hierarchical
    exchange needs the sub-groups of :func:`build_transport_groups`; when
    ``group`` is the whole world (one process per worker) they are built here,
    so every rank must then construct its transports in the same order.

    Args:
        cluster: the cluster; ``len(cluster.workers)`` must equal the group size.
        group: process group of the worker leaders (default: the world).
        store: store for the arrival barrier (default: the default group's store).
        timeout_s: seconds to wait for all workers to arrive at an exchange.
        hierarchical: intra-region, then leaders, then broadcast (else one flat all-gather).
        groups: pre-built sub-groups (needed when ``group`` is not the world).
        prefix: store key prefix (distinct per transport object).

    Raises:
        TransportError: group size differs from the cluster, missing sub-groups,
            or no store is available.
    """

    def __init__(
        self,
        cluster: ClusterSpec,
        group: dist.ProcessGroup | None = None,
        *,
        store: dist.Store | None = None,
        timeout_s: float = 600.0,
        hierarchical: bool = True,
        groups: TransportGroups | None = None,
        prefix: str = "geomesh",
    ) -> None:
        self.cluster = cluster
        self.group = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(self.group)  # global rank of worker i
        if len(self.ranks) != len(cluster.workers):
            raise TransportError(
                f"process group has {len(self.ranks)} ranks but cluster '{cluster.name}' "
                f"has {len(cluster.workers)} workers; launch one leader rank per worker"
            )
        self.worker = dist.get_rank(self.group)
        self.local_workers = [self.worker]
        if store is None:
            try:
                store = dist.distributed_c10d._get_default_store()
            except Exception as e:  # noqa: BLE001 - private API; explain the fix instead
                raise TransportError("no store for the arrival barrier; pass store=") from e
        self.store = store
        self.timeout_s = timeout_s
        self.hierarchical = hierarchical
        self.prefix = prefix
        self.round = 0
        self.wire = WireBytes()
        backend = dist.get_backend(self.group)
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        me = cluster.workers[self.worker]
        self.region = me.region
        index = {w.name: i for i, w in enumerate(cluster.workers)}
        # Sub-group collectives return results in ascending global-rank order.
        self._by_rank = lambda idx: sorted(idx, key=lambda i: self.ranks[i])
        self.region_members = self._by_rank(
            [index[w.name] for w in cluster.workers_in(self.region)]
        )
        self.leaders = self._by_rank(
            [index[cluster.leader_of(r.name).name] for r in cluster.regions]
        )
        self.is_leader = self.worker == index[cluster.leader_of(self.region).name]
        if hierarchical and groups is None:
            if dist.get_world_size() != len(self.ranks):
                raise TransportError(
                    "group is not the whole world: build the sub-groups on every "
                    "rank with build_transport_groups() and pass groups="
                )
            groups = build_transport_groups(cluster, self.ranks, timeout_s=timeout_s)
        groups = groups or TransportGroups()
        self.region_group = groups.region
        self.leader_group = groups.leaders
        if hierarchical and (
            (len(self.region_members) > 1) != (self.region_group is not None)
            or (self.is_leader and len(self.leaders) > 1) != (self.leader_group is not None)
        ):
            raise TransportError(
                f"sub-groups do not match cluster '{cluster.name}' for worker "
                f"{me.name}; build them with build_transport_groups()"
            )

    # -- arrival barrier -----------------------------------------------------
    def _key(self, rnd: int, worker: int) -> str:
        return f"{self.prefix}/{rnd}/{worker}"

    def _arrive(self) -> None:
        """Store barrier; raises RegionTimeoutError naming the missing regions."""
        rnd = self.round
        self.store.set(self._key(rnd, self.worker), b"1")
        keys = [self._key(rnd, i) for i in range(len(self.cluster.workers))]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - store errors differ across torch versions
            missing = [i for i, k in enumerate(keys) if not self.store.check([k])]
            if not missing:  # arrived just after the timeout
                return
            workers = [self.cluster.workers[i] for i in missing]
            regions = list(dict.fromkeys(w.region for w in workers))
            raise RegionTimeoutError(
                f"GeoMesh exchange {rnd}: no answer within {self.timeout_s:g} s from region(s) "
                f"{regions} (workers {[w.name for w in workers]}); check that those processes are "
                "alive and reachable, or raise geomesh.timeout_s if they are just slow",
                regions,
                [w.name for w in workers],
            ) from None
        if rnd >= 2:  # everyone has passed round rnd-1, so nobody waits on rnd-2 any more
            self.store.delete_key(self._key(rnd - 2, self.worker))

    # -- collectives -----------------------------------------------------------
    def _all_gather(self, data: bytes, group: dist.ProcessGroup, phase: str) -> list[bytes]:
        try:
            n = dist.get_world_size(group)
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            sizes = [torch.zeros_like(size) for _ in range(n)]
            dist.all_gather(sizes, size, group=group)
            lengths = [int(s.item()) for s in sizes]
            buf = torch.zeros(max(max(lengths), 1), dtype=torch.uint8, device=self.device)
            if data:
                buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(  # host
                    self.device
                )
            outs = [torch.empty_like(buf) for _ in range(n)]
            dist.all_gather(outs, buf, group=group)
        except RuntimeError as e:
            raise TransportError(f"GeoMesh exchange {self.round}: {phase} failed: {e}") from e
        self.wire.gathered(len(data), lengths)
        return [o[:k].cpu().numpy().tobytes() for o, k in zip(outs, lengths)]

    def _broadcast(
        self, data: bytes | None, src_worker: int, group: dist.ProcessGroup, phase: str
    ) -> bytes:
        src = self.ranks[src_worker]
        try:
            size = torch.tensor(
                [len(data) if data is not None else 0], dtype=torch.int64, device=self.device
            )
            dist.broadcast(size, src=src, group=group)
            n = int(size.item())
            buf = torch.empty(max(n, 1), dtype=torch.uint8, device=self.device)
            if data is not None and n:
                buf[:n] = torch.frombuffer(  # host
                    bytearray(data), dtype=torch.uint8).to(self.device)
            dist.broadcast(buf, src=src, group=group)
        except RuntimeError as e:
            raise TransportError(f"GeoMesh exchange {self.round}: {phase} failed: {e}") from e
        if dist.get_rank() == src:
            self.wire.sent += n * (dist.get_world_size(group) - 1)
        else:
            self.wire.received += n
        return buf[:n].cpu().numpy().tobytes()

    def exchange(self, messages: Mapping[int, MessageLike]) -> list[bytes]:
        self._check_local(messages)
        mine = as_bytes(messages[self.worker])
        self._arrive()
        if not self.hierarchical:
            out = self._all_gather(mine, self.group, "all-gather among all workers")
        else:
            out = self._hierarchical(mine)
        self.round += 1
        return out

    def _hierarchical(self, mine: bytes) -> list[bytes]:
        region = self.region
        if self.region_group is not None:  # 1. intra-region all-gather
            local = self._all_gather(
                mine, self.region_group, f"intra-region all-gather in {region!r}"
            )
        else:
            local = [mine]
        full = None
        if self.is_leader:  # 2. leaders exchange region bundles over the WAN
            bundle = encode_bundle(local)
            if self.leader_group is not None:
                bundles = self._all_gather(
                    bundle, self.leader_group, f"inter-region all-gather (leader of {region!r})"
                )
            else:
                bundles = [bundle]
            by_worker: dict[int, bytes] = {}
            for leader, b in zip(self.leaders, bundles):
                lregion = self.cluster.workers[leader].region
                members = self._by_rank(
                    [i for i, w in enumerate(self.cluster.workers) if w.region == lregion]
                )
                msgs = decode_bundle(b)
                if len(msgs) != len(members):
                    raise TransportError(
                        f"region {lregion!r} sent {len(msgs)} messages for {len(members)} workers"
                    )
                by_worker.update(zip(members, msgs))
            full = encode_bundle([by_worker[i] for i in range(len(self.cluster.workers))])
        if self.region_group is not None:  # 3. leader broadcasts everything to its region
            leader = self.cluster.worker_index(self.cluster.leader_of(region).name)
            full = self._broadcast(
                full, leader, self.region_group, f"intra-region broadcast in {region!r}"
            )
        return decode_bundle(full)
