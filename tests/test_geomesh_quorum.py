"""A round's quorum after a lighthouse restart, against a scripted torchft Manager.

No processes: :meth:`Membership.quorum` runs with a stand-in for torchft's
``Manager`` that hands out a scripted list of quorums, the way a restarted
lighthouse answers (``quorum_compute`` in torchft's ``src/lighthouse.rs``).
The real thing is ``tests/test_geomesh_real.py``'s lighthouse restart, a slow test.
"""

from __future__ import annotations

import types

import pytest

from geomesh.exchange import membership
from geomesh.exchange.membership import MAX_ATTEMPTS, Membership, PeerLostError
from geomesh.fleet.cluster import load_cluster

CLUSTER = "geomesh/clusters/two_worker_real.yaml"


class ScriptedManager:
    """torchft's Manager as :meth:`Membership.quorum` uses it: each ``start_quorum``
    takes the next quorum of ``script`` (``None``: the process group fails to form)."""

    def __init__(self, pg, script: list[list[int] | None], heal=None):
        self.pg, self.script, self.asked, self.commits = pg, list(script), 0, 0
        self._error, self.heal = None, heal  # heal(): torchft's load_state_dict callback

    def start_quorum(self, allow_heal: bool = True) -> None:
        quorum = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        self.asked += 1
        self._error = None
        if quorum is None:
            self._error = types.SimpleNamespace(original_exception=RuntimeError("store gone"))
        else:
            self.pg.members = quorum
            if self.heal and self.asked == 1:  # the first quorum heals this worker
                self.heal()

    def report_error(self, e: Exception) -> None:
        self._error = types.SimpleNamespace(original_exception=e)

    def errored(self):
        return self._error

    def should_commit(self) -> bool:
        self.commits += self._error is None
        return self._error is None


def _member(script, *, outage: bool = True, timeout_s: float = 30.0, heartbeat_s: float = 0.2):
    """Worker 0 of a two-worker run whose last quorum held both workers."""
    m = Membership.__new__(Membership)
    m.cluster, m.worker, m.report = load_cluster(CLUSTER), 0, False
    m.timeout_s, m.heartbeat_s, m.policy, m.lighthouse = timeout_s, heartbeat_s, "continue", "x"
    m.pg = types.SimpleNamespace(members=[0, 1])
    m.opener = types.SimpleNamespace(run=0)  # the run identity a failed heal is checked against
    m.members, m._healed, m._load = [0, 1], None, None
    m._outages, m._outages_at_quorum = (1 if outage else 0), 0
    m.manager = ScriptedManager(m.pg, script)
    return m


@pytest.fixture
def beats(monkeypatch):
    """The lighthouse's /status: seconds since it heard each worker (set per test)."""
    heard: dict[int, float] = {0: 0.1, 1: 0.1}
    monkeypatch.setattr(membership, "lighthouse_heartbeats", lambda addr: heard)
    monkeypatch.setattr(membership, "REASK_S", 0.01)
    return heard


def test_partial_quorums_of_a_restarted_lighthouse_are_asked_again_until_the_alive_worker_joins(
        beats):
    """Catches a run that ended although both workers were alive: a restarted
    lighthouse answers every re-ask with the same partial quorum (torchft's fast
    quorum) until the left-out worker asks too, and these refusals counted as
    failed attempts, three in a second (bench/faults.py's lighthouse restart on
    loaded cores: exit 3, 'no working quorum after 3 attempts')."""
    partial = 2 * MAX_ATTEMPTS
    m = _member([[0]] * partial + [[0, 1]])
    members, healed = m.quorum(2)
    assert members == [0, 1] and not healed
    assert m.manager.asked == partial + 1 and m.manager.commits == 0
    assert m._outages_at_quorum == m._outages  # the outage is behind it


def test_a_heal_during_a_refused_partial_quorum_is_kept(beats):
    """Catches a heal thrown away: torchft loads a peer's state (and moves its step on)
    inside the partial quorum that is then refused; the next quorum heals no more, so
    clearing it at each ask left stale weights under a step that had moved on."""
    m = _member([[0, 2], [0, 2], [0, 1, 2]])
    m.members, m.pg.members = [0, 1, 2], [0, 1, 2]
    loaded = []
    m._load = loaded.append
    m.manager.heal = lambda: m._load_state({"step": 7})
    members, healed = m.quorum(2)
    assert members == [0, 1, 2] and healed and loaded == [{"step": 7}]


def test_a_partial_quorum_stands_when_the_left_out_worker_is_silent(beats):
    """The left-out worker is not heard within the heartbeat: it is lost, not waited for."""
    beats.pop(1)
    m = _member([[0], [0, 1]])
    members, _ = m.quorum(2)
    assert members == [0] and m.manager.asked == 1 and m.members == [0]


def test_a_partial_quorum_stands_after_the_straggler_timeout(beats):
    """An alive worker that never asks is waited for ``geomesh.timeout_s``, then the
    partial quorum stands (as for any straggler past the timeout)."""
    m = _member([[0]], timeout_s=0.1)
    members, _ = m.quorum(2)
    assert members == [0] and 2 <= m.manager.asked <= 100


def test_no_outage_no_wait(beats):
    """Without a lighthouse outage a smaller quorum is the lighthouse's word (a lost worker)."""
    m = _member([[0], [0, 1]], outage=False)
    assert m.quorum(2)[0] == [0] and m.manager.asked == 1


def test_failed_attempts_still_end_the_run(beats):
    """A process group that cannot form, again and again, still stops after MAX_ATTEMPTS."""
    m = _member([None], outage=False)
    with pytest.raises(PeerLostError, match=f"no working quorum after {MAX_ATTEMPTS} attempts"):
        m.quorum(2)
    assert m.manager.asked == MAX_ATTEMPTS


@pytest.mark.parametrize("heard, why", [
    (False, "no heartbeat for 0.2 s (geomesh.heartbeat_s)"),
    (True, "heartbeating, but not at the exchange within 0.1 s (geomesh.timeout_s)"),
])
def test_a_lost_worker_is_reported_with_its_reason(beats, heard, why):
    """Catches an alive straggler, dropped after the ``timeout_s`` wait, reported as
    "no heartbeat" while the lighthouse still heard it: the line then sends the user to
    a region that is running, instead of to the straggler's speed or ``timeout_s``."""
    if not heard:
        beats.pop(1)
    m = _member([[0]], timeout_s=0.1)
    m.policy = "fail"
    with pytest.raises(PeerLostError, match=r"worker .*: " + why.replace("(", r"\(")
                       .replace(")", r"\)")):
        m.quorum(2)


def test_workers_lost_for_different_reasons_are_all_named(beats):
    """Catches ``on_worker_loss=fail`` naming only the first group: a silent worker and
    an alive straggler lost in the same round, the error stopped at the silent one."""
    m = _member([[0]], outage=False)
    m.cluster = load_cluster("geomesh/clusters/four_region.yaml")
    m.members, m.policy = [0, 1, 2], "fail"
    beats.pop(1)
    beats[2] = 0.1
    with pytest.raises(PeerLostError) as e:
        m.quorum(2)
    names = [f"{w.name} ({w.region})" for w in m.cluster.workers[1:3]]
    assert f"{names[0]}: no heartbeat" in str(e.value), e.value
    assert f"{names[1]}: heartbeating, but not at the exchange" in str(e.value), e.value


def test_a_lighthouse_that_breaks_off_its_answer_is_an_oserror():
    """Catches ``http.client.IncompleteRead`` (not an ``OSError``) escaping the callers'
    ``except OSError`` as a traceback when the lighthouse dies mid-reply."""
    import socket
    import threading

    from geomesh.lighthouse import lighthouse_heartbeats

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def answer_half():
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\npartial")
        conn.close()

    threading.Thread(target=answer_half, daemon=True).start()
    try:
        with pytest.raises(OSError, match="broke off its answer"):
            lighthouse_heartbeats(f"http://127.0.0.1:{server.getsockname()[1]}")
    finally:
        server.close()
