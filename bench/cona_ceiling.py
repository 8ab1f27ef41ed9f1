"""How much can chaining win at all?  The Pollux-model ceiling per cluster and noise scale.

For each timing target (GPT-3 1.3B, BERT-Large, Llama-3.2-1B at their own sequence
lengths) on ``N`` emulated GPUs, the fastest layout per global batch
(``cona/emulated.py``, the cost model ``bench/cona_ttp.py`` times with) and a noise scale
that grows ``G``-fold over the run from ``--phi0`` target sequences, this prints the ideal
chain's speed-up over the best static batch (:func:`cona.surrogate.chaining_ceiling`: no
switch costs, efficiency exactly Pollux's).  A *model estimate*, not a measurement: no
chain of these candidates can beat it while the model holds, so it says which TTP ratios
``bench/cona_ttp.py`` can show at all, and which noise-scale growth a 1.2x win needs.

Usage::

    python bench/cona_ceiling.py                      # A100-80GB, 64 to 512 GPUs
    python bench/cona_ceiling.py --gpu H100 --gpus 64 --phi0 80

Prints one JSON object: ``{"model_estimate": true, "gpu", "phi0", "batches", "rows":
[{"target", "gpus", "growth", "best_static_batch", "ceiling"}], "growth_for_1.2x": {target:
{gpus: G or null}}}``; ``growth_for_1.2x`` is the first power of two at which the ceiling
reaches 1.2 (the ceiling is not monotone in G: the best static batch moves with it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TARGETS = {"gpt3_1.3b": "tiny_gpt", "bert_large": "tiny_bert", "llama3.2_1b": "tiny_llama"}
BATCHES = [64, 128, 256, 512, 1024, 2048, 4096]  # target sequences
GROWTHS = [4, 8, 16, 64, 256, 1024]


def samples_per_s(target: str, gpu: str, gpus: int, batches: list[int]) -> dict[int, float]:
    """Sequences/s of the fastest candidate layout at each global batch (emulated cluster)."""
    from cona.baselines import fastest_rates
    from cona.candidates import build_candidates
    from cona.emulated import EmulatedCluster
    from cona.mapping import ProxyMapping
    from jobruntime.config import load_config

    model = load_config(target).model
    cfg = load_config(TARGETS[target], [
        "cona.enabled=true", "cona.clock=emulated", f"cona.target_model={target}",
        f"cona.gpu={gpu}", f"cona.num_gpus={gpus}",
        f"cona.global_batch_sizes=[{','.join(map(str, batches))}]"])
    cluster = EmulatedCluster(model, gpu, gpus)
    mapping = ProxyMapping(1.0, model.seq_length, model.seq_length)
    cands = build_candidates(cfg, model, gpus, mapping=mapping,
                             memory_limit_bytes=cluster.memory_limit_bytes)
    return fastest_rates(cands, cluster.iter_s)


def main(argv=None) -> int:
    from jobruntime.hardware import gpu_profile_arg
    from jobruntime.metrics import json_text

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", default="A100-80GB", type=gpu_profile_arg,
                   help="emulated GPU profile (jobruntime/gpu_profiles.yaml)")
    p.add_argument("--gpus", type=int, nargs="*", default=[64, 128, 256, 512])
    p.add_argument("--phi0", type=float, default=64.0,
                   help="noise scale at the start, target sequences (default 64: the "
                        "smallest batch; bench/cona_ttp.py measured 34-145 at CONA's first "
                        "decision on 2026-12-01)")
    args = p.parse_args(argv)
    from cona.surrogate import chaining_ceiling

    m0 = min(BATCHES)
    rows, needed = [], {}
    for target in TARGETS:
        needed[target] = {}
        for n in args.gpus:
            speed = samples_per_s(target, args.gpu, n, BATCHES)
            for g in GROWTHS:
                best, c = chaining_ceiling(speed, args.phi0, args.phi0 * g, m0)
                rows.append({"target": target, "gpus": n, "growth": g,
                             "best_static_batch": best, "ceiling": round(c, 3)})
            needed[target][n] = next(
                (g for g in (2 ** k for k in range(1, 21))
                 if chaining_ceiling(speed, args.phi0, args.phi0 * g, m0)[1] >= 1.2), None)
    print(json_text({"model_estimate": True, "gpu": args.gpu, "phi0": args.phi0,
                      "batches": BATCHES, "rows": rows, "growth_for_1.2x": needed}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
