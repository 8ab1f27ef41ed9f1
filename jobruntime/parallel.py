"""Process groups and the parallel layout of one job.

:class:`Topology` is the validated description of the layout that code
receives explicitly; megatron-core's ``parallel_state`` holds the groups
themselves (the one module-level singleton we accept, because megatron's
layers read it).
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from . import cpu_compat
from .config import JobConfig
from .devices import install_collective_check
from .faults import note_run_dir
from .ports import free_port

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """This rank's place in the (DP, TP, PP) layout."""

    world_size: int
    rank: int
    dp: int
    tp: int
    pp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int

    @property
    def pp_is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def pp_is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def is_logging_rank(self) -> bool:
        """The rank that writes metrics: DP rank 0, TP rank 0, last PP stage."""
        return self.dp_rank == 0 and self.tp_rank == 0 and self.pp_is_last_stage


def prepare_process() -> None:
    """Per-process setup before any process group: the CPU layer where CUDA is
    absent (:func:`jobruntime.cpu_compat.enable`) and the device check of every
    collective (:func:`jobruntime.devices.install_collective_check`).  Idempotent."""
    cpu_compat.enable()
    install_collective_check()


def init_distributed(timeout_s: float = 600.0) -> None:
    """Initialise ``torch.distributed`` from torchrun's environment, or as a world of 1.

    Backend: NCCL with CUDA, gloo on CPU (where the CPU layer of
    :mod:`jobruntime.cpu_compat` is switched on first).  Collectives check
    their tensors' devices against the group's backend
    (:func:`jobruntime.devices.install_collective_check`).
    """
    prepare_process()
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=cpu_compat.backend(), timeout=datetime.timedelta(seconds=timeout_s)
    )


def model_parallel_groups() -> list[dist.ProcessGroup]:
    """The process groups megatron's ``parallel_state`` holds now, the default group
    excepted: its registry of every group ``create_group`` made with this rank a member
    (``parallel_state._global_process_group_list``; megatron-core 0.16), in creation
    order (the same on every rank).  ``destroy_model_parallel`` forgets them and
    destroys only its gloo data-parallel groups."""
    return [g for g in parallel_state._global_process_group_list or [] if g is not None]


def destroy_groups(groups: list[dist.ProcessGroup]) -> None:
    """Destroy ``groups`` (``torch.distributed.destroy_process_group`` each: their
    communicators, and gloo's three threads per group).  Every rank calls it for the
    groups it is a member of, in the same order (:func:`model_parallel_groups`'), as it
    called ``new_group``: on NCCL destroying a group waits for its members, so a rank that
    died first leaves the others waiting (call it on the healthy path only).  A group
    already destroyed (megatron destroys its gloo data-parallel groups itself) or that
    cannot be destroyed is logged and skipped: it costs threads and sockets, not the
    run's results."""
    for g in groups:
        try:
            dist.destroy_process_group(g)
        except Exception as e:  # noqa: BLE001 - see the docstring
            log.debug("could not destroy an old process group: %s", e)


def initialize_layout(cfg: JobConfig, *, release_old_groups: bool = True) -> Topology:
    """(Re)build megatron's process groups for ``cfg.parallel``; return the topology.

    A rebuild destroys the groups of the layout before it (``destroy_model_parallel``
    only forgets them: each gloo group kept three threads, one of them polling, so a
    process that rebuilt its layout a few hundred times -- the CONA bench's runs, a long
    CONA run -- held thousands of threads that took its CPU), and collects the garbage
    that still referenced them.  ``release_old_groups=False`` leaves
    them to the caller, who still needs them (a layout switch reshards over both
    layouts): destroy them with :func:`destroy_groups` (:func:`model_parallel_groups`
    before the rebuild lists them).  So a model or trainer built on the previous layout
    cannot train after the rebuild: one job per process at a time, or a switch.

    Raises:
        ConfigError: the layout does not fit the world size or the model.
    """
    init_distributed()
    world = dist.get_world_size()
    dp = cfg.validate(world)
    old = []
    if parallel_state.model_parallel_is_initialized():
        old = model_parallel_groups()
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=cfg.parallel.tp,
        pipeline_model_parallel_size=cfg.parallel.pp,
    )
    if release_old_groups and old:
        destroy_groups(old)
        del old
        # a group's threads end with its last reference, and the old layout's model and
        # optimizer hold theirs in reference cycles: collect them now, not at the
        # collector's next full pass (hundreds of gloo threads polling meanwhile)
        gc.collect()
    return Topology(
        world_size=world,
        rank=dist.get_rank(),
        dp=dp,
        tp=cfg.parallel.tp,
        pp=cfg.parallel.pp,
        dp_rank=parallel_state.get_data_parallel_rank(),
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
    )


def set_seed(seed: int) -> None:
    """Seed Python, NumPy, torch and megatron's model-parallel RNG tracker.

    All ranks use the same base seed (the compute device's default generator
    included: ``torch.manual_seed`` seeds every CUDA device) and TP-sharded
    weights are initialised from the full tensor (``use_cpu_initialization``,
    run on the compute device, see :func:`jobruntime.model.build_model`), so
    TP=1 and TP=2 start from the same model; a PP stage first advances the generator past the
    earlier stages' draws (:func:`jobruntime.model.build_model`), so every
    PP size starts from the same model too.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def share_tp_generators() -> None:
    """Give every rank of each tensor-parallel group its first rank's default generators
    (Python's, NumPy's, torch's CPU and CUDA ones).  Megatron-core's default generator
    draws dropout outside TP regions on activations every TP rank holds whole, so it is
    "the same among a set of model parallel GPUs" (``model_parallel_cuda_manual_seed``);
    a rank that brings its own state from another layout (a PP stage advanced past the
    earlier stages' draws) would draw other masks than its TP peers, and their replicated
    parameters would drift apart.  The TP-region tracker states are left as they are
    (they differ per TP rank by design).  No-op at TP = 1."""
    group = parallel_state.get_tensor_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    box = [default_generators() if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, group=group)
    set_default_generators(box[0])


def default_generators() -> dict:
    """This process's default generators: Python's, NumPy's, torch's CPU one and the
    current CUDA device's (``None`` without CUDA).  NumPy's key array is held as a torch
    tensor, so that a checkpoint of it loads with ``torch.load(weights_only=True)``
    whatever registered NumPy's types."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(),
            # a tensor of its own (a from_numpy one does not survive pickle's legacy path)
            "numpy": (name, torch.tensor(keys.tolist(), dtype=torch.int64, device="cpu"),  # host
                      pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}


def set_default_generators(state: dict) -> None:
    """Set what :func:`default_generators` returned (its CUDA state only with CUDA;
    NumPy's keys as a tensor or, as older checkpoints saved them, an array)."""
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def rng_state() -> dict:
    """This rank's generators: :func:`default_generators` and megatron's model-parallel
    tracker (its named states: TP-region dropout, e.g. attention's), as Megatron-LM's
    ``get_rng_state`` keeps them.  What every checkpoint saves, and what is put back
    around work that must leave training's random draws as they were, so that a resumed
    run draws the dropout masks the uninterrupted one would."""
    return {**default_generators(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict | torch.Tensor) -> None:
    """Set what :func:`rng_state` returned (a bare tensor: torch's CPU generator alone,
    what GeoMesh states saved before; a dict without ``tracker``: the tracker as is).

    The tracker's states are the device's generator states (CUDA's on a GPU, the CPU's
    here): saved on another kind of device they do not fit, and are left as seeded with
    a warning (the dropout masks then differ from the uninterrupted run's), as the CUDA
    state is without CUDA."""
    if isinstance(state, torch.Tensor):
        torch.set_rng_state(state)
        return
    set_default_generators(state)
    saved = state.get("tracker")
    if not saved:
        return
    tracker = tensor_parallel.get_cuda_rng_tracker()
    now = tracker.get_states()
    if all(k in now and now[k].numel() == v.numel() for k, v in saved.items()) or not now:
        tracker.set_states(saved)
    else:
        log.warning("the saved model-parallel RNG states (%s) are of another device kind than "
                    "this run's: left as seeded, so dropout draws other masks than the "
                    "uninterrupted run", ", ".join(sorted(saved)))


def same_run_dir(run_dir, group: dist.ProcessGroup | None = None, src: int = 0) -> Path:
    """Rank 0's ``run_dir`` on every rank of the default process group.

    Each process of a ``torchrun`` job derives the default folder
    (``runs/<preset>-<time>``) from its own clock; ranks started either side
    of a second boundary would write checkpoints into two folders.  The run
    functions call this right after the process group exists, so all ranks
    use the folder rank 0 chose (one ``broadcast_object_list``).

    Also tells :func:`jobruntime.faults.note_run_dir` the folder.

    Args:
        group, src: the ranks of one job and the global rank deciding for
            them (default: the whole world, rank 0).
    """
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        obj = [str(run_dir)]
        dist.broadcast_object_list(obj, src=src, group=group)
        run_dir = obj[0]
    note_run_dir(run_dir)  # an interrupted run's message says whether it can resume from it
    return Path(run_dir)


def shutdown() -> None:
    """Destroy megatron's groups and the default process group."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
