"""Emulated GeoMesh runs end to end: resume, re-planning, baselines, outputs.

One spawned process runs every case (megatron-core import costs ~5 s):

* GeoMesh on the two-worker cluster with an injected 2x slowdown of the H100
  worker from outer step 2 on, 3 outer steps, checkpoints every step;
* the same run resumed from its step-2 checkpoint;
* DDP, DiLoCo and async for 2 outer steps on the same cluster.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.dist_utils import child_env, launch

OVERRIDES = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
    "model.seq_length=32", "parallel.global_batch_size=8", "parallel.micro_batch_size=4",
    "geomesh.inner_steps=2", "geomesh.target_model=gpt3_1.3b", "train.eval_iters=1",
    "train.warmup_iters=2", "logging.wandb=disabled",
]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _all(cache_dir: str, root: str) -> dict:
    import torch

    torch.set_num_threads(1)  # shared 2-core machine: spinning threads would crawl

    from geomesh.fleet.cluster import CLUSTERS_DIR
    from geomesh.run import run
    from jobruntime.checkpoint import CheckpointError
    from jobruntime.config import load_config

    root = Path(root)
    raw = yaml.safe_load((CLUSTERS_DIR / "two_worker.yaml").read_text())
    raw["slowdown"] = {"worker": "h100-eastus", "factor": 2, "from_round": 1}
    cluster = root / "slow.yaml"
    cluster.write_text(yaml.safe_dump(raw))

    def cfg(method, *extra):
        return load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", f"geomesh.cluster={cluster}",
                                        f"geomesh.method={method}", *OVERRIDES, *extra])

    out = {"summary": {}}
    ef = "geomesh.error_feedback=true"  # its residuals must survive a resume
    out["summary"]["full"] = run(cfg("geomesh", "geomesh.outer_steps=3", ef,
                                     "checkpoint.save_interval=1", "checkpoint.keep_last=5"),
                                 root / "full")
    ckpt = root / "full" / "checkpoints" / "outer_0000002"
    state = torch.load(ckpt / "rank00000.pt", weights_only=False)
    out["state"] = {
        "round": state["round"],
        "momentum_norm": float(sum(v.norm() for v in state["outer"]["momentum_buffer"].values())),
        "residual_norm": float(sum(v.norm() for fb in state["feedback"].values()
                                   for v in fb["residuals"].values())),
        "adam_states": [len(w["optimizer"]["state"]) for w in state["workers"].values()],
    }
    out["summary"]["resumed"] = run(cfg("geomesh", "geomesh.outer_steps=3", ef,
                                        f"checkpoint.load={ckpt}"), root / "resumed")
    # a finished run trained further (outer_steps raised on the resume)
    run(cfg("geomesh", "geomesh.outer_steps=4", ef, "checkpoint.save_interval=1",
            f"checkpoint.load={root / 'full' / 'checkpoints' / 'outer_0000003'}"),
        root / "extended")
    out["extended"] = [torch.load(root / run_dir / "checkpoints" / f"outer_000000{k}" /
                                  "rank00000.pt", weights_only=False)
                       for run_dir, k in (("full", 3), ("extended", 4))]
    for m in ("ddp", "diloco", "async"):
        saves = ["checkpoint.save_interval=1", "checkpoint.keep_last=5"] if m == "ddp" else []
        out["summary"][m] = run(cfg(m, "geomesh.outer_steps=2", *saves), root / m)
    try:  # a finished DDP run resumed with no round left (it trained none, silently)
        run(cfg("ddp", "geomesh.outer_steps=2",
                f"checkpoint.load={root / 'ddp' / 'checkpoints' / 'outer_0000002'}"),
            root / "ddp-done")
    except CheckpointError as e:
        out["ddp_done"] = str(e)
    out["summary"]["ddp-resumed"] = run(
        cfg("ddp", "geomesh.outer_steps=2",
            f"checkpoint.load={root / 'ddp' / 'checkpoints' / 'outer_0000001'}"),
        root / "ddp-resumed")
    # with dropout: a resume must restore every generator (megatron's tracker too)
    for m in ("geomesh", "ddp"):
        drop = ["model.dropout=0.1", "geomesh.outer_steps=2"]
        run(cfg(m, *drop, "checkpoint.save_interval=1", "checkpoint.keep_last=5"), root / f"{m}-drop")
        run(cfg(m, *drop, f"checkpoint.load={root / f'{m}-drop' / 'checkpoints' / 'outer_0000001'}"),
            root / f"{m}-drop-resumed")
    # A 4x slowdown: the re-plan changes the workers' proxy inner steps (3, 1 -> 2, 2).
    raw4 = dict(raw, name="slow4", slowdown={"worker": "h100-eastus", "factor": 4, "from_round": 1})
    slow4 = root / "slow4.yaml"
    slow4.write_text(yaml.safe_dump(raw4))
    for name, extra in (("slow4", ["checkpoint.save_interval=1", "checkpoint.keep_last=5"]),
                        ("slow4-resumed", [f"checkpoint.load={root / 'slow4' / 'checkpoints'}"
                                           "/outer_0000002", "checkpoint.save_interval=1"])):
        run(cfg("geomesh", "geomesh.outer_steps=3", f"geomesh.cluster={slow4}", *extra), root / name)
        final = torch.load(root / name / "checkpoints" / "outer_0000003" / "rank00000.pt",
                           weights_only=False)
        out[name] = {"schedulers": [w["scheduler"] for w in final["workers"].values()]}
    # Overlapped rounds: at zero delay, and one round delayed (checkpointed, resumed).
    for name, extra in (("plain", ["geomesh.overlap=null"]), ("overlap0", ["geomesh.overlap=0"]),
                        ("overlap1", ["geomesh.overlap=1", "checkpoint.save_interval=2"])):
        out["summary"][name] = run(cfg("geomesh", "geomesh.outer_steps=4", *extra), root / name)
    # Every step overlapped (tau = H) when a slowdown starts: the profile seconds left to
    # charge after them are 0, or a rounding error below it
    raw3 = dict(raw, name="slow3", slowdown={"worker": "h100-eastus", "factor": 3, "from_round": 3})
    slow3 = root / "slow3.yaml"
    slow3.write_text(yaml.safe_dump(raw3))
    out["summary"]["overlap1-slow3"] = run(
        cfg("geomesh", "geomesh.outer_steps=5", "geomesh.overlap=1", f"geomesh.cluster={slow3}"),
        root / "overlap1-slow3")
    # One worker: its eager estimate is the aggregate itself (token share 1).
    raw["workers"], raw["name"] = raw["workers"][:1], "solo"
    solo = root / "solo.yaml"
    solo.write_text(yaml.safe_dump(raw))
    for name, extra in (("solo-plain", []), ("solo-overlap1", ["geomesh.overlap=1"])):
        run(cfg("geomesh", "geomesh.outer_steps=4", f"geomesh.cluster={solo}", *extra), root / name)
    ckpt = root / "overlap1" / "checkpoints" / "outer_0000002"
    out["summary"]["overlap1-resumed"] = run(
        cfg("geomesh", "geomesh.outer_steps=4", "geomesh.overlap=1", "checkpoint.save_interval=2",
            f"checkpoint.load={ckpt}"), root / "overlap1-resumed")
    return out


@pytest.fixture(scope="module")
def results(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("geomesh_run")
    (out,) = launch(_all, 1, cache_dir, str(root))
    return root, out


def test_resume_equals_uninterrupted_run(results):
    """Catches outer state that is not checkpointed or not restored (θ_global,
    Nesterov momentum, error-feedback residuals, inner AdamW moments, data
    position, re-planned batch sizes, emulated clock): resuming from the step-2
    checkpoint, outer step 3 equals the uninterrupted run's — loss, validation
    loss, tokens and emulated time bit for bit (same ops in the same order)."""
    root, out = results
    st = out["state"]
    assert st["round"] == 2 and st["momentum_norm"] > 0 and st["residual_norm"] > 0
    assert all(n > 0 for n in st["adam_states"])
    full, resumed = _metrics(root / "full"), _metrics(root / "resumed")
    assert [r["step"] for r in resumed] == [3]
    a, b = full[2], resumed[0]
    for key in ("loss", "val_loss", "tokens", "time_s", "batch_sizes", "bytes"):
        assert a[key] == b[key], key
    s_full, s_res = out["summary"]["full"], out["summary"]["resumed"]
    for key in ("final_val_ppl", "tokens", "time_s", "straggler_idle_frac", "bytes_per_outer_step"):
        assert s_full[key] == s_res[key], key


def test_the_ddp_baseline_resumes_from_its_checkpoint(results):
    """Catches DDP checkpoints that no resume accepts (the state check asked every
    method for the outer loop's state, which DDP has none of): resumed from its step-1
    checkpoint, DDP's step 2 equals the uninterrupted run's; resumed from its last one
    with no round left, it says so (it trained nothing and exited 0)."""
    root, out = results
    full, resumed = _metrics(root / "ddp"), _metrics(root / "ddp-resumed")
    assert [r["step"] for r in resumed] == [2]
    for key in ("loss", "tokens", "time_s", "bytes"):
        assert full[1][key] == resumed[0][key], key
    assert out["summary"]["ddp"]["final_val_ppl"] == out["summary"]["ddp-resumed"]["final_val_ppl"]
    assert out.get("ddp_done", "").startswith("checkpoint is at outer step 2, geomesh.outer_steps=2")


def test_slowdown_triggers_replan(results):
    """Catches a planner that ignores drift: the H100 worker becomes 2x slower
    in outer step 2 (its straggler-free plan now leaves the T4 waiting); GeoMesh
    re-plans after it, and step 3 is balanced again (within the planner's 5 %)
    with a smaller share of the round's tokens for the slowed worker (H100 vs
    T4 speed ~4.5:1 → ~2.25:1, share ~0.82 → ~0.69)."""
    root, _ = results
    full = _metrics(root / "full")
    assert full[0]["imbalance"] < 0.05 and full[1]["imbalance"] > 0.3
    assert full[1].get("replanned") and full[2]["imbalance"] < 0.05

    def h100_share(r):
        tokens = [b * h for b, h in zip(r["target_batch_sizes"], r["inner_steps"])]
        return tokens[0] / sum(tokens)

    assert h100_share(full[2]) < 0.9 * h100_share(full[1])


def test_lr_schedules_follow_a_replan(results):
    """Catches LR schedules sized from the first plan (issue 25): each worker's
    schedule was ``outer_steps · H_i`` of the first plan, so after the 4x
    slowdown's re-plan (proxy inner steps 3, 1 -> 2, 2 in round 3) the H100's
    schedule still had a step to go (9 vs 8 trained) and the T4 ran one step past
    its end (3 vs 4).  Every worker's schedule must end with the run — its
    decay length equal to the steps it trained (the uninterrupted run's
    3+3+2 and 1+1+2) — also when resumed from the checkpoint taken when the
    re-plan was decided, before it took effect (megatron's scheduler takes the
    lengths saved in its own state, which predate the pending re-plan).  The emulated round's tokens stay H · G_p = 16
    sequences (the data stream is sized by them)."""
    root, out = results
    m = _metrics(root / "slow4")
    assert [r["replanned"] for r in m if "replanned" in r] == [True]
    assert [sum(r["proxy_samples"]) for r in m] == [16, 16, 16]
    for name in ("slow4", "slow4-resumed"):
        scheds = out[name]["schedulers"]
        assert [s["num_steps"] for s in scheds] == [8, 4], name
        assert [s["lr_decay_steps"] for s in scheds] == [8, 4], name
    resumed = _metrics(root / "slow4-resumed")
    assert resumed[0]["step"] == 3 and resumed[0]["loss"] == m[2]["loss"]


def test_a_replan_sets_the_lr_of_the_next_inner_step():
    """Catches a re-plan that resized a worker's schedule but left its param groups at
    the LR the old schedule had set (megatron sets it in ``step``): the first inner
    step after every re-plan trained at the old schedule's LR (measured: 0.0016 where
    the new one gives 0.00178)."""
    import torch

    from geomesh.worker import set_schedule, worker_schedule
    from jobruntime.config import load_config
    from jobruntime.trainer import lr_scheduler

    cfg = load_config("tiny_gpt", ["train.warmup_iters=4"])
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    opt.param_groups[0].update(max_lr=cfg.train.lr, min_lr=cfg.train.min_lr)
    sched = lr_scheduler(opt, worker_schedule(cfg, inner_iters=12, warmup_iters=4))
    sched.step(increment=6)  # six inner steps trained, in decay
    before = opt.param_groups[0]["lr"]
    set_schedule(sched, inner_iters=20, warmup_iters=4)
    assert sched.num_steps == 6
    assert opt.param_groups[0]["lr"] == pytest.approx(sched.get_lr(opt.param_groups[0]))
    assert opt.param_groups[0]["lr"] > before * 1.05  # a longer decay: a higher LR at step 6


@pytest.mark.parametrize("method", ["geomesh", "ddp"])
def test_a_resume_with_dropout_draws_the_same_masks(results, method):
    """Catches a checkpoint without every generator: GeoMesh saved torch's CPU generator
    alone (not megatron's model-parallel tracker, which attention dropout draws from) and
    the DDP baseline none, so a resumed run with dropout trained round 2 on other masks
    (loss 8.2505 against 8.2506; DDP 8.2685 against 8.2652).  Resumed from round 1, round
    2's loss is the uninterrupted run's bit for bit."""
    root, _ = results
    full, resumed = _metrics(root / f"{method}-drop"), _metrics(root / f"{method}-drop-resumed")
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == full[1]["loss"]


def test_a_schedules_position_follows_a_replan():
    """Catches a worker's schedule position taken as ``r · H_i`` (what a healed worker was
    stepped to, and the guard's expected scale assumed): after a re-plan from H = 3 to 5
    at round 2 of 5, a worker that trained 3 + 3 + 5 steps before round 3 stands at 11,
    not 15; without a re-plan both agree."""
    from geomesh.worker import ProxyStep, follow_replan, schedule_position

    def step(h):
        return ProxyStep(target=None, batches=(4,) * h)

    (total, _), = follow_replan([(5 * 3, 2)], [step(3)], [step(5)], 2, 5)
    assert total == 3 + 3 + 3 * 5
    assert [schedule_position(total, 5, r, 5) for r in (2, 3, 4, 5)] == [6, 11, 16, 21]
    assert [schedule_position(15, 3, r, 5) for r in range(6)] == [3 * r for r in range(6)]


def test_a_run_trained_further_keeps_its_schedules_end(results):
    """Catches schedule positions read against the raised ``outer_steps`` of a resume
    that trains a finished run further: its schedules were sized for the saved run's 3
    rounds, so position = length - (rounds left of those) x H_i must give each worker's
    trained steps after round 4; against 4 rounds it stood H_i behind (a healed worker
    was not moved, a negative position failed the guard's scale).  The added round
    trains past the schedules' end, at the final LR."""
    from geomesh.worker import schedule_position

    _, out = results
    before, st = out["extended"]
    assert st["round"] == 4 and st["schedule_rounds"] == 3
    trained = [w["scheduler"]["num_steps"] for w in st["workers"].values()]
    h = [t - w["scheduler"]["num_steps"] for t, w in zip(trained, before["workers"].values())]
    assert all(x > 0 for x in h)  # each worker's H_i in round 4
    assert [schedule_position(n, x, 4, st["schedule_rounds"])
            for (n, _), x in zip(st["schedules"], h)] == trained
    assert [schedule_position(n, x, 4, 4) for (n, _), x in zip(st["schedules"], h)] != trained
    # the schedules end where the saved run's did: the added round trained past their
    # decay, at the final LR (docs/geomesh.md)
    assert all(w["scheduler"]["num_steps"] > w["scheduler"]["lr_decay_steps"]
               for w in st["workers"].values())


def test_overlap_without_delay_equals_blocking_rounds(results):
    """Catches overlap machinery that changes the math or the clock when nothing
    overlaps (a rebase that is not exactly θ_global, records or re-plans shifted
    by a round, waits charged twice): geomesh.overlap=0 — background exchange,
    deferred outer step, rebase, pending clock — gives the blocking run's losses,
    validation losses, batch sizes (incl. the re-plan after the slowdown) and
    emulated times bit for bit, and the same total idle time."""
    root, out = results
    plain, zero = _metrics(root / "plain"), _metrics(root / "overlap0")
    assert len(plain) == len(zero) == 4 and any(r.get("replanned") for r in plain)
    for a, b in zip(plain, zero):
        for key in ("loss", "val_loss", "tokens", "time_s", "batch_sizes", "bytes", "compute_s"):
            assert a[key] == b[key], key
        assert a["straggler_idle_s"] + a["wan_idle_s"] == \
            pytest.approx(b["straggler_idle_s"] + b["wan_idle_s"], rel=1e-9)


def test_one_round_delay_hides_the_wan_and_resumes(results):
    """Catches an overlap that still waits for the exchange, or whose checkpoint
    misses state: with geomesh.overlap=1 the exchanges of rounds 1 and 3 run
    behind the next round's compute and cost no idle time at all (the blocking
    run waits 0.1-0.2 s on the WAN each round; round 2 is a checkpoint round and
    round 4 the last: both drained), so the run ends sooner; it trains (val loss
    falls); resuming from its step-2 checkpoint reproduces steps 3-4 bit for bit."""
    root, out = results
    plain, ovl = out["summary"]["plain"], out["summary"]["overlap1"]
    m, p = _metrics(root / "overlap1"), _metrics(root / "plain")
    assert ovl["overlap"] == 1.0 and ovl["time_s"] < plain["time_s"]
    for k in (0, 2):
        assert p[k]["wan_idle_s"] > 0.1 and m[k]["wan_idle_s"] == m[k]["straggler_idle_s"] == 0
    assert m[-1]["val_loss"] < m[0]["val_loss"]
    resumed = _metrics(root / "overlap1-resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(m[2:], resumed):
        for key in ("loss", "val_loss", "tokens", "time_s", "batch_sizes"):
            assert a[key] == b[key], key


def test_fully_overlapped_rounds_survive_a_slowdown(results):
    """Catches a negative compute time charged to the emulated clock: with
    ``geomesh.overlap=1`` every inner step runs while the exchange travels, so the round's
    profile seconds less those already charged are 0, and a slowdown from round 3 made
    the float difference -1.4e-14 (ValueError, exit 1).  The run finishes its rounds."""
    _, out = results
    assert out["summary"]["overlap1-slow3"]["outer_steps"] == 5


def test_one_worker_overlap_equals_blocking_rounds(results):
    """Catches an eager start that is not the estimate the aggregate will be (the
    worker's own dense pseudo-gradient instead of its decoded message, a wrong
    token share, a stale aggregate): with one worker the estimate is exact, so a
    one-round-delayed run trains the blocking run's losses to float rounding
    (the previous eager start was 1e-3 off by round 2)."""
    root, _ = results
    plain, ovl = _metrics(root / "solo-plain"), _metrics(root / "solo-overlap1")
    assert len(plain) == len(ovl) == 4
    for a, b in zip(plain, ovl):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)


def test_summaries_have_the_comparison_fields(results):
    """Catches missing or mislabelled outputs: every method writes the summary
    fields the benchmark reads, in the emulated clock; GeoMesh sends ~32x fewer
    bytes than fp32 DiLoCo; DDP waits on stragglers and the WAN every step."""
    root, out = results
    keys = {"method", "clock", "ttp_s", "final_val_ppl", "tokens", "straggler_idle_frac",
            "wan_idle_frac", "bytes_per_outer_step", "compression_ratio", "workers"}
    for name, s in out["summary"].items():
        assert keys <= s.keys(), name
        assert s["sync_share"] == pytest.approx(s["straggler_idle_frac"] + s["wan_idle_frac"])
        assert s["clock"] == "emulated" and s["mode"] == "emulated"
        # where the workers' models ran, read from their parameters (the GPU tier asserts cuda)
        assert (s["device"], s["precision"], s["gpu"]) == ("cpu", "float32", None), name
        assert json.loads((root / name / "summary.json").read_text())["method"] == s["method"]
    geo, dil = out["summary"]["full"], out["summary"]["diloco"]
    assert geo["outer_device"] == dil["outer_device"] == "cpu"  # θ_global's device
    # fp32 DiLoCo: 1 up to the canonical message's header and schema (~1 kB of 5.3 GB)
    assert geo["compression_ratio"] > 31 and dil["compression_ratio"] == pytest.approx(1.0, rel=1e-5)
    assert dil["bytes_per_outer_step"] / geo["bytes_per_outer_step"] > 31
    ddp = out["summary"]["ddp"]
    assert ddp["straggler_idle_frac"] > 0.2 and ddp["wan_idle_frac"] > 0.01
    assert out["summary"]["async"]["straggler_idle_frac"] == 0
    # GeoMesh's own memory (error feedback on in this run): θ_global and momentum
    # in fp32 and the encoded message on the device; the residual (fp32) in host
    # memory.  Default codec top-24 of 256 with 2-bit values: a row of this model's
    # 64 or 128 columns fills a (padded) 256-chunk, 38 bytes per row, so its message
    # is 0.3-0.6 bytes per parameter (GPT-3 1.3B's rows: 0.12).
    mem = geo["memory_overhead"]
    n = mem["params"]
    assert geo["codec"] == "topk"
    assert mem["global_weights_bytes"] == mem["outer_momentum_bytes"] == 4 * n
    assert mem["host_error_feedback_bytes"] == 4 * n and n / 4 < mem["packed_message_bytes"] < n
    assert 8.1 < mem["target_total_bytes"] / 1_315_723_264 < 9
    assert dil["memory_overhead"]["host_error_feedback_bytes"] == 0
    for name in ("ddp", "diloco", "async"):
        assert [r["step"] for r in _metrics(root / name)] == [1, 2]
        assert out["summary"][name]["tokens"] == 2 * 2 * 8 * 32


@pytest.mark.parametrize("case", ["ef-toggled", "nothing-left", "damaged", "outer-lr-0",
                                  "momentum-1.5", "does-not-fit", "ordinary-checkpoint",
                                  "worker-renamed", "workers-reordered", "other-adam",
                                  "other-warmup", "ddp-other-warmup", "other-outer-lr"])
def test_bad_geomesh_input_is_one_line_exit_2(results, cache_dir, tmp_path, case):
    """Catches tracebacks (KeyError, ValueError, PlanError, a torch zip error),
    a silent no-op run, or a left-behind run folder (config.yaml, wandb/) on bad
    GeoMesh settings and checkpoints.  A resume on a cluster file whose workers
    are not the saved ones: a renamed worker crashed with a raw KeyError in
    geomesh/fleet/clock.py, reordered workers were accepted silently (each ran the
    other's saved plan and optimizer state); both must be refused by identity.  A resume
    with other Adam betas or weight decay trained on the checkpoint's."""
    import shutil
    import subprocess
    import sys

    root, _ = results
    ckpt = root / "full" / "checkpoints" / "outer_0000002"
    cluster = root / "slow.yaml"
    extra = {
        "ef-toggled": [f"checkpoint.load={ckpt}", "geomesh.outer_steps=3",
                       "geomesh.error_feedback=false"],
        "nothing-left": [f"checkpoint.load={ckpt}", "geomesh.outer_steps=2",
                         "geomesh.error_feedback=true"],
        "outer-lr-0": ["geomesh.outer_lr=0"],
        "momentum-1.5": ["geomesh.outer_momentum=1.5"],
        # the workers' Adam and weight decay came from the checkpoint, silently
        "other-adam": [f"checkpoint.load={ckpt}", "geomesh.outer_steps=3",
                       "geomesh.error_feedback=true", "train.adam_beta2=0.99",
                       "train.weight_decay=0.05"],
        # the saved schedules went on, config.yaml recorded the new warmup
        # the outer step's learning rate came from the checkpoint (review helper)
        "other-outer-lr": [f"checkpoint.load={ckpt}", "geomesh.outer_steps=3",
                           "geomesh.error_feedback=true", "geomesh.outer_lr=0.5"],
        "other-warmup": [f"checkpoint.load={ckpt}", "geomesh.outer_steps=3",
                         "geomesh.error_feedback=true", "train.warmup_iters=50"],
        "ddp-other-warmup": [f"checkpoint.load={root / 'ddp' / 'checkpoints' / 'outer_0000001'}",
                             "geomesh.outer_steps=2", "geomesh.method=ddp",
                             "train.warmup_iters=50"],
    }.get(case, [])
    needle = {"ef-toggled": "error feedback", "nothing-left": "nothing left",
              "damaged": "is damaged", "outer-lr-0": "geomesh.outer_lr",
              "momentum-1.5": "geomesh.outer_momentum", "does-not-fit": "cannot fit",
              "ordinary-checkpoint": "ordinary train.py run",
              "worker-renamed": "worker 1 is 't4-westeurope' (T4 x4, tp=4, pp=1), the cluster "
                                "file's is 't4-northeurope'",
              "workers-reordered": "list the workers in the saved order",
              "other-adam": "train.weight_decay: checkpoint 0.1, config 0.05; "
                            "train.adam_beta2: checkpoint 0.95, config 0.99",
              "other-warmup": "train.warmup_iters=2, this config has 50",
              "other-outer-lr": "other outer optimizer settings (geomesh.outer_lr: checkpoint",
              "ddp-other-warmup": "train.warmup_iters=2, this config has 50"}[case]
    if case in ("worker-renamed", "workers-reordered"):
        raw = yaml.safe_load(cluster.read_text())
        assert [w["name"] for w in raw["workers"]] == ["h100-eastus", "t4-westeurope"]
        if case == "worker-renamed":
            raw["workers"][1]["name"] = "t4-northeurope"
        else:
            raw["workers"].reverse()
        cluster = tmp_path / "changed.yaml"
        cluster.write_text(yaml.safe_dump(raw))
        extra = [f"checkpoint.load={ckpt}", "geomesh.outer_steps=3", "geomesh.error_feedback=true"]
    if case == "ordinary-checkpoint":
        (tmp_path / "ckpts" / "iter_0000002").mkdir(parents=True)
        (tmp_path / "ckpts" / "iter_0000002" / "COMPLETE").write_text("step 2\n")
        extra = [f"checkpoint.load={tmp_path / 'ckpts'}"]
    if case == "damaged":
        bad = tmp_path / "outer_0000002"
        shutil.copytree(ckpt, bad)
        f = bad / "rank00000.pt"
        f.write_bytes(f.read_bytes()[:1000])
        extra = [f"checkpoint.load={bad}", "geomesh.outer_steps=3", "geomesh.error_feedback=true"]
    if case == "does-not-fit":
        raw = yaml.safe_load(cluster.read_text())
        raw["workers"][1]["memory_gib"] = 0.5
        cluster = tmp_path / "tiny_memory.yaml"
        cluster.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "train.py", "--config", "tiny_gpt", f"data.cache_dir={cache_dir}",
           f"geomesh.cluster={cluster}", "geomesh.method=geomesh", *OVERRIDES, *extra,
           "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                          text=True, timeout=300, env={**child_env(), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    import re

    logs = re.compile(r"^\[\d\d:\d\d:\d\d\] ")  # INFO lines; a "[rank0]:" traceback counts
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and not logs.match(ln)]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert not (tmp_path / "run").exists(), "a failed run left a half-written folder"


@pytest.mark.parametrize("module", ["geomesh.planner", "geomesh.fleet.planner"])
def test_checkpoint_from_before_the_subpackages_still_loads(module, tmp_path, monkeypatch):
    """Catches a resume that breaks on checkpoints written when the plan classes lived
    in another module (``geomesh.planner``; then ``geomesh.fleet.planner``, before
    ``geomesh.fleet.plan``: "is damaged (UnpicklingError)"), their Plan pickled under
    that name: load_state allows the old names for the same class (tests/test_fuzz.py:
    files that would run code stay refused)."""
    import sys
    import types

    from geomesh.fleet.plan import Plan, WorkerPlan
    from geomesh.state import load_state, save_state

    old = types.ModuleType(module)
    old.Plan, old.WorkerPlan = Plan, WorkerPlan
    monkeypatch.setitem(sys.modules, module, old)
    monkeypatch.setattr(Plan, "__module__", module)
    plan = Plan(workers=[], target_tokens=1024, tolerance=0.05)
    save_state(tmp_path / "ck", 3, {"method": "geomesh", "round": 3, "outer": {}, "plan": plan},
               rank=0, job_leader=True)
    monkeypatch.undo()  # the old module is gone, as after the upgrade
    st = load_state(tmp_path / "ck", rank=0)
    assert type(st["plan"]) is Plan and st["plan"].target_tokens == 1024
