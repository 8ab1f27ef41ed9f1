"""Checks of decoded pseudo-gradients before aggregation, and robust aggregation.

An authenticated message (:mod:`geomesh.wire.envelope`) can still carry values no
honest worker sends: a worker in another organisation may be buggy or
hostile.  Before equation (1) of :mod:`geomesh.outer` weights a message,
:class:`Guard` checks, per worker ``i`` (all receivers run the same checks on
the same messages, so every copy of ``θ_global`` stays identical):

1. **finite** — every value (fp32), scale (sign, top-k) and coefficient
   (``sign_pred``) is finite (the decoder refuses others: ``malformed``);
2. **tokens** — ``n_i`` within ``geomesh.token_tolerance`` (relative) of the
   tokens the plan gave worker ``i`` this round (a worker claiming more
   tokens would take more weight; the plan is known to every worker);
3. **norm** — the norm of the decoded pseudo-gradient, ``‖m_i · sign(Δ_i)‖₂``
   (``sqrt(Σ m² · elements per scale)``) or ``‖Δ_i‖₂``, divided by worker
   ``i``'s expected scale of the round, from its inner learning rates
   (:class:`geomesh.worker.LrScale`, computed by the receiver from the plan; a
   worker with scale 0 — its only step ran at warmup's lr 0 — is divided by
   the round's smallest positive scale), at most ``geomesh.max_norm_ratio``
   times the larger of the median of the other workers' normalised norms this
   round and worker ``i``'s own history (an exponential mean of its accepted
   normalised norms, weight 1/2); references of 0 are ignored (that worker
   sent ``Δ = 0``); with neither (one worker, first round) the check passes.  Without the division
   honest workers of a heterogeneous plan differed 13x in warmup (the
   four-region plan's H100, 25 inner steps at lrs up to 24/62 of ``train.lr``,
   was rejected in round 1 against the V100's 2 steps at lrs 0 and 1/5);
   with it they differ by their data and by at most ``(H_max/H_min) ** 0.25``
   (2.2x on that plan), so the default ratio 10 rejects no honest worker in
   the tests and benches;
4. **element** — no element carries more than its share of the norm: in every
   tensor ``max_j |Δ_j| ≤ MAX_PEAK_RATIO · sqrt(mean_j Δ_j²)`` (the peak-to-RMS
   or crest factor; sign messages: ``max m_r / sqrt(mean m_r²)`` over the row
   scales).  Without it a worker could put its whole permitted norm (check 3)
   into one weight, ``sqrt(numel)`` times the RMS.  A crest factor does not
   depend on the lr, the round or the worker's size, so one bound fits all;
   measured on honest emulated four-region runs (6 rounds, ``tiny_gpt``): at
   most 2.2 (``sign_row`` with error feedback), 4.5 (``compress_update``),
   4.6 (``sign_pred``), 5.2 (``topk``: a row's kept elements are ``chunk/k``
   times sparser, ``sqrt(256/8) = 5.7`` is its ideal), 5.7 (fp32, DiLoCo).
   The bound 64 is 11x the largest; a tensor of at most ``64² = 4096``
   elements is not constrained by it (its crest is at most ``sqrt(numel)``);
5. **figures** — the loss and compute seconds a worker reports with its
   message (one job per region; they feed the logged loss, the idle
   statistics and re-planning) are bounded like values are
   (:meth:`Guard.screen_figures`): finite, non-negative (seconds positive),
   and within ``max_norm_ratio`` (loss) or ``max_norm_ratio²`` (seconds) of
   at least half of the other workers' figures.  Out-of-bound figures are left out of the log
   and the re-plan of that round; the pseudo-gradient is judged by 1-4.

Identity.  Every check is keyed on the worker whose slot of the exchange a
message arrived in (authenticated by :mod:`geomesh.wire.envelope`), never on the
id in the codec header: a header naming another worker is dropped as
``identity``, one of its own worker but another round as ``round`` (a replay;
:func:`geomesh.wire.codec.aggregate_decoded`), and a worker the plan gives no
tokens this round has no weight (``tokens``).

A worker that fails checks 1-4 or the identity check is dropped from the
round like a lost worker (its weight renormalised away) and named in a
warning; :attr:`Guard.rejected` counts rejections by reason.  The one
exception: a ``round`` rejection in a job's first round stops the job (exit 2),
since there it means the regions started from checkpoints of different outer
steps (:meth:`geomesh.sync.OuterLoop.refuse_other_start`); so an insider holding
the run's secret can stop a run at its start, as it could by sending nothing.

Robust aggregation (``geomesh.robust_aggregation``), for insiders whose
values pass the checks but point the wrong way:

* ``sign_majority`` — with the sign kinds of the codec, per element the
  token-weighted majority of the signs, ``Δ = (Σ w_i |x_i|) · sign(Σ w_i
  sign(x_i))`` on the decoded values ``x_i = ±m_i`` (ties give 0): a minority
  cannot flip an element (signSGD with majority vote, Bernstein et al. 2019,
  "signSGD with Majority Vote is Communication Efficient and Fault
  Tolerant", Alg. 1, with the token-weighted scale of equation (1)); with
  fp32 and top-k, the trimmed mean below;
* ``trimmed_mean`` — the coordinate-wise trimmed mean of the workers' decoded
  values (the largest and smallest ``max(1, ⌊K/4⌋)`` dropped when ``K ≥ 3``,
  unweighted; Yin et al. 2018, "Byzantine-Robust Distributed Learning",
  Def. 2).

Their perplexity cost is not yet measured on the current code (``bench/geomesh_ttp.py
--set geomesh.robust_aggregation=...`` measures it; docs/geomesh.md).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence

import torch

log = logging.getLogger(__name__)

ROBUST = ("none", "sign_majority", "trimmed_mean")
MAX_PEAK_RATIO = 64.0
"""Bound of check 4: an element's magnitude over its tensor's RMS (module docstring)."""


def dense_peaks(delta: Mapping[str, torch.Tensor]) -> tuple[float, str]:
    """The largest peak-to-RMS ratio ``max |Δ_j| / sqrt(mean Δ_j²)`` over the tensors
    of ``delta``, and that tensor's name (``(0, "")`` when all are zero)."""
    worst = (0.0, "")
    for name, t in delta.items():
        x = t.double()
        if x.numel():
            worst = max(worst, (peak_ratio(x.abs().max(), float(x.pow(2).mean())), name))
    return worst


def peak_ratio(peak: torch.Tensor, mean_square: float) -> float:
    """``peak / sqrt(mean_square)``; 0 for a zero tensor, ``inf`` for a non-finite one."""
    p = float(peak)
    if not (math.isfinite(p) and math.isfinite(mean_square)):
        return math.inf
    return p / math.sqrt(mean_square) if mean_square > 0 else 0.0


def dense_norm(delta: Mapping[str, torch.Tensor]) -> float:
    """``‖Δ‖₂`` over all tensors (fp64); ``inf``/``nan`` when any value is not finite."""
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in delta.values()))


class Guard:
    """The checks of the module docstring, with the state they keep across rounds.

    Args:
        names: worker names, cluster order (for messages).
        regions: each worker's region, cluster order.
        max_norm_ratio: bound factor of check 3 (``> 1``).
        token_tolerance: relative tolerance of check 2.
        robust: ``none``, ``sign_majority`` or ``trimmed_mean``.
    """

    def __init__(self, names: Sequence[str], regions: Sequence[str], *,
                 max_norm_ratio: float = 10.0, token_tolerance: float = 0.05,
                 robust: str = "none", max_peak_ratio: float | None = None) -> None:
        if robust not in ROBUST:
            raise ValueError(f"robust aggregation {robust!r}: use one of {list(ROBUST)}")
        self.names, self.regions = list(names), list(regions)
        self.max_norm_ratio = max_norm_ratio
        self.max_peak_ratio = MAX_PEAK_RATIO if max_peak_ratio is None else max_peak_ratio
        self.token_tolerance = token_tolerance
        self.robust = robust
        self.expected: dict[int, int] = {}
        self.scales: dict[int, float] = {}
        self.history: dict[int, float] = {}
        self.rejected: Counter[str] = Counter()
        self.last_rejected: dict[int, str] = {}
        """Worker -> reason, for the last screened round."""

    @classmethod
    def from_config(cls, g, cluster) -> Guard:
        """From a ``GeoMeshConfig`` and a ``ClusterSpec``."""
        return cls([w.name for w in cluster.workers], [w.region for w in cluster.workers],
                   max_norm_ratio=g.max_norm_ratio, token_tolerance=g.token_tolerance,
                   robust=g.robust_aggregation)

    def expect(self, tokens: Mapping[int, int], scales: Mapping[int, float] | None = None) -> None:
        """The plan's tokens per worker for the round about to be screened, and each
        worker's expected pseudo-gradient scale (:meth:`geomesh.worker.LrScale.round`;
        ``None``: norms are compared as they are).  Starts a round."""
        self.expected = dict(tokens)
        self.scales = dict(scales or {})
        self.last_rejected = {}

    def _divisors(self, workers: Sequence[int]) -> list[float]:
        """Each worker's norm divisor: its expected scale, the round's smallest
        positive scale where its own is 0 (or unknown), 1 without scales."""
        known = [self.scales[k] for k in workers if self.scales.get(k, 0.0) > 0]
        floor = min(known) if known else 1.0
        return [self.scales[k] if self.scales.get(k, 0.0) > 0 else floor for k in workers]

    def _name(self, k: int) -> str:
        if 0 <= k < len(self.names):
            return f"worker {self.names[k]} (region {self.regions[k]!r})"
        return f"worker #{k}"

    def screen(self, workers: Sequence[int], tokens: Sequence[int], norms: Sequence[float],
               peaks: Sequence[tuple[float, str]] | None = None) -> list[int]:
        """Positions (into the given lists) of the messages that pass; see the module docstring.

        Args:
            workers: the authenticated sender of each message (its slot), never
                an id read from the message.
            tokens: each message's ``n_i``.
            norms: each message's decoded norm (:func:`dense_norm`, or the whole
                canonical tensors' over a worker's shards).
            peaks: each message's ``(peak-to-RMS ratio, tensor)`` (:func:`dense_peaks`);
                ``None``: check 4 is skipped.
        """
        ok: list[int] = []
        peaks = list(peaks) if peaks is not None else [(0.0, "")] * len(workers)
        for j, (k, n, nrm) in enumerate(zip(workers, tokens, norms)):
            exp = self.expected.get(k)
            if not math.isfinite(nrm):
                self.drop(k, "non_finite", "its pseudo-gradient has NaN/Inf values")
            elif self.expected and exp is None:
                self.drop(k, "tokens", "the plan gives it no tokens this round (not a worker "
                                       "of the round)")
            elif peaks[j][0] > self.max_peak_ratio:
                self.drop(k, "element", f"one element of tensor '{peaks[j][1]}' is "
                                        f"{peaks[j][0]:.4g} x the tensor's RMS (at most "
                                        f"{self.max_peak_ratio:g})")
            elif exp is not None and abs(n - exp) > self.token_tolerance * max(exp, 1):
                self.drop(k, "tokens", f"it claims {n} tokens, the plan gave it {exp} "
                                        f"(tolerance {self.token_tolerance:g})")
            elif n <= 0:
                self.drop(k, "tokens", f"it claims {n} tokens")
            else:
                ok.append(j)
        passed = []
        raw, norms = norms, [n / d for n, d in zip(norms, self._divisors(workers))]
        for j in ok:
            k, nrm = workers[j], norms[j]
            others = sorted(norms[i] for i in ok if i != j and norms[i] > 0)
            refs = []
            if others:
                m = len(others)
                refs.append(others[m // 2] if m % 2 else 0.5 * (others[m // 2 - 1] + others[m // 2]))
            if k in self.history:
                refs.append(self.history[k])
            # a zero reference says nothing about scale (a worker whose only inner
            # step ran at warmup's lr 0 sends Δ = 0): it bounds nobody
            refs = [r for r in refs if r > 0]
            bound = self.max_norm_ratio * max(refs) if refs else math.inf
            if nrm > bound:
                self.drop(k, "norm", f"its pseudo-gradient norm {raw[j]:.4g} ({nrm:.4g} per "
                                      f"unit of its inner learning-rate scale) exceeds "
                                      f"{self.max_norm_ratio:g} x {max(refs):.4g} (the other "
                                      "workers' median or its own history)")
            else:
                passed.append(j)
        for j in passed:
            k = workers[j]
            h = self.history.get(k)
            self.history[k] = norms[j] if h is None else 0.5 * h + 0.5 * norms[j]
        return passed

    def screen_figures(self, workers: Sequence[int], losses: Sequence[float],
                       compute_s: Sequence[float]) -> list[int]:
        """The workers (of ``workers``, order kept) whose reported figures are credible.

        A worker's mean training loss of the round and its compute seconds ride
        along with its message and steer the logged loss, the idle statistics
        and re-planning (module docstring, check 5).  A loss must be finite and
        ``>= 0``, compute seconds finite and ``> 0``, and each within a factor of
        at least half of the *other* workers' valid figures (a majority that
        one liar cannot move, unlike a mean or a median of two; with two
        workers a lie removes both figures, nobody can tell which is true):
        ``max_norm_ratio`` for the loss (honest workers start the round from
        the same ``θ_global`` on the same data distribution),
        ``max_norm_ratio²`` for compute seconds (the plan balances them, but a
        throttled GPU may legitimately be several times slower until the next
        re-plan).  The verdict depends on the shared
        figures alone, so every job leaves out the same workers and re-plans
        alike; a left-out worker keeps its pseudo-gradient (its values passed
        their own checks), its figures are counted under ``figures``.

        Args:
            workers: the authenticated senders (slots) of the figures.
            losses: mean training loss of each worker's round (nats per token).
            compute_s: each worker's compute seconds of the round.
        """
        r_loss, r_time = self.max_norm_ratio, self.max_norm_ratio ** 2
        valid = [math.isfinite(x) and x >= 0 and math.isfinite(t) and t > 0
                 for x, t in zip(losses, compute_s)]
        keep = []
        for j, k in enumerate(workers):
            why = None if valid[j] else (f"it reports loss {losses[j]!r} and {compute_s[j]!r} "
                                         "compute seconds (a loss must be finite and >= 0, "
                                         "seconds finite and > 0)")
            for name, vals, ratio in (("loss", losses, r_loss), ("compute seconds", compute_s,
                                                                   r_time)):
                others = [vals[i] for i in range(len(workers)) if i != j and valid[i]]
                if why is not None or not others:
                    continue
                agree = sum(o / ratio <= vals[j] <= o * ratio for o in others)
                if 2 * agree < len(others):
                    why = (f"its {name} {vals[j]:.6g} is more than {ratio:g}x away from most "
                           f"other workers' ({', '.join(f'{o:.6g}' for o in others)})")
            if why is None:
                keep.append(k)
            else:
                self.rejected["figures"] += 1
                log.warning("GeoMesh: left out the figures of %s: %s; its loss and compute "
                            "time are not logged or used for re-planning this round",
                            self._name(k), why)
        return keep

    def drop(self, k: int, reason: str, why: str) -> None:
        """Reject worker ``k``'s message this round (counted, named in a warning)."""
        self.rejected[reason] += 1
        self.last_rejected[k] = reason
        log.warning("GeoMesh: rejected the message of %s: %s; dropped from this round",
                    self._name(k), why)

    # -- robust aggregation ------------------------------------------------------
    def robust_dense(self, deltas: Sequence[Mapping[str, torch.Tensor]],
                     weights: Sequence[float], *, signs: bool = False) -> dict[str, torch.Tensor]:
        """Element-wise trimmed mean (either robust mode) of fp32 pseudo-gradients.

        ``signs``: the values are decoded sign messages (``±m`` per element); then
        ``sign_majority`` votes on them, element by element:
        ``sign(Σ w_i sign(x_i)) · Σ w_i |x_i|`` with token weights ``w_i``.
        """
        if signs and self.robust == "sign_majority":
            total = float(sum(weights))
            w = [float(x) / total for x in weights]
            return {k: torch.sign(sum(wi * torch.sign(d[k].float()) for wi, d in zip(w, deltas)))
                    * sum(wi * d[k].float().abs() for wi, d in zip(w, deltas)) for k in deltas[0]}
        return {k: trimmed_mean(torch.stack([d[k].float() for d in deltas]))
                for k in deltas[0]}

    def state_dict(self) -> dict:
        return {"history": dict(self.history), "rejected": dict(self.rejected),
                "per_lr_scale": True}

    def load_state_dict(self, state: Mapping) -> None:
        # a history of raw norms (saved before norms were divided by the lr scale)
        # is on another scale: start it again
        history = state.get("history", {}) if state.get("per_lr_scale") else {}
        self.history = {int(k): float(v) for k, v in history.items()}
        self.rejected = Counter({str(k): int(v) for k, v in state.get("rejected", {}).items()})


def trimmed_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over dim 0 without the ``max(1, ⌊K/4⌋)`` largest and smallest (``K ≥ 3``)."""
    K = x.shape[0]
    if K < 3:
        return x.mean(dim=0)
    b = max(1, K // 4)
    s, _ = torch.sort(x, dim=0)
    return s[b:K - b].mean(dim=0)
