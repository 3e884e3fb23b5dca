"""The pure part of order claims: what an auction does about the claim it finds."""

from __future__ import annotations

import msgspec
import pytest
from nats.js.errors import APIError, NoStreamResponseError
from nats.js.errors import Error as JsError

from bourse.auction.claim_store import put_result
from bourse.auction.claims import (
    TAKEOVER_SLACK_MS,
    Adopt,
    Claim,
    ClaimDecision,
    ClaimState,
    Conflict,
    Create,
    TakeOver,
    Wait,
    decide,
    fingerprint,
    key_of,
    order_shape,
)
from bourse.auction.verdicts import Verdict, judge, vouched
from bourse.nats.jetstream import claims_bucket_name
from bourse.wire.messages import Machine, OrderId, Placed, PlaceOrder, Resources

ORDER = PlaceOrder(
    order_id="o-1", region="mad", resources=Resources(cpus=1, memory_mb=64), image="web"
)
FP = fingerprint(ORDER)
PLACED = Placed(
    order_id="o-1",
    machine_id="a~M1",
    worker_id="a",
    region="mad",
    score=0.5,
    image_cached=True,
    elapsed_ms=3.0,
)
NOW = 1_000_000


def claim(state: ClaimState = "auctioning", fp: str = FP, until: int = NOW + 500) -> Claim:
    placed = PLACED if state == "placed" else None
    return Claim(state=state, auction_id="A", fingerprint=fp, until_ms=until, placed=placed)


@pytest.mark.parametrize(
    ("found", "now", "expected"),
    [
        pytest.param(None, NOW, Create(), id="no claim: create it and run"),
        pytest.param(claim("placed"), NOW, Adopt(PLACED), id="placed: its machine at once"),
        pytest.param(
            claim("placed", until=NOW - 10**6), NOW, Adopt(PLACED), id="placed never expires here"
        ),
        pytest.param(
            claim(), NOW, Wait(NOW + 500 + TAKEOVER_SLACK_MS), id="live auction: wait for it"
        ),
        pytest.param(
            claim(until=NOW - TAKEOVER_SLACK_MS + 1),
            NOW,
            Wait(NOW + 1),
            id="just past its end: the owner may be writing, wait the slack",
        ),
        pytest.param(
            claim(until=NOW - TAKEOVER_SLACK_MS), NOW, TakeOver(), id="past end+slack: take over"
        ),
        pytest.param(
            claim("unfilled", until=NOW + 10**6),
            NOW,
            TakeOver(),
            id="unfilled after a commit: take over at once, gather as a retry (adopt an orphan)",
        ),
        pytest.param(
            claim("reclaimed"), NOW, Create(), id="reclaimed: the orphan is gone, start afresh"
        ),
    ],
)
def test_decide(found: Claim | None, now: int, expected: ClaimDecision) -> None:
    assert decide(found, ORDER, FP, now) == expected


@pytest.mark.parametrize("state", ["auctioning", "placed", "unfilled"])
def test_a_different_order_under_the_same_id_is_a_conflict(state: ClaimState) -> None:
    other = msgspec.structs.replace(ORDER, image="api")
    d = decide(claim(state), other, fingerprint(other), NOW)
    assert isinstance(d, Conflict)
    assert "order id 'o-1'" in d.detail and "different order" in d.detail


@pytest.mark.parametrize(
    ("change", "same"),
    [
        ({"retry": True}, True),
        ({"deadline_ms": 3000}, True),
        ({"min_score": 0.5}, True),
        ({"exclude_workers": ["a"]}, True),  # I3 outranks exclude_workers
        ({"image": "api"}, False),
        ({"region": "fra"}, False),
        ({"resources": Resources(cpus=2, memory_mb=64)}, False),
        ({"constraints": {"disk": "ssd"}}, False),
        ({"metadata": {"app": "x"}}, False),
    ],
)
def test_the_fingerprint_is_what_is_placed(change: dict[str, object], same: bool) -> None:
    assert (fingerprint(msgspec.structs.replace(ORDER, **change)) == FP) is same


def same_order(**fields: object) -> PlaceOrder:
    return msgspec.structs.replace(ORDER, **fields)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        pytest.param(
            same_order(metadata={"a": "1", "b": "2"}),
            same_order(metadata={"b": "2", "a": "1"}),
            id="metadata in another order (--meta a=1 --meta b=2, then b=2 a=1)",
        ),
        pytest.param(
            same_order(constraints={"disk": "ssd", "zone": "a"}),
            same_order(constraints={"zone": "a", "disk": "ssd"}),
            id="constraints in another order",
        ),
        pytest.param(
            same_order(resources=Resources(cpus=1, memory_mb=64)),
            same_order(resources=Resources(cpus=1, cpu_millis=1000, memory_mb=64)),
            id="one CPU with and without cpu_millis",
        ),
        pytest.param(
            same_order(resources=Resources(cpus=3, memory_mb=64)),
            same_order(resources=Resources(cpus=3, cpu_millis=3000, memory_mb=64)),
            id="three CPUs with and without cpu_millis",
        ),
    ],
)
def test_one_order_has_one_fingerprint(one: PlaceOrder, other: PlaceOrder) -> None:
    assert fingerprint(one) == fingerprint(other)


@pytest.mark.parametrize(
    ("order", "digest"),
    [
        (ORDER, "177ab0f5c0c4fe9a357cece5"),
        (
            same_order(
                resources=Resources(cpus=1, cpu_millis=500, memory_mb=64, disk_mb=10, gpus=1),
                constraints={"disk": "ssd", "zone": "a"},
                metadata={"app": "x", "é": "ü"},
            ),
            "97fa9d6c732bcdb081f1696e",
        ),
    ],
)
def test_an_order_already_in_canonical_form_keeps_its_fingerprint(
    order: PlaceOrder, digest: str
) -> None:
    """Claims written before the canonical form stay valid for such orders (a rolling
    upgrade): sorted maps, cpus whole or cpu_millis beside its rounded-up cpus."""
    assert fingerprint(order) == digest


def test_names() -> None:
    assert claims_bucket_name("bourse") == "BOURSE_ORDERS"
    assert claims_bucket_name("t.x") == "T_X_ORDERS"
    assert key_of("ns:order-1.a") == "ns=order-1/a"  # ':' is not a KV key character


@pytest.mark.parametrize("order_id", ["o-1.", "a..b", "x:y", "A.b:c-d_e", "u" * 128])
def test_every_valid_order_id_is_a_valid_kv_key(order_id: str) -> None:
    from nats.js.kv import _is_key_valid  # the client's own check, as put() applies it

    assert msgspec.json.decode(
        msgspec.json.encode({"order_id": order_id}), type=dict[str, OrderId]
    ) == {"order_id": order_id}  # a valid order id...
    key = key_of(order_id)
    assert _is_key_valid(key) and ".." not in key  # ...is a valid key, one subject token


# -- reclaiming: the verdict on a worker's reserved machine (docs/protocol.md §5.3d) --------

MINE = PLACED  # the worker's reserved machine a~M1, as its Placed
OTHER = msgspec.structs.replace(PLACED, machine_id="b~M2", worker_id="b")


def with_placed(p: Placed) -> Claim:
    return msgspec.structs.replace(claim("placed"), placed=p)


@pytest.mark.parametrize(
    ("found", "expected"),
    [
        pytest.param(
            None,
            Verdict("keep", "no claim for the order (no claims, or past the window)"),
            id="no claim: nothing to go by, keep",
        ),
        pytest.param(with_placed(MINE), Verdict("keep", "the order's machine"), id="named: keep"),
        pytest.param(
            with_placed(OTHER),
            Verdict("orphan", "the order's machine is b~M2"),
            id="another machine is the order's: orphan",
        ),
        pytest.param(
            claim("unfilled", until=NOW - 5),
            Verdict(
                "orphan",
                "the buyer was told the order is unfilled",
                msgspec.structs.replace(
                    claim("unfilled"), state="reclaimed", until_ms=NOW, reclaimed="a~M1"
                ),
            ),
            id="unfilled: orphan, once the claim says reclaimed (the id is free)",
        ),
        pytest.param(
            msgspec.structs.replace(claim("reclaimed"), reclaimed="a~M1"),
            Verdict("orphan", "the order was unfilled; its orphan is being reclaimed"),
            id="reclaimed already (a re-check after a crash): orphan again",
        ),
        pytest.param(
            claim(until=NOW - TAKEOVER_SLACK_MS + 1),
            Verdict("wait", "an auction for the order is under way"),
            id="live auction: wait",
        ),
        pytest.param(
            claim(until=NOW - TAKEOVER_SLACK_MS),
            Verdict(
                "keep",
                "the order's auction died without an outcome: adopted",
                msgspec.structs.replace(
                    claim(until=NOW - TAKEOVER_SLACK_MS), state="placed", until_ms=NOW, placed=MINE
                ),
            ),
            id="dead auction: adopt it (the claim names it, a retry gets it)",
        ),
    ],
)
def test_judge(found: Claim | None, expected: Verdict) -> None:
    assert judge(found, MINE, NOW) == expected


def test_an_adopted_or_reclaimed_claim_answers_the_next_attempt() -> None:
    adopted = judge(claim(until=NOW - 10**6), MINE, NOW).write
    assert adopted is not None and decide(adopted, ORDER, FP, NOW) == Adopt(MINE)
    gone = judge(claim("unfilled"), MINE, NOW).write
    assert gone is not None and decide(gone, ORDER, FP, NOW) == Create()


@pytest.mark.parametrize(
    ("data", "headers", "expected"),
    [
        (b'{"stream":"KV_X","seq":7}', None, 7),
        (b'{"stream":"KV_X","seq":7,"duplicate":true}', {}, 7),
        (
            b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 6"}}',
            None,
            None,
        ),
        (
            b'{"error":{"code":400,"err_code":10164,"description":"wrong last sequence"}}',
            None,
            None,
        ),
        (b'{"error":{"code":503,"err_code":10008,"description":"unavailable"}}', None, APIError),
        (b"", {"Status": "503"}, NoStreamResponseError),
        (b"not json", None, JsError),
    ],
)
def test_the_answer_to_a_claim_write_sent_apart(
    data: bytes, headers: dict[str, str] | None, expected: int | type[Exception] | None
) -> None:
    if isinstance(expected, type):
        with pytest.raises(expected):
            put_result(data, headers)
    else:
        assert put_result(data, headers) == expected


# -- whether a worker's word for its machine holds (vouched) --------------------------------

SHAPED = msgspec.structs.replace(claim(until=NOW - 10**6), shape=order_shape(ORDER))
LISTED = Machine(
    machine_id="a~M1",
    order_id="o-1",
    worker_id="a",
    region="mad",
    state="reserved",
    resources=ORDER.resources,
    image=ORDER.image,
)


def not_the_orders(region: str) -> str:
    return (
        f"machine a~M1 in region {region!r} is not the order's (its region, resources, image "
        "or metadata differ)"
    )


@pytest.mark.parametrize(
    ("asked", "shown", "why"),
    [
        pytest.param(MINE, LISTED, "", id="listed by its worker in the order's region: holds"),
        pytest.param(
            MINE,
            msgspec.structs.replace(
                LISTED, resources=Resources(cpus=1, cpu_millis=1000, memory_mb=64)
            ),
            "",
            id="its resources written the other way: the same order",
        ),
        pytest.param(
            MINE,
            None,
            "machine a~M1 is not listed reserved by worker 'a' in region 'mad'",
            id="not listed (made up, or nobody of that region answers for the worker)",
        ),
        pytest.param(
            MINE,
            msgspec.structs.replace(LISTED, worker_id="b"),
            "machine a~M1 is not listed reserved by worker 'a' in region 'mad'",
            id="listed by another worker",
        ),
        pytest.param(
            MINE,
            msgspec.structs.replace(LISTED, order_id="o-2"),
            "machine a~M1 was placed for order 'o-2'",
            id="another order's machine",
        ),
        pytest.param(
            msgspec.structs.replace(MINE, region="fra"),
            msgspec.structs.replace(LISTED, region="mad"),
            not_the_orders("fra"),
            id="listed in another region, whatever region the listing says",
        ),
        pytest.param(
            MINE,
            msgspec.structs.replace(LISTED, image="api"),
            not_the_orders("mad"),
            id="another image",
        ),
        pytest.param(
            MINE,
            msgspec.structs.replace(LISTED, metadata={"app": "x"}),
            not_the_orders("mad"),
            id="other metadata",
        ),
        pytest.param(
            MINE,
            msgspec.structs.replace(LISTED, constraints={}),
            "",
            id="recorded constraints: the order's (none)",
        ),
        pytest.param(
            MINE,
            msgspec.structs.replace(LISTED, constraints={"disk": "ssd"}),
            "machine a~M1 in region 'mad' was placed under other constraints",
            id="recorded constraints: not the order's",
        ),
    ],
)
def test_a_workers_word_for_its_machine_holds_only_as_its_region_lists_it(
    asked: Placed, shown: Machine | None, why: str
) -> None:
    assert vouched(SHAPED, asked, shown) == why


def test_a_claim_without_a_shape_takes_the_workers_word() -> None:
    """Written by an exchange that kept no shape: nothing to check the machine against."""
    assert vouched(claim(until=NOW - 10**6), MINE, None) == ""
