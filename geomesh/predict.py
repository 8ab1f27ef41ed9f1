"""Sign compression of the part of a pseudo-gradient the outer momentum does not predict.

Every worker holds the same outer momentum ``v`` (:class:`geomesh.outer.OuterNesterov`:
all apply the same aggregates), and a round's pseudo-gradient points largely
along it: on the quick bench ``cos(Δ_t, v_{t−1})`` is 0.74-0.82 for the
aggregate and 0.4-0.8 per worker (measured, ``geomesh/sync.py``).  So worker
``i`` fits ``x = Δ_i + e_i`` by ``γ v`` per row (``γ_r = ⟨x_r, v_r⟩ / ‖v_r‖²``,
least squares; one coefficient per scale of :class:`~geomesh.codec.SignCodec`:
per row of a matrix with row scales, else per tensor) and sign-compresses only
the innovation ``y = x − γ v``:

    message  = (γ_r, fp32 per row) + SignCodec(y)      (m_r · sign(y), m_r = mean |y_r|)
    decoded  = γ_r v_r + m_r sign(y_r)
    residual = y − m sign(y)                           (error feedback, if on)

The predicted part travels exactly (4 bytes per row: 31.2x instead of 31.6x
on GPT-3 1.3B), so coordinates that move consistently — large in ``v`` — get
their own magnitude instead of the row's mean, and the sign error shrinks
with ``‖y‖ / ‖x‖`` (0.6-0.75 measured).  The first round has no momentum:
``γ = 0``, plain signs.  This is predictive (differential) coding, as in
DPCM; the outer momentum is the predictor every receiver already has, as
1-bit Adam uses the shared momentum (Tang et al. 2021).

Layout: the dot products of a row split over TP ranks are all-reduced over
the worker's TP group, like the L1 sums of :class:`~geomesh.codec.SignCodec`,
so a TP=2 worker sends what a TP=1 worker would.

Wire format: ``"GMPR" | version u16 | reserved u16 | count u32`` (12 B), then
``count`` fp32 coefficients in schema order (one per scale), then the
:class:`~geomesh.codec.SignCodec` message of ``y``.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from .codec import SignCodec, _decoded
from .compression import ErrorFeedback, MessageError, TensorSchema, WorkerMessage, decode_message
from .outer import _check_weights, aggregate_messages

_HEAD = struct.Struct("<4sHHI")
_MAGIC = b"GMPR"


def fit_coefficients(both: torch.Tensor) -> torch.Tensor:
    """fp32 ``γ = ⟨x, v⟩ / ‖v‖²`` per scale from fp64 ``[2, n]`` sums ``(⟨x, v⟩, ‖v‖²)``
    over each scale's elements (0 where ``v`` is 0: no prediction)."""
    return torch.where(both[1] > 0, both[0] / both[1].clamp(min=1e-300),
                       torch.zeros_like(both[0])).float()


class PredictiveSignCodec(SignCodec):
    """:class:`SignCodec` of ``x − γ v`` plus the per-scale coefficients ``γ`` (module docstring).

    :meth:`encode` and :meth:`aggregate` take ``predictor`` = the outer momentum
    ``v`` (same on every worker; empty before the first outer step).
    """

    kind = "sign-pred"

    def _num_coefs(self, schema: TensorSchema | None = None) -> int:
        schema = schema or self.schema
        return sum(schema.num_scales(shape) for _, shape in schema.entries)

    def encoded_bytes(self, schema: TensorSchema) -> int:  # type: ignore[override]
        return _HEAD.size + 4 * self._num_coefs(schema) + schema.encoded_bytes()

    def compression_ratio(self, schema: TensorSchema) -> float:  # type: ignore[override]
        return 4 * schema.numel / self.encoded_bytes(schema)

    def _coefs(self, xs: dict[str, torch.Tensor], v: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``γ`` per scale (fp32, schema order), TP-reduced like the L1 sums."""
        dots, vvs, reduce = [], [], []
        # on the pseudo-gradients' device: the TP all-reduce below needs it there
        device = next((x.device for x in xs.values()), torch.device("cpu"))
        for name, shape in self.schema.entries:
            n = self.schema.num_scales(shape)
            x, p = xs[name], v.get(name)
            if p is None or x.numel() == 0:
                dots.append(torch.zeros(n, dtype=torch.float64, device=device))
                vvs.append(torch.zeros(n, dtype=torch.float64, device=device))
            else:
                xr, pr = x.reshape(n, -1).double(), p.reshape(n, -1).to(x.device).double()
                dots.append((xr * pr).sum(dim=1).to(device))
                vvs.append((pr * pr).sum(dim=1).to(device))
            reduce.append(torch.full((n,), self._reduced(name, shape), dtype=torch.bool,
                                     device=device))
        if not dots:
            return torch.zeros(0, device=device)
        both = torch.stack([torch.cat(dots), torch.cat(vvs)])  # [2, scales] fp64
        mask = torch.cat(reduce)
        if bool(mask.any()):
            part = torch.where(mask, both, torch.zeros_like(both))
            dist.all_reduce(part, group=self.tp_group)
            both = torch.where(mask, part, both)
        return fit_coefficients(both)

    def _times(self, gamma: torch.Tensor, v: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor]):
        """``γ ⊙ v`` per tensor (rows scaled by their coefficient); zeros without ``v``."""
        out, off = {}, 0
        for name, shape in self.schema.entries:
            n = self.schema.num_scales(shape)
            g = gamma[off:off + n]
            off += n
            p = v.get(name)
            ref = like[name]
            if p is None:
                out[name] = torch.zeros(shape, dtype=torch.float32, device=ref.device)
            else:
                p = p.to(device=ref.device, dtype=torch.float32)
                out[name] = (p.reshape(n, -1) * g.to(p.device).unsqueeze(1)).reshape(shape) \
                    if p.numel() else torch.zeros(shape, device=ref.device)
        return out

    def encode(self, deltas, num_tokens, *, worker, round, feedback: ErrorFeedback | None = None,
               predictor: Mapping[str, torch.Tensor] | None = None) -> bytes:
        v = predictor or {}
        xs = {name: (feedback.add(name, deltas[name].detach().float()) if feedback is not None
                     else deltas[name].detach().float()) for name, _ in self.schema.entries}
        gamma = self._coefs(xs, v)
        if not bool(torch.isfinite(gamma).all()):
            raise ValueError(f"pseudo-gradient of worker {worker} has NaN/Inf; the worker "
                             "diverged (lower the inner learning rate)")
        pred = self._times(gamma, v, xs)
        # SignCodec adds the residual e itself: hand it Δ − γv, it compresses Δ + e − γv.
        ys = {name: deltas[name].detach().float() - pred[name] for name, _ in self.schema.entries}
        body = super().encode(ys, num_tokens, worker=worker, round=round, feedback=feedback)
        head = _HEAD.pack(_MAGIC, 1, 0, gamma.numel())
        return head + gamma.cpu().numpy().astype("<f4").tobytes() + body

    def _decode_pred(self, m: bytes) -> tuple[np.ndarray, WorkerMessage]:
        """``(γ, sign message)`` of one predictive message (``MessageError`` if malformed)."""
        n = self._num_coefs()
        if len(m) < _HEAD.size + 4 * n:
            raise MessageError(f"predictive message truncated: {len(m)} bytes")
        magic, _ver, _res, count = _HEAD.unpack_from(m, 0)
        if magic != _MAGIC or count != n:
            raise MessageError(f"not a predictive sign message for this model "
                               f"(magic {bytes(magic)!r}, {count} coefficients, need {n})")
        gamma = np.frombuffer(m, "<f4", n, _HEAD.size).astype(np.float32)
        sign = decode_message(memoryview(m)[_HEAD.size + 4 * n:], self.schema)
        if not np.isfinite(gamma).all():
            raise MessageError(f"predictive message of worker {sign.worker} carries a "
                               "non-finite coefficient")
        return gamma, sign

    def aggregate(self, messages: Sequence[bytes | None], *, guard=None,
                  predictor: Mapping[str, torch.Tensor] | None = None, senders=None, round=None):
        """``(Δ, n_i list)`` like :meth:`SignCodec.aggregate` (identities from
        ``senders`` and ``round``): ``None`` entries and messages the ``guard``
        rejects (screened on each worker's decoded ``D(msg_i) + γ_i v``) count 0
        tokens; ``Δ`` is ``None`` when none is left."""
        pos, decoded, who = _decoded(messages, self._decode_pred, guard, senders=senders,
                                     round=round)
        v = predictor or {}
        if guard is not None:
            full = []
            for gm, sm in decoded:  # each worker's decoded Δ_i (the checks look at it whole)
                d = aggregate_messages([dataclasses.replace(sm, num_tokens=1)])  # D(msg_i) alone
                p = self._times(torch.from_numpy(gm), v, d)  # host: decoded wire bytes
                full.append({k: d[k] + p[k] for k in d})
            keep = guard.screen_dense(who, full,
                                      [sm.num_tokens for _, sm in decoded])
        else:
            keep = range(len(decoded))
        tokens = [0] * len(messages)  # positional, like messages
        for j in keep:
            tokens[pos[j]] = decoded[j][1].num_tokens
        if not keep:
            return None, tokens
        if guard is not None and guard.robust != "none":
            return guard.robust_dense([full[j] for j in keep],
                                      [decoded[j][1].num_tokens for j in keep]), tokens
        gammas, signs = [decoded[j][0] for j in keep], [decoded[j][1] for j in keep]
        weights = _check_weights([d.num_tokens for d in signs])
        agg = aggregate_messages(signs)
        gamma = torch.from_numpy(  # host: decoded wire bytes
            sum(w * g.astype(np.float64) for w, g in zip(weights, gammas)))
        pred = self._times(gamma.float(), v, agg)
        return {k: agg[k] + pred[k] for k in agg}, tokens
