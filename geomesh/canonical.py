"""Canonical tensors: where this rank's parameters sit in the unsharded model.

A worker's TP/PP layout is set by its memory, so two regions may shard the
model differently.  A layout-independent exchange addresses a pseudo-gradient
by the parameter's *canonical* key and global coordinates instead of this
rank's local name and shape.  The source of truth is megatron-core's
``sharded_state_dict`` (``megatron.core.dist_checkpointing.ShardedTensor``:
key, global shape, global offset, replica id), the metadata
``dist_checkpointing`` reshards checkpoints by:

- keys are built with ``metadata={"non_homogeneous_layers": True}``, so every
  transformer layer has its own key with its *global* layer number
  (``decoder.layers.{offset + i}.``; the PP offset of
  ``get_transformer_layer_offset``, :mod:`jobruntime.model`) and no prepended
  layer axis;
- global shapes are those of the unsharded tensor; the vocabulary is the run's
  ``model.padded_vocab`` (:mod:`jobruntime.vocab`), the same at every TP, so the
  embedding and output layer have one canonical shape per run;
- the offset along the TP-split dim (``partition_dim``) is
  ``tp_rank · local size``, other dims 0;
- ``replica_id = (tie, tp, dp)``: ``tie = 1`` on the last stage's copy of a tied
  word embedding (``output_layer.weight``, key ``embedding.word_embeddings.weight``),
  ``tp`` the TP rank for tensors replicated across TP (layer norms,
  row-parallel biases), ``dp`` the data-parallel rank.

A worker's *main* shard of a canonical tensor has ``tie = tp = 0``: the main
shards of all its processes tile each canonical tensor exactly once.  (DP
replicas inside a worker hold equal copies; choosing one of them is the
hierarchical exchange's job: DP rank 0, :mod:`geomesh.region`.)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .compression import MessageError


@dataclass(frozen=True)
class Shard:
    """One local parameter in canonical coordinates.

    Attributes:
        key: canonical key (``ShardedTensor.key``; global layer numbers).
        global_shape: shape of the unsharded tensor.
        offsets: global offset of this rank's slice, one per dim.
        local_shape: shape of this rank's slice (the local parameter's shape).
        replica_id: megatron's ``(tie, tp, dp)`` replica id (an int ``r`` reads
            as ``(0, r, 0)``).
    """

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local_shape: tuple[int, ...]
    replica_id: tuple[int, ...] = (0, 0, 0)

    @property
    def main(self) -> bool:
        """This worker sends this slice: ``tie = tp = 0`` (any DP rank)."""
        return not any(self.replica_id[:2])

    @property
    def tp_main(self) -> bool:
        """First copy inside the TP group (``tp = 0``): counted once in TP reductions."""
        return self.replica_id[1] == 0

    @property
    def box(self) -> tuple[slice, ...]:
        """Slices of the global tensor this rank holds."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.local_shape))

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


def _replica(rid) -> tuple[int, ...]:
    if isinstance(rid, int):
        return (0, rid, 0)
    rid = tuple(int(r) for r in rid)
    return rid + (0,) * (3 - len(rid))


def layout_map(module: torch.nn.Module) -> dict[str, Shard]:
    """Canonical place of every parameter of a megatron model chunk, by local name.

    Args:
        module: the unwrapped ``GPTModel`` / ``BertModel`` chunk of this rank
            (``jobruntime.trainer.Trainer.module``), at any TP/PP.

    Returns:
        ``{local parameter name: Shard}`` in ``named_parameters`` order.

    Raises:
        ValueError: a parameter has no ``ShardedTensor`` in
            ``module.sharded_state_dict`` (a layer megatron cannot checkpoint),
            or one with a flattened range or prepended axes.

    Source: ``MegatronModule.sharded_state_dict`` (megatron-core 0.16.1,
    ``TransformerBlock.sharded_state_dict`` with ``non_homogeneous_layers``).
    """
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    sd = module.sharded_state_dict(metadata={"non_homogeneous_layers": True})
    by_id = {id(v.data): v for v in nested_values(sd) if isinstance(v, ShardedTensor)}
    out = {}
    for name, p in module.named_parameters():
        st = by_id.get(id(p))
        if st is None:
            raise ValueError(f"parameter '{name}' has no ShardedTensor in the model's "
                             "sharded_state_dict; its canonical place is unknown")
        if st.flattened_range is not None or st.prepend_axis_num:
            raise ValueError(f"parameter '{name}' (key '{st.key}') is a flattened or stacked "
                             "ShardedTensor; the canonical exchange needs whole local tensors")
        local = tuple(int(d) for d in p.shape)
        off = tuple(int(o) for o in st.global_offset)
        shard = Shard(st.key, tuple(int(d) for d in st.global_shape), off, local,
                      _replica(st.replica_id))
        if any(o + n > g for o, n, g in zip(off, local, shard.global_shape)):
            raise ValueError(f"parameter '{name}' {local} at {off} exceeds '{st.key}' "
                             f"{shard.global_shape}")
        out[name] = shard
    return out


def whole_layout(schema: CanonicalSchema) -> dict[str, Shard]:
    """The layout of one process holding every canonical tensor whole (TP=PP=1),
    keyed by canonical key: the reference every other layout must match."""
    return {k: Shard(k, s, (0,) * len(s), s) for k, s in schema.entries}


@dataclass(frozen=True)
class CanonicalSchema:
    """Sorted ``(canonical key, global shape)`` of a whole model: layout-independent."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]

    @classmethod
    def from_shapes(cls, named: Iterable[tuple[str, Sequence[int]]]) -> CanonicalSchema:
        """Schema of ``(key, global shape)`` pairs (duplicates must agree).

        Raises:
            ValueError: one key with two global shapes.
        """
        seen: dict[str, tuple[int, ...]] = {}
        for k, s in named:
            s = tuple(int(d) for d in s)
            if seen.setdefault(k, s) != s:
                raise ValueError(f"canonical tensor '{k}' has global shapes {seen[k]} and {s}")
        return cls(tuple(sorted(seen.items())))

    @classmethod
    def gather(cls, layout: Mapping[str, Shard], group: dist.ProcessGroup | None = None
               ) -> CanonicalSchema:
        """Union of the layouts of a worker's processes (``group``: its TP×PP ranks,
        ``parallel_state.get_model_parallel_group()``; ``None``: this process alone).
        A collective over ``group``: every member calls it."""
        mine = [(s.key, s.global_shape) for s in layout.values()]
        if group is None or dist.get_world_size(group) == 1:
            return cls.from_shapes(mine)
        parts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, mine, group=group)
        return cls.from_shapes(e for part in parts for e in part)

    @property
    def digest(self) -> bytes:
        """8-byte BLAKE2b digest of the canonical keys and global shapes."""
        return hashlib.blake2b(self.to_text().encode(), digest_size=8).digest()

    def to_text(self) -> str:
        return "".join(f"{k}:{','.join(map(str, s))}\n" for k, s in self.entries)

    @classmethod
    def from_text(cls, text: str) -> CanonicalSchema:
        entries = []
        for line in text.splitlines():
            k, _, dims = line.rpartition(":")
            entries.append((k, tuple(int(d) for d in dims.split(",") if d)))
        return cls(tuple(entries))

    def index(self) -> dict[str, int]:
        return {k: i for i, (k, _) in enumerate(self.entries)}

    def check(self, peer: CanonicalSchema, who: str = "peer") -> None:
        """Raise ``MessageError`` naming the first canonical tensor where ``peer`` differs.

        Raises:
            MessageError: one line: the key, both shapes (or which side lacks it).
        """
        mine, theirs = dict(self.entries), dict(peer.entries)
        for key in sorted(set(mine) | set(theirs)):
            a, b = mine.get(key), theirs.get(key)
            if a == b:
                continue
            if a is None or b is None:
                side, has = ("here", who) if a is None else (f"at {who}", "here")
                raise MessageError(f"canonical tensor '{key}' is missing {side} (present "
                                   f"{has}); all workers must build the same model")
            raise MessageError(f"canonical tensor '{key}' has global shape {b} at {who}, {a} "
                               "here (another model or vocabulary padding: model.padded_vocab_size "
                               "and the model section must match)")


Piece = tuple[str, tuple[int, ...], torch.Tensor]
"""``(canonical key, global offsets, values)``: one box of a canonical tensor."""


def main_pieces(layout: Mapping[str, Shard], tensors: Mapping[str, torch.Tensor]) -> list[Piece]:
    """This rank's main shards of ``tensors`` (by local name) as canonical pieces.

    The main shards of a worker's model-parallel ranks tile every canonical
    tensor exactly once (module docstring); a DP replica's are equal copies,
    so one replica (DP rank 0) contributes them.

    Raises:
        KeyError: a parameter of ``layout`` is missing from ``tensors``.
    """
    return [(s.key, s.offsets, tensors[name]) for name, s in layout.items() if s.main]


def assemble(layout: Mapping[str, Shard], pieces: Iterable[Piece], *, what: str = "state"
             ) -> dict[str, torch.Tensor]:
    """This rank's shards, cut from canonical pieces of any layout.

    Args:
        layout: this rank's ``{local name: Shard}`` (:func:`layout_map`).
        pieces: boxes of canonical tensors (another layout's :func:`main_pieces`).
        what: named in errors (e.g. ``"healing state"``).

    Returns:
        ``{local name: fp32 tensor of its local_shape}`` on the host.

    Raises:
        ValueError: the pieces do not cover a shard exactly once (one missing,
            or two overlapping), or a piece lies outside its tensor.
    """
    by_key: dict[str, list[Piece]] = {}
    for p in pieces:
        by_key.setdefault(p[0], []).append(p)
    out = {}
    for name, s in layout.items():
        t = torch.zeros(s.local_shape)  # host: assembled from received pieces
        dsts = []
        for _key, offs, box in by_key.get(s.key, ()):
            sl = overlap(s, offs, tuple(box.shape))
            if sl is None:
                continue
            dst, src = sl
            t[dst] = box[src].float().cpu()
            dsts.append(dst)
        covered, twice = coverage(dsts)
        if twice or covered != s.numel:
            raise ValueError(f"{what}: the pieces cover {covered} of the {s.numel} elements of "
                             f"'{s.key}' held here{' with overlaps' if twice else ''} (a piece "
                             "is missing or repeated)")
        out[name] = t
    return out


def coverage(regions: Sequence[tuple[slice, ...]]) -> tuple[int, bool]:
    """``(elements, overlap)`` of boxes in one shard (:func:`overlap`'s first slices):
    the sum of their sizes, and whether two of them share an element.  The boxes
    tile the shard exactly once iff there is no overlap and the sum is its size
    (a count alone passes an overlap that hides an equal gap).  Pairwise: a shard
    meets at most one box per sender process."""
    total, twice = 0, False
    for i, a in enumerate(regions):
        total += math.prod(d.stop - d.start for d in a)
        twice = twice or any(all(x.start < y.stop and y.start < x.stop for x, y in zip(a, b))
                             for b in regions[:i])
    return total, twice


def overlap(s: Shard, offsets: Sequence[int], lengths: Sequence[int]
            ) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Where a box ``offsets + lengths`` of ``s``'s canonical tensor meets ``s``:
    ``(slices into the shard, slices into the box)``, or ``None`` when they are apart
    (a 0-dim tensor always meets)."""
    lo = [max(a, b) for a, b in zip(offsets, s.offsets)]
    hi = [min(a + n, b + m) for a, n, b, m in zip(offsets, lengths, s.offsets, s.local_shape)]
    if s.local_shape and any(h <= low for low, h in zip(lo, hi)):
        return None
    return (tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, s.offsets)),
            tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, offsets)))


def canonical_digest(schema: CanonicalSchema, pieces: Iterable[Piece]) -> str:
    """SHA-256 of the whole canonical tensors (fp32, little-endian, keys in schema
    order) cut from ``pieces`` of any layout: equal for equal weights whatever
    the layouts that hold them.  Assembles one tensor at a time.

    Raises:
        ValueError: the pieces do not cover a tensor exactly once.
    """
    by_key: dict[str, list[Piece]] = {}
    for p in pieces:
        by_key.setdefault(p[0], []).append(p)
    h = hashlib.sha256()
    for key, shape in schema.entries:
        whole = whole_layout(CanonicalSchema(((key, shape),)))
        t = assemble(whole, by_key.get(key, ()), what="weights digest")[key]
        h.update(key.encode() + b"\0")
        h.update(t.contiguous().numpy().astype("<f4").tobytes())
    return h.hexdigest()
