"""Plans for a changed membership, and plans carried to a worker that heals.

When workers are lost or rejoin (:mod:`geomesh.exchange.membership`), the round's
target tokens ``T`` are re-planned over the workers present: the planner's
algorithm (:class:`geomesh.fleet.planner.Planner`) runs on the cluster restricted
to them, with the speed corrections measured so far, so the survivors
share ``T`` and still finish together.  Absent workers keep their last
entry (the plan has one per worker, cluster order) but train nothing: the
outer loop skips them.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

from .plan import Plan, WorkerPlan
from .planner import Planner


def plan_for_members(planner: Planner, current: Plan, names: Sequence[str]) -> Plan:
    """A balanced plan of ``planner``'s ``T`` over the workers ``names``.

    Args:
        planner: the run's planner (not modified).
        current: the plan so far (its entries stand in for absent workers).
        names: the workers present next round.

    Returns:
        A plan with one entry per cluster worker, in cluster order.
    """
    present = set(names)
    if present == {w.worker for w in current.workers}:
        return planner.plan()
    sub = copy.copy(planner)
    sub.cluster = dataclasses.replace(
        planner.cluster, workers=tuple(w for w in planner.cluster.workers if w.name in present))
    sub.fit = planner.fit.restrict(present)
    part = {wp.worker: wp for wp in sub.plan().workers}
    return Plan(workers=tuple(part.get(wp.worker, wp) for wp in current.workers),
                target_tokens=current.target_tokens, tolerance=current.tolerance)


def plan_from_dict(d: dict, tolerance: float) -> Plan:
    """Inverse of :meth:`Plan.to_dict` (a peer's plan, received when healing)."""
    fields = {f.name for f in dataclasses.fields(WorkerPlan)}
    return Plan(workers=tuple(WorkerPlan(**{k: v for k, v in w.items() if k in fields})
                              for w in d["workers"]),
                target_tokens=int(d["target_tokens"]), tolerance=tolerance)
