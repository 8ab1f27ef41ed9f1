"""The ``cona`` section: online parallelism switching (``cona/``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from .base import (
    ConfigError,
    did_you_mean,
)
from .parallel import MAX_GLOBAL_BATCH

# Settings only CONA's emulated clock reads (the wall clock times the job it runs).
_EMULATED_ONLY = ("num_gpus", "target_model", "batch_ratio", "step_dilation")


@dataclass(kw_only=True)
class ConaConfig:
    """CONA: online parallelism-strategy chaining (see ``cona/``)."""

    enabled: bool = False
    decision_interval: int = 20
    """Steps between controller decisions (K)."""
    candidates: list | None = None
    """Explicit candidates ``[{dp, tp, pp, micro_batch_size, global_batch_size}]``;
    ``None`` enumerates them.  Each must fit with the noise-scale probe's state
    (``cona.candidates.build_candidates``), or the run is refused: in real mode the
    device's memory as the launch check counts it (``train.check_memory=false`` keeps
    them), emulated the cluster's GPU."""
    global_batch_sizes: list | None = None
    """Global batch sizes (sequences) the enumeration tries; ``None`` =
    ``parallel.global_batch_size`` times 1, 2, 4 and 8."""
    gpu: str = "A100-80GB"
    """GPU type whose profile times the strategies: emulated mode, every step of the target
    model; real mode, the candidates not yet measured, which the controller ranks from
    this cost model (``cona/cost_model.py``) until it has timed them."""
    num_gpus: int | None = None
    """Emulated mode: device count; ``None`` = world size."""
    target_model: str | None = None
    """Emulated mode: preset that gives FLOPs and memory; ``None`` = this model."""
    batch_ratio: float = 1.0
    """Emulated mode: target sequences one proxy sequence stands for (``cona/mapping.py``;
    ``bench/cona_ttp.py`` fixes it at 8).  ``cona.global_batch_sizes`` are target sequences."""
    step_dilation: float = 1.0
    """Emulated mode: target optimizer steps one proxy step stands for; each proxy step
    charges this many target step times (switch costs unchanged).  ``bench/cona_ttp.py``
    sets it from the noise-scale growth (``cona/targets.py``, Kaplan et al. 2020)."""
    clock: Literal["wall", "emulated"] = "wall"
    min_gain: float = 0.05
    """Switch only if the best candidate scores this fraction above current."""
    horizon_steps: int = 100
    """Steps over which a switch must repay its measured cost."""
    lr_scaling: Literal["sqrt", "linear", "none"] = "sqrt"
    """How the learning rate follows the global batch size when it changes."""
    gns_average: Literal["plain", "scale_free"] = "scale_free"
    """How the noise-scale estimator averages steps (``cona/grad_stats.py``): ``scale_free``
    divides each step's estimates by its ``|G_big|^2`` before the EMAs, so the average is
    free of the gradient's scale; ``plain`` is McCandlish's ratio of EMAs, which weights
    each step by ``|G|^2`` and therefore reads a rising noise scale low while ``|G|^2``
    falls within the EMA's window (tiny_bert: 44 against 125 measured directly,
    scale-free 113; on least squares with a known answer 0.66 of the truth against 0.85,
    ``tests/test_cona_grad_stats.py``).  The default follows that mechanism, the same for
    every model."""
    gns_definition: Literal["simple", "newton", "pollux"] = "simple"
    """Which noise scale ranks the global batches: that of the gradients times a power of
    Adam's preconditioner ``P = 1/(sqrt(v_hat)+eps)`` (``cona/probe.py``): ``simple``
    (``B_simple = tr(Sigma)/|G|^2``), ``newton`` (``tr(P Sigma)/(G^T P G)``) or ``pollux``
    (``tr(P Sigma P)/|P G|^2``, what Pollux uses for adaptive optimizers, Qiao et al.
    OSDI'21, Sec. 3.1).  For Adam's step ``P g`` the noise scale that makes the efficiency
    exact is ``tr(P H P Sigma) / (G^T P H P G)`` (McCandlish et al. 2018, eq. 2.7-2.8, for
    the preconditioned step; ``cona/surrogate.py``): ``simple`` where the curvature follows
    Adam's ``v`` (``H ~ P^-2``), ``newton`` where ``P`` is the inverse curvature (``H ~
    P^-1``, the premise under which Adam's step is a diagonal Newton step), ``pollux``
    where the Hessian is isotropic (each tested on a quadratic with known efficiency,
    ``tests/test_cona_controller.py``).  (Was ``gns_preconditioned``: ``true`` =
    ``pollux``.)"""
    gns_split_every: int = 4
    """Where a step at DP = 1 has nothing to measure the noise scale from within it (one
    micro-batch at PP = 1; any number at PP > 1, where 1F1B reads no micro-batch's
    gradient), run every this many steps split (``cona/probe.py``): its micro-batch as
    two parts (``"split"``), or at PP > 1 its micro-batches as two schedule calls,
    finalised once (``"calls"``); the same samples and gradient, and the noise scale
    measured from the parts.  That step costs more (smaller micro-batches; at PP > 1
    one more pipeline fill and drain; ``bench/cona_split_cost.py``).  4 = that overhead
    on a quarter of the steps and one estimate per 4 steps, 5 per default
    ``decision_interval``: the estimator's average then spans 4x the steps, and the
    start decision (``start_probe_updates`` estimates) comes after 13 steps (14 with a
    preconditioned ``gns_definition``: no split before the optimizer has state), not
    after 4 (5).  0 = never: no
    estimate at such a layout, and the controller ranks only strategies of its global
    batch there (``cona/controller.py``, "No estimate")."""
    efficiency_correction: Literal["off", "progress"] = "off"
    """``progress``: once ``horizon_steps`` steps after a batch change (and its LR ramp)
    are in, fit the factor ``k`` in ``phi_true = k * phi`` from the training loss either
    side of it (``cona/progress_fit.py``: the loss must be one smooth curve of the
    effective samples that ``E(M)`` counts) and rank at ``k * phi`` from then on, ``k``
    the end of its 95 % interval nearest 1; ``off``: rank at the measured ``phi`` (the
    gradient noise scale; ``E(M)``: Pollux's statistical efficiency of global batch
    ``M``).  A change is tested only with at least 20 steps before it, ``horizon_steps``
    after its ramp, and a window that adds at most 30 % to the samples trained before it.
    Off by default: no batch change in the CONA bench meets that (docs/cona.md, "Online
    correction" under "Which noise scale")."""
    gns_decision_window: int = 5
    """Decisions rank candidates at the median of the noise-scale estimates of the last
    this many decisions, the current one included (``cona/controller.py``,
    "Transients"): a switch must repay over ``horizon_steps``, so it should follow a
    noise scale that persists, not a loss spike's (measured on the Llama proxy: 6-8x its
    level for ~30 steps).  5 decisions at the default interval are 50 steps, half the
    horizon; 1 = the latest estimate alone."""
    start_probe_updates: int = 4
    """The start decision comes as soon as the noise-scale estimator holds this many
    updates (the steps before it are the probe: real training steps at the start strategy,
    on the clock), instead of at the first ``decision_interval``; 0 = no start decision.
    4 updates of the micro-batch or replica estimate average at least 8 small-batch
    gradients, the same as one step at ``dp=8``; ``min_gain`` absorbs the rest of its
    error."""
    lr_ramp_steps: int = 10
    """After a switch that raises the learning rate (a larger global batch under
    ``lr_scaling``), ramp it linearly from the old to the new value over this many
    optimizer steps (Goyal et al. 2017, Sec. 2.2, gradual warmup); a lower LR applies at
    once; 0 = jump.  10 = ``1/(1 - beta1)`` for Adam's ``beta1 = 0.9``, the steps its first
    moment takes to forget the smaller batch's gradients, and half the default
    ``decision_interval``, so the next decision sees the new strategy at its full LR."""
    adam_beta2_batch: int | None = None
    """The global batch (sequences; emulated mode: target sequences, as
    ``cona.global_batch_sizes``) at which ``train.adam_beta2`` holds.  At any other global
    batch ``B`` the job runs ``beta2 = 1 - (1 - train.adam_beta2) * B / adam_beta2_batch``,
    so Adam's second moment averages over the same number of *samples* at every batch
    (Malladi et al. 2022's square-root scaling rule, its ``beta2`` half;
    :func:`cona.lr_rule.scale_beta`).  At one ``beta2`` a larger batch averages over more
    samples, and on GPT-3's bench proxy batch 256 then needed fewer samples than batch 64,
    which the noise-scale efficiency the controller ranks by (``E(M) <= 1``) does not
    allow; with 256's memory in samples batch 64 needed fewer (``docs/cona.md``, "Adam's
    memory in samples").  ``beta1`` stays (scaled, it cost samples on both proxies
    measured).  The moments are rescaled on every change so that their bias-corrected
    values carry over (:func:`cona.state.set_adam_betas`).  ``None``: ``train.adam_beta2``
    at every batch (its memory in steps).  ``bench/cona_ttp.py`` sets each family's
    published batch."""
    start_slack: float = 0.02
    """Emulated mode: the start layout may be this fraction slower than the fastest at the
    start batch if it runs the next larger batch faster (``cona.picks.start_strategy``:
    a later batch-only switch instead of a layout switch); 0 = the fastest.  If the noise
    scale never calls for the larger batch, the whole run is this much slower, so keep it
    at the slowdown you accept in that case.  Must be below ``min_gain``, or the controller undoes the start."""
    ttp_resolution: float = 0.0
    """Evaluate more often as the validation perplexity nears ``train.target_ppl``, so
    the two evaluations that bracket the TTP crossing are about this fraction of the
    run's samples apart (a target, not a bound; ``jobruntime.metrics.dense_eval_gap``:
    the next evaluation after half the samples predicted to the target by the steeper
    of the last two evaluations' secant and the run's, at least this fraction of the
    samples so far); never later than the ``train.eval_interval``
    cadence.  0 = that cadence only.  The emulated clock charges the cadence alone
    (``cona/emulated.py``): the added evaluations measure the crossing.  In real mode
    they take wall time.  ``bench/cona_ttp.py`` sets 0.01."""
    eval_clock: bool = False
    """Emulated mode: the evaluation cadence in clock time, not in samples: every strategy
    is evaluated every ``train.eval_interval`` step times of the reference strategy (the
    preset's batch at its fastest layout), so every run is observed at the same times
    (TTP is a time) and a large batch, which covers many samples per second, evaluates
    less often per sample.  The clock still charges evaluations as a job validating every
    ``train.eval_interval`` reference batches pays (``cona/emulated.py``); ``False``: the
    cadence is ``train.eval_interval`` x ``parallel.global_batch_size`` samples.
    ``bench/cona_ttp.py`` sets it."""
    switch_timeout_s: float = 600.0
    """Real mode: a layout switch still running after this many seconds means
    a rank stalled or was lost; every rank then exits with one line (resume
    from the last checkpoint at either layout)."""
    schedule: list | None = None
    """GeoMesh, one job per region (``geomesh.region``): layout switches at round
    boundaries, ``[{after_step, region, tp, pp}]`` -- after outer step ``after_step``
    (the metrics' ``step``) region ``region`` moves to TP=``tp``, PP=``pp`` (DP = its
    processes / (tp*pp)) with CONA's in-memory switch (``geomesh/layout_switch.py``).
    Needs ``cona.enabled=true``.  A schedule, because CONA's controller ranks global
    batches and GeoMesh's planner owns each region's batch: the controller does not
    drive GeoMesh regions yet."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad CONA setting."""
        if self.schedule is not None and not self.enabled:
            raise ConfigError("cona.schedule switches GeoMesh regions with CONA's switch; set "
                              "cona.enabled=true (or unset cona.schedule)")
        if not self.enabled:
            return
        for key in ("decision_interval", "horizon_steps", "gns_decision_window"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"cona.{key}={getattr(self, key)} must be positive")
        for key in ("start_probe_updates", "lr_ramp_steps", "gns_split_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"cona.{key}={getattr(self, key)} must be >= 0 (0 = off)")
        if not 0 <= self.min_gain < float("inf"):
            raise ConfigError(f"cona.min_gain={self.min_gain} must be >= 0 (0.05 = switch for a "
                              "5 % better score)")
        b = self.adam_beta2_batch
        if b is not None and (isinstance(b, bool) or not isinstance(b, int)
                              or not 0 < b <= MAX_GLOBAL_BATCH):
            raise ConfigError(f"cona.adam_beta2_batch={self.adam_beta2_batch} must be a global "
                              f"batch from 1 to {MAX_GLOBAL_BATCH} sequences (the batch "
                              "train.adam_beta2 was set for), or null to keep beta2 at every batch")
        if not 0 <= self.start_slack < 1:
            raise ConfigError(f"cona.start_slack={self.start_slack} must be in [0, 1) (0.02 = "
                              "start up to 2 % slower for a cheaper later switch; 0 = fastest)")
        if self.clock == "emulated" and self.start_slack > 0 and self.start_slack >= self.min_gain:
            raise ConfigError(f"cona.start_slack={self.start_slack} must be below cona.min_gain="
                              f"{self.min_gain}: the controller would switch back from the "
                              "start layout at its first decision; lower start_slack")
        if not 0 <= self.ttp_resolution < 1:
            raise ConfigError(f"cona.ttp_resolution={self.ttp_resolution} must be in [0, 1) "
                              "(0.01 = bracket the TTP crossing within 1 % of the run; 0 = off)")
        if not 0 < self.switch_timeout_s < float("inf"):
            raise ConfigError(f"cona.switch_timeout_s={self.switch_timeout_s} must be a positive "
                              "number of seconds (default 600)")
        if self.num_gpus is not None and self.num_gpus <= 0:
            raise ConfigError(f"cona.num_gpus={self.num_gpus} must be positive (or null: the "
                              "world size)")
        if self.candidates is not None and not self.candidates:
            raise ConfigError("cona.candidates=[] lists no candidate; give some, or null to "
                              "enumerate them")
        if not 1 <= self.step_dilation < float("inf"):
            raise ConfigError(f"cona.step_dilation={self.step_dilation} must be a number >= 1 "
                              "(1 = one target step per proxy step)")
        if self.eval_clock and self.clock != "emulated":
            raise ConfigError("cona.eval_clock=true applies to the emulated clock; set "
                              "cona.clock=emulated (or unset it)")
        if not 0 < self.batch_ratio < float("inf"):
            raise ConfigError(f"cona.batch_ratio={self.batch_ratio} must be a positive number")
        self._check_global_batch_sizes()
        emulated_only = [f.name for f in dataclasses.fields(self)
                         if f.name in _EMULATED_ONLY and getattr(self, f.name) != f.default]
        if self.clock == "wall" and emulated_only:  # the wall clock reads none of them
            one = len(emulated_only) == 1
            raise ConfigError(f"cona.{', cona.'.join(emulated_only)} appl{'ies' if one else 'y'} "
                              "to the emulated clock; set cona.clock=emulated (or unset "
                              f"{'it' if one else 'them'})")
        if self.target_model is not None:
            from .loading import check_preset  # loading imports this module

            check_preset(self.target_model, "cona.target_model")
        from ..hardware import gpu_profiles

        if self.gpu.lower() not in {k.lower() for k in gpu_profiles()}:
            raise ConfigError(f"cona.gpu={self.gpu!r} is unknown;"
                              f"{did_you_mean(self.gpu, gpu_profiles())} use one of "
                              f"{sorted(gpu_profiles())} or add it to jobruntime/gpu_profiles.yaml")

    def _check_global_batch_sizes(self) -> None:
        """Each of ``cona.global_batch_sizes`` a whole number of target sequences >= 1, and
        (emulated) of proxy sequences (``cona.mapping.ProxyMapping.proxy_batch``)."""
        sizes = self.global_batch_sizes
        if sizes is None:
            return
        if not sizes:
            raise ConfigError("cona.global_batch_sizes=[] must list at least one batch size "
                              "(sequences); or null for parallel.global_batch_size x 1, 2, 4, 8")
        for b in sizes:
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= MAX_GLOBAL_BATCH:
                raise ConfigError(f"cona.global_batch_sizes={sizes} must be whole numbers of "
                                  f"sequences from 1 to {MAX_GLOBAL_BATCH} ({b!r} is not)")
            proxy = b / self.batch_ratio
            if self.clock == "emulated" and (proxy < 1 or abs(proxy - round(proxy)) > 1e-9):
                raise ConfigError(f"cona.global_batch_sizes={sizes} must be multiples of "
                                  f"cona.batch_ratio={self.batch_ratio:g} (whole proxy sequences; "
                                  f"{b} is not)")
