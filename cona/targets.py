"""What a CONA bench family is measured against: the corpus's unigram perplexity, the
target perplexity, and the time scale that says which span of the target's training one
run stands for.

**Unigram perplexity** (:func:`unigram_perplexity`): the perplexity on the validation
tokens of a model that knows only token frequencies, ``p(w) = (c_w + 1) / (N + V)``
counted on the training tokens (add-one smoothing: a token absent from training gets
``1 / (N + V)``, not zero), ``exp(-mean_val log p(w))``.  With the family's tokenizer
(its vocabulary ``V``).  A language model below it has learned more than frequencies.

**Target** (:func:`target_ppl`): ``TARGET_FRACTION`` (0.5) of the lower of the unigram
perplexity and the warm state's perplexity (:mod:`cona.warm`), both fixed before any
method runs.  At most half the unigram perplexity (the bench's bar, issue 23: the model
predicts the next token at least twice as well as frequencies alone, which only context
can give) for any warm state: 0.5 is the largest fraction that holds for every family
by construction, and the shallowest (the cheapest segment).  Below the warm state's:
the evaluated segment spans at least ``ln 2 = 0.69`` nats of loss past the warmup, so
the target lies deep in training even where the warmup alone reaches the unigram bar
(tiny_gpt: 381 after its 200 warmup steps against a unigram 785).  The segment should
also span a growth of the directly measured noise scale of at least 4x (issue 23);
``bench/cona_calibrate.py`` measures it along the reference against the fraction, as
the bench reads it (the warm state's probe against the trend at the target, below).
In fp32 (``docs/results/cona_calibrate_*.json``) 0.5 gave 4.5x on GPT-3's proxy; in
the bench's bf16 set-up (``docs/results/cona_calibrate_bf16_*.json``) it gives 2.9x
(GPT-3) and 3.7x (Llama), and only 0.3 clears 4x on both, at 2.4-4x the samples
(docs/cona.md, "How deep a target the growth bar needs"): the fraction stays 0.5, the
same for every family, and the bench reports the growth it measured per family
(``noise_scale_growth_direct``).

**Noise scale along the segment** (:func:`fit_noise_scale`).  The time scale below is
steep in the noise scale at the target (twice the noise scale there gives ~6x the step
dilation), and along a run the noise scale is not smooth: a probe is precise within one
state, but in a loss spike the per-sequence gradient variance rose 50-250x for a few
hundred samples (the Llama proxy after its warmup), and one probe a few steps from
another reads 2x different.  So the segment's ends are not read from single probes: the
reference is probed along the segment (the bench: 4 times per evaluation interval), and a
power law in the loss,
``log phi = a + c log L`` (the form of Kaplan et al.'s ``B_crit(L)``, eq. 5.3; McCandlish
et al. 2018, Fig. 4: the noise scale rises as the loss falls), is fitted through all the
probes by Theil-Sen regression (robust to the spike's points).  The segment's ends are
the warm state's own probe ``phi_0`` (one state, the start of every method; 18 probes
there read 5.9-6.7 on the Llama proxy) and the trend's value at the target's loss
``phi_1`` (fixed by the rule above; each method reaches it in a state of its own), as
``bench/cona_reference.py``'s ``segment_trend`` reads them.

**Time scale** (:func:`time_scale`).  The proxy's gradient noise scale ``phi_p`` (proxy
sequences) stands for ``r * phi_p`` target sequences (:mod:`cona.mapping`), i.e. a
critical batch of ``B = r * phi_p * s_t`` tokens.  Kaplan et al. 2020 (Sec. 5.1, eq. 5.3)
give the critical batch as a function of the loss only,

    B_crit(L) = B* / L^(1/alpha_B),   B* = 2e8 tokens, alpha_B = 0.21,

so a measured noise scale names the target's loss ``L = (B* / B)^alpha_B``.  Their
training curve (eq. 5.6 / 1.6, Table 3: ``alpha_N = 0.077, N_c = 6.5e13, alpha_S = 0.76,
S_c = 2.1e3``) at ``N`` non-embedding parameters,

    L(N, S_min) = (N_c / N)^alpha_N + (S_c / S_min)^alpha_S,

names the optimizer steps ``S_min`` (at ``B >> B_crit``) at which the target has that
loss; training at the critical batch takes ``2 S_min`` steps and ``2 E_min`` tokens
(eq. 5.4; McCandlish et al. 2018), with ``dE_min = B_crit(L(S)) dS``.  So the noise-scale
range the proxy's reference run measures over the evaluated segment, ``[phi_0, phi_1]``,
names a span of the target's training of

    T = 2 * integral_{S_min(L_0)}^{S_min(L_1)} B_crit(L(N, S)) dS   tokens,

and one proxy step stands for ``k = T / (r * S_p * s_t)`` target steps of its batch
(``S_p``: the proxy samples of the segment): the emulated clock charges ``k`` times the
target's step time per proxy step (``cona.step_dilation``; switch costs stay real seconds).
The rule is continuous in the two measurements (no rounding edge) and uses no method's
result.
"""

from __future__ import annotations

import math

import numpy as np

TARGET_FRACTION = 0.5  # of the lower of the unigram and the warm state's perplexity
# the version of the time-scale rule (fit_noise_scale, time_scale and the bench's probes
# along its reference): raise it with any change to what a set-up measures, so that a
# committed calibration of the old rule (bench/cona_time_scale.py) no longer applies
TIME_SCALE_RULE = 1
# Kaplan et al. 2020: eq. 5.3 (critical batch) and Table 3 / eq. 5.6 (L(N, S_min))
B_STAR_TOKENS = 2.0e8
ALPHA_B = 0.21
ALPHA_N, N_C = 0.077, 6.5e13
ALPHA_S, S_C = 0.76, 2.1e3


def token_counts(prefix: str, docs: np.ndarray, vocab_size: int) -> np.ndarray:
    """Counts (int64, shape ``[vocab_size]``) of every token id in documents ``docs`` of
    the megatron indexed dataset at ``prefix`` (``.bin``/``.idx``)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(prefix))
    bounds = ds.document_indices
    counts = np.zeros(vocab_size, dtype=np.int64)
    for d in docs:
        for i in range(bounds[d], bounds[d + 1]):
            counts += np.bincount(ds[i], minlength=vocab_size)[:vocab_size]
    return counts


def unigram_perplexity(train_counts: np.ndarray, val_counts: np.ndarray) -> float:
    """``exp(-sum_w c_val(w) log p(w) / N_val)`` with add-one smoothed training frequencies
    ``p(w) = (c_train(w) + 1) / (N_train + V)`` (module docstring).

    Args:
        train_counts, val_counts: token counts, shape ``[V]``.

    Raises:
        ValueError: shapes differ or the validation counts are empty.
    """
    train = np.asarray(train_counts, dtype=np.float64)
    val = np.asarray(val_counts, dtype=np.float64)
    if train.shape != val.shape or val.sum() <= 0:
        raise ValueError(f"need equal-shape counts and validation tokens; got {train.shape}, "
                         f"{val.shape}, {val.sum():.0f} validation tokens")
    logp = np.log(train + 1.0) - math.log(train.sum() + train.size)
    return float(math.exp(-(val * logp).sum() / val.sum()))


def corpus_unigram_perplexity(corpus, vocab_size: int) -> float:
    """:func:`unigram_perplexity` of a :class:`jobruntime.data.Corpus`'s validation
    documents under its training documents (the family's tokenizer)."""
    return unigram_perplexity(token_counts(corpus.prefix, corpus.train_docs, vocab_size),
                              token_counts(corpus.prefix, corpus.val_docs, vocab_size))


def non_embedding_params(model) -> int:
    """``N`` of Kaplan et al. 2020 (Sec. 2.1): parameters without the token and position
    embeddings (:func:`jobruntime.flops.num_params` of the model less that of its
    0-layer version, which holds only embeddings, final norm and head)."""
    import dataclasses

    from jobruntime.flops import num_params

    return num_params(model) - num_params(dataclasses.replace(model, num_layers=0))


def target_ppl(unigram_ppl: float, warm_ppl: float | None = None) -> float:
    """``TARGET_FRACTION * min(unigram_ppl, warm_ppl)`` (module docstring); ``warm_ppl``
    ``None``: of the unigram perplexity alone."""
    return TARGET_FRACTION * min(unigram_ppl, warm_ppl if warm_ppl is not None else math.inf)


def loss_at_critical_batch(tokens: float) -> float:
    """``L`` (nats/token) with ``B_crit(L) = tokens`` (Kaplan eq. 5.3 inverted)."""
    return (B_STAR_TOKENS / tokens) ** ALPHA_B


def critical_batch_tokens(loss: float) -> float:
    """``B_crit(L) = B* / L^(1/alpha_B)`` tokens (Kaplan et al. 2020, eq. 5.3)."""
    return B_STAR_TOKENS / loss ** (1.0 / ALPHA_B)


def steps_to_loss(loss: float, params: float) -> float:
    """``S_min`` with ``L(N, S_min) = loss`` (Kaplan eq. 5.6 inverted).

    Raises:
        ValueError: ``loss`` is at or below the model's converged loss ``(N_c/N)^alpha_N``
            (a noise scale larger than the critical batch the model ever reaches).
    """
    floor = (N_C / params) ** ALPHA_N
    if not loss > floor:
        raise ValueError(
            f"loss {loss:.3f} is at or below the converged loss {floor:.3f} of a "
            f"{params:.3g}-parameter model: the proxy's noise scale (x the batch ratio) "
            f"exceeds B_crit at convergence ({critical_batch_tokens(floor):.3g} tokens); "
            "lower cona.batch_ratio")
    return S_C / (loss - floor) ** (1.0 / ALPHA_S)


def target_tokens(phi0_tokens: float, phi1_tokens: float, params: float,
                  points: int = 2000) -> float:
    """Target tokens ``T`` between critical batches ``phi0_tokens`` and ``phi1_tokens``
    (module docstring): ``2 * integral B_crit(L(N, S)) dS`` over ``S`` from ``S_min(L_0)``
    to ``S_min(L_1)`` (trapezoid rule on a log grid in ``S``).

    Raises:
        ValueError: ``phi1_tokens <= phi0_tokens`` (the noise scale did not grow) or
            :func:`steps_to_loss`'s error.
    """
    if not 0 < phi0_tokens < phi1_tokens:
        raise ValueError(f"the noise scale must grow over the segment: {phi0_tokens:.4g} -> "
                         f"{phi1_tokens:.4g} tokens")
    s0 = steps_to_loss(loss_at_critical_batch(phi0_tokens), params)
    s1 = steps_to_loss(loss_at_critical_batch(phi1_tokens), params)
    s = np.geomspace(s0, s1, points)
    floor = (N_C / params) ** ALPHA_N
    b = B_STAR_TOKENS / (floor + (S_C / s) ** ALPHA_S) ** (1.0 / ALPHA_B)
    return float(2.0 * np.trapezoid(b, s))


def fit_noise_scale(losses, grad_sq, trace, at) -> dict:
    """The noise scale's trend along a run from direct probes: the power law
    ``log phi = a + c log L`` fitted by Theil-Sen regression (module docstring), evaluated
    at the losses ``at``.

    Each probe ``i`` gives unbiased estimates ``|G|^2_i`` and ``tr(Sigma)_i``
    (:func:`cona.direct_gns.measure_gradient_stats`; McCandlish et al. 2018, App. A.1) and so
    ``phi_i = tr_i / |G|^2_i``.  Within one state a probe of 64 micro-batches is precise
    (6 probes at the Llama proxy's warm state: 5.9-6.7, ``bench/cona_probe_precision.py``),
    but along a run the noise scale itself jumps: in a loss spike after the warmup ``tr(Sigma)`` rose 50-250x and
    ``phi`` 15-30x for a few hundred samples.  Least squares would follow such points
    (in ``log phi``, or in the sums of ``tr`` and ``|G|^2``, where they dominate), so the
    slope is the median of the pairwise slopes and the intercept the median of ``log
    phi_i - c log L_i`` (Theil 1950, Sen 1968: robust to up to 29 % of the points, and
    continuous in the data).

    Args:
        losses: validation loss at each probe (nats per token), shape ``[n]``.
        grad_sq, trace: the probes' ``|G|^2`` and ``tr(Sigma)`` estimates, shape ``[n]``; a
            probe without a positive pair (no signal or no noise measured) is dropped.
        at: losses (nats per token) to evaluate the trend at.

    Returns:
        ``{"at": the trend's noise scale at ``at`` (the probes' units: sequences),
        "slope": c, "intercept": a, "points": probes used, "log_mad": the median absolute
        deviation of ``log phi_i`` from the trend (how far single probes scatter)}``.

    Raises:
        ValueError: fewer than three usable probes, a non-positive loss, or all losses
            equal.
    """
    pts = [(float(x), float(t) / float(g)) for x, g, t in zip(losses, grad_sq, trace)
           if g > 0 and t > 0]
    if len(pts) < 3:
        raise ValueError(f"need at least 3 noise-scale probes with |G|^2 > 0 and tr > 0, got "
                         f"{len(pts)}: probe more often along the segment")
    if any(x <= 0 for x, _ in pts):
        raise ValueError(f"losses must be positive, got {[x for x, _ in pts]}")
    x = np.log([p[0] for p in pts])
    y = np.log([p[1] for p in pts])
    i, j = np.triu_indices(len(x), 1)
    keep = x[j] != x[i]
    if not keep.any():
        raise ValueError("all probes at the same loss: no slope to fit")
    c = float(np.median((y[j] - y[i])[keep] / (x[j] - x[i])[keep]))
    a = float(np.median(y - c * x))
    return {"at": [float(math.exp(a + c * math.log(v))) for v in at], "slope": c,
            "intercept": a, "points": len(pts),
            "log_mad": float(np.median(np.abs(y - a - c * x)))}


def trend_interval(losses, grad_sq, trace, at: float, *, over: float | None = None,
                   block: int = 1, level: float = 0.95, draws: int = 2000, seed: int = 0,
                   min_usable: float = 0.9) -> list[float]:
    """How precisely :func:`fit_noise_scale`'s trend reads the noise scale at one loss
    (or its growth between two): the percentile bootstrap interval (Efron & Tibshirani
    1993, ch. 13) of the trend's value at ``at``, or with ``over`` of the ratio of its
    values at ``at`` and at ``over`` (``(at / over)^c``: the growth the trend names between
    the two losses), refitting the Theil-Sen trend on each draw.

    Draws resample the probes with replacement, a probe's loss and noise scale together,
    in moving blocks of ``block`` consecutive probes (Kunsch 1989; ``arch.bootstrap.
    MovingBlockBootstrap``, the probes in the order they were taken along the run):
    probes that share a loss spike (a few hundred samples) are correlated, and resampled
    one at a time (``block=1``, the pairs bootstrap) they would count as independent and
    give too narrow an interval.  :func:`bootstrap_block` picks ``block`` from the data.

    It measures the scatter of the probes about the trend (states along a run read 2x
    apart, a loss spike's far more), which is what a segment's growth rests on: on the
    committed run at 792d30e, Llama's 8 probes gave a growth of 3.6x with an interval
    of 0.1-10x; more probes along the segment narrow it about as ``1/sqrt(n)`` where
    they are uncorrelated, more slowly where they are not.
    Draws with fewer than 3 usable probes or all at one loss (no slope) are skipped; a
    draw is skipped only with few distinct probes, the widest draws, so where many are
    the interval is refused (``min_usable``).

    Args:
        losses, grad_sq, trace: as :func:`fit_noise_scale` (shape ``[n]``, in the order
            the probes were taken).
        at: the loss (nats per token) to read the trend at.
        over: ``None``, or a second loss (nats per token): the interval is then of the
            trend's growth from ``over`` to ``at`` (a ratio, no unit).
        block: probes per resampled block, in ``[1, n]``.
        level: the interval's coverage, in (0, 1).
        draws: bootstrap draws.
        seed: the resampling's seed (the interval is deterministic in it).
        min_usable: the least share of draws that must be fitted.

    Returns:
        ``[low, high]``: the ``(1 - level)/2`` and ``(1 + level)/2`` percentiles of the
        trend's value at ``at`` (the probes' units: sequences), or of its growth.

    Raises:
        ValueError: ``level`` outside (0, 1), ``draws`` < 100, ``block`` outside
            ``[1, n]``, the probes cannot be fitted at all (:func:`fit_noise_scale`'s
            errors), or fewer than ``min_usable`` of the draws could be fitted (too few
            probes to bootstrap).
    """
    from arch.bootstrap import MovingBlockBootstrap

    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if draws < 100:
        raise ValueError(f"need at least 100 bootstrap draws, got {draws}")
    points = [at] if over is None else [at, over]
    fit_noise_scale(losses, grad_sq, trace, points)  # the probes' own errors, named once
    cols = [np.asarray(v, dtype=float) for v in (losses, grad_sq, trace)]
    if not 1 <= block <= len(cols[0]):
        raise ValueError(f"block must be in [1, {len(cols[0])}] (the probes), got {block}")

    def value(x, g, t) -> np.ndarray:
        try:
            v = fit_noise_scale(x, g, t, points)["at"]
        except ValueError:  # a draw with fewer than 3 usable probes or one loss
            return np.array([np.nan])
        return np.array([v[0] if over is None else v[0] / v[1]])

    boot = MovingBlockBootstrap(block, *cols, seed=np.random.default_rng(seed))
    values = boot.apply(value, reps=draws)[:, 0]
    values = values[np.isfinite(values)]
    if len(values) < min_usable * draws:
        raise ValueError(f"only {len(values)} of {draws} bootstrap draws could be fitted: "
                         f"{len(cols[0])} probes are too few to bootstrap; probe more often")
    tail = 50.0 * (1.0 - level)
    low, high = np.percentile(values, [tail, 100.0 - tail])
    return [float(low), float(high)]


MIN_BLOCK_PROBES = 20  # fewer usable probes: no block length is estimated (pairs bootstrap)


def bootstrap_block(losses, grad_sq, trace) -> int:
    """The block length (probes) for :func:`trend_interval`'s moving-block bootstrap:
    Politis & White (2004)'s optimal block length, with Patton, Politis & White (2009)'s
    correction, for the circular/moving-block bootstrap (``arch.bootstrap.
    optimal_block_length``; the two share their first-order optimal length) of the
    probes' residuals about :func:`fit_noise_scale`'s trend (``log phi_i`` less the
    trend, in the order taken), rounded up: 1 (the pairs bootstrap) where the residuals
    are uncorrelated, longer the further their correlation reaches; at most half the
    usable probes.  The rule is derived for a sample mean and applied here to a robust
    trend's residuals, a heuristic; below :data:`MIN_BLOCK_PROBES` usable probes it is
    too noisy to use (white noise of 8-16 points mostly returns its cap), so the result
    is 1 there and the interval treats the probes as independent.

    Args:
        losses, grad_sq, trace: as :func:`fit_noise_scale` (shape ``[n]``), in the order
            the probes were taken.

    Raises:
        ValueError: :func:`fit_noise_scale`'s errors.
    """
    from arch.bootstrap import optimal_block_length

    fit = fit_noise_scale(losses, grad_sq, trace, [])
    r = np.array([math.log(float(t) / float(g)) - fit["intercept"]
                  - fit["slope"] * math.log(float(x))
                  for x, g, t in zip(losses, grad_sq, trace) if g > 0 and t > 0])
    if len(r) < MIN_BLOCK_PROBES:
        return 1
    b = float(optimal_block_length(r)["circular"].iloc[0])
    if not math.isfinite(b):
        return 1
    return int(min(max(1, math.ceil(b)), len(r) // 2))


def time_scale(phi0_proxy: float, phi1_proxy: float, *, ratio: float, target_seq: int,
               params: float, segment_proxy_samples: float) -> dict:
    """The step dilation ``k`` and what one run stands for (module docstring).

    Args:
        phi0_proxy, phi1_proxy: the reference's noise scale (proxy sequences) at the
            segment's start (warm checkpoint) and at the target (the bench passes
            :func:`fit_noise_scale`'s values at their losses).
        ratio: ``r``, target sequences per proxy sequence.
        target_seq: the target's sequence length ``s_t`` (tokens).
        params: the target's non-embedding parameters ``N``.
        segment_proxy_samples: proxy samples the reference trained over the segment.

    Returns:
        ``{"step_dilation", "target_tokens_per_run", "target_loss_range", "source"}``.
    """
    t0, t1 = ratio * phi0_proxy * target_seq, ratio * phi1_proxy * target_seq
    tokens = target_tokens(t0, t1, params)
    undilated = ratio * segment_proxy_samples * target_seq
    return {"step_dilation": tokens / undilated, "target_tokens_per_run": tokens,
            "target_loss_range": [loss_at_critical_batch(t0), loss_at_critical_batch(t1)],
            "critical_batch_tokens_range": [t0, t1],
            "source": "Kaplan et al. 2020, eq. 5.3 (B_crit(L)), eq. 5.6 + Table 3 (L(N, S)), "
                      "eq. 5.4 (2x steps and tokens at B_crit)"}
