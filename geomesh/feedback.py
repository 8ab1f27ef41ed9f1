"""Where the compression error goes: error feedback before or after the outer momentum.

Two places to compress (``geomesh.compress_update``):

* **the pseudo-gradient** (DiLoCo's order, ``compress_update=false``): worker
  ``i`` sends ``C(Δ_i + e_i)``, the aggregate ``Σ w_i C(·)`` enters one global
  Nesterov momentum ``v ← μ v + Δ̂``, ``θ ← θ − lr (Δ̂ + μ v)``
  (:class:`geomesh.outer.OuterNesterov`);
* **the outer update** (1-bit Adam's order, Tang et al. 2021, "1-bit Adam",
  Alg. 1, which compresses the momentum rather than the gradient;
  ``compress_update=true``): worker ``i`` keeps its own momentum of its own
  pseudo-gradients, ``v_i ← μ v_i + Δ_i``, and sends ``C(u_i + e_i)`` with
  ``u_i = Δ_i + μ v_i``; every worker applies ``θ ← θ − lr Σ_i w_i C(u_i + e_i)``
  (:meth:`geomesh.outer.OuterNesterov.apply_update`).  Momentum is linear,
  so with fixed token weights ``Σ w_i u_i = Δ + μ v`` — without compression
  this *is* DiLoCo's Nesterov step.  Unlike 1-bit Adam, the momentum stays
  local and exact (no shared compressed momentum), which is what makes the
  error bound below hold.

Why error feedback gained nothing (measured, quick bench, ``geomesh/sync.py``).

1. *It was not measured at the same plan.*  The residual (4 bytes per
   parameter) was counted as accelerator memory, so turning it on changed
   the planner's plan (A100 7 steps of 144 → 9 of 120, round 15.9 → 17.1 s);
   "EF on 713 vs off 715, TTP 158 vs 130 s" compared two plans — the TTP
   difference is the longer round.  The residual now lives in host memory
   (:class:`geomesh.wire.compression.ErrorFeedback`): same plan either way, and
   EF on the pseudo-gradient gives 679 vs 724 (fp32: 601).
2. *What it repays, the next round re-derives.*  In DiLoCo-style training the
   part of ``Δ_t`` that was not sent still shows in the loss gradient, and
   the next round's inner AdamW steps (which move every coordinate by about
   the learning rate) largely find it again, so EF pays it twice.  With sign
   compression the residual is ~40 % of ``‖x‖`` per round; it grows to
   exceed the fresh pseudo-gradient (per worker ‖e‖ ≈ 5.2 vs ‖Δ‖ ≈ 5.0 at
   round 6, 2.9 vs 0.9 at round 12, as pseudo-gradients shrink ~10x with the
   inner learning rate), and late messages mostly carry old debt: their
   cosine with the fp32 aggregate falls from 0.94 to 0.5 while the
   cumulative sum stays right (cosine 0.998; 0.955 without EF, whose sum is
   22 % short).  With top-k (90 % unsent) the double payment shows as a
   perplexity bump mid-run (``geomesh.error_feedback_decay`` < 1 forgets
   part of the residual).
3. *The momentum weights late repayments like fresh gradients* (by
   ``c_k = Σ_{j≤k+1} μ^j``, 1.9 up to 10), so the parameter error of EF on
   ``Δ`` is a multiple of the residual (tested:
   ``tests/test_geomesh_feedback.py``).  Compressing the update instead
   (above) makes it exactly ``lr Σ_i w_i e_i`` — but measured no better (709
   without EF, 712 with): ``u_i`` is dominated by ``μ v_i``, which the
   receivers as good as know, so the bits go to known information and the
   sign error grows with ``‖u‖ ≫ ‖Δ‖``.  Predicting ``Δ_i`` by the shared
   momentum and sending only the innovation (:mod:`geomesh.wire.predict`) did
   not help either (676 with EF, 755 without).

Memory: ``v_i`` is 4 bytes per parameter on the device and replaces the
global momentum; the residual ``e_i`` (4 bytes per parameter) is in host memory.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class LocalMomentum:
    """Worker ``i``'s outer momentum of its own pseudo-gradients (fp32, model shapes).

    Args:
        nesterov: send ``Δ_i + μ v_i`` (Nesterov, as :class:`~geomesh.outer.OuterNesterov`)
            or ``v_i`` (heavy ball).
    """

    def __init__(self, *, nesterov: bool = True) -> None:
        self.nesterov = nesterov
        self.buffers: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def update(self, delta: Mapping[str, torch.Tensor], mu: float) -> dict[str, torch.Tensor]:
        """``v ← μ v + Δ`` (``v_1 = Δ_1``); return the update ``u = Δ + μ v`` (new tensors)."""
        out = {}
        for name, d in delta.items():
            d = d.detach().float()
            v = self.buffers.get(name)
            if v is None:
                v = self.buffers[name] = d.clone()
            else:
                v.mul_(mu).add_(d)
            out[name] = d.add(v, alpha=mu) if self.nesterov else v.clone()
        return out

    def state_dict(self) -> dict:
        return {"nesterov": self.nesterov, "buffers": {k: v.clone() for k, v in self.buffers.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        self.nesterov = state["nesterov"]
        self.buffers = {k: v.clone() for k, v in state["buffers"].items()}
