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
    python bench/cona_ttp.py --families bert_large --gpu H100-80GB --num-gpus 32

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
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.cona_aggregate import aggregate, oracle_finding, ratios, static_fixed  # noqa: E402
from bench.cona_reference import (  # noqa: E402
    RECIPE_BUDGET_SCALE,
    reference,
    seed_context,
    time_scale_for,
)
from bench.machine_load import LoadSampler  # noqa: E402
from bench.seeded_units import run_families, run_units, write_report  # noqa: E402

BATCHES = [64, 128, 256, 512, 1024]  # target sequences
SEEDS = 3
VAL_SEQUENCES = 256
# micro-batches per direct noise-scale probe of the reference (rule 4; quick runs: 64 too,
# the default where the settings name none).  A probe's own spread is small against the
# scatter between states along the reference, which no probe size removes
# (docs/results/cona_probe_precision.json): sd of log phi 0.02-0.12 at the warm states for
# 64, 128 and 256 alike; along the segment 64 against 256 at the same states differ by sd
# 0.08-0.18, against a scatter of 0.27-0.70.  256 cost 4x as much (most of the set-up's
# 21 / 32 minutes), and the growth's intervals and the time scale moved little with 64
PROBE_MICROBATCHES = 64
# the reference probes this many times per evaluation interval (rule 4): the segment's
# growth and the time scale rest on the probes' trend, and with one probe per evaluation
# Llama's trend rested on 8 probes, which named its growth only within 0.1-10x (95 %
# bootstrap interval, cona.targets.trend_interval, at 792d30e); 4x the probes narrow the
# interval in log about sqrt(4) = 2x
PROBE_DENSITY = 4
# the bench proxy (rule 0): the preset's tiny twin narrowed to 2 layers of width 128
# (same architecture otherwise); per sequence ~3x cheaper to train and ~5x cheaper to
# evaluate on one thread than the 4 x 256 preset, at a warm perplexity near the preset's
NARROW = ["model.hidden_size=128", "model.num_layers=2"]
# target -> proxy preset, its narrowing, sequence, budget (train.iters at the preset's
# batch, warmup included: the reference must reach the target within it) and evaluation
# interval (steps at the preset's batch)
MODELS = {  # the longest first, so that --jobs 2 ends soonest
    # BERT's proxy masks 40 % of its tokens, not BERT's 15 % (Wettig et al. 2023, "Should
    # You Mask 15% in Masked Language Modeling?": 40 % trains BERT-Large as well or
    # better), at sequence 64 like the others: at 15 % and sequence 128 the reference
    # was at perplexity 810 after 900 steps (7 min, one thread) against a target of 531,
    # at 40 % and 64 at 567 after 1,900 steps (7.5 min): 2.7x more loss tokens per
    # proxy FLOP, the one way its segment fits the bench
    "bert_large": {"proxy": "tiny_bert", "seq": 64, "iters": 3000, "eval_interval": 20,
                   "overrides": [*NARROW, "model.num_attention_heads=2",
                                 "model.ffn_hidden_size=512", "model.mask_prob=0.4"]},
    "llama3.2_1b": {"proxy": "tiny_llama", "seq": 64, "iters": 3000, "eval_interval": 20,
                    "overrides": [*NARROW, "model.num_attention_heads=4",
                                  "model.num_query_groups=1", "model.ffn_hidden_size=352"]},
    "gpt3_1.3b": {"proxy": "tiny_gpt", "seq": 64, "iters": 3000, "eval_interval": 20,
                  "overrides": [*NARROW, "model.num_attention_heads=2"]},
}
# the oracle's moves at a window boundary: up to two grid steps, either way (cona/oracle.py)
MOVES = (-2, -1, 1, 2)
# CONA again with each other noise-scale definition (cona.gns_definition; rows
# cona_gns_<definition>): which the controller ranks by is an ablation, side by side
GNS_ABLATIONS = ("simple", "newton", "pollux")
# the proxies' train.precision (rule 0); a report records it, so a re-run can match it
PRECISION = "bf16"
# the side studies' (cona_efficiency, cona_adam_memory, cona_calibrate): their committed
# results were measured in fp32, before rule 0's bf16, and re-run as they were
STUDY_PRECISION = "fp32"
FULL = {"windows": 6, "batches": BATCHES, "seeds": SEEDS, "lr_factors": (0.5, 1.0, 2.0),
        "val_sequences": VAL_SEQUENCES, "moves": MOVES, "prune": "dominated", "beam": 2,
        "probe_microbatches": PROBE_MICROBATCHES, "probe_density": PROBE_DENSITY,
        "gns_ablations": GNS_ABLATIONS, "precision": PRECISION}
# CI-sized: one family, one seed, three batches (with the recipe's 512), 32 validation
# sequences, a short warmup and a shallow target (the reference's perplexity after
# ``quick_segment`` steps: rule 3 needs thousands)
QUICK = {"windows": 2, "batches": [64, 128, 512], "seeds": 1, "lr_factors": (1.0,), "moves": MOVES,
         "val_sequences": 32, "warm_steps": 20, "quick_segment": 60, "precision": PRECISION,
         "models": {"gpt3_1.3b": {"proxy": "tiny_gpt", "seq": 64, "iters": 200,
                                  "eval_interval": 8}}}
COMMON = [
    "cona.enabled=true",
    "cona.clock=emulated",
    "cona.decision_interval=10",
    "train.stop_at_target=true",
    "cona.ttp_resolution=0.01",  # the TTP crossing bracketed within 1 % of every run
    "cona.eval_clock=true",  # every method evaluated at the same clock times (rule 5)
    "logging.wandb=disabled",
]


def family_config(target: str, spec: dict, settings: dict, cache_dir: str | None,
                  seed_index: int = 0):
    """The proxy's config for ``target`` (rules 1, 5): batch ratio, grid, cluster, budget,
    evaluation every ``eval_interval`` steps on ``settings["val_sequences"]`` sequences
    (:data:`VAL_SEQUENCES` in full runs), the preset's seed + ``seed_index``."""
    from cona.mapping import BATCH_RATIO
    from jobruntime.config import load_config

    overrides = [*COMMON, *spec.get("overrides", []), f"cona.target_model={target}",
                 f"train.iters={spec['iters']}",
                 f"model.seq_length={spec['seq']}", f"cona.batch_ratio={BATCH_RATIO}",
                 f"cona.gpu={settings['gpu']}", f"cona.num_gpus={settings['num_gpus']}",
                 f"train.eval_interval={spec['eval_interval']}"]
    if settings.get("precision"):
        overrides.append(f"train.precision={settings['precision']}")
    if cache_dir:
        overrides.append(f"data.cache_dir={cache_dir}")
    cfg = load_config(spec["proxy"], overrides)
    cfg.train.eval_iters = -(-settings["val_sequences"] // cfg.parallel.global_batch_size)
    cfg.train.seed += seed_index
    cfg.cona.global_batch_sizes = list(settings["batches"])
    if "warm_steps" in settings:
        cfg.train.warmup_iters = settings["warm_steps"]
    return cfg


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
                    probe_every_samples=max(1, ctx.eval_samples // density) if density else None)
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


def setup_summary(target: str, spec: dict, setup: dict, settings: dict) -> dict:
    """What a family's set-up (rules 1-5, :func:`setup_task`) measured, JSON-ready: proxy,
    unigram and target perplexity, the direct noise-scale growth, the time scale and the
    span of the target's training one run stands for, the reference and the set-up's cost
    (wall and CPU seconds)."""
    from cona.mapping import PUBLISHED_BATCH, recipe_batch
    from cona.targets import TARGET_FRACTION

    cfg, ref, ts = setup["cfg"], setup["ref"], setup["ts"]
    return {
        "proxy": spec["proxy"],
        "proxy_overrides": spec.get("overrides", []),
        "unigram_ppl": setup["unigram"],
        "target_ppl": cfg.train.target_ppl,
        "cona_gns_definition": cfg.cona.gns_definition,
        "target_rule": "quick: the reference's perplexity after a short segment"
        if settings.get("quick_segment") else
        f"{TARGET_FRACTION} x min(unigram_ppl, warm_ppl) (cona/targets.py)",
        "noise_scale_growth_direct": ref["noise_scale_target_proxy"]
        / ref["noise_scale_warm_proxy"],
        # the trend's 95 % bootstrap interval at the target over the warm state's probe
        "noise_scale_growth_direct_interval": ref["noise_scale_growth"]["direct_interval"],
        # the growth along the segment's own probes, Kaplan's over its loss range beside it
        "noise_scale_growth_along": {k: ref["noise_scale_growth"][k] for k in (
            "along", "along_interval", "kaplan", "slope", "kaplan_slope", "bootstrap_block")},
        # the same run's trend through one probe per evaluation interval (the cadence before
        # PROBE_DENSITY), side by side: what the denser probes buy
        "noise_scale_growth_one_per_eval": _growth_one_per_eval(ref),
        "target_tokens_per_run": ts["target_tokens_per_run"],
        "time_scale": ts,
        "layout_switch_s_median": statistics.median(setup["layout_s"])
        if setup["layout_s"] else None,
        "recipe": {"batch": recipe_batch(target), "source": PUBLISHED_BATCH[target][1],
                   "adam_beta2": cfg.train.adam_beta2,
                   "adam_beta2_batch": cfg.cona.adam_beta2_batch},
        "reference": {**ref, "warm_steps": cfg.train.warmup_iters,
                      "probe_microbatches": settings.get("probe_microbatches", 64)},
        "mapping": {**setup["mapping"], "step_dilation": cfg.cona.step_dilation},
        "candidates": setup["candidates"],
        "wall_s": {"setup": setup["wall_s"]},
        "cpu_s": setup["cpu_s"],
    }


def _growth_one_per_eval(ref: dict) -> dict | None:
    """The reference's growth (and its 95 % interval) through one probe per evaluation
    interval (:func:`bench.cona_reference.reference`'s side-by-side subset), or ``None``."""
    sub = ref.get("noise_scale_target_one_per_eval_proxy")
    if not sub or not sub["interval"]:
        return None
    phi0 = ref["noise_scale_warm_proxy"]
    return {"growth": sub["value"] / phi0, "interval": [v / phi0 for v in sub["interval"]],
            "points": sub["points"]}


def finish_family(target: str, spec: dict, setup: dict, seeds: list[dict], settings: dict,
                  out: str | None) -> dict:
    """A family's report entry from its setup (:func:`setup_summary`) and its seeds'
    results (module docstring); with ``out`` also ``out/target/result.json`` and its
    plot."""
    per_seed = [s["methods"] for s in seeds]
    methods = aggregate(per_seed)
    if methods.get("static_oracle"):  # the sweeps stay in the seed files (static_fixed)
        methods["static_oracle"].pop("runs", None)
    recipe_ttp = methods["static_recipe"]["ttp_s"]
    result = setup_summary(target, spec, setup, settings)
    layout_s = result["layout_switch_s_median"]
    result["reference"]["warm"] = [s["warm"] for s in seeds]
    result.update({
        # what a layout switch costs against a run (the bar: a few percent at most)
        "layout_switch_share_of_recipe_ttp": layout_s / recipe_ttp
        if layout_s is not None and recipe_ttp else None,
        "oracle": oracle_finding(per_seed),
        "static_fixed": (fixed := static_fixed(per_seed)),
        # a lower bound where static_fixed's ttp_s is null (a cut run)
        "ratios": {**ratios(methods), "static_fixed_over_cona":
                   fixed["ttp_lower_bound_s"] / methods["cona"]["ttp_s"]
                   if fixed and methods["cona"]["ttp_s"] else None},
        "methods": methods,
        "wall_s": {"setup": setup["wall_s"], "seeds": [s["wall_s"] for s in seeds]},
        "cpu_s": setup["cpu_s"] + sum(s["cpu_s"] for s in seeds),
        "seeds_done": len(seeds),
        "seed_runs": [{k: s.get(k) for k in ("seed_index", "setup_key", "reused", "wall_s",
                                              "cpu_s", "phase_wall_s")} for s in seeds],
    })
    if out is not None:
        d = Path(out) / target
        d.mkdir(parents=True, exist_ok=True)
        from bench.cona_plot import plot_family
        from jobruntime.metrics import write_json_atomic

        write_json_atomic(d / "result.json", result)
        plot_family(target, result, d / "ppl_vs_time.png")
    return result


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
    p.add_argument("--gpu", default="A100-80GB", help="emulated GPU profile (cona.gpu)")
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
