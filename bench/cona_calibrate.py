"""Calibration of the CONA bench's target fraction: noise-scale growth against target depth.

:data:`cona.targets.TARGET_FRACTION` must put the target deep enough that the reference's
directly measured noise scale grows at least 4x over the evaluated segment (issue 23).
This bench measures that growth as a function of the fraction, on the full bench's proxy
of one family (``bench/cona_ttp.py``: narrowed preset, warm state, one torch thread): the
reference (preset batch, the scaling rule's LR) trains from the warm state, and the first
time its validation perplexity falls below ``f x min(unigram, warm ppl)`` for each ``f``
in ``--fractions`` the noise scale is measured directly
(:data:`bench.cona_ttp.PROBE_MICROBATCHES` micro-batches) and divided by the warm
state's.  No CONA method runs: the calibration uses the reference alone, as the bench's
rule 3 does.

Usage::

    python bench/cona_calibrate.py --family gpt3_1.3b --cache-dir C > out.json

Prints one JSON object: ``{"family", "proxy", "unigram_ppl", "warm_ppl",
"noise_scale_warm_proxy", "rows": [{"fraction", "target_ppl", "reached", "step",
"val_ppl", "noise_scale_proxy", "growth"}], "date", "commit", "machine", "command"}``
(``growth``: the noise scale where the reference first crossed the fraction over the
warm state's; ``reached`` false where it did not within the family's budget).
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread, as the bench (before torch)
    os.environ[_v] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def calibrate(family: str, fractions: list[float], cache_dir: str | None) -> dict:
    """The growth of the directly measured noise scale at each target ``fractions`` of
    ``min(unigram, warm ppl)`` along ``family``'s reference run (module docstring)."""
    from bench.cona_ttp import (
        FULL,
        MODELS,
        PROBE_MICROBATCHES,
        family_config,
        seed_context,
        worker_setup,
    )
    from cona.run import Loop
    from cona.targets import corpus_unigram_perplexity

    spec = MODELS[family]
    worker_setup(spec["proxy"])
    settings = dict(FULL, gpu="A100-80GB", num_gpus=64)
    cfg = family_config(family, spec, settings, cache_dir)
    ctx, _ = seed_context(cfg, cfg.train.warmup_iters, probe_microbatches=PROBE_MICROBATCHES)
    unigram = corpus_unigram_perplexity(ctx.data.corpus, cfg.model.vocab_size)
    warm_ppl, phi0 = ctx.warm["extra"]["val_ppl"], ctx.warm["extra"]["noise_scale_proxy"]
    base = min(unigram, warm_ppl)
    ctx.cfg.train.target_ppl = None  # the loop runs until every fraction is met (or budget)
    todo = sorted(fractions, reverse=True)  # shallowest first: the order the run meets them
    rows = []
    job = ctx.make_job(ctx.reference_strategy())
    loop = Loop(job, ctx.cfg, budget_samples=ctx.budget_samples, eval_samples=ctx.eval_samples,
                keep_records=False)
    while todo and not loop.done:
        n = len(loop.progress.evals)
        loop.step()
        if len(loop.progress.evals) == n:
            continue
        ppl = loop.progress.last_val_ppl
        while todo and ppl <= todo[0] * base:
            phi = job.measure_noise_scale(PROBE_MICROBATCHES)
            rows.append({"fraction": todo[0], "target_ppl": todo[0] * base, "reached": True,
                         "step": job.trainer.step, "val_ppl": ppl, "noise_scale_proxy": phi,
                         "growth": phi / phi0})
            todo.pop(0)
    rows += [{"fraction": f, "target_ppl": f * base, "reached": False} for f in todo]
    return {"family": family, "proxy": spec["proxy"], "proxy_overrides": spec["overrides"],
            "unigram_ppl": unigram, "warm_ppl": warm_ppl, "noise_scale_warm_proxy": phi0,
            "probe_microbatches": PROBE_MICROBATCHES, "rows": rows}


def main(argv=None) -> int:
    from bench.cona_ttp import MODELS, write_report
    from jobruntime.metrics import provenance

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="gpt3_1.3b", choices=sorted(MODELS))
    p.add_argument("--fractions", type=float, nargs="+", default=[0.6, 0.55, 0.5, 0.45, 0.4])
    p.add_argument("--cache-dir", default=None, help="data and warm-checkpoint cache")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON")
    args = p.parse_args(argv)
    if not all(0 < f < 1 for f in args.fractions):
        p.error(f"--fractions must lie in (0, 1), got {args.fractions}")
    report = {**provenance(argv), **calibrate(args.family, args.fractions, args.cache_dir)}
    write_report(report, args.out, "cona_calibrate.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
