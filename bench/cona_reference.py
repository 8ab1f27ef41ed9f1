"""The CONA bench's seed contexts and its reference run (rules 2, 4 and 5 of
:mod:`bench.cona_ttp`): a seed's context started from its cached warm state, the
reference from there to the target with the noise scale probed directly along it, the
probes' trend at the target's loss, and the time scale it gives.

Used by :mod:`bench.cona_ttp`, :mod:`bench.cona_calibrate` and
:mod:`bench.cona_efficiency`; nothing here looks at a method's result.
"""

from __future__ import annotations

import math

RECIPE_BUDGET_SCALE = 4  # static_recipe has no cap: it may train this x the budget


def seed_context(cfg, warm_steps: int, data=None, probe_microbatches: int = 64):
    """``(ctx, cached)``: the context of ``cfg`` (its seed's data, the budget's 4x for
    static_recipe, evaluations charged: rule 5) started from its cached warm state
    (rule 2), its perplexity and noise scale (``probe_microbatches`` micro-batches)
    measured there; ``cached``: the warm state was read from disk."""
    from cona.context import build_context
    from cona.emulated import eval_steps_per_step
    from cona.warm import load_or_train_warm

    budget = cfg.train.iters * cfg.parallel.global_batch_size
    ctx = build_context(cfg, data=data, min_train_samples=RECIPE_BUDGET_SCALE * budget)
    # rule 5: evaluations charged to every method, the oracle's clock included
    ctx.cluster.eval_steps = eval_steps_per_step(ctx.data.val_samples, ctx.eval_samples)

    def measure(job):
        from jobruntime.metrics import perplexity

        g_sq, trace = job.measure_gradient_stats(probe_microbatches)
        return {"val_ppl": perplexity(job.evaluate()), "grad_sq": g_sq, "grad_trace": trace,
                "noise_scale_proxy": trace / g_sq if g_sq > 0 else None}

    warm, cached = load_or_train_warm(ctx, warm_steps, measure)
    ctx.warm = warm
    return ctx, cached



def probe_spacing(ctx, density: int | None) -> int | None:
    """Proxy samples between the reference's direct probes at ``density`` probes per
    evaluation interval (``ctx.eval_samples``); ``None`` (no density): one probe per
    evaluation, :func:`reference`'s default."""
    return max(1, ctx.eval_samples // density) if density else None


def reference(ctx, quick_segment: int | None = None, probe_microbatches: int = 64,
              probe_every_samples: int | None = None) -> dict:
    """Rule 4's reference: the preset batch (fastest layout, LR 1x) from the warm state to
    the target (``quick_segment``: for ``quick_segment`` steps, its perplexity there is
    the target), the noise scale measured directly (``probe_microbatches``) along it and
    at its end: at every evaluation of its cadence, or (``probe_every_samples``) every
    that many samples from the warm state, each with an evaluation of its own for the
    loss (more probes than evaluations: the trend's precision grows with the probes,
    :func:`cona.targets.trend_interval`).  The segment's ends: the warm state's own
    probe (one state, common to every method: ``noise_scale_warm_proxy``) and the
    probes' trend at the target's loss (:func:`segment_trend`: each method reaches the
    target in its own state, and single probes scatter ~2x along a run).

    Returns:
        A JSON-ready record: ``reached``, ``val_ppl``, ``samples`` and
        ``segment_samples`` (proxy samples), ``noise_scale_warm_proxy`` and
        ``noise_scale_target_proxy`` (proxy sequences), ``noise_scale_target_interval_proxy``
        (its 95 % moving-block bootstrap interval ``[low, high]``, ``None`` where too few
        probes), ``noise_scale_growth`` (:func:`segment_growth`),
        ``noise_scale_target_one_per_eval_proxy`` (with ``probe_every_samples``: the same
        run's trend through one probe per evaluation interval, ``{"value", "interval",
        "points", "every_samples"}``, or ``None`` where too few), ``noise_scale_fit``,
        ``noise_scale_probes`` (``samples``, ``val_loss`` in nats, ``grad_sq``,
        ``grad_trace``), ``probe_every_samples`` and ``evals``.

    Raises:
        ValueError: fewer than 3 usable probes along the segment
            (:func:`cona.targets.fit_noise_scale`).
    """
    from cona.run import Loop

    job = ctx.make_job(ctx.reference_strategy(), track_gns=False)  # probed directly instead
    loop = Loop(job, ctx.cfg, budget_samples=ctx.budget_samples,
                eval_samples=ctx.eval_samples, keep_records=False)
    evals = loop.progress.evals
    warm = ctx.warm["extra"]
    w0 = ctx.warm["consumed_samples"]
    probes = [{"samples": w0, "val_loss": math.log(warm["val_ppl"]),
               "grad_sq": warm["grad_sq"], "grad_trace": warm["grad_trace"]}]

    def probe() -> None:
        # not charged: the reference's clock is no result, and its evaluation cadence on
        # the clock (cona.eval_clock) would jump past the steps a probe is charged
        g_sq, trace = job.measure_gradient_stats(probe_microbatches, charge=False)
        probes.append({"samples": job.consumed_samples, "grad_sq": g_sq, "grad_trace": trace,
                       "val_loss": math.log(loop.progress.last_val_ppl)})

    end = ctx.warm["steps"] + (quick_segment or 0)
    while not loop.done and not (quick_segment is not None and job.trainer.step >= end):
        n, before = len(evals), job.consumed_samples
        loop.step()
        if loop.done:
            break
        if probe_every_samples is None:
            if len(evals) > n and evals[-1]["cadence"]:
                probe()  # at the cadence's evaluations (not at the dense ones near the target)
        elif (job.consumed_samples - w0) // probe_every_samples > (before - w0) // probe_every_samples:
            if len(evals) == n:  # no evaluation at this step yet: one for the loss
                loop.evaluate()
            if not loop.done:  # that evaluation may be the target's crossing: probed below
                probe()
    if quick_segment is not None and evals[-1]["samples"] != job.consumed_samples:
        loop.evaluate()
    if probes[-1]["samples"] != job.consumed_samples:  # not probed at this state yet
        probe()  # at the end: the target's crossing
    end_loss = math.log(loop.progress.last_val_ppl if quick_segment is not None
                        else ctx.cfg.train.target_ppl)
    phi0, fit = warm["noise_scale_proxy"], segment_trend(probes, end_loss)
    growth = segment_growth(probes, end_loss, phi0)
    sparse = None
    if probe_every_samples is not None:  # side by side: the same run's probes, one per
        # evaluation interval as the cadence took them before (and the end's)
        per = max(1, ctx.eval_samples // probe_every_samples)  # grid points per interval
        sub = [probes[0], *(p for p in probes[1:-1]
                            if (p["samples"] - w0) // probe_every_samples % per == 0),
               probes[-1]]
        try:
            trend = segment_trend(sub, end_loss)
            sparse = {"value": trend["at"][0],
                      "interval": segment_trend_interval(sub, end_loss),
                      "points": trend["points"], "every_samples": per * probe_every_samples}
        except ValueError:  # fewer than 3 usable probes
            sparse = None
    return {"reached": loop.progress.ttp.reached or quick_segment is not None,
            "val_ppl": loop.progress.last_val_ppl, "samples": job.consumed_samples,
            "segment_samples": job.consumed_samples - w0,
            "noise_scale_warm_proxy": phi0, "noise_scale_target_proxy": fit["at"][0],
            "noise_scale_target_interval_proxy": None if growth["direct_interval"] is None
            else [v * phi0 for v in growth["direct_interval"]],
            "noise_scale_growth": growth,
            "noise_scale_target_one_per_eval_proxy": sparse,
            "noise_scale_fit": fit, "noise_scale_probes": probes,
            "probe_every_samples": probe_every_samples,
            "evals": [{k: e[k] for k in ("samples", "val_ppl")} for e in evals]}



def segment_trend(probes: list[dict], loss: float) -> dict:
    """:func:`cona.targets.fit_noise_scale` over the probes of the segment's states
    (``probes[1:]``: ``probes[0]`` is the warm state, which every method starts from and
    which is measured as it is), read at ``loss``."""
    from cona.targets import fit_noise_scale

    return fit_noise_scale(*segment_columns(probes), [loss])


def segment_trend_interval(probes: list[dict], loss: float,
                           block: int | None = None) -> list[float] | None:
    """The 95 % moving-block bootstrap interval ``[low, high]`` (proxy sequences) of
    :func:`segment_trend` at ``loss`` (:func:`cona.targets.trend_interval`, the same
    probes, blocks of ``block`` or else :func:`cona.targets.bootstrap_block`'s); ``None``
    where the probes are too few to bootstrap (a short quick segment)."""
    from cona.targets import bootstrap_block, trend_interval

    cols = segment_columns(probes)
    try:
        return trend_interval(*cols, loss, block=block or bootstrap_block(*cols))
    except ValueError:
        return None


def segment_growth(probes: list[dict], end_loss: float, phi0: float) -> dict:
    """The segment's noise-scale growth two ways, each with its 95 % moving-block bootstrap
    interval (:func:`segment_trend_interval`'s blocks; ``None`` where too few probes),
    and Kaplan's over the same losses:

    - ``direct``: the probes' trend at the target's loss ``end_loss`` over the warm
      state's own probe ``phi0`` (proxy sequences): what the bench's growth bar and its
      time scale read (:func:`time_scale_for`).
    - ``along``: the trend at the target over the trend at the warm state's loss,
      ``(L_1 / L_0)^c``: the growth the segment's own probes show, without the warm
      state's probe.  Where the two differ, the growth is a step between the warm state
      and the segment's first probes, not a rise along it.
    - ``kaplan``: ``(L_0 / L_1)^(1/alpha_B)``, what Kaplan et al. 2020's ``B_crit(L)``
      (eq. 5.3) gives over the same loss range, beside ``slope`` ``c`` and Kaplan's
      ``-1/alpha_B`` (a check of the trend's form, not of its level).

    ``along`` reads the trend at the warm state's loss, which lies before the segment's
    first probe (a step of one or more optimizer steps): there it is extrapolated.

    Losses in nats per token; growths are ratios.  Raises :func:`segment_trend`'s
    ``ValueError`` (fewer than 3 usable probes)."""
    from cona.targets import ALPHA_B, bootstrap_block, trend_interval

    cols = segment_columns(probes)
    warm_loss = probes[0]["val_loss"]
    fit = segment_trend(probes, end_loss)
    block = bootstrap_block(*cols)
    direct = segment_trend_interval(probes, end_loss, block)
    try:
        along = trend_interval(*cols, end_loss, over=warm_loss, block=block)
    except ValueError:  # too few probes to bootstrap
        along = None
    return {"direct": fit["at"][0] / phi0,
            "direct_interval": None if direct is None else [v / phi0 for v in direct],
            "along": (end_loss / warm_loss) ** fit["slope"], "along_interval": along,
            "kaplan": (warm_loss / end_loss) ** (1.0 / ALPHA_B),
            "slope": fit["slope"], "kaplan_slope": -1.0 / ALPHA_B,
            "warm_loss": warm_loss, "target_loss": end_loss,
            "points": fit["points"], "bootstrap_block": block}


def probe_noise_scale(probe: dict) -> float | None:
    """A stored probe's noise scale ``tr(Sigma) / |G|^2`` (proxy sequences), ``None``
    where it read no positive signal or noise (a probe the trend leaves out)."""
    g, t = probe["grad_sq"], probe["grad_trace"]
    return t / g if g > 0 and t > 0 else None


def segment_columns(probes: list[dict]) -> tuple[list, list, list]:
    """The segment's probes (``probes[1:]``: ``probes[0]`` is the warm state) as the
    columns the trend is fitted to: losses (nats), ``|G|^2`` and ``tr(Sigma)``."""
    seg = probes[1:]
    return ([p["val_loss"] for p in seg], [p["grad_sq"] for p in seg],
            [p["grad_trace"] for p in seg])



def static_loop(ctx, strategy, lr_factor: float = 1.0):
    """``(job, loop)``: a job at ``strategy`` and ``lr_factor`` x the scaling rule's LR
    from ``ctx``'s start (its warm state where set) and its loop over ``ctx``'s budget
    (to the target or the budget's end)."""
    from cona.run import Loop

    job = ctx.make_job(strategy, lr_factor=lr_factor)
    return job, Loop(job, ctx.cfg, budget_samples=ctx.budget_samples,
                     eval_samples=ctx.eval_samples, keep_records=False)



def time_scale_for(ctx, ref: dict) -> dict:
    """Rule 4 (:func:`cona.targets.time_scale`); on a noise scale that did not grow (a
    too-short quick run) the dilation is 1 and the error is recorded."""
    from cona.targets import non_embedding_params, time_scale

    try:
        return time_scale(ref["noise_scale_warm_proxy"], ref["noise_scale_target_proxy"],
                          ratio=ctx.mapping.ratio, target_seq=ctx.target.seq_length,
                          params=non_embedding_params(ctx.target),
                          segment_proxy_samples=ref["segment_samples"])
    except ValueError as e:
        return {"step_dilation": 1.0, "target_tokens_per_run": None, "error": str(e)}
