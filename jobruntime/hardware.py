"""GPU profiles: peak throughput, memory and an efficiency curve per GPU type.

Shared by GeoMesh (heterogeneous workers) and CONA (emulated devices).  The
datasheet numbers and their sources live in ``gpu_profiles.yaml``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

PROFILES_FILE = Path(__file__).with_name("gpu_profiles.yaml")


@dataclass(frozen=True, kw_only=True)
class GPUProfile:
    """One GPU type.

    Attributes:
        name: profile key, e.g. ``"A100-80GB"``.
        peak_tflops: dense BF16 (FP16 on V100/T4) tensor throughput, TFLOP/s.
        memory_gib: device memory, GiB.
        memory_bw_gbs: memory bandwidth, GB/s.
        mfu_max: model-FLOPs utilisation reached at large micro-batches.
        half_sat_tokens: tokens per micro-batch at which half of ``mfu_max``
            is reached.
        source: datasheet the numbers come from.
    """

    name: str
    peak_tflops: float
    memory_gib: float
    memory_bw_gbs: float
    mfu_max: float
    half_sat_tokens: float
    source: str = ""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    def efficiency(self, tokens_per_microbatch: float) -> float:
        """MFU at a micro-batch of ``tokens_per_microbatch`` tokens (saturating curve)."""
        t = max(float(tokens_per_microbatch), 0.0)
        return self.mfu_max * t / (t + self.half_sat_tokens)

    def achieved_flops(self, tokens_per_microbatch: float) -> float:
        """Achieved FLOP/s at that micro-batch size."""
        return self.peak_tflops * 1e12 * self.efficiency(tokens_per_microbatch)


@functools.cache
def gpu_profiles() -> dict[str, GPUProfile]:
    """All bundled profiles, keyed by name."""
    raw = yaml.safe_load(PROFILES_FILE.read_text())
    return {name: GPUProfile(name=name, **fields) for name, fields in raw.items()}


def get_gpu_profile(name: str) -> GPUProfile:
    """Profile by name (case-insensitive).

    Raises:
        KeyError: unknown GPU; the message lists the known ones.
    """
    profiles = gpu_profiles()
    for key, prof in profiles.items():
        if key.lower() == name.lower():
            return prof
    raise KeyError(f"unknown GPU type '{name}'; known: {sorted(profiles)}")


def gpu_profile_arg(name: str) -> str:
    """``argparse`` ``type=`` for an emulated GPU's name (a bench's ``--gpu``): ``name``
    itself where a bundled profile has it (case-insensitive, :func:`get_gpu_profile`).

    Raises:
        argparse.ArgumentTypeError: unknown GPU; the message lists the known ones (so the
            bench stops with a usage error before any set-up, not a traceback in a worker).
    """
    import argparse

    try:
        get_gpu_profile(name)
    except KeyError as e:
        raise argparse.ArgumentTypeError(e.args[0]) from None
    return name


def profile_for_device(name: str | None = None) -> GPUProfile | None:
    """The profile of a CUDA device by its name (``torch.cuda.get_device_name``).

    ``"NVIDIA H200"`` → ``H200``, ``"NVIDIA A100-SXM4-80GB"`` → ``A100-80GB``:
    the longest profile key whose parts all occur in the device name.  None on
    CPU or for an unknown GPU.
    """
    import torch

    if name is None:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name()
    upper = name.upper()
    hits = [p for key, p in gpu_profiles().items()
            if all(part in upper for part in key.upper().split("-"))]
    return max(hits, key=lambda p: len(p.name)) if hits else None
