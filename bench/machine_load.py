"""Whether a bench ran alone: the CPU time other processes used while it ran.

A bench's wall time is a result only if nothing else shared the cores: on 2 cores a test
suite or a second bench beside a ``--jobs 2`` run stretches every unit.  The load average
cannot tell: it counts the bench's own threads too (gloo's TCP loop threads poll, and a
run that leaked process groups read 224 with nothing else on the machine; the leak that
``jobruntime.parallel.initialize_layout`` now closes).  So :class:`LoadSampler` measures
what others used directly: the machine's busy CPU time (``/proc/stat``: user, nice,
system, irq, softirq and steal) over the block, less the CPU time of this process and of
its children that ended within it (``resource.getrusage``; a process pool's workers are
joined before the block ends).  What remains is other processes' time, the kernel's
(interrupts, the hypervisor's steal) and that of a child still running at the end; a
child started before the block counts as ours entirely.  It also samples the 1-minute
load average every ``interval_s`` seconds in a daemon thread, reported beside (max and
mean).
"""

from __future__ import annotations

import os
import resource
import statistics
import threading
import time
from collections.abc import Callable

BUSY = (0, 1, 2, 5, 6, 7)  # /proc/stat's cpu line: user nice system irq softirq steal


def machine_busy_s() -> float | None:
    """All CPUs' busy seconds since boot (``/proc/stat``), ``None`` where it is absent."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    return sum(int(fields[i]) for i in BUSY) / os.sysconf("SC_CLK_TCK")


def machine_cpus() -> int:
    """The CPUs ``/proc/stat`` sums over (its ``cpuN`` lines; ``os.cpu_count()`` where it
    is absent): the denominator of a share of its busy time."""
    try:
        with open("/proc/stat") as f:
            n = sum(1 for line in f if line.startswith("cpu") and line[3].isdigit())
    except OSError:
        n = 0
    return n or os.cpu_count() or 1


def own_cpu_s() -> float:
    """CPU seconds of this process and of its ended (waited-for) children."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                 resource.getrusage(resource.RUSAGE_CHILDREN)))


class LoadSampler:
    """The CPU time others used, and the 1-minute load average, while in a ``with`` block.

    Args:
        interval_s: seconds between load samples (> 0).
        read: returns the 1-minute load average (default ``os.getloadavg()[0]``).
        busy: returns the machine's busy CPU seconds (default :func:`machine_busy_s`).
        own: returns this process tree's CPU seconds (default :func:`own_cpu_s`).

    Raises:
        ValueError: ``interval_s`` is not positive.

    Example::

        with LoadSampler() as load:
            run_the_bench()
        report["load_average_1min"] = load.summary()
    """

    def __init__(self, interval_s: float = 15.0,
                 read: Callable[[], float] = lambda: os.getloadavg()[0],
                 busy: Callable[[], float | None] = machine_busy_s,
                 own: Callable[[], float] = own_cpu_s):
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s} must be > 0")
        self.interval_s = interval_s
        self._read, self._busy, self._own = read, busy, own
        self.samples: list[float] = []
        self.other_cpu_s: float | None = None
        self.wall_s: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while True:
            self.samples.append(float(self._read()))
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> LoadSampler:
        self._start = (time.perf_counter(), self._busy(), self._own())
        self._thread = threading.Thread(target=self._run, name="load-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.samples.append(float(self._read()))  # the end, however short the block
        t0, busy0, own0 = self._start
        busy1 = self._busy()
        self.wall_s = time.perf_counter() - t0
        if busy0 is not None and busy1 is not None:
            self.other_cpu_s = max(0.0, (busy1 - busy0) - (self._own() - own0))

    def summary(self) -> dict:
        """``{"other_cpu_s", "other_cpu_share", "max", "mean", "at_end", "samples",
        "interval_s"}``: the CPU seconds other processes (and the kernel) used during the
        block and their share of all cores' time over it (``None`` without
        ``/proc/stat``), and the 1-minute load average's samples (``None`` before any)."""
        s = self.samples
        share = None
        if self.other_cpu_s is not None and self.wall_s:
            share = self.other_cpu_s / (self.wall_s * machine_cpus())
        return {"other_cpu_s": self.other_cpu_s, "other_cpu_share": share,
                "max": max(s) if s else None, "mean": statistics.fmean(s) if s else None,
                "at_end": s[-1] if s else None, "samples": len(s),
                "interval_s": self.interval_s}
