"""The candidate strategies of a CONA run (pure logic, no process groups).

``cona.candidates`` if given, else every valid strategy for the device count
with global batch sizes ``cona.global_batch_sizes`` (target sequences; default:
the target batch of the configured global batch times 1, 2, 4, 8, see
:mod:`cona.mapping`) and micro-batch sizes 1, 2, 4, 8, filtered by per-device
memory (:class:`cona.memory_model.MemoryModel`, with what the noise-scale probe holds:
a gradient copy at DP = 1, a preconditioned definition's preconditioner) when a limit is
known; an explicit candidate that does not fit is refused.  Every
candidate's global batch must map to a whole number of proxy sequences.
"""

from __future__ import annotations

from jobruntime.config import ConfigError, JobConfig, ModelConfig
from jobruntime.memory import GIB, GPU_OVERHEAD_BYTES

from .mapping import ProxyMapping
from .memory_model import MemoryModel
from .probe import probe_state
from .strategy import Strategy, enumerate_strategies, strategies_from_dicts

AUTO_MICRO_BATCH_SIZES = (1, 2, 4, 8)


def global_batch_sizes(cfg: JobConfig, mapping: ProxyMapping | None = None) -> list[int]:
    """``cona.global_batch_sizes`` or the configured global batch (in target sequences)
    times 1, 2, 4, 8."""
    if cfg.cona.global_batch_sizes:
        return sorted({int(b) for b in cfg.cona.global_batch_sizes})
    gb = (mapping or ProxyMapping()).target_batch(cfg.parallel.global_batch_size)
    return [gb * k for k in (1, 2, 4, 8)]


def build_candidates(
    cfg: JobConfig,
    model: ModelConfig,
    world_size: int,
    *,
    mapping: ProxyMapping | None = None,
    memory_limit_bytes: float | None = None,
    precision: str = "mixed",
    overhead_bytes: float = GPU_OVERHEAD_BYTES,
) -> list[Strategy]:
    """Candidate strategies for ``model`` on ``world_size`` devices (module docstring).

    Args:
        memory_limit_bytes: per-device memory (bytes); ``None`` checks none.
        precision, overhead_bytes: the trainer's state precision and fixed allowance
            (:class:`jobruntime.memory.MemoryModel`).

    Raises:
        ValueError: an explicit candidate is invalid or does not fit
            ``memory_limit_bytes`` (:class:`~jobruntime.config.ConfigError`, naming it),
            a global batch does not map to whole proxy sequences, or no candidate is left.
    """
    mapping = mapping or ProxyMapping()
    # what the noise-scale probe holds (cona.probe): at DP = 1 a copy of the gradients,
    # and a preconditioned definition Adam's preconditioner at any DP
    probe = probe_state(cfg.cona.gns_definition)
    mem = (MemoryModel(model, precision=precision, overhead_bytes=overhead_bytes,
                       extra_bytes_per_param=probe.bytes_per_param,
                       extra_bytes_per_param_at_dp1=probe.bytes_per_param_at_dp1)
           if memory_limit_bytes else None)
    if cfg.cona.candidates:
        cands = strategies_from_dicts(cfg.cona.candidates, model, world_size)
        over = [c for c in cands if mem is not None and mem.peak_bytes(c) > memory_limit_bytes]
        if over:
            need = ", ".join(f"{c.label} {mem.peak_bytes(c) / GIB:,.2f} GiB" for c in over)
            raise ConfigError(
                f"cona.candidates: {len(over)} of them do not fit {memory_limit_bytes / GIB:,.2f} "
                f"GiB per device (estimated peak with CONA's noise-scale probe: {need}); drop "
                "them from cona.candidates (real mode: or set train.check_memory=false to run "
                "them anyway)")
    else:
        cands = enumerate_strategies(
            model,
            world_size,
            global_batch_sizes=global_batch_sizes(cfg, mapping),
            micro_batch_sizes=AUTO_MICRO_BATCH_SIZES,
            memory_limit_bytes=memory_limit_bytes,
            memory_model=mem,
        )
    for c in cands:
        mapping.proxy_batch(c.global_batch_size)  # raises if not whole proxy sequences
    if not cands:
        raise ValueError(
            f"no valid CONA candidate strategy for {world_size} devices; list "
            "cona.candidates or change cona.global_batch_sizes"
        )
    return cands
