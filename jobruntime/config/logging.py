"""The ``logging`` section: metrics sinks and progress."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class LoggingConfig:
    """Metrics sinks."""

    wandb: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline runs can be synced later with ``wandb sync``."""
    project: str = "geocona"
    group: str | None = None
    """wandb group (runs of one comparison share it)."""
    name: str | None = None
    """Run name; ``None`` derives one from the config and time."""
    progress: Literal["auto", "on", "off"] = "auto"
    """Terminal progress bar: ``auto`` shows it on a TTY for runs of > 50 steps
    and otherwise logs a line per evaluation and every 5 % of the steps;
    ``off``: neither."""
