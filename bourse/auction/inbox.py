"""The auctioneer's inbox: every reply to its auctions, on one wildcard subscription.

Each auction gets a token under the inbox for its bid's replies (a sampled bid one per
shard, §5.3a, so the auction knows which shard answered); the ``Answers`` to the
auctioneer's batches (§4.4.4) come to the token ``answers`` and are split by auction. A reply
goes to its auction's ``Mailbox``. A reply to an auction that has ended, and folded its
region release into its commit (§4.6), gets the workers it names a release (§5.2 step 8)
as long as a hold taken for that auction's bid can live: nothing else would drop it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.auction.core import FoldedAuctions, late_releases
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import Answers, Offers
from bourse.wire.subjects import Subjects

log = structlog.get_logger("bourse.auction")

# The token the Answers to the auctioneer's batches come to (auction ids are ULIDs).
ANSWERS_TOKEN = "answers"
# A wake this much later than asked for means the process did not run meanwhile (a GC
# pause, its CPU taken by other processes): replies that came in that time may be unread.
STALL_S = 0.02


class Mailbox:
    """Replies to one auction (messages, and answers routed to it out of an ``Answers``
    message): a deque and at most one waiter (no task per wait)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: deque[Msg | Offers] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, msg: Msg | Offers) -> None:
        self.items.append(msg)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self, within_s: float) -> bool:
        """Wait up to ``within_s`` for a reply; False if none came."""
        if self.items:
            return True
        if within_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        self.waiter = waiter = loop.create_future()
        timer = loop.call_later(within_s, _wake, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self.waiter = None
        return bool(self.items)

    async def wait_after_stall(self, woke_for: float, until: float) -> bool:
        """A wait for a reply until monotonic ``woke_for`` found none. If the wake came
        more than STALL_S late, wait as long again, never past ``until``: time the process
        did not run is not time it listened, and the replies sent in it are read only
        now. True if one came."""
        now = time.monotonic()
        late = now - woke_for
        return late > STALL_S and await self.wait(min(late, until - now))


class Inbox:
    """The replies to one auctioneer's auctions, routed to their mailboxes."""

    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self.nc = nc
        self.subjects = subjects
        self.prefix = ""  # the inbox's subject, once open
        self._sub: Subscription | None = None
        self._boxes: dict[str, Mailbox] = {}
        # Auctions that folded their region release into the commit, kept while a hold of
        # theirs can live (_late).
        self._folded = FoldedAuctions()

    @property
    def answers_to(self) -> str:
        """Where the answers to the auctioneer's batches go."""
        return f"{self.prefix}.{ANSWERS_TOKEN}"

    async def open(self) -> None:
        """Subscribe (once) to every token under the inbox."""
        if self._sub is None:
            prefix = self.nc.new_inbox()
            self._sub = await self.nc.subscribe(prefix + ".*", cb=self._route)
            self.prefix = prefix

    def box(self, auction_id: str, shards: tuple[int, ...]) -> tuple[Mailbox, str]:
        """A mailbox for the replies to auction ``auction_id`` (of its sampled bid's
        ``shards`` too), and the reply subject of its bid."""
        box = self._boxes[auction_id] = Mailbox()
        for k in shards:
            self._boxes[shard_token(auction_id, k)] = box
        return box, f"{self.prefix}.{auction_id}"

    def drop(self, auction_id: str, shards: tuple[int, ...]) -> None:
        """The auction has ended: its replies are no longer routed to its mailbox."""
        del self._boxes[auction_id]
        for k in shards:
            del self._boxes[shard_token(auction_id, k)]

    async def fold(
        self, auction_id: str, order_id: str, hold_ms: int, leftovers: Iterable[Msg | Offers]
    ) -> None:
        """Auction ``auction_id`` of ``order_id`` folded its region release into its commit:
        remember it as long as a hold taken for its bid can live (``hold_ms``, plus a
        margin for a bid received late), and release what ``leftovers`` (replies that came
        during the commit, too late for the auction) hold."""
        self._folded.fold(auction_id, order_id, hold_ms, time.monotonic())
        for item in leftovers:
            await self._late(auction_id, item if isinstance(item, Offers) else item.data)

    async def close(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None

    async def _route(self, msg: Msg) -> None:
        token = msg.subject[len(self.prefix) + 1 :]
        if token == ANSWERS_TOKEN:
            for late in self._route_answers(msg):
                await self._late(late.auction_id, late)
            return
        box = self._boxes.get(token)
        if box is not None:
            box.put(msg)
        elif self._folded:
            await self._late(token.partition("-")[0], msg.data)  # a shard's token too

    def _route_answers(self, msg: Msg) -> list[Offers]:
        """One supplier process's answers to the bids of a batch: each to its auction.
        Returns those whose auction has ended (for ``_late``)."""
        try:
            answers = decode(msg.data, Answers)
        except BadMessage as exc:
            log.warning("bad_answers", error=str(exc))
            return []
        late: list[Offers] = []
        for offers in answers.answers:
            box = self._boxes.get(offers.auction_id)
            if box is not None:
                box.put(offers)
            elif self._folded and offers.offers:
                late.append(offers)
        return late

    async def _late(self, auction_id: str, reply: bytes | Offers) -> None:
        """A reply to an auction that has ended: if it folded its release, whatever the
        reply holds goes (a process the auction did not know)."""
        order_id = self._folded.order_of(auction_id, time.monotonic())
        if order_id is None:
            return
        releases = late_releases(reply, order_id, auction_id)
        if not releases:
            return
        log.info(
            "late_reply_released",
            order_id=order_id,
            auction_id=auction_id,
            workers=[r.worker_id for r in releases],
        )
        try:
            for release in releases:
                await self.nc.publish(self.subjects.release(release.worker_id), encode(release))
        except Exception as exc:  # connection lost: the holds fall back to their TTL
            log.warning("release_failed", order_id=order_id, error=repr(exc))


def shard_token(auction_id: str, shard: int) -> str:
    """The token of a sampled bid's replies from one shard (auction ids are ULIDs, which
    have no '-'); its reply subject is the auction's with the same suffix."""
    return f"{auction_id}-{shard}"


def reply_shard(subject: str) -> int | None:
    """The shard whose reply subject (``shard_token``) ``subject`` is, or None."""
    dash = subject.rfind("-", subject.rfind(".") + 1)
    return int(subject[dash + 1 :]) if dash >= 0 else None


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
