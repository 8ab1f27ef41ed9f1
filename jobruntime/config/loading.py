"""Loading a preset, applying ``section.key=value`` overrides (type-checked), saving."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml

from .base import (
    MODEL_CONFIGS_DIR,
    REPO_ROOT,
    ConfigError,
    did_you_mean,
)
from .job import JobConfig

# ---------------------------------------------------------------------------
# Loading and overrides
# ---------------------------------------------------------------------------


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """Return ``value`` coerced to ``hint`` or raise ConfigError naming ``where``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _check_type(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if isinstance(value, bool) and value not in allowed:
            # YAML 1.1 reads on/off/yes/no as booleans; map them back to the words.
            words = ("on", "true", "yes") if value else ("off", "false", "no")
            value = next((w for w in words if w in allowed), value)
        if value not in allowed:
            raise ConfigError(f"{where}={value!r} is not one of {list(allowed)};"
                              f"{did_you_mean(value, allowed)}".rstrip(";"))
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be true or false")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be an integer")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}={value!r} must be a number")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}={value!r} must be a string")
    if hint is list or origin is list:
        if isinstance(value, list):
            return value
        raise ConfigError(f"{where}={value!r} must be a list")
    return value


# keys renamed since a config was saved: old path -> (new key in the same section, the
# old value's new form); a saved config.yaml or an old override keeps working
RENAMED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "cona.gns_preconditioned": ("gns_definition", lambda v: {True: "pollux", False: "simple"}.get(v, v)),
    # a run folder's config.yaml from before the rename (its resume advice loads it)
    "checkpoint.lr_schedule": ("optimizer_settings", lambda v: v),
}


def _apply(obj: Any, values: dict, where: str) -> None:
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if path in RENAMED:
            key, value = RENAMED[path][0], RENAMED[path][1](value)
            path = f"{where}.{key}" if where else key
        if key not in names:
            # the key of another section, given here (train.save_interval)
            elsewhere = [f"{f.name}.{key}" for f in dataclasses.fields(JobConfig)
                         if where and f.name != where and dataclasses.is_dataclass(f.default_factory)
                         and key in {x.name for x in dataclasses.fields(f.default_factory)}]
            hint = did_you_mean(key, names, prefix=f"{where}." if where else "", also=elsewhere)
            raise ConfigError(
                f"unknown config key {path!r};{hint} valid keys here: {', '.join(sorted(names))}"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{path!r} is a section; give it a mapping of keys")
            _apply(current, value, path)
        else:
            setattr(obj, key, _check_type(value, hints[key], path))


def resolve_preset(name_or_path: str | Path) -> Path:
    """Map ``tiny_gpt`` or ``model_configs/tiny_gpt.yaml`` or any path (``~`` is the home
    folder: ``--config=~/job.yaml`` reaches it unexpanded) to a file.

    Raises:
        ConfigError: no such preset or file.
    """
    p = Path(name_or_path).expanduser()
    candidates = [p, MODEL_CONFIGS_DIR / p, MODEL_CONFIGS_DIR / f"{p}.yaml", REPO_ROOT / p]
    for c in candidates:
        if c.is_file():
            return c
    known = sorted(x.stem for x in MODEL_CONFIGS_DIR.glob("*.yaml"))
    raise ConfigError(f"config {str(name_or_path)!r} not found;{did_you_mean(p.stem, known)} use "
                      f"a YAML file or one of {known}")


PRESET_RULE = "must name a preset or a job-config YAML"
"""What :func:`check_preset` asks of a setting (``tools/config_reference.py`` lists it)."""


def check_preset(name: str, setting: str) -> None:
    """Fail at validation, not after the data is prepared, on a setting (``setting``, e.g.
    ``cona.target_model``) whose value must name a preset or a job-config YAML: one that names
    no file, a file that is not a job config (a cluster YAML, say), or a config whose
    model section is invalid fails here.

    Raises:
        ConfigError: naming the setting, the value and what is wrong with it.
    """
    try:
        load_config(name).model.validate()  # its model sets time, bytes and memory
    except ConfigError as e:
        raise ConfigError(f"{setting}={name!r} {PRESET_RULE}: {e}") from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``section.key=value`` into (``[section, key]``, YAML-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    if not key:
        raise ConfigError(f"override {text!r} has no key")
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML "
                          f"({' '.join(str(e).split())})") from None
    return key.split("."), value


# Keys that name files or folders: a leading ``~`` in them is a home folder.
PATH_KEYS = (("data", "path"), ("data", "tokenizer"), ("data", "cache_dir"),
             ("checkpoint", "load"), ("geomesh", "cluster"), ("geomesh", "target_model"),
             ("geomesh", "secret_file"), ("cona", "target_model"), ("train", "zero_shot_tasks"))


def _expand_home(cfg: JobConfig) -> None:
    """Expand a leading ``~`` in every :data:`PATH_KEYS` value (``os.path.expanduser``;
    list items too): the shell expands none after ``section.key=``, so
    ``data.cache_dir=~/cache`` made a folder named ``~`` in the working directory."""
    def expand(v: Any) -> Any:
        if isinstance(v, list):
            return [expand(x) for x in v]
        return os.path.expanduser(v) if isinstance(v, str) and v.startswith("~") else v

    for section, key in PATH_KEYS:
        part = getattr(cfg, section)
        setattr(part, key, expand(getattr(part, key)))


def load_config(path: str | Path | None = None, overrides: list[str] | tuple = ()) -> JobConfig:
    """Load a preset YAML and apply ``section.key=value`` overrides.

    Args:
        path: preset name (``tiny_gpt``) or YAML path; ``None`` = defaults.
        overrides: strings ``section.key=value``; values are parsed as YAML.

    Raises:
        ConfigError: unknown key, wrong type, unreadable YAML.
    """
    cfg = JobConfig()
    if path is not None:
        file = resolve_preset(path)
        try:
            values = yaml.safe_load(file.read_text()) or {}
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
            raise ConfigError(f"{file}: not a readable YAML text file ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{file}: top level must be a mapping of sections")
        values.setdefault("name", file.stem)
        _apply(cfg, values, "")
    for text in overrides:
        keys, value = parse_override(text)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _apply(cfg, nested, "")
    _expand_home(cfg)
    return cfg


def save_config(cfg: JobConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically: temp file, then rename).

    ``model.padded_vocab_size`` is written resolved (the size this run's
    embedding has), so a resume or fine-tune builds the same shapes.
    """
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    values = cfg.to_dict()
    values["model"]["padded_vocab_size"] = cfg.model.padded_vocab
    tmp.write_text(yaml.safe_dump(values, sort_keys=False))
    tmp.replace(path)
