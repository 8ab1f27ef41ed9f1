"""Token-weighted aggregation of pseudo-gradients and the outer Nesterov optimizer.

Aggregation.  Worker ``i`` trained on ``n_i`` tokens this round and sends
``C(Δ_i)``, e.g. ``m_i · sign(Δ_i)`` (see :mod:`geomesh.compression`).  With
``N = Σ_i n_i`` the outer gradient is the token-weighted mean

    Δ = Σ_i (n_i / N) · m_i · sign(Δ_i)                                    (1)

so a worker that processed more data (a faster GPU, larger ``b_i`` or
``H_i``) counts proportionally more — the estimate a single job would get
from the union of all workers' tokens.  With equal ``n_i`` this is DiLoCo's
plain mean (Douillard et al. 2023, Alg. 1, line 12).

Outer optimizer.  Nesterov momentum SGD on ``Δ`` as the gradient, with
PyTorch's ``torch.optim.SGD(nesterov=True, dampening=0)`` semantics
(Sutskever et al. 2013 in the Bengio et al. 2013 reformulation):

    v_t = μ · v_{t-1} + Δ_t            (v_0 = 0, so v_1 = Δ_1)
    θ_t = θ_{t-1} − lr · (Δ_t + μ · v_t)                                    (2)

DiLoCo's defaults are ``lr = 0.7``, ``μ = 0.9``.  With ``nesterov=False``
the update is heavy-ball ``θ ← θ − lr · v``.  Every worker applies (1)–(2)
to the same messages in the same order, so all copies of ``θ_global`` stay
bitwise identical without another broadcast.

This is DiLoCo's outer step (Douillard et al. 2023, Alg. 1) as torchft's
``torchft.local_sgd.DiLoCo`` takes it with ``torch.optim.SGD(lr, momentum=μ,
nesterov=True)``: the same pseudo-gradient sign, the mean over replicas
(``Manager.allreduce``: sum, then ``/ K``), the same operations in the same
order.  Two workers of ``geomesh.method=diloco`` and two torchft replica
groups give the same θ bit for bit after every round
(``tests/test_geomesh_torchft_diloco.py``).  ``momentum_warmup`` (on by
default, ``geomesh.outer_momentum_warmup``) is not in the paper: it is the
same optimizer with ``μ_t`` in place of ``μ``, bit for bit torchft's DiLoCo
whose outer SGD gets ``μ_t`` before round ``t``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def _check_weights(num_tokens: Sequence[int]) -> list[float]:
    if not num_tokens:
        raise ValueError("aggregate: no workers' pseudo-gradients given")
    if any(n < 0 for n in num_tokens):
        raise ValueError(f"aggregate: token counts must be >= 0, got {list(num_tokens)}")
    total = sum(num_tokens)
    if total <= 0:
        raise ValueError("aggregate: all workers report 0 tokens; nothing was trained this round")
    return [n / total for n in num_tokens]


def aggregate(
    deltas: Sequence[Mapping[str, torch.Tensor]], num_tokens: Sequence[int],
) -> dict[str, torch.Tensor]:
    """Token-weighted mean ``Σ (n_i/N) Δ_i`` of (decoded) pseudo-gradients; the guard's
    checks and robust modes come first (:func:`geomesh.codec.aggregate_decoded`).

    Args:
        deltas: one name -> tensor mapping per worker, same names and shapes.
        num_tokens: ``n_i`` per worker, same order.

    Returns:
        name -> fp32 tensor (on the first worker's device).

    Raises:
        ValueError: mismatched lengths, names or shapes; no tokens at all.
    """
    if len(deltas) != len(num_tokens):
        raise ValueError(
            f"aggregate: {len(deltas)} pseudo-gradients but {len(num_tokens)} token counts"
        )
    weights = _check_weights(num_tokens)
    names = list(deltas[0])
    out: dict[str, torch.Tensor] = {}
    for name in names:
        ref = deltas[0][name]
        acc = torch.zeros(ref.shape, dtype=torch.float32, device=ref.device)
        for i, (d, w) in enumerate(zip(deltas, weights)):
            if name not in d or d[name].shape != ref.shape:
                raise ValueError(f"aggregate: worker {i} lacks '{name}' or has another shape")
            acc.add_(d[name].float(), alpha=w)
        out[name] = acc
    for i, d in enumerate(deltas):
        if len(d) != len(names):
            raise ValueError(
                f"aggregate: worker {i} has {len(d)} tensors, worker 0 has {len(names)}"
            )
    return out


class OuterNesterov:
    """Outer optimizer: Nesterov SGD on pseudo-gradients, equation (2).

    Owns the global weights ``θ_global`` (fp32, updated in place) and the
    momentum buffers ``v`` (fp32, same shapes: 4 bytes per parameter).

    Args:
        params: name -> fp32 tensor of the global weights (kept by reference).
        lr: outer learning rate (DiLoCo: 0.7).
        momentum: ``μ`` (DiLoCo: 0.9).
        nesterov: Nesterov (True) or heavy-ball (False) momentum.
        momentum_warmup: ramp the momentum as ``μ_t = min(μ, 1 − 3/(t + 5))``
            (Nesterov's schedule, Sutskever et al. 2013, §2) instead of using
            ``μ`` from the first step: early pseudo-gradients are large and
            quickly outdated (the model first fits unigram statistics), and a
            full momentum keeps pushing along them for many rounds.  Not in
            DiLoCo's paper (``False`` is its Alg. 1).
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        lr: float = 0.7,
        momentum: float = 0.9,
        nesterov: bool = True,
        momentum_warmup: bool = False,
    ) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(
                f"OuterNesterov: need lr > 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}"
            )
        self.params: dict[str, torch.Tensor] = dict(params)
        self.lr = lr
        self.momentum = momentum
        self.momentum_warmup = momentum_warmup
        self.nesterov = nesterov
        self.momentum_buffer: dict[str, torch.Tensor] = {}
        self.step_count = 0

    @torch.no_grad()
    def step(self, delta: Mapping[str, torch.Tensor]) -> None:
        """Apply one outer step with pseudo-gradient ``delta`` (= θ_global − θ_avg).

        Raises:
            ValueError: ``delta`` names or shapes differ from the parameters.
        """
        if set(delta) != set(self.params):
            missing = sorted(set(self.params) - set(delta))[:5]
            extra = sorted(set(delta) - set(self.params))[:5]
            raise ValueError(
                f"outer step: pseudo-gradient names differ (missing {missing}, extra {extra})"
            )
        mu = self.current_momentum
        for name, p in self.params.items():
            g = delta[name].to(device=p.device, dtype=p.dtype)
            if g.shape != p.shape:
                raise ValueError(
                    f"outer step: '{name}' has shape {tuple(g.shape)}, parameter {tuple(p.shape)}"
                )
            buf = self.momentum_buffer.get(name)
            if buf is None:
                buf = self.momentum_buffer[name] = g.clone()  # v_1 = Δ_1
            else:
                buf.mul_(mu).add_(g)
            update = g.add(buf, alpha=mu) if self.nesterov else buf
            p.sub_(update, alpha=self.lr)
        self.step_count += 1

    @torch.no_grad()
    def preview(self, delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The weights :meth:`step` would give for ``delta``, without changing any
        state (overlapped rounds start from it, :mod:`geomesh.sync`)."""
        mu, out = self.current_momentum, {}
        for name, p in self.params.items():
            g = delta[name].to(device=p.device, dtype=p.dtype)
            buf = self.momentum_buffer.get(name)
            v = g if buf is None else buf * mu + g
            out[name] = p - self.lr * (g + mu * v if self.nesterov else v)
        return out

    @torch.no_grad()
    def apply_update(self, update: Mapping[str, torch.Tensor]) -> None:
        """``θ ← θ − lr · update`` for an already momentum-corrected update (the
        workers kept the momentum, :class:`geomesh.feedback.LocalMomentum`); counts
        as a step of the momentum schedule.

        Raises:
            ValueError: ``update`` names or shapes differ from the parameters.
        """
        if set(update) != set(self.params):
            raise ValueError("outer update: names differ from the parameters "
                             f"(e.g. {sorted(set(update) ^ set(self.params))[:5]})")
        for name, p in self.params.items():
            u = update[name].to(device=p.device, dtype=p.dtype)
            if u.shape != p.shape:
                raise ValueError(
                    f"outer update: '{name}' has shape {tuple(u.shape)}, parameter {tuple(p.shape)}"
                )
            p.sub_(u, alpha=self.lr)
        self.step_count += 1

    @property
    def current_momentum(self) -> float:
        """``μ`` of the next step (ramped with ``momentum_warmup``)."""
        if not self.momentum_warmup:
            return self.momentum
        return min(self.momentum, 1.0 - 3.0 / (self.step_count + 1 + 5))

    def state_dict(self) -> dict:
        """Copies of the global weights, momentum buffers and hyper-parameters."""
        return {
            "lr": self.lr,
            "momentum": self.momentum,
            "momentum_warmup": self.momentum_warmup,
            "nesterov": self.nesterov,
            "step": self.step_count,
            "params": {k: v.detach().clone() for k, v in self.params.items()},
            "momentum_buffer": {k: v.clone() for k, v in self.momentum_buffer.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` output; weights are copied into the existing tensors.

        Raises:
            ValueError: the saved weights have other names or shapes.
        """
        saved = state["params"]
        if set(saved) != set(self.params):
            raise ValueError(
                "outer load_state_dict: saved weights have other names than the model "
                f"(e.g. {sorted(set(saved) ^ set(self.params))[:5]})"
            )
        for k, p in self.params.items():
            if saved[k].shape != p.shape:
                raise ValueError(
                    f"outer load_state_dict: '{k}' saved {tuple(saved[k].shape)}, model {tuple(p.shape)}"
                )
            p.copy_(saved[k])
        self.lr = state["lr"]
        self.momentum = state["momentum"]
        self.momentum_warmup = state.get("momentum_warmup", False)
        self.nesterov = state["nesterov"]
        self.step_count = state["step"]
        # in place: callers hold the dict (the predictive codec's predictor, geomesh/sync.py)
        self.momentum_buffer.clear()
        self.momentum_buffer.update(
            {k: v.clone().to(self.params[k].device) for k, v in state["momentum_buffer"].items()})
