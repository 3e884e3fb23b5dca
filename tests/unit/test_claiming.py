"""One order under its claim (bourse/auction/claiming.py, docs/protocol.md §5.3c): events in
with a fake clock, the exact decisions out. Each row is one order's way: the claim found,
what the bucket answered (written, taken first, failed, the reply lost), what the auction
ended with, and what the order is answered. No NATS, no sleep."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

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
from bourse.auction.claiming import KV_BACKOFF_S, TAKEN_OVER, Claiming, Clock, waited_out
from bourse.auction.claims import (
    KV_TIMEOUT_S,
    TAKEOVER_SLACK_MS,
    Claim,
    fingerprint,
    order_shape,
)
from bourse.auction.core import AuctionConfig, AuctionStateError, Finish, Log, Refuse
from bourse.wire.messages import Placed, PlaceOrder, Resources, Unfilled

T0 = 100.0  # the fake monotonic clock at the order's start, in seconds
W0 = 1_000_000  # the fake wall clock then, in ms
AID = "A-MINE"
ORDER = PlaceOrder(
    order_id="o-1", region="mad", resources=Resources(cpus=1, memory_mb=64), image="web"
)
FP = fingerprint(ORDER)
SHAPE = order_shape(ORDER)
GRACE_MS = 250  # AuctionConfig's commit_grace_ms + hold_margin_ms
UNTIL = W0 + 500 + GRACE_MS  # our claim's end, written at W0 (deadline 500 ms)
PLACED = Placed(
    order_id="o-1",
    machine_id="a~M1",
    worker_id="a",
    region="mad",
    score=0.9,
    image_cached=True,
    elapsed_ms=12.0,
)


def claim(auction_id: str = AID, until_ms: int = UNTIL, **kw: Any) -> Claim:
    fields: dict[str, Any] = {"state": "auctioning", "fingerprint": FP, "shape": SHAPE, **kw}
    return Claim(auction_id=auction_id, until_ms=until_ms, **fields)


MINE = claim()
LIVE = claim("A-LIVE", until_ms=W0 + 60_000)  # another auction, running for a minute yet
DEAD = claim("A-DEAD", until_ms=W0 - TAKEOVER_SLACK_MS)  # past its end: its process died
ELSEWHERE = claim("A-LIVE", until_ms=W0 + 60_000, state="placed", placed=PLACED)
OTHER_ORDER = claim("A-OTHER", fingerprint="another order")
RECLAIMED = claim("A-OLD", state="reclaimed", reclaimed="a~M0")


def unfilled(commits_tried: int = 0) -> Unfilled:
    return Unfilled(
        order_id="o-1",
        region="mad",
        reason="no_offers" if not commits_tried else "all_commits_rejected",
        offers=commits_tried,
        commits_tried=commits_tried,
        elapsed_ms=100.0,
        detail="…",
    )


def placed_claim(revision_claim: Claim = MINE) -> Claim:
    return msgspec.structs.replace(revision_claim, state="placed", placed=PLACED)


def unfilled_claim(at_ms: int) -> Claim:
    return msgspec.structs.replace(MINE, state="unfilled", until_ms=at_ms)


def run(order: PlaceOrder = ORDER, spent_ms: float = 0.0, retry: bool = False) -> RunAuction:
    return RunAuction(msgspec.structs.replace(order, retry=retry), spent_ms)


def warning(event: str, **fields: object) -> Log:
    return Log("warning", event, fields)


def failed(error: str = "timeout") -> Log:
    return warning("order_claim_failed", error=error)


def outcome_write(c: Claim, revision: int, at_ms: int = 0) -> WriteClaim:
    """The outcome's write, ``at_ms`` after the start: its timeout is what is left of our
    claim (KV_TIMEOUT_S at most)."""
    left = (UNTIL - (W0 + at_ms)) / 1000.0
    return WriteClaim(c, revision, min(KV_TIMEOUT_S, max(left, KV_BACKOFF_S)))


class FakeClock:
    """Both clocks, moved only by ``tick``."""

    def __init__(self) -> None:
        self.ms = 0

    def tick(self, ms: int) -> None:
        self.ms += ms

    def clock(self) -> Clock:
        return Clock(monotonic=lambda: T0 + self.ms / 1000.0, wall_ms=lambda: W0 + self.ms)


# A step: an event (a method of Claiming and its arguments; ("tick", ms) moves the clocks)
# and the decisions it must return.
Step = tuple[tuple[Any, ...], list[ClaimStep]]


def rounded(steps: list[ClaimStep]) -> list[ClaimStep]:
    """Float fields to nine places: times computed by the core and by the table differ in
    the last bits."""

    def one(s: ClaimStep) -> ClaimStep:
        if not isinstance(s, msgspec.Struct):
            return s
        floats = {
            f.name: round(v, 9)
            for f in msgspec.structs.fields(s)
            if isinstance(v := getattr(s, f.name), float)
        }
        return msgspec.structs.replace(s, **floats)

    return [one(s) for s in steps]


def play(steps: list[Step], order: PlaceOrder = ORDER, **kw: Any) -> Claiming:
    """Feed ``steps`` to a new Claiming of ``order``; each event's decisions must be the
    step's, exactly."""
    clock = FakeClock()
    c = Claiming(order, AuctionConfig(), AID, clock=clock.clock(), **kw)
    for n, ((event, *args), want) in enumerate(steps):
        if event == "tick":
            clock.tick(*args)
            continue
        got = getattr(c, event)(*args)
        assert rounded(got) == rounded(want), f"step {n} ({event}): {got}"
    return c


# The first steps of most rows: the claim created blind (at revision 7), or that create
# finding the id claimed already.
CREATED: list[Step] = [(("start",), [WriteClaim(MINE, 0)]), (("written", 7), [run()])]
CREATE_LOST: list[Step] = [(("start",), [WriteClaim(MINE, 0)]), (("written", None), [ReadClaim()])]

ROWS: dict[str, list[Step]] = {
    "a new id: the claim is created before the auction, then names its machine": [
        *CREATED,
        (("tick", 20), []),
        (("ended", PLACED), [outcome_write(placed_claim(), 7, at_ms=20)]),
        (("written", 8), [Finish(PLACED)]),
    ],
    "the create finds the id claimed by a live auction: wait, then adopt its machine": [
        *CREATE_LOST,
        (("read", LIVE, 3), [WaitForChange(3, T0 + 0.5)]),  # the order's deadline first
        (("tick", 30), []),
        (("changed",), [ReadClaim()]),
        (
            ("read", ELSEWHERE, 4),
            [
                Log("info", "order_adopted", {"machine_id": "a~M1"}),
                Finish(msgspec.structs.replace(PLACED, existing=True, elapsed_ms=30.0)),
            ],
        ),
    ],
    "a live auction that ends soon is waited for until its end and the slack": [
        *CREATE_LOST,
        (("read", claim("A-LIVE", until_ms=W0 + 100), 3), [WaitForChange(3, T0 + 0.35)]),
    ],
    "another auction holds the id past this order's deadline: unfilled, waited out": [
        *CREATE_LOST,
        (("read", LIVE, 3), [WaitForChange(3, T0 + 0.5)]),
        (("tick", 500), []),
        (("changed",), [ReadClaim()]),
        (("read", LIVE, 3), [Finish(waited_out(ORDER, 500.0))]),
    ],
    "the id names a different order: refused": [
        *CREATE_LOST,
        (
            ("read", OTHER_ORDER, 3),
            [
                Refuse(
                    "order id 'o-1' is being placed for a different order: an order id names "
                    "one order (use a new id for a new order)"
                )
            ],
        ),
    ],
    "a dead auction's claim is taken over: run as a retry, its unfilled end recorded": [
        *CREATE_LOST,
        (("read", DEAD, 3), [WriteClaim(MINE, 3)]),
        (
            ("written", 4),
            [warning("order_claim_taken_over", previous="A-DEAD"), run(retry=True)],
        ),
        (("ended", unfilled()), [outcome_write(unfilled_claim(W0), 4)]),  # it may have one
        (("written", 5), [Finish(unfilled())]),
    ],
    "a reclaimed claim: created anew over its revision, a fresh start": [
        *CREATE_LOST,
        (("read", RECLAIMED, 3), [WriteClaim(MINE, 3)]),
        (("written", 4), [run()]),
        (("ended", unfilled()), [RemoveClaim(4)]),
        (("removed",), [Finish(unfilled())]),
    ],
    "a fresh claim without a commit is removed: no machine can exist for the id": [
        *CREATED,
        (("ended", unfilled()), [RemoveClaim(7)]),
        (("removed",), [Finish(unfilled())]),
    ],
    "a remove that fails: the buyer is told unfilled all the same": [
        *CREATED,
        (("ended", unfilled()), [RemoveClaim(7)]),
        (
            ("failed", "timeout"),
            [warning("order_claim_not_recorded", error="timeout"), Finish(unfilled())],
        ),
    ],
    "unfilled after a commit: the claim says unfilled (a worker may hold an orphan)": [
        *CREATED,
        (("tick", 100), []),
        (("ended", unfilled(1)), [outcome_write(unfilled_claim(W0 + 100), 7, at_ms=100)]),
        (("written", 8), [Finish(unfilled(1))]),
    ],
    "an unfilled write that fails once is tried again": [
        *CREATED,
        (("ended", unfilled(1)), [outcome_write(unfilled_claim(W0), 7)]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.05)]),
        (("tick", 50), []),
        (("woke",), [outcome_write(unfilled_claim(W0), 7, at_ms=50)]),
        (("written", 8), [Finish(unfilled(1))]),
    ],
    "an unfilled write whose claim was taken over: told unfilled, nothing to say": [
        *CREATED,
        (("ended", unfilled(1)), [outcome_write(unfilled_claim(W0), 7)]),
        (("written", None), [ReadClaim()]),
        (("read", claim("A-TAKER"), 8), [Finish(unfilled(1))]),
    ],
    "an unfilled write that fails to the claim's end: told unfilled, said": [
        *CREATED,
        (("ended", unfilled(1)), [outcome_write(unfilled_claim(W0), 7)]),
        (("tick", 750), []),
        (
            ("failed", "timeout"),
            [warning("order_claim_not_recorded", error="timeout"), Finish(unfilled(1))],
        ),
    ],
    "a placed write that fails once is tried again, then the buyer is told": [
        *CREATED,
        (("ended", PLACED), [outcome_write(placed_claim(), 7)]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.05)]),
        (("tick", 50), []),
        (("woke",), [outcome_write(placed_claim(), 7, at_ms=50)]),
        (("failed", "no responders"), [failed("no responders"), BackOff(T0 + 0.05 + 0.1)]),
        (("tick", 100), []),
        (("woke",), [outcome_write(placed_claim(), 7, at_ms=150)]),
        (("written", 8), [Finish(PLACED)]),
    ],
    "a placed write whose reply was lost: the claim reads back as ours, Placed": [
        *CREATED,
        (("ended", PLACED), [outcome_write(placed_claim(), 7)]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.05)]),
        (("tick", 50), []),
        (("woke",), [outcome_write(placed_claim(), 7, at_ms=50)]),
        (("written", None), [ReadClaim()]),  # the revision moved: by our lost write?
        (("read", placed_claim(), 8), [Finish(PLACED)]),
    ],
    "a placed write that finds the claim taken over: not told Placed (unrecorded)": [
        *CREATED,
        (("ended", PLACED), [outcome_write(placed_claim(), 7)]),
        (("written", None), [ReadClaim()]),
        (
            ("read", claim("A-TAKER"), 8),
            [
                warning("order_claim_not_recorded", machine_id="a~M1", error=TAKEN_OVER),
                Unrecorded(PLACED, TAKEN_OVER),
            ],
        ),
    ],
    "a placed write that fails to the claim's end: not told Placed (unrecorded)": [
        *CREATED,
        (("tick", 700), []),
        (("ended", PLACED), [outcome_write(placed_claim(), 7, at_ms=700)]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.7 + 0.05)]),  # the last, at the end
        (("tick", 50), []),
        (("woke",), [outcome_write(placed_claim(), 7, at_ms=750)]),
        (
            ("failed", "timeout"),
            [
                warning("order_claim_not_recorded", machine_id="a~M1", error="timeout"),
                Unrecorded(PLACED, "timeout"),
            ],
        ),
    ],
    "the create's reply was lost: the claim read back is ours, the auction runs under it": [
        (("start",), [WriteClaim(MINE, 0)]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.05)]),
        (("tick", 50), []),
        (("woke",), [ReadClaim()]),
        (("read", MINE, 7), [run(spent_ms=50.0)]),
        (("ended", unfilled()), [RemoveClaim(7)]),  # created by this auction: fresh
    ],
    "a create that fails unwritten: created again after the back-off": [
        (("start",), [WriteClaim(MINE, 0)]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.05)]),
        (("tick", 50), []),
        (("woke",), [ReadClaim()]),
        (("read", None, 0), [WriteClaim(claim(until_ms=UNTIL), 0)]),
        (("written", 7), [run(spent_ms=50.0)]),
    ],
    "claim requests that keep failing: refused as unavailable, nothing run": [
        (("start",), [WriteClaim(MINE, 0)]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.05)]),
        (("tick", 50), []),
        (("woke",), [ReadClaim()]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.05 + 0.1)]),
        (("tick", 100), []),
        (("woke",), [ReadClaim()]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.15 + 0.2)]),
        (("tick", 200), []),
        (("woke",), [ReadClaim()]),
        (
            ("failed", "timeout"),  # 150 ms left, the next pause 400 ms: no time for it
            [
                failed(),
                Unavailable(
                    "order claims unavailable (timeout): nothing was placed; try again "
                    "(docs/protocol.md §5.3c)"
                ),
            ],
        ),
    ],
    "a wait that fails is a failed request: backed off, then read again": [
        *CREATE_LOST,
        (("read", LIVE, 3), [WaitForChange(3, T0 + 0.5)]),
        (("failed", "timeout"), [failed(), BackOff(T0 + 0.05)]),
        (("tick", 50), []),
        (("woke",), [ReadClaim()]),
    ],
    "the auction refuses the order (its id names another machine): the claim goes first": [
        *CREATED,
        (("refused", "order id 'o-1' was placed as machine b~M9 …"), [RemoveClaim(7)]),
        (("removed",), [Refuse("order id 'o-1' was placed as machine b~M9 …")]),
    ],
    "a refused order whose claim could not be removed is refused all the same": [
        *CREATED,
        (("refused", "mismatch"), [RemoveClaim(7)]),
        (("failed", "timeout"), [Refuse("mismatch")]),
    ],
}


@pytest.mark.parametrize("steps", ROWS.values(), ids=ROWS.keys())
def test_an_order_under_its_claim(steps: list[Step]) -> None:
    play(steps)


def test_a_retry_on_a_fresh_claim_commits_at_once() -> None:
    """A fresh claim proves no machine exists for the id: the auction does not gather as a
    retry, whatever the order says (`buyer place --order-id` sends retry=true)."""
    retry = msgspec.structs.replace(ORDER, retry=True)
    play([(("start",), [WriteClaim(MINE, 0)]), (("written", 7), [run(retry)])], retry)


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(
            [(("start",), [OpenClaims()]), (("opened", True), [WriteClaim(MINE, 0)])],
            id="opened: created blind, as with the bucket open",
        ),
        pytest.param(
            [
                (("start",), [OpenClaims()]),
                (("tick", 5), []),
                (("opened", False), [RunUnclaimed(5.0)]),
            ],
            id="no JetStream: the auction runs without a claim",
        ),
        pytest.param(
            [
                (("start",), [OpenClaims()]),
                (("failed", "unavailable"), [failed("unavailable"), BackOff(T0 + 0.05)]),
                (("tick", 50), []),
                (("woke",), [OpenClaims()]),
                (("opened", True), [ReadClaim()]),  # a failure may have left a claim: read
            ],
            id="an open that fails: tried again, then the claim is read",
        ),
    ],
)
def test_a_bucket_not_open_yet_is_opened_first(steps: list[Step]) -> None:
    play(steps, opened=False)


FULL = "the order claims' bucket holds 97 of its 100 bytes"


@pytest.mark.parametrize(
    ("steps", "opened"),
    [
        pytest.param(
            [
                (("start",), [WriteClaim(MINE, 0)]),
                (("failed", "max bytes", True), [NoRoom("max bytes", refused=True)]),
            ],
            True,
            id="the create refused for room: refused at once, no back-off to the deadline",
        ),
        pytest.param(
            [
                (("start",), [OpenClaims()]),
                (("failed", "no storage", True), [NoRoom("no storage", refused=True)]),
            ],
            False,
            id="a bucket that cannot be made for room: refused at once",
        ),
        pytest.param(
            [
                *CREATED,
                (("ended", PLACED), [outcome_write(placed_claim(), 7)]),
                (("failed", "max bytes", True), [failed("max bytes"), BackOff(T0 + 0.05)]),
            ],
            True,
            id="an outcome refused for room is tried again while the claim is the auction's",
        ),
    ],
)
def test_a_write_refused_for_room(steps: list[Step], opened: bool) -> None:
    play(steps, opened=opened)


@pytest.mark.parametrize(
    "steps",
    [
        pytest.param(
            [(("start",), [ReadClaim()]), (("read", None, 0), [NoRoom(FULL)])],
            id="a new order id: refused (the claim is read first, not created blind)",
        ),
        pytest.param(
            [(("start",), [ReadClaim()]), (("read", DEAD, 3), [NoRoom(FULL)])],
            id="a dead auction's claim is not taken over",
        ),
        pytest.param(
            [
                (("start",), [ReadClaim()]),
                (
                    ("read", ELSEWHERE, 3),
                    [
                        Log("info", "order_adopted", {"machine_id": "a~M1"}),
                        Finish(msgspec.structs.replace(PLACED, existing=True, elapsed_ms=0.0)),
                    ],
                ),
            ],
            id="a placed order is answered from its claim",
        ),
        pytest.param(
            [(("start",), [ReadClaim()]), (("read", LIVE, 3), [WaitForChange(3, T0 + 0.5)])],
            id="a duplicate waits for the live auction",
        ),
    ],
)
def test_a_full_bucket_takes_no_new_auction(steps: list[Step]) -> None:
    """A new auction's outcome might find no room: the order is refused (store_full),
    nothing placed. What needs no new claim goes on."""
    play(steps, full=FULL)


@pytest.mark.parametrize(
    ("event", "args"),
    [
        ("written", (7,)),
        ("read", (None, 0)),
        ("ended", (PLACED,)),
        ("refused", ("x",)),
        ("removed", ()),
        ("changed", ()),
        ("woke", ()),
        ("opened", (True,)),
    ],
)
def test_an_event_out_of_turn_is_a_driver_bug(event: str, args: tuple[Any, ...]) -> None:
    c = Claiming(ORDER, AuctionConfig(), AID, clock=FakeClock().clock())
    with pytest.raises(AuctionStateError, match="o-1"):
        getattr(c, event)(*args)
    c.start()
    c.written(7)  # the auction runs: no claim request is under way
    with pytest.raises(AuctionStateError, match="no claim request"):
        c.failed("timeout")
