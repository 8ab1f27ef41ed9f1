"""The run identity that binds a region's messages (:mod:`geomesh.exchange.run_identity`).

Regions started with other settings used to share an identity made of the cluster's
name and workers, the method, the seed and the model only: two regions with another
``geomesh.outer_lr`` accepted each other's messages, applied different outer steps and
ended on different weights, each exiting 0 (break-test helper, 2026-12-07).
"""

from __future__ import annotations

import pytest

from geomesh.exchange.run_identity import PARTS, differing_parts, run_identity, shared_settings
from geomesh.fleet.cluster import cluster_from_dict
from jobruntime.config import load_config
from jobruntime.tokenizer import Tokenizer

CLUSTER = {"name": "two", "mode": "real", "rendezvous": "127.0.0.1:29400",
           "regions": [{"name": "East US", "id": 0}, {"name": "West Europe", "id": 1}],
           "workers": [{"name": "w0", "gpu": "A100-80GB", "num_gpus": 1, "region": "East US"},
                       {"name": "w1", "gpu": "V100", "num_gpus": 2, "region": "West Europe",
                        "tp": 2}]}


def _tokenizer(pieces: list[str]) -> Tokenizer:
    return Tokenizer(lambda texts: [[0] for _ in texts], pieces.__getitem__, len(pieces), eod=0,
                     pad=None, cls=None, sep=None, mask=None, kind="gpt")


PIECES = ["<eod>", "a", "b", "▁the"]


def _identity(*overrides: str, cluster: dict = CLUSTER, pieces=PIECES) -> int:
    cfg = load_config("tiny_gpt", ["geomesh.method=geomesh", *overrides])
    return run_identity(shared_settings(cfg, cluster_from_dict(cluster), _tokenizer(pieces)))


BASE = _identity()


@pytest.mark.parametrize("override, part", [
    ("geomesh.outer_lr=0.3", "geomesh"),
    ("geomesh.compression=sign_row", "geomesh"),
    ("geomesh.inner_steps=7", "geomesh"),
    ("train.lr=0.0123", "train"),
    ("train.warmup_iters=3", "train"),
    ("train.seed=7", "seed"),
    ("model.num_layers=3", "model"),
    ("data.val_every=7", "data"),
    ("parallel.global_batch_size=16", "batch"),
])
def test_a_shared_setting_changes_its_own_part_only(override, part):
    """Each shared setting moves its part's byte and no other, so a receiver names it."""
    assert differing_parts(BASE, _identity(override)) == [part]


@pytest.mark.parametrize("override", [
    "geomesh.region=West Europe", "geomesh.timeout_s=30", "geomesh.heartbeat_s=3",
    "geomesh.secret_file=/elsewhere/secret", "parallel.tp=2", "parallel.micro_batch_size=1",
    "train.precision=bf16", "train.eval_iters=9", "train.iters=5", "data.cache_dir=/tmp/x",
    "checkpoint.load=/somewhere", "checkpoint.save_interval=3", "logging.wandb=disabled",
    "model.attention_backend=local",
])
def test_a_regions_own_setting_leaves_the_identity(override):
    """A region's layout, precision, evaluation, folders and timeouts are its own."""
    assert _identity(override) == BASE


def test_the_tokenizer_and_the_cluster_are_parts():
    """Catches regions that number tokens otherwise (each trained its own tokenizer) or
    plan from other cluster files; the rendezvous address may be spelled otherwise."""
    assert differing_parts(BASE, _identity(pieces=[*PIECES[:3], "▁then"])) == ["tokenizer"]
    slower = {**CLUSTER, "workers": [CLUSTER["workers"][0],
                                     {**CLUSTER["workers"][1], "gpu": "T4"}]}
    assert differing_parts(BASE, _identity(cluster=slower)) == ["cluster"]
    assert _identity(cluster={**CLUSTER, "rendezvous": "localhost:29400"}) == BASE


def test_differing_parts_reads_one_byte_per_part():
    ours = int.from_bytes(bytes(range(8)), "little")
    theirs = int.from_bytes(bytes([0, 1, 9, 3, 4, 5, 6, 9]), "little")
    assert differing_parts(ours, theirs) == [PARTS[2], PARTS[7]]
    assert differing_parts(ours, ours) == []


def test_a_heal_sealed_for_another_run_is_a_named_refusal():
    """Catches a region restarted with other settings that retried its heal until "no
    working quorum": the heal's EnvelopeError of reason ``other_run`` becomes the exit-2
    ConfigError naming the parts that differ; any other failed heal stays a retry."""
    from geomesh.exchange.membership import other_run_heal
    from geomesh.wire.envelope import EnvelopeError
    from jobruntime.config import ConfigError

    ours = int.from_bytes(bytes(range(8)), "little")
    theirs = int.from_bytes(bytes([0, 1, 2, 3, 4, 99, 6, 7]), "little")  # byte 5: geomesh
    err = other_run_heal(EnvelopeError("sealed for another run", "other_run", theirs), ours)
    assert isinstance(err, ConfigError) and "part(s) that differ: geomesh" in str(err)
    assert other_run_heal(EnvelopeError("bad tag", "unauthenticated"), ours) is None
    assert other_run_heal(RuntimeError("connection reset"), ours) is None
