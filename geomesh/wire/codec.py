"""The fp32 codec of the async baseline, and the aggregate every codec shares.

The running exchange (:mod:`geomesh.sync`) sends every method's messages with
:class:`geomesh.wire.canonical_codec.CanonicalCodec`, which addresses canonical
(unsharded) tensors.  This module keeps what it shares with the one baseline
that sends messages outside that exchange (:func:`geomesh.baselines.run_async`,
one process holding the whole model):

- :class:`DenseCodec`: the fp32 pseudo-gradient of one process's tensors;
- :func:`aggregate_decoded`: decode a round's messages, check identities,
  screen them with the guard, and form the token-weighted aggregate
  ``Δ = Σ (n_i/N) · D(msg_i)`` (:mod:`geomesh.outer`, eq. 1) or the guard's
  robust one;
- :func:`mean_abs_scales`: the sign codecs' least-squares scales.

Dense wire format (little-endian), one message per worker per round::

    header  36 B  magic "GMDN" | version u16 | flags u16 | worker u32 | round u32
                  | num_tokens u64 | schema digest 8 B | num_tensors u32
    body          per tensor, in schema order: numel fp32 values
    trailer  4 B  CRC-32 of header + body
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from ..outer import aggregate
from .compression import (
    MessageError,
    TensorSchema,
)
from .guard import dense_norm, dense_peaks

_DENSE_HEADER = struct.Struct("<4sHHIIQ8sI")
_DENSE_MAGIC = b"GMDN"
_CRC = struct.Struct("<I")


class DenseCodec:
    """The fp32 pseudo-gradient of one process's tensors (format in the module docstring).

    Args:
        schema: the ``(name, shape)`` list of the tensors sent (its digest is in
            every message).
    """

    kind = "fp32"

    def __init__(self, schema: TensorSchema) -> None:
        self.schema = schema

    def encode(self, deltas: Mapping[str, torch.Tensor], num_tokens: int, *, worker: int,
               round: int) -> bytes:
        """One message: header, ``deltas`` in schema order as fp32, CRC-32.

        Raises:
            ValueError: a tensor of another shape, or NaN/Inf values.
        """
        parts = [
            _DENSE_HEADER.pack(
                _DENSE_MAGIC, 1, 0, worker, round % 2**32, int(num_tokens), self.schema.digest,
                len(self.schema.entries),
            )
        ]
        for name, shape in self.schema.entries:
            t = deltas[name].detach().float().contiguous()
            if tuple(t.shape) != shape:
                raise ValueError(f"tensor '{name}' has shape {tuple(t.shape)}, schema says {shape}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"pseudo-gradient '{name}' of worker {worker} has NaN/Inf")
            parts.append(t.cpu().numpy().astype("<f4", copy=False).tobytes())
        body = b"".join(parts)
        return body + _CRC.pack(zlib.crc32(body))

    def _decode(self, data: bytes) -> tuple[dict[str, torch.Tensor], int, int]:
        buf = bytearray(data)
        if len(buf) != self.encoded_bytes(self.schema):
            raise MessageError(
                f"fp32 message has {len(buf)} bytes, the schema needs {self.encoded_bytes(self.schema)}"
            )
        magic, version, flags, worker, rnd, tokens, digest, count = _DENSE_HEADER.unpack_from(buf, 0)
        if magic != _DENSE_MAGIC or digest != self.schema.digest:
            raise MessageError(f"fp32 message from worker {worker} is for another model or format")
        if version != 1 or flags != 0 or count != len(self.schema.entries):
            raise MessageError(f"fp32 message from worker {worker} has wire version {version}, "
                               f"flags {flags}, {count} tensors; this build reads version 1, "
                               f"flags 0, {len(self.schema.entries)} tensors")
        (crc,) = _CRC.unpack_from(buf, len(buf) - _CRC.size)
        if crc != zlib.crc32(memoryview(buf)[: len(buf) - _CRC.size]):
            raise MessageError(f"fp32 message from worker {worker}: CRC-32 mismatch")
        off, out = _DENSE_HEADER.size, {}
        for name, shape in self.schema.entries:
            n = int(np.prod(shape)) if shape else 1
            out[name] = (torch.frombuffer(buf, dtype=torch.float32, count=n, offset=off)  # host
                         if n else torch.zeros(0)).reshape(shape)  # host: decoded wire bytes
            if not bool(torch.isfinite(out[name]).all()):  # an honest encoder refuses them
                raise MessageError(f"fp32 message from worker {worker}: tensor '{name}' has "
                                   "NaN/Inf values")
            off += 4 * n
        return out, tokens, worker, rnd

    def aggregate(self, messages: Sequence[bytes | None], *, guard=None,
                  senders: Sequence[int] | None = None, round: int | None = None
                  ) -> tuple[dict[str, torch.Tensor] | None, list[int]]:
        """Token-weighted ``Δ = Σ (n_i/N) Δ_i`` of the messages (worker order) and the
        ``n_i`` per position: :func:`aggregate_decoded` (identities, guard)."""
        return aggregate_decoded(messages, self._decode, guard, senders=senders, round=round)

    @classmethod
    def encoded_bytes(cls, schema: TensorSchema) -> int:
        """Exact bytes of one encoded message for ``schema`` (e.g. the target model's)."""
        return _DENSE_HEADER.size + 4 * schema.numel + _CRC.size


def mean_abs_scales(l1: torch.Tensor, counts: torch.Tensor, *, worker: int) -> torch.Tensor:
    """fp32 sign-codec scales ``m = Σ|x| / count`` (least squares, :mod:`geomesh.wire.compression`).

    Args:
        l1: fp64 ``[n]`` L1 sums of each scale's elements (already summed over the
            worker's TP group where a scale's elements are split).
        counts: fp64 ``[n]`` elements per scale.
        worker: for the error message.

    Raises:
        ValueError: a scale is NaN/Inf (a diverged worker).
    """
    scales = (l1 / counts.clamp(min=1)).float()  # fp32 on the wire
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"pseudo-gradient of worker {worker} has NaN/Inf; the worker "
                         "diverged (lower the inner learning rate)")
    return scales


def aggregate_decoded(messages: Sequence[bytes | None], decode, guard=None, *,
                      senders: Sequence[int] | None = None, round: int | None = None,
                      agree=None, measure=None, signs: bool = False
                      ) -> tuple[dict[str, torch.Tensor] | None, list[int]]:
    """Aggregate of codecs whose messages decode to dense tensors.

    ``decode(message) -> (Δ_i, n_i, header worker, header round)``.  Identity
    comes from where a message arrived, never from its header: ``senders[j]``
    is the worker whose slot of the exchange message ``j`` came in (default
    with a ``guard``: its position, the order the transport and the envelope,
    :mod:`geomesh.wire.envelope`, authenticate; with neither, a worker decoding its
    own messages, nothing is checked), and ``round`` the round the exchange
    was sealed for (``None``: not checked).  A header naming another worker is a
    forgery, one of the slot's worker but another round a replay
    (:class:`OtherRoundError`): a ``MessageError``, or with a ``guard`` that slot's
    worker dropped (reason ``identity`` or ``round``).  The decoded values are
    screened with ``guard`` (:meth:`geomesh.wire.guard.Guard.screen`, keyed on ``senders``),
    then averaged by tokens (equation 1) or by the guard's robust mode.  Returns
    ``(Δ, n_i per message position)``: ``None`` entries and rejected messages
    count 0 tokens; ``Δ`` is ``None`` when no message is left.

    Hooks for a worker whose ranks each decode their own shard
    (:class:`geomesh.wire.canonical_codec.CanonicalCodec`): ``agree(positions)`` returns
    the positions every rank decoded (the others are dropped as malformed),
    ``measure(deltas)`` the ``(norms, peaks)`` of the whole pseudo-gradients
    (default: :func:`geomesh.wire.guard.dense_norm` / ``dense_peaks`` of the local
    tensors); ``signs``: the values are decoded signs (``sign_majority`` votes).
    """
    pos, decoded, workers = _decoded(messages, decode, guard, senders=senders, round=round)
    if agree is not None:
        ok = set(agree(pos))
        for j in [j for j in range(len(pos)) if pos[j] not in ok]:
            if guard is None:
                raise MessageError(f"message {pos[j]} does not decode on every shard of this worker")
            guard.drop(workers[j], "malformed", "a part of its message does not decode on "
                                                "another shard of this worker")
        keep = [j for j in range(len(pos)) if pos[j] in ok]
        pos, decoded, workers = ([x[j] for j in keep] for x in (pos, decoded, workers))
    deltas, counts = [d[0] for d in decoded], [d[1] for d in decoded]
    if guard is not None:
        norms, peaks = measure(deltas) if measure is not None else \
            ([dense_norm(d) for d in deltas], [dense_peaks(d) for d in deltas])
        keep = guard.screen(workers, counts, norms, peaks)
    else:
        keep = range(len(decoded))
    tokens = [0] * len(messages)  # positional, like messages
    for j in keep:
        tokens[pos[j]] = counts[j]
    if not keep:
        return None, tokens
    deltas, counts = [deltas[j] for j in keep], [counts[j] for j in keep]
    if guard is not None and guard.robust != "none":
        return guard.robust_dense(deltas, counts, signs=signs), tokens
    return aggregate(deltas, counts), tokens


def header_identity(decoded: tuple) -> tuple[int, int]:
    """``(worker, round)`` a decoded message's codec header claims: ``decode``'s
    ``(Δ, n, worker, round)``."""
    return decoded[2], decoded[3]


def _decoded(messages, decode, guard, *, senders=None, round=None
             ) -> tuple[list[int], list, list[int]]:
    """Decode the messages present; return ``(positions, decoded, senders)`` of those kept.

    The worker is ``senders[j]`` (default ``j``), the slot the message arrived
    in; a header that names another worker, or another round than ``round``,
    is a ``MessageError``.  Without ``senders`` and ``guard`` (a worker decoding
    its own message) the header's id is reported and nothing is checked.  With a ``guard`` a malformed or forged message drops
    the worker of its slot (never the one its header names) instead of
    stopping the round."""
    check = senders is not None or guard is not None  # unguarded local decoding: no slots
    senders = list(range(len(messages))) if senders is None else list(senders)
    if len(senders) != len(messages):
        raise ValueError(f"{len(messages)} messages for {len(senders)} senders")
    pos, out, who = [], [], []
    for i, m in enumerate(messages):
        if m is None:
            continue
        k = senders[i]
        try:
            d = decode(m)
            worker, rnd = header_identity(d)
            if not check:
                k = worker
            elif worker == k and round is not None and rnd != round % 2**32:
                raise OtherRoundError(f"message in worker {k}'s slot is of round {rnd} in its "
                                      f"codec header; the exchange is in round {round} (a "
                                      "replay, or a peer started from another round's "
                                      "checkpoint)")
            elif worker != k:
                raise _Forged(f"message in worker {k}'s slot claims worker {worker}, round "
                              f"{rnd} in its codec header; the exchange says worker {k}"
                              + (f", round {round}" if round is not None else "")
                              + " (a forged identity)")
        except MessageError as e:
            if guard is None:
                raise
            guard.drop(k, "round" if isinstance(e, OtherRoundError) else
                       "identity" if isinstance(e, _Forged) else "malformed", str(e))
            continue
        pos.append(i)
        out.append(d)
        who.append(k)
    return pos, out, who


class _Forged(MessageError):
    """A codec header whose worker or round differs from the authenticated slot."""


class OtherRoundError(_Forged):
    """A codec header of its slot's own worker but of another round than the exchange's:
    a replayed message, or a peer that started from a checkpoint of another outer step
    (the guard's reason ``round``; :meth:`geomesh.sync.OuterLoop.aggregate` stops the job
    where it happens in the job's first round)."""
