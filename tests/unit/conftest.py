"""Fixtures the supplier's unit tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from supplier.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A real store (SQLite) in the test's temp dir, closed after it."""
    s = Store(tmp_path / "supplier.db")
    try:
        yield s
    finally:
        s.close()
