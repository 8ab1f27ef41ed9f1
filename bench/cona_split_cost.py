"""What a split step costs: CONA's noise-scale probe at DP = 1 (``cona/probe.py``).

At DP = 1 with one micro-batch per step (``"split"``) or with PP > 1 (``"calls"``), every
``cona.gns_split_every``-th step runs split so that the probe can read parts of it: its
micro-batch as equal parts, or its micro-batches as equal schedule calls finalised once.
This bench times split steps against plain steps of the same layout, side by side in one
run (split and plain steps alternate, ``split_every=2``), on CPU processes over gloo
(torchrun, one thread each), for tiny_gpt at global batch 8:

- ``dp1-pp1-mb8``: one micro-batch of 8, split into 2 parts of 4 (1 process);
- ``dp1-pp2-mb2``: 4 micro-batches of 2 at PP = 2, run as 2 schedule calls (2 processes);
- ``dp1-pp2-mb8``: one micro-batch of 8 at PP = 2, split into 2 parts, one call each.

Each step's time is the wall time of ``Trainer.train_step`` (max over ranks); the first
``--warmup`` steps are not counted.  Per layout: the median plain and split step, their
ratio, and what splitting every 4th step (the default) adds to the mean step time.

Usage::

    python bench/cona_split_cost.py --steps 40 --out FILE

Prints one JSON object: ``{"preset", "global_batch_size", "steps", "warmup",
"layouts": {NAME: {"dp", "pp", "micro_batch_size", "processes", "mode",
"plain_step_s", "split_step_s", "split_over_plain", "overhead_at_every_4",
"estimates"}}, "load_average_1min", "date", "commit", "machine", "command"}`` (seconds
are wall-clock medians; ``estimates``: noise-scale updates the probe made;
``load_average_1min``: :class:`bench.machine_load.LoadSampler`'s summary, the CPU time
other processes used while it ran).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESET, GB = "tiny_gpt", 8
LAYOUTS = {"dp1-pp1-mb8": (1, 8), "dp1-pp2-mb2": (2, 2), "dp1-pp2-mb8": (2, 8)}  # (pp, mb)


def time_steps(pp: int, mb: int, steps: int, warmup: int, overrides: list[str]) -> dict:
    """Train ``steps`` steps of tiny_gpt at DP = 1, PP = ``pp``, micro-batch ``mb`` on
    the launched processes (a world of ``pp``), the probe splitting every other step;
    the median plain and split step (seconds, max over ranks) after ``warmup`` steps.

    Raises:
        ValueError: the world size is not ``pp``, or the layout splits no step.
    """
    import torch
    import torch.distributed as dist

    from cona.grad_stats import GradientNoiseScale
    from cona.probe import GNSProbe, estimate_mode
    from cona.state import build_trainer
    from cona.switch import max_over_ranks
    from jobruntime.config import load_config
    from jobruntime.loop import build_data
    from jobruntime.parallel import initialize_layout, set_seed, shutdown

    mode = estimate_mode(1, pp, GB // mb, mb, split_every=2)
    if mode not in ("split", "calls"):
        raise ValueError(f"dp1-pp{pp}-mb{mb} at global batch {GB} splits no step "
                         f"(probe mode {mode})")
    torch.set_num_threads(1)
    cfg = load_config(PRESET, [*overrides, f"parallel.pp={pp}", f"parallel.micro_batch_size={mb}",
                               f"parallel.global_batch_size={GB}", f"train.iters={steps}",
                               "train.eval_interval=0", "logging.wandb=disabled"])
    topo = initialize_layout(cfg)
    if dist.get_world_size() != pp:
        raise ValueError(f"dp1-pp{pp} needs {pp} processes, got {dist.get_world_size()}")
    set_seed(cfg.train.seed)
    trainer = build_trainer(cfg, GB)
    probe = GNSProbe(GradientNoiseScale(), split_every=2)
    probe.attach(trainer)
    data = build_data(cfg, topo, 0)
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(steps):
        batch = data.train.next()
        microbatches = probe.prepare(batch)
        split = probe.schedule_calls > 1 or len(microbatches) != len(batch)
        dist.barrier()
        t0 = time.perf_counter()
        trainer.train_step(microbatches, probe.schedule_calls)
        dt = max_over_ranks([time.perf_counter() - t0])[0]
        if step >= warmup:
            times[split].append(dt)
    out = {"dp": 1, "pp": pp, "micro_batch_size": mb, "processes": pp, "mode": probe.mode,
           "estimates": probe.estimator.num_updates}
    probe.detach()
    shutdown()
    plain, split = statistics.median(times[False]), statistics.median(times[True])
    return {**out, "plain_step_s": plain, "split_step_s": split,
            "split_over_plain": split / plain,
            "overhead_at_every_4": (split - plain) / (4 * plain)}


def _launch(name: str, args, work: Path) -> dict:
    """One layout in its own torchrun world; its result from rank 0's file."""
    from jobruntime.ports import free_port

    pp, _ = LAYOUTS[name]
    out = work / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(pp),
           "--master-port", str(free_port()), __file__, "--worker", name, "--out", str(out),
           "--steps", str(args.steps), "--warmup", str(args.warmup), *args.overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    log = work / f"{name}.log"
    with open(log, "w") as f:
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode:
            raise SystemExit(f"error: layout {name} failed; see {log}")
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4, help="first steps not counted")
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--worker", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    args = p.parse_args(argv)
    if args.steps - args.warmup < 4:
        p.error("--steps must leave at least 4 timed steps after --warmup")
    if args.worker:
        result = time_steps(*LAYOUTS[args.worker], args.steps, args.warmup, args.overrides)
        if int(os.environ.get("RANK", "0")) == 0:
            from jobruntime.metrics import json_text

            args.out.write_text(json_text(result))
        return 0
    from bench.machine_load import LoadSampler
    from jobruntime.metrics import publish_json

    work = Path(tempfile.mkdtemp(prefix="cona_split_"))
    with LoadSampler() as load:  # whether anything ran beside it
        layouts = {name: _launch(name, args, work) for name in args.layouts}  # keeps work on failure
    shutil.rmtree(work, ignore_errors=True)
    out = {"preset": PRESET, "overrides": args.overrides, "global_batch_size": GB,
           "steps": args.steps, "warmup": args.warmup, "layouts": layouts,
           "load_average_1min": load.summary()}
    publish_json(out, args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
