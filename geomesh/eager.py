"""Eager starts for overlapped rounds (``geomesh.overlap``).

Kale, Douillard & Donchev 2025, "Eager updates for overlapped communication
and computation in DiLoCo" (arXiv 2502.12996).  With overlapped rounds a
worker sends its round-``r`` message and goes on training before the others'
messages arrive, so it needs a stand-in for ``θ_global`` of round ``r+1``.
The eager update builds it from what the worker knows at that moment: its
own message, and the others' messages of one round before,

    Δ̂_i = w_i · D(msg_i^(r)) + (1 − w_i) · Δ^(r−1)                        (1)

with ``w_i = n_i / N`` the worker's token share of the round, ``D(msg_i)``
its message as every worker decodes it (compression and error feedback
included) and ``Δ^(r−1)`` the last aggregate (the last non-empty one, if a
round's messages were all rejected) — the paper's "delayed mixture
of the other replicas' outer gradients", here with the worker's own old
message inside it at weight ``(1 − w_i) w_i`` so that no per-worker copy is
kept.  The start is the outer step of ``Δ̂_i``,
:meth:`geomesh.outer.OuterNesterov.preview` (with ``compress_update``,
``θ_global − lr · Δ̂_i``: the messages are already momentum-corrected).  In
the first overlapped round there is no aggregate yet and ``Δ̂_i = D(msg_i)``.

Measured (``bench/geomesh_ttp.py --full --ablation`` settings cut to 20
outer steps, outer lr 0.5, ``overlap 0.1``: τ_i = 3, 1, 1, 1 steps from the
eager start; final validation perplexity, the blocking run 411.0): (1) 411.3;
the worker's own dense ``Δ_i`` alone (this module's predecessor) 421.0; its
decoded message alone 434.0; the last aggregate alone 446.8; no eager start
(the worker's own weights) 446.4.  The own message alone over-weights one
worker's data (the T4 runs its whole one-step round from there), the last
aggregate alone is a round stale.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .outer import OuterNesterov


class EagerStart:
    """The last aggregate pseudo-gradient and the eager start of equation (1).

    Holds one fp32 copy of the model's (this rank's shard's) pseudo-gradient
    in host memory, shared by the rank's workers.
    """

    def __init__(self) -> None:
        self.last: dict[str, torch.Tensor] | None = None

    def remember(self, aggregate: Mapping[str, torch.Tensor]) -> None:
        """Keep round ``r``'s aggregate ``Δ^(r)`` (what the outer step used) for
        the eager starts of round ``r+1``."""
        self.last = {k: v.detach().float().cpu().clone() for k, v in aggregate.items()}

    def estimate(self, own: Mapping[str, torch.Tensor], weight: float) -> dict[str, torch.Tensor]:
        """``Δ̂_i`` of equation (1).

        Args:
            own: ``D(msg_i)``, the worker's decoded message, name -> fp32 tensor.
            weight: ``w_i = n_i / N`` in [0, 1].

        Raises:
            ValueError: ``weight`` outside [0, 1], or ``own`` names other tensors
                than the remembered aggregate.
        """
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"eager start: token share must be in [0, 1], got {weight}")
        if self.last is None:
            return {k: v.float() for k, v in own.items()}
        if set(own) != set(self.last):
            raise ValueError("eager start: the message's tensors differ from the last aggregate's "
                             f"(e.g. {sorted(set(own) ^ set(self.last))[:5]})")
        return {k: weight * v.float() + (1.0 - weight) * self.last[k].to(v.device)
                for k, v in own.items()}

    def start(self, outer: OuterNesterov, own: Mapping[str, torch.Tensor], weight: float, *,
              corrected: bool = False) -> dict[str, torch.Tensor]:
        """The weights a worker continues from: the outer step of :meth:`estimate`
        (``corrected``: ``θ_global − lr · Δ̂_i``, for momentum-corrected messages),
        without changing ``outer``."""
        est = self.estimate(own, weight)
        if corrected:
            return {k: p - outer.lr * est[k].to(p.device) for k, p in outer.params.items()}
        return outer.preview(est)

    def nbytes(self) -> int:
        """Host bytes held (the last aggregate)."""
        return sum(v.numel() * v.element_size() for v in (self.last or {}).values())

    def state_dict(self) -> dict:
        return {"last": None if self.last is None else {k: v.clone() for k, v in self.last.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        last = state.get("last")
        self.last = None if last is None else {k: v.float().cpu().clone() for k, v in last.items()}
