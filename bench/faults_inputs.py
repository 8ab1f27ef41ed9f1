"""Hostile messages and bad inputs of ``bench/faults.py``: in process, no job runs.

Hostile messages go through the same Opener and Guard as a run (the cases are
``tests/test_geomesh_trust.py``'s); bad inputs are seeded random config overrides,
cluster files, region shapes, wire bytes and checkpoint files, each given to the loader
a user's input meets (the config to ``train.py``'s own check), counted when it is bad,
and clean when the error is the loader's one-line error type.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def hostile() -> tuple[int, int]:
    """Hostile messages tried and rejected (envelopes, then sealed insiders)."""
    from geomesh.wire.envelope import DATA, EnvelopeError, Opener, Sealer
    from geomesh.wire.guard import Guard
    from tests.test_geomesh_trust import KINDS, _codec, aggregate, hostile_cases

    tried = rejected = 0
    s, o = Sealer(b"s" * 32, 1), Opener(b"s" * 32, 1)
    ok = s.seal(b"m", kind=DATA, round=5, worker=1)
    o.open(ok, round=5, sender=1)
    forged = bytearray(ok)
    forged[20] ^= 1
    envelopes = [ok, bytes(forged), s.seal(b"m", kind=DATA, round=4, worker=1),
                 Sealer(b"s" * 32, 2).seal(b"m", kind=DATA, round=5, worker=1),
                 Sealer(b"t" * 32, 1).seal(b"m", kind=DATA, round=5, worker=1),
                 s.seal(b"m", kind=DATA, round=5, worker=0), ok[:50],
                 ok[:4] + b"\x09\x00" + ok[6:]]
    for e in envelopes:
        tried += 1
        try:
            o.open(e, round=5, sender=1)
        except EnvelopeError:
            rejected += 1
    for kind in KINDS:  # the exchange's codec, every kind (tests.test_geomesh_trust)
        codec = _codec(kind)
        for msgs in hostile_cases(codec).values():
            guard = Guard(["a", "b", "c"], ["A", "B", "C"])
            guard.expect({0: 100, 1: 100, 2: 100})
            _, tokens = aggregate(codec, msgs, guard=guard)
            tried += 1
            rejected += tokens[2] == 0 and tokens[:2] == [100, 100]
    return tried, rejected


def forged_identity() -> dict:
    """An insider (valid envelope in its own slot) forging its codec header, every codec.

    Per codec, worker 2's header claims worker 999 with 10^12 tokens, borrows
    worker 0's id (with absurd values), or names the last round
    (:func:`tests.test_geomesh_identity.forged_cases`).  Rejected: the forger
    gets 0 tokens, the honest two keep theirs and the aggregate is exactly
    theirs; ``honest_blamed`` counts rounds where an honest worker was dropped.
    """
    import torch

    from geomesh.wire.guard import Guard
    from tests.test_geomesh_identity import _through_envelope, forged_cases
    from tests.test_geomesh_trust import KINDS, _codec, aggregate

    out = {"kind": "forged_identity", "tried": 0, "rejected": 0, "honest_blamed": 0}
    for kind in KINDS:
        codec = _codec(kind)
        for msgs in forged_cases(codec).values():
            guard = Guard(["a", "b", "c"], ["A", "B", "C"])
            guard.expect({0: 100, 1: 100, 2: 100})
            agg, tokens = aggregate(codec, _through_envelope(msgs), guard=guard, round=5)
            ref, _ = aggregate(codec, msgs[:2])
            out["tried"] += 1
            out["rejected"] += tokens == [100, 100, 0] and all(
                torch.equal(agg[k], ref[k]) for k in ref)
            out["honest_blamed"] += bool(set(guard.last_rejected) - {2})
    return out


def lying_statistics() -> dict:
    """An insider lying about the figures that ride with its message: a NaN or negative
    or tiny loss, 999,999.9, 0 or infinite compute seconds
    (:func:`tests.test_geomesh_identity.lying_figures`), and a two-worker lie.
    Rejected: exactly the liar's figures are left out of the logged loss, the idle
    statistics and the re-plan (with two workers: both, nobody can tell which is
    true); ``honest_left_out`` counts honest figures dropped with three workers."""
    from geomesh.wire.guard import Guard
    from tests.test_geomesh_identity import lying_figures

    out = {"kind": "lying_statistics", "tried": 0, "rejected": 0, "honest_left_out": 0}
    cases = list(lying_figures().values())
    for losses, seconds in cases:
        guard = Guard(["a", "b", "c"], ["A", "B", "C"])
        kept = guard.screen_figures([0, 1, 2], losses, seconds)
        out["tried"] += 1
        out["rejected"] += 2 not in kept
        out["honest_left_out"] += 2 - len(set(kept) & {0, 1})
    two = Guard(["a", "b"], ["A", "B"]).screen_figures([0, 1], [4.1, 4.2], [10.0, 999_999.9])
    out["tried"] += 1
    out["rejected"] += 1 not in two
    return out


HOSTILE_KINDS = (forged_identity, lying_statistics)
"""Hostile kinds with their own JSON entry (``hostile_kinds``), counted in ``hostile_*``."""


#: Valid jobs a wrong setting is drawn into (``tiny_gpt`` plus these overrides): one job,
#: an emulated GeoMesh run, CONA on its emulated clock.  A random value of a random key
#: mostly fails the loader's type check; these reach the sections' own checks.
CONFIG_BASES = {
    "job": [],
    "geomesh": ["geomesh.method=diloco", "geomesh.cluster=geomesh/clusters/four_region.yaml"],
    "cona_emulated": ["cona.enabled=true", "cona.clock=emulated"],
}
#: Settings of the right type that are wrong for their base (one process) or that it would
#: ignore, each refused by ``train.check_config`` before the heavy imports.
WRONG_SETTINGS = {
    "job": [["parallel.tp=3"], ["parallel.pp=2"], ["parallel.global_batch_size=7"],
            ["parallel.global_batch_size=33554432"],
            ["parallel.sequence_parallel=true"], ["model.hidden_size=7"],
            ["cona.min_gain=0.1"], ["geomesh.outer_steps=3"],  # ignored: feature off
            ["train.zero_shot_tasks=[x.jsonl]", "cona.enabled=true"]],
    "geomesh": [["geomesh.region=East US"], ["geomesh.mode=real"],
                ["geomesh.method=async", "geomesh.mode=real"],
                ["geomesh.cluster=two_worker_real"],
                ["geomesh.cluster=two_worker_real", "geomesh.region=Mars"],
                ["geomesh.cluster=two_worker_real", "geomesh.region=East US"],  # no secret
                ["geomesh.target_model=gpt3_13b"],
                ["geomesh.target_model=geomesh/clusters/four_region.yaml"],
                ["geomesh.cluster=model_configs/tiny_gpt.yaml"],
                ["cona.enabled=true"], ["parallel.tp=2"],  # the cluster lays out regions
                ["geomesh.overlap=0.1"], ["geomesh.fragments=4"],  # other methods' keys
                ["geomesh.heartbeat_s=3"],  # real mode's; four_region is emulated
                ["train.iters=4"]],  # a GeoMesh run lasts geomesh.outer_steps rounds
    "cona_emulated": [["cona.target_model=gpt3_13b"],
                      ["cona.target_model=geomesh/clusters/four_region.yaml"],
                      ["cona.gpu=Z100"], ["cona.batch_ratio=0"], ["cona.clock=wall", "cona.num_gpus=8"],
                      ["cona.global_batch_sizes=[]"], ["cona.global_batch_sizes=[8.5]"],
                      ["cona.batch_ratio=8", "cona.global_batch_sizes=[12]"],
                      ["cona.clock=wall", "cona.step_dilation=4"]],
}


def wrong_setting(rng: random.Random) -> list[str]:
    """Overrides of ``tiny_gpt``: a :data:`CONFIG_BASES` job with one of its
    :data:`WRONG_SETTINGS`."""
    base = rng.choice(sorted(CONFIG_BASES))
    return CONFIG_BASES[base] + rng.choice(WRONG_SETTINGS[base])


def bad_inputs(n: int, tmp: Path) -> tuple[int, int]:
    """Seeded random bad inputs to the four loaders, to the region-shape check (a
    four_region worker's tp, pp, num_gpus or memory against GPT-3 1.3B:
    :mod:`geomesh.fleet.shapes`) and wrong settings of valid jobs (:func:`wrong_setting`);
    ``(bad tried, clean one-line errors)``."""
    import dataclasses

    import torch
    import yaml

    from geomesh.fleet.cluster import ClusterError, cluster_from_dict
    from geomesh.fleet.shapes import check_region_shapes
    from geomesh.fleet.worker_models import OUTER_STATE_BYTES, MemoryModel
    from geomesh.state import load_state
    from geomesh.wire.canonical_codec import join_parts
    from geomesh.wire.compression import MessageError
    from jobruntime.checkpoint import CheckpointError
    from jobruntime.config import ConfigError, JobConfig, load_config
    from tests.test_geomesh_trust import _codec, _named, pp2_parts
    from train import check_config

    rng = random.Random(0)
    keys = [f"{s}.{f.name}" for s in ("model", "parallel", "train", "geomesh", "cona")
            for f in dataclasses.fields(getattr(JobConfig(), s))]
    junk = ["-1", "0", "nan", "inf", "abc", "[1,", "{}", "1e999", "", "null", "-0.5", "true"]
    base = yaml.safe_load((REPO / "geomesh/clusters/four_region.yaml").read_text())
    codec = _codec("sign_row")  # a PP2 worker's two parts in one bundle, as the exchange sends
    good = join_parts(pp2_parts("sign_row", _named(0), 100, worker=0))
    tried = clean = 0

    def check(fn, kinds) -> None:
        nonlocal tried, clean
        try:
            fn()
        except kinds as e:
            tried += 1
            clean += "\n" not in str(e) and bool(str(e))
        except Exception:  # noqa: BLE001 - an unclean error is what this counts
            tried += 1

    def config():  # as train.py checks it, before its heavy imports (one process)
        overrides = [f"{rng.choice(keys)}={rng.choice(junk)}" for _ in range(rng.randint(1, 3))]
        check_config(load_config("tiny_gpt", overrides), 1, overrides)

    def cluster():
        raw = json.loads(json.dumps(base))
        node = raw["workers"][rng.randrange(4)] if rng.random() < 0.6 else raw
        text = rng.choice(junk) or "x"
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:  # the bench's own parsing: give the product the raw text
            value = text
        node[rng.choice(list(node))] = value
        cluster_from_dict(raw)

    def wire():
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        codec.aggregate([bytes(data[:rng.randint(0, len(data))] if rng.random() < 0.3
                               else data)])

    shape_rng = random.Random(1)  # its own draws: the other loaders' stay as they were
    target = load_config("gpt3_1.3b").model
    memory = MemoryModel(model=target, extra_bytes_per_param=OUTER_STATE_BYTES)

    def shape():
        raw = json.loads(json.dumps(base))
        key, values = shape_rng.choice([("tp", [3, 5, 6, 12, 32]), ("pp", [5, 7, 16, 48]),
                                        ("num_gpus", [1, 3, 6, 12]),
                                        ("memory_gib", [0.5, 4, 8, 12])])
        raw["workers"][shape_rng.randrange(4)][key] = shape_rng.choice(values)
        check_region_shapes(cluster_from_dict(raw), target, memory, model_name="gpt3_1.3b")

    setting_rng = random.Random(2)

    def setting():  # a valid job with one wrong setting, as train.py checks it
        overrides = wrong_setting(setting_rng)
        check_config(load_config("tiny_gpt", overrides), 1, overrides)

    def checkpoint():
        f = tmp / "checkpoints" / "outer_0000001"
        f.mkdir(parents=True, exist_ok=True)
        (f / "COMPLETE").write_text("x")
        (f / "rank00000.pt").write_bytes(rng.randbytes(rng.randint(0, 300)))
        load_state(tmp / "checkpoints", rank=0)

    torch.manual_seed(0)
    for _ in range(n):
        check(config, ConfigError)
        check(cluster, ClusterError)
        check(wire, MessageError)
        check(checkpoint, CheckpointError)
        check(shape, ClusterError)
        check(setting, ConfigError)
    return tried, clean
