"""Does the noise scale with the curvature measured predict the efficiency the others miss?

Pollux's ``E(M) = (phi + M0) / (phi + M)`` is exact on a locally quadratic loss at
``phi = tr(P H P Sigma) / (G' P H P G)`` (McCandlish et al. 2018, eq. 2.7-2.8, for the
step ``-eps P g``; :mod:`cona.surrogate`).  The controller reads one of three gradient
statistics in its place (:data:`cona.probe.DEFINITIONS`), each exact under an assumption
about the Hessian ``H``; ``bench/cona_efficiency.py`` found that none predicts both proxies'
measured efficiency (``docs/results/cona_efficiency.json``: ``newton`` on GPT-3's, ``simple``
on Llama's).  This bench measures the curvature instead of assuming it
(:mod:`cona.curvature`: second differences of the loss in float64 on held-out
micro-batches):

1. **Trajectory.**  The reference run of ``bench/cona_efficiency.py`` again (its set-up:
   fp32, the preset's ``beta2`` at every batch, the reference batch ``M0`` in its
   fastest layout at the rule's LR, from the cached warm state), stopping every
   ``--every`` steps to measure ``simple`` (64 micro-batches, as the committed
   trajectory: the same value says the same state), ``curvature`` (``P`` Adam's
   preconditioner) and ``curvature_sgd`` (``P = I``, McCandlish's ``B_noise``), each of
   the last two from 64 gradient micro-batches, 16 directions and 16 curvature
   micro-batches; at the first point also at a tenth of the second difference's step
   (``delta_check``: the quadratic model at that scale).
2. **Predicted against measured.**  Proxy samples to the target at each grid batch in
   Pollux's model from each trajectory (:func:`bench.cona_efficiency.predicted_samples`),
   and the error in ratios between batches (:func:`bench.cona_efficiency.prediction_error`)
   against the efficiencies measured in ``--from`` (a committed
   ``bench/cona_efficiency.py`` result of the same set-up), beside that run's errors of
   the controller's definitions.

Usage::

    python bench/cona_curvature.py --from docs/results/cona_efficiency.json \\
        --models gpt3_1.3b llama3.2_1b --every 20 --cache-dir DIR   # ~30 min, 2 cores

Prints one JSON object ``{"date", "commit", "machine", "command", "every", "from",
"models": {NAME: {"trajectory": [{"step", "samples", "simple", "simple_committed",
"curvature", "curvature_sgd", ...}], "delta_check", "batches": {M: {"measured",
"predicted": {key: {"samples", "efficiency"}}}}, "prediction_error": {key: error},
"committed_prediction_error": {...}}}}`` (noise scales in proxy sequences; the signal and
noise terms of each curvature estimate beside it).  Measured on the proxy in samples; no
clock.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.cona_ttp as ttp  # noqa: E402
from bench.cona_efficiency import (  # noqa: E402
    PROBE_MICROBATCHES,
    predicted_samples,
    prediction_error,
    static_run,
)
from bench.seeded_units import run_families, write_report  # noqa: E402

CURVATURE = ("curvature", "curvature_sgd")  # Adam's P; P = I
KEYS = ("simple", *CURVATURE)
CURVATURE_MICROBATCHES = 16  # held out for the second differences (cona.curvature)


def curvature_point(job, delta: float | None = None) -> dict:
    """Step 1's measurements at the job's current state: ``simple`` and both curvature
    noise scales (``None`` where a term is not positive), with their terms; ``delta``:
    the second difference's step (default :data:`cona.curvature.DELTA`)."""
    from cona.curvature import DELTA

    out = {"simple": job.measure_noise_scale(PROBE_MICROBATCHES, charge=False)}
    for key in CURVATURE:
        stats = job.measure_curvature_stats(PROBE_MICROBATCHES, CURVATURE_MICROBATCHES,
                                            preconditioned=key == "curvature",
                                            delta=delta or DELTA)
        signal, noise = stats if stats else (None, None)
        out[key] = noise / signal if stats and signal > 0 and noise > 0 else None
        out[f"{key}_terms"] = None if stats is None else {"signal": signal, "noise": noise}
    return out


def delta_check(job) -> dict:
    """Both curvature noise scales at :data:`cona.curvature.DELTA` and at a tenth of it
    (the second difference's step), at the job's current state."""
    from cona.curvature import DELTA

    out = {}
    for delta in (DELTA, DELTA / 10):
        point = curvature_point(job, delta)
        out[str(delta)] = {k: point[k] for k in CURVATURE}
    return out


def curvature_family(target: str, spec: dict, batches: list[int], every: int,
                     cache_dir: str | None, committed_models: dict) -> dict:
    ttp.worker_setup(spec["proxy"])
    committed = committed_models[target]
    from bench.cona_reference import seed_context
    from cona.baselines import fastest_per_batch
    from cona.context import build_context
    from cona.targets import corpus_unigram_perplexity, target_ppl

    t0 = time.perf_counter()
    settings = dict(ttp.FULL, batches=batches, gpu="A100-80GB", num_gpus=64,
                    time_scale="measured", precision=ttp.STUDY_PRECISION)
    cfg = ttp.family_config(target, spec, settings, cache_dir)
    ctx0, _ = seed_context(cfg, cfg.train.warmup_iters, probe_microbatches=PROBE_MICROBATCHES)
    unigram = corpus_unigram_perplexity(ctx0.data.corpus, cfg.model.vocab_size)
    cfg.train.target_ppl = target_ppl(unigram, ctx0.warm["extra"]["val_ppl"])
    cfg.cona.adam_beta2_batch = None  # as bench/cona_efficiency.py
    ctx = build_context(cfg, data=ctx0.data)
    ctx.warm = ctx0.warm
    per = fastest_per_batch(ctx.candidates, ctx.cluster.iter_s)
    m0, ratio = ctx.reference_batch, ctx.mapping.ratio
    checked = {}

    def measure(job) -> dict:
        if not checked:
            checked.update(delta_check(job))
        return curvature_point(job)

    _, trajectory = static_run(ctx, per[m0], measure_every=every, measure=measure)
    theirs = {p["step"]: p.get("simple") for p in committed["trajectory"]}
    for p in trajectory:
        p["simple_committed"] = theirs.get(p["step"])
    s0 = committed["batches"][str(m0)]["measured"]["samples"]  # as cona_efficiency.compare
    out = {}
    for b, rec in sorted(committed["batches"].items(), key=lambda kv: int(kv[0])):
        if "efficiency" not in rec["measured"]:
            continue
        samples = {k: predicted_samples(trajectory, int(b), m0, ratio, k) for k in KEYS}
        out[b] = {"measured": rec["measured"],
                  "predicted": {k: None if samples[k] is None else
                                {"samples": samples[k], "efficiency": s0 / samples[k]}
                                for k in KEYS}}
    return {"proxy": spec["proxy"], "target_ppl": cfg.train.target_ppl, "ratio": ratio,
            "reference_batch": m0, "trajectory": trajectory, "delta_check": checked,
            "batches": out, "prediction_error": prediction_error(out, keys=KEYS),
            "committed_prediction_error": committed["prediction_error"],
            "wall_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, required=True,
                   help="a bench/cona_efficiency.py result (its measured efficiencies)")
    p.add_argument("--models", nargs="*", default=None, choices=sorted(ttp.MODELS))
    p.add_argument("--every", type=int, default=20,
                   help="steps between measurements (the committed result's, default 20)")
    p.add_argument("--cache-dir", default=None, help="tokenizer/dataset cache (data.cache_dir)")
    p.add_argument("--out", type=Path, default=None, help="write cona_curvature.json here")
    p.add_argument("--jobs", type=int, default=2, help="families in parallel processes")
    args = p.parse_args(argv)
    from jobruntime.metrics import provenance
    from jobruntime.outputs import refuse_output_folder

    refuse_output_folder(p, args.out)
    try:
        source = json.loads(args.source.read_text())
    except (OSError, ValueError) as e:
        p.error(f"cannot read {args.source}: {e}")
    if source.get("every") != args.every:
        p.error(f"--every {args.every} differs from {args.source}'s ({source.get('every')}): "
                "the trajectory's points would not match")
    names = [n for n in (args.models or source["models"]) if n in source["models"]]
    if not names:
        p.error(f"none of {args.models} is in {args.source}")
    t0 = time.perf_counter()
    report = {**provenance(argv), "every": args.every,
              "from": {"file": str(args.source), "commit": source.get("commit"),
                       "date": source.get("date")},
              "models": run_families(curvature_family, {n: ttp.MODELS[n] for n in names},
                                     args.jobs, ttp.BATCHES, args.every, args.cache_dir,
                                     {n: source["models"][n] for n in names})}
    report["wall_s"] = time.perf_counter() - t0
    write_report(report, args.out, "cona_curvature.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
