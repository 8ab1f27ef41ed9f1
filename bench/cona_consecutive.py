"""Why CONA's probe splits a step rather than pair consecutive steps (``cona/probe.py``).

Where a step yields one gradient, AdaptDL (Pollux's implementation,
``adaptdl/torch/gradient_noise_scale.py``) estimates the noise scale from two consecutive
steps' gradients, ``g_{t-1}`` and ``g_t``, as two batches of ``B`` samples (McCandlish et
al. 2018, App. A.1, with ``B_small = B`` and ``B_big = 2B``).  The weights move between
the two, so their difference also holds the gradient's change over one step, which the
estimate reads as noise.  This bench trains one model and measures, along the same run,
the noise scale two ways, each into its own estimator as the controller builds it
(:meth:`cona.grad_stats.GradientNoiseScale.from_config`: ``cona.gns_average``):

- ``within_step``: the probe's own ``"microbatch"`` mode, from the step's micro-batches
  at one set of weights (what a split step measures);
- ``consecutive``: from each step's global-batch gradient and the previous step's.

Both read the same steps; the run trains as it would without them.  Every ``--every``
steps it records both estimates, the loss and the learning rate.

Usage::

    python bench/cona_consecutive.py --config tiny_gpt --steps 400 --out FILE

Prints one JSON object: ``{"config", "overrides", "global_batch_size",
"micro_batch_size", "gns_average", "steps", "points": [{"step", "loss", "lr", "within_step",
"consecutive"}], "median_ratio", "median_ratio_by_phase": {"warmup", "after"},
"date", "commit", "machine", "command"}`` (noise scales in sequences;
``median_ratio``: of ``consecutive / within_step`` over the points; the phases split at
``train.warmup_iters``).
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread, before torch loads
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(config: str, overrides: list[str], steps: int, every: int) -> dict:
    """Train ``config`` for ``steps`` steps in this process (DP = PP = 1, at least two
    micro-batches per step) with both estimators fed (module docstring); their values
    every ``every`` steps.

    Raises:
        ValueError: a layout with fewer than two micro-batches per step (no within-step
            estimate to compare with).
    """
    import torch

    from cona.grad_stats import GradientNoiseScale
    from cona.probe import GNSProbe, _grad, _is_counted
    from cona.state import build_trainer
    from jobruntime.config import load_config
    from jobruntime.loop import build_data
    from jobruntime.parallel import initialize_layout, set_seed, shutdown

    torch.set_num_threads(1)
    cfg = load_config(config, [*overrides, f"train.iters={steps}", "train.eval_interval=0",
                               "logging.wandb=disabled"])
    p = cfg.parallel
    if p.global_batch_size < 2 * p.micro_batch_size:
        raise ValueError(f"parallel.global_batch_size={p.global_batch_size} runs one "
                         f"micro-batch of {p.micro_batch_size}: set it to >= 2 micro-batches")
    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer = build_trainer(cfg, p.global_batch_size)
    within, consecutive = (GradientNoiseScale.from_config(cfg.cona) for _ in range(2))
    probe = GNSProbe(within)
    probe.attach(trainer)
    inner = trainer.tcfg.finalize_model_grads_func  # the probe's
    last: list = []  # [(gradient copy, its squared norm)] of the previous step

    def finalize(*args, **kwargs):
        out = inner(*args, **kwargs)
        # fp64 copies, not views of the buffers the next step zeroes
        now = [_grad(q).detach().to(torch.float64, copy=True)
               for q in trainer.module.parameters() if _is_counted(q) and _grad(q) is not None]
        sq = float(sum(g.pow(2).sum() for g in now))
        if last:
            prev, prev_sq = last.pop()
            dot = float(sum((a * b).sum() for a, b in zip(now, prev)))
            # |G_small|^2: the mean of the two squared norms (batch B); |G_big|^2: the
            # squared norm of their mean (batch 2B)
            consecutive.update((prev_sq + sq) / 2, p.global_batch_size,
                               (prev_sq + sq + 2 * dot) / 4, 2 * p.global_batch_size)
        last.append((now, sq))
        return out

    trainer.tcfg.finalize_model_grads_func = finalize
    data = build_data(cfg, topo, 0)
    points = []
    for step in range(1, steps + 1):
        result = trainer.train_step(data.train.next())
        if step % every == 0:
            points.append({"step": step, "loss": result.loss, "lr": result.lr,
                           "within_step": within.noise_scale,
                           "consecutive": consecutive.noise_scale})
    probe.detach()
    shutdown()
    return {"global_batch_size": p.global_batch_size, "micro_batch_size": p.micro_batch_size,
            "gns_average": cfg.cona.gns_average, "warmup_steps": cfg.train.warmup_iters,
            "points": points}


def _median_ratio(points: list[dict]) -> float | None:
    ratios = [x["consecutive"] / x["within_step"] for x in points
              if x["consecutive"] and x["within_step"]]
    return statistics.median(ratios) if ratios else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny_gpt")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=20, help="steps between recorded points")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("overrides", nargs="*", help="config overrides, section.key=value")
    args = p.parse_args(argv)
    if args.steps < 2 * args.every or args.every < 1:
        p.error("--steps must cover at least two --every intervals")
    from jobruntime.config import ConfigError
    from jobruntime.metrics import publish_json

    try:  # a world of one process (jobruntime.parallel.init_distributed)
        run = measure(args.config, args.overrides, args.steps, args.every)
    except (ConfigError, ValueError) as e:
        p.error(str(e))
    pts, warm = run["points"], run.pop("warmup_steps")
    out = {"config": args.config, "overrides": args.overrides, "steps": args.steps, **run,
           "median_ratio": _median_ratio(pts),
           "median_ratio_by_phase": {"warmup": _median_ratio([x for x in pts if x["step"] <= warm]),
                                     "after": _median_ratio([x for x in pts if x["step"] > warm])}}
    publish_json(out, args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
