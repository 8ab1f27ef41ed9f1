"""Cluster description of a GeoMesh job: workers, regions and WAN links.

A GeoMesh cluster is a set of *workers*; each worker is one ordinary
(possibly TP/PP/DP-parallel) training job on ``num_gpus`` GPUs of one type in
one *region*.  Workers in a region share a fast intra-region link; regions are
joined by directed WAN links (round-trip latency, bandwidth).  The description
is loaded from YAML (examples in ``geomesh/clusters/``) and validated here,
without any process group, so that a typo fails before anything is launched.

YAML schema (all keys but ``workers`` optional)::

    name: four_region
    mode: emulated            # emulated | real
    rendezvous: null          # real mode: "host:port" of the inter-worker store
    wan_csv: default          # default = geomesh/data/azure_wan.csv, or a path
    wan_bandwidth_scale: 1.0  # multiplies every WAN bandwidth (0.1 ~ 1 Gbit/s)
    wan_links:                # extra / overriding directed links
      - {src: East US, dst: West Europe, rtt_ms: 89, gbps: 13.38}
    regions:                  # default: regions of the workers, ids 0, 1, ...
      - {name: East US, id: 0, intra_gbps: 25, intra_rtt_ms: 1.0}
    workers:
      - {name: h100-eastus, gpu: H100, num_gpus: 8, region: East US,
         tp: 1, pp: 1, memory_gib: null}
    slowdown:                 # optional injected slowdown (tests of re-planning);
      - {worker: h100-eastus, factor: 2, from_round: 3, until_round: null}
                              # a single mapping is fine too; emulated mode scales
                              # the worker's compute time, real mode sleeps

Units: bandwidth in bytes/s and latency in seconds once loaded
(:class:`WanLink`); the YAML and CSV use Gbit/s and milliseconds.

Errors: every validation problem raises :class:`ClusterError` (a
``ValueError`` via :class:`jobruntime.config.ConfigError`) whose message names
the offending field (``workers[2].gpu``) and says how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from jobruntime.config import ConfigError
from jobruntime.config.base import did_you_mean
from jobruntime.hardware import GPUProfile, get_gpu_profile, gpu_profiles

from .wan import DEFAULT_WAN_CSV, WanLink, WanProfileError, gbps_to_bytes_per_s, load_wan_csv

CLUSTERS_DIR = Path(__file__).resolve().parent.parent / "clusters"  # geomesh/clusters

# Intra-region defaults between two VMs of one Azure region (assumptions, not
# measurements): accelerated networking gives tens of Gbit/s and < 2 ms RTT.
DEFAULT_INTRA_GBPS = 25.0
DEFAULT_INTRA_RTT_MS = 1.0


class ClusterError(ConfigError):
    """A cluster description is invalid; the message names the field and the fix."""


@dataclass(frozen=True, kw_only=True)
class RegionSpec:
    """A region: its id (rank among regions in real mode) and intra-region link."""

    name: str
    region_id: int
    intra_link: WanLink
    """Link between two workers of this region (src == dst == name)."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """One worker: an ordinary training job on ``num_gpus`` GPUs of one type.

    Attributes:
        name: unique worker name.
        gpu: GPU type, a key of ``jobruntime/gpu_profiles.yaml``.
        num_gpus: GPUs of this worker (``tp * pp * dp``).
        region: region name.
        tp, pp: tensor/pipeline parallel sizes inside the worker.
        memory_gib: per-GPU memory override in GiB (``None`` = profile's).
    """

    name: str
    gpu: str
    num_gpus: int = 1
    region: str
    tp: int = 1
    pp: int = 1
    memory_gib: float | None = None

    @property
    def profile(self) -> GPUProfile:
        return get_gpu_profile(self.gpu)

    @property
    def label(self) -> str:
        """``'v100-japaneast' (V100 x8, tp=2, pp=1)``: the worker as messages name it."""
        return f"'{self.name}' ({self.gpu} x{self.num_gpus}, tp={self.tp}, pp={self.pp})"

    @property
    def dp(self) -> int:
        """Data-parallel replicas inside the worker."""
        return self.num_gpus // (self.tp * self.pp)

    @property
    def memory_bytes_per_gpu(self) -> int:
        gib = self.memory_gib if self.memory_gib is not None else self.profile.memory_gib
        return int(gib * 2**30)


@dataclass(frozen=True, kw_only=True)
class Slowdown:
    """Worker ``worker`` computes ``factor`` times slower in rounds
    ``from_round <= r < until_round`` (``until_round=None``: to the end)."""

    worker: str
    factor: float
    from_round: int = 0
    until_round: int | None = None


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A validated cluster.  Workers keep YAML order; worker index = position.

    Attributes:
        links: directed WAN links keyed by ``(src, dst)`` region names, for
            every ordered pair of distinct regions in use (scaled bandwidth).
    """

    name: str
    mode: Literal["emulated", "real"] = "emulated"
    workers: tuple[WorkerSpec, ...]
    regions: tuple[RegionSpec, ...]
    links: dict[tuple[str, str], WanLink] = field(default_factory=dict)
    wan_bandwidth_scale: float = 1.0
    rendezvous: str | None = None
    slowdowns: tuple[Slowdown, ...] = ()

    def slowdown_factor(self, worker: str, round: int) -> float:
        """Injected compute-time factor of ``worker`` in outer step ``round`` (1 = none)."""
        f = 1.0
        for s in self.slowdowns:
            if s.worker == worker and s.from_round <= round and (
                s.until_round is None or round < s.until_round
            ):
                f *= s.factor
        return f

    # -- lookups -------------------------------------------------------------
    def worker(self, name: str) -> WorkerSpec:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(
            f"no worker '{name}' in cluster '{self.name}'; "
            f"workers: {[w.name for w in self.workers]}"
        )

    def worker_index(self, name: str) -> int:
        return [w.name for w in self.workers].index(self.worker(name).name)

    def region(self, name: str) -> RegionSpec:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"no region '{name}' in cluster '{self.name}'")

    def workers_in(self, region: str) -> list[WorkerSpec]:
        """Workers of a region in YAML order; the first is the region leader."""
        return [w for w in self.workers if w.region == region]

    def leader_of(self, region: str) -> WorkerSpec:
        return self.workers_in(region)[0]

    def link(self, src: str, dst: str) -> WanLink:
        """Link between two regions (the intra-region link when equal)."""
        if src == dst:
            return self.region(src).intra_link
        return self.links[(src, dst)]

    @property
    def rendezvous_host_port(self) -> tuple[str, int]:
        """``(host, port)`` of :attr:`rendezvous` (real mode)."""
        if not self.rendezvous:
            raise ClusterError(
                f"cluster '{self.name}' has no rendezvous; set rendezvous: host:port"
            )
        host, port = self.rendezvous.rsplit(":", 1)
        return host, int(port)


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _num(value: Any, where: str, *, positive: bool = True, integer: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if integer:
        ok = ok and float(value).is_integer()
    if not ok or not math.isfinite(value) or (positive and value <= 0) or value < 0:
        kind = (
            "a positive integer"
            if integer
            else ("a positive number" if positive else "a number >= 0")
        )
        raise ClusterError(f"{where}={value!r} must be {kind}")
    return int(value) if integer else float(value)


def _check_keys(d: Any, allowed: set[str], where: str) -> dict:
    if not isinstance(d, dict):
        raise ClusterError(f"{where} must be a mapping with keys {sorted(allowed)}")
    unknown = set(d) - allowed
    if unknown:
        raise ClusterError(
            f"{where}: unknown key(s) {sorted(unknown)}; valid keys: {sorted(allowed)}"
        )
    return d


def _parse_workers(raw_workers: Any) -> list[WorkerSpec]:
    """``workers:`` list -> WorkerSpecs (GPU known, num_gpus divisible by tp*pp, unique names)."""
    if not isinstance(raw_workers, list) or not raw_workers:
        raise ClusterError("workers must be a non-empty list of {name, gpu, num_gpus, region}")
    workers: list[WorkerSpec] = []
    wkeys = {"name", "gpu", "num_gpus", "region", "tp", "pp", "memory_gib"}
    for i, w in enumerate(raw_workers):
        where = f"workers[{i}]"
        _check_keys(w, wkeys, where)
        for key in ("name", "gpu", "region"):
            if key not in w or w[key] in (None, ""):
                raise ClusterError(f"{where}.{key} is missing; give a non-empty string")
            if not isinstance(w[key], str):
                raise ClusterError(f"{where}.{key}={w[key]!r} must be a string (quote it)")
        try:
            get_gpu_profile(w["gpu"])
        except KeyError:
            raise ClusterError(
                f"{where}.gpu={w['gpu']!r} is unknown; use one of "
                f"{sorted(gpu_profiles())} or add it to jobruntime/gpu_profiles.yaml"
            ) from None
        n = _num(w.get("num_gpus", 1), f"{where}.num_gpus", integer=True)
        tp = _num(w.get("tp", 1), f"{where}.tp", integer=True)
        pp = _num(w.get("pp", 1), f"{where}.pp", integer=True)
        if n % (tp * pp):
            raise ClusterError(
                f"{where}.num_gpus={n} is not a multiple of tp*pp={tp * pp} (worker "
                f"'{w['name']}': tp={tp}, pp={pp}; replicas = num_gpus / (tp*pp)); change "
                "num_gpus, tp or pp"
            )
        mem = w.get("memory_gib")
        if mem is not None:
            mem = _num(mem, f"{where}.memory_gib")
        workers.append(
            WorkerSpec(
                name=w["name"],
                gpu=get_gpu_profile(w["gpu"]).name,
                num_gpus=n,
                region=w["region"],
                tp=tp,
                pp=pp,
                memory_gib=mem,
            )
        )
    names = [w.name for w in workers]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise ClusterError(f"workers: duplicate name(s) {dup}; worker names must be unique")
    return workers


def _parse_regions(raw_regions: Any, workers: list[WorkerSpec]) -> list[RegionSpec]:
    """``regions:`` list (default: workers' regions) -> RegionSpecs sorted by id."""
    used = list(dict.fromkeys(w.region for w in workers))  # first-appearance order
    if raw_regions is None:
        raw_regions = [{"name": r, "id": k} for k, r in enumerate(used)]
    if not isinstance(raw_regions, list):
        raise ClusterError("regions must be a list of {name, id}")
    regions: list[RegionSpec] = []
    rkeys = {"name", "id", "intra_gbps", "intra_rtt_ms"}
    for i, r in enumerate(raw_regions):
        where = f"regions[{i}]"
        _check_keys(r, rkeys, where)
        if not isinstance(r.get("name"), str):
            raise ClusterError(f"{where}.name is missing; give the region name used by workers")
        rid = r.get("id", i)
        if not isinstance(rid, int) or isinstance(rid, bool) or rid < 0:
            raise ClusterError(f"{where}.id={rid!r} must be an integer >= 0")
        intra = WanLink(
            src=r["name"],
            dst=r["name"],
            rtt_s=_num(
                r.get("intra_rtt_ms", DEFAULT_INTRA_RTT_MS), f"{where}.intra_rtt_ms", positive=False
            )
            / 1e3,
            bandwidth_bytes_per_s=gbps_to_bytes_per_s(
                _num(r.get("intra_gbps", DEFAULT_INTRA_GBPS), f"{where}.intra_gbps")
            ),
        )
        regions.append(RegionSpec(name=r["name"], region_id=rid, intra_link=intra))
    rnames = [r.name for r in regions]
    if len(set(rnames)) != len(rnames):
        raise ClusterError(f"regions: duplicate region names in {rnames}")
    ids = sorted(r.region_id for r in regions)
    if ids != list(range(len(regions))):
        raise ClusterError(
            f"regions[*].id = {ids} must be 0..{len(regions) - 1}, each once "
            "(they are the region ranks in real mode)"
        )
    for i, w in enumerate(workers):
        if w.region not in rnames:
            raise ClusterError(
                f"workers[{i}].region={w.region!r} is not listed under regions "
                f"{rnames}; add it there or fix the name"
            )
    unused = [r for r in rnames if r not in used]
    if unused:
        raise ClusterError(f"regions {unused} have no workers; remove them from regions")
    regions.sort(key=lambda r: r.region_id)
    return regions


def _parse_links(
    raw: dict, rnames: list[str], scale: float, base_dir: Path | None
) -> dict[tuple[str, str], WanLink]:
    """WAN CSV + ``wan_links`` overrides -> a link for every ordered region pair (scaled)."""
    csv_opt = raw.get("wan_csv", "default")
    if csv_opt in (None, "default"):
        csv_path = DEFAULT_WAN_CSV
    else:
        csv_path = Path(str(csv_opt))
        if not csv_path.is_absolute() and base_dir is not None:
            csv_path = base_dir / csv_path
    try:
        table = load_wan_csv(csv_path)
    except WanProfileError as e:
        raise ClusterError(f"wan_csv: {e}") from None
    lkeys = {"src", "dst", "rtt_ms", "gbps"}
    for i, link in enumerate(raw.get("wan_links") or []):
        where = f"wan_links[{i}]"
        _check_keys(link, lkeys, where)
        if set(link) != lkeys:
            raise ClusterError(f"{where} needs all of {sorted(lkeys)}")
        table[(str(link["src"]), str(link["dst"]))] = (
            _num(link["rtt_ms"], f"{where}.rtt_ms", positive=False),
            _num(link["gbps"], f"{where}.gbps"),
        )
    known = sorted({s for s, _ in table} | {d for _, d in table})
    links: dict[tuple[str, str], WanLink] = {}
    for src in rnames:
        for dst in rnames:
            if src == dst:
                continue
            if (src, dst) not in table:
                raise ClusterError(
                    f"no WAN link {src!r} -> {dst!r} in {csv_path.name} or wan_links; regions "
                    f"known there: {known}; fix the region name or add "
                    f"{{src: {src}, dst: {dst}, rtt_ms: ..., gbps: ...}} under wan_links"
                )
            rtt_ms, gbps = table[(src, dst)]
            links[(src, dst)] = WanLink(
                src=src,
                dst=dst,
                rtt_s=rtt_ms / 1e3,
                bandwidth_bytes_per_s=gbps_to_bytes_per_s(gbps) * scale,
            )
    return links


def _parse_rendezvous(rendezvous: Any, mode: str) -> str | None:
    """``rendezvous: host:port`` (required in real mode)."""
    if rendezvous is not None:
        ok = isinstance(rendezvous, str) and ":" in rendezvous
        if ok:
            host, port = rendezvous.rsplit(":", 1)
            ok = bool(host) and port.isdigit() and 0 < int(port) < 65536
        if not ok:
            raise ClusterError(
                f"rendezvous={rendezvous!r} must look like host:port (e.g. 10.0.0.1:29500)"
            )
    if mode == "real" and rendezvous is None:
        raise ClusterError(
            "mode=real needs rendezvous: host:port of the inter-worker store "
            "(a TCPStore all worker leaders can reach)"
        )
    return rendezvous


def _parse_slowdowns(raw: Any, workers: list[WorkerSpec]) -> tuple[Slowdown, ...]:
    """``slowdown:`` (one mapping or a list) -> Slowdowns naming existing workers."""
    if raw is None:
        return ()
    items = [raw] if isinstance(raw, dict) else raw
    if not isinstance(items, list):
        raise ClusterError("slowdown must be a mapping {worker, factor, from_round} or a list of them")
    names = [w.name for w in workers]
    out = []
    for i, d in enumerate(items):
        where = f"slowdown[{i}]"
        _check_keys(d, {"worker", "factor", "from_round", "until_round"}, where)
        if d.get("worker") not in names:
            raise ClusterError(f"{where}.worker={d.get('worker')!r} is not a worker; use one of {names}")
        until = d.get("until_round")
        out.append(Slowdown(
            worker=d["worker"],
            factor=_num(d.get("factor"), f"{where}.factor"),
            from_round=int(_num(d.get("from_round", 0), f"{where}.from_round", positive=False,
                                integer=True)),
            until_round=None if until is None else int(
                _num(until, f"{where}.until_round", integer=True)),
        ))
        if out[-1].until_round is not None and out[-1].until_round <= out[-1].from_round:
            raise ClusterError(f"{where}.until_round={out[-1].until_round} must be greater than "
                               f"from_round={out[-1].from_round} (or null: to the end)")
    return tuple(out)


def cluster_from_dict(raw: dict, *, base_dir: Path | None = None) -> ClusterSpec:
    """Validate a parsed YAML mapping and build a :class:`ClusterSpec`.

    Args:
        raw: the YAML mapping (schema in the module docstring).
        base_dir: directory against which a relative ``wan_csv`` is resolved.

    Raises:
        ClusterError: any invalid field (the message names it and the fix).
    """
    top = {
        "name",
        "mode",
        "rendezvous",
        "wan_csv",
        "wan_bandwidth_scale",
        "wan_links",
        "regions",
        "workers",
        "slowdown",
    }
    raw = _check_keys(raw, top, "cluster")
    name = str(raw.get("name", "cluster"))
    mode = raw.get("mode", "emulated")
    if mode not in ("emulated", "real"):
        raise ClusterError(f"mode={mode!r} must be 'emulated' or 'real'")
    scale = _num(raw.get("wan_bandwidth_scale", 1.0), "wan_bandwidth_scale")

    workers = _parse_workers(raw.get("workers"))
    regions = _parse_regions(raw.get("regions"), workers)
    links = _parse_links(raw, [r.name for r in regions], scale, base_dir)
    rendezvous = _parse_rendezvous(raw.get("rendezvous"), mode)
    slowdowns = _parse_slowdowns(raw.get("slowdown"), workers)

    return ClusterSpec(
        name=name,
        mode=mode,
        workers=tuple(workers),
        regions=tuple(regions),
        links=links,
        wan_bandwidth_scale=scale,
        rendezvous=rendezvous,
        slowdowns=slowdowns,
    )


def resolve_cluster(name_or_path: str | Path) -> Path:
    """Map ``four_region`` or a path to a cluster YAML file.

    Raises:
        ClusterError: no such file; the message suggests the nearest shipped example
            ("did you mean", as for config keys) and lists them all.
    """
    p = Path(name_or_path)
    for c in (p, CLUSTERS_DIR / p, CLUSTERS_DIR / f"{p}.yaml"):
        if c.is_file():
            return c
    known = sorted(x.stem for x in CLUSTERS_DIR.glob("*.yaml"))
    raise ClusterError(f"cluster '{name_or_path}' not found;{did_you_mean(p.stem, known)} give a "
                       f"YAML path or one of {known}")


def load_cluster(
    name_or_path: str | Path, *, wan_bandwidth_scale: float | None = None
) -> ClusterSpec:
    """Load and validate a cluster YAML (``geomesh.cluster`` in the job config).

    Args:
        name_or_path: a shipped example name (``four_region``) or a YAML path.
        wan_bandwidth_scale: overrides the file's scale when given.

    Raises:
        ClusterError: unreadable YAML or any invalid field.
    """
    path = resolve_cluster(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ClusterError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    if not isinstance(raw, dict):
        raise ClusterError(f"{path}: top level must be a mapping (name, mode, workers, ...)")
    raw.setdefault("name", path.stem)
    if wan_bandwidth_scale is not None:
        raw["wan_bandwidth_scale"] = wan_bandwidth_scale
    try:
        return cluster_from_dict(raw, base_dir=path.parent)
    except ClusterError as e:
        raise ClusterError(f"{path.name}: {e}") from None
