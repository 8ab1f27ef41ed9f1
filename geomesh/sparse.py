"""Sparse pseudo-gradient codec: top-k per chunk, one sign bit per kept value.

In the spirit of SparseLoCo (Sarfi et al. 2025, "SparseLoCo: communication-
efficient LLM training": top-k of the error-feedback-corrected pseudo-gradient
per chunk, low-bit values) and Deep Gradient Compression (Lin et al. 2018):
each row of a matrix (``shape[0]`` rows) is cut into chunks of ``chunk``
consecutive elements (the last one zero-padded); in every chunk the ``k``
largest ``|x|`` are kept and sent as their position (one byte, so ``chunk ≤
256``) and sign (one bit); the row sends one fp32 scale, ``m = mean |x_j|``
over its kept elements (the least-squares magnitude for that support and
those signs).  The receiver decodes ``m · sign`` at the kept positions and
zero elsewhere.  Vectors (biases, norms: ~0.3 % of a GPT's parameters) go as
fp32.  Used with error feedback (``geomesh.error_feedback``), the unsent
``x − D(C(x))`` waits in the residual; SparseLoCo's finding is that this is
what keeps the loss (:mod:`geomesh.feedback` for where the residual sits).

Bytes per matrix row of ``L`` elements: ``4 + ceil(L/chunk) · (k + ceil(k/8))``;
with ``chunk = 256, k = 8`` that is 0.30 bits per element on GPT-3 1.3B's
2048-wide rows, ~108x less than fp32 (a scale per row: 79x on 256-wide rows).

Layout.  Chunks are cut along a row on one rank; a tensor split across TP
ranks along its rows' length would need a cross-rank top-k: real mode allows
this codec only without TP (:func:`geomesh.context.build_context`).

Wire format (little-endian), one message per worker per round::

    header  36 B  magic "GMTK" | version u16 | flags u16 (chunk - 1 | k << 8) | worker u32
                  | round u32 | num_tokens u64 | schema digest 8 B | num_tensors u32
    body          per tensor, in schema order: matrices: rows x f32 scales, then
                  per row and chunk k u8 positions and ceil(k/8) sign bytes;
                  vectors: numel f32 values
    trailer  4 B  CRC-32 of header + body
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from .codec import Codec, aggregate_decoded
from .compression import ErrorFeedback, MessageError, TensorSchema

_HEADER = struct.Struct("<4sHHIIQ8sI")
_MAGIC = b"GMTK"
_CRC = struct.Struct("<I")


def chunk_layout(shape: Sequence[int], chunk: int) -> tuple[int, int] | None:
    """``(rows, chunks per row)`` of a matrix, ``None`` for a vector (sent as fp32)."""
    if len(shape) < 2:
        return None
    rows = int(shape[0])
    cols = math.prod(shape) // rows if rows else 0
    return rows, -(-cols // chunk)


class TopKCodec(Codec):
    """Top-``k`` of every ``chunk`` elements of each row; sign (+ level) bits; scales per row.

    Args:
        schema: this rank's tensors.
        chunk: elements per chunk (2 .. 256: a position is one byte).
        k: kept elements per chunk (``1 .. chunk``).
        bits: bits per kept value: 1 (sign; one scale per row) or 2 (sign and
            a level bit: the larger half of a row's kept magnitudes gets the
            row's ``m_hi``, the rest ``m_lo``, each the mean of its half).
    """

    kind = "topk"

    def __init__(self, schema: TensorSchema, *, chunk: int = 256, k: int = 8, bits: int = 2) -> None:
        super().__init__(schema)
        if not (2 <= chunk <= 256 and 1 <= k <= chunk and bits in (1, 2)):
            raise ValueError(f"TopKCodec: need 2 <= chunk <= 256, 1 <= k <= chunk, bits 1 or 2; "
                             f"got chunk={chunk}, k={k}, bits={bits}")
        self.chunk, self.k, self.bits = chunk, k, bits

    @classmethod
    def bytes_for(cls, schema: TensorSchema, chunk: int = 256, k: int = 8, bits: int = 2) -> int:
        """Exact bytes of one encoded message for ``schema``."""
        n = _HEADER.size + _CRC.size
        for _, shape in schema.entries:
            lay = chunk_layout(shape, chunk)
            if lay is None:
                n += 4 * math.prod(shape)
            else:
                rows, nch = lay
                n += 4 * bits * rows + rows * nch * (k + bits * ((k + 7) // 8))
        return n

    def encoded_bytes(self, schema: TensorSchema) -> int:  # type: ignore[override]
        return self.bytes_for(schema, self.chunk, self.k, self.bits)

    def compression_ratio(self, schema: TensorSchema) -> float:  # type: ignore[override]
        return 4 * schema.numel / self.encoded_bytes(schema)

    @property
    def _flags(self) -> int:
        return ((self.chunk - 1) | (self.k - 1) << 8) & 0x7FFF | (self.bits - 1) << 15

    def _select(self, x: torch.Tensor, rows: int, nch: int):
        """Positions ``[rows, nch, k]``, signs, levels (``bits = 2``) and the row
        scales ``[bits, rows]`` of ``x``."""
        k = self.k
        if rows * nch == 0:  # an empty tensor: nothing to send but its (zero) scales
            z = torch.zeros(rows, nch, k, dtype=torch.bool, device=x.device)
            return (torch.zeros(rows, nch, k, dtype=torch.long, device=x.device), z, z,
                    torch.zeros(self.bits, rows, device=x.device))
        pos, vals = self.pick(x, rows, nch)
        level, scales = self.levels(vals.abs().reshape(rows, -1))  # a padded slot counts as 0
        return pos, vals >= 0, level.reshape(vals.shape), scales

    def pick(self, x: torch.Tensor, rows: int, nch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions (sorted) and values of the top-``k`` ``|x|`` of each chunk: ``[rows, nch, k]``
        each; ``x`` is ``rows`` rows of ``nch`` chunks (the last one zero-padded)."""
        c, k = self.chunk, self.k
        flat = x.reshape(rows, -1)
        pad = nch * c - flat.shape[1]
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        blocks = flat.reshape(rows, nch, c)
        _, pos = blocks.abs().topk(k, dim=-1, sorted=False)
        pos, _ = pos.sort(dim=-1)  # deterministic order on the wire
        return pos, blocks.gather(-1, pos)

    def levels(self, mag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Level bits ``[rows, n]`` and fp32 scales ``[bits, rows]`` of each row's kept
        magnitudes ``mag [rows, n]`` (the whole row's, in chunk order)."""
        if self.bits == 1:
            return torch.zeros_like(mag, dtype=torch.bool), mag.mean(dim=1, keepdim=True).T.float()
        # split each row's kept magnitudes at their median: least squares per half
        hi = mag > mag.median(dim=1, keepdim=True).values
        n_hi = hi.sum(dim=1).clamp(min=1)
        n_lo = (~hi).sum(dim=1).clamp(min=1)
        m_hi = torch.where(hi, mag, 0.0).sum(dim=1) / n_hi
        m_lo = torch.where(hi, 0.0, mag).sum(dim=1) / n_lo
        return hi, torch.stack([m_lo, m_hi]).float()

    def encode(self, deltas, num_tokens, *, worker, round, feedback: ErrorFeedback | None = None):
        parts = [_HEADER.pack(_MAGIC, 1, self._flags, worker, round % 2**32, int(num_tokens),
                              self.schema.digest, len(self.schema.entries))]
        for name, shape in self.schema.entries:
            x = deltas[name].detach().float()
            if tuple(x.shape) != shape:
                raise ValueError(f"tensor '{name}' has shape {tuple(x.shape)}, schema says {shape}")
            if feedback is not None:
                x = feedback.add(name, x)
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"pseudo-gradient '{name}' of worker {worker} has NaN/Inf; the "
                                 "worker diverged (lower the inner learning rate)")
            lay = chunk_layout(shape, self.chunk)
            if lay is None:
                parts.append(x.contiguous().cpu().numpy().astype("<f4", copy=False).tobytes())
                sent = x
            else:
                rows, nch = lay
                pos, sign, level, scales = self._select(x, rows, nch)
                parts.append(self.matrix_bytes(pos, sign, level, scales))
                sent = self.dense(pos, sign, level, scales, shape).to(x.device)
            if feedback is not None:  # e ← x − D(C(x)), kept locally
                feedback.keep(name, x - sent)
        data = b"".join(parts)
        return data + _CRC.pack(zlib.crc32(data))

    def matrix_bytes(self, pos: torch.Tensor, sign: torch.Tensor, level: torch.Tensor,
                     scales: torch.Tensor) -> bytes:
        """Wire bytes of one matrix: scales ``[bits, rows]`` f32, then per row and chunk
        ``k`` u8 positions, sign bits and (``bits = 2``) level bits."""
        body = [pos.to(torch.uint8).cpu().numpy(), np.packbits(sign.cpu().numpy(), axis=-1)]
        if self.bits == 2:
            body.append(np.packbits(level.cpu().numpy(), axis=-1))
        return scales.cpu().numpy().astype("<f4").tobytes() + np.concatenate(body, axis=-1).tobytes()

    def matrix_size(self, rows: int, nch: int) -> int:
        """Bytes of :meth:`matrix_bytes` for ``rows`` rows of ``nch`` chunks."""
        return 4 * self.bits * rows + rows * nch * (self.k + self.bits * ((self.k + 7) // 8))

    def read_matrix(self, buf: bytes, off: int, shape: Sequence[int], rows: int, nch: int,
                    who: str) -> torch.Tensor:
        """Decoded matrix of ``shape`` from :meth:`matrix_bytes` at ``buf[off:]`` (host).

        Raises:
            MessageError: a negative or non-finite scale, a position outside its chunk.
        """
        k, kb = self.k, (self.k + 7) // 8
        scales = torch.from_numpy(np.frombuffer(buf, "<f4", self.bits * rows, off)  # host
                                  .astype(np.float32)).reshape(self.bits, rows)
        off += 4 * self.bits * rows
        if not bool((torch.isfinite(scales) & (scales >= 0)).all()):
            raise MessageError(f"{who} has a negative or non-finite scale")
        width = k + self.bits * kb
        body = np.frombuffer(buf, np.uint8, rows * nch * width, off).reshape(rows, nch, width)
        if int(body[..., :k].max(initial=0)) >= self.chunk:
            raise MessageError(f"{who}: position out of chunk")
        pos = torch.from_numpy(body[..., :k].copy())  # host: decoded wire bytes
        sign = torch.from_numpy(  # host
            np.unpackbits(body[..., k:k + kb], axis=-1, count=k).astype(bool))
        level = torch.from_numpy(np.unpackbits(body[..., k + kb:], axis=-1, count=k)  # host
                                 .astype(bool)) if self.bits == 2 else sign & False
        return self.dense(pos, sign, level, scales, shape)

    def dense(self, pos: torch.Tensor, sign: torch.Tensor, level: torch.Tensor,
               scales: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """Decoded tensor: ``±scale`` of the value's level at the kept positions, 0 elsewhere."""
        rows, nch, k = pos.shape
        c = self.chunk
        dev = pos.device  # the encoder's (accelerator) or the decoded message's (host)
        scale = scales[level.long(), torch.arange(rows, device=dev).view(rows, 1, 1)] \
            if self.bits == 2 else scales[0].view(rows, 1, 1)
        vals = torch.where(sign, 1.0, -1.0) * scale
        out = torch.zeros(rows, nch, c, dtype=torch.float32, device=dev)
        out.scatter_(-1, pos.long(), vals)
        cols = math.prod(shape) // rows if rows else 0
        return out.reshape(rows, nch * c)[:, :cols].reshape(tuple(shape))

    def _decode(self, data: bytes) -> tuple[dict[str, torch.Tensor], int, int]:
        buf = bytes(data)
        need = self.encoded_bytes(self.schema)
        if len(buf) != need:
            raise MessageError(f"top-k message has {len(buf)} bytes, the schema needs {need}")
        magic, version, flags, worker, rnd, tokens, digest, count = _HEADER.unpack_from(buf, 0)
        if magic != _MAGIC or digest != self.schema.digest or flags != self._flags:
            raise MessageError(f"top-k message from worker {worker} is for another model, "
                               "format or chunk/k/bits setting")
        if version != 1 or count != len(self.schema.entries):
            raise MessageError(f"top-k message from worker {worker} has wire version {version} "
                               f"and {count} tensors; this build reads version 1 and "
                               f"{len(self.schema.entries)} tensors")
        (crc,) = _CRC.unpack_from(buf, len(buf) - _CRC.size)
        if crc != zlib.crc32(buf[: len(buf) - _CRC.size]):
            raise MessageError(f"top-k message from worker {worker}: CRC-32 mismatch")
        off, out = _HEADER.size, {}
        for name, shape in self.schema.entries:
            lay = chunk_layout(shape, self.chunk)
            if lay is None:
                n = math.prod(shape)
                out[name] = torch.from_numpy(  # host: decoded wire bytes
                    np.frombuffer(buf, "<f4", n, off).astype(np.float32)).reshape(shape)
                if not bool(torch.isfinite(out[name]).all()):  # an honest encoder refuses them
                    raise MessageError(f"top-k message from worker {worker}: tensor '{name}' "
                                       "has NaN/Inf values")
                off += 4 * n
                continue
            rows, nch = lay
            out[name] = self.read_matrix(buf, off, shape, rows, nch,
                                         f"top-k message from worker {worker}: tensor '{name}'")
            off += self.matrix_size(rows, nch)
        return out, tokens, worker, rnd

    def aggregate(self, messages: Sequence[bytes | None], *, guard=None, senders=None,
                  round=None) -> tuple[dict[str, torch.Tensor] | None, list[int]]:
        """Decode the messages (worker order), screen them with ``guard`` like
        :class:`~geomesh.codec.DenseCodec` (decoded values; identities from
        ``senders`` and ``round``, :meth:`Codec.aggregate`), return ``(Δ, n_i
        list)``; ``None`` entries and rejected messages count 0 tokens, ``Δ`` is
        ``None`` when none is left."""
        return aggregate_decoded(messages, self._decode, guard, senders=senders, round=round)
