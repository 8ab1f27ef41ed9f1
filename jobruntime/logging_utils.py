"""Rank-aware logging: rank 0 (or the given rank) logs at INFO, others at WARNING.

Also what a run tells its user while it works: :func:`phase` (a line when a
long phase starts and when it ends) and :class:`StepProgress` (a progress bar
on a terminal, log lines elsewhere).
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager


def quiet_expected_warnings() -> None:
    """Ignore warnings that are expected here and say nothing actionable:
    megatron-core's import-time notes on missing Apex / Transformer Engine
    (normal on CPU) and torch's ShardedTensor deprecation notices, which
    megatron 0.16's dist_checkpointing triggers on every load.  Called when
    :mod:`jobruntime` is imported, so the tools' output stays clean too."""
    for pattern in ("Transformer Engine", "Apex is not installed", "full scope is deprecated",
                    "`load_state_dict` is deprecated", "Please use DTensor instead"):
        warnings.filterwarnings("ignore", message=f".*{pattern}.*")


def setup_logging(level: int = logging.INFO, info_stream=None) -> None:
    """Configure the ``jobruntime``/``geomesh``/``cona`` loggers for this rank.

    Args:
        info_stream: where records below WARNING go (``train.py`` gives
            ``sys.stdout``: its phases and progress are output, and stderr keeps
            its one ``error:`` line for bad input); warnings and errors always go
            to stderr.  ``None``: everything to stderr (tools whose stdout is data).

    (Expected library warnings are already filtered when :mod:`jobruntime` is
    imported, see :func:`quiet_expected_warnings`.)
    """
    rank = int(os.environ.get("RANK", "0"))
    fmt = f"[%(asctime)s r{rank}] %(name)s: %(message)s" if "RANK" in os.environ else \
        "[%(asctime)s] %(name)s: %(message)s"
    handlers = None
    if info_stream is not None:
        info, problems = logging.StreamHandler(info_stream), logging.StreamHandler(sys.stderr)
        info.addFilter(lambda r: r.levelno < logging.WARNING)
        problems.setLevel(logging.WARNING)
        handlers = [info, problems]
    logging.basicConfig(level=level if rank == 0 else logging.WARNING, format=fmt,
                        datefmt="%H:%M:%S", handlers=handlers)
    for name in ("megatron", "megatron.core"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # torch.distributed.checkpoint logs a traceback (on the root logger) for a
    # checkpoint without global metadata, then raises; jobruntime.checkpoint
    # turns that error into one line, so the logged copy is only noise.
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda r: not r.getMessage().startswith("Global metadata is not found"))


def seconds_text(seconds: float) -> str:
    """``seconds`` for a log line: one decimal below 10 s (an emulated clock's first steps
    take fractions of a second: ``0.2 s``, not ``0 s``), whole seconds with thousands
    separators above (``4,515 s``)."""
    return f"{seconds:.1f} s" if abs(round(seconds, 1)) < 10 else f"{seconds:,.0f} s"


@contextmanager
def phase(logger: logging.Logger, what: str, *args) -> Iterator[dict]:
    """Log ``<what> ...`` when a phase of a run starts and ``<what>: done in X s`` when
    it ends (seconds of wall time), followed by ``(<result>)`` when the block set
    ``result`` in the dict it was given.

    For the phases a user would otherwise wait through in silence (tokenizer
    training, tokenising and caching the corpus, the model build, checkpoint
    save and load, the evaluation after training).  Logging, not the progress
    bar, so the lines show in a file or a pipe as on a terminal.  ``what`` is a
    %-format string with ``args``.  Nothing is logged at the end when the block
    raises: its error is reported once, by the caller.
    """
    text = what % args if args else what
    logger.info("%s ...", text)
    t0, info = time.perf_counter(), {}
    yield info
    logger.info("%s: done in %.1f s%s", text, time.perf_counter() - t0,
                f" ({info['result']})" if info.get("result") else "")


class StepProgress:
    """A run's progress: one reporter for every training loop (the plain job's, CONA's).

    On a terminal (``logging.progress=auto`` with stdout and stderr TTYs and more
    than 50 units to go, or ``on``) a tqdm bar on stderr; otherwise (a file, a pipe, SLURM) a log
    line at every evaluation and each time another 5 % of ``total`` is done;
    ``off``: neither.  Only the logging rank reports.

    Args:
        mode: ``cfg.logging.progress`` (``auto``, ``on``, ``off``).
        enabled: this rank reports (the job's logging rank).
        total: units of the whole run: steps, or ``"sample"`` where the global
            batch changes mid-run (CONA).
        initial: units already done (a resumed run).
        unit: ``"step"`` or ``"sample"``.
        logger: where the log lines go.
    """

    def __init__(self, mode: str, *, enabled: bool, total: int, initial: int = 0,
                 unit: str = "step", logger: logging.Logger | None = None):
        self.total, self.done, self.unit = total, initial, unit
        self.log = logger or logging.getLogger("jobruntime")
        self.bar = None
        # the bar draws on stderr, the log lines go where train.py logs (stdout): a
        # run whose stdout is a file gets lines there even when stderr is a terminal
        interactive = sys.stderr.isatty() and sys.stdout.isatty()
        show = mode == "on" or (mode == "auto" and interactive and total - initial > 50)
        if enabled and show:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit=unit, dynamic_ncols=True)
        self.lines = enabled and self.bar is None and mode != "off"
        self.every = max(total // 20, 1)
        self._next_line = (initial // self.every + 1) * self.every

    def update(self, done: int, *, step: int, loss: float, val_ppl: float | None,
               tokens_per_s: float | None, time_s: float, evaluated: bool = False,
               note: str = "") -> None:
        """Report ``done`` units done after optimizer step ``step``.

        Args:
            loss: the step's training loss (nats per token).
            val_ppl: the latest validation perplexity (``None`` before the first); a log
                line shows it only for the step that ran the evaluation (``-`` otherwise).
            tokens_per_s: the step's throughput (tokens per second); ``None``
                where it means nothing (an emulated clock times another model).
            time_s: the run's clock (seconds since training started).
            evaluated: this step ran an evaluation (a log line is due).
            note: appended to the log line (e.g. CONA's current strategy).
        """
        ppl = f"{val_ppl:.1f}" if val_ppl else "-"
        if self.bar is not None:  # one line, redrawn: the last evaluation's value stays in view
            self.bar.update(done - self.done)
            self.bar.set_postfix(loss=f"{loss:.3f}", val_ppl=ppl)
        elif self.lines and (evaluated or done >= self._next_line or done >= self.total):
            ppl = ppl if evaluated else "-"  # a line per step: the value on its evaluation's only
            where = (f"step {step}/{self.total}" if self.unit == "step"
                     else f"step {step} ({done}/{self.total} {self.unit}s)")
            speed = f"  {tokens_per_s:.0f} tokens/s" if tokens_per_s is not None else ""
            self.log.info("%s  loss %.3f  val ppl %s%s  %s%s", where, loss, ppl, speed,
                          seconds_text(time_s), f"  {note}" if note else "")
        while self._next_line <= done:
            self._next_line += self.every
        self.done = done

    def close(self) -> None:
        """Close the bar (if any)."""
        if self.bar is not None:
            self.bar.close()
