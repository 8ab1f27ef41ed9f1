"""Streaming DiLoCo, emulated: ``geomesh.method=streaming_diloco``.

Douillard et al. 2025, "Streaming DiLoCo with overlapping communication:
towards a distributed free lunch" (arXiv 2501.18512), as torchft implements
it (``torchft.local_sgd.DiLoCo`` with ``model_fragments``,
``fragment_sync_delay``, ``fragment_update_alpha``): DiLoCo (uniform ``b, H``,
outer Nesterov on the token-weighted mean pseudo-gradient, :mod:`geomesh.sync`)
whose model is split into ``P`` fragments (``geomesh.fragments``) that are
synchronised in turn.

Schedule (torchft's): with ``S = H / P``, fragment ``q`` is synchronised at
inner steps ``(q+1)·S + k·H`` of every worker (torchft: fragment
``manager step mod P``, one sync every ``S`` steps), so each fragment every
``H`` steps and the WAN carries ``1/P`` of the model at a time.  For each
sync, at step ``(q+1)·S − τ`` (``τ = geomesh.fragment_sync_delay``) every
worker computes its fragment's pseudo-gradient ``Δ_i^q = θ_global^q − θ_i^q``
and sends it; it trains ``τ`` more steps while the messages travel; at step
``(q+1)·S`` it takes the outer step of fragment ``q`` (one
:class:`~geomesh.outer.OuterNesterov` per fragment: torchft steps one outer
optimizer with only that fragment's gradients set, so each parameter's
momentum advances only at its fragment's syncs) and merges the new
``θ_global^q`` with its ``τ`` steps of local progress,
``θ_i^q ← lerp(θ_global^q, θ_i^q, α)`` (``α = geomesh.fragment_update_alpha``;
torchft's ``_merge_parameters``).  The other fragments' weights are not
touched.  An outer step of the records is ``H`` inner steps: ``P`` syncs, every
fragment once, the tokens of a DiLoCo round.  Fragments: transformer layer
``l`` in fragment ``l mod P`` (the paper's strided pattern), the embeddings
with fragment 0, the final norm (and an untied output layer) with fragment
``P−1`` (where torchtitan's torchft split puts the input and output modules).

Defaults (``jobruntime/config.py``): ``P = 2`` (torchtitan's torchft DiLoCo
example, ``num_fragments=2``), ``τ = 1`` and ``α = 0.5`` (the paper's overlap
of one inner step and mixing factor; torchft's defaults, ``τ = 0`` and
``α = 0``, switch both off).

Low-bit messages (``geomesh.fragment_bits``).  torchft's ``should_quantize``
(fp8 e4m3, one scale per row) runs as triton kernels on CUDA only, and none of
our codecs (:mod:`geomesh.wire.canonical_codec`: 1-bit signs, 2-bit top-k) has
8 or 4 bits per element, so the quantisation is emulated here
(:func:`quantize`): each worker's ``Δ_i^q`` is rounded to the values an 8-bit
(fp8 e4m3, torchft's format) or 4-bit (E3M0: sign and three exponent bits,
the paper's 4-bit float) message with one fp32 scale ``max |x|`` per row
carries; the in-process exchange moves these values as fp32 and the clock
charges the low-bit size (:func:`low_bit_bytes`).  torchft reduces quantised
values in its collective; here they are averaged in fp32.

Time (emulated clock, :class:`geomesh.fleet.clock.EmulatedClock` with
overlap): each fragment's exchange is charged with the *target* model's
fragment message (its canonical tensors, fp32 or low-bit, framing included),
scheduled when the fragment is sent and waited for ``τ`` steps of compute
later (:meth:`EmulatedClock.wait`: straggler idle against a zero-network twin
of the clock, WAN idle the rest), the same accounting as GeoMesh's
overlapped rounds.

Emulated mode only (real mode is refused by :func:`geomesh.context.build_context`:
torchft's class is the real-mode implementation); no checkpoints.
Equality with torchft's ``DiLoCo`` on θ: ``tests/test_geomesh_torchft_streaming.py``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch

from jobruntime.config import ConfigError
from jobruntime.trainer import mean_loss

from .context import RunContext, target_canonical_schema
from .exchange.transport import InProcessTransport
from .fleet.clock import EmulatedClock
from .outer import OuterNesterov
from .report import not_finite
from .sync import OuterLoop, _Round, _true_step_s
from .wire.canonical import CanonicalSchema
from .wire.canonical_codec import CanonicalCodec
from .wire.compression import num_row_scales
from .wire.guard import Guard

FP8_MAX = 448.0  # largest finite float8_e4m3fn
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# E3M0 magnitudes relative to the row's scale: 0 and 2^-6 .. 2^0 (8 codes + a sign bit)
_E3M0 = torch.tensor([0.0] + [2.0 ** -e for e in range(6, -1, -1)])  # host
_E3M0_MIDS = (_E3M0[1:] + _E3M0[:-1]) / 2
CODEC_NAMES = {32: "fp32", 8: "fp8-e4m3-row", 4: "fp4-e3m0-row"}


def fragment_of(key: str, fragments: int) -> int:
    """Fragment of canonical tensor ``key`` (module docstring: layers strided, embeddings
    with the first, the rest with the last)."""
    m = _LAYER.search(key)
    if m:
        return int(m.group(1)) % fragments
    return 0 if "embedding" in key else fragments - 1


@torch.no_grad()
def quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The values a ``bits``-bit message with one fp32 scale ``max |x|`` per row carries
    for ``x`` (rows: dim 0 of a 2+-dim tensor, else the whole tensor), fp32, shape of ``x``.

    ``bits=32``: ``x``; 8: fp8 e4m3 of ``x / max|x| · 448`` (torchft's rowwise
    fp8); 4: E3M0, ``|x| / max|x|`` rounded to the nearest of ``0, 2^-6 .. 1``.

    Raises:
        ValueError: ``bits`` not 32, 8 or 4.
    """
    if bits == 32:
        return x
    if bits not in (8, 4):
        raise ValueError(f"quantize: bits must be 32, 8 or 4, got {bits}")
    rows = x.float().reshape(x.shape[0], -1) if x.dim() >= 2 else x.float().reshape(1, -1)
    amax = rows.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax, torch.ones_like(amax))
    y = rows / scale  # [-1, 1]
    if bits == 8:
        q = (y * FP8_MAX).to(torch.float8_e4m3fn).float() / FP8_MAX
    else:
        q = _E3M0.to(y.device)[torch.bucketize(y.abs(), _E3M0_MIDS.to(y.device))] * torch.sign(y)
    return (q * scale).reshape(x.shape)


def low_bit_bytes(fp32_bytes: int, shapes: Sequence[Sequence[int]], bits: int) -> int:
    """Bytes of a fragment message of ``bits`` per element: the fp32 message
    (``fp32_bytes``, framing included) with each tensor's ``4·numel`` payload replaced by
    ``⌈numel·bits/8⌉`` bytes and one fp32 scale per row (:func:`quantize`)."""
    if bits == 32:
        return fp32_bytes
    out = fp32_bytes
    for shape in shapes:
        n = math.prod(shape)
        out += math.ceil(n * bits / 8) + 4 * num_row_scales(shape) - 4 * n
    return out


class StreamingLoop(OuterLoop):
    """The outer loop of Streaming DiLoCo (module docstring), on :class:`OuterLoop`'s
    workers, plan, data order, records and summary.

    Raises:
        ConfigError: checkpoints asked for, a plan whose proxy steps are not ``H``
            per worker, or more fragments than the model has parts to fill.
    """

    def __init__(self, ctx: RunContext) -> None:
        cfg = ctx.cfg
        if cfg.checkpoint.load or cfg.checkpoint.save_interval:
            raise ConfigError("geomesh.method=streaming_diloco does not support checkpoints; set "
                              "checkpoint.save_interval=0 and no checkpoint.load")
        if not ctx.emulated:  # build_context refuses it first
            raise ConfigError("geomesh.method=streaming_diloco runs in emulated mode only")
        super().__init__(ctx)
        g, P = self.g, self.g.fragments
        self.P, self.tau, self.alpha, self.bits = (P, g.fragment_sync_delay,
                                                   g.fragment_update_alpha, g.fragment_bits)
        self.period = g.inner_steps // P
        if any(s.inner_steps != g.inner_steps for s in self.steps):
            raise ConfigError("geomesh.method=streaming_diloco: a worker's proxy share is below one "
                              "sequence per inner step; raise parallel.global_batch_size")
        self.names = [[n for n in self.theta if fragment_of(self.layout[n].key, P) == q]
                      for q in range(P)]
        if not all(self.names):
            raise ConfigError(f"geomesh.fragments={P}: fragment(s) "
                              f"{[q for q, x in enumerate(self.names) if not x]} hold no tensor; "
                              "use at most model.num_layers fragments")
        target = target_canonical_schema(ctx.target)
        self.codecs, self.fbytes, self.fp32_bytes, self.outers, self.guards = [], [], [], [], []
        for names in self.names:
            lay = {n: self.layout[n] for n in names}
            codec = CanonicalCodec("fp32", lay, CanonicalSchema.gather(lay))
            part = CanonicalSchema(tuple((k, s) for k, s in target.entries
                                         if fragment_of(k, P) == len(self.codecs)))
            fp32 = codec.message_bytes(part)
            self.codecs.append(codec)
            self.fp32_bytes.append(fp32)
            self.fbytes.append(low_bit_bytes(fp32, [s for _, s in part.entries], self.bits))
            self.outers.append(OuterNesterov({n: self.theta[n] for n in names}, lr=g.outer_lr,
                                             momentum=g.outer_momentum,
                                             momentum_warmup=g.outer_momentum_warmup))
            self.guards.append(Guard.from_config(g, self.cl))
        self.clock = EmulatedClock(self.cl, overlap=True)  # exchanges overlap τ steps
        self.transport = InProcessTransport(self.cl, clock=self.clock)
        self.syncs = 0

    @property
    def keeps_local_weights(self) -> bool:
        return True  # a worker's other fragments (and α of its progress) stay local

    def run(self) -> dict:
        """``geomesh.outer_steps`` outer steps of ``P`` fragment syncs each; the summary."""
        S, tau, seq = self.period, self.tau, self.cfg.model.seq_length
        for r in range(self.g.outer_steps):
            rnd = _Round(r=r, steps=self.steps)
            offsets = self.offsets()
            per = {w.name: dict(compute_s=0.0, straggler_idle_s=0.0, wan_idle_s=0.0,
                                sent_bytes=0) for w in self.cl.workers}
            done: dict[int, list] = {i: [] for i in self.pl.workers}
            nbytes = [0, 0]
            tokens = {i: self.steps[i].samples * seq for i in self.pl.workers}
            for q in range(self.P):  # the round's q-th sync is fragment q's
                self.train_span(rnd, done, offsets, q * S, (q + 1) * S - tau, per)
                if self.stats.diverged(self._diverged_workers(done), rnd.r + 1):
                    break  # before its fragment is encoded
                received = self.send(q, tokens)
                self.train_span(rnd, done, offsets, (q + 1) * S - tau, (q + 1) * S, per)
                self.sync(q, received, tokens, per, nbytes)
            if self.stats.diverged_at_step is not None:
                self.ctx.log_outer_step(dict(step=rnd.r + 1, tokens=self.stats.tokens,
                                             time_s=self.stats.time_s, loss=float("nan")))
                break
            rnd.losses = {i: mean_loss(done[i]) for i in self.pl.workers}
            self.stats.time_s = self.clock.now_s  # every fragment of this θ_global exists
            k = list(range(self.K))
            record = self.record(rnd, per, [tokens[i] for i in k], k, k, dict(rnd.losses),
                                 (nbytes[0], nbytes[1]))
            self.ctx.log_outer_step(record)
            if self.stats.diverged_at_step is not None:  # θ_global's validation
                break
            self.position += sum(s.samples for s in self.steps)
            if self.cfg.train.stop_at_target and self.stats.reached_here:
                break
        return self.summary()

    def _diverged_workers(self, done: dict[int, list]) -> list[str]:
        """Workers whose inner losses so far this round or weights are not finite (one
        process, emulated: no collective)."""
        return [w for i in self.pl.workers for w in not_finite(
            mean_loss(done[i]) if done[i] else 0.0, self.workers[i].trainer.module.parameters(),
            who=repr(self.cl.workers[i].name), local=True)]

    def train_span(self, rnd: _Round, done: dict[int, list], offsets: list[int], first: int,
                   last: int, per: dict[str, dict]) -> None:
        """Inner steps ``first .. last-1`` of the round on every worker, charged to the clock."""
        for i in self.pl.workers:
            s, name = self.steps[i], self.cl.workers[i].name
            done[i] += self.workers[i].train_steps(s, self.position + offsets[i], first, last)
            seconds = _true_step_s(self.ctx, i, s, rnd.r) * (last - first)
            self.clock.compute(name, seconds)
            per[name]["compute_s"] += seconds

    def send(self, q: int, tokens: Mapping[int, int]) -> list[bytes]:
        """Every worker's ``Δ_i^q = θ_global^q − θ_i^q`` (low-bit values with
        ``fragment_bits < 32``), exchanged: the clock schedules the target's fragment
        message and the workers go on computing."""
        msgs = {}
        for i in self.pl.workers:
            local = self.workers[i].trainer.get_params()
            delta = {n: quantize(self.theta[n] - local[n], self.bits) for n in self.names[q]}
            msgs[i] = self.codecs[q].encode(delta, tokens[i], worker=i, round=self.syncs)
        self.transport.charged_bytes = self.fbytes[q]
        return self.transport.exchange(msgs)

    def sync(self, q: int, received: list[bytes], tokens: Mapping[int, int],
             per: dict[str, dict], nbytes: list[int]) -> None:
        """Wait for fragment ``q``'s messages, take its outer step, merge every worker's
        fragment with the new ``θ_global^q`` (``lerp`` by ``α``)."""
        for w in self.cl.workers:
            strag, wan = self.clock.wait(w.name)
            per[w.name]["straggler_idle_s"] += strag
            per[w.name]["wan_idle_s"] += wan
            per[w.name]["sent_bytes"] += self.fbytes[q]
        nbytes[0] += self.fbytes[q] * self.K
        nbytes[1] += self.fp32_bytes[q] * self.K
        guard = self.guards[q]
        guard.expect(dict(tokens))
        agg, _ = self.codecs[q].aggregate(received, guard=guard, round=self.syncs)
        self.syncs += 1
        if agg is None:  # every message rejected: θ_global^q stays, as after a failed commit
            return
        self.outers[q].step(agg)
        with torch.no_grad():
            for i in self.pl.workers:
                tr = self.workers[i].trainer
                local = tr.get_params()
                local.update({n: self.theta[n].lerp(local[n], self.alpha) for n in self.names[q]})
                tr.set_params(local)

    def summary(self) -> dict:
        out = super().summary()
        out.update(codec=CODEC_NAMES[self.bits], fragments=self.P,
                   fragment_sync_delay=self.tau, fragment_update_alpha=self.alpha,
                   fragment_bits=self.bits, fragment_message_bytes=self.fbytes)
        return out


def run_streaming(ctx: RunContext) -> dict:
    """Train ``geomesh.outer_steps`` outer steps of Streaming DiLoCo; return the summary."""
    return StreamingLoop(ctx).run()
