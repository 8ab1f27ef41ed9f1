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
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geomesh.cluster import ClusterError, cluster_from_dict
from geomesh.codec import DenseCodec, SignCodec
from geomesh.compression import MessageError, TensorSchema, decode_message
from geomesh.context import _validate
from geomesh.envelope import DATA, EnvelopeError, Opener, Sealer
from geomesh.guard import Guard
from geomesh.state import load_state
from jobruntime.checkpoint import CheckpointError, find_checkpoint
from jobruntime.config import ConfigError, JobConfig, load_config

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
            cfg.validate_sections()
            if cfg.geomesh.method != "none":
                _validate(cfg)
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
        cfg.validate_sections()
        _validate(cfg)

    # the CONA and GeoMesh sections are read (and checked) only when switched on
    on = ["cona.enabled=true", "geomesh.method=geomesh", "geomesh.cluster=four_region"]
    accepted = []
    for section in ("model", "train", "data", "checkpoint", "cona", "geomesh"):
        obj = getattr(JobConfig(), section)
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            kind = str(hints[f.name])
            if not ("int" in kind or "float" in kind):
                continue
            for bad in (-1, *((float("nan"),) if "float" in kind else ())):
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


def _named(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(6, 8, generator=g), "b": torch.randn(7, generator=g)}


@pytest.mark.parametrize("n", EXAMPLES)
def test_fuzz_wire_decoder_never_changes_theta(n):
    """Catches decoder crashes on hostile bytes and hostile bytes that move θ:
    worker 2's message is random or a mutated valid message; opening its
    envelope fails (EnvelopeError) or, sealed by an insider, the guard rejects
    it or it decodes to a valid message — the aggregate then equals what the
    same round gives with that message's own decoded values, and without the
    guard every failure is a MessageError."""
    schema = dataclasses.replace(TensorSchema.from_tensors(_named(0)), row_scales=True)
    codecs = {"sign": SignCodec(schema), "fp32": DenseCodec(schema)}
    honest = {k: [c.encode(_named(i), 100, worker=i, round=0) for i in range(2)]
              for k, c in codecs.items()}
    sealer, good = Sealer(b"s" * 32, 7), codecs["sign"].encode(_named(2), 100, worker=2, round=0)

    @_settings(n)
    @given(st.sampled_from(["sign", "fp32"]), st.one_of(
        st.binary(max_size=300),
        st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)).map(
            lambda t: good[:t[0]] + bytes([good[t[0]] ^ t[1]]) + good[t[0] + 1:]),
        st.integers(0, len(good)).map(lambda n: good[:n])))
    def run(kind, data):
        codec = codecs[kind]
        opener = Opener(b"s" * 32, 7)
        with pytest.raises(EnvelopeError):  # an outsider's bytes never open
            opener.open(data, round=0, sender=2)
        opener.open(sealer.seal(data, kind=DATA, round=0, worker=2), round=0, sender=2)
        guard = Guard(["a", "b", "c"], ["A", "B", "C"])
        guard.expect({0: 100, 1: 100, 2: 100})
        agg, tokens = codec.aggregate([*honest[kind], data], guard=guard)
        ref, _ = codec.aggregate(honest[kind])
        if tokens[2] == 0:  # rejected: θ moves exactly as without it
            for k in ref:
                assert torch.equal(agg[k], ref[k])
        else:
            assert all(torch.isfinite(v).all() for v in agg.values())
        try:
            codec.aggregate([data])
        except MessageError as e:
            _one_line(e)
        except ValueError as e:  # zero tokens: nothing to weight
            assert "tokens" in str(e)

    run()
    with pytest.raises(MessageError):
        decode_message(b"", schema)


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
    from geomesh.planner import Plan, WorkerPlan

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
