"""A TCP port for a rendezvous (``MASTER_PORT``, a GeoMesh lighthouse) on this host.

The usual recipe, bind port 0 and close, hands out a port from the kernel's
ephemeral range: the same range the kernel draws from for the source port of every
outgoing connection.  Between the close and the server's bind, any process on the
host that opens a connection (gloo's full mesh, a TCPStore client, another test's
job) can be given that port, and the job's store then answers its clients with
"Connection reset by peer" until the rendezvous times out.  A port below the
ephemeral range is never handed out implicitly, so only another explicit chooser
can race for it, and this module's choices are spread at random over ~20,000 ports.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10_000  # above the registered ports that system services are likely to hold
LINUX_DEFAULT = (32768, 60999)
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_rng = random.SystemRandom()


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of implicitly assigned ports, inclusive (Linux's
    ``net.ipv4.ip_local_port_range``; its default where that cannot be read or does not
    hold two ports from 1 to 65535)."""
    try:
        low, high = sorted(int(v) for v in _RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT
    return (low, high) if 1 <= low <= high <= 65535 else LINUX_DEFAULT


def free_port() -> int:
    """A TCP port free on every IPv4 interface of this host now (where a rank-0 store
    binds) that the kernel will not give to an outgoing connection meanwhile: drawn at
    random from :data:`LOWEST` up, outside the ephemeral range.  Where that leaves fewer
    than 1,000 ports, falls back to one the kernel picks (bind to port 0).

    Raises:
        OSError: no port could be bound.
    """
    low, high = ephemeral_range()
    below, above = range(LOWEST, low), range(max(high + 1, LOWEST), 65536)
    pool = below if len(below) >= len(above) else above
    if len(pool) >= 1000:
        for _ in range(64):
            port = _rng.choice(pool)
            with socket.socket() as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]
