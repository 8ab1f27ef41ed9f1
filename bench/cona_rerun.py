"""CONA alone, run again against an earlier full run's other methods (a development loop).

A full ``bench/cona_ttp.py`` run costs about 100 minutes for two families on 2 cores,
CONA itself a few percent of it.  To try a change to the controller, this script runs
each family's set-up again (rules 1-5a), checks that it reproduces the earlier run's
(target perplexity, the oracle's window ends and the step dilation equal), and then
runs only CONA on each seed, from that seed's warm state; every other method is read
back from the earlier run's seed files.  The report has ``cona_ttp.json``'s shape and
says what it is (``rerun``: the methods run again, and the file, commit and date the
others come from).  Its ratios mix two commits: a result for the README comes from one
full run, never from this.

Usage::

    python bench/cona_rerun.py docs/results/cona_ttp.json --families gpt3_1.3b \\
        --cache-dir runs/cache --out runs/rerun [--cona efficiency_correction=progress]

``--cona KEY=VALUE`` sets a ``cona.*`` setting for CONA's runs only (the set-up and every
other method are as the earlier run's); the report's ``rerun.cona_settings`` records it.

The earlier run's seed files are read from ``--seeds-dir`` (default: the report's folder,
``FAMILY/seed_K.json`` as ``--out`` writes them, or ``<report stem>_seeds/FAMILY/`` as
committed under ``docs/results/``).

Raises ``SystemExit`` with the reason where a set-up does not reproduce or a seed file is
missing.
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread, as bench/cona_ttp.py
    os.environ[_v] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import cona_ttp as ttp  # noqa: E402
from bench.seeded_units import run_units, write_report  # noqa: E402


def seeds_dir(report: Path, given: Path | None) -> Path:
    """Where the earlier run's ``FAMILY/seed_K.json`` files lie (module docstring)."""
    if given is not None:
        return given
    committed = report.with_name(f"{report.stem}_seeds")
    return committed if committed.is_dir() else report.parent


def check_reproduced(target: str, setup: dict, earlier: dict, seed: dict) -> None:
    """Raise ``SystemExit`` unless ``setup`` (this run's rules 1-5a) equals the earlier
    run's: target perplexity (relative 1e-9), step dilation (1e-9), the oracle's window
    ends (in ``seed``'s search record) and the batch Adam's ``beta2`` is anchored at
    (rule 5a; ``None`` in a run made before it) — what every method's result depends on
    beyond the code."""
    cfg = setup["cfg"]
    then = {"target_ppl": earlier["target_ppl"],
            "step_dilation": earlier["mapping"]["step_dilation"],
            "boundaries": seed["methods"]["oracle_chain"]["search"]["boundaries"],
            "adam_beta2_batch": earlier.get("recipe", {}).get("adam_beta2_batch")}
    now = {"target_ppl": cfg.train.target_ppl, "step_dilation": cfg.cona.step_dilation,
           "boundaries": setup["boundaries"], "adam_beta2_batch": cfg.cona.adam_beta2_batch}
    same = (math.isclose(now["target_ppl"], then["target_ppl"], rel_tol=1e-9)
            and math.isclose(now["step_dilation"], then["step_dilation"], rel_tol=1e-9)
            and list(now["boundaries"]) == list(then["boundaries"])
            and now["adam_beta2_batch"] == then["adam_beta2_batch"])
    if not same:
        raise SystemExit(f"{target}: the set-up does not reproduce the earlier run's "
                         f"(now {now}, then {then}); a comparison needs a full run "
                         "(bench/cona_ttp.py)")


def parse_cona_settings(items: list[str]) -> dict:
    """``["KEY=VALUE", ...]`` (``--cona``) as ``{key: value}`` for
    :func:`cona.baselines.run_cona`, each read as the override ``cona.KEY=VALUE`` by
    :func:`jobruntime.config.load_config` (its YAML values, types and choices).

    Raises:
        ValueError: not ``KEY=VALUE``, not a ``cona.*`` setting, or a value it refuses.
    """
    from jobruntime.config import ConfigError, load_config

    out = {}
    for item in items:
        key, eq, _ = item.partition("=")
        try:
            if not eq or not key:
                raise ConfigError("no KEY=")
            out[key] = getattr(load_config(None, [f"cona.{item}"]).cona, key)
        except ConfigError as e:
            raise ValueError(f"--cona {item}: give KEY=VALUE with KEY a cona.* setting "
                             f"({e})") from None
    return out


def rerun_seed(target: str, spec: dict, setup: dict, seed_index: int, settings: dict,
               earlier: dict, folder: str, cona_settings: dict | None = None) -> dict:
    """Seed ``seed_index`` (in a worker): the earlier run's seed with CONA run again from
    this seed's warm state (:func:`cona.baselines.run_cona`, with ``cona_settings``)."""
    import copy

    ttp.worker_setup(spec["proxy"])
    from bench.cona_reference import seed_context
    from cona.baselines import run_cona

    path = Path(folder) / target / f"seed_{seed_index}.json"
    if not path.is_file():
        raise SystemExit(f"{path} is missing: the earlier run's seed {seed_index} of {target}")
    seed = json.loads(path.read_text())
    check_reproduced(target, setup, earlier, seed)
    t0, c0 = time.perf_counter(), time.process_time()
    cfg = copy.deepcopy(setup["cfg"])
    cfg.train.seed += seed_index
    ctx, cached = seed_context(cfg, cfg.train.warmup_iters,
                              probe_microbatches=settings.get("probe_microbatches", 64))
    methods = {k: v for k, v in seed["methods"].items() if not k.startswith("cona")}
    # the earlier ablation rows (cona_gns_*) left out
    methods["cona"] = run_cona(ctx, **(cona_settings or {}))[0]
    wall = time.perf_counter() - t0
    return {"methods": methods, "warm": {"cached": cached, **ctx.warm["extra"]},
            "wall_s": wall, "cpu_s": time.process_time() - c0, "phase_wall_s": {"cona": wall}}


def read_seed(path: Path) -> dict:
    """The earlier run's seed file at ``path`` (``bench/cona_ttp.py --out``'s
    ``FAMILY/seed_K.json``), checked to hold what a re-run reads: a ``setup_key`` and
    CONA's record (``methods.cona`` with ``ttp_s``).

    Raises:
        ValueError: naming ``path``: missing, not JSON (e.g. cut short), or without those.
    """
    try:
        seed = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as a seed file ({e})") from None
    cona = seed.get("methods", {}).get("cona") if isinstance(seed, dict) else None
    if not isinstance(cona, dict) or "ttp_s" not in cona or "setup_key" not in seed:
        raise ValueError(f"{path} is not a bench/cona_ttp.py seed file (it needs setup_key "
                         "and methods.cona with ttp_s)")
    return seed


def earlier_cona(folder: Path, target: str, seeds: int) -> dict:
    """The earlier run's CONA per seed, from its seed files: ``{"ttp_s_by_seed",
    "chain_by_seed"}`` (each seed's TTP in emulated seconds, its chain's labels)."""
    runs = [read_seed(folder / target / f"seed_{i}.json")["methods"]["cona"]
            for i in range(seeds)]
    return {"ttp_s_by_seed": [r["ttp_s"] for r in runs],
            "chain_by_seed": [[c["strategy"] for c in r.get("chain") or []] for r in runs]}


def check_earlier(report: Path, families: list[str] | None, given: Path | None,
                  out: Path | None) -> tuple[dict, list[str], Path, int]:
    """Everything a re-run reads, checked before any set-up runs: ``(earlier report,
    families, seed folder, seeds)``.

    Raises:
        ValueError: the report is not a full run's (unreadable, quick, set-up only, a
            re-run, no families, families with different seed counts), a family is not
            in it, a seed file is missing, cannot be read or holds no CONA record
            (:func:`read_seed`), or was made by another run (its key is not the
            one the report names) or by a re-run, or ``out`` is the seed folder (the
            re-run's seed files would overwrite the earlier ones).
    """
    try:
        earlier = json.loads(report.read_text())
        runs = {n: m["seed_runs"] for n, m in earlier["models"].items()}
        earlier["gpu"], earlier["num_gpus"]  # noqa: B018 - present, or not a full report
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{report} is not a bench/cona_ttp.py report ({e!r})") from None
    if earlier.get("quick") or earlier.get("setup_only") or "rerun" in earlier or not runs:
        raise ValueError(f"{report} is not a full run's report")
    names = families or list(runs)
    unknown = [n for n in names if n not in runs or n not in ttp.MODELS]
    if unknown:
        raise ValueError(f"{unknown}: not families of {report}")
    counts = {n: len(runs[n]) for n in names}
    if len(set(counts.values())) != 1:
        raise ValueError(f"the families ran different seed counts {counts}: re-run one "
                         "family at a time (--families)")
    folder = seeds_dir(report, given)
    if out is not None and out.resolve() == folder.resolve():
        raise ValueError(f"--out {out} is the earlier run's seed folder: choose another")
    for n in names:
        for i, run in enumerate(runs[n]):
            path = folder / n / f"seed_{i}.json"
            key = read_seed(path)["setup_key"] if path.is_file() else None
            if key is None or key.startswith("rerun-") or key != run.get("setup_key", key):
                raise ValueError(f"{path} is missing or not the seed {i} that {report} "
                                 "names (--seeds-dir)")
    return earlier, names, folder, counts[names[0]]


def compare_cona(now: dict, then: dict) -> dict:
    """The earlier run's CONA beside this one's, over the seeds both ran:
    ``{"ttp_s_by_seed": then's (emulated seconds, ``None`` where a seed missed),
    "chain_by_seed": then's, "equal": whether every seed's TTP and chain are the same}``
    (a change to the controller shows here; no change must give equal)."""
    n = min(len(now.get("ttp_s_by_seed") or []), len(then.get("ttp_s_by_seed") or []))
    t_now, t_then = now["ttp_s_by_seed"][:n], then["ttp_s_by_seed"][:n]
    chains = [(m.get("chain_by_seed") or [])[:n] for m in (now, then)]
    equal = n > 0 and t_now == t_then and chains[0] == chains[1] and len(chains[0]) == n
    return {"ttp_s_by_seed": t_then, "chain_by_seed": chains[1], "equal": equal}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", type=Path, help="the earlier full run's cona_ttp.json")
    p.add_argument("--seeds-dir", type=Path, default=None,
                   help="its seed files' folder (default: see above)")
    p.add_argument("--families", nargs="*", default=None, help="subset of its families")
    p.add_argument("--out", type=Path, default=None, help="folder for JSON and seed files")
    p.add_argument("--cache-dir", default=None, help="data.cache_dir (warm checkpoints)")
    p.add_argument("--jobs", type=int, default=2, help="processes (default 2)")
    p.add_argument("--cona", action="append", default=[], metavar="KEY=VALUE",
                   help="a cona.* setting for CONA's runs only (repeatable, e.g. "
                        "efficiency_correction=progress); the report records it")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    try:
        cona_settings = parse_cona_settings(args.cona)
    except ValueError as e:
        p.error(str(e))
    try:
        earlier, names, folder, seeds = check_earlier(args.report, args.families,
                                                      args.seeds_dir, args.out)
    except ValueError as e:
        p.error(str(e))
    from jobruntime.metrics import provenance
    from jobruntime.outputs import refuse_output_folder

    refuse_output_folder(p, args.out)
    before = {n: earlier_cona(folder, n, seeds) for n in names}  # read before any write
    settings = dict(ttp.FULL, gpu=earlier["gpu"], num_gpus=earlier["num_gpus"],
                    time_scale="calibrated", gns_ablations=(), seeds=seeds,
                    precision=earlier.get("precision"))  # a report before the key: the preset's
    models = {n: ttp.MODELS[n] for n in names}
    report = {"clock": "emulated", "gpu": earlier["gpu"], "num_gpus": earlier["num_gpus"],
              "quick": False, **provenance(argv),
              "rerun": {"methods": ["cona"], "cona_settings": cona_settings, "others_from": {
                  "file": str(args.report), **{k: earlier.get(k) for k in ("commit", "date")}}}}
    t0 = time.perf_counter()
    out = str(args.out) if args.out is not None else None
    report["models"] = run_units(
        models, args.jobs, settings["seeds"], out,
        setup=partial(ttp.setup_task, settings=settings, cache_dir=args.cache_dir),
        seed=partial(_seed_for, settings=settings, report=earlier, folder=str(folder),
                     cona_settings=cona_settings),
        key=lambda setup, i: "rerun-" + ttp.setup_key(setup, i, settings),
        finish=partial(ttp.finish_family, settings=settings, out=out))
    for name, m in report["models"].items():  # the earlier CONA beside this one
        m["cona_earlier"] = compare_cona(m["methods"]["cona"], before[name])
    report["wall_s"] = time.perf_counter() - t0
    write_report(report, args.out, "cona_rerun.json")
    return 0


def _seed_for(target, spec, setup, seed_index, *, settings, report, folder, cona_settings):
    """:func:`rerun_seed` with the earlier report's entry for ``target``."""
    return rerun_seed(target, spec, setup, seed_index, settings, report["models"][target],
                      folder, cona_settings)


if __name__ == "__main__":
    sys.exit(main())
