"""The rendezvous port of every multi-process test and bench job (jobruntime/ports.py)."""

from __future__ import annotations

import socket

import pytest

import jobruntime.ports as ports


def _draw_first(monkeypatch, port: int, times: int) -> list[int]:
    """Make ``free_port``'s first ``times`` random draws land on ``port``; returns the
    list of every draw, filled as ``free_port`` draws."""
    draws, choice = [], ports._rng.choice

    def rigged(pool):
        draws.append(port if len(draws) < times else choice(pool))
        return draws[-1]

    monkeypatch.setattr(ports._rng, "choice", rigged)
    return draws


def test_the_port_is_bindable_and_outside_the_range_the_kernel_hands_out():
    """A port from the ephemeral range can be taken as the source port of any outgoing
    connection before the job's store binds it (the CI fast tier once lost a module of
    30 tests that way, "Connection reset by peer" from its own store port)."""
    low, high = ports.ephemeral_range()
    chosen = {ports.free_port() for _ in range(50)}
    assert all(not low <= p <= high for p in chosen), sorted(chosen)
    assert len(chosen) > 40  # drawn at random: two tests starting together do not collide
    for p in list(chosen)[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_that_is_taken_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        draws = _draw_first(monkeypatch, taken, 3)
        assert ports.free_port() != taken
        assert draws[:3] == [taken] * 3 and len(draws) >= 4


def test_no_room_outside_the_ephemeral_range_falls_back_to_the_kernel(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.free_port()))


def test_an_unreadable_range_file_means_linux_default(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_range() == ports.LINUX_DEFAULT
    for text, expected in [("not numbers\n", ports.LINUX_DEFAULT),
                           ("0 0\n", ports.LINUX_DEFAULT),  # gave a pool of 1..65535
                           ("60999 32768\n", (32768, 60999)),  # swapped: covered the range
                           ("1024 65535\n", (1024, 65535))]:
        (tmp_path / "range").write_text(text)
        monkeypatch.setattr(ports, "_RANGE_FILE", tmp_path / "range")
        assert ports.ephemeral_range() == expected, text


def test_a_port_held_on_another_local_address_is_skipped(monkeypatch):
    """The store binds every interface: a port another process holds on 127.0.0.2 only
    is not free for it (a review helper's EADDRINUSE)."""
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.2", 0))
        except OSError:
            pytest.skip("no 127.0.0.2 on this host")
        held.listen()
        taken = held.getsockname()[1]
        draws = _draw_first(monkeypatch, taken, 1)
        assert ports.free_port() != taken and draws[0] == taken
