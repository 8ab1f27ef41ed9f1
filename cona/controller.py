"""The online controller: every K steps rank candidates, decide whether to switch.

Decision rule at a decision step (every ``cfg.decision_interval`` steps):

1. Score every candidate and the current strategy with
   :func:`cona.surrogate.rank_strategies` (calibrated cost model x Pollux
   efficiency at the current noise scale ``phi``).  Until the GNS estimator
   has a value, only candidates with the current global batch size are
   considered (their efficiencies are equal, so throughput alone is safe).
2. Repay test: over a horizon of ``T = horizon_steps * iter_s(current)``
   seconds (at most the time the rest of the budget takes at the current
   rate, when the caller knows it), candidate ``b`` makes the current one's
   progress ``r_c T`` in ``T r_c / r_b`` seconds, saving ``T (1 - r_c/r_b)``
   at an expected switch cost ``C_b``.
3. A candidate qualifies if ``gain = score_b / score_current - 1 >=
   min_gain`` and its saving exceeds ``C_b``.  Of those, the controller
   switches to the one with the largest net saving ``T (1 - r_c/r_b) - C_b``
   — not simply the top-scored one: a slightly slower candidate that a cheap
   batch-only switch reaches beats the best one behind a layout switch that
   cannot repay.
   If none qualifies, it stays, and the decision names the top-ranked
   candidate and the test it fails.

Switch cost ``C`` (seconds), what the switch is charged on the clock:

- emulated clock: ``switch_cost_model(current, best)``, the emulated cluster's
  modelled cost, which is exactly what the clock is then charged;
- real clock: a running mean of measured switches (the wall time of the
  whole switch), kept separately for *layout* switches (dp, tp or pp change:
  rebuild process groups, reshard weights and optimizer state) and *batch*
  switches (same layout, new micro/global batch: no resharding).  Before the
  first switch of a kind the job's start-up measurements are used
  (``switch_cost_priors_s``, :attr:`cona.job.RealJob.measured_costs`: the
  time to build the start layout, and a no-op batch switch).
  :data:`SWITCH_COST_PRIORS_S` (30 s / 1 s, assumptions) apply only where a
  caller gives neither.

Uncertainty of extrapolated step times: a candidate's time is predicted from
its own measurements, from measured strategies of the same TP/PP layout, or
from other layouts (:meth:`CostModel.calibration_source`).  After each switch
the first measured step of the new strategy is compared with the prediction
that motivated it; the mean ``|log(measured / predicted)|`` per source is
kept, and the scores of candidates (not of the current strategy, whose time
is being measured) predicted from that source are discounted by
``exp(-mean error)`` when ranking.  Where the analytic model is exact (emulated
mode) nothing changes; where it is poor (an A100 model timing CPU processes)
the controller stops chasing layouts it has only extrapolated, and noisy step
times (source ``"measured"``: returning to a strategy measured before) raise
the bar for switching back, instead of flapping on optimistic predictions.

Learning rate: :mod:`cona.lr_rule` (the scaling rule and the ramp after a switch).

Start probe: the first decision comes as soon as the noise-scale estimator
holds ``cona.start_probe_updates`` updates (the training steps before it are
the probe: real steps at the start strategy, on the clock), so the start
strategy is ranked at a measured noise scale after a few steps instead of
being kept for a whole decision interval (:meth:`Controller.wants_start_decision`).

No estimate: where the noise scale cannot be measured at the current strategy
(:func:`cona.probe.no_estimate_reason`: DP = 1 with one micro-batch of one sequence per
step, or with PP > 1 or one micro-batch per step when ``cona.gns_split_every`` is 0) the
caller says so
(``decide(no_estimate=...)``);
the controller then
ignores any estimate left from an earlier strategy and falls back to the stated
rule: only strategies of the current global batch, ranked by throughput.  The
decision's reason says so.

Transients: decisions rank at the median of the noise-scale estimates of the last
``cona.gns_decision_window`` decisions (default 5, with the default interval the last
50 steps, half the repay horizon), not at the latest alone.  A switch is worth its
cost only if the noise scale that motivates it persists over the horizon; in a loss
spike it does not (measured on the Llama proxy: ``tr(Sigma)`` 50-250x and the online
estimate 6-8x its level for ~30 steps, after which CONA had moved to 4x its batch and
back).  The median ignores a transient seen by fewer than half the window's decisions
and follows a sustained change after half the window.

Online correction (``cona.efficiency_correction=progress``, off by default): once
``horizon_steps`` steps after a batch change (and its LR ramp) are in, the factor ``k`` in
``phi_true = k * phi`` is fitted once from the training losses either side of it
(:mod:`cona.progress_fit`, fed by :meth:`Controller.record_progress`), and decisions rank
at ``k`` times the median above; the decision records the fit.

Every decision is logged as a dict in :attr:`Controller.decisions`; its one-line
form (:meth:`Decision.describe`: what it does, the scores of the chosen and the
current strategy, and why) goes to the ``cona`` logger.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from jobruntime.config import ConaConfig

from .cost_model import CostModel
from .grad_stats import GradientNoiseScale
from .lr_rule import scale_lr
from .progress_fit import ProgressFit, fit_noise_scale_factor
from .strategy import Strategy, switch_kind
from .surrogate import Score, rank_strategies

SWITCH_COST_PRIORS_S = {"layout": 30.0, "batch": 1.0}


@dataclass
class Decision:
    """Outcome of one decision step (see :meth:`to_dict` for the logged form)."""

    step: int
    current: Strategy
    best: Strategy
    switch: bool
    reason: str
    scores: dict[str, float]
    noise_scale: float | None
    gain: float
    time_saved_s: float
    switch_cost_s: float
    lr: float
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: what the decision does, the scores (reference-batch samples/s) of the
        chosen and the current strategy, the noise scale and the reason."""
        what = (f"switch {self.current.label} -> {self.best.label}" if self.switch
                else f"stay on {self.current.label}")
        phi = "none" if self.noise_scale is None else f"{self.noise_scale:.4g}"
        head = "start decision" if self.extra.get("start") else "decision"
        return (f"CONA {head} at step {self.step}: {what}; best {self.best.label} scores "
                f"{self.scores.get(self.best.label, float('nan')):.4g} against current "
                f"{self.scores.get(self.current.label, float('nan')):.4g} (noise scale {phi}): "
                f"{self.reason}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "current": self.current.label,
            "best": self.best.label,
            "switch": self.switch,
            "reason": self.reason,
            "scores": dict(self.scores),
            "noise_scale": self.noise_scale,
            "gain": self.gain,
            "time_saved_s": self.time_saved_s,
            "switch_cost_s": self.switch_cost_s,
            "lr": self.lr,
            **self.extra,
        }


class Controller:
    """Ranks candidates every ``cfg.decision_interval`` steps and decides switches.

    It never switches anything itself: :meth:`decide` returns a
    :class:`Decision`; the runtime performs the switch and then calls
    :meth:`commit_switch` with the measured cost.

    Args:
        candidates: strategies to choose from (validated elsewhere).
        cost_model: calibrated throughput model (:meth:`record_iteration` feeds it).
        gns_estimator: the runtime updates it every step.
        cfg: ``decision_interval``, ``min_gain``, ``horizon_steps``, ``lr_scaling``.
        current: the strategy the job starts with (need not be a candidate).
        base_lr: learning rate tuned for ``reference_batch``.
        reference_batch: ``M0`` of the efficiency and ``B_ref`` of the LR rule;
            ``None`` = ``current.global_batch_size``.
        switch_cost_priors_s: override :data:`SWITCH_COST_PRIORS_S`.
        switch_cost_model: ``(old, new) -> seconds``; when given, the cost of
            every switch (emulated clock), instead of measured means.

    Raises:
        ValueError: no candidates, or invalid ``cfg`` values.
    """

    def __init__(
        self,
        candidates: Sequence[Strategy],
        cost_model: CostModel,
        gns_estimator: GradientNoiseScale,
        cfg: ConaConfig,
        *,
        current: Strategy,
        base_lr: float,
        reference_batch: int | None = None,
        switch_cost_priors_s: dict[str, float] | None = None,
        switch_cost_model: Callable[[Strategy, Strategy], float] | None = None,
    ) -> None:
        if not candidates:
            raise ValueError("Controller needs at least one candidate strategy")
        if cfg.decision_interval <= 0:
            raise ValueError(
                f"cona.decision_interval must be positive, got {cfg.decision_interval}"
            )
        if cfg.min_gain < 0 or cfg.horizon_steps <= 0:
            raise ValueError("cona.min_gain must be >= 0 and cona.horizon_steps positive")
        scale_lr(base_lr, 1, 1, cfg.lr_scaling)  # validates the rule
        self.candidates = list(dict.fromkeys(candidates))
        self.cost_model = cost_model
        self.gns = gns_estimator
        self.cfg = cfg
        self.current = current
        self.base_lr = base_lr
        self.reference_batch = reference_batch or current.global_batch_size
        self._priors = dict(SWITCH_COST_PRIORS_S, **(switch_cost_priors_s or {}))
        self._cost_model_fn = switch_cost_model
        self._switch_costs: dict[str, list[float]] = {"layout": [], "batch": []}
        self._pred_errors: dict[str, list[float]] = {}
        self._pending: tuple[Strategy, float, str] | None = None
        self._phi_history: list[float] = []  # the estimator's value at each decision
        # (samples, training loss, global batch, noise scale) per step, for the online
        # correction: the two windows either side of a batch change and the ramp
        self._progress: deque[tuple[float, float, int, float]] = deque(
            maxlen=2 * cfg.horizon_steps + cfg.lr_ramp_steps + cfg.decision_interval)
        self.noise_scale_factor = 1.0
        self.last_fit: ProgressFit | None = None
        self._tested_change: float | None = None  # samples at the batch change last tested
        self.decisions: list[dict[str, Any]] = []
        # decisions of the run before a resume (their records are in its metrics.jsonl)
        self.decisions_before = 0

    # -- inputs from the training loop --------------------------------------

    def record_iteration(self, iter_s: float, strategy: Strategy | None = None) -> None:
        """Feed a measured step time (s) of ``strategy`` (default: current) to the cost model.

        The first measurement after a switch also scores the prediction that
        motivated it (module docstring).
        """
        strategy = strategy or self.current
        if self._pending is not None and self._pending[0] == strategy and iter_s > 0:
            _, predicted, source = self._pending
            self._pred_errors.setdefault(source, []).append(abs(math.log(iter_s / predicted)))
            self._pending = None
        self.cost_model.calibrate(strategy, iter_s)

    def record_progress(self, samples: float, loss: float) -> None:
        """Feed a step's training loss (nats, taken before its update) and the samples
        consumed after it (counted from the model's initialisation, any unit proportional
        to sequences) to the online correction (``cona.efficiency_correction``)."""
        phi = self.gns.noise_scale
        if self.cfg.efficiency_correction == "off" or phi is None or not phi > 0:
            return
        self._progress.append((float(samples), float(loss),
                               self.current.global_batch_size, float(phi)))

    def _refit_noise_scale_factor(self) -> None:
        """Test the latest batch change once, when ``horizon_steps`` steps after its ramp
        are in (:mod:`cona.progress_fit`), and rank at the fit's factor from then on."""
        if not self._progress:
            return
        samples, losses, batches, phis = zip(*self._progress)
        changes = [samples[i] for i in range(1, len(batches)) if batches[i] != batches[i - 1]]
        if not changes or changes[-1] == self._tested_change:
            return  # no batch change in the records, or the latest one was tested
        fit = fit_noise_scale_factor(samples, losses, batches, phis, self.reference_batch,
                                     skip_after_change=self.cfg.lr_ramp_steps,
                                     window=self.cfg.horizon_steps,
                                     min_after=self.cfg.horizon_steps)
        if fit is not None:  # the whole window after the change is in: its one test
            self.last_fit, self._tested_change = fit, changes[-1]
            self.noise_scale_factor = fit.factor

    def prediction_error(self, source: str) -> float:
        """Mean ``|log(measured/predicted)|`` of past switches predicted from ``source`` (0 if none)."""
        errs = self._pred_errors.get(source)
        return sum(errs) / len(errs) if errs else 0.0

    def record_switch_cost(self, kind: str, seconds: float) -> None:
        """Add a measured switch cost (``kind`` = ``"layout"`` or ``"batch"``).

        Raises:
            ValueError: unknown kind or negative seconds.
        """
        if kind not in self._switch_costs or seconds < 0:
            raise ValueError(f"bad switch cost record: kind={kind!r}, seconds={seconds}")
        self._switch_costs[kind].append(float(seconds))

    @property
    def switch_costs(self) -> dict[str, list[float]]:
        """Measured switch costs recorded so far (seconds), by kind."""
        return {k: list(v) for k, v in self._switch_costs.items()}

    def switch_cost_s(self, new: Strategy) -> float:
        """Expected seconds to switch from the current strategy to ``new`` (0 if equal)."""
        if new == self.current:
            return 0.0
        if self._cost_model_fn is not None:
            return float(self._cost_model_fn(self.current, new))
        kind = switch_kind(self.current, new)
        seen = self._switch_costs[kind]
        return sum(seen) / len(seen) if seen else self._priors[kind]

    def commit_switch(self, new: Strategy, measured_cost_s: float | None = None) -> float:
        """The runtime switched to ``new``; record its cost; return the new learning rate."""
        if measured_cost_s is not None:
            self.record_switch_cost(switch_kind(self.current, new), measured_cost_s)
        if new != self.current:
            self._pending = (
                new,
                self.cost_model.predict(new).iter_s,
                self.cost_model.calibration_source(new),
            )
        self.current = new
        return self.lr()

    # -- decisions ----------------------------------------------------------

    def lr(self, strategy: Strategy | None = None) -> float:
        """Learning rate for ``strategy``'s global batch (default: current)."""
        gb = (strategy or self.current).global_batch_size
        return scale_lr(self.base_lr, gb, self.reference_batch, self.cfg.lr_scaling)

    def should_decide(self, step: int) -> bool:
        """True at steps ``K, 2K, ...`` (never at step 0: no statistics yet)."""
        return step > 0 and step % self.cfg.decision_interval == 0

    def wants_start_decision(self, step: int, num_updates: int) -> bool:
        """True for the start decision: no decision taken yet, a regular one not due at
        ``step``, and the estimator holds ``cona.start_probe_updates`` (> 0) updates
        and a positive estimate."""
        n = self.cfg.start_probe_updates
        return (n > 0 and not self.decisions and not self.decisions_before and num_updates >= n
                and self.gns.noise_scale is not None and not self.should_decide(step))

    def decision_noise_scale(self) -> float | None:
        """The noise scale decisions rank at: the median of the estimator's values at the
        last ``cona.gns_decision_window`` decisions, this one included (module docstring,
        "Transients"); ``None`` while the estimator has none."""
        now = self.gns.noise_scale
        if now is None:
            return None
        seen = [*self._phi_history, now][-self.cfg.gns_decision_window:]
        return statistics.median(seen) * self.noise_scale_factor

    def rank(self, *, use_noise_scale: bool = True) -> list[Score]:
        """Current ranking (candidates + current strategy), best first; scores are
        discounted by the prediction error of their calibration source.
        ``use_noise_scale=False`` ranks as without an estimate (same global batch only)."""
        phi = self.decision_noise_scale() if use_noise_scale else None
        pool = list(dict.fromkeys([*self.candidates, self.current]))
        if phi is None:
            pool = [s for s in pool if s.global_batch_size == self.current.global_batch_size]
        ranked = rank_strategies(pool, self.cost_model, phi, self.reference_batch)
        if not self._pred_errors:
            return ranked
        out = []
        for sc in ranked:
            err = 0.0
            if sc.strategy != self.current:  # the current strategy's time is being measured
                err = self.prediction_error(self.cost_model.calibration_source(sc.strategy))
            out.append(replace(sc, score=sc.score * math.exp(-err)) if err else sc)
        return sorted(out, key=lambda x: (-x.score, x.strategy.label))

    def decide(self, step: int, remaining_samples: float | None = None, *,
               no_estimate: str | None = None, start: bool = False) -> Decision:
        """Rank, and switch to the qualifying candidate with the largest net saving
        (module docstring, rules 1-3); the decision is appended to :attr:`decisions`.

        Args:
            remaining_samples: samples (the strategies' units) left in the budget;
                the repay horizon is at most their time at the current rate.
            no_estimate: why the noise scale cannot be measured at the current
                strategy (``None``: it can); then the fallback rule (module docstring).
            start: the start decision after the probe (logged as such).
        """
        if self.cfg.efficiency_correction == "progress":
            self._refit_noise_scale_factor()
        phi = None if no_estimate else self.decision_noise_scale()
        ranked = self.rank(use_noise_scale=not no_estimate)
        if not no_estimate and self.gns.noise_scale is not None:
            self._phi_history.append(self.gns.noise_scale)
        by_strategy = {sc.strategy: sc for sc in ranked}
        cur = by_strategy[self.current]
        horizon_s = self.cfg.horizon_steps * cur.iter_s
        if remaining_samples is not None and cur.samples_per_s > 0:
            horizon_s = min(horizon_s, remaining_samples / cur.samples_per_s)

        def saved(sc) -> float:  # seconds saved over the horizon by running sc instead
            return horizon_s * (1.0 - cur.score / sc.score) if sc.score > 0 else -math.inf

        # Of the candidates that pass both tests (rule 3), the one with the most time
        # saved net of its switch cost: the top-scored one can lose to a slightly
        # slower one that a cheap switch reaches (a batch-only switch at the current
        # layout, one lost step, against a layout switch).  If none passes, the
        # top-ranked one is reported with the test it fails.
        net = {sc.strategy: saved(sc) - self.switch_cost_s(sc.strategy) for sc in ranked
               if sc.strategy != self.current
               and sc.score >= cur.score * (1.0 + self.cfg.min_gain)}
        eligible = [sc for sc in ranked if net.get(sc.strategy, 0.0) > 0]
        best = max(eligible, key=lambda sc: (net[sc.strategy], sc.score)) if eligible \
            else ranked[0]
        gain = best.score / cur.score - 1.0 if cur.score > 0 else float("inf")
        time_saved = saved(best) if best.score > 0 else 0.0
        cost = self.switch_cost_s(best.strategy)
        if best.strategy == self.current:
            switch, reason = False, "current_is_best"
        elif gain < self.cfg.min_gain:
            switch, reason = False, f"gain {gain:.3f} < min_gain {self.cfg.min_gain}"
        elif time_saved <= cost:
            switch, reason = (
                False,
                f"saves {time_saved:.1f} s over {horizon_s:.1f} s <= switch cost {cost:.1f} s",
            )
        else:
            switch, reason = (
                True,
                (f"gain {gain:.3f}; saves {time_saved:.1f} s > switch cost {cost:.1f} s"),
            )
        gb = self.current.global_batch_size
        if no_estimate:
            reason += (f" (no noise-scale estimate at {self.current.label}: {no_estimate}; "
                       f"fallback rule: only global batch {gb}, ranked by throughput)")
        elif phi is None:
            reason += (" (no positive noise-scale estimate yet: only global batch "
                       f"{gb}, ranked by throughput)")
        extra: dict[str, Any] = {"start": True} if start else {}
        if no_estimate:
            extra["no_estimate"] = no_estimate
        if ranked[0].strategy != best.strategy:  # a cheaper switch won on net time saved
            extra["top_ranked"] = ranked[0].strategy.label
        if self.last_fit is not None:  # the online correction (noise_scale includes k)
            extra.update(noise_scale_factor=self.noise_scale_factor,
                         progress_fit=self.last_fit.to_dict())
        if self._pred_errors:
            extra["prediction_error"] = dict(
                sorted((k, self.prediction_error(k)) for k in self._pred_errors))
        d = Decision(
            step=step,
            current=self.current,
            best=best.strategy,
            switch=switch,
            reason=reason,
            scores={sc.strategy.label: sc.score for sc in ranked},
            noise_scale=phi,
            gain=gain,
            time_saved_s=time_saved,
            switch_cost_s=cost,
            lr=self.lr(best.strategy if switch else self.current),
            extra=extra,
        )
        self.decisions.append(d.to_dict())
        return d

    def maybe_decide(self, step: int) -> Decision | None:
        """:meth:`decide` at decision steps, else ``None``."""
        return self.decide(step) if self.should_decide(step) else None

    # -- checkpointing ------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What the controller decides from (for checkpoints): the current strategy,
        measured switch costs and prediction errors (and the prediction of a switch not
        yet measured), the number of decisions and the
        noise scales of the last ``cona.gns_decision_window`` ones, the estimator's and
        the cost model's state.  Not the decision records: a run of hours makes thousands
        (each with every candidate's score), and ``metrics.jsonl`` holds them."""
        window = self.cfg.gns_decision_window
        return {
            "current": self.current.label,
            "switch_costs": {k: list(v) for k, v in self._switch_costs.items()},
            "prediction_errors": {k: list(v) for k, v in self._pred_errors.items()},
            "num_decisions": self.decisions_before + len(self.decisions),
            "noise_scale_history": self._phi_history[-window:],
            "noise_scale_factor": self.noise_scale_factor,
            "progress_fit": self.last_fit.to_dict() if self.last_fit else None,
            "tested_change": self._tested_change,
            "progress": [list(r) for r in self._progress],
            # a switch's step-time prediction, scored at the first step after it (which
            # a checkpoint saved right after the switch comes before)
            "pending_prediction": None if self._pending is None else
            [self._pending[0].label, self._pending[1], self._pending[2]],
            "gns": self.gns.state_dict(),
            "cost_model": self.cost_model.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from :meth:`state_dict`; :attr:`decisions` then holds this run's only
        (:attr:`decisions_before` counts the earlier ones)."""
        self.current = Strategy.from_label(state["current"])
        self._switch_costs = {k: list(v) for k, v in state["switch_costs"].items()}
        self._pred_errors = {k: list(v) for k, v in state.get("prediction_errors", {}).items()}
        self.decisions, self.decisions_before = [], int(state["num_decisions"])
        self._phi_history = list(state.get("noise_scale_history", []))
        pending = state.get("pending_prediction")
        self._pending = None if pending is None else (
            Strategy.from_label(pending[0]), float(pending[1]), str(pending[2]))
        self.noise_scale_factor, self.last_fit, self._tested_change = 1.0, None, None
        self._progress.clear()
        if self.cfg.efficiency_correction == "progress":  # else the saved factor is not used
            self.noise_scale_factor = float(state.get("noise_scale_factor", 1.0))
            fit = state.get("progress_fit")
            self.last_fit = ProgressFit.from_dict(fit) if fit else None
            self._tested_change = state.get("tested_change")
            self._progress.extend(tuple(r) for r in state.get("progress", []))
        self.gns.load_state_dict(state["gns"])
        self.cost_model.load_state_dict(state["cost_model"])
