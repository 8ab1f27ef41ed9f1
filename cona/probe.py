"""Feed the gradient noise scale from the training step, without an extra backward.

Two small/big gradient pairs come for free (McCandlish et al. 2018, App. A.1;
estimator in :mod:`cona.grad_stats`):

- **DP > 1** (``"replica"``): the loss is a sum over tokens (megatron's
  per-token loss, :mod:`jobruntime.trainer`), DDP sums and megatron's
  ``finalize_model_grads`` divides by the global batch's loss-token count
  ``N``.  Just before it, each replica's buffer holds the summed gradient of its
  ``n_r`` loss tokens (``B/dp`` samples), so ``G_small`` is the buffer over
  ``n_r`` (the schedule's token count, the wrapped function's argument);
  just after it, the buffer is the mean over the global batch (``G_big``).
  The probe wraps ``config.finalize_model_grads_func`` to read both.
- **DP = 1, PP = 1, >= 2 micro-batches** (``"microbatch"``):
  :attr:`Trainer.microbatch_hook` runs before the forward of micro-batch
  ``i``, i.e. after the backward of micro-batch ``i - 1``, and is told the
  micro-batch's loss-token count ``n_i``; the buffer then holds the summed
  gradient of the earlier micro-batches' tokens, so micro-batch ``i - 1``'s
  mean gradient is the buffer's change since the previous hook over
  ``n_{i-1}`` (the last one's: since the last hook, read before the gradients
  are finalised).  ``|G_small|^2`` is the mean over all ``m`` micro-batches
  (measured: with only micro-batch 0, a batch of 8 gave estimates 0.7-6.5x the
  true noise scale on least squares; with both, 0.8-1.3x), ``B_small`` the
  micro-batch size.  (With PP > 1 the 1F1B schedule runs several forwards
  before the first backward, so these points do not exist; no estimate then.)
- **DP = 1, PP = 1, one micro-batch per step** (``"split"``): every
  ``cona.gns_split_every``-th step runs its micro-batch as equal parts (its smallest
  divisor >= 2 of them, single sequences for a prime size; the same samples, and the same
  gradient up to summation order: the loss is a sum over tokens; with dropout, other
  masks), and reads them as in ``"microbatch"`` mode, ``B_small`` the part's size; the
  other steps run as they are and add nothing.  A split step costs more than a plain one
  (smaller micro-batches, and the copies of the gradient every mode that reads
  micro-batches makes), and its time enters the measured step time like any other.
  The difference of consecutive steps' gradients (AdaptDL's estimate for one gradient
  per step) would need no split, but it also holds the gradient's change over a step,
  which reads as noise: on tiny_gpt it read several times the within-step estimate
  while the learning rate was high (``bench/cona_consecutive.py``,
  ``docs/results/cona_consecutive.json``).

Squared norms follow megatron's gradient-norm rules: TP-duplicated parameters
count once, the last stage's tied copy of the word embedding (``shared``) is
skipped, and shards are summed over the model-parallel group.  Before the DP
all-reduce with ``pp > 1`` and tied embeddings, the first stage's embedding
gradient lacks the output-layer part (megatron adds it inside
``finalize_model_grads``), so the probe sums a copy over the embedding group.
The replica norms are averaged over DP.  All results are identical on every
rank.  Cost: two passes over the gradients and a few scalar all-reduces per step.
Not handled: with sequence parallelism megatron sums the layer norms' gradients over
TP inside ``finalize_model_grads`` too, so the small-batch norms (read before it) hold
one rank's share of those few parameters (not run: it needs Transformer Engine or apex).

Definitions (``cona.gns_definition``; :data:`DEFINITIONS`): every gradient is
multiplied by a power ``a`` of Adam's preconditioner ``P = 1/(sqrt(v_hat) + eps)``
(:func:`adam_preconditioner`, the state before this step's update) before its norm,
so the estimate is ``tr(P^a Sigma P^a) / |P^a G|^2``: ``simple`` (``a = 0``,
``B_simple``), ``newton`` (``a = 1/2``: ``tr(P Sigma) / (G' P G)``) and ``pollux``
(``a = 1``, Qiao et al., OSDI'21, Sec. 3.1).  Which one makes Pollux's efficiency
exact depends on the curvature (:mod:`cona.surrogate`).  No estimate on the first step
of a preconditioned definition (no optimizer state yet).  Cost: one more pass over
the optimizer state per step.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from jobruntime.trainer import Trainer

from .grad_stats import GradientNoiseScale

log = logging.getLogger("cona")

# noise-scale definition -> the power of Adam's preconditioner P applied to each gradient
# before its norm (module docstring; cona/surrogate.py: which curvature makes each exact)
DEFINITIONS = {"simple": 0.0, "newton": 0.5, "pollux": 1.0}


def preconditioner_power(definition: str) -> float:
    """The power of Adam's preconditioner of a noise-scale ``definition``.

    Raises:
        ValueError: unknown definition (the message lists the known ones).
    """
    if definition not in DEFINITIONS:
        raise ValueError(f"noise-scale definition {definition!r} is not one of "
                         f"{sorted(DEFINITIONS)}")
    return DEFINITIONS[definition]


def _parts(micro_batch_size: int) -> int:
    """Equal parts a micro-batch splits into for ``"split"`` mode: its smallest divisor
    ``>= 2`` (0 for one sequence: it does not split)."""
    return next((k for k in range(2, micro_batch_size + 1) if micro_batch_size % k == 0), 0)


def _is_counted(param: torch.nn.Parameter) -> bool:
    if getattr(param, "shared", False):
        return False
    return tensor_parallel.param_is_not_tensor_parallel_duplicate(param)


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm accumulated in fp64 (without an fp64 copy of ``t``)."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float64) ** 2


def _all_reduce(t: torch.Tensor, group) -> None:
    if dist.get_world_size(group) > 1:  # a one-rank gloo collective still costs ~ms
        dist.all_reduce(t, group=group)


def _grad(param) -> torch.Tensor | None:
    return getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def no_estimate_reason(dp: int, pp: int, num_microbatches: int) -> str | None:
    """Why no noise-scale estimate is possible at a layout, with the fix; ``None`` if one is.

    An estimate needs two gradients of different batch sizes from the step itself
    (module docstring): DP replicas (``dp > 1``), or ``>= 2`` micro-batches read between
    backward passes, which 1F1B does not allow with ``pp > 1``.
    """
    if dp > 1 or (num_microbatches >= 2 and pp == 1):
        return None
    why = (f"dp=1 with pp={pp} (1F1B runs forwards ahead of backwards)" if pp > 1
           else "dp=1 with 1 micro-batch per step")
    return (f"{why}; for one, run >= 2 data-parallel processes"
            + ("" if pp > 1 else " or set parallel.global_batch_size >= 2 x "
               "parallel.micro_batch_size"))


class GNSProbe:
    """Updates a :class:`GradientNoiseScale` after every training step of a trainer.

    Args:
        estimator: the estimator the controller reads.
        definition: ``simple``, ``newton`` or ``pollux`` (:data:`DEFINITIONS`): the norms
            of the gradients or of Adam-preconditioned ones (module docstring).
        split_every: in ``"split"`` mode, split every this many steps' micro-batch
            (``cona.gns_split_every``); 0: never, and no estimate there.

    Attributes:
        mode: ``"replica"``, ``"microbatch"``, ``"split"`` or ``None`` (no estimate
            possible).
        no_estimate: why no estimate is possible at the attached layout, with the fix
            (:func:`no_estimate_reason`); ``None`` if one is.
        last: the last step's ``(small_sq, small_batch, big_sq, big_batch)``.
    """

    def __init__(self, estimator: GradientNoiseScale, definition: str = "simple",
                 split_every: int = 4):
        if split_every < 0:
            raise ValueError(f"split_every must be >= 0, got {split_every}")
        self.estimator, self.power = estimator, preconditioner_power(definition)
        self.split_every = split_every
        self._steps = 0  # steps prepared since attach ("split" mode)
        self._parts = 0  # parts this step's micro-batch runs as; 0: not split
        self.preconditioned = self.power > 0
        self._weight: dict[int, torch.Tensor] | None = None  # id(param) -> P this step
        self.trainer: Trainer | None = None
        self.mode: str | None = None
        self.no_estimate: str | None = None
        self.last: tuple | None = None
        self._orig = None
        self._prev: list | None = None
        self._small: list[torch.Tensor | None] = []  # 0-d fp64 on the compute device; None: no loss tokens
        self._tokens: list[int] = []  # loss tokens of the micro-batches begun this step

    # -- wiring -------------------------------------------------------------
    def attach(self, trainer: Trainer) -> None:
        """Hook into ``trainer`` (its current layout and batch); detaches from any other."""
        self.detach()
        p = trainer.cfg.parallel
        dp = dist.get_world_size(trainer.grad_dp_group)
        m = p.global_batch_size // (p.micro_batch_size * dp)
        self.no_estimate = no_estimate_reason(dp, p.pp, m)
        if dp > 1:
            self.mode = "replica"
        elif self.no_estimate is None:
            self.mode = "microbatch"
        elif p.pp == 1 and m == 1 and self.split_every and _parts(p.micro_batch_size):
            self.mode, self.no_estimate = "split", None
            log.info("GNS probe: one micro-batch of %d per step at DP = 1; every %d-th step "
                     "runs it as %d parts to measure the noise scale", p.micro_batch_size,
                     self.split_every, _parts(p.micro_batch_size))
        else:
            self.mode = None
            if p.pp == 1 and m == 1:  # dp = 1: a split step would have measured it
                self.no_estimate += (" (a micro-batch of one sequence cannot be split)"
                                     if self.split_every else
                                     " (or set cona.gns_split_every > 0 to split a step)")
            log.warning("GNS probe: no noise-scale estimate at this layout: %s; CONA then "
                        "ranks only strategies of the current global batch, by throughput",
                        self.no_estimate)
        self.trainer, self._dp = trainer, dp
        self._orig = trainer.tcfg.finalize_model_grads_func
        trainer.tcfg.finalize_model_grads_func = self._finalize
        if self.mode in ("microbatch", "split"):
            trainer.microbatch_hook = self._on_microbatch
        self._steps, self._parts = 0, 0

    def prepare(self, microbatches: list[dict]) -> list[dict]:
        """The micro-batches to run this step: in ``"split"`` mode, on every
        ``split_every``-th step since :meth:`attach`, each split along its batch dimension
        into equal parts (module docstring); otherwise ``microbatches`` as they are.  Call
        once per training step, before :meth:`jobruntime.trainer.Trainer.train_step`."""
        if self.mode != "split":
            return microbatches
        self._steps += 1
        self._parts = 0
        if (self._steps - 1) % self.split_every:
            return microbatches
        self._parts = _parts(self.trainer.cfg.parallel.micro_batch_size)
        return [dict(zip(mb, vals)) for mb in microbatches
                for vals in zip(*(t.chunk(self._parts) for t in mb.values()))]

    def detach(self) -> None:
        if self.trainer is not None:
            self.trainer.tcfg.finalize_model_grads_func = self._orig
            if self.trainer.microbatch_hook == self._on_microbatch:
                self.trainer.microbatch_hook = None
        self.trainer, self._orig, self._prev, self._small, self._tokens = None, None, None, [], []
        self._weight, self.mode, self._parts = None, None, 0

    # -- norms --------------------------------------------------------------
    def _sq_norm(self, fix_tied: bool) -> float:
        """Squared norm of this replica's gradient, summed over the model-parallel group."""
        module = self.trainer.module
        total = torch.zeros(1, dtype=torch.float64, device=self.trainer.device)
        tied = None
        if (
            fix_tied
            and parallel_state.get_pipeline_model_parallel_world_size() > 1
            and getattr(module, "share_embeddings_and_output_weights", False)
            and module._is_in_embd_group()
        ):
            w = module.shared_embedding_or_output_weight()
            g = _grad(w).detach().clone()
            dist.all_reduce(g, group=module.embd_group)  # input + output parts
            tied = w
            if _is_counted(w):
                total += _sq(self._weighted(w, g))
        for param in module.parameters():
            g = _grad(param)
            if g is None or param is tied or not _is_counted(param):
                continue
            total += _sq(self._weighted(param, g))
        _all_reduce(total, parallel_state.get_model_parallel_group())
        return float(total[0])

    def _weighted(self, param, g: torch.Tensor) -> torch.Tensor:
        """``P^a g`` when preconditioned (fp64, like the norms), else ``g``."""
        return g if self._weight is None else g.detach().double() * self._weight[id(param)]

    def _ready(self) -> bool:
        """``False`` while preconditioned without a preconditioner: no estimate this step."""
        return not self.preconditioned or self._weight is not None

    def _load_weights(self) -> bool:
        """Fetch this step's preconditioner (when preconditioned); :meth:`_ready` after."""
        if self.preconditioned:
            weights = adam_preconditioner(self.trainer, self.power)
            counted = [p for p in self.trainer.module.parameters() if _is_counted(p)]
            self._weight = None if weights is None else {
                id(p): w for p, w in zip(counted, weights, strict=True)}
        return self._ready()

    def _grads(self) -> list[torch.Tensor]:
        """Copies of this rank's counted gradients (``dp = pp = 1``: its TP shard of the
        model), preconditioned when asked."""
        return [self._weighted(p, g).detach().clone() for p in self.trainer.module.parameters()
                if _is_counted(p) and (g := _grad(p)) is not None]

    def _microbatch_sq(self) -> None:
        """Add the squared norm of the micro-batch just finished: the buffer's change
        (its summed gradient) over its loss tokens; none for a micro-batch without any."""
        now = self._grads()
        prev = self._prev or [torch.zeros_like(g) for g in now]
        n = self._tokens[len(self._small)] if len(self._small) < len(self._tokens) else 0
        if n > 0:
            sq = torch.zeros((), dtype=torch.float64, device=self.trainer.device)
            for a, b in zip(now, prev):  # summed on the device: no host sync per parameter
                sq += _sq(a - b)
            self._small.append(sq / n**2)
        else:
            self._small.append(None)
        self._prev = now

    def _on_microbatch(self, index: int, num_tokens: int) -> None:
        if self.mode == "split" and not self._parts:
            return  # a step run as it is: nothing to read
        if index == 0:
            self._prev, self._small, self._tokens = None, [], []
            self._load_weights()
        elif self._ready():
            self._microbatch_sq()
        self._tokens.append(num_tokens)

    def _replica_tokens(self, num_tokens: torch.Tensor | None) -> float:
        """This replica's loss-token count: the schedule's (last stage only) on every stage."""
        n = torch.zeros(1, dtype=torch.float64, device=self.trainer.device)
        if num_tokens is not None and parallel_state.is_pipeline_last_stage():
            n[0] = float(num_tokens)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(n, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        return float(n[0])

    def _finalize(self, model, num_tokens=None, *args, **kwargs):
        small = None
        p = self.trainer.cfg.parallel
        if self.mode == "replica" and self._load_weights():
            n = self._replica_tokens(num_tokens)
            local = torch.tensor([self._sq_norm(fix_tied=True) / max(n, 1.0) ** 2],
                                 dtype=torch.float64, device=self.trainer.device)
            _all_reduce(local, self.trainer.grad_dp_group)
            small, small_batch = float(local[0]) / self._dp, p.global_batch_size // self._dp
        elif (self.mode == "microbatch" or self.mode == "split" and self._parts) \
                and self._tokens and self._ready():
            self._microbatch_sq()  # the last micro-batch
            finite = [x for x in self._small if x is not None]  # micro-batches with loss tokens
            if finite:  # every TP rank reads the same micro-batches: the same Nones
                shards = torch.stack(finite)  # this rank's shard of each micro-batch's norm
                _all_reduce(shards, parallel_state.get_model_parallel_group())
                small, small_batch = float(shards.mean()), p.micro_batch_size
                if self.mode == "split":
                    small_batch //= self._parts
            self._small, self._prev, self._tokens = [], None, []
        self._parts = 0  # read: the next step is split only if prepare() says so
        out = self._orig(model, num_tokens, *args, **kwargs)
        if small is not None:
            big = self._sq_norm(fix_tied=False)
            self.last = (small, small_batch, big, p.global_batch_size)
            try:
                self.estimator.update(small, small_batch, big, p.global_batch_size)
            except ValueError as e:  # a non-finite norm (diverged step): skip it
                log.warning("GNS update skipped: %s", e)
        return out


def adam_preconditioner(trainer: Trainer, power: float = 1.0) -> list[torch.Tensor] | None:
    """Adam's preconditioner ``P = 1/(sqrt(v_hat) + eps)`` to the ``power`` (1: ``P``;
    1/2: its square root, the ``newton`` definition), one tensor per counted parameter
    of ``trainer.module`` (the order of :func:`measure_noise_scale`).

    ``v_hat = exp_avg_sq / (1 - beta2^step)`` is Adam's bias-corrected second moment
    (the optimizer state of :func:`cona.state.optimizer_state_by_name`: with bf16 that
    of the fp32 main copy; ``step`` from the state, or the group as apex keeps it).
    Pollux (Qiao et al., OSDI'21, Sec. 3.1) measures the noise scale of ``P g`` for
    adaptive optimizers.  ``None`` before the first optimizer step (no state yet).
    """
    from .state import optimizer_state_by_name

    states = optimizer_state_by_name(trainer)
    weights = []
    for name, p in trainer.module.named_parameters():
        if not _is_counted(p):
            continue
        ps = states[name]
        if "exp_avg_sq" not in ps.state:
            return None
        group, step = ps.group, ps.step
        if step < 1:
            return None
        beta2, eps = group["betas"][1], group["eps"]
        correction = 1 - beta2**step if group.get("bias_correction", True) else 1.0
        v_hat = ps.state["exp_avg_sq"].double() / correction
        weights.append((v_hat.sqrt() + eps) ** -power)
    return weights


def microbatch_gradients(trainer: Trainer, microbatches: list,
                         weights: list[torch.Tensor] | None = None):
    """Each micro-batch's own mean gradient at the trainer's current weights, one at a
    time: yields, per micro-batch, a list of new fp64 tensors (one per counted parameter
    of ``trainer.module``, in its order), each times ``weights``' tensor where given (e.g.
    :func:`adam_preconditioner`).  No optimizer step; the gradient buffers are left
    zeroed once the generator is exhausted.  One process with ``dp = pp = 1`` (the
    emulated proxy).

    Raises:
        ValueError: not one process, or ``weights`` not one per counted parameter.
    """
    if dist.get_world_size() != 1:
        raise ValueError("direct gradient probes run in one process (the emulated proxy)")
    params = [p for p in trainer.module.parameters() if _is_counted(p)]
    if weights is None:
        weights = [None] * len(params)
    elif len(weights) != len(params):
        raise ValueError(f"{len(weights)} weights for {len(params)} counted parameters")
    for mb in microbatches:
        trainer.zero_grad()  # not only the buffers: see Trainer.zero_grad
        trainer._run_schedule([mb], forward_only=False)
        grads = []
        for p, w in zip(params, weights):
            g = _grad(p).detach().to(torch.float64, copy=True)  # not a view of the buffer
            grads.append(g * w if w is not None else g)
        yield grads
    trainer.zero_grad()


def measure_gradient_stats(trainer: Trainer, microbatches: list,
                           weights: list[torch.Tensor] | None = None) -> tuple[float, float]:
    """Unbiased estimates ``(|G|^2, tr(Sigma))`` at the trainer's current weights from many
    micro-batches (per sequence: ``tr(Sigma)`` of one sequence's gradient).

    A direct measurement for calibration, not the per-step estimate: each
    micro-batch's gradient alone (``G_small``, ``B_small`` = its size) and their
    mean (``G_big`` over all of them), McCandlish et al. 2018 App. A.1, with no
    optimizer step (:func:`microbatch_gradients`); the gradient buffers are left
    zeroed.  One process with ``dp = pp = 1`` (the emulated proxy).  Their ratio is
    ``B_simple`` (:func:`measure_noise_scale`); kept apart, several measurements pool
    as a ratio of sums (:func:`cona.targets.fit_noise_scale`).

    Args:
        weights: multiply each counted parameter's gradient by this before its norm
            (e.g. :func:`adam_preconditioner`: Pollux's preconditioned noise scale
            ``tr(P Sigma P) / |P G|^2``); ``None`` measures the plain gradient.

    Raises:
        ValueError: fewer than two micro-batches, not ``dp = pp = 1``, or ``weights``
            not one per counted parameter.
    """
    from .grad_stats import estimate_from_norms

    if len(microbatches) < 2:
        raise ValueError("need at least two micro-batches")
    total, small = None, []
    for grads in microbatch_gradients(trainer, microbatches, weights):
        # a device scalar per tensor, one host sync per micro-batch
        small.append(float(sum(g.pow(2).sum() for g in grads)))
        total = grads if total is None else [a.add_(g) for a, g in zip(total, grads)]
    n = len(microbatches)
    big = float(sum((acc / n).pow(2).sum() for acc in total))
    b = int(next(iter(microbatches[0].values())).shape[0])
    return estimate_from_norms(sum(small) / n, b, big, n * b)


def measure_noise_scale(trainer: Trainer, microbatches: list,
                        weights: list[torch.Tensor] | None = None) -> float | None:
    """``B_simple = tr(Sigma) / |G|^2`` (sequences) of :func:`measure_gradient_stats`
    (same arguments and errors); ``None`` if the signal estimate is not positive."""
    g_sq, trace = measure_gradient_stats(trainer, microbatches, weights)
    return trace / g_sq if g_sq > 0 else None
