"""A region's scheduled layout switches (``cona.schedule``): parsed and checked
against the cluster before anything is built.  Torch-free, so ``train.py`` runs these
checks before its heavy imports; :mod:`geomesh.layout_switch` carries the switches out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jobruntime.config import ConfigError, JobConfig

from .cluster import ClusterError, ClusterSpec


@dataclass(frozen=True)
class Switch:
    """One scheduled layout switch: after outer step ``after_step``, ``region`` runs ``(tp, pp)``."""

    after_step: int
    region: str
    tp: int
    pp: int = 1


def parse_schedule(cfg: JobConfig) -> list[Switch]:
    """``cona.schedule`` as :class:`Switch` entries (empty without one).

    Raises:
        ConfigError: an entry that is not ``{after_step, region, tp[, pp]}`` of
            positive integers and a region name.
    """
    raw = cfg.cona.schedule
    if raw is None:
        return []
    out = []
    for i, e in enumerate(raw if isinstance(raw, list) else [raw]):
        keys = set(e) if isinstance(e, dict) else set()
        if not keys or not {"after_step", "region", "tp"} <= keys <= {"after_step", "region", "tp",
                                                                        "pp"}:
            raise ConfigError(f"cona.schedule[{i}]={e!r} must be {{after_step: N, region: NAME, "
                              "tp: T, pp: P} (pp optional, default 1)")
        ints = [e["after_step"], e["tp"], e.get("pp", 1)]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in ints):
            raise ConfigError(f"cona.schedule[{i}]: after_step, tp and pp must be positive "
                              f"integers, got {e!r}")
        out.append(Switch(int(e["after_step"]), str(e["region"]), int(e["tp"]),
                          int(e.get("pp", 1))))
    return out


def check_schedule(cfg: JobConfig, cluster: ClusterSpec, memory, *, model_name: str) -> None:
    """Refuse a ``cona.schedule`` this run cannot follow, before anything is built.

    Args:
        cfg: the job config (``cona``, ``geomesh``, ``checkpoint`` sections).
        cluster: the loaded cluster (its mode already resolved).
        memory: the planner's memory model, to check each new shape's fit
            (:func:`geomesh.fleet.shapes.check_region_shapes`).
        model_name: how messages name the model.

    Raises:
        ConfigError: CONA on without a schedule in a GeoMesh run or a schedule
            without CONA (:meth:`jobruntime.config.ConaConfig.validate`), a schedule in
            emulated mode or without ``geomesh.region``, with ``checkpoint.load``, an
            unknown region, a step outside ``[1, outer_steps)``, two switches of one
            region after the same step, or a ``tp·pp`` that does not divide the
            region's processes.
        ClusterError: a new shape that does not split the model or fit the GPUs.
    """
    from .shapes import check_region_shapes

    g = cfg.geomesh
    cfg.cona.validate()  # a schedule without cona.enabled, before any process group
    if cfg.cona.enabled and cfg.cona.schedule is None:
        raise ConfigError("cona.enabled=true in a GeoMesh run switches regions on cona.schedule "
                          "(CONA's controller does not drive GeoMesh regions yet); give "
                          "cona.schedule=[{after_step: N, region: NAME, tp: T, pp: P}] or set "
                          "cona.enabled=false")
    sched = parse_schedule(cfg)
    if not sched:
        return
    if cluster.mode != "real" or g.region is None:
        raise ConfigError("cona.schedule switches the layout of one region's job: it needs "
                          "mode: real with one job per region (geomesh.region, e.g. python -m "
                          "geomesh.launch_local); unset cona.schedule")
    if cfg.checkpoint.load:
        raise ConfigError("cona.schedule does not combine with checkpoint.load yet (a checkpoint "
                          "holds per-rank state of one layout); unset one of them")
    names = [r.name for r in cluster.regions]
    seen = set()
    for s in sched:
        if s.region not in names:
            raise ConfigError(f"cona.schedule: region {s.region!r} is not in cluster "
                              f"'{cluster.name}'; use one of {names}")
        if not 1 <= s.after_step < g.outer_steps:
            raise ConfigError(f"cona.schedule: after_step={s.after_step} must be in [1, "
                              f"geomesh.outer_steps={g.outer_steps}) (a switch between rounds)")
        if (s.region, s.after_step) in seen:
            raise ConfigError(f"cona.schedule: region {s.region!r} switches twice after step "
                              f"{s.after_step}; keep one entry")
        seen.add((s.region, s.after_step))
        for w in cluster.workers_in(s.region):
            if w.num_gpus % (s.tp * s.pp):
                raise ConfigError(f"cona.schedule: region {s.region!r} has {w.num_gpus} "
                                  f"process(es), not a multiple of tp*pp={s.tp * s.pp}")
            moved = dataclasses.replace(w, tp=s.tp, pp=s.pp)
            try:
                check_region_shapes(dataclasses.replace(cluster, workers=[moved]), cfg.model,
                                    memory, model_name=model_name)
            except ClusterError as e:  # the fix is in the schedule, not the cluster file
                raise ClusterError(f"cona.schedule after step {s.after_step}: {e}") from None


def max_tp(cfg: JobConfig, cluster: ClusterSpec) -> int:
    """Largest TP any worker runs in this run: the cluster file's or a scheduled one
    (every region reads the same config, so all choose the same codec)."""
    return max([w.tp for w in cluster.workers] + [s.tp for s in parse_schedule(cfg)])
