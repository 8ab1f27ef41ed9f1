"""Direct measurements at an emulated job's state: the noise scale, Adam's progress per
sequence and the curvature noise scale, each from fresh micro-batches, the training
state, data position and RNG left as they were.

:class:`DirectProbes` is a mixin of :class:`cona.job.EmulatedJob` (one process, the
proxy); it reads the job's ``trainer``, ``sampler``, ``probe`` and clock.  The
estimators themselves live in :mod:`cona.direct_gns`, :mod:`cona.adam_efficiency` and
:mod:`cona.curvature`; the bench's reference (``bench/cona_reference.py``) and the
analysis benches call these.
"""

from __future__ import annotations

import contextlib

from jobruntime.parallel import rng_state, set_rng_state


class DirectProbes:
    """Direct measurements of :class:`cona.job.EmulatedJob` (module docstring)."""

    def measure_gradient_stats(self, microbatches: int = 64, definition: str = "simple",
                               charge: bool = True) -> tuple[float, float] | None:
        """Direct ``(|G|^2, tr(Sigma))`` estimates at the current weights from
        ``microbatches`` fresh micro-batches (:func:`cona.direct_gns.measure_gradient_stats`);
        ``definition`` other than ``simple``: of gradients times a power of Adam's
        preconditioner (:data:`cona.probe.DEFINITIONS`; ``None`` before the first step).
        The data position, RNG and training state are left as they were.  The clock is
        charged what the probe costs the target: forward and backward over the probe's
        sequences at the current layout (``target_step_s`` x probe sequences / proxy
        batch), undilated (it is run once, not per target step); ``charge=False``: not
        charged (a run whose clock is no result, e.g. the bench's reference, whose
        evaluation cadence on the clock must not jump past its steps)."""
        from .direct_gns import measure_gradient_stats
        from .probe import adam_preconditioner, preconditioner_power

        power = preconditioner_power(definition)
        weights = adam_preconditioner(self.trainer, power) if power > 0 else None
        if power > 0 and weights is None:
            return None

        with self._probe_microbatches(microbatches, charge) as mbs:
            return measure_gradient_stats(self.trainer, mbs, weights)

    def measure_adam_progress(self, microbatches: int, target_batches) -> dict[int, float]:
        """Adam's best progress per sequence at each of ``target_batches`` (target
        sequences), up to a common factor (:func:`cona.adam_efficiency.progress_per_sample`
        from ``microbatches`` fresh micro-batches, with the optimizer's epsilon), not
        charged to the clock; the data position, RNG and training state are left as they
        were.  A batch above the probe's proxy sequences (where ``v(B)`` has no unbiased
        estimate) is left out of the result."""
        from .adam_efficiency import progress_per_sample

        eps = next((g["eps"] for g in self.trainer.optimizer.param_groups if "eps" in g), 1e-8)
        with self._probe_microbatches(microbatches, charge=False) as mbs:
            seqs = sum(len(next(iter(mb.values()))) for mb in mbs)
            proxy = {b: p for b in target_batches
                     if (p := self.ctx.mapping.proxy_batch(b)) <= seqs}
            pps = progress_per_sample(self.trainer, mbs, sorted(set(proxy.values())), eps)
        return {b: pps[p] for b, p in proxy.items()}

    def measure_curvature_stats(self, microbatches: int = 64, curvature_microbatches: int = 16,
                                preconditioned: bool = True,
                                delta: float | None = None) -> tuple[float, float] | None:
        """``(G' P H P G, tr(P H P Sigma))`` at the current weights, the curvature measured
        (:func:`cona.curvature.measure_curvature_stats`: gradients of ``microbatches``
        fresh micro-batches, curvature on the next ``curvature_microbatches``); ``P`` is
        Adam's preconditioner (``None`` before the first step), or ``I`` where not
        ``preconditioned``; ``delta``: the second difference's step (default
        :data:`cona.curvature.DELTA`).  Not charged to the clock (a measurement); the data
        position, RNG and training state are left as they were."""
        from .curvature import DELTA, measure_curvature_stats
        from .probe import adam_preconditioner

        weights = adam_preconditioner(self.trainer) if preconditioned else None
        if preconditioned and weights is None:
            return None
        with self._probe_microbatches(microbatches + curvature_microbatches, False) as mbs:
            return measure_curvature_stats(self.trainer, mbs[:microbatches],
                                           mbs[microbatches:], weights, delta=delta or DELTA)

    @contextlib.contextmanager
    def _probe_microbatches(self, microbatches: int, charge: bool):
        """``microbatches`` fresh micro-batches to probe with, the clock charged what the
        probe costs the target where ``charge`` (:meth:`measure_gradient_stats`); on exit
        the data position, RNG and the in-run probe are as they were."""
        consumed, rng = self.consumed_samples, rng_state()
        self.probe.detach()
        mbs = []
        while len(mbs) < microbatches:
            mbs += self.sampler.next()
        probe_seqs = sum(len(next(iter(mb.values()))) for mb in mbs[:microbatches])
        if charge:
            self._clock += (self.cluster.target_step_s(self.strategy) * probe_seqs
                            / self.proxy_batch(self.strategy))
        try:
            yield mbs[:microbatches]
        finally:
            self._attach_probe()
            self.sampler = self._sampler(self.topo, consumed)
            set_rng_state(rng)

    def measure_noise_scale(self, microbatches: int = 64, definition: str = "simple",
                            charge: bool = True) -> float | None:
        """A direct noise scale (proxy sequences) from :meth:`measure_gradient_stats`
        (same arguments, clock charge and state left as it was); ``None`` before the
        first step (preconditioned) or where the signal estimate is not positive."""
        stats = self.measure_gradient_stats(microbatches, definition, charge)
        if stats is None or stats[0] <= 0:
            return None
        return stats[1] / stats[0]

