"""Layout-independent pseudo-gradient messages: canonical keys, global coordinates.

Each process of a worker encodes only its main shards (:mod:`geomesh.wire.canonical`)
as *pieces*: canonical tensor, global box (offsets and lengths), payload.  A
worker's message is the list of its processes' parts.  A receiver at any TP/PP
decodes, for each of its own parameters, only the pieces that overlap its
shard, and checks that they cover it exactly once; the payload of a piece of a
tensor it does not hold (another PP stage's layer, say) is skipped unread.  No
process materialises the full model: a piece it decodes is at most one sender
shard.

Codecs (the math of :mod:`geomesh.wire.codec`, :mod:`geomesh.wire.compression`,
:mod:`geomesh.wire.predict` and :mod:`geomesh.wire.sparse`, reused, not copied):

- ``fp32``: the values of the box (DiLoCo).
- ``sign``: one bit per element (:func:`~geomesh.wire.compression.pack_signs`) and
  one scale ``mean |x|`` per *canonical* tensor.
- ``sign_row``: one scale per *global* row (dim 0 of the global tensor, the
  other dims flattened), for tensors of 2+ dims.  A row split across TP ranks
  (row-parallel weights, split along dim 1) gets its L1 sum summed over the
  worker's TP group (:func:`~geomesh.wire.codec.mean_abs_scales`; one all-reduce
  of a vector of the stage's global rows per round), so a TP=2 worker sends
  the scales a TP=1 worker sends.  A piece carries the scales of its rows: a
  row split over ``t`` TP ranks sends its scale ``t`` times (on GPT-3 1.3B at
  TP=8: 2.75 MB, 1.7 % of the message; at TP=2 0.2 %).
- ``sign_pred``: predictive sign coding (:mod:`geomesh.wire.predict`) on global rows:
  ``γ = ⟨x, v⟩ / ‖v‖²`` per global row (both sums over the TP group), then
  ``sign_row`` of the innovation ``y = Δ + e − γ v``; a piece carries the
  ``γ`` of its rows before the scales; the receiver adds ``γ v`` with its own
  shard of the outer momentum ``v``.
- ``topk``: :mod:`geomesh.wire.sparse`'s top-k on global rows.  Chunks are cut at
  global columns ``0, chunk, 2·chunk, ...``, so a row split along dim 1 across
  TP ranks keeps its chunks whole when ``chunk`` divides the shard width
  (refused otherwise, naming the tensor); positions are within the chunk,
  hence global.  The row's scales (``bits = 2``: the median split of the
  whole row's kept magnitudes) need the whole row's kept magnitudes: they are
  all-gathered over the TP group (``k/chunk`` of the row per rank).

Decoding is bit-identical whatever the sender's and the receiver's layouts:
signs, positions and top-k selections are exact; scales and coefficients are
the fp32 rounding of fp64 sums, which a different summation split changes
only when an fp64 sum lies within a few fp64 ulps of an fp32 rounding
boundary (about 1e-8 per scale).

Wire format of one part (little-endian)::

    header  44 B  magic "GMCN" | version u16 | codec u8 | bits u8 | chunk u16 | k u16
                  (top-k's setting, else 0) | worker u32 | round u32
                  | num_tokens u64 | schema digest 8 B | schema bytes u32 | pieces u32
    schema        zlib of the sender's canonical schema text (``key:d0,d1`` lines),
                  so that a receiver of another model names the first differing tensor
                  (1 kB for GPT-3 1.3B)
    pieces        key index u32 | offsets ndim x u32 | lengths ndim x u32 | payload
                  fp32: numel f32; sign / sign_row: 1 (or box rows) f32 scales, then
                  ceil(numel/8) sign bytes (row-major box); sign_pred: as many f32
                  coefficients γ first; top-k: matrices as
                  :meth:`geomesh.wire.sparse.TopKCodec.matrix_bytes` of the box, vectors fp32
    trailer  4 B  CRC-32 of everything before

A worker's processes each encode one part; DP replicas inside a worker hold
the same values, so only DP rank 0's parts go into the worker's message
(:meth:`geomesh.exchange.deploy.Placement.collect`: an all-gather over the worker's
ranks, then :func:`join_parts`).  Every method and mode of :mod:`geomesh.sync`
exchanges these messages.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..exchange.transport import TransportError, decode_bundle, encode_bundle
from .canonical import CanonicalSchema, Shard, coverage, overlap
from .codec import aggregate_decoded, mean_abs_scales
from .compression import (
    ErrorFeedback,
    MessageError,
    num_row_scales,
    pack_signs,
    packed_size,
    scale_signs,
    unpack_signs,
)
from .guard import peak_ratio
from .predict import fit_coefficients
from .sparse import TopKCodec, chunk_layout

HEADER = struct.Struct("<4sHBBHHIIQ8sII")
_MAGIC = b"GMCN"
_CRC = struct.Struct("<I")
_KINDS = {"fp32": 0, "sign": 1, "sign_row": 2, "topk": 3, "sign_pred": 4}
_ROWS = ("sign_row", "sign_pred")  # one scale per global row of 2+-dim tensors


class CanonicalCodec:
    """Encode this process's shards, decode any layout's message into them.

    Args:
        kind: ``"fp32"``, ``"sign"``, ``"sign_row"``, ``"sign_pred"`` or ``"topk"``.
        layout: ``{local name: Shard}`` (:func:`geomesh.wire.canonical.layout_map`).
        schema: the whole model's canonical schema (:meth:`CanonicalSchema.gather`).
        tp_group: the worker's TP group (scales of split tensors and rows are
            reduced over it); ``None``: no reduction (TP=1).
        mp_group: the worker's model-parallel group (TP x PP,
            ``parallel_state.get_model_parallel_group()``): the guard's statistics
            and the set of decodable messages are agreed over it; ``None``: one rank.
        chunk, k, bits: the top-k setting (:class:`geomesh.wire.sparse.TopKCodec`).

    Raises:
        ValueError: unknown ``kind``, or a shard whose key is not in ``schema``.
    """

    def __init__(self, kind: str, layout: Mapping[str, Shard], schema: CanonicalSchema, *,
                 tp_group: dist.ProcessGroup | None = None,
                 mp_group: dist.ProcessGroup | None = None, chunk: int = 256, k: int = 8,
                 bits: int = 2) -> None:
        if kind not in _KINDS:
            raise ValueError(f"canonical codec '{kind}' unknown; have {sorted(_KINDS)}")
        self.topk = TopKCodec(chunk=chunk, k=k, bits=bits) if kind == "topk" else None
        self._params = (bits, chunk, k) if self.topk is not None else (0, 0, 0)
        self.kind, self.layout, self.schema, self.tp_group = kind, dict(layout), schema, tp_group
        self.mp_group = mp_group
        self._index, shapes = schema.index(), dict(schema.entries)
        for name, s in self.layout.items():
            if shapes.get(s.key) != s.global_shape:
                raise ValueError(f"parameter '{name}' ({s.key} {s.global_shape}) is not in the "
                                 "canonical schema")
        self._schema_blob = zlib.compress(schema.to_text().encode())
        self._held: dict[str, list[Shard]] = {}  # this rank's shards by canonical key
        for sh in self.layout.values():
            self._held.setdefault(sh.key, []).append(sh)

    def message_bytes(self, schema: CanonicalSchema | None = None) -> int:
        """Bytes of one worker's message (a bundle of one part) holding every tensor of
        ``schema`` (default: this codec's) whole: what a TP=PP=1 worker sends.  The
        emulated clock charges it for the target model."""
        schema = schema or self.schema
        blob = len(zlib.compress(schema.to_text().encode()))
        size = HEADER.size + blob + _CRC.size + 16  # + the bundle's count and one length
        for _, shape in schema.entries:
            size += 4 + 8 * len(shape) + self._payload(shape)[0]
        return size

    def _payload(self, lens: Sequence[int]) -> tuple[int, int, int, tuple | None]:
        """Wire size of a piece's payload for a box of ``lens``: ``(bytes, scales,
        sign_pred coefficient bytes, top-k chunk layout or None)``."""
        n, nd = math.prod(lens), len(lens)
        lay = chunk_layout(lens, self.topk.chunk) if self.topk is not None else None
        if lay is not None:
            return self.topk.matrix_size(*lay), 0, 0, lay
        if self.kind in ("fp32", "topk"):
            return 4 * n, 0, 0, None
        ns = lens[0] if self.kind in _ROWS and nd >= 2 else 1
        pred = 4 * ns if self.kind == "sign_pred" else 0
        return pred + 4 * ns + packed_size(n), ns, pred, None

    # -- scales -------------------------------------------------------------

    def _num_scales(self, shape: Sequence[int]) -> int:
        return num_row_scales(shape) if self.kind in _ROWS else 1

    def _global_sums(self, sums, device) -> tuple[torch.Tensor, dict]:
        """fp64 ``[m, scales of this stage]``: ``sums(name, x_rows)`` (``[m, local scales]``
        over each scale's local elements, ``x_rows = [local scales, -1]`` views) placed at
        the global positions of the canonical scales and summed over the TP group;
        TP replicas add nothing (counted once, by TP rank 0)."""
        spans, pos = {}, 0
        for name, s in self.layout.items():
            spans[name] = (pos, self._num_scales(s.global_shape))
            pos += spans[name][1]
        out = None
        for name, s in self.layout.items():
            at, n = spans[name]
            if not s.tp_main:
                continue
            rows = 1 if n == 1 else s.local_shape[0]
            part = sums(name, rows)  # [m, rows] fp64
            if out is None:
                out = torch.zeros(part.shape[0], pos, dtype=torch.float64, device=device)
            r0 = at + (0 if n == 1 else s.offsets[0])
            out[:, r0:r0 + rows] = part.to(device)
        if out is None:  # nothing here (an empty model chunk)
            out = torch.zeros(1, pos, dtype=torch.float64, device=device)
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            dist.all_reduce(out, group=self.tp_group)
        return out, spans

    def _local(self, vec: torch.Tensor, spans: dict) -> dict[str, torch.Tensor]:
        """This shard's entries of a per-canonical-scale vector, by local name."""
        out = {}
        for name, s in self.layout.items():
            at, n = spans[name]
            out[name] = (vec[at:at + n] if n == 1 else
                         vec[at + s.offsets[0]:at + s.offsets[0] + s.local_shape[0]])
        return out

    def _scales(self, xs: Mapping[str, torch.Tensor], worker: int) -> dict[str, torch.Tensor]:
        """Per local name, fp32 scales of the whole canonical tensor or of its global
        rows: L1 sums placed at global positions, summed over the TP group."""
        device = next((x.device for x in xs.values()), torch.device("cpu"))
        l1, spans = self._global_sums(
            lambda name, rows: xs[name].reshape(rows, xs[name].numel() // max(rows, 1)).abs()
            .sum(dim=1, dtype=torch.float64).unsqueeze(0), device)  # an empty tensor: 0 rows
        counts = torch.zeros(l1.shape[1], dtype=torch.float64, device=device)
        for name, s in self.layout.items():
            at, n = spans[name]
            counts[at:at + n] = math.prod(s.global_shape) / max(n, 1)
        return self._local(mean_abs_scales(l1[0], counts, worker=worker), spans)

    def _coefs(self, xs: Mapping[str, torch.Tensor], v: Mapping[str, torch.Tensor]
               ) -> dict[str, torch.Tensor]:
        """``γ`` of :mod:`geomesh.wire.predict` per global row (or tensor), by local name:
        ``⟨x, v⟩`` and ``‖v‖²`` summed over the TP group (fp64)."""
        def sums(name, rows):
            x, p = xs[name], v.get(name)
            if p is None or x.numel() == 0:
                return torch.zeros(2, rows, dtype=torch.float64, device=x.device)
            xr, pr = x.reshape(rows, -1).double(), p.reshape(rows, -1).to(x.device).double()
            return torch.stack([(xr * pr).sum(dim=1), (pr * pr).sum(dim=1)])

        device = next((x.device for x in xs.values()), torch.device("cpu"))
        both, spans = self._global_sums(sums, device)
        return self._local(fit_coefficients(both), spans)

    @staticmethod
    def _times(gamma: torch.Tensor, v: torch.Tensor | None, shape) -> torch.Tensor:
        """``γ ⊙ v`` (rows scaled by their coefficient), zeros without ``v``."""
        if v is None or not math.prod(shape):
            return torch.zeros(shape)  # host: no prediction
        return (v.float().reshape(gamma.numel(), -1) * gamma.to(v.device).unsqueeze(1)).reshape(shape)

    # -- encode -------------------------------------------------------------

    def encode(self, deltas: Mapping[str, torch.Tensor], num_tokens: int, *, worker: int,
               round: int, feedback: ErrorFeedback | None = None,
               predictor: Mapping[str, torch.Tensor] | None = None) -> bytes:
        """This process's part of the worker's message.

        Args:
            deltas: ``{local name: pseudo-gradient}`` of this rank's shards
                (``local_shape`` each).  With sign and top-k codecs, a collective
                over ``tp_group``: every TP rank calls it.
            feedback: error-feedback residuals by local name (kept on every
                rank, TP replicas included, ``e = x − D(C(x))``).
            predictor: ``sign_pred``: the outer momentum ``v`` by local name
                (this rank's shards; empty before the first outer step).

        Raises:
            ValueError: a missing tensor, a wrong shape, or NaN/Inf values.
        """
        xs = {}
        for name, s in self.layout.items():
            if name not in deltas:
                raise ValueError(f"pseudo-gradient '{name}' ({s.key}) is missing")
            x = deltas[name].detach().float()
            if tuple(x.shape) != s.local_shape:
                raise ValueError(f"tensor '{name}' has shape {tuple(x.shape)}, its shard of "
                                 f"'{s.key}' is {s.local_shape}")
            xs[name] = feedback.add(name, x) if feedback is not None else x
            if self.kind == "fp32" and not bool(torch.isfinite(x).all()):
                raise ValueError(f"pseudo-gradient '{name}' of worker {worker} has NaN/Inf")
        gamma = {}
        if self.kind == "sign_pred":  # send the innovation y = Δ + e − γ v (geomesh.predict)
            v = predictor or {}
            gamma = self._coefs(xs, v)
            for name, s in self.layout.items():
                y = deltas[name].detach().float() - self._times(gamma[name], v.get(name),
                                                                s.local_shape)
                xs[name] = feedback.add(name, y) if feedback is not None else y
        scales = self._scales(xs, worker) if self.kind in ("sign", *_ROWS) else {}
        pieces = []
        for name, s in self.layout.items():
            x = xs[name]
            if self.topk is not None:
                payload, sent = self._topk_shard(s, x)
                if feedback is not None:  # e ← x − D(C(x)), on every rank holding x
                    feedback.keep(name, x - sent)
            elif self.kind != "fp32":
                packed, _ = pack_signs(x)
                if feedback is not None:  # e ← x − m·sign(x), on every rank holding x
                    feedback.keep(name, x - self._dense(packed, scales[name], s.local_shape))
            if not s.main:
                continue
            box = struct.pack(f"<I{2 * len(s.local_shape)}I", self._index[s.key],
                              *s.offsets, *s.local_shape)
            if self.topk is not None:
                pieces.append(box + payload)
            elif self.kind == "fp32":
                pieces.append(box + x.contiguous().cpu().numpy().astype("<f4").tobytes())
            else:
                pieces.append(box + (gamma[name].cpu().numpy().astype("<f4").tobytes()
                                     if gamma else b"")
                              + scales[name].cpu().numpy().astype("<f4").tobytes()
                              + packed.cpu().numpy().tobytes())
        head = HEADER.pack(_MAGIC, 1, _KINDS[self.kind], *self._params, worker, round % 2**32,
                            int(num_tokens), self.schema.digest, len(self._schema_blob),
                            len(pieces))
        body = b"".join([head, self._schema_blob, *pieces])
        return body + _CRC.pack(zlib.crc32(body))

    @staticmethod
    def _dense(packed: torch.Tensor, scale: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        """``m · sign`` of a box (one scale, or one per box row)."""
        return scale_signs(unpack_signs(packed, shape), scale.to(packed.device))

    def _topk_shard(self, s: Shard, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """Top-k payload of one shard (chunks of global rows) and its decoded values.

        Raises:
            ValueError: the shard splits a row inside a chunk (``chunk`` must
                divide the TP shard width).
        """
        t = self.topk
        lay = chunk_layout(s.local_shape, t.chunk)
        if lay is None:  # vectors go as fp32 (geomesh.sparse)
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"pseudo-gradient of '{s.key}' has NaN/Inf")
            return x.contiguous().cpu().numpy().astype("<f4").tobytes(), x
        rows, nch = lay
        nd = len(s.global_shape)
        split = s.offsets[1:] != (0,) * (nd - 1) or s.local_shape[1:] != s.global_shape[1:]
        if split:
            c0, width, cols = s.offsets[1], s.local_shape[1], s.global_shape[1]
            if nd != 2 or c0 % t.chunk or (width % t.chunk and c0 + width != cols):
                raise ValueError(f"top-k: '{s.key}' {s.global_shape} is split across TP "
                                 f"ranks inside a chunk ({width} columns at {c0}, chunk "
                                 f"{t.chunk}); use a geomesh.topk chunk that divides {width}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"pseudo-gradient of '{s.key}' has NaN/Inf")
        pos, vals = t.pick(x, rows, nch)
        mag = vals.abs().reshape(rows, nch * t.k)
        size = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        if split and size > 1:  # the whole row's kept magnitudes, in chunk order
            me = dist.get_rank(self.tp_group)
            if s.offsets[1] != me * s.local_shape[1]:
                raise ValueError(f"top-k: '{s.key}' columns at {s.offsets[1]} on TP rank {me}; "
                                 "expected TP ranks in column order")
            parts = [torch.empty_like(mag) for _ in range(size)]
            dist.all_gather(parts, mag.contiguous(), group=self.tp_group)
            level, scales = t.levels(torch.cat(parts, dim=1))
            level = level[:, me * mag.shape[1]:(me + 1) * mag.shape[1]]
        else:
            level, scales = t.levels(mag)
        sign, level = vals >= 0, level.reshape(vals.shape)
        return (t.matrix_bytes(pos, sign, level, scales),
                t.dense(pos, sign, level, scales, s.local_shape).to(x.device))

    # -- decode -------------------------------------------------------------

    def _pieces(self, data: bytes):
        """Parse one part: header fields and ``[(key, offsets, lengths, dense box)]`` of
        the pieces that overlap a shard of this rank (the others' payloads are skipped
        unread: a rank never builds the dense values of tensors it does not hold)."""
        buf = bytes(data)
        if len(buf) < HEADER.size + _CRC.size:
            raise MessageError(f"canonical message truncated: {len(buf)} bytes")
        magic, version, kind, *params, worker, rnd, tokens, digest, blob, count = \
            HEADER.unpack_from(buf, 0)
        if magic != _MAGIC or version != 1:
            raise MessageError(f"not a canonical GeoMesh message of version 1 (magic "
                               f"{bytes(magic)!r}, version {version})")
        (crc,) = _CRC.unpack_from(buf, len(buf) - _CRC.size)
        if crc != zlib.crc32(buf[:len(buf) - _CRC.size]):
            raise MessageError(f"canonical message from worker {worker}: CRC-32 mismatch")
        if digest != self.schema.digest:
            off = HEADER.size
            try:
                peer = CanonicalSchema.from_text(zlib.decompress(buf[off:off + blob]).decode())
            except (zlib.error, ValueError, UnicodeDecodeError) as e:
                raise MessageError(f"canonical message from worker {worker}: unreadable "
                                   f"schema ({e})") from None
            self.schema.check(peer, f"worker {worker}")
            raise MessageError(f"canonical message from worker {worker} has schema digest "
                               f"{digest.hex()}, here {self.schema.digest.hex()}")
        if kind != _KINDS[self.kind] or tuple(params) != self._params:
            raise MessageError(f"canonical message from worker {worker} uses codec {kind} "
                               f"(bits, chunk, k) {tuple(params)}; this worker decodes "
                               f"'{self.kind}' ({_KINDS[self.kind]}) {self._params}")
        off, end = HEADER.size + blob, len(buf) - _CRC.size
        out = []
        for _ in range(count):
            if off + 4 > end:
                raise MessageError(f"canonical message from worker {worker} truncated")
            (i,) = struct.unpack_from("<I", buf, off)
            if i >= len(self.schema.entries):
                raise MessageError(f"canonical message from worker {worker}: tensor index {i}")
            key, gshape = self.schema.entries[i]
            nd = len(gshape)
            dims = struct.unpack_from(f"<{2 * nd}I", buf, off + 4)
            offs, lens = dims[:nd], dims[nd:]
            off += 4 + 8 * nd
            if any(o + n > g for o, n, g in zip(offs, lens, gshape)):
                raise MessageError(f"canonical message from worker {worker}: box {offs}+{lens} "
                                   f"outside '{key}' {gshape}")
            n = math.prod(lens)
            need, ns, pred, lay = self._payload(lens)  # pred: sign_pred's coefficient bytes
            if off + need > end:
                raise MessageError(f"canonical message from worker {worker} truncated in '{key}'")
            if not any(overlap(s, offs, lens) is not None for s in self._held.get(key, ())):
                off += need  # held elsewhere: that rank decodes (and checks) it
                continue
            if lay is not None:
                box = self.topk.read_matrix(buf, off, lens, *lay, f"canonical message from "
                                            f"worker {worker}: '{key}'")
            elif self.kind in ("fp32", "topk"):
                box = torch.from_numpy(np.frombuffer(buf, "<f4", n, off).astype(np.float32))  # host
                if not bool(torch.isfinite(box).all()):
                    raise MessageError(f"canonical message from worker {worker}: '{key}' has "
                                       "NaN/Inf values")
                box = box.reshape(lens)
            else:
                if pred:  # the coefficients γ of the box's rows
                    gamma = torch.from_numpy(np.frombuffer(buf, "<f4", ns, off).astype(np.float32))  # host
                    if not bool(torch.isfinite(gamma).all()):
                        raise MessageError(f"canonical message from worker {worker}: '{key}' "
                                           "has a non-finite coefficient")
                    off += pred
                    need -= pred
                scale = torch.from_numpy(np.frombuffer(buf, "<f4", ns, off).astype(np.float32))  # host
                if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
                    raise MessageError(f"canonical message from worker {worker}: '{key}' has "
                                       "a negative or non-finite scale")
                packed = torch.from_numpy(np.frombuffer(buf, np.uint8, packed_size(n),  # host
                                                        off + 4 * ns).copy())
                box = self._dense(packed, scale, lens)
            off += need
            out.append((key, offs, lens, box, gamma if pred else None))
        if off != end:
            raise MessageError(f"canonical message from worker {worker} is overlong")
        return (worker, rnd, tokens), out

    def decode(self, parts: Sequence[bytes], *, predictor: Mapping[str, torch.Tensor] | None = None
               ) -> tuple[dict[str, torch.Tensor], int, int, int]:
        """Decode one worker's message (its processes' parts, any layout) into this rank's shards.

        ``predictor``: ``sign_pred``'s outer momentum ``v`` on this rank's shards
        (by local name); each decoded row is ``m sign(y) + γ v``.

        Returns:
            ``({local name: fp32 tensor of its local_shape}, num_tokens, worker, round)``,
            the form :func:`geomesh.wire.codec.aggregate_decoded` takes.

        Raises:
            MessageError: malformed part, another codec, another canonical schema
                (naming the first differing tensor), parts of different workers,
                rounds or token counts, or pieces that do not cover a shard
                exactly once.
        """
        parts = split_parts(parts)
        ident, by_key = None, {}
        for data in parts:
            head, pieces = self._pieces(data)
            if ident is not None and head != ident:
                raise MessageError(f"parts of one message disagree: (worker, round, tokens) "
                                   f"{ident} and {head}")
            ident = head
            for key, offs, lens, box, gamma in pieces:
                by_key.setdefault(key, []).append((offs, lens, box, gamma))
        if ident is None:
            raise MessageError("empty canonical message (no parts)")
        worker, rnd, tokens = ident
        out = {}
        for name, s in self.layout.items():
            t = torch.zeros(s.local_shape)  # host: decoded wire bytes
            dsts = []
            v = (predictor or {}).get(name)
            for offs, lens, box, gamma in by_key.get(s.key, ()):
                sl = overlap(s, offs, lens)
                if sl is None:
                    continue
                dst, src = sl
                t[dst] = box[src]
                if gamma is not None and v is not None:  # + γ v on the overlap (geomesh.predict)
                    g = gamma[src[0]].view(-1, *[1] * (len(lens) - 1)) if gamma.numel() > 1 \
                        else gamma[0]
                    t[dst] += v[dst].float() * g
                dsts.append(dst)
            covered, twice = coverage(dsts)
            if twice or covered != s.numel:
                raise MessageError(f"message from worker {worker} covers {covered} of the "
                                   f"{s.numel} elements of '{s.key}' held here"
                                   f"{' with overlapping pieces' if twice else ''} (a part "
                                   "is missing or repeated)")
            out[name] = t
        return out, tokens, worker, rnd

    def aggregate(self, messages: Sequence[bytes | Sequence[bytes] | None], *, guard=None,
                  senders: Sequence[int] | None = None, round: int | None = None,
                  predictor: Mapping[str, torch.Tensor] | None = None
                  ) -> tuple[dict[str, torch.Tensor] | None, list[int]]:
        """Token-weighted ``Δ = Σ (n_i/N) D(msg_i)`` on this rank's shards (equation 1).

        ``messages[j]`` is worker ``j``'s message (:func:`join_parts` bytes or its list
        of parts; ``None``: lost); identities, guard and return value as
        :func:`geomesh.wire.codec.aggregate_decoded`.  With ``mp_group`` a collective over
        it: the worker's ranks keep the same messages (one that fails to decode on
        any shard is dropped on all) and the guard sees the norms and peaks of the
        whole canonical pseudo-gradients, so its verdicts do not depend on the layout.
        """
        multi = self.mp_group is not None and dist.get_world_size(self.mp_group) > 1
        return aggregate_decoded(
            messages, lambda m: self.decode(m, predictor=predictor), guard, senders=senders,
            round=round, agree=(lambda pos: self._agree(pos, len(messages))) if multi else None,
            measure=self._measure, signs=self.kind not in ("fp32", "topk"))

    def _agree(self, positions: Sequence[int], n: int) -> list[int]:
        """The positions decoded on every rank of ``mp_group`` (a MIN all-reduce)."""
        ok = torch.zeros(n, dtype=torch.int32, device=self._device())
        ok[list(positions)] = 1
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.mp_group)
        return [j for j in range(n) if int(ok[j])]

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(self.mp_group) == "nccl" else torch.device("cpu")

    def _measure(self, deltas: Sequence[Mapping[str, torch.Tensor]]
                 ) -> tuple[list[float], list[tuple[float, str]]]:
        """``(‖Δ_i‖₂, (peak-to-RMS ratio, canonical key))`` of each whole canonical
        pseudo-gradient: per tensor ``Σx²``, element count and ``max|x|`` of the main
        shards (each canonical element counted once), summed (max) over ``mp_group``
        (:func:`geomesh.wire.guard.dense_norm`, :func:`geomesh.wire.guard.dense_peaks`)."""
        keys = [k for k, _ in self.schema.entries]
        at = self._index
        sums = torch.zeros(len(deltas), len(keys), 2, dtype=torch.float64)  # host: fp64 sums
        peak = torch.zeros(len(deltas), len(keys), dtype=torch.float64)  # host
        for j, d in enumerate(deltas):
            for name, s in self.layout.items():
                if not s.main or not s.numel:
                    continue
                x = d[name].double()
                sums[j, at[s.key], 0] += float(x.pow(2).sum())
                sums[j, at[s.key], 1] += s.numel
                peak[j, at[s.key]] = max(float(peak[j, at[s.key]]), float(x.abs().max()))
        if self.mp_group is not None and dist.get_world_size(self.mp_group) > 1 and deltas:
            dev = self._device()
            sums, peak = sums.to(dev), peak.to(dev)
            dist.all_reduce(sums, group=self.mp_group)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.mp_group)
            sums, peak = sums.cpu(), peak.cpu()
        norms, peaks = [], []
        for j in range(len(deltas)):
            norms.append(math.sqrt(float(sums[j, :, 0].sum())))
            worst = (0.0, "")
            for e, key in enumerate(keys):
                n = float(sums[j, e, 1])
                if n:
                    worst = max(worst, (peak_ratio(peak[j, e], float(sums[j, e, 0]) / n), key))
            peaks.append(worst)
        return norms, peaks


def join_parts(parts: Sequence[bytes]) -> bytes:
    """One worker's message: its processes' parts in one bundle
    (:func:`geomesh.exchange.transport.encode_bundle`)."""
    return encode_bundle(list(parts))


def split_parts(message: bytes | Sequence[bytes]) -> list[bytes]:
    """The parts of a worker's message (:func:`join_parts` bytes, one bare part, or a list).

    Raises:
        MessageError: a corrupted bundle.
    """
    if not isinstance(message, (bytes, bytearray, memoryview)):
        return list(message)
    data = bytes(message)
    if data[:4] == _MAGIC:
        return [data]
    try:
        return decode_bundle(data)
    except TransportError as e:
        raise MessageError(str(e)) from None
