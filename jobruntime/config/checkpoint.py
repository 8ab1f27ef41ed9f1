"""The ``checkpoint`` section: dist_checkpointing save and load."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import (
    _need,
)


@dataclass(kw_only=True)
class CheckpointConfig:
    """dist_checkpointing save/load."""

    save_interval: int = 0
    """Save every N steps (and at the end when > 0); 0 saves no checkpoints during
    training (see ``save_final``)."""
    save_final: bool = True
    """Save a checkpoint after the last step of an ordinary job or a real-mode
    CONA run, also with ``save_interval=0``, so a finished run can be evaluated
    (``tools/zero_shot.py``), converted or fine-tuned without a rerun; ``false``
    saves none.  (GeoMesh saves by ``save_interval`` only, its last round
    included; CONA's emulated clock saves none.)"""
    load: str | None = None
    """Checkpoint directory to resume from (a run's ``checkpoints/`` folder or
    one ``iter_XXXXXXX`` folder inside it)."""
    load_optimizer: bool = True
    """Resume optimizer, LR schedule, step, data position and clock from
    ``load``; ``false`` loads only the model weights and starts training afresh
    (fine-tuning, e.g. from ``tools/convert_checkpoint.py`` output).  A GeoMesh run
    only resumes (``false`` is refused); CONA's emulated clock only starts from the
    weights (``true`` with ``load`` is refused)."""
    optimizer_settings: Literal["same", "config", "checkpoint"] = "same"
    """On a resume whose optimizer settings differ from the checkpoint's (the LR
    schedule: ``train.lr``, ``min_lr``, ``warmup_iters``, ``lr_decay_iters`` or, without
    it, ``iters``; ``train.weight_decay``, ``adam_beta1``, ``adam_beta2``, ``adam_eps``):
    ``same`` refuses it, naming each difference; ``config`` trains on with this config's
    (the LR moves to the new schedule's value at the resumed step); ``checkpoint`` keeps
    the checkpoint's, and ``config.yaml`` records them (Megatron-LM's
    ``--override-opt_param-scheduler`` / ``--use-checkpoint-opt_param-scheduler``, which
    cover the LR and weight decay).  GeoMesh reads ``same`` or ``config`` (its regions
    train with the config's settings, the run identity they share; each worker sizes its
    own warmup and decay, so another ``train.warmup_iters`` is refused); CONA trains with
    its config's."""
    keep_last: int = 2
    """Number of checkpoints kept: the ones saved last, in the order they were saved (not
    by step: after a resume from an older checkpoint, higher steps of the abandoned run
    are deleted first), the one just saved always among them; 0 keeps all."""
    load_exact: bool = True
    """Whether the weights in ``load`` compute the function of the model they came from.
    ``false`` is written by ``tools/convert_checkpoint.py`` for an HF architecture that
    megatron-core does not implement (post-LN ``BertForMaskedLM``): the weights are an
    initialisation to fine-tune, not that model; loading them logs a warning."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first out-of-range setting."""
        _need(self, "checkpoint", self.save_interval >= 0, "save_interval",
              "must be >= 0 (0: none during training)")
        _need(self, "checkpoint", self.keep_last >= 0, "keep_last", "must be >= 0 (0 keeps all)")
