"""Wire contract v1: the JSON codec. One encoder, one strict decoder per message type;
a decode error names the offending field by its JSON path (``BadMessage``)."""

from __future__ import annotations

from typing import Any, TypeVar, overload

import msgspec

from bourse.errors import BourseError
from bourse.wire.limits import DERIVED_OVERHEAD_BYTES, MAX_PAYLOAD_BYTES
from bourse.wire.messages import (
    Bid,
    Commit,
    ExplainRequest,
    ListMachines,
    MachineRequest,
    PlaceOrder,
    Release,
    StatusRequest,
)


class BadMessage(BourseError, ValueError):
    """A payload that is not a valid message of the expected type. ``str()`` names the field."""


_encoder = msgspec.json.Encoder()
_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}
T = TypeVar("T")


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def _decoder(typ: type[T]) -> msgspec.json.Decoder[T]:
    dec = _decoders.get(typ)
    if dec is None:
        dec = _decoders[typ] = msgspec.json.Decoder(typ, strict=True)
    return dec


def type_name(typ: Any) -> str:
    return getattr(typ, "__name__", None) or " | ".join(a.__name__ for a in typ.__args__)


def validation_detail(exc: msgspec.ValidationError) -> str:
    """msgspec's message, with patterns shown as every regex dialect writes them ($), not
    Python's \\Z."""
    return str(exc).replace("\\\\Z'", "$'")


def payload_limit(typ: Any) -> int | None:
    """The size cap of a message type: MAX_PAYLOAD_BYTES for what a client sends; a little
    more for Bid and Commit, which repeat an order's fields with defaults written out plus
    their own (so an order at the limit can still be bid and committed); none for replies
    (a MachineList grows with the machines; NATS's own max_payload bounds it)."""
    if typ in (Bid, Commit):
        return MAX_PAYLOAD_BYTES + DERIVED_OVERHEAD_BYTES
    if typ in (PlaceOrder, Release, StatusRequest, MachineRequest, ListMachines, ExplainRequest):
        return MAX_PAYLOAD_BYTES
    return None


@overload
def decode(data: bytes, typ: type[T]) -> T: ...


# A union (``Placed | Unfilled | Error``) is not a ``type[T]``: like msgspec's own decode,
# its result is typed Any, and the caller annotates what it expects.
@overload
def decode(data: bytes, typ: Any) -> Any: ...


def decode(data: bytes, typ: Any) -> Any:
    """Decode ``data`` as ``typ`` (a message class or a union of them).

    Raises BadMessage with a message that names the problem and the field, e.g.
    ``invalid PlaceOrder: Expected `int` >= 1 - at `$.resources.cpus```.
    """
    limit = payload_limit(typ)
    if limit is not None and len(data) > limit:
        raise BadMessage(f"payload of {len(data)} bytes exceeds the limit of {limit} bytes")
    if not data:
        raise BadMessage(f"empty payload: expected a JSON {type_name(typ)} object")
    try:
        return _decoder(typ).decode(data)
    except msgspec.ValidationError as exc:
        raise BadMessage(f"invalid {type_name(typ)}: {validation_detail(exc)}") from None
    except msgspec.DecodeError as exc:
        raise BadMessage(f"malformed JSON: {exc}") from None
    # msgspec lets these two escape as they are; they are bad input all the same (I6), not
    # an internal failure: arrays/objects nested ~1000 deep, and a typed string field
    # holding bytes that are not UTF-8 (e.g. an encoded surrogate).
    except RecursionError:
        raise BadMessage("malformed JSON: nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise BadMessage(f"malformed JSON: a string is not valid UTF-8 ({exc.reason})") from None
