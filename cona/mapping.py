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

**Calibration of ``r``** (:func:`calibrate_ratio`; ``cona.batch_ratio``
holds the value).  The proxy's noise scale at a reference point ``phi_ref``
is matched to the critical batch published for the target,

    r = 2 ** round(log2(B_pub / phi_ref)),

rounded to a power of two so that power-of-two proxy batches map to
power-of-two target batches.  ``B_pub`` (:data:`PUBLISHED_BATCH`, target
sequences) is the global batch the target's published pre-training ran at for
most of its steps.  McCandlish et al. 2018 (Sec. 4, Fig. 7) find such tuned
large-scale batch sizes close to the measured critical batch ``B_crit ~
B_noise``; Kaplan et al. 2020 (Sec. 5.1, eq. 5.3, ``B_crit(L) = B*/L^(1/alpha_B)``
with ``B* ~ 2e8`` tokens, ``alpha_B ~ 0.21``) find ``B_crit`` depends on the
loss only, not on the model size, and reaches ~1M tokens (~500 sequences of
2048) at the losses ~1B models train at.  ``bench/cona_ttp.py`` takes
``phi_ref`` where the reference run reaches the target perplexity (the end
of the part of training the bench emulates), so the proxy's noise-scale range
over the run ends at the published batch and starts ``growth`` times lower.

In real mode (``cona.clock=wall``) proxy and target are the same model and
``r = 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# target preset -> (global batch in target sequences, source)
PUBLISHED_BATCH: dict[str, tuple[int, str]] = {
    "gpt3_1.3b": (512, "Brown et al. 2020, Table 2.1: GPT-3 XL (1.3B), batch 1M tokens = 512 x 2048"),
    "bert_large": (256, "Devlin et al. 2019, App. A.2: 256 sequences x 512 tokens"),
    "llama3.2_1b": (
        512,
        "no batch published for Llama-3.2-1B; Kaplan et al. 2020 Sec. 5.1: B_crit depends on "
        "the loss, not the size, so GPT-3 1.3B's 1M tokens = 512 x 2048",
    ),
}


def calibrate_ratio(phi_ref: float, target: str) -> int:
    """``r = 2**round(log2(B_pub / phi_ref))`` for ``target`` (module docstring).

    Args:
        phi_ref: the proxy's noise scale (proxy sequences) at the reference point.
        target: a key of :data:`PUBLISHED_BATCH`.

    Raises:
        KeyError: no published batch for ``target``.
        ValueError: ``phi_ref`` is not a positive finite number.
    """
    if target not in PUBLISHED_BATCH:
        raise KeyError(f"no published batch for {target!r}; known: {sorted(PUBLISHED_BATCH)}")
    if not (phi_ref > 0 and math.isfinite(phi_ref)):
        raise ValueError(f"phi_ref must be a positive finite noise scale, got {phi_ref}")
    return 2 ** max(0, round(math.log2(PUBLISHED_BATCH[target][0] / phi_ref)))


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
