"""bench/machine_load.py: the load sampled while a bench runs (its maximum catches what
the load at the end misses)."""

import threading

import pytest

from bench.machine_load import LoadSampler


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


def test_a_short_block_still_has_its_end_sample():
    with LoadSampler(interval_s=3600, read=lambda: 1.5) as load:
        pass
    assert load.summary()["max"] == 1.5 and load.summary()["samples"] >= 1


def test_bad_interval_is_refused():
    with pytest.raises(ValueError, match="interval_s"):
        LoadSampler(interval_s=0)
