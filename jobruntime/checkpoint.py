"""Checkpoints with megatron-core ``dist_checkpointing``: layout-independent
model and optimizer state, plus the LR schedule, step, data position and RNG.

Layout of a run's ``checkpoints/`` folder::

    iter_0000020/      one dist_checkpointing checkpoint (+ COMPLETE marker)
    latest             text file naming the newest complete checkpoint

A save writes into ``iter_XXXXXXX.tmp``; only after every rank has finished
does rank 0 write the ``COMPLETE`` marker, rename the folder and update
``latest`` (atomically).  A crash during a save therefore leaves at most a
``.tmp`` folder that :func:`find_checkpoint` never returns.

Because dist_checkpointing stores global tensors, a checkpoint saved at one
TP/PP/DP layout loads into any other (resharding on load).
"""

from __future__ import annotations

import logging
import multiprocessing
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing import ShardedObject
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from .config import ModelConfig
from .faults import die_with_parent, fault_point
from .logging_utils import phase
from .outputs import saved_checkpoints
from .parallel import rng_state, set_rng_state

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
FORMAT_VERSION = 1
# Model fields that change tensor shapes or semantics: a mismatch is an error.
_ARCH_FIELDS = (
    "family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
    "ffn_hidden_size", "vocab_size", "position_embedding", "normalization", "activation",
    "add_bias_linear", "tie_embeddings",
)


class CheckpointError(ValueError):
    """The checkpoint is missing, incomplete or from another model."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextmanager
def committed_folder(root: Path, name: str, *, leader: bool | None = None, keep_last: int = 0,
                     marker: str = "") -> Iterator[Path]:
    """Write a checkpoint folder that is either complete or invisible.

    Yields ``root/<name>.tmp`` for every rank to write into.  When all ranks
    have left the block, the leader writes the ``COMPLETE`` marker, renames the
    folder to ``root/<name>``, points ``root/latest`` at it (atomically) and
    deletes the complete folders with the same prefix (``iter_``, ``outer_``)
    saved before the last ``keep_last`` saves, this one included
    (:func:`stale_checkpoints`; 0 keeps all).  An exception inside the
    block (a failed write, a stop: ``StopRequested``, ``KeyboardInterrupt``)
    makes the leader remove the ``.tmp`` folder once it raises too (its own, or
    the barrier after the block when a peer failed: at once over gloo, at the
    watchdog's timeout over NCCL); a rank killed mid-save leaves it, which no
    reader returns and the next save with that prefix removes.
    Collective: every rank of the default process group must enter.

    Args:
        leader: the rank that creates and commits (default: global rank 0).
        marker: text of the ``COMPLETE`` file.
    """
    leader = _rank() == 0 if leader is None else leader
    final, tmp = root / name, root / f"{name}.tmp"
    prefix = name.split("_")[0]
    if leader:
        root.mkdir(parents=True, exist_ok=True)
        # an earlier save cut short (a kill leaves its .tmp folder) is not a checkpoint
        for stale in (final, *root.glob(f"{prefix}_*.tmp")):
            if stale.is_dir():
                shutil.rmtree(stale)
        tmp.mkdir()
    _barrier()
    try:
        yield tmp
        _barrier()
    except BaseException:  # a failed save or a stop (StopRequested, Ctrl-C) leaves nothing
        if leader:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if leader:
        # when: the save order keep_last and the resume fallback read (not the file's
        # mtime alone, which a copy of the run folder resets)
        (tmp / COMPLETE).write_text(f"{marker}\nsaved_ns {time.time_ns()}\n")
        tmp.rename(final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(name + "\n")
        latest_tmp.replace(root / "latest")
        for old in stale_checkpoints(root, prefix, final, keep_last):
            shutil.rmtree(old, ignore_errors=True)
    _barrier()


def stale_checkpoints(root: Path, prefix: str, final: Path, keep_last: int) -> list[Path]:
    """The complete ``root/<prefix>_*`` folders that ``keep_last`` drops once ``final`` is
    saved: all but the ``keep_last`` saved last, ``final`` always kept (``[]`` for
    ``keep_last=0``, keep all).

    By save order (:func:`jobruntime.outputs.saved_checkpoints`), not by step: after a
    resume from ``iter_0000004`` while ``iter_0000008`` exists (the same run folder),
    ordering by name deleted the checkpoint just saved (``iter_0000005`` with
    ``keep_last=1``, leaving ``iter_0000008`` for ``find_checkpoint``'s fallback) and
    kept the abandoned ``iter_0000008`` for good; here ``iter_0000008`` is the oldest
    save once ``keep_last`` newer ones exist.  (torchtitan's ``keep_latest_k`` sorts by
    step, which is the same order in a run that never went back.)
    """
    if keep_last <= 0:
        return []
    older = [p for p in saved_checkpoints(root, prefix) if p.name != final.name]
    return older[:max(len(older) - (keep_last - 1), 0)]


def find_checkpoint(path: str | Path) -> Path:
    """Resolve a ``checkpoints/`` folder (via ``latest``) or one ``iter_*`` folder.

    Raises:
        CheckpointError: ``path`` does not exist (naming the checkpoints its folder still
            holds), or holds no complete checkpoint.
    """
    path = Path(path)
    if path.name.startswith("outer_") or (list(path.glob("outer_*"))
                                          and not list(path.glob("iter_*"))):
        raise CheckpointError(
            f"'{path}' is a GeoMesh checkpoint; resume it with the geomesh.* settings it was "
            "saved with (geomesh.method, geomesh.cluster)"
        )
    if (path / COMPLETE).is_file():
        return path
    latest = path / "latest"
    if latest.is_file():
        ckpt = path / latest.read_text().strip()
        if (ckpt / COMPLETE).is_file():
            return ckpt
    complete = saved_checkpoints(path, "iter")  # no (valid) latest: the one saved last
    if complete:
        return complete[-1]
    if not path.exists():
        kept = sorted(p.name for p in path.parent.glob("iter_*")
                      if (p / COMPLETE).is_file()) if path.parent.is_dir() else []
        raise CheckpointError(
            f"checkpoint '{path}' does not exist" + (
                f"; its folder holds {', '.join(kept)} (checkpoint.keep_last deletes older "
                f"ones): point checkpoint.load at one of those, or at '{path.parent}' for "
                "the latest" if kept else "; point checkpoint.load (a tool's --input / "
                "--checkpoint) at a run's checkpoints/ folder or one iter_XXXXXXX folder in it"))
    raise CheckpointError(
        f"no complete checkpoint in '{path}'; point checkpoint.load (a tool's --input / "
        "--checkpoint) at a run's checkpoints/ folder or an iter_XXXXXXX folder that has a "
        "COMPLETE marker"
    )


def _arch(model: ModelConfig) -> dict:
    arch = {k: getattr(model, k) for k in _ARCH_FIELDS}
    if model.position_embedding == "learned_absolute":  # the table's shape
        arch["max_positions"] = model.max_positions
    arch["padded_vocab_size"] = model.padded_vocab  # the embedding's rows (jobruntime/vocab.py)
    return arch


def saved_arch(ckpt: Path, common: dict) -> dict:
    """The ``arch`` record of a checkpoint, with ``padded_vocab_size`` read from the
    embedding's shape where the record predates it (it then depended on the TP size)."""
    arch = dict(common.get("arch") or {})
    if "padded_vocab_size" not in arch:
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
        for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            if key in meta:
                arch["padded_vocab_size"] = int(meta[key].global_shape[0])
                break
    return arch


def arch_diff(saved: dict, model: ModelConfig) -> dict:
    """``{field: (checkpoint value, config value)}`` where the architectures differ.

    Defaults are resolved first, so ``num_query_groups: null`` equals the head
    count and ``ffn_hidden_size: null`` equals ``4 * hidden_size``.
    """
    def resolved(arch: dict) -> dict:
        out = dict(arch)
        out["num_query_groups"] = arch.get("num_query_groups") or arch.get("num_attention_heads")
        out["ffn_hidden_size"] = arch.get("ffn_hidden_size") or 4 * (arch.get("hidden_size") or 0)
        return out

    a, b = resolved(saved), resolved(_arch(model))
    keys = [*_ARCH_FIELDS, *(["max_positions"] if "max_positions" in a and "max_positions" in b else []),
            *(["padded_vocab_size"] if "padded_vocab_size" in a else [])]
    return {k: (saved.get(k), b[k] if k == "padded_vocab_size" else getattr(model, k))
            for k in keys if a.get(k) != b[k]}


def arch_mismatch(ckpt: Path, diff: dict) -> str:
    """One-line message for :func:`arch_diff`'s result (names the fields and the fix)."""
    desc = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in diff.items())
    fix = "use the matching --config or start without checkpoint.load"
    if set(diff) == {"padded_vocab_size"}:
        fix = f"set model.padded_vocab_size={diff['padded_vocab_size'][0]} (the checkpoint's)"
    return f"checkpoint '{ckpt}' is from another model ({desc}); {fix}"


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _layout() -> list[int]:
    """``[tp, pp, dp]`` of the model-parallel state (``[1, 1, world]`` without one)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return [1, 1, _world()]
    return [ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size()]


def _rng_object(state: dict | None) -> ShardedObject:
    """This rank's RNG state as its own shard of ``rng_state`` (one per global rank): each
    rank's generators differ (a PP stage advances past the earlier stages' draws at build,
    a layout switch draws on some ranks only), and common state holds rank 0's alone."""
    return ShardedObject("rng_state", state, (_world(),), (_rank(),), replica_id=0)


def save_queue_dies_with_rank() -> None:
    """Start the process behind dist_checkpointing's write-results queue so that it dies
    with this rank.

    megatron-core starts a ``multiprocessing`` manager server (a spawned process) on a
    rank's first save, for the queue its writers report on
    (``dist_checkpointing.strategies.filesystem_async._get_write_results_queue``).  A rank
    killed by SIGKILL (the OOM killer, a preemption) runs no exit handler, and that server
    stayed behind for good (measured: one ~270 MB process per killed rank, still there 36
    minutes after the job).  Here the server is started first, with
    :func:`jobruntime.faults.die_with_parent` as its initializer, and megatron-core finds
    the queue made.  Idempotent; call it before ``dist_checkpointing.save``.
    """
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # megatron-core's context
    manager.start(initializer=die_with_parent)
    filesystem_async._results_queue = manager.Queue()  # its proxy keeps the manager alive


def save_checkpoint(root: Path, trainer, *, consumed_samples: int, extra: dict | None = None,
                    keep_last: int = 2) -> Path:
    """Save ``trainer`` (model, optimizer, scheduler, step, ``consumed_tokens``) to
    ``root/iter_<step>``.

    Args:
        root: the run's ``checkpoints/`` folder.
        consumed_samples: data position (samples of the training set consumed).
        extra: more picklable state (e.g. the run's clock), stored as common
            state under ``"extra"``: rank 0's (broadcast to the other ranks).
        keep_last: keep this many checkpoints, the ones saved last (this one included),
            deleting those saved before (:func:`stale_checkpoints`); 0 keeps all.

    Returns:
        The final checkpoint folder.
    """
    name = f"iter_{trainer.step:07d}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        # rank 0's extra is the one saved; every rank holds it, so that megatron's
        # check that the common state is the same on all ranks does not log a
        # "common state dict differs" warning for each rank's own clock (time_s)
        box = [extra]
        dist.broadcast_object_list(box, src=0)
        extra = box[0]
    model_sd = trainer.module.sharded_state_dict(prefix="")
    state = {
        "model": model_sd,
        "optimizer": trainer.optimizer.sharded_state_dict(model_sd),
        "scheduler": trainer.scheduler.state_dict(),
        "step": trainer.step,
        "consumed_samples": consumed_samples,
        "consumed_tokens": trainer.consumed_tokens,
        "rng": _rng_object(rng_state()),
        "rng_layout": _layout(),  # each rank's generators fit this layout only
        "arch": _arch(trainer.cfg.model),
        "format_version": FORMAT_VERSION,
        "extra": extra or {},
    }
    save_queue_dies_with_rank()
    with phase(log, "saving checkpoint %s", root / name), \
            committed_folder(root, name, keep_last=keep_last, marker=f"step {trainer.step}") as tmp:
        dist_checkpointing.save(state, str(tmp))
        fault_point("save", trainer.step)  # test-only: a rank lost before the commit
    return root / name


def _unreadable(ckpt: Path, e: BaseException) -> str:
    if isinstance(e, CheckpointException) and e.failures:  # {rank: exception} of torch DCP
        cause = next(iter(e.failures.values()))  # (exception, traceback) in torch 2.x
        e = cause[0] if isinstance(cause, tuple) else cause
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return (f"checkpoint '{ckpt}' is damaged or incomplete ({type(e).__name__}: {first}); "
            "load an earlier iter_XXXXXXX folder or start without checkpoint.load")


@contextmanager
def reading(ckpt: Path) -> Iterator[None]:
    """Any error while reading ``ckpt`` (missing or corrupt ``common.pt``,
    ``metadata.json``, truncated shards; megatron's ``CheckpointingException``, torch
    DCP's ``CheckpointException``) becomes a :class:`CheckpointError` that names the
    folder and the fix.  Every reader of checkpoints (training, the converter) reads
    through it."""
    try:
        yield
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - whatever the reader hit
        raise CheckpointError(_unreadable(ckpt, e)) from None


def load_checkpoint(path: str | Path, trainer, *, load_optimizer: bool = True) -> dict:
    """Load a checkpoint into ``trainer`` (any TP/PP/DP layout).

    With ``load_optimizer=False`` (a fine-tune, zero-shot) only the weights are read;
    the optimizer's fp32 main copies of bf16/fp16 weights are refreshed from them
    (:meth:`Trainer.load_weights`), so the first step trains the loaded model.

    Returns:
        ``{"step", "consumed_samples", "consumed_tokens", "extra"}`` of the
        checkpoint.  ``consumed_tokens`` (also set on ``trainer`` with the step
        when ``load_optimizer``) is the accumulated count; a checkpoint from
        before it was saved gets ``consumed_samples x model.seq_length`` (right
        unless the sequence length changed), with a log line saying so.

    Raises:
        CheckpointError: not found, incomplete, or saved from another model
            architecture (the message names the differing fields).
    """
    ckpt = find_checkpoint(path)
    if not trainer.cfg.checkpoint.load_exact and _rank() == 0:
        log.warning("%s is an initialisation converted from another architecture, not that "
                    "model (checkpoint.load_exact=false): fine-tune before comparing", ckpt)
    with reading(ckpt):
        common = dist_checkpointing.load_common_state_dict(str(ckpt))
    if not isinstance(common, dict) or "arch" not in common:
        raise CheckpointError(f"'{ckpt}' is not a checkpoint of this project (no 'arch' record)")
    diff = arch_diff(saved_arch(ckpt, common), trainer.cfg.model)
    if diff:
        raise CheckpointError(arch_mismatch(ckpt, diff))
    if load_optimizer and common.get("weights_only"):
        raise CheckpointError(f"'{ckpt}' holds model weights only (a converted checkpoint); "
                              "set checkpoint.load_optimizer=false to fine-tune from it")
    model_sd = trainer.module.sharded_state_dict(prefix="")
    request = {"model": model_sd}
    if load_optimizer:
        request["optimizer"] = trainer.optimizer.sharded_state_dict(model_sd, is_loading=True)
        if common.get("rng_layout") == _layout():  # each rank's own generators
            request["rng"] = _rng_object(None)
    with phase(log, "loading checkpoint %s%s", ckpt, "" if load_optimizer else " (weights)"), \
            reading(ckpt):
        loaded = dist_checkpointing.load(request, str(ckpt))
    trainer.load_weights(loaded["model"])  # also the fp32 main copies of a bf16 optimizer
    if load_optimizer:  # the saved main copies and moments replace those
        trainer.optimizer.load_state_dict(loaded["optimizer"])
        trainer.scheduler.load_state_dict(common["scheduler"])
    samples = int(common["consumed_samples"])
    tokens = common.get("consumed_tokens")
    if tokens is None:
        tokens = samples * trainer.cfg.model.seq_length
    if load_optimizer and "consumed_tokens" not in common:
        log.info("checkpoint %s predates the token counter: %d tokens derived as consumed "
                 "samples x model.seq_length", ckpt, tokens)
    if load_optimizer:
        trainer.step = int(common["step"])
        trainer.consumed_tokens = int(tokens)
        if "rng" in loaded:
            set_rng_state(loaded["rng"])
        elif "rng" in common:  # saved before each rank's was: rank 0's, on every rank
            set_rng_state(common["rng"])
        elif _rank() == 0:  # another layout: a rank's generators fit its old place only
            log.info("%s was saved at TP/PP/DP %s, resumed at %s: each rank keeps the "
                     "generators seeded at start (dropout draws differ from an "
                     "uninterrupted run)", ckpt, common.get("rng_layout"), _layout())
    return {
        "step": int(common["step"]),
        "consumed_samples": samples,
        "consumed_tokens": int(tokens),
        "extra": common.get("extra", {}),
    }
