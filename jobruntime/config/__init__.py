"""One typed configuration tree for a training job.

A job is described by :class:`JobConfig`, a tree of keyword-only dataclasses
loaded from a YAML preset in ``model_configs/`` and narrowed by command-line
overrides of the form ``section.key=value``.  Unknown keys and values of the
wrong type are errors that name the key and the fix (:class:`ConfigError`).

This module is pure data: the conversion to megatron-core's
``TransformerConfig`` happens in exactly one place,
:func:`jobruntime.model.to_transformer_config`.  GeoMesh and CONA read their
own sections (:class:`GeoMeshConfig`, :class:`ConaConfig`) and never raw
arguments.

One module per section, each with its keys and its checks: :mod:`.model`,
:mod:`.parallel`, :mod:`.train`, :mod:`.data`, :mod:`.checkpoint`,
:mod:`.logging`, :mod:`.geomesh`, :mod:`.cona`; :mod:`.job` joins them,
:mod:`.loading` reads presets and overrides, :mod:`.unused` refuses overrides a job would
ignore, :mod:`.base` holds what they share.
Every public name is re-exported here: ``from jobruntime.config import X``.
"""

from __future__ import annotations

from .base import MODEL_CONFIGS_DIR, PAD_MULTIPLE, REPO_ROOT, ConfigError, did_you_mean
from .checkpoint import CheckpointConfig
from .cona import ConaConfig
from .data import DataConfig
from .geomesh import GeoMeshConfig
from .job import JobConfig
from .loading import load_config, parse_override, resolve_preset, save_config
from .logging import LoggingConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .train import TrainConfig
from .unused import check_overrides_used

__all__ = [
    "MODEL_CONFIGS_DIR", "PAD_MULTIPLE", "REPO_ROOT", "CheckpointConfig", "ConaConfig",
    "ConfigError", "DataConfig", "GeoMeshConfig", "JobConfig", "LoggingConfig", "ModelConfig",
    "ParallelConfig", "TrainConfig", "check_overrides_used", "did_you_mean", "load_config",
    "parse_override", "resolve_preset", "save_config",
]
