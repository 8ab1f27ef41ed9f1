"""Streaming DiLoCo, emulated (``geomesh.method=streaming_diloco``): fragments,
low-bit messages, the clock's overlap accounting, and the refusals.

One spawned process runs two 2-outer-step runs on a cluster of two equal workers
in two regions (``τ = 1`` and ``τ = 0``, otherwise equal) and the refusals; the rest is pure
logic.  ~30-60 s on the shared 2-core machine.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist_utils import launch

OVERRIDES = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
    "model.seq_length=32", "parallel.global_batch_size=8", "parallel.micro_batch_size=4",
    "geomesh.inner_steps=4", "geomesh.outer_steps=2", "geomesh.eval_interval=2",
    "geomesh.target_model=gpt3_1.3b", "train.eval_iters=1", "train.warmup_iters=2",
    "logging.wandb=disabled", "logging.progress=off", "geomesh.method=streaming_diloco",
    "geomesh.cluster=two_worker", "geomesh.fragments=2",
]


def test_fragments_are_strided_layers_with_embeddings_first():
    """Catches a sequential split or a lost tensor: layer ``l`` goes to fragment
    ``l mod P`` (the paper's strided pattern), embeddings to 0, the final norm to P−1."""
    from geomesh.streaming import fragment_of

    assert [fragment_of(f"decoder.layers.{i}.mlp.linear_fc1.weight", 3) for i in range(6)] == \
        [0, 1, 2, 0, 1, 2]
    assert fragment_of("embedding.word_embeddings.weight", 3) == 0
    assert fragment_of("embedding.position_embeddings.weight", 3) == 0
    assert fragment_of("decoder.final_layernorm.weight", 3) == 2


def test_low_bit_values_and_bytes():
    """Catches a quantiser that is not the message's format or a byte count that is not
    its size: 8 bits are fp8 e4m3 of ``x / max|x| · 448`` per row (torchft's rowwise
    fp8), 4 bits the E3M0 levels ``0, 2^-6 .. 1`` of ``max|x|`` per row (nearest), and a
    ``[r, c]`` tensor costs ``⌈r·c·bits/8⌉ + 4·r`` bytes instead of ``4·r·c``."""
    from geomesh.streaming import low_bit_bytes, quantize

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 37, generator=g)
    x[2] = 0.0  # an all-zero row stays zero
    amax = x.abs().amax(1, keepdim=True).clamp_min(1e-30)
    ref8 = (x / amax * 448).to(torch.float8_e4m3fn).float() / 448 * amax
    assert torch.equal(quantize(x, 8), ref8)
    q4 = quantize(x, 4)
    levels = torch.tensor([0.0] + [2.0 ** -e for e in range(6, -1, -1)])
    rel = (q4.abs() / amax)
    assert torch.all((rel[..., None] - levels).abs().amin(-1) < 1e-6)  # on the grid
    # nearest level: no level is closer to |x|/max|x| than the chosen one
    dist = ((x.abs() / amax)[..., None] - levels).abs()
    assert torch.allclose((rel - x.abs() / amax).abs(), dist.amin(-1), atol=1e-6)
    assert torch.equal(torch.sign(q4[q4 != 0]), torch.sign(x[q4 != 0]))
    assert torch.equal(quantize(x, 32), x)
    assert low_bit_bytes(1000 + 4 * 5 * 37, [(5, 37)], 4) == 1000 + math.ceil(185 / 2) + 20
    assert low_bit_bytes(777, [(5, 37)], 32) == 777
    with pytest.raises(ValueError, match="32, 8 or 4"):
        quantize(x, 2)


def _runs(cache_dir: str, root: str) -> dict:
    import json
    from pathlib import Path

    torch.set_num_threads(1)
    from geomesh.context import target_canonical_schema
    from geomesh.run import run
    from geomesh.wire.canonical_codec import CanonicalCodec
    from jobruntime.config import ConfigError, load_config

    def cfg(*extra):
        return load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", *OVERRIDES, *extra])

    import yaml

    from geomesh.fleet.cluster import CLUSTERS_DIR

    # two equal workers: each waits for the other's message, which τ steps can hide
    # (behind a straggler the fast worker idles anyway and the slow one never waits)
    raw = yaml.safe_load((CLUSTERS_DIR / "two_worker.yaml").read_text())
    raw["name"], raw["workers"][1] = "two_h100", {"name": "h100-westeurope", "gpu": "H100",
                                                  "num_gpus": 1, "region": "West Europe"}
    equal = Path(root) / "two_h100.yaml"
    equal.write_text(yaml.safe_dump(raw))
    out = {}
    for tau in (1, 0):
        d = Path(root) / f"tau{tau}"
        out[tau] = run(cfg(f"geomesh.fragment_sync_delay={tau}", f"geomesh.cluster={equal}"), d)
        out[f"records{tau}"] = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    schema = target_canonical_schema(load_config("gpt3_1.3b"))
    full = CanonicalCodec("fp32", {}, schema)  # sizes only
    out["full_fp32_bytes"] = full.message_bytes(schema)
    errors = {}
    for name, extra in {"real": ["geomesh.mode=real"],
                        "tau": ["geomesh.fragment_sync_delay=2"],
                        "fragments": ["geomesh.fragments=3"],
                        "bits": ["geomesh.fragment_bits=2"],
                        "checkpoint": ["checkpoint.save_interval=1"]}.items():
        try:
            run(cfg(*extra), Path(root) / f"bad-{name}")
            errors[name] = None
        except ConfigError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    (out,) = launch(_runs, 1, cache_dir, str(tmp_path_factory.mktemp("streaming")))
    return out


def test_fragment_bytes_and_compute_on_the_clock(runs):
    """Catches a run that charges the whole model per sync, or misses a fragment: the
    bytes per outer step are every worker's fragment messages, which together are the
    whole target model's fp32 message (up to each message's framing, < 0.1 %), and each
    worker's compute is its ``H`` profile steps per outer step."""
    s = runs[1]
    frag = s["fragment_message_bytes"]
    assert len(frag) == 2 and s["codec"] == "fp32"
    assert s["bytes_per_outer_step"] == 2 * sum(frag)
    assert abs(sum(frag) - runs["full_fp32_bytes"]) / runs["full_fp32_bytes"] < 1e-3
    for rec in runs["records1"]:
        assert rec["bytes"] == 2 * sum(frag)
    for w in s["workers"]:
        assert w["sent_bytes"] == 2 * sum(frag)  # two outer steps


def test_tau_steps_hide_wan_time(runs):
    """Catches an exchange charged as blocking whatever ``τ``: with ``τ = 1`` each
    fragment's transfer overlaps one inner step, so two equal workers wait less on the
    WAN for each other's message and the run ends sooner than with ``τ = 0`` (same
    compute, same bytes).  (Behind a straggler, τ changes nothing on this clock: the
    fast worker waits for the slow one's message either way, the slow one never.)"""
    one, zero = runs[1], runs[0]
    wan = [sum(w["wan_idle_s"] for w in s["workers"]) for s in (one, zero)]
    print(f"WAN idle s: tau=1 {wan[0]:.1f}, tau=0 {wan[1]:.1f}; time {one['time_s']:.1f} vs "
          f"{zero['time_s']:.1f}")
    assert wan[0] < wan[1]
    assert one["time_s"] < zero["time_s"]
    assert [w["compute_s"] for w in one["workers"]] == \
        pytest.approx([w["compute_s"] for w in zero["workers"]])


def test_bad_settings_are_one_line_errors(runs):
    """Catches settings torchft's schedule cannot run, or a real-mode run that would
    silently be something else: each is a ConfigError naming the key."""
    e = runs["errors"]
    assert "emulated mode only" in e["real"]
    assert "fragment_sync_delay=2" in e["tau"]
    assert "fragments=3" in e["fragments"]
    assert "fragment_bits=2" in e["bits"]
    assert "checkpoints" in e["checkpoint"]
