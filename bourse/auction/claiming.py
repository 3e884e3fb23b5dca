"""One order under its id's claim (docs/protocol.md §5.3c), as a pure state machine
(sans-I/O, like ``bourse.auction.core.Auction``).

``Claiming`` never touches NATS, JetStream or a timer: the auctioneer performs each decision
it returns, in order, and feeds back what came of it. The clock (monotonic seconds and
wall-clock milliseconds) is injected: tests give a fake one.

Events in (methods):

- ``start()``: the first step: the bucket to open, or the claim to create (most order ids
  are new: the claim is created without a read first).
- ``opened(present)``: the claims bucket is open (``present``), or the server has none.
- ``read(claim, revision)``: the claim as read (None and the last revision when absent).
- ``written(revision)``: a revision-checked write answered: the claim's new revision, or
  None when someone else changed the claim first.
- ``removed()``: a remove answered (a wrong revision is not an error: the taker owns it).
- ``changed()``: a wait for the claim to change ended (changed or not: it is read again).
- ``woke()``: a back-off ended.
- ``failed(error, no_room)``: the last KV request failed (a timeout, no responders, an API
  error; ``no_room``: JetStream refused it for room, bourse/auction/room.py).
- ``ended(result)``: the auction ended with an outcome.
- ``refused(detail)``: the auction refused the order (its id names another order's machine).

Decisions out: the steps of ``bourse.auction.claim_steps`` (a KV request or a pause,
then the event it answers; the auction to run; the order's end), each list possibly
preceded by a ``Log`` (a structlog event with ``order_id`` and ``region`` bound).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from bourse.auction.claim_steps import (
    BackOff,
    ClaimStep,
    NoRoom,
    OpenClaims,
    ReadClaim,
    RemoveClaim,
    RunAuction,
    RunUnclaimed,
    Unavailable,
    Unrecorded,
    WaitForChange,
    WriteClaim,
)
from bourse.auction.claims import (
    KV_TIMEOUT_S,
    Adopt,
    Claim,
    ClaimDecision,
    Conflict,
    Create,
    TakeOver,
    Wait,
    decide,
    fingerprint,
    order_shape,
)
from bourse.auction.core import AuctionConfig, AuctionStateError, Finish, Log, Refuse
from bourse.wire.messages import Placed, PlaceOrder, Unfilled, now_ms

# A claim request that fails is tried again after this, doubling up to the max: while the
# order's deadline allows (then the order is refused, nothing placed without its claim), or,
# for the outcome's write, while the claim is the auction's (its until_ms).
KV_BACKOFF_S = 0.05
KV_BACKOFF_MAX_S = 0.4

TAKEN_OVER = "the claim was taken over by another auction"


@dataclass(frozen=True, slots=True)
class Clock:
    """The two clocks claims need: monotonic seconds (deadlines, pauses) and wall-clock
    milliseconds (a claim's ``until_ms``, shared with other processes)."""

    monotonic: Callable[[], float] = time.monotonic
    wall_ms: Callable[[], int] = now_ms


SYSTEM_CLOCK = Clock()


Phase = Literal[
    "new",
    "opening",  # the bucket is being opened
    "reading",  # the claim is being read
    "creating",  # this auction's claim is being written
    "waiting",  # another live auction holds the id
    "pausing",  # a failed request's back-off
    "auctioning",
    "recording",  # the outcome is being written
    "confirming",  # a rejected outcome write: is the claim ours after all?
    "record_pausing",  # a failed outcome write's back-off
    "removing",  # the claim of an auction without a commit is being deleted
    "refusing",  # the claim of a refused order is being deleted
    "done",
]


class Claiming:
    """One order's way through its claim: find (or create) the claim, run the auction under
    it, record the outcome. ``auction_id`` names the claim's holder and the auction's bids;
    ``spent_ms``: time the order already waited (admission); ``opened``: whether the
    claims bucket is open already (else it is opened first); ``full``: why the bucket takes
    no new order ("" while it does: an order whose id is claimed already is still answered
    from its claim); ``clock``: the system's unless given."""

    __slots__ = (
        "_backoff",
        "_decision",
        "_found",
        "_fp",
        "_full",
        "_grace_ms",
        "_held",
        "_looked",
        "_mine",
        "_opened",
        "_outcome",
        "_refusal",
        "_result",
        "_shape",
        "_spent_at_claim",
        "_until_ms",
        "auction_id",
        "clock",
        "deadline",
        "order",
        "phase",
        "spent_ms",
        "t0",
    )

    def __init__(
        self,
        order: PlaceOrder,
        config: AuctionConfig,
        auction_id: str,
        *,
        spent_ms: float = 0.0,
        opened: bool = True,
        full: str = "",
        clock: Clock | None = None,
    ) -> None:
        self.order = order
        self.auction_id = auction_id
        self.clock = clock = clock or SYSTEM_CLOCK
        self.phase: Phase = "new"
        self.t0 = clock.monotonic()
        self.spent_ms = spent_ms
        self.deadline = self.t0 + max(1.0, order.deadline_ms - spent_ms) / 1000.0
        self._fp = fingerprint(order)
        self._shape = order_shape(order)  # kept in the claim: a reclaim check goes by it
        # the claim outlives the deadline as the auction's holds do
        self._grace_ms = int(config.commit_grace_ms) + config.hold_margin_ms
        self._opened = opened
        self._full = full
        self._looked = False  # read at least once (else: created blind)
        self._found: Claim | None = None  # the claim as last read
        self._decision: ClaimDecision = Create()
        self._mine: Claim | None = None  # this auction's claim
        self._until_ms = 0  # its end (wall clock)
        self._held = 0  # its revision
        self._spent_at_claim = 0.0
        self._backoff = KV_BACKOFF_S
        self._result: Placed | Unfilled | None = None
        self._outcome: Claim | None = None  # the outcome's write
        self._refusal = ""

    # -- events ----------------------------------------------------------------------------

    def start(self) -> list[ClaimStep]:
        """The first step: open the bucket, or create the claim without reading it first
        (most order ids are new: one KV round trip saved; a create that loses reads it)."""
        self._expect("new")
        return self._look()

    def opened(self, present: bool) -> list[ClaimStep]:
        """The bucket is open (``present``), or the server has no JetStream."""
        self._expect("opening")
        if not present:  # no JetStream (or claims off): as without claims
            return self._end(RunUnclaimed(self._spent(self.clock.monotonic())))
        self._opened = True
        return self._look()

    def read(self, claim: Claim | None, revision: int) -> list[ClaimStep]:
        """The claim as read (None: absent, ``revision`` its last one)."""
        if self.phase == "confirming":
            assert self._outcome is not None  # the outcome's write was rejected
            if claim is not None and _same_outcome(claim, self._outcome):
                return self._recorded()  # our write, whose answer was lost
            return self._not_recorded(TAKEN_OVER, failed=False)
        self._expect("reading")
        return self._found_claim(claim, revision)

    def written(self, revision: int | None) -> list[ClaimStep]:
        """The write answered: the claim's new revision, or None (changed by someone else)."""
        if self.phase == "recording":
            if revision is not None:
                return self._recorded()
            self.phase = "confirming"
            return [ReadClaim()]
        self._expect("creating")
        if revision is None:  # another process claimed it first: look again
            return self._look()
        return self._run(revision)

    def removed(self) -> list[ClaimStep]:
        """The remove answered."""
        if self.phase == "refusing":
            return self._end(Refuse(self._refusal))
        self._expect("removing")
        return self._recorded()

    def changed(self) -> list[ClaimStep]:
        """The wait for a change ended (changed or not)."""
        self._expect("waiting")
        return self._look()

    def woke(self) -> list[ClaimStep]:
        """The back-off ended."""
        if self.phase == "record_pausing":
            return self._write_outcome()
        self._expect("pausing")
        return self._look()

    def failed(self, error: str, no_room: bool = False) -> list[ClaimStep]:
        """The last KV request failed (``error`` says how; ``no_room``: refused for room)."""
        if no_room and self.phase in ("opening", "creating"):
            return self._end(NoRoom(error, refused=True))
        if self.phase in ("opening", "reading", "creating", "waiting"):
            return self._pause(error)
        if self.phase in ("recording", "confirming"):
            return self._record_failed(error)
        if self.phase == "removing":  # the buyer may be told Unfilled: no machine is named
            return [_warning("order_claim_not_recorded", error=error), *self.removed()]
        if self.phase == "refusing":
            return self.removed()
        raise AuctionStateError(f"order {self.order.order_id}: no claim request in {self.phase}")

    def ended(self, result: Placed | Unfilled) -> list[ClaimStep]:
        """The auction's outcome: recorded in the claim (placed, or unfilled after a
        commit or on a claim taken over), or the claim removed (unfilled without a commit
        on a claim this auction created: no machine can exist for the id)."""
        self._expect("auctioning")
        self._result = result
        mine = self._mine
        assert mine is not None  # held, since the auction runs
        if isinstance(result, Placed):
            return self._record(msgspec.structs.replace(mine, state="placed", placed=result))
        if result.commits_tried == 0 and isinstance(self._decision, Create):
            self.phase = "removing"
            return [RemoveClaim(self._held)]
        # A commit went out and was not placed (if it timed out, the worker may hold a
        # machine whose abort is lost), or the claim was taken over from an auction that
        # may have committed one this auction did not hear. The claim says so: the next
        # attempt takes it over at once and gathers as a retry (it adopts such a machine),
        # and without one the worker reclaims it (§5.3d). Deleting it would forget that
        # machine.
        gone = msgspec.structs.replace(mine, state="unfilled", until_ms=self.clock.wall_ms())
        return self._record(gone)

    def refused(self, detail: str) -> list[ClaimStep]:
        """The auction refused the order: its id names another order's machine (past the
        window): the claim is not this order's to keep."""
        self._expect("auctioning")
        self.phase, self._refusal = "refusing", detail
        return [RemoveClaim(self._held)]

    # -- steps -----------------------------------------------------------------------------

    def _look(self) -> list[ClaimStep]:
        if not self._opened:
            self.phase = "opening"
            return [OpenClaims()]
        if self._looked or self._full:  # a full bucket: the id may be answered from it
            self.phase = "reading"
            return [ReadClaim()]
        self._looked = True
        return self._found_claim(None, 0)

    def _found_claim(self, claim: Claim | None, revision: int) -> list[ClaimStep]:
        """What to do about the claim found (or assumed absent)."""
        now, wall = self.clock.monotonic(), self.clock.wall_ms()
        self._found = claim
        spent = self._spent(now)
        own = claim is not None and claim.auction_id == self.auction_id
        d = Create() if own else decide(claim, self.order, self._fp, wall)
        if now >= self.deadline and not isinstance(d, Adopt | Conflict):
            return self._end(Finish(waited_out(self.order, spent)))  # lost every race
        if isinstance(d, Adopt):
            adopted = msgspec.structs.replace(d.placed, existing=True, elapsed_ms=round(spent, 3))
            fields: dict[str, object] = {"machine_id": adopted.machine_id}
            return [Log("info", "order_adopted", fields), *self._end(Finish(adopted))]
        if isinstance(d, Conflict):
            return self._end(Refuse(d.detail))
        if isinstance(d, Wait):
            self.phase = "waiting"
            until = min(self.deadline, now + (d.until_ms - wall) / 1000.0)
            return [WaitForChange(revision, until)]
        if self._full and not own:  # a new auction: its outcome may find no room
            return self._end(NoRoom(self._full))
        self._decision, self._spent_at_claim = d, spent
        self._until_ms = wall + int((self.deadline - now) * 1000.0) + self._grace_ms
        self._mine = Claim(
            state="auctioning",
            auction_id=self.auction_id,
            fingerprint=self._fp,
            until_ms=self._until_ms,
            shape=self._shape,
        )
        if own:  # our own write, whose answer was lost
            return self._run(revision)
        self.phase = "creating"
        return [WriteClaim(self._mine, revision)]

    def _run(self, held: int) -> list[ClaimStep]:
        """The claim is held at revision ``held``: the auction runs. A fresh claim means no
        machine exists for the id (within the window): no retry gathering. A taken-over one
        may have a machine: it gathers as a retry."""
        self.phase, self._held = "auctioning", held
        retry = isinstance(self._decision, TakeOver)
        run = RunAuction(msgspec.structs.replace(self.order, retry=retry), self._spent_at_claim)
        if not retry:
            return [run]
        previous = self._found.auction_id if self._found is not None else None
        return [_warning("order_claim_taken_over", previous=previous), run]

    def _pause(self, error: str) -> list[ClaimStep]:
        """A claim request failed: try again after the back-off, or refuse the order when
        it has no time left for another try. No claim, no auction: one placed without its
        claim could be this id's second machine (I3 before availability)."""
        now = self.clock.monotonic()
        said = _warning("order_claim_failed", error=error)
        self._looked = True
        if self.deadline - now <= self._backoff:
            detail = (
                f"order claims unavailable ({error}): nothing was placed; try again "
                "(docs/protocol.md §5.3c)"
            )
            return [said, *self._end(Unavailable(detail))]
        self.phase = "pausing"
        until = now + self._backoff
        self._backoff = min(2 * self._backoff, KV_BACKOFF_MAX_S)
        return [said, BackOff(until)]

    def _record(self, outcome: Claim) -> list[ClaimStep]:
        self._outcome, self._backoff = outcome, KV_BACKOFF_S
        return self._write_outcome()

    def _write_outcome(self) -> list[ClaimStep]:
        """Write the outcome over our claim, revision-checked. A failed write is tried
        again while the claim is ours (until its until_ms: nobody takes it over before
        then, and a late try never overwrites a taker's)."""
        self.phase = "recording"
        assert self._outcome is not None  # set by _record
        left = self._left_s()
        timeout = min(KV_TIMEOUT_S, max(left, KV_BACKOFF_S))
        return [WriteClaim(self._outcome, self._held, timeout)]

    def _record_failed(self, error: str) -> list[ClaimStep]:
        left = self._left_s()
        if left <= 0:
            return self._not_recorded(error, failed=True)
        self.phase = "record_pausing"
        until = self.clock.monotonic() + min(self._backoff, left)  # the last at the end
        self._backoff = min(2 * self._backoff, KV_BACKOFF_MAX_S)
        return [_warning("order_claim_failed", error=error), BackOff(until)]

    def _recorded(self) -> list[ClaimStep]:
        assert self._result is not None  # the auction has ended
        self.phase = "done"
        return [Finish(self._result)]

    def _not_recorded(self, why: str, *, failed: bool) -> list[ClaimStep]:
        """The outcome is not in the claim. A Placed is not told (the claim stays as it
        was: auctioning until it expires, then taken over as a retry's, which adopts this
        machine from its worker; or reclaimed by the worker's check when another machine is
        the claim's, §5.3c, §5.3d). An Unfilled is told all the same."""
        result = self._result
        assert result is not None  # the auction has ended
        if isinstance(result, Placed):
            said = _warning("order_claim_not_recorded", machine_id=result.machine_id, error=why)
            return [said, *self._end(Unrecorded(result, why))]
        if not failed:
            return self._end(Finish(result))
        return [_warning("order_claim_not_recorded", error=why), *self._end(Finish(result))]

    def _end(self, step: ClaimStep) -> list[ClaimStep]:
        self.phase = "done"
        return [step]

    def _spent(self, now: float) -> float:
        return self.spent_ms + (now - self.t0) * 1000.0

    def _left_s(self) -> float:
        """Seconds until our claim's end (its until_ms)."""
        return (self._until_ms - self.clock.wall_ms()) / 1000.0

    def _expect(self, phase: Phase) -> None:
        if self.phase != phase:
            raise AuctionStateError(
                f"order {self.order.order_id}'s claim is {self.phase}, not {phase}"
            )


def waited_out(order: PlaceOrder, elapsed_ms: float) -> Unfilled:
    """The order's deadline passed while another auction held its id."""
    return Unfilled(
        order_id=order.order_id,
        region=order.region,
        reason="deadline",
        offers=0,
        commits_tried=0,
        elapsed_ms=round(elapsed_ms, 3),
        detail=f"order id {order.order_id!r} is being placed by another auction, which did "
        "not finish by this order's deadline; ask again for its outcome",
    )


def _same_outcome(a: Claim, b: Claim) -> bool:
    """Whether claim ``a`` is the write ``b``: the same auction, state and machine."""
    machine = a.placed.machine_id if a.placed is not None else None
    return (a.auction_id, a.state, machine) == (
        b.auction_id,
        b.state,
        b.placed.machine_id if b.placed is not None else None,
    )


def _warning(event: str, **fields: object) -> Log:
    return Log("warning", event, fields)
