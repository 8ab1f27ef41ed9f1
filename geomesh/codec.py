"""Pseudo-gradient codecs: what a worker puts on the wire each round.

:class:`SignCodec` (GeoMesh) sends one sign bit per element and one fp32
scale per tensor (:mod:`geomesh.compression`), with optional error feedback;
:class:`DenseCodec` (DiLoCo, async baseline) sends the fp32 pseudo-gradient.
Both decode a round's messages straight into the token-weighted aggregate
``Δ = Σ (n_i/N) · D(msg_i)`` (:mod:`geomesh.outer`, eq. 1).

Layout independence.  A worker may be tensor-parallel: each TP rank holds a
shard of every TP-split tensor and exchanges that shard with the same TP rank
of the other workers.  The sign of an element does not depend on the layout,
but the scale ``m = mean |x|`` of a split tensor does if taken per shard.  The
sign codec therefore takes it over the *whole* tensor: every TP rank sums
``|x|`` over its shard (fp64), the sums of split tensors are all-reduced over
the worker's TP group (one small vector per round), and ``m = Σ|x| / numel``.
With row scales, a row split across ranks (a row-parallel weight, split
along columns) is reduced the same way; rows kept whole on one rank
(column-parallel weights, the vocabulary-parallel embedding) need nothing.
Replicated tensors (layer norms, row-parallel biases) use their local sums.
With this, a TP=2 worker computes bit for bit the message halves a TP=1
worker would send, and GeoMesh's math is the same in every layout.

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
import torch.distributed as dist

from .compression import (
    CompressedTensor,
    ErrorFeedback,
    MessageError,
    TensorSchema,
    WorkerMessage,
    decode_message,
    encode_message,
    pack_signs,
    scale_signs,
    unpack_signs,
)
from .guard import dense_norm, dense_peaks, message_norm, message_peaks
from .outer import aggregate, aggregate_messages

_DENSE_HEADER = struct.Struct("<4sHHIIQ8sI")
_DENSE_MAGIC = b"GMDN"
_CRC = struct.Struct("<I")


class Codec:
    """Interface: ``encode`` one worker's pseudo-gradients, ``aggregate`` a round.

    Attributes:
        schema: this rank's ``(name, shape)`` list (its shard of the model).
        kind: ``"sign"`` or ``"fp32"``.
    """

    kind = "codec"

    def __init__(self, schema: TensorSchema) -> None:
        self.schema = schema

    def encode(
        self,
        deltas: Mapping[str, torch.Tensor],
        num_tokens: int,
        *,
        worker: int,
        round: int,
        feedback: ErrorFeedback | None = None,
    ) -> bytes:
        raise NotImplementedError

    def aggregate(self, messages: Sequence[bytes | None], *, guard=None,
                  senders: Sequence[int] | None = None, round: int | None = None
                  ) -> tuple[dict[str, torch.Tensor] | None, list[int]]:
        """Decode all workers' messages (worker order); return ``(Δ, n_i list)``.

        Identity comes from where a message arrived, never from its header:
        ``senders[j]`` is the worker whose slot of the exchange message ``j``
        came in (default with a ``guard``: its position, the order the
        transport and the envelope, :mod:`geomesh.envelope`, authenticate; with
        neither, a worker decoding its own messages, nothing is checked), and ``round`` the
        round the exchange was sealed for (``None``: not checked).  A header
        naming another worker or round is a forgery: a ``MessageError``, or
        with a ``guard`` that slot's worker dropped (reason ``identity``).  The
        guard keys its token, norm and history checks on ``senders``.

        ``None`` entries (lost workers) and messages the ``guard``
        (:class:`geomesh.guard.Guard`) rejects count 0 tokens; ``Δ`` is
        ``None`` when no message is left.
        """
        raise NotImplementedError

    @classmethod
    def encoded_bytes(cls, schema: TensorSchema) -> int:
        """Exact bytes of one encoded message for ``schema`` (e.g. the target model's)."""
        raise NotImplementedError

    @classmethod
    def compression_ratio(cls, schema: TensorSchema) -> float:
        """fp32 bytes of the pseudo-gradient / bytes of its encoded message."""
        return 4 * schema.numel / cls.encoded_bytes(schema)


class SignCodec(Codec):
    """GeoMesh: ``m · sign(Δ + e)``, scales over whole (unsharded) tensors or rows.

    Args:
        schema: this rank's tensors; ``schema.row_scales`` selects one scale per
            row of 2+-dimensional tensors (:mod:`geomesh.compression`).
        tp_group: the worker's TP group (``None`` or size 1: no reduction).
        tp_partition: ``{name: dim}`` of tensors split across ``tp_group``.
    """

    kind = "sign"

    def __init__(
        self,
        schema: TensorSchema,
        *,
        tp_group: dist.ProcessGroup | None = None,
        tp_partition: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(schema)
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_partition = dict(tp_partition or {})

    def _reduced(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the L1 sums of ``name`` need the other TP ranks' parts: the
        tensor is split and a scale's elements (whole tensor, or a row when
        splitting along columns) are spread over the ranks."""
        if self.tp_size == 1 or name not in self.tp_partition:
            return False
        return not (self.schema.row_scales and len(shape) >= 2 and self.tp_partition[name] == 0)

    def encode(self, deltas, num_tokens, *, worker, round, feedback=None) -> bytes:
        xs, sums, counts, reduce = [], [], [], []
        # The L1 sums, their counts and the TP mask live where the pseudo-gradients
        # are (the accelerator): one device for the division and the all-reduce.
        device = next((d.device for d in deltas.values()), torch.device("cpu"))
        for name, shape in self.schema.entries:
            x = deltas[name].detach().float()
            if feedback is not None:
                x = feedback.add(name, x)
            n = self.schema.num_scales(shape)
            rows = x.reshape(n, -1) if x.numel() else x.reshape(n, 0)
            xs.append(x)
            sums.append(rows.abs().sum(dim=1, dtype=torch.float64).to(device))  # [n] L1 per scale
            per = rows.shape[1]
            red = self._reduced(name, shape)
            counts.append(torch.full((n,), float(per * (self.tp_size if red else 1)),
                                     dtype=torch.float64, device=device))
            reduce.append(torch.full((n,), red, dtype=torch.bool, device=device))
        l1 = torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
        mask = torch.cat(reduce) if reduce else torch.zeros(0, dtype=torch.bool, device=device)
        counts = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.float64, device=device)
        scales = mean_abs_scales(l1, counts, worker=worker, group=self.tp_group, reduce=mask)
        tensors, off = {}, 0
        for (name, shape), x in zip(self.schema.entries, xs):
            n = self.schema.num_scales(shape)
            scale = scales[off:off + n].clone() if self.schema.row_scales and len(shape) >= 2 \
                else float(scales[off])
            off += n
            packed, _ = pack_signs(x)
            tensors[name] = CompressedTensor(packed=packed, scale=scale, shape=torch.Size(x.shape))
            if feedback is not None:  # e ← x − m·sign(x), kept locally (EF-signSGD)
                feedback.keep(name, x - scale_signs(unpack_signs(packed, x.shape), scale))
        msg = WorkerMessage(worker=worker, round=round, num_tokens=int(num_tokens), tensors=tensors)
        return encode_message(msg, self.schema)

    def aggregate(self, messages, *, guard=None, senders=None, round=None):
        pos, decoded, who = _decoded(messages, lambda m: decode_message(m, self.schema), guard,
                                     senders=senders, round=round)
        keep = guard.screen(who, [m.num_tokens for m in decoded],
                            [message_norm(m) for m in decoded],
                            [message_peaks(m) for m in decoded]) if guard is not None \
            else range(len(decoded))
        kept = [decoded[j] for j in keep]
        tokens = [0] * len(messages)  # positional, like messages
        for j in keep:
            tokens[pos[j]] = decoded[j].num_tokens
        if not kept:
            return None, tokens
        if guard is not None and guard.robust != "none":
            return guard.robust_sign(kept, [m.num_tokens / sum(tokens) for m in kept]), tokens
        return aggregate_messages(kept), tokens

    @classmethod
    def encoded_bytes(cls, schema: TensorSchema) -> int:
        return schema.encoded_bytes()


class DenseCodec(Codec):
    """DiLoCo: the fp32 pseudo-gradient itself (format in the module docstring)."""

    kind = "fp32"

    def encode(self, deltas, num_tokens, *, worker, round, feedback=None) -> bytes:
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

    def aggregate(self, messages, *, guard=None, senders=None, round=None):
        return aggregate_decoded(messages, self._decode, guard, senders=senders, round=round)

    @classmethod
    def encoded_bytes(cls, schema: TensorSchema) -> int:
        return _DENSE_HEADER.size + 4 * schema.numel + _CRC.size


def mean_abs_scales(l1: torch.Tensor, counts: torch.Tensor, *, worker: int,
                    group: dist.ProcessGroup | None = None,
                    reduce: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 sign-codec scales ``m = Σ|x| / count`` (least squares, :mod:`geomesh.compression`).

    Args:
        l1: fp64 ``[n]`` L1 sums of this rank's part of each scale's elements.
        counts: fp64 ``[n]`` elements per scale over the whole (reduced) scale.
        worker: for the error message.
        group: the worker's TP group; entries selected by ``reduce`` are summed
            over it first (one all-reduce), so a scale covers a whole tensor or
            row split across TP ranks.
        reduce: bool ``[n]``; ``None``: every entry.

    Raises:
        ValueError: a scale is NaN/Inf (a diverged worker).
    """
    if group is not None and (reduce is None or bool(reduce.any())):
        part = l1.clone() if reduce is None else torch.where(reduce, l1, torch.zeros_like(l1))
        dist.all_reduce(part, group=group)
        l1 = part if reduce is None else torch.where(reduce, part, l1)
    scales = (l1 / counts.clamp(min=1)).float()  # fp32 on the wire
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"pseudo-gradient of worker {worker} has NaN/Inf; the worker "
                         "diverged (lower the inner learning rate)")
    return scales


def aggregate_decoded(messages: Sequence[bytes | None], decode, guard=None, *,
                      senders: Sequence[int] | None = None, round: int | None = None,
                      agree=None, measure=None, signs: bool = False
                      ) -> tuple[dict[str, torch.Tensor] | None, list[int]]:
    """Aggregate of codecs whose messages decode to dense tensors (fp32, top-k).

    ``decode(message) -> (Δ_i, n_i, header worker, header round)``; identities
    are checked as in :meth:`Codec.aggregate`, the decoded values screened with
    ``guard`` (:meth:`geomesh.guard.Guard.screen`, keyed on ``senders``),
    then averaged by tokens (equation 1) or by the guard's robust mode.  Returns
    ``(Δ, n_i per message position)``: ``None`` entries and rejected messages
    count 0 tokens; ``Δ`` is ``None`` when no message is left.

    Hooks for a worker whose ranks each decode their own shard
    (:class:`geomesh.canonical_codec.CanonicalCodec`): ``agree(positions)`` returns
    the positions every rank decoded (the others are dropped as malformed),
    ``measure(deltas)`` the ``(norms, peaks)`` of the whole pseudo-gradients
    (default: :func:`geomesh.guard.dense_norm` / ``dense_peaks`` of the local
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


def header_identity(decoded) -> tuple[int, int]:
    """``(worker, round)`` a decoded message's codec header claims (any codec's decoder)."""
    if isinstance(decoded, WorkerMessage):
        return decoded.worker, decoded.round
    if isinstance(decoded, tuple) and len(decoded) == 4:  # fp32 / top-k: (Δ, n, worker, round)
        return decoded[2], decoded[3]
    return header_identity(decoded[-1])  # predictive: (γ, sign message)


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
            elif worker != k or (round is not None and rnd != round % 2**32):
                raise _Forged(f"message in worker {k}'s slot claims worker {worker}, round "
                              f"{rnd} in its codec header; the exchange says worker {k}"
                              + (f", round {round}" if round is not None else "")
                              + " (a forged identity)")
        except MessageError as e:
            if guard is None:
                raise
            guard.drop(k, "identity" if isinstance(e, _Forged) else "malformed", str(e))
            continue
        pos.append(i)
        out.append(d)
        who.append(k)
    return pos, out, who


class _Forged(MessageError):
    """A codec header whose worker or round differs from the authenticated slot."""


def build_codec(kind: str, schema: TensorSchema, **kwargs) -> Codec:
    """``"sign"`` → :class:`SignCodec`, ``"fp32"`` → :class:`DenseCodec`."""
    if kind == "sign":
        return SignCodec(schema, **kwargs)
    return DenseCodec(schema)
