"""Planning and emulated-clock cost at scale: 16, 128 and 1,000 workers.

The cluster is ``geomesh/clusters/four_region.yaml`` with every worker
replicated ``K/4`` times in its region (8xH100 East US, 8xA100 West Europe,
8xV100 Japan East TP=2, 8xT4 Australia East TP=4; four GPU types), target
GPT-3 1.3B, ``T = H · G · s`` with ``G = 512 · K/4`` sequences, in two setups
(``SETUPS``): ``quick_bench`` — ``H = 8``, balancing by steps, the memory
model counting GeoMesh's own state (8.25 B/param), as ``bench/geomesh_ttp.py``
plans — and ``planner_defaults`` — :class:`~geomesh.fleet.planner.Planner`'s
defaults (``H = 20``, balancing by batch).  Per setup and size it measures,
on one thread:

* ``plan_s``: CPU seconds of ``Planner(...).plan()`` (a fresh planner; CPU
  time of the process, best of ``--repeat``, so that other jobs on a shared
  machine do not count);
* ``replan_s``: :meth:`Planner.replan` after worker 0 measures 2x slower
  than planned (one worker throttles);
* ``imbalance`` / ``replan_imbalance``: the plans' relative compute spread,
  the latter under the true (slowed) speeds;
* ``clock_round_s``: one emulated outer round as ``geomesh/sync.py`` charges
  it — each worker's step time from the GPU profile, ``compute`` on the
  :class:`~geomesh.fleet.clock.EmulatedClock`, the hierarchical exchange of the
  GeoMesh message (``clock_round_overlap_s``: the same with the exchange
  overlapped with the next round, ``geomesh.overlap=1``).

Prints one JSON object ``{"setups": {setup: {K: {...}}}, "reference": {...}?}``.
``--reference DIR`` also runs this script against another checkout (e.g. the
``main`` branch before the grouped planner) in a subprocess and reports its
timings side by side (``speedup``).

    python bench/geomesh_plan.py                       # ~10 s on one core
    python bench/geomesh_plan.py --reference ../main   # + the old planner (minutes)
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if os.environ.get("GEOMESH_PLAN_BENCH_REPO"):  # --reference: import the other checkout
    sys.path.insert(0, os.environ["GEOMESH_PLAN_BENCH_REPO"])
else:
    sys.path.insert(0, str(REPO))

SIZES = (16, 128, 1000)
G_PER_WORKER = 128  # G = 512 on the 4-worker cluster
SETUPS = {"quick_bench": dict(inner_steps=8, balance="steps", extra_bytes_per_param=8.25),
          "planner_defaults": dict(inner_steps=20, balance="batch", extra_bytes_per_param=0.0)}


def scaled_cluster(k: int):
    """four_region with each worker replicated ``k/4`` times in its region."""
    import yaml

    from geomesh.fleet.cluster import CLUSTERS_DIR, cluster_from_dict

    raw = yaml.safe_load((CLUSTERS_DIR / "four_region.yaml").read_text())
    base = raw["workers"]
    raw["workers"] = [dict(w, name=f"{w['name']}-{j}") for w in base for j in range(k // len(base))]
    return cluster_from_dict(raw, base_dir=CLUSTERS_DIR)


def _timed(fn, repeat: int = 3):
    """``(best CPU seconds of this process, result)`` over ``repeat`` calls: CPU
    time, not wall time, so that other jobs on a shared machine do not count."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.process_time()
        out = fn()
        best = min(best, time.process_time() - t0)
    return best, out


def measure(k: int, repeat: int, setup: dict) -> dict:
    from geomesh.fleet.clock import EmulatedClock, inner_step_time_s
    from geomesh.fleet.planner import Planner
    from geomesh.fleet.worker_models import MemoryModel
    from jobruntime.config import load_config
    from jobruntime.flops import num_params

    target = load_config("gpt3_1.3b")
    model = target.model
    cluster = scaled_cluster(k)

    H = setup["inner_steps"]

    def planner():
        return Planner(cluster, model, tokens_per_round=H * G_PER_WORKER * k * model.seq_length,
                       inner_steps=H, balance=setup["balance"],
                       memory=MemoryModel(model=model,
                                          extra_bytes_per_param=setup["extra_bytes_per_param"]))

    plan_s, plan = _timed(lambda: planner().plan(), repeat)
    p = planner()
    p.plan()
    slow = cluster.workers[0].name
    measured = {wp.worker: wp.step_time_s * (2.0 if wp.worker == slow else 1.0)
                for wp in p.current.workers}

    def replan():
        q = planner()
        q.plan()
        t0 = time.process_time()
        new = q.replan(measured)
        return time.process_time() - t0, new

    replan_s, new = min((replan() for _ in range(repeat)), key=lambda x: x[0])
    workers = {w.name: w for w in cluster.workers}
    true = [wp.inner_steps * inner_step_time_s(workers[wp.worker], model, wp.micro_batch_size,
                                               wp.grad_accum) * (2.0 if wp.worker == slow else 1.0)
            for wp in new.workers]  # compute under the true (slowed) speeds
    msg = num_params(model) // 8 * 32 // 31  # ~ the sign message at 31x; size does not change the cost

    def one_round(overlap: float):
        clock = EmulatedClock(cluster, overlap=True) if overlap else EmulatedClock(cluster)
        for wp in plan.workers:
            w = workers[wp.worker]
            t = inner_step_time_s(w, model, wp.micro_batch_size, wp.grad_accum,
                                  seq_length=wp.seq_length) * cluster.slowdown_factor(w.name, 0)
            clock.compute(w.name, t * wp.inner_steps)
        sched = clock.exchange({w.name: msg for w in cluster.workers})
        if overlap:  # the next round's compute, then every worker waits for the messages
            for w in cluster.workers:
                clock.compute(w.name, 1.0)
                clock.wait(w.name)
        return sched

    clock_s, _ = _timed(lambda: one_round(0.0), repeat)
    out = dict(workers=k, plan_s=plan_s, replan_s=replan_s, imbalance=plan.imbalance,
               replan_imbalance=(max(true) - min(true)) / max(true),
               round_time_s=plan.round_time_s, total_tokens=plan.total_tokens,
               target_tokens=plan.target_tokens, clock_round_s=clock_s)
    if "overlap" in inspect.signature(EmulatedClock).parameters:  # not in older checkouts
        out["clock_round_overlap_s"], _ = _timed(lambda: one_round(1.0), repeat)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=int, default=list(SIZES),
                   help="worker counts (multiples of 4)")
    p.add_argument("--repeat", type=int, default=3, help="best of N timings")
    p.add_argument("--reference", default=None, metavar="DIR",
                   help="another checkout to time the same way (e.g. the main branch)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # "on one core"
    t0 = time.perf_counter()
    report = {"clock": "emulated (round) / wall (planning)", "threads": 1,
              "setups": {name: {str(k): measure(k, args.repeat, setup) for k in args.sizes}
                         for name, setup in SETUPS.items()}}
    if args.reference:
        env = {**os.environ, "GEOMESH_PLAN_BENCH_REPO": str(Path(args.reference).resolve())}
        cmd = [sys.executable, __file__, "--repeat", "1", "--sizes", *map(str, args.sizes)]
        ref = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                        text=True).stdout)
        report["reference"] = {"repo": str(args.reference), "setups": ref["setups"]}
        for name, sizes in ref["setups"].items():
            for k, r in sizes.items():
                mine = report["setups"][name][k]
                mine["speedup_plan"] = r["plan_s"] / mine["plan_s"]
                mine["speedup_replan"] = r["replan_s"] / mine["replan_s"]
                mine["same_plan_as_reference"] = (r["imbalance"], r["total_tokens"]) == \
                    (mine["imbalance"], mine["total_tokens"])
    report["wall_s"] = time.perf_counter() - t0
    # strict JSON without jobruntime.metrics.json_text: --reference imports another checkout
    print(json.dumps(report, indent=2, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
