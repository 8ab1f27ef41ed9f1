"""Faults, hostile messages and bad inputs: what GeoMesh and CONA survive (real processes).

Usage::

    python bench/faults.py --quick --out runs/faults      # ~20 min on 2 idle cores

Each GeoMesh scenario (:data:`SCENARIOS`) runs a torchft lighthouse (``python -m
geomesh.lighthouse``) and one job per region (``train.py ... geomesh.region=...``,
gloo; two regions of one process each unless the scenario gives region shapes, a
job of several processes under ``torchrun``) of ``tiny_gpt`` at test size, and
injects one fault with ``GEOCONA_FAULT`` (SIGKILL at a named point:
:mod:`jobruntime.faults`) or with SIGSTOP/SIGCONT from here (a network stall):

* a worker killed after its inner steps (``train``), after the round's quorum
  (``exchange``), after the all-gather (``commit``), inside a checkpoint save
  (``save``); the store host (worker 0: torchft's quorum store is the lowest
  replica's) killed; a late join (worker 1 killed, restarted, heals); the same
  across layouts (a TP2 job healed by a TP1 one, a PP2 job by a DP2 one, a TP1 job
  by a TP2 one with ``geomesh.compress_update``); a
  region of a TP1/TP2/PP2 cluster lost (a rank of its PP2 job killed); a stall
  of twice the heartbeat; the same loss with ``on_worker_loss=fail``; the
  lighthouse killed and restarted on its address 3.6 s later, or killed for good;
* a 10x straggler that triggers a re-plan (one ``torchrun`` of 2 ranks playing
  both workers): survived when the run finishes, re-plans, and every round's
  tokens stay within the plan's tolerance of the budget (:func:`straggler_replan`);
* CONA (one ``torchrun`` of 2 ranks, gloo): rank 1 killed inside a layout
  switch, then the last checkpoint resumed at the old and at the new layout.

*Survived* means: ``continue`` — every job alive at the end exits 0 after all
rounds with the same ``global_weights_sha256`` in its ``summary.json`` (θ_global
bit-identical; a rejoined worker also with the survivors' final loss); ``fail`` and the
CONA switch — every surviving process exits within the detection time with
exactly one ``error:`` line naming the lost region (or the switch) and no
traceback, and the resumes exit 0.  *Bytes lost*: run files (metrics,
committed checkpoints) seen during a run that are gone or shorter at its end
(``checkpoint.keep_last=0``, so nothing is rotated away).

Hostile messages (in process, the same Opener and Guard as a run): forged,
replayed, duplicated, other-run, other-version and wrong-slot envelopes, and
sealed insiders' absurd values, NaN bodies, token grabs, zero tokens, truncated
or corrupted parts, a worker's bundle with a part repeated, missing, overlapping
or disagreeing, and parts of another model, codec or format, on every kind of the
exchange's codec (:class:`geomesh.wire.canonical_codec.CanonicalCodec`); an insider
with a forged identity (codec header naming another worker or round) and one
lying about its loss and compute seconds (``hostile_kinds``).  Bad inputs: random config
overrides, cluster files, region shapes, wire bytes and checkpoint files (seeded), counted
when they are bad; a clean error is the module's one-line error type.  Both are
:mod:`bench.faults_inputs`.  Prints one line per scenario and, last,
one JSON object; ``--out`` also gets ``faults.json`` and the logs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from jobruntime.metrics import json_text  # noqa: E402
from jobruntime.ports import free_port  # noqa: E402

SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
         "model.seq_length=32", "parallel.global_batch_size=8", "parallel.micro_batch_size=2",
         "train.eval_iters=1", "train.warmup_iters=2", "logging.wandb=disabled",
         "logging.progress=on"]
HEARTBEAT_S = 5.0
SLOWDOWN = 8.0  # each round sleeps 7x its compute time (geomesh/fleet/cluster.py ``slowdown``)
REGIONS = ["East US", "West Europe", "Japan East", "Australia East"]


class Watch(threading.Thread):
    """Polls run folders: the last size of every metrics file and committed checkpoint file."""

    def __init__(self, dirs: list[Path]) -> None:
        super().__init__(daemon=True)
        self.dirs, self.seen, self.stop = dirs, {}, threading.Event()
        self.start()

    def scan(self) -> dict[Path, int]:
        out = {}
        for d in self.dirs:
            for f in [d / "metrics.jsonl", *d.glob("checkpoints/*/*")]:
                committed = f.parent.name == d.name or (f.parent / "COMPLETE").is_file()
                if committed and f.is_file() and ".tmp" not in f.parent.name:
                    out[f] = f.stat().st_size
        return out

    def run(self) -> None:
        while not self.stop.wait(0.3):
            try:
                self.seen.update(self.scan())
            except OSError:
                pass

    def lost(self) -> int:
        self.stop.set()
        self.join()
        now = self.scan()
        return sum(n - now.get(f, 0) for f, n in self.seen.items() if now.get(f, 0) < n)


class Run:
    """One process of a scenario, its output in ``log``."""

    def __init__(self, cmd: list[str], log: Path, env: dict) -> None:
        self.log, self.t0, self.t_exit = log, time.monotonic(), None
        self.cmd, self.env = cmd, env  # to start it again (a restarted lighthouse)
        self.f = open(log, "w")  # noqa: SIM115 - closed in wait()
        self.p = subprocess.Popen(cmd, cwd=REPO, stdout=self.f, stderr=subprocess.STDOUT, env=env)
        threading.Thread(target=self._exited, daemon=True).start()

    def _exited(self) -> None:
        self.p.wait()
        self.t_exit = time.monotonic()

    def wait(self, timeout: float) -> int | None:
        try:
            rc = self.p.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            self.p.kill()
            rc = None
        self.f.close()
        return rc

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _env(secret: str, fault: str | None = None) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true",
           "GEOMESH_SECRET": secret}
    env.pop("GEOCONA_FAULT", None)
    if fault:
        env["GEOCONA_FAULT"] = fault
    return env


def _clean_exit(text: str, name: str) -> bool:
    errors = [x for x in text.splitlines() if x.startswith("error:")]
    return len(errors) == 1 and name in errors[0] and "Traceback" not in text


def _job_cmd(nproc: int) -> list[str]:
    """The command that starts a region's ``train.py``: itself for one process,
    ``torchrun --standalone --nproc-per-node N`` for more (as ``geomesh.launch_local``)."""
    if nproc == 1:
        return [sys.executable, "train.py"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(nproc), "train.py"]


def _digest(run_dir: Path) -> str | None:
    """``global_weights_sha256`` of a region job's ``summary.json`` (``None``: none written)."""
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("global_weights_sha256")
    except (OSError, ValueError):
        return None


def geomesh(root: Path, cache: str, name: str, rounds: int, *, fault: tuple[int, str] | None = None,
            policy: str = "continue", rejoin: bool | str = False, stall: bool = False,
            act: Callable[[list[Run], Run], Run] | None = None,
            shapes: list[dict] | None = None, slowdown: list[float] | None = None,
            overrides: tuple[str, ...] = (), heartbeat_s: float = HEARTBEAT_S,
            rejoin_with: tuple[str, ...] = ()) -> dict:
    """One GeoMesh scenario (module docstring); returns its result record.

    ``shapes``: one dict per region of worker fields over one process at TP1
    (e.g. ``{"num_gpus": 2, "tp": 2}``); default two regions of one process.  A
    region of ``N > 1`` processes runs under ``torchrun --nproc-per-node N``, and
    ``fault``'s spec kills its job rank ``/<rank>`` (default 0, the torchft leader).
    ``slowdown``: each region's factor (default :data:`SLOWDOWN`): a survivor slower
    than the victim is still running when a restarted multi-process job is back
    (with ``stall``, the victim's is 1: its stall is not slept off again).
    ``overrides``: more ``section.key=value`` for every job.  ``heartbeat_s``: the
    lighthouse's and the jobs' (a long one keeps a restarted region in the quorum: it
    heals without a membership change).
    ``rejoin``: restart the victim once its fault killed it, in a new run folder
    (``True``), or with its resume command, in its own folder with ``checkpoint.load``
    of its checkpoints (``"resume"``: the command docs/geomesh.md gives);
    ``rejoin_with``: overrides of the restarted job only (other settings than the run's:
    survived then means that it is refused, exit 2 with one line naming what differs,
    while the others finish).
    ``act(jobs, lighthouse)``, if given, runs once the victim has finished round 2
    and returns the lighthouse the run goes on with (the same, or a new one).
    With ``continue``, survived also means that every job alive at the end holds
    the same ``global_weights_sha256`` (``same_digest``); ``layouts`` when ``shapes`` is given.
    """
    shapes = shapes if shapes is not None else [{}, {}]
    slowdown = list(slowdown or [SLOWDOWN] * len(shapes))
    if stall:
        # the injected slowdown sleeps (factor - 1) times a round's compute wall time: a
        # SIGSTOP landing in the victim's compute would be slept off 7 times over (a
        # 10 s stall became 80 s, the survivor had finished, the digests differed)
        slowdown[fault[0] if fault else 1] = 1.0
    regions = REGIONS[:len(shapes)]
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    port, secret = free_port(), os.urandom(16).hex()
    cluster = d / "cluster.yaml"
    workers = [{"name": f"w{i}", "gpu": "A100-80GB", "num_gpus": 1, "region": r, **shapes[i]}
               for i, r in enumerate(regions)]
    cluster.write_text(json_text({
        "name": name, "mode": "real", "rendezvous": f"127.0.0.1:{port}",
        "regions": [{"name": r, "id": i} for i, r in enumerate(regions)], "workers": workers,
        # rounds of seconds, not a fraction of one: a restart or a stall lands mid-run
        "slowdown": [{"worker": w["name"], "factor": f} for w, f in zip(workers, slowdown)]}))
    lh = Run([sys.executable, "-m", "geomesh.lighthouse", "--bind", f"127.0.0.1:{port}",
              "--heartbeat-s", str(heartbeat_s), "--join-timeout-s", "120"], d / "lighthouse.log",
             _env(secret))
    common = [*SMALL, f"data.cache_dir={cache}", f"geomesh.cluster={cluster}",
              "geomesh.method=geomesh", "geomesh.inner_steps=2", f"geomesh.outer_steps={rounds}",
              "geomesh.replan=false", f"geomesh.heartbeat_s={heartbeat_s}", "geomesh.timeout_s=120",
              f"geomesh.on_worker_loss={policy}", "checkpoint.save_interval=1",
              "checkpoint.keep_last=0", *overrides]

    def job(k: int, tag: str, fault_spec: str | None, *more: str, log: str = "") -> Run:
        return Run([*_job_cmd(workers[k]["num_gpus"]), "--config", "tiny_gpt", "--run-dir",
                    str(d / f"{tag}{k}"), *common, f"geomesh.region={regions[k]}", *more],
                   d / (log or f"{tag}{k}.log"), _env(secret, fault_spec))

    t0 = time.monotonic()
    n = len(regions)
    jobs = [job(k, "w", fault[1] if fault and fault[0] == k else None) for k in range(n)]
    victim = fault[0] if fault else 1
    watch = Watch([*(d / f"w{k}" for k in range(n)), d / f"re{victim}"])
    extra: list[Run] = []
    if stall or rejoin or act:  # wait for round 2 of the victim (its metrics), then act
        deadline = time.monotonic() + 600
        m = d / f"w{victim}" / "metrics.jsonl"
        while time.monotonic() < deadline and jobs[victim].p.poll() is None and (
                not m.is_file() or len(m.read_text().splitlines()) < 2):
            time.sleep(0.2)
        if stall:
            jobs[victim].p.send_signal(signal.SIGSTOP)
            time.sleep(2 * HEARTBEAT_S)
            jobs[victim].p.send_signal(signal.SIGCONT)
    if act:
        lh = act(jobs, lh)
    if rejoin:
        jobs[victim].wait(600)  # killed by its fault
        time.sleep(2)
        extra.append(job(victim, "w", None, f"checkpoint.load={d / f'w{victim}' / 'checkpoints'}",
                         *rejoin_with, log=f"w{victim}_resumed.log") if rejoin == "resume"
                     else job(victim, "re", None, *rejoin_with))
    rcs = [j.wait(1200) for j in jobs] + [j.wait(1200) for j in extra]
    seconds = time.monotonic() - t0
    lh.p.terminate()
    lh.wait(30)
    lost = watch.lost()
    texts = [j.text() for j in jobs + extra]
    survivors = [i for i in range(n) if not (fault and fault[0] == i and not stall)]
    digests = None
    if policy == "fail":
        lost_region = regions[victim]
        # the victim must have died of its fault (-9; a torchrun job: 1, its rank killed):
        # a survivor that stopped first saw a loss that was not there (a false detection)
        killed = -signal.SIGKILL if workers[victim]["num_gpus"] == 1 else 1
        ok = rcs[victim] == killed and all(
            rcs[i] == 3 and _clean_exit(texts[i], lost_region) for i in survivors)
        # detection: from the lost worker's death to the last survivor's exit
        detect = max((jobs[i].t_exit or time.monotonic()) for i in survivors) - (
            jobs[victim].t_exit or time.monotonic())
    else:
        refused = bool(extra and rejoin_with)  # a restart with other settings: refused
        alive = survivors + ([n] if extra and not refused else [])
        ok = all(rcs[i] == 0 and f"outer step {rounds}/{rounds}" in texts[i] for i in alive)
        if refused:
            errors = [x for x in texts[n].splitlines() if x.startswith("error:")]
            ok = ok and rcs[n] == 2 and len(errors) == 1 and "other settings" in errors[0]
        elif extra:  # the rejoined worker ends with the survivors' model
            finals = [texts[i].rsplit("final val ppl", 1)[-1].split(",")[0] for i in alive]
            ok = ok and len(set(finals)) == 1
        # θ_global in canonical form: bit-identical in every job alive at the end
        rejoined = f"w{victim}" if rejoin == "resume" else f"re{victim}"
        digests = [_digest(d / (f"w{i}" if i < n else rejoined)) for i in alive]
        ok = ok and None not in digests and len(set(digests)) == 1
        detect = None
    return {"scenario": name, "survived": bool(ok), "exit_codes": rcs, "bytes_lost": lost,
            "wall_s": round(seconds, 1),
            **({"layouts": [f"tp{w.get('tp', 1)}/pp{w.get('pp', 1)}/{w['num_gpus']}proc"
                            for w in workers]} if any(shapes) else {}),
            **({"detect_s": round(detect, 1)} if detect is not None else {}),
            **({"same_digest": len(set(digests)) == 1 and None not in digests}
               if digests is not None else {})}


TP2 = {"num_gpus": 2, "tp": 2}
SCENARIOS: dict[str, dict] = {
    "worker_killed_in_train": dict(fault=(1, "train@2")),
    "worker_killed_at_exchange": dict(fault=(1, "exchange@2")),
    "worker_killed_before_commit": dict(fault=(1, "commit@2")),
    "worker_killed_in_checkpoint_save": dict(fault=(1, "save@2")),
    "store_host_killed": dict(fault=(0, "train@2")),
    "late_join": dict(fault=(1, "train@1"), rejoin=True),
    # healing across layouts: the TP1 region serves a TP2 job, a DP2 job (its replica
    # sends nothing) serves a PP2 one (its last stage cuts the tied output layer);
    # the survivor is slower than the victim so that it still runs when the restarted
    # torchrun of two processes is back (about a minute on two loaded cores)
    "late_join_across_layouts": dict(fault=(1, "train@1"), rejoin=True, shapes=[{}, TP2],
                                     slowdown=[50.0, SLOWDOWN]),
    "late_join_dp2_serves_pp2": dict(fault=(1, "train@1"), rejoin=True,
                                     shapes=[{"num_gpus": 2}, {"num_gpus": 2, "pp": 2}],
                                     slowdown=[25.0, SLOWDOWN]),
    # a TP2 job serves (its follower rank answers its leader's state request) a TP1 one,
    # with the outer momentum kept by the workers (geomesh.compress_update): none to heal
    "late_join_compress_update": dict(fault=(1, "train@1"), rejoin=True, shapes=[TP2, {}],
                                      overrides=("geomesh.compress_update=true",)),
    # a lost region in a mixed-shape cluster: rank 1 (not the torchft leader) of the PP2 job
    "region_lost_mixed_shapes": dict(fault=(2, "train@2/1"),
                                     shapes=[{}, TP2, {"num_gpus": 2, "pp": 2}]),
    "network_stall": dict(stall=True),
    "worker_lost_fail_policy": dict(fault=(1, "train@2"), policy="fail"),
    "store_host_lost_fail_policy": dict(fault=(0, "train@2"), policy="fail"),
}
"""The :func:`geomesh` scenarios of the bench, by name: ``geomesh()``'s keyword arguments."""
ROUNDS_SCALE = {"late_join": 3, "late_join_across_layouts": 2, "late_join_dp2_serves_pp2": 2,
                "late_join_compress_update": 2, "network_stall": 3}
"""Rounds of a scenario in units of the bench's: a restarted or stalled job must find the
run going (at 6 rounds the survivor of a 10 s stall finished before the stalled one came
back, which then trained alone: the digests differ, a scenario too short, not a split)."""


RESTART_AFTER_S = 3.6  # the gap between a lighthouse's SIGKILL and its restart (issue 25)
# a lighthouse gone for good is reported within the heartbeat, plus the monitor's probe
# period (min(1, heartbeat/4) s) and slack for two loaded cores
LIGHTHOUSE_BOUND_S = HEARTBEAT_S + 2.5


def _kill_lighthouse(restart_after: float | None, seen: dict) -> Callable[[list[Run], Run], Run]:
    """A :func:`geomesh` ``act``: SIGKILL the lighthouse; restart the same command on the
    same address ``restart_after`` seconds later (``None``: never).  Notes the jobs and the
    kill time in ``seen``."""

    def act(jobs: list[Run], lh: Run) -> Run:
        lh.p.kill()
        seen.update(killed=time.monotonic(), jobs=jobs)
        if restart_after is None:
            return lh
        time.sleep(restart_after)
        return Run(lh.cmd, lh.log.with_name("lighthouse_restarted.log"), lh.env)

    return act


def lighthouse_restart(root: Path, cache: str, rounds: int) -> dict:
    """The lighthouse killed after round 2 and restarted on its address 3.6 s later.

    Survived: both jobs finish every round (exit 0), at most one round is missing
    from a worker's metrics (``rounds_lost``: it healed past a round instead of
    training it), and no round took more than the restart gap plus the heartbeat
    over the median round (``stall_s``: the slowest round less the median; rounds
    2 onwards of worker 0, round 1 holds the start-up).  ``attempts_retried``: failed
    quorum or exchange attempts tried again (the round's messages are kept, not its
    training redone); a partial quorum of the restarted lighthouse asked again until
    the left-out worker joins is a wait, not a failed attempt.
    """
    name = "lighthouse_restart"
    seen: dict = {}
    res = geomesh(root, cache, name, rounds, act=_kill_lighthouse(RESTART_AFTER_S, seen))
    texts = [j.text() for j in seen.get("jobs", [])]
    retried = max((t.count("quorum attempt") + t.count("exchange failed") for t in texts),
                  default=0)
    # a round a worker did not train and commit (it healed past it instead) has no record
    lost = max(rounds - len((root / name / f"w{k}" / "metrics.jsonl").read_text().splitlines())
               for k in range(2))
    times = [json.loads(x)["time_s"] for x in
             (root / name / "w0" / "metrics.jsonl").read_text().splitlines()]
    took = [b - a for a, b in zip(times, times[1:])] or [0.0]  # round 1 holds the start-up
    median = statistics.median(took)
    stall = max(took) - median
    res.update(survived=res["survived"] and lost <= 1 and stall <= RESTART_AFTER_S + HEARTBEAT_S,
               rounds_lost=lost, attempts_retried=retried, stall_s=round(stall, 1),
               median_round_s=round(median, 1), restart_after_s=RESTART_AFTER_S)
    return res


def lighthouse_lost(root: Path, cache: str, rounds: int) -> dict:
    """The lighthouse killed for good after round 2.

    Survived: every job exits 3 with one ``error:`` line naming the lighthouse and no
    traceback, within :data:`LIGHTHOUSE_BOUND_S` of the kill (``detect_s``).
    """
    seen: dict = {}
    res = geomesh(root, cache, "lighthouse_lost", rounds, act=_kill_lighthouse(None, seen))
    jobs = seen.get("jobs", [])
    detect = max((j.t_exit or time.monotonic() for j in jobs), default=float("inf")) - \
        seen.get("killed", 0.0)
    ok = bool(jobs) and res["exit_codes"] == [3] * len(jobs) and all(
        _clean_exit(j.text(), "lighthouse") for j in jobs)
    res.update(survived=ok and detect <= LIGHTHOUSE_BOUND_S, detect_s=round(detect, 1),
               bound_s=LIGHTHOUSE_BOUND_S)
    return res


def cona_switch(root: Path, cache: str) -> list[dict]:
    """Rank 1 killed inside a CONA layout switch; then resume at both layouts."""
    d = root / "cona_switch"
    d.mkdir(parents=True, exist_ok=True)
    cands = ("[{dp: 2, tp: 1, pp: 1, micro_batch_size: 2, global_batch_size: 8},"
             " {dp: 1, tp: 2, pp: 1, micro_batch_size: 4, global_batch_size: 8}]")
    base = [*SMALL, f"data.cache_dir={cache}", "checkpoint.save_interval=2",
            "checkpoint.keep_last=0", "train.iters=12"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                "2", "--log-dir", str(d / "ranks"), "--redirects", "3", "train.py", "--config",
                "tiny_gpt"]
    run = d / "run"
    t0 = time.monotonic()
    watch = Watch([run])
    p = Run([*torchrun, "--run-dir", str(run), *base, "parallel.pp=2", "cona.enabled=true",
             "cona.decision_interval=4", "cona.horizon_steps=1000", f"cona.candidates={cands}",
             "cona.switch_timeout_s=30"], d / "torchrun.log", _env("x" * 16, "switch@0/1"))
    p.wait(900)
    seconds = time.monotonic() - t0
    logs = {f.parent.name: f.read_text(errors="replace")
            for f in (d / "ranks").glob("*/attempt_0/*/stderr.log")}
    survivor = logs.get("0", "")
    ok = _clean_exit(survivor, "switch") or _clean_exit(survivor, "signal")
    lost = watch.lost()
    out = [{"scenario": "cona_switch_killed", "survived": bool(ok), "bytes_lost": lost,
            "seconds": round(seconds, 1)}]
    for layout, par in (("old", ["parallel.pp=2"]), ("new", ["parallel.tp=2"])):
        r = Run([*torchrun[:-3], "train.py", "--config", "tiny_gpt", "--run-dir",
                 str(d / f"resume_{layout}"), *base, *par, "train.iters=8",
                 # an ordinary run goes on with the CONA run's schedule as saved (in steps)
                 "checkpoint.optimizer_settings=checkpoint",
                 f"checkpoint.load={run / 'checkpoints'}"], d / f"resume_{layout}.log",
                _env("x" * 16))
        rc = r.wait(900)
        out.append({"scenario": f"cona_resume_{layout}_layout", "survived": rc == 0,
                    "exit_codes": [rc], "bytes_lost": 0})
    return out


def straggler_replan(root: Path, cache: str, rounds: int) -> dict:
    """A 10x straggler that triggers a re-plan (real mode, one ``torchrun`` of two
    ranks playing both workers, gloo): worker ``w1`` sleeps 9x its compute from
    round 1 on, re-planning on.  Survived: the run exits 0 after all rounds, at
    least one re-plan happened, and every round's tokens stay within the plan's
    tolerance of the budget ``T = inner_steps · global_batch_size · seq_length``
    (a re-plan once put 8.7 T into a round, issue 25)."""
    d = root / "straggler_replan"
    d.mkdir(parents=True, exist_ok=True)
    cluster = d / "cluster.yaml"
    cluster.write_text(json_text({
        "name": "straggler", "mode": "real", "rendezvous": f"127.0.0.1:{free_port()}",
        "regions": [{"name": r, "id": i} for i, r in enumerate(REGIONS[:2])],
        "workers": [{"name": f"w{i}", "gpu": "A100-80GB", "num_gpus": 1, "region": r}
                    for i, r in enumerate(REGIONS[:2])],
        "slowdown": [{"worker": "w1", "factor": 10.0, "from_round": 1}]}))
    inner, batch, seq, tol = 4, 8, 32, 0.05  # SMALL's batch and sequence; the planner's tolerance
    run = d / "run"
    watch = Watch([run])
    p = Run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", "train.py", "--config", "tiny_gpt", "--run-dir", str(run), *SMALL,
             f"data.cache_dir={cache}", f"geomesh.cluster={cluster}", "geomesh.method=geomesh",
             f"geomesh.inner_steps={inner}", f"geomesh.outer_steps={rounds}",
             f"geomesh.plan_tolerance={tol}", "geomesh.replan=true"], d / "torchrun.log",
            _env("x" * 16))
    rc = p.wait(1200)
    lost = watch.lost()
    m = run / "metrics.jsonl"
    records = [json.loads(x) for x in m.read_text().splitlines()] if m.is_file() else []
    budget = inner * batch * seq
    tokens = [sum(r["proxy_samples"]) * seq for r in records]
    worst = max((abs(t - budget) / budget for t in tokens), default=None)
    replans = sum(bool(r.get("replanned")) for r in records)
    ok = rc == 0 and len(records) == rounds and replans >= 1 and worst is not None and worst <= tol
    return {"scenario": "straggler_replan", "survived": bool(ok), "exit_codes": [rc],
            "bytes_lost": lost, "replans": replans, "token_budget": budget,
            "round_tokens": tokens, "max_token_deviation": worst,
            "batch_sizes": [r["batch_sizes"] for r in records],
            "inner_steps": [r["inner_steps"] for r in records],
            "imbalance": [round(r["imbalance"], 3) for r in records]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and bad inputs")
    ap.add_argument("--out", default=None, help="folder for logs and faults.json")
    ap.add_argument("--cache-dir", default=".cache", help="tokenizer/corpus cache (data.cache_dir)")
    args = ap.parse_args(argv)
    from jobruntime.outputs import refuse_output_folder

    refuse_output_folder(ap, args.out)  # before the run, not after it
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="faults-"))
    root.mkdir(parents=True, exist_ok=True)
    rounds = 6 if args.quick else 12
    t0 = time.monotonic()
    results = []
    for name, kw in SCENARIOS.items():
        res = geomesh(root, args.cache_dir, name, rounds * ROUNDS_SCALE.get(name, 1), **kw)
        results.append(res)
        print(json_text(res), flush=True)
    for kind in (lighthouse_restart, lighthouse_lost, straggler_replan):
        results.append(kind(root, args.cache_dir, rounds))
        print(json_text(results[-1]), flush=True)
    for res in cona_switch(root, args.cache_dir):
        results.append(res)
        print(json_text(res), flush=True)
    from bench.faults_inputs import HOSTILE_KINDS, bad_inputs, hostile

    h_tried, h_rejected = hostile()
    kinds = [kind() for kind in HOSTILE_KINDS]
    h_tried += sum(k["tried"] for k in kinds)
    h_rejected += sum(k["rejected"] for k in kinds)
    b_tried, b_clean = bad_inputs(50 if args.quick else 500, root / "bad")
    summary = {
        "faults_injected": len(results), "faults_survived": sum(r["survived"] for r in results),
        "hostile_tried": h_tried, "hostile_rejected": h_rejected,
        "bad_inputs_tried": b_tried, "clean_errors": b_clean,
        "hostile_kinds": kinds, "bytes_lost": sum(r["bytes_lost"] for r in results),
        "wall_s": round(time.monotonic() - t0, 1), "quick": args.quick,
    }
    from jobruntime.metrics import provenance, write_json_atomic

    write_json_atomic(root / "faults.json", {"summary": summary, "scenarios": results,
                                             **provenance()})
    print(json_text(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
