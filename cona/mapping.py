"""Proxy -> target: the one rule that maps the trained proxy's batches and noise scale
onto the timed target model (emulated mode).

In emulated mode a small proxy (e.g. ``tiny_gpt``, sequence ``s_p`` = 64) really
trains on real text, while time comes from the target (e.g. GPT-3 1.3B,
sequence ``s_t`` = 2048) on the emulated cluster.  One proxy step of ``B_p``
sequences stands for one target step of

    B_t = r * B_p        target sequences (of s_t tokens)

and the proxy's measured gradient noise scale ``phi_p`` (McCandlish et al.
2018, ``B_simple``, in proxy sequences) stands for ``phi_t = r * phi_p``.
Everything the controller compares lives in target units; Pollux's
efficiency ``E(M) = (phi + M0)/(phi + M)`` (Qiao et al. OSDI'21, eq. 5) is
unchanged when ``phi``, ``M`` and ``M0`` are all scaled by ``r``, so the
proxy's convergence per sample is what the target's would be at ``r`` times
the batch.

**The ratio is fixed** (:data:`BATCH_RATIO` = 8 for every family, a constant
chosen before any run, not measured): the bench's target grid of 64-1024
sequences is then proxy batches of 8-128, whose smallest is the preset batch
of tiny_gpt and tiny_llama (where their LR is tuned) and whose largest still
trains in seconds per step on one CPU core; tiny_bert's preset batch 16
stands for 128.  The earlier rule rounded ``B_pub / phi_ref`` (a measured
noise scale) to a power of two, so a small numeric difference between
machines or thread counts could move a whole family across a rounding edge.
Where the proxy's noise scale lands on the target's training is now said by
the time scale instead (:func:`cona.targets.time_scale`), which is
continuous in the measurement: ``r * phi_p`` target sequences name, through
Kaplan et al. 2020's ``B_crit(L)``, the target's loss, and so the span of
its training one run stands for.

:data:`PUBLISHED_BATCH` holds each target's published global batch (target
sequences, with its source): the ``static_recipe`` baseline's batch
(:mod:`cona.baselines`).

In real mode (``cona.clock=wall``) proxy and target are the same model and
``r = 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BATCH_RATIO = 8  # target sequences per proxy sequence, every family (module docstring)

# target preset -> (published global batch in target sequences, source)
PUBLISHED_BATCH: dict[str, tuple[int, str]] = {
    "gpt3_1.3b": (512, "Brown et al. 2020, Table 2.1: GPT-3 XL (1.3B), batch 1M tokens = 512 x 2048"),
    "bert_large": (256, "Devlin et al. 2019, Sec. A.2: 256 sequences x 512 tokens = 128k tokens"),
    "llama3.2_1b": (
        1024,
        "Meta's Llama-3.2-1B model card gives no batch; nearest published recipe: TinyLlama "
        "1.1B (Zhang et al. 2024, Llama-2 architecture, 1.1B), batch 2M tokens = 1024 x 2048",
    ),
}


def recipe_batch(target: str) -> int:
    """The published global batch of ``target`` in target sequences (:data:`PUBLISHED_BATCH`).

    Raises:
        KeyError: no published batch for ``target``.
    """
    if target not in PUBLISHED_BATCH:
        raise KeyError(f"no published batch for {target!r}; known: {sorted(PUBLISHED_BATCH)}")
    return PUBLISHED_BATCH[target][0]


@dataclass(frozen=True)
class ProxyMapping:
    """``B_t = ratio * B_p`` between proxy and target sequences (module docstring).

    Attributes:
        ratio: target sequences per proxy sequence (``cona.batch_ratio``).
        proxy_seq: proxy sequence length (tokens).
        target_seq: target sequence length (tokens).
    """

    ratio: float = 1.0
    proxy_seq: int = 1
    target_seq: int = 1

    def __post_init__(self) -> None:
        if not (self.ratio > 0 and math.isfinite(self.ratio)):
            raise ValueError(f"cona.batch_ratio={self.ratio} must be a positive number")

    def target_batch(self, proxy_batch: int) -> int:
        """Target sequences one proxy step of ``proxy_batch`` sequences stands for.

        Raises:
            ValueError: ``ratio * proxy_batch`` is not a whole number.
        """
        b = self.ratio * proxy_batch
        if abs(b - round(b)) > 1e-9:
            raise ValueError(f"proxy batch {proxy_batch} x cona.batch_ratio={self.ratio} "
                             "is not a whole number of target sequences")
        return int(round(b))

    def proxy_batch(self, target_batch: int) -> int:
        """Proxy sequences per step for a target global batch of ``target_batch``.

        Raises:
            ValueError: ``target_batch / ratio`` is not a whole number >= 1.
        """
        b = target_batch / self.ratio
        if b < 1 or abs(b - round(b)) > 1e-9:
            raise ValueError(
                f"target global batch {target_batch} / cona.batch_ratio={self.ratio} is not a "
                "whole number of proxy sequences >= 1; choose cona.global_batch_sizes that are "
                "multiples of the ratio"
            )
        return int(round(b))

    def target_samples(self, proxy_samples: float) -> float:
        """Target sequences for ``proxy_samples`` proxy sequences."""
        return self.ratio * proxy_samples

    def target_noise_scale(self, proxy_noise_scale: float | None) -> float | None:
        """``r * phi_p`` in target sequences (``None`` stays ``None``)."""
        return None if proxy_noise_scale is None else self.ratio * proxy_noise_scale

    def to_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio, "proxy_seq": self.proxy_seq, "target_seq": self.target_seq}


class TargetNoiseScale:
    """A view of a :class:`cona.grad_stats.GradientNoiseScale` in target sequences.

    The controller reads ``noise_scale`` (and checkpoints ``state_dict``); the
    estimator itself keeps proxy units, as the probe feeds it.
    """

    def __init__(self, estimator, mapping: ProxyMapping):
        self.estimator, self.mapping = estimator, mapping

    @property
    def noise_scale(self) -> float | None:
        return self.mapping.target_noise_scale(self.estimator.noise_scale)

    def state_dict(self) -> dict:
        return self.estimator.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.estimator.load_state_dict(state)
