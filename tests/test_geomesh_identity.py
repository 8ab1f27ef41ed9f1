"""No identity or figure of a message is trusted beyond what its envelope authenticates.

Pure logic, no processes.  An insider holds the run's secret, so its envelope
opens in its own slot (:mod:`geomesh.envelope` binds slot, run and round); what
it writes *inside* — the codec header's worker id, round, version, tensor
count, token count, the values, and the loss and compute seconds riding along —
is checked here, one test per kind (issue 25, "a self-reported identity is
trusted").  The hostile messages are shared with ``bench/faults.py``
(:func:`forged_cases`).
"""

from __future__ import annotations

import dataclasses
import math
import struct
import zlib

import pytest
import torch

from geomesh.codec import DenseCodec, SignCodec
from geomesh.compression import MessageError, TensorSchema
from geomesh.envelope import DATA, Opener, Sealer
from geomesh.guard import Guard
from geomesh.predict import PredictiveSignCodec
from geomesh.sparse import TopKCodec

SECRET, RUN = b"i" * 32, 77
KINDS = ["sign", "fp32", "topk", "sign_pred"]


def _named(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(6, 8, generator=g) * scale, "b": torch.randn(7, generator=g) * scale}


def _codec(kind: str, named=None):
    schema = dataclasses.replace(TensorSchema.from_tensors(named or _named(0)),
                                 row_scales=kind in ("sign", "sign_pred"))
    if kind == "topk":
        return TopKCodec(schema, chunk=4, k=2)
    if kind == "sign_pred":
        return PredictiveSignCodec(schema)
    return SignCodec(schema) if kind == "sign" else DenseCodec(schema)


def _guard(k: int = 3) -> Guard:
    guard = Guard([f"w{i}" for i in range(k)], [f"R{i}" for i in range(k)])
    guard.expect({i: 100 for i in range(k)})
    return guard


def _through_envelope(msgs: list[bytes], round: int = 5) -> list[bytes]:
    """Each worker seals its body in its own slot; the receiver opens them all."""
    opener = Opener(SECRET, RUN)
    return [opener.open(Sealer(SECRET, RUN).seal(m, kind=DATA, round=round, worker=k),
                        round=round, sender=k).body for k, m in enumerate(msgs)]


def forged_cases(codec, round: int = 5) -> dict[str, list[bytes]]:
    """Rounds of 3 workers where worker 2 (slot 2, a valid envelope) forges its header.

    ``claims_999``: worker 999 with 10^12 tokens; ``borrows_0``: worker 0's id with
    absurd values (the guard would blame worker 0); ``other_round``: its own id
    and honest values, a header of round ``round - 1`` (a message of the last
    round replayed inside a fresh envelope).
    """
    honest = [codec.encode(_named(k), 100, worker=k, round=round) for k in range(2)]
    cases = {
        "claims_999": codec.encode(_named(2), 10**12, worker=999, round=round),
        "borrows_0": codec.encode(_named(2, 1e6), 100, worker=0, round=round),
        "other_round": codec.encode(_named(2), 100, worker=2, round=round - 1),
    }
    return {k: [*honest, v] for k, v in cases.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_forged_header_identity_is_dropped_and_blames_its_slot(kind):
    """Catches the guard keying its checks on the codec header's worker id: a
    header claiming worker 999 with 10^12 tokens took 100 % of the aggregate's
    weight (no expected token count for an unknown id); one borrowing worker 0's
    id got the honest worker 0 blamed (``last_rejected`` = {0: 'norm'}, dropped
    as lost).  Now the aggregate equals the two honest workers' exactly, slot 2
    gets 0 tokens and the only rejection is slot 2's, reason ``identity``."""
    codec = _codec(kind)
    for name, msgs in forged_cases(codec).items():
        guard = _guard()
        agg, tokens = codec.aggregate(_through_envelope(msgs), guard=guard, round=5)
        ref, _ = codec.aggregate(msgs[:2])
        assert tokens == [100, 100, 0], name
        assert guard.last_rejected == {2: "identity"}, (name, guard.last_rejected)
        for k in ref:
            assert torch.equal(agg[k], ref[k]), (name, k)


def test_worker_without_planned_tokens_has_no_weight():
    """Catches ``expected.get(k) is None`` passing the token check: a worker the
    plan gives no tokens this round (not a member, or an id outside the cluster)
    must not be weighted, whatever it claims."""
    guard = _guard(2)
    assert guard.screen([0, 1, 7], [100, 100, 10**12], [1.0, 1.0, 1.0]) == [0, 1]
    assert guard.last_rejected == {7: "tokens"}


@pytest.mark.parametrize("kind", ["fp32", "topk"])
@pytest.mark.parametrize("field", ["version", "count"])
def test_fp32_and_topk_decoders_check_version_and_tensor_count(kind, field):
    """Catches the fp32 and top-k decoders ignoring the header's version and
    tensor-count fields (the sign decoder checked them): a message of wire
    version 2, or announcing one tensor more, with a valid CRC, is a
    ``MessageError`` naming the field, not decoded as version 1."""
    codec = _codec(kind)
    raw = bytearray(codec.encode(_named(0), 100, worker=0, round=0))
    if field == "version":
        struct.pack_into("<H", raw, 4, 2)
    else:
        struct.pack_into("<I", raw, 32, len(codec.schema.entries) + 1)
    struct.pack_into("<I", raw, len(raw) - 4, zlib.crc32(raw[:-4]))
    with pytest.raises(MessageError, match="version 2" if field == "version" else "tensors"):
        codec.aggregate([bytes(raw)])


def _big(seed: int) -> dict[str, torch.Tensor]:
    """A tensor of 8192 rows (sign row scales) or 256 x 256 (fp32, top-k): large
    enough that a spike exceeds 64 x the RMS (crest <= sqrt(elements) always)."""
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g), "e": torch.randn(8192, 2, generator=g)}


def spike(named: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """``named`` with tensor ``name`` replaced by one nonzero element (sign row
    scales: one nonzero row) carrying that tensor's whole norm; the total norm is
    unchanged, so the norm check (3) passes it."""
    out = dict(named)
    t = torch.zeros_like(named[name])
    t.view(t.shape[0], -1)[0] = named[name].norm() / math.sqrt(t[0].numel())
    if name == "w":  # fp32 / top-k: one element
        t.zero_()
        t[0, 0] = named[name].norm()
    out[name] = t
    return out


@pytest.mark.parametrize("kind", ["sign", "fp32", "topk"])
def test_one_element_cannot_carry_a_workers_whole_norm(kind):
    """Catches a worker putting its whole permitted norm into one element (one row
    with row scales: every element of a row decodes to the row's mean): the
    norm check passed it (same norm as an honest message) and θ moved by
    ‖Δ‖ in one weight.  Now its crest factor (peak / RMS of the tensor, 90.5 and
    256 here) exceeds MAX_PEAK_RATIO = 64: dropped, reason ``element``; honest
    workers' crest factors (< 6 measured) pass and the aggregate is theirs."""
    named = [_big(k) for k in range(3)]
    schema = dataclasses.replace(TensorSchema.from_tensors(named[0]), row_scales=kind == "sign")
    codec = {"sign": SignCodec, "fp32": DenseCodec}.get(kind, TopKCodec)(schema)
    target = "e" if kind == "sign" else "w"
    msgs = [codec.encode(named[k], 100, worker=k, round=0) for k in range(2)]
    msgs.append(codec.encode(spike(named[2], target), 100, worker=2, round=0))
    guard = _guard()
    agg, tokens = codec.aggregate(msgs, guard=guard)
    ref, _ = codec.aggregate(msgs[:2])
    assert tokens == [100, 100, 0] and guard.last_rejected == {2: "element"}, guard.last_rejected
    assert all(torch.equal(agg[k], ref[k]) for k in ref)
    honest = _guard()  # the same round with worker 2 honest: nobody is dropped
    codec.aggregate([*msgs[:2], codec.encode(named[2], 100, worker=2, round=0)], guard=honest)
    assert not honest.rejected and honest.max_peak_ratio == 64.0


def lying_figures() -> dict[str, tuple[list[float], list[float]]]:
    """``(losses, compute seconds)`` of 3 workers where worker 2 lies, one case per lie."""
    loss, sec = [4.10, 4.05], [12.0, 12.5]
    return {"nan_loss": ([*loss, math.nan], [*sec, 12.2]),
            "negative_loss": ([*loss, -3.0], [*sec, 12.2]),
            "tiny_loss": ([*loss, 1e-3], [*sec, 12.2]),
            "huge_compute": ([*loss, 4.07], [*sec, 999_999.9]),
            "zero_compute": ([*loss, 4.07], [*sec, 0.0]),
            "inf_compute": ([*loss, 4.07], [*sec, math.inf])}


def test_lying_loss_and_compute_figures_are_left_out():
    """Catches the loss and compute seconds riding along with a message being used
    unchecked: a NaN loss made the logged loss NaN on both jobs, 999,999.9 s made
    the idle statistics 999,999.9 s and re-planned b_i and H_i from it, 0 s
    crashed the re-plan (``replan: step time must be positive``).  Each lie
    leaves exactly the liar's figures out (counted under ``figures``) and keeps
    the honest ones; honest figures of different sizes (a 5x straggler) pass;
    with two workers a lie removes both figures (nobody can tell which is
    true), so the round neither logs a lie nor re-plans on one."""
    for name, (losses, sec) in lying_figures().items():
        guard = _guard()
        assert guard.screen_figures([0, 1, 2], losses, sec) == [0, 1], name
        assert guard.rejected == {"figures": 1} and not guard.last_rejected, name
    guard = _guard()
    assert guard.screen_figures([0, 1, 2], [4.1, 4.3, 3.9], [10.0, 11.0, 50.0]) == [0, 1, 2]
    assert guard.screen_figures([0, 1], [4.1, math.nan], [10.0, 11.0]) == [0]
    assert guard.screen_figures([0, 1], [4.1, 4.2], [10.0, 999_999.9]) == []
