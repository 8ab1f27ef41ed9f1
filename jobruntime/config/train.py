"""The ``train`` section: optimisation and loop settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import (
    _finite,
    _need,
)


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and loop settings."""

    iters: int = 100
    """Optimizer steps to run."""
    lr: float = 1e-3
    """Peak learning rate (AdamW)."""
    min_lr: float = 1e-4
    """Learning rate at the end of the cosine decay."""
    warmup_iters: int = 10
    """Linear warmup steps."""
    lr_decay_iters: int | None = None
    """Cosine decay length in steps; ``None`` means ``iters``."""
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    seed: int = 1234
    """Seed for weights, data order and dropout."""
    precision: Literal["fp32", "bf16", "auto"] = "auto"
    """``auto`` = bf16 on CUDA, fp32 on CPU."""
    check_memory: bool = True
    """Refuse, before the model is built, a job whose estimated peak bytes per device
    (:class:`jobruntime.memory.MemoryModel`: weights, gradients, Adam state, the
    activations of the micro-batches in flight, a fixed overhead) exceed the GPU's memory,
    or on CPU the host's memory (its cgroup limit if lower) divided among the node's
    ranks; ``false`` builds it anyway (the allocator then has the last word), and keeps
    explicit ``cona.candidates`` that the same estimate refuses."""
    log_interval: int = 1
    """Steps between metrics records."""
    eval_interval: int = 20
    """Steps between validation evaluations (and at the last step); 0 disables."""
    eval_iters: int = 4
    """Validation batches (of the global batch size) per evaluation."""
    target_ppl: float | None = None
    """Validation perplexity that defines time-to-target-perplexity (TTP)."""
    stop_at_target: bool = False
    """Stop the run once ``target_ppl`` is reached (after the step or outer step whose
    evaluation reached it; GeoMesh with one job per region: after the next outer step,
    when every region has heard of it, so that all stop with the same weights).  A run
    resumed past that point trains on to its end."""
    max_wall_s: float | None = None
    """Stop (after the current step, with a final evaluation) past this many seconds."""
    zero_shot_tasks: list | None = None
    """Local JSONL files in the HellaSwag or PIQA layout scored zero-shot at the
    end of the run (``tools/zero_shot.py``); results go to summary.json."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first out-of-range setting."""
        def need(ok: bool, key: str, rule: str) -> None:
            _need(self, "train", ok, key, rule)

        need(self.iters > 0, "iters", "must be positive")
        need(_finite(self.lr) and self.lr > 0, "lr", "must be a positive number")
        need(_finite(self.min_lr) and 0 <= self.min_lr <= self.lr, "min_lr",
             f"must be between 0 and train.lr={self.lr}")
        need(self.warmup_iters >= 0, "warmup_iters", "must be >= 0")
        need(self.lr_decay_iters is None or self.lr_decay_iters > 0, "lr_decay_iters",
             "must be positive (or null for train.iters)")
        need(_finite(self.weight_decay) and self.weight_decay >= 0, "weight_decay", "must be >= 0")
        for key in ("adam_beta1", "adam_beta2"):
            need(0 <= getattr(self, key) < 1, key, "must be in [0, 1)")
        need(_finite(self.adam_eps) and self.adam_eps > 0, "adam_eps", "must be positive")
        need(_finite(self.clip_grad) and self.clip_grad >= 0, "clip_grad", "must be >= 0 (0 disables)")
        need(self.log_interval >= 1, "log_interval", "must be >= 1")
        need(self.eval_interval >= 0, "eval_interval", "must be >= 0 (0 disables evaluation)")
        need(self.eval_iters >= 1, "eval_iters",
             "must be >= 1 (to skip evaluation set train.eval_interval=0)")
        need(self.target_ppl is None or (_finite(self.target_ppl) and self.target_ppl > 1),
             "target_ppl", "must be a perplexity > 1 (or null)")
        need(self.max_wall_s is None or self.max_wall_s > 0, "max_wall_s", "must be positive (or null)")
        need(0 <= self.seed < 2**32, "seed", "must be in [0, 2**32) (numpy's range)")
