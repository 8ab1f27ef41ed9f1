"""A CONA run resumed from its checkpoint goes on where it stopped (a run lasts hours).

Real mode saves, with every checkpoint, the clock, the progress (TTP tracker,
evaluations, chain, switches, the LR ramp) and the controller's state (noise-scale
estimator, calibrated cost model, measured switch costs, decisions): ``Loop.state_dict``.
The old checkpoint held the strategy's label only, so a resumed run restarted its clock
at 0 (a wrong TTP), ranked with a cold cost model and estimator, re-ran the start
probe, and jumped to the new learning rate in the middle of a ramp.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.dist_utils import child_env, launch
from tests.test_cona_run_loop import _constant_scheduler, _fake_loop, _FakeJob

PP2, DP2 = "dp1-tp1-pp2-mb2-gb16", "dp2-tp1-pp1-mb2-gb16"


def _real(cache_dir, run_dir, iters, load, extra=()):
    import torch

    torch.set_num_threads(1)
    from cona.run import run
    from jobruntime.config import load_config

    cands = ("[{dp: 2, tp: 1, pp: 1, micro_batch_size: 2, global_batch_size: 16},"
             " {dp: 1, tp: 2, pp: 1, micro_batch_size: 2, global_batch_size: 16}]")
    cfg = load_config("tiny_gpt", [
        f"data.cache_dir={cache_dir}", "model.seq_length=64", "logging.wandb=disabled",
        "cona.enabled=true", "train.warmup_iters=2", "parallel.pp=2",
        "parallel.micro_batch_size=2", "parallel.global_batch_size=16",
        # one schedule for both runs (decay over 16 steps): the resumed run must go on
        # along it (by default megatron keeps the checkpoint's schedule settings)
        f"train.iters={iters}", "train.lr_decay_iters=16", "train.eval_interval=4",
        "cona.decision_interval=4",
        "cona.horizon_steps=1000", f"cona.candidates={cands}",
        f"checkpoint.save_interval={8 if load is None else 0}",
        *([f"checkpoint.load={load}"] if load else []), *extra])
    return run(cfg, Path(run_dir))


def _steps(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("event") == "step"]


@pytest.fixture(scope="module")
def resumed(cache_dir, tmp_path_factory):
    """Run 1: 8 steps at PP2 launch, switched to DP2 at step 4, checkpoint at step 8.
    Run 2: resumed from it at the launch layout (PP2), to step 16."""
    first, second = tmp_path_factory.mktemp("cona_first"), tmp_path_factory.mktemp("cona_resumed")
    a = launch(_real, 2, cache_dir, str(first), 8, None)
    b = launch(_real, 2, cache_dir, str(second), 16, str(first / "checkpoints" / "iter_0000008"))
    return a[0], b, first, second


def test_resumed_run_goes_on_from_its_checkpoint(resumed):
    """Catches a resumed CONA run that forgets its run: its clock must go on from the
    saved one (TTP counts the time before the stop), its chain, evaluations and measured
    switch costs must start with the first run's and it must count the first run's
    decisions, the noise-scale estimator must hold the first run's updates, no second
    start decision may come, the layout it was
    resumed at (the launch one, not the one saved) is recorded in the chain, and a
    switch back, where the machine's timings make one repay, goes to DP2."""
    a, bs, first, second = resumed
    b = bs[0]
    assert a["chain"] == [{"strategy": PP2, "start_step": 0}, {"strategy": DP2, "start_step": 4}]
    assert all(x["chain"] == b["chain"] for x in bs)  # every rank holds the same
    assert b["chain"][:2] == a["chain"]
    assert b["chain"][2] == {"strategy": PP2, "start_step": 8, "resumed": True}
    # a switch back, if one repaid (it depends on the machine's timings), is to DP2
    assert all(c["strategy"] == DP2 for c in b["chain"][3:]) and len(b["chain"]) <= 4
    # the decisions go on (their records stay in the first run's metrics.jsonl)
    assert b["decisions_before_resume"] == len(a["decisions"]) > 0
    assert not any(d.get("start") for d in b["decisions"])  # no second start decision
    assert b["evals"][:len(a["evals"])] == a["evals"]
    steps_a, steps_b = _steps(first), _steps(second)
    # the LR schedule goes on where it stopped: warmup 2 and cosine decay over 16 steps
    # of 16 samples, at every step of both runs (a checkpoint's schedule once loaded 16x
    # further on: the resumed run trained at the final LR)
    def lr(step: int) -> float:  # megatron's convention: step s trains at s - 1 steps done
        done, warm, decay = (step - 1) * 16, 2 * 16, 16 * 16
        if done <= warm:
            return 2e-3 * done / warm
        return 2e-4 + (2e-3 - 2e-4) * 0.5 * (1 + math.cos(math.pi * (done - warm) / (decay - warm)))

    # every step record has train.py's throughput field (the wall clock's; it had none)
    assert all(r["tokens_per_s"] > 0 for r in steps_a + steps_b)
    assert [r["lr"] for r in steps_a + steps_b] == pytest.approx(
        [lr(r["step"]) for r in steps_a + steps_b], rel=1e-6)
    # the clock goes on from the one saved with step 8 (its save itself is not counted)
    assert steps_b[0]["step"] == 9 and steps_b[0]["time_s"] > steps_a[-1]["time_s"] > 0
    assert steps_b[0]["time_s"] - steps_a[-1]["time_s"] < steps_a[-1]["time_s"]
    # the estimator holds the first run's updates, and the first step at DP1-PP2 (a
    # split step: the probe runs it as two schedule calls) adds one
    assert steps_a[-1]["gns_updates"] > 0
    assert steps_b[0]["gns_updates"] == steps_a[-1]["gns_updates"] + 1
    layout = a["switch_costs_charged"]["layout"]
    assert b["switch_costs_charged"]["layout"][:len(layout)] == layout
    # the next decision comes at step 12, the first of the interval after the resume
    assert [d["step"] for d in b["decisions"]][:1] == [12]


def test_a_finished_real_run_saves_its_last_step_once(resumed):
    """Catches a finished real-mode CONA run that left no checkpoint (nor tokenizer) to
    evaluate or convert (``checkpoint.save_final``, default on, was read by ordinary runs only):
    the resumed run (``save_interval=0``) must save its last step, and the first run,
    whose periodic save fell on its last step, must save it once, not twice."""
    from jobruntime.outputs import last_checkpoint

    _, _, first, second = resumed
    assert sorted(p.name for p in (first / "checkpoints").glob("iter_*")) == ["iter_0000008"]
    assert last_checkpoint(second) == "iter_0000016"
    # self-contained, as an ordinary run's folder: the tokenizer with the config (the
    # tools' conversion reads it; a CONA folder had none)
    assert (first / "config.yaml").is_file() and (first / "tokenizer.model").is_file()


def test_an_ordinary_run_goes_on_from_a_cona_checkpoint_in_its_own_steps(resumed, cache_dir,
                                                                         tmp_path):
    """Catches an ordinary run that read a CONA checkpoint's sample-counted schedule as
    steps: refused as "another LR schedule" (warmup 32 against 2) by default, and with
    ``checkpoint.lr_schedule=checkpoint`` it trained on a schedule stretched 16x (one
    step moved it one sample) while ``config.yaml`` recorded a warmup of 32 steps.  Now
    steps 9-12 train at the uninterrupted schedule's LR (warmup 2, decay over 16 steps of
    16 samples) and config.yaml holds the config's settings."""
    import subprocess
    import sys

    from jobruntime.config import load_config

    _, _, first, _ = resumed
    run = tmp_path / "ordinary"
    proc = subprocess.run(
        [sys.executable, "train.py", "--config", "tiny_gpt", "--run-dir", str(run),
         f"data.cache_dir={cache_dir}", "model.seq_length=64", "logging.wandb=disabled",
         "train.warmup_iters=2", "parallel.micro_batch_size=2", "parallel.global_batch_size=16",
         "train.iters=12", "train.lr_decay_iters=16", "train.eval_interval=0",
         "checkpoint.save_final=false", f"checkpoint.load={first / 'checkpoints' / 'iter_0000008'}"],
        cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=600,
        env={**child_env(), "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == [9, 10, 11, 12]

    def lr(step: int) -> float:  # as test_resumed_run_goes_on_from_its_checkpoint's
        done, warm, decay = step - 1, 2, 16
        return 2e-4 + (2e-3 - 2e-4) * 0.5 * (1 + math.cos(math.pi * (done - warm) / (decay - warm)))

    assert [r["lr"] for r in steps] == pytest.approx([lr(r["step"]) for r in steps], rel=1e-6)
    saved = load_config(str(run / "config.yaml"))
    assert (saved.train.warmup_iters, saved.train.lr_decay_iters) == (2, 16)


def test_weights_only_load_starts_a_fresh_run(resumed, cache_dir, tmp_path):
    """Catches ``checkpoint.load_optimizer=false`` (start afresh from the weights) that
    took the checkpoint's data position anyway: a real-mode CONA run loaded from the
    first run's step-8 checkpoint with ``train.iters=4`` trained nothing and exited 0.
    It must train its 4 steps from sample 0 at the start of its schedule, with no earlier
    decision or clock."""
    _, _, first, _ = resumed
    c = launch(_real, 2, cache_dir, str(tmp_path), 4, str(first / "checkpoints" / "iter_0000008"),
               ("checkpoint.load_optimizer=false",))[0]
    steps = _steps(tmp_path)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert steps[0]["lr"] == 0.0 and steps[0]["time_s"] < steps[-1]["time_s"]
    assert c["decisions_before_resume"] == 0 and c["chain"][0] == {"strategy": PP2,
                                                                  "start_step": 0}


def test_a_checkpoint_holds_the_decision_and_switch_of_its_step():
    """Catches a checkpoint saved before its step's decision: metrics.jsonl kept the
    decision (a resume replaces only later records) while the checkpoint's state had
    neither it nor its switch, so a resumed run never made a switch its log shows.  With
    the start decision (a switch to batch 512) at step 3 and a save every 3 steps, the
    save at step 3 must hold the decision and the chain with the switch."""
    from cona.strategy import Strategy

    small, big = Strategy(8, 1, 1, 1, 64), Strategy(8, 1, 1, 4, 512)
    job = _FakeJob(small, phi=1e4)
    loop, ctl = _fake_loop(job, ["cona.start_probe_updates=3", "cona.decision_interval=20",
                                 "checkpoint.save_interval=3"], 16 * 64, [small, big])
    saved = []
    loop.save = lambda: saved.append((job.trainer.step, len(ctl.decisions),
                                      [c["strategy"] for c in loop.progress.chain]))
    loop.run(until=lambda: job.trainer.step >= 3)
    assert saved == [(3, 1, [small.label, big.label])]


def test_a_resume_from_an_ordinary_runs_checkpoint_counts_its_schedule_in_samples(monkeypatch):
    """Catches a CONA resume that read an ordinary train.py checkpoint's step-counted
    schedule as samples: 4 steps of 16 sequences must put the sample schedule at 64
    samples (at 4 once, 7x too low an LR in warmup); a CONA checkpoint's position, in
    samples already, is kept as saved."""
    import types

    import cona.job as cjob
    from cona.state import SampleScheduler
    from jobruntime.config import load_config
    from jobruntime.trainer import lr_scheduler

    cfg = load_config("tiny_gpt", ["cona.enabled=true", "checkpoint.load=/nowhere"])
    ordinary = lr_scheduler(types.SimpleNamespace(param_groups=[]), cfg.train)  # steps
    ordinary.step(increment=4)

    def trainer():
        opt = types.SimpleNamespace(param_groups=[])
        return types.SimpleNamespace(scheduler=SampleScheduler(
            opt, global_batch_size=16, init_lr=0.0, max_lr=1e-3, min_lr=1e-4,
            lr_warmup_steps=320, lr_decay_steps=3200, lr_decay_style="cosine", start_wd=0.0,
            end_wd=0.0, wd_incr_steps=3200, wd_incr_style="constant"))

    saved = ordinary.state_dict()
    for extra, position in (({}, 64), ({"cona": {"clock_s": 1.0}}, 4)):
        t = trainer()

        def load(path, tr, load_optimizer, extra=extra):
            tr.scheduler.load_state_dict(saved)
            return {"step": 4, "consumed_samples": 64, "extra": extra}

        monkeypatch.setattr(cjob, "load_checkpoint", load)
        assert cjob.load_start(cfg, t) == (64, extra.get("cona", {}))
        assert t.scheduler.num_steps == position


def test_lr_ramp_goes_on_across_a_resume():
    """Catches a resume in the middle of an LR ramp that jumps to the new rate (the old
    known limit): a run that switched from proxy batch 16 to 128 with a 4-step ramp and
    stopped 2 steps into it must, resumed from ``Loop.state_dict``, train the last two
    ramp steps at 3/4 and all of the way, as the run without a stop did; its clock goes on
    from the saved one.  (The loop's state alone: a real run resumes only at its launch
    batch, test_a_resume_with_another_launch_batch_is_refused, so there the ramp goes on
    where the saved strategy is at that batch, e.g. a layout switch or the warm start's.)"""
    from cona.state import set_peak_lr
    from cona.strategy import Strategy

    small, big = Strategy(8, 1, 1, 1, 64), Strategy(8, 1, 1, 4, 512)
    over = ["cona.lr_ramp_steps=4", "cona.decision_interval=1000"]

    def start(strategy):
        _, sched = _constant_scheduler()
        job = _FakeJob(strategy, scheduler=sched)
        job.resume_clock = lambda s: setattr(job, "clock_s", s)
        set_peak_lr(job.trainer, sched, *job.lr_for(strategy))
        return job, _fake_loop(job, over, 10**6, [small, big])[0]

    trained = {}
    for stop in (False, True):
        job, loop = start(small)
        for k in range(6):
            if k == 2:
                job.apply(big)
                set_peak_lr(job.trainer, job.trainer.scheduler, *job.lr_for(big))
            if stop and k == 4:  # stop here; resume at the strategy it was at
                state, clock = loop.state_dict(), job.clock_s
                trained_before, job, loop = job.trained_lr, *start(big)
                job.trained_lr, job.trainer.step = trained_before, 4
                loop.load_state_dict(state)
                assert job.clock_s == clock
            loop.step()
        trained[stop] = job.trained_lr
    lo, hi = _FakeJob(small).lr_for(small)[0], _FakeJob(big).lr_for(big)[0]
    assert trained[False] == pytest.approx([lo, lo] + [lo + (hi - lo) * i / 4 for i in (1, 2, 3, 4)])
    assert trained[True] == pytest.approx(trained[False], rel=1e-12)


def test_state_from_another_version_is_refused():
    """Catches a half-read resume: a checkpoint's CONA state without its progress must be
    refused with an error naming what it lacks and the fix."""
    from cona.strategy import Strategy
    from jobruntime.checkpoint import CheckpointError

    job = _FakeJob(Strategy(8, 1, 1, 1, 64))
    loop, _ = _fake_loop(job, [], 10**6, [job.strategy])
    with pytest.raises(CheckpointError, match="lacks progress.*load_optimizer=false"):
        loop.load_state_dict({"clock_s": 1.0, "samples0": 0, "controller": None})


def test_a_resume_with_another_launch_batch_is_refused():
    """Catches a resume whose ``parallel.global_batch_size`` differs from the saved run's
    (e.g. launched at the batch the chain had moved to): it silently changed the run's
    budget (``train.iters`` of it) and the learning-rate rule's reference batch, so every
    later step trained at another LR.  Refused naming the saved batch; the same batch
    resumes."""
    from cona.strategy import Strategy
    from jobruntime.checkpoint import CheckpointError

    def loop_at(batch):
        job = _FakeJob(Strategy(8, 1, 1, 1, batch))
        job.reference_batch, job.resume_clock = batch, lambda s: setattr(job, "clock_s", s)
        return _fake_loop(job, [], 10**6, [job.strategy])[0]

    saved = loop_at(64).state_dict()
    assert saved["reference_batch"] == 64
    with pytest.raises(CheckpointError, match="global_batch_size=64.*this resume has 128"):
        loop_at(128).load_state_dict(saved)
    loop_at(64).load_state_dict(saved)


def _refused_in_place(cache_dir, run_dir):
    """A 1-process real CONA run of 2 steps saved at step 2, then its resume into the same
    folder at another global batch: the error and whether ``config.yaml`` and
    ``metrics.jsonl`` are as the run left them."""
    import torch

    torch.set_num_threads(1)
    from cona.run import run
    from jobruntime.checkpoint import CheckpointError
    from jobruntime.config import load_config

    run_dir = Path(run_dir)
    over = [f"data.cache_dir={cache_dir}", "model.seq_length=64", "logging.wandb=disabled",
            "cona.enabled=true", "train.iters=2", "train.warmup_iters=1",
            "checkpoint.save_interval=2"]
    run(load_config("tiny_gpt", over), run_dir)
    before = {f: (run_dir / f).read_bytes() for f in ("config.yaml", "metrics.jsonl")}
    try:
        run(load_config("tiny_gpt", [*over, "parallel.global_batch_size=16",
                                     f"checkpoint.load={run_dir / 'checkpoints'}"]), run_dir)
        err = None
    except CheckpointError as e:
        err = str(e)
    return err, all((run_dir / f).read_bytes() == b for f, b in before.items())


def test_a_refused_resume_leaves_the_run_folder_as_it_was(cache_dir, tmp_path):
    """Catches a refusal that comes after the run wrote its inputs: a resume into the run's
    own folder at another global batch rewrote ``config.yaml`` (with the refused batch,
    so the documented resume command ``--config DIR/config.yaml`` was refused from then
    on) before the CONA state was checked.  It is refused with the run's files as
    they were."""
    (res,) = launch(_refused_in_place, 1, cache_dir, str(tmp_path / "run"))
    err, untouched = res
    assert err is not None and "global_batch_size=8" in err
    assert untouched


def test_saved_state_does_not_grow_with_the_decisions():
    """Catches a checkpoint that carries every decision record (each with every
    candidate's score): a run of hours makes thousands.  The state after 400 decisions
    is no larger than after 20 (the estimator's window of noise scales is bounded),
    and it still counts them all."""
    import pickle

    from cona.strategy import Strategy

    small, big = Strategy(8, 1, 1, 1, 64), Strategy(8, 1, 1, 4, 512)
    job = _FakeJob(small, phi=100.0)
    loop, ctl = _fake_loop(job, ["cona.decision_interval=1", "cona.start_probe_updates=0"],
                           10**9, [small, big])
    sizes = {}
    for n in (20, 400):
        while len(ctl.decisions) < n:
            loop.step()
        sizes[n] = len(pickle.dumps(loop.state_dict()))
        assert loop.state_dict()["controller"]["num_decisions"] == n
    assert sizes[400] <= sizes[20] + 256, sizes
