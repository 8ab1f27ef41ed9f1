"""Feed the gradient noise scale from the training step, without an extra backward.

Small- and big-batch gradient pairs from the step itself (McCandlish et al. 2018,
App. A.1; estimator in :mod:`cona.grad_stats`); the first two modes cost no extra
computation, the last two run some steps split:

- **DP > 1** (``"replica"``): the loss is a sum over tokens (megatron's
  per-token loss, :mod:`jobruntime.objective`), DDP sums and megatron's
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
  before the first backward, so these points do not exist: ``"calls"`` mode.)
- **DP = 1, PP = 1, one micro-batch per step** (``"split"``): every
  ``cona.gns_split_every``-th step runs its micro-batch as two parts (sizes differing by
  at most one; the same samples, and the same gradient up to summation order: the loss
  is a sum over tokens; with dropout, other masks), and reads them as in
  ``"microbatch"`` mode; the other steps run as they are and add nothing.
- **DP = 1, PP > 1** (``"calls"``): every ``cona.gns_split_every``-th step runs as two
  schedule calls (``schedule_calls`` of :meth:`jobruntime.trainer.Trainer.train_step`:
  the gradients accumulate and are finalised once, the same step), each half of its
  micro-batches, or with one micro-batch, one of its two parts.  Between the calls
  (:attr:`Trainer.schedule_call_hook`) and before the finalisation the probe reads the
  buffer's change, the summed gradient of that call's loss tokens, as in
  ``"microbatch"`` mode.

  In both, ``B_small`` is the harmonic mean of the two parts' sizes (sequences):
  ``E mean_i |G_i|^2 = |G|^2 + tr(Sigma) mean_i(1 / b_i)``, exact for unequal parts.
  A split step costs more than a plain one: smaller micro-batches, or at PP > 1 one more
  pipeline fill and drain (``bench/cona_split_cost.py``), and the gradient copy below;
  its time enters the measured step time like any other.
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
rank.  Cost: two passes over the gradients and a few scalar all-reduces per step; in the
modes that read parts of a step, one fp32 copy of this rank's gradients held through the
step (the previous part's: :data:`GRADIENT_COPY_BYTES`, counted by CONA's memory filter)
and, at PP > 1 with tied embeddings, the word embedding's gradient change all-reduced
over the embedding group per part.
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
the optimizer state per step, and the preconditioner held in fp64 through the step
(:data:`PRECONDITIONER_BYTES`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from jobruntime.memory import ExtraState
from jobruntime.trainer import Trainer, call_bounds

from .grad_stats import GradientNoiseScale

log = logging.getLogger("cona")

PRECONDITIONER_BYTES = 8.0
"""Bytes per parameter a preconditioned definition (``newton``, ``pollux``) holds during a
step, at any DP: Adam's preconditioner in fp64 (:func:`adam_preconditioner`); counted by
CONA's candidate filter and launch check (:func:`probe_state`)."""

GRADIENT_COPY_BYTES = 4.0
"""Bytes per parameter the probe keeps at DP = 1, where it reads parts of a step: one
copy of the gradient buffers (fp32: the trainer's ``grad_reduce_in_fp32``); counted by
CONA's candidate filter and launch check (:func:`probe_state`)."""

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


def probe_state(definition: str) -> ExtraState:
    """What the probe holds on the device during a step for noise-scale ``definition``,
    per parameter: :data:`PRECONDITIONER_BYTES` at any DP for ``newton`` / ``pollux`` (0
    for ``simple``) and :data:`GRADIENT_COPY_BYTES` more at DP = 1.  An upper bound: at
    DP = 1 no copy is held where the probe reads nothing (``cona.gns_split_every = 0``
    with one micro-batch or PP > 1).  Counted by CONA's candidate filter
    (:func:`cona.candidates.build_candidates`) and the start layout's launch check
    (:func:`cona.state.build_trainer`).

    Raises:
        ValueError: unknown definition (as :func:`preconditioner_power`).
    """
    precond = PRECONDITIONER_BYTES if preconditioner_power(definition) else 0.0
    return ExtraState("CONA's noise-scale probe", precond, GRADIENT_COPY_BYTES,
                      fix="cona.gns_definition=simple (no preconditioner)",
                      fix_at_dp1="run at DP >= 2 (no gradient copy)")


def _halves(mb: dict) -> list[dict]:
    """A micro-batch's two parts along its batch dimension (the first one sequence larger
    for an odd size; ``torch.tensor_split``)."""
    return [dict(zip(mb, vals)) for vals in zip(*(t.tensor_split(2) for t in mb.values()))]


def _harmonic(sizes: list[int]) -> float:
    """``1 / mean(1 / b)``: the ``B_small`` of small batches of unequal sizes (module
    docstring)."""
    return len(sizes) / sum(1 / b for b in sizes)


def _is_counted(param: torch.nn.Parameter) -> bool:
    if getattr(param, "shared", False):
        return False
    return tensor_parallel.param_is_not_tensor_parallel_duplicate(param)


def _sq(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm accumulated in fp64 (torch may form a transient fp64 copy of
    ``t``, one tensor at a time: on CPU it does)."""
    return torch.linalg.vector_norm(t.detach(), dtype=torch.float64) ** 2


def _all_reduce(t: torch.Tensor, group) -> None:
    if dist.get_world_size(group) > 1:  # a one-rank gloo collective still costs ~ms
        dist.all_reduce(t, group=group)


def _grad(param) -> torch.Tensor | None:
    return getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def estimate_mode(dp: int, pp: int, num_microbatches: int, micro_batch_size: int,
                  split_every: int) -> str | None:
    """How the probe measures the noise scale at a layout (module docstring):
    ``"replica"``, ``"microbatch"``, ``"split"``, ``"calls"``, or ``None`` where it
    cannot (:func:`no_estimate_reason` says why).

    Args:
        dp, pp: the layout's data- and pipeline-parallel sizes.
        num_microbatches: micro-batches per step on one DP rank.
        micro_batch_size: sequences per micro-batch.
        split_every: ``cona.gns_split_every`` (0: never split a step).
    """
    if dp > 1:
        return "replica"
    if pp == 1 and num_microbatches >= 2:
        return "microbatch"
    if not split_every or (num_microbatches == 1 and micro_batch_size < 2):
        return None
    return "split" if pp == 1 else "calls"


def no_estimate_reason(dp: int, pp: int, num_microbatches: int, micro_batch_size: int,
                       split_every: int) -> str | None:
    """Why no noise-scale estimate is possible at a layout, with the fix; ``None`` if
    one is (:func:`estimate_mode`, the same arguments).

    An estimate needs two gradients of different batch sizes from the step itself
    (module docstring): DP replicas (``dp > 1``), or gradients of parts of the step
    (its micro-batches, or with ``split_every`` a split step's parts or schedule calls),
    of which a step of one single-sequence micro-batch at DP = 1 has none.
    """
    if estimate_mode(dp, pp, num_microbatches, micro_batch_size, split_every) is not None:
        return None
    fixes = ["run >= 2 data-parallel processes"]  # every fix listed gives an estimate
    if num_microbatches == 1 and estimate_mode(1, pp, 2, micro_batch_size, split_every):
        fixes.append("set parallel.global_batch_size >= 2 x parallel.micro_batch_size")
    splittable = estimate_mode(1, pp, num_microbatches, micro_batch_size, 1) is not None
    if not split_every and splittable:
        fixes.append("set cona.gns_split_every > 0")
        why = (f"dp=1 with pp={pp}" if pp > 1 else "dp=1 with 1 micro-batch per step")
        why += " and cona.gns_split_every=0 (no step is split)"
    else:
        why = "dp=1 with 1 micro-batch of one sequence per step (it cannot be split)"
    return f"{why}; for one, " + " or ".join(fixes)


class GNSProbe:
    """Updates a :class:`GradientNoiseScale` after every training step of a trainer.

    Args:
        estimator: the estimator the controller reads.
        definition: ``simple``, ``newton`` or ``pollux`` (:data:`DEFINITIONS`): the norms
            of the gradients or of Adam-preconditioned ones (module docstring).
        split_every: in ``"split"`` and ``"calls"`` modes, split every this many steps
            (``cona.gns_split_every``); 0: never, and no estimate there.

    Attributes:
        mode: ``"replica"``, ``"microbatch"``, ``"split"``, ``"calls"`` or ``None`` (no
            estimate possible; :func:`estimate_mode`).
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
        self._steps = 0  # steps prepared since attach ("split", "calls")
        # sequences of each part of a step prepare() split (parts or schedule calls); None:
        # this step is not split (its micro-batches, if any, are the parts)
        self._sizes: list[int] | None = None
        self.schedule_calls = 1
        """Schedule calls to run the step :meth:`prepare` returned as
        (``Trainer.train_step``'s ``schedule_calls``)."""
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
        self._read = 0  # "calls": loss tokens of this step's calls read so far

    # -- wiring -------------------------------------------------------------
    def attach(self, trainer: Trainer) -> None:
        """Hook into ``trainer`` (its current layout and batch); detaches from any other."""
        self.detach()
        p = trainer.cfg.parallel
        dp = dist.get_world_size(trainer.grad_dp_group)
        m = p.global_batch_size // (p.micro_batch_size * dp)
        self.mode = estimate_mode(dp, p.pp, m, p.micro_batch_size, self.split_every)
        self.no_estimate = no_estimate_reason(dp, p.pp, m, p.micro_batch_size, self.split_every)
        if self.mode in ("split", "calls"):
            log.info("GNS probe: DP = 1 with %s; one step in %d runs as two %s to measure "
                     "the noise scale", f"PP = {p.pp}" if p.pp > 1 else "one micro-batch",
                     self.split_every, "schedule calls" if self.mode == "calls" else "parts")
        elif self.mode is None:
            log.warning("GNS probe: no noise-scale estimate at this layout: %s; CONA then "
                        "ranks only strategies of the current global batch, by throughput",
                        self.no_estimate)
        self.trainer, self._dp = trainer, dp
        self._orig = trainer.tcfg.finalize_model_grads_func
        trainer.tcfg.finalize_model_grads_func = self._finalize
        if self.mode in ("microbatch", "split", "calls"):
            trainer.microbatch_hook = self._on_microbatch
        if self.mode == "calls":
            trainer.schedule_call_hook = self._on_call
        self._steps, self._sizes, self.schedule_calls = 0, None, 1

    def prepare(self, microbatches: list[dict]) -> list[dict]:
        """The micro-batches to run this step, and :attr:`schedule_calls`: on every
        ``split_every``-th step since :meth:`attach` in ``"split"`` mode, the micro-batch
        as two parts; in ``"calls"`` mode, the micro-batches in two schedule calls (one
        micro-batch as two parts, one per call); otherwise ``microbatches`` as they are,
        in one call (module docstring).  A preconditioned definition splits no step
        before the optimizer has state (nothing to read).  Call once per training step,
        before :meth:`jobruntime.trainer.Trainer.train_step`."""
        self._sizes, self.schedule_calls = None, 1
        if self.mode not in ("split", "calls"):
            return microbatches
        self._steps += 1
        if (self._steps - 1) % self.split_every:
            return microbatches
        if not self._load_weights():  # no optimizer state yet: split the next step
            self._steps -= 1
            return microbatches
        if self.mode == "calls":
            self.schedule_calls = 2
        if len(microbatches) >= 2:  # "calls": two groups of micro-batches, as Trainer runs them
            bounds = call_bounds(len(microbatches), 2)
            self._sizes = [sum(int(mb["loss_mask"].shape[0]) for mb in microbatches[a:b])
                           for a, b in zip(bounds, bounds[1:])]
            return microbatches
        parts = _halves(microbatches[0])
        self._sizes = [int(part["loss_mask"].shape[0]) for part in parts]
        return parts

    def detach(self) -> None:
        if self.trainer is not None:
            self.trainer.tcfg.finalize_model_grads_func = self._orig
            if self.trainer.microbatch_hook == self._on_microbatch:
                self.trainer.microbatch_hook = None
            if self.trainer.schedule_call_hook == self._on_call:
                self.trainer.schedule_call_hook = None
        self.trainer, self._orig, self._prev, self._small, self._tokens = None, None, None, [], []
        self._weight, self.mode, self._sizes, self.schedule_calls = None, None, None, 1

    # -- norms --------------------------------------------------------------
    def _tied(self) -> torch.nn.Parameter | None:
        """This stage's copy of the tied word embedding where its gradient lacks the other
        stage's part until ``finalize_model_grads`` (``pp > 1``, tied, in the embedding
        group); else ``None``."""
        module = self.trainer.module
        if (parallel_state.get_pipeline_model_parallel_world_size() > 1
                and getattr(module, "share_embeddings_and_output_weights", False)
                and module._is_in_embd_group()):
            return module.shared_embedding_or_output_weight()
        return None

    def _sq_norm(self, fix_tied: bool) -> float:
        """Squared norm of this replica's gradient, summed over the model-parallel group."""
        total = torch.zeros(1, dtype=torch.float64, device=self.trainer.device)
        tied = self._tied() if fix_tied else None
        if tied is not None:
            g = _grad(tied).detach().clone()
            dist.all_reduce(g, group=self.trainer.module.embd_group)  # input + output parts
            if _is_counted(tied):
                total += _sq(self._weighted(tied, g))
        for param in self.trainer.module.parameters():
            g = _grad(param)
            if g is None or param is tied or not _is_counted(param):
                continue
            total += _sq(self._weighted(param, g))
        _all_reduce(total, parallel_state.get_model_parallel_group())
        return float(total[0])

    def _read_part(self, n: int, keep: bool = True) -> None:
        """Add the squared norm (this rank's share) of the part of the step just finished,
        a micro-batch or a schedule call: the buffer's change since the last read, its
        summed gradient, over its ``n`` loss tokens (none without any), the tied
        embedding's change summed over the embedding group and counted once.  One fp32
        copy of the gradients is kept for the next part (``keep``; the last part's read
        keeps none); the changes are formed one parameter at a time."""
        tied = self._tied()
        params = [p for p in self.trainer.module.parameters()
                  if _grad(p) is not None and (p is tied or _is_counted(p))]
        first = self._prev is None
        prev = [] if first else self._prev
        sq = torch.zeros((), dtype=torch.float64, device=self.trainer.device)
        for i, param in enumerate(params):
            g = _grad(param).detach()
            d = g if first else g - prev[i]
            if param is tied:  # summed in a tensor of its own: the buffer stays this stage's
                d = d.clone() if first else d
                dist.all_reduce(d, group=self.trainer.module.embd_group)
            if _is_counted(param) and n > 0:  # summed on the device: no host sync per tensor
                sq += _sq(self._weighted(param, d))
            if keep and first:
                prev.append(g.clone())
            elif keep:
                prev[i].copy_(g)
        self._small.append(sq / n**2 if n > 0 else None)
        self._prev = prev if keep else None

    def _weighted(self, param, g: torch.Tensor) -> torch.Tensor:
        """``P^a g`` when preconditioned (fp64, like the norms), else ``g``."""
        return g if self._weight is None else g.detach().double() * self._weight[id(param)]

    def _ready(self) -> bool:
        """``False`` while preconditioned without a preconditioner: no estimate this step."""
        return not self.preconditioned or self._weight is not None

    def _load_weights(self) -> bool:
        """Fetch this step's preconditioner (when preconditioned); :meth:`_ready` after."""
        if self.preconditioned:
            self._weight = None  # not two preconditioners alive at once
            weights = adam_preconditioner(self.trainer, self.power)
            counted = [p for p in self.trainer.module.parameters() if _is_counted(p)]
            self._weight = None if weights is None else {
                id(p): w for p, w in zip(counted, weights, strict=True)}
        return self._ready()

    def _on_microbatch(self, index: int, num_tokens: int) -> None:
        if self.mode in ("split", "calls") and self._sizes is None:
            return  # a step run as it is: nothing to read
        if index == 0:
            self._prev, self._small, self._tokens, self._read = None, [], [], 0
            if self._sizes is None:  # a split step's were loaded by prepare()
                self._load_weights()
        elif self.mode != "calls" and self._ready():  # micro-batch index - 1 just ended
            self._read_part(self._tokens[-1])
        self._tokens.append(num_tokens)

    def _on_call(self) -> None:
        """Between a step's schedule calls (:attr:`Trainer.schedule_call_hook`)."""
        if self._sizes is not None and self._tokens and self._ready():
            self._read_part(self._call_tokens())

    def _call_tokens(self) -> int:
        """``"calls"``: the loss tokens of the call just finished (its micro-batches')."""
        n = sum(self._tokens) - self._read
        self._read += n
        return n

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
        big_batch = p.global_batch_size
        if self.mode == "replica" and self._load_weights():
            n = self._replica_tokens(num_tokens)
            local = torch.tensor([self._sq_norm(fix_tied=True) / max(n, 1.0) ** 2],
                                 dtype=torch.float64, device=self.trainer.device)
            _all_reduce(local, self.trainer.grad_dp_group)
            small, small_batch = float(local[0]) / self._dp, p.global_batch_size // self._dp
        elif ((self.mode == "microbatch" or self._sizes is not None) and self._tokens
              and self._ready()):
            # the last call or micro-batch
            self._read_part(self._call_tokens() if self.mode == "calls" else self._tokens[-1],
                            keep=False)
            sizes = self._sizes or [p.micro_batch_size] * len(self._small)
            # parts with loss tokens (every model-parallel rank reads the same parts): the
            # big batch is theirs, a part without any adds nothing to the gradient
            finite = [(x, b) for x, b in zip(self._small, sizes) if x is not None]
            if len(self._small) != len(sizes):
                log.warning("GNS update skipped: %d of this step's %d parts were read (run "
                            "the step with the probe's schedule_calls)", len(self._small),
                            len(sizes))
            elif len(finite) < 2:
                log.warning("GNS update skipped: %d of this step's parts hold loss tokens, "
                            "two are needed", len(finite))
            else:
                shards = torch.stack([x for x, _ in finite])  # this rank's share of each
                _all_reduce(shards, parallel_state.get_model_parallel_group())
                small, small_batch = float(shards.mean()), _harmonic([b for _, b in finite])
                big_batch = sum(b for _, b in finite)
            self._small, self._prev, self._tokens, self._read = [], None, [], 0
        self._sizes = None  # read: the next step is split only if prepare() says so
        out = self._orig(model, num_tokens, *args, **kwargs)
        if small is not None:
            big = self._sq_norm(fix_tied=False)
            self.last = (small, small_batch, big, big_batch)
            try:
                self.estimator.update(small, small_batch, big, big_batch)
            except ValueError as e:  # a non-finite norm (diverged step): skip it
                log.warning("GNS update skipped: %s", e)
        self._weight = None  # the preconditioner is this step's: not held between steps
        return out


def adam_preconditioner(trainer: Trainer, power: float = 1.0) -> list[torch.Tensor] | None:
    """Adam's preconditioner ``P = 1/(sqrt(v_hat) + eps)`` to the ``power`` (1: ``P``;
    1/2: its square root, the ``newton`` definition), one tensor per counted parameter
    of ``trainer.module`` (the order of :func:`cona.direct_gns.measure_noise_scale`).

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
