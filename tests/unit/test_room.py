"""Whether the claims bucket takes a new order (bourse/auction/room.py): what a look at its
fill and a write refused for room do, and the sizing rule's figures. No NATS, no sleep."""

from __future__ import annotations

import pytest
from nats.js.errors import APIError, ServiceUnavailableError

from bourse.auction.room import (
    CLAIM_BYTES,
    DEFAULT_WINDOW_S,
    FULL,
    ROOM,
    ROOM_LOOK_S,
    ClaimLimits,
    Room,
    no_room,
)

MAX = 10_000  # a bucket of 10,000 bytes: claims may take 9,500 of them


def test_new_orders_are_counted_until_one_more_claim_would_eat_into_the_room_kept() -> None:
    room = Room()
    assert room.admit(0.0) is None and room.full == ""  # not looked at yet: nothing to go by
    room.ended()
    assert room.due(0.0)
    assert room.looked(300, MAX, 0.0) is None and room.taken == 0
    assert not room.due(ROOM_LOOK_S - 0.001) and room.due(ROOM_LOOK_S)
    assert CLAIM_BYTES == 800
    # 300 stored: 11 claims of 800 bytes fit in 9,200 more; the 12th would not
    assert [room.admit(0.5) for _ in range(11)] == [None] * 11 and room.full == ""
    assert room.admit(0.5) == FULL and room.taken == 11
    assert room.full == (
        "the order claims' bucket holds about 9100 of its 10000 bytes (the last 5% are kept "
        "for the outcomes of the orders under way)"
    )
    assert room.admit(0.6) is None and room.full  # refused again: said once
    # a look finds what the claims really take (and what other processes wrote)
    assert room.looked(9000, MAX, 1.0) is None and room.full  # 9,000 + 800 > 9,500
    for _ in range(10):
        room.ended()
    # the one order still under way is counted whole again: its claim grows at its outcome
    assert room.looked(7000, MAX, 2.0) == ROOM and (room.full, room.taken) == ("", 1)
    assert room.admit(2.1) is None and (room.taken, room.open) == (2, 2)
    # 7,000 + 3 claims fit in 9,500; a fourth would not
    assert [room.admit(2.2) for _ in range(2)] == [None, FULL]


def test_a_write_refused_for_room_refuses_new_orders_for_a_look_at_least() -> None:
    room = Room()
    assert room.refused("maximum bytes exceeded", 10.0) == FULL
    assert room.full == "maximum bytes exceeded"
    # a look that finds room at once does not lift it (the server's store may be what is
    # full, which the bucket's bytes do not show)...
    assert room.looked(0, -1, 10.5) is None and room.full == "maximum bytes exceeded"
    # ...one a look later does: the next order tries again
    assert room.looked(0, -1, 10.0 + ROOM_LOOK_S) == ROOM and room.full == ""


def test_a_bucket_without_a_byte_limit_is_never_full_by_its_bytes() -> None:
    assert Room().looked(10**15, -1, 0.0) is None


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (APIError(code=503, err_code=10077, description="maximum bytes exceeded"), True),
        (APIError(code=503, err_code=10023, description="insufficient resources"), True),
        (
            APIError(code=500, err_code=10047, description="insufficient storage resources"),
            True,
        ),
        (APIError(code=400, err_code=10071, description="wrong last sequence"), False),
        (ServiceUnavailableError(code=503, description="JetStream unavailable"), False),
        (TimeoutError(), False),
    ],
)
def test_which_refusals_mean_no_room(exc: BaseException, expected: bool) -> None:
    assert no_room(exc) is expected


def test_the_sizing_rule() -> None:
    """800 bytes a claim, an hour's window: the default 1 GiB holds about 350 orders a
    second; 3,000 orders a second need 9.1 GB (docs/operations.md)."""
    assert (CLAIM_BYTES, DEFAULT_WINDOW_S) == (800, 3600.0)
    assert round(ClaimLimits().covers()) == 354
    assert round(ClaimLimits(max_bytes=9_094_736_842).covers()) == 3000
