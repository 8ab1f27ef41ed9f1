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

from dataclasses import replace

from jobruntime.config import ConfigError, JobConfig, ModelConfig
from jobruntime.memory import ExtraState, format_bytes

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
    memory_limit_what: str = "",
    memory_model: MemoryModel | None = None,
    check_explicit: bool = True,
) -> list[Strategy]:
    """Candidate strategies for ``model`` on ``world_size`` devices (module docstring).

    Args:
        memory_limit_bytes: per-device memory (bytes); ``None`` checks none.
        memory_limit_what: where that limit comes from, for a refusal (e.g. "host
            memory / 2 ranks on this node").
        memory_model: estimates each candidate's peak without the probe, which is
            added (default: ``MemoryModel(model)``, mixed precision on a GPU; real
            mode passes the trainer's, :func:`jobruntime.memory.trainer_memory_model`).
        check_explicit: refuse explicit candidates that do not fit (real mode with
            ``train.check_memory=false``: keep them).

    Raises:
        ValueError: an explicit candidate is invalid or does not fit
            ``memory_limit_bytes`` (:class:`~jobruntime.config.ConfigError`, naming it),
            a global batch does not map to whole proxy sequences, or no candidate is left.
    """
    mapping = mapping or ProxyMapping()
    # what the noise-scale probe holds (cona.probe): at DP = 1 a copy of the gradients,
    # and a preconditioned definition Adam's preconditioner at any DP
    probe = probe_state(cfg.cona.gns_definition)
    plain = memory_model or MemoryModel(model)
    mem = (replace(plain, extra_bytes_per_param=probe.bytes_per_param,
                   extra_bytes_per_param_at_dp1=probe.bytes_per_param_at_dp1)
           if memory_limit_bytes else None)
    if cfg.cona.candidates:
        cands = strategies_from_dicts(cfg.cona.candidates, model, world_size)
        over = [c for c in cands if check_explicit and mem is not None
                and mem.peak_bytes(c) > memory_limit_bytes]
        if over:
            raise ConfigError(_refusal(over, mem, plain, memory_limit_bytes, memory_limit_what,
                                       probe))
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


def _refusal(over: list[Strategy], mem: MemoryModel, plain: MemoryModel, limit: float,
             what: str, probe: ExtraState) -> str:
    """The message refusing explicit candidates ``over``: each one's estimate and the
    probe's share of it, the limit and where it comes from, and the fixes."""
    def need(c: Strategy) -> str:
        share = mem.peak_bytes(c) - plain.peak_bytes(c)
        of_which = f", of which {format_bytes(share)} {probe.what}" if share > 0 else ""
        return f"{c.label} needs {format_bytes(mem.peak_bytes(c))}{of_which}"

    fixes = sorted({f for c in over for f in probe.fixes(c.dp)
                    if mem.peak_bytes(c) > plain.peak_bytes(c)})
    where = f" ({what})" if what else ""
    return (f"cona.candidates: {'; '.join(need(c) for c in over)}: more than "
            f"{format_bytes(limit)} per device{where}; drop "
            f"{'it' if len(over) == 1 else 'them'} from cona.candidates"
            + "".join(f", or {f}" for f in fixes)
            + " (real mode: or set train.check_memory=false to run anyway)")
