"""Top-k sparsification of pseudo-gradients: top-k per chunk, one sign bit per kept value.

In the spirit of SparseLoCo (Sarfi et al. 2025, "SparseLoCo: communication-
efficient LLM training": top-k of the error-feedback-corrected pseudo-gradient
per chunk, low-bit values) and Deep Gradient Compression (Lin et al. 2018):
each row of a matrix (``shape[0]`` rows) is cut into chunks of ``chunk``
consecutive elements (the last one zero-padded); in every chunk the ``k``
largest ``|x|`` are kept and sent as their position (one byte, so ``chunk ≤
256``) and sign (one bit); the row sends one fp32 scale, ``m = mean |x_j|``
over its kept elements (the least-squares magnitude for that support and
those signs), or two with ``bits = 2``.  The receiver decodes ``m · sign`` at
the kept positions and zero elsewhere.  Vectors (biases, norms: ~0.3 % of a
GPT's parameters) go as fp32.  Used with error feedback
(``geomesh.error_feedback``), the unsent ``x − D(C(x))`` waits in the
residual; SparseLoCo's finding is that this is what keeps the loss
(:mod:`geomesh.feedback` for where the residual sits).

Bytes per matrix row of ``L`` elements: ``4·bits + ceil(L/chunk) · (k + bits·ceil(k/8))``;
with ``chunk = 256, k = 8, bits = 1`` that is 0.30 bits per element on GPT-3
1.3B's 2048-wide rows, ~108x less than fp32.

This module is the math; the wire format, with chunks cut at global columns
so that a row split across TP ranks keeps its chunks, is the ``topk`` kind of
:class:`geomesh.canonical_codec.CanonicalCodec`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from .compression import MessageError


def chunk_layout(shape: Sequence[int], chunk: int) -> tuple[int, int] | None:
    """``(rows, chunks per row)`` of a matrix, ``None`` for a vector (sent as fp32)."""
    if len(shape) < 2:
        return None
    rows = int(shape[0])
    cols = math.prod(shape) // rows if rows else 0
    return rows, -(-cols // chunk)


class TopKCodec:
    """Top-``k`` of every ``chunk`` elements of each row; sign (+ level) bits; scales per row.

    Args:
        chunk: elements per chunk (2 .. 256: a position is one byte).
        k: kept elements per chunk (``1 .. chunk``).
        bits: bits per kept value: 1 (sign; one scale per row) or 2 (sign and
            a level bit: the larger half of a row's kept magnitudes gets the
            row's ``m_hi``, the rest ``m_lo``, each the mean of its half).

    Raises:
        ValueError: a setting outside those ranges.
    """

    def __init__(self, *, chunk: int = 256, k: int = 8, bits: int = 2) -> None:
        if not (2 <= chunk <= 256 and 1 <= k <= chunk and bits in (1, 2)):
            raise ValueError(f"TopKCodec: need 2 <= chunk <= 256, 1 <= k <= chunk, bits 1 or 2; "
                             f"got chunk={chunk}, k={k}, bits={bits}")
        self.chunk, self.k, self.bits = chunk, k, bits

    def pick(self, x: torch.Tensor, rows: int, nch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions (sorted) and values of the top-``k`` ``|x|`` of each chunk: ``[rows, nch, k]``
        each; ``x`` is ``rows`` rows of ``nch`` chunks (the last one zero-padded)."""
        c, k = self.chunk, self.k
        if rows * nch == 0:  # an empty tensor: nothing kept
            z = torch.zeros(rows, nch, k, dtype=torch.long, device=x.device)
            return z, z.float()
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
        if mag.numel() == 0:  # an empty tensor: zero scales
            return torch.zeros_like(mag, dtype=torch.bool), mag.new_zeros(self.bits, mag.shape[0])
        if self.bits == 1:
            return torch.zeros_like(mag, dtype=torch.bool), mag.mean(dim=1, keepdim=True).T.float()
        # split each row's kept magnitudes at their median: least squares per half
        hi = mag > mag.median(dim=1, keepdim=True).values
        n_hi = hi.sum(dim=1).clamp(min=1)
        n_lo = (~hi).sum(dim=1).clamp(min=1)
        m_hi = torch.where(hi, mag, 0.0).sum(dim=1) / n_hi
        m_lo = torch.where(hi, 0.0, mag).sum(dim=1) / n_lo
        return hi, torch.stack([m_lo, m_hi]).float()

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
