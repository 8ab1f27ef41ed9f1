"""Run a real-mode GeoMesh cluster on this machine: the lighthouse and one torchrun per region.

Usage::

    python -m geomesh.launch_local --cluster geomesh/clusters/four_shape_cpu.yaml \\
        --run-dir runs/four_shape geomesh.outer_steps=2

It starts the torchft lighthouse at the cluster's ``rendezvous``
(``python -m geomesh.lighthouse``, its log ``DIR/lighthouse.log``), waits until it
answers, then starts one ``torchrun --standalone --nproc-per-node N train.py``
per region, ``N`` = the GPUs (processes) of the region's workers, with
``geomesh.cluster=FILE geomesh.region=<region>`` and the overrides given here,
in ``DIR/<region slug>`` (e.g. ``DIR/east-us``; every rank's output in its
``job.log``).  It waits for every region, stops the lighthouse and prints one
row per region: layout (tp/pp/dp), exit code, and what its ``summary.json``
holds (``b_i``, ``H_i``, validation perplexity, θ_global's digest, wall time,
bytes, idle).  The lighthouse gets the jobs' ``geomesh.heartbeat_s`` and
``geomesh.timeout_s``; ``geomesh.method`` defaults to ``geomesh``, ``--config``
to ``tiny_gpt``.  Without ``$GEOMESH_SECRET`` or ``geomesh.secret_file`` one
random secret is made for the run and given to the jobs in their environment;
``OMP_NUM_THREADS`` defaults to this machine's cores over all processes.

``--resume`` goes on with the run in ``--run-dir``: every region from the newest round that
every region saved complete (:mod:`geomesh.launch_resume`) with its saved ``config.yaml``
(no ``--config``; overrides still apply, e.g. a larger ``geomesh.outer_steps``), its output
appended to its folder.

A lost region does not leave the others waiting forever: with
``geomesh.on_worker_loss=continue`` (the default) they finish the run without it,
with ``fail`` they stop within the heartbeat (exit 3), and a job that writes
nothing for ``geomesh.timeout_s + geomesh.heartbeat_s + 60`` s after a loss is
stopped here.  Ctrl-C (or SIGTERM) stops every job's process tree and the
lighthouse (SIGTERM, then SIGKILL after 15 s); a worker whose torchrun died
is stopped too (:mod:`geomesh.proctree`), so nothing outlives the launcher
unless the launcher itself is SIGKILLed.

Exit codes: 0 every region's job exited 0; 1 a region failed (one ``error:`` line
per failed region, in the order they exited: its name, exit code, cause and log; then the
``--resume`` command that goes on, or why the run cannot); 2 bad input (cluster file,
config, run folder, a lighthouse that cannot bind), or every failed region failed
on bad input; 130 interrupted (and the ``--resume`` line).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from geomesh.fleet.cluster import ClusterError, ClusterSpec, load_cluster, resolve_cluster
from geomesh.fleet.job_check import check_settings
from geomesh.wire.envelope import SECRET_ENV
from jobruntime.config import (
    ConfigError,
    JobConfig,
    check_overrides_used,
    load_config,
    parse_override,
)
from jobruntime.faults import ENV as FAULT_ENV
from jobruntime.faults import REGION_ENV as FAULT_REGION_ENV
from jobruntime.outputs import RUN_OUTPUTS, output_folder_error

from .launch_resume import (
    LaunchError,
    resume_hint,
    resume_load,
    resume_round,
    set_aside_newer,
)
from .proctree import become_subreaper, start_tree, stop_trees, sweep_orphans

TRAIN_PY = Path(__file__).resolve().parent.parent / "train.py"
DEFAULT_CONFIG = "tiny_gpt"  # --config without one
LIGHTHOUSE_START_S = 60.0  # the lighthouse loads no torch (~1 s), but 2 loaded cores are slow
STOP_GRACE_S = 15.0  # SIGTERM -> SIGKILL: train.py stops on SIGTERM and exits 3
STALL_SLACK_S = 60.0  # over timeout_s + heartbeat_s: how long a survivor may stay silent
POLL_S = 0.5
EXIT_INTERRUPTED = 130  # the shell's code for a Ctrl-C


@dataclass
class RegionJob:
    """One region's ``torchrun`` and what came of it.

    Attributes:
        region: region name (``geomesh.region``).
        slug: folder name of the region under the run folder.
        nproc: processes of the job (the sum of its workers' ``num_gpus``).
        layout: ``(tp, pp, dp)`` of its (first) worker, from the cluster file.
        run_dir: the job's ``--run-dir``; its output goes to ``run_dir / "job.log"``.
        cmd: the command line.
        rc: the job's exit code once it has exited (``None`` while it runs).
        wall_s: from the job's start to its exit (seconds).
        stalled: stopped here after a loss because it wrote nothing for too long.
    """

    region: str
    slug: str
    nproc: int
    layout: tuple[int, int, int]
    run_dir: Path
    cmd: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = field(default=None, repr=False)
    t0: float = 0.0
    started_at: float = 0.0  # time.time() at its start: a summary.json older is not its
    log_offset: int = 0  # where its output starts in job.log (a resumed job's follows)
    rc: int | None = None
    wall_s: float | None = None
    stalled: bool = False

    @property
    def log(self) -> Path:
        return self.run_dir / "job.log"

    def log_text(self) -> str:
        """This job's output in ``job.log`` (not an earlier part's, before a resume)."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""


def region_slug(name: str) -> str:
    """Folder name of a region: lower case, runs of other characters as ``-`` (``East US`` -> ``east-us``)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def region_folder(region) -> str:
    """A region's folder under the run folder: its slug, or ``region<id>`` for a name
    without letters or digits."""
    return region_slug(region.name) or f"region{region.region_id}"


def plan_jobs(cluster: ClusterSpec, cluster_file: Path, run_dir: Path, config: str | None,
              overrides: list[str], resume_step: int | None = None) -> list[RegionJob]:
    """One :class:`RegionJob` per region of ``cluster``, in region-id order (no process started).

    With ``resume_step`` (a ``--resume``'s :func:`~geomesh.launch_resume.resume_round`)
    each region's job goes on from its folder's checkpoint of that round with its own saved
    config (``--config REGION/config.yaml checkpoint.load=REGION/checkpoints/outer_N``:
    :func:`jobruntime.faults.resume_command`'s advice, with the round's folder named),
    ``config`` unused.

    Raises:
        LaunchError: two regions whose names give the same folder name.
    """
    jobs, seen = [], {}
    for r in cluster.regions:
        workers = cluster.workers_in(r.name)
        slug = region_folder(r)
        if slug in seen:
            raise LaunchError(f"regions {seen[slug]!r} and {r.name!r} both map to the folder "
                              f"{slug!r}; rename one of them in {cluster_file}")
        seen[slug] = r.name
        w = workers[0]
        nproc = sum(x.num_gpus for x in workers)
        job = RegionJob(region=r.name, slug=slug, nproc=nproc, layout=(w.tp, w.pp, w.dp),
                        run_dir=run_dir / slug)
        if resume_step is not None:  # its own saved config, from the common round's checkpoint
            preset, first, last = job.run_dir / "config.yaml", [], [resume_load(job, resume_step)]
        else:
            preset, first, last = config or DEFAULT_CONFIG, ["geomesh.method=geomesh"], []
        job.cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), str(TRAIN_PY), "--config", str(preset),
                   "--run-dir", str(job.run_dir), *first, *overrides, *last,
                   f"geomesh.cluster={cluster_file}", f"geomesh.region={r.name}"]
        jobs.append(job)
    return jobs


def check_inputs(args: argparse.Namespace) -> tuple[ClusterSpec, Path, JobConfig]:
    """Load the cluster and the job config as the region jobs will; refuse what cannot run.
    With ``args.resume`` the config is the first region's saved ``config.yaml`` under
    ``args.run_dir`` (every region's holds the same settings but its region).

    Returns:
        ``(cluster, absolute cluster path, job config)``.

    Raises:
        LaunchError, ClusterError, ConfigError: the one-line reason (exit 2).
    """
    for text in args.overrides:
        keys, _ = parse_override(text)
        if keys in (["geomesh", "cluster"], ["geomesh", "region"]):
            raise LaunchError(f"{text!r}: the launcher sets geomesh.{keys[1]} for every region "
                              "itself; give the cluster with --cluster and drop this override")
        if args.resume and keys in (["checkpoint", "load"], ["checkpoint", "load_optimizer"]):
            raise LaunchError(f"{text!r}: --resume loads every region's own checkpoints with "
                              "their optimizer state; drop this override")
    path = resolve_cluster(args.cluster).resolve()
    if args.resume:
        if args.config is not None:
            raise LaunchError("--resume: every region goes on with its own saved config.yaml; "
                              "drop --config (overrides still apply, e.g. geomesh.outer_steps)")
        first = min(load_cluster(path).regions, key=lambda r: r.region_id)
        saved = Path(args.run_dir) / region_folder(first)
        if not (saved / "config.yaml").is_file():
            raise LaunchError(f"--resume: {saved} holds no config.yaml of a run to resume; give "
                              "the --run-dir of an earlier launch with this --cluster")
        cfg = load_config(str(saved / "config.yaml"), [*args.overrides, f"geomesh.cluster={path}",
                                                       f"checkpoint.load={saved / 'checkpoints'}"])
    else:
        cfg = load_config(args.config or DEFAULT_CONFIG, ["geomesh.method=geomesh",
                                                          *args.overrides, f"geomesh.cluster={path}"])
    cfg.validate_sections()
    cfg.geomesh.validate()  # what each region's train.py would refuse, once, before any start
    check_overrides_used(cfg, args.overrides)
    g = cfg.geomesh
    cluster = load_cluster(path, wan_bandwidth_scale=g.wan_bandwidth_scale)
    mode = g.mode or cluster.mode
    if mode != "real" or not cluster.rendezvous:
        raise LaunchError(
            f"--cluster {args.cluster} is {mode} mode{'' if cluster.rendezvous else ' without a rendezvous'}"
            f"; the launcher runs real-mode clusters (mode: real, rendezvous: host:port), an "
            f"emulated one runs in one process: python train.py geomesh.cluster={args.cluster} "
            "geomesh.method=geomesh")
    if g.method == "none":
        raise LaunchError("geomesh.method=none trains one ordinary job; the launcher runs a "
                          "GeoMesh method (geomesh, diloco): drop the override")
    if g.method not in ("geomesh", "diloco"):  # ddp: one process group; the others emulated
        raise LaunchError(f"geomesh.method={g.method} does not run as one job per region; the "
                          "launcher runs geomesh or diloco (ddp: one torchrun for the whole "
                          "cluster; async, streaming_diloco: emulated mode)")
    if not (0 < g.heartbeat_s <= g.timeout_s < float("inf")):
        raise LaunchError(f"geomesh.heartbeat_s={g.heartbeat_s} and geomesh.timeout_s={g.timeout_s}"
                          " must be positive, heartbeat_s at most timeout_s")
    check_settings(cfg, schedule=False)  # every region's shape, as each job checks its own
    return cluster, path, cfg


# -- the lighthouse -------------------------------------------------------------------


def start_lighthouse(cluster: ClusterSpec, cluster_file: Path, cfg: JobConfig, run_dir: Path,
                     env: dict[str, str]) -> subprocess.Popen:
    """Start ``python -m geomesh.lighthouse`` with the jobs' heartbeat and timeout; wait until it answers.

    Raises:
        LaunchError: it exited (e.g. the rendezvous port is taken; its error line
            is in the message) or did not answer within :data:`LIGHTHOUSE_START_S`.
    """
    from geomesh.lighthouse import lighthouse_heartbeats

    log = run_dir / "lighthouse.log"
    cmd = [sys.executable, "-m", "geomesh.lighthouse", "--cluster", str(cluster_file),
           "--heartbeat-s", str(cfg.geomesh.heartbeat_s), "--join-timeout-s",
           str(cfg.geomesh.timeout_s)]
    host, port = cluster.rendezvous_host_port
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "[::]") else host
    proc = start_tree(cmd, log, env)
    deadline = time.monotonic() + LIGHTHOUSE_START_S
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
                why = next((x for x in lines if x.startswith("error:")), lines[-1] if lines else "")
                raise LaunchError(f"the lighthouse did not start ({why.removeprefix('error: ')}); "
                                  f"see {log}")
            try:
                lighthouse_heartbeats(f"http://{host}:{port}", timeout_s=1.0)
                return proc
            except OSError:
                time.sleep(0.2)
    except BaseException:  # Ctrl-C while waiting: the caller holds no handle to stop it
        stop_trees([proc], STOP_GRACE_S)
        raise
    stop_trees([proc], STOP_GRACE_S)
    raise LaunchError(f"the lighthouse did not answer at {host}:{port} within "
                      f"{LIGHTHOUSE_START_S:.0f} s; see {log}")


# -- running the regions --------------------------------------------------------------


def job_env(base: dict[str, str], region: str) -> dict[str, str]:
    """A region job's environment: ``base`` without the test-only fault variable
    when :data:`jobruntime.faults.REGION_ENV` names another region."""
    env = dict(base)
    target = env.pop(FAULT_REGION_ENV, None)
    if target is not None and target != region:
        env.pop(FAULT_ENV, None)
    return env


def _last_activity(job: RegionJob) -> float:
    """Latest write to the job's log or metrics (seconds since the epoch)."""
    times = [p.stat().st_mtime for p in (job.log, job.run_dir / "metrics.jsonl") if p.exists()]
    return max(times, default=0.0)


def wait_jobs(jobs: list[RegionJob], roots: set[int], stall_s: float) -> None:
    """Wait until every job has exited; after the first failure, stop jobs silent for ``stall_s`` seconds.

    Prints one line per job as it exits.  Sets ``rc``, ``wall_s`` and ``stalled``.
    ``roots``: the pids this launcher started (not orphans, see :func:`sweep_orphans`).
    """
    failed_at = None
    while any(j.rc is None for j in jobs):
        for j in jobs:
            if j.rc is not None:
                continue
            if j.proc.poll() is not None:
                j.rc, j.wall_s = j.proc.returncode, time.monotonic() - j.t0
                sweep_orphans(roots)  # what the job's torchrun left behind, if anything
                print(f"region {j.region}: exit code {j.rc} after {j.wall_s:.1f} s", flush=True)
                if j.rc != 0 and failed_at is None:
                    failed_at = time.time()
            elif failed_at is not None and time.time() - max(failed_at, _last_activity(j)) > stall_s:
                print(f"region {j.region}: no output for {stall_s:.0f} s after a region failed; "
                      "stopping it", flush=True)
                j.stalled = True
                (j.rc,), j.wall_s = stop_trees([j.proc], STOP_GRACE_S), time.monotonic() - j.t0
        time.sleep(POLL_S)


_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*)?(?:Error|Exception)\b: .*)$",
                        re.MULTILINE)


def failure_line(job: RegionJob) -> str:
    """One line naming a failed region, its exit code, the cause found in its log, and the log."""
    text = job.log_text()
    causes = []
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", text)  # torchrun's failure report per rank
    if codes:
        code = int(codes[-1])  # the last block is torchrun's root cause
        try:
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        except ValueError:  # not a signal number
            how = f"exited with {code}"
        causes.append(f"a process {how}")
    errors = [x.removeprefix("error:") for x in text.splitlines() if x.startswith("error:")]
    # no one-line error: a traceback's exception line (a rank's, not torchrun's own)
    errors = errors or [m.group(1) for m in _EXCEPTION.finditer(text)
                        if "torch.distributed.elastic" not in m.group(1)]
    if errors:
        causes.append(errors[0].strip()[:300])
    if job.stalled:
        causes.append("stopped by the launcher: no output after another region failed")
    cause = f" ({'; '.join(causes)})" if causes else ""
    return f"error: region {job.region!r} failed with exit code {job.rc}{cause}; log: {job.log}"


def bad_input_only(jobs: list[RegionJob]) -> bool:
    """Every failed job failed on bad input, as torchrun's report says: a rank exited 2,
    and its other ranks exited 2 too or were stopped by torchrun (SIGTERM, -15) once
    the first had failed (which of those a rank reports is a race)."""
    failed = [j for j in jobs if j.rc != 0]
    codes = [set(re.findall(r"exitcode\s*:\s*(-?\d+)", j.log_text())) for j in failed]
    return bool(failed) and all("2" in c and c <= {"2", "-15"} for c in codes)


# -- the table ------------------------------------------------------------------------


def _bytes(n) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def region_row(job: RegionJob) -> dict[str, str]:
    """The table row of one region: its layout and exit code, and what its
    ``summary.json`` holds (keys absent there are left out)."""
    path = job.run_dir / "summary.json"
    try:  # an earlier part's (before a resume) is not this job's
        s = json.loads(path.read_text()) if path.stat().st_mtime >= job.started_at else {}
    except (OSError, ValueError):
        s = {}
    mine = [w for w in s.get("workers", []) if w.get("region") == job.region]
    lay = s.get("layout")
    tp, pp, dp = ((lay["tp"], lay["pp"], lay["dp"]) if isinstance(lay, dict) else job.layout)
    row = {"region": job.region, "tp/pp/dp": f"{tp}/{pp}/{dp}", "exit": str(job.rc)}
    if mine:
        row["b_i"] = "+".join(str(w["batch_size"]) for w in mine if "batch_size" in w)
        row["H_i"] = "+".join(str(w["inner_steps"]) for w in mine if "inner_steps" in w)
    if s.get("final_val_ppl") is not None:
        row["val ppl"] = f"{s['final_val_ppl']:.2f}"
    if s.get("global_weights_sha256"):
        row["θ sha256"] = str(s["global_weights_sha256"])[:12]
    if job.wall_s is not None:  # the whole job: start, imports, joining, rounds
        row["job s"] = f"{job.wall_s:.1f}"
    if s.get("wall_s") is not None:  # the rounds alone (the run's own clock)
        row["rounds s"] = f"{s['wall_s']:.1f}"
    sent = s.get("bytes_sent", sum(w.get("sent_bytes", 0) for w in mine) if mine else None)
    if sent is not None:
        row["sent"] = _bytes(sent)
    if s.get("bytes_received") is not None:
        row["received"] = _bytes(s["bytes_received"])
    if mine and all(w.get("straggler_idle_s") is not None and w.get("wan_idle_s") is not None
                    for w in mine):
        row["idle s (straggler/WAN)"] = (f"{sum(w['straggler_idle_s'] for w in mine):.1f}/"
                                         f"{sum(w['wan_idle_s'] for w in mine):.1f}")
    row["summary"] = str(path) if path.is_file() else "-"
    return row


def format_table(rows: list[dict[str, str]]) -> str:
    """Rows as an aligned text table; a column appears when any row has it."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    width = {c: max(len(c), *(len(r.get(c, "-")) for r in rows)) for c in cols}
    lines = ["  ".join(c.ljust(width[c]) for c in cols)]
    lines += ["  ".join(r.get(c, "-").ljust(width[c]) for c in cols) for r in rows]
    return "\n".join(x.rstrip() for x in lines)


# -- main -----------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", required=True,
                   help="real-mode cluster YAML, or a name in geomesh/clusters/ (four_shape_cpu)")
    p.add_argument("--run-dir", required=True, help="folder of the run: one sub-folder per region")
    p.add_argument("--config", default=None, help="preset name or YAML (default: tiny_gpt)")
    p.add_argument("--resume", action="store_true",
                   help="go on with the run in --run-dir from every region's last complete "
                   "checkpoint, each with its saved config.yaml (raise geomesh.outer_steps to "
                   "train further after a finished run)")
    p.add_argument("overrides", nargs="*", help="section.key=value, given to every region's train.py")
    return p.parse_intermixed_args(argv)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def prepare(args: argparse.Namespace) -> tuple[list[RegionJob], ClusterSpec, Path, JobConfig,
                                               dict[str, str]]:
    """Validate the inputs, create the run folders, and build the jobs' environment.

    Raises:
        LaunchError, ClusterError, ConfigError: bad input (exit 2).
    """
    cluster, cluster_file, cfg = check_inputs(args)
    run_dir = Path(args.run_dir).resolve()
    if problem := output_folder_error(run_dir, "--run-dir"):
        raise LaunchError(problem)
    jobs = plan_jobs(cluster, cluster_file, run_dir, args.config, args.overrides)
    if args.resume:  # every region from the same round (geomesh/launch_resume.py)
        step = resume_round(jobs, cfg.geomesh.outer_steps)
        jobs = plan_jobs(cluster, cluster_file, run_dir, None, args.overrides, step)
        if line := set_aside_newer(jobs, step):
            print(line, flush=True)
    for j in jobs:
        if not args.resume and (held := [n for n in RUN_OUTPUTS if (j.run_dir / n).exists()]):
            raise LaunchError(f"--run-dir {run_dir}: {j.run_dir} already holds a run's results "
                              f"({', '.join(held)}); give a new folder, or go on with that run: "
                              "--resume")
    for j in jobs:
        j.run_dir.mkdir(parents=True, exist_ok=True)
        if not args.resume:  # a resumed job's output follows its first part's
            j.log.unlink(missing_ok=True)
    env = dict(os.environ)
    if not env.get(SECRET_ENV) and not cfg.geomesh.secret_file:
        env[SECRET_ENV] = secrets.token_hex(32)  # one run, one machine: a fresh secret
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // sum(j.nproc for j in jobs))))
    return jobs, cluster, cluster_file, cfg, env


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        jobs, cluster, cluster_file, cfg, env = prepare(args)
    except (LaunchError, ClusterError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = jobs[0].run_dir.parent
    lighthouse, roots = None, set()
    become_subreaper()  # a worker whose torchrun died becomes ours to stop
    # SIGINT too, explicitly: a launcher started in the background by a shell (``&``
    # without job control) inherits SIGINT ignored, and Python then installs no
    # handler, so ``kill -INT`` would leave every region training.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    interrupted = False
    try:
        try:
            lighthouse = start_lighthouse(cluster, cluster_file, cfg, run_dir, env)
        except LaunchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        roots.add(lighthouse.pid)
        print(f"lighthouse at {cluster.rendezvous} (log {run_dir / 'lighthouse.log'})", flush=True)
        for j in jobs:
            j.log_offset = j.log.stat().st_size if j.log.exists() else 0
            j.t0, j.started_at = time.monotonic(), time.time()
            j.proc = start_tree(j.cmd, j.log, job_env(env, j.region))
            roots.add(j.proc.pid)
            print(f"region {j.region}: {j.nproc} process(es), tp/pp/dp {'/'.join(map(str, j.layout))}"
                  f", log {j.log}", flush=True)
        g = cfg.geomesh
        wait_jobs(jobs, roots, g.timeout_s + g.heartbeat_s + STALL_SLACK_S)
    except KeyboardInterrupt:
        print("interrupted: stopping every region's job and the lighthouse", file=sys.stderr,
              flush=True)
        interrupted = True
    finally:
        # A second Ctrl-C must not cut the stop short (it takes at most STOP_GRACE_S per job).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        running = [j for j in jobs if j.proc is not None and j.rc is None]
        for j, rc in zip(running, stop_trees([j.proc for j in running], STOP_GRACE_S)):
            j.rc = rc  # whatever path led here, no job outlives the launcher
        if lighthouse is not None:  # after the jobs: they need it to leave their quorum
            stop_trees([lighthouse], STOP_GRACE_S)
        sweep_orphans(roots)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    hint = resume_hint(jobs, args.cluster, run_dir, cfg.geomesh.outer_steps,
                       args.overrides if args.resume else ())
    if interrupted:
        print(hint, file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    print(format_table([region_row(j) for j in jobs]), flush=True)
    # in the order they exited: the first is the likeliest cause of the others
    failed = sorted((j for j in jobs if j.rc != 0), key=lambda j: j.t0 + (j.wall_s or 0.0))
    for j in failed:
        print(failure_line(j), file=sys.stderr, flush=True)
    if not failed:
        return 0
    if bad_input_only(jobs):
        return 2
    print(hint, file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
