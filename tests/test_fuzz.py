"""Fuzzed inputs (hypothesis): config loader, cluster files, wire decoder, checkpoints.

Every bad input must end as one ``ConfigError`` / ``ClusterError`` /
``MessageError`` / ``EnvelopeError`` / ``CheckpointError`` with a one-line
message (``train.py`` turns the first four into exit code 2), or as a
rejected message — never another exception, a hang or a changed ``θ``.  The
fast tier runs a few dozen examples per target, the slow tier hundreds
(:data:`EXAMPLES`); ``derandomize`` keeps the fast tier reproducible.
"""

from __future__ import annotations

import dataclasses
import math
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from geomesh.fleet.cluster import ClusterError, cluster_from_dict
from geomesh.state import load_state
from geomesh.wire.canonical import CanonicalSchema
from geomesh.wire.canonical_codec import HEADER
from geomesh.wire.compression import MessageError
from geomesh.wire.envelope import DATA, EnvelopeError, Opener, Sealer
from geomesh.wire.guard import Guard
from jobruntime.checkpoint import CheckpointError, find_checkpoint
from jobruntime.config import ConfigError, JobConfig, load_config
from tests.test_geomesh_trust import _codec, _named
from train import check_config

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = [pytest.param(30, id="fast"), pytest.param(400, id="slow", marks=pytest.mark.slow)]
KEYS = {f"{s}.{f.name}" for s in ("model", "parallel", "train", "data", "checkpoint", "logging",
                                  "geomesh", "cona")
        for f in dataclasses.fields(getattr(JobConfig(), s))}
_values = st.one_of(st.integers(-10**12, 10**12), st.floats(allow_nan=True), st.booleans(),
                    st.none(), st.text(max_size=12), st.sampled_from(["[1, 2", "{a: }", "-1",
                                                                      "nan", "inf", "1e999", ""]))


def _one_line(e: BaseException) -> None:
    text = str(e)
    assert text and "\n" not in text and "Traceback" not in text, repr(text)


def _settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=n < 100,
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("n", EXAMPLES)
def test_fuzz_config_overrides(n):
    """Catches a config value that crashes the loader or the validators
    (TypeError, OverflowError, ...) instead of a one-line ConfigError."""

    @_settings(n)
    @given(st.lists(st.tuples(st.one_of(st.sampled_from(sorted(KEYS)), st.text(max_size=15)),
                              _values), max_size=4))
    def run(pairs):
        overrides = [f"{k}={v}" for k, v in pairs]
        try:
            cfg = load_config("tiny_gpt", overrides)
            check_config(cfg, 1)
        except ConfigError as e:
            _one_line(e)

    run()


def test_every_numeric_setting_has_a_range():
    """Catches numeric settings that no validator checks: a new user's
    ``checkpoint.save_interval=-1`` saved a checkpoint every step (``step % -1
    == 0``) and ``model.mask_prob=1.5`` crashed inside megatron's dataset.
    Every int/float field of the sections ``validate_sections`` checks must
    refuse -1 (and NaN for floats) with a one-line ConfigError naming it."""
    import typing

    def check(cfg):
        check_config(cfg, 1)

    # the CONA and GeoMesh sections are read (and checked) only when switched on
    on = ["cona.enabled=true", "geomesh.method=geomesh", "geomesh.cluster=four_region"]
    accepted = []
    for section in ("model", "train", "data", "checkpoint", "cona", "geomesh"):
        obj = getattr(JobConfig(), section)
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
            if not kinds & {int, float}:  # (a Literal's names are not types: "checkpoint")
                continue
            for bad in (-1, *((float("nan"),) if float in kinds else ())):
                cfg = load_config("tiny_gpt", on)
                setattr(getattr(cfg, section), f.name, bad)
                try:
                    check(cfg)
                    accepted.append(f"{section}.{f.name}={bad}")
                except ConfigError as e:
                    _one_line(e)
                    assert f.name in str(e), (f.name, str(e))
    assert not accepted, f"accepted without a range check: {accepted}"


def test_bad_overrides_exit_2_with_one_line():
    """Catches bad input that reaches the user as a traceback: train.py with an
    unknown key, a wrong type and an out-of-range GeoMesh setting exits 2 with
    one 'error:' line each (no megatron import needed)."""
    for bad in ("geomesh.heartbeat_s=-1", "nope.key=1", "train.lr=abc",
                "geomesh.robust_aggregation=median", "cona.enabled=true cona.switch_timeout_s=0"):
        cmd = [sys.executable, str(REPO / "train.py"), *bad.split(),
               "geomesh.method=geomesh", "geomesh.cluster=two_worker"]
        if bad.startswith("cona"):
            cmd = cmd[:-2]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 2, (bad, p.stderr[-2000:])
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert len([x for x in lines if x.startswith("error:")]) == 1, (bad, p.stderr[-2000:])
        assert "Traceback" not in p.stderr, (bad, p.stderr[-2000:])


_cluster_value = st.recursive(
    _values, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                     st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)


@pytest.mark.parametrize("n", EXAMPLES)
def test_fuzz_cluster_files(n, tmp_path_factory):
    """Catches cluster YAML that crashes the parser (KeyError, TypeError, ...)
    instead of a one-line ClusterError: mutations of a valid file (a field
    replaced by a random value) and random YAML text."""
    base = yaml.safe_load((REPO / "geomesh/clusters/four_region.yaml").read_text())
    paths = [("name",), ("mode",), ("rendezvous",), ("regions",), ("workers",),
             ("workers", 0, "gpu"), ("workers", 1, "num_gpus"), ("workers", 2, "tp"),
             ("workers", 0, "region"), ("regions", 0, "id"), ("regions", 1, "name"),
             ("wan_bandwidth_scale",), ("slowdowns",)]

    @_settings(n)
    @given(st.sampled_from(paths), _cluster_value, st.text(max_size=60))
    def run(path, value, text):
        import copy

        raw = copy.deepcopy(base)
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        for candidate in (raw, text):
            try:
                if isinstance(candidate, str):
                    candidate = yaml.safe_load(candidate)
                    if not isinstance(candidate, dict):
                        continue
                cluster_from_dict(candidate)
            except ClusterError as e:
                _one_line(e)
            except yaml.YAMLError:
                pass

    run()


FUZZ_KINDS = ("sign", "sign_row", "fp32")
"""Kinds of the exchange's codec whose every number an independent reader can check."""


def _pieces_at(data: bytes) -> int:
    """Offset of a part's first piece: header, then its zlib'd schema."""
    return HEADER.size + struct.unpack_from("<I", data, 36)[0]


def _reference_decode(kind: str, data: bytes, schema: CanonicalSchema
                      ) -> tuple[dict[str, np.ndarray], int, list[float]]:
    """An independent reading (numpy, the wire format of :mod:`geomesh.wire.canonical_codec`)
    of a one-process part holding every tensor whole, whose header is valid:
    ``(values, tokens, scales)`` with values in fp64; ``scales`` are the sign
    kinds' scales (empty for fp32)."""
    tokens = struct.unpack_from("<Q", data, 20)[0]
    off, out, scales = _pieces_at(data), {}, []
    for i, (name, shape) in enumerate(schema.entries):
        nd = len(shape)
        box = struct.unpack_from(f"<I{2 * nd}I", data, off)
        assert box == (i, *(0,) * nd, *shape), f"accepted a moved piece {box} of '{name}'"
        off += 4 + 8 * nd
        n = math.prod(shape)
        if kind == "fp32":
            out[name] = np.frombuffer(data, "<f4", n, off).astype(np.float64).reshape(shape)
            off += 4 * n
            continue
        rows = shape[0] if kind == "sign_row" and nd >= 2 else 1
        m = np.frombuffer(data, "<f4", rows, off).astype(np.float64)
        scales += m.tolist()
        off += 4 * rows
        bits = np.unpackbits(np.frombuffer(data, np.uint8, (n + 7) // 8, off))[:n]
        off += (n + 7) // 8
        out[name] = (np.where(bits == 1, 1.0, -1.0).reshape(rows, -1) * m[:, None]).reshape(shape)
    return out, tokens, scales


def _number_offsets(kind: str, data: bytes, schema: CanonicalSchema) -> list[int]:
    """Byte offsets of every fp32 number (sign scales or fp32 values) in a part."""
    offs, off = [], _pieces_at(data)
    for _, shape in schema.entries:
        off += 4 + 8 * len(shape)
        n = math.prod(shape)
        k = n if kind == "fp32" else shape[0] if kind == "sign_row" and len(shape) >= 2 else 1
        offs += [off + 4 * i for i in range(k)]
        off += 4 * k + (0 if kind == "fp32" else (n + 7) // 8)
    return offs


@pytest.mark.parametrize("n", EXAMPLES)
def test_fuzz_wire_decoder_never_changes_theta(n):
    """Catches decoder crashes on hostile bytes and hostile bodies that move θ.

    Worker 2 is an insider: its mutated part of the exchange's canonical codec
    (random byte flips in header, schema, piece boxes, scales, signs and values;
    fp32 numbers — NaN, ±inf, negative, huge — written over scales or values; any
    token count) carries a valid CRC-32 and is sealed in a valid envelope, so it
    reaches the body parser (an outsider's copy of the same bytes never opens,
    EnvelopeError).  Then either the guard rejects it and the aggregate equals
    the honest two workers' exactly, or it is accepted and an independent
    reading of its bytes (:func:`_reference_decode`) finds its pieces where an
    honest part puts them, finite values and non-negative scales — what an
    honest encoder can send — and the aggregate equals ``Σ n_i D(msg_i) / Σ n_i``
    of the three independent readings (fp64 reference, fp32 arithmetic: rtol
    1e-5).  Decoded alone without the guard it is a one-line MessageError or
    exactly its independent reading.  At least half the examples must get past
    the CRC and the header."""
    codecs = {k: _codec(k) for k in FUZZ_KINDS}
    schema = codecs["fp32"].schema
    honest = {k: [c.encode(_named(i), 100, worker=i, round=0) for i in range(2)]
              for k, c in codecs.items()}
    good = {k: c.encode(_named(2), 100, worker=2, round=0) for k, c in codecs.items()}
    offsets = {k: _number_offsets(k, good[k], schema) for k in codecs}
    sealer = Sealer(b"s" * 32, 7)
    seen = {"examples": 0, "past_crc": 0, "accepted": 0, "values_rejected": 0}
    numbers = st.floats(width=32, allow_nan=True, allow_infinity=True)
    head = HEADER.size

    flip = st.tuples(st.integers(0, 10**6), st.integers(1, 255))

    @_settings(n)
    @given(st.sampled_from(FUZZ_KINDS), st.tuples(st.integers(0, 3), flip),
           st.lists(flip, max_size=3), st.lists(st.tuples(st.floats(0, 1), numbers),
                                               max_size=2),
           st.one_of(st.none(), st.integers(0, 2**64 - 1), st.integers(90, 110)))
    @example("sign", (0, (0, 1)), [], [(0.99, math.nan)], None)  # a tensor scale: NaN
    @example("sign_row", (0, (0, 1)), [], [(0.5, -0.5)], None)  # a row scale: negative
    def run(kind, head_flip, flips, writes, tokens):
        codec, raw = codecs[kind], bytearray(good[kind])
        body = len(raw) - 4
        if head_flip[0] == 3:  # about one example in four: a flip in the 44-byte header
            raw[head_flip[1][0] % head] ^= head_flip[1][1]
        for at, x in flips:  # schema, boxes, scales, signs, values
            raw[head + at % (body - head)] ^= x
        for at, v in writes:
            where = offsets[kind]  # at: where among the part's fp32 numbers
            struct.pack_into("<f", raw, where[min(int(at * len(where)), len(where) - 1)], v)
        if tokens is not None:
            struct.pack_into("<Q", raw, 20, tokens)
        struct.pack_into("<I", raw, body, zlib.crc32(raw[:body]))  # an insider's valid CRC
        data = bytes(raw)
        opener = Opener(b"s" * 32, 7)
        with pytest.raises(EnvelopeError):  # an outsider's bytes never open
            opener.open(data, round=0, sender=2)
        data = opener.open(sealer.seal(data, kind=DATA, round=0, worker=2), round=0,
                           sender=2).body
        seen["examples"] += 1
        # magic, version, codec, top-k setting, digest, schema length, piece count intact
        seen["past_crc"] += data[:12] == good[kind][:12] and data[28:head] == good[kind][28:head]
        guard = Guard(["a", "b", "c"], ["A", "B", "C"])
        guard.expect({0: 100, 1: 100, 2: 100})
        agg, tokens_out = codec.aggregate([*honest[kind], data], guard=guard)
        ref, _ = codec.aggregate(honest[kind])
        reason = guard.last_rejected.get(2)
        if tokens_out[2] == 0:  # rejected: θ moves exactly as without it
            seen["values_rejected"] += reason in ("non_finite", "norm", "element", "tokens")
            for k in ref:
                assert torch.equal(agg[k], ref[k])
        else:
            seen["accepted"] += 1
            readings = [_reference_decode(kind, m, schema) for m in [*honest[kind], data]]
            values, count, scales = readings[2]
            assert all(np.isfinite(v).all() for v in values.values()), "accepted NaN/Inf"
            assert all(m >= 0 for m in scales), f"accepted a negative scale: {scales}"
            total = sum(r[1] for r in readings)
            for k in ref:
                want = sum(r[1] * r[0][k] for r in readings) / total
                assert np.allclose(agg[k].double().numpy(), want, rtol=1e-5, atol=1e-7), k
        try:
            alone, (count,) = codec.aggregate([data])
        except MessageError as e:
            _one_line(e)
        except ValueError as e:  # zero tokens: nothing to weight
            assert "tokens" in str(e)
        else:
            values, _, scales = _reference_decode(kind, data, schema)
            assert all(m >= 0 for m in scales), f"decoded a negative scale: {scales}"
            for k, v in values.items():
                assert np.isfinite(v).all() and torch.isfinite(alone[k]).all(), k
                assert np.array_equal(alone[k].double().numpy(), v.astype(np.float32)), k

    run()
    assert seen["past_crc"] >= seen["examples"] / 2, seen
    assert seen["accepted"] and seen["values_rejected"], seen
    with pytest.raises(MessageError):
        codecs["sign"].decode([b""])


@pytest.mark.parametrize("n", EXAMPLES)
def test_fuzz_checkpoint_files(n, tmp_path_factory):
    """Catches checkpoint readers that crash on damaged files: random bytes as a
    GeoMesh rank file, and as a run's checkpoints/ folder, end in one-line
    CheckpointErrors."""
    root = tmp_path_factory.mktemp("ckpt")

    @_settings(n)
    @given(st.binary(max_size=400), st.text(max_size=20))
    def run(blob, latest):
        folder = root / "checkpoints" / "outer_0000001"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "COMPLETE").write_text("x")
        (folder / "rank00000.pt").write_bytes(blob)
        (root / "checkpoints" / "latest").write_text(latest)
        with pytest.raises(CheckpointError) as e:
            load_state(root / "checkpoints", rank=0)
        _one_line(e.value)
        empty = root / "empty"
        empty.mkdir(exist_ok=True)
        (empty / "latest").write_text(latest)
        with pytest.raises(CheckpointError) as e:
            find_checkpoint(empty)
        _one_line(e.value)

    run()


class _RunsCode:
    """Pickles to a call of ``Path.touch`` on unpickling: what a hostile
    checkpoint file does with ``torch.load(weights_only=False)``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_checkpoint_that_runs_code_is_refused(tmp_path):
    """Catches a GeoMesh resume that unpickles arbitrary objects: its rank file
    was read with ``weights_only=False``, so a crafted file ran code on load.
    It must be a one-line CheckpointError, and the code must not run; a real
    state (tensors and a plan) still loads."""
    from geomesh.fleet.plan import Plan, WorkerPlan

    folder = tmp_path / "checkpoints" / "outer_0000001"
    folder.mkdir(parents=True)
    (folder / "COMPLETE").write_text("x")
    marker = tmp_path / "pwned"
    torch.save({"method": "geomesh", "round": 1, "outer": {}, "x": _RunsCode(marker)},
               folder / "rank00000.pt")
    with pytest.raises(CheckpointError) as e:
        load_state(tmp_path / "checkpoints", rank=0)
    _one_line(e.value)
    assert not marker.exists(), "loading the checkpoint ran code"
    w = WorkerPlan(worker="a", micro_batch_size=1, grad_accum=2, dp=1, batch_size=2,
                   inner_steps=3, seq_length=64, tokens=384, step_time_s=0.5, compute_s=1.5,
                   memory_bytes=1.0, memory_limit_bytes=2.0)
    plan = Plan(workers=(w,), target_tokens=384, tolerance=0.05)
    torch.save({"method": "geomesh", "round": 1, "outer": {"theta": torch.ones(3)}, "plan": plan},
               folder / "rank00000.pt")
    state = load_state(tmp_path / "checkpoints", rank=0)
    assert state["plan"] == plan and torch.equal(state["outer"]["theta"], torch.ones(3))


def test_binary_or_unreadable_preset_is_a_config_error(tmp_path):
    """Catches a UnicodeDecodeError traceback from ``--config`` given a binary
    file (a fresh-user pass tried one): a one-line ConfigError naming the file."""
    blob = tmp_path / "model.bin"
    blob.write_bytes(bytes(range(256)))
    with pytest.raises(ConfigError) as e:
        load_config(blob)
    _one_line(e.value)
    assert "model.bin" in str(e.value)
