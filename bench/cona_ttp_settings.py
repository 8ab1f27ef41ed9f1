"""The CONA bench's settings (:mod:`bench.cona_ttp`, whose docstring states the rules
they fix): the batch grid, seeds and validation sequences, the direct probes' size and
density, the families' proxies (:data:`MODELS`), the oracle's moves, the noise-scale
ablations, the proxies' precision, the full and quick settings, the overrides every run
shares, and a family's config from them (:func:`family_config`).

Read by :mod:`bench.cona_ttp`, which re-exports every name here (the side studies import
them from there).
"""

from __future__ import annotations

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
