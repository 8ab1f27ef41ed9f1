"""The ``parallel`` section: the TP/PP/DP layout and the batch sizes."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import (
    ConfigError,
)
from .model import ModelConfig

MAX_GLOBAL_BATCH = 2**24
"""Largest global batch (sequences) a run or a CONA candidate may have: about 10^4 times
GPT-3 175B's 3.2M tokens of 2,048 (Brown et al. 2020, Table 2.1); a larger one is a typo,
and megatron's dataset index for it would not finish."""


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout.  DP is not set: it is ``world_size / (tp * pp)``."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    micro_batch_size: int = 4
    """Sequences per micro-batch per DP rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step across all DP ranks; must be a multiple of
    ``micro_batch_size * dp``.  Gradient accumulation makes up the rest."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs ``tp > 1``)."""

    def validate(self, model: ModelConfig, world_size: int) -> int:
        """Check the layout against the model and world; return the DP size.

        Raises:
            ConfigError: a size does not divide (names the key and the fix).
        """
        for name in ("tp", "pp", "micro_batch_size", "global_batch_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"parallel.{name} must be positive, got {getattr(self, name)}")
        if self.global_batch_size > MAX_GLOBAL_BATCH:
            raise ConfigError(f"parallel.global_batch_size={self.global_batch_size} must be at "
                              f"most {MAX_GLOBAL_BATCH} sequences; set the global batch you mean")
        if world_size % (self.tp * self.pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by parallel.tp*parallel.pp="
                f"{self.tp * self.pp}; launch a multiple of tp*pp processes, or set a layout "
                f"that fits {world_size} (e.g. parallel.tp={math.gcd(world_size, self.tp)} "
                "parallel.pp=1: a checkpoint loads at any layout)"
            )
        dp = world_size // (self.tp * self.pp)
        problems = model.split_problems(self.tp, self.pp)
        if problems:
            raise ConfigError(f"parallel.{problems[0]}")
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ConfigError(
                f"parallel.global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size*dp={self.micro_batch_size}*{dp}; change one of them"
            )
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel needs parallel.tp > 1")
        return dp
