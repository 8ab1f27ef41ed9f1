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
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass

import torch


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
