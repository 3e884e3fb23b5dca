"""Fractional CPUs (bourse/wire/resources.py, docs/protocol.md §4.1): CPU amounts as people
write them, in millicores inside, and ``cpus`` + ``cpu_millis`` on the wire."""

from __future__ import annotations

import msgspec
import pytest

from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.messages import Amount, Bid, PlaceOrder, Resources
from bourse.wire.resources import (
    amount,
    cpu_fields,
    format_cpus,
    format_vec,
    parse_cpus,
    resources,
    vec,
    whole_cpus,
    wire_cpus,
)


@pytest.mark.parametrize(
    ("text", "millis"),
    [
        ("2", 2000),
        ("0.5", 500),
        ("250m", 250),
        ("1.5", 1500),
        ("0.001", 1),
        (".5", 500),
        (" 3 ", 3000),
        ("1.500", 1500),  # trailing zeros are still whole millicores
        ("4096", 4_096_000),  # MAX_CPUS
        ("1m", 1),
        (2, 2000),  # from a config file: an int...
        (0.25, 250),  # ... or a float
    ],
)
def test_parse_cpus_reads_cpus_as_people_write_them(text: str | int | float, millis: int) -> None:
    assert parse_cpus(text) == millis


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("0", "'0' is not more than 0 CPUs: use a number of CPUs (2, 0.5) or of millicores (250m)"),
        ("0m", "'0m' is not more than 0 CPUs"),
        ("-1", "'-1' is not more than 0 CPUs"),
        ("-0.5", "'-0.5' is not more than 0 CPUs"),
        ("1.0005", "'1.0005' is finer than a millicore (0.001 CPU): use at most 3 decimals"),
        ("0.0001", "'0.0001' is finer than a millicore"),
        ("abc", "'abc' is not a CPU amount: use a number of CPUs (2, 0.5) or of millicores (250m)"),
        ("", "'' is not a CPU amount"),
        ("1e3", "'1e3' is not a CPU amount"),
        ("nan", "'nan' is not a CPU amount"),
        ("2.5m", "'2.5m' is not a CPU amount"),  # millicores are whole
        ("4097", "'4097' is more than 4096 CPUs"),
        (True, "True is not a CPU amount"),
    ],
)
def test_parse_cpus_refuses_bad_amounts_in_one_line(text: str | bool, error: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_cpus(text)
    assert str(info.value).startswith(error), str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("millis", "text"),
    [(2000, "2"), (500, "0.5"), (250, "0.25"), (1500, "1.5"), (1, "0.001"), (0, "0"), (10, "0.01")],
)
def test_format_cpus_writes_them_back(millis: int, text: str) -> None:
    assert format_cpus(millis) == text
    if millis:
        assert parse_cpus(text) == millis  # and they read back the same


@pytest.mark.parametrize(
    ("millis", "fields"),
    [
        (2000, {"cpus": 2}),  # whole: exactly the v1 message
        (500, {"cpus": 1, "cpu_millis": 500}),  # cpus rounded UP
        (1001, {"cpus": 2, "cpu_millis": 1001}),
        (1, {"cpus": 1, "cpu_millis": 1}),
    ],
)
def test_cpu_fields_round_up_whole_cpus_beside_the_millis(
    millis: int, fields: dict[str, int]
) -> None:
    assert cpu_fields(millis) == fields
    assert whole_cpus(millis) == fields["cpus"]
    r = Resources(**fields, memory_mb=64)
    assert vec(r)[0] == millis
    assert resources(vec(r)) == r


@pytest.mark.parametrize(
    ("wire", "v"),
    [
        (Resources(cpus=2, memory_mb=64), (2000, 64, 0, 0, 0)),  # v1: no cpu_millis
        (Resources(cpus=2, memory_mb=64, cpu_millis=2000), (2000, 64, 0, 0, 0)),  # whole, said
        (Resources(cpus=1, memory_mb=64, cpu_millis=500), (500, 64, 0, 0, 0)),
        (Resources(cpus=1, memory_mb=1, disk_mb=5, gpus=1, cpu_millis=250), (250, 1, 5, 1, 0)),
        (Amount(), (0, 0, 0, 0, 0)),
        (Amount(cpus=16, memory_mb=8), (16000, 8, 0, 0, 0)),
        (Amount(cpus=1, cpu_millis=750), (750, 0, 0, 0, 0)),
    ],
)
def test_vec_reads_cpu_millis_when_present_else_whole_cpus(
    wire: Resources | Amount, v: tuple[int, int, int, int]
) -> None:
    assert vec(wire) == v


def test_amount_of_a_fractional_vector_carries_millis_and_rounds_cpus_up() -> None:
    assert amount((1500, 1, 0, 0, 0)) == Amount(cpus=2, memory_mb=1, cpu_millis=1500)
    assert amount((3000, 1, 0, 0, 0)) == Amount(cpus=3, memory_mb=1)  # whole: as in v1
    assert amount((0, 0, 0, 0, 0)) == Amount()


def test_format_vec_names_each_resource() -> None:
    assert format_vec((500, 256, 0, 1, 0)) == "cpus=0.5 memory_mb=256 disk_mb=0 gpus=1"


@pytest.mark.parametrize(
    ("raw", "out"),
    [
        ({"cpus": 16, "memory_mb": 1}, {"cpus": 16, "memory_mb": 1}),  # untouched
        ({"cpus": 0.5, "memory_mb": 1}, {"cpus": 1, "cpu_millis": 500, "memory_mb": 1}),
        ({"cpus": "1500m"}, {"cpus": 2, "cpu_millis": 1500}),
        ({"cpus": 2.0}, {"cpus": 2}),
        ({"memory_mb": 1}, {"memory_mb": 1}),  # no cpus: left to the strict conversion
    ],
)
def test_wire_cpus_turns_a_config_capacity_into_wire_fields(
    raw: dict[str, object], out: dict[str, object]
) -> None:
    assert wire_cpus(raw) == out


# -- the wire: compatibility and validation ------------------------------------------------------


class OldResources(msgspec.Struct, kw_only=True):
    """Resources as a v1 receiver from before cpu_millis declares it."""

    cpus: int
    memory_mb: int
    disk_mb: int = 0
    gpus: int = 0


def test_half_a_cpu_on_the_wire_is_cpus_1_cpu_millis_500() -> None:
    r = resources((500, 256, 0, 0, 0))
    data = msgspec.json.decode(encode(r))
    assert data == {"cpus": 1, "memory_mb": 256, "disk_mb": 0, "gpus": 0, "cpu_millis": 500}
    assert msgspec.json.decode(encode(r), type=Resources) == r  # round trip


def test_an_old_receiver_ignores_cpu_millis_and_reads_one_whole_cpu() -> None:
    # A v1 receiver that knows no cpu_millis skips it (unknown fields are ignored) and reads
    # cpus: 1, so an old supplier holds and confines a whole CPU for a 0.5-CPU order:
    # it wastes half a CPU but never overcommits (I1).
    old = msgspec.json.decode(encode(resources((500, 256, 0, 0, 0))), type=OldResources)
    assert (old.cpus, old.memory_mb) == (1, 256)
    old = msgspec.json.decode(encode(resources((2500, 256, 0, 0, 0))), type=OldResources)
    assert old.cpus == 3


def test_an_old_senders_message_without_cpu_millis_means_whole_cpus() -> None:
    raw = (
        b'{"type":"Bid","order_id":"o1","region":"mad","auction_id":"a1","image":"web",'
        b'"resources":{"cpus":2,"memory_mb":64},"constraints":{},"exclude_workers":[],'
        b'"hold_ms":500}'
    )
    b = decode(raw, Bid)
    assert b.resources.cpu_millis == 0
    assert vec(b.resources) == (2000, 64, 0, 0, 0)


@pytest.mark.parametrize(
    ("resources", "error"),
    [
        # the two disagree: refused, not read two ways by two peers
        (
            {"cpus": 1, "cpu_millis": 3000, "memory_mb": 1},
            "cpu_millis 3000 needs cpus 3 (the millicores rounded up to whole CPUs), not 1 - at "
            "`$.resources`",
        ),
        (
            {"cpus": 2, "cpu_millis": 500, "memory_mb": 1},
            "cpu_millis 500 needs cpus 1 (the millicores rounded up to whole CPUs), not 2",
        ),
        ({"cpus": 1, "cpu_millis": -1, "memory_mb": 1}, ">= 0 - at `$.resources.cpu_millis`"),
        (
            {"cpus": 4096, "cpu_millis": 4_096_001, "memory_mb": 1},
            "<= 4096000 - at `$.resources.cpu_millis`",
        ),
        ({"cpus": 1, "cpu_millis": 0.5, "memory_mb": 1}, "at `$.resources.cpu_millis`"),
        # cpus is still required and >= 1: a 0.5 order says cpus 1
        ({"cpus": 0, "cpu_millis": 500, "memory_mb": 1}, ">= 1 - at `$.resources.cpus`"),
        ({"cpu_millis": 500, "memory_mb": 1}, "missing required field `cpus`"),
    ],
)
def test_bad_cpu_millis_is_a_bad_request_naming_the_field(
    resources: dict[str, object], error: str
) -> None:
    raw = {"type": "PlaceOrder", "region": "mad", "image": "web", "resources": resources}
    with pytest.raises(BadMessage) as info:
        decode(msgspec.json.encode(raw), PlaceOrder)
    assert error in str(info.value)
