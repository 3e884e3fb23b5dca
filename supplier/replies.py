"""How a supplier host sends what the desk planned (supplier/desk.py ``Plan``, ``Post``):
each post at its delay, through the outbox, as the message its shape says, with what is
still due of it then; every offer signed with the host's key when it has one.

This is the host's side of a plan, performed as planned: what goes where and when is the
desk's decision.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Generic

import msgspec

from bourse.wire.codec import encode
from bourse.wire.messages import Offer, Offers, Waiting
from bourse.wire.signing import OfferSigner
from supplier.desk import Desk
from supplier.outbox import Outbox
from supplier.plans import Post, Send
from supplier.seat import S


class Replies(Generic[S]):
    """Performs the desk's posts for one host. ``responder``: the host's name in its
    prompt answers (``Offers.responder``, §4.4.3)."""

    def __init__(
        self, desk: Desk[S], outbox: Outbox, signer: OfferSigner | None, responder: str
    ) -> None:
        self.desk = desk
        self.outbox = outbox
        self.signer = signer  # the auction may require signed offers (--trust)
        self.responder = responder

    def schedule(self, posts: Sequence[Post[S]], t0: float) -> None:
        """Send each post at ``t0`` (a ``time.monotonic()`` reading) + its delay."""
        if not posts:
            return
        loop = asyncio.get_running_loop()
        # One reading of the clock for all of them: a post due later than one scheduled is
        # scheduled too, at a later time. (Reading the clock per post let a worse offer that
        # was already due go out before a better one still scheduled a fraction of a
        # millisecond earlier.)
        now = loop.time()
        skew = now - time.monotonic()  # the loop may keep its own clock
        for post in posts:
            at = t0 + skew + post.delay_s
            if at > now:
                loop.call_at(at, self.send, post)
            else:
                self.send(post)

    def send(self, post: Post[S]) -> None:
        """Send ``post`` now, with what is still due of it (maybe nothing)."""
        due = self.desk.due(post)
        if due is None:
            return
        msg: Offers | Offer | Waiting
        if post.shape == "answer":
            msg = self.answer(post, due)
        elif len(due) > 1:  # one process's offers in one message (§4.4.2)
            msg = Offers(offers=[self.signed(s.reply) for s in due if isinstance(s.reply, Offer)])
        else:
            reply = due[0].reply
            msg = self.signed(reply) if isinstance(reply, Offer) else reply
        self.outbox.post(post.inbox, encode(msg))

    def answer(self, post: Post[S], due: Sequence[Send[S]]) -> Offers:
        """A prompt answer (§4.4.3): this process's offers for an auction, naming the
        process, each signed and with the delay it would have waited as ``delay_ms``."""
        offers = [self.signed(s.reply, s.delay_s) for s in due if isinstance(s.reply, Offer)]
        return Offers(
            offers=offers, responder=self.responder, auction_id=post.auction_id, batches=True
        )

    def signed(self, offer: Offer, delay_s: float = 0.0) -> Offer:
        """``offer`` signed with the host's key when it has one, with ``delay_ms`` when it
        is a prompt answer's that would have waited ``delay_s``."""
        signed = self.signer.sign(offer) if self.signer is not None else offer
        if delay_s <= 0:
            return signed
        return msgspec.structs.replace(signed, delay_ms=round(delay_s * 1000.0, 3))
