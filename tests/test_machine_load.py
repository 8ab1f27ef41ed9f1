"""bench/machine_load.py: what other processes used while a bench ran (the CPU time they
took, and the load average's peak that the load at the end misses)."""

import threading

import pytest

from bench.machine_load import LoadSampler, machine_busy_s, own_cpu_s


def test_sampler_keeps_the_peak_that_the_end_misses():
    values = iter([2.0, 2.1, 37.5, 2.2] + [2.0] * 10_000)
    lock = threading.Lock()

    def read():
        with lock:
            return next(values)

    seen = threading.Event()
    with LoadSampler(interval_s=0.001, read=read) as load:
        while len(load.samples) < 4:  # the thread has read past the peak
            seen.wait(0.001)
    s = load.summary()
    assert s["max"] == 37.5 and s["at_end"] == 2.0
    assert s["samples"] == len(load.samples) >= 5  # the end is sampled too
    assert 2.0 < s["mean"] < 37.5


def test_other_cpu_is_the_machines_busy_time_less_our_own():
    """The machine was busy 50 CPU-s over the block, 45 of them ours: others used 5."""
    busy, own = iter([100.0, 150.0]), iter([10.0, 55.0])
    with LoadSampler(interval_s=3600, read=lambda: 1.0, busy=lambda: next(busy),
                     own=lambda: next(own)) as load:
        pass
    assert load.summary()["other_cpu_s"] == pytest.approx(5.0)
    assert load.summary()["other_cpu_share"] > 0
    no_proc = LoadSampler(interval_s=3600, read=lambda: 1.0, busy=lambda: None)
    with no_proc:
        pass
    assert no_proc.summary()["other_cpu_s"] is None  # no /proc/stat: not measured


def test_real_counters_move_with_our_own_work():
    """On this machine a busy loop in this process moves both counters (what others used
    depends on what else runs, so only the counters are checked here)."""
    b0 = machine_busy_s()
    if b0 is None:
        pytest.skip("no /proc/stat")
    c0 = own_cpu_s()
    while own_cpu_s() - c0 < 0.2:
        sum(range(10_000))
    assert machine_busy_s() - b0 >= 0.1


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        LoadSampler(interval_s=0)
