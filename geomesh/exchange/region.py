"""A region's job of any shape as one torchft replica group.

One job per region (``geomesh.region``) runs the region's worker as
``tp · pp · dp`` processes: megatron-core's layout inside the job, its DDP
over the job's data-parallel replicas (the region's fast network).  Regions
may differ in all three, so the WAN cannot pair shard ``g`` of one region
with shard ``g`` of another (torchft pairs equal group ranks): only the job's
*leader* (rank 0) is a torchft replica group member
(:class:`geomesh.exchange.membership.Membership` of one rank).  The exchange is
hierarchical:

1. inside the region, the worker's ranks all-gather their canonical parts
   (:mod:`geomesh.wire.canonical_codec`; DP replicas hold equal copies, so only DP
   rank 0 contributes) into the worker's message (:meth:`Placement.collect
   <geomesh.exchange.deploy.Placement.collect>`);
2. the leader exchanges the message over the WAN (quorum, all-gather, commit);
3. the leader broadcasts the round's messages, the members and whether it
   healed to the job's ranks; each rank decodes what overlaps its own shard.

Healing across layouts.  The state torchft hands a joining region is in
canonical form: each rank's main shards of ``θ_global``, the outer
momentum and the inner AdamW moments (they are shaped and split like the
parameters) as ``(canonical key, global offsets)`` pieces
(:func:`geomesh.wire.canonical.main_pieces`), gathered to the serving leader on
demand; the joiner's leader broadcasts them and each rank cuts its own
shards out (:func:`geomesh.wire.canonical.assemble`), whatever the two layouts.

The other ranks follow the leader: while it is inside a torchft call they wait
for its commands on the job's process group (``state``: send your pieces for
a peer that heals; ``done``: the call's result).  torchft calls the state
function from its quorum thread while the leader's main thread waits, so the
leader's collectives keep one order on every rank.

Costs, stated: the serving leader holds the whole ``θ_global`` and momentum
(fp32, 8 bytes per parameter) and the inner moments (bf16, 4 bytes) while it
sends a healing payload, and every rank of a region holds the round's
compressed messages of all regions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import torch.distributed as dist

from ..wire.canonical import Shard, assemble, main_pieces
from .membership import Membership
from .worker_loss import lost_workers

log = logging.getLogger(__name__)

# the heal state's tensors held per shard, by local name: (section, part); a section
# absent from a state (``inner`` from tests' states) stays absent
_TENSOR_STATE = (("outer", "params"), ("outer", "momentum_buffer"),
                 ("inner", "exp_avg"), ("inner", "exp_avg_sq"))


def _piece_name(key: str, offsets: tuple[int, ...]) -> str:
    return f"{key}@{','.join(map(str, offsets))}"


def _parse_piece(name: str) -> tuple[str, tuple[int, ...]]:
    key, _, offs = name.rpartition("@")
    return key, tuple(int(o) for o in offs.split(",") if o)


def to_canonical(state: dict, layout: Mapping[str, Shard]) -> dict:
    """A heal state's per-shard tensors (outer optimizer, inner moments) as
    ``{"key@offsets": tensor}`` main pieces.

    An empty part stays empty: the outer momentum does not exist before the first
    outer step, nor ever with ``geomesh.compress_update`` (the workers keep it), and
    the inner moments not before the worker's first inner step.
    """
    out = {**state, **{sec: dict(state[sec]) for sec, _ in _TENSOR_STATE if sec in state}}
    for sec, part in _TENSOR_STATE:
        if sec in out:
            out[sec][part] = {_piece_name(k, o): t.detach().cpu()
                              for k, o, t in main_pieces(layout, out[sec][part])} \
                if out[sec][part] else {}
    return out


def from_canonical(state: dict, layout: Mapping[str, Shard]) -> dict:
    """Inverse of :func:`to_canonical` for this rank's layout (any other layout's pieces);
    an empty part stays empty.

    Raises:
        ValueError: the pieces do not cover this rank's shards exactly once.
    """
    out = {**state, **{sec: dict(state[sec]) for sec, _ in _TENSOR_STATE if sec in state}}
    for sec, part in _TENSOR_STATE:
        if sec in out:
            pieces = [(*_parse_piece(n), t) for n, t in out[sec][part].items()]
            out[sec][part] = assemble(layout, pieces, what=f"healing state ({part})") \
                if pieces else {}
    return out


class RegionMembership:
    """This rank's view of the region's torchft membership (module docstring).

    Args:
        leader: the job's rank 0 holds the :class:`Membership`; ``None`` elsewhere.
        layout: this rank's ``{local name: Shard}`` (for healing state).
        contributes: this rank's shards go into the region's state (DP rank 0).
        cluster, worker, policy: for naming lost workers on every rank.

    Every rank calls the same methods in the same order.
    """

    def __init__(self, leader: Membership | None, layout: Mapping[str, Shard], *,
                 contributes: bool, cluster, worker: int, policy: str) -> None:
        self.leader, self.layout, self.contributes = leader, dict(layout), contributes
        self.cluster, self.worker, self.policy = cluster, worker, policy
        self.members: list[int] = []
        self.step = 0
        self.healed = False
        self.other_run: dict[int, list[str]] = {}
        """:attr:`Membership.other_run <geomesh.exchange.membership.Membership.other_run>` of
        the last exchange, on every rank."""
        self._save: Callable[[], dict] | None = None
        self._load: Callable[[dict], None] | None = None
        if leader is not None:
            leader.set_state_fns(self._serve, self._stash)
        self._received: dict | None = None

    # -- state ---------------------------------------------------------------------
    def set_state_fns(self, save: Callable[[], dict], load: Callable[[dict], None]) -> None:
        """``save()``: this rank's heal state (outer state by local name, the rest
        shared); ``load(state)``: apply one in this rank's layout."""
        self._save, self._load = save, load

    def _mine(self) -> dict | None:
        return to_canonical(self._save(), self.layout) if self.contributes else None

    def _serve(self) -> dict:
        """Leader, in torchft's quorum thread: the region's state, gathered now; or, where
        this region healed earlier in the same call (a quorum asked again after a failed
        all-gather) and has not applied it yet, the state it healed from (its own is
        the one the heal replaces)."""
        if self._received is not None:
            return self._received
        _bcast(("state",))
        states: list = [None] * dist.get_world_size()
        dist.gather_object(self._mine(), states, dst=0)
        out = next(s for s in states if s is not None)
        for s in states:  # every contributing rank's pieces; the rest is the same everywhere
            if s is not None and s is not out:
                for sec, part in _TENSOR_STATE:
                    if sec in out:
                        out[sec][part].update(s[sec][part])
        return out

    def _stash(self, state: dict) -> None:
        self._received = state

    def _follow(self):
        """Other ranks: answer the leader's commands until its call's result arrives."""
        while True:
            cmd = _bcast(None)
            if cmd[0] == "state":
                dist.gather_object(self._mine(), None, dst=0)
            else:
                return cmd[1]

    def _finish(self, result):
        """Leader: end the followers' wait with ``result`` (which they return)."""
        _bcast(("done", result))
        return result

    def _apply(self, healed_state: dict | None) -> None:
        if healed_state is not None and self._load is not None:
            self._load(from_canonical(healed_state, self.layout))

    # -- the Membership calls --------------------------------------------------------
    def join(self, r: int) -> bool:
        """:meth:`Membership.join` on the leader; every rank applies a heal."""
        if self.leader is not None:
            self._received = None
            healed = self.leader.join(r)
            res = self._finish((healed, list(self.leader.members), self.leader.step,
                                self._received))
        else:
            res = self._follow()
        return self._result(res)

    def exchange(self, message: bytes | None, *, quorum_done: bool = False
                 ) -> list[bytes | None]:
        """:meth:`Membership.exchange` of the worker's message on the leader.

        Returns:
            every worker's message of the round (``None``: absent); :attr:`healed`
            tells whether this region healed instead of sending.
        """
        if self.leader is not None:
            self._received = None
            out, healed = self.leader.exchange(self.leader.step, message, quorum_done=quorum_done)
            res = self._finish((healed, list(self.leader.members), self.leader.step,
                                self._received, out, dict(self.leader.other_run)))
        else:
            res = self._follow()
        self._result(res[:4])
        self.other_run = res[5]
        return res[4]

    def _result(self, res) -> bool:
        healed, self.members, self.step, state = res
        self.healed = bool(healed)
        if healed:
            self._apply(state)
        return self.healed

    def lost(self, r: int, lost: list[int], why: str | dict[int, str]) -> None:
        """Workers dropped from round ``r`` (:func:`geomesh.exchange.membership.lost_workers`)."""
        lost_workers(self.cluster, self.policy, r, lost, why,
                     members=len(set(self.members) - set(lost)),
                     report=self.leader is not None and self.leader.report)

    def stop_watching(self) -> None:
        """:meth:`Membership.stop_watching <geomesh.exchange.membership.Membership.stop_watching>`
        on the job's rank 0 (the others watch nothing)."""
        if self.leader is not None:
            self.leader.stop_watching()

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()


def _bcast(obj):
    """Broadcast a small object from the job's rank 0 over the job's world."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]

