"""A client cut off from NATS fails an order at once instead of sending it late, and closes
cleanly whatever it published meanwhile."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import uvloop

from bourse.client import BourseClient, ClientError
from bourse.nats.connection import connect, shutdown
from bourse.nats.embedded import EmbeddedNats
from bourse.wire.messages import PlaceOrder, Resources
from tests.market import wait_until


async def test_order_is_not_buffered_while_disconnected(tmp_path: Path) -> None:
    srv = EmbeddedNats(workdir=tmp_path / "nats").start()
    nc = await connect(srv.url, name="offline-client", service=True)
    try:
        srv.stop()
        await wait_until(lambda: not nc.is_connected, timeout_s=10)  # the client noticed
        order = PlaceOrder(
            region="mad", resources=Resources(cpus=1, memory_mb=64), image="web", deadline_ms=500
        )
        t0 = time.monotonic()
        with pytest.raises(ClientError, match="not connected to NATS") as err:
            await BourseClient(nc).place(order)
        assert err.value.code == "not_connected"
        # at once, not after the 2.5 s reply timeout: nothing was queued to go out later
        assert time.monotonic() - t0 < 1.0
    finally:
        await shutdown(nc)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_client_that_published_while_cut_off_closes_cleanly(tmp_path: Path, loop: str) -> None:
    """What nats-py buffered while disconnected cannot be sent once the client closes; its
    close wrote it to the dead socket and raised (uvloop, the programs' loop: RuntimeError
    "the handler is closed"; asyncio's: ConnectionResetError), so a program stopped while
    reconnecting exited 1. On each loop, as the programs and the tests run it."""
    srv = EmbeddedNats(workdir=tmp_path / "nats").start()

    async def cut_off_then_closed() -> None:
        nc = await connect(srv.url, name="offline-publisher", service=True)
        srv.stop()
        await wait_until(lambda: not nc.is_connected, timeout_s=10)
        await nc.publish("somewhere", b"published while cut off")  # kept for a reconnect
        await shutdown(nc)
        assert nc.is_closed

    try:
        run = uvloop.run if loop == "uvloop" else asyncio.run
        run(cut_off_then_closed())
    finally:
        srv.stop()
