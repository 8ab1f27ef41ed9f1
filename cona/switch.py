"""The switch: move a running job to another parallel layout, in memory.

A *layout switch* (DP, TP or PP size changes) on every rank, in order:

1. keep the world process group; remember the old layout's megatron groups
   and the RNG state;
2. ``jobruntime.parallel.initialize_layout`` on a copy of the config
   (``destroy_model_parallel`` + ``initialize_model_parallel``, with
   ``release_old_groups=False``); the old model keeps its own
   ``pg_collection``, so its groups stay usable until step 7;
3. build the new model (initialised, then overwritten: megatron 0.16 sets
   the tensor-parallel attributes that resharding needs only while
   initialising; the RNG state is restored afterwards) and wrap it in a new
   :class:`~jobruntime.trainer.Trainer` (DDP, optimizer, schedule);
4. reshard the weights with megatron-core's
   ``resharding.swap_model_weights`` (a plan of point-to-point copies of TP
   slices between the old and new owners, PP-aware through global layer
   numbers), then run **the same plan** once per optimizer-state tensor
   (AdamW ``exp_avg``, ``exp_avg_sq``, fp32 master weights under bf16): the
   parameters' ``.data`` are pointed at those tensors for the copy, since they
   have the parameters' shapes.  The step count (a scalar, equal on all
   ranks) is copied;
5. the tied output-layer copy of the word embedding on the last pipeline
   stage (``pp > 1``) is not in megatron's plan (its name does not exist in
   a ``pp = 1`` source), so it is hidden from the plan and filled the way
   megatron initialises it: zero, then all-reduce over the embedding group
   (first + last stage), for the weight and for each state tensor;
6. the LR schedule position (samples), step and token counters and RNG are carried;
   the data position (``consumed_samples``) is kept by the caller;
7. the old model, optimizer and process groups are freed (the groups destroyed:
   ``jobruntime.parallel.destroy_groups``).

A *batch switch* (same DP/TP/PP, new micro or global batch) needs no
resharding: the trainer's config, the schedule's batch and the LR change.

Time and peak resident memory (psutil RSS, sampled every 5 ms by a thread;
the maximum over ranks) are measured for every switch.  Peak memory is about
twice the model + optimizer state: old and new copies coexist during step 4.

Fallback, not used: a ``dist_checkpointing`` save/load round trip through a
tmpfs folder (``jobruntime.checkpoint``) also reshards everything, but costs
file I/O and serialisation; the in-memory path was reliable on CPU (see
``tests/test_cona_switch.py``), so it is the only one implemented.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import psutil
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from jobruntime import cpu_compat
from jobruntime.config import JobConfig
from jobruntime.faults import RunInterrupted, exit_interrupted, fault_point
from jobruntime.model import build_model
from jobruntime.parallel import (
    Topology,
    default_generators,
    destroy_groups,
    initialize_layout,
    model_parallel_groups,
    set_default_generators,
    share_tp_generators,
)
from jobruntime.trainer import Trainer

from .state import (
    adam_hyperparameters,
    build_trainer,
    optimizer_state_by_name,
    rebias_adam_moments,
    set_peak_lr,
)

log = logging.getLogger("cona")


class _SWITCHES:  # layout switches so far in this process (for fault_point)
    count = 0


@dataclass
class SwitchReport:
    """Measured cost of one switch (identical on every rank).

    Attributes:
        kind: ``"layout"`` (resharded) or ``"batch"``.
        seconds: wall time of the switch, max over ranks.
        peak_rss_mib: highest resident memory of any rank during the switch.
        rss_before_mib / rss_after_mib: that rank's RSS before and after (max over ranks).
    """

    kind: str
    seconds: float
    peak_rss_mib: float
    rss_before_mib: float
    rss_after_mib: float

    def to_dict(self) -> dict:
        return asdict(self)


class PeakRSS:
    """Context manager sampling this process's RSS in a thread; ``.peak`` in bytes."""

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self._proc = psutil.Process()
        self.start = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.end = self._proc.memory_info().rss
        self.peak = max(self.peak, self.end)


def max_over_ranks(values: list[float]) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks (one all-reduce on the compute
    device, as the NCCL group needs); ``values`` unchanged without a process group."""
    t = torch.tensor(values, dtype=torch.float64, device=cpu_compat.device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _report(kind: str, seconds: float, rss: PeakRSS) -> SwitchReport:
    mib = 2.0**20
    s, peak, before, after = max_over_ranks(
        [seconds, rss.peak / mib, rss.start / mib, rss.end / mib]
    )
    return SwitchReport(kind, s, peak, before, after)


def _tied_output_weight(module: torch.nn.Module) -> torch.nn.Parameter | None:
    """The last stage's copy of the word embedding (``pp > 1``, tied), else ``None``."""
    if not getattr(module, "share_embeddings_and_output_weights", False):
        return None
    if getattr(module, "pre_process", True) or not getattr(module, "post_process", False):
        return None
    return module.output_layer.weight


@contextlib.contextmanager
def _hidden_param(module: torch.nn.Module, param: torch.nn.Parameter | None):
    """Temporarily unregister ``param`` so ``named_parameters`` skips it."""
    if param is None:
        yield
        return
    owner, key = None, None
    for m in module.modules():
        for k, p in m._parameters.items():
            if p is param:
                owner, key = m, k
    owner._parameters.pop(key)
    try:
        yield
    finally:
        owner._parameters[key] = param


def _sync_tied_copy(module: torch.nn.Module, tensor_of) -> None:
    """Fill the tied output copy from the first stage: zero it, all-reduce over the embedding group."""
    if not getattr(module, "share_embeddings_and_output_weights", False):
        return
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return
    if not module._is_in_embd_group():
        return
    weight = module.shared_embedding_or_output_weight()
    t = tensor_of(weight)
    if _tied_output_weight(module) is weight:
        t.zero_()
    dist.all_reduce(t, group=module.embd_group)


@torch.no_grad()
def _reshard(src: Trainer, dst: Trainer) -> None:
    """Copy weights, optimizer state and step from ``src`` (old layout) to ``dst``."""
    from megatron.core.resharding import swap_model_weights

    backend = cpu_compat.backend()
    src_m, dst_m = src.module, dst.module
    hidden = _tied_output_weight(dst_m)
    with _hidden_param(dst_m, hidden):
        swap_model_weights(src_m, dst_m, backend)  # builds and caches the plan on dst_m
    _sync_tied_copy(dst_m, lambda p: p.data)

    src_states, dst_states = optimizer_state_by_name(src), optimizer_state_by_name(dst)
    stepped = next((s for s in src_states.values() if s.step > 0), None)
    if stepped is None:  # switched before the first step: nothing but weights to move
        for s in dst_states.values():
            if s.main is not s.param:
                s.main.copy_(s.param.float())
        return
    # Fresh AdamW state in the new optimizer, to be overwritten by the copy; the step
    # where the old optimizer kept it (per parameter, or per group: TE's FusedAdam)
    for s in dst_states.values():
        s.state.clear()
        if "step" in stepped.state:
            s.state["step"] = stepped.state["step"].detach().clone()
        else:
            s.group["step"] = stepped.group["step"]
        s.state["exp_avg"] = torch.zeros_like(s.main)
        s.state["exp_avg_sq"] = torch.zeros_like(s.main)
    kinds = ["exp_avg", "exp_avg_sq"]
    if any(s.main is not s.param for s in src_states.values()):
        kinds.append("main")

    def tensor(s, kind):
        return s.main if kind == "main" else s.state[kind]

    for kind in kinds:
        saved_src = {n: s.param.data for n, s in src_states.items()}
        saved_dst = {n: s.param.data for n, s in dst_states.items()}
        try:
            for s in (*src_states.values(), *dst_states.values()):
                s.param.data = tensor(s, kind)
            with _hidden_param(dst_m, hidden):
                swap_model_weights(src_m, dst_m, backend)  # cached plan
            _sync_tied_copy(dst_m, lambda p: p.data)
        finally:
            for n, s in src_states.items():
                s.param.data = saved_src[n]
            for n, s in dst_states.items():
                s.param.data = saved_dst[n]


class SwitchInterrupted(RunInterrupted):
    """A rank was lost during a layout switch (every rank exits; resume from a checkpoint)."""


@contextlib.contextmanager
def _watchdog(seconds: float, what: str):
    """Exit this process with one line if the block runs longer than ``seconds``.

    A rank killed in a switch closes its sockets and the others' collectives
    fail at once (then :class:`SwitchInterrupted`); a rank that hangs (stalled
    host, lost network) leaves them waiting in a collective that only the
    process group's timeout would end, so a timer stops them instead.
    """
    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            exit_interrupted(f"[rank {dist.get_rank() if dist.is_initialized() else 0}] {what} "
                             f"did not finish within {seconds:g} s (a rank stalled or was lost)")

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()


def switch_layout(
    owner, new_cfg: JobConfig, *, reference_batch: int | None = None, seed: int,
    build: Callable[[JobConfig, torch.nn.Module, Trainer], Trainer] | None = None,
) -> tuple[Topology, SwitchReport]:
    """Move ``owner.trainer`` to ``new_cfg``'s layout (collective: call on every rank).

    Args:
        owner: any object whose ``trainer`` attribute holds the running
            :class:`Trainer` (and the only reference to it, so that the old
            layout's memory is freed inside the switch); it is replaced by the
            new trainer.
        new_cfg: config of the new layout (parallel section) and LR (train.lr/min_lr).
        reference_batch: batch the schedule's samples are counted against
            (see :func:`cona.state.build_trainer`); CONA's trainer only.
        seed: base seed to re-seed megatron's model-parallel RNG tracker for
            the new TP rank (dropout streams); the default torch/NumPy/Python
            RNG states are carried over unchanged.
        build: ``build(new_cfg, model, old_trainer)`` wraps the new layout's model
            in a trainer whose LR schedule continues the old one's; default CONA's
            (:func:`cona.state.build_trainer`, a sample-counting schedule).  GeoMesh's
            regions pass their own (:mod:`geomesh.layout_switch`).  Weights, optimizer
            state, step and token counts are moved here whatever ``build`` does.

    Returns:
        ``(topology, report)`` of the new layout.

    Raises:
        RuntimeError: a collective failed (a rank died); a rank that hangs
            makes every rank exit after ``cona.switch_timeout_s`` instead.
    """
    with PeakRSS() as rss, _watchdog(new_cfg.cona.switch_timeout_s, "CONA layout switch"):
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        rng = default_generators()
        old_groups = model_parallel_groups()  # resharding reads over both layouts
        topo = initialize_layout(new_cfg, release_old_groups=False)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        # Initialised although overwritten: megatron sets the TP attributes
        # (partition dim, stride) that resharding reads only while initialising.
        # Built on the compute device (build_model's default): no host copy to move.
        module = build_model(new_cfg.model, new_cfg.parallel, params_dtype=owner.trainer.dtype)
        fault_point("switch", _SWITCHES.count)
        _SWITCHES.count += 1
        if build is None:
            new = build_trainer(new_cfg, reference_batch, model=module,
                                num_samples=owner.trainer.scheduler.num_steps)
        else:
            new = build(new_cfg, module, owner.trainer)
        _reshard(owner.trainer, new)
        # the moments were built under the old trainer's betas (beta2 may follow the batch)
        rebias_adam_moments(new, adam_hyperparameters(owner.trainer))
        new.step, new.consumed_tokens = owner.trainer.step, owner.trainer.consumed_tokens
        set_default_generators(rng)
        share_tp_generators()  # TP peers that were other PP stages drew apart
        owner.trainer = new
        del module, new
        gc.collect()  # the old model, DDP buffers and optimizer state go here
        destroy_groups(old_groups)
        if dist.is_initialized():
            dist.barrier()
        seconds = time.perf_counter() - t0
    return topo, _report("layout", seconds, rss)


def switch_batch(trainer: Trainer, new_cfg: JobConfig) -> SwitchReport:
    """Same layout, new micro/global batch and LR: no resharding (collective only for timing)."""
    with PeakRSS() as rss:
        t0 = time.perf_counter()
        trainer.cfg = new_cfg
        trainer.scheduler.global_batch_size = new_cfg.parallel.global_batch_size
        set_peak_lr(trainer, trainer.scheduler, new_cfg.train.lr, new_cfg.train.min_lr)
        seconds = time.perf_counter() - t0
    return _report("batch", seconds, rss)
