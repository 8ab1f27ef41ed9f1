"""The ``geomesh`` section: geo-distributed synchronous training (``geomesh/``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .base import ConfigError


@dataclass(kw_only=True)
class GeoMeshConfig:
    """GeoMesh: geo-distributed synchronous training (see ``geomesh/``)."""

    method: Literal["none", "geomesh", "diloco", "streaming_diloco", "ddp", "async"] = "none"
    """``none`` trains one ordinary job; others run the named method
    (``streaming_diloco``: emulated mode only, ``geomesh/streaming.py``)."""
    cluster: str | None = None
    """Cluster description YAML (workers, GPUs, regions, WAN, mode)."""
    outer_steps: int = 10
    """Outer steps (rounds) to run."""
    outer_lr: float = 0.7
    """Outer Nesterov SGD learning rate (DiLoCo default)."""
    outer_momentum: float = 0.9
    """Outer Nesterov momentum (DiLoCo default)."""
    outer_momentum_warmup: bool = True
    """Ramp the outer momentum from 0.5 to ``outer_momentum`` as
    ``min(μ, 1 − 3/(t+5))`` over outer steps ``t`` (Nesterov's schedule; not in
    DiLoCo's paper, for every method alike); ``false``: ``outer_momentum`` from
    the first step, DiLoCo's Alg. 1, with which ``method=diloco`` gives torchft's
    ``DiLoCo`` θ bit for bit (``tests/test_geomesh_torchft_diloco.py``).  For
    diloco on the quick bench the ramp gave final val ppl 723.9 against 803.9 at
    its best outer lr without it (``docs/results/diloco_momentum_ramp.json``)."""
    inner_steps: int = 20
    """Inner steps ``H`` per round for uniform methods; GeoMesh's planner
    targets ``inner_steps * global_batch_size`` tokens-worth per round."""
    error_feedback: bool = True
    """Keep the compression residual (in host memory) and add it to the next
    round's pseudo-gradient (error feedback, Karimireddy et al. 2019)."""
    error_feedback_decay: float = 0.5
    """Factor on the error-feedback residual kept for the next round (1: all
    of it, EF-signSGD; 0.5, measured best with top-k: the next round's inner
    steps re-derive much of what was not sent, ``geomesh/feedback.py``)."""
    balance: Literal["steps", "batch"] = "steps"
    """How GeoMesh's planner equalises compute time: faster workers run more
    inner steps ``H_i`` at about the uniform per-worker batch ``G/K``
    (``steps``, default: every step has the batch ``train.lr`` is meant for),
    or larger batches ``b_i`` at about ``inner_steps`` steps (``batch``)."""
    plan_tolerance: float = 0.05
    """GeoMesh's planner: allowed relative spread of the workers' compute time
    per round.  The planner picks the fastest plan per token within it; 0.02
    halves the straggler idle of the four-region cluster (imbalance 0.7 %
    instead of 1.9 %) at 1.9 % more seconds per token (``geomesh/fleet/planner.py``)."""
    inner_lr_scaling: Literal["none", "sqrt", "linear"] = "none"
    """How a worker's inner learning rate follows its batch ``b_i``, relative to
    the uniform per-worker batch ``G/K`` for which ``train.lr`` is meant:
    unchanged (``none``, default: measured better with the outer Nesterov
    step), ``lr · (b_i K / G)^{1/2}`` (``sqrt``) or linear.  Uniform methods
    (DiLoCo, async) are unaffected."""
    compression: Literal["sign_row", "sign_pred", "sign", "topk", "fp32"] = "topk"
    """GeoMesh's pseudo-gradient codec: the ``topk_k`` largest of every 256
    elements of a row, position + 2-bit value (``topk``, default: 32.8x less
    than fp32 on GPT-3 1.3B; ``geomesh/wire/sparse.py``; real-mode workers with
    TP > 1 fall back to ``sign_row``); sign bits with one fp32 magnitude per
    row of every matrix (``sign_row``, 31.6x), the same for the part the
    outer momentum does not predict plus one coefficient per row
    (``sign_pred``, ``geomesh/wire/predict.py``), one magnitude per tensor
    (``sign``), or none (``fp32``, an ablation).  Measured by
    ``bench/geomesh_ttp.py --ablation``."""
    compress_update: bool = False
    """GeoMesh: compress each worker's momentum-corrected outer update
    ``Δ_i + μ v_i`` (its own momentum ``v_i``, 1-bit Adam's order; every worker
    applies the aggregate directly) instead of the pseudo-gradient ``Δ_i``
    (DiLoCo's order, one global momentum).  Same step without compression;
    with error feedback the parameter error stays bounded by the current
    residual (``geomesh/feedback.py``)."""
    overlap: float | None = None
    """GeoMesh: hide the exchange behind compute: the messages of round ``r`` travel
    while each worker runs the first ``⌈overlap · H_i⌉`` inner steps of round
    ``r+1`` from an estimate of the next θ_global (the eager update: its own
    message at its token share, the last aggregate for the others',
    ``geomesh/eager.py``); then it moves onto the new ``θ_global`` keeping that
    progress (1 = a one-round-delayed outer update).  ``0.1`` covers the
    four-region cluster's exchange (its WAN idle and perplexity cost:
    ``bench/geomesh_ttp.py --ablation``).
    ``null`` (default): blocking rounds.  Checkpoint rounds and the last round
    are not overlapped (``geomesh/sync.py``).  The baselines (DiLoCo, DDP,
    async) never overlap."""
    topk_k: int = 24
    """``compression=topk``: elements kept of every 256 of a row (with 2-bit
    values: 24 → 32.8x less than fp32 on GPT-3 1.3B, counted from the encoded
    bytes; 7 → 99.7x, 6 → 110.5x, the sparse mode: run it at a larger
    ``outer_lr``, 1.0-1.4, its messages make smaller steps;
    ``bench/geomesh_ttp.py --ablation``)."""
    topk_bits: int = 2
    """``compression=topk``: bits per kept value, 1 (sign, one magnitude per
    row) or 2 (sign and a level bit, two magnitudes per row)."""
    fragments: int = 2
    """``method=streaming_diloco``: fragments ``P`` the model is split into (transformer
    layers strided, layer ``l`` in fragment ``l mod P``, embeddings with the first,
    final norm and output layer with the last; Douillard et al. 2025, "Streaming
    DiLoCo", strided pattern).  One fragment is synchronised every ``H/P`` inner
    steps, each every ``H`` (torchft's ``DiLoCo(model_fragments=...)``).  2:
    torchtitan's torchft DiLoCo example (``num_fragments=2``).  Must divide
    ``inner_steps``."""
    fragment_sync_delay: int = 1
    """``method=streaming_diloco``: ``τ``, inner steps a fragment's exchange overlaps
    before the worker blocks on it (torchft's ``fragment_sync_delay``; the paper's
    τ, of which 1 step cost it no loss; torchft's default 0 = no overlap).  Must
    be below ``inner_steps / fragments``."""
    fragment_update_alpha: float = 0.5
    """``method=streaming_diloco``: ``α`` of the merge ``θ_i ← (1−α)·θ_global + α·θ_i``
    of a synchronised fragment with the worker's τ steps of local progress
    (torchft's ``fragment_update_alpha``, ``lerp``; the paper's mixing factor 0.5;
    torchft's default 0 keeps only θ_global).  In [0, 1]."""
    fragment_bits: int = 32
    """``method=streaming_diloco``: bits per element of the fragments' pseudo-gradients
    on the wire: 32 (fp32), 8 (fp8 e4m3 with one fp32 scale per row: torchft's
    ``should_quantize`` format) or 4 (E3M0: sign and 3 exponent bits, one fp32
    scale per row: the paper's 4-bit messages); emulated (``geomesh/streaming.py``)."""
    target_model: str | None = None
    """Emulated mode: preset whose FLOPs and bytes set time and traffic.  Real mode
    measures both and ignores it (with a warning), but a value that names no preset
    fails validation in either mode: the cluster file may set the mode."""
    timeout_s: float = 600.0
    """Real mode: seconds to wait for a region before failing with its name."""
    mode: Literal["emulated", "real"] | None = None
    """Override the cluster file's mode (``None`` = the file's)."""
    region: str | None = None
    """Real mode with one ``torchrun`` per region: the region this job plays
    (its processes join the others at the cluster's ``rendezvous``).  ``None``
    = this ``torchrun`` plays every worker of the cluster."""
    wan_bandwidth_scale: float | None = None
    """Multiply every WAN bandwidth of the cluster (``None`` = the file's scale)."""
    replan: bool = True
    """Re-plan ``b_i``, ``H_i`` when measured speeds drift (method ``geomesh``)."""
    eval_interval: int = 1
    """Outer steps between validation evaluations (and at the last one)."""
    on_worker_loss: Literal["continue", "fail"] = "continue"
    """Real mode, one job per region: when a worker is lost (crashed, stalled
    past ``heartbeat_s``, or its message rejected), the others finish the
    round without it and go on (``continue``; it may rejoin at a round
    boundary), or every job stops with one line naming it (``fail``)."""
    heartbeat_s: float = 10.0
    """Real mode, one job per region: seconds without a heartbeat after which
    a worker counts as lost (the lighthouse's heartbeat timeout; give the
    lighthouse the same ``--heartbeat-s``)."""
    secret_file: str | None = None
    """Real mode: file holding the run's secret that authenticates messages
    (HMAC-SHA256); ``None`` = the ``GEOMESH_SECRET`` environment variable.
    Never give the secret itself on the command line."""
    max_norm_ratio: float = 10.0
    """A message whose pseudo-gradient norm exceeds this multiple of the other
    workers' median (or of its own history) is rejected (``geomesh/wire/guard.py``)."""
    token_tolerance: float = 0.05
    """A message whose token count is off the plan's by more than this
    fraction is rejected."""
    robust_aggregation: Literal["none", "sign_majority", "trimmed_mean"] = "none"
    """Aggregate by a token-weighted majority of signs, or with trimmed-mean
    scales, instead of equation (1) (``geomesh/wire/guard.py``)."""

    @property
    def inner_lr_rule(self) -> str:
        """``inner_lr_scaling`` where it applies: method ``geomesh``, whose planner gives
        workers different batches; ``none`` for the uniform methods, whose per-worker
        batch only rounds ``G/K`` (they were scaled by that rounding, 0.89x-1.1x on
        four_region with ``sqrt``)."""
        return self.inner_lr_scaling if self.method == "geomesh" else "none"

    def validate(self) -> None:
        """Check this section's settings (ranges, combinations, torchft's fragment schedule):
        config only, no cluster file (``geomesh.fleet.cluster.load_cluster`` checks that).

        Raises:
            ConfigError: the first bad setting, named, with the fix.
        """
        g = self
        if g.method != "none" and not g.cluster:
            raise ConfigError(
                f"geomesh.method={g.method} needs geomesh.cluster=FILE (a cluster YAML, e.g. "
                "geomesh/clusters/four_region.yaml)"
            )
        if g.target_model is not None:
            from .loading import check_preset  # loading imports this module

            check_preset(g.target_model, "geomesh.target_model")
        for name in ("outer_steps", "inner_steps", "eval_interval"):
            if getattr(g, name) <= 0:
                raise ConfigError(f"geomesh.{name} must be positive, got {getattr(g, name)}")
        if not g.timeout_s > 0:
            raise ConfigError(f"geomesh.timeout_s must be positive, got {g.timeout_s}")
        if not 0 < g.outer_lr < float("inf"):
            raise ConfigError(f"geomesh.outer_lr must be a positive number, got {g.outer_lr} "
                              "(DiLoCo's default is 0.7)")
        if g.compression == "sign_pred" and g.compress_update:
            raise ConfigError("geomesh.compression=sign_pred predicts from the global outer momentum; "
                              "it needs geomesh.compress_update=false")
        if not 1 <= g.topk_k <= 256 or g.topk_bits not in (1, 2):
            raise ConfigError(f"geomesh.topk_k must be in [1, 256] (kept of every 256) and "
                              f"geomesh.topk_bits 1 or 2, got {g.topk_k} and {g.topk_bits}")
        if not 0 <= g.error_feedback_decay <= 1:
            raise ConfigError(f"geomesh.error_feedback_decay must be in [0, 1], got "
                              f"{g.error_feedback_decay}")
        if not 0 < g.plan_tolerance < 1:
            raise ConfigError(f"geomesh.plan_tolerance must be above 0 and below 1, got "
                              f"{g.plan_tolerance}")
        if g.overlap is not None and not 0 <= g.overlap <= 1:
            raise ConfigError(f"geomesh.overlap must be in [0, 1] (the share of a round's inner steps "
                              f"behind which the previous exchange runs) or null, got {g.overlap}")
        if g.overlap is not None and g.region:
            raise ConfigError("geomesh.overlap does not combine with geomesh.region (one torchft job "
                              "per region: quorum, healing); unset geomesh.overlap")
        if not 0 <= g.outer_momentum < 1:
            raise ConfigError(f"geomesh.outer_momentum must be in [0, 1), got {g.outer_momentum} "
                              "(DiLoCo's default is 0.9)")
        if not 0 < g.heartbeat_s < float("inf") or (g.region and g.heartbeat_s > g.timeout_s):
            raise ConfigError(f"geomesh.heartbeat_s={g.heartbeat_s} must be positive and at most "
                              f"geomesh.timeout_s={g.timeout_s} (default 10 s)")
        if not 1 < g.max_norm_ratio < float("inf"):
            raise ConfigError(f"geomesh.max_norm_ratio={g.max_norm_ratio} must be a number above 1 "
                              "(default 10)")
        if g.wan_bandwidth_scale is not None and not 0 < g.wan_bandwidth_scale < float("inf"):
            raise ConfigError(f"geomesh.wan_bandwidth_scale={g.wan_bandwidth_scale} must be a "
                              "positive number (or null: the cluster file's)")
        self._validate_streaming()
        if not 0 <= g.token_tolerance < 1:
            raise ConfigError(f"geomesh.token_tolerance={g.token_tolerance} must be in [0, 1) "
                              "(default 0.05)")

    def _validate_streaming(self) -> None:
        """torchft's constraints on the fragment schedule (``torchft.local_sgd.DiLoCo``): the
        ranges for every method (a bad value is refused whatever reads it), the fit with
        ``inner_steps`` where ``method=streaming_diloco`` runs it."""
        g = self
        P, H, tau = g.fragments, g.inner_steps, g.fragment_sync_delay
        if P < 1:
            raise ConfigError(f"geomesh.fragments={P} must be >= 1 (default 2)")
        if tau < 0:
            raise ConfigError(f"geomesh.fragment_sync_delay={tau} must be >= 0 (0 = no overlap)")
        if not 0 <= g.fragment_update_alpha <= 1:
            raise ConfigError(f"geomesh.fragment_update_alpha={g.fragment_update_alpha} must be in "
                              "[0, 1]")
        if g.fragment_bits not in (32, 8, 4):
            raise ConfigError(f"geomesh.fragment_bits={g.fragment_bits}: use 32, 8 or 4")
        if g.method != "streaming_diloco":
            return
        if H % P:
            raise ConfigError(f"geomesh.fragments={P} must divide geomesh.inner_steps={H} "
                              "(one fragment is synchronised every inner_steps/fragments steps)")
        if tau >= H // P:
            raise ConfigError(f"geomesh.fragment_sync_delay={tau} must be in [0, inner_steps/fragments"
                              f" = {H // P}) (a fragment is synchronised before it is sent again)")
