"""Faults, hostile messages and bad inputs: what GeoMesh and CONA survive (real processes).

Usage::

    python bench/faults.py --quick --out runs/faults      # ~20 min on 2 idle cores

Each GeoMesh scenario runs a torchft lighthouse (``python -m geomesh.lighthouse``)
and two region jobs (``train.py ... geomesh.region=...``, one process each,
gloo) of ``tiny_gpt`` at test size, and injects one fault with
``GEOCONA_FAULT`` (SIGKILL at a named point: :mod:`jobruntime.faults`) or with
SIGSTOP/SIGCONT from here (a network stall):

* a worker killed after its inner steps (``train``), after the round's quorum
  (``exchange``), after the all-gather (``commit``), inside a checkpoint save
  (``save``); the store host (worker 0: torchft's quorum store is the lowest
  replica's) killed; a late join (worker 1 killed, restarted, heals); a stall
  of twice the heartbeat; the same loss with ``on_worker_loss=fail``;
* a 10x straggler that triggers a re-plan (one ``torchrun`` of 2 ranks playing
  both workers): survived when the run finishes, re-plans, and every round's
  tokens stay within the plan's tolerance of the budget (:func:`straggler_replan`);
* CONA (one ``torchrun`` of 2 ranks, gloo): rank 1 killed inside a layout
  switch, then the last checkpoint resumed at the old and at the new layout.

*Survived* means: ``continue`` — every job alive at the end exits 0 after all
rounds (a rejoined worker with the survivors' final loss); ``fail`` and the
CONA switch — every surviving process exits within the detection time with
exactly one ``error:`` line naming the lost region (or the switch) and no
traceback, and the resumes exit 0.  *Bytes lost*: run files (metrics,
committed checkpoints) seen during a run that are gone or shorter at its end
(``checkpoint.keep_last=0``, so nothing is rotated away).

Hostile messages (in process, the same Opener and Guard as a run): forged,
replayed, duplicated, other-run, other-version and wrong-slot envelopes, and
sealed insiders' absurd values, NaN bodies, token grabs, zero tokens and
malformed bodies.  Bad inputs: random config overrides, cluster files, wire
bytes and checkpoint files (seeded), counted when they are bad; a clean error
is the module's one-line error type.  Prints one line per scenario and, last,
one JSON object; ``--out`` also gets ``faults.json`` and the logs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
SMALL = ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
         "model.seq_length=32", "parallel.global_batch_size=8", "parallel.micro_batch_size=2",
         "train.eval_iters=1", "train.warmup_iters=2", "logging.wandb=disabled",
         "logging.progress=on"]
HEARTBEAT_S = 5.0
SLOWDOWN = 8.0  # each round sleeps 7x its compute time (geomesh/cluster.py ``slowdown``)
REGIONS = ["East US", "West Europe"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def geomesh(root: Path, cache: str, name: str, rounds: int, *, fault: tuple[int, str] | None = None,
            policy: str = "continue", rejoin: bool = False, stall: bool = False) -> dict:
    """One GeoMesh scenario (module docstring); returns its result record."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    port, secret = _port(), os.urandom(16).hex()
    cluster = d / "cluster.yaml"
    cluster.write_text(json.dumps({
        "name": name, "mode": "real", "rendezvous": f"127.0.0.1:{port}",
        "regions": [{"name": r, "id": i} for i, r in enumerate(REGIONS)],
        "workers": [{"name": f"w{i}", "gpu": "A100-80GB", "num_gpus": 1, "region": r}
                    for i, r in enumerate(REGIONS)],
        # rounds of seconds, not a fraction of one: a restart or a stall lands mid-run
        "slowdown": [{"worker": f"w{i}", "factor": SLOWDOWN} for i in range(2)]}))
    lh = Run([sys.executable, "-m", "geomesh.lighthouse", "--bind", f"127.0.0.1:{port}",
              "--heartbeat-s", str(HEARTBEAT_S), "--join-timeout-s", "120"], d / "lighthouse.log",
             _env(secret))
    common = [*SMALL, f"data.cache_dir={cache}", f"geomesh.cluster={cluster}",
              "geomesh.method=geomesh", "geomesh.inner_steps=2", f"geomesh.outer_steps={rounds}",
              "geomesh.replan=false", f"geomesh.heartbeat_s={HEARTBEAT_S}", "geomesh.timeout_s=120",
              f"geomesh.on_worker_loss={policy}", "checkpoint.save_interval=1",
              "checkpoint.keep_last=0"]

    def job(k: int, tag: str, fault_spec: str | None) -> Run:
        return Run([sys.executable, "train.py", "--config", "tiny_gpt", "--run-dir",
                    str(d / f"{tag}{k}"), *common, f"geomesh.region={REGIONS[k]}"],
                   d / f"{tag}{k}.log", _env(secret, fault_spec))

    jobs = [job(k, "w", fault[1] if fault and fault[0] == k else None) for k in range(2)]
    watch = Watch([d / "w0", d / "w1", d / "re1"])
    victim = fault[0] if fault else 1
    extra: list[Run] = []
    if stall or rejoin:  # wait for round 2 of the victim (its metrics), then act
        deadline = time.monotonic() + 600
        m = d / f"w{victim}" / "metrics.jsonl"
        while time.monotonic() < deadline and jobs[victim].p.poll() is None and (
                not m.is_file() or len(m.read_text().splitlines()) < 2):
            time.sleep(0.2)
        if stall:
            jobs[victim].p.send_signal(signal.SIGSTOP)
            time.sleep(2 * HEARTBEAT_S)
            jobs[victim].p.send_signal(signal.SIGCONT)
    if rejoin:
        jobs[victim].wait(600)  # killed by its fault
        time.sleep(2)
        extra.append(job(victim, "re", None))
    rcs = [j.wait(1200) for j in jobs] + [j.wait(1200) for j in extra]
    lh.p.terminate()
    lh.wait(30)
    lost = watch.lost()
    texts = [j.text() for j in jobs + extra]
    survivors = [i for i in range(2) if not (fault and fault[0] == i and not stall)]
    if policy == "fail":
        lost_region = REGIONS[victim]
        # the victim must have died of its fault (-9): a survivor that stopped first saw a
        # loss that was not there (a false detection), which is not surviving
        ok = rcs[victim] == -signal.SIGKILL and all(
            rcs[i] == 3 and _clean_exit(texts[i], lost_region) for i in survivors)
        # detection: from the lost worker's death to the last survivor's exit
        detect = max((jobs[i].t_exit or time.monotonic()) for i in survivors) - (
            jobs[victim].t_exit or time.monotonic())
    else:
        alive = survivors + ([2] if extra else [])
        ok = all(rcs[i] == 0 and f"outer step {rounds}/{rounds}" in texts[i] for i in alive)
        if extra:  # the rejoined worker ends with the survivors' model
            finals = [texts[i].rsplit("final val ppl", 1)[-1].split(",")[0] for i in alive]
            ok = ok and len(set(finals)) == 1
        detect = None
    return {"scenario": name, "survived": bool(ok), "exit_codes": rcs, "bytes_lost": lost,
            **({"detect_s": round(detect, 1)} if detect is not None else {})}


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
    cluster.write_text(json.dumps({
        "name": "straggler", "mode": "real", "rendezvous": f"127.0.0.1:{_port()}",
        "regions": [{"name": r, "id": i} for i, r in enumerate(REGIONS)],
        "workers": [{"name": f"w{i}", "gpu": "A100-80GB", "num_gpus": 1, "region": r}
                    for i, r in enumerate(REGIONS)],
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


def hostile() -> tuple[int, int]:
    """Hostile messages tried and rejected (envelopes, then sealed insiders)."""
    from geomesh.codec import DenseCodec, SignCodec
    from geomesh.envelope import DATA, EnvelopeError, Opener, Sealer
    from geomesh.guard import Guard
    from tests.test_geomesh_trust import _schema, hostile_cases

    tried = rejected = 0
    s, o = Sealer(b"s" * 32, 1), Opener(b"s" * 32, 1)
    ok = s.seal(b"m", kind=DATA, round=5, worker=1)
    o.open(ok, round=5, sender=1)
    forged = bytearray(ok)
    forged[20] ^= 1
    envelopes = [ok, bytes(forged), s.seal(b"m", kind=DATA, round=4, worker=1),
                 Sealer(b"s" * 32, 2).seal(b"m", kind=DATA, round=5, worker=1),
                 Sealer(b"t" * 32, 1).seal(b"m", kind=DATA, round=5, worker=1),
                 s.seal(b"m", kind=DATA, round=5, worker=0), ok[:50],
                 ok[:4] + b"\x09\x00" + ok[6:]]
    for e in envelopes:
        tried += 1
        try:
            o.open(e, round=5, sender=1)
        except EnvelopeError:
            rejected += 1
    for codec in (SignCodec(_schema()), DenseCodec(_schema(False))):
        cases = hostile_cases(codec)
        cases["malformed"] = [*cases["huge_values"][:2], b"GMSH" + bytes(100)]
        for msgs in cases.values():
            guard = Guard(["a", "b", "c"], ["A", "B", "C"])
            guard.expect({0: 100, 1: 100, 2: 100})
            _, tokens = codec.aggregate(msgs, guard=guard)
            tried += 1
            rejected += tokens[2] == 0 and tokens[:2] == [100, 100]
    return tried, rejected


def bad_inputs(n: int, tmp: Path) -> tuple[int, int]:
    """Seeded random bad inputs to the four loaders; ``(bad tried, clean one-line errors)``."""
    import dataclasses

    import torch
    import yaml

    from geomesh.cluster import ClusterError, cluster_from_dict
    from geomesh.codec import SignCodec
    from geomesh.compression import MessageError
    from geomesh.context import _validate
    from geomesh.state import load_state
    from jobruntime.checkpoint import CheckpointError
    from jobruntime.config import ConfigError, JobConfig, load_config
    from tests.test_geomesh_trust import _named, _schema

    rng = random.Random(0)
    keys = [f"{s}.{f.name}" for s in ("model", "parallel", "train", "geomesh", "cona")
            for f in dataclasses.fields(getattr(JobConfig(), s))]
    junk = ["-1", "0", "nan", "inf", "abc", "[1,", "{}", "1e999", "", "null", "-0.5", "true"]
    base = yaml.safe_load((REPO / "geomesh/clusters/four_region.yaml").read_text())
    codec = SignCodec(_schema())
    good = codec.encode(_named(0), 100, worker=0, round=0)
    tried = clean = 0

    def check(fn, kinds) -> None:
        nonlocal tried, clean
        try:
            fn()
        except kinds as e:
            tried += 1
            clean += "\n" not in str(e) and bool(str(e))
        except Exception:  # noqa: BLE001 - an unclean error is what this counts
            tried += 1

    def config():
        cfg = load_config("tiny_gpt", [f"{rng.choice(keys)}={rng.choice(junk)}"
                                       for _ in range(rng.randint(1, 3))])
        cfg.validate_sections()
        if cfg.geomesh.method != "none":
            _validate(cfg)

    def cluster():
        raw = json.loads(json.dumps(base))
        node = raw["workers"][rng.randrange(4)] if rng.random() < 0.6 else raw
        text = rng.choice(junk) or "x"
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:  # the bench's own parsing: give the product the raw text
            value = text
        node[rng.choice(list(node))] = value
        cluster_from_dict(raw)

    def wire():
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] ^= rng.randint(1, 255)
        codec.aggregate([bytes(data[:rng.randint(0, len(data))] if rng.random() < 0.3
                               else data)])

    def checkpoint():
        f = tmp / "checkpoints" / "outer_0000001"
        f.mkdir(parents=True, exist_ok=True)
        (f / "COMPLETE").write_text("x")
        (f / "rank00000.pt").write_bytes(rng.randbytes(rng.randint(0, 300)))
        load_state(tmp / "checkpoints", rank=0)

    torch.manual_seed(0)
    for _ in range(n):
        check(config, ConfigError)
        check(cluster, ClusterError)
        check(wire, MessageError)
        check(checkpoint, CheckpointError)
    return tried, clean


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
    plan = [
        ("worker_killed_in_train", dict(fault=(1, "train@2"))),
        ("worker_killed_at_exchange", dict(fault=(1, "exchange@2"))),
        ("worker_killed_before_commit", dict(fault=(1, "commit@2"))),
        ("worker_killed_in_checkpoint_save", dict(fault=(1, "save@2"))),
        ("store_host_killed", dict(fault=(0, "train@2"))),
        ("late_join", dict(fault=(1, "train@1"), rejoin=True)),
        ("network_stall", dict(stall=True)),
        ("worker_lost_fail_policy", dict(fault=(1, "train@2"), policy="fail")),
        ("store_host_lost_fail_policy", dict(fault=(0, "train@2"), policy="fail")),
    ]
    for name, kw in plan:
        res = geomesh(root, args.cache_dir, name, rounds if name != "late_join" else 3 * rounds,
                      **kw)
        results.append(res)
        print(json.dumps(res), flush=True)
    results.append(straggler_replan(root, args.cache_dir, rounds))
    print(json.dumps(results[-1]), flush=True)
    for res in cona_switch(root, args.cache_dir):
        results.append(res)
        print(json.dumps(res), flush=True)
    h_tried, h_rejected = hostile()
    b_tried, b_clean = bad_inputs(50 if args.quick else 500, root / "bad")
    summary = {
        "faults_injected": len(results), "faults_survived": sum(r["survived"] for r in results),
        "hostile_tried": h_tried, "hostile_rejected": h_rejected,
        "bad_inputs_tried": b_tried, "clean_errors": b_clean,
        "bytes_lost": sum(r["bytes_lost"] for r in results),
        "wall_s": round(time.monotonic() - t0, 1), "quick": args.quick,
    }
    (root / "faults.json").write_text(json.dumps({"summary": summary, "scenarios": results},
                                                 indent=1))
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
