"""The broker's refusals (bourse/auction/broker.py): how each travels as a wire ``Error``,
and how an image reference that does not resolve becomes one (the broker on a real market:
tests/integration/test_broker.py)."""

from __future__ import annotations

import anyio
import nats.errors
import pytest

from bourse.auction.broker import RefusalKind, Refused, image_refusal, resolve_image
from bourse.auction.content import CATALOG, Resolver
from bourse.client.errors import refusal
from bourse.images.errors import BadImage, BadReference, ImageNotFound, StoreUnavailable
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


DIGEST = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    ("exc", "kind", "detail"),
    [
        (ImageNotFound("no such blob"), "image_unknown", "no such blob"),
        (BadReference("bad digest"), "bad_image", "bad digest"),
        (BadImage("an index"), "bad_image", "an index"),
        (
            StoreUnavailable("no JetStream"),
            "cannot_run",
            "image 'x': the image store: no JetStream",
        ),
        (nats.errors.TimeoutError(), "cannot_run", "image 'x': the image store: nats: timeout"),
        (TimeoutError(), "cannot_run", "image 'x': the image store: TimeoutError"),
    ],
)
def test_an_image_that_does_not_resolve_is_refused(
    exc: Exception, kind: RefusalKind, detail: str
) -> None:
    assert image_refusal("x", exc) == Refused(kind, detail)


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (ImageNotFound("no such blob"), "image_unknown"),
        (BadReference("bad digest"), "bad_request"),
        (TimeoutError(), "internal"),
    ],
)
def test_a_buyer_is_told_an_image_refusal_by_its_code(exc: Exception, code: str) -> None:
    """The exchange's refusal and a buyer's own dry run raise the same ClientError."""
    told = refusal(image_refusal("x", exc).error())
    assert (told.code, str(told)) == (code, image_refusal("x", exc).detail)


class Stalled:
    """A store whose reads never end."""

    async def read_blob(self, digest: str) -> bytes:
        await anyio.Event().wait()
        raise AssertionError("never read")


async def test_resolve_image_gives_content_or_the_refusal() -> None:
    assert await resolve_image(Resolver(), "web") is CATALOG  # a catalog name
    no_store = await resolve_image(Resolver(), f"app@{DIGEST}")
    assert isinstance(no_store, Refused) and no_store.kind == "image_unknown"
    stalled = await resolve_image(Resolver(blobs=Stalled()), f"app@{DIGEST}", within_s=0.01)
    assert stalled == Refused("cannot_run", f"image 'app@{DIGEST}': the image store: TimeoutError")
