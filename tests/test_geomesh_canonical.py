"""The canonical (layout-independent) exchange: layout map, schema, fp32/sign/sign_row codecs.

One launch of 4 gloo processes builds tiny_gpt at TP2, PP2, TP2·PP2, TP1 and TP2
again (parallel_state rebuilt in between; the workers are the DP replicas of
each layout), encodes one canonical pseudo-gradient with every codec, and
decodes every message seen so far (any sender layout) into its own shards.
Reference: the same codec on one process holding every tensor whole (TP1 with
no reduction), checked against the closed form in the single-process tests.
"""

from __future__ import annotations

import math
import struct
import zlib

import pytest
import torch

from geomesh.canonical import CanonicalSchema, Shard, assemble, whole_layout
from geomesh.canonical_codec import HEADER, CanonicalCodec, join_parts
from geomesh.compression import ErrorFeedback, MessageError
from tests.dist_utils import launch

KINDS = ("fp32", "sign", "sign_row", "sign_pred", "topk")
TOPK = {"chunk": 16, "k": 4, "bits": 2}  # 16 divides every TP2 shard width of the model below
LAYOUTS = ((2, 1), (1, 2), (2, 2), (1, 1), (2, 1))  # (tp, pp); TP2 again decodes TP1's message
OVERRIDES = ["model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=1000",
             "model.seq_length=64", "parallel.micro_batch_size=1",
             "logging.wandb=disabled"]


def canonical_delta(key: str, shape) -> torch.Tensor:
    """A pseudo-gradient of the whole canonical tensor, the same in every process;
    rows of different magnitude so that row scales matter."""
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    x = torch.randn(shape, generator=g)
    if len(shape) >= 2:
        x *= (1 + torch.arange(shape[0]) % 5).float().view(-1, *[1] * (len(shape) - 1))
    return x


def _codec(kind, layout, schema, tp_group=None) -> CanonicalCodec:
    return CanonicalCodec(kind, layout, schema, tp_group=tp_group,
                          **(TOPK if kind == "topk" else {}))


def momentum(key: str, shape) -> torch.Tensor:
    """The outer momentum ``v`` (sign_pred's predictor), correlated with the delta."""
    return 0.5 * canonical_delta(key, shape) + canonical_delta(key + "/v", shape)


def _reference(kind: str, schema: CanonicalSchema) -> dict[str, torch.Tensor]:
    """Decoded values from one process holding ``schema``'s tensors whole, by key."""
    codec = _codec(kind, whole_layout(schema), schema)
    v = {k: momentum(k, s) for k, s in schema.entries}
    data = codec.encode({k: canonical_delta(k, s) for k, s in schema.entries}, 100,
                        worker=0, round=3, predictor=v)
    return codec.decode([data], predictor=v)[0]


def _worker(layouts):
    torch.set_num_threads(1)  # 4 ranks share 2 cores
    import torch.distributed as dist
    from megatron.core import parallel_state

    from geomesh.canonical import layout_map
    from geomesh.deploy import Placement
    from jobruntime.config import load_config
    from jobruntime.model import build_model
    from jobruntime.parallel import initialize_layout, set_seed

    messages, report = {}, {"digests": [], "checks": 0, "bad": [], "main": [], "repeated": 0}
    for tp, pp in layouts:
        name = f"tp{tp}pp{pp}"
        cfg = load_config("tiny_gpt", [*OVERRIDES, f"parallel.tp={tp}", f"parallel.pp={pp}"])
        topo = initialize_layout(cfg)
        set_seed(0)
        module = build_model(cfg.model, cfg.parallel)
        layout = layout_map(module)
        schema = CanonicalSchema.gather(layout, parallel_state.get_model_parallel_group())
        report["digests"].append(schema.digest)
        report["main"].append((name, topo.dp_rank, {s.key: s.box for s in layout.values() if s.main}))
        mine = CanonicalSchema.from_shapes((s.key, s.global_shape) for s in layout.values())
        deltas = {n: canonical_delta(s.key, s.global_shape)[s.box] for n, s in layout.items()}
        v = {n: momentum(s.key, s.global_shape)[s.box] for n, s in layout.items()}
        for kind in KINDS:
            codec = _codec(kind, layout, schema, parallel_state.get_tensor_model_parallel_group())
            part = codec.encode(deltas, 100, worker=0, round=3, predictor=v)
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (topo.dp_rank, part))
            # the worker's message as the running exchange joins it: the DP replicas of
            # this layout are one worker's replicas (DP2-in-region), DP rank 0's parts go
            joined = Placement(mode="real", workers=[0], dp_in_rank=topo.dp_rank,
                               worker_group=dist.group.WORLD).collect(
                part if topo.dp_rank == 0 else None)
            messages.setdefault((name, kind), joined)
            if topo.dp_rank == 0 and topo.dp > 1:  # every replica's parts: repeated
                try:
                    codec.decode(join_parts([p for _, p in parts]), predictor=v)
                    report["bad"].append(f"{kind} on {name}: replicas' parts accepted twice")
                except MessageError as e:
                    report["repeated"] += "repeated" in str(e)
            ref = _reference(kind, mine)
            for (sender, k), msg in messages.items():
                if k != kind:
                    continue
                decoded, tokens, worker, rnd = codec.decode(msg, predictor=v)
                assert (tokens, worker, rnd) == (100, 0, 3)
                for n, s in layout.items():
                    report["checks"] += 1
                    if not torch.equal(decoded[n], ref[s.key][s.box]):
                        diff = (decoded[n] - ref[s.key][s.box]).abs().max().item()
                        report["bad"].append(f"{kind} from {sender} on {name}: {s.key} {diff:.3g}")
    # A worker of another vocabulary padding (same layout): its message is refused.
    cfg = load_config("tiny_gpt", [*OVERRIDES, "model.padded_vocab_size=1152",
                                   f"parallel.tp={tp}", f"parallel.pp={pp}"])
    set_seed(0)
    other = layout_map(build_model(cfg.model, cfg.parallel))
    peer = CanonicalCodec("sign_row", other,
                          CanonicalSchema.gather(other, parallel_state.get_model_parallel_group()),
                          tp_group=parallel_state.get_tensor_model_parallel_group())
    part = peer.encode({n: canonical_delta(s.key, s.global_shape)[s.box] for n, s in other.items()},
                       100, worker=1, round=3)
    try:
        codec.decode([part])
        report["refused"] = None
    except MessageError as e:
        report["refused"] = str(e)
    return report


@pytest.fixture(scope="module")
def reports():
    return launch(_worker, 4, LAYOUTS)


def test_every_layout_decodes_every_layouts_message_bit_identically(reports):
    """Catches scales taken per shard instead of per canonical tensor or global row
    (a TP-split row), pieces placed at local instead of global coordinates, and
    PP layer numbers that are not global: a message sent at TP1, TP2, PP2 or
    TP2·PP2 decodes, on every rank of every layout, to bit for bit the values of
    one process holding the tensors whole; the worker's message is joined as the
    running exchange joins it (DP rank 0's parts, :meth:`Placement.collect`), and
    one holding every DP replica's parts is refused as repeated."""
    for r in reports:
        assert r["bad"] == [], r["bad"][:5]
    # every (layout, sender, codec, local tensor) pair was checked on every rank
    assert all(r["checks"] > 100 for r in reports)
    # DP2-in-region: a message holding every replica's parts is refused as repeated,
    # for every codec on each DP-rank-0 process (tp·pp of them) of a layout with replicas
    assert sum(r["repeated"] for r in reports) == len(KINDS) * sum(
        tp * pp for tp, pp in LAYOUTS if 4 // (tp * pp) > 1)


def test_message_of_other_vocabulary_padding_is_refused_naming_the_embedding(reports):
    """Catches a decoder that accepts (or silently crops) a TP2 model padded to 1152
    rows instead of 1024: the error names the word embedding and both shapes."""
    for r in reports:
        assert r["refused"] is not None and r["refused"].startswith(
            "canonical tensor 'embedding.word_embeddings.weight' has global shape (1152, 64) at "
            "worker 1, (1024, 64) here"), r["refused"]


def test_schema_digest_and_main_shards_do_not_depend_on_layout(reports):
    """Catches a digest over local names or shapes, and a layout map whose main
    shards do not tile each canonical tensor exactly once per worker."""
    digests = {d for r in reports for d in r["digests"]}
    assert len(digests) == 1
    for i, (tp, pp) in enumerate(LAYOUTS):
        workers = {}
        for r in reports:
            name, dp, boxes = r["main"][i]
            for key, box in boxes.items():
                workers.setdefault(dp, {}).setdefault(key, []).append(box)
        for dp, boxes in workers.items():
            total = {k: sum(torch.Size([b.stop - b.start for b in box]).numel() for box in bs)
                     for k, bs in boxes.items()}
            schema = dict(_tiny_schema_entries(reports))
            assert set(total) == set(schema), (tp, pp, dp)
            for k, n in total.items():
                assert n == torch.Size(schema[k]).numel(), (tp, pp, dp, k)


def _tiny_schema_entries(reports):
    # the TP1 layout's boxes are the whole tensors
    i = LAYOUTS.index((1, 1))
    return [(k, tuple(b.stop for b in box)) for r in reports for k, box in r["main"][i][2].items()]


# -- single process: closed forms and refusals ----------------------------------------------

SHAPES = [("embedding.word_embeddings.weight", (1024, 64)), ("decoder.layers.0.fc2.weight", (64, 96)),
          ("decoder.layers.0.fc2.bias", (64,))]


def test_whole_layout_is_the_codecs_closed_form():
    """Catches a canonical codec that does not send m·sign(x) with m = mean|x| over the
    tensor (sign) or each row (sign_row), sign_pred that does not send γ v + m·sign(y)
    with y = x − γ v, γ = ⟨x, v⟩/‖v‖² per row, top-k that does not keep the k largest
    |x| of each chunk at ±(the mean of the upper or lower half of its row's kept |x|), lost
    fp32 bits, and error feedback that does not keep x − D(C(x))."""
    schema = CanonicalSchema.from_shapes(SHAPES)
    xs = {k: canonical_delta(k, s) for k, s in schema.entries}
    vs = {k: momentum(k, s) for k, s in schema.entries}
    for kind in KINDS:
        codec = _codec(kind, whole_layout(schema), schema)
        fb = ErrorFeedback()
        out, tokens, _, _ = codec.decode(codec.encode(xs, 7, worker=2, round=1, feedback=fb,
                                                      predictor=vs), predictor=vs)
        assert tokens == 7
        for k, x in xs.items():
            sign = torch.where(x >= 0, 1.0, -1.0)
            if kind == "sign_pred":
                v = vs[k].reshape(x.shape[0] if x.dim() == 2 else 1, -1)
                xr = x.reshape(v.shape)
                gamma = (xr * v).sum(dim=1, keepdim=True) / (v * v).sum(dim=1, keepdim=True)
                y = xr - gamma * v
                expect = (gamma * v + y.abs().mean(dim=1, keepdim=True) * y.sign()).reshape(x.shape)
                assert gamma.abs().mean() > 0.2  # the predictor matters
            elif kind == "topk":
                expect = _topk_reference(x, TOPK["chunk"], TOPK["k"])
                assert torch.allclose(out[k], expect, rtol=1e-6, atol=0), k
            elif kind == "fp32":
                expect = x
            elif kind == "sign_row" and x.dim() == 2:
                expect = x.abs().mean(dim=1, keepdim=True) * sign
            else:
                expect = x.abs().mean() * sign
            tol = 1e-5 if kind == "sign_pred" else 0  # γ in fp64 here, fp32 in the test
            assert torch.allclose(out[k], expect, rtol=1e-6, atol=tol), (kind, k)
            if kind != "fp32":
                assert torch.allclose(out[k] + fb.residuals[k], x, atol=1e-6), (kind, k)


def _topk_reference(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """Top-k with 2 bits, written out (matrices; vectors go as fp32): in each chunk
    of ``chunk`` columns of a row the ``k`` largest |x| are kept; a kept value
    whose |x| is above the median of its row's kept |x| decodes to ±(the mean of
    those above), the others to ±(the mean of the rest)."""
    if x.dim() < 2:
        return x
    rows = x.reshape(x.shape[0], -1)
    out = torch.zeros_like(rows)
    for r in range(rows.shape[0]):
        kept = []
        for c0 in range(0, rows.shape[1], chunk):
            block = rows[r, c0:c0 + chunk].abs().tolist()
            kept += [c0 + j for j in sorted(range(len(block)), key=lambda j: -block[j])[:k]]
        mag = rows[r, kept].abs()
        hi = mag > mag.sort().values[(len(kept) - 1) // 2]  # the lower median
        m_hi, m_lo = mag[hi].mean() if hi.any() else 0.0, mag[~hi].mean()
        for j, h in zip(kept, hi.tolist()):
            out[r, j] = math.copysign(float(m_hi if h else m_lo), float(rows[r, j]))
    return out.reshape(x.shape)


def test_assemble_refuses_pieces_that_overlap_and_leave_a_gap():
    """Catches a coverage check that counts elements: two pieces of a 6-row tensor
    (rows 0-3 and 2-3) hold 6 rows' worth of elements but leave rows 4-5 at zero;
    a healing state cut from them is refused, naming the tensor; a true tiling
    (rows 0-3 and 4-5) is assembled exactly."""
    x = torch.arange(48.0).reshape(6, 8)
    layout = {"w": Shard("w", (6, 8), (0, 0), (6, 8))}
    with pytest.raises(ValueError, match="cover 48 of the 48 elements of 'w' held here with "
                                         "overlaps"):
        assemble(layout, [("w", (0, 0), x[:4]), ("w", (2, 0), x[2:4])], what="healing state")
    got = assemble(layout, [("w", (0, 0), x[:4]), ("w", (4, 0), x[4:])])["w"]
    assert torch.equal(got, x)


def test_a_rank_decodes_only_the_pieces_it_holds():
    """Catches a decoder that builds the dense values of every tensor of a message
    (the whole model on every rank, e.g. every layer on each PP stage): a rank
    that does not hold the embedding skips its payload unread — a NaN planted
    there does not reach it — while a rank holding it refuses the message."""
    schema = CanonicalSchema.from_shapes(SHAPES)
    codec = CanonicalCodec("fp32", whole_layout(schema), schema)
    data = bytearray(codec.encode({k: canonical_delta(k, s) for k, s in schema.entries}, 5,
                                  worker=0, round=0))
    emb, fc2 = SHAPES[0], SHAPES[1]
    assert schema.entries[-1][0] == emb[0]  # the last piece: its last value ends the payload
    at = len(data) - 4 - 4
    data[at:at + 4] = struct.pack("<f", float("nan"))
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))  # an insider's valid CRC
    stage = {n: Shard(k, s, (0,) * len(s), s) for n, (k, s) in (("w", fc2), ("e", emb))}
    other = CanonicalCodec("fp32", {"w": stage["w"]}, schema)
    out = other.decode(bytes(data))[0]["w"]
    assert torch.equal(out, canonical_delta(*fc2))
    with pytest.raises(MessageError, match="NaN"):
        CanonicalCodec("fp32", {"e": stage["e"]}, schema).decode(bytes(data))


def test_topk_refuses_a_tp_shard_that_splits_a_chunk():
    """Catches top-k chunks cut at local instead of global columns: a row-parallel
    shard starting inside a chunk (column 8 with chunk 16) is refused naming it."""
    from geomesh.canonical import Shard

    schema = CanonicalSchema.from_shapes([("w", (4, 32))])
    layout = {"w": Shard("w", (4, 32), (0, 8), (4, 24))}
    with pytest.raises(ValueError, match="'w' .* inside a chunk .* divides 24"):
        _codec("topk", layout, schema).encode({"w": torch.ones(4, 24)}, 1, worker=0, round=0)


def test_aggregate_weights_workers_by_tokens():
    """Catches an aggregate that ignores n_i or a lost worker: Σ (n_i/N) D(msg_i)."""
    schema = CanonicalSchema.from_shapes(SHAPES)
    codec = CanonicalCodec("fp32", whole_layout(schema), schema)
    xs = [{k: canonical_delta(k, s) * (i + 1) for k, s in schema.entries} for i in range(2)]
    msgs = [[codec.encode(x, n, worker=i, round=0)] for i, (x, n) in enumerate(zip(xs, (1, 3)))]
    agg, tokens = codec.aggregate([*msgs, None], senders=[0, 1, 2], round=0)
    assert tokens == [1, 3, 0]
    for k, _ in schema.entries:
        assert torch.allclose(agg[k], 0.25 * xs[0][k] + 0.75 * xs[1][k], rtol=1e-6)


def test_other_padding_or_missing_tensor_is_refused_naming_the_tensor():
    """Catches a schema check that does not name the tensor, and a decoder that
    accepts a message of another model (other vocabulary padding, a missing tensor)."""
    schema = CanonicalSchema.from_shapes(SHAPES)
    padded = CanonicalSchema.from_shapes([("embedding.word_embeddings.weight", (1152, 64)),
                                          *SHAPES[1:]])
    missing = CanonicalSchema.from_shapes(SHAPES[:2])
    assert padded.digest != schema.digest != missing.digest
    with pytest.raises(MessageError, match=r"'embedding.word_embeddings.weight' has global "
                                           r"shape \(1152, 64\) at peer, \(1024, 64\) here"):
        schema.check(padded)
    with pytest.raises(MessageError, match="'decoder.layers.0.fc2.bias' is missing at peer"):
        schema.check(missing)
    here = CanonicalCodec("sign_row", whole_layout(schema), schema)
    for other in (padded, missing):
        peer = CanonicalCodec("sign_row", whole_layout(other), other)
        data = peer.encode({k: canonical_delta(k, s) for k, s in other.entries}, 1,
                           worker=5, round=0)
        with pytest.raises(MessageError, match="canonical tensor '.*' .*worker 5"):
            here.decode([data])
    # a message that lacks a part (half of a TP-split tensor) is refused, not zero-filled
    codec = CanonicalCodec("fp32", whole_layout(schema), schema)
    data = codec.encode({k: canonical_delta(k, s) for k, s in schema.entries}, 1, worker=0,
                        round=0)
    with pytest.raises(MessageError, match="covers 0 of the 65536 elements of 'embedding"):
        codec.decode([_drop_piece(data)])


def _drop_piece(data: bytes) -> bytes:
    """The message with its last piece (the 1024 x 64 embedding) removed, re-framed."""
    import struct

    head = HEADER
    fields = list(head.unpack_from(data, 0))
    fields[-1] -= 1
    body = head.pack(*fields) + data[head.size:len(data) - 4 - (4 + 16 + 4 * 1024 * 64)]
    return body + struct.pack("<I", zlib.crc32(body))
