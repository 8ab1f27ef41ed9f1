"""WAN links: the latency + bandwidth model and the bundled Azure profile.

A directed link between two regions is a round-trip latency and a sustained
throughput; pushing ``B`` bytes one way takes ``rtt/2 + B/bandwidth`` seconds.
The default profile, ``geomesh/data/azure_wan.csv`` (sources in
``geomesh/data/README.md``), has p95 RTTs from Microsoft's Azure round-trip
latency statistics and iperf3 throughput from the Skyplane project's grid,
in milliseconds and Gbit/s; loaded links use seconds and bytes/s.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from jobruntime.config import ConfigError

DEFAULT_WAN_CSV = Path(__file__).resolve().parent.parent / "data" / "azure_wan.csv"  # geomesh/data


class WanProfileError(ConfigError):
    """A WAN CSV is missing or malformed (the message names file, line and column)."""


def gbps_to_bytes_per_s(gbps: float) -> float:
    """Gbit/s (10^9 bit/s, as in the CSV) to bytes/s."""
    return gbps * 1e9 / 8.0


@dataclass(frozen=True, kw_only=True)
class WanLink:
    """One directed link.

    Attributes:
        src, dst: region names (equal for an intra-region link).
        rtt_s: round-trip latency, seconds.
        bandwidth_bytes_per_s: sustained throughput, bytes/s (already scaled by
            ``wan_bandwidth_scale`` for WAN links).
    """

    src: str
    dst: str
    rtt_s: float
    bandwidth_bytes_per_s: float

    def transfer_s(self, nbytes: float) -> float:
        """Seconds for a one-way push of ``nbytes``: ``rtt/2 + nbytes/bandwidth``.

        One-way propagation is half the RTT; TCP slow start and handshakes are
        not modelled (long-lived connections are assumed).
        """
        return self.rtt_s / 2.0 + nbytes / self.bandwidth_bytes_per_s


def load_wan_csv(path: str | Path = DEFAULT_WAN_CSV) -> dict[tuple[str, str], tuple[float, float]]:
    """Read a WAN CSV into ``{(src, dst): (rtt_ms, gbps)}`` (unscaled).

    Columns: ``src_region,dst_region,rtt_p95_ms,throughput_gbps``.

    Raises:
        WanProfileError: missing file, missing column or a bad value.
    """
    path = Path(path)
    if not path.is_file():
        raise WanProfileError(f"file {path} not found; give an existing CSV or 'default'")
    out: dict[tuple[str, str], tuple[float, float]] = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        need = {"src_region", "dst_region", "rtt_p95_ms", "throughput_gbps"}
        if not need <= set(reader.fieldnames or ()):
            raise WanProfileError(f"{path}: needs columns {sorted(need)}, has {reader.fieldnames}")
        for lineno, row in enumerate(reader, start=2):
            try:
                rtt, gbps = float(row["rtt_p95_ms"]), float(row["throughput_gbps"])
            except (TypeError, ValueError):
                raise WanProfileError(f"{path}:{lineno}: rtt/throughput are not numbers") from None
            if rtt < 0 or gbps <= 0:
                raise WanProfileError(f"{path}:{lineno}: need rtt >= 0 and throughput > 0")
            out[(row["src_region"].strip(), row["dst_region"].strip())] = (rtt, gbps)
    return out
