"""Real mode on CPU (gloo): GeoMesh end to end equals the emulated run.

Same seeds, same plan (re-planning off), same data stream: only the transport
(torch.distributed vs in-process) and the layout differ, so the losses of the
first outer steps must agree.  Layouts: 4 processes as 2 workers of TP=2, as
4 workers of one rank (two regions of two workers: intra-region and WAN
phases of the hierarchical exchange), and two separate ``torchrun`` jobs (one
per region) joined by torchft through a lighthouse at the cluster's
rendezvous address; then lost workers (``bench/faults.py`` scenarios).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from jobruntime.outputs import round_folder
from tests.dist_utils import child_env, free_port, launch

REPO = Path(__file__).resolve().parent.parent
STEPS = 3
OVERRIDES = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
    "model.seq_length=32", "parallel.global_batch_size=8", "parallel.micro_batch_size=2",
    "geomesh.inner_steps=2", f"geomesh.outer_steps={STEPS}", "geomesh.replan=false",
    "train.eval_iters=1", "train.warmup_iters=2", "logging.wandb=disabled",
]
REGIONS = [{"name": "East US", "id": 0}, {"name": "West Europe", "id": 1}]


def _clusters(root: Path, port: int) -> dict[str, Path]:
    def w(name, region, **kw):
        return {"name": name, "gpu": "A100-80GB", "region": region, **kw}

    specs = {
        "tp2": [w("w0", "East US", num_gpus=2, tp=2), w("w1", "West Europe", num_gpus=2, tp=2)],
        "four": [w("w0", "East US"), w("w1", "East US"), w("w2", "West Europe"),
                 w("w3", "West Europe")],
        "jobs": [w("w0", "East US"), w("w1", "West Europe")],
    }
    out = {}
    for name, workers in specs.items():
        # The rendezvous is used only when regions run separate torchrun jobs.
        raw = {"name": name, "mode": "real", "regions": REGIONS, "workers": workers,
               "rendezvous": f"127.0.0.1:{port}"}
        out[name] = root / f"{name}.yaml"
        out[name].write_text(yaml.safe_dump(raw))
    return out


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _run(cache_dir: str, cluster: str, run_dir: str, *extra: str) -> list[dict] | None:
    import torch

    torch.set_num_threads(1)  # 4 processes on 2 cores: spinning threads would crawl
    from geomesh.run import run
    from jobruntime.config import load_config

    cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", f"geomesh.cluster={cluster}",
                                   "geomesh.method=geomesh", *OVERRIDES, *extra])
    run(cfg, Path(run_dir))
    rank = int(os.environ.get("RANK", "0"))
    return _metrics(Path(run_dir)) if rank == 0 else None


OVERLAP = "geomesh.overlap=1"  # the "four-overlap" case: exchange behind the next round
# Real workers of TP=2 replace the default top-k codec by sign_row (its chunks would
# span TP shards); the emulated twin names it (emulated workers hold whole tensors).
EMULATED = {"tp2": ["geomesh.compression=sign_row"]}


def _emulated_all(cache_dir: str, clusters: dict, root: str) -> dict:
    out = {name: _run(cache_dir, str(path), f"{root}/emu-{name}", "geomesh.mode=emulated",
                      *EMULATED.get(name, []))
           for name, path in clusters.items()}
    out["four-overlap"] = _run(cache_dir, str(clusters["four"]), f"{root}/emu-four-overlap",
                               "geomesh.mode=emulated", OVERLAP)
    return out


def _real_4proc(cache_dir: str, clusters: dict, root: str) -> dict:
    out = {name: _run(cache_dir, str(clusters[name]), f"{root}/real-{name}")
           for name in ("tp2", "four")}
    out["four-overlap"] = _run(cache_dir, str(clusters["four"]), f"{root}/real-four-overlap",
                               OVERLAP)
    return out


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("geomesh_real")
    clusters = _clusters(root, free_port())
    (emulated,) = launch(_emulated_all, 1, cache_dir, clusters, str(root))
    real = launch(_real_4proc, 4, cache_dir, clusters, str(root))[0]
    return root, clusters, emulated, real


def _assert_same(real: list[dict], emu: list[dict]) -> None:
    assert [r["step"] for r in real] == list(range(1, STEPS + 1))
    for a, b in zip(real, emu):
        assert a["tokens"] == b["tokens"] and a["batch_sizes"] == b["batch_sizes"]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-4), (a, b)
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-4), (a, b)
        assert a["bytes"] > 0 and a["clock"] == "wall" and b["clock"] == "emulated"
    assert real[-1]["val_loss"] < real[0]["val_loss"] + 0.5  # trains, does not diverge


@pytest.mark.parametrize("layout", ["tp2", "four", "four-overlap"])
def test_real_matches_emulated(runs, layout):
    """Catches a worker whose inner DDP all-reduces across workers (megatron's DP
    group spans them), per-shard sign scales (TP=2 would then differ from TP=1),
    exchanges mixing shards or workers, data slices that differ between modes,
    and (four-overlap) a background exchange that races the inner steps or
    delivers another round's messages: after 3 outer steps, the training and
    validation losses of the real gloo run equal the emulated run's within 1e-4
    (TP reduction order ~1e-6)."""
    _, _, emulated, real = runs
    _assert_same(real[layout], emulated[layout])
    summary = json.loads((runs[0] / f"real-{layout}" / "summary.json").read_text())
    assert summary["clock"] == "wall" and summary["mode"] == "real"
    assert summary["overlap"] == (1.0 if layout == "four-overlap" else None)
    if layout == "tp2":  # top-k chunks would span TP shards: signs with row scales instead
        # Measured on the test model itself: a row of 64 columns carries 8 sign bytes
        # and a 4-byte scale (ratio 21), of 128 columns 16 + 4 (25.6); GPT-3 1.3B: 31.6.
        assert summary["codec"] == "sign-row" and 20 < summary["compression_ratio"] < 26
    else:  # top-24 of a (padded) 256-chunk per row: 38 bytes per row of 64 or 128 columns
        assert summary["codec"] == "topk" and 6 < summary["compression_ratio"] < 14


SECRET_ENV = {"GEOMESH_SECRET": "0123456789abcdef0123456789abcdef", "WANDB_SILENT": "true",
              "OMP_NUM_THREADS": "1"}


def _lighthouse(cluster: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "geomesh.lighthouse", "--cluster", str(cluster),
                             "--heartbeat-s", "10", "--join-timeout-s", "60"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**child_env(), **SECRET_ENV})


def _torchrun(cluster: Path, region: str, run_dir: Path, cache_dir: str, *extra: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(REPO / "train.py"), "--config", "tiny_gpt", "--run-dir", str(run_dir),
           f"data.cache_dir={cache_dir}", f"geomesh.cluster={cluster}", "geomesh.method=geomesh",
           f"geomesh.region={region}", *OVERRIDES, *extra]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**child_env(), **SECRET_ENV})


@pytest.mark.slow
def test_two_torchrun_jobs_on_torchft(runs, cache_dir):
    """Catches region jobs that cannot find each other through the torchft
    lighthouse, or that train other math than the emulated run: two torchrun
    jobs (one per region, each its own world and torchft replica group) run 3
    outer steps, and both report the emulated losses within 1e-4."""
    root, clusters, emulated, _ = runs
    lh = _lighthouse(clusters["jobs"])
    try:
        procs = [_torchrun(clusters["jobs"], region, root / f"job-{k}", cache_dir)
                 for k, region in enumerate(("East US", "West Europe"))]
        outs = [p.communicate(timeout=900) for p in procs]
    finally:
        lh.terminate()
        lh.wait(30)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    for k in range(2):
        _assert_same(_metrics(root / f"job-{k}"), emulated["jobs"])


def test_missing_region_fails_with_its_name(runs, cache_dir):
    """Catches a hang or an anonymous error when a region never starts: the East
    US job alone (timeout 3 s) exits with code 2 and a one-line error naming
    West Europe and the fix; without a lighthouse, the line names it."""
    root, clusters, _, _ = runs
    cmd = [sys.executable, str(REPO / "train.py"), "--config", "tiny_gpt", "--run-dir",
           str(root / "alone"), f"data.cache_dir={cache_dir}", f"geomesh.cluster={clusters['jobs']}",
           "geomesh.method=geomesh", "geomesh.region=East US", "geomesh.timeout_s=3",
           "geomesh.heartbeat_s=2", *OVERRIDES]
    env = {**child_env(), **SECRET_ENV}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    line = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode in (2, 3) and len(line) == 1, proc.stderr[-3000:]
    assert "lighthouse" in line[0] and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lh = _lighthouse(clusters["jobs"])
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    finally:
        lh.terminate()
        lh.wait(30)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line and "West Europe" in line[0] and "geomesh.timeout_s" in line[0], proc.stderr[-2000:]


def test_regions_with_other_settings_stop_naming_what_differs(cache_dir, tmp_path):
    """Catches regions that were started with other settings and each trained alone to
    exit 0 on other weights: their messages named another run, each region dropped the
    other as lost (break-test helper: outer_lr 0.7 vs 0.3, two digests, both exit 0).
    Now each stops in its first round with exit 2 and one error line that names the
    other region and the part of the settings that differs (``geomesh``)."""
    cluster = _clusters(tmp_path, free_port())["jobs"]
    lh = _lighthouse(cluster)
    try:
        procs = [_torchrun(cluster, region, tmp_path / f"job-{k}", cache_dir, *extra)
                 for k, (region, extra) in enumerate((("East US", ()),
                                                       ("West Europe", ("geomesh.outer_lr=0.3",))))]
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        lh.terminate()
        lh.wait(30)
    for p, (_, err), other in zip(procs, outs, ("West Europe", "East US")):
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        # torchrun exits 1 for any failed rank; its report holds the rank's own code
        assert p.returncode == 1 and "exitcode  : 2" in err and lines, err[-3000:]
        assert repr(other) in lines[0] and "differ: geomesh)" in lines[0], lines


def test_stop_flag_rides_with_the_messages_stats():
    """Catches a stop flag that is lost, or read into the codec's bytes, on its way
    through a region's exchange (no processes; a stand-in for the torchft membership
    all-gathers the bodies the regions' placements send, the third region joining
    without one): only the flag of the region that set it is read back, and the codec
    messages and stats come back unchanged."""
    from geomesh.exchange.deploy import Placement

    class Gather:  # the run's torchft exchange: one call per region, all see every body
        healed, sent = False, {}

        def __init__(self, k: int) -> None:
            self.k = k

        def exchange(self, body, *, quorum_done):
            Gather.sent[self.k] = body
            return [Gather.sent.get(j) for j in range(3)]

    regions = [Placement(mode="real", workers=[k], per_region=True, membership=Gather(k))
               for k in range(3)]
    regions[1].exchange(b"msg1", stats=(2.5, 1.0), stop=True)
    regions[2].exchange(b"", quorum_done=True)  # healed this round: no body, no flag
    out = regions[0].exchange(b"msg0", stats=(3.0, 2.0), stop=False)
    assert out == [b"msg0", b"msg1", None] and regions[0].stop_requests == [1]
    assert [r[:3] for r in regions[0].rows] == [[0, 3.0, 2.0], [1, 2.5, 1.0]]


def test_stop_at_target_ends_every_region_after_the_same_round(cache_dir, tmp_path):
    """Catches regions that stop at different rounds under ``train.stop_at_target``
    because each stopped on its own evaluation, whose cadence is region-local: East US
    evaluates every round and reaches the target (ppl 1e9) after round 1, West Europe
    evaluates only at the end.  Before, East US stopped after round 1 and West Europe
    waited out the heartbeat, reported it lost and trained rounds 2-3 alone (two
    digests).  Now East US flags the stop in its round-2 message and both end after
    round 2, with one θ_global digest, an evaluation of it in each, the same
    checkpoint step, and no region reported lost."""
    cluster = _clusters(tmp_path, free_port())["jobs"]
    stop = ("train.target_ppl=1e9", "train.stop_at_target=true")
    lh = _lighthouse(cluster)
    try:
        procs = [_torchrun(cluster, region, tmp_path / f"job-{k}", cache_dir, *stop,
                           f"geomesh.eval_interval={every}")
                 for k, (region, every) in enumerate((("East US", 1), ("West Europe", 100)))]
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        lh.terminate()
        lh.wait(30)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "lost worker" not in err, err[-3000:]
    runs = [tmp_path / f"job-{k}" for k in range(2)]
    steps = [[r["step"] for r in _metrics(d)] for d in runs]
    assert steps == [[1, 2], [1, 2]], steps
    summaries = [json.loads((d / "summary.json").read_text()) for d in runs]
    assert summaries[0]["global_weights_sha256"] == summaries[1]["global_weights_sha256"]
    assert all(_metrics(d)[-1].get("val_ppl") for d in runs)  # θ_global evaluated at the stop
    assert [sorted(x.name for x in (d / "checkpoints").glob("outer_*")) for d in runs] == \
        [[round_folder(2)], [round_folder(2)]]


@pytest.mark.slow
def test_a_region_that_ends_first_is_not_lost_to_one_still_saving(cache_dir, tmp_path):
    """Catches a finished run stopped with exit 3 under ``geomesh.on_worker_loss=fail``:
    after the last exchange East US (one validation batch) closed, and West Europe (300
    batches, longer than ``geomesh.heartbeat_s=1``) was still evaluating when its monitor
    saw East US silent: "lost region(s) ['East US']", exit 1 from torchrun, no summary.
    No exchange follows the last round, so the monitor stops there."""
    cluster = _clusters(tmp_path, free_port())["jobs"]
    lh = _lighthouse(cluster)
    common = ("geomesh.on_worker_loss=fail", "geomesh.heartbeat_s=1")
    try:
        procs = [_torchrun(cluster, region, tmp_path / f"job-{k}", cache_dir, *common, *extra)
                 for k, (region, extra) in enumerate((("East US", ()),
                                                      ("West Europe", ("train.eval_iters=300",))))]
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        lh.terminate()
        lh.wait(30)
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0 and "lost region" not in err, err[-3000:]
    assert all((tmp_path / f"job-{k}" / "summary.json").is_file() for k in range(2))


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["late_join", "store_host_lost_fail_policy",
                                      "network_stall"])
def test_lost_worker_scenarios(scenario, cache_dir, tmp_path):
    """Catches a run that dies with a lost worker, a restarted worker that does
    not heal to the survivors' model, a fail policy that hangs or prints a
    traceback, and a stalled worker that comes back into a quorum of its own
    (the run split in two, each finishing with its own θ_global):
    bench/faults.py's scenarios, asserted (late join and stall: both jobs
    finish with the same θ_global digest; fail: the survivor exits 3 with one
    line naming the lost region, within the heartbeat plus a round)."""
    from bench.faults import geomesh

    kw = {"late_join": dict(fault=(1, "train@1"), rejoin=True),
          "store_host_lost_fail_policy": dict(fault=(0, "train@2"), policy="fail"),
          "network_stall": dict(stall=True)}[scenario]
    # the survivor of a 10 s stall must still be training when the stalled worker is back
    res = geomesh(tmp_path, cache_dir, scenario, 18 if scenario == "network_stall" else 10, **kw)
    assert res["survived"], res
    assert res["bytes_lost"] == 0


@pytest.mark.slow
def test_a_region_restarted_with_other_settings_is_refused_by_name(cache_dir, tmp_path):
    """Catches a region restarted mid-run with other settings than the running one's that
    tried to heal three times (their state is sealed for another run) and stopped with
    "no working quorum" and a resume hint, not the one-line exit 2 that names what
    differs, as in a job's first round; the survivor finishes."""
    from bench.faults import geomesh

    res = geomesh(tmp_path, cache_dir, "other_settings_rejoin", 8, fault=(1, "train@1"),
                  rejoin=True, rejoin_with=("geomesh.outer_lr=0.5",))
    assert res["survived"], res
    assert res["exit_codes"][-1] == 2


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lighthouse_restart", "lighthouse_lost"])
def test_lighthouse_restart_and_loss(kind, cache_dir, tmp_path):
    """Catches a quorum that never completes once the lighthouse died under it
    (torchft's manager server asked the old lighthouse once and waited out
    2 x geomesh.timeout_s = 240 s, then exited 3), and a lighthouse gone for
    good that is reported only then.  bench/faults.py's scenarios, asserted:
    restarted 3.6 s after a SIGKILL after round 2, the run completes every
    round, no worker misses more than one (healed past it), at most one
    attempt is retried, and no round takes more than the gap plus the heartbeat
    (5 s) over the median round; killed for good, both jobs
    exit 3 with one line naming the lighthouse within the heartbeat plus the
    probe period and slack (7.5 s; the independent reference is the kill time
    taken by the bench)."""
    from bench.faults import HEARTBEAT_S, LIGHTHOUSE_BOUND_S, lighthouse_lost, lighthouse_restart

    if kind == "lighthouse_restart":
        res = lighthouse_restart(tmp_path, cache_dir, 6)
        why = (res, _warnings(tmp_path / kind))
        assert res["exit_codes"] == [0, 0] and res["rounds_lost"] <= 1, why
        assert res["attempts_retried"] <= 1, why
        assert res["stall_s"] <= 3.6 + HEARTBEAT_S, why
    else:
        res = lighthouse_lost(tmp_path, cache_dir, 6)
        why = (res, _warnings(tmp_path / kind))
        assert res["exit_codes"] == [3, 3] and res["detect_s"] <= LIGHTHOUSE_BOUND_S, why
    print(json.dumps(res))  # the bench's record (pytest -s shows it)
    assert res["survived"] and res["bytes_lost"] == 0, why


def _warnings(scenario: Path) -> dict[str, list[str]]:
    """Each job's GeoMesh warnings and errors: what a failed timed scenario says about
    itself in the CI log (the run folder is gone with the CI machine)."""
    return {f.name: [x[-200:] for x in f.read_text(errors="replace").splitlines()
                     if ("GeoMesh round" in x and "waiting" not in x) or "error:" in x][-8:]
            for f in sorted(scenario.glob("w*.log"))}


def test_lighthouse_serves_without_torch():
    """Catches a lighthouse that imports torch to start (torchft/__init__: 9 s on
    two loaded cores, longer than the 5-10 s heartbeat in which a restarted
    lighthouse must answer again): torchft's Rust server is loaded alone, serves
    its /status page, and lighthouse_heartbeats reads no heartbeats from it."""
    code = ("import sys; from geomesh.lighthouse import lighthouse_heartbeats, "
            "lighthouse_server_class;"
            "s = lighthouse_server_class()(bind='127.0.0.1:0', min_replicas=1);"
            "addr = 'http://127.0.0.1:' + s.address().rsplit(':', 1)[1];"
            "print('torch' in sys.modules, lighthouse_heartbeats(addr)); s.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**child_env(), "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "{}"], out.stdout
