"""Who is in a round: quorum, loss, healing and the exchange, on torchft.

Real mode with one job per region (``geomesh.region``) runs each worker as
one torchft *replica group*: its processes hold a :class:`torchft.Manager`
(one per shard rank, ``replica_id = geomesh_<worker index>``) that
heartbeats to a torchft Lighthouse (``python -m geomesh.lighthouse``, at the
cluster file's ``rendezvous`` address) and gets a *quorum* — the workers
alive now — at every round's exchange.  torchft then reconfigures a
fault-tolerant process group (``ProcessGroupGloo`` on CPU,
``ProcessGroupNCCL`` on GPU) among exactly those workers, rendezvousing on
the store of one of them (another one's when that one is gone), and heals
a worker whose round is behind the others' by sending it the state of a live
peer.  Every round (``r`` = the Manager's step, rounds committed so far):

1. **quorum** at the exchange point: a worker waits until every worker of
   the last quorum that is alive (heartbeating) has arrived; one silent for
   ``geomesh.heartbeat_s`` is lost, and an alive straggler is waited for at
   most ``geomesh.timeout_s`` (the lighthouse's ``--join-timeout-s``).  While
   waiting a line every 5 s names the workers of the last quorum and how long
   ago the lighthouse heard from each.  ``on_worker_loss=fail`` stops here
   (and a monitor thread stops the job within ``heartbeat_s`` of a loss even
   mid-training), ``continue`` goes on with the workers that are there;
2. **heal**: a worker behind (restarted, or a straggler dropped from the
   last round) receives ``θ_global``, the outer momentum, the round, the data
   position and the plan from a live peer (torchft's checkpoint transport,
   with an authenticated, pickle-free payload:
   :class:`~geomesh.exchange.heal_payload.SignedHTTPTransport`),
   sends an empty JOIN message this round, applies the same outer step from
   the others' messages, and trains from the next round on;
3. **all-gather** of the sealed messages (:mod:`geomesh.wire.envelope`) over the
   quorum's process group: lengths (int64), then uint8 buffers padded to the
   longest; each message is opened against the slot it came in;
4. **commit** (``Manager.should_commit``): the round counts, the step moves
   on.  A failure in 3 (a worker died after the quorum) is reported to the
   Manager and 1-3 are retried with the same messages, at most 3 times.

The lighthouse itself may restart (same address, within ``heartbeat_s``): torchft
re-asks it for the quorum in flight, the first quorum after the outage rebuilds
the process group on fresh store keys, and a quorum the new lighthouse formed
before it heard every alive worker is refused once (1-3 again).  A lighthouse
silent for ``heartbeat_s`` stops every job with exit code 3 (a monitor thread).

What torchft does not do here, and why.  torchft's exchange primitive is an
all-reduce of dense tensors (``Manager.allreduce``); GeoMesh must see every
worker's message apart — to check it (:mod:`geomesh.wire.guard`) and because a sum
of sign-compressed messages is not a sign-compressed message (an all-reduce
would need the fp32 pseudo-gradient, 32x the bytes).  So the exchange is an
all-gather on torchft's process group, not the Manager's all-reduce; and
torchft has one flat group per quorum, so the hierarchical exchange of
:mod:`geomesh.exchange.transport` (inside regions, then between leaders) is not used
here (one worker per region job: the two are the same).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
from torch.distributed.distributed_c10d import AllgatherOptions
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

from jobruntime.config import ConfigError
from jobruntime.faults import exit_interrupted, fault_point

from ..fleet.cluster import ClusterError, ClusterSpec
from ..lighthouse import lighthouse_heartbeats, quorum_retries
from ..wire.envelope import DATA, JOIN, EnvelopeError, Opener
from .heal_payload import SignedHTTPTransport
from .quorum_group import recording_group
from .run_identity import differing_parts
from .transport import WireBytes
from .worker_loss import PeerLostError, lost_workers

log = logging.getLogger(__name__)
for _name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
    logging.getLogger(_name).setLevel(logging.CRITICAL)  # its exceptions are ours to report
REPORT_EVERY_S = 5.0
MAX_ATTEMPTS = 3
REASK_S = 0.5  # pause before re-asking a restarted lighthouse for a whole quorum


def other_run_heal(cause: BaseException, run: int) -> ConfigError | None:
    """The error for a heal that failed because the live peers run with other settings
    (the healing state is sealed for another run identity), else ``None``.

    A region restarted with other settings than the running regions' cannot open their
    healing state; each quorum attempt failed alike, and after :data:`MAX_ATTEMPTS` the
    job stopped with "no working quorum", not the exit-2 refusal a region started with
    other settings gets in its first round (:meth:`geomesh.sync.OuterLoop.refuse_other_start`).

    Args:
        cause: the exception torchft's manager recorded for the attempt.
        run: this job's run identity (:func:`geomesh.exchange.run_identity.run_identity`).
    """
    if not (isinstance(cause, EnvelopeError) and cause.reason == "other_run"
            and cause.peer_run is not None):
        return None
    parts = differing_parts(run, cause.peer_run)
    return ConfigError(
        f"the running regions run with other settings than this region (part(s) that "
        f"differ: {', '.join(parts) or 'none named'}), so it cannot heal from them; restart "
        "it with the run's settings: its resume command (docs/geomesh.md) or the same "
        "overrides as the other regions (geomesh.exchange.run_identity lists what they "
        "share)")


class Membership:
    """One shard rank's membership in the run (module docstring).

    Args:
        cluster: the cluster (worker order = ``replica_id`` order).
        worker: this job's worker index.
        shard / num_shards: this rank's group rank inside the worker, and how many.
        lighthouse: ``http://host:port`` of the lighthouse.
        store_addr / store_port: this job's own TCPStore (torchrun's or its own).
        opener: the run's :class:`~geomesh.wire.envelope.Opener`.
        timeout_s, heartbeat_s, on_worker_loss: ``geomesh.*``.
        start_round: torchft's step to start from.  The region jobs start at 0 (rounds
            since the job's start, not the run's: :mod:`geomesh.exchange.deploy`), so a
            region restarted alone is behind the others and heals; that every job resumed
            the same round is checked by the launcher (:mod:`geomesh.launch_resume`) and
            in the first round (:meth:`geomesh.sync.OuterLoop.refuse_other_start`).
        report: print lines (the job's first rank).
    """

    def __init__(self, cluster: ClusterSpec, worker: int, *, shard: int, num_shards: int,
                 lighthouse: str, store_addr: str, store_port: int, opener: Opener,
                 timeout_s: float, heartbeat_s: float, on_worker_loss: str,
                 start_round: int = 0, report: bool = True) -> None:
        self.cluster, self.worker, self.shard = cluster, worker, shard
        self.lighthouse, self.opener = lighthouse, opener
        self.timeout_s, self.heartbeat_s, self.policy = timeout_s, heartbeat_s, on_worker_loss
        self.report = report
        nccl = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else \
            torch.device("cpu")
        tout = timedelta(seconds=timeout_s)
        beat_s = min(heartbeat_s / 10, 1.0)
        self.pg = recording_group(ProcessGroupNCCL if nccl else ProcessGroupGloo)(timeout=tout)
        self.members: list[int] = []
        self.wire = WireBytes()  # the exchange's payload bytes (geomesh.transport)
        self.other_run: dict[int, list[str]] = {}
        """Last exchange: workers whose message named another run identity, with the parts
        of it that differ from this one's (a region started with other settings,
        :func:`geomesh.exchange.run_identity.differing_parts`)."""
        self._healed: dict | None = None
        self._save: Callable[[], dict] | None = None
        self._load: Callable[[dict], None] | None = None
        try:
            self.manager = Manager(
                pg=self.pg, load_state_dict=None, state_dict=None, min_replica_size=1,
                use_async_quorum=False, timeout=tout, quorum_timeout=tout + tout,
                connect_timeout=timedelta(seconds=min(timeout_s, 60.0)), rank=shard,
                world_size=num_shards, store_addr=store_addr, store_port=store_port,
                lighthouse_addr=lighthouse, replica_id=f"geomesh_{worker:04d}",
                heartbeat_interval=timedelta(seconds=beat_s),
                quorum_retries=quorum_retries(2 * timeout_s, beat_s),
                checkpoint_transport=SignedHTTPTransport(opener, worker=worker, shard=shard,
                                                         timeout=tout),
                init_sync=False)
        except Exception as e:  # noqa: BLE001 - the Rust client raises RuntimeError variants
            raise PeerLostError(self._no_lighthouse(e)) from None
        self.manager.register_state_dict_fn("geomesh", self._load_state, self._save_state)
        self.manager.load_state_dict({"step": start_round, "batches_committed": 0})
        self._outages = self._outages_at_quorum = 0  # times the lighthouse went silent
        self._silent_since: float | None = None
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._watch, daemon=True)
        self._monitor.start()

    def _no_lighthouse(self, e: BaseException) -> str:
        return (f"GeoMesh: the lighthouse at {self.lighthouse} does not answer "
                f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}); start it "
                "with python -m geomesh.lighthouse --cluster FILE (the cluster file's rendezvous "
                "address), or check that this host can reach it")

    def name(self, k: int) -> str:
        w = self.cluster.workers[k]
        return f"{w.name} ({w.region})"

    # -- state handed to a worker that heals ----------------------------------------
    def set_state_fns(self, save: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """What a live peer sends (``save``) and how a healing worker applies it (``load``)."""
        self._save, self._load = save, load

    def _save_state(self) -> dict:
        return self._save() if self._save is not None else {}

    def _load_state(self, state: dict) -> None:
        self._healed = state

    @property
    def step(self) -> int:
        """Rounds committed (torchft's step)."""
        return self.manager.current_step()

    # -- quorum ------------------------------------------------------------------
    def _waiting(self, r: int, done: threading.Event) -> None:
        t0 = time.monotonic()
        while not done.wait(REPORT_EVERY_S):
            others = [k for k in (self.members or range(len(self.cluster.workers)))
                      if k != self.worker]
            try:
                beats = lighthouse_heartbeats(self.lighthouse)
                seen = ", ".join(f"{self.name(k)} " + (f"heard {beats[k]:.1f} s ago"
                                                        if k in beats else "never heard")
                                 for k in others)
            except OSError:
                seen = f"the lighthouse at {self.lighthouse} does not answer"
            if self.report:
                log.info("GeoMesh round %d: waiting %.0f s for %s at the exchange (%s)", r,
                         time.monotonic() - t0, ", ".join(self.name(k) for k in others), seen)

    def quorum(self, r: int) -> tuple[list[int], bool]:
        """Wait for this round's quorum; return ``(members, healed)``.

        Raises:
            PeerLostError: the lighthouse is gone, or (``fail``) a worker was lost.
        """
        done = threading.Event()
        waiter = threading.Thread(target=self._waiting, args=(r, done), daemon=True)
        waiter.start()
        try:
            self._working_quorum(r)
        finally:
            done.set()
        new = list(self.pg.members)
        healed = self._healed is not None
        if healed and self._load is not None:
            self._load(self._healed)
        old = self.members
        lost = [k for k in old if k not in new]
        joined = [k for k in new if k not in old and old]
        self.members = new
        if lost:
            self._report_lost(r, lost)
        if joined and self.report:
            log.info("GeoMesh round %d: %s joined (%d workers)", r,
                     ", ".join(self.name(k) for k in joined), len(new))
        return new, healed

    def _working_quorum(self, r: int) -> None:
        """Ask torchft for round ``r``'s quorum until it is one to train with.

        Two kinds of refusal.  A failed attempt (a process group that could not
        form because its store's host just died, or a heal that failed) counts
        towards :data:`MAX_ATTEMPTS`.  A partial quorum of a restarted lighthouse
        that left out an alive worker does not: torchft's lighthouse answers
        every re-ask at once with the same partial quorum (its fast quorum: all
        members of the previous quorum asked again, ``quorum_compute`` in
        ``src/lighthouse.rs``) until the left-out worker asks too, so such
        refusals came three in one second and ended a run whose peers were all
        alive (``bench/faults.py``'s lighthouse restart on loaded cores).  They
        are re-asked every :data:`REASK_S` for up to ``geomesh.timeout_s`` (the
        wait for an alive straggler); after that the partial quorum stands.

        Raises:
            PeerLostError: the lighthouse does not answer, or no working quorum
                after :data:`MAX_ATTEMPTS` failed attempts.
        """
        failed, partial_until, why = 0, None, ""
        # A heal during a refused partial quorum is kept: torchft moved its step on with
        # it, so the next quorum will not heal again.
        self._healed = None
        while True:
            try:
                self.manager.start_quorum(allow_heal=True)
            except Exception as e:  # noqa: BLE001 - quorum RPC errors (lighthouse gone)
                raise PeerLostError(self._no_lighthouse(e)) from None
            if self._outages != self._outages_at_quorum and (
                    partial_until is None or time.monotonic() < partial_until):
                alive = self._left_out_alive()
                if alive:
                    self.manager.report_error(RuntimeError("a partial quorum after a restart"))
                    self.manager.should_commit()  # this step failed: nobody commits it
                    if partial_until is None:
                        partial_until = time.monotonic() + self.timeout_s
                        if self.report:
                            log.warning("GeoMesh round %d: the restarted lighthouse formed a "
                                        "quorum without %s, which is alive; asking again until "
                                        "it joins (up to %g s, geomesh.timeout_s)", r,
                                        ", ".join(self.name(k) for k in alive), self.timeout_s)
                    time.sleep(REASK_S)
                    continue
            err = self.manager.errored()
            if err is None:
                self._outages_at_quorum = self._outages
                return
            refused = other_run_heal(err.original_exception, self.opener.run)
            if refused is not None:  # no attempt will heal it: the job's settings differ
                raise refused
            failed += 1
            self._healed = None  # a heal that failed
            why = str(err.original_exception).splitlines()[0][:160]
            self.manager.should_commit()  # tell torchft this step failed, and ask again
            if self.report:
                log.warning("GeoMesh round %d: quorum attempt %d failed (%s)", r, failed, why)
            if failed == MAX_ATTEMPTS:
                raise PeerLostError(f"GeoMesh round {r}: no working quorum after "
                                    f"{MAX_ATTEMPTS} attempts (last: {why}); restart the "
                                    "regions")

    def lost(self, r: int, lost: list[int], why: str | dict[int, str]) -> None:
        """Workers dropped from round ``r`` (:func:`lost_workers`)."""
        lost_workers(self.cluster, self.policy, r, lost, why,
                     members=len(set(self.members) - set(lost)), report=self.report)

    def _report_lost(self, r: int, lost: list[int]) -> None:
        """Workers of the last quorum missing from round ``r``'s, each with its reason: the
        lighthouse heard it within ``heartbeat_s`` (alive, but not at the exchange within
        ``timeout_s``: a straggler, or left out after a lighthouse restart), or not."""
        try:
            beats = lighthouse_heartbeats(self.lighthouse)
        except OSError:
            beats = {}
        late = (f"heartbeating, but not at the exchange within {self.timeout_s:g} s "
                "(geomesh.timeout_s)")
        silent = f"no heartbeat for {self.heartbeat_s:g} s (geomesh.heartbeat_s)"
        self.lost(r, lost, {k: late if beats.get(k, float("inf")) <= self.heartbeat_s
                            else silent for k in lost})

    def join(self, r: int) -> bool:
        """Startup: wait until every worker is in the quorum, or heal from a running run.

        Returns:
            whether this worker healed (the run was already going).

        Raises:
            ClusterError: workers missing after ``geomesh.timeout_s`` (named).
        """
        t0 = time.monotonic()
        deadline, said = t0 + self.timeout_s, t0
        K = len(self.cluster.workers)
        while True:
            members, healed = self.quorum(r)
            if healed or len(members) == K:
                return healed
            if self.report and time.monotonic() - said >= REPORT_EVERY_S:
                said = time.monotonic()
                log.info("GeoMesh: waiting %.0f s for %s to join at the lighthouse %s",
                         said - t0, ", ".join(self.name(k) for k in range(K) if k not in members),
                         self.lighthouse)
            if time.monotonic() > deadline:
                missing = [k for k in range(K) if k not in members]
                regions = list(dict.fromkeys(self.cluster.workers[k].region for k in missing))
                raise ClusterError(
                    f"GeoMesh: region(s) {regions} (workers "
                    f"{[self.cluster.workers[k].name for k in missing]}) did not join at the "
                    f"lighthouse {self.lighthouse} within {self.timeout_s:g} s; start their jobs "
                    "with geomesh.region=<name>, check that they reach the lighthouse, or raise "
                    "geomesh.timeout_s")
            self.members = []
            time.sleep(1.0)

    def _watch(self) -> None:
        """Stop the job within ``heartbeat_s`` of losing the lighthouse, or (``fail``) a worker.

        A probe of the lighthouse's ``/status`` every ``min(1, heartbeat_s / 4)`` s,
        from construction on (also during a quorum, which torchft retries on a
        lighthouse that came back: :func:`quorum_retries`).  Silent for longer than
        ``heartbeat_s`` (both policies): the lighthouse is gone for good, and every
        quorum would wait for it.  A worker the lighthouse has not heard of (a
        restarted lighthouse that hears the first heartbeats) counts as silent from
        when the probe first saw it absent, not from forever.
        """
        absent_since: dict[int, float] = {}
        failed = 0
        while not self._stop.wait(min(1.0, self.heartbeat_s / 4)):
            try:
                beats = lighthouse_heartbeats(self.lighthouse)
            except OSError:
                # silent from the first probe that failed: a restart gets all of heartbeat_s
                failed += 1
                self._silent_since = self._silent_since or time.monotonic()
                if failed == 2:  # one lost probe is a blip, two an outage (a restart)
                    self._outage()
                if time.monotonic() - self._silent_since > self.heartbeat_s:
                    self._exit(self._lighthouse_gone())
                continue
            self._silent_since, failed, now = None, 0, time.monotonic()
            for k in range(len(self.cluster.workers)):
                if k in beats:
                    absent_since.pop(k, None)
                else:
                    absent_since.setdefault(k, now)
            if self.policy != "fail":
                continue
            lost = [k for k in self.members if k != self.worker
                    and beats.get(k, now - absent_since.get(k, now)) > self.heartbeat_s]
            if lost:
                regions = list(dict.fromkeys(self.cluster.workers[k].region for k in lost))
                self._exit(f"GeoMesh: lost region(s) {regions} (worker "
                           f"{', '.join(self.name(k) for k in lost)}: no heartbeat for "
                           f"{self.heartbeat_s:g} s); geomesh.on_worker_loss=fail stops every "
                           "job: restart all regions")

    def _outage(self) -> None:
        """The lighthouse went silent or restarted: the next quorum rebuilds the process group.

        torchft's Manager rebuilds its process group only for a quorum id other than
        its own (``Manager._quorum_id``, the one private field touched here), and a
        restarted lighthouse numbers its quorums from 1 again: an equal id would
        keep a group whose peers have rebuilt theirs, and both would wait out
        ``geomesh.timeout_s``.  Set from the monitor thread while the lighthouse is
        away, so that every worker's next quorum, also one in flight (torchft
        re-asks the restarted lighthouse), rebuilds it: all of them, or none.  A
        restart faster than two probes is not seen; then every worker keeps or
        rebuilds its group alike (the ids are compared with the same last one).
        """
        self._outages += 1
        self.manager._quorum_id = -1
        if self.report:
            log.warning("GeoMesh: the lighthouse at %s does not answer; waiting up to %g s "
                        "(geomesh.heartbeat_s) for it to come back", self.lighthouse,
                        self.heartbeat_s)

    def _left_out_alive(self) -> list[int]:
        """Workers of the last quorum missing from this one although alive, after an outage.

        A restarted lighthouse forms a quorum of whoever asks before it has heard
        the others' heartbeats.  Waits up to ``heartbeat_s`` for the lighthouse to
        hear them (torchft reconnects with a backoff); one it hears was left out,
        not lost.
        """
        missing = [k for k in self.members if k not in self.pg.members]
        deadline = time.monotonic() + self.heartbeat_s
        while missing and time.monotonic() < deadline:
            try:
                beats = lighthouse_heartbeats(self.lighthouse)
            except OSError:
                beats = {}
            alive = [k for k in missing if beats.get(k, float("inf")) <= self.heartbeat_s]
            if alive:
                return alive
            time.sleep(min(0.5, self.heartbeat_s / 10))
        return []

    def _lighthouse_gone(self) -> str:
        return (f"GeoMesh: the lighthouse at {self.lighthouse} has not answered for "
                f"{self.heartbeat_s:g} s (geomesh.heartbeat_s; a restart within that is "
                "survived), so no round can form a quorum: start it again with python -m "
                "geomesh.lighthouse --cluster FILE, then every region")

    def _exit(self, message: str) -> None:
        exit_interrupted(message)  # the main thread may sit in a collective only a timeout ends

    # -- exchange ------------------------------------------------------------------
    def _all_gather(self, data: bytes) -> list[bytes]:
        n = self.pg.size()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        sizes = [[torch.zeros_like(size) for _ in range(n)]]
        self.pg.allgather(sizes, [size], AllgatherOptions()).wait()
        lengths = [int(s.item()) for s in sizes[0]]
        buf = torch.zeros(max(max(lengths), 1), dtype=torch.uint8, device=self.device)
        if data:
            buf[:len(data)] = torch.frombuffer(  # host bytes, copied to the device
                bytearray(data), dtype=torch.uint8).to(self.device)
        outs = [[torch.empty_like(buf) for _ in range(n)]]
        self.pg.allgather(outs, [buf], AllgatherOptions()).wait()
        self.wire.gathered(len(data), lengths)
        return [o[:k].cpu().numpy().tobytes() for o, k in zip(outs[0], lengths)]

    def exchange(self, r: int, body: bytes | None, *, quorum_done: bool = False
                 ) -> tuple[list[bytes | None], bool]:
        """Round ``r``'s messages of every worker (``None``: absent, joining or rejected).

        Args:
            body: this worker's codec message (``None``: it has none, it just healed).
            quorum_done: the quorum of this round was already taken (by :meth:`join`).

        Returns:
            ``(messages, healed)``: when ``healed``, this worker was behind; the
            state fns loaded the peers' state and ``body`` was not sent.
        """
        K = len(self.cluster.workers)
        healed_any = False
        for attempt in range(MAX_ATTEMPTS):
            if not (quorum_done and attempt == 0):
                members, healed = self.quorum(r if not healed_any else self.step)
                if healed:
                    healed_any, body = True, None
            r_now = self.step
            kind = DATA if body is not None else JOIN
            sealed = self.opener.seal(body or b"", kind=kind, round=r_now, worker=self.worker,
                                      shard=self.shard)
            fault_point("exchange", r_now)
            try:
                got = self._all_gather(sealed)
            except Exception as e:  # noqa: BLE001 - gloo/NCCL errors: a peer died after the quorum
                self.manager.report_error(e)
                self.manager.should_commit()
                self.opener.forget_round(r_now)
                if self.report:
                    log.warning("GeoMesh round %d: exchange failed (%s); new quorum, attempt %d",
                                r_now, str(e).splitlines()[0][:120], attempt + 2)
                continue
            out: list[bytes | None] = [None] * K
            bad, self.other_run = [], {}
            for k, data in zip(self.pg.members, got):
                try:
                    env = self.opener.open(data, round=r_now, sender=k, shard=self.shard)
                except EnvelopeError as e:
                    bad.append(k)
                    if e.peer_run is not None:
                        self.other_run[k] = differing_parts(self.opener.run, e.peer_run)
                    if self.report:
                        log.warning("GeoMesh round %d: rejected the message of %s: %s", r_now,
                                    self.name(k), e)
                    continue
                out[k] = env.body if env.kind == DATA else None
            fault_point("commit", r_now)
            if not self.manager.should_commit():
                self.opener.forget_round(r_now)
                continue
            # a peer of another run is the job's call, on every rank (refuse_other_start)
            if bad := [k for k in bad if k not in self.other_run]:
                self.lost(r_now, bad, "message rejected")
            return out, healed_any
        raise PeerLostError(f"GeoMesh round {r}: the exchange failed {MAX_ATTEMPTS} times "
                            "(workers keep dropping out); restart the regions")

    def stop_watching(self) -> None:
        """No exchange follows (the run's last round, or the agreed stop at the target):
        stop the monitor thread.  A peer that finished first and left is not lost; with
        ``on_worker_loss=fail`` it stopped this job with exit 3 while it evaluated and
        saved its last round (longer than ``heartbeat_s``)."""
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # noqa: BLE001 - shutting down after a peer died
            pass
