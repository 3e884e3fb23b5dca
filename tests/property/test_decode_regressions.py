"""Regressions found by the property tests, pinned at the codec (no processes needed)."""

from __future__ import annotations

import pytest

from bourse.wire.codec import BadMessage, decode, encode, payload_limit
from bourse.wire.limits import DERIVED_OVERHEAD_BYTES, MAX_PAYLOAD_BYTES
from bourse.wire.messages import (
    Bid,
    Commit,
    Machine,
    MachineList,
    MachineReply,
    PlaceOrder,
    Resources,
    StatusRequest,
)


def _bad(data: bytes, typ: object = PlaceOrder) -> str:
    with pytest.raises(BadMessage) as exc:
        decode(data, typ)
    return str(exc.value)


def test_deep_nesting_is_bad_input_not_an_internal_error() -> None:
    # msgspec raised RecursionError, which the handlers answered as Error{internal}
    deep = b'{"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    assert _bad(deep, StatusRequest) == "malformed JSON: nested too deeply"
    assert _bad(b'{"region":' + b'{"a":' * 3000 + b"1" + b"}" * 3001) == (
        "invalid PlaceOrder: Expected `str`, got `object` - at `$.region`"
    )


@pytest.mark.parametrize("junk", [b"\xff", b"\xc3", b"\xed\xa0\x80"])
def test_a_string_that_is_not_utf8_is_bad_input_not_an_internal_error(junk: bytes) -> None:
    # msgspec raised UnicodeDecodeError, which the handlers answered as Error{internal}
    detail = _bad(b'{"region":"p' + junk + b'"}')
    assert detail.startswith("malformed JSON: a string is not valid UTF-8 (")


def test_bid_and_commit_made_from_an_order_at_the_limit_are_accepted() -> None:
    assert payload_limit(PlaceOrder) == MAX_PAYLOAD_BYTES
    assert payload_limit(Bid) == payload_limit(Commit) == MAX_PAYLOAD_BYTES + 1024
    commit = Commit(
        order_id="o",
        worker_id="w",
        resources=Resources(cpus=1, memory_mb=1),
        image="web",
        metadata={f"{i:02d}": "a" * 1024 for i in range(63)},
    )
    data = encode(commit)
    data = data[:-1] + b" " * (MAX_PAYLOAD_BYTES + DERIVED_OVERHEAD_BYTES - len(data)) + b"}"
    assert len(data) == MAX_PAYLOAD_BYTES + DERIVED_OVERHEAD_BYTES
    assert decode(data, Commit) == commit
    assert "exceeds the limit of 66560 bytes" in _bad(data[:-1] + b" }", Commit)


def test_replies_have_no_64_kib_limit() -> None:
    """A worker's machine list grows with its machines: a client must be able to read it."""
    machines = [
        Machine(
            machine_id=f"w-1~{i:026d}",
            order_id=f"o{i}",
            worker_id="w-1",
            region="r",
            state="destroyed",
            resources=Resources(cpus=1, memory_mb=1),
            image="web",
            metadata={"note": "n" * 1000},
        )
        for i in range(100)
    ]
    data = encode(MachineList(worker_id="w-1", machines=machines))
    assert len(data) > MAX_PAYLOAD_BYTES
    assert decode(data, MachineReply) == MachineList(worker_id="w-1", machines=machines)
