"""Metrics sinks of a run: ``metrics.jsonl``, ``summary.json`` and wandb.

Every record carries the time on the run's clock: ``"wall"`` (seconds since
the run started) or ``"emulated"`` (seconds of a modelled cluster, see
``geomesh/`` and ``cona/``).  :class:`TTPTracker` records the
time-to-target-perplexity (TTP): the clock time and tokens at which
validation perplexity crossed ``target_ppl``, interpolated between the
evaluations on either side of the crossing (:func:`crossing_fraction`), and
the step of the first evaluation at or below it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

log = logging.getLogger("jobruntime")


def perplexity(loss: float) -> float:
    """exp(loss), capped to avoid overflow for diverged runs."""
    return math.exp(min(loss, 50.0))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file and rename (never half-written)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def _cpu_has(flag: str) -> bool:
    """Whether ``/proc/cpuinfo`` lists CPU flag ``flag`` (Linux; ``False`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and flag in line.split() for line in f)
    except OSError:
        return False


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """Where a bench result comes from, for the JSON it writes: ``date`` (UTC, ISO),
    ``commit`` (short hash of the repository's HEAD, ``+dirty`` with uncommitted
    changes; ``None`` outside a git checkout; the ``GEOCONA_COMMIT`` environment variable
    instead where set: a copy of the tree sent to another machine, such as the GPU
    machine's, may carry no ``.git`` or a stale one, and whoever sent it knows the commit),
    ``machine`` (CPU count and model, the
    vector instruction set torch's CPU kernels use, e.g. ``AVX2`` or ``AVX512``, and
    ``AMX-BF16`` where the CPU has it (oneDNN's bf16 matmuls then run on AMX): results
    of the same commit can differ between them; GPU name where CUDA is present) and
    ``command`` (``argv``, default ``sys.argv``)."""
    import datetime
    import platform
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    given = os.environ.get("GEOCONA_COMMIT")
    commit = given or git("rev-parse", "--short", "HEAD") or None
    if commit and not given and git("status", "--porcelain", "--untracked-files=no"):
        commit += "+dirty"
    machine = f"{os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}"
    try:
        import torch

        machine += f", {torch.backends.cpu.get_cpu_capability()}"
        if _cpu_has("amx_bf16"):  # oneDNN's bf16 matmuls run on AMX tiles: other roundings
            machine += ", AMX-BF16"
        if torch.cuda.is_available():
            machine += f", {torch.cuda.get_device_name()}"
    except ImportError:
        pass
    return {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "commit": commit, "machine": machine,
            "command": " ".join(["python", *(sys.argv if argv is None else argv)])}


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every float that is not finite (NaN, +-inf) replaced by ``None``.

    Recurses into dicts, lists and tuples (tuples become lists, as JSON has them);
    numbers that are not ``float`` but convert to one (numpy scalars, 0-d tensors) are
    converted first.  Other values are returned unchanged.
    """
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def _json_number(obj: Any) -> Any:
    """``json.dumps``'s ``default``: a number JSON does not know (numpy scalar, 0-d
    tensor) as a float, ``None`` where it is not finite.

    Raises:
        TypeError: ``obj`` does not convert to a float (as ``json.dumps`` would).
    """
    try:
        x = float(obj)
    except (TypeError, ValueError):
        raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable") from None
    return x if math.isfinite(x) else None


def json_text(obj: Any, **kwargs: Any) -> str:
    """``obj`` as strict JSON text (RFC 8259): what every file and report of the project
    that users or tools read is written with (``metrics.jsonl``, ``summary.json``, the
    tools' and benches' JSON).

    Python's ``json`` writes a float that is not finite as the bare tokens ``NaN`` /
    ``Infinity``, which strict parsers (``jq``, JavaScript, many exporters) reject.  Here
    such a value becomes ``null`` (:func:`finite_or_none`; numpy scalars and 0-d tensors
    are converted to floats first), and the text is written with ``allow_nan=False``, so
    that no value can slip through as a bare ``NaN``.

    Args:
        obj: dicts, lists, tuples, strings, numbers, bools, ``None`` (nested).
        kwargs: passed to :func:`json.dumps` (``indent``, ``sort_keys`` ...; not
            ``allow_nan`` or ``default``).

    Raises:
        TypeError: a value that is neither JSON nor convertible to a float.
    """
    return json.dumps(finite_or_none(obj), allow_nan=False, default=_json_number, **kwargs)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as strict JSON (:func:`json_text`: a non-finite number is ``null``,
    indented by 2) to ``path`` via a temp file and rename (never half-written).

    Raises:
        TypeError: ``obj`` holds a value JSON cannot hold (:func:`json_text`).
    """
    write_text_atomic(path, json_text(obj, indent=2) + "\n")


def publish_json(report: dict, out: Path | None = None, argv: list[str] | None = None) -> dict:
    """A bench's result as it leaves the bench: ``report`` with :func:`provenance` added
    (``argv``: the command; default ``sys.argv``), written to ``out`` (atomically) where
    given, and printed as JSON (both strict, :func:`json_text`); returns the report."""
    report.update(provenance(argv))
    if out is not None:
        write_json_atomic(out, report)
    print(json_text(report, indent=2))
    return report


def crossing_fraction(ppl_above: float, ppl_at: float, target: float) -> float:
    """Where between two evaluations the validation perplexity crossed ``target``.

    The curve between the evaluations is taken piecewise linear in *log*
    perplexity (the validation loss, nats/token), not in perplexity: the loss
    is what falls roughly linearly over a short stretch of training, while
    perplexity = exp(loss) is convex in it, so linear interpolation of
    perplexity would put the crossing systematically late.

    Args:
        ppl_above: perplexity of the last evaluation above the target.
        ppl_at: perplexity of the first evaluation at or below it.
        target: the target perplexity, ``ppl_at <= target < ppl_above``.

    Returns:
        ``f`` in [0, 1] with ``log target = (1 - f) log ppl_above + f log ppl_at``
        (1.0 when ``ppl_above`` is not finite: no usable earlier point).
    """
    if not math.isfinite(ppl_above) or not ppl_at <= target < ppl_above:
        return 1.0
    hi, lo = math.log(ppl_above), math.log(ppl_at)
    return min(max((hi - math.log(target)) / (hi - lo), 0.0), 1.0)


def dense_eval_gap(evals: list[tuple[float, float]], target: float | None,
                   resolution: float, start: float = 0.0) -> float | None:
    """How far ahead to evaluate so that the TTP crossing is bracketed finely.

    The TTP interpolation (:func:`crossing_fraction`) is only as fine as the gap
    between the two evaluations that bracket the crossing.  Evaluating at a fixed
    cadence makes that gap a different share of each run's time to target (a run at
    a large batch crosses within one gap of a few steps); this rule aims to make it
    ``resolution`` of the samples trained since ``start``.  It predicts the samples
    still to go, ``d = (log p_last - log target) / (-slope)``, and returns
    ``max(d / 2, resolution * (s_last - start))``: the gaps halve as the target nears,
    down to the resolution.  ``slope`` (the change of log perplexity per sample) is
    the steeper of two secants: the last two evaluations' and the run's (its first
    evaluation to its last; evaluations that are not finite and positive are
    skipped).  Log perplexity is convex and falling in samples, so the run's secant
    overstates the rate ahead and ``d`` errs short (more evaluations); the last
    two's alone is at the mercy of one noisy evaluation near the target, where the
    curve is flat: a small rise between them turned the rule off, and a flat pair
    put the prediction far ahead, so the crossing fell between two evaluations of
    the cadence (up to about 10 % of a run apart in the run at ``813f09b``,
    ``docs/results/cona_ttp_2026-12-07_two_point.json``, against the 1 % asked).
    The gap is a target, not a bound: where the curve falls faster than either
    secant, the bracket is wider (up to 3 % of a run in the run after it).

    Args:
        evals: ``(samples, perplexity)`` of the run's evaluations so far, in order
            (samples in any unit: sequences or tokens; the gap is in the same unit).
        target: the target perplexity (``None``: no target, no rule).
        resolution: the finest gap as a fraction of the samples since ``start``
            (``0``: off).
        start: the samples at the start of the run (a warm start's count).

    Returns:
        The gap to the next evaluation (``> 0``), or ``None`` where the rule does not
        apply (off, fewer than two finite evaluations, the target already reached, or
        perplexity not falling by either secant): the caller keeps its fixed cadence.
        The caller should take the earlier of the two, so the rule only adds
        evaluations.
    """
    if resolution <= 0 or target is None or target <= 0:
        return None
    def usable(p: float) -> bool:
        return math.isfinite(p) and p > 0

    if not evals or not usable(evals[-1][1]):
        return None
    points = [(s, math.log(p)) for s, p in evals if usable(p)]
    if len(points) < 2:
        return None
    (s_first, y_first), (s0, y0), (s1, y1) = points[0], points[-2], points[-1]
    if y1 <= math.log(target):
        return None
    secants = [(y1 - y) / (s1 - s) for s, y in ((s0, y0), (s_first, y_first)) if s1 > s]
    slope = min(secants, default=0.0)
    if slope >= 0:
        return None
    to_go = (y1 - math.log(target)) / -slope
    return max(to_go / 2, resolution * (s1 - start))


def target_reached_line(target_ppl: float, step: str, time_s: float, clock: str) -> str:
    """The log line of the first evaluation at or below the target perplexity, e.g.
    ``target perplexity 300 reached at the evaluation of step 125 (99.9 s, wall clock;
    TTP is interpolated between evaluations)``.  ``step`` names the step (``"step 125"``,
    ``"outer step 4"``); ``time_s`` is that evaluation's clock, seconds.  The results line's
    TTP is earlier: :class:`TTPTracker` interpolates the crossing."""
    return (f"target perplexity {target_ppl:g} reached at the evaluation of {step} "
            f"({time_s:,.1f} s, {clock} clock; TTP is interpolated between evaluations)")


@dataclass
class TTPTracker:
    """Time-to-target-perplexity, interpolated at the crossing of the target.

    Fed the evaluations in order (clock time ``t_j``, perplexity ``p_j``), TTP
    is the time at which the piecewise-linear interpolation of ``log p`` between
    the last evaluation above the target and the first at or below it crosses
    ``log target`` (:func:`crossing_fraction`); when the first evaluation of the
    run is already at or below the target, it is that evaluation's time.  Taking
    the first evaluation's time instead made TTP jump by a whole evaluation
    interval when a curve crossed the target just after an evaluation.

    Attributes:
        target_ppl: target validation perplexity (``None``: never reached).
        ttp_s: interpolated clock seconds of the crossing, else ``None``.
        ttp_tokens: training tokens at the crossing (interpolated the same way).
        ttp_step: step (GeoMesh: outer step) of the first evaluation at or below
            the target ("reached at step N").
        reached_s: clock seconds of that evaluation (``>= ttp_s``).
        crossing: fraction of the way from the last evaluation above the target
            to ``ttp_step``'s evaluation at which the target was crossed (1.0
            without an earlier evaluation).
        above_s, above_tokens, above_ppl: the last evaluation above the target
            (``None`` before the first evaluation).
    """

    target_ppl: float | None
    ttp_s: float | None = None
    ttp_tokens: int | None = None
    ttp_step: int | None = None
    reached_s: float | None = None
    crossing: float | None = None
    above_s: float | None = None
    above_tokens: int | None = None
    above_ppl: float | None = None

    def update(self, val_ppl: float, time_s: float, tokens: int, step: int) -> bool:
        """Record an evaluation (perplexity, clock seconds, training tokens, step);
        return True the first time the target is reached."""
        if self.target_ppl is None or self.reached:
            return False
        if not val_ppl <= self.target_ppl:  # above (or NaN): the crossing is later
            self.above_s, self.above_tokens, self.above_ppl = time_s, tokens, val_ppl
            return False
        f = 1.0 if self.above_s is None else crossing_fraction(self.above_ppl, val_ppl,
                                                               self.target_ppl)
        t0, n0 = (time_s, tokens) if self.above_s is None else (self.above_s, self.above_tokens)
        self.ttp_s = t0 + f * (time_s - t0)
        self.ttp_tokens = round(n0 + f * (tokens - n0))
        self.ttp_step, self.reached_s, self.crossing = step, time_s, f
        return True

    @property
    def reached(self) -> bool:
        return self.ttp_s is not None

    def summary(self) -> dict:
        """The ``summary.json`` fields: ``ttp_s``, ``ttp_tokens``, ``ttp_step`` and
        ``ttp_reached_s`` (the clock at ``ttp_step``'s evaluation)."""
        return {"ttp_s": self.ttp_s, "ttp_tokens": self.ttp_tokens, "ttp_step": self.ttp_step,
                "ttp_reached_s": self.reached_s}

    @classmethod
    def from_state(cls, state: dict, target_ppl: float | None) -> TTPTracker:
        """Restore from ``asdict(tracker)`` of a checkpoint; ``target_ppl`` is the run's.

        A state saved before interpolation (only ``ttp_s``, ``ttp_tokens``,
        ``ttp_step``) keeps its TTP as it was: the reaching evaluation's time
        (``reached_s``) with no crossing fraction recorded.
        """
        known = {f.name for f in fields(cls)} - {"target_ppl"}
        out = cls(target_ppl, **{k: v for k, v in state.items() if k in known})
        if out.ttp_s is not None and out.reached_s is None:
            out.reached_s = out.ttp_s
        return out


def run_method(config: dict) -> str:
    """What kind of run a resolved config (``config.yaml``, ``JobConfig.to_dict()``)
    describes: the GeoMesh method (``geomesh``, ``diloco``, …), ``cona`` or ``single``
    (an ordinary job) — the ``method``/``mode`` a finished run's summary names."""
    method = (config.get("geomesh") or {}).get("method", "none")
    if method != "none":
        return method
    return "cona" if (config.get("cona") or {}).get("enabled") else "single"


def read_records(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (``[]`` if there is none), skipping a torn
    last line of a run stopped while writing it."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def summary_from_records(records: list[dict], config: dict) -> dict:
    """The ``summary.json`` fields that a run's records and config determine: for a run
    without a summary (interrupted: ``train.py`` writes this one; ``tools/compare_runs.py``).

    TTP is what the run's :class:`TTPTracker` computes, fed the same evaluations
    (records with ``val_ppl``: clock ``time_s``, ``tokens`` — the last seen where an
    evaluation record has none, as CONA's final ``eval`` — and ``step``) against
    ``train.target_ppl`` of ``config``.

    Args:
        records: ``metrics.jsonl`` records in order (:func:`read_records`).
        config: the resolved config (``config.yaml``).

    Returns:
        ``method``, ``mode`` (what a finished run's summary says: ``single``, ``cona``,
        or GeoMesh's cluster mode, ``emulated`` or ``real``), ``clock``, ``target_ppl``,
        ``ttp_s``, ``ttp_tokens``, ``ttp_step``, ``ttp_reached_s``, ``final_val_ppl``
        (the last evaluation, ``None`` without), ``steps`` (the last recorded step;
        GeoMesh: outer steps), ``samples`` and ``tokens`` (the last recorded; ``None``
        where no record has them), ``time_s`` (clock seconds of the last record) and,
        for CONA, ``switches`` (the number of ``switch`` events) and ``decisions`` (the
        ``decision`` records); for GeoMesh also ``outer_steps`` (= ``steps``, the name
        its finished summary uses).
    """
    target = (config.get("train") or {}).get("target_ppl")
    ttp, tokens, samples, final = TTPTracker(target), None, None, None
    for r in records:
        tokens, samples = r.get("tokens", tokens), r.get("samples", samples)
        if r.get("val_ppl") is not None and r.get("time_s") is not None:
            final = r["val_ppl"]
            ttp.update(final, r["time_s"], tokens or 0, r.get("step"))
    method = run_method(config)
    clock = records[0].get("clock") if records else None
    mode = method  # ``single`` or ``cona``; GeoMesh's is its cluster's, which the clock tells
    if method not in ("single", "cona"):
        mode = None if clock is None else ("emulated" if clock == "emulated" else "real")
    out = {"method": method, "mode": mode, "clock": clock,
           "target_ppl": target, **ttp.summary(), "final_val_ppl": final,
           "steps": max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0),
           "samples": samples, "tokens": tokens,
           "time_s": next((r["time_s"] for r in reversed(records) if "time_s" in r), None)}
    if mode in ("emulated", "real"):  # a GeoMesh summary counts outer steps by that name
        out["outer_steps"] = out["steps"]
    if method == "cona":
        out["switches"] = sum(r.get("event") == "switch" for r in records)
        out["decisions"] = [{k: v for k, v in r.items() if k not in ("event", "clock", "time_s")}
                            for r in records if r.get("event") == "decision"]
    return out


@dataclass
class MetricsWriter:
    """Writes metrics of one run to its run directory and (optionally) wandb.

    Only the logging rank should create one with ``enabled=True``; other ranks
    get a disabled writer whose methods do nothing.

    A ``metrics.jsonl`` already in ``run_dir`` (a reused folder, or the run
    being resumed) keeps only its records before the first step this writer
    logs: a resumed run continues its history, a fresh run replaces it.
    """

    run_dir: Path
    clock: str = "wall"
    mode: str = "single"
    enabled: bool = True
    wandb_mode: str = "offline"
    wandb_project: str = "geocona"
    wandb_group: str | None = None
    wandb_name: str | None = None
    config: dict = field(default_factory=dict)
    _file: Any = None
    _wandb: Any = None

    def __post_init__(self):
        if self.clock not in ("wall", "emulated"):
            raise ValueError(f"clock must be 'wall' or 'emulated', got {self.clock!r}")
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.wandb_mode != "disabled":
            try:
                import wandb

                os.environ.setdefault("WANDB_SILENT", "true")
                self._wandb = wandb.init(
                    project=self.wandb_project,
                    group=self.wandb_group,
                    name=self.wandb_name,
                    mode=self.wandb_mode,
                    dir=str(self.run_dir),
                    config={**self.config, "clock": self.clock, "mode": self.mode},
                    reinit="finish_previous",
                )
            except Exception as e:  # wandb must never kill a training run
                log.warning("wandb disabled: %s", e)
                self._wandb = None

    def log(self, record: dict) -> None:
        """Append one record (must contain ``step``) to metrics.jsonl (one line of strict
        JSON, :func:`json_text`: a value that is not finite, such as the loss of a diverged
        step, is ``null``) and wandb (as given: wandb plots NaN)."""
        if not self.enabled:
            return
        record = {"clock": self.clock, **record}
        if self._file is None:
            self._open(first_step=record["step"])
        self._file.write(json_text(record) + "\n")  # a NaN loss: null
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))},
                            step=int(record["step"]))

    def _open(self, first_step: int) -> None:
        """Open metrics.jsonl for appending, dropping old records at ``step >= first_step``."""
        path = self.run_dir / "metrics.jsonl"
        if path.exists():
            lines = path.read_text().splitlines()
            kept = []
            for line in lines:
                try:
                    if json.loads(line)["step"] < first_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    pass  # a torn last line of a killed run
            if len(kept) < len(lines):
                log.warning("%s: replacing %d earlier record(s) from step %s on",
                            path, len(lines) - len(kept), first_step)
                tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
                tmp.write_text("".join(line + "\n" for line in kept))
                tmp.replace(path)
        self._file = open(path, "a", buffering=1)

    def summary(self, summary: dict) -> Path | None:
        """Write ``summary.json`` (atomically, strict JSON: a value that is not finite is
        ``null``, :func:`json_text`) and set the wandb run summary (the same values)."""
        if not self.enabled:
            return None
        summary = finite_or_none({"mode": self.mode, "clock": self.clock, **summary})
        path = self.run_dir / "summary.json"
        write_json_atomic(path, summary)
        if self._wandb is not None:
            for k, v in summary.items():
                if isinstance(v, (int, float, str)) or v is None:
                    self._wandb.summary[k] = v
        return path

    @property
    def wandb_dir(self) -> str | None:
        return getattr(self._wandb, "dir", None) if self._wandb is not None else None

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
