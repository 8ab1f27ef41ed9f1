"""Run the torchft Lighthouse of a GeoMesh run: ``python -m geomesh.lighthouse``.

The lighthouse decides who is in each round's quorum (:mod:`geomesh.exchange.membership`).
It holds no training state, so it can run anywhere every region reaches,
and a lost region never takes it down with it; start it before the regions'
jobs, at the cluster file's ``rendezvous`` address::

    python -m geomesh.lighthouse --cluster geomesh/clusters/two_worker_real.yaml
    python -m geomesh.lighthouse --bind 0.0.0.0:29511 --heartbeat-s 10 --join-timeout-s 600

``--heartbeat-s`` must equal the jobs' ``geomesh.heartbeat_s`` (a worker silent
that long is lost) and ``--join-timeout-s`` their ``geomesh.timeout_s`` (how
long an alive straggler is waited for at an exchange).  Exit code 2 with one
line for bad arguments or an address already in use.

A restart on the same address that answers again within ``geomesh.heartbeat_s``
is survived: the quorum in flight is asked again (:func:`quorum_retries`), a
partial quorum that the restarted lighthouse formed before it heard every
worker is asked again until the left-out worker joins
(``Membership._working_quorum``), the next quorum rebuilds the process group,
and the round goes on (``bench/faults.py``'s restart 3.6 s after a SIGKILL,
``docs/reliability.md``; before, both jobs waited 240 s and exited 3).  Silent
longer, it is gone for good: every job stops within the heartbeat with one
``error:`` line and exit code 3.  The client side of its ``/status`` page is here
too (:func:`lighthouse_heartbeats`).
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import math
import os
import re
import signal
import sys
import threading
import urllib.request
from pathlib import Path

_HEARTBEAT = re.compile(r"([A-Za-z0-9_.\-]+):[0-9a-f\-]+: seen ([0-9.eE+\-]+)s ago")


def lighthouse_heartbeats(addr: str, timeout_s: float = 2.0) -> dict[int, float]:
    """Seconds since the lighthouse last heard from each worker (its ``/status`` page).

    Several entries of one worker (restarts) keep the freshest.

    Raises:
        OSError: the lighthouse does not answer, or its answer breaks off (a lighthouse
            dying mid-reply: ``http.client``'s ``IncompleteRead``, ``RemoteDisconnected``
            and the like, which are not ``OSError``).
    """
    try:
        with urllib.request.urlopen(f"{addr}/status", timeout=timeout_s) as f:
            text = f.read().decode("utf-8", "replace")
    except http.client.HTTPException as e:
        raise OSError(f"the lighthouse at {addr} broke off its answer ({e!r})") from e
    out: dict[int, float] = {}
    for rid, age in _HEARTBEAT.findall(text):
        m = re.fullmatch(r"geomesh_(\d+)", rid)
        if m:
            k = int(m.group(1))
            out[k] = min(out.get(k, float("inf")), float(age))
    return out


def quorum_retries(quorum_timeout_s: float, gap_s: float) -> int:
    """torchft's ``Manager(quorum_retries=)`` that re-asks a restarted lighthouse every ``gap_s``.

    torchft's manager server (``src/manager.rs``, ``_quorum_with_retries``) sends
    the round's quorum request to the lighthouse.  When the lighthouse dies under
    that call (the connection is reset), it sleeps ``quorum_timeout /
    (retries + 1)``, reconnects (backing off up to ``connect_timeout``) and asks
    again, at most ``retries`` times; torchft's own test of this is
    ``test_get_quorum_when_lighthouse_down``.  With no retry (torchft's default)
    the failed call is never answered (``_run_quorum`` returns its error without
    telling the waiting ranks: a TODO there), and the round's quorum waits its
    whole timeout (``2 * geomesh.timeout_s``) although the restarted lighthouse
    hears the heartbeats seconds later.  Here the sleep is at most ``gap_s``, so
    a restart costs the time the lighthouse is away plus ``gap_s``; a lighthouse
    gone for good is the monitor's to report (``Membership._watch``), not the
    retries' to wait out.

    Args:
        quorum_timeout_s: the Manager's ``quorum_timeout`` (seconds).
        gap_s: the longest sleep between two tries (seconds; the heartbeat interval).

    Returns:
        ``ceil(quorum_timeout_s / gap_s)``, at least 1.
    """
    return max(1, math.ceil(quorum_timeout_s / gap_s))


def lighthouse_server_class() -> type:
    """torchft's ``LighthouseServer`` (Rust), loaded without importing torch.

    ``torchft/__init__`` imports torch and its Manager: ~2 s of CPU, 9 s on two
    loaded cores, and a restarted lighthouse must answer again within the jobs'
    ``geomesh.heartbeat_s`` (:meth:`geomesh.exchange.membership.Membership._watch`).  The
    class lives in the extension module ``torchft._torchft``, which links no
    torch, so it is loaded from its file; any surprise falls back to the
    package's own ``torchft.coordination.LighthouseServer`` (the same class).
    """
    try:
        spec = importlib.util.find_spec("torchft")  # finds the package, runs none of it
        so = next(f for d in spec.submodule_search_locations for f in Path(d).glob("_torchft.*"))
        ext = importlib.util.spec_from_file_location("torchft._torchft", so)
        module = importlib.util.module_from_spec(ext)
        ext.loader.exec_module(module)
        return module.LighthouseServer
    except Exception:  # noqa: BLE001 - a layout other than torchft 0.2.0's wheel
        from torchft.coordination import LighthouseServer

        return LighthouseServer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", help="cluster YAML whose rendezvous host:port to bind")
    p.add_argument("--bind", help="host:port to bind (default: the cluster's rendezvous)")
    p.add_argument("--heartbeat-s", type=float, default=10.0,
                   help="seconds without a heartbeat before a worker is lost (default 10)")
    p.add_argument("--join-timeout-s", type=float, default=600.0,
                   help="seconds an alive straggler is waited for (default 600)")
    p.add_argument("--min-workers", type=int, default=1,
                   help="fewest workers that make a quorum (default 1)")
    args = p.parse_args(argv)

    def fail(msg: str) -> int:
        print(f"error: {msg}", file=sys.stderr)
        return 2

    bind = args.bind
    if bind is None and args.cluster:
        from geomesh.fleet.cluster import ClusterError, load_cluster

        try:
            cluster = load_cluster(args.cluster)
            host, port = cluster.rendezvous_host_port
        except (ClusterError, KeyError, TypeError, ValueError) as e:
            return fail(f"--cluster {args.cluster}: {e}")
        bind = f"{'[::]' if host in ('0.0.0.0', '::') else host}:{port}"
    if not bind:
        return fail("give --cluster FILE (its rendezvous address) or --bind HOST:PORT")
    if not (args.heartbeat_s > 0 and args.join_timeout_s > 0 and args.min_workers >= 1):
        return fail("--heartbeat-s and --join-timeout-s must be positive, --min-workers >= 1")
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        server = lighthouse_server_class()(bind=bind, min_replicas=args.min_workers,
                                  join_timeout_ms=int(args.join_timeout_s * 1000),
                                  heartbeat_timeout_ms=int(args.heartbeat_s * 1000))
    except Exception as e:  # noqa: BLE001 - bind errors come as RuntimeError from Rust
        return fail(f"cannot serve the lighthouse at {bind} ({str(e).splitlines()[0][:160]}); "
                    "is another one running there? pick a free port in the cluster file")
    print(f"lighthouse at {server.address()} (bind {bind}); Ctrl-C stops it", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
