"""The machine's load while a bench runs, so that its wall time says whether it ran alone.

A bench's wall time is a result only if nothing else ran beside it: on 2 cores a test
suite or a second bench beside a ``--jobs 2`` run stretches every unit (seen here: one
CONA run of GPT-3's proxy took 416 s in a bench whose 1-minute load average ended at 224,
and 37 s alone).  The load at the end alone misses what ran in the middle, so
:class:`LoadSampler` reads the 1-minute load average (``os.getloadavg``: runnable and
uninterruptible tasks, an exponential average over one minute) every ``interval_s``
seconds in a daemon thread and reports its maximum and mean.  A run of ``jobs`` busy
single-threaded workers alone on the machine reads ``jobs`` to ``2 * jobs + 1`` (each
worker's gloo TCP loop thread is runnable while it polls; the parent process); a maximum
well above it means the wall time is not the bench's own.
"""

from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable


class LoadSampler:
    """Samples the 1-minute load average while in a ``with`` block.

    Args:
        interval_s: seconds between samples (> 0).
        read: returns the 1-minute load average (default ``os.getloadavg()[0]``;
            injectable for tests).

    Raises:
        ValueError: ``interval_s`` is not positive.

    Example::

        with LoadSampler() as load:
            run_the_bench()
        report["load_average_1min"] = load.summary()
    """

    def __init__(self, interval_s: float = 15.0,
                 read: Callable[[], float] = lambda: os.getloadavg()[0]):
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be > 0")
        self.interval_s = interval_s
        self._read = read
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            self.samples.append(float(self._read()))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> LoadSampler:
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append(float(self._read()))  # the end, however short the block

    def summary(self) -> dict:
        """``{"max", "mean", "at_end", "samples", "interval_s"}`` of the 1-minute load
        average (runnable tasks); ``max``/``mean``/``at_end`` are ``None`` before any
        sample."""
        s = self.samples
        return {"max": max(s) if s else None, "mean": statistics.fmean(s) if s else None,
                "at_end": s[-1] if s else None, "samples": len(s),
                "interval_s": self.interval_s}

