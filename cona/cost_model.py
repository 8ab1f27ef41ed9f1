"""Throughput model of a strategy: iteration time (s) and tokens/s on a GPU profile.

One optimizer step of strategy ``(dp, tp, pp, b, B)`` with ``m = B/(dp*b)``
micro-batches per DP rank, sequence ``s`` and hidden ``h``:

- **Compute** (per micro-batch, per stage): ``F_stage * s*b / tp`` FLOPs at
  ``peak * efficiency(s*b / tp)`` FLOP/s (``jobruntime.hardware``; the
  efficiency curve is in tokens of per-device work per micro-batch: a TP rank's
  GEMMs are ``1/tp`` as wide, and smaller matrix multiplications run at lower
  utilisation, Narayanan et al. 2021 Sec. 3.2 / Fig. 13).  ``F_stage`` is the training FLOPs per token
  of ``L/pp`` layers (``jobruntime.flops.flops_per_token``, Narayanan et al.
  2021 eq. 3); the last stage also computes the logits (``6hV`` per token), so
  it is the slowest and sets the pace.  Summed over the job this is the usual
  ``flops_per_token * tokens / (peak * efficiency * devices)``.
- **TP all-reduce** (Megatron-LM, Shoeybi et al. 2019, Sec. 3): 2 in the
  forward and 2 in the backward per layer of ``s*b*h`` activation elements;
  ring all-reduce of ``n`` bytes over ``k`` ranks costs
  ``2(k-1)/k * n / bandwidth + 2(k-1) * latency`` (Patarasuk & Yuan 2009).
- **PP point-to-point**: per micro-batch one ``s*b*h`` activation forward and
  one gradient backward between neighbouring stages; with tied embeddings and
  ``pp > 1`` the embedding gradient is all-reduced between first and last stage.
- **Pipeline bubble** (1F1B, Narayanan et al. 2021 Sec. 2.2):
  ``t_pipeline = (m + pp - 1) * t_stage``, i.e. a bubble fraction
  ``(pp-1)/(m+pp-1)`` of the pipeline time.
- **DP gradient all-reduce** (ring) of the stage's gradient bytes over ``dp``;
  with the distributed optimizer, a reduce-scatter of gradients plus an
  all-gather of parameters.  Megatron DDP with ``overlap_grad_reduce`` hides it
  behind the backward of the last micro-batch: the exposed part is
  ``t_dp - min(dp_overlap * t_dp, backward of one micro-batch)``.
  ``dp_overlap = 0.5`` is an assumed default (buckets are ready only as the
  backward proceeds); set 0 for no overlap.
- **Optimizer step**: memory-bound AdamW, ``optimizer_bytes_per_param`` (30:
  read fp32 grad, master, m, v; write master, m, v and the bf16 copy) per local
  parameter at the profile's HBM bandwidth.

Bandwidths (:class:`Interconnect`): a group that fits in one node
(``gpus_per_node``, megatron rank order tp fastest, then dp, then pp) uses the
intra-node link, otherwise the inter-node one.  Defaults per GPU are
per-direction datasheet numbers (:data:`DEFAULT_INTERCONNECTS`).

Not modelled: activation recomputation, sequence parallelism's different
collectives, interleaved schedules, stragglers.  :meth:`CostModel.calibrate`
absorbs what the analytic model misses from live measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from jobruntime.config import ModelConfig
from jobruntime.flops import flops_per_token
from jobruntime.hardware import GPUProfile, get_gpu_profile

from .memory_model import STATE_BYTES, MemoryModel, Precision
from .strategy import Strategy


@dataclass(frozen=True, kw_only=True)
class Interconnect:
    """Link bandwidths (GB/s = 1e9 bytes/s, per direction) and per-hop latency (s)."""

    intra_node_gbs: float
    inter_node_gbs: float
    gpus_per_node: int = 8
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 2e-5
    source: str = ""


# Per-direction bandwidths: NVLink totals on datasheets are bidirectional.
DEFAULT_INTERCONNECTS: dict[str, Interconnect] = {
    "A100": Interconnect(
        intra_node_gbs=300.0,
        inter_node_gbs=25.0,
        source="A100 SXM4 NVLink3 600 GB/s bidirectional; HDR InfiniBand 200 Gb/s per GPU",
    ),
    "H100": Interconnect(
        intra_node_gbs=450.0,
        inter_node_gbs=50.0,
        source="H100 SXM5 NVLink4 900 GB/s bidirectional; NDR InfiniBand 400 Gb/s per GPU",
    ),
    "H200": Interconnect(
        intra_node_gbs=450.0,
        inter_node_gbs=50.0,
        source="H200 SXM NVLink4 900 GB/s bidirectional; NDR InfiniBand 400 Gb/s per GPU",
    ),
    "V100": Interconnect(
        intra_node_gbs=150.0,
        inter_node_gbs=12.5,
        source="V100 SXM2 NVLink2 300 GB/s bidirectional; EDR InfiniBand 100 Gb/s",
    ),
    "T4": Interconnect(
        intra_node_gbs=16.0,
        inter_node_gbs=12.5,
        source="PCIe Gen3 x16; 100 GbE",
    ),
    "L4": Interconnect(
        intra_node_gbs=32.0,
        inter_node_gbs=12.5,
        source="PCIe Gen4 x16; 100 GbE",
    ),
    "A10": Interconnect(
        intra_node_gbs=32.0,
        inter_node_gbs=12.5,
        source="PCIe Gen4 x16; 100 GbE",
    ),
}


def default_interconnect(gpu_name: str) -> Interconnect:
    """Default links for a GPU profile name (``"A100-80GB"`` matches ``"A100"``).

    Raises:
        KeyError: no default for that GPU; pass an ``Interconnect`` explicitly.
    """
    for key in sorted(DEFAULT_INTERCONNECTS, key=len, reverse=True):
        if gpu_name.upper().startswith(key):
            return DEFAULT_INTERCONNECTS[key]
    raise KeyError(
        f"no default interconnect for GPU '{gpu_name}'; known: {sorted(DEFAULT_INTERCONNECTS)}; "
        f"pass interconnect=Interconnect(...)"
    )


def ring_allreduce_s(nbytes: float, ranks: int, gbs: float, latency_s: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``ranks`` at ``gbs`` GB/s per link."""
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / (gbs * 1e9) + 2.0 * (ranks - 1) * latency_s


@dataclass(frozen=True)
class IterationEstimate:
    """Predicted time of one optimizer step; all times in seconds.

    ``analytic_s`` is the sum of the components; ``iter_s`` is it times the
    calibration ``correction`` (1.0 until measurements arrive).
    """

    strategy: Strategy
    compute_s: float  # m micro-batches of the slowest stage's compute
    bubble_s: float  # (pp - 1) stage slots of the pipeline fill and drain
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # exposed (not overlapped) part
    optimizer_s: float
    correction: float
    tokens_per_iter: int

    @property
    def analytic_s(self) -> float:
        return (
            self.compute_s
            + self.bubble_s
            + self.tp_comm_s
            + self.pp_comm_s
            + self.dp_comm_s
            + self.optimizer_s
        )

    @property
    def iter_s(self) -> float:
        return self.analytic_s * self.correction

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_iter / self.iter_s

    @property
    def samples_per_s(self) -> float:
        """Sequences per second."""
        return self.strategy.global_batch_size / self.iter_s


class CostModel:
    """Analytic iteration time of strategies for one model on one GPU type, plus calibration.

    Args:
        model_cfg: the target model (FLOPs and bytes).
        gpu: profile name (``jobruntime.hardware``) or a ``GPUProfile``.
        interconnect: links; ``None`` = :func:`default_interconnect` of the GPU.
        precision: as in :class:`cona.memory_model.MemoryModel` (bytes of
            activations, gradients and parameters on the wire).
        distributed_optimizer: reduce-scatter + all-gather instead of all-reduce,
            optimizer step on ``1/dp`` of the parameters.
        dp_overlap: fraction of the DP all-reduce that may hide behind the last
            micro-batch's backward (0..1, module docstring).
        optimizer_bytes_per_param: HBM traffic of one AdamW update per parameter.
        calibration: how measured corrections spread to un-measured strategies
            (see :meth:`correction`): ``"layout"``, ``"global"`` or ``"exact"``.
        calibration_weight: EMA weight of a new measurement in log space (0..1].

    Raises:
        KeyError: unknown GPU or no default interconnect for it.
        ValueError: a parameter out of range.
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        gpu: str | GPUProfile,
        *,
        interconnect: Interconnect | None = None,
        precision: Precision = "mixed",
        distributed_optimizer: bool = False,
        dp_overlap: float = 0.5,
        optimizer_bytes_per_param: float = 30.0,
        calibration: Literal["layout", "global", "exact"] = "layout",
        calibration_weight: float = 0.5,
    ) -> None:
        self.model = model_cfg
        self.gpu = get_gpu_profile(gpu) if isinstance(gpu, str) else gpu
        self.interconnect = interconnect or default_interconnect(self.gpu.name)
        if precision not in STATE_BYTES:
            raise ValueError(f"precision={precision!r} is not one of {sorted(STATE_BYTES)}")
        if not 0.0 <= dp_overlap <= 1.0:
            raise ValueError(f"dp_overlap={dp_overlap} must be in [0, 1]")
        if calibration not in ("layout", "global", "exact"):
            raise ValueError(f"calibration={calibration!r} must be layout, global or exact")
        if not 0.0 < calibration_weight <= 1.0:
            raise ValueError(f"calibration_weight={calibration_weight} must be in (0, 1]")
        self.precision = precision
        self.distributed_optimizer = distributed_optimizer
        self.dp_overlap = dp_overlap
        self.optimizer_bytes_per_param = optimizer_bytes_per_param
        self.calibration = calibration
        self.calibration_weight = calibration_weight
        self._memory = MemoryModel(
            model_cfg, precision=precision, distributed_optimizer=distributed_optimizer
        )
        self._log_factors: dict[Strategy, float] = {}

    # -- analytic model -----------------------------------------------------

    def _bw(self, group_span: int) -> tuple[float, float]:
        """(GB/s, latency) for a group whose ranks span ``group_span`` consecutive ranks."""
        ic = self.interconnect
        if group_span <= ic.gpus_per_node:
            return ic.intra_node_gbs, ic.intra_latency_s
        return ic.inter_node_gbs, ic.inter_latency_s

    def analytic(self, strategy: Strategy) -> IterationEstimate:
        """Uncalibrated estimate (what the emulated clock should use)."""
        m_cfg, st = self.model, strategy
        s, b, h = m_cfg.seq_length, st.micro_batch_size, m_cfg.hidden_size
        tp, pp, dp, n_mb = st.tp, st.pp, st.dp, st.num_microbatches
        weight_b, grad_b, _ = STATE_BYTES[self.precision]
        act_b = 4.0 if self.precision == "fp32" else 2.0
        tokens_mb = s * b

        # Compute of one micro-batch on the slowest (last) stage.
        logits_fpt = 6.0 * h * m_cfg.vocab_size
        layers_fpt = flops_per_token(m_cfg) - logits_fpt
        stage_fpt = layers_fpt / pp + logits_fpt
        flops_rate = self.gpu.achieved_flops(tokens_mb / tp)  # per-device GEMM size
        t_compute_mb = stage_fpt * tokens_mb / tp / flops_rate

        # TP: 4 all-reduces of s*b*h activations per layer (2 fwd + 2 bwd).
        gbs, lat = self._bw(tp)
        layers_per_stage = m_cfg.num_layers // pp
        t_tp_mb = layers_per_stage * 4 * ring_allreduce_s(tokens_mb * h * act_b, tp, gbs, lat)

        # PP: one activation forward and one gradient backward per micro-batch.
        gbs_pp, lat_pp = self._bw(st.world_size)
        t_pp_mb = 0.0
        if pp > 1:
            t_pp_mb = 2.0 * (tokens_mb * h * act_b / (gbs_pp * 1e9) + lat_pp)

        t_stage = t_compute_mb + t_tp_mb + t_pp_mb
        compute_s = n_mb * t_compute_mb
        bubble_s = (pp - 1) * t_stage

        # DP gradient sync of the largest stage's gradients.
        params = max(self._memory.stage_params(st))
        gbs_dp, lat_dp = self._bw(tp * dp)
        if self.distributed_optimizer:
            # reduce-scatter (grads) + all-gather (params): each half a ring all-reduce
            t_dp = 0.5 * ring_allreduce_s(params * (grad_b + weight_b), dp, gbs_dp, lat_dp)
        else:
            t_dp = ring_allreduce_s(params * grad_b, dp, gbs_dp, lat_dp)
        backward_window = t_compute_mb * 2.0 / 3.0
        dp_exposed = t_dp - min(self.dp_overlap * t_dp, backward_window)
        if pp > 1 and m_cfg.tie_embeddings:
            v = m_cfg.padded_vocab
            dp_exposed += ring_allreduce_s(v * h / tp * grad_b, 2, gbs_pp, lat_pp)

        local_params = params / dp if self.distributed_optimizer else params
        optimizer_s = local_params * self.optimizer_bytes_per_param / (self.gpu.memory_bw_gbs * 1e9)
        return IterationEstimate(
            strategy=st,
            compute_s=compute_s,
            bubble_s=bubble_s,
            tp_comm_s=n_mb * t_tp_mb,
            pp_comm_s=n_mb * t_pp_mb,
            dp_comm_s=dp_exposed,
            optimizer_s=optimizer_s,
            correction=1.0,
            tokens_per_iter=st.global_batch_size * s,
        )

    # -- calibrated predictions ---------------------------------------------

    def predict(self, strategy: Strategy) -> IterationEstimate:
        """Estimate with the calibration :meth:`correction` applied."""
        return replace(self.analytic(strategy), correction=self.correction(strategy))

    def iteration_time(self, strategy: Strategy) -> float:
        """Calibrated seconds per optimizer step."""
        return self.predict(strategy).iter_s

    def tokens_per_second(self, strategy: Strategy) -> float:
        return self.predict(strategy).tokens_per_s

    def samples_per_second(self, strategy: Strategy) -> float:
        """Calibrated sequences per second."""
        return self.predict(strategy).samples_per_s

    def calibrate(self, strategy: Strategy, measured_iter_s: float) -> float:
        """Record a measured iteration time; return the strategy's new correction factor.

        The factor is ``measured / analytic``, smoothed as an EMA in log space
        (weight ``calibration_weight``) over repeated measurements of the same
        strategy, so one slow step moves it only part of the way.

        Raises:
            ValueError: ``measured_iter_s`` is not a positive finite number.
        """
        if not (measured_iter_s > 0 and math.isfinite(measured_iter_s)):
            raise ValueError(f"measured_iter_s must be positive and finite, got {measured_iter_s}")
        log_ratio = math.log(measured_iter_s / self.analytic(strategy).analytic_s)
        old = self._log_factors.get(strategy)
        w = self.calibration_weight
        self._log_factors[strategy] = log_ratio if old is None else (1 - w) * old + w * log_ratio
        return math.exp(self._log_factors[strategy])

    def correction(self, strategy: Strategy) -> float:
        """Multiplicative correction for ``strategy``'s analytic time.

        1. a measured strategy uses its own factor;
        2. ``"layout"``: otherwise the geometric mean of the measured strategies
           with the same ``(tp, pp)`` (the layout fixes the communication share
           and kernel shapes, where the analytic model is least accurate; batch
           changes within a layout mostly rescale compute, which it captures);
        3. ``"layout"`` or ``"global"``: otherwise the geometric mean of all
           measured factors (a systematic bias such as a slower-than-profile GPU);
        4. otherwise 1.0.  ``"exact"`` stops after step 1.
        """
        if strategy in self._log_factors:
            return math.exp(self._log_factors[strategy])
        if self.calibration == "exact" or not self._log_factors:
            return 1.0
        if self.calibration == "layout":
            same = [
                f
                for s, f in self._log_factors.items()
                if (s.tp, s.pp) == (strategy.tp, strategy.pp)
            ]
            if same:
                return math.exp(sum(same) / len(same))
        vals = list(self._log_factors.values())
        return math.exp(sum(vals) / len(vals))

    def calibration_source(self, strategy: Strategy) -> str:
        """Where :meth:`correction` takes ``strategy``'s factor from: ``"measured"`` (its
        own), ``"layout"`` (same TP/PP measured), ``"global"`` (other layouts) or ``"none"``."""
        if strategy in self._log_factors:
            return "measured"
        if self.calibration == "exact" or not self._log_factors:
            return "none"
        if self.calibration == "layout" and any(
            (s.tp, s.pp) == (strategy.tp, strategy.pp) for s in self._log_factors
        ):
            return "layout"
        return "global"

    @property
    def measured(self) -> dict[Strategy, float]:
        """Correction factors of the measured strategies."""
        return {s: math.exp(f) for s, f in self._log_factors.items()}

    def reset_calibration(self) -> None:
        self._log_factors.clear()

    def state_dict(self) -> dict:
        """Calibration state (labels -> log factors), for checkpoints."""
        return {"log_factors": {s.label: f for s, f in self._log_factors.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._log_factors = {
            Strategy.from_label(k): float(v) for k, v in state["log_factors"].items()
        }
