"""Fixtures of the topology tests: real superclusters (see supercluster.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bourse.nats.supercluster import Supercluster


@pytest.fixture(scope="session")
def three_clusters(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supercluster]:
    """Cluster a (2 servers: exchange and buyers), b and c (1 server each: suppliers).
    Shared by the tests of this directory; each uses its own subject prefix."""
    sc = Supercluster(tmp_path_factory.mktemp("sc3"), {"a": 2, "b": 1, "c": 1}).start()
    yield sc
    sc.stop()
