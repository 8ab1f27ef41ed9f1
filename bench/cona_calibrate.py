"""Calibration of the CONA bench's target fraction: noise-scale growth against target depth.

:data:`cona.targets.TARGET_FRACTION` must put the target deep enough that the reference's
directly measured noise scale grows at least 4x over the evaluated segment (issue 23).
This bench measures that growth as a function of the fraction, on the full bench's proxy
of one family (``bench/cona_ttp.py``: narrowed preset, warm state, one torch thread): the
bench's own reference (:func:`bench.cona_reference.reference`: preset batch, the scaling rule's
LR, the noise scale probed directly at every evaluation of its cadence, or
``--probe-density`` times per evaluation interval as the TTP bench probes since
``PROBE_DENSITY``) trains from the
warm state to the deepest fraction's target, and for each ``f`` in ``--fractions`` the
trend of the probes up to the first crossing of ``f x min(unigram, warm ppl)``
(:func:`bench.cona_reference.segment_trend`, as the bench reads it) at that target's loss over
the warm state's own probe gives the growth.  No CONA method runs.

Usage::

    python bench/cona_calibrate.py --family gpt3_1.3b --cache-dir C > out.json
    # as the TTP bench's full run sets up its reference (bf16, 4 probes per interval)
    python bench/cona_calibrate.py --family gpt3_1.3b --precision bf16 --probe-density 4

``--precision`` defaults to ``STUDY_PRECISION`` (fp32), the one the committed
``docs/results/cona_calibrate_*.json`` were measured in (before the TTP bench's rule 0
made its proxies bf16); the warm state is the one that precision's bench starts from.

Prints one JSON object: ``{"family", "proxy", "unigram_ppl", "warm_ppl", "probes",
"rows": [{"fraction", "target_ppl", "reached", "samples", "growth", "noise_scale_proxy",
"probes"}], "date", "commit", "machine", "command"}`` (``growth``: the trend's noise scale
at the fraction's target over the warm state's; ``samples``: the reference's
proxy samples from the warm state to the crossing; ``reached`` false where it did not
cross within the family's budget).
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # one thread, as the bench (before torch)
    os.environ[_v] = "1"

import argparse  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def calibrate(family: str, fractions: list[float], cache_dir: str | None,
              precision: str | None = None, probe_density: int | None = None) -> dict:
    """The trend growth of the directly measured noise scale at each target ``fractions``
    of ``min(unigram, warm ppl)`` along ``family``'s reference run (module docstring).

    ``precision``: the proxies' ``train.precision`` (default ``STUDY_PRECISION``);
    ``probe_density``: probes per evaluation interval (``None``: one per evaluation)."""
    from bench.cona_reference import probe_spacing, reference, seed_context, segment_trend
    from bench.cona_ttp import (
        FULL,
        MODELS,
        PROBE_MICROBATCHES,
        STUDY_PRECISION,
        family_config,
        worker_setup,
    )
    from cona.targets import corpus_unigram_perplexity

    spec = MODELS[family]
    worker_setup(spec["proxy"])
    settings = dict(FULL, gpu="A100-80GB", num_gpus=64, precision=precision or STUDY_PRECISION)
    cfg = family_config(family, spec, settings, cache_dir)
    ctx, _ = seed_context(cfg, cfg.train.warmup_iters, probe_microbatches=PROBE_MICROBATCHES)
    unigram = corpus_unigram_perplexity(ctx.data.corpus, cfg.model.vocab_size)
    warm_ppl = ctx.warm["extra"]["val_ppl"]
    base = min(unigram, warm_ppl)
    ctx.cfg.train.target_ppl = min(fractions) * base  # the deepest: every fraction on the way
    ref = reference(ctx, probe_microbatches=PROBE_MICROBATCHES,
                    probe_every_samples=probe_spacing(ctx, probe_density))
    probes, w0 = ref["noise_scale_probes"], ctx.warm["consumed_samples"]
    phi0 = ref["noise_scale_warm_proxy"]
    rows = []
    for f in sorted(fractions, reverse=True):
        crossing = next((e["samples"] for e in ref["evals"] if e["val_ppl"] <= f * base), None)
        if crossing is None:
            rows.append({"fraction": f, "target_ppl": f * base, "reached": False})
            continue
        fit = segment_trend([p for p in probes if p["samples"] <= crossing], math.log(f * base))
        rows.append({"fraction": f, "target_ppl": f * base, "reached": True,
                     "samples": crossing - w0, "growth": fit["at"][0] / phi0,
                     "noise_scale_proxy": fit["at"][0], "probes": fit["points"]})
    return {"family": family, "proxy": spec["proxy"], "proxy_overrides": spec["overrides"],
            "unigram_ppl": unigram, "warm_ppl": warm_ppl,
            "probe_microbatches": PROBE_MICROBATCHES, "probes": probes, "rows": rows}


def main(argv=None) -> int:
    from bench.cona_ttp import MODELS, PRECISION, STUDY_PRECISION
    from bench.seeded_units import write_report
    from jobruntime.metrics import provenance

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="gpt3_1.3b", choices=sorted(MODELS))
    p.add_argument("--fractions", type=float, nargs="+", default=[0.6, 0.55, 0.5, 0.45, 0.4])
    p.add_argument("--cache-dir", default=None, help="data and warm-checkpoint cache")
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON")
    p.add_argument("--precision", choices=sorted({PRECISION, STUDY_PRECISION}),
                   default=STUDY_PRECISION, help="the proxies' train.precision (default: "
                   f"the committed study's; the TTP bench's full run: {PRECISION})")
    p.add_argument("--probe-density", type=int, default=None,
                   help="probes per evaluation interval (default: one per evaluation; the "
                   "TTP bench's full run: its PROBE_DENSITY)")
    args = p.parse_args(argv)
    if not all(0 < f < 1 for f in args.fractions):
        p.error(f"--fractions must lie in (0, 1), got {args.fractions}")
    if args.probe_density is not None and args.probe_density < 1:
        p.error(f"--probe-density must be at least 1, got {args.probe_density}")
    report = {**provenance(argv), "precision": args.precision,
              "probe_density": args.probe_density,
              **calibrate(args.family, args.fractions, args.cache_dir, args.precision,
                          args.probe_density)}
    write_report(report, args.out, "cona_calibrate.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
