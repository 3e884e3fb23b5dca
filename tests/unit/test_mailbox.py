"""An auction's mailbox (bourse/auction/inbox.py) after a wake that found no reply: one that
came late, the process not running meanwhile, listens as long again for the replies the
stall held up, never past the auction's end; one on time does not wait."""

from __future__ import annotations

import asyncio
import time

from bourse.auction.inbox import STALL_S, Mailbox
from bourse.wire.messages import Offers

REPLY = Offers(offers=[], responder="p1", auction_id="A1")


async def test_a_late_wake_listens_as_long_again_for_the_replies_the_stall_held_up() -> None:
    box = Mailbox()
    now = time.monotonic()
    asyncio.get_running_loop().call_later(0.01, box.put, REPLY)  # read once the loop runs
    assert await box.wait_after_stall(woke_for=now - 5 * STALL_S, until=now + 60)
    assert list(box.items) == [REPLY]


async def test_a_late_wake_listens_no_longer_than_the_auction_lasts() -> None:
    box = Mailbox()
    now = time.monotonic()
    asyncio.get_running_loop().call_later(0.01, box.put, REPLY)
    assert not await box.wait_after_stall(woke_for=now - 5 * STALL_S, until=now - 0.001)
    assert not box.items  # it did not wait for the reply


async def test_a_wake_on_time_does_not_wait() -> None:
    box = Mailbox()
    asyncio.get_running_loop().call_later(0.01, box.put, REPLY)
    assert not await box.wait_after_stall(
        woke_for=time.monotonic() + 60, until=time.monotonic() + 60
    )
    assert not box.items
