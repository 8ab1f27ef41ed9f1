"""Emulated time: per-worker compute, WAN transfers, and round schedules.

Emulated mode trains a small proxy model for the loss curve but charges time
as if each worker trained the *target* model on its GPUs.  All times are in
seconds, sizes in bytes, throughputs in tokens/s or FLOP/s.

Compute.  One inner step of worker ``i`` (micro-batch ``mb`` sequences of
``s`` tokens, ``a`` accumulation steps, ``dp`` replicas) processes
``mb·a·dp·s`` tokens and takes

    t_step = flops_per_token(target) · mb·a·dp·s / (achieved_flops(mb·s) · num_gpus)
             · (a + pp − 1) / a                                              (1)

``achieved_flops`` is the GPU profile's efficiency curve at the micro-batch's
token count (``jobruntime.hardware``); the last factor is the 1F1B pipeline
bubble (Narayanan et al. 2021, bubble fraction ``(p−1)/m``), 1 when
``pp == 1``.  TP/PP communication inside a worker is not modelled.

Links.  A one-way push of ``B`` bytes over a link takes ``rtt/2 + B/bandwidth``
(:meth:`geomesh.fleet.cluster.WanLink.transfer_s`): half the round trip is the
propagation delay of one direction; connections are assumed long-lived.

GeoMesh round (hierarchical all-gather, modelled by :meth:`EmulatedClock.exchange`):

1. *intra-region gather*: each non-leader worker pushes its message to its
   region leader (first worker of the region) over the intra-region link; all
   pushes run concurrently (full-bisection datacenter fabric).  The region's
   bundle (concatenated messages, no re-compression — the aggregate stays
   exact) is ready at ``D_r = max(ready_leader, max_m ready_m + intra(B_m))``.
2. *inter-region exchange*: each leader pushes its bundle directly to every
   other leader, all directed links concurrently (the CSV throughput is per
   VM pair; the sender NIC is assumed not to be the bottleneck).  Leader ``r``
   has everything at ``A_r = max(D_r, max_{q≠r} D_q + wan(q→r, bundle_q))``.
3. *intra-region broadcast*: the leader pushes the messages a member does not
   have (``total − B_m`` bytes) to each member: ``E_m = A_r + intra(total − B_m)``,
   ``E_leader = A_r``.

Worker ``m`` then applies the outer step (negligible time) and starts the next
round at ``E_m``.  Its idle time ``E_m − ready_m`` is split into
``straggler_idle_s = max_j ready_j − ready_m`` (waiting for the slowest
worker's compute, which no network could hide) and ``wan_idle_s`` = the rest
(waiting on communication, intra-region hops included).

Baselines: :func:`ddp_schedule` (synchronous DDP, fp32 all-reduce every step,
hierarchical: intra reduce, ring all-reduce among region leaders, intra
broadcast) and :func:`async_schedule` (a parameter server applies each
worker's update when it arrives).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field

from jobruntime.config import ModelConfig
from jobruntime.flops import flops_per_token

from .cluster import ClusterSpec, WorkerSpec

# ---------------------------------------------------------------------------
# Compute
# ---------------------------------------------------------------------------


def worker_tokens_per_s(
    worker: WorkerSpec, model: ModelConfig, micro_batch_size: int, *, seq_length: int | None = None
) -> float:
    """Training throughput of the whole worker, tokens/s, at a micro-batch size.

    ``num_gpus · achieved_flops(mb · s) / flops_per_token`` (no pipeline bubble).
    """
    s = seq_length or model.seq_length
    flops = worker.num_gpus * worker.profile.achieved_flops(micro_batch_size * s)
    return flops / flops_per_token(model, seq_length=s)


def pipeline_bubble_factor(pp: int, grad_accum: int) -> float:
    """``(a + pp − 1) / a``: 1F1B step time over bubble-free time."""
    return (grad_accum + pp - 1) / grad_accum


def inner_step_time_s(
    worker: WorkerSpec,
    model: ModelConfig,
    micro_batch_size: int,
    grad_accum: int,
    *,
    seq_length: int | None = None,
) -> float:
    """Seconds of one inner optimizer step of ``worker``, equation (1)."""
    s = seq_length or model.seq_length
    tokens = micro_batch_size * grad_accum * worker.dp * s
    rate = worker_tokens_per_s(worker, model, micro_batch_size, seq_length=s)
    return tokens / rate * pipeline_bubble_factor(worker.pp, grad_accum)


# ---------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------


@dataclass
class WorkerTiming:
    """One worker's time in a round (or summed over rounds/steps), seconds.

    ``end_s = start_s + compute_s + straggler_idle_s + wan_idle_s`` for one round.
    """

    start_s: float = 0.0
    compute_s: float = 0.0
    straggler_idle_s: float = 0.0
    wan_idle_s: float = 0.0
    end_s: float = 0.0
    sent_bytes: int = 0

    @property
    def idle_s(self) -> float:
        return self.straggler_idle_s + self.wan_idle_s


@dataclass
class RoundSchedule:
    """Per-worker timings of a round (or of a run of steps, for DDP/async).

    Attributes:
        wan_bytes: bytes crossing inter-region links (sum over directed links).
        intra_bytes: bytes on intra-region links.
    """

    workers: dict[str, WorkerTiming]
    wan_bytes: int = 0
    intra_bytes: int = 0
    events: list = field(default_factory=list)

    @property
    def end_s(self) -> float:
        return max(t.end_s for t in self.workers.values())

    @property
    def start_s(self) -> float:
        return min(t.start_s for t in self.workers.values())


class EmulatedClock:
    """Virtual per-worker clocks for GeoMesh rounds.

    Usage per round: ``clock.compute(name, seconds)`` for each worker, then
    ``clock.exchange({name: message_bytes})`` (called by
    :class:`geomesh.exchange.transport.InProcessTransport`), which advances every
    worker to the time it holds all messages.  :attr:`totals` accumulates.

    Overlapped rounds (``overlap=True``, ``geomesh.overlap``): ``exchange``
    only schedules the transfers (each worker keeps computing the next round)
    and :meth:`wait` later advances a worker to the time it holds the
    messages.  The wait splits into straggler and WAN idle against a
    zero-network twin of the clock (same compute, instantaneous transfers):
    straggler idle is what that twin waits (slower workers' compute, which no
    network can hide), WAN idle the rest.  A link carries one transfer at a
    time: a push starts when the link's previous push has ended (this binds
    only when exchanges overlap each other, i.e. one outlasts a round).
    """

    def __init__(self, cluster: ClusterSpec, *, overlap: bool = False) -> None:
        self.cluster = cluster
        self.overlap = overlap
        self.time_s: dict[str, float] = {w.name: 0.0 for w in cluster.workers}
        self._round_start = dict(self.time_s)
        self._round_compute = {w.name: 0.0 for w in cluster.workers}
        self.totals: dict[str, WorkerTiming] = {w.name: WorkerTiming() for w in cluster.workers}
        self.wan_bytes = 0
        self.intra_bytes = 0
        self.rounds: list[RoundSchedule] = []
        self._link_free: dict[tuple[str, str, str], float] = {}  # when a directed link is idle again
        self._pending: dict[str, float] = {}  # overlap: when a worker holds the last messages
        self._twin = dict(self.time_s)  # zero-network clock (overlap)
        self._twin_pending = 0.0
        self.last_exchange_end_s = 0.0
        """When the last worker holds all messages of the latest exchange."""

    @property
    def now_s(self) -> float:
        """Time of the latest worker (the run's elapsed emulated time)."""
        return max(self.time_s.values())

    def compute(self, worker: str, seconds: float) -> None:
        """Advance ``worker`` by ``seconds`` of computation."""
        if seconds < 0:
            raise ValueError(f"compute time must be >= 0, got {seconds} for {worker}")
        self.time_s[worker] += seconds
        self._twin[worker] += seconds
        self._round_compute[worker] += seconds
        self.totals[worker].compute_s += seconds

    def wait(self, worker: str) -> tuple[float, float]:
        """Overlap: advance ``worker`` to when it holds the last exchange's messages.

        Returns:
            ``(straggler_idle_s, wan_idle_s)`` of this wait (class docstring).

        Raises:
            RuntimeError: no exchange of this worker is pending.
        """
        if worker not in self._pending:
            raise RuntimeError(f"wait: no exchange pending for worker {worker}")
        t = self.time_s[worker]
        end = max(t, self._pending.pop(worker))
        idle = end - t
        twin = self._twin[worker]
        straggler = min(idle, max(0.0, self._twin_pending - twin))
        self._twin[worker] = max(twin, self._twin_pending)
        self.time_s[worker] = end
        tot = self.totals[worker]
        tot.straggler_idle_s += straggler
        tot.wan_idle_s += idle - straggler
        tot.end_s = end
        return straggler, idle - straggler

    def _push(self, link: tuple[str, str, str], ready: float, seconds: float) -> float:
        """End time of a push over a directed link (``("wan"|"intra", src, dst)``),
        one push at a time."""
        end = max(ready, self._link_free.get(link, ready)) + seconds
        self._link_free[link] = end
        return end

    def state_dict(self) -> dict:
        """Clocks and totals (not the per-round history) for checkpoints."""
        if self._pending:
            raise RuntimeError("EmulatedClock.state_dict: an overlapped exchange is pending")
        return {
            "time_s": dict(self.time_s),
            "round_start": dict(self._round_start),
            "round_compute": dict(self._round_compute),
            "totals": {k: vars(v).copy() for k, v in self.totals.items()},
            "wan_bytes": self.wan_bytes,
            "intra_bytes": self.intra_bytes,
            "link_free": [[*k, t] for k, t in self._link_free.items()],
            "twin": dict(self._twin),
            "last_exchange_end_s": self.last_exchange_end_s,
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.time_s = dict(state["time_s"])
        self._round_start = dict(state["round_start"])
        self._round_compute = dict(state["round_compute"])
        self.totals = {k: WorkerTiming(**v) for k, v in state["totals"].items()}
        self.wan_bytes = state["wan_bytes"]
        self.intra_bytes = state["intra_bytes"]
        self._link_free = {(k, s, d): t for k, s, d, t in state.get("link_free", [])}
        self._twin = dict(state.get("twin", self.time_s))
        self.last_exchange_end_s = state.get("last_exchange_end_s", max(self.time_s.values()))

    def exchange(self, message_bytes: Mapping[str, int]) -> RoundSchedule:
        """Hierarchical all-gather of one message per worker (module docstring).

        Args:
            message_bytes: bytes each worker sends (every worker present).

        Returns:
            The round's schedule; per-worker clocks are moved to their end times
            (overlap: the end times are pending until :meth:`wait`, and the
            schedule's idle times are 0).

        Raises:
            KeyError: a worker of the cluster is missing from ``message_bytes``.
            RuntimeError: overlap, and the previous exchange was not waited for.
        """
        c = self.cluster
        missing = [w.name for w in c.workers if w.name not in message_bytes]
        if missing:
            raise KeyError(f"exchange: no message size for workers {missing}")
        if self._pending:
            raise RuntimeError("exchange: the previous overlapped exchange was not waited for")
        ready = dict(self.time_s)
        slowest = max(ready.values())
        total = sum(int(message_bytes[w.name]) for w in c.workers)
        members = {r.name: c.workers_in(r.name) for r in c.regions}
        bundle_ready: dict[str, float] = {}
        bundle_bytes: dict[str, int] = {}
        intra = 0
        for r in c.regions:
            leader = members[r.name][0].name
            link = r.intra_link
            times = [ready[leader]]
            for m in members[r.name][1:]:
                times.append(self._push(("intra", m.name, leader), ready[m.name],
                                        link.transfer_s(message_bytes[m.name])))
                intra += int(message_bytes[m.name])
            bundle_ready[r.name] = max(times)
            bundle_bytes[r.name] = sum(int(message_bytes[m.name]) for m in members[r.name])
        wan = 0
        have_all: dict[str, float] = {}
        for r in c.regions:
            t = bundle_ready[r.name]
            for q in c.regions:
                if q.name != r.name:
                    t = max(t, self._push(("wan", q.name, r.name), bundle_ready[q.name],
                                          c.link(q.name, r.name).transfer_s(bundle_bytes[q.name])))
                    wan += bundle_bytes[q.name]
            have_all[r.name] = t
        timings: dict[str, WorkerTiming] = {}
        for r in c.regions:
            leader = members[r.name][0].name
            for k, m in enumerate(members[r.name]):
                end = have_all[r.name]
                if k > 0:
                    end = self._push(("intra", leader, m.name), end, r.intra_link.transfer_s(
                        total - int(message_bytes[m.name])))
                    intra += total - int(message_bytes[m.name])
                straggler = 0.0 if self.overlap else slowest - ready[m.name]
                timings[m.name] = WorkerTiming(
                    start_s=self._round_start[m.name],
                    compute_s=self._round_compute[m.name],
                    straggler_idle_s=straggler,
                    wan_idle_s=0.0 if self.overlap else end - ready[m.name] - straggler,
                    end_s=end,
                    sent_bytes=int(message_bytes[m.name]),
                )
        for name, t in timings.items():
            self._round_start[name] = t.end_s if not self.overlap else self.time_s[name]
            self._round_compute[name] = 0.0
            self.totals[name].sent_bytes += t.sent_bytes
            if self.overlap:
                self._pending[name] = t.end_s
                continue
            self.time_s[name] = t.end_s
            self.totals[name].straggler_idle_s += t.straggler_idle_s
            self.totals[name].wan_idle_s += t.wan_idle_s
            self.totals[name].end_s = t.end_s
        if self.overlap:
            self._twin_pending = max(self._twin.values())
        else:
            self._twin = dict(self.time_s)
        self.last_exchange_end_s = max(t.end_s for t in timings.values())
        self.wan_bytes += wan
        self.intra_bytes += intra
        sched = RoundSchedule(
            workers={w.name: timings[w.name] for w in c.workers}, wan_bytes=wan, intra_bytes=intra
        )
        self.rounds.append(sched)
        return sched


def geomesh_round(
    cluster: ClusterSpec, compute_s: Mapping[str, float], message_bytes: Mapping[str, int] | int
) -> RoundSchedule:
    """Schedule of one GeoMesh round starting at time 0 (all workers together).

    Args:
        compute_s: seconds of inner steps per worker (``H_i · t_step,i``).
        message_bytes: encoded message bytes per worker, or one size for all.
    """
    clock = EmulatedClock(cluster)
    for name, sec in compute_s.items():
        clock.compute(name, sec)
    if isinstance(message_bytes, int):
        message_bytes = {w.name: message_bytes for w in cluster.workers}
    return clock.exchange(message_bytes)


def allreduce_s(cluster: ClusterSpec, nbytes: int) -> tuple[float, int, int]:
    """Time of a hierarchical all-reduce of ``nbytes`` per worker.

    Intra-region reduce to the leader (concurrent pushes of ``nbytes``), a ring
    all-reduce among region leaders in region-id order (``2(R−1)`` steps, each
    moving ``nbytes/R`` over every ring link at once; a step lasts as long as
    the slowest link), then an intra-region broadcast of ``nbytes``.

    Returns:
        ``(seconds, wan_bytes, intra_bytes)`` of one all-reduce.
    """
    regions = cluster.regions
    multi = [r for r in regions if len(cluster.workers_in(r.name)) > 1]
    intra_t = max((r.intra_link.transfer_s(nbytes) for r in multi), default=0.0)
    intra_bytes = sum(2 * nbytes * (len(cluster.workers_in(r.name)) - 1) for r in multi)
    R = len(regions)
    if R == 1:
        return 2 * intra_t, 0, intra_bytes
    chunk = nbytes / R
    step = max(
        cluster.link(regions[k].name, regions[(k + 1) % R].name).transfer_s(chunk) for k in range(R)
    )
    wan_bytes = int(round(2 * (R - 1) * R * chunk))
    return 2 * intra_t + 2 * (R - 1) * step, wan_bytes, intra_bytes


def ddp_schedule(
    cluster: ClusterSpec, step_compute_s: Mapping[str, float], grad_bytes: int, num_steps: int
) -> RoundSchedule:
    """Synchronous DDP over the WAN: every step, all-reduce ``grad_bytes`` (fp32 grads).

    Each step starts on all workers at once, worker ``i`` computes
    ``step_compute_s[i]``, the all-reduce (:func:`allreduce_s`) starts when the
    slowest finishes; fast workers wait every step.  Returns totals over
    ``num_steps`` steps (all steps are alike).
    """
    ar_s, wan_b, intra_b = allreduce_s(cluster, grad_bytes)
    slowest = max(step_compute_s[w.name] for w in cluster.workers)
    step_s = slowest + ar_s
    timings = {
        w.name: WorkerTiming(
            start_s=0.0,
            compute_s=num_steps * step_compute_s[w.name],
            straggler_idle_s=num_steps * (slowest - step_compute_s[w.name]),
            wan_idle_s=num_steps * ar_s,
            end_s=num_steps * step_s,
            sent_bytes=num_steps * grad_bytes,
        )
        for w in cluster.workers
    }
    return RoundSchedule(
        workers=timings, wan_bytes=num_steps * wan_b, intra_bytes=num_steps * intra_b
    )


@dataclass(frozen=True)
class AsyncUpdate:
    """One update applied by the parameter server.

    Attributes:
        time_s: arrival (= application) time.
        worker: sender.
        version_read: model version the worker started its round from.
        staleness: updates applied by others in between (``version − version_read``).
    """

    time_s: float
    worker: str
    version_read: int
    staleness: int


def async_schedule(
    cluster: ClusterSpec,
    round_compute_s: Mapping[str, float],
    update_bytes: int,
    model_bytes: int,
    horizon_s: float,
    *,
    server_region: str | None = None,
) -> RoundSchedule:
    """Asynchronous baseline: each worker's update is applied when it arrives.

    A parameter server sits at the leader of ``server_region`` (default: the
    region of worker 0).  Worker ``i`` loops: compute ``round_compute_s[i]``,
    push ``update_bytes`` to the server (applied on arrival), pull
    ``model_bytes`` of fresh weights, repeat.  No overlap of compute and
    communication; no straggler idle by construction.  Updates arriving after
    ``horizon_s`` are not applied.  ``events`` lists :class:`AsyncUpdate` in
    application order (ties broken by worker index).
    """
    server = server_region or cluster.workers[0].region
    cluster.region(server)  # KeyError on a bad name
    timings = {w.name: WorkerTiming() for w in cluster.workers}
    heap: list[
        tuple[float, int, float, int]
    ] = []  # (arrival, worker idx, compute start, version read)
    for i, w in enumerate(cluster.workers):
        arrive = round_compute_s[w.name] + cluster.link(w.region, server).transfer_s(update_bytes)
        heapq.heappush(heap, (arrive, i, 0.0, 0))
    version = 0
    events: list[AsyncUpdate] = []
    wan = 0
    while heap:
        arrive, i, start, read = heapq.heappop(heap)
        if arrive > horizon_s:
            continue
        w = cluster.workers[i]
        events.append(
            AsyncUpdate(time_s=arrive, worker=w.name, version_read=read, staleness=version - read)
        )
        version += 1
        back = arrive + cluster.link(server, w.region).transfer_s(model_bytes)
        t = timings[w.name]
        t.compute_s += round_compute_s[w.name]
        t.wan_idle_s += back - start - round_compute_s[w.name]
        t.sent_bytes += update_bytes
        t.end_s = back
        if w.region != server:
            wan += update_bytes + model_bytes
        nxt = (
            back + round_compute_s[w.name] + cluster.link(w.region, server).transfer_s(update_bytes)
        )
        heapq.heappush(heap, (nxt, i, back, version))
    return RoundSchedule(workers=timings, wan_bytes=wan, events=events)
