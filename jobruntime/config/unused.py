"""Overrides a job would ignore: refused, so a run never trains without what was asked.

``python train.py cona.efficiency_correction=progress`` (CONA off) or ``geomesh.overlap=0.1``
(GeoMesh off) trained an ordinary job and exited 0.  :func:`check_overrides_used` names
such an override and what would make it count.  Only command-line overrides are checked:
a preset or a run's saved ``config.yaml`` may keep a feature's settings switched off.
"""

from __future__ import annotations

import typing
from typing import Any

from .base import ConfigError
from .geomesh import GeoMeshConfig
from .job import JobConfig
from .loading import parse_override

_METHODS = [m for m in typing.get_args(typing.get_type_hints(GeoMeshConfig)["method"])
            if m != "none"]
GEOMESH_ON = f"geomesh.method={_METHODS[0]} (or {', '.join(_METHODS[1:])})"
# Keys only one GeoMesh method reads: GeoMesh's own planner, codec and overlap (the other
# methods run a uniform plan and exchange fp32: geomesh/sync.py), and the fragments of
# Streaming DiLoCo (geomesh/streaming.py).
METHOD_ONLY = {
    **dict.fromkeys(("balance", "plan_tolerance", "inner_lr_scaling", "replan", "compression",
                     "topk_k", "topk_bits", "compress_update", "error_feedback",
                     "error_feedback_decay", "overlap"), "geomesh"),
    **dict.fromkeys(("fragments", "fragment_sync_delay", "fragment_update_alpha",
                     "fragment_bits"), "streaming_diloco"),
}


# GeoMesh keys some methods do not read: DDP has no outer step (geomesh/baselines.py); DDP
# and async exchange no messages a guard checks (geomesh/wire/guard.py runs in sync and
# streaming only).
NOT_READ_BY = {
    **dict.fromkeys(("outer_lr", "outer_momentum", "outer_momentum_warmup"), ("ddp",)),
    **dict.fromkeys(("max_norm_ratio", "token_tolerance", "robust_aggregation"),
                    ("ddp", "async")),
}
# train.* keys a GeoMesh run replaces with its own (its length and cadence are rounds).
TRAIN_IN_GEOMESH = {
    "iters": "it lasts geomesh.outer_steps rounds of geomesh.inner_steps inner steps; set those",
    "lr_decay_iters": "each worker decays its LR over its own inner steps of the run",
    "eval_interval": "it evaluates every geomesh.eval_interval outer steps; set that",
    "max_wall_s": "it stops after geomesh.outer_steps rounds; set that",
}
# checkpoint.* keys of saving (jobruntime/loop.py, cona/run.py and cona/loop.py, geomesh/state.py).
CHECKPOINT_SAVES = ("save_interval", "save_final", "keep_last")
# GeoMesh methods without checkpoints (geomesh/baselines.py run_async, geomesh/streaming.py).
NO_CHECKPOINTS = ("async", "streaming_diloco")
# checkpoint.* values that ask for no saving or loading: what a job that saves nothing
# (CONA's emulated clock) or saves and loads nothing (NO_CHECKPOINTS) does anyway, so a
# script that always passes them runs everywhere.
SAVES_NOTHING = {"save_interval": (0,), "save_final": (False,), "load": (None, "")}
# GeoMesh keys only real mode reads (one job per region: transport, heartbeats, messages).
REAL_MODE_ONLY = ("timeout_s", "heartbeat_s", "on_worker_loss", "secret_file")


def _asks_for_nothing(key: str, value: Any) -> bool:
    """Whether ``checkpoint.<key>=<value>`` asks for no saving or loading
    (:data:`SAVES_NOTHING`; ``False`` is not ``0`` here, nor ``0`` ``False``)."""
    return any(type(value) is type(v) and value == v for v in SAVES_NOTHING.get(key, ()))


def _why_ignored(cfg: JobConfig, section: str, key: str, value: Any,
                 geomesh_mode: str | None) -> str | None:
    """Why a job with ``cfg`` reads no ``section.key`` (set to ``value``), and the fix;
    ``None`` if it reads it, or if it asks for nothing the job would do anyway."""
    method = cfg.geomesh.method
    geomesh = method != "none"
    cona_emulated = cfg.cona.enabled and cfg.cona.clock == "emulated"
    if section == "cona" and key != "enabled":
        if not cfg.cona.enabled:
            return "cona is off in this job; switch it on with cona.enabled=true, or drop it"
        if geomesh and key not in ("schedule", "switch_timeout_s"):  # a region's switch
            return ("a GeoMesh run reads only cona.schedule and cona.switch_timeout_s of the "
                    "cona section (CONA's controller does not drive GeoMesh regions); drop it")
        if not geomesh and cona_emulated and key == "switch_timeout_s":
            return ("CONA's emulated clock charges a modelled switch and runs none (real mode, "
                    "cona.clock=wall, reads it); drop it")
    if section == "geomesh" and key != "method":
        if not geomesh:
            return f"geomesh is off in this job; switch it on with {GEOMESH_ON}, or drop it"
        if METHOD_ONLY.get(key, method) != method:
            return (f"geomesh.method={method} does not read it (geomesh.method="
                    f"{METHOD_ONLY[key]} does); drop it")
        if method in NOT_READ_BY.get(key, ()):
            return f"geomesh.method={method} does not read it; drop it"
        if key in REAL_MODE_ONLY and geomesh_mode == "emulated":
            return ("the cluster runs in emulated mode, which does not read it (real mode "
                    "does, one job per region); drop it")
    if section == "checkpoint" and (method in NO_CHECKPOINTS or (cona_emulated and not geomesh)) \
            and _asks_for_nothing(key, value):
        return None  # saves (or loads) nothing, as the job does
    if section == "checkpoint" and method in NO_CHECKPOINTS and key in (
            *CHECKPOINT_SAVES, "load", "load_optimizer", "optimizer_settings"):
        return (f"geomesh.method={method} saves and loads no checkpoints (geomesh.method="
                "geomesh, diloco or ddp do); drop it")
    if section == "checkpoint" and key == "optimizer_settings" and cfg.cona.enabled and \
            not geomesh:
        return ("CONA trains with its config's optimizer settings on a resume (its layout "
                "switches rebuild them from it); drop it")
    if section == "checkpoint" and key == "optimizer_settings" and value != "same" and not (
            cfg.checkpoint.load and cfg.checkpoint.load_optimizer):
        return ("it chooses the optimizer settings of a resume (checkpoint.load, with "
                "checkpoint.load_optimizer), and this run resumes nothing; drop it")
    if section == "checkpoint" and key in CHECKPOINT_SAVES:
        if geomesh and key == "save_final":
            return ("a GeoMesh run saves every checkpoint.save_interval outer steps and after "
                    "its last round when that is above 0; set checkpoint.save_interval")
        if cona_emulated and not geomesh:
            return ("CONA's emulated clock trains a proxy and saves no checkpoint (real mode, "
                    "cona.clock=wall, does); drop it")
    if section == "train" and geomesh and key in TRAIN_IN_GEOMESH:
        return f"a GeoMesh run does not read it: {TRAIN_IN_GEOMESH[key]}"
    if section == "parallel" and key in ("tp", "pp"):
        if geomesh:
            return ("a GeoMesh run takes each region's layout from the cluster file (its "
                    "workers' tp and pp); set it there, or drop it")
        if cona_emulated:
            return ("CONA's emulated clock picks the start layout from its candidates; give "
                    "cona.candidates to choose it, or drop it")
    return None


def _keys(text: str) -> list[tuple[str, str, Any]]:
    """The ``(section, key, value)`` triples an override sets: one, or each key of a
    section given whole (``cona={clock: emulated}``)."""
    keys, value = parse_override(text)
    if len(keys) >= 2:
        return [(keys[0], keys[1], value)]
    return [(keys[0], k, v) for k, v in value.items()] if isinstance(value, dict) else []


def check_overrides_used(cfg: JobConfig, overrides: list[str] | tuple[Any, ...], *,
                         geomesh_mode: str | None = None) -> None:
    """Refuse a command-line override that the job would ignore:

    - a ``cona.*`` key while ``cona.enabled`` is false, or other than ``cona.schedule``
      and ``cona.switch_timeout_s`` (a region's layout switch) in a GeoMesh run;
    - a ``geomesh.*`` key while ``geomesh.method`` is ``none``, or one that only another
      method reads (:data:`METHOD_ONLY`), or only real mode reads (:data:`REAL_MODE_ONLY`)
      where ``geomesh_mode`` is ``emulated``;
    - a ``geomesh.*`` key that the method does not read (:data:`NOT_READ_BY`), or a
      ``train.*`` key that a GeoMesh run replaces with its own (:data:`TRAIN_IN_GEOMESH`);
    - ``parallel.tp`` or ``parallel.pp`` in a GeoMesh run (the cluster file lays out
      each region) or on CONA's emulated clock (CONA picks the start layout);
    - any ``checkpoint.*`` key of saving or loading with a GeoMesh method that has no
      checkpoints (:data:`NO_CHECKPOINTS`);
    - ``checkpoint.save_final`` in a GeoMesh run (it saves by ``save_interval``), and
      the keys of saving (:data:`CHECKPOINT_SAVES`) and ``cona.switch_timeout_s`` on
      CONA's emulated clock (it saves nothing and runs no switch).

    A value that asks for no saving or loading (:data:`SAVES_NOTHING`:
    ``checkpoint.save_interval=0``, ``save_final=false``, ``load=null``) is accepted
    where the job saves nothing: it is what the job does.

    Args:
        cfg: the loaded config (preset and overrides applied, :func:`load_config`).
        overrides: the same ``section.key=value`` strings.
        geomesh_mode: the GeoMesh cluster's mode once its file is read (``emulated`` or
            ``real``); ``None``: not known yet.

    Raises:
        ConfigError: naming the first such override, why it has no effect and the fix.
    """
    for text in overrides:
        for section, key, value in _keys(text):
            if (why := _why_ignored(cfg, section, key, value, geomesh_mode)) is not None:
                raise ConfigError(f"override {text!r} has no effect: {why}")
