"""How the CONA bench runs its seeds and combines them (``bench/seeded_units.py``,
``bench/cona_aggregate.py``): each seed's file written as it ends and reused only under its
own set-up key, workers that end with the bench, and the means over seeds."""

from __future__ import annotations

from pathlib import Path

import pytest


def test_seeds_aggregate_to_a_mean_with_misses_as_null_and_layout_switches_counted():
    """Catches a mean that skips a seed that missed the target (a biased ``ttp_s``), a
    missed seed not reported as null, or batch switches counted as layout switches: seeds
    at 10 s and 14 s give 12 s; one missed gives ``ttp_s`` null with the miss in
    ``ttp_s_by_seed``; a chain dp8-tp8 gb64 -> dp8-tp8 gb128 -> dp16-tp4 gb128 has two
    switches, one of them a layout switch (also the plot's marker kinds)."""
    from bench.cona_aggregate import aggregate
    from bench.cona_plot import switch_points

    chain = [{"strategy": "dp8-tp8-pp1-mb8-gb64"}, {"strategy": "dp8-tp8-pp1-mb8-gb128"},
             {"strategy": "dp16-tp4-pp1-mb8-gb128"}]
    a = {"cona": {"ttp_s": 10.0, "chain": chain, "switches": 2, "switch_times_s": [1.0, 2.0]}}
    b = {"cona": {"ttp_s": 14.0, "chain": chain[:1], "switches": 0, "lr_factor": 0.5}}
    miss = {"cona": {"ttp_s": None, "chain": chain[:1], "switches": 0}}
    out = aggregate([a, b])["cona"]
    assert out["ttp_s"] == pytest.approx(12.0) and out["ttp_s_by_seed"] == [10.0, 14.0]
    assert out["layout_switches"] == 1 and out["layout_switches_by_seed"] == [1, 0]
    assert out["switches"] == 2 and out["switches_by_seed"] == [2, 0]
    assert out["lr_factor_by_seed"] == [None, 0.5]  # each seed's own, not the first's
    assert out["chain_by_seed"] == [[c["strategy"] for c in chain], [chain[0]["strategy"]]]
    missed = aggregate([a, miss])["cona"]
    assert missed["ttp_s"] is None and missed["ttp_s_by_seed"] == [10.0, None]
    assert switch_points(a["cona"]) == [(1.0, "batch"), (2.0, "layout")]


def test_best_static_chosen_once_is_the_lowest_mean_and_sizes_the_selection(monkeypatch):
    """Catches a "best static chosen once" that is each seed's own best again (no
    selection sized), a mean over seeds taken from one seed, or a cut run's lower bound
    reported as a TTP.  Three settings on two seeds, ``static_oracle`` each seed's best:
    A reaches at 10 and 14 s (mean 12), B at 9 and 17 (13), C is cut at 12 on the first
    seed and reaches 11 on the second (its mean 11.5 is a bound, below A's).  So the
    winner is C with ``ttp_s`` null and bound 11.5; without C, A at 12 s exact; the
    selection is the mean of the seeds' best (9 and 11, or 9 and 14) over that."""
    from bench.cona_aggregate import static_fixed

    def seed(runs):
        best = min((r[2] for r in runs if r[2] is not None), default=None)
        keys = ("strategy", "lr_factor", "ttp_s", "ttp_lower_bound_s")
        return {"static_oracle": {"ttp_s": best, "runs": [dict(zip(keys, r)) for r in runs]}}

    a, b, c = ("gb256", 1.0), ("gb128", 1.0), ("gb256", 0.5)
    seeds = [[(*a, 10.0, None), (*b, 9.0, None), (*c, None, 12.0)],
             [(*a, 14.0, None), (*b, 17.0, None), (*c, 11.0, None)]]
    out = static_fixed([seed(r) for r in seeds])
    assert (out["strategy"], out["lr_factor"], out["ttp_s"]) == ("gb256", 0.5, None)
    assert out["ttp_lower_bound_s"] == pytest.approx(11.5)
    assert out["ttp_s_by_seed"] == [None, 11.0]
    assert out["selection"] == pytest.approx(10.0 / 11.5)
    exact = static_fixed([seed(r[:2]) for r in seeds])
    assert (exact["strategy"], exact["ttp_s"], exact["ttp_s_by_seed"]) == ("gb256", 12.0, [10.0, 14.0])
    assert exact["selection"] == pytest.approx(11.5 / 12.0)
    assert static_fixed([{"static_oracle": {"ttp_s": 3.0}}]) is None  # an older JSON
    # the recipe's 1x run is in the sweep twice (the search's own, reused): counted once
    twice = [r[:1] + r for r in seeds]
    assert static_fixed([seed(r) for r in twice]) == static_fixed([seed(r) for r in seeds])
    assert static_fixed([seed(r[:1] * 2) for r in seeds])["ttp_s"] == pytest.approx(12.0)
    longer = [[(*c, None, 12.0), (*c, None, 13.0)], [(*c, 11.0, None)]]  # cut twice: 13 holds
    assert static_fixed([seed(r) for r in longer])["ttp_lower_bound_s"] == pytest.approx(12.0)
    assert static_fixed([seed(r) for r in longer])["selection"] is None  # a seed with no best
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    from render_cona import _static_fixed  # its line: a bound read as a bound

    assert "≥ 12 s" in _static_fixed(out, 6.0) and "1.92x (at least" in _static_fixed(out, 6.0)
    assert "at most 0.87x" in _static_fixed(out, 6.0)
    assert "12 s mean" in _static_fixed(exact, 6.0) and "at least" not in _static_fixed(exact, 6.0)
    assert _static_fixed(None, 6.0) == ""


def test_bench_runs_each_seed_of_a_family_after_its_setup_and_reuses_only_its_own(
        tmp_path):
    """Catches a scheduler that gives every seed the same seed index, hands a seed another
    family's setup, drops a seed's result or writes it nowhere, or a reuse that reads back
    a seed made under another set-up: two families of three seeds (in-process executor)
    must each get seeds 0, 1, 2 with their own setup, every seed's result must reach its
    family's report and ``out/NAME/seed_K.json``; a second run with ``reuse`` and no
    training reports the same seeds from disk, except one whose set-up key changed or
    whose file cannot be read (run again with training)."""
    import json

    from bench.seeded_units import run_units

    calls = []

    def seed(name, spec, setup, i):
        calls.append((name, setup["of"], i))
        return {"seed": i, "of": setup["of"]}

    fns = dict(setup=lambda name, spec: {"of": name}, seed=seed,
               key=lambda setup, i: f"{setup['of']}{i}",
               finish=lambda name, spec, setup, seeds: {"seeds": seeds})
    models = {"a": {}, "b": {}}
    report = run_units(models, 1, 3, str(tmp_path), **fns)
    assert sorted(calls) == [(f, f, i) for f in "ab" for i in range(3)]
    for f in "ab":
        assert [(x["seed"], x["of"], x["seed_index"]) for x in report[f]["seeds"]] == \
            [(i, f, i) for i in range(3)]
        assert json.loads((tmp_path / f / "seed_2.json").read_text())["setup_key"] == f"{f}2"
    fns["key"] = lambda setup, i: "changed" if (setup["of"], i) == ("b", 1) else \
        f"{setup['of']}{i}"
    calls.clear()
    again = run_units(models, 1, 3, str(tmp_path), reuse=True, train=False, **fns)
    assert calls == []
    assert [x["seed_index"] for x in again["a"]["seeds"]] == [0, 1, 2]
    assert [x["seed_index"] for x in again["b"]["seeds"]] == [0, 2]
    assert all(x["reused"] for f in "ab" for x in again[f]["seeds"])
    # a seed file cut short or of another shape is not reused (it crashed the bench
    # after its set-up, naming no file); with training, the seed runs again
    (tmp_path / "a" / "seed_0.json").write_text('{"setup_key": "a0", "seed')
    (tmp_path / "a" / "seed_1.json").write_text("[]")
    again = run_units(models, 1, 3, str(tmp_path), reuse=True, train=False, **fns)
    assert [x["seed_index"] for x in again["a"]["seeds"]] == [2]
    run_units(models, 1, 3, str(tmp_path), reuse=True, **fns)
    assert sorted(c for c in calls if c[0] == "a") == [("a", "a", 0), ("a", "a", 1)]
    assert json.loads((tmp_path / "a" / "seed_0.json").read_text())["setup_key"] == "a0"


def test_a_seed_file_is_written_as_soon_as_its_seed_ends(monkeypatch, tmp_path):
    """Catches seed files written in seed order: a run stopped while seed 0 was still
    training lost seed 1, which had ended an hour earlier.  Seed 0 here ends only after it
    sees seed 1's file (or after 5 s: then the file was not written in time)."""
    import concurrent.futures as cf
    import time

    import bench.seeded_units as units

    seen = []

    def seed(name, spec, setup, i):
        if i == 0:
            t0 = time.monotonic()
            while not (tmp_path / name / "seed_1.json").exists() and time.monotonic() - t0 < 5:
                time.sleep(0.02)
            seen.append((tmp_path / name / "seed_1.json").exists())
        return {"seed": i}

    monkeypatch.setattr(units, "executor", lambda jobs: cf.ThreadPoolExecutor(max_workers=2))
    units.run_units({"a": {}}, 2, 2, str(tmp_path), setup=lambda name, spec: {}, seed=seed,
                    key=lambda setup, i: f"k{i}", finish=lambda *a: {})
    assert seen == [True]


def test_setup_key_names_what_a_seed_depends_on_and_not_how_many_seeds_run():
    """Catches a key over the seed count (a one-seed run's seed 0 could then not be
    reused by a three-seed run of the same set-up) or one that misses a setting a seed
    does depend on (its reuse would report another bench's result)."""
    from bench.cona_ttp import FULL, setup_key
    from jobruntime.config import load_config

    setup = {"cfg": load_config("tiny_gpt", []), "boundaries": [10, 20]}
    key = setup_key(setup, 0, dict(FULL, time_scale="calibrated"))
    assert setup_key(setup, 0, dict(FULL, seeds=1, time_scale="measured")) == key
    assert setup_key(setup, 1, dict(FULL)) != key
    assert setup_key(setup, 0, dict(FULL, windows=3)) != key
    assert setup_key(dict(setup, boundaries=[10, 21]), 0, dict(FULL)) != key


_PARENT = """
import sys, time
sys.path.insert(0, {root!r})
from bench.seeded_units import executor
from tests.test_cona_bench_seeds import _report_pid_and_sleep

pool = executor(2)
futures = [pool.submit(_report_pid_and_sleep, {out!r}, i) for i in range(2)]
time.sleep(600)
"""


def _report_pid_and_sleep(folder: str, i: int) -> None:
    import os
    import time

    Path(folder, f"{i}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def test_bench_workers_end_when_the_bench_is_killed(tmp_path):
    """Catches a bench's spawned workers outliving it: killed with SIGKILL (as ``kill -9
    PID`` of the bench alone, not its process group), its two workers, each in a task of
    10 minutes, are gone within 20 s (they ran on for an hour beside the next run before
    ``bench.seeded_units._die_with_parent``)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    root = str(Path(__file__).resolve().parent.parent)
    parent = subprocess.Popen([sys.executable, "-c", _PARENT.format(root=root, out=str(tmp_path))],
                              cwd=root, start_new_session=True)
    try:
        deadline = time.time() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.time() < deadline:
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert len(pids) == 2, "the workers did not start"
        parent.send_signal(signal.SIGKILL)
        parent.wait()

        def alive(pid: int) -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            state = Path(f"/proc/{pid}/stat").read_text().split()[2] \
                if Path(f"/proc/{pid}/stat").exists() else "X"
            return state != "Z"  # a zombie has ended

        deadline = time.time() + 20
        while any(alive(p) for p in pids) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(alive(p) for p in pids)
    finally:
        if parent.poll() is None:
            parent.kill()
        for p in tmp_path.glob("*.pid"):
            try:
                os.kill(int(p.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
