"""A bench's work as resumable units: each family's set-up, then each of its seeds.

``run_units`` spreads the units over ``jobs`` spawned processes (one per core; 1: in this
process, debuggable); a family's seeds start as soon as its set-up is done, and each
seed's result is written to ``out/FAMILY/seed_K.json`` as soon as it ends (in any order)
with the key of the set-up it was made under.  With ``reuse`` a seed whose file holds an
equal key is read back instead of run, so a stopped multi-hour run goes on where it
stopped; ``train=False`` runs no seed and reports what is there.  Used by
``bench/cona_ttp.py``; ``run_families`` (one unit per family) and ``write_report`` by the
other CONA benches too.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("bench")


def reusable(path: Path, key: str) -> dict | None:
    """The seed result at ``path`` if it was made under ``key``, else ``None`` (logged):
    also where it cannot be read as a seed result (cut short, edited), so the seed runs
    again and its file is rewritten whole."""
    if not path.is_file():
        return None
    try:
        seed = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        log.warning("%s cannot be read (%s): not reused", path, e)
        return None
    if not isinstance(seed, dict):
        log.warning("%s holds no seed result (a JSON %s): not reused", path, type(seed).__name__)
        return None
    if seed.get("setup_key") != key:
        log.warning("%s was made under another set-up (key %s, now %s): not reused", path,
                    seed.get("setup_key"), key)
        return None
    return seed


def run_units(families: dict, jobs: int, seeds: int, out: str | None, *,
              setup: Callable, seed: Callable, key: Callable, finish: Callable,
              reuse: bool = False, train: bool = True) -> dict:
    """``{family: finish(family, spec, set_up, seed_results)}`` (module docstring).

    Args:
        families: ``{name: spec}``.
        seeds: seeds per family, indices ``0 .. seeds - 1``.
        out: folder for the seed files (``None``: none written or reused).
        setup: ``setup(name, spec) -> set_up`` (picklable, run in a worker).
        seed: ``seed(name, spec, set_up, index) -> dict`` (picklable, run in a worker;
            JSON-serialisable result).
        key: ``key(set_up, index) -> str``, what a seed's result depends on.
        finish: ``finish(name, spec, set_up, seed_results)``, in this process; a family
            with no seed result is left out.

    Each seed result gains ``setup_key`` and ``seed_index`` (and ``reused`` if read back).
    """
    from jobruntime.metrics import write_json_atomic

    with executor(jobs) as pool:
        setups = {pool.submit(setup, name, spec): name for name, spec in families.items()}
        done_setup, seed_futs = {}, {}
        for fut in cf.as_completed(setups):
            name = setups[fut]
            done_setup[name] = set_up = fut.result()
            seed_futs[name] = []
            for i in range(seeds):
                k = key(set_up, i)
                old = reusable(Path(out) / name / f"seed_{i}.json", k) if reuse and out else None
                if old is not None:
                    f = cf.Future()
                    f.set_result(dict(old, reused=True))
                elif train:
                    f = pool.submit(seed, name, families[name], set_up, i)
                else:
                    continue
                seed_futs[name].append((i, k, f))
        # each seed's file as soon as it ends (a stopped run keeps every finished seed)
        pending = {f: (name, i, k) for name, futs in seed_futs.items() for i, k, f in futs}
        done = {}
        for f in cf.as_completed(pending):
            name, i, k = pending[f]
            done[name, i] = result = dict(f.result(), setup_key=k, seed_index=i)
            if out is not None and not result.get("reused"):
                (Path(out) / name).mkdir(parents=True, exist_ok=True)
                write_json_atomic(Path(out) / name / f"seed_{i}.json", result)
        report = {}
        for name, spec in families.items():
            results = [done[name, i] for i, _, _ in seed_futs[name]]
            if results:
                report[name] = finish(name, spec, done_setup[name], results)
        return report


class _Inline(cf.Executor):
    """An executor that runs each task when it is submitted (``jobs == 1``)."""

    def submit(self, fn, /, *args, **kwargs):
        fut = cf.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - handed to the caller by result()
            fut.set_exception(e)
        return fut


def _die_with_parent(parent: int) -> None:
    """A worker's initializer: on Linux the kernel sends it SIGTERM when the process that
    started it dies (``prctl(PR_SET_PDEATHSIG)``, prctl(2)), and it exits at once if that
    process is already gone.  Without it, killing a bench (``kill PID``, not Ctrl-C,
    which signals the whole process group) left its spawned workers running: they went on
    training for an hour beside the next run, wrote into its log and cache, and their
    idle gloo threads took a fifth of a core each."""
    import ctypes
    import os
    import signal
    import sys

    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGTERM, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this worker will not "
                        "end with its parent", ctypes.get_errno())
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def executor(jobs: int) -> cf.Executor:
    """``jobs`` spawned worker processes (each ends when this process dies:
    :func:`_die_with_parent`), or for ``jobs == 1`` this process."""
    if jobs == 1:
        return _Inline()
    import os

    return cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"),
                                  initializer=_die_with_parent, initargs=(os.getpid(),))


def write_report(report: dict, out: Path | None, name: str) -> None:
    """Print ``report`` as JSON; with ``out`` also write it to ``out/name`` (through a
    temporary name, so a killed run leaves no half-written report)."""
    from jobruntime.metrics import json_text, write_json_atomic

    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / name, report)
    print(json_text(report, indent=2))


def run_families(fn, models: dict, jobs: int, *args) -> dict:
    """``{name: fn(name, spec, *args)}`` over ``models``; ``jobs`` > 1 runs them in that
    many spawned processes (one per core), 1 in this process (easier to debug)."""
    with executor(min(jobs, len(models))) as pool:
        futures = {name: pool.submit(fn, name, spec, *args) for name, spec in models.items()}
        return {name: fut.result() for name, fut in futures.items()}
