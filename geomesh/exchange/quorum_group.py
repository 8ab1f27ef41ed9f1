"""The process group of a GeoMesh quorum: torchft's, remembering who is in it.

torchft (``torchft.process_group``) rebuilds its process group at every new quorum
with ``configure``; :class:`geomesh.exchange.membership.Membership` needs the
members of the quorum (worker indices) to label each gathered message, and a store
prefix that a restarted lighthouse's quorum ids (numbered from 1 again) cannot reuse.
"""

from __future__ import annotations

from torchft.process_group import create_store_client


def recording_group(base: type) -> type:
    """A subclass of torchft's ``base`` (``ProcessGroupGloo`` or ``ProcessGroupNCCL``)
    whose ``members`` lists the worker indices of its current quorum, sorted.

    Each ``configure`` (a new quorum) also moves the group's store prefix to a new
    epoch, so a quorum id that a restarted lighthouse hands out again never meets the
    rendezvous keys of an earlier group.
    """

    class Recording(base):
        members: list[int] = []

        def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None,
                      group_rank=None, group_world_size=None, global_ranks=None):
            # torchft's prefix is <store>/torchft/<quorum id>/<group rank>, and a restarted
            # lighthouse numbers its quorums from 1 again: the same prefix would meet the
            # stale rendezvous keys of an earlier group.  Every member of a quorum counts
            # itself in on the prefix; each use of it by world_size members is one epoch.
            uses = create_store_client(store_addr, timeout=self._timeout).add(
                f"geomesh_uses/{world_size}", 1)
            super().configure(f"{store_addr}/e{(uses - 1) // world_size}", replica_id, rank,
                              world_size, quorum_id, group_rank, group_world_size, global_ranks)
            # torchft numbers replica k's group rank g as k * group_world_size + g.
            self.members = sorted(r // max(group_world_size or 1, 1) for r in global_ranks or [])

    return Recording
