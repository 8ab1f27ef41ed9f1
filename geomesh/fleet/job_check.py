"""Every check of a GeoMesh job that needs only its config, the cluster file and the
process count: run by ``train.py`` before its heavy imports (megatron, ~10 s) and by
:func:`geomesh.context.build_context` before any process group, data or plan.

Torch-free.  What it checks, in order: the method and the section's own settings
(:meth:`jobruntime.config.GeoMeshConfig.validate`); the cluster file
(:func:`geomesh.fleet.cluster.load_cluster`) and the method against its mode;
``geomesh.region`` against the mode; every region's shape against the model it must
hold (:func:`geomesh.fleet.shapes.check_region_shapes`); ``cona.schedule``
(:func:`geomesh.fleet.schedule.check_schedule`); then, in real mode, how the job was
launched: ``geomesh.region`` among the cluster's regions, the run's secret, the process
count against the workers' ``tp · pp · dp`` and the validation batch against their DP.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jobruntime.config import ConfigError, JobConfig, load_config

from .cluster import ClusterError, ClusterSpec, WorkerSpec, load_cluster
from .schedule import check_schedule
from .shapes import check_region_shapes
from .worker_models import OUTER_STATE_BYTES, MemoryModel

METHODS = ("geomesh", "diloco", "streaming_diloco", "ddp", "async")


@dataclass(frozen=True)
class CheckedJob:
    """What the checks loaded, for the run to build on."""

    cluster: ClusterSpec
    """The cluster file, its mode resolved (``geomesh.mode`` over the file's)."""
    target: JobConfig
    """The model that sets time and bytes: ``geomesh.target_model`` in emulated mode, else
    the job's own."""
    memory: MemoryModel
    """The planner's memory model of ``target``: ``θ_global`` and the outer momentum (fp32,
    8 bytes/parameter) and the packed message (~1/8 byte) stay on the worker's GPUs next to
    its shard (:func:`geomesh.report.memory_overhead`); the error-feedback residual and the
    overlap snapshot live in host memory."""


def worker_shape(w: WorkerSpec) -> tuple[int, int, int]:
    """``(tp, pp, dp)`` of a worker: its processes are ``num_gpus = tp · pp · dp``."""
    return w.tp, w.pp, w.num_gpus // (w.tp * w.pp)


def job_worker_shape(cluster: ClusterSpec, region: str | None) -> tuple[int, int, int]:
    """``(tp, pp, dp)`` of the workers this real-mode job runs: the one worker of
    ``region`` (one job per region), or every worker's (one torchrun for the cluster).

    Raises:
        ClusterError: an unknown region, a region of several workers, or one torchrun
            for workers whose shapes differ.
    """
    if region is not None:
        try:
            cluster.region(region)
        except KeyError:
            raise ClusterError(
                f"geomesh.region={region!r} is not a region of cluster '{cluster.name}'; use one "
                f"of {[r.name for r in cluster.regions]}") from None
        members = cluster.workers_in(region)
        if len(members) != 1:
            raise ClusterError(
                "one job per region runs one worker (its replicas inside: num_gpus = tp * pp * "
                f"dp); region {region!r} of cluster '{cluster.name}' has {len(members)} workers: "
                "merge them into one worker of more GPUs, or split the region")
        return worker_shape(members[0])
    shapes = {(w.tp, w.pp, w.num_gpus) for w in cluster.workers}
    if len(shapes) != 1:
        raise ClusterError(
            f"one torchrun for the whole cluster needs the same tp, pp and num_gpus on every "
            f"worker, cluster '{cluster.name}' has {sorted(shapes)}; run one job per region "
            "(geomesh.region=<name>, e.g. python -m geomesh.launch_local), where regions may "
            "differ, or use mode: emulated"
        )
    return worker_shape(cluster.workers[0])


def check_job(cfg: JobConfig, world_size: int) -> CheckedJob:
    """Check a GeoMesh job (``geomesh.method != none``) against its cluster file.

    Args:
        cfg: the job config.
        world_size: this job's processes (torchrun's ``WORLD_SIZE``; 1 without torchrun).

    Raises:
        ConfigError: the first bad setting, named, with the fix.
        ClusterError: a bad cluster file, region, process count or region shape.
    """
    job = check_settings(cfg)
    if job.cluster.mode != "emulated":  # how the job was launched, once its settings hold
        _check_processes(cfg, job.cluster, world_size)
    return job


def check_settings(cfg: JobConfig, *, schedule: bool = True) -> CheckedJob:
    """:func:`check_job` but how the job was launched: the method, the cluster file, every
    region's shape against the model and its GPUs' memory, ``cona.schedule`` (with
    ``schedule``: it needs the job's own ``geomesh.region``).  The launcher
    (:mod:`geomesh.launch_local`) runs it once, without ``schedule``, before it starts
    any region (it sets each job's region; each job checks its schedule).

    Raises:
        ConfigError, ClusterError: as :func:`check_job`.
    """
    g = cfg.geomesh
    if g.method not in METHODS:
        raise ConfigError(f"geomesh.method={g.method!r}: use one of {list(METHODS)}")
    g.validate()
    cluster = load_cluster(g.cluster, wan_bandwidth_scale=g.wan_bandwidth_scale)
    cluster = dataclasses.replace(cluster, mode=g.mode or cluster.mode)
    emulated = cluster.mode == "emulated"
    if emulated and g.region is not None:
        raise ConfigError("geomesh.region is for real mode (one torchrun per region); unset it")
    if not emulated:
        if g.method == "ddp" and g.region is not None:  # each region would train alone
            raise ConfigError("geomesh.method=ddp all-reduces every step over one process "
                              "group: run the cluster as one torchrun (unset geomesh.region); "
                              "one job per region runs geomesh or diloco")
        if g.method in ("async", "streaming_diloco"):
            raise ConfigError(
                f"geomesh.method={g.method} runs in emulated mode only; set geomesh.mode=emulated"
                + (" (real mode: torchft.local_sgd.DiLoCo)" if g.method == "streaming_diloco"
                   else ""))
    target = load_config(g.target_model) if emulated and g.target_model else cfg
    memory = MemoryModel(model=target.model, seq_length=target.model.seq_length,
                         extra_bytes_per_param=OUTER_STATE_BYTES)
    check_region_shapes(cluster, target.model, memory, model_name=(
        f"the target model {target.name} (geomesh.target_model)" if target is not cfg
        else f"the model {cfg.name}"))
    if schedule:
        check_schedule(cfg, cluster, memory, model_name=f"the model {cfg.name}")
    return CheckedJob(cluster=cluster, target=target, memory=memory)


def _check_processes(cfg: JobConfig, cluster: ClusterSpec, world_size: int) -> None:
    """Real mode: the job's process count and validation batch, and (one job per region)
    the run's secret."""
    from ..wire.envelope import load_secret  # torch-free

    g = cfg.geomesh
    tp, pp, dp_in = job_worker_shape(cluster, g.region)
    if g.region is not None:
        load_secret(g.secret_file)
    check_world(cluster, g.region, world_size)
    per = cfg.parallel.micro_batch_size * dp_in
    if cfg.parallel.global_batch_size % per:
        raise ConfigError(
            f"parallel.global_batch_size={cfg.parallel.global_batch_size} (validation batch) "
            f"is not a multiple of micro_batch_size*dp_in={per}; change one of them")


def check_world(cluster: ClusterSpec, region: str | None, world_size: int) -> None:
    """Real mode: this job's process count against its workers' ``tp · pp · dp`` (the
    region's one worker, or every worker for one torchrun); run before the process group
    from ``WORLD_SIZE`` and after it from the group's size.

    Raises:
        ClusterError: the counts differ (names the count to launch).
    """
    tp, pp, dp_in = job_worker_shape(cluster, region)
    if region is not None:
        if world_size != tp * pp * dp_in:
            raise ClusterError(
                f"region {region!r} has 1 worker of {tp * pp * dp_in} process(es) (tp={tp}, "
                f"pp={pp}, dp={dp_in}); launch its torchrun with {tp * pp * dp_in} processes, "
                f"not {world_size}")
        return
    K = len(cluster.workers)
    if world_size != K * tp * pp * dp_in:
        raise ClusterError(
            f"cluster '{cluster.name}' has {K} workers of {tp * pp * dp_in} process(es) = "
            f"{K * tp * pp * dp_in} ranks, but the world has {world_size}; launch that many "
            "processes")
