"""Device checks: every tensor on the compute device, every collective on its backend's.

A tensor created without ``device=`` lands on the CPU.  On a CPU machine that
is the compute device and nothing shows; on a GPU the same tensor handed to an
NCCL collective fails deep inside torch (``No backend type associated with
device type cpu``), or a CPU parameter makes megatron's optimizer refuse the
model.  These checks turn both into one clear error at the first offending
call, on every machine:

* :func:`install_collective_check` wraps ``torch.distributed``'s tensor
  collectives (process-wide, idempotent; :func:`jobruntime.parallel.init_distributed`
  installs it): an NCCL group gets CUDA tensors only, a gloo group CPU or
  CUDA tensors (gloo copies CUDA tensors through the host);
* :func:`check_module_devices` asserts that a model's parameters and buffers
  sit on the compute device.

The static twin of these checks is
``tests/test_gpu_path.py::test_every_tensor_factory_names_its_device``: every tensor
factory call in the project names its device, or says why it is host memory.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist

# torch.distributed functions whose tensor arguments go over the wire
COLLECTIVES = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
    "all_to_all_single", "send", "recv", "isend", "irecv",
)
_ALLOWED = {"nccl": ("cuda",), "gloo": ("cpu", "cuda")}


class DeviceError(RuntimeError):
    """A tensor is on the wrong device for its module or collective."""


def _tensors(values) -> Iterable[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _backend(group) -> str:
    try:
        return str(dist.get_backend(group)).lower()
    except Exception:  # noqa: BLE001 - a group this rank is not in: nothing to check
        return ""


def _checked(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        backend = _backend(kwargs.get("group"))
        allowed = _ALLOWED.get(backend)
        if allowed:
            for t in _tensors([*args, *kwargs.values()]):
                if t.device.type not in allowed:
                    raise DeviceError(
                        f"torch.distributed.{name} on a {backend} group got a tensor on "
                        f"{t.device} (shape {tuple(t.shape)}, {t.dtype}); {backend} needs "
                        f"{' or '.join(allowed)} tensors: create it on the compute device "
                        "(device=...)")
        return fn(*args, **kwargs)

    wrapper.__device_checked__ = True
    return wrapper


def install_collective_check() -> None:
    """Wrap ``torch.distributed``'s tensor collectives with the backend device check.

    Patches the module attributes (``torch.distributed.all_reduce`` and
    ``torch.distributed.distributed_c10d.all_reduce`` alike), which is how
    megatron-core and this project call them.  Idempotent.

    Raises (from a wrapped collective):
        DeviceError: a tensor's device does not fit the group's backend
            (NCCL: CUDA only; gloo: CPU or CUDA).
    """
    from torch.distributed import distributed_c10d as c10d

    for name in COLLECTIVES:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, "__device_checked__", False):
            continue
        wrapped = _checked(name, fn)
        setattr(c10d, name, wrapped)
        if getattr(dist, name, None) is fn:
            setattr(dist, name, wrapped)


def check_module_devices(module: torch.nn.Module, device: torch.device, what: str) -> None:
    """Every parameter and buffer of ``module`` on ``device``'s type.

    Raises:
        DeviceError: names the first tensor elsewhere and the device it is on.
    """
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.device.type != device.type:
            raise DeviceError(f"{what}: {name} is on {t.device}, the compute device is "
                              f"{device}; move the model with .to(device) before wrapping it")


def device_summary(module: torch.nn.Module) -> dict:
    """Where ``module`` runs, read from its parameters (not from what was asked
    for, nor from ``torch.cuda.is_available()``): what a run's ``summary.json``
    and the benches record, so that work that silently ran elsewhere shows.

    Args:
        module: the model (its first parameter decides; a model is on one device).

    Returns:
        ``{"device": "cuda"|"cpu"|..., "gpu": name or None, "precision":
        "bfloat16"|"float32"|... (the parameters' dtype), "peak_memory_gib":
        max allocated GiB on that GPU, or None off CUDA}``.
    """
    p = next(module.parameters())
    cuda = p.device.type == "cuda"
    return {"device": p.device.type, "gpu": torch.cuda.get_device_name(p.device) if cuda else None,
            "precision": str(p.dtype).replace("torch.", ""),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(p.device) / 2**30, 3)
            if cuda else None}
