"""CONA benchmark: time to target perplexity on an emulated 64x A100 cluster.

For each timing target (GPT-3 1.3B, BERT-Large, Llama-3.2-1B) its tiny twin
(tiny_gpt, tiny_bert, tiny_llama) really trains on the bundled corpus in one
process, at sequence 64 (128 for tiny_bert); the clock comes from the cost
model of the target at its own shape (sequence 2048, BERT 512) on 64 A100s
(8 nodes of 8; ``cona.clock=emulated``, ``cona/emulated.py``), at target global
batches of 64 to 1024 sequences.  Methods (``cona/baselines.py``), all from the
same initial weights, data order, LR rule (sqrt of the global batch) and
sample-based schedule; every method's TTP (the oracle's too) is interpolated
(log-perplexity) at the crossing of the target between the evaluations either
side (``jobruntime.metrics.TTPTracker``):

- ``static_throughput``: the candidate with the highest modelled tokens/s;
- ``static_oracle``: the best TTP over all static candidates;
- ``cona``: the online controller (starts at the reference batch, which rule 1
  puts at the grid's smallest, in the layout chosen one switch ahead,
  ``cona.controller.start_strategy``; decides every K steps);
- ``oracle_chain``: exact branch-and-bound search over chains on a window grid
  (``cona/oracle.py``); asserted ``<= static_oracle``.

Full runs add rows outside the table's comparison: the same controller on other
noise-scale estimates (:data:`GNS_ABLATION`: ``cona_scale_free_gns`` with
``cona.gns_average=scale_free``, ``cona_preconditioned_gns`` with
``cona.gns_preconditioned=true`` as well, Pollux's estimate for Adam) and, where
``static_throughput`` misses the target, ``static_throughput_long`` (its TTP given
4x the budget, own data order; :func:`throughput_long`).

Rules fixed before any method runs (per family):

1. **Reference and target.** The reference is the proxy at its preset global
   batch ``B_ref`` (where its LR is tuned) with the run's schedule; the target
   perplexity is its validation perplexity after ``TARGET_FRACTION`` of the
   budget (``train.iters * B_ref`` samples).  Runs stop at the target or at
   the budget.  If ``B_ref`` stands for fewer target sequences than the
   grid's smallest batch (rule 2), the reference is run again at that batch
   (LR by the run's rule, same sample budget; ``rebase``), so the target is one
   the grid can reach (tiny_llama and tiny_bert: 8 and 16 proxy sequences
   stand for 32 target sequences, below 64).
2. **Proxy -> target batches.** ``cona.batch_ratio`` by
   :func:`cona.mapping.calibrate_ratio` from the reference's noise scale at
   that point (the one rule, in ``cona/mapping.py``, with its sources); it is
   fixed from the preset-batch reference, also when rule 1 moves the reference
   (``mapping.ratio_from_noise_scale_proxy`` in the output).
3. **Oracle grid.** Window ends at 1/D, ..., (D-1)/D of the reference's samples
   to target.

Usage::

    python bench/cona_ttp.py --quick              # tiny_gpt / GPT-3 1.3B, CI-sized
    python bench/cona_ttp.py --out runs/cona_ttp  # all three families (long)
    python bench/cona_ttp.py --models bert_large --jobs 1
    python bench/cona_ttp.py --models llama3.2_1b --budget-scale 2   # a deeper target

Prints one JSON object: ``{"clock": "emulated", "models": {NAME: {"target_ppl",
"ratios", "gns_growth", "methods": {METHOD: {"ttp_s", "chain", "switch_times_s",
"evals", ...}}}}}``; with ``--out`` also a plot per family (perplexity against
emulated time, switches marked, noise scale beneath; ``bench/cona_plot.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import copy
import json
import logging
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGET_FRACTION = 0.5
BATCHES = [64, 128, 256, 512, 1024]  # target sequences
# target preset -> proxy preset and run length (budget = iters * the preset's batch)
MODELS = {  # the longest first, so that --jobs 2 ends soonest
    "bert_large": {"proxy": "tiny_bert", "iters": 188, "seq": 128},
    "llama3.2_1b": {"proxy": "tiny_llama", "iters": 375, "seq": 64},
    "gpt3_1.3b": {"proxy": "tiny_gpt", "iters": 375, "seq": 64},
}
# full runs: (method name, cona config overrides) of the noise-scale ablation rows.  The
# preconditioned estimate runs scale-free: |P G|^2 falls by orders of magnitude once Adam's
# v_hat averages over steps, so with the plain EMA the first steps pinned it (measured: it
# moved 1.0-1.1x over a run where the direct measurement grew 4-19x).
GNS_ABLATION = [("cona_scale_free_gns", {"gns_average": "scale_free"}),
                ("cona_preconditioned_gns", {"gns_average": "scale_free",
                                             "gns_preconditioned": True})]
FULL = {"windows": 3, "batches": BATCHES, "throughput_budget_scale": 4, "gns_ablation": True}
QUICK = {"windows": 2, "batches": BATCHES[:3], "models": {
    "gpt3_1.3b": {"proxy": "tiny_gpt", "iters": 150, "seq": 64}}}
COMMON = [
    "cona.enabled=true",
    "cona.clock=emulated",
    "cona.gpu=A100-80GB",
    "cona.num_gpus=64",
    "cona.decision_interval=10",
    "train.eval_interval=8",
    "train.eval_iters=4",
    "train.stop_at_target=true",
    "train.warmup_iters=20",  # what the targets were measured with (the preset's, before 100)
    "logging.wandb=disabled",
]


def reference(cfg):
    """Rules 1 and 2: the reference run's target perplexity and its noise scale, measured
    directly (``Job.measure_noise_scale``, 64 micro-batches, no effect on the run) at
    the first decision point and at the target point."""
    from cona.context import build_context
    from cona.run import Loop

    ref_cfg = copy.deepcopy(cfg)
    ref_cfg.cona.global_batch_sizes = [cfg.parallel.global_batch_size]
    ref_cfg.cona.batch_ratio = 1.0
    ref_cfg.train.target_ppl = None
    big = max(BATCHES)  # the later context's largest proxy batch is at most this
    ctx = build_context(ref_cfg, min_train_samples=ctx_budget(cfg) + big)
    job = ctx.make_job()
    samples = int(TARGET_FRACTION * ctx.budget_samples)
    loop = Loop(job, ref_cfg, budget_samples=samples, eval_samples=ctx.eval_samples,
                keep_records=False)
    loop.run(until=lambda: job.trainer.step >= cfg.cona.decision_interval)
    first = job.measure_noise_scale()
    loop.run()
    phi = job.measure_noise_scale()
    return {
        "target_ppl": round(loop.progress.last_val_ppl, 2),
        "noise_scale_proxy": phi,
        "noise_scale_first_decision_proxy": first,
        "samples": job.consumed_samples,
    }, ctx.data


def rebase(cfg, proxy_batch: int):
    """Rule 1's reference moved to global batch ``proxy_batch`` (the grid's smallest): the
    learning rates follow the run's rule (``cona.lr_scaling``) from the preset's batch;
    ``train.iters``, ``warmup_iters`` and ``lr_decay_iters`` (steps of the reference batch)
    are rescaled so that the budget, warmup and decay keep their length in samples; the
    micro-batch is the largest divisor of ``proxy_batch`` not above the preset's."""
    from cona.controller import scale_lr

    cfg = copy.deepcopy(cfg)
    p, t = cfg.parallel, cfg.train
    old = p.global_batch_size

    def steps(n: int) -> int:  # n steps at the old batch, in steps at the new one
        return max(round(n * old / proxy_batch), 1)

    budget = ctx_budget(cfg)
    t.lr = scale_lr(t.lr, proxy_batch, old, cfg.cona.lr_scaling)
    t.min_lr = scale_lr(t.min_lr, proxy_batch, old, cfg.cona.lr_scaling)
    t.warmup_iters = steps(t.warmup_iters) if t.warmup_iters else 0
    if t.lr_decay_iters:
        t.lr_decay_iters = steps(t.lr_decay_iters)
    p.micro_batch_size = max(m for m in range(1, min(p.micro_batch_size, proxy_batch) + 1)
                             if proxy_batch % m == 0)
    p.global_batch_size = proxy_batch
    t.iters = -(-budget // proxy_batch)
    return cfg


def ctx_budget(cfg) -> int:
    return max(cfg.train.iters, 1) * cfg.parallel.global_batch_size


def family_config(target: str, spec: dict, batches: list[int], cache_dir: str | None):
    """Rules 1 and 2 for one family: the proxy's config with ``cona.batch_ratio``, the grid
    and ``train.target_ppl`` set, the reference moved into the grid if needed.

    Returns ``(cfg, ref, data, setup)``: the reference's measurements (:func:`reference`),
    its dataset (shared by later runs) and the rule's record (ratio, its source, rebase).

    Raises:
        SystemExit: the calibrated ratio divides none of ``batches``.
    """
    from cona.mapping import PUBLISHED_BATCH, calibrate_ratio
    from jobruntime.config import load_config

    log = logging.getLogger("cona")
    overrides = [*COMMON, f"cona.target_model={target}", f"train.iters={spec['iters']}",
                 f"model.seq_length={spec['seq']}"]
    if cache_dir:
        overrides.append(f"data.cache_dir={cache_dir}")
    cfg = load_config(spec["proxy"], overrides)
    ref, data = reference(cfg)
    ratio = calibrate_ratio(ref["noise_scale_proxy"], target)
    log.info("reference: target ppl %.1f after %d samples, noise scale %.1f proxy seq. -> "
             "batch ratio %d", ref["target_ppl"], ref["samples"], ref["noise_scale_proxy"], ratio)
    cfg.cona.batch_ratio = float(ratio)
    cfg.cona.global_batch_sizes = [b for b in batches if b % ratio == 0]
    if not cfg.cona.global_batch_sizes:
        raise SystemExit(f"{target}: batch ratio {ratio} divides none of the grid's batches "
                         f"{batches}; add multiples of {ratio} to BATCHES")
    setup = {"ratio": ratio, "ratio_from_noise_scale_proxy": ref["noise_scale_proxy"],
             "published_batch": PUBLISHED_BATCH[target][0], "source": PUBLISHED_BATCH[target][1],
             "reference_rebased": None}
    smallest = min(cfg.cona.global_batch_sizes)
    if ratio * cfg.parallel.global_batch_size < smallest:  # rule 1: reference inside the grid
        setup["reference_rebased"] = {"from_proxy_batch": cfg.parallel.global_batch_size,
                                      "first_target_ppl": ref["target_ppl"]}
        cfg = rebase(cfg, -(-smallest // ratio))
        ref, data = reference(cfg)
        log.info("reference rebased to proxy batch %d (target batch %d): target ppl %.1f after "
                 "%d samples", cfg.parallel.global_batch_size, smallest, ref["target_ppl"],
                 ref["samples"])
    cfg.train.target_ppl = ref["target_ppl"]
    return cfg, ref, data, setup


def worker_setup(proxy: str, threads: int) -> None:
    """A family's process: ``threads`` torch threads, log lines tagged with ``proxy``."""
    import torch

    torch.set_num_threads(threads)
    from jobruntime.logging_utils import setup_logging

    setup_logging(logging.INFO)
    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"[%(asctime)s {proxy}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("jobruntime").setLevel(logging.WARNING)


def bench_model(target: str, spec: dict, settings: dict, cache_dir: str | None,
                out: str | None, threads: int) -> dict:
    worker_setup(spec["proxy"], threads)
    log = logging.getLogger("cona")
    from cona.baselines import run_cona, run_search
    from cona.context import build_context
    from cona.grad_stats import noise_scale_growth as growth

    t0, c0 = time.perf_counter(), time.process_time()
    cfg, ref, data, setup = family_config(target, spec, settings["batches"], cache_dir)
    ctx = build_context(cfg, data=data)
    D = settings["windows"]
    boundaries = [round(ref["samples"] * k / D) for k in range(1, D)]
    t1 = time.perf_counter()
    search = run_search(ctx, boundaries)
    t2 = time.perf_counter()
    log.info("static + oracle search done in %.0f s: %s", t2 - t1, search["search"])
    methods = {k: search[k] for k in ("static_throughput", "static_oracle", "oracle_chain")}
    methods["cona"], loop = run_cona(ctx)
    if settings.get("gns_ablation"):  # the same controller on other noise-scale estimates
        for name, overrides in GNS_ABLATION:
            other = copy.deepcopy(cfg)
            for field, value in overrides.items():
                setattr(other.cona, field, value)
            methods[name], _ = run_cona(build_context(other, data=data))
    t3 = time.perf_counter()
    scale = settings.get("throughput_budget_scale")
    thr = methods["static_throughput"]
    if thr["ttp_s"] is None and scale:
        from cona.strategy import Strategy

        batch = Strategy.from_label(thr["chain"][0]["strategy"]).global_batch_size
        if search["per_batch"][batch]["cut"]:  # stopped by the search's bound: run it out
            methods["static_throughput_long"] = {**throughput_long(cfg, 1, data), "reason": "cut"}
        else:  # the budget ended before the target
            methods["static_throughput_long"] = {**throughput_long(cfg, scale), "reason": "budget"}
    t4 = time.perf_counter()
    so, oc = methods["static_oracle"], methods["oracle_chain"]
    if so is not None and oc["ttp_s"] is not None:
        assert oc["ttp_s"] <= so["ttp_s"] * (1 + 1e-12), "oracle_chain slower than static_oracle"
    decided = [d["noise_scale"] for d in methods["cona"]["decisions"]]
    result = {
        "proxy": spec["proxy"],
        "target_ppl": cfg.train.target_ppl,
        "rule": {"target_fraction": TARGET_FRACTION, "budget_samples": ctx.budget_samples,
                 "reference_batch_proxy": cfg.parallel.global_batch_size,
                 "reference_rebased": setup["reference_rebased"], "lr": cfg.train.lr,
                 "reference_samples_to_target": ref["samples"]},
        "mapping": {"ratio": setup["ratio"],
                    "ratio_from_noise_scale_proxy": setup["ratio_from_noise_scale_proxy"],
                    "noise_scale_ref_proxy": ref["noise_scale_proxy"],
                    "published_batch": setup["published_batch"], "source": setup["source"],
                    "proxy_seq": ctx.mapping.proxy_seq, "target_seq": ctx.mapping.target_seq},
        "candidates": len(ctx.candidates),
        "batches": sorted({c.global_batch_size for c in ctx.candidates}),
        "gns_growth": {"cona_first_to_last_decision": growth(decided),
                       "cona_first_decision": next((v for v in decided if v), None),
                       "cona_last_decision": next((v for v in reversed(decided) if v), None),
                       **{f"{name}_first_to_last_decision": growth(
                           [d["noise_scale"] for d in methods[name]["decisions"]])
                          for name, _ in GNS_ABLATION if name in methods},
                       "reference_direct": ref["noise_scale_proxy"]
                       / ref["noise_scale_first_decision_proxy"]
                       if ref["noise_scale_first_decision_proxy"] else None},
        "ratios": ratios(methods),
        "pollux_model": pollux_model(ctx, ref),
        "methods": methods,
        "per_batch": search["per_batch"],
        "search": search["search"],
        "wall_s": {"reference": t1 - t0, "static_and_oracle": t2 - t1, "cona": t3 - t2,
                   "static_throughput_long": t4 - t3},
        # CPU seconds of this process: the wall time on an idle core (the machine is shared)
        "cpu_s": time.process_time() - c0,
    }
    if out is not None:
        d = Path(out) / target
        d.mkdir(parents=True, exist_ok=True)
        with open(d / "cona_metrics.jsonl", "w") as f:
            for rec in loop.progress.records:
                f.write(json.dumps(rec, default=float) + "\n")
        # this family's result as soon as it is done (the whole report comes at the end)
        (d / "result.json").write_text(json.dumps(result, indent=2, default=float) + "\n")
        from bench.cona_plot import plot_family

        plot_family(target, result, d / "ppl_vs_time.png")
    return result


def static_loop(ctx, strategy):
    """``(job, loop)``: a job at ``strategy`` from the initial weights and its loop over
    ``ctx``'s budget (to the target or the budget's end)."""
    from cona.run import Loop

    job = ctx.make_job(strategy)
    return job, Loop(job, ctx.cfg, budget_samples=ctx.budget_samples,
                     eval_samples=ctx.eval_samples, keep_records=False)


def throughput_long(cfg, scale: float, data=None) -> dict:
    """``static_throughput`` run out without the search's cut, given ``scale`` times the
    budget in samples (its LR decay stretched over it, warmup unchanged): its TTP where
    the table's run ended before the target.  With ``scale`` != 1 the training set is
    built for the longer run, so its data order is its own (``data_order``; megatron
    shuffles all epochs together); ``data`` (the table's) is only valid at scale 1.
    Reported apart from the table's methods."""
    from cona.context import build_context
    from cona.controller import best_throughput_strategy

    long = copy.deepcopy(cfg)
    long.train.iters = max(round(cfg.train.iters * scale), 1)
    if long.train.lr_decay_iters:
        long.train.lr_decay_iters = max(round(cfg.train.lr_decay_iters * scale), 1)
    ctx = build_context(long, data=data if scale == 1 else None)
    strategy = best_throughput_strategy(ctx.candidates, ctx.cost_model)
    job, loop = static_loop(ctx, strategy)
    loop.run()
    reached = loop.progress.ttp.reached
    return {"ttp_s": loop.progress.ttp.ttp_s,
            "ttp_lower_bound_s": None if reached else job.clock_s,
            "budget_scale": scale, "data_order": "same" if scale == 1 else "own",
            "strategy": strategy.label, "samples": job.consumed_samples,
            "budget_samples": ctx.budget_samples, "evals": loop.progress.evals}


def pollux_model(ctx, ref: dict) -> dict:
    """What chaining could gain at most *in the model* the controller uses
    (:func:`cona.surrogate.chaining_ceiling`): the noise scale growing log-linearly in
    progress between the reference's two direct measurements, the emulated cluster's
    fastest layout per batch, no switch costs.  Returns the best static batch and the
    ideal chain's speed-up over it (a model estimate, not a measurement)."""
    from cona.baselines import fastest_rates
    from cona.surrogate import chaining_ceiling

    phi0, phi1 = ref["noise_scale_first_decision_proxy"], ref["noise_scale_proxy"]
    if not phi0 or not phi1:
        return {}
    r = ctx.mapping.ratio
    speed = fastest_rates(ctx.candidates, ctx.cluster.iter_s)
    best, ceiling = chaining_ceiling(speed, r * phi0, r * phi1, ctx.reference_batch)
    return {"best_static_batch": best, "ideal_chain_over_best_static": ceiling,
            "noise_scale_range_target": [r * phi0, r * phi1]}


def ratios(methods: dict) -> dict:
    """TTP ratios against CONA (> 1: CONA faster); a baseline that never reached the
    target gives a lower bound from its clock at the budget's end."""
    c = methods["cona"]["ttp_s"]
    out = {}
    for name in ("static_oracle", "oracle_chain", "static_throughput", "static_throughput_long"):
        if name not in methods:
            continue
        m = methods[name] or {}
        t = m.get("ttp_s")
        if c is None:
            out[f"{name}_over_cona"] = None
        elif t is not None:
            out[f"{name}_over_cona"] = t / c
        elif m.get("ttp_lower_bound_s") is not None:
            out[f"{name}_over_cona_at_least"] = m["ttp_lower_bound_s"] / c
    best = (methods.get("static_oracle") or {}).get("ttp_s")
    for name, _ in GNS_ABLATION:
        other = (methods.get(name) or {}).get("ttp_s")
        if other and best:
            out[f"static_oracle_over_{name}"] = best / other
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="GPT-3 1.3B / tiny_gpt, short, CI-sized")
    p.add_argument("--models", nargs="*", default=None, choices=sorted(MODELS),
                   help="subset of the full benchmark's families")
    p.add_argument("--out", type=Path, default=None, help="folder for JSON, metrics, plots")
    p.add_argument("--cache-dir", default=None, help="tokenizer/dataset cache (data.cache_dir)")
    p.add_argument("--jobs", type=int, default=2,
                   help="families run in parallel processes (default 2: one per core)")
    p.add_argument("--budget-scale", type=float, default=1.0,
                   help="multiply every family's training budget (train.iters) by this; "
                   "the target stays at half the budget, so it moves deeper into training")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (default 1: OpenMP threads that "
                   "oversubscribe shared cores slow every step down many times)")
    args = p.parse_args(argv)
    from jobruntime.outputs import refuse_output_folder

    refuse_output_folder(p, args.out)  # before the run, not after it
    if args.jobs < 1 or args.threads < 1:
        p.error("--jobs and --threads must be >= 1")
    if not 0 < args.budget_scale < float("inf"):
        p.error(f"--budget-scale must be a positive number, got {args.budget_scale}")
    settings = QUICK if args.quick else FULL
    models = settings.get("models") or {
        k: v for k, v in MODELS.items() if args.models is None or k in args.models}
    models = {k: {**v, "iters": max(round(v["iters"] * args.budget_scale), 1)}
              for k, v in models.items()}
    report = {"clock": "emulated", "gpu": "A100-80GB", "num_gpus": 64,
              "budget_scale": args.budget_scale, "models": {}}
    t0 = time.perf_counter()
    out = str(args.out) if args.out is not None else None
    report["models"] = run_families(bench_model, models, args.jobs, settings, args.cache_dir,
                                    out, args.threads)
    report["wall_s"] = time.perf_counter() - t0
    report["load_average_1min_at_end"] = os.getloadavg()[0]
    write_report(report, args.out, "cona_ttp.json")
    return 0


def write_report(report: dict, out: Path | None, name: str) -> None:
    """Print ``report`` as JSON; with ``out`` also write it to ``out/name`` (through a
    temporary name, so a killed run leaves no half-written report)."""
    from jobruntime.metrics import write_json_atomic

    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out / name, report)
    print(json.dumps(report, indent=2, default=float))


def run_families(fn, models: dict, jobs: int, *args) -> dict:
    """``{name: fn(name, spec, *args)}`` over ``models``; ``jobs`` > 1 runs them in that
    many spawned processes (one per core), 1 in this process (easier to debug)."""
    if jobs == 1:
        return {name: fn(name, spec, *args) for name, spec in models.items()}
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(models)),
                                mp_context=mp.get_context("spawn")) as pool:
        futures = {name: pool.submit(fn, name, spec, *args) for name, spec in models.items()}
        return {name: fut.result() for name, fut in futures.items()}


if __name__ == "__main__":
    sys.exit(main())
