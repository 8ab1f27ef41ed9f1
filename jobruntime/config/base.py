"""What every section shares: the repository paths, :class:`ConfigError`, the
"did you mean" helper and the range check of one key."""

from __future__ import annotations

from pathlib import Path

# Where the bundled presets live (``model_configs/`` next to the ``jobruntime`` package).
REPO_ROOT = Path(__file__).resolve().parent.parent.parent
MODEL_CONFIGS_DIR = REPO_ROOT / "model_configs"


# The default padding of the vocabulary: a multiple of 128, whatever the layout
# (see jobruntime/vocab.py).
PAD_MULTIPLE = 128


class ConfigError(ValueError):
    """A configuration key or value is invalid; the message names it and the fix.

    Always one line: line breaks that user text brings into the message (a key
    or value with a newline) are shown escaped, as ``\\n``.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message.replace("\r", "\\r").replace("\n", "\\n"))


def did_you_mean(word, choices, *, prefix: str = "", also=()) -> str:
    """``" did you mean 'x'?"`` naming the ``choices`` closest to a misspelt ``word``
    (``difflib.get_close_matches``: similarity ratio >= 0.6, at most three), else ``""``.

    Args:
        prefix: put before each suggestion (``"train."`` for a key of that section).
        also: suggestions to name first (e.g. the same key in another section).
    """
    import difflib

    close = [*also, *(prefix + c for c in difflib.get_close_matches(
        str(word), [str(c) for c in choices], n=3))]
    return f" did you mean {' or '.join(map(repr, close))}?" if close else ""


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def _need(section: object, name: str, ok: bool, key: str, rule: str) -> None:
    """Raise ConfigError ``<name>.<key>=<value> <rule>`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{name}.{key}={getattr(section, key)!r} {rule}")
