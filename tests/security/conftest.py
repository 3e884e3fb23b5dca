"""A secured market: keys from bourse/nats/authdir.py (what `bourse auth init` writes), a real
nats-server started with the generated config, and connections as each role.

Users: operator (the market's JetStream set-up), buyer (the shared buyer key), buyer:alice and
buyer:bob (tenants), exchange, supplier:mad-1 and supplier:mad-2 (one worker each), and
supplier:fleet-fra (a fleet user covering fra-1 and fra-2). The server runs JetStream.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NATS

from bourse.nats.authdir import AuthFiles, SupplierSpec, write_auth_dir
from bourse.nats.connection import connect
from bourse.nats.embedded import EmbeddedNats
from bourse.wire.subjects import Subjects

PREFIX = "sec"
SUPPLIERS = [
    SupplierSpec("mad-1", (("mad-1", "mad"),)),
    SupplierSpec("mad-2", (("mad-2", "mad"),)),
    SupplierSpec("fleet-fra", (("fra-1", "fra"), ("fra-2", "fra"))),
]
TENANTS = ("alice", "bob")
FLEET_FRA = """
[[worker]]
worker_id = "fra-1"
region = "fra"
capacity = { cpus = 8, memory_mb = 8192 }
images = ["web"]

[[worker]]
worker_id = "fra-2"
region = "fra"
capacity = { cpus = 4, memory_mb = 4096 }
"""


class Violations:
    """error_cb of one connection: permission violations queue up, to be awaited (never
    slept on); anything else is kept in ``other``."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue()
        self.other: list[Exception] = []

    async def error_cb(self, exc: Exception) -> None:
        if "permissions violation" in str(exc):
            self.queue.put_nowait(str(exc))
        else:
            self.other.append(exc)

    async def next(self, timeout_s: float = 5.0) -> str:
        return await asyncio.wait_for(self.queue.get(), timeout_s)

    def none_yet(self) -> bool:
        return self.queue.empty()

    def denied(self) -> set[str]:
        """The subjects of the violations queued so far (lower case, as nats-py says them);
        await a round trip first (flush_all): the server reports a violation before it."""
        out = set()
        while not self.queue.empty():
            found = re.search(r'publish to "([^"]+)"', self.queue.get_nowait())
            if found:
                out.add(found.group(1))
        return out


@dataclass
class Secured:
    server: EmbeddedNats
    files: AuthFiles
    subjects: Subjects
    conns: list[NATS] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.url

    def creds(self, user: str) -> str:
        return str(self.files.seed_file(user))

    async def close(self) -> None:
        for nc in self.conns:
            if not nc.is_closed:
                await nc.close()

    async def connect(self, user: str, **kw: Any) -> tuple[NATS, Violations]:
        v = Violations()
        nc = await connect(
            self.url, name=user, creds=self.creds(user), service=False, error_cb=v.error_cb, **kw
        )
        self.conns.append(nc)
        return nc, v


def make_auth_dir(out: Path, **kw: Any) -> AuthFiles:
    return write_auth_dir(out, Subjects(PREFIX), SUPPLIERS, buyers=TENANTS, **kw)


@pytest.fixture
def auth_files(tmp_path: Path) -> AuthFiles:
    return make_auth_dir(tmp_path / "auth")


@pytest.fixture
def secured_server(auth_files: AuthFiles, tmp_path: Path) -> Iterator[EmbeddedNats]:
    # JetStream on, as the market requires (and as `auth init`'s run line starts it)
    srv = EmbeddedNats(
        workdir=tmp_path / "nats", config=auth_files.server_conf, jetstream=True
    ).start()
    yield srv
    srv.stop()


@pytest.fixture
async def secured(secured_server: EmbeddedNats, auth_files: AuthFiles) -> AsyncIterator[Secured]:
    s = Secured(secured_server, auth_files, Subjects(PREFIX))
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def secured_js(auth_files: AuthFiles, tmp_path: Path) -> AsyncIterator[Secured]:
    """``secured`` with JetStream on (order claims)."""
    srv = EmbeddedNats(
        workdir=tmp_path / "nats-js", config=auth_files.server_conf, jetstream=True
    ).start()
    s = Secured(srv, auth_files, Subjects(PREFIX))
    try:
        yield s
    finally:
        await s.close()
        srv.stop()
