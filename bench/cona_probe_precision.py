"""How many micro-batches a direct noise-scale probe of the CONA bench needs.

Rule 4 of ``bench/cona_ttp.py`` probes the noise scale along the reference and fits a
trend through the probes; the trend's precision is what the growth and the time scale
rest on (:func:`cona.targets.trend_interval`).  A probe's reading varies two ways: within
one state (which micro-batches it draws; shrinks with the probe's size) and between the
states along the run (loss spikes, the trajectory: no probe size removes it; the trend's
residual scatter).  Probes of ``M`` micro-batches are worth their cost while the first is
not negligible against the second.

This bench measures the first at each family's warm state: ``--repeats`` probes of each
size in ``--sizes``, each on micro-batches no other probe used (the training state is not
touched), and the standard deviation of their ``log phi``; beside it the second, read
from a committed full run (``--from``: its reference's trend, ``1.4826 x`` the median
absolute deviation of the probes' ``log phi`` about it, a robust standard deviation).

The warm state is one state, where the noise scale is low.  Along the segment a probe's
own spread is read from two full runs whose references trained the same states (the same
warm states and data: every probe at the same samples and loss) with probes of different
sizes (``--paired-with``): the difference of their ``log phi`` at each state, whose
standard deviation is at most the smaller probe's own (its micro-batches are the larger
one's first ones, so the two readings share them), and each run's scatter about its trend.

Usage::

    python bench/cona_probe_precision.py --from docs/results/cona_ttp.json \\
        --paired-with docs/results/cona_ttp_2026-12-06_dense.json --cache-dir DIR

Prints one JSON object: ``{"families": {NAME: {"proxy", "microbatch_sequences",
"sizes": {M: {"noise_scale_proxy": [...], "log_sd", "share_of_variance"}},
"between_states_log_sd", "paired"}}, "repeats", "from", "paired_with", "date", "commit",
"machine", "command"}`` (``paired``, with ``--paired-with``: ``{"probes", "microbatches":
[this run's, the other's], "log_diff_sd", "log_diff_robust_sd", "trend_log_sd": [this
run's, the other's]}``)
(noise scales in proxy sequences; ``share_of_variance``: the within-state variance over
the sum of both, at that size).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIZES = (64, 128, 256)
REPEATS = 6
MAD_TO_SD = 1.4826  # a normal's standard deviation over its median absolute deviation


def probe_spread(ctx, sizes=SIZES, repeats: int = REPEATS) -> dict:
    """``repeats`` probes of each size in ``sizes`` (micro-batches) at ``ctx``'s warm
    state, every probe on micro-batches of its own: ``{M: [phi, ...]}`` (proxy
    sequences; ``None`` where a probe read no positive signal) and the micro-batch's
    sequences."""
    job = ctx.make_job(ctx.reference_strategy(), track_gns=False)
    start, used, out = job.consumed_samples, 0, {}
    for m in sizes:
        out[m] = []
        for _ in range(repeats):
            # the probe draws the sampler's next micro-batches and puts it back where it
            # was: start it past every micro-batch an earlier probe drew
            job.sampler = job._sampler(job.topo, start)
            skipped = 0
            while skipped < used:
                skipped += len(job.sampler.next())
            out[m].append(job.measure_noise_scale(m, charge=False))
            used = skipped + m
    mb = job.sampler.next()[0]
    return {"phis": out, "microbatch_sequences": len(next(iter(mb.values())))}


def between_states_log_sd(result: dict, family: str) -> float | None:
    """``1.4826 x`` the median absolute deviation of a committed run's reference probes'
    ``log phi`` about their trend (``noise_scale_fit.log_mad``), or ``None``."""
    fit = ((result.get("models", {}).get(family) or {}).get("reference") or {}).get(
        "noise_scale_fit") or {}
    return MAD_TO_SD * fit["log_mad"] if "log_mad" in fit else None


def paired(result: dict, other: dict, family: str) -> dict | None:
    """The same states probed by two runs (``result`` and ``other``, each a
    ``bench/cona_ttp.py`` JSON; module docstring): the probes of ``family``'s reference
    that sit at the same samples and loss in both, the standard deviation of the
    difference of their ``log phi`` (plain and ``1.4826 x`` MAD), both runs' probe sizes
    (micro-batches) and their scatter about their own trends; ``None`` where the family
    is not in both or no probe matches."""
    refs = [((r.get("models", {}).get(family) or {}).get("reference") or {})
            for r in (result, other)]
    if not all(ref.get("noise_scale_probes") for ref in refs):
        return None

    from bench.cona_reference import probe_noise_scale as phi

    theirs = {(p["samples"], p["val_loss"]): phi(p) for p in refs[1]["noise_scale_probes"]}
    diffs = [math.log(a) - math.log(b) for p in refs[0]["noise_scale_probes"]
             if (a := phi(p)) and (b := theirs.get((p["samples"], p["val_loss"])))]
    if len(diffs) < 2:
        return None
    med = statistics.median(diffs)
    return {"probes": len(diffs),
            "microbatches": [ref.get("probe_microbatches") for ref in refs],
            "log_diff_sd": statistics.stdev(diffs),
            "log_diff_robust_sd": MAD_TO_SD * statistics.median(abs(d - med) for d in diffs),
            "trend_log_sd": [between_states_log_sd(r, family) for r in (result, other)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, required=True,
                   help="a full bench/cona_ttp.py result (its families and their scatter)")
    p.add_argument("--cache-dir", help="where the warm states are cached (as the bench's)")
    p.add_argument("--repeats", type=int, default=REPEATS)
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    p.add_argument("--paired-with", type=Path,
                   help="a full run whose reference trained the same states with probes of "
                        "another size (module docstring)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    if args.repeats < 2:
        p.error("--repeats must be at least 2 (a standard deviation)")
    from bench.cona_reference import seed_context
    from bench.cona_ttp import FULL, MODELS, family_config, worker_setup
    from jobruntime.metrics import publish_json

    try:
        result = json.loads(args.source.read_text())
        other = json.loads(args.paired_with.read_text()) if args.paired_with else None
    except (OSError, ValueError) as e:
        p.error(f"cannot read {args.source} or {args.paired_with}: {e}")
    settings = dict(FULL, gpu="A100-80GB", num_gpus=64, precision=result.get("precision"))
    families = {}
    for name in result["models"]:
        spec = MODELS[name]
        worker_setup(spec["proxy"])
        cfg = family_config(name, spec, settings, args.cache_dir)
        ctx, _ = seed_context(cfg, cfg.train.warmup_iters, probe_microbatches=min(args.sizes))
        spread = probe_spread(ctx, args.sizes, args.repeats)
        between = between_states_log_sd(result, name)
        sizes = {}
        for m, phis in spread["phis"].items():
            logs = [math.log(v) for v in phis if v and v > 0]
            sd = statistics.stdev(logs) if len(logs) > 1 else None
            sizes[m] = {"noise_scale_proxy": phis, "log_sd": sd,
                        "share_of_variance": sd * sd / (sd * sd + between * between)
                        if sd is not None and between else None}
        families[name] = {"proxy": spec["proxy"],
                          "microbatch_sequences": spread["microbatch_sequences"],
                          "sizes": sizes, "between_states_log_sd": between,
                          "paired": paired(result, other, name) if other else None}
    out = {"families": families, "repeats": args.repeats,
           "from": {"file": str(args.source),
                    **{k: result.get(k) for k in ("date", "commit", "machine")}},
           "paired_with": None if other is None else {
               "file": str(args.paired_with),
               **{k: other.get(k) for k in ("date", "commit", "machine")}}}
    publish_json(out, args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
