"""bench/cona_rerun.py: CONA run again only where the earlier run's set-up reproduces."""

from __future__ import annotations

import json
import types

import pytest

from bench import cona_rerun


def _setup(target_ppl=190.4, dilation=65.8, boundaries=(10, 20)):
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(target_ppl=target_ppl),
                                cona=types.SimpleNamespace(step_dilation=dilation))
    return {"cfg": cfg, "boundaries": list(boundaries)}


EARLIER = {"target_ppl": 190.4, "mapping": {"step_dilation": 65.8}}
SEED = {"methods": {"oracle_chain": {"search": {"boundaries": [10, 20]}}}}


def test_a_set_up_that_does_not_reproduce_is_refused():
    """Catches a rerun compared against another set-up: a target, dilation or window end
    that differs must stop it with the reason; an equal one passes."""
    cona_rerun.check_reproduced("gpt3_1.3b", _setup(), EARLIER, SEED)
    for bad in (_setup(target_ppl=190.5), _setup(dilation=49.1), _setup(boundaries=(10, 21))):
        with pytest.raises(SystemExit, match="does not reproduce"):
            cona_rerun.check_reproduced("gpt3_1.3b", bad, EARLIER, SEED)


def test_seed_files_are_found_where_a_run_or_the_repository_keeps_them(tmp_path):
    """The committed layout (``<stem>_seeds/``) is preferred where it exists, else the
    report's own folder (``--out``'s layout); ``--seeds-dir`` wins."""
    report = tmp_path / "cona_ttp.json"
    assert cona_rerun.seeds_dir(report, None) == tmp_path
    (tmp_path / "cona_ttp_seeds").mkdir()
    assert cona_rerun.seeds_dir(report, None) == tmp_path / "cona_ttp_seeds"
    assert cona_rerun.seeds_dir(report, tmp_path / "x") == tmp_path / "x"


def test_only_a_full_runs_report_is_accepted(tmp_path, capsys):
    """A quick, set-up-only or rerun report, an unknown family and a missing file are
    refused in one line (argparse's exit 2), before any set-up runs."""
    for extra in ({"quick": True}, {"setup_only": True}, {"rerun": {}}):
        path = tmp_path / "r.json"
        path.write_text(json.dumps({"models": {"gpt3_1.3b": {}}, **extra}))
        with pytest.raises(SystemExit) as e:
            cona_rerun.main([str(path)])
        assert e.value.code == 2 and "not a full run's report" in capsys.readouterr().err
    path.write_text(json.dumps({"models": {"gpt3_1.3b": {}}}))
    with pytest.raises(SystemExit):
        cona_rerun.main([str(path), "--families", "bert_large"])
    assert "not families of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cona_rerun.main([str(tmp_path / "none.json")])
    assert "is not a file" in capsys.readouterr().err


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
