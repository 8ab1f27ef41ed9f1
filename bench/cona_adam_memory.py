"""Is a larger batch more sample-efficient than a smaller one because of Adam's memory?

On the GPT-3 proxy of ``bench/cona_ttp.py`` batch 256 needs fewer samples to the target
than batch 64 (``docs/results/cona_efficiency.json``: efficiency 1.13), which no
noise-scale model allows: for a fixed optimizer, a sample at a larger batch is worth at
most one at a smaller (McCandlish et al. 2018, eq. 2.11).  But the optimizer is not
fixed in *samples*: at fixed ``beta1``, ``beta2`` Adam's moments average over
``1 / (1 - beta)`` *steps*, i.e. over ``B / (1 - beta)`` samples, so a 4x larger batch
averages its second moment over 4x more samples.  Malladi et al. 2022 (Sec. 5, the
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

    python bench/cona_adam_memory.py --models gpt3_1.3b llama3.2_1b --cache-dir DIR  # ~15 min

Prints one JSON object ``{"date", "commit", "machine", "command", "batches", "models":
{NAME: {"proxy", "target_ppl", "preset": {"adam_beta1", "adam_beta2", "adam_eps"},
"anchor_batch", "runs": {VARIANT: {BATCH: {"samples", "reached", "adam_beta1",
"adam_beta2", "adam_eps"}}}, "efficiency": {VARIANT: {BATCH: ratio}}, "wall_s"}}}``
(batches in target sequences; samples in proxy sequences, at evaluation granularity
refined near the target by ``cona.ttp_resolution``).
"""

from __future__ import annotations

import argparse
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


def memory_family(target: str, spec: dict, batches: tuple[int, ...],
                  cache_dir: str | None) -> dict:
    """One family: its set-up (``bench/cona_ttp.py``'s rules), then the static runs of the
    module docstring, in this process."""
    ttp.worker_setup(spec["proxy"])  # one torch thread
    from cona.baselines import fastest_per_batch
    from cona.context import build_context

    t0 = time.perf_counter()
    settings = dict(ttp.FULL, batches=list(batches), gpu="A100-80GB", num_gpus=64,
                    time_scale="measured")  # samples to the target do not depend on it
    cfg, ctx0, _, _, _ = ttp.family_setup(target, spec, settings, cache_dir)
    ctx = build_context(cfg, data=ctx0.data)
    ctx.warm = ctx0.warm
    per = fastest_per_batch(ctx.candidates, ctx.cluster.iter_s)
    missing = [b for b in batches if b not in per]
    if missing:
        raise SystemExit(f"{target}: batches {missing} are not candidates {sorted(per)}")
    t = ctx.cfg.train
    preset = (t.adam_beta1, t.adam_beta2, t.adam_eps)
    anchor = max(batches)
    runs: dict[str, dict[int, dict]] = {}
    for variant in ("preset", *VARIANTS):
        for b in batches if variant == "preset" else [b for b in batches if b != anchor]:
            t.adam_beta1, t.adam_beta2, t.adam_eps = adam_variant(preset, variant, b, anchor)
            rec, _ = static_run(ctx, per[b])
            runs.setdefault(variant, {})[b] = {
                "samples": rec["samples"], "reached": rec["reached"],
                "adam_beta1": t.adam_beta1, "adam_beta2": t.adam_beta2, "adam_eps": t.adam_eps}
    t.adam_beta1, t.adam_beta2, t.adam_eps = preset
    largest = runs["preset"][anchor]
    efficiency = {
        variant: {b: r["samples"] / largest["samples"]
                  for b, r in by_batch.items() if b != anchor and r["reached"]}
        for variant, by_batch in runs.items()} if largest["reached"] else {}
    return {"proxy": spec["proxy"], "target_ppl": cfg.train.target_ppl,
            "preset": dict(zip(("adam_beta1", "adam_beta2", "adam_eps"), preset)),
            "anchor_batch": anchor, "runs": runs, "efficiency": efficiency,
            "wall_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=None, choices=sorted(ttp.MODELS))
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES),
                   help="global batches (target sequences, grid batches of the TTP bench); "
                   "the largest is the anchor whose Adam memory the others take")
    p.add_argument("--cache-dir", default=None, help="tokenizer/dataset cache (data.cache_dir)")
    p.add_argument("--out", type=Path, default=None, help="write cona_adam_memory.json here")
    p.add_argument("--jobs", type=int, default=2, help="families in parallel processes")
    args = p.parse_args(argv)
    from jobruntime.metrics import provenance
    from jobruntime.outputs import refuse_output_folder

    refuse_output_folder(p, args.out)
    if args.jobs < 1:
        p.error("--jobs must be >= 1")
    batches = tuple(sorted(set(args.batches)))
    if len(batches) < 2 or batches[0] <= 0:
        p.error("--batches needs at least two positive batches")
    models = {k: v for k, v in ttp.MODELS.items() if args.models is None or k in args.models}
    t0 = time.perf_counter()
    report = {**provenance(argv), "batches": list(batches),
              "models": run_families(memory_family, models, args.jobs, batches,
                                     args.cache_dir)}
    report["wall_s"] = time.perf_counter() - t0
    write_report(report, args.out, "cona_adam_memory.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
