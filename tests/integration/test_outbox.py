"""The supplier's outbox (supplier/outbox.py): in order, drained on close, and a publish
that fails is counted without stopping the rest."""

from __future__ import annotations

import anyio
from nats.aio.msg import Msg

from bourse.nats.connection import flush_all
from supplier.outbox import Outbox
from tests.market import Market, wait_until


async def test_messages_go_out_in_order_and_close_sends_what_is_queued(market: Market) -> None:
    sub_nc = await market.connect("sub")
    got: list[bytes] = []

    async def collect(msg: Msg) -> None:
        got.append(msg.data)

    subject = market.subjects.prefix + ".outbox"
    await sub_nc.subscribe(subject, cb=collect)
    await flush_all(sub_nc)
    box = Outbox(await market.connect("pub"))
    async with anyio.create_task_group() as tasks:
        await tasks.start(box.run)
        for i in range(200):
            box.post(subject, str(i).encode())
        await box.close()  # returns once all 200 are handed to the connection
    assert len(box) == 0
    await flush_all(box.nc)
    await wait_until(lambda: len(got) == 200)
    assert got == [str(i).encode() for i in range(200)]


async def test_a_failing_publish_is_counted_and_the_pump_goes_on(market: Market) -> None:
    nc = await market.connect("pub")
    box = Outbox(nc)
    async with anyio.create_task_group() as tasks:
        await tasks.start(box.run)
        await nc.close()  # every publish now raises
        box.post("x.y", b"1")
        box.post("x.y", b"2")
        await wait_until(lambda: box.failed == 2)
        await box.close()
