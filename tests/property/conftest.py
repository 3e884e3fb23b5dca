"""One supplier process and one exchange process for all the property tests (started once)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bourse.nats.embedded import EmbeddedNats
from tests.property.harness import Harness


@pytest.fixture(scope="session")
def harness(
    nats_server: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Harness]:
    h = Harness(nats_server.url, tmp_path_factory.mktemp("property")).start()
    try:
        yield h
    finally:
        h.close()
