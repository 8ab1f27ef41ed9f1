"""The noise scale with the curvature measured: the one that makes Pollux's efficiency exact.

On a locally quadratic loss (Hessian ``H``, per-sample gradient covariance ``Sigma``,
true gradient ``G``) a step ``-eps P g_B`` with a fixed preconditioner ``P`` (Adam's
``1/(sqrt(v_hat) + eps)``; ``P = I`` for SGD) lowers the loss by at most
``dL_max / (1 + B_noise / B)`` at the best ``eps``, with (McCandlish et al. 2018,
"An Empirical Model of Large-Batch Training", eq. 2.7-2.8, for the preconditioned step)::

    B_noise = tr(P H P Sigma) / (G' P H P G)

so ``phi = B_noise`` makes Pollux's ``E(M) = (phi + M0) / (phi + M)`` exact
(:mod:`cona.surrogate`).  The three definitions the controller can read
(:data:`cona.probe.DEFINITIONS`) each stand in for it under an assumption about ``H``;
this module measures it, curvature included, as a check of those assumptions (a
measurement, ``bench/cona_efficiency.py --curvature``; no controller option: each
estimate costs ``2 x directions + 3`` forward passes over the held-out micro-batches
beside the gradients' backward passes).

Estimator.  With ``Q(v) = v' H v``, ``E[Q(P g_B)] = G' P H P G + tr(P H P Sigma) / B``
for the mean gradient ``g_B`` of ``B`` samples, so the quadratic form at two batch sizes
gives both terms (:func:`cona.grad_stats.two_batch_estimate`): each of ``directions``
micro-batch gradients (``B_small``, the micro-batch's sequences) and the mean over all
probe micro-batches (``B_big``).  ``Q`` along ``v`` is the central second difference of
the loss, ``(L(theta + h v) - 2 L(theta) + L(theta - h v)) / h^2`` with
``|h v| = delta |theta|``, on curvature micro-batches held apart from the gradients'
(so ``E[v' H_C v | v] = v' H v``), in float64 on a copy of the model (in eval mode: no
dropout), its cross entropy included (:func:`float64_probe`), so that rounding stays far
below the second difference.  ``H`` may be
indefinite: a non-positive signal or noise term gives no noise scale.

``tests/test_cona_curvature.py`` recovers ``tr(H Sigma) / (G' H G)`` of a least-squares
problem whose ``H`` and ``Sigma`` are known, and checks the second difference against
autograd's Hessian-vector product.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch

from .grad_stats import two_batch_estimate

# |h v| / |theta| of the second difference: small enough that the loss's higher orders
# do not show (docs/results/cona_efficiency_curvature.json's curvature_delta_check: the
# same at a tenth of it), large enough that float64 rounding does not
DELTA = 1e-4
DIRECTIONS = 16  # micro-batch gradients whose quadratic form is averaged (B_small's term)


class CurvatureProbe:
    """``v' H v`` along directions ``v`` from a loss's central second difference.

    Args:
        params: the parameters that the directions perturb, by name (float64 tensors the
            loss reads; changed in place during :meth:`quadratic_form`, restored after).
        loss: the loss (nats, a float) at the parameters' current values, on a fixed
            batch (deterministic: no dropout).
        delta: ``|h v| / |theta|`` of the second difference (``theta``: ``params``).

    Raises:
        ValueError: no parameters, or ``delta`` not positive.
    """

    def __init__(self, params: dict[str, torch.Tensor], loss: Callable[[], float],
                 delta: float = DELTA):
        if not params or not delta > 0:
            raise ValueError(f"need parameters and delta > 0, got {len(params)}, {delta}")
        self.params, self.loss, self.delta = params, loss, delta
        self.theta = {n: p.detach().clone() for n, p in params.items()}
        self.theta_norm = math.sqrt(sum(float(t.pow(2).sum()) for t in self.theta.values()))
        self.loss0 = loss()

    @torch.no_grad()
    def _shift(self, v: dict[str, torch.Tensor], h: float) -> None:
        for n, p in self.params.items():
            p.copy_(self.theta[n])
            if h and n in v:
                p.add_(v[n].to(p.dtype), alpha=h)

    def quadratic_form(self, v: dict[str, torch.Tensor]) -> float:
        """``v' H v`` (H: the Hessian of the loss in ``params``); ``v`` by parameter name
        (absent names: zero).  Two loss evaluations.

        Raises:
            ValueError: ``v`` is zero or not finite.
        """
        norm = math.sqrt(sum(float(x.double().pow(2).sum()) for x in v.values()))
        if not 0 < norm < math.inf:
            raise ValueError(f"direction norm must be positive and finite, got {norm}")
        h = self.delta * self.theta_norm / norm
        try:
            self._shift(v, h)
            up = self.loss()
            self._shift(v, -h)
            down = self.loss()
        finally:
            self._shift(v, 0.0)
        return (up + down - 2.0 * self.loss0) / (h * h)


def curvature_stats(gradients: Iterable[Sequence[torch.Tensor]], names: Sequence[str],
                    microbatch_size: int, probe: CurvatureProbe,
                    directions: int = DIRECTIONS) -> tuple[float, float]:
    """Unbiased ``(G' P H P G, tr(P H P Sigma))`` from micro-batch gradients (module
    docstring).

    Args:
        gradients: per micro-batch, its (already preconditioned) mean gradient, one tensor
            per name of ``names`` (the first one's are summed into in place); at least two
            micro-batches.
        names: the parameter names of each gradient's tensors (``probe.params``' keys).
        microbatch_size: samples per micro-batch (``B_small``).
        probe: the curvature's second differences.
        directions: the first this many micro-batches' gradients give ``B_small``'s
            term; all of them, averaged, ``B_big``'s.

    Raises:
        ValueError: fewer than two micro-batches, or ``directions`` < 1.
    """
    if directions < 1:
        raise ValueError(f"directions must be >= 1, got {directions}")
    total, small, n = None, [], 0
    for grads in gradients:
        if len(small) < directions:
            small.append(probe.quadratic_form(dict(zip(names, grads))))
        total = grads if total is None else [a.add_(g) for a, g in zip(total, grads)]
        n += 1
    if n < 2:
        raise ValueError("need at least two micro-batches")
    big = probe.quadratic_form({name: t / n for name, t in zip(names, total)})
    return two_batch_estimate(sum(small) / len(small), microbatch_size, big,
                              n * microbatch_size)


def float64_probe(trainer, microbatches: list, delta: float = DELTA) -> CurvatureProbe:
    """A :class:`CurvatureProbe` on a float64 copy of ``trainer.module``.

    The copy is built for the trainer's config (megatron-core's layers as the trainer's;
    Transformer Engine's do not run in float64), loaded with
    :meth:`jobruntime.trainer.Trainer.get_params` (the fp32 main parameters under bf16)
    and put in eval mode.  Its loss is the token mean over ``microbatches`` of the cross
    entropy of its logits, taken in float64 here: megatron's own per-token loss
    (``vocab_parallel_cross_entropy``) casts the logits to float32, whose rounding
    (~1e-7 of the loss) would swamp second differences at small steps.  The default
    generators (CPU and the current CUDA device) are left as they were (building draws an
    initialisation).

    Args:
        trainer: a one-process trainer (``dp = tp = pp = 1``: the emulated proxy).
        microbatches: the held-out micro-batches, dicts of ``[micro_batch, seq]``
            tensors as :class:`jobruntime.data.GlobalBatchSampler` yields them (with
            ``labels`` and ``loss_mask``).
        delta: the second difference's step (:class:`CurvatureProbe`).

    Raises:
        ValueError: no micro-batches, or none with a loss token.
    """
    from jobruntime.model import build_model
    from jobruntime.parallel import rng_state, set_rng_state

    if not microbatches:
        raise ValueError("the curvature needs at least one held-out micro-batch")
    rng = rng_state()
    try:
        copy = build_model(trainer.cfg.model, trainer.cfg.parallel).double()
    finally:
        set_rng_state(rng)
    copy.eval()
    params = dict(copy.named_parameters())
    with torch.no_grad():
        for name, value in trainer.get_params().items():
            params[name].copy_(value)
    batches = []
    for mb in microbatches:
        pad = mb.get("padding_mask")
        batches.append({**{k: v.to(trainer.device) for k, v in mb.items()},
                        "unpadded": pad is not None and bool(pad.all())})
    if not sum(float(b["loss_mask"].sum()) for b in batches) > 0:
        raise ValueError("the held-out micro-batches have no loss token")

    @torch.no_grad()
    def loss() -> float:
        total = tokens = 0.0
        for batch in batches:
            # the trainer's forward without labels: logits [b, s, vocab] (padding ids -inf)
            logits = trainer._forward({**batch, "labels": None}, copy).double()
            labels, mask = batch["labels"], batch["loss_mask"].double()
            per_token = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.clamp(min=0).flatten(), reduction="none")
            total += float((per_token.view(labels.shape) * mask).sum())
            tokens += float(mask.sum())
        return total / tokens

    return CurvatureProbe(params, loss, delta)


def measure_curvature_stats(trainer, microbatches: list, curvature_microbatches: list,
                            weights: list[torch.Tensor] | None = None,
                            directions: int = DIRECTIONS,
                            delta: float = DELTA) -> tuple[float, float]:
    """``(G' P H P G, tr(P H P Sigma))`` at the trainer's current weights (module
    docstring): gradients of ``microbatches`` (:func:`cona.direct_gns.microbatch_gradients`,
    times ``weights``: ``P``, e.g. :func:`cona.probe.adam_preconditioner`; ``None``:
    ``P = I``), curvature on ``curvature_microbatches`` (others than those).  Their ratio
    is ``B_noise``; the gradient buffers are left zeroed, the weights as they were.

    Raises:
        ValueError: as :func:`curvature_stats`, :func:`float64_probe` and
            :func:`cona.direct_gns.microbatch_gradients`.
    """
    from .direct_gns import microbatch_gradients
    from .probe import _is_counted

    if len(microbatches) < 2:  # before the copy is built (the gradients come lazily)
        raise ValueError("need at least two micro-batches")
    names = [n for n, p in trainer.module.named_parameters() if _is_counted(p)]
    probe = float64_probe(trainer, curvature_microbatches, delta)
    b = int(next(iter(microbatches[0].values())).shape[0])
    return curvature_stats(microbatch_gradients(trainer, microbatches, weights), names, b,
                           probe, directions)
