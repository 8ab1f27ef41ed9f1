"""Run the torchft Lighthouse of a GeoMesh run: ``python -m geomesh.lighthouse``.

The lighthouse decides who is in each round's quorum (:mod:`geomesh.membership`).
It holds no training state, so it can run anywhere every region reaches,
and a lost region never takes it down with it; start it before the regions'
jobs, at the cluster file's ``rendezvous`` address::

    python -m geomesh.lighthouse --cluster geomesh/clusters/two_worker_real.yaml
    python -m geomesh.lighthouse --bind 0.0.0.0:29511 --heartbeat-s 10 --join-timeout-s 600

``--heartbeat-s`` must equal the jobs' ``geomesh.heartbeat_s`` (a worker silent
that long is lost) and ``--join-timeout-s`` their ``geomesh.timeout_s`` (how
long an alive straggler is waited for at an exchange).  Exit code 2 with one
line for bad arguments or an address already in use.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading


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
        from geomesh.cluster import ClusterError, load_cluster

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
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(bind=bind, min_replicas=args.min_workers,
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
