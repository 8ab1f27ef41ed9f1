"""Does the surrogate's statistical efficiency predict how many samples a global batch needs?

CONA ranks strategies by throughput x Pollux's efficiency ``E(M) = (phi + M0)/(phi + M)``
(Qiao et al., OSDI'21, eq. 5; :mod:`cona.surrogate`), which says a sample at batch ``M``
is worth ``E(M)`` samples at the reference batch ``M0``.  This bench measures that
directly on each family of ``bench/cona_ttp.py`` (the same rules 1-2: reference, target,
batch ratio ``r``, grid, sqrt LR rule, schedule in samples):

1. **Trajectory.**  The reference run (batch ``M0``) again, stopping every ``--every``
   steps to measure the noise scale directly from 64 micro-batches (no effect on the
   run), in each definition of ``cona.gns_definition`` (:data:`cona.probe.DEFINITIONS`):
   ``simple`` (``B_simple``, McCandlish et al. 2018), ``newton`` (``tr(P Sigma)/(G' P
   G)``) and ``pollux`` (``tr(P Sigma P)/|P G|^2``, what Pollux uses for adaptive
   optimizers, Sec. 3.1), P = ``1/(sqrt(v_hat) + eps)`` Adam's preconditioner, and
   the controller's own in-run estimates (:class:`cona.grad_stats.GradientNoiseScale`,
   ``cona.gns_average`` plain and scale-free), and, from the same micro-batches per
   coordinate, Adam's best progress per sequence at each grid batch (``adam``:
   :mod:`cona.adam_efficiency`, Adam's second moment at each batch rather than a fixed
   preconditioner).  With ``--curvature`` also the noise scale with the curvature
   measured rather than assumed, ``tr(P H P Sigma) / (G' P H P G)`` (McCandlish et al.
   2018, eq. 2.7-2.8, for the step ``-eps P g``: the ``phi`` that makes ``E(M)`` exact on
   a locally quadratic loss; :mod:`cona.curvature`, float64 second differences of the
   loss on 16 held-out micro-batches), with Adam's ``P`` (``curvature``) and ``P = I``
   (``curvature_sgd``), and at the warm state at a tenth of the second difference's step
   (``curvature_delta_check``).
2. **Measured.**  Every other grid batch trained static in its fastest layout until the
   target or the budget: proxy samples to the target (at evaluation granularity) and
   whether the validation perplexity ever more than doubled between two evaluations
   (an unstable run).  ``efficiency = samples(M0) / samples(M)``.  With ``--lr-factors``
   every batch, ``M0`` included, also trains at those multiples of the rule's LR (a run
   stops once past the fewest samples its batch needed yet), and the efficiency is
   reported again with each batch at its best factor (``measured_best_lr``): Pollux's
   ``E(M)`` assumes an LR that suits every batch, the rule's LR may not.
3. **Predicted.**  ``samples(M) = sum_k dS_k / E(M, r phi_k)`` over the trajectory's
   intervals (``phi_k`` measured at the end of interval ``k``; an interval without a
   positive estimate takes its neighbour's), for each noise-scale definition; for
   ``adam``, ``sum_k dS_k / E_k(M)`` with ``E_k`` point ``k``'s ratio of progress per
   sequence at ``M`` and at ``M0`` (:func:`adam_samples`).

Usage::

    python bench/cona_efficiency.py --models gpt3_1.3b llama3.2_1b --every 20  # ~35 min
    python bench/cona_efficiency.py --models gpt3_1.3b llama3.2_1b --every 20 --lr-factors 0.5 1 2
    python bench/cona_efficiency.py --models gpt3_1.3b llama3.2_1b --every 20 --curvature
    python bench/cona_efficiency.py --models bert_large --jobs 1   # hours: its proxy is slow

Prints one JSON object ``{"date", "commit", "machine", "command", "every", "models":
{NAME: {"prediction_error": {definition: error}, "prediction_error_best_lr", "lr_factors",
"trajectory": [...], "batches": {M: {"measured", "predicted"[, "measured_best_lr"]}}}}}``
(``prediction_error``: :func:`prediction_error`; the rest: :func:`compare`).
Measured on the proxy (emulated mode's trained model) in samples; the emulated clock
only times the evaluations (``cona.eval_clock``), and the direct probes are not charged
to it.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.cona_ttp as ttp  # noqa: E402
from bench.cona_reference import static_loop  # noqa: E402
from bench.seeded_units import run_families, write_report  # noqa: E402

DIRECT = ("simple", "newton", "pollux")  # cona.probe.DEFINITIONS, measured directly
ADAM = "adam"  # cona/adam_efficiency.py: an efficiency curve per point, not a noise scale
DEFINITIONS = (*DIRECT, ADAM, "in_run_plain", "in_run_scale_free")
# --curvature: tr(P H P Sigma) / (G' P H P G), Adam's P and P = I (cona/curvature.py)
CURVATURE = ("curvature", "curvature_sgd")
CURVATURE_MICROBATCHES = 16  # held out for the second differences
PROBE_MICROBATCHES = 64  # per direct measurement (job.measure_noise_scale's default)


def predicted_samples(trajectory: list[dict], batch: float, reference_batch: float,
                      ratio: float, key: str) -> float | None:
    """Proxy samples to the target at target batch ``batch`` in Pollux's model (step 3 of
    the module docstring); ``None`` without a positive noise scale anywhere."""
    from cona.surrogate import statistical_efficiency

    if key == ADAM:
        return adam_samples(trajectory, batch, reference_batch)
    phis = [p[key] if p[key] and p[key] > 0 else None for p in trajectory]
    known = [i for i, v in enumerate(phis) if v is not None]
    if not known:
        return None
    total, prev = 0.0, 0
    for i, point in enumerate(trajectory):
        phi = phis[min(known, key=lambda j: (abs(j - i), -j))]
        total += (point["samples"] - prev) / statistical_efficiency(batch, ratio * phi,
                                                                    reference_batch)
        prev = point["samples"]
    return total


def adam_samples(trajectory: list[dict], batch: int, reference_batch: int) -> float | None:
    """Proxy samples to the target at target batch ``batch`` in the Adam-consistent model
    (:mod:`cona.adam_efficiency`): ``sum_k dS_k / E_k``, ``E_k`` the ratio of the
    progress per sequence at ``batch`` and at ``reference_batch`` measured at the end of
    interval ``k``; ``None`` where a point lacks either."""
    total, prev = 0.0, 0
    for point in trajectory:
        pps = point.get(ADAM) or {}
        mine, ref = pps.get(str(batch)), pps.get(str(reference_batch))
        if not (mine and ref):
            return None
        total += (point["samples"] - prev) * ref / mine
        prev = point["samples"]
    return total


def prediction_error(batches: dict, measured_key: str = "measured",
                     keys=DEFINITIONS) -> dict:
    """Per definition (of ``keys``), how far its predicted efficiencies are from the
    measured ones where the controller uses them: in ratios between two batches (a ranking
    compares candidates' ``E(M)`` at one moment; ``M0`` cancels), the mean over every pair
    of batches that reached the target of ``|ln(pred ratio / measured ratio)|`` (0: exact;
    0.1: ratios off by ~10 %); ``None`` for a definition without a prediction at two of
    them."""
    out = {}
    for key in keys:
        eff = {b: (x["predicted"][key]["efficiency"], x[measured_key]["efficiency"])
               for b, x in batches.items()
               if "efficiency" in x.get(measured_key, {}) and x["predicted"][key] is not None}
        errs = [abs(math.log(eff[a][0] / eff[b][0]) - math.log(eff[a][1] / eff[b][1]))
                for a, b in itertools.combinations(sorted(eff), 2)]
        out[key] = sum(errs) / len(errs) if errs else None
    return out


def trajectory_point(job, adam_batches=(), curvature: bool = False) -> dict:
    """The direct measurements at one point of the trajectory (module docstring, step 1),
    none charged to the clock (it times the evaluations, cona.eval_clock, and the
    reference's must fall where an unprobed run's do); with ``curvature`` also
    :data:`CURVATURE` (:func:`curvature_point`)."""
    point = {**{d: job.measure_noise_scale(PROBE_MICROBATCHES, d, charge=False)
                for d in DIRECT},
             ADAM: {str(b): v for b, v in job.measure_adam_progress(
                 PROBE_MICROBATCHES, adam_batches).items()},
             "in_run_plain": job.gns.noise_scale_plain,
             "in_run_scale_free": job.gns.noise_scale_scale_free}
    return {**point, **curvature_point(job)} if curvature else point


def curvature_point(job, delta: float | None = None) -> dict:
    """Both :data:`CURVATURE` noise scales at the job's state (``None`` where a term is not
    positive), each with its signal and noise terms, from 64 gradient micro-batches and
    :data:`CURVATURE_MICROBATCHES` curvature ones; ``delta``: the second difference's step
    (default :data:`cona.curvature.DELTA`)."""
    out = {}
    for key in CURVATURE:
        stats = job.measure_curvature_stats(PROBE_MICROBATCHES, CURVATURE_MICROBATCHES,
                                            preconditioned=key == "curvature", delta=delta)
        signal, noise = stats if stats else (None, None)
        out[key] = noise / signal if stats and signal > 0 and noise > 0 else None
        out[f"{key}_terms"] = None if stats is None else {"signal": signal, "noise": noise}
    return out


def delta_check(job) -> dict:
    """:func:`curvature_point` at the job's state at :data:`cona.curvature.DELTA` and at a
    tenth of it (the second difference's step: the quadratic model at that scale), by
    ``str(delta)``."""
    from cona.curvature import DELTA

    return {str(d): {k: v for k, v in curvature_point(job, d).items() if k in CURVATURE}
            for d in (DELTA, DELTA / 10)}


def static_run(ctx, strategy, measure_every: int | None = None, lr_factor: float = 1.0,
               bound_samples: int | None = None, adam_batches=(), curvature: bool = False):
    """Train ``strategy`` at ``lr_factor`` x the scaling rule's LR from the initial weights
    until the target, the budget, or past ``bound_samples`` proxy samples (a run that
    cannot need fewer samples than one already measured at this batch: not reached).

    With ``measure_every`` (steps) the noise scale is measured directly along the way
    (trajectory points; the last at the stop), and Adam's progress per sequence at each of
    ``adam_batches`` (target sequences; :meth:`cona.job.EmulatedJob.measure_adam_progress`,
    under ``"adam"`` by ``str(batch)``): :func:`trajectory_point` (``curvature``: with
    the curvature noise scales).  Returns ``(record, trajectory)``."""
    job, loop = static_loop(ctx, strategy, lr_factor)
    trajectory = []
    while measure_every and not loop.done:
        nxt = job.trainer.step + measure_every
        loop.run(until=lambda nxt=nxt: job.trainer.step >= nxt)
        trajectory.append({"step": job.trainer.step, "samples": job.consumed_samples,
                           **trajectory_point(job, adam_batches, curvature)})
    loop.run(until=None if bound_samples is None
             else lambda: job.consumed_samples > bound_samples)
    evals = [e["val_ppl"] for e in loop.progress.evals]
    record = {"reached": loop.progress.ttp.reached, "samples": job.consumed_samples,
              "strategy": strategy.label, "lr_factor": lr_factor,
              "peak_val_ppl_after_first_eval": max(evals[1:], default=None),
              "val_ppl_doubled": any(b > 2 * a for a, b in zip(evals, evals[1:]))}
    return record, trajectory


def best_lr(runs: dict[float, dict]) -> dict:
    """Of one batch's runs by LR factor (:func:`static_run` records), the one that reached
    the target with the fewest proxy samples (the lowest factor on a tie); where none
    did, the rule's own (factor 1, or the first)."""
    reached = [f for f, r in runs.items() if r["reached"]]
    if not reached:
        return runs.get(1.0, next(iter(runs.values())))
    return runs[min(reached, key=lambda f: (runs[f]["samples"], f))]


def compare(by_lr: dict[int, dict[float, dict]], trajectory: list[dict], m0: int,
            ratio: float) -> dict:
    """Steps 2-3 of the module docstring on measured runs: ``{"batches": {M: {"measured",
    "predicted"[, "measured_best_lr"]}}, "prediction_error", "prediction_error_best_lr"}``.

    ``measured`` is batch ``M`` at the rule's LR (factor 1), its ``efficiency`` (or
    ``efficiency_at_most`` where it missed the target) ``samples(M0) / samples(M)``;
    ``measured_best_lr`` (where ``by_lr`` holds several factors) the same with each
    batch, ``M0`` included, at its best factor (:func:`best_lr`), with every factor's
    samples under ``by_lr``; ``predicted`` per definition from ``trajectory`` (the
    reference's, at factor 1).  ``prediction_error_best_lr`` is ``None`` with one factor.

    Args:
        by_lr: per target batch, per LR factor, a :func:`static_run` record.
        trajectory: :func:`static_run`'s points along the reference.
        m0: the reference batch (target sequences); ratio: target sequences per proxy one.
    """
    keys = (*DEFINITIONS, *(k for k in CURVATURE if any(k in p for p in trajectory)))
    rule = {b: runs[1.0] for b, runs in by_lr.items()}
    s0, s0_best = rule[m0]["samples"], best_lr(by_lr[m0])["samples"]
    out = {}
    for b, rec in sorted(rule.items()):
        label = "efficiency" if rec["reached"] else "efficiency_at_most"
        predicted = {key: predicted_samples(trajectory, b, m0, ratio, key)
                     for key in keys}
        out[b] = {"measured": {**rec, label: s0 / rec["samples"]},
                  "predicted": {key: None if s is None else {"samples": s, "efficiency": s0 / s}
                                for key, s in predicted.items()}}
        if len(by_lr[b]) > 1:
            best = best_lr(by_lr[b])
            label = "efficiency" if best["reached"] else "efficiency_at_most"
            out[b]["measured_best_lr"] = {
                **best, label: s0_best / best["samples"],
                "by_lr": {str(f): {"samples": x["samples"], "reached": x["reached"]}
                          for f, x in sorted(by_lr[b].items())}}
    several = any(len(runs) > 1 for runs in by_lr.values())
    return {"batches": out, "prediction_error": prediction_error(out, keys=keys),
            "prediction_error_best_lr": (prediction_error(out, "measured_best_lr", keys)
                                         if several else None)}


def efficiency_family(target: str, spec: dict, batches: list[int], every: int,
                      cache_dir: str | None, threads: int,
                      lr_factors: tuple[float, ...] = (1.0,), curvature: bool = False) -> dict:
    ttp.worker_setup(spec["proxy"])
    from cona.baselines import fastest_per_batch
    from cona.context import build_context

    t0 = time.perf_counter()
    # its measure (samples to the target) does not depend on the dilation: its own
    settings = dict(ttp.FULL, batches=batches, gpu="A100-80GB", num_gpus=64,
                    time_scale="measured", precision=ttp.STUDY_PRECISION)
    cfg, ctx0, ref, setup, _ = ttp.family_setup(target, spec, settings, cache_dir)
    # the preset's beta2 at every batch, as docs/results/cona_efficiency.json was measured
    # (the TTP bench's rule 5a makes it follow the batch)
    cfg.cona.adam_beta2_batch = None
    ctx = build_context(cfg, data=ctx0.data)
    ctx.warm = ctx0.warm
    per = fastest_per_batch(ctx.candidates, ctx.cluster.iter_s)
    m0, r = ctx.reference_batch, ctx.mapping.ratio
    if m0 not in per:
        raise SystemExit(f"{target}: the reference batch {m0} (target sequences) is not a "
                         f"candidate batch {sorted(per)}; the prediction needs it as M0")
    measured = {}
    measured[m0], trajectory = static_run(ctx, per[m0], measure_every=every,
                                          adam_batches=sorted(per), curvature=curvature)
    if not measured[m0]["reached"]:
        raise SystemExit(f"{target}: the reference batch did not reach its own target")
    for b in sorted(per):
        if b != m0:
            measured[b], _ = static_run(ctx, per[b])
    # each batch at the other LR factors, cut once past the fewest samples it needed yet
    by_lr = {b: {1.0: rec} for b, rec in measured.items()}
    for f in (f for f in lr_factors if f != 1.0):
        for b in sorted(per):
            bound = min((x["samples"] for x in by_lr[b].values() if x["reached"]), default=None)
            by_lr[b][f], _ = static_run(ctx, per[b], lr_factor=f, bound_samples=bound)
    extra = {"curvature_delta_check": delta_check(ctx.make_job(per[m0]))} if curvature else {}
    return {"proxy": spec["proxy"], "target_ppl": cfg.train.target_ppl, "ratio": r,
            "lr_factors": list(lr_factors), **compare(by_lr, trajectory, m0, r), **extra,
            "reference_batch": m0, "lr": cfg.train.lr, "setup": setup,
            "trajectory": trajectory, "wall_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=None, choices=sorted(ttp.MODELS))
    p.add_argument("--every", type=int, default=10,
                   help="steps between direct noise-scale measurements (default 10: "
                   "cona.decision_interval of the TTP bench)")
    p.add_argument("--cache-dir", default=None, help="tokenizer/dataset cache (data.cache_dir)")
    p.add_argument("--out", type=Path, default=None, help="write cona_efficiency.json here")
    p.add_argument("--jobs", type=int, default=2, help="families in parallel processes")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--lr-factors", type=float, nargs="+", default=[1.0],
                   help="also train every batch at these multiples of the scaling rule's LR "
                   "and report the efficiency at each batch's best (Pollux's E(M) assumes "
                   "an LR that suits every batch); e.g. 0.5 1 2, the TTP bench's choices")
    p.add_argument("--curvature", action="store_true",
                   help="also measure the noise scale with the curvature measured "
                   "(cona/curvature.py) at each trajectory point, Adam's P and P = I, and "
                   "predict from it (per point and P: 64 more backward passes and 35 "
                   "forward passes over 16 held-out micro-batches)")
    args = p.parse_args(argv)
    from jobruntime.outputs import refuse_output_folder

    refuse_output_folder(p, args.out)  # before the run, not after it
    if args.jobs < 1 or args.threads < 1 or args.every < 1:
        p.error("--jobs, --threads and --every must be >= 1")
    if 1.0 not in args.lr_factors or any(f <= 0 for f in args.lr_factors):
        p.error("--lr-factors must be positive and hold 1 (the rule's LR: the trajectory's)")
    models = {k: v for k, v in ttp.MODELS.items() if args.models is None or k in args.models}
    from jobruntime.metrics import provenance

    t0 = time.perf_counter()
    report = {**provenance(argv), "precision": ttp.STUDY_PRECISION, "every": args.every,
              "models": run_families(efficiency_family, models, args.jobs, ttp.BATCHES,
                                     args.every, args.cache_dir, args.threads,
                                     tuple(sorted(set(args.lr_factors))), args.curvature)}
    report["wall_s"] = time.perf_counter() - t0
    write_report(report, args.out, "cona_efficiency.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
