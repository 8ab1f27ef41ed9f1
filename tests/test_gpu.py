"""GPU tier: skipped without CUDA.  NCCL, bf16 and Transformer Engine specs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_tiny_gpt_trains_on_gpu_in_bf16():
    """Catches the CPU layer leaking onto GPU, or the TE/bf16 path failing."""
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "throughput.py"), "--config",
                           "tiny_gpt", "--steps", "5", "--gpu", "H100"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "cuda" and out["precision"] == "bfloat16"
    assert out["tokens_per_s"] > 0 and out["last_loss"] < 20
