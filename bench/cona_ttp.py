"""CONA benchmark: time to target perplexity on an emulated GPU cluster, deep in training.

For each timing target (GPT-3 1.3B, BERT-Large, Llama-3.2-1B) a narrowed tiny twin
(the preset tiny_gpt, tiny_llama, tiny_bert at 2 layers of width 128, rule 0;
sequence 64; BERT's masked-LM proxy masks 40 %) really trains on the bundled corpus
in one process (one torch thread: results do not depend on the machine's core
count); the clock comes
from the cost model of the target at its own shape on ``--num-gpus`` x ``--gpu``
(default 64 A100s; ``cona/emulated.py``), at target global batches of 64 to 1024
sequences.

Rules fixed before any method runs (per family; none looks at a method's result):

0. **Proxy.** The preset's architecture narrowed (:data:`MODELS`' ``overrides``) so that
   the full bench's many runs fit on 2 cores; the quick run keeps the presets.  Every
   proxy trains in bf16 mixed precision (:data:`PRECISION`: bf16 weights and matmuls,
   gradients reduced in fp32, fp32 main weights and Adam moments: megatron-core's
   mixed-precision optimizer), as the target trains on its GPUs (``--precision fp32``:
   the presets' CPU default, a set-up of its own; how fast either runs depends on the
   CPU's bf16 instructions).
1. **Batches.** One proxy sequence stands for ``r = 8`` target sequences, every
   family (:data:`cona.mapping.BATCH_RATIO`, a constant: no measured quantity is
   rounded on the way to the table).
2. **Warm start.** The proxy trains once through its preset's recipe (its batch,
   LR and full warmup, ``train.warmup_iters`` steps) and is cached on disk
   (:mod:`cona.warm`); every method of every seed starts from its seed's warm state,
   a start above the warm state's LR ramped like a switch (``cona.lr_ramp_steps``).
3. **Target.** 0.5 of the lower of the corpus's unigram perplexity (the family's
   tokenizer) and the warm state's perplexity (:func:`cona.targets.target_ppl`: why
   0.5).
4. **Time scale.** The reference (the preset batch at its LR, first seed, from the
   warm state to the target) measures the noise scale directly at the warm state,
   :data:`PROBE_DENSITY` times per evaluation interval and at the target
   (:data:`PROBE_MICROBATCHES` micro-batches each); ``phi_0`` is the warm state's
   probe, ``phi_1`` the value at the target's loss of a power law in the loss fitted
   robustly to the segment's probes (:func:`bench.cona_reference.segment_trend`; single
   probes along a run scatter ~2x), reported with its 95 % moving-block bootstrap
   interval (``noise_scale_growth_direct_interval``) and beside the growth along the
   segment's own probes (``noise_scale_growth_along``: the trend at the target over the
   trend at the warm state's loss; :func:`bench.cona_reference.segment_growth`).  Kaplan et al. 2020's
   ``B_crit(L)`` and ``L(N, S)`` turn the range ``r x [phi_0, phi_1]`` into the span of the target's training one run
   stands for (``target_tokens_per_run``) and so the step dilation ``k``
   (``cona.step_dilation``): one proxy step is charged ``k`` target steps
   (:func:`cona.targets.time_scale`).  Switch costs stay real seconds.  The end of the
   range is read along a run whose trajectory differs between machines, and the
   dilation is steep in it, so the dilation charged is the one measured once for the
   set-up and committed (``bench/cona_time_scale.py``; ``--time-scale measured``: this
   run's own, which is always reported beside it).
5. **Evaluations.** Every method is evaluated (``VAL_SEQUENCES`` validation
   sequences) every ``eval_interval`` step times of the reference strategy on its clock
   (``cona.eval_clock``: the same times for every batch), more often near the target
   (``cona.ttp_resolution``), and the oracle at each window's end.  They are charged to
   every method alike, as a job validating every ``eval_interval`` reference batches
   pays (``cona/emulated.py``); a direct noise-scale probe to the method that runs it
   (``cona/job.py``).
5a. **Adam across batches.** Every method runs Adam's ``beta2`` at its batch by the
   square-root scaling rule from the recipe's: the preset's ``beta2`` (0.95, GPT-3's
   and TinyLlama's published AdamW value; BERT's published 0.999 is not the preset's)
   at the family's published batch (``cona.adam_beta2_batch``), so the second moment
   averages over the recipe's number of samples at every batch.  At one ``beta2`` a
   larger batch averages over more samples, and on GPT-3's proxy batch 256 then needed
   fewer samples than batch 64, which no noise-scale efficiency allows
   (``bench/cona_adam_memory.py``).  The reference (rule 4) is the preset's run as it
   is: it sets the target and the time scale, no method's result.
6. **Oracle grid.** Window ends at 1/D, ..., (D-1)/D of the reference's segment.
   The full run searches it with dominance pruning and a beam of 2
   (``cona/oracle_pruned.py``: the exact search over 6 windows trains 900-2,000 times
   a static run's samples on synthetic problems of this shape, the pruned one ~17 and
   found the exact optimum on them); the quick run searches exactly.

Methods (``cona/baselines.py``), 3 seeds each (data order and initialisation; the
warm state is per seed), TTP interpolated at the crossing of the target:

- ``static_recipe``: the target's published batch (GPT-3 1.3B 512 x 2048, BERT-Large
  256 x 512, Llama-3.2-1B 1024 x 2048 from TinyLlama's recipe) at the layout with
  the lowest modelled per-iteration time and the best of the same LR factors as
  ``static_oracle``, run to the target without a cap;
- ``static_throughput``: the candidate with the highest modelled tokens/s;
- ``static_oracle``: every grid batch at its fastest layout and at 0.5, 1 or 2 x the
  scaling rule's LR, hindsight best (per seed); its whole sweep is kept (``runs``), and
  the family's ``static_fixed`` is the one setting with the best mean over the seeds
  (``bench/cona_aggregate.py``: how much of the per-seed best is selection on noise);
- ``oracle_chain``: the oracle search over chains (``cona/oracle.py``; in the full run
  a beam search, ``search.exact`` False); asserted ``<= static_oracle`` at LR factor 1
  (the search's own statics, run first in either mode);
- ``cona``: the online controller.

Usage::

    python bench/cona_ttp.py --quick              # tiny_gpt / GPT-3 1.3B, CI-sized
    python bench/cona_ttp.py --out runs/cona_ttp  # all three families
    python bench/cona_ttp.py --families bert_large --gpu H100 --num-gpus 32

Prints one JSON object: ``{"clock": "emulated", "date", "commit", "machine",
"command", "models": {NAME: {"unigram_ppl", "target_ppl", "noise_scale_growth_direct",
"target_tokens_per_run", "time_scale", "oracle", "static_fixed", "methods": {METHOD: {"ttp_s",
"ttp_s_by_seed", "switches", "layout_switches", "chain", "evals", ...}}}}, "wall_s",
"load_average_1min"}`` (``ttp_s``: mean over seeds, ``None`` if a seed missed;
``load_average_1min``: the CPU seconds other processes used over the run, which say
whether the wall time is the bench's alone, and the load average sampled through it,
:mod:`bench.machine_load`); with ``--out`` also a plot per family
(``bench/cona_plot.py``).
"""

from __future__ import annotations

import os

for _v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # rule: one thread, before torch loads
    os.environ[_v] = "1"

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.cona_family_report import finish_family, setup_summary  # noqa: E402
from bench.cona_reference import (  # noqa: E402
    RECIPE_BUDGET_SCALE,
    probe_spacing,
    reference,
    seed_context,
    time_scale_for,
)
from bench.cona_ttp_settings import (  # noqa: E402, F401 - every setting still importable here
    BATCHES,
    COMMON,
    FULL,
    GNS_ABLATIONS,
    MODELS,
    MOVES,
    NARROW,
    PRECISION,
    PROBE_DENSITY,
    PROBE_MICROBATCHES,
    QUICK,
    SEEDS,
    STUDY_PRECISION,
    VAL_SEQUENCES,
    family_config,
)
from bench.machine_load import LoadSampler  # noqa: E402
from bench.seeded_units import run_families, run_units, write_report  # noqa: E402
from jobruntime.hardware import gpu_profile_arg  # noqa: E402


def seed_methods(ctx, settings: dict, boundaries: list[int],
                 recipe_batch: int) -> tuple[dict, dict]:
    """Every method on one seed's context (module docstring): ``(methods, phase_wall_s)``,
    the latter each phase's wall seconds (``search``, ``recipe``, ``lr_sweep``, ``cona``
    and, where ``settings["gns_ablations"]`` asks for them, ``cona_ablations``)."""
    from cona.baselines import (
        fastest_per_batch,
        recipe_strategy,
        run_cona,
        run_lr_sweep,
        run_search,
        run_static,
    )

    log = logging.getLogger("cona")
    wall = {}  # each phase's wall seconds (the bench's cost, reported per seed)
    t0 = time.perf_counter()
    search = run_search(ctx, boundaries, moves=settings["moves"],
                        prune=settings.get("prune"), beam=settings.get("beam"))
    methods = {k: search[k] for k in ("static_throughput", "oracle_chain", "oracle_greedy")}
    methods["oracle_chain"]["search"] = search["search"]  # the oracle's findings and cost
    fastest = fastest_per_batch(ctx.candidates, ctx.cluster.iter_s)
    statics = {b: search["static_chains"][b] for b in fastest if b in search["static_chains"]}
    best = min((m["ttp_s"] for m in statics.values() if m["ttp_s"] is not None), default=None)
    so1 = min((m for m in statics.values() if m["ttp_s"] is not None),
              key=lambda m: m["ttp_s"], default=None)
    oc = methods["oracle_chain"]
    if so1 is not None and oc["ttp_s"] is not None:
        assert oc["ttp_s"] <= so1["ttp_s"] * (1 + 1e-12), "oracle_chain slower than static_oracle"
    wall["search"] = (t := time.perf_counter()) - t0
    # static_recipe: its batch at the planner's layout and its best LR, run out (no cap);
    # the search's own run at LR 1x is reused where it reached the target
    recipe_at = recipe_strategy(ctx.candidates, ctx.cluster.iter_s, recipe_batch)
    own = statics.get(recipe_batch)
    recipe, recipe_runs = run_lr_sweep(
        ctx, recipe_at, settings["lr_factors"],
        budget_samples=RECIPE_BUDGET_SCALE * ctx.budget_samples,
        known={1.0: own} if own is not None and own["ttp_s"] is not None else None)
    methods["static_recipe"] = recipe
    wall["recipe"] = (t1 := time.perf_counter()) - t
    swept = [dict(m, lr_factor=1.0) for m in statics.values()] + recipe_runs
    for strategy in fastest.values():  # static_oracle's LR choice, cut past the best so far
        if strategy == recipe_at:
            continue  # swept above, with the same trajectories
        for f in settings["lr_factors"]:
            if f != 1.0:
                swept.append(run_static(ctx, strategy, f, bound_s=best))
                t = swept[-1]["ttp_s"]
                best = t if best is None or (t is not None and t < best) else best
    reached = [m for m in swept if m["ttp_s"] is not None]
    methods["static_oracle"] = min(reached, key=lambda m: m["ttp_s"]) if reached else None
    if methods["static_oracle"] is not None:  # the whole sweep: bench.cona_aggregate.static_fixed
        methods["static_oracle"]["runs"] = [
            {"strategy": m["chain"][0]["strategy"], "lr_factor": m["lr_factor"],
             "ttp_s": m["ttp_s"], "ttp_lower_bound_s": m.get("ttp_lower_bound_s")}
            for m in swept]
    wall["lr_sweep"] = (t := time.perf_counter()) - t1
    methods["cona"], _ = run_cona(ctx)
    wall["cona"] = (t1 := time.perf_counter()) - t
    ablations = [d for d in settings.get("gns_ablations", ())
                 if d != ctx.cfg.cona.gns_definition]  # the default's row is "cona"
    for d in ablations:
        methods[f"cona_gns_{d}"], _ = run_cona(ctx, gns_definition=d)
    if ablations:
        wall["cona_ablations"] = time.perf_counter() - t1
    log.info("seed %d wall s: %s", ctx.cfg.train.seed,
             ", ".join(f"{k} {v:.0f}" for k, v in wall.items()))
    return methods, wall


def family_setup(target: str, spec: dict, settings: dict, cache_dir: str | None):
    """Rules 1-5 for one family, on its first seed: ``(cfg, ctx, ref, ts, unigram)`` with
    ``cfg.train.target_ppl`` and ``cfg.cona.step_dilation`` set, ``ctx`` the first
    seed's warm context (its data reused), ``ref`` the reference's record and ``ts`` the
    time scale (:func:`bench.cona_reference.time_scale_for`).

    Raises:
        SystemExit: the reference does not reach the target within the budget.
    """
    from bench.cona_time_scale import pick_time_scale
    from cona.mapping import recipe_batch
    from cona.targets import corpus_unigram_perplexity, target_ppl

    log = logging.getLogger("cona")
    quick = settings.get("quick_segment")
    cfg = family_config(target, spec, settings, cache_dir)
    probe = settings.get("probe_microbatches", 64)
    # rule 2: the preset's full warmup
    ctx, _ = seed_context(cfg, cfg.train.warmup_iters, probe_microbatches=probe)
    unigram = corpus_unigram_perplexity(ctx.data.corpus, cfg.model.vocab_size)
    warm_ppl = ctx.warm["extra"]["val_ppl"]
    cfg.train.target_ppl = ctx.cfg.train.target_ppl = None if quick else target_ppl(unigram,
                                                                                    warm_ppl)
    density = settings.get("probe_density")
    ref = reference(ctx, quick, probe,
                    probe_every_samples=probe_spacing(ctx, density))
    if not ref["reached"]:
        raise SystemExit(f"{target}: the reference did not reach the target perplexity "
                         f"{cfg.train.target_ppl:.1f} within train.iters={cfg.train.iters} "
                         f"(reached {ref['val_ppl']:.1f}); raise iters in MODELS")
    if quick:
        cfg.train.target_ppl = ref["val_ppl"]
    ts = pick_time_scale(target, cfg, settings, time_scale_for(ctx, ref))
    cfg.cona.step_dilation = ts["step_dilation"]
    cfg.cona.adam_beta2_batch = recipe_batch(target)  # rule 5a, for the methods
    log.info("unigram ppl %.1f, target %.1f, noise scale %.1f -> %.1f proxy seq., step "
             "dilation %.1f (%s)", unigram, cfg.train.target_ppl,
             ref["noise_scale_warm_proxy"], ref["noise_scale_target_proxy"],
             ts["step_dilation"], "calibrated" if ts.get("calibration") else "measured")
    return cfg, ctx, ref, ts, unigram


def setup_task(target: str, spec: dict, settings: dict, cache_dir: str | None) -> dict:
    """A family's rules 1-5 (:func:`family_setup`, in a worker): what its seeds need
    (``cfg`` with target and dilation, the oracle's window ends) and what the report
    keeps of it."""
    worker_setup(spec["proxy"])
    from cona.baselines import recipe_strategy
    from cona.mapping import recipe_batch

    t0, c0 = time.perf_counter(), time.process_time()
    cfg, ctx, ref, ts, unigram = family_setup(target, spec, settings, cache_dir)
    D = settings["windows"]
    w0 = ctx.warm["consumed_samples"]
    pick = recipe_strategy(ctx.candidates, ctx.cluster.iter_s, recipe_batch(target))
    layout_s = [ctx.cluster.switch_s(pick, c) for c in ctx.candidates
                if (c.dp, c.tp, c.pp) != (pick.dp, pick.tp, pick.pp)]
    return {"cfg": cfg, "ref": ref, "ts": ts, "unigram": unigram,
            "boundaries": [w0 + round(ref["segment_samples"] * k / D) for k in range(1, D)],
            "mapping": ctx.mapping.to_dict(), "candidates": len(ctx.candidates),
            "layout_s": layout_s, "wall_s": time.perf_counter() - t0,
            "cpu_s": time.process_time() - c0}


def seed_task(target: str, spec: dict, setup: dict, seed_index: int, settings: dict) -> dict:
    """Every method on seed ``seed_index`` of a set-up family (in a worker): its warm state
    (trained and cached if absent) and :func:`seed_methods`."""
    worker_setup(spec["proxy"])
    from cona.mapping import recipe_batch

    t0, c0 = time.perf_counter(), time.process_time()
    cfg = copy.deepcopy(setup["cfg"])
    cfg.train.seed += seed_index
    ctx, cached = seed_context(cfg, cfg.train.warmup_iters,
                              probe_microbatches=settings.get("probe_microbatches", 64))
    methods, phases = seed_methods(ctx, settings, setup["boundaries"], recipe_batch(target))
    return {"methods": methods, "warm": {"cached": cached, **ctx.warm["extra"]},
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
            "phase_wall_s": phases}




def setup_only_task(target: str, spec: dict, settings: dict, cache_dir: str | None) -> dict:
    """``--setup-only``: a family's :func:`setup_summary` (in a worker), no seed run."""
    return setup_summary(target, spec, setup_task(target, spec, settings, cache_dir), settings)


def setup_key(setup: dict, seed_index: int, settings: dict) -> str:
    """A hex digest over what a seed's result depends on: the family's set-up config
    (target, step dilation, proxy), the oracle's window ends, the bench settings and the
    seed.  A seed file is reused only under an equal key."""
    import dataclasses
    import hashlib

    # cfg holds the dilation; a seed's result does not depend on how many seeds run
    kept = {k: v for k, v in settings.items() if k not in ("time_scale", "seeds")}
    blob = json.dumps({"cfg": dataclasses.asdict(setup["cfg"]), "boundaries": setup["boundaries"],
                       "settings": kept, "seed": seed_index}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def worker_setup(proxy: str) -> None:
    """A family's process: one torch thread (rule: results independent of core count),
    log lines tagged with ``proxy``."""
    import torch

    torch.set_num_threads(1)
    from jobruntime.logging_utils import setup_logging

    setup_logging(logging.INFO)
    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"[%(asctime)s {proxy}] %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("jobruntime").setLevel(logging.WARNING)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="GPT-3 1.3B / tiny_gpt, short, CI-sized")
    p.add_argument("--families", "--models", nargs="*", default=None, choices=sorted(MODELS),
                   dest="families", help="subset of the full benchmark's families")
    p.add_argument("--gpu", default="A100-80GB", type=gpu_profile_arg,
                   help="emulated GPU profile (cona.gpu; jobruntime/gpu_profiles.yaml)")
    p.add_argument("--num-gpus", type=int, default=64, help="emulated devices (cona.num_gpus)")
    p.add_argument("--out", type=Path, default=None, help="folder for JSON and plots")
    p.add_argument("--cache-dir", default=None,
                   help="tokenizer/dataset/warm-checkpoint cache (data.cache_dir)")
    p.add_argument("--jobs", type=int, default=2,
                   help="set-ups and seeds run in parallel processes (default 2: one per core)")
    p.add_argument("--reuse", action="store_true",
                   help="read back --out's seed results made under the same set-up "
                   "instead of running them (a killed run goes on where it stopped)")
    p.add_argument("--no-train", action="store_true",
                   help="with --reuse: run no seed; report the seeds found (seeds_done)")
    p.add_argument("--time-scale", choices=("calibrated", "measured"), default="calibrated",
                   help="the step dilation charged: the committed calibration of the family's "
                   "set-up (default; measured where it has none) or this run's measurement "
                   "(bench/cona_time_scale.py)")
    p.add_argument("--seeds", type=int, default=None,
                   help=f"seeds per family (default {SEEDS}; quick 1): fewer is a partial run, "
                   "labelled by its seed count")
    p.add_argument("--setup-only", action="store_true",
                   help="run each family's set-up (warm state, reference, target, time "
                   "scale) and report it, no method: what a family measures and costs "
                   "before its seeds' hours")
    p.add_argument("--no-ablations", action="store_true",
                   help="skip CONA's runs with the other noise-scale definitions")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                   help=f"the proxies' train.precision (default {PRECISION}, rule 0); "
                   "each is a set-up of its own (its own warm states and time-scale entry)")
    args = p.parse_args(argv)
    if args.setup_only and (args.reuse or args.no_train or args.seeds is not None):
        p.error("--setup-only runs no seed: --reuse, --no-train and --seeds do not apply")
    if args.seeds is not None and args.seeds < 1:
        p.error("--seeds must be >= 1")
    if args.families == []:
        p.error("--families needs at least one family")
    if args.no_train and not (args.reuse and args.out):
        p.error("--no-train needs --reuse and --out (it reports the seeds found there)")
    from jobruntime.metrics import provenance
    from jobruntime.outputs import refuse_output_folder

    refuse_output_folder(p, args.out)  # before the run, not after it
    if args.time_scale == "calibrated" and not args.quick:
        from bench.cona_time_scale import load_calibration

        try:  # a bad file is named now, not after hours of set-up
            load_calibration()
        except ValueError as e:
            p.error(str(e))
    if args.jobs < 1 or args.num_gpus < 1:
        p.error("--jobs and --num-gpus must be >= 1")
    settings = dict(QUICK if args.quick else FULL, gpu=args.gpu, num_gpus=args.num_gpus,
                    time_scale=args.time_scale)
    if args.no_ablations:
        settings["gns_ablations"] = ()
    if args.precision:
        settings["precision"] = args.precision
    if args.seeds is not None:
        settings["seeds"] = args.seeds
    models = settings.get("models") or {
        k: v for k, v in MODELS.items() if args.families is None or k in args.families}
    report = {"clock": "emulated", "gpu": args.gpu, "num_gpus": args.num_gpus,
              "quick": args.quick, "precision": settings.get("precision"),
              **provenance(argv), "models": {}}
    t0 = time.perf_counter()
    out = str(args.out) if args.out is not None else None
    if args.setup_only:
        report["setup_only"] = True
        report["models"] = run_families(setup_only_task, models, args.jobs, settings,
                                        args.cache_dir)
        report["wall_s"] = time.perf_counter() - t0
        write_report(report, args.out, "cona_setup.json")
        return 0
    with LoadSampler() as load:  # whether anything ran beside it (bench/machine_load.py)
        report["models"] = run_units(
            models, args.jobs, settings["seeds"], out, reuse=args.reuse,
            train=not args.no_train,
            setup=partial(setup_task, settings=settings, cache_dir=args.cache_dir),
            seed=partial(seed_task, settings=settings),
            key=partial(setup_key, settings=settings),
            finish=partial(finish_family, settings=settings, out=out))
    # the bench's own wall time only where it ran every seed itself
    fresh = all(not w.get("reused") for m in report["models"].values()
                for w in m["seed_runs"])
    report["wall_s"] = time.perf_counter() - t0 if fresh else None
    # other processes' CPU over the run says whether it ran alone (render_cona._load_note)
    report["load_average_1min"] = dict(load.summary(), jobs=args.jobs)
    write_report(report, args.out, "cona_ttp.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
