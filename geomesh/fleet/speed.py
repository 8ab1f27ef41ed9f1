"""Measured speed of each worker against its profile: the planner's correction.

The planner's step time of worker ``i`` at micro-batch ``mb`` and ``a``
accumulation steps is the profile's ``m_i(mb, a)`` (:mod:`geomesh.fleet.clock`)
corrected by what was measured:

    ``t_i(mb, a) = m_i(mb, a) / speed_i + overhead_i · a``     (seconds per inner step)

``speed_i`` scales the profile (a slower GPU, a throttled one, an injected
slowdown); ``overhead_i`` is a fixed cost per micro-batch that the profile does
not have (kernel launches, the Python step: on CPU wall clock it dominates a
small model's step).  With measurements at one configuration only, ``overhead_i
= 0`` and ``speed_i = m/t`` — the single factor the planner used to apply at
every batch size, which put a re-plan's slow worker at one sequence per step
on the belief that it costs a sixteenth of sixteen (issue 25: 72-96 % idle
after re-plans in ``bench/faults.py``).  With two or more configurations,
``(1/speed_i, overhead_i)`` is the least-squares fit of ``t = k·m + o·a``
(``o ≥ 0``; else the fit through the origin).  A configuration measured again
is a drift (the machine changed, not the curve): every stored time of that
worker is scaled by the new/old ratio before the fit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


class SpeedModel:
    """Per-worker ``speed`` and ``overhead`` (module docstring) with the measured
    step times they are fitted to.

    Args:
        names: the workers (all start at ``speed`` 1, ``overhead`` 0, nothing measured).
    """

    def __init__(self, names: Iterable[str]) -> None:
        names = list(names)
        self.speed: dict[str, float] = {n: 1.0 for n in names}
        """Factor on the profile's throughput (1 = as modelled)."""
        self.overhead: dict[str, float] = {n: 0.0 for n in names}
        """Seconds per micro-batch on top of the profile."""
        self.samples: dict[str, dict[tuple[int, int], tuple[float, float]]] = {n: {} for n in names}
        """``{(mb, a): (profile seconds, measured seconds)}`` per worker and step."""

    def observe(self, name: str, mb: int, a: int, model_s: float, measured_s: float) -> None:
        """Worker ``name`` took ``measured_s`` per inner step at ``(mb, a)``, where the
        profile (speed 1, no overhead) says ``model_s``; refit its correction."""
        table = self.samples.setdefault(name, {})
        if (mb, a) in table:  # a drift: the whole curve moves
            ratio = measured_s / table[(mb, a)][1]
            for key, (m, t) in table.items():
                table[key] = (m, t * ratio)
        table[(mb, a)] = (model_s, measured_s)
        pts = [(m, float(acc), t) for (_, acc), (m, t) in table.items()]
        k, o = _fit(pts)
        self.speed[name], self.overhead[name] = 1.0 / k, o

    def restrict(self, names: Iterable[str]) -> SpeedModel:
        """A copy for the workers ``names`` only (re-planning for a membership)."""
        keep = set(names)
        out = SpeedModel([])
        out.speed = {n: v for n, v in self.speed.items() if n in keep}
        out.overhead = {n: v for n, v in self.overhead.items() if n in keep}
        out.samples = {n: dict(v) for n, v in self.samples.items() if n in keep}
        return out

    def state_dict(self) -> dict:
        """Plain containers (JSON-safe: healing payloads carry it)."""
        return {"overhead": dict(self.overhead),
                "samples": {n: [[mb, a, m, t] for (mb, a), (m, t) in v.items()]
                            for n, v in self.samples.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (``speed`` travels on its own, as before)."""
        self.overhead.update({n: float(v) for n, v in state.get("overhead", {}).items()})
        for n, rows in state.get("samples", {}).items():
            self.samples[n] = {(int(mb), int(a)): (float(m), float(t)) for mb, a, m, t in rows}


def _fit(pts: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares ``t = k·m + o·a`` over ``(m, a, t)`` with ``k > 0``, ``o ≥ 0``;
    through the origin (``o = 0``) when one point, a singular system or a
    negative overhead."""
    smm = sum(m * m for m, _, _ in pts)
    smt = sum(m * t for m, _, t in pts)
    through_origin = (smt / smm, 0.0)
    if len(pts) < 2:
        return through_origin
    saa = sum(a * a for _, a, _ in pts)
    sma = sum(m * a for m, a, _ in pts)
    sat = sum(a * t for _, a, t in pts)
    det = smm * saa - sma * sma
    if det <= 1e-12 * smm * saa:
        return through_origin
    k = (smt * saa - sma * sat) / det
    o = (smm * sat - sma * smt) / det
    return (k, o) if k > 0 and o >= 0 else through_origin
