"""Entry point of a GeoMesh job: ``run(cfg, run_dir) -> summary``.

``train.py`` calls :func:`run` when ``geomesh.method`` is not ``none``::

    # emulated (the cluster file says mode: emulated): one process plays all workers
    python train.py --config tiny_gpt geomesh.cluster=four_region geomesh.method=geomesh \\
        geomesh.target_model=gpt3_1.3b

    # real, one torchrun for the whole cluster (4 processes = 2 workers of TP=2)
    torchrun --nproc-per-node 4 train.py --config tiny_gpt geomesh.cluster=FILE \\
        geomesh.method=geomesh

    # real, one torchrun per region, joined at the cluster file's rendezvous
    torchrun --nproc-per-node 1 train.py ... geomesh.region="East US"      # region 0
    torchrun --nproc-per-node 1 train.py ... geomesh.region="West Europe"  # region 1

Methods (``geomesh.method``): ``geomesh`` (planner-balanced ``b_i, H_i``,
sign compression with a scale per row, optional error feedback, outer
Nesterov; :mod:`geomesh.sync`),
``diloco`` (uniform ``b, H``, fp32 pseudo-gradients; :mod:`geomesh.sync`),
``streaming_diloco`` (fragments synchronised in turn, overlapped; emulated;
:mod:`geomesh.streaming`), ``ddp`` and ``async`` (:mod:`geomesh.baselines`).  Outputs under ``run_dir``:
``metrics.jsonl`` (one record per outer step: ``step, tokens, time_s, loss,
val_loss, val_ppl``, idle time, bytes, batch sizes), ``summary.json``
(:meth:`geomesh.report.RunStats.summary`), ``config.yaml``, ``wandb/`` (group
``logging.group``, default ``geomesh-<cluster>``), and with
``checkpoint.save_interval`` (in outer steps) ``checkpoints/``
(:mod:`geomesh.state`); ``checkpoint.load`` resumes.  ``train.iters`` is not
used: a worker runs ``outer_steps · H_i`` inner steps, its LR schedule spans
them, ``train.warmup_iters`` is scaled by ``H_i / H``.

Errors: :class:`~jobruntime.config.ConfigError` /
:class:`~geomesh.fleet.cluster.ClusterError` for bad settings, a wrong process
count, or a region that does not answer within ``geomesh.timeout_s`` (the
message names it) — ``train.py`` prints them on one line and exits with 2.
"""

from __future__ import annotations

import logging
from pathlib import Path

from jobruntime.faults import resume_advice

from .context import build_context
from .exchange.transport import RegionTimeoutError, TransportError
from .fleet.cluster import ClusterError

log = logging.getLogger(__name__)


def run(cfg, run_dir: Path) -> dict:
    """Run ``cfg.geomesh.method`` on ``cfg.geomesh.cluster``; return the summary.

    Raises:
        ConfigError, ClusterError, DataError, TokenizerError, CheckpointError: bad input.
    """
    run_dir = Path(run_dir)
    ctx = build_context(cfg, run_dir)
    try:
        if ctx.method in ("geomesh", "diloco"):
            from .sync import run_sync as fn
        elif ctx.method == "streaming_diloco":
            from .streaming import run_streaming as fn
        elif ctx.method == "ddp":
            from .baselines import run_ddp as fn
        else:
            from .baselines import run_async as fn
        try:
            summary = fn(ctx)
        except RegionTimeoutError as e:
            raise ClusterError(str(e)) from e
        except TransportError as e:  # a peer's process died mid-exchange
            raise ClusterError(f"{e}; another region's job stopped (see its log): restart all "
                               f"regions; {resume_advice(ctx.run_dir)}") from e
        summary["mode"] = ctx.cluster.mode
        ctx.writer.summary(summary)
        summary["wandb_dir"] = ctx.writer.wandb_dir
    finally:
        ctx.close()
    return summary
