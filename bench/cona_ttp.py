"""CONA benchmark: time to target perplexity on an emulated 8x A100 node.

For each timing target (GPT-3 1.3B, BERT-Large, Llama-3.2-1B) its tiny twin
(tiny_gpt, tiny_bert, tiny_llama) really trains on the bundled corpus in one
process, while the clock comes from the cost model of the target on 8 A100s
(``cona.clock=emulated``, see ``cona/emulated.py``).  Four methods, all from
the same initial weights, data order, LR rule (sqrt of the global batch) and
sample-based schedule (``cona/baselines.py``):

- ``static_throughput``: the candidate with the highest modelled tokens/s;
- ``static_oracle``: the best TTP over all static candidates;
- ``cona``: the online controller (starts at the fastest layout of the
  preset's global batch, decides every K steps);
- ``oracle_chain``: per decision window, the best of all global batches
  tried from the same in-memory state.

Candidates: every valid (DP, TP, PP, micro-batch) layout on 8 GPUs that fits
80 GB, with global batches of the preset's times 1, 2, 4, 8 (in sequences of
the proxy's length, 64 tokens).  Each run stops at the target perplexity.

Usage::

    python bench/cona_ttp.py --quick          # tiny_gpt / GPT-3 1.3B only
    python bench/cona_ttp.py --out runs/cona_ttp   # all three models (long)
    python bench/cona_ttp.py --models gpt3_1.3b    # one of them

Prints one JSON object: ``{"clock": "emulated", "models": {NAME: {"target_ppl",
"methods": {METHOD: {"ttp_s", "final_val_ppl", "switches", "chain"}}}}}``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# target preset -> proxy preset and run settings.  The target perplexity is what the
# fastest layout of the preset's global batch (the reference) reaches after
# ``target_samples`` training samples (a measured calibration run, independent of
# CONA); ``iters * B_ref`` samples is every run's budget and LR-decay horizon.
MODELS = {
    "gpt3_1.3b": {"proxy": "tiny_gpt", "target_samples": 2400, "iters": 1200},
    "bert_large": {"proxy": "tiny_bert", "target_samples": 4800, "iters": 1200},
    "llama3.2_1b": {"proxy": "tiny_llama", "target_samples": 2400, "iters": 1200},
}
# --quick: GPT-3 1.3B / tiny_gpt only, to an early, fixed target (measured: the
# reference reaches it after ~830 samples), so it fits 10 minutes on 2 shared cores.
QUICK = {"gpt3_1.3b": {"proxy": "tiny_gpt", "target_ppl": 850.0, "iters": 800}}
COMMON = [
    "model.seq_length=64",
    "cona.enabled=true",
    "cona.clock=emulated",
    "cona.gpu=A100-80GB",
    "cona.num_gpus=8",
    "cona.decision_interval=10",
    "train.eval_interval=8",
    "train.eval_iters=4",
    "train.stop_at_target=true",
    "train.warmup_iters=20",  # what the targets were measured with (the preset's, before 100)
    "logging.wandb=disabled",
]


def reference_ppl(cfg, samples: int) -> float:
    """Validation perplexity of the reference strategy after ``samples`` training samples."""
    from cona.run import Loop, setup

    s = setup(cfg)
    loop = Loop(s.job, cfg, budget_samples=samples, eval_samples=samples)
    loop.run()  # evaluates at the last step
    return round(loop.progress.last_val_ppl, 1)


def bench_model(target: str, spec: dict, cache_dir: str | None, out: Path | None) -> dict:
    from cona.baselines import run_cona, run_oracle_chain, run_static
    from jobruntime.config import load_config

    overrides = [*COMMON, f"cona.target_model={target}", f"train.iters={spec['iters']}"]
    if cache_dir:
        overrides.append(f"data.cache_dir={cache_dir}")
    cfg = load_config(spec["proxy"], overrides)
    t0 = time.perf_counter()
    if spec.get("target_ppl") is None:
        cfg.train.target_ppl = reference_ppl(cfg, spec["target_samples"])
    else:
        cfg.train.target_ppl = spec["target_ppl"]
    static = run_static(cfg)
    t1 = time.perf_counter()
    cona, loop = run_cona(cfg)
    t2 = time.perf_counter()
    chain = run_oracle_chain(cfg)
    t3 = time.perf_counter()
    methods = {
        "static_throughput": static["static_throughput"],
        "static_oracle": static["static_oracle"],
        "cona": cona,
        "oracle_chain": chain,
    }
    result = {
        "proxy": spec["proxy"],
        "target_ppl": cfg.train.target_ppl,
        "methods": methods,
        "wall_s": {"static": t1 - t0, "cona": t2 - t1, "oracle_chain": t3 - t2},
    }
    if out is not None:
        d = out / target
        d.mkdir(parents=True, exist_ok=True)
        (d / "static_per_batch.json").write_text(json.dumps(static["per_batch"], indent=2))
        with open(d / "cona_metrics.jsonl", "w") as f:
            for rec in loop.progress.records:
                f.write(json.dumps(rec, default=float) + "\n")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="GPT-3 1.3B / tiny_gpt only")
    p.add_argument(
        "--models",
        nargs="*",
        default=None,
        choices=sorted(MODELS),
        help="subset of the full benchmark's models",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON and run details")
    p.add_argument("--cache-dir", default=None, help="tokenizer/dataset cache (data.cache_dir)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: on a shared machine, OpenMP threads that "
        "oversubscribe the cores slow every step down many times)",
    )
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from jobruntime.logging_utils import setup_logging

    setup_logging(logging.INFO)
    logging.getLogger("jobruntime").setLevel(logging.WARNING)
    models = (
        QUICK
        if args.quick
        else {k: v for k, v in MODELS.items() if args.models is None or k in args.models}
    )
    report = {"clock": "emulated", "gpu": "A100-80GB", "num_gpus": 8, "models": {}}
    t0 = time.perf_counter()
    for name, spec in models.items():
        report["models"][name] = bench_model(name, spec, args.cache_dir, args.out)
    report["wall_s"] = time.perf_counter() - t0
    text = json.dumps(report, indent=2, default=float)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cona_ttp.json").write_text(text + "\n")
    print(text)
    from jobruntime.parallel import shutdown

    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
