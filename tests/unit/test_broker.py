"""The broker's refusals (bourse/auction/broker.py): how each travels as a wire ``Error``
(the broker on a real market: tests/integration/test_broker.py)."""

from __future__ import annotations

import pytest

from bourse.auction.broker import RefusalKind, Refused
from bourse.wire.codec import decode, encode
from bourse.wire.messages import (
    IMAGE_UNKNOWN_REASON,
    OVERLOADED_REASON,
    SHUTTING_DOWN_REASON,
    STORE_FULL_REASON,
    UNRECORDED_REASON,
    Error,
    ErrorCode,
)


@pytest.mark.parametrize(
    ("kind", "code", "reason"),
    [
        ("image_unknown", "bad_request", IMAGE_UNKNOWN_REASON),
        ("bad_image", "bad_request", ""),
        ("overloaded", "internal", OVERLOADED_REASON),
        ("conflicting_order", "bad_request", ""),
        ("cannot_run", "internal", ""),
        ("store_full", "internal", STORE_FULL_REASON),
        ("unrecorded", "internal", UNRECORDED_REASON),
        ("shutting_down", "internal", SHUTTING_DOWN_REASON),
    ],
)
def test_each_refusal_travels_as_an_error(kind: RefusalKind, code: ErrorCode, reason: str) -> None:
    assert Refused(kind, "why").error() == Error(code=code, detail="why", reason=reason)


def test_error_reason_is_optional_and_free_on_the_wire() -> None:
    v1 = decode(b'{"type":"Error","code":"internal","detail":"x"}', Error)
    assert v1.reason == ""  # from a peer that does not know the field
    newer = decode(b'{"type":"Error","code":"internal","detail":"x","reason":"later"}', Error)
    assert newer.reason == "later"  # a value this version does not know still decodes
    assert b'"reason":"overloaded"' in encode(Refused("overloaded", "x").error())
