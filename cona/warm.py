"""Warm checkpoints: the proxy trained once through its preset's warmup, cached on disk.

Every method of the CONA bench starts from the same warm state, so the evaluated
segment lies past the warmup, where statistical efficiency and the noise scale
matter, and no method is charged (or favoured) for the warmup.  The warm run is
the preset's recipe: its global batch, its LR and min LR, its full warmup
(``train.warmup_iters`` optimizer steps at ``parallel.global_batch_size``,
counted in steps) and the cosine decay over ``train.iters`` of the run it warms,
data order and initialisation from ``train.seed``.

Cache: ``data.cache_dir/cona-warm-<key>.pt``, ``key`` = a hash of everything that
determines the state (:func:`warm_key`: model, data, recipe, seed, steps, the
proxy's micro-batch and the torch version); written through a temporary name and
renamed, so a killed run never leaves a half-written checkpoint that a later
run would load.  Only the state is cached: what is measured at it (perplexity on
the validation set, a noise-scale probe) is measured again at every load
(:func:`measure_warm`), so a measurement never comes from an older validation set
or probe (a cached perplexity on 256 validation sequences was once reported for a
run on 32).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from . import state as cstate

log = logging.getLogger("cona")
WARM_FORMAT = 2  # bump when the stored fields or their meaning change (2: no measurements)
# train.* fields that do not change the warm state (evaluation, stopping, logging)
_TRAIN_IGNORED = {"eval_interval", "eval_iters", "target_ppl", "stop_at_target", "max_wall_s"}


def warm_key(cfg, steps: int, train_samples: int) -> str:
    """A hex digest over what determines the warm state of ``cfg`` after ``steps`` steps.

    Included: ``cfg.model``, ``cfg.data`` (not its cache folder), ``cfg.train``
    (not evaluation or stopping settings), the preset's global and micro batch,
    ``steps``, the training set's size ``train_samples`` (megatron shuffles all
    epochs of it together, so it sets the data order), :data:`WARM_FORMAT` and the
    torch version."""
    data = {k: v for k, v in dataclasses.asdict(cfg.data).items() if k != "cache_dir"}
    train = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _TRAIN_IGNORED}
    blob = json.dumps({"model": dataclasses.asdict(cfg.model), "data": data, "train": train,
                       "global_batch_size": cfg.parallel.global_batch_size,
                       "micro_batch_size": cfg.parallel.micro_batch_size, "steps": steps,
                       "train_samples": train_samples, "format": WARM_FORMAT,
                       "torch": torch.__version__},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def warm_path(cfg, steps: int, train_samples: int) -> Path:
    """Where :func:`warm_key`'s checkpoint lives (``data.cache_dir``, like the data cache)."""
    cache = Path(cfg.data.cache_dir)
    if not cache.is_absolute():
        cache = Path.cwd() / cache
    return cache / f"cona-warm-{warm_key(cfg, steps, train_samples)}.pt"


def save_atomic(obj, path: Path) -> None:
    """``torch.save`` to a temporary file in ``path``'s folder, then rename onto ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def train_warm(ctx, steps: int) -> dict:
    """Train a fresh job of ``ctx`` (at the preset's batch) for ``steps`` optimizer steps.

    Returns the warm state: ``{"trainer": cona.state.snapshot, "consumed_samples",
    "steps"}``."""
    job = ctx.make_job(ctx.reference_strategy(), track_gns=False)
    for _ in range(steps):
        job.train_step()
    return {"trainer": cstate.snapshot(job.trainer), "consumed_samples": job.consumed_samples,
            "steps": steps}


def measure_warm(ctx, warm: dict, measure) -> dict:
    """``measure(job)`` on a job of ``ctx`` at the preset's batch started from ``warm``
    (e.g. the validation perplexity and a direct noise-scale probe there; the job is
    then dropped, ``ctx`` is left as it was)."""
    previous, ctx.warm = ctx.warm, warm
    try:
        return measure(ctx.make_job(ctx.reference_strategy(), track_gns=False))
    finally:
        ctx.warm = previous


def load_or_train_warm(ctx, steps: int, measure=None) -> tuple[dict, bool]:
    """The cached warm state of ``ctx.cfg`` after ``steps`` steps, trained and cached if
    absent, with ``extra`` = ``measure(job)`` taken at it now (:func:`measure_warm`; ``{}``
    without ``measure``; never cached).  Returns ``(warm, cached)``; ``cached`` is true
    when the state was read from disk."""
    path = warm_path(ctx.cfg, steps, len(ctx.data.train))
    if path.is_file():
        log.info("warm checkpoint %s (cached)", path.name)
        warm, cached = torch.load(path, weights_only=False), True
        # a state cached before snapshots held Adam's betas: they are the config's
        # (warm_key covers train.adam_*), under which its moments were built
        t = ctx.cfg.train
        warm["trainer"].setdefault("adam", (t.adam_beta1, t.adam_beta2, t.adam_eps))
    else:
        warm, cached = train_warm(ctx, steps), False
        save_atomic(warm, path)
        log.info("warm checkpoint %s: %d steps trained and cached", path.name, steps)
    warm["extra"] = measure_warm(ctx, warm, measure) if measure is not None else {}
    return warm, cached
