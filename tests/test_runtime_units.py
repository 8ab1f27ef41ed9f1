"""Pure-logic tests of the job runtime: config, data formats, CPU layer, checkpoints."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jobruntime.config import ConfigError, load_config
from jobruntime.data import DataError, read_documents, val_document_mask
from jobruntime.metrics import TTPTracker, dense_eval_gap

REPO = Path(__file__).resolve().parent.parent


def test_overrides_are_type_checked_and_unknown_keys_rejected():
    """Catches silently ignored typos in overrides (a classic source of wasted runs)."""
    cfg = load_config("tiny_gpt", ["train.iters=7", "train.lr=3e-4", "parallel.tp=2",
                                   "train.target_ppl=null"])
    assert (cfg.train.iters, cfg.train.lr, cfg.parallel.tp, cfg.train.target_ppl) == (7, 3e-4, 2, None)
    with pytest.raises(ConfigError, match="unknown config key 'model.hiden_size'"):
        load_config("tiny_gpt", ["model.hiden_size=3"])
    with pytest.raises(ConfigError, match="model.normalization"):
        load_config("tiny_gpt", ["model.normalization=BatchNorm"])
    with pytest.raises(ConfigError, match="not found"):
        load_config("no_such_preset")


def test_a_renamed_key_of_a_saved_config_still_loads(tmp_path):
    """Catches a run folder's config.yaml that no longer loads after a key was renamed
    (``cona.gns_preconditioned`` became ``cona.gns_definition``): the old key, in a YAML
    file or an override, sets the new one to its meaning; a bad value still fails."""
    old = tmp_path / "config.yaml"
    old.write_text("cona:\n  gns_preconditioned: true\n")
    assert load_config(str(old)).cona.gns_definition == "pollux"
    assert load_config("tiny_gpt", ["cona.gns_preconditioned=false"]).cona.gns_definition == "simple"
    with pytest.raises(ConfigError, match="gns_definition"):
        load_config("tiny_gpt", ["cona.gns_preconditioned=3"])


def test_layout_validation_names_the_field():
    """Catches layouts megatron would reject later with an assertion."""
    cfg = load_config("tiny_gpt", ["parallel.tp=3"])
    with pytest.raises(ConfigError, match="parallel.tp"):
        cfg.validate(world_size=3)
    cfg = load_config("tiny_gpt", ["parallel.global_batch_size=6"])
    with pytest.raises(ConfigError, match="global_batch_size"):
        cfg.validate(world_size=2)
    assert load_config("tiny_gpt").validate(world_size=2) == 2
    # An FFN width TP does not divide: megatron's RowParallelLinear asserts
    # divide(ffn_hidden_size, tp) inside the build (fc2's input is the FFN width).
    cfg = load_config("tiny_gpt", ["parallel.tp=4", "model.ffn_hidden_size=1002"])
    with pytest.raises(ConfigError, match=r"^parallel\.tp=4 does not divide the FFN hidden size "
                                          r"\(model\.ffn_hidden_size=1002\)$"):
        cfg.validate(world_size=4)


def test_documents_split_by_document_not_line():
    """Catches a validation set that shares documents with training."""
    mask = val_document_mask(100, 20)
    assert mask.sum() == 5 and list(np.flatnonzero(mask)) == [19, 39, 59, 79, 99]


def test_read_documents_formats(tmp_path):
    """JSONL (plain and .gz), text files, folders and saved HF datasets give the
    same documents; malformed input names the file and line."""
    import gzip

    docs = ["first doc\nline two", "second doc", "third"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"text": d}) for d in docs))
    folder = tmp_path / "txt"
    folder.mkdir()
    for i, d in enumerate(docs):
        (folder / f"{i}.txt").write_text(d)
    import datasets

    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "hf"))
    for p in ("a.jsonl", "a.jsonl.gz", "txt", "hf"):
        assert read_documents(tmp_path / p) == docs, p
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no 'text' field"):
        read_documents(tmp_path / "bad.jsonl")
    (tmp_path / "x.parquet").write_text("")
    with pytest.raises(DataError, match="unknown data format"):
        read_documents(tmp_path / "x.parquet")


def test_ttp_tracker_records_first_crossing_only():
    """Catches TTP taken at the last evaluation instead of the first below target."""
    t = TTPTracker(target_ppl=100.0)
    assert not t.update(150.0, 10.0, 1000, 1)
    assert t.update(99.0, 20.0, 2000, 2)
    assert not t.update(50.0, 30.0, 3000, 3)
    assert (t.ttp_step, t.reached_s) == (2, 20.0)
    assert not TTPTracker(target_ppl=None).update(1.0, 1.0, 1, 1)
    assert not TTPTracker(target_ppl=10.0).update(math.nan, 1.0, 1, 1)


def test_ttp_is_interpolated_in_log_perplexity_at_the_crossing():
    """Catches TTP taken at the first evaluation at or below the target (it jumped by a
    whole evaluation interval when a curve crossed just after an evaluation; the old
    tracker returned 30 s here).  Perplexity 120 at 20 s, 80 at 30 s, target 100: log-
    linear interpolation crosses at f = ln(120/100) / ln(120/80) = 0.44966, i.e.
    24.4966 s and 2,450 tokens (linear in perplexity it would be 25 s); the step stays
    that of the evaluation at or below the target."""
    t = TTPTracker(target_ppl=100.0)
    for ppl, time_s, tokens, step in ((200.0, 10.0, 1000, 1), (120.0, 20.0, 2000, 2)):
        assert not t.update(ppl, time_s, tokens, step)
    assert t.update(80.0, 30.0, 3000, 3)
    f = math.log(1.2) / math.log(1.5)
    assert t.ttp_s == pytest.approx(20.0 + 10.0 * f, rel=1e-12)
    assert (t.ttp_tokens, t.ttp_step, t.reached_s) == (2450, 3, 30.0)
    assert t.crossing == pytest.approx(f, rel=1e-12)
    assert t.summary() == {"ttp_s": t.ttp_s, "ttp_tokens": 2450, "ttp_step": 3, "ttp_reached_s": 30.0}
    # the first evaluation already at the target: no earlier point, its own time
    first = TTPTracker(target_ppl=100.0)
    assert first.update(90.0, 5.0, 500, 1) and (first.ttp_s, first.crossing) == (5.0, 1.0)
    # a NaN evaluation gives no point to interpolate from: the reaching evaluation's time
    after_nan = TTPTracker(target_ppl=100.0)
    after_nan.update(math.nan, 5.0, 500, 1)
    assert after_nan.update(90.0, 10.0, 1000, 2) and after_nan.ttp_s == 10.0


def test_dense_eval_gap_halves_towards_the_target_down_to_the_resolution():
    """On a log-linear curve ``log p = 7 - 0.001 s`` (target ``e^5``: 2000 samples) the
    rule predicts the samples to go exactly and asks for half of them; near the target
    it stops at ``resolution`` x the samples since the start; off, before two
    evaluations, once reached or where perplexity rises it leaves the cadence alone."""
    def at(s):
        return (s, math.exp(7 - 0.001 * s))

    target = math.exp(5)
    assert dense_eval_gap([at(0), at(400)], target, 0.01) == pytest.approx(800)
    assert dense_eval_gap([at(1900), at(1990)], target, 0.01) == pytest.approx(19.9)
    assert dense_eval_gap([at(1900), at(1990)], target, 0.01, start=1000) == pytest.approx(9.9)
    assert dense_eval_gap([at(0), at(400)], target, 0.0) is None
    assert dense_eval_gap([at(400)], target, 0.01) is None
    assert dense_eval_gap([at(1900), at(2100)], target, 0.01) is None  # reached
    assert dense_eval_gap([at(0), at(400)], None, 0.01) is None
    assert dense_eval_gap([(0, 100.0), (10, 120.0)], 50.0, 0.01) is None  # rising
    assert dense_eval_gap([(0, math.nan), (10, 120.0)], 50.0, 0.01) is None


def test_dense_eval_gap_survives_a_noisy_evaluation_near_the_target():
    """Near the target the curve is flat and one evaluation's noise can make the last
    two rise (CONA on GPT-3's seed 2 in the run at ``813f09b``: 189.9 then 190.4
    against 189.26) or stay level: the rule must keep bracketing finely from the run's
    trend, not hand the crossing back to a cadence 8 % of the run away."""
    target = 189.26
    run = [(1792, 330.0), (2624, 245.1), (3456, 214.2), (4064, 196.9), (4224, 190.4)]
    rose = dense_eval_gap([*run, (4256, 190.9)], target, 0.01, start=1600)
    assert rose is not None and rose <= 0.01 * (4256 - 1600) * 1.0001  # the finest gap
    level = dense_eval_gap([*run, (4256, 190.39)], target, 0.01, start=1600)
    assert level is not None and level < 100  # a flat pair alone predicts ~3.6k samples
    # the run's secant is steeper than the local rate, so the gap errs short
    trend = dense_eval_gap(run[:-1], target, 0.0001, start=1600)
    local = (math.log(196.9) - math.log(target)) / ((math.log(214.2) - math.log(196.9)) / 608)
    assert trend < local / 2
    assert dense_eval_gap([(0, 300.0), (10, 320.0), (20, 330.0)], 50.0, 0.01) is None
    # a drop after a plateau: the last pair is steeper than the run and decides
    plateau = [(0, 300.0), (1000, 290.0), (1100, 200.0)]
    to_go = (math.log(200.0) - math.log(190.0)) / ((math.log(290.0) - math.log(200.0)) / 100)
    assert dense_eval_gap(plateau, 190.0, 0.0001) == pytest.approx(to_go / 2)
    # nothing usable last (NaN, or a perplexity that is not positive): no rule
    assert dense_eval_gap([*run, (4300, math.nan)], target, 0.01) is None
    assert dense_eval_gap([*run, (4300, 0.0)], target, 0.01) is None


def test_provenance_takes_the_commit_it_is_given(monkeypatch):
    """Catches a GPU-machine result with the wrong commit: the tree travelled there with
    the session's first ``.git``, and the H200 summary of 2026-12-04 said
    ``c932ec4+dirty`` for code at babdd60.  ``GEOCONA_COMMIT`` wins where set; without it
    and without git, None (never a made-up value)."""
    from jobruntime.metrics import provenance

    def no_git(*args, **kwargs):
        raise OSError("no git here")

    monkeypatch.setattr(subprocess, "run", no_git)
    monkeypatch.delenv("GEOCONA_COMMIT", raising=False)
    assert provenance([])["commit"] is None
    monkeypatch.setenv("GEOCONA_COMMIT", "abc1234")
    assert provenance([])["commit"] == "abc1234"
    monkeypatch.undo()  # git answers again: the variable still wins
    monkeypatch.setenv("GEOCONA_COMMIT", "abc1234")
    assert provenance([])["commit"] == "abc1234"


def test_ttp_tracker_state_round_trip_and_old_checkpoints():
    """Catches a resumed run that loses the last evaluation above the target (it would
    take the next crossing without interpolation) and checkpoints written before
    interpolation that no longer load: a tracker and GeoMesh's RunStats restored from
    their state mid-run finish with the TTP of an uninterrupted run; an old state (only
    ttp_s/_tokens/_step) keeps its TTP, with reached_s = ttp_s."""
    from dataclasses import asdict

    from geomesh.fleet.cluster import load_cluster
    from geomesh.report import RunStats

    whole = TTPTracker(target_ppl=100.0)
    whole.update(130.0, 10.0, 1000, 1)
    resumed = TTPTracker.from_state(json.loads(json.dumps(asdict(whole))), 100.0)
    for t in (whole, resumed):
        assert t.update(70.0, 20.0, 2000, 2)
    assert asdict(resumed) == asdict(whole) and 10.0 < whole.ttp_s < 20.0
    old = TTPTracker.from_state({"ttp_s": 20.0, "ttp_tokens": 2000, "ttp_step": 2}, 100.0)
    assert (old.ttp_s, old.reached_s, old.ttp_step, old.reached) == (20.0, 20.0, 2, True)
    assert not TTPTracker.from_state({"ttp_s": None, "ttp_tokens": None, "ttp_step": None},
                                     100.0).reached

    cluster = load_cluster("two_worker")
    stats = RunStats.for_cluster(cluster, 100.0)
    stats.time_s, stats.tokens = 10.0, 1000
    stats.evaluated(math.log(130.0), 130.0, 1)
    back = RunStats.for_cluster(cluster, None)
    back.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    for s in (stats, back):
        s.time_s, s.tokens = 20.0, 2000
        assert s.evaluated(math.log(70.0), 70.0, 2)
    assert back.state_dict() == stats.state_dict()
    legacy = stats.state_dict()
    legacy["ttp"] = {"target_ppl": 100.0, "ttp_s": 20.0, "ttp_tokens": 2000, "ttp_step": 2}
    back.load_state_dict(legacy)
    assert (back.ttp.ttp_s, back.ttp.reached_s, back.ttp.ttp_step) == (20.0, 20.0, 2)


def test_a_wan_idle_not_measured_stays_out_of_the_fractions():
    """Catches a region's summary that gives another region's worker this job's own exchange
    wait as its WAN idle (one job per region measures its own only): a worker added with
    ``wan_idle_s=None`` keeps ``None`` through a checkpoint, and the fractions are over the
    measured workers (here the first: 2 s straggler, 1 s WAN of 10 s)."""
    from geomesh.fleet.cluster import load_cluster
    from geomesh.report import RunStats

    cluster = load_cluster("two_worker")
    a, b = (w.name for w in cluster.workers)
    stats = RunStats.for_cluster(cluster, None)
    for _ in range(2):
        stats.add_worker(a, compute_s=3.5, straggler_idle_s=1.0, wan_idle_s=0.5)
        stats.add_worker(b, compute_s=4.5, straggler_idle_s=0.0, wan_idle_s=None)
    back = RunStats.for_cluster(cluster, None)
    back.load_state_dict(json.loads(json.dumps(stats.state_dict())))
    for s in (stats, back):
        assert s.workers[b].wan_idle_s is None and s.workers[a].wan_idle_s == 1.0
        assert s._frac("straggler_idle_s") == 0.2 and s._frac("wan_idle_s") == 0.1


_CPU_LAYER_SCRIPT = r"""
import torch
from jobruntime import cpu_compat
assert cpu_compat.enable() and cpu_compat.enable()  # idempotent
a = torch.zeros(3, device="cuda"); b = torch.ones(2, device=torch.cuda.current_device())
c = torch.empty(1).cuda(); d = torch.ones(1).to("cuda:0")
assert {t.device.type for t in (a, b, c, d)} == {"cpu"}
with torch.cuda.stream(torch.cuda.Stream()):
    torch.cuda.synchronize()
# megatron's RNG tracker forks and restores the generator state
from megatron.core import tensor_parallel
tracker = tensor_parallel.get_cuda_rng_tracker()
tracker.reset(); tracker.add("model-parallel-rng", 7)
torch.manual_seed(0); x0 = torch.rand(1)
torch.manual_seed(0)
with tracker.fork():
    torch.rand(5)
x1 = torch.rand(1)
assert torch.equal(x0, x1), "fork() did not restore the default generator"
# gradient clipping: same math as torch's clip_grad_norm_
from megatron.core.optimizer import clip_grads
p = [torch.nn.Parameter(torch.randn(10)) for _ in range(3)]
q = [torch.nn.Parameter(t.detach().clone()) for t in p]
for x, y in zip(p, q):
    x.grad = torch.randn(10); y.grad = x.grad.clone()
norm = torch.norm(torch.stack([x.grad.norm() for x in p])).item()
clip_grads.clip_grad_by_total_norm_fp32(p, 0.5, norm)
torch.nn.utils.clip_grad_norm_(q, 0.5)
assert all(torch.allclose(x.grad, y.grad, atol=1e-6) for x, y in zip(p, q))
print("ok")
"""


def test_cpu_layer_maps_cuda_to_cpu_and_clips_like_torch():
    """Catches the CPU layer missing a CUDA entry point megatron-core uses
    (device="cuda", streams, RNG tracker fork, gradient clipping). Runs in a
    fresh interpreter because the layer is process-wide."""
    proc = subprocess.run([sys.executable, "-c", _CPU_LAYER_SCRIPT], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


_CRASH_SCRIPT = r"""
import sys
from pathlib import Path
from megatron.core import dist_checkpointing
from jobruntime.config import load_config
from jobruntime.parallel import initialize_layout, set_seed
from jobruntime.trainer import Trainer
from jobruntime import checkpoint
root = Path(sys.argv[1])
cfg = load_config("tiny_gpt", ["model.num_layers=1", "model.vocab_size=512"])
initialize_layout(cfg); set_seed(1)
tr = Trainer(cfg)
checkpoint.save_checkpoint(root, tr, consumed_samples=8)
tr.step = 2
real_save = dist_checkpointing.save
def crash(state, path, *a, **k):
    real_save(state, path, *a, **k)   # the data is on disk...
    raise KeyboardInterrupt("killed")  # ...but the process dies before finishing
checkpoint.dist_checkpointing.save = crash
try:
    checkpoint.save_checkpoint(root, tr, consumed_samples=16)
except KeyboardInterrupt:
    pass
print(checkpoint.find_checkpoint(root).name)
"""


def test_crash_during_save_never_yields_a_valid_checkpoint(tmp_path):
    """Catches a half-written checkpoint being picked up on resume: after a
    crash inside the save of step 2, the newest loadable one is still step 0, and
    the save's ``.tmp`` folder is gone (the exception's path removes it)."""
    proc = subprocess.run([sys.executable, "-c", _CRASH_SCRIPT, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "iter_0000000"
    assert not (tmp_path / "iter_0000002.tmp").exists() and not (tmp_path / "iter_0000002").exists()


def test_train_settings_out_of_range_are_config_errors():
    """Catches settings that used to fail late or silently: eval_iters=0 gave
    val ppl 1.0 (a false TTP), log_interval=0 a ZeroDivisionError, lr=nan a
    diverged run."""
    for override, needle in [("train.eval_iters=0", "train.eval_interval=0"),
                             ("train.log_interval=0", "log_interval"),
                             ("train.lr=.nan", "train.lr"), ("train.lr=-1", "train.lr"),
                             ("train.min_lr=1", "min_lr"), ("train.target_ppl=0.5", "target_ppl")]:
        cfg = load_config("tiny_gpt", [override])
        with pytest.raises(ConfigError, match=needle):
            cfg.validate()
    load_config("tiny_gpt").validate()


def test_metrics_of_a_reused_run_dir_are_replaced_and_of_a_resume_kept(tmp_path):
    """Catches a reused --run-dir whose metrics.jsonl mixes two runs, and a
    resume that loses (or duplicates) the history before its first step."""
    from jobruntime.metrics import MetricsWriter

    def write(steps):
        w = MetricsWriter(tmp_path, wandb_mode="disabled")
        for s in steps:
            w.log({"step": s, "loss": float(s)})
        w.close()
        return [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]

    assert write(range(1, 9)) == list(range(1, 9))
    assert write(range(5, 9)) == list(range(1, 9))  # resumed at step 4
    assert write(range(1, 4)) == [1, 2, 3]  # a fresh run in the same folder


def _agreed_run_dir():
    import torch.distributed as dist

    from jobruntime.parallel import init_distributed, same_run_dir

    init_distributed()
    return str(same_run_dir(Path(f"runs/demo-{dist.get_rank()}")))


def test_all_ranks_use_rank0s_run_dir():
    """Catches ranks that derive the default run folder from their own clocks
    and split one checkpoint across two folders."""
    from tests.dist_utils import launch

    assert launch(_agreed_run_dir, 2, timeout_s=300) == ["runs/demo-0", "runs/demo-0"]


@pytest.mark.parametrize("stop", [OSError("disk full"), KeyboardInterrupt()])
def test_a_save_cut_short_leaves_no_tmp_folder(tmp_path, stop):
    """Catches a stale ``iter_N.tmp`` left in a run folder by a save that failed or was
    stopped (a SIGTERM raises ``StopRequested`` in the middle of ``dist_checkpointing.save``):
    the leader removes its ``.tmp`` folder and re-raises; a ``.tmp`` left by a rank killed
    mid-save (which can remove nothing) goes at the next save with that prefix, not one
    of another prefix; the complete checkpoints stay."""
    from jobruntime.checkpoint import COMPLETE, committed_folder, find_checkpoint

    root = tmp_path / "checkpoints"
    with committed_folder(root, "iter_0000002") as tmp:
        (tmp / "shard").write_text("x")
    with pytest.raises(type(stop)), committed_folder(root, "iter_0000004") as tmp:
        (tmp / "shard").write_text("x")
        raise stop
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000002", "latest"]
    killed = [root / "iter_0000006.tmp", root / "outer_0000001.tmp"]  # a kill's leftovers
    for k in killed:
        k.mkdir()
    with committed_folder(root, "iter_0000008") as tmp:
        (tmp / "shard").write_text("x")
    assert sorted(p.name for p in root.iterdir()) == [
        "iter_0000002", "iter_0000008", "latest", "outer_0000001.tmp"]
    assert find_checkpoint(root) == root / "iter_0000008"
    assert (root / "iter_0000002" / COMPLETE).is_file()
    # a checkpoint that keep_last deleted (or a typo) is named missing, with what is left
    # ("no complete checkpoint in" it, before)
    from jobruntime.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match=r"iter_0000004' does not exist; its folder "
                       r"holds iter_0000002, iter_0000008 \(checkpoint.keep_last"):
        find_checkpoint(root / "iter_0000004")
    # nothing there: the line names the setting and what to point it at (it said only
    # "'/nonexistent' does not exist", break-test helper)
    with pytest.raises(CheckpointError, match=r"checkpoint '.*nowhere' does not exist; point "
                       r"checkpoint.load .* at a run's checkpoints/ folder"):
        find_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match=r"no complete checkpoint in '.*latest'"):
        find_checkpoint(root / "latest")  # there, but a file: not "does not exist"
