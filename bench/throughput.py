"""Training throughput (tokens/s), MFU and peak memory of a preset, side by side
with its plain-PyTorch peer.

Runs ``--warmup`` untimed and ``--steps`` timed optimizer steps of this
project's trainer (megatron-core model, Float16Module, megatron DDP and
optimizer) and prints one JSON object.  ``--peer`` then trains the same model
shape as a Hugging Face ``transformers`` model in the same process (SDPA,
bf16 autocast, fused AdamW: ``bench/hf_peer.py``), at ours' micro-batch, global
batch and sequence (its record states them), and adds its tokens/s and
``ratio`` = ours / peer; ``--peer-compile`` adds the ``torch.compile`` peer.
``device`` and ``precision`` are read from each model's parameters.
The JSON object is printed after each stage (ours, the eager peer, the
compiled peer), each line a superset of the one before: the last line is the
result.  ``--sweep-mbs 1,2,4,8`` re-times ours at several micro-batch sizes (same global
batch) and fits the efficiency curve of ``jobruntime/gpu_profiles.yaml``
(``mfu = mfu_max * t / (t + half_sat_tokens)``, t = tokens per micro-batch).

Inputs are uniformly random tokens (``--data random``, the same for both
sides) or the preset's corpus (``--data real``).  MFU needs the device's peak:
``--gpu NAME`` (a profile in ``jobruntime/gpu_profiles.yaml``, e.g. H200;
default: found from the CUDA device's name); it is null on CPU.  FLOPs per token: :func:`jobruntime.flops.flops_per_token`
(Narayanan et al. 2021), identical for both sides, so the ratio of MFUs is the
ratio of tokens/s.

    python bench/throughput.py --config tiny_gpt --steps 10
    python bench/throughput.py --config gpt3_1.3b --gpu H200 --peer --peer-compile \\
        parallel.micro_batch_size=4 parallel.global_batch_size=16
    torchrun --nproc-per-node 8 bench/throughput.py --config gpt3_1.3b --gpu H100 \\
        parallel.tp=2 parallel.micro_batch_size=4 parallel.global_batch_size=64
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _sync(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()


def _time_ours(trainer, batches_fn, steps: int, warmup: int, cuda: bool) -> dict:
    """``warmup`` untimed and ``steps`` timed steps; ``cuda``: the model is on a GPU."""
    import torch

    for _ in range(warmup):
        trainer.train_step(batches_fn())
    _sync(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        result = trainer.train_step(batches_fn())
    _sync(cuda)
    step_s = (time.perf_counter() - t0) / steps
    return {"tokens_per_s": result.tokens / step_s, "step_s": step_s, "last_loss": result.loss,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def profile_step(trainer, batches_fn, cuda: bool, top: int = 12) -> dict:
    """One more step under ``torch.profiler``: the kernels that took the most time.

    Returns:
        ``{"step_s", "device_busy_s", "top": [{"name", "ms", "share", "calls"}]}``;
        ``share`` is of the summed self time of all kernels (device time on
        CUDA, CPU time otherwise); ``device_busy_s`` below ``step_s`` is idle GPU.
    """
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    batches = batches_fn()
    _sync(cuda)
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        trainer.train_step(batches)
        _sync(cuda)
    step_s = time.perf_counter() - t0
    events = prof.key_averages()
    if cuda:  # kernels only: an aten op's device time is also its kernels' (no double count)
        events = [e for e in events if str(e.device_type).endswith("CUDA")]

    def self_us(e) -> float:
        if cuda:
            return getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        return e.self_cpu_time_total

    total = sum(self_us(e) for e in events) or 1.0
    ranked = sorted(events, key=self_us, reverse=True)[:top]
    return {"step_s": round(step_s, 4), "device_busy_s": round(total / 1e6, 4),
            "top": [{"name": e.key[:90], "ms": round(self_us(e) / 1e3, 2),
                     "share": round(self_us(e) / total, 4), "calls": e.count} for e in ranked]}


def fit_efficiency(points: list[tuple[float, float]]) -> dict | None:
    """Least-squares fit of ``mfu = m * t / (t + h)`` through ``(t, mfu)`` points.

    Linear in ``1/mfu = 1/m + (h/m) * (1/t)``.  Returns ``{"mfu_max", "half_sat_tokens"}``,
    or None with fewer than two distinct points.
    """
    import numpy as np

    pts = [(t, m) for t, m in points if t > 0 and m and m > 0]
    if len({t for t, _ in pts}) < 2:
        return None
    x = np.array([1.0 / t for t, _ in pts])
    y = np.array([1.0 / m for _, m in pts])
    slope, intercept = np.polyfit(x, y, 1)
    mfu_max = 1.0 / intercept
    return {"mfu_max": round(float(mfu_max), 4), "half_sat_tokens": round(float(slope * mfu_max), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny_gpt")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--gpu", default="auto",
                   help="GPU profile for MFU (peak TFLOP/s); auto: from the CUDA device's name")
    p.add_argument("--data", choices=("random", "real"), default="random")
    p.add_argument("--peer", action="store_true", help="also time the Hugging Face peer")
    p.add_argument("--peer-compile", action="store_true", help="also time the compiled peer")
    p.add_argument("--sweep-mbs", default="", help="comma-separated micro-batch sizes to re-time")
    p.add_argument("--profile", action="store_true",
                   help="profile one more step of ours: top kernels by time (under the profiler)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    from jobruntime.logging_utils import setup_logging

    setup_logging()
    import torch

    from jobruntime.config import load_config
    from jobruntime.data import synthetic_microbatch
    from jobruntime.devices import device_summary
    from jobruntime.flops import flops_per_token
    from jobruntime.hardware import get_gpu_profile, profile_for_device
    from jobruntime.loop import build_data
    from jobruntime.metrics import json_text
    from jobruntime.parallel import initialize_layout, set_seed, shutdown
    from jobruntime.trainer import Trainer

    n = args.warmup + args.steps
    cfg = load_config(args.config, [f"train.iters={n}", "train.eval_iters=1", *args.overrides])
    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer = Trainer(cfg)
    par = cfg.parallel
    if args.data == "real":
        data = build_data(cfg, topo)
        batches = data.train.next
    else:
        gen = torch.Generator().manual_seed(cfg.train.seed + topo.dp_rank)

        def batches():
            k = par.global_batch_size // (par.micro_batch_size * topo.dp)
            return [synthetic_microbatch(cfg.model, par.micro_batch_size, gen) for _ in range(k)]

    fpt = flops_per_token(cfg.model)
    prof = profile_for_device() if args.gpu == "auto" else get_gpu_profile(args.gpu)
    peak = prof.peak_tflops if prof else None

    def with_mfu(r: dict) -> dict:
        tflops = fpt * r["tokens_per_s"] / topo.world_size / 1e12  # per device
        return {**{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()},
                "tokens_per_s": round(r["tokens_per_s"], 1),
                "achieved_tflops_per_device": round(tflops, 2),
                "mfu": round(tflops / peak, 4) if peak else None}

    # where the model's parameters are, and their dtype: not torch.cuda.is_available()
    ran = device_summary(trainer.module)
    cuda = ran["device"] == "cuda"
    # the layout of the run; the sweep below changes cfg.parallel (the trainer's own)
    mbs, gbs = par.micro_batch_size, par.global_batch_size
    ours = with_mfu(_time_ours(trainer, batches, args.steps, args.warmup, cuda))
    out = {
        "model": cfg.name, "device": ran["device"], "gpu_name": ran["gpu"],
        "world_size": topo.world_size, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp,
        "micro_batch_size": mbs, "global_batch_size": gbs,
        "seq_length": cfg.model.seq_length, "data": args.data,
        "precision": ran["precision"],
        "attention_backend": cfg.model.attention_backend,
        "flops_per_token": fpt, "peak_tflops": peak, **ours,
    }
    if args.profile:
        out["profile"] = profile_step(trainer, batches, cuda)
    if args.sweep_mbs:
        sweep = []
        for m in [int(x) for x in args.sweep_mbs.split(",")]:
            if gbs % (m * topo.dp):
                continue
            trainer.set_batch_size(gbs, m)
            r = with_mfu(_time_ours(trainer, batches, max(args.steps // 2, 2), 1, cuda))
            sweep.append({"micro_batch_size": m, "tokens_per_micro_batch": m * cfg.model.seq_length,
                          "tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"]})
        trainer.set_batch_size(gbs, mbs)
        out["mbs_sweep"] = sweep
        out["efficiency_fit"] = fit_efficiency([(s["tokens_per_micro_batch"], s["mfu"]) for s in sweep])
    variants = [k for k, on in (("peer", args.peer), ("peer_compiled", args.peer_compile)) if on]
    out["peers_requested"] = variants if topo.world_size == 1 else []  # the summary checks these
    emit = (lambda: print(json_text(out), flush=True)) if topo.rank == 0 else (lambda: None)
    emit()  # one line per stage: a run stopped at a time limit keeps what it measured
    if variants and topo.world_size == 1:
        from bench.hf_peer import time_peers

        del trainer
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        # the same work as ours: the micro-batch, global batch and sequence of ours' timed run
        peers = time_peers(cfg.model, cfg.train, micro_batch_size=mbs, global_batch_size=gbs,
                           steps=args.steps, warmup=args.warmup,
                           device=torch.device(ran["device"]), variants=variants)
        for key, r in peers:
            out[key] = with_mfu(r)
            out[f"ratio_vs_{key}"] = round(ours["tokens_per_s"] / r["tokens_per_s"], 3)
            emit()
        if cuda:
            torch._dynamo.reset()
    shutdown()


if __name__ == "__main__":
    main()
