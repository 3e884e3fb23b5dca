"""Shared fixtures: one real nats-server per test session (tests isolate themselves with a
unique subject prefix), and a Market helper that builds suppliers, exchanges and buyers on
it and closes everything it built."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from bourse.nats.embedded import EmbeddedNats
from bourse.view.keeper import ENV_KEEPER_S
from bourse.wire.subjects import Subjects
from tests.market import Market

# pytester: the unit tests check their own boundary by running a test session in process;
# tests.isolation: what lets tests share the host (its fixtures)
pytest_plugins = ("pytester", "tests.isolation")


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    # JetStream on, its own store dir; every test's prefix gets its own event stream (each
    # reserves its max_bytes), hence a store limit far above what the session writes.
    # Monitoring on: the load-test smoke run reads its message counters (/varz).
    srv = EmbeddedNats(
        workdir=tmp_path_factory.mktemp("nats"), jetstream_max_store_mb=1024 * 1024, monitor=True
    ).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session", autouse=True)
def _view_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The buyer keeps its view of a market under the user's cache directory: the tests'
    under a directory of their own, not the home's. And no keeper of a view is started by
    an invocation (a keeper outlives its invocation by minutes: one a test's market would
    outlive the tests); tests/integration/test_view_keeper.py turns them on, and stops
    them."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))
    os.environ[ENV_KEEPER_S] = "0"
    yield


@pytest.fixture
def subjects() -> Subjects:
    return Subjects(f"t{uuid.uuid4().hex[:12]}")


@pytest.fixture
async def market(
    nats_server: EmbeddedNats, subjects: Subjects, tmp_path: Path
) -> AsyncIterator[Market]:
    async with Market(nats_server.url, subjects, tmp_path) as m:
        yield m
