"""Rank-aware logging: rank 0 (or the given rank) logs at INFO, others at WARNING."""

from __future__ import annotations

import logging
import os
import warnings


def quiet_expected_warnings() -> None:
    """Ignore warnings that are expected here and say nothing actionable:
    megatron-core's import-time notes on missing Apex / Transformer Engine
    (normal on CPU) and torch's ShardedTensor deprecation notices, which
    megatron 0.16's dist_checkpointing triggers on every load.  Called when
    :mod:`jobruntime` is imported, so the tools' output stays clean too."""
    for pattern in ("Transformer Engine", "Apex is not installed", "full scope is deprecated",
                    "`load_state_dict` is deprecated", "Please use DTensor instead"):
        warnings.filterwarnings("ignore", message=f".*{pattern}.*")


def setup_logging(level: int = logging.INFO) -> None:
    """Configure the ``jobruntime``/``geomesh``/``cona`` loggers for this rank.

    (Expected library warnings are already filtered when :mod:`jobruntime` is
    imported, see :func:`quiet_expected_warnings`.)
    """
    rank = int(os.environ.get("RANK", "0"))
    fmt = f"[%(asctime)s r{rank}] %(name)s: %(message)s" if "RANK" in os.environ else \
        "[%(asctime)s] %(name)s: %(message)s"
    logging.basicConfig(level=level if rank == 0 else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S")
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # torch.distributed.checkpoint logs a traceback (on the root logger) for a
    # checkpoint without global metadata, then raises; jobruntime.checkpoint
    # turns that error into one line, so the logged copy is only noise.
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda r: not r.getMessage().startswith("Global metadata is not found"))
