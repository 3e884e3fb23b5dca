"""The client's errors: ``ClientError`` and its codes, and how a wire ``Error`` (an order's
refusal, a machine verb's failure) becomes one.

A refusal keeps its kind in ``ClientError.code``: the wire's code (``bad_request``,
``internal``), or, where the Error's ``reason`` tells an order's refusal apart, that
reason (``overloaded``, ``unrecorded``, ``image_unknown``): a caller tells "try again
later" from "send it again under the same id" without reading the detail.
"""

from __future__ import annotations

from typing import TypeVar

from bourse.errors import BourseError
from bourse.wire.messages import (
    IMAGE_UNKNOWN_REASON,
    OVERLOADED_REASON,
    UNRECORDED_REASON,
    Error,
)

T = TypeVar("T")

# ClientError.code of an order the exchange (or a direct buyer's own admission control)
# refused as overloaded: nothing was bid; try again later or elsewhere. On the wire it is an
# Error "internal" (the v1 codes are fixed) with reason "overloaded".
OVERLOADED_CODE = "overloaded"
# ClientError.code of an order whose machine was placed but whose claim could not name it
# (a claims outage at that moment, §5.3c): send the order again under the same id (as a
# retry), which is answered with the order's one machine. On the wire: Error "internal",
# reason "unrecorded".
UNRECORDED_CODE = "unrecorded"
# ClientError.code of an order (or dry run) whose image names a digest the image store does
# not hold (§4.3a): nothing was bid. On the wire: Error "bad_request", reason
# "image_unknown".
IMAGE_UNKNOWN_CODE = IMAGE_UNKNOWN_REASON


class ClientError(BourseError, RuntimeError):
    """The request failed: an Error reply, no exchange/worker reachable, or a timeout."""

    def __init__(self, message: str, code: str = "internal") -> None:
        super().__init__(message)
        self.code = code


def refusal(error: Error) -> ClientError:
    """An order's Error as a ClientError: an overload refusal (Error.reason) gets code
    ``overloaded``, an unrecorded placement ``unrecorded``, an unknown image
    ``image_unknown``, anything else its wire code."""
    if error.reason == OVERLOADED_REASON:
        return ClientError(error.detail, OVERLOADED_CODE)
    if error.reason == UNRECORDED_REASON:
        return ClientError(error.detail, UNRECORDED_CODE)
    if error.reason == IMAGE_UNKNOWN_REASON:
        return ClientError(error.detail, IMAGE_UNKNOWN_CODE)
    return ClientError(error.detail, error.code)


def expect(reply: object, typ: type[T]) -> T:
    """``reply`` if it is a ``typ``; an Error reply raised as a ClientError (its wire code),
    anything else as a ClientError saying what came instead."""
    if isinstance(reply, Error):
        raise ClientError(reply.detail, reply.code)
    if not isinstance(reply, typ):
        raise ClientError(f"expected {typ.__name__}, got {type(reply).__name__}")
    return reply
