"""What a GeoMesh round measured: per-worker compute, idle and bytes, the metrics
record, and the run's summary (:class:`geomesh.sync.OuterLoop`'s figures).

Emulated mode reads compute, straggler idle and WAN idle off the emulated
clock's schedule (:class:`geomesh.fleet.clock.EmulatedClock`) and charges the target
model's message bytes; real mode measures wall time on every rank and gathers
one row per rank (:meth:`geomesh.exchange.deploy.Placement.gather_rows`), and its bytes
are the transport's count.  A worker's straggler idle is ``max_j compute_j −
compute_i`` (overlapped: only the waiting after compute), its WAN idle the rest
of its wait for the exchange.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from jobruntime.metrics import perplexity, target_reached_line

from .wire.canonical import CanonicalSchema, canonical_digest, main_pieces

if TYPE_CHECKING:
    from .sync import _Round

log = logging.getLogger(__name__)


class RoundFigures:
    """The figures half of :class:`geomesh.sync.OuterLoop` (its attributes are used)."""

    def figures(self, rnd: _Round, per: dict[str, dict]
                ) -> tuple[list[int], list[int], dict[int, float], tuple[int, int]]:
        """Per worker: compute, straggler and WAN idle, bytes — from the emulated clock's
        schedule, or (real) from every rank's wall-clock row.  Returns ``(present,
        counted, losses, (round bytes, their fp32 equivalent))``; ``counted`` are the
        workers whose reported figures pass :meth:`Guard.screen_figures`."""
        cl, K = self.cl, self.K
        if self.ctx.emulated:
            if self.overlap is None:
                for w in cl.workers:
                    t = self.transport.last_schedule.workers[w.name]
                    per[w.name] = dict(compute_s=t.compute_s, straggler_idle_s=t.straggler_idle_s,
                                       wan_idle_s=t.wan_idle_s, sent_bytes=t.sent_bytes)
            self.stats.time_s = self.clock.last_exchange_end_s  # when this θ_global exists
            return (list(range(K)), list(range(K)), dict(rnd.losses),
                    (self.charged * K, 4 * self.ctx.target_schema.numel * K))
        me, fp32 = self.pl.workers[0], 4 * self.canon_numel
        sent = len(rnd.msgs[me]) if self.pl.transport is not None and me in rnd.msgs else 0
        rows = self.pl.gather_rows([me, rnd.losses.get(me, 0.0), rnd.compute.get(me, 0.0),
                                    rnd.wait_s, sent, fp32 if sent else 0], fp32)
        present = sorted({int(x[0]) for x in rows})
        compute = {k: max(x[2] for x in rows if int(x[0]) == k) for k in present}
        # the loss and compute seconds a worker reports steer the log, the idle
        # statistics and re-planning: out-of-bounds ones are left out (Guard.screen_figures)
        counted = self.guard.screen_figures(
            present, [next(x[1] for x in rows if int(x[0]) == k) for k in present],
            [compute[k] for k in present])
        slowest = max((compute[k] for k in counted), default=0.0)
        losses = {}
        for k in counted:
            mine = [x for x in rows if int(x[0]) == k]
            waited = max(x[3] for x in mine)
            straggler = slowest - compute[k]
            if self.overlap is not None:  # only the waiting after compute is idle
                straggler = min(straggler, waited)
            losses[k] = mine[0][1]
            # one job per region: another worker's exchange wait is not sent (its row
            # carries this worker's), so its WAN idle is not measured here (None)
            own = not self.pl.per_region or k == me
            per[cl.workers[k].name] = dict(compute_s=compute[k], straggler_idle_s=straggler,
                                           wan_idle_s=max(waited - straggler, 0.0) if own else None,
                                           sent_bytes=int(sum(x[4] for x in mine)))
        self.stats.time_s = time.perf_counter() - self.t0
        return present, counted, losses, (int(sum(x[4] for x in rows)),
                                          int(sum(x[5] for x in rows)))

    def record(self, rnd: _Round, per: dict[str, dict], tokens: list[int], present: list[int],
               counted: list[int], losses: dict[int, float], nbytes: tuple[int, int], *,
               final: bool = False) -> dict:
        """The round's metrics record (and the run statistics); evaluates θ_global on the
        validation batches at evaluation rounds and at a ``final`` round (the run stops
        after it: :meth:`geomesh.sync.OuterLoop.stop_agreed`)."""
        stats, cl, step, rsteps = self.stats, self.cl, rnd.r + 1, rnd.steps
        for k in counted:
            stats.add_worker(cl.workers[k].name, tokens=tokens[k], **per[cl.workers[k].name])
        weighed = sum(tokens[k] for k in losses)
        # token-weighted over the accepted figures; with none, this job's own (local) loss
        loss = sum(tokens[k] * losses[k] for k in losses) / weighed if weighed else \
            sum(rnd.losses.values()) / max(len(rnd.losses), 1)
        stats.tokens += sum(tokens)
        stats.outer_steps = step
        stats.bytes_total += nbytes[0]
        stats.fp32_bytes_total += nbytes[1]
        times = [per[cl.workers[k].name]["compute_s"] for k in counted] or [0.0]
        record = dict(
            step=step, tokens=stats.tokens, time_s=stats.time_s, loss=loss,
            compute_s=max(times), imbalance=(max(times) - min(times)) / max(max(times), 1e-12),
            straggler_idle_s=sum(p["straggler_idle_s"] for p in per.values()),
            wan_idle_s=sum(p["wan_idle_s"] or 0.0 for p in per.values()), bytes=nbytes[0],
            batch_sizes=[s.batch_size for s in rsteps],
            target_batch_sizes=[s.target.batch_size for s in rsteps],
            inner_steps=[s.target.inner_steps for s in rsteps],
            proxy_samples=[s.samples for s in rsteps],
        )
        if len(present) < self.K or self.guard.last_rejected:
            record["workers_present"] = [cl.workers[k].name for k in present
                                         if k not in self.guard.last_rejected]
        if self.ctx.is_eval_step(step) or final:
            trainer, p = self.first.trainer, self.cfg.parallel
            keep = trainer.get_params() if self.keeps_local_weights else None
            trainer.set_params(self.theta)
            trainer.set_batch_size(p.global_batch_size, p.micro_batch_size)
            val_loss = trainer.evaluate(self.val)
            if keep is not None:  # overlapped/streaming rounds continue from the local weights
                trainer.set_params(keep)
            record.update(val_loss=val_loss, val_ppl=perplexity(val_loss))
            if stats.evaluated(val_loss, record["val_ppl"], step):
                log.info(target_reached_line(self.cfg.train.target_ppl, f"outer step {step}",
                                             stats.time_s, self.ctx.clock_name))
        return record

    def summary(self) -> dict:
        """The run's summary (:meth:`geomesh.report.RunStats.summary`) with the exchange's
        layout, bytes and the canonical digest of θ_global."""
        pl, cl, g = self.pl, self.cl, self.g
        info = {w.name: {"batch_size": s.target.batch_size, "inner_steps": s.target.inner_steps,
                         "proxy_batches": list(s.batches)}
                for w, s in zip(cl.workers, self.steps)}
        tp, pp, dp = pl.layout_shape
        names = {"sign_row": "sign-row", "sign_pred": "sign-pred-row"}  # the summaries' names
        extra = {"codec": names.get(self.codec.kind, self.codec.kind),
                 "error_feedback": bool(self.feedback),
                 "layout": {"tp": tp, "pp": pp, "dp": dp}, **_wire_bytes(pl, self.transport),
                 "region": g.region,
                 "global_weights_sha256": _weights_digest(pl, self.layout, self.cschema, self.theta),
                 "layout_switches": self.layouts.reports if self.layouts is not None else [],
                 "compress_update": bool(self.local_mom), "overlap": self.overlap,
                 "replans": self.replans, "plan": self.plan.to_dict(),
                 "wall_s": time.perf_counter() - self.wall0, "world_size": pl.world,
                 "inner_steps": g.inner_steps, "memory_overhead": self.overhead,
                 "outer_device": next(iter(self.theta.values())).device.type}  # θ_global's
        return self.stats.summary(method=self.ctx.method, clock=self.ctx.clock_name, cluster=cl,
                                  model=self.first.trainer.module, extra=extra, worker_info=info)


def _weights_digest(pl, layout, schema: CanonicalSchema, theta: dict) -> str | None:
    """SHA-256 of ``θ_global`` in canonical form (:func:`geomesh.wire.canonical.canonical_digest`):
    the same in every region after the same round, whatever their layouts.  The
    worker's main shards are gathered to its leader (``None`` on the other ranks)."""
    mine = [(k, o, t.cpu()) for k, o, t in main_pieces(layout, theta)] if pl.dp_in_rank == 0 else []
    if pl.worker_group is None or dist.get_world_size(pl.worker_group) == 1:
        return canonical_digest(schema, mine)
    lead = dist.get_rank() == pl.leader_rank
    parts: list | None = [None] * dist.get_world_size(pl.worker_group) if lead else None
    dist.gather_object(mine, parts, dst=pl.leader_rank, group=pl.worker_group)
    return canonical_digest(schema, [x for part in parts for x in part]) if lead else None


def _wire_bytes(pl, transport) -> dict:
    """This job's exchange bytes as its transport counted them (emulated: the proxy's
    real messages, not the target's charged bytes): ``bytes_sent``, ``bytes_received``."""
    counter = (transport or pl.transport or pl.ft_leader)
    wire = getattr(counter, "wire", None)
    return {"bytes_sent": wire.sent, "bytes_received": wire.received} if wire is not None else {}
