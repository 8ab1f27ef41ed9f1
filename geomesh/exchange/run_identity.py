"""The run identity that binds a GeoMesh region's messages: what every region must share.

Each region of a run is its own job, started with its own command
(``geomesh.region``).  The regions average pseudo-gradients, so they must train
the same model with the same recipe on the same token ids; two regions started
with, say, another ``geomesh.outer_lr`` or another tokenizer would each apply a
different outer step to the same messages and part ways without an error.
So every envelope is bound to a 64-bit run identity
(:class:`geomesh.wire.envelope.Sealer`) made of one byte per part below, each
the first byte of SHA-256 over that part's settings:

========= =============================================================
part      settings
========= =============================================================
model     ``model.*`` but the kernel choices (``attention_backend``,
          ``kernel_fusions``: a region picks what its GPUs run)
train     the inner optimizer and its schedule (``train.lr``, ``min_lr``,
          ``warmup_iters``, ``weight_decay``, Adam's, ``clip_grad``),
          ``target_ppl``, ``stop_at_target``
seed      ``train.seed``
data      the corpus file's name and size, ``data.text_key``,
          ``max_documents``, ``val_every`` (its path may differ per machine)
tokenizer the tokenizer's vocabulary and special ids (a region that
          trained its own could number the tokens otherwise)
geomesh   ``geomesh.*`` but the region's own (``region``, ``mode``,
          ``cluster`` path, ``secret_file``, ``timeout_s``, ``heartbeat_s``,
          ``eval_interval``, ``on_worker_loss``, the emulated-only
          ``target_model`` and ``wan_bandwidth_scale``)
cluster   the cluster file's name, workers and regions (not its
          ``rendezvous`` address, links or injected slowdowns)
batch     ``parallel.global_batch_size`` (the round's token budget)
========= =============================================================

Local by design: each region's layout (``parallel.tp``, ``pp``,
``micro_batch_size``, from the cluster file), precision (a V100 has no bf16),
``checkpoint.*``, ``logging.*``, the evaluation's size and cadence, the run
folder; ``train.iters`` and ``lr_decay_iters`` are not used by GeoMesh
(:mod:`geomesh.run`).  Evaluations being local, so is the verdict that the
target was reached: with ``stop_at_target`` the stop itself is agreed in the
exchange (:mod:`geomesh.sync`, "Stopping at the target").

A byte per part lets a receiver name the parts that differ
(:func:`differing_parts`); two runs that differ in one part collide with
probability 1/256 there, which only matters to runs that share a secret
(the secret, not this identity, keeps other runs out).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping

from jobruntime.config import JobConfig
from jobruntime.documents import resolve_data_path

PARTS = ("model", "train", "seed", "data", "tokenizer", "geomesh", "cluster", "batch")
"""The parts of the identity, in byte order (byte 0 = ``model``)."""

_LOCAL = {
    "model": {"attention_backend", "kernel_fusions"},
    "geomesh": {"region", "mode", "cluster", "secret_file", "timeout_s", "heartbeat_s",
                "eval_interval", "on_worker_loss", "target_model", "wan_bandwidth_scale"},
}
_TRAIN = ("lr", "min_lr", "warmup_iters", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
          "clip_grad", "target_ppl", "stop_at_target")


def tokenizer_digest(tokenizer) -> str:
    """SHA-256 of a tokenizer's pieces in id order and its special ids (hex).

    Args:
        tokenizer: a :class:`jobruntime.tokenizer.Tokenizer` (``inv_vocab``, the specials).
    """
    h = hashlib.sha256()
    for i in range(tokenizer.vocab_size):
        h.update(tokenizer.inv_vocab[i].encode("utf-8", "surrogatepass") + b"\x00")
    h.update(repr((tokenizer.eod, tokenizer.pad, tokenizer.cls, tokenizer.sep,
                   tokenizer.mask)).encode())
    return h.hexdigest()


def shared_settings(cfg: JobConfig, cluster, tokenizer) -> dict[str, object]:
    """Each part's settings (module docstring), as JSON-safe values.

    Args:
        cfg: the region's job config (as given, before its layout is applied).
        cluster: the :class:`geomesh.fleet.cluster.ClusterSpec`.
        tokenizer: the job's tokenizer (:func:`tokenizer_digest`).
    """
    def without(section, local=()):
        return {k: v for k, v in sorted(dataclasses.asdict(section).items()) if k not in local}

    src = resolve_data_path(cfg.data.path)
    size = src.stat().st_size if src.is_file() else None  # an indexed prefix: its name
    return {
        "model": without(cfg.model, _LOCAL["model"]),
        "train": {k: getattr(cfg.train, k) for k in _TRAIN},
        "seed": cfg.train.seed,
        "data": {"file": src.name, "bytes": size, "text_key": cfg.data.text_key,
                 "max_documents": cfg.data.max_documents, "val_every": cfg.data.val_every},
        "tokenizer": tokenizer_digest(tokenizer),
        "geomesh": without(cfg.geomesh, _LOCAL["geomesh"]),
        "cluster": {"name": cluster.name,
                    "workers": [dataclasses.asdict(w) for w in cluster.workers],
                    "regions": [[r.name, r.region_id] for r in cluster.regions]},
        "batch": cfg.parallel.global_batch_size,
    }


def run_identity(settings: Mapping[str, object]) -> int:
    """The 64-bit identity of :func:`shared_settings`: byte ``j`` hashes part ``PARTS[j]``.

    Raises:
        KeyError: a part is missing.
    """
    out = bytes(hashlib.sha256(json.dumps(settings[p], sort_keys=True, default=str).encode())
                .digest()[0] for p in PARTS)
    return int.from_bytes(out, "little")


def differing_parts(ours: int, theirs: int) -> list[str]:
    """The parts whose bytes differ between two identities (:data:`PARTS` order)."""
    a, b = ours.to_bytes(8, "little"), theirs.to_bytes(8, "little")
    return [p for p, x, y in zip(PARTS, a, b) if x != y]
