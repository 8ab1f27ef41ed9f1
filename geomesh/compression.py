"""Sign compression of pseudo-gradients, error feedback, and the wire format.

Each worker sends, per tensor, one sign bit per element (8 per byte) and one
fp32 magnitude ``m``; the receiver reconstructs ``m * sign(x)``.

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

Row scales (``TensorSchema(row_scales=True)``, GeoMesh's default in
:class:`geomesh.codec.SignCodec`).  A tensor of two or more dimensions may
carry one scale per row (``shape[0]`` scales, each ``mean |x|`` of its row)
instead of one per tensor: the same minimiser applied row by row.  It matters
for embeddings and output layers, whose rows (tokens) see very different
updates in a round — with one scale per tensor, every row of a token not seen
in the round would receive ``±m`` of the seen rows.  Cost: 4 bytes per row,
e.g. 2 MB on GPT-3 1.3B's 164 MB of signs (compression ratio 31.6 instead of
32.0).  The wire format then sends the row scales in place of the one scale.

Sign convention: bit 1 for ``x >= 0`` (``+0`` and ``-0`` included), bit 0 for
``x < 0`` or NaN (non-finite input is rejected by :func:`compress`).  Bits are
MSB-first within a byte (``numpy.packbits`` order); pad bits are 0.

Error feedback (Karimireddy et al. 2019): the worker compresses
``x_t = Δ_t + e_t`` and keeps ``e_{t+1} = x_t - C(x_t)`` locally, so the
compression error is sent in later rounds instead of being lost.

Wire format (little-endian), one message per worker per round::

    header  36 B  magic "GMSH" | version u16 | flags u16 | worker u32 | round u32
                  | num_tokens u64 | schema digest 8 B | num_tensors u32
    body          per tensor, in schema order: scale f32 (rows x f32 with row
                  scales) | ceil(numel/8) sign bytes
    trailer  4 B  CRC-32 of header + body

Names and shapes are not sent: every worker builds the same model, and the
8-byte digest of the (name, shape) schema catches a mismatch.  The payload
counted as traffic, :attr:`WorkerMessage.wire_bytes` = sign bytes + 4 B scale
per tensor + 8 B token count; the encoded message is exactly
``wire_bytes + FRAMING_BYTES`` (32 B of framing).
"""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

MAGIC = b"GMSH"
VERSION = 1
FLAG_ROW_SCALES = 1  # header flag: tensors of 2+ dims carry one scale per row
_HEADER = struct.Struct("<4sHHIIQ8sI")  # 36 bytes
_SCALE = struct.Struct("<f")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size
# Framing beyond the payload: header minus the 8-byte token count, plus CRC.
FRAMING_BYTES = HEADER_BYTES - 8 + _CRC.size

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


@dataclass(frozen=True)
class CompressedTensor:
    """One compressed tensor: ``decompressed = scale * sign``.

    Attributes:
        packed: uint8 ``[ceil(numel/8)]`` sign bits.
        scale: fp32-representable magnitude ``mean |x|`` (>= 0), or an fp32
            tensor ``[shape[0]]`` of row scales.
        shape: shape of the original tensor.
    """

    packed: torch.Tensor
    scale: float | torch.Tensor
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def num_scales(self) -> int:
        return self.scale.numel() if isinstance(self.scale, torch.Tensor) else 1

    @property
    def wire_bytes(self) -> int:
        """Sign bytes + 4 bytes per fp32 scale."""
        return self.packed.numel() + _SCALE.size * self.num_scales


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


def _fp32(x: float) -> float:
    """Round a Python float to the nearest fp32 (what goes on the wire)."""
    return _SCALE.unpack(_SCALE.pack(x))[0]


def compress(delta: torch.Tensor, residual: torch.Tensor | None = None) -> CompressedTensor:
    """Sign-compress ``x = delta + residual`` with scale ``mean |x|``.

    Args:
        delta: pseudo-gradient tensor, any shape/dtype/device.
        residual: error-feedback memory of the same shape (``None`` = none).

    Raises:
        ValueError: ``x`` contains NaN/Inf (a diverged worker must not poison
            the aggregate), or ``residual`` has another shape.
    """
    x = delta.detach().float()
    if residual is not None:
        if residual.shape != delta.shape:
            raise ValueError(
                f"residual shape {tuple(residual.shape)} != delta shape {tuple(delta.shape)}"
            )
        x = x + residual.float()
    scale = _fp32(x.abs().mean().item()) if x.numel() else 0.0
    if not math.isfinite(scale):
        raise ValueError(
            f"pseudo-gradient of shape {tuple(delta.shape)} has NaN/Inf; "
            "the worker diverged (lower the inner learning rate)"
        )
    packed, _ = pack_signs(x)
    return CompressedTensor(packed=packed, scale=scale, shape=torch.Size(delta.shape))


def decompress(
    ct: CompressedTensor,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``scale * sign`` as a ``dtype`` tensor of ``ct.shape``."""
    packed = ct.packed if device is None else ct.packed.to(device)
    scale = ct.scale.to(packed.device) if isinstance(ct.scale, torch.Tensor) else ct.scale
    return scale_signs(unpack_signs(packed, ct.shape, dtype=dtype), scale)


def compress_with_feedback(
    delta: torch.Tensor, residual: torch.Tensor | None
) -> tuple[CompressedTensor, torch.Tensor]:
    """EF-signSGD step: ``ct = C(delta + residual)``, new residual ``x - D(ct)`` (fp32)."""
    x = delta.detach().float() if residual is None else delta.detach().float() + residual.float()
    ct = compress(x)
    return ct, x - decompress(ct, device=x.device)


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

    def compress(self, name: str, delta: torch.Tensor) -> CompressedTensor:
        ct, self.residuals[name] = compress_with_feedback(delta, self.residuals.get(name))
        return ct

    def state_dict(self) -> dict:
        return {"residuals": {k: v.clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}


# ---------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSchema:
    """Ordered ``(name, shape)`` list that all workers share (same model)."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]
    row_scales: bool = False
    """One scale per row of 2+-dimensional tensors (module docstring)."""

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
        if self.row_scales:
            text += ";row_scales"
        return hashlib.blake2b(text.encode(), digest_size=8).digest()

    def num_scales(self, shape: Sequence[int]) -> int:
        return num_row_scales(shape) if self.row_scales else 1

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for _, s in self.entries)

    def wire_bytes(self) -> int:
        """Payload bytes of one message: sign bytes + 4 B per scale + 8 B tokens."""
        return sum(packed_size(math.prod(s)) + _SCALE.size * self.num_scales(s)
                   for _, s in self.entries) + 8

    def encoded_bytes(self) -> int:
        """Exact length of an encoded message for this schema."""
        return self.wire_bytes() + FRAMING_BYTES

    def compression_ratio(self) -> float:
        """fp32 bytes of the pseudo-gradient / encoded message bytes."""
        return 4 * self.numel / self.encoded_bytes()


@dataclass(frozen=True)
class WorkerMessage:
    """What one worker sends per round.

    Attributes:
        worker: worker index in the cluster.
        round: outer step number (wraps at 2^32).
        num_tokens: tokens the worker trained on this round (``n_i``).
        tensors: name -> compressed pseudo-gradient, in schema order.
    """

    worker: int
    round: int
    num_tokens: int
    tensors: dict[str, CompressedTensor]

    @property
    def wire_bytes(self) -> int:
        """Sign bytes + 4 B per tensor + 8 B token count (the counted traffic)."""
        return sum(ct.wire_bytes for ct in self.tensors.values()) + 8


def compress_message(
    deltas: Mapping[str, torch.Tensor],
    num_tokens: int,
    *,
    worker: int,
    round: int,
    feedback: ErrorFeedback | None = None,
) -> WorkerMessage:
    """Compress every pseudo-gradient of a worker (with error feedback if given)."""
    if feedback is None:
        tensors = {k: compress(v) for k, v in deltas.items()}
    else:
        tensors = {k: feedback.compress(k, v) for k, v in deltas.items()}
    return WorkerMessage(worker=worker, round=round, num_tokens=int(num_tokens), tensors=tensors)


def encode_message(msg: WorkerMessage, schema: TensorSchema) -> bytes:
    """Serialize ``msg`` (tensors in ``schema`` order) to bytes.

    Raises:
        ValueError: ``msg`` does not have exactly the schema's tensors and shapes.
    """
    names = [k for k, _ in schema.entries]
    if set(msg.tensors) != set(names):
        missing = sorted(set(names) - set(msg.tensors))
        extra = sorted(set(msg.tensors) - set(names))
        raise ValueError(
            f"message tensors differ from the schema: missing {missing[:5]}, extra {extra[:5]}"
        )
    parts = [
        _HEADER.pack(
            MAGIC,
            VERSION,
            FLAG_ROW_SCALES if schema.row_scales else 0,
            msg.worker,
            msg.round % 2**32,
            msg.num_tokens,
            schema.digest,
            len(names),
        )
    ]
    for name, shape in schema.entries:
        ct = msg.tensors[name]
        if tuple(ct.shape) != shape:
            raise ValueError(f"tensor '{name}' has shape {tuple(ct.shape)}, schema says {shape}")
        n = schema.num_scales(shape)
        if ct.num_scales != n or (schema.row_scales and len(shape) >= 2) != isinstance(
            ct.scale, torch.Tensor
        ):
            raise ValueError(f"tensor '{name}' has {ct.num_scales} scale(s), the schema needs {n}")
        if isinstance(ct.scale, torch.Tensor):
            parts.append(ct.scale.detach().cpu().numpy().astype("<f4", copy=False).tobytes())
        else:
            parts.append(_SCALE.pack(ct.scale))
        parts.append(ct.packed.detach().cpu().numpy().tobytes())
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def decode_message(data: bytes | bytearray | memoryview, schema: TensorSchema) -> WorkerMessage:
    """Parse a peer's message; inverse of :func:`encode_message`.

    Raises:
        MessageError: truncated or overlong data, bad magic, unknown version,
            different model (schema digest / tensor count), checksum mismatch,
            or a negative/non-finite scale.  The message says which.
    """
    buf = bytearray(data)  # writable copy: torch.frombuffer shares it below
    n = len(buf)
    if n < HEADER_BYTES + _CRC.size:
        raise MessageError(
            f"GeoMesh message truncated: {n} bytes, the header alone needs {HEADER_BYTES + _CRC.size}"
        )
    magic, version, _flags, worker, rnd, tokens, digest, count = _HEADER.unpack_from(buf, 0)
    who = f"message from worker {worker} (round {rnd})"
    if magic != MAGIC:
        raise MessageError(
            f"not a GeoMesh message (magic {bytes(magic)!r}, expected {MAGIC!r}); "
            "is another program talking on this port?"
        )
    if version != VERSION:
        raise MessageError(
            f"{who} has wire version {version}, this build reads {VERSION}; "
            "run the same GeoMesh version on all workers"
        )
    if digest != schema.digest or count != len(schema.entries):
        raise MessageError(
            f"{who} is for a different model ({count} tensors, schema digest "
            f"{digest.hex()}; here {len(schema.entries)} tensors, {schema.digest.hex()}); "
            "all workers must build the same model"
        )
    expected = schema.encoded_bytes()
    if n != expected:
        kind = "truncated" if n < expected else "overlong"
        raise MessageError(f"{who} {kind}: {n} bytes, the schema needs {expected}")
    (crc,) = _CRC.unpack_from(buf, n - _CRC.size)
    if crc != zlib.crc32(memoryview(buf)[: n - _CRC.size]):
        raise MessageError(f"{who}: CRC-32 mismatch, corrupted in transit")
    off = HEADER_BYTES
    tensors: dict[str, CompressedTensor] = {}
    for name, shape in schema.entries:
        if schema.row_scales and len(shape) >= 2:
            rows = int(shape[0])
            scale = (torch.frombuffer(buf, dtype=torch.float32, count=rows, offset=off).clone()  # host
                     if rows else torch.zeros(0))  # host: decoded wire bytes
            off += _SCALE.size * rows
            bad = not bool((torch.isfinite(scale) & (scale >= 0)).all()) if rows else False
            if bad:
                raise MessageError(f"{who}: tensor '{name}' has a negative or non-finite row scale")
        else:
            (scale,) = _SCALE.unpack_from(buf, off)
            off += _SCALE.size
            if not (math.isfinite(scale) and scale >= 0):
                raise MessageError(
                    f"{who}: tensor '{name}' has scale {scale}; must be finite and >= 0"
                )
        nb = packed_size(math.prod(shape))
        packed = (
            torch.frombuffer(buf, dtype=torch.uint8, count=nb, offset=off)  # host: wire bytes
            if nb
            else torch.empty(0, dtype=torch.uint8)  # host
        )
        off += nb
        tensors[name] = CompressedTensor(packed=packed, scale=scale, shape=torch.Size(shape))
    return WorkerMessage(worker=worker, round=rnd, num_tokens=tokens, tensors=tensors)
