"""bench/cona_rerun.py: CONA run again only where the earlier run's set-up reproduces."""

from __future__ import annotations

import json
import types

import pytest

from bench import cona_rerun


def _setup(target_ppl=190.4, dilation=65.8, boundaries=(10, 20), beta2_batch=512):
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(target_ppl=target_ppl),
                                cona=types.SimpleNamespace(step_dilation=dilation,
                                                           adam_beta2_batch=beta2_batch))
    return {"cfg": cfg, "boundaries": list(boundaries)}


EARLIER = {"target_ppl": 190.4, "mapping": {"step_dilation": 65.8},
           "recipe": {"batch": 512, "adam_beta2_batch": 512}}
SEED = {"methods": {"oracle_chain": {"search": {"boundaries": [10, 20]}}}}


def test_a_set_up_that_does_not_reproduce_is_refused():
    """Catches a rerun compared against another set-up: a target, dilation, window end or
    Adam ``beta2`` anchor (rule 5a; a run made before it has none) that differs must stop
    it with the reason; an equal one passes."""
    cona_rerun.check_reproduced("gpt3_1.3b", _setup(), EARLIER, SEED)
    for bad in (_setup(target_ppl=190.5), _setup(dilation=49.1), _setup(boundaries=(10, 21)),
                _setup(beta2_batch=None)):
        with pytest.raises(SystemExit, match="does not reproduce"):
            cona_rerun.check_reproduced("gpt3_1.3b", bad, EARLIER, SEED)
    before_5a = {**EARLIER, "recipe": {"batch": 512}}
    with pytest.raises(SystemExit, match="does not reproduce"):
        cona_rerun.check_reproduced("gpt3_1.3b", _setup(), before_5a, SEED)


def test_seed_files_are_found_where_a_run_or_the_repository_keeps_them(tmp_path):
    """The committed layout (``<stem>_seeds/``) is preferred where it exists, else the
    report's own folder (``--out``'s layout); ``--seeds-dir`` wins."""
    report = tmp_path / "cona_ttp.json"
    assert cona_rerun.seeds_dir(report, None) == tmp_path
    (tmp_path / "cona_ttp_seeds").mkdir()
    assert cona_rerun.seeds_dir(report, None) == tmp_path / "cona_ttp_seeds"
    assert cona_rerun.seeds_dir(report, tmp_path / "x") == tmp_path / "x"


def _report(tmp_path, seeds=(("gpt3_1.3b", 2),), **extra):
    """A full run's report with ``n`` seed runs per family, its seed files beside it."""
    models = {}
    for name, n in seeds:
        models[name] = {"seed_runs": [{"setup_key": f"k{i}"} for i in range(n)]}
        (tmp_path / name).mkdir(exist_ok=True)
        for i in range(n):
            (tmp_path / name / f"seed_{i}.json").write_text(json.dumps(_seed(f"k{i}")))
    path = tmp_path / "cona_ttp.json"
    path.write_text(json.dumps({"gpu": "A100-80GB", "num_gpus": 64, "models": models, **extra}))
    return path


def _seed(key: str) -> dict:
    """The least of a seed file a re-run reads: its key and CONA's record."""
    return {"setup_key": key, "methods": {"cona": {"ttp_s": 1.0, "chain": []}}}


def test_only_a_full_runs_report_with_its_own_seed_files_is_accepted(tmp_path, capsys):
    """Catches a re-run started on what it cannot compare against, or one that would
    overwrite the earlier seed files: each is refused in one line (argparse's exit 2)
    before any set-up runs."""
    def refused(argv, text):
        with pytest.raises(SystemExit) as e:
            cona_rerun.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and text in err, err

    path = _report(tmp_path)
    earlier, names, folder, seeds = cona_rerun.check_earlier(path, None, None, None)
    assert (names, folder, seeds) == (["gpt3_1.3b"], tmp_path, 2)
    for extra in ({"quick": True}, {"setup_only": True}, {"rerun": {}}):
        refused([str(_report(tmp_path, **extra))], "not a full run's report")
    path.write_text("[1, 2")
    refused([str(path)], "is not a bench/cona_ttp.py report")
    path.write_text(json.dumps([1]))
    refused([str(path)], "is not a bench/cona_ttp.py report")
    refused([str(tmp_path / "none.json")], "is not a bench/cona_ttp.py report")
    path = _report(tmp_path)
    refused([str(path), "--families", "bert_large"], "not families of")
    refused([str(path), "--jobs", "0"], "--jobs must be >= 1")
    refused([str(path), "--out", str(tmp_path)], "is the earlier run's seed folder")
    seed1 = tmp_path / "gpt3_1.3b" / "seed_1.json"
    seed1.write_text(json.dumps(_seed("rerun-k1")))
    refused([str(path)], "seed_1.json is missing or not the seed 1")
    seed1.write_text(json.dumps(_seed("other")))
    refused([str(path)], "seed_1.json is missing or not the seed 1")
    # a seed file cut short, of another shape, or without CONA's record: named, before
    # any set-up (a traceback or an unnamed JSON error once)
    seed1.write_text(json.dumps(_seed("k1"))[:20])
    refused([str(path)], f"{seed1} cannot be read as a seed file")
    for bad in ([], {"setup_key": "k1"}, {"setup_key": "k1", "methods": {"cona": {}}}):
        seed1.write_text(json.dumps(bad))
        refused([str(path)], f"{seed1} is not a bench/cona_ttp.py seed file")
    (tmp_path / "gpt3_1.3b" / "seed_1.json").unlink()
    refused([str(path)], "seed_1.json is missing")
    refused([str(_report(tmp_path, (("gpt3_1.3b", 2), ("llama3.2_1b", 3))))],
            "different seed counts")


def test_the_earlier_cona_is_compared_seed_by_seed():
    """Catches a comparison that reads only the first seed or ignores the chain: equal
    only where every common seed's TTP and chain are the same; a seed the earlier run
    missed (``None``) compares as such."""
    def cona(ttps, chains):
        return {"ttp_s_by_seed": ttps, "chain_by_seed": chains}

    then = cona([100.0, None, 300.0], [["a"], ["a", "b"], ["c"]])
    assert cona_rerun.compare_cona(cona([100.0, None, 300.0], [["a"], ["a", "b"], ["c"]]),
                                   then)["equal"]
    assert not cona_rerun.compare_cona(cona([100.0, None, 301.0], [["a"], ["a", "b"], ["c"]]),
                                       then)["equal"]
    assert not cona_rerun.compare_cona(cona([100.0, None, 300.0], [["a"], ["a"], ["c"]]),
                                       then)["equal"]
    two = cona_rerun.compare_cona(cona([100.0, None], [["a"], ["a", "b"]]), then)
    assert two["equal"] and two["ttp_s_by_seed"] == [100.0, None]
    assert not cona_rerun.compare_cona(cona([], []), then)["equal"]


def test_cona_settings_for_the_rerun_are_parsed_and_checked():
    """``--cona KEY=VALUE``: YAML values for ``cona.*`` keys only, so a typo does not
    silently re-run the default controller."""
    assert cona_rerun.parse_cona_settings(
        ["efficiency_correction=progress", "min_gain=0.1", "gns_decision_window=3"]) == {
        "efficiency_correction": "progress", "min_gain": 0.1, "gns_decision_window": 3}
    assert cona_rerun.parse_cona_settings([]) == {}
    for bad in ("efficency_correction=progress", "min_gain", "=1"):
        with pytest.raises(ValueError, match="KEY=VALUE with KEY a cona"):
            cona_rerun.parse_cona_settings([bad])
