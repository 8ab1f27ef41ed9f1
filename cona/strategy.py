"""Parallelism strategies: one layout (DP, TP, PP, micro-batch, global batch).

A :class:`Strategy` is what CONA ranks and switches between.  It is a frozen
value (hashable, usable as a dict key) and knows nothing about process groups;
validity against a model and a world size is checked here, memory feasibility
by :mod:`cona.memory_model`.

Validity rules (the same as megatron-core's and
:meth:`jobruntime.config.ParallelConfig.validate`):

- ``dp * tp * pp == world_size``;
- ``tp`` divides the query heads and the key/value heads (GQA);
- ``pp`` divides the number of layers (no uneven stages);
- ``global_batch_size`` is a multiple of ``dp * micro_batch_size`` (gradient
  accumulation supplies ``num_microbatches`` micro-batches per DP rank).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from jobruntime.config import ModelConfig

_LABEL_RE = re.compile(r"^dp(\d+)-tp(\d+)-pp(\d+)-mb(\d+)-gb(\d+)$")


@dataclass(frozen=True, order=True)
class Strategy:
    """One parallel layout.  All sizes are positive integers.

    Attributes:
        dp: data-parallel replicas.
        tp: tensor-parallel size (devices that split each layer).
        pp: pipeline-parallel stages.
        micro_batch_size: sequences per micro-batch per DP rank.
        global_batch_size: sequences per optimizer step over all DP ranks.

    Raises:
        ValueError: a size is not a positive int, or ``global_batch_size`` is
            not a multiple of ``dp * micro_batch_size``.
    """

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    global_batch_size: int

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch_size", "global_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"Strategy.{name} must be a positive int, got {value!r}")
        if self.global_batch_size % (self.dp * self.micro_batch_size):
            raise ValueError(
                f"Strategy {self.label}: global_batch_size={self.global_batch_size} is not a "
                f"multiple of dp*micro_batch_size={self.dp}*{self.micro_batch_size}"
            )

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per DP rank per optimizer step (gradient accumulation steps)."""
        return self.global_batch_size // (self.dp * self.micro_batch_size)

    @property
    def world_size(self) -> int:
        """Devices used: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    @property
    def model_parallel_size(self) -> int:
        """Devices holding one model replica: ``tp * pp``."""
        return self.tp * self.pp

    @property
    def label(self) -> str:
        """Short stable name, e.g. ``"dp4-tp2-pp1-mb2-gb64"`` (parse with :meth:`from_label`)."""
        return (
            f"dp{self.dp}-tp{self.tp}-pp{self.pp}"
            f"-mb{self.micro_batch_size}-gb{self.global_batch_size}"
        )

    def __str__(self) -> str:
        return self.label

    def to_dict(self) -> dict[str, int]:
        """The five sizes as a plain dict (the format of ``cona.candidates``)."""
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": self.pp,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Strategy:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: missing or unknown keys (named), or invalid sizes.
        """
        keys = {"dp", "tp", "pp", "micro_batch_size", "global_batch_size"}
        missing, unknown = keys - set(d), set(d) - keys
        if missing or unknown:
            raise ValueError(
                f"strategy {d!r}: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}; "
                f"expected exactly {sorted(keys)}"
            )
        return cls(**{k: d[k] for k in keys})

    @classmethod
    def from_label(cls, label: str) -> Strategy:
        """Parse ``"dp4-tp2-pp1-mb2-gb64"``.

        Raises:
            ValueError: the text does not have that form.
        """
        m = _LABEL_RE.match(label.strip())
        if not m:
            raise ValueError(f"'{label}' is not a strategy label like 'dp4-tp2-pp1-mb2-gb64'")
        return cls(*(int(g) for g in m.groups()))


def check_strategy(strategy: Strategy, model_cfg: ModelConfig, world_size: int) -> list[str]:
    """Reasons why ``strategy`` cannot run ``model_cfg`` on ``world_size`` devices.

    Returns:
        A list of human-readable reasons; empty means valid.  Memory is not
        checked here (see :class:`cona.memory_model.MemoryModel`).
    """
    reasons = []
    if strategy.world_size != world_size:
        reasons.append(f"dp*tp*pp={strategy.world_size} != world size {world_size}")
    reasons += model_cfg.split_problems(strategy.tp, strategy.pp)  # megatron's split rules
    return reasons


class PeakMemory(Protocol):
    """Anything with ``peak_bytes(strategy) -> float`` (e.g. ``MemoryModel``)."""

    def peak_bytes(self, strategy: Strategy) -> float: ...


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_strategies(
    model_cfg: ModelConfig,
    world_size: int,
    *,
    global_batch_sizes: Iterable[int],
    micro_batch_sizes: Iterable[int],
    memory_limit_bytes: float | None = None,
    memory_model: PeakMemory | Callable[[Strategy], float] | None = None,
    tp_sizes: Sequence[int] | None = None,
    pp_sizes: Sequence[int] | None = None,
) -> list[Strategy]:
    """All valid, memory-feasible strategies on ``world_size`` devices.

    Args:
        model_cfg: the model whose heads and layers constrain TP and PP.
        world_size: devices; every strategy uses all of them.
        global_batch_sizes: candidate global batch sizes (sequences).
        micro_batch_sizes: candidate micro-batch sizes (sequences per DP rank).
        memory_limit_bytes: per-device memory; ``None`` skips the memory check.
        memory_model: gives a strategy's peak bytes per device, either an
            object with ``peak_bytes(strategy)`` (e.g.
            ``cona.memory_model.MemoryModel``) or a callable; required with a
            limit.
        tp_sizes, pp_sizes: restrict TP / PP (e.g. TP to one node's GPUs);
            ``None`` tries every divisor of ``world_size``.

    Returns:
        Strategies sorted by (dp, tp, pp, micro-batch, global batch); no
        duplicates.

    Raises:
        ValueError: ``world_size`` is not positive, or a memory limit without
            a memory model.
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if memory_limit_bytes is not None and memory_model is None:
        raise ValueError("memory_limit_bytes needs a memory_model (e.g. cona.memory_model.MemoryModel)")
    peak: Callable[[Strategy], float] | None = None
    if memory_model is not None:
        peak = memory_model.peak_bytes if hasattr(memory_model, "peak_bytes") else memory_model

    gbs = sorted(set(global_batch_sizes))
    mbs = sorted(set(micro_batch_sizes))
    out = []
    for tp in tp_sizes or _divisors(world_size):
        for pp in pp_sizes or _divisors(world_size):
            if world_size % (tp * pp):
                continue
            dp = world_size // (tp * pp)
            for mb in mbs:
                for gb in gbs:
                    if mb <= 0 or gb <= 0 or gb % (dp * mb):
                        continue
                    s = Strategy(dp, tp, pp, mb, gb)
                    if check_strategy(s, model_cfg, world_size):
                        continue
                    if memory_limit_bytes is not None and peak(s) > memory_limit_bytes:
                        continue
                    out.append(s)
    return sorted(set(out))


def strategies_from_dicts(
    entries: Sequence[dict], model_cfg: ModelConfig, world_size: int
) -> list[Strategy]:
    """Parse and validate explicit candidates (``cona.candidates`` in the config).

    Raises:
        ValueError: an entry is malformed or invalid; the message gives its
            index and the reasons.
    """
    out = []
    for i, d in enumerate(entries):
        try:
            s = Strategy.from_dict(dict(d))
        except (TypeError, ValueError) as e:
            raise ValueError(f"cona.candidates[{i}]: {e}") from None
        reasons = check_strategy(s, model_cfg, world_size)
        if reasons:
            raise ValueError(f"cona.candidates[{i}] ({s.label}): " + "; ".join(reasons))
        out.append(s)
    return out


def switch_kind(a: Strategy, b: Strategy) -> str:
    """``"layout"`` if dp, tp or pp differ (resharding), else ``"batch"``."""
    return "layout" if (a.dp, a.tp, a.pp) != (b.dp, b.tp, b.pp) else "batch"
