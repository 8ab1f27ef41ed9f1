"""Sign compression of pseudo-gradients: bit packing, scales, error feedback.

The sign kinds of :class:`geomesh.canonical_codec.CanonicalCodec` send one sign
bit per element (8 per byte) and fp32 magnitudes ``m``; the receiver
reconstructs ``m * sign(x)``.

Scale.  For ``x`` with ``d`` elements, the scale that minimises the squared
error ``||x - m sign(x)||^2`` is ``m = ||x||_1 / d = mean |x|`` (set the
derivative ``-2 sum |x_j| + 2 d m`` to zero).  "mean |Δ|" and "L1 / numel" are
therefore the same number; it is the scale of EF-signSGD (Karimireddy et al.
2019, "Error Feedback Fixes SignSGD and other Gradient Compression Schemes",
Alg. 2, ``C(x) = ||x||_1/d * sign(x)``), and it keeps the decompressed
tensor's L1 norm equal to the input's.  signSGD itself (Bernstein et al.
2018) uses the bare sign; GeoMesh needs the magnitude because pseudo-gradient
sizes differ across tensors and workers (DiLoCo, Douillard et al. 2023, sends
the full pseudo-gradient).

Row scales (``sign_row``, GeoMesh's default).  A tensor of two or more
dimensions may carry one scale per row (``shape[0]`` scales, each ``mean |x|``
of its row, :func:`num_row_scales`) instead of one per tensor: the same
minimiser applied row by row.  It matters for embeddings and output layers,
whose rows (tokens) see very different updates in a round — with one scale per
tensor, every row of a token not seen in the round would receive ``±m`` of the
seen rows.  Cost: 4 bytes per row, e.g. 2 MB on GPT-3 1.3B's 164 MB of signs
(compression ratio 31.6 instead of 32.0).

Sign convention: bit 1 for ``x >= 0`` (``+0`` and ``-0`` included), bit 0 for
``x < 0`` or NaN (the codecs reject non-finite input).  Bits are MSB-first
within a byte (``numpy.packbits`` order); pad bits are 0.

Error feedback (Karimireddy et al. 2019): the worker compresses
``x_t = Δ_t + e_t`` and keeps ``e_{t+1} = x_t - C(x_t)`` locally
(:class:`ErrorFeedback`), so the compression error is sent in later rounds
instead of being lost.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)


class MessageError(ValueError):
    """A peer's message is malformed, truncated or from a different model/version."""


# ---------------------------------------------------------------------------
# Bit packing
# ---------------------------------------------------------------------------


def packed_size(numel: int) -> int:
    """Bytes of the packed signs of ``numel`` elements: ``ceil(numel / 8)``."""
    return (numel + 7) // 8


def pack_signs(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Pack the signs of ``t`` (any shape, incl. 0-D and empty) 8 per byte.

    Args:
        t: tensor of any floating/integer dtype and rank, on any device.

    Returns:
        ``(packed, numel)``: ``packed`` is uint8 ``[ceil(numel/8)]`` on
        ``t.device``; bit 1 means ``t >= 0``.
    """
    flat = t.detach().reshape(-1)
    n = flat.numel()
    bits = (flat >= 0).to(torch.uint8)  # [n]
    pad = (-n) % 8
    if pad:
        bits = torch.cat([bits, bits.new_zeros(pad)])
    bits = bits.view(-1, 8)  # [n/8, 8]
    packed = bits[:, 0] << 7
    for k in range(1, 8):
        packed |= bits[:, k] << (7 - k)
    return packed, n


def unpack_signs(
    packed: torch.Tensor, shape: Sequence[int] | torch.Size, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`pack_signs`: ``±1`` tensor of ``shape``.

    Args:
        packed: uint8 ``[ceil(numel/8)]``.
        shape: target shape (``()`` for a 0-D tensor).

    Raises:
        ValueError: ``packed`` has the wrong dtype or length for ``shape``.
    """
    shape = torch.Size(shape)
    n = shape.numel()
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(
            f"packed signs must be a 1-D uint8 tensor, got {packed.dtype} {tuple(packed.shape)}"
        )
    if packed.numel() != packed_size(n):
        raise ValueError(
            f"packed signs have {packed.numel()} bytes; shape {tuple(shape)} needs {packed_size(n)}"
        )
    shifts = torch.tensor(_SHIFTS, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1  # [n/8, 8] uint8
    bits = bits.reshape(-1)[:n]
    return (bits.to(dtype) * 2 - 1).reshape(shape)


# ---------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------


def num_row_scales(shape: Sequence[int]) -> int:
    """Scales of a tensor with row scales: ``shape[0]`` for 2+ dims, else 1."""
    return int(shape[0]) if len(shape) >= 2 else 1


def scale_signs(sign: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``sign * scale`` in place; a tensor ``scale`` multiplies row by row."""
    if isinstance(scale, torch.Tensor):
        if sign.numel() == 0:
            return sign
        return sign.view(scale.numel(), -1).mul_(scale.to(sign.dtype).unsqueeze(1)).view(sign.shape)
    return sign.mul_(scale)


class ErrorFeedback:
    """Per-tensor error-feedback memory ``e`` (fp32, same shapes as the model).

    Kept locally by each worker, never sent, in host memory: it is read and
    written once per round (4 bytes per parameter over PCIe), so it takes no
    accelerator memory and the planner's plan does not depend on it.
    """

    def __init__(self, decay: float = 1.0) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        self.decay = decay
        """Factor on the kept residual (1: EF-signSGD; < 1 forgets old errors)."""

    def add(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``x + e`` (on ``x``'s device); ``x`` itself when there is no residual yet."""
        e = self.residuals.get(name)
        return x if e is None else x + e.to(x.device)

    def keep(self, name: str, residual: torch.Tensor) -> None:
        """Store the new residual ``decay · (x − D(C(x)))`` (moved to host memory)."""
        r = residual.detach().cpu()
        self.residuals[name] = r if self.decay == 1.0 else r.mul_(self.decay)

    def state_dict(self) -> dict:
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}


# ---------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSchema:
    """Ordered ``(name, shape)`` list of one process's tensors (the async baseline's
    :class:`geomesh.codec.DenseCodec`; the target model's parameter count)."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def from_tensors(cls, named: Mapping[str, torch.Tensor]) -> TensorSchema:
        """Schema of a name->tensor mapping, in its iteration order (meta tensors work)."""
        return cls(tuple((k, tuple(v.shape)) for k, v in named.items()))

    @classmethod
    def from_shapes(cls, named: Iterable[tuple[str, Sequence[int]]]) -> TensorSchema:
        return cls(tuple((k, tuple(int(d) for d in s)) for k, s in named))

    @property
    def digest(self) -> bytes:
        """8-byte BLAKE2b digest of names and shapes."""
        text = ";".join(f"{k}:{','.join(map(str, s))}" for k, s in self.entries)
        return hashlib.blake2b(text.encode(), digest_size=8).digest()

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.entries)
