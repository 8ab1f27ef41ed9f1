"""Which fused kernels this process can use: decided by what imports, never assumed.

megatron-core's ``TransformerConfig`` has switches for kernels that live in
other packages: apex's persistent and fused LayerNorm, the
``scaled_masked_softmax_cuda`` extensions (apex or a Megatron-LM build), apex's
``fused_weight_gradient_mlp_cuda``, Transformer Engine's fused RoPE, and
megatron's own ``jit_fuser`` (``torch.compile``) kernels for bias+GeLU,
bias+SwiGLU, bias+dropout+add and the vocab-parallel cross entropy.  Turning
one on where its kernel is missing fails inside megatron (an assertion in
``WrappedTorchNorm``, ``ModuleNotFoundError: scaled_masked_softmax_cuda``), so
each switch here is the result of an import probe.

The ``torch.compile`` fusions need a compiler backend for the compute device:
Triton for CUDA.  On a CPU build they are left off: Inductor's C++ backend
works there, but compiling in every freshly spawned process costs more than it
saves on the tiny CPU models (and the tests start many processes).

:func:`available_kernels` is the one place that decides;
:func:`jobruntime.model.to_transformer_config` reads it.

Multi-tensor ops: without apex and Transformer Engine, megatron-core 0.16.1
falls back to ``megatron.core.utils.local_multi_tensor_l2_norm`` (one
``torch.norm`` per parameter gathered with ``torch.tensor([...])``: one
device-to-host sync per parameter, ~390 per step for GPT-3 1.3B or BERT-Large)
and ``local_multi_tensor_scale`` (a Python loop of one multiply and one copy per
parameter).  :func:`install_multi_tensor_ops` puts :func:`foreach_l2_norm` and
:func:`foreach_scale` (``torch._foreach_*``: a few grouped kernels, no host
sync) in their place, in the two megatron modules that look them up, and only
where megatron chose its fallback.  Same numbers as the fallback.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass

import torch
from torch import Tensor


def _imports(module: str) -> bool:
    """True when ``module`` imports (a compiled extension may exist but fail to load)."""
    try:
        if importlib.util.find_spec(module) is None:
            return False
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - broken builds raise anything from OSError to RuntimeError
        return False
    return True


@dataclass(frozen=True)
class Kernels:
    """Fused kernels usable in this process (each ``True`` only if it imports).

    Attributes:
        transformer_engine: Transformer Engine's PyTorch layers (TE layer specs).
        persist_layer_norm: apex ``FastLayerNormFN`` (megatron's
            ``persist_layer_norm``).
        fused_layer_norm: apex ``FusedLayerNormAffineFunction``.
        masked_softmax: the ``scaled_masked_softmax_cuda`` and
            ``scaled_upper_triang_masked_softmax_cuda`` extensions
            (megatron's ``masked_softmax_fusion``).
        grad_accumulation: apex ``fused_weight_gradient_mlp_cuda``
            (megatron's ``gradient_accumulation_fusion``).
        rope: Transformer Engine's fused RoPE (megatron's ``apply_rope_fusion``).
        jit: megatron's ``jit_fuser`` (``torch.compile``) kernels: the
            compute device is CUDA and Triton imports.
    """

    transformer_engine: bool
    persist_layer_norm: bool
    fused_layer_norm: bool
    masked_softmax: bool
    grad_accumulation: bool
    rope: bool
    jit: bool

    @classmethod
    def none(cls) -> Kernels:
        """No fused kernel at all (``model.kernel_fusions=off``)."""
        return cls(**{f: False for f in cls.__dataclass_fields__})


@functools.cache
def available_kernels() -> Kernels:
    """Probe the fused kernels once per process (see :class:`Kernels`)."""
    cuda = torch.cuda.is_available()
    te = cuda and _imports("transformer_engine.pytorch")
    return Kernels(
        transformer_engine=te,
        persist_layer_norm=cuda and _imports("apex.contrib.layer_norm.layer_norm"),
        fused_layer_norm=cuda and _imports("apex.normalization.fused_layer_norm"),
        masked_softmax=cuda and _imports("scaled_masked_softmax_cuda")
        and _imports("scaled_upper_triang_masked_softmax_cuda"),
        grad_accumulation=cuda and _imports("fused_weight_gradient_mlp_cuda"),
        rope=te,
        jit=cuda and _imports("triton"),
    )


# -- multi-tensor ops ----------------------------------------------------------


def foreach_l2_norm(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                    per_tensor: bool, *args) -> tuple[Tensor, None]:
    """L2 norm of all tensors of ``tensor_lists`` together, without a host sync.

    Drop-in for ``amp_C.multi_tensor_l2norm`` (called through megatron's
    ``multi_tensor_applier``) and for megatron-core's fallback
    ``megatron.core.utils.local_multi_tensor_l2_norm``, which it replaces
    (:func:`install_multi_tensor_ops`): the per-tensor norms come from one
    ``torch._foreach_norm`` and stay on the device, where the fallback copies
    each to the host (``torch.tensor([norm, ...])``).  The same reduction as
    the fallback (the norm of the per-tensor norms, in fp32): equal results
    to the bit on CPU.  ``chunk_size``, ``noop_flag`` and ``per_tensor``
    (per-tensor norms, which megatron never asks for here) are ignored, as the
    fallback does.

    Returns:
        ``(norm, None)``: ``norm`` is a ``[1]`` fp32 tensor on the tensors'
        device (zeros on ``noop_flag``'s device when every list is empty).
    """
    norms = [n for tensors in tensor_lists if tensors for n in torch._foreach_norm(tensors)]
    if not norms:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    return torch.linalg.vector_norm(torch.stack(norms).float()).reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                  scale: float) -> None:
    """``dst[i] = src[i] * scale`` for ``[src, dst] = tensor_lists``, as grouped kernels.

    Drop-in for ``amp_C.multi_tensor_scale`` and megatron-core's fallback
    ``megatron.core.utils.local_multi_tensor_scale`` (a Python loop of
    ``dst.copy_(src * scale)``), which it replaces
    (:func:`install_multi_tensor_ops`).  Used by megatron's gradient clipping
    (``src is dst``: one ``torch._foreach_mul_``) and by its mixed-precision
    optimizer's copies (``scale == 1``: one ``torch._foreach_copy_``, casting to
    ``dst``'s dtype).  Same values as the fallback; like it, ``noop_flag`` is
    not set on non-finite values (apex does).
    """
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if len(src) == len(dst) and all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def install_multi_tensor_ops() -> bool:
    """Replace megatron-core's per-parameter multi-tensor fallbacks by the ``foreach`` ones.

    megatron-core picks its multi-tensor kernels at import time: Transformer
    Engine's, else apex's ``amp_C``, else its local Python fallbacks.  Only
    the fallbacks are replaced, in the module globals megatron calls them
    through: ``megatron.core.optimizer.clip_grads.l2_norm_impl`` (gradient
    norm) and ``multi_tensor_scale_impl`` (gradient clipping), and
    ``megatron.core.optimizer.optimizer.multi_tensor_scale_impl`` (copies
    between model and main parameters).  megatron-core itself is not edited.
    Idempotent; :class:`jobruntime.trainer.Trainer` calls it before building
    the optimizer.

    Returns:
        True when some fallback is now the ``foreach`` version (no apex, no TE).
    """
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    utils = importlib.import_module("megatron.core.utils")
    active = False
    if clip_grads.l2_norm_impl in (utils.local_multi_tensor_l2_norm, foreach_l2_norm):
        clip_grads.l2_norm_impl = foreach_l2_norm
        active = True
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl in (utils.local_multi_tensor_scale, foreach_scale):
            module.multi_tensor_scale_impl = foreach_scale
            active = True
    return active
