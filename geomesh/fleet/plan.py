"""A balanced round's plan: what :class:`geomesh.fleet.planner.Planner` returns.

:class:`WorkerPlan` is one worker's share of a round (micro-batch, accumulation,
inner steps, tokens, predicted seconds and memory); :class:`Plan` is one per worker,
with the round's time, imbalance and token budget.  Plain data: the workers, the
checkpoint (:mod:`geomesh.state`) and the membership re-plans read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, kw_only=True)
class WorkerPlan:
    """One worker's share of a round.

    Attributes:
        batch_size: sequences per inner step, ``micro_batch_size · grad_accum · dp``.
        tokens: tokens per round, ``inner_steps · batch_size · seq_length``.
        step_time_s: predicted seconds per inner step.
        compute_s: predicted seconds of compute per round (``inner_steps · step_time_s``).
        memory_bytes / memory_limit_bytes: predicted need and usable memory per GPU.
    """

    worker: str
    micro_batch_size: int
    grad_accum: int
    dp: int
    batch_size: int
    inner_steps: int
    seq_length: int
    tokens: int
    step_time_s: float
    compute_s: float
    memory_bytes: float
    memory_limit_bytes: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A balanced round: one :class:`WorkerPlan` per worker, cluster order."""

    workers: tuple[WorkerPlan, ...]
    target_tokens: int
    tolerance: float

    @property
    def total_tokens(self) -> int:
        return sum(w.tokens for w in self.workers)

    @property
    def round_time_s(self) -> float:
        """Compute time of the slowest worker."""
        return max(w.compute_s for w in self.workers)

    @property
    def imbalance(self) -> float:
        """``(max C_i − min C_i) / max C_i``."""
        times = [w.compute_s for w in self.workers]
        return (max(times) - min(times)) / max(times)

    @property
    def balanced(self) -> bool:
        return self.imbalance <= self.tolerance

    @property
    def token_deviation(self) -> float:
        """``|N − T| / T``: how far the round's tokens are from the budget."""
        return abs(self.total_tokens - self.target_tokens) / self.target_tokens

    @property
    def within_budget(self) -> bool:
        """The round's tokens are within ``tolerance`` of the budget ``T`` (the
        planner's constraint; it fails only when no discrete choice comes closer)."""
        return self.token_deviation <= self.tolerance

    def same_choices(self, other: Plan) -> bool:
        """Every worker has the same ``(micro_batch_size, grad_accum, inner_steps)``."""
        def key(p: Plan) -> list[tuple]:
            return [(w.worker, w.micro_batch_size, w.grad_accum, w.inner_steps) for w in p.workers]
        return key(self) == key(other)

    def for_worker(self, name: str) -> WorkerPlan:
        for w in self.workers:
            if w.worker == name:
                return w
        raise KeyError(f"no worker '{name}' in plan")

    def to_dict(self) -> dict:
        return {
            "target_tokens": self.target_tokens,
            "total_tokens": self.total_tokens,
            "round_time_s": self.round_time_s,
            "imbalance": self.imbalance,
            "tolerance": self.tolerance,
            "token_deviation": self.token_deviation,
            "workers": [asdict(w) for w in self.workers],
        }
