"""``python -m geomesh.launch_local``: the lighthouse and one torchrun per region on this machine.

Bad inputs and the four-shape cluster's jobs are checked without training; the
happy path, a lost region and Ctrl-C run the real command on a two-region
cluster of one process each (tiny_gpt at test size, as tests/test_geomesh_real.py).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.dist_utils import child_env, free_port
from tests.test_geomesh_real import OVERRIDES

REPO = Path(__file__).resolve().parent.parent
# test_geomesh_real's tiny run; the jobs' heartbeat (and so the lighthouse's) shorter
SMALL = [*OVERRIDES, "geomesh.heartbeat_s=5", "geomesh.timeout_s=60"]
REGIONS = ("East US", "West Europe")


def _cluster(root: Path, port: int, mode: str = "real", tp3: bool = False) -> Path:
    """Two regions of one process each; GPUs of two speeds, so that their H_i differ
    (``tp3``: the second region is 3 processes at TP3, which no test model splits)."""
    raw = {"name": "two_cpu", "mode": mode, "rendezvous": f"127.0.0.1:{port}",
           "regions": [{"name": r, "id": i} for i, r in enumerate(REGIONS)],
           "workers": [{"name": "w0", "gpu": "A100-80GB", "num_gpus": 1, "region": REGIONS[0]},
                       {"name": "w1", "gpu": "V100", "num_gpus": 3 if tp3 else 1,
                        "region": REGIONS[1], **({"tp": 3} if tp3 else {})}]}
    path = root / f"two_{mode}{'_tp3' if tp3 else ''}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {**child_env(), "PYTHONPATH": str(REPO), "WANDB_SILENT": "true", **extra}
    for k in ("GEOCONA_FAULT", "GEOCONA_FAULT_REGION", "GEOMESH_SECRET"):
        if k not in extra:
            env.pop(k, None)
    return env


def _cmd(cluster: Path | str, run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "geomesh.launch_local", "--cluster", str(cluster),
            "--run-dir", str(run_dir), *overrides]


def _launch(cluster, run_dir, *overrides, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(_cmd(cluster, run_dir, *overrides), cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=env or _env())


def _errors(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("error:")]


def _processes_naming(marker: str) -> list[str]:
    """Command lines of living processes that mention ``marker`` (a test's tmp folder)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                out.append(f"{d.name}: {cmd[:200]}")
    return out


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        # connections of the run may linger in TIME_WAIT; only a listener makes bind fail
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_bad_inputs_exit_2_with_one_line(tmp_path):
    """Catches a launcher that starts processes (or writes folders) for input it cannot
    run, or answers it with a traceback: a missing cluster file, an emulated cluster,
    an override of what the launcher sets per region, an override every region's job
    would refuse (one the job ignores, a GeoMesh setting out of range), a run folder
    holding results,
    and a rendezvous port already taken (the lighthouse cannot bind) each exit 2
    with one ``error:`` line that names the problem."""
    port = free_port()
    real = _cluster(tmp_path, port)
    emulated = _cluster(tmp_path, port, mode="emulated")
    cases = [
        ((tmp_path / "nope.yaml", tmp_path / "r1"), "nope.yaml"),
        ((emulated, tmp_path / "r2"), "emulated"),
        ((real, tmp_path / "r3", "geomesh.region=East US"), "geomesh.region"),
        ((real, tmp_path / "r4", "geomesh.method=none"), "geomesh.method=none"),
        ((real, tmp_path / "r5", "geomesh.nope=1"), "geomesh.nope"),
        # each region's train.py refused these after every process had started (exit 1)
        ((real, tmp_path / "r6", "cona.decision_interval=3"), "has no effect: cona is off"),
        ((real, tmp_path / "r7", "geomesh.outer_steps=0"), "geomesh.outer_steps"),
        # a region shape that does not split the model: each job refused it once its
        # ranks had started, and the launcher said exit 1 (a rank stopped by torchrun)
        ((_cluster(tmp_path, port, tp3=True), tmp_path / "r8"), "cannot split"),
        # each region trained alone (ddp's all-reduce never crossed regions)
        ((real, tmp_path / "r9", "geomesh.method=ddp"), "geomesh.method=ddp"),
    ]
    for args, word in cases:
        proc = _launch(*args, timeout=120)
        errors = _errors(proc.stderr)
        assert proc.returncode == 2 and len(errors) == 1 and word in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr and not args[1].exists(), proc.stderr
    held = tmp_path / "held"
    (held / "west-europe").mkdir(parents=True)
    (held / "west-europe" / "summary.json").write_text("{}")
    proc = _launch(real, held, timeout=120)
    errors = _errors(proc.stderr)
    assert proc.returncode == 2 and len(errors) == 1 and "already holds" in errors[0], proc.stderr
    assert not (held / "east-us").exists()
    with socket.socket() as taken:  # someone else serves at the rendezvous
        taken.bind(("127.0.0.1", port))
        taken.listen()
        proc = _launch(real, tmp_path / "r6", timeout=120)
    errors = _errors(proc.stderr)
    assert proc.returncode == 2 and len(errors) == 1 and "lighthouse" in errors[0], proc.stderr
    assert not _processes_naming(str(tmp_path))


def test_ddp_as_one_job_per_region_is_refused():
    """Catches ``geomesh.method=ddp`` with ``geomesh.region`` accepted: each region's job
    all-reduced over its own processes only, so the regions trained alone to other
    weights (helper's reading); one job per region runs geomesh or diloco."""
    from geomesh.fleet.job_check import check_settings
    from jobruntime.config import ConfigError, load_config

    def job(method):
        return load_config("tiny_gpt", [f"geomesh.method={method}", "geomesh.region=East US",
                                        "geomesh.cluster=two_worker_real"])

    with pytest.raises(ConfigError, match="geomesh.method=ddp all-reduces every step"):
        check_settings(job("ddp"), schedule=False)
    check_settings(job("diloco"), schedule=False)


def test_a_layout_schedule_passes_the_launchers_checks(tmp_path):
    """Catches a launcher that refused every ``cona.schedule`` (review helper): checking
    each region's shape before the start ran the schedule's check, which needs the job's
    own ``geomesh.region`` that the launcher sets per region; the command docs/geomesh.md
    gives was refused naming the launcher itself as the fix."""
    from geomesh.launch_local import check_inputs, parse_args

    cluster, _, cfg = check_inputs(parse_args([
        "--cluster", str(REPO / "geomesh/clusters/four_shape_cpu.yaml"), "--run-dir",
        str(tmp_path / "run"), "geomesh.outer_steps=4", "cona.enabled=true",
        "cona.schedule=[{after_step: 2, region: West Europe, tp: 2, pp: 1}]"]))
    assert cfg.cona.schedule and not (tmp_path / "run").exists()


def test_four_shape_cluster_jobs():
    """Catches a four-shape cluster or a launcher that runs a region with the wrong
    process count or layout, or GPU kinds the planner cannot tell apart: the
    shipped four_shape_cpu.yaml gives four torchrun jobs of 1, 2, 2, 2 processes
    at TP1, DP2, TP2 and PP2 (7 processes, for tiny_gpt: 4 heads, 4 layers), each
    with its own region and folder, and the planner gives the four regions
    distinct batch sizes or inner steps (b_i, H_i) for tiny_gpt."""
    from geomesh.fleet.cluster import load_cluster
    from geomesh.fleet.planner import Planner
    from geomesh.launch_local import plan_jobs
    from jobruntime.config import load_config

    cluster = load_cluster("four_shape_cpu")
    assert cluster.mode == "real" and cluster.rendezvous.startswith("127.0.0.1:")
    jobs = plan_jobs(cluster, Path("c.yaml"), Path("/runs/x"), "tiny_gpt", ["geomesh.outer_steps=2"])
    assert [(j.nproc, j.layout) for j in jobs] == [
        (1, (1, 1, 1)), (2, (1, 1, 2)), (2, (2, 1, 1)), (2, (1, 2, 1))]
    assert len({j.run_dir for j in jobs}) == 4
    for j in jobs:
        cmd = " ".join(j.cmd)
        assert f"--nproc-per-node {j.nproc} " in cmd and f"--run-dir /runs/x/{j.slug}" in cmd
        assert j.cmd[-2:] == ["geomesh.cluster=c.yaml", f"geomesh.region={j.region}"]
        assert "geomesh.outer_steps=2" in j.cmd
    cfg = load_config("tiny_gpt")
    assert cfg.model.num_attention_heads % 2 == 0 and cfg.model.num_layers % 2 == 0
    plan = Planner.from_job_config(cfg, cluster, balance=cfg.geomesh.balance).plan()
    assert len({(w.batch_size, w.inner_steps) for w in plan.workers}) == 4, plan.to_dict()


def test_happy_path(tmp_path, cache_dir):
    """Catches a launcher whose regions do not find each other, that reports success
    before every region finished, or that leaves a process behind: two regions (one
    process each) train 2 rounds; the command exits 0, each region's folder holds its
    summary.json with the same final validation loss as the other region's (both
    evaluate the same θ_global after the same round: equal to the last digit), the
    table names both regions with exit code 0, and afterwards the lighthouse's port
    is free and no process of the run is left."""
    port = free_port()
    cluster = _cluster(tmp_path, port)
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = _launch(cluster, run_dir, f"data.cache_dir={cache_dir}", *SMALL, "geomesh.outer_steps=2")
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    summaries = [json.loads((run_dir / slug / "summary.json").read_text())
                 for slug in ("east-us", "west-europe")]
    # "steps": metrics.jsonl's step, outer steps here, as an interrupted run's summary says
    assert all(s["outer_steps"] == s["steps"] == 2 and s["mode"] == "real" for s in summaries)
    # each region's folder is self-contained, as an ordinary run's (it had no tokenizer)
    assert all((run_dir / slug / "tokenizer.model").is_file() for slug in ("east-us", "west-europe"))
    assert summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]
    # a region measures its own worker's WAN idle only: the other's exchange wait is not
    # in its message (it reported its own wait as the other's, 2.12 s against 3.88 s)
    for region, s in zip(REGIONS, summaries):
        wan = {w["region"]: w["wan_idle_s"] for w in s["workers"]}
        assert wan[region] is not None and wan[REGIONS[REGIONS.index(region) - 1]] is None, wan
        assert s["wan_idle_frac"] is not None
    table = proc.stdout.splitlines()
    head = next(i for i, x in enumerate(table) if x.split()[:3] == ["region", "tp/pp/dp", "exit"])
    rows = table[head + 1:head + 3]
    for region, row in zip(REGIONS, rows):
        assert row.startswith(region) and " 0 " in row and "summary.json" in row, proc.stdout
    assert _port_free(port) and not _processes_naming(str(tmp_path))
    print(f"launch_local happy path: {wall:.1f} s")


def test_resume_goes_on_in_every_region_from_its_checkpoints(tmp_path, cache_dir):
    """Catches a launcher that could not go on with a run: it refused any --run-dir that
    held results, so a stopped GeoMesh run meant one torchrun per region by hand.  A run
    of 2 rounds saving every round, then ``--resume geomesh.outer_steps=3``: exit 0, each
    region's metrics.jsonl goes on to round 3 in the same folder (one history), its
    summary says 3 outer steps, and the regions end on the same θ_global (equal final
    validation loss).  A --resume where a region holds no complete checkpoint or has
    nothing left to run, with --config or with its own checkpoint.load, is refused before
    any process starts (exit 2, one line)."""
    port = free_port()
    cluster = _cluster(tmp_path, port)
    run_dir = tmp_path / "run"
    base = [f"data.cache_dir={cache_dir}", *SMALL, "checkpoint.save_interval=1"]
    first = _launch(cluster, run_dir, *base, "geomesh.outer_steps=2")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    for args, why in ((["--resume"], "nothing left to run; raise geomesh.outer_steps"),
                      (["--resume", "geomesh.outer_steps=3", "checkpoint.load=/x"],
                       "drop this override")):
        proc = _launch(cluster, run_dir, *args)  # refused before any process starts
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr[-2000:]
    # A stop while the regions save: West Europe's round 2 is not complete.  Each region
    # going on from its own newest checkpoint (as --resume did) is refused inside the jobs
    # (each one's first round sees the other's messages of another round), not trained on
    # into two models; --resume takes round 1, the newest both hold.
    shutil.rmtree(run_dir / "west-europe" / "checkpoints" / "outer_0000002")
    own_newest = ("import sys, geomesh.launch_local as L; "
                  "L.resume_load = lambda j, step: f'checkpoint.load={j.run_dir}/checkpoints'; "
                  "L.set_aside_newer = lambda jobs, step: None; "
                  "sys.exit(L.main(sys.argv[1:]))")
    split = subprocess.run([sys.executable, "-c", own_newest, *_cmd(cluster, run_dir, "--resume",
                                                                    "geomesh.outer_steps=3")[3:]],
                           cwd=REPO, capture_output=True, text=True, timeout=600, env=_env())
    assert split.returncode == 2, split.stdout[-2000:] + split.stderr[-3000:]
    for region in REGIONS:
        line = next(x for x in _errors(split.stderr) if region in x)
        assert "started from checkpoints of different outer steps" in line, line
    again = _launch(cluster, run_dir, "--resume", "geomesh.outer_steps=3")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "resuming every region at outer step 1, the newest all of them saved ('East US' " \
        "saved 2" in again.stdout, again.stdout
    assert (run_dir / "east-us" / "checkpoints" / "superseded" / "outer_0000002").is_dir()
    summaries = []
    for slug in ("east-us", "west-europe"):
        steps = [json.loads(x)["step"] for x in
                 (run_dir / slug / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3], (slug, steps)
        summaries.append(json.loads((run_dir / slug / "summary.json").read_text()))
    assert all(s["outer_steps"] == 3 and "interrupted" not in s for s in summaries)
    assert summaries[0]["final_val_loss"] == summaries[1]["final_val_loss"]
    fresh = tmp_path / "fresh"
    for args, why in (([fresh, "--resume"], "holds no config.yaml"),
                      ([run_dir, "--resume", "--config", "tiny_gpt"], "drop --config")):
        (fresh / "east-us").mkdir(parents=True, exist_ok=True)
        proc = _launch(cluster, *args)
        assert proc.returncode == 2 and why in proc.stderr, proc.stderr[-2000:]
        assert len(_errors(proc.stderr)) == 1, proc.stderr
    (run_dir / "west-europe" / "checkpoints").rename(tmp_path / "moved")
    proc = _launch(cluster, run_dir, "--resume", "geomesh.outer_steps=4")
    assert proc.returncode == 2 and "holds no complete checkpoint" in proc.stderr, proc.stderr


def test_lost_region_is_named(tmp_path, cache_dir):
    """Catches a launcher that exits 0 (or hangs) when a region dies, or names the
    wrong one: West Europe's process is SIGKILLed after the inner steps of round 1
    (GEOCONA_FAULT=train@1 for that region only); East US finishes the 3 rounds
    without it (on_worker_loss=continue) and exits 0, and the launcher exits 1 with
    exactly one error line, naming West Europe, the SIGKILL and its log."""
    cluster = _cluster(tmp_path, free_port())
    run_dir = tmp_path / "run"
    env = _env(GEOCONA_FAULT="train@1", GEOCONA_FAULT_REGION="West Europe")
    proc = _launch(cluster, run_dir, f"data.cache_dir={cache_dir}", *SMALL,
                   "geomesh.outer_steps=3", env=env)
    errors = _errors(proc.stderr)
    assert proc.returncode == 1 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "'West Europe'" in errors[0] and "SIGKILL" in errors[0], errors
    assert str(run_dir / "west-europe" / "job.log") in errors[0], errors
    east = json.loads((run_dir / "east-us" / "summary.json").read_text())
    assert east["outer_steps"] == 3
    assert not (run_dir / "west-europe" / "summary.json").exists()
    # nothing saved (save_interval=0): no --resume offered
    assert proc.stderr.rstrip().splitlines()[-1].startswith(
        "cannot resume: no region saved a complete checkpoint"), proc.stderr
    assert not _processes_naming(str(tmp_path))


def test_ctrl_c_stops_every_process(tmp_path, cache_dir):
    """Catches orphans on Ctrl-C: the launcher's children run in sessions of their own
    (a terminal's Ctrl-C reaches the launcher only), so a launcher that does not stop
    them leaves every region training.  SIGINT once both regions' workers exist (a run
    of 50 rounds): the launcher exits 130 within its stop grace, and no process of the
    run is left.  The launcher starts with SIGINT ignored, as a shell's background job
    (``&`` without job control) inherits it: it must stop on SIGINT all the same (it
    finished all 50 rounds and exited 0 when it relied on Python's default handler)."""
    cluster = _cluster(tmp_path, free_port())
    run_dir = tmp_path / "run"
    p = subprocess.Popen(_cmd(cluster, run_dir, f"data.cache_dir={cache_dir}", *SMALL,
                              "geomesh.outer_steps=50"),
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(), preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                      signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 300
        # the workers' own command lines name their run folders (train.py --run-dir ...)
        while time.monotonic() < deadline and p.poll() is None and not all(
                any("train.py" in c and "torch.distributed.run" not in c and f"run/{slug} " in c
                    for c in _processes_naming(str(run_dir)))
                for slug in ("east-us", "west-europe")):
            time.sleep(0.5)
        assert p.poll() is None, p.communicate()
        time.sleep(3)  # into their imports
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130, out[-2000:] + err[-3000:]
    assert "interrupted" in err and "Traceback" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1].startswith("cannot resume: "), err[-3000:]
    time.sleep(1)
    assert not _processes_naming(str(tmp_path))


# torchrun's report of a failed rank (torch 2.13), as it ends a job.log
TORCHRUN_FAILURE = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/repo/train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_00:35:27
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : {code} (pid: 18622) {signal}
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def _job(tmp_path: Path, region: str, cmd: list[str] | None = None, log: str = ""):
    from geomesh.launch_local import RegionJob, region_slug

    job = RegionJob(region=region, slug=region_slug(region), nproc=1, layout=(1, 1, 1),
                    run_dir=tmp_path / region_slug(region))
    job.run_dir.mkdir()
    job.log.write_text(log)
    if cmd:
        job.proc, job.t0 = subprocess.Popen(cmd), time.monotonic()
    return job


def test_resume_hint_names_the_launchers_resume_or_why_not(tmp_path):
    """Catches a failed or stopped run that leaves the user only each region's own
    ``train.py`` advice (one torchrun job's, not the run's): where every region holds a
    complete checkpoint below ``geomesh.outer_steps`` the hint is this launcher's
    ``--resume`` command (which ``parse_args`` reads back); otherwise it says why not,
    naming a region without a checkpoint before a finished one."""
    from geomesh.launch_local import RegionJob, parse_args
    from geomesh.launch_resume import (
        LaunchError,
        resume_hint,
        resume_load,
        resume_round,
        set_aside_newer,
    )
    from jobruntime.outputs import saved_rounds

    def job(region, saved):
        folder = tmp_path / region.lower()
        for step in saved:
            (folder / "checkpoints" / f"outer_{step:07d}").mkdir(parents=True)
            (folder / "checkpoints" / f"outer_{step:07d}" / "COMPLETE").write_text("x\n")
        return RegionJob(region, region.lower(), 1, (1, 1, 1), folder)

    east, west = job("East", [1, 2]), job("West", [1])
    assert resume_round([east, west], outer_steps=3) == 1  # the newest both hold
    assert resume_load(west, 1) == f"checkpoint.load={west.run_dir}/checkpoints/outer_0000001"
    apart = job("Apart", [2])
    with pytest.raises(LaunchError, match="hold no outer step in common .'West' 1; 'Apart' 2"):
        resume_round([west, apart], outer_steps=3)
    hint = resume_hint([east, west], "two.yaml", tmp_path, outer_steps=3)
    command = hint.removeprefix("go on with: python -m geomesh.launch_local ").split()
    args = parse_args(command)
    assert (args.cluster, args.run_dir, args.resume) == ("two.yaml", str(tmp_path), True), hint
    spaced = resume_hint([east, west], "my cluster.yaml", tmp_path, outer_steps=3,
                         overrides=["geomesh.outer_steps=3"])  # a --resume's own, repeated
    args = parse_args(shlex.split(spaced.removeprefix("go on with: python -m "
                                                      "geomesh.launch_local ")))
    assert (args.cluster, args.overrides) == ("my cluster.yaml", ["geomesh.outer_steps=3"])
    assert resume_hint([east, west], "two.yaml", tmp_path, outer_steps=1) == (
        "cannot resume: every region saved outer step 1 of geomesh.outer_steps=1: nothing "
        "left to run; raise geomesh.outer_steps to train further")
    assert resume_hint([west, apart], "two.yaml", tmp_path, outer_steps=3).startswith(
        "cannot resume: the regions hold no outer step in common")
    bare = job("Bare", [])
    assert resume_hint([east, bare], "two.yaml", tmp_path, outer_steps=2).startswith(
        f"cannot resume: {tmp_path / 'bare'} holds no complete checkpoint, so region 'Bare'")
    assert resume_hint([bare], "two.yaml", tmp_path, outer_steps=2).startswith(
        "cannot resume: no region saved a complete checkpoint")
    # going back to round 1: East's round 2 leaves every search for a checkpoint (a later
    # resume must not take it for the round 2 the run trains again), and is kept
    (east.run_dir / "checkpoints" / "latest").write_text("outer_0000002\n")
    (east.run_dir / "checkpoints" / "outer_3").mkdir()  # not a name save_state writes
    (east.run_dir / "checkpoints" / "outer_3" / "COMPLETE").write_text("x\n")
    assert saved_rounds(east.run_dir) == [1, 2]
    assert set_aside_newer([east, west], 1).startswith(
        "resuming every region at outer step 1, the newest all of them saved ('East' saved 2;")
    assert saved_rounds(east.run_dir) == [1]
    assert (east.run_dir / "checkpoints" / "latest").read_text().strip() == "outer_0000001"
    assert (east.run_dir / "checkpoints" / "superseded" / "outer_0000002" / "COMPLETE").is_file()
    assert set_aside_newer([east, west], 1) is None


def test_failure_lines_and_stalled_survivors(tmp_path):
    """Catches a failure line without the region, cause or log, a run failed on bad
    input reported as a crash, and a survivor that hangs the launcher forever after
    another region failed.  Logs with torchrun's real failure report (rank exit code 2
    with the job's ``error:`` line; -9): the lines name the region, ``exit code 1``,
    the job's error or SIGKILL, and the log; only all-bad-input counts as bad input.
    A rank's traceback gives its exception line, not torchrun's ChildFailedError.
    Then one job fails (exit 1) while another sleeps silently: ``wait_jobs`` with a
    stall limit of 2 s stops the sleeper within the limit plus the stop grace,
    marked stalled, and its line says the launcher stopped it."""
    from geomesh.launch_local import STOP_GRACE_S, bad_input_only, failure_line, wait_jobs

    bad = "error: geomesh.topk_k must be in [1, 256]\n" + TORCHRUN_FAILURE.format(code=2, signal="")
    killed = TORCHRUN_FAILURE.format(code=-9, signal="(SIGKILL)")
    a, b = _job(tmp_path, "East US", log=bad), _job(tmp_path, "West Europe", log=killed)
    a.rc = b.rc = 1
    assert failure_line(a) == (f"error: region 'East US' failed with exit code 1 (a process exited "
                               f"with 2; geomesh.topk_k must be in [1, 256]); log: {a.log}")
    assert failure_line(b) == (f"error: region 'West Europe' failed with exit code 1 (a process "
                               f"was killed by SIGKILL); log: {b.log}")
    crash = ("[rank1]:   File \"geomesh/exchange/transport.py\", line 91, in decode_bundle\n"
             "[rank1]: TypeError: object of type 'NoneType' has no len()\n"
             "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
             + TORCHRUN_FAILURE.format(code=1, signal=""))
    c = _job(tmp_path, "Japan", log=crash)
    c.rc = 1
    assert failure_line(c) == (f"error: region 'Japan' failed with exit code 1 (a process exited "
                               f"with 1; TypeError: object of type 'NoneType' has no len()); "
                               f"log: {c.log}")
    assert bad_input_only([a]) and not bad_input_only([a, b]) and not bad_input_only([c])
    # a job of two ranks: the other rank was stopped by torchrun once the first exited 2
    # (its report lists -15; the launcher said exit 1 and offered a resume, helper 2026-12-07)
    stopped = "[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : -15 (pid: 18623)\n"
    d = _job(tmp_path, "Japan West", log=bad.replace("  <NO_OTHER_FAILURES>\n", stopped))
    e = _job(tmp_path, "Brazil", log=TORCHRUN_FAILURE.format(code=-15, signal="(SIGTERM)"))
    d.rc = e.rc = 1
    assert bad_input_only([d]) and not bad_input_only([e]) and not bad_input_only([d, e])
    jobs = [_job(tmp_path, "Japan East", [sys.executable, "-c", "import sys; sys.exit(1)"]),
            _job(tmp_path, "Australia East", ["sleep", "600"])]
    t0 = time.monotonic()
    wait_jobs(jobs, {j.proc.pid for j in jobs}, stall_s=2.0)
    assert time.monotonic() - t0 < 2.0 + STOP_GRACE_S
    assert [j.rc for j in jobs] == [1, -signal.SIGTERM] and [j.stalled for j in jobs] == [False, True]
    assert "stopped by the launcher" in failure_line(jobs[1])


PROCTREE_SCRIPT = """
import os, signal, subprocess, sys, time
from pathlib import Path
from geomesh.proctree import become_subreaper, start_tree, stop_trees, sweep_orphans

def alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False

# a root that starts a worker in a session of its own (as torchrun does), prints its
# pid and ignores SIGTERM; the worker ignores SIGTERM too
SPAWN = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "w = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
         "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'], start_new_session=True); "
         "print(w.pid, flush=True); time.sleep(600)")
assert become_subreaper()
log = Path(sys.argv[1])
roots = []
for k in range(2):
    roots.append(start_tree([sys.executable, "-c", SPAWN], log, dict(os.environ)))
    while len(log.read_text().split()) <= k:
        time.sleep(0.05)
workers = [int(x) for x in log.read_text().split()]
# 1. stop_trees: SIGTERM ignored by root and worker -> both killed after the grace
t0 = time.monotonic()
rcs = stop_trees([roots[0]], grace_s=1.0)
assert rcs == [-signal.SIGKILL] and time.monotonic() - t0 < 5, rcs
time.sleep(0.2)
assert not alive(workers[0]), "worker of a stopped tree still alive"
# 2. a root killed alone (out of memory, SIGKILL) leaves its worker; it is ours now
roots[1].kill()
roots[1].wait()
time.sleep(0.2)
assert alive(workers[1])
# the first tree's killed worker is ours too (a zombie): both are reaped, no root
assert sorted(sweep_orphans({p.pid for p in roots})) == sorted(workers)
assert not alive(workers[1])
print("ok")
"""


def test_process_trees_leave_no_orphans(tmp_path):
    """Catches a stop that reaches only torchrun (its workers run in sessions of their
    own) and a worker left running after its torchrun was SIGKILLed: in a separate
    process (the subreaper setting is per process), a root ignoring SIGTERM with a
    worker ignoring it is gone, worker included, 1 s after ``stop_trees``; a root
    SIGKILLed alone leaves its worker re-parented to the launcher, and
    ``sweep_orphans`` kills it and reaps exactly the two workers (never a root)."""
    proc = subprocess.run([sys.executable, "-c", PROCTREE_SCRIPT, str(tmp_path / "pids")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
