"""No identity or figure of a message is trusted beyond what its envelope authenticates.

Pure logic, no processes.  An insider holds the run's secret, so its envelope
opens in its own slot (:mod:`geomesh.wire.envelope` binds slot, run and round); what
it writes *inside* — the codec header's worker id, round, version, piece
count, token count, the values, and the loss and compute seconds riding along —
is checked here, one test per kind (issue 25, "a self-reported identity is
trusted").  The hostile messages are shared with ``bench/faults.py``
(:func:`forged_cases`).
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

from geomesh.wire.compression import MessageError
from geomesh.wire.envelope import DATA, Opener, Sealer
from geomesh.wire.guard import Guard
from tests.test_geomesh_trust import KINDS, V, _codec, _crc, _named, aggregate, encode

SECRET, RUN = b"i" * 32, 77


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
    honest = [encode(codec, _named(k), 100, worker=k, round=round) for k in range(2)]
    cases = {
        "claims_999": encode(codec, _named(2), 10**12, worker=999, round=round),
        "borrows_0": encode(codec, _named(2, 1e6), 100, worker=0, round=round),
        "other_round": encode(codec, _named(2), 100, worker=2, round=round - 1),
    }
    return {k: [*honest, v] for k, v in cases.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_forged_header_identity_is_dropped_and_blames_its_slot(kind):
    """Catches the guard keying its checks on the codec header's worker id: a
    header claiming worker 999 with 10^12 tokens took 100 % of the aggregate's
    weight (no expected token count for an unknown id); one borrowing worker 0's
    id got the honest worker 0 blamed (``last_rejected`` = {0: 'norm'}, dropped
    as lost).  Now the aggregate equals the two honest workers' exactly, slot 2
    gets 0 tokens and the only rejection is slot 2's, reason ``identity`` (``round`` for
    its own id with another round's header, which stops a job in its first round:
    tests/test_geomesh_launch.py's resume)."""
    codec = _codec(kind)
    for name, msgs in forged_cases(codec).items():
        guard = _guard()
        agg, tokens = aggregate(codec, _through_envelope(msgs), guard=guard, round=5)
        ref, _ = aggregate(codec, msgs[:2])
        assert tokens == [100, 100, 0], name
        why = "round" if name == "other_round" else "identity"  # a replay, or another start
        assert guard.last_rejected == {2: why}, (name, guard.last_rejected)
        for k in ref:
            assert torch.equal(agg[k], ref[k]), (name, k)


def test_worker_without_planned_tokens_has_no_weight():
    """Catches ``expected.get(k) is None`` passing the token check: a worker the
    plan gives no tokens this round (not a member, or an id outside the cluster)
    must not be weighted, whatever it claims."""
    guard = _guard(2)
    assert guard.screen([0, 1, 7], [100, 100, 10**12], [1.0, 1.0, 1.0]) == [0, 1]
    assert guard.last_rejected == {7: "tokens"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("field", ["version", "more_pieces", "fewer_pieces"])
def test_decoder_checks_version_and_piece_count(kind, field):
    """Catches a decoder that ignores the header's version or piece count: a part
    of wire version 2, or announcing one piece more or fewer than it carries, with
    a valid CRC, is a ``MessageError`` naming the problem, not decoded as version 1
    or cut short."""
    codec = _codec(kind)
    raw = bytearray(codec.encode(_named(0), 100, worker=0, round=0, predictor=V))
    if field == "version":
        struct.pack_into("<H", raw, 4, 2)
    else:
        struct.pack_into("<I", raw, 40, 2 + (1 if field == "more_pieces" else -1))
    want = {"version": "version 2", "more_pieces": "truncated", "fewer_pieces": "overlong"}
    with pytest.raises(MessageError, match=want[field]):
        aggregate(codec, [_crc(raw)])


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


@pytest.mark.parametrize("kind", ["sign_row", "fp32", "topk"])
def test_one_element_cannot_carry_a_workers_whole_norm(kind):
    """Catches a worker putting its whole permitted norm into one element (one row
    with row scales: every element of a row decodes to the row's mean): the
    norm check passed it (same norm as an honest message) and θ moved by
    ‖Δ‖ in one weight.  Now its crest factor (peak / RMS of the tensor, 90.5 and
    256 here) exceeds MAX_PEAK_RATIO = 64: dropped, reason ``element``; honest
    workers' crest factors (< 6 measured) pass and the aggregate is theirs."""
    named = [_big(k) for k in range(3)]
    codec = _codec(kind, named[0])
    target = "e" if kind == "sign_row" else "w"
    msgs = [encode(codec, named[k], 100, worker=k) for k in range(2)]
    msgs.append(encode(codec, spike(named[2], target), 100, worker=2))
    guard = _guard()
    agg, tokens = aggregate(codec, msgs, guard=guard)
    ref, _ = aggregate(codec, msgs[:2])
    assert tokens == [100, 100, 0] and guard.last_rejected == {2: "element"}, guard.last_rejected
    assert all(torch.equal(agg[k], ref[k]) for k in ref)
    honest = _guard()  # the same round with worker 2 honest: nobody is dropped
    aggregate(codec, [*msgs[:2], encode(codec, named[2], 100, worker=2)], guard=honest)
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


def test_a_peer_of_another_round_stops_a_job_only_in_its_first_round():
    """Catches a job that trains on alone when its peers resumed another round (before:
    each region dropped the others as forged and finished on its own weights, exit 0),
    and one that stops on an honest run: a ``round`` rejection in the job's first round
    raises a ``CheckpointError`` naming the peer's region; later (a replay), or an
    ``identity`` rejection, only drops the worker."""
    from types import SimpleNamespace

    from geomesh.sync import OuterLoop
    from jobruntime.checkpoint import CheckpointError

    workers = [SimpleNamespace(name=f"w{k}", region=f"R{k}") for k in range(3)]
    loop = SimpleNamespace(start=4, guard=SimpleNamespace(last_rejected={}), ft=None,
                           ctx=SimpleNamespace(cluster=SimpleNamespace(workers=workers)))
    for first, rejected in ((4, {}), (4, {2: "identity"}), (5, {2: "round"})):
        loop.guard.last_rejected = rejected
        OuterLoop.refuse_other_start(loop, first)  # no raise
    loop.guard.last_rejected = {1: "round", 2: "norm"}
    with pytest.raises(CheckpointError, match=r"^'R1' sent messages of another round in this "
                       r"job's first round \(4\): the regions started from checkpoints of "
                       "different outer steps"):
        OuterLoop.refuse_other_start(loop, 4)
    # a peer whose envelope names another run identity (other settings) in the first
    # round: a ConfigError naming the region and the parts that differ; later, dropped
    from jobruntime.config import ConfigError

    loop.guard.last_rejected = {}
    lost = []
    loop.ft = SimpleNamespace(other_run={2: ["geomesh", "tokenizer"]},
                              lost=lambda r, ks, why: lost.append((r, ks, why)))
    OuterLoop.refuse_other_start(loop, 5)  # later: a lost worker, the policy decides
    assert lost == [(5, [2], {2: "message sealed for another run (settings differ: geomesh, "
                                 "tokenizer)"})]
    with pytest.raises(ConfigError, match=r"^'R2' runs with other settings than this region "
                       r"\(part\(s\) that differ: geomesh, tokenizer\) \(the tokenizer differs"):
        OuterLoop.refuse_other_start(loop, 4)
