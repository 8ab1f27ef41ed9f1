"""Shared fixtures: one tokenizer/dataset cache for the whole test session."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> str:
    """Tokenizer and tokenized-corpus cache shared by every test (built once).

    Under pytest-xdist each worker has its own (a subfolder per worker of
    ``GEOCONA_TEST_CACHE``): files are written atomically, but megatron-core's
    dataset index cache is not, and two workers building the same index at once
    could read each other's half-written file."""
    env = os.environ.get("GEOCONA_TEST_CACHE")
    if env:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        path = Path(env) / worker if worker else Path(env)
        path.mkdir(parents=True, exist_ok=True)
        return str(path)
    return str(tmp_path_factory.mktemp("cache"))
