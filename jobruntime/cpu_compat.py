"""Run megatron-core on a CPU-only torch build (gloo), and only there.

megatron-core 0.16.1 assumes CUDA in a few places (see ``DESIGN.md``,
"Findings"): tensors created with ``device="cuda"`` or
``torch.cuda.current_device()`` (global memory buffer, DDP buffers, pipeline
p2p and schedules, gradient clipping), the CUDA RNG tracker, CUDA streams in
the resharding copy service, and type checks on ``Tensor.type()`` strings
(``torch.cuda.FloatTensor`` / ``torch.cuda.BFloat16Tensor``) in the
mixed-precision optimizer and in gradient clipping.

:func:`enable` installs, process-wide and idempotently:

* a ``TorchFunctionMode`` that maps a ``device`` of ``"cuda"``, ``"cuda:N"``,
  ``torch.device("cuda")`` or an int to ``"cpu"`` in factory functions,
  ``Tensor.to`` and ``Tensor.cuda``, and makes ``Tensor.type()`` (no
  argument) name a CPU tensor as its CUDA twin (``torch.cuda.BFloat16Tensor``),
  so megatron's bf16 optimizer and gradient clipping run the same code as on
  GPU;
* a filter for megatron's ``CUDA_DEVICE_MAX_CONNECTIONS`` advice (no CUDA
  streams to order);
* CPU stand-ins for ``torch.cuda.current_device / synchronize / manual_seed /
  get_rng_state / set_rng_state / Stream / stream / current_stream / Event``
  and the default generators used by megatron's RNG tracker.

It does nothing when CUDA is available: on GPU megatron-core runs unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
from torch.overrides import TorchFunctionMode

_ENABLED = False


def _to_cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments to CPU in every torch function call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)  # e.g. "torch.BFloat16Tensor" -> "torch.cuda.BFloat16Tensor"
            return name.replace("torch.", "torch.cuda.", 1) if args[0].device.type == "cpu" else name
        if "device" in kwargs:
            kwargs["device"] = _to_cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            first = args[1]
            if isinstance(first, (int, str, torch.device)) and not isinstance(first, bool):
                args = (args[0], _to_cpu_device(first), *args[2:])
        return func(*args, **kwargs)


class _CpuStream:
    """Stand-in for ``torch.cuda.Stream`` / ``Event``: every operation is synchronous."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        pass

    def wait_event(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def record_event(self, *args, **kwargs):
        return _CpuStream()

    def record(self, *args, **kwargs):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


@contextlib.contextmanager
def _cpu_stream_ctx(stream=None):
    yield stream


def cuda_available() -> bool:
    """True when this process can use CUDA (then :func:`enable` is a no-op)."""
    return torch.cuda.is_available()


def enable() -> bool:
    """Install the CPU layer if CUDA is unavailable.  Idempotent.

    Returns:
        True if the layer is active in this process, False on a CUDA machine.
    """
    global _ENABLED
    if cuda_available():
        return False
    if _ENABLED:
        return True

    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.synchronize = lambda *a, **k: None
    # torch.manual_seed calls cuda.manual_seed_all: that one must not recurse.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)
    cuda.manual_seed_all = lambda seed: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    cuda.default_generators = (torch.default_generator,)
    cuda.Stream = _CpuStream
    cuda.Event = _CpuStream
    cuda.stream = _cpu_stream_ctx
    cuda.current_stream = lambda *a, **k: _CpuStream()
    cuda.default_stream = lambda *a, **k: _CpuStream()
    cuda.set_device = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.device_count = lambda: 0

    # megatron's RNG tracker defers state changes through torch.cuda._lazy_call,
    # which on a CPU build queues them forever; run them at once instead.
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._lazy_call = lambda cb: cb()
    mp_random._lazy_init = lambda: None
    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state)
    )

    # megatron's TP linear layers warn (once per process) to set
    # CUDA_DEVICE_MAX_CONNECTIONS=1, which orders CUDA kernel launches so that
    # the gradient all-reduce overlaps; there are no CUDA streams on CPU, so the
    # advice does not apply here (on GPU the warning stays).
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*",
                            category=UserWarning)

    mode = _CudaToCpuMode()
    mode.__enter__()  # process-wide: stays on the mode stack for the life of the process
    _ENABLED = True
    return True


@functools.cache
def backend() -> str:
    """The torch.distributed backend for this machine: ``nccl`` with CUDA, else ``gloo``."""
    return "nccl" if cuda_available() else "gloo"


def device() -> torch.device:
    """The compute device of this process (``cuda:LOCAL_RANK`` or ``cpu``)."""
    if cuda_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
