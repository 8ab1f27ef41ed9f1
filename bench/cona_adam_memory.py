"""Is a larger batch more sample-efficient than a smaller one because of Adam's memory?

On the GPT-3 proxy of ``bench/cona_ttp.py`` batch 256 needs fewer samples to the target
than batch 64 (``docs/results/cona_efficiency.json``: efficiency 1.13), which no
noise-scale model allows: for a fixed optimizer, a sample at a larger batch is worth at
most one at a smaller (McCandlish et al. 2018, eq. 2.11).  But the optimizer is not
fixed in *samples*: at fixed ``beta1``, ``beta2`` Adam's moments average over
``1 / (1 - beta)`` *steps*, i.e. over ``B / (1 - beta)`` samples, so a 4x larger batch
averages its second moment over 4x more samples.  Malladi et al. 2022 (the
square-root scaling rule, :func:`cona.lr_rule.scale_adam`) scale ``1 - beta`` with the
batch so that this memory stays the same.

This bench trains, from each family's warm state to its target at the fastest layout
and the scaling rule's learning rate (``cona.lr_scaling``, as every CONA bench method),
every batch of ``--batches`` at the preset's Adam hyperparameters (``preset``), and every
smaller batch again with its Adam memory in samples set to the largest batch's (the rule
anchored there), in three variants that say which moment matters: ``beta1`` (only
``beta1`` scaled), ``beta2`` (only ``beta2``) and ``sde`` (the whole rule: both betas
and ``eps``).  It reports the proxy samples each run needed and the efficiency of the
largest batch against each smaller one (``samples(small) / samples(largest)``): above 1
the larger batch is the more sample-efficient.  If Adam's memory is the cause, the
efficiency falls to at most 1 once the smaller batch's memory matches.

Usage::

    python bench/cona_adam_memory.py --models gpt3_1.3b llama3.2_1b --cache-dir DIR  # ~25 min
    python bench/cona_adam_memory.py --variants beta2 --seeds 3 --cache-dir DIR

With ``--seeds N`` every run repeats on N seeds (data order and warm state, as the TTP
bench's seeds).

Prints one JSON object ``{"date", "commit", "machine", "command", "batches", "seeds",
"models": {NAME: {"proxy", "target_ppl", "seeds", "preset": {"adam_beta1", "adam_beta2",
"adam_eps"}, "anchor_batch", "runs": {VARIANT: {BATCH: {"samples" (mean over seeds),
"samples_by_seed", "reached" (on every seed), "adam_beta1", "adam_beta2", "adam_eps"}}},
"efficiency": {VARIANT: {BATCH: ratio of the means}}, "efficiency_by_seed": {VARIANT:
{BATCH: [ratio per seed]}}, "wall_s"}}, "wall_s"}`` (batches in target sequences; samples
in proxy sequences, at evaluation granularity refined near the target by
``cona.ttp_resolution``; a batch that missed the target on a seed has no efficiency).

Each run starts from the warm state's Adam moments, built under the preset's betas; they
are rescaled so that Adam's bias-corrected moments are the same under the run's betas
(:func:`cona.state.rebias_adam_moments`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench.cona_ttp as ttp  # noqa: E402
from bench.cona_efficiency import static_run  # noqa: E402
from bench.seeded_units import run_families, write_report  # noqa: E402

BATCHES = (64, 128, 256)  # target sequences: the reference and the two CONA weighs next
VARIANTS = ("beta1", "beta2", "sde")  # which of Adam's hyperparameters follow the rule


def adam_variant(preset: tuple[float, float, float], variant: str, batch: int,
                 anchor: int) -> tuple[float, float, float]:
    """``(beta1, beta2, eps)`` at ``batch`` for ``variant``: ``preset`` unchanged, or the
    square-root scaling rule anchored at ``anchor`` (:func:`cona.lr_rule.scale_adam`)
    applied to ``beta1`` only, ``beta2`` only, or to all three (``sde``)."""
    from cona.lr_rule import scale_adam

    b1, b2, eps = preset
    if variant == "preset":
        return preset
    (s1, s2), seps = scale_adam((b1, b2), eps, batch, anchor)
    return {"beta1": (s1, b2, eps), "beta2": (b1, s2, eps), "sde": (s1, s2, seps)}[variant]


def _seed_context(cfg, ctx0, seed_index: int, probe_microbatches: int):
    """Seed ``seed_index``'s context: the set-up's own (seed 0) or, for another seed, its
    own data order and warm state (``bench/cona_ttp.py``'s seeds: ``train.seed`` plus the
    index; a warm state the TTP bench cached is reused)."""
    import copy

    from cona.context import build_context

    if seed_index:
        cfg = copy.deepcopy(cfg)
        cfg.train.seed += seed_index
        ctx0, _ = ttp.seed_context(cfg, cfg.train.warmup_iters,
                                   probe_microbatches=probe_microbatches)
    ctx = build_context(cfg, data=ctx0.data)
    ctx.warm = ctx0.warm
    return ctx


def memory_family(target: str, spec: dict, batches: tuple[int, ...], variants: tuple[str, ...],
                  seeds: int, cache_dir: str | None) -> dict:
    """One family: its set-up (``bench/cona_ttp.py``'s rules), then the static runs of the
    module docstring on each of ``seeds`` seeds, in this process."""
    ttp.worker_setup(spec["proxy"])  # one torch thread
    from cona.baselines import fastest_per_batch

    t0 = time.perf_counter()
    settings = dict(ttp.FULL, batches=list(batches), gpu="A100-80GB", num_gpus=64,
                    time_scale="measured",  # samples to the target do not depend on it
                    precision=ttp.STUDY_PRECISION)
    cfg, ctx0, _, _, _ = ttp.family_setup(target, spec, settings, cache_dir)
    cfg.cona.adam_beta2_batch = None  # each run at the betas set below, as they are
    if cfg.cona.lr_scaling != "sqrt":  # the rule's learning rate goes with sqrt(kappa)
        raise SystemExit(f"{target}: cona.lr_scaling={cfg.cona.lr_scaling}; the square-root "
                         "scaling rule needs sqrt")
    preset = (cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_eps)
    anchor = max(batches)
    by_seed: dict[str, dict[int, list[dict]]] = {}
    for k in range(seeds):
        ctx = _seed_context(cfg, ctx0, k, settings["probe_microbatches"])
        per = fastest_per_batch(ctx.candidates, ctx.cluster.iter_s)
        missing = [b for b in batches if b not in per]
        if missing:
            raise SystemExit(f"{target}: batches {missing} are not candidates {sorted(per)}")
        t = ctx.cfg.train
        for variant in ("preset", *variants):
            for b in batches if variant == "preset" else [b for b in batches if b != anchor]:
                t.adam_beta1, t.adam_beta2, t.adam_eps = adam_variant(preset, variant, b, anchor)
                rec, _ = static_run(ctx, per[b])
                by_seed.setdefault(variant, {}).setdefault(b, []).append({
                    "samples": rec["samples"], "reached": rec["reached"],
                    "adam_beta1": t.adam_beta1, "adam_beta2": t.adam_beta2,
                    "adam_eps": t.adam_eps})
        t.adam_beta1, t.adam_beta2, t.adam_eps = preset
    runs = {v: {b: {**recs[0], "samples": statistics.mean(r["samples"] for r in recs),
                    "samples_by_seed": [r["samples"] for r in recs],
                    "reached": all(r["reached"] for r in recs)}
                for b, recs in bb.items()} for v, bb in by_seed.items()}
    largest, anchor_run = by_seed["preset"][anchor], runs["preset"][anchor]
    efficiency, efficiency_by_seed = {}, {}
    for variant, bb in by_seed.items():
        for b, recs in bb.items():
            if b == anchor or not (runs[variant][b]["reached"] and anchor_run["reached"]):
                continue
            efficiency.setdefault(variant, {})[b] = (runs[variant][b]["samples"]
                                                     / anchor_run["samples"])
            efficiency_by_seed.setdefault(variant, {})[b] = [
                r["samples"] / a["samples"] for r, a in zip(recs, largest)]
    return {"proxy": spec["proxy"], "target_ppl": cfg.train.target_ppl, "seeds": seeds,
            "preset": dict(zip(("adam_beta1", "adam_beta2", "adam_eps"), preset)),
            "anchor_batch": anchor, "runs": runs, "efficiency": efficiency,
            "efficiency_by_seed": efficiency_by_seed, "wall_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=None, choices=sorted(ttp.MODELS))
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES),
                   help="global batches (target sequences, grid batches of the TTP bench); "
                   "the largest is the anchor whose Adam memory the others take")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                   help="which of Adam's hyperparameters the smaller batches scale "
                   "(the preset's always runs)")
    p.add_argument("--seeds", type=int, default=1,
                   help="seeds (data order and warm state, as bench/cona_ttp.py's)")
    p.add_argument("--cache-dir", default=None, help="tokenizer/dataset cache (data.cache_dir)")
    p.add_argument("--out", type=Path, default=None, help="write cona_adam_memory.json here")
    p.add_argument("--jobs", type=int, default=2, help="families in parallel processes")
    args = p.parse_args(argv)
    from jobruntime.metrics import provenance
    from jobruntime.outputs import refuse_output_folder

    refuse_output_folder(p, args.out)
    if args.jobs < 1 or args.seeds < 1:
        p.error("--jobs and --seeds must be >= 1")
    batches = tuple(sorted(set(args.batches)))
    if len(batches) < 2 or batches[0] <= 0:
        p.error("--batches needs at least two positive batches")
    models = {k: v for k, v in ttp.MODELS.items() if args.models is None or k in args.models}
    t0 = time.perf_counter()
    variants = tuple(v for v in VARIANTS if v in args.variants)
    report = {**provenance(argv), "precision": ttp.STUDY_PRECISION,
              "batches": list(batches), "seeds": args.seeds,
              "models": run_families(memory_family, models, args.jobs, batches, variants,
                                     args.seeds, args.cache_dir)}
    report["wall_s"] = time.perf_counter() - t0
    write_report(report, args.out, "cona_adam_memory.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
