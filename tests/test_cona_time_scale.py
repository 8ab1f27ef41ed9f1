"""The CONA bench's committed time scale (``bench/cona_time_scale.py``): the same
dilation on every machine for a set-up that has one, its own measurement otherwise,
and a calibration that names the set-up it holds for."""

from __future__ import annotations

import copy
import json

import pytest


def _settings():
    from bench.cona_ttp import FULL

    return dict(FULL, gpu="A100-80GB", num_gpus=64, time_scale="calibrated")


def _cfg(family="gpt3_1.3b", settings=None, cache_dir=None):
    from bench.cona_ttp import MODELS, family_config

    return family_config(family, MODELS[family], settings or _settings(), cache_dir)


def _calibration(digest, dilation=40.0):
    return {"families": {"gpt3_1.3b": {
        "setup_digest": digest, "step_dilation": dilation, "target_tokens_per_run": 2e9,
        "target_loss_range": [4.2, 3.0], "critical_batch_tokens_range": [2e5, 1e6],
        "source": "Kaplan"}},
        "from": {"file": "r.json", "date": "d", "commit": "abc", "machine": "m",
                 "command": "c"}}


def test_a_calibrated_set_up_charges_the_committed_dilation_whatever_this_run_measured():
    """Catches the old rule (the dilation re-measured on every machine: 65.8 on one 2-core
    machine, 49.1 on another for the same commit): two runs measuring different ranges
    get the same dilation, and each keeps its own measurement beside it."""
    from bench.cona_time_scale import choose_time_scale, setup_digest

    s = _settings()
    digest = setup_digest("gpt3_1.3b", _cfg(settings=s), s)
    cal = _calibration(digest)
    a = choose_time_scale("gpt3_1.3b", digest, {"step_dilation": 65.8}, cal)
    b = choose_time_scale("gpt3_1.3b", digest, {"step_dilation": 49.1}, cal)
    assert a["step_dilation"] == b["step_dilation"] == 40.0
    assert a["target_tokens_per_run"] == 2e9
    assert (a["measured"]["step_dilation"], b["measured"]["step_dilation"]) == (65.8, 49.1)
    assert a["calibration"]["from"]["commit"] == "abc"


def test_a_set_up_without_a_matching_entry_is_measured_and_says_why():
    from bench.cona_time_scale import choose_time_scale

    cal = _calibration("0" * 20)
    other = choose_time_scale("gpt3_1.3b", "1" * 20, {"step_dilation": 7.0}, cal)
    assert other["step_dilation"] == 7.0 and other["calibration"] is None
    assert "another set-up" in other["calibration_miss"]
    none = choose_time_scale("bert_large", "1" * 20, {"step_dilation": 3.0}, cal)
    assert none["step_dilation"] == 3.0 and "no entry for bert_large" in none["calibration_miss"]


def test_set_up_digest_names_what_the_reference_depends_on_and_nothing_else():
    """The cache folder, the emulated cluster and the controller's settings do not move
    the reference's run, so they keep the digest; the proxy's width, its LR, the batch
    ratio, the probe count or the family do."""
    from bench.cona_time_scale import setup_digest

    s = _settings()
    base = _cfg(settings=s)
    d0 = setup_digest("gpt3_1.3b", base, s)
    same = copy.deepcopy(base)
    same.data.cache_dir = "/elsewhere"
    same.train.target_ppl = 123.0
    same.cona.gpu, same.cona.num_gpus = "H100-80GB", 8
    same.cona.decision_interval += 5
    same.cona.step_dilation = 99.0
    assert setup_digest("gpt3_1.3b", same, dict(s, gpu="H100-80GB", num_gpus=8,
                                                 gns_ablations=())) == d0
    for change in ("model.hidden_size", "train.lr", "cona.batch_ratio"):
        c = copy.deepcopy(base)
        sec, key = change.split(".")
        setattr(getattr(c, sec), key, getattr(getattr(c, sec), key) * 2)
        assert setup_digest("gpt3_1.3b", c, s) != d0, change
    assert setup_digest("gpt3_1.3b", base, dict(s, probe_microbatches=128)) != d0
    assert setup_digest("llama3.2_1b", base, s) != d0
    assert base.train.precision == "bf16"  # rule 0
    fp32 = dict(s, precision="fp32")  # --precision fp32: a set-up of its own
    assert _cfg(settings=fp32).train.precision == "fp32"
    assert setup_digest("gpt3_1.3b", _cfg(settings=fp32), fp32) != d0


def test_calibration_from_a_result_checks_its_recorded_set_up(tmp_path):
    from bench.cona_time_scale import calibration_from, setup_digest
    from cona.mapping import BATCH_RATIO

    s = _settings()
    cfg = _cfg(settings=s)
    model = {"proxy": "tiny_gpt", "proxy_overrides": _spec()["overrides"],
             "mapping": {"ratio": BATCH_RATIO},
             "time_scale": {"step_dilation": 50.0, "target_tokens_per_run": 3e9,
                            "target_loss_range": [4, 3], "critical_batch_tokens_range": [1, 2],
                            "source": "Kaplan"},
             "reference": {"probe_microbatches": s["probe_microbatches"],
                           "warm_steps": cfg.train.warmup_iters,
                           "noise_scale_warm_proxy": 13.0, "noise_scale_target_proxy": 60.0,
                           "segment_samples": 3456, "noise_scale_probes": [{}] * 5}}
    result = {"quick": False, "commit": "abc", "models": {"gpt3_1.3b": model}}
    cal = calibration_from(result, "r.json", s)
    entry = cal["families"]["gpt3_1.3b"]
    assert entry["setup_digest"] == setup_digest("gpt3_1.3b", cfg, s)
    assert entry["step_dilation"] == 50.0 and entry["probes"] == 5
    assert cal["from"]["commit"] == "abc"
    # a calibrated run's own measurement is what a new calibration takes
    calibrated = copy.deepcopy(result)
    calibrated["models"]["gpt3_1.3b"]["time_scale"] = {
        "step_dilation": 65.8, "measured": model["time_scale"]}
    assert calibration_from(calibrated, "r.json", s)["families"]["gpt3_1.3b"][
        "step_dilation"] == 50.0
    wrong = copy.deepcopy(result)
    wrong["models"]["gpt3_1.3b"]["reference"]["probe_microbatches"] = 128
    with pytest.raises(ValueError, match="probe_microbatches was 128"):
        calibration_from(wrong, "r.json", s)
    with pytest.raises(ValueError, match="--quick"):
        calibration_from(dict(result, quick=True), "r.json", s)


def _spec():
    from bench.cona_ttp import MODELS

    return MODELS["gpt3_1.3b"]


def test_committed_calibration_holds_for_todays_set_up():
    """The committed calibration names today's set-up for each family it holds: a change
    to a proxy, its recipe or the bench's rules without a new calibration (and a new
    full run) fails here rather than charging a stale time scale."""
    from bench.cona_time_scale import CALIBRATION, load_calibration, setup_digest

    cal = load_calibration()
    assert cal["families"], f"{CALIBRATION} holds no family"
    s = _settings()
    for family, entry in cal["families"].items():
        assert entry["setup_digest"] == setup_digest(family, _cfg(family, s), s), family
        assert entry["step_dilation"] > 1 and entry["target_tokens_per_run"] > 0


def test_a_calibration_file_that_is_not_one_is_refused_with_its_name(tmp_path):
    from bench.cona_time_scale import load_calibration

    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"gpt3_1.3b": 3}))
    with pytest.raises(ValueError, match="not a CONA time-scale calibration"):
        load_calibration(bad)
    bad.write_text('{"families": {')
    with pytest.raises(ValueError, match=r"cal\.json: cannot read"):
        load_calibration(bad)
    cal = _calibration("0" * 20)
    del cal["families"]["gpt3_1.3b"]["step_dilation"], cal["from"]["commit"]
    bad.write_text(json.dumps(cal))
    with pytest.raises(ValueError, match=r"lacks commit, gpt3_1\.3b\.step_dilation"):
        load_calibration(bad)
    assert load_calibration(tmp_path / "absent.json") == {"families": {}}


def test_family_setup_charges_the_committed_dilation_and_keeps_its_own_beside(monkeypatch):
    """The bench's wiring (rule 4): with the reference's measurement stubbed to another
    machine's (49.1), the set-up charges the committed dilation; with ``--time-scale
    measured`` and in a quick run, its own, labelled."""
    from types import SimpleNamespace

    import bench.cona_ttp as ttp
    import cona.targets
    from bench.cona_time_scale import load_calibration

    ctx = SimpleNamespace(warm={"extra": {"val_ppl": 400.0}}, data=SimpleNamespace(corpus=None),
                          cfg=SimpleNamespace(train=SimpleNamespace(target_ppl=None)),
                          eval_samples=160)
    monkeypatch.setattr(ttp, "seed_context", lambda cfg, steps, probe_microbatches: (ctx, True))
    monkeypatch.setattr(cona.targets, "corpus_unigram_perplexity", lambda corpus, v: 800.0)
    monkeypatch.setattr(ttp, "reference", lambda ctx, quick, probe, **kw: {
        "reached": True, "val_ppl": 199.0, "noise_scale_warm_proxy": 13.0,
        "noise_scale_target_proxy": 60.0})
    monkeypatch.setattr(ttp, "time_scale_for", lambda ctx, ref: {
        "step_dilation": 49.1, "target_tokens_per_run": 1e9})
    spec, s = ttp.MODELS["gpt3_1.3b"], _settings()
    committed = load_calibration()["families"]["gpt3_1.3b"]["step_dilation"]
    cfg, _, _, ts, _ = ttp.family_setup("gpt3_1.3b", spec, s, None)
    assert cfg.cona.step_dilation == ts["step_dilation"] == committed != 49.1
    assert ts["measured"]["step_dilation"] == 49.1 and ts["calibration"]["from"]["commit"]
    cfg, _, _, ts, _ = ttp.family_setup("gpt3_1.3b", spec, dict(s, time_scale="measured"),
                                        None)
    assert cfg.cona.step_dilation == 49.1
    assert ts["calibration"] is None and ts["calibration_miss"] == "--time-scale measured"
    quick = dict(ttp.QUICK, gpu="A100-80GB", num_gpus=64, time_scale="calibrated")
    cfg, _, _, ts, _ = ttp.family_setup("gpt3_1.3b", quick["models"]["gpt3_1.3b"], quick, None)
    assert cfg.cona.step_dilation == 49.1 and "quick" in ts["calibration_miss"]


def _run(ttp: dict, dilation: float, measured: float | None = None, quick=False):
    ts = {"step_dilation": dilation}
    if measured is not None:
        ts["measured"] = {"step_dilation": measured}
    return {"quick": quick, "date": "2026-12-04T00:00:00Z", "commit": "c", "machine": "m",
            "command": "python bench/cona_ttp.py",
            "models": {"gpt3_1.3b": {"time_scale": ts, "target_ppl": 190.0, "ratios": {},
                                     "methods": {k: {"ttp_s": t, "ttp_s_sd": sd}
                                                 for k, (t, sd) in ttp.items()}}}}


def test_repro_compares_methods_within_the_larger_seed_sd_and_at_equal_dilation():
    """A run that charged a smaller dilation has every TTP scaled by it: outside the seed
    spread, and at equal dilation the same; a run at the same dilation whose means differ
    by less than the larger sd is within it; a missed method is not counted."""
    import sys
    from pathlib import Path

    from bench.cona_repro import compare

    a = _run({"cona": (4000.0, 300.0), "static_recipe": (3000.0, 30.0),
              "oracle_chain": (None, None)}, 65.8)
    scaled = _run({"cona": (4000.0 * 0.75, 225.0), "static_recipe": (2250.0, 20.0),
                   "oracle_chain": (2000.0, 10.0)}, 65.8 * 0.75)
    r = compare(a, scaled)
    m = r["models"]["gpt3_1.3b"]["methods"]
    assert m["cona"]["within_seed_spread"] is False
    assert m["cona"]["b_over_a_at_equal_dilation"] == pytest.approx(1.0)
    assert m["oracle_chain"]["within_seed_spread"] is None
    assert r["within_seed_spread"] == {"methods": 0, "of": 2}
    same = compare(a, _run({"cona": (4250.0, 200.0), "static_recipe": (3040.0, 25.0)}, 65.8,
                           measured=49.1))
    assert same["within_seed_spread"] == {"methods": 1, "of": 2}  # recipe: 40 s > 30 s sd
    assert same["models"]["gpt3_1.3b"]["step_dilation_measured"] == {"a": 65.8, "b": 49.1}
    with pytest.raises(ValueError, match="--quick"):
        compare(a, _run({}, 1.0, quick=True))
    one_seed = compare(_run({"cona": (4000.0, None)}, 65.8), _run({"cona": (4100.0, None)}, 65.8))
    assert one_seed["within_seed_spread"] == {"methods": 0, "of": 0}  # no spread to judge by
    exact = compare(_run({"cona": (4000.0, 0.0)}, 65.8), _run({"cona": (4000.0, 0.0)}, 65.8))
    assert exact["within_seed_spread"] == {"methods": 1, "of": 1}
    x, y = _run({"cona": (1.0, 1.0)}, 65.8), _run({"cona": (1.0, 1.0)}, 65.8)
    x["models"]["gpt3_1.3b"]["time_scale"]["setup_digest"] = "a" * 20
    y["models"]["gpt3_1.3b"]["time_scale"]["setup_digest"] = "b" * 20
    with pytest.raises(ValueError, match="different set-ups"):
        compare(x, y)
    on_purpose = compare(x, y, across_setups=True)  # a set-up change, compared on purpose
    assert on_purpose["across_setups"] is True
    assert on_purpose["models"]["gpt3_1.3b"]["setup_digest"] == {"a": "a" * 20, "b": "b" * 20}
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from render_cona import cona_repro

    same.update(a={"file": "x.json", "commit": "c1", "machine": "m"},
                b={"file": "y.json", "commit": "c2", "machine": "m"},
                date="2026-12-04T00:00:00Z", commit="c3", machine="m", command="cmd")
    out = cona_repro(same)
    assert "| CONA | 4,000 ± 300 s | 4,250 ± 200 s | 1.062x |" in out
    assert "Within the seed spread: 1 of 2 methods." in out
    assert "measured 65.8 / 49.1" in out and "docs/results/cona_repro.json" in out
    assert "--across-setups" not in out
    on_purpose.update({k: same[k] for k in ("a", "b", "date", "commit", "machine", "command")})
    assert "Two set-ups compared on purpose (`--across-setups`)" in cona_repro(on_purpose)


def test_the_table_says_where_its_time_scale_came_from():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
    from render_cona import _time_scale_origin

    cal = {"step_dilation": 33.1, "calibration": {"from": {"commit": "bd2e672"}},
           "measured": {"step_dilation": 8.2}}
    assert _time_scale_origin(cal) == (" (step dilation 33.1, calibrated at `bd2e672`; "
                                       "this run measured 8.2)")
    assert "measured in this run" in _time_scale_origin(
        {"step_dilation": 3.0, "calibration": None, "calibration_miss": "no entry"})
    assert _time_scale_origin({"step_dilation": 65.8}) == ""  # made before calibrations
