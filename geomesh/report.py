"""Run statistics of a GeoMesh comparison: per-worker time split, traffic, TTP, summary.

Every second of a worker is compute, straggler idle (waiting for a slower
worker's compute) or WAN idle (waiting for communication), see
:mod:`geomesh.fleet.clock`.  Fractions are over all workers' time together:

    straggler_idle_frac = Σ_i straggler_i / Σ_i (compute_i + straggler_i + wan_i)

and likewise ``wan_idle_frac``; ``sync_share`` is their sum, the share of
worker time spent synchronising rather than computing.  One job per region
measures its own worker's WAN idle only (another worker's exchange wait is
not in its message): the others' ``wan_idle_s`` is ``None`` in its summary,
and the fractions are over the workers whose WAN idle it measured.  ``bytes_per_outer_step`` counts the bytes
the workers (and, for the async baseline, the parameter server) put on the
links per outer step — for DDP per ``H`` synchronous steps, the same tokens
as one outer step.  ``compression_ratio`` = fp32 bytes of the same tensors /
bytes on the wire.  ``device``, ``gpu``, ``precision`` and ``peak_memory_gib``
say where this process's worker models ran, read from their parameters
(:func:`jobruntime.devices.device_summary`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from jobruntime.devices import device_summary
from jobruntime.metrics import TTPTracker

from .fleet.cluster import ClusterSpec

log = logging.getLogger(__name__)


def not_finite(loss: float, tensors=(), *, who: str, group=None,
               local: bool = False) -> list[str]:
    """Which of the job's workers gave a non-finite round: ``who`` (this process's worker)
    where ``loss`` or a value of ``tensors`` (its pseudo-gradient here) is NaN or inf,
    gathered from every process of ``group`` (default: the job's world; an object
    all-gather, whatever the backend, so that every process of the job stops at the
    same round and none waits in a collective the others left).  Sorted, no repeats;
    ``[]`` when all were finite.

    Args:
        loss: the worker's mean loss of the round (nats).
        tensors: tensors of any shape (an iterable of them).
        who: the worker's name, for the log and the error.
        group: the process group that must agree; ``None`` = the default group (no
            collective where ``torch.distributed`` is not initialised).
        local: this process alone decides (no collective).
    """
    flags = [torch.isfinite(t).all() for t in tensors]  # one host sync below, not one each
    ok = math.isfinite(loss) and (not flags or bool(torch.stack(flags).all()))
    mine = None if ok else who
    if not local and dist.is_available() and dist.is_initialized():
        seen = [None] * dist.get_world_size(group)
        dist.all_gather_object(seen, mine, group=group)
    else:
        seen = [mine]
    return sorted({w for w in seen if w is not None})


@dataclass
class WorkerTotals:
    """One worker's totals over the run (seconds, bytes, proxy tokens)."""

    compute_s: float = 0.0
    straggler_idle_s: float = 0.0
    wan_idle_s: float | None = 0.0
    """``None``: not measured by this job (another region's worker)."""
    sent_bytes: int = 0
    tokens: int = 0


@dataclass
class RunStats:
    """Accumulates rounds; restored from checkpoints with :meth:`load_state_dict`."""

    workers: dict[str, WorkerTotals]
    target_ppl: float | None = None
    outer_steps: int = 0
    tokens: int = 0
    time_s: float = 0.0
    bytes_total: int = 0
    fp32_bytes_total: int = 0
    final_val_ppl: float | None = None
    final_val_loss: float | None = None
    ttp: TTPTracker = field(default_factory=lambda: TTPTracker(None))
    reached_here: bool = False
    """This job's evaluations crossed ``target_ppl`` (:meth:`evaluated`), what
    ``train.stop_at_target`` stops on; not saved: a run resumed or healed past the
    crossing trains on, as an ordinary run does."""
    diverged_at_step: int | None = None
    """The outer step whose inner loss, pseudo-gradient or validation loss of θ_global was
    not finite (:meth:`diverged`): the run stopped there (``train.py`` exits 1)."""

    @classmethod
    def for_cluster(cls, cluster: ClusterSpec, target_ppl: float | None) -> RunStats:
        return cls(workers={w.name: WorkerTotals() for w in cluster.workers},
                   target_ppl=target_ppl, ttp=TTPTracker(target_ppl))

    def add_worker(self, name: str, *, compute_s: float = 0.0, straggler_idle_s: float = 0.0,
                   wan_idle_s: float | None = 0.0, sent_bytes: int = 0, tokens: int = 0) -> None:
        """Add one round of worker ``name`` (seconds, bytes, tokens); ``wan_idle_s=None``:
        not measured by this job (the total is ``None`` until a measured round)."""
        w = self.workers[name]
        w.compute_s += compute_s
        w.straggler_idle_s += straggler_idle_s
        w.wan_idle_s = None if wan_idle_s is None else (w.wan_idle_s or 0.0) + wan_idle_s
        w.sent_bytes += int(sent_bytes)
        w.tokens += int(tokens)

    def evaluated(self, val_loss: float, val_ppl: float, step: int) -> bool:
        """Record an evaluation at the current time/tokens; True when the target is first
        reached.  A validation loss that is not finite (an outer step that broke θ_global)
        is the run's divergence (:meth:`diverged`), not an evaluation."""
        if self.diverged([] if math.isfinite(val_loss) else ["θ_global (its validation loss)"],
                         step):
            return False
        self.final_val_loss, self.final_val_ppl = val_loss, val_ppl
        crossed = self.ttp.update(val_ppl, self.time_s, self.tokens, step)
        self.reached_here = self.reached_here or crossed
        return crossed

    def diverged(self, bad: list[str], step: int) -> bool:
        """Record outer step ``step`` as the run's divergence where ``bad`` names workers
        whose round was not finite (:func:`not_finite`); log it once.  Returns whether it
        diverged.  As an ordinary run (:func:`jobruntime.loop.run`): the loop stops at
        that step, saves nothing of it, and ``summary.json`` holds ``diverged_at_step``
        (``train.py`` exits 1)."""
        if not bad:
            return False
        if self.diverged_at_step is None:
            log.error("the loss or pseudo-gradient of %s is not finite (NaN or inf) in outer "
                      "step %d; stopping", ", ".join(bad), step)
            self.diverged_at_step = step
        return True

    def _frac(self, attr: str) -> float | None:
        measured = [w for w in self.workers.values() if w.wan_idle_s is not None]
        total = sum(w.compute_s + w.straggler_idle_s + w.wan_idle_s for w in measured)
        if total <= 0:
            return None
        return sum(getattr(w, attr) for w in measured) / total

    def summary(self, *, method: str, clock: str, cluster: ClusterSpec, model: torch.nn.Module,
                extra: dict | None = None, worker_info: dict[str, dict] | None = None) -> dict:
        """The ``summary.json`` fields of the run (module docstring); ``model`` is
        one of this process's worker models (where the run ran)."""
        table = []
        for w in cluster.workers:
            row = {"worker": w.name, "gpu": w.gpu, "region": w.region, **asdict(self.workers[w.name])}
            row.update((worker_info or {}).get(w.name, {}))
            table.append(row)
        ratio = self.fp32_bytes_total / self.bytes_total if self.bytes_total else None
        straggler, wan = self._frac("straggler_idle_s"), self._frac("wan_idle_s")
        return {
            "method": method,
            "clock": clock,
            "cluster": cluster.name,
            "target_ppl": self.target_ppl,
            **self.ttp.summary(),
            "final_val_ppl": self.final_val_ppl,
            "final_val_loss": self.final_val_loss,
            "tokens": self.tokens,
            "outer_steps": self.outer_steps,
            "steps": self.outer_steps,  # metrics.jsonl's "step", as an interrupted run's summary
            "time_s": self.time_s,
            "straggler_idle_frac": straggler,
            "wan_idle_frac": wan,
            "sync_share": None if wan is None else straggler + wan,
            "bytes_per_outer_step": self.bytes_total / self.outer_steps if self.outer_steps else None,
            "compression_ratio": ratio,
            "workers": table,
            **device_summary(model),
            **({} if self.diverged_at_step is None
               else {"diverged_at_step": self.diverged_at_step}),
            **(extra or {}),
        }

    def state_dict(self) -> dict:
        return {
            "workers": {k: asdict(v) for k, v in self.workers.items()},
            "scalars": {k: getattr(self, k) for k in (
                "target_ppl", "outer_steps", "tokens", "time_s", "bytes_total", "fp32_bytes_total",
                "final_val_ppl", "final_val_loss")},
            "ttp": asdict(self.ttp),
        }

    def load_state_dict(self, state: dict) -> None:
        self.workers = {k: WorkerTotals(**v) for k, v in state["workers"].items()}
        for k, v in state["scalars"].items():
            setattr(self, k, v)
        self.ttp = TTPTracker.from_state(state["ttp"], state["ttp"].get("target_ppl"))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def memory_overhead(theta: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor],
                    residuals: list[dict[str, torch.Tensor]], packed_bytes: list[int],
                    target_params: int | None = None,
                    snapshots: list[dict[str, torch.Tensor]] = (), eager_bytes: int = 0) -> dict:
    """Per-worker memory GeoMesh adds to the inner job, measured from the live tensors.

    Counted per worker (one rank's TP/PP shard): the global weights
    ``θ_global`` (fp32), the outer Nesterov momentum (fp32, after the first
    outer step), the error-feedback residual (fp32, only when on) and the
    packed pseudo-gradient message (sign bits, scales, header); with
    ``geomesh.compress_update`` the momentum is the worker's own
    (:mod:`geomesh.feedback`).  Reported apart, in host memory: the
    error-feedback residual (fp32, only when on) and, with overlapped rounds,
    the snapshot of the weights whose pseudo-gradient is in flight (fp32,
    :mod:`geomesh.sync`) and the last aggregate of the eager start (fp32, one
    per rank, :mod:`geomesh.eager`).  The others live
    on the device of the inner job's parameters (``Trainer.get_params``
    clones them there); the planner's memory model counts them
    (:func:`geomesh.context.build_context`).

    Args:
        theta, momentum: the outer optimizer's tensors on this rank.
        residuals: each local worker's error-feedback residuals (empty dicts
            without error feedback).
        packed_bytes: each local worker's encoded message length, bytes.
        target_params: parameters of the timing target model (emulated
            mode): the overhead is also given for it, at the measured bytes
            per parameter.
        snapshots: each local worker's overlap snapshot (none without overlap).
        eager_bytes: host bytes of the eager start's last aggregate, one per rank
            (0 without overlap).

    Returns:
        ``{"params", "global_weights_bytes", "outer_momentum_bytes",
        "packed_message_bytes", "total_bytes", "bytes_per_param",
        "host_error_feedback_bytes", "host_snapshot_bytes", "host_eager_bytes"}``
        and, with ``target_params``, ``"target_total_bytes"`` (one copy of the
        target model's worth: a worker's GPUs each hold their ``1/(tp·pp)``
        shard of it, once per DP replica inside the worker).
    """
    n = sum(t.numel() for t in theta.values())
    k = max(len(packed_bytes), 1)
    out = {
        "params": n,
        "global_weights_bytes": _nbytes(theta.values()),
        "outer_momentum_bytes": _nbytes(momentum.values()),
        "packed_message_bytes": sum(packed_bytes) // k,
    }
    out["total_bytes"] = sum(v for key, v in out.items() if key.endswith("_bytes"))
    out["host_error_feedback_bytes"] = sum(_nbytes(r.values()) for r in residuals) // k
    out["host_snapshot_bytes"] = sum(_nbytes(s.values()) for s in snapshots) // k
    out["host_eager_bytes"] = eager_bytes  # one per rank, like θ_global: not divided
    out["bytes_per_param"] = out["total_bytes"] / max(n, 1)
    if target_params:
        out["target_total_bytes"] = round(out["bytes_per_param"] * target_params)
    return out
