"""What losing a worker does to a GeoMesh run: ``geomesh.on_worker_loss``.

``fail`` stops every job with :class:`PeerLostError` (exit 3, naming the lost regions and
the fix); ``continue`` warns and goes on with the workers left, which a lost worker may
rejoin at a round boundary.  Used by the torchft membership of a region job
(:mod:`geomesh.exchange.membership`) and by a region's other ranks
(:mod:`geomesh.exchange.region`).
"""

from __future__ import annotations

import logging

from jobruntime.faults import RunInterrupted

from ..fleet.cluster import ClusterSpec

log = logging.getLogger(__name__)


class PeerLostError(RunInterrupted):
    """A worker of the run was lost (``on_worker_loss=fail``) or the lighthouse is gone."""


def lost_workers(cluster: ClusterSpec, policy: str, r: int, lost: list[int],
                 why: str | dict[int, str], *, members: int, report: bool) -> None:
    """Workers dropped from round ``r``: ``fail`` raises, ``continue`` warns.

    Args:
        why: the reason, one for all, or one per worker of ``lost``.

    Raises:
        PeerLostError: ``policy == "fail"`` (names every lost worker, the regions and the
            fix).
    """
    reasons = why if isinstance(why, dict) else dict.fromkeys(lost, why)
    by_reason: dict[str, list[int]] = {}
    for k in lost:
        by_reason.setdefault(reasons[k], []).append(k)
    detail = "; ".join(", ".join(f"{cluster.workers[k].name} ({cluster.workers[k].region})"
                                 for k in ks) + f": {reason}"
                       for reason, ks in by_reason.items())
    regions = list(dict.fromkeys(cluster.workers[k].region for k in lost))
    if policy == "fail":
        raise PeerLostError(
            f"GeoMesh round {r}: lost region(s) {regions} (worker {detail}); "
            "geomesh.on_worker_loss=fail stops every job: restart all regions, or use "
            "on_worker_loss=continue")  # train.py adds whether a checkpoint can resume
    if report:
        log.warning("GeoMesh round %d: lost worker %s; continuing with %d worker(s), it may "
                    "rejoin at a round boundary", r, detail, members)
