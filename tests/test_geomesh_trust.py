"""No message trusted: envelopes (HMAC, binding) and checks before aggregation.

Pure logic, no processes: every hostile message of ``bench/faults.py`` goes
through the same :class:`~geomesh.wire.envelope.Opener` and
:class:`~geomesh.wire.guard.Guard` as in a run (:func:`hostile_cases` is shared).
"""

from __future__ import annotations

import math
import struct
import zlib

import pytest
import torch

from geomesh.exchange.heal_payload import pack_state, unpack_state
from geomesh.wire.canonical import CanonicalSchema, Shard, whole_layout
from geomesh.wire.canonical_codec import CanonicalCodec, join_parts
from geomesh.wire.compression import MessageError
from geomesh.wire.envelope import DATA, HEAL, JOIN, EnvelopeError, Opener, Sealer, load_secret
from geomesh.wire.guard import Guard
from jobruntime.config import ConfigError

SECRET = b"k" * 32
RUN = 1234
KINDS = ["fp32", "sign", "sign_row", "sign_pred", "topk"]
"""Every kind of :class:`~geomesh.wire.canonical_codec.CanonicalCodec`, the exchange's one codec."""
TOPK = {"chunk": 4, "k": 2}  # two chunks per row of the 6 x 8 tensor


def _named(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(6, 8, generator=g) * scale, "b": torch.randn(7, generator=g) * scale}


V = {k: 0.5 * v + _named(99)[k] for k, v in _named(0).items()}
"""The outer momentum every worker holds (``sign_pred``'s predictor; the others ignore it)."""


def _schema(named: dict[str, torch.Tensor] | None = None) -> CanonicalSchema:
    return CanonicalSchema.from_shapes((k, v.shape) for k, v in (named or _named(0)).items())


def _codec(kind: str, named: dict[str, torch.Tensor] | None = None,
           layout: dict[str, Shard] | None = None, **topk) -> CanonicalCodec:
    """The exchange's codec of ``kind`` for the model of ``named`` (canonical key = name),
    on one process holding every tensor whole unless ``layout`` says otherwise;
    ``topk``: the top-k setting (default :data:`TOPK`)."""
    schema = _schema(named)
    return CanonicalCodec(kind, layout or whole_layout(schema), schema,
                          **((topk or TOPK) if kind == "topk" else {}))


def encode(codec: CanonicalCodec, named: dict[str, torch.Tensor], tokens: int, *, worker: int,
           round: int = 0) -> bytes:
    """A worker's message as the exchange sends it: its one part in a bundle."""
    return join_parts([codec.encode(named, tokens, worker=worker, round=round, predictor=V)])


def pp2_parts(kind: str, named: dict[str, torch.Tensor], tokens: int, *, worker: int,
              round: int = 0) -> list[bytes]:
    """The two parts of a worker at PP2: ``emb`` on one process, ``b`` on the other."""
    whole = whole_layout(_schema(named))
    return [_codec(kind, named, {k: whole[k]}).encode({k: named[k]}, tokens, worker=worker,
                                                      round=round, predictor=V)
            for k in ("emb", "b")]


def aggregate(codec: CanonicalCodec, msgs, **kw):
    """``codec.aggregate`` with the shared predictor."""
    return codec.aggregate(msgs, predictor=V, **kw)


def _crc(raw: bytearray) -> bytes:
    """``raw`` with a valid CRC-32 trailer: what an insider can always send."""
    struct.pack_into("<I", raw, len(raw) - 4, zlib.crc32(raw[:-4]))
    return bytes(raw)


def first_number(part: bytes) -> int:
    """Offset of the first fp32 number of a whole-layout part: ``b``'s first value
    (fp32, top-k), its scale (sign, sign_row) or its coefficient γ (sign_pred)."""
    (blob,) = struct.unpack_from("<I", part, 36)
    return 44 + blob + 4 + 8  # header, schema, piece index and 1-dim box


def _overlapping(kind: str, named: dict[str, torch.Tensor], worker: int) -> bytes:
    """A part whose pieces of ``emb`` overlap (rows 0-3 and 2-3) and leave rows 4-5
    out: as many elements as the tensor, not a tiling of it."""
    whole = whole_layout(_schema(named))
    layout = {"b": whole["b"], "e0": Shard("emb", (6, 8), (0, 0), (4, 8)),
              "e1": Shard("emb", (6, 8), (2, 0), (2, 8))}
    x = {"b": named["b"], "e0": named["emb"][:4], "e1": named["emb"][2:4]}
    return _codec(kind, named, layout).encode(x, 100, worker=worker, round=0, predictor=V)


REASONS = {"huge_values": "norm", "token_grab": "tokens", "zero_tokens": "tokens"}
"""Guard reason of each hostile case; the others are ``malformed`` (refused by the decoder)."""


def hostile_cases(codec: CanonicalCodec, round: int = 0) -> dict[str, list]:
    """Round messages of 3 workers where worker 2 is hostile, one case per attack.

    Honest workers send 100 tokens each: worker 0 from one process (TP1), worker
    1 from two (PP2: a bundle of two parts).  Returns ``{name: [msg0, msg1, msg2]}``.
    """
    kind, x = codec.kind, _named(2)
    honest = [encode(codec, _named(0), 100, worker=0, round=round),
              join_parts(pp2_parts(kind, _named(1), 100, worker=1, round=round))]
    part = codec.encode(x, 100, worker=2, round=round, predictor=V)
    nan = bytearray(part)
    struct.pack_into("<f", nan, first_number(part), float("nan"))
    flipped = bytearray(part)
    flipped[len(part) // 2] ^= 0x10
    pa, pb = pp2_parts(kind, x, 100, worker=2, round=round)
    other = {"emb": torch.randn(8, 8), "b": x["b"]}  # another vocabulary padding
    cases = {
        "huge_values": encode(codec, _named(2, 1e6), 100, worker=2, round=round),
        "token_grab": encode(codec, x, 10**9, worker=2, round=round),
        "zero_tokens": encode(codec, x, 0, worker=2, round=round),
        "nan_body": join_parts([_crc(nan)]),  # NaN value, scale or coefficient, valid CRC
        "truncated": join_parts([part[:-9]]),
        "corrupted": join_parts([bytes(flipped)]),
        "repeated_part": join_parts([pa, pa, pb]),
        "missing_part": join_parts([pa]),
        "overlapping_parts": join_parts([_overlapping(kind, x, 2)]),
        "parts_disagree": join_parts([pa, pp2_parts(kind, x, 10**6, worker=2, round=round)[1]]),
        "other_schema": join_parts([_codec(kind, other).encode(other, 100, worker=2,
                                                               round=round)]),
        "other_codec": encode(_codec("fp32" if kind != "fp32" else "sign_row"), x, 100,
                              worker=2, round=round),
        "garbage": b"GMCN" + bytes(100),
        "empty_bundle": join_parts([]),
    }
    return {k: [*honest, v] for k, v in cases.items()}


def test_envelope_round_trip_and_binding():
    """Catches an envelope that accepts a replay from another round, another
    run, another shard, a message in the wrong worker's slot, a duplicate, a
    flipped bit or a wrong key, or that reads fields before checking the tag:
    each is rejected with its own reason and counted; a genuine one opens."""
    s, o = Sealer(SECRET, RUN), Opener(SECRET, RUN)
    env = s.seal(b"body", kind=DATA, round=3, worker=1, shard=0)
    assert o.open(env, round=3, sender=1).body == b"body"
    bad = {
        "duplicate": env,
        "replay": s.seal(b"x", kind=DATA, round=2, worker=1),
        "other_run": Sealer(SECRET, RUN + 1).seal(b"x", kind=DATA, round=3, worker=2),
        "wrong_sender": s.seal(b"x", kind=DATA, round=3, worker=0),
        "shard": s.seal(b"x", kind=DATA, round=3, worker=2, shard=1),
        "unauthenticated": Sealer(b"z" * 32, RUN).seal(b"x", kind=DATA, round=3, worker=2),
        "kind": s.seal(b"x", kind=HEAL, round=3, worker=2),
        "truncated": env[:10],
    }
    flipped = bytearray(s.seal(b"abc", kind=DATA, round=3, worker=2))
    flipped[45] ^= 1
    bad["unauthenticated_bit"] = bytes(flipped)
    for reason, data in bad.items():
        sender = 1 if reason == "duplicate" else 2  # "wrong_sender" claims worker 0
        with pytest.raises(EnvelopeError) as e:
            o.open(data, round=3, sender=sender)
        assert e.value.reason == reason.removesuffix("_bit"), reason
    assert sum(o.rejected.values()) == len(bad) and o.opened == 1
    # A retried exchange (after a lost worker) may deliver the same message again.
    o.forget_round(3)
    assert o.open(env, round=3, sender=1).kind == DATA
    assert o.open(s.seal(b"", kind=JOIN, round=3, worker=2), round=3, sender=2).body == b""


def test_secret_from_file_or_env_never_short(tmp_path, monkeypatch):
    """Catches a secret taken from nowhere, a short one, or a missing file turned
    into a traceback: each is a one-line ConfigError naming the fix."""
    monkeypatch.delenv("GEOMESH_SECRET", raising=False)
    with pytest.raises(ConfigError, match="GEOMESH_SECRET"):
        load_secret(None)
    assert load_secret(None, required=False) is None
    monkeypatch.setenv("GEOMESH_SECRET", "short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret(None)
    f = tmp_path / "secret"
    f.write_text("a" * 40 + "\n")
    assert load_secret(str(f)) == b"a" * 40
    with pytest.raises(ConfigError, match="cannot be read"):
        load_secret(str(tmp_path / "missing"))


@pytest.mark.parametrize("kind", KINDS)
def test_guard_drops_hostile_worker_and_keeps_honest_result(kind, caplog):
    """Catches absurd-but-finite values, NaN bodies, token grabs, zero-token tricks,
    truncated or corrupted parts, a worker's bundle with a part repeated, missing,
    overlapping another (an overlap that hides an equal gap passed a count of
    covered elements), or disagreeing with its other parts, and a part of another
    model, codec or format reaching θ_global, with every kind of the exchange's
    codec: with the guard, the aggregate of each hostile round equals the honest
    two workers' (one at TP1, one at PP2) exactly, the hostile worker gets 0
    tokens, and the one rejection is counted under its reason; a part of another
    canonical schema is refused naming the first differing tensor.  An absent
    worker (``None``) counts 0 tokens and no rejection."""
    codec = _codec(kind)
    cases = hostile_cases(codec)
    honest = cases["huge_values"][:2]
    guard = Guard(["w0", "w1", "w2"], ["A", "B", "C"])
    guard.expect({0: 100, 1: 100, 2: 100})
    agg, tokens = aggregate(codec, [*honest, None], guard=guard)
    ref, _ = aggregate(codec, honest)
    assert tokens == [100, 100, 0] and not guard.last_rejected
    assert all(torch.equal(agg[k], ref[k]) for k in ref)
    for name, msgs in cases.items():
        guard = Guard(["w0", "w1", "w2"], ["A", "B", "C"])
        guard.expect({0: 100, 1: 100, 2: 100})
        caplog.clear()
        agg, tokens = aggregate(codec, msgs, guard=guard)
        assert tokens == [100, 100, 0], name
        for k in ref:
            assert torch.equal(agg[k], ref[k]), (name, k)
        assert guard.last_rejected == {2: REASONS.get(name, "malformed")}, (name, guard.rejected)
        assert sum(guard.rejected.values()) == 1, name
        if name == "other_schema":
            assert "canonical tensor 'emb' has global shape (8, 8) at worker 2, (6, 8) here" \
                in caplog.text, caplog.text
        if name == "overlapping_parts":
            assert "covers 48 of the 48 elements of 'emb' held here with overlapping" \
                in caplog.text, caplog.text


def test_guard_never_rejects_honest_workers_of_different_sizes():
    """Catches a norm bound so tight that an honest worker with 4x the inner steps
    (a 4x larger pseudo-gradient) is dropped: the default ratio 10 keeps all."""
    codec = _codec("sign_row")
    guard = Guard(["a", "b", "c"], ["A", "B", "C"])
    for r in range(3):
        msgs = [encode(codec, _named(10 * r + k, 1 + 3 * (k == 2)), 100, worker=k, round=r)
                for k in range(3)]
        guard.expect({0: 100, 1: 100, 2: 100})
        _, tokens = aggregate(codec, msgs, guard=guard)
        assert tokens == [100, 100, 100]
    assert not guard.rejected


def test_guard_keeps_honest_worker_when_the_other_sent_zero():
    """Catches a norm bound of 10 x 0: in a real two-region run the T4's one
    inner step of round 1 ran at warmup's lr 0, its pseudo-gradient was 0, and
    the H100's honest message (norm 0.66) was rejected as 'exceeds 10 x 0'."""
    codec = _codec("fp32")
    zero = {k: torch.zeros_like(v) for k, v in _named(0).items()}
    msgs = [encode(codec, _named(1), 100, worker=0), encode(codec, zero, 100, worker=1)]
    guard = Guard(["h100", "t4"], ["A", "B"])
    guard.expect({0: 100, 1: 100})
    _, tokens = aggregate(codec, msgs, guard=guard)
    assert tokens == [100, 100] and not guard.rejected


def _four_region_scales() -> tuple[list[float], object, list, float]:
    """Round-1 expected scales of the four-region quick plan (H_i = 25, 9, 2, 1
    proxy steps of 4 sequences, 12 rounds of H = 8, warmup 20 scaled by H_i / H),
    with the LrScale, the proxy steps and train.lr."""
    from geomesh.worker import LrScale, ProxyStep
    from jobruntime.config import load_config

    cfg = load_config("tiny_gpt", ["train.warmup_iters=20"])
    hs = [25, 9, 2, 1]
    lrs = LrScale(cfg, [(12 * h, round(20 * h / 8)) for h in hs], reference_batch=4.0,
                  scaling="sqrt")
    steps = [ProxyStep(target=None, batches=(4,) * h) for h in hs]
    return [lrs.round(i, s) for i, s in enumerate(steps)], lrs, steps, cfg.train.lr


def _scale(eta):
    return math.sqrt(sum(eta) * math.sqrt(sum(e * e for e in eta)))


def test_lr_scale_follows_each_workers_warmup():
    """Catches a scale that ignores the schedule (H_i alone) or its position: the
    round-1 learning rates are lr·h/warmup_i with megatron's lr 0 at step 0, the
    scale is sqrt(Σ η · sqrt(Σ η²)), and a worker's next round continues its
    schedule."""
    scales, lrs, steps, lr = _four_region_scales()
    for i, (h, w) in enumerate(zip([25, 9, 2, 1], [62, 22, 5, 2])):
        eta = [lr * k / w for k in range(h)]
        assert lrs.lrs(i, steps[i]) == pytest.approx(eta, rel=1e-9)
        assert scales[i] == pytest.approx(_scale(eta), rel=1e-9)
    assert scales[3] == 0.0 and 10 < scales[0] / scales[2] < 13
    lrs.advance(2, steps[2])
    assert lrs.round(2, steps[2]) == pytest.approx(_scale([lr * 2 / 5, lr * 3 / 5]), rel=1e-9)


@pytest.mark.parametrize("regime", ["coherent", "random_walk"])
def test_guard_keeps_honest_workers_in_warmup_of_a_heterogeneous_plan(regime):
    """Catches the round-1 rejection of the four-region plan's H100 (norm 3.3 >
    10 x the V100's 0.25 in every quick bench run): honest pseudo-gradients whose
    norms grow like Σ η (updates aligned, early training) or like sqrt(Σ η²)
    (updates mostly noise) all pass; one worker sending 30x its honest norm is
    still dropped."""
    scales, lrs, steps, _ = _four_region_scales()
    etas = [lrs.lrs(i, s) for i, s in enumerate(steps)]
    norms = [sum(e) if regime == "coherent" else math.sqrt(sum(x * x for x in e)) for e in etas]
    codec = _codec("fp32")

    def msgs(boost: float = 1.0):
        out = []
        for i, n in enumerate(norms):
            d = _named(i)
            unit = math.sqrt(sum(float(v.pow(2).sum()) for v in d.values()))
            out.append(encode(codec, {k: v * n / unit * (boost if i == 1 else 1.0)
                                      for k, v in d.items()}, 100, worker=i))
        return out

    for boost, want in ((1.0, [100] * 4), (30.0, [100, 0, 100, 100])):
        guard = Guard(list("abcd"), list("ABCD"))
        guard.expect(dict.fromkeys(range(4), 100), dict(enumerate(scales)))
        _, tokens = aggregate(codec, msgs(boost), guard=guard)
        assert tokens == want, (boost, guard.rejected)
        assert sum(guard.rejected.values()) == (boost > 1)


@pytest.mark.parametrize("kind", ["sign_row", "fp32"])
def test_robust_aggregation_resists_a_flipped_minority(kind):
    """Catches robust modes that follow a sign-flipping insider: with 3 honest
    workers sending the same direction and one sending 50x its negation (equal
    tokens, a norm bound lifted), sign_majority keeps the honest sign everywhere
    and trimmed_mean (element-wise, the largest and smallest of 4 dropped) the
    honest values; the plain mean follows the insider."""
    codec = _codec(kind)
    base = _named(0)
    msgs = [encode(codec, base, 100, worker=k) for k in range(3)]
    msgs.append(encode(codec, {k: -v * 50 for k, v in base.items()}, 100, worker=3))
    plain, _ = aggregate(codec, msgs)
    honest, _ = aggregate(codec, msgs[:3])
    for mode in ("sign_majority", "trimmed_mean"):
        guard = Guard(list("abcd"), list("ABCD"), robust=mode, max_norm_ratio=1e9)
        agg, _ = aggregate(codec, msgs, guard=guard)
        for k in honest:
            assert torch.equal(torch.sign(agg[k]), torch.sign(honest[k])), (mode, k)
            if mode == "trimmed_mean":
                assert torch.allclose(agg[k], honest[k], rtol=1e-6), k
    assert (torch.sign(plain["b"]) != torch.sign(honest["b"])).any()  # the attack works unguarded


def test_healing_payload_round_trip_without_pickle():
    """Catches a healing state that loses tensors, dtypes or nesting, or that is
    encoded or decoded with pickle (which runs code a peer chose): the payload
    is a safetensors file (read back by safetensors' own parser, tensors and
    the JSON tree in its metadata), is not a pickle (``pickle.loads`` refuses
    it), and a pickled state — even of plain data — is refused by the decoder
    before anything in it is used.  (The old check looked for the string
    ``b"pickle"``, which a pickle does not contain.)"""
    import json
    import pickle

    from safetensors import SafetensorError
    from safetensors.torch import load as st_load

    state = {"round": 7, "plan": {"workers": [{"a": 1.5}], "x": None},
             "outer": {"params": {"w": torch.arange(6.0).reshape(2, 3)},
                       "momentum_buffer": {"w": torch.ones(2, 3, dtype=torch.float64)}}}
    payload = pack_state(state)
    out = unpack_state(payload)
    assert out["round"] == 7 and out["plan"] == state["plan"]
    assert torch.equal(out["outer"]["params"]["w"], state["outer"]["params"]["w"])
    assert out["outer"]["momentum_buffer"]["w"].dtype == torch.float64
    tensors = st_load(payload)  # the format's own parser accepts it
    assert {t.dtype for t in tensors.values()} == {torch.float32, torch.float64}
    head = json.loads(payload[8:8 + int.from_bytes(payload[:8], "little")])
    assert json.loads(head["__metadata__"]["tree"])["round"] == 7
    with pytest.raises((pickle.UnpicklingError, ValueError, EOFError)):
        pickle.loads(payload)
    for blob in (pickle.dumps(state), pickle.dumps({"round": 7})):
        with pytest.raises((ValueError, SafetensorError)):
            unpack_state(blob)


@pytest.mark.parametrize("kind", KINDS)
def test_bad_wire_bytes_are_message_errors(kind):
    """Catches a decoder that crashes (struct.error, IndexError) on short or
    garbage input instead of a MessageError naming the problem: bare parts and
    bundles, empty, short, padded, zeroed."""
    codec = _codec(kind)
    good = codec.encode(_named(0), 100, worker=0, round=0, predictor=V)
    for data in (b"", good[:20], b"GMCN" + bytes(60), good[:-1], good + b"x", b"GMBD" + bytes(3),
                 b"GMBD\xff\xff\xff\xff", join_parts([good])[:-1], join_parts([good[:50]])):
        with pytest.raises(MessageError):
            aggregate(codec, [data])


def test_overlap_with_one_job_per_region_is_refused():
    """Catches overlapped rounds combined with per-region torchft membership (its
    quorum, healing and lost-worker re-plans run only in blocking rounds): one
    ConfigError line naming both keys, before anything starts."""
    from jobruntime.config import load_config

    cfg = load_config("tiny_gpt", ["geomesh.method=geomesh", "geomesh.cluster=two_worker_real",
                                   "geomesh.overlap=0.25", "geomesh.region=East US"])
    with pytest.raises(ConfigError, match="geomesh.overlap.*geomesh.region"):
        cfg.geomesh.validate()
    cfg.geomesh.overlap = None
    cfg.geomesh.validate()
