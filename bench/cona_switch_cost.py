"""Switch cost in real mode: CONA's in-memory switch against the restart it replaces.

On 4 CPU processes (torchrun, gloo), for tiny_gpt and a ~100M-parameter GPT
(GPT-2-small shape: 12 layers, hidden 768, 12 heads; vocabulary 8192), both at
sequence 64, global batch 8:

1. **in-memory switch** (``cona.switch.switch_layout``): train 2 steps at
   DP4, then move to DP1-TP2-PP2 in the running processes: new process
   groups, new model and optimizer, weights and Adam state resharded; the
   wall time of the switch, max over ranks.
2. **restart**: the same step-2 state saved with ``dist_checkpointing``
   (``jobruntime.checkpoint``; the save's wall time, max over ranks), then new
   processes launched with torchrun at DP1-TP2-PP2 that build the model and
   optimizer and load the checkpoint; from the launch until every rank has
   loaded (Python start and imports included: a relaunch pays them).

Both continue with one training step on the same batch; the two losses must
agree (same state, same layout), which the JSON reports.  The machine is
shared, so the load average is printed with the numbers.

Usage::

    python bench/cona_switch_cost.py                # both models
    python bench/cona_switch_cost.py --models tiny_gpt

Prints one JSON object: ``{"clock": "wall", "processes": 4, "models": {NAME:
{"params", "in_memory_s", "restart_s", "save_s", "relaunch_load_s",
"restart_over_in_memory", "loss_after_switch", "loss_after_restart"}}}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jobruntime.metrics import json_text  # noqa: E402
from jobruntime.ports import free_port  # noqa: E402

MODELS = {
    "tiny_gpt": ("tiny_gpt", []),
    "gpt_100m": ("tiny_gpt", ["model.num_layers=12", "model.hidden_size=768",
                              "model.num_attention_heads=12", "model.vocab_size=8192"]),
}
COMMON = ["model.seq_length=64", "parallel.micro_batch_size=2", "parallel.global_batch_size=8",
          "train.warmup_iters=1", "train.iters=10", "train.eval_interval=0",
          "logging.wandb=disabled"]
FROM, TO = (1, 1), (2, 2)  # (tp, pp): DP4 -> DP1-TP2-PP2 on 4 processes
STEPS = 2


def _cfg(model: str, cache_dir: str | None, tp_pp: tuple[int, int]):
    from jobruntime.config import load_config

    preset, extra = MODELS[model]
    over = [*COMMON, *extra, f"parallel.tp={tp_pp[0]}", f"parallel.pp={tp_pp[1]}"]
    if cache_dir:
        over.append(f"data.cache_dir={cache_dir}")
    return load_config(preset, over)


def _max(seconds: float) -> float:
    from cona.switch import max_over_ranks

    return max_over_ranks([seconds])[0]


def _setup(cfg, consumed: int):
    """Layout, data sampler at ``consumed`` and a fresh trainer for ``cfg``."""
    from cona.state import build_trainer
    from jobruntime.data import GlobalBatchSampler, build_dataset, prepare_corpus
    from jobruntime.parallel import initialize_layout, set_seed

    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer = build_trainer(cfg, cfg.parallel.global_batch_size)
    corpus = prepare_corpus(cfg.data, cfg.model)
    ds = build_dataset(corpus, cfg.model, "train", 64, cfg.train.seed, cfg.data.cache_dir)
    p = cfg.parallel

    def sampler(c, t, pos):
        q = c.parallel
        return GlobalBatchSampler(ds, global_batch_size=q.global_batch_size,
                                  micro_batch_size=q.micro_batch_size, dp=t.dp,
                                  dp_rank=t.dp_rank, consumed_samples=pos)

    return topo, trainer, sampler, sampler(cfg, topo, consumed), p


def worker(args) -> None:
    """One rank of phase ``switch`` (train, save, switch in memory, step) or ``restart``
    (build at the new layout, load, step)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from cona.state import strategy_config
    from cona.strategy import Strategy
    from cona.switch import switch_layout
    from jobruntime.checkpoint import load_checkpoint, save_checkpoint
    from jobruntime.flops import num_params
    from jobruntime.parallel import init_distributed, shutdown

    init_distributed()
    out = {}
    if args.worker == "switch":
        cfg = _cfg(args.model, args.cache_dir, FROM)
        topo, trainer, sampler, s, p = _setup(cfg, 0)
        for _ in range(STEPS):
            trainer.train_step(s.next())
        dist.barrier()
        t0 = time.perf_counter()
        save_checkpoint(Path(args.ckpt), trainer, consumed_samples=s.consumed_samples)
        dist.barrier()
        out["save_s"] = _max(time.perf_counter() - t0)
        new_cfg = strategy_config(cfg, Strategy(4 // (TO[0] * TO[1]), *TO, p.micro_batch_size,
                                                p.global_batch_size),
                                  lr=cfg.train.lr, min_lr=cfg.train.min_lr)
        holder = type("Holder", (), {})()
        holder.trainer = trainer
        del trainer
        topo, report = switch_layout(holder, new_cfg, reference_batch=p.global_batch_size,
                                     seed=cfg.train.seed)
        out.update(in_memory_s=report.seconds, peak_rss_mib=report.peak_rss_mib,
                   params=num_params(cfg.model))
        out["loss"] = holder.trainer.train_step(sampler(new_cfg, topo, s.consumed_samples).next()).loss
    else:
        cfg = _cfg(args.model, args.cache_dir, TO)
        topo, trainer, sampler, _, _ = _setup(cfg, 0)
        info = load_checkpoint(args.ckpt, trainer)
        dist.barrier()
        out["loaded_at"] = time.time()
        out["loss"] = trainer.train_step(sampler(cfg, topo, info["consumed_samples"]).next()).loss
    if dist.get_rank() == 0:
        Path(args.out).write_text(json_text(out))
    shutdown()


def _torchrun(argv: list[str], log: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-port", str(free_port()), __file__, *argv]
    with open(log, "a") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env())
    if r.returncode:
        raise SystemExit(f"error: worker failed ({' '.join(argv[:4])}); see {log}")


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def measure(model: str, cache_dir: str | None, work: Path) -> dict:
    ckpt, log = work / model / "ckpt", work / f"{model}.log"
    ckpt.mkdir(parents=True)
    common = ["--model", model, "--ckpt", str(ckpt)] + (
        ["--cache-dir", cache_dir] if cache_dir else [])
    _torchrun(["--worker", "switch", "--out", str(work / "switch.json"), *common], log)
    sw = json.loads((work / "switch.json").read_text())
    launched = time.time()
    _torchrun(["--worker", "restart", "--out", str(work / "restart.json"), *common], log)
    rs = json.loads((work / "restart.json").read_text())
    relaunch = rs["loaded_at"] - launched
    restart = sw["save_s"] + relaunch
    return {
        "params": sw["params"],
        "from": "dp4-tp1-pp1", "to": "dp1-tp2-pp2",
        "in_memory_s": sw["in_memory_s"],
        "save_s": sw["save_s"],
        "relaunch_load_s": relaunch,
        "restart_s": restart,
        "restart_over_in_memory": restart / sw["in_memory_s"],
        "peak_rss_mib_in_memory": sw["peak_rss_mib"],
        "loss_after_switch": sw["loss"],
        "loss_after_restart": rs["loss"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=sorted(MODELS), choices=sorted(MODELS))
    p.add_argument("--cache-dir", default=None, help="tokenizer/dataset cache (data.cache_dir)")
    p.add_argument("--worker", choices=["switch", "restart"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    report = {"clock": "wall", "processes": 4, "backend": "gloo", "models": {}}
    tmp = Path(tempfile.mkdtemp(prefix="cona_switch_"))
    for m in args.models:
        load0 = os.getloadavg()[0]
        report["models"][m] = measure(m, args.cache_dir, tmp)  # exits, keeping tmp, on failure
        report["models"][m]["load_average_1min"] = [load0, os.getloadavg()[0]]
    shutil.rmtree(tmp, ignore_errors=True)
    print(json_text(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
