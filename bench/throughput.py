"""Training throughput (tokens/s) and MFU of a preset for a few steps.

Runs ``--steps`` optimizer steps on synthetic-free real data (the bundled
corpus, or ``data.path``) after ``--warmup`` untimed steps, and prints one JSON
object: ``{"model", "device", "world_size", "tp", "pp", "dp", "tokens_per_s",
"step_s", "flops_per_token", "achieved_tflops", "mfu", "peak_tflops"}``.
MFU needs the device's peak: pass ``--gpu NAME`` (a profile in
``jobruntime/gpu_profiles.yaml``, e.g. H200); on CPU it is null.

    python bench/throughput.py --config tiny_gpt --steps 10
    torchrun --nproc-per-node 8 bench/throughput.py --config gpt3_1.3b --gpu H100 \
        parallel.tp=2 parallel.micro_batch_size=4 parallel.global_batch_size=64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="tiny_gpt")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--gpu", default=None, help="GPU profile for MFU (peak TFLOP/s)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    from jobruntime.logging_utils import setup_logging

    setup_logging()
    import torch

    from jobruntime.config import load_config
    from jobruntime.flops import flops_per_token
    from jobruntime.hardware import get_gpu_profile
    from jobruntime.loop import build_data
    from jobruntime.parallel import initialize_layout, set_seed, shutdown
    from jobruntime.trainer import Trainer

    n = args.warmup + args.steps
    cfg = load_config(args.config, [f"train.iters={n}", "train.eval_iters=1", *args.overrides])
    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer = Trainer(cfg)
    data = build_data(cfg, topo)
    for _ in range(args.warmup):
        trainer.train_step(data.train.next())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        result = trainer.train_step(data.train.next())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / args.steps
    tokens_per_s = result.tokens / step_s
    fpt = flops_per_token(cfg.model)
    achieved = fpt * tokens_per_s / topo.world_size / 1e12  # per device
    peak = get_gpu_profile(args.gpu).peak_tflops if args.gpu else None
    out = {
        "model": cfg.name, "device": "cuda" if torch.cuda.is_available() else "cpu",
        "world_size": topo.world_size, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp,
        "precision": str(trainer.dtype).replace("torch.", ""),
        "tokens_per_s": round(tokens_per_s, 1), "step_s": round(step_s, 4),
        "flops_per_token": fpt, "achieved_tflops_per_device": round(achieved, 4),
        "peak_tflops": peak, "mfu": round(achieved / peak, 4) if peak else None,
        "last_loss": result.loss,
    }
    if topo.rank == 0:
        print(json.dumps(out))
    shutdown()


if __name__ == "__main__":
    main()
