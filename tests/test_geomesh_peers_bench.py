"""bench/geomesh_peers.py's rows, and bench/geomesh_ttp.py's reuse of finished runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import geomesh_peers as peers  # noqa: E402
import geomesh_ttp as ttp  # noqa: E402


def test_every_preset_row_trains_the_same_tokens():
    """Catches an H sweep at unequal token budgets or a row that runs another method or
    codec than its name says: every preset row's ``H · outer_steps`` is the full run's
    832 inner steps, and the name's parts become its overrides."""
    for name in peers.PRESET:
        spec = peers.parse_row(name, "full")
        over = dict(x.split("=", 1) for x in spec["overrides"])
        assert int(over["geomesh.inner_steps"]) * int(over["geomesh.outer_steps"]) == 832, name
    s = peers.parse_row("diloco_h32_lr0.7_const", "full")
    assert (s["method"], s["H"], s["outer_lr"], s["ramp"]) == ("diloco", 32, 0.7, False)
    assert "geomesh.outer_momentum_warmup=false" in s["overrides"]
    assert "geomesh.fragment_bits=4" in peers.parse_row("streaming_diloco_4bit", "full")["overrides"]
    assert "geomesh.compression=fp32" in peers.parse_row("geomesh_fp32", "full")["overrides"]
    assert peers.parse_row("geomesh", "quick")["overrides"][:2] == \
        ["geomesh.inner_steps=8", "geomesh.outer_steps=12"]
    assert [peers.eval_interval(h, 16) for h in (8, 16, 32, 64)] == [2, 1, 1, 1]
    for bad, why in (("diloco_h48", "does not divide"), ("diloco_4bit", "fp32 only"),
                     ("sgd_h8", "use <method>")):
        with pytest.raises(peers.RowError, match=why):
            peers.parse_row(bad, "full")
    assert peers._with_lr("diloco_h32_lr0.7_const", 0.25) == "diloco_h32_lr0.25_const"


def test_reuse_ignores_settings_a_method_does_not_read(tmp_path):
    """Catches a reuse check that re-runs finished DiLoCo runs saved before the
    streaming keys existed (the sweep's runs already under way) or that reuses a
    Streaming DiLoCo run of another message width: a saved diloco config without
    ``geomesh.fragment*`` is this run's; a streaming run with other ``fragment_bits``
    is not."""
    from jobruntime.config import load_config

    def saved(method: str, drop: tuple[str, ...] = (), **geomesh) -> tuple:
        cfg = load_config("tiny_gpt", ttp.overrides("full", method, "disabled", "g"))
        d = cfg.to_dict()
        d["model"]["padded_vocab_size"] = cfg.model.padded_vocab
        d["geomesh"] = {k: v for k, v in {**d["geomesh"], **geomesh}.items() if k not in drop}
        folder = tmp_path / f"{method}-{len(drop)}-{sorted(geomesh.items())}"
        folder.mkdir()
        (folder / "config.yaml").write_text(yaml.safe_dump(d))
        (folder / "summary.json").write_text(json.dumps({"ttp_s": 1.0}))
        return cfg, folder

    from jobruntime.config.unused import METHOD_ONLY

    streaming_only = tuple(k for k, m in METHOD_ONLY.items() if m == "streaming_diloco")
    cfg, folder = saved("diloco", drop=streaming_only)  # as the older code saved it
    assert ttp._reused(cfg, folder) == {"ttp_s": 1.0}
    cfg, folder = saved("diloco", fragment_bits=4)  # a key diloco does not read
    assert ttp._reused(cfg, folder) is not None
    cfg, folder = saved("streaming_diloco", fragment_bits=4)
    assert ttp._reused(cfg, folder) is None
    cfg, folder = saved("streaming_diloco")
    assert ttp._reused(cfg, folder) is not None


def test_reuse_takes_keys_added_since_at_their_default(tmp_path):
    """Catches a reuse check that re-runs every finished run when a config key is added
    (``checkpoint.save_final``) or CONA's defaults move while CONA is off, or that reuses a
    run whose saved value of a key differs from this run's: a saved config without a key
    this run holds at its default is this run's; one missing a key set off its default,
    or with another seed, is not; CONA's section is read only where CONA is on."""
    from jobruntime.config import load_config

    def saved(extra: list[str], edit) -> tuple:
        cfg = load_config("tiny_gpt", ttp.overrides("full", "geomesh", "disabled", "g") + extra)
        d = cfg.to_dict()
        d["model"]["padded_vocab_size"] = cfg.model.padded_vocab
        edit(d)
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.yaml").write_text(yaml.safe_dump(d))
        (folder / "summary.json").write_text(json.dumps({"ttp_s": 2.0}))
        return cfg, folder

    cfg, folder = saved([], lambda d: d["checkpoint"].pop("save_final"))
    assert ttp._reused(cfg, folder) == {"ttp_s": 2.0}
    cfg, folder = saved(["checkpoint.save_final=false"], lambda d: d["checkpoint"].pop("save_final"))
    assert ttp._reused(cfg, folder) is None  # off its default: the old run did otherwise
    cfg, folder = saved([], lambda d: d["cona"].update(gns_average="plain"))
    assert ttp._reused(cfg, folder) is not None  # CONA is off: its keys change nothing
    cfg, folder = saved(["cona.enabled=true"], lambda d: d["cona"].update(gns_average="plain"))
    assert ttp._reused(cfg, folder) is None
    cfg, folder = saved([], lambda d: d["train"].update(seed=7))
    assert ttp._reused(cfg, folder) is None


def test_no_train_reports_only_finished_runs(tmp_path, capsys):
    """Catches ``--no-train`` launching a run, reporting a seed that was not run, or
    keeping a row with no finished run: one finished seed of ``diloco_h16`` (saved as
    bench/geomesh_ttp.py saves it) is the row's only seed; ``geomesh`` is dropped."""
    from jobruntime.config import load_config

    spec = peers.parse_row("diloco_h16_lr0.15_ramp", "full")
    cfg = load_config("tiny_gpt", ttp.overrides("full", "diloco", "disabled", "g")
                      + [*spec["overrides"], "geomesh.eval_interval=1", "train.seed=1235"])
    d = cfg.to_dict()
    d["model"]["padded_vocab_size"] = cfg.model.padded_vocab
    folder = tmp_path / "full" / spec["row"] / "seed1235" / "diloco"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump(d))
    (folder / "summary.json").write_text(json.dumps(
        {"ttp_s": 5.0, "final_val_ppl": 300.0, "bytes_per_outer_step": 8.0}))
    assert peers.main(["--full", "--no-train", "--runs", str(tmp_path), "--rows", spec["row"],
                       "geomesh", "--seeds", "1234", "1235"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["row"], r["seeds"], r["ttp_s_by_seed"]) for r in rows] == \
        [(spec["row"], [1235], [5.0])]
