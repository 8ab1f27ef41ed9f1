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
    """Tokenizer and tokenized-corpus cache shared by every test (built once)."""
    env = os.environ.get("GEOCONA_TEST_CACHE")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return env
    return str(tmp_path_factory.mktemp("cache"))
