"""Wire contract v1 (bourse/wire/) and subject names (bourse/wire/subjects.py)."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest

from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.limits import MAX_CPUS, MAX_DEADLINE_MS, MAX_MEMORY_MB, MAX_PAYLOAD_BYTES
from bourse.wire.messages import (
    Amount,
    Answers,
    Batch,
    BatchBid,
    Bid,
    BidReply,
    Commit,
    EdgeActivity,
    Error,
    Event,
    ExecAck,
    ExecCancel,
    ExecExit,
    ExecInput,
    ExecOutput,
    ExecRequest,
    ExecResize,
    ExecStarted,
    ExplainRequest,
    Explanation,
    Heartbeat,
    ImagePush,
    ImageTag,
    ImageTagged,
    ImageUntag,
    ListMachines,
    Machine,
    MachineCommand,
    MachineList,
    MachineLogs,
    MachinePage,
    MachineRequest,
    Message,
    Offer,
    Offers,
    Placed,
    PlaceOrder,
    Reason,
    ReclaimCheck,
    ReclaimVerdict,
    ReclaimVerdicts,
    Rejected,
    Release,
    Resources,
    StateEpoch,
    StatusRequest,
    Unfilled,
    Waiting,
    WorkerControl,
    WorkerRow,
    WorkerState,
    WorkerStatus,
    WorkerVerdict,
    new_machine_id,
    new_order_id,
    worker_of_machine,
)
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects, is_valid_id

ULID_RE = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")  # Crockford base32, 26 chars
RES = Resources(cpus=4, memory_mb=4096, disk_mb=10_000, gpus=1)
MACHINE = Machine(
    machine_id="mad-1~01J0000000000000000000000A",
    order_id="order-1",
    worker_id="mad-1",
    region="mad",
    state="started",
    resources=RES,
    image="registry.example/web:1.2",
    metadata={"team": "infra"},
    score=0.75,
    created_at_ms=1_700_000_000_000,
    updated_at_ms=1_700_000_000_500,
    aborted=False,
)

# One fully populated (non-default where possible) instance of every wire message.
SAMPLES: list[Message] = [
    PlaceOrder(
        order_id="order-1",
        region="mad",
        resources=RES,
        image="web",
        constraints={"disk": "ssd"},
        exclude_workers=["mad-2"],
        min_score=0.25,
        deadline_ms=750,
        metadata={"who": "ci"},
    ),
    Bid(
        order_id="order-1",
        region="mad",
        resources=RES,
        image="web",
        constraints={"disk": "ssd"},
        exclude_workers=["mad-2"],
        hold_ms=800,
        auction_id="a1",
        wait_ms=100,
    ),
    Offer(
        order_id="order-1",
        worker_id="mad-1",
        region="mad",
        score=0.5,
        subscores={"cpus": 0.5, "utility": 0.5, "image": 1.0},
        image_cached=True,
        hold_expires_at_ms=1_700_000_000_800,
        machine_id="mad-1~01J0000000000000000000000A",
    ),
    Commit(order_id="order-1", worker_id="mad-1", resources=RES, image="web", metadata={"a": "b"}),
    Placed(
        order_id="order-1",
        machine_id="mad-1~01J0000000000000000000000A",
        worker_id="mad-1",
        region="mad",
        score=0.5,
        image_cached=True,
        elapsed_ms=3.25,
        subscores={"utility": 0.5},
        existing=True,
    ),
    Rejected(order_id="order-1", worker_id="mad-1", reason="hold_expired", detail="late"),
    Unfilled(
        order_id="order-1",
        region="mad",
        reason="below_min_score",
        offers=3,
        commits_tried=0,
        elapsed_ms=12.5,
        detail="best score 0.2",
    ),
    Error(code="bad_request", detail="bad region"),
    Release(order_id="order-1", worker_id="mad-1", auction_id="a1", abort_commit=True),
    Batch(
        bids=[
            BatchBid(
                reply="_INBOX.x.a1",
                bid=Bid(order_id="order-1", region="mad", resources=RES, image="web", hold_ms=750),
            )
        ],
        releases=[Release(order_id="order-0", auction_id="a0")],
        answers_to="_INBOX.x.answers",
    ),
    Answers(
        answers=[
            Offers(offers=[], responder="p1", auction_id="a1", batches=True),
        ]
    ),
    StatusRequest(),
    WorkerStatus(
        worker_id="mad-1",
        region="mad",
        labels={"disk": "ssd"},
        capacity=Amount(cpus=16, memory_mb=65536, disk_mb=1000, gpus=2),
        committed=Amount(cpus=4, memory_mb=4096),
        held=Amount(cpus=1, memory_mb=512),
        images=["db", "web"],
        machines=1,
        draining=True,
        holds=1,
    ),
    MachineRequest(machine_id="mad-1~01J0000000000000000000000A"),
    MachineRequest(machine_id="mad-1~01J0000000000000000000000A", queue_if_away=True),
    MachineCommand(
        command_id="01J0000000000000000000000C",
        machine_id="mad-1~01J0000000000000000000000A",
        worker_id="mad-1",
        verb="stop",
        requested_by="tenant:acme",
        reason="failover",
        at_ms=1,
    ),
    WorkerControl(worker_id="mad-1", action="stop"),
    WorkerState(
        worker_id="mad-1",
        region="mad",
        serving=False,
        draining=True,
        drain_reason="operator",
        machines=2,
    ),
    ExplainRequest(order_id="order-1", region="mad", resources=RES, image="web"),
    Explanation(
        order_id="order-1",
        region="mad",
        responder="r1",
        page=2,
        pages=3,
        last=False,
        verdicts=[
            WorkerVerdict(worker_id="mad-1", verdict="offer", score=0.5, subscores={"cpus": 0.5}),
            WorkerVerdict(
                worker_id="mad-2",
                verdict="decline",
                reasons=[Reason(code="constraint_mismatch", detail="label gpu", label="gpu")],
            ),
        ],
    ),
    ListMachines(worker_id="mad-1", include_destroyed=True),
    MACHINE,
    MachineList(worker_id="mad-1", machines=[MACHINE]),
    MachinePage(worker_id="mad-1", region="mad", page=1, pages=2, last=False, machines=[MACHINE]),
    MachineLogs(machine_id=MACHINE.machine_id, lines=["booting", "ready"], truncated=True),
    Event(
        kind="placed",
        region="mad",
        worker_id="mad-1",
        at_ms=1_700_000_000_000,
        order_id="order-1",
        machine_id="mad-1~01J0000000000000000000000A",
        detail="x",
    ),
    ReclaimCheck(
        worker_id="mad-1",
        machines=[
            Placed(
                order_id="order-1",
                machine_id="mad-1~01J0000000000000000000000A",
                worker_id="mad-1",
                region="mad",
                score=0.5,
                image_cached=False,
                elapsed_ms=0.0,
            )
        ],
    ),
    ReclaimVerdicts(
        verdicts=[
            ReclaimVerdict(
                machine_id="mad-1~01J0000000000000000000000A",
                verdict="orphan",
                detail="the buyer was told the order is unfilled",
            )
        ]
    ),
    ImagePush(
        reference="acme/web:v2",
        upload="01J0000000000000000000000B",
        manifest="sha256:" + "ab" * 32,
        manifest_size=403,
    ),
    ImageTag(source="acme/web:v2", reference="acme/web:stable"),
    ImageUntag(reference="acme/web:stable"),
    ImageTagged(
        reference="acme/web:v2",
        digest="sha256:" + "ab" * 32,
        size=104_857_600,
        uploaded_bytes=1024,
        reused_bytes=104_856_576,
    ),
    WorkerRow(
        worker_id="mad-1",
        region="mad",
        beat="mad-1",
        capacity=Amount(cpus=16, memory_mb=65536, ports=100),
        free=Amount(cpus=14, memory_mb=64512, ports=99),
        machines=1,
        version="0.1.0",
        at_ms=1_795_320_932_076,
    ),
    Heartbeat(beat="mad-1", workers=["mad-1", "mad-2"], at_ms=1_795_320_933_000),
    StateEpoch(epoch="01KBX2W7Q4M1S8YV3D5N0RZ6TC", at_ms=1_795_320_900_000),
    EdgeActivity(
        edge="e-01m8hh",
        at_ms=1_795_320_934_000,
        machines={"mad-1~01J8Y3Z6V5W4X3Y2Z1A0B9C8D7": 1_795_320_933_512},
    ),
    ExecRequest(
        machine_id="mad-1~01J8Y3Z6V5W4X3Y2Z1A0B9C8D7",
        command=["sh", "-c", "id -u"],
        tty=True,
        stdin=True,
        env={"TERM": "xterm"},
        session="5f0c8d6a0e0f4f3c9b7d2e1a4c6b8d0e",
        requester="tenant:acme",
    ),
    ExecStarted(
        session="5f0c8d6a0e0f4f3c9b7d2e1a4c6b8d0e",
        machine_id="mad-1~01J8Y3Z6V5W4X3Y2Z1A0B9C8D7",
        input="bourse.v1.exec.5f0c8d6a0e0f4f3c9b7d2e1a4c6b8d0e",
    ),
    ExecOutput(session="s1", stream="stderr", offset=7, data=b"\x00\xffoops\n"),
    ExecInput(session="s1", offset=0, data=b"hello\n", eof=True),
    ExecAck(session="s1", received=65536),
    ExecResize(session="s1", rows=50, cols=132),
    ExecCancel(session="s1"),
    ExecExit(session="s1", code=None, signal=9, detail="timeout: 3600 s"),
    Offers(
        offers=[
            Offer(order_id="order-1", worker_id="mad-1", region="mad", score=0.9, sig="s1"),
            Offer(order_id="order-1", worker_id="mad-2", region="mad", score=0.6, sig="s2"),
        ]
    ),
    Waiting(order_id="order-1", worker_id="mad-1", region="mad", wait_ms=250),
]
ALL_TYPES = Placed | Unfilled | Error  # a union, as the requesters use them


def _ids(m: Message) -> str:
    return type(m).__name__


def _all_subclasses(cls: type) -> set[type]:
    out: set[type] = set()
    subclasses: list[type] = cls.__subclasses__()
    for sub in subclasses:
        out |= {sub} | _all_subclasses(sub)
    return out


def _order(**overrides: Any) -> bytes:
    body: dict[str, Any] = {
        "type": "PlaceOrder",
        "order_id": "order-1",
        "region": "mad",
        "resources": {"cpus": 2, "memory_mb": 2048},
        "image": "web",
    }
    body.update(overrides)
    return json.dumps(body).encode()


def _bad(data: bytes, typ: Any = PlaceOrder) -> str:
    with pytest.raises(BadMessage) as info:
        decode(data, typ)
    return str(info.value)


# -- round trips and the tag ----------------------------------------------------------------


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == _all_subclasses(Message)


@pytest.mark.parametrize("msg", SAMPLES, ids=_ids)
def test_round_trip(msg: Message) -> None:
    assert decode(encode(msg), type(msg)) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=_ids)
def test_type_tag_is_class_name(msg: Message) -> None:
    raw = json.loads(encode(msg))
    assert raw["type"] == type(msg).__name__
    assert next(iter(raw)) == "type"  # the tag leads, so a human reading a log sees it first


@pytest.mark.parametrize("msg", SAMPLES, ids=_ids)
def test_missing_tag_accepted_for_single_type(msg: Message) -> None:
    raw = json.loads(encode(msg))
    del raw["type"]
    assert decode(json.dumps(raw).encode(), type(msg)) == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=_ids)
def test_unknown_fields_ignored(msg: Message) -> None:
    raw = json.loads(encode(msg))
    raw["added_in_v2"] = {"nested": [1, 2, 3]}
    raw["zz_flag"] = True
    assert decode(json.dumps(raw).encode(), type(msg)) == msg


def test_unknown_nested_field_ignored() -> None:
    msg = decode(_order(resources={"cpus": 2, "memory_mb": 2048, "fpgas": 1}), PlaceOrder)
    assert msg.resources == Resources(cpus=2, memory_mb=2048)


def test_wrong_tag_rejected_for_single_type() -> None:
    text = _bad(_order(type="Bid"))
    assert text == "invalid PlaceOrder: Invalid value 'Bid' - at `$.type`"


def test_union_picks_type_by_tag() -> None:
    err = Error(code="internal", detail="boom")
    unfilled = SAMPLES[6]
    assert decode(encode(err), ALL_TYPES) == err
    assert decode(encode(unfilled), ALL_TYPES) == unfilled


def test_union_requires_tag() -> None:
    raw = json.loads(encode(Error(code="internal", detail="boom")))
    del raw["type"]
    text = _bad(json.dumps(raw).encode(), ALL_TYPES)
    assert text == "invalid Placed | Unfilled | Error: Object missing required field `type`"


def test_union_rejects_type_not_in_union() -> None:
    text = _bad(encode(SAMPLES[0]), ALL_TYPES)
    assert text == "invalid Placed | Unfilled | Error: Invalid value 'PlaceOrder' - at `$.type`"


def test_bid_reply_union() -> None:
    offer, offers, waiting = SAMPLES[2], SAMPLES[-2], SAMPLES[-1]
    assert decode(encode(offer), BidReply) == offer
    assert isinstance(offers, Offers)  # one process's offers in one message
    assert decode(encode(offers), BidReply) == offers
    assert decode(encode(waiting), BidReply) == waiting
    withdraw = json.loads(encode(waiting))
    withdraw["wait_ms"] = 0  # a withdrawal is a Waiting with wait_ms 0
    assert decode(json.dumps(withdraw).encode(), BidReply) == Waiting(
        order_id="order-1", worker_id="mad-1", region="mad", wait_ms=0
    )
    withdraw["wait_ms"] = MAX_DEADLINE_MS + 1
    assert _bad(json.dumps(withdraw).encode(), BidReply) == (
        "invalid Offer | Offers | Waiting: Expected `int` <= 30000 - at `$.wait_ms`"
    )


def test_defaults_filled_in() -> None:
    msg = decode(_order(), PlaceOrder)
    assert msg.constraints == {}
    assert msg.exclude_workers == []
    assert msg.min_score == 0.0
    assert msg.deadline_ms == 500
    assert msg.metadata == {}
    assert msg.resources.disk_mb == 0
    assert msg.resources.gpus == 0


def test_order_id_defaults_to_fresh_ulid() -> None:
    raw = json.loads(_order())
    del raw["order_id"]
    data = json.dumps(raw).encode()
    a = decode(data, PlaceOrder)
    b = decode(data, PlaceOrder)
    assert ULID_RE.match(a.order_id), a.order_id
    assert ULID_RE.match(b.order_id), b.order_id
    assert a.order_id != b.order_id
    c = PlaceOrder(region="mad", resources=RES, image="web")
    assert ULID_RE.match(c.order_id) and c.order_id not in (a.order_id, b.order_id)


def test_new_order_id_is_ulid() -> None:
    ids = {new_order_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(ULID_RE.match(i) for i in ids)


def test_new_machine_id_embeds_worker() -> None:
    mid = new_machine_id("mad-1")
    worker, sep, ulid = mid.partition("~")
    assert (worker, sep) == ("mad-1", "~")
    assert ULID_RE.match(ulid), ulid
    assert worker_of_machine(mid) == "mad-1"
    assert new_machine_id("mad-1") != mid
    # the id is valid on the wire
    assert decode(encode(MachineRequest(machine_id=mid)), MachineRequest).machine_id == mid


def test_worker_of_machine() -> None:
    assert worker_of_machine("w-9~01ABC") == "w-9"
    assert worker_of_machine("w-9~a~b") == "w-9"
    assert worker_of_machine("no-separator") == "no-separator"


# -- strictness --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cpus", "got"),
    [("2", "str"), (True, "bool"), (2.0, "float"), (None, "null")],
)
def test_int_fields_are_strict(cpus: Any, got: str) -> None:
    text = _bad(_order(resources={"cpus": cpus, "memory_mb": 2048}))
    assert text == f"invalid PlaceOrder: Expected `int`, got `{got}` - at `$.resources.cpus`"


def test_bool_field_rejects_int() -> None:
    text = _bad(encode(SAMPLES[8]).replace(b"true", b"1"), Release)
    assert text == "invalid Release: Expected `bool`, got `int` - at `$.abort_commit`"


def test_str_field_rejects_number() -> None:
    text = _bad(_order(image=5))
    assert text == "invalid PlaceOrder: Expected `str`, got `int` - at `$.image`"


def test_missing_required_field() -> None:
    raw = json.loads(_order())
    del raw["region"]
    text = _bad(json.dumps(raw).encode())
    assert text == "invalid PlaceOrder: Object missing required field `region`"


# -- constraints: every error names the JSON path ----------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"resources": {"cpus": 0, "memory_mb": 1}}, "Expected `int` >= 1 - at `$.resources.cpus`"),
        (
            {"resources": {"cpus": 1, "memory_mb": -1}},
            "Expected `int` >= 1 - at `$.resources.memory_mb`",
        ),
        (
            {"resources": {"cpus": 1, "memory_mb": 0}},
            "Expected `int` >= 1 - at `$.resources.memory_mb`",
        ),
        (
            {"resources": {"cpus": 1, "memory_mb": 1, "disk_mb": -1}},
            "Expected `int` >= 0 - at `$.resources.disk_mb`",
        ),
        (
            {"resources": {"cpus": 1, "memory_mb": 1, "gpus": 257}},
            "Expected `int` <= 256 - at `$.resources.gpus`",
        ),
        (
            {"resources": {"cpus": MAX_CPUS + 1, "memory_mb": 1}},
            f"Expected `int` <= {MAX_CPUS} - at `$.resources.cpus`",
        ),
        (
            {"resources": {"cpus": 1, "memory_mb": MAX_MEMORY_MB + 1}},
            f"Expected `int` <= {MAX_MEMORY_MB} - at `$.resources.memory_mb`",
        ),
        (
            {"resources": {"cpus": 1, "memory_mb": 10**30}},
            f"Expected `int` <= {MAX_MEMORY_MB} - at `$.resources.memory_mb`",
        ),
        (
            {"region": "MAD"},
            "Expected `str` matching regex '^[a-z0-9][a-z0-9-]{0,62}$' - at `$.region`",
        ),
        (
            {"region": "-mad"},
            "Expected `str` matching regex '^[a-z0-9][a-z0-9-]{0,62}$' - at `$.region`",
        ),
        (
            {"region": "m" * 64},
            "Expected `str` matching regex '^[a-z0-9][a-z0-9-]{0,62}$' - at `$.region`",
        ),
        (
            {"region": "mad.x"},
            "Expected `str` matching regex '^[a-z0-9][a-z0-9-]{0,62}$' - at `$.region`",
        ),
        (
            {"order_id": "bad order"},
            "Expected `str` matching regex '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$' - at `$.order_id`",
        ),
        (
            {"order_id": ""},
            "Expected `str` matching regex '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$' - at `$.order_id`",
        ),
        ({"deadline_ms": 0}, "Expected `int` >= 1 - at `$.deadline_ms`"),
        (
            {"deadline_ms": MAX_DEADLINE_MS + 1},
            "Expected `int` <= 30000 - at `$.deadline_ms`",
        ),
        ({"min_score": 1.5}, "Expected `float` <= 1.0 - at `$.min_score`"),
        ({"min_score": -0.1}, "Expected `float` >= 0.0 - at `$.min_score`"),
        (
            {"image": "bad image"},
            "Expected `str` matching regex '^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}$' - at `$.image`",
        ),
        (
            {"image": ""},
            "Expected `str` matching regex '^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}$' - at `$.image`",
        ),
        (
            {"constraints": {"-bad": "x"}},
            "Expected `str` matching regex '^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$'"
            " - at `key` in `$.constraints`",
        ),
        (
            {"constraints": {"disk": "has space"}},
            "Expected `str` matching regex '^[A-Za-z0-9._:/-]{0,128}$' - at `$.constraints[...]`",
        ),
        (
            {"exclude_workers": ["OK"]},
            "Expected `str` matching regex '^[a-z0-9][a-z0-9-]{0,62}$' - at `$.exclude_workers[0]`",
        ),
        (
            {"metadata": {"": "x"}},
            "Expected `str` of length >= 1 - at `key` in `$.metadata`",
        ),
    ],
)
def test_constraint_errors_name_the_path(overrides: dict[str, Any], expected: str) -> None:
    assert _bad(_order(**overrides)) == f"invalid PlaceOrder: {expected}"


@pytest.mark.parametrize(
    "path",
    ["/healthz\r\nX-Injected: 1", "/a\nb", "/a\rb", "/a\x00b", "/a\tb", "/a\x7fb", "/a\x85b"],
)
def test_a_check_path_with_a_control_character_is_refused(path: str) -> None:
    """A CR LF in a check's path went into the probe's request line: a header injected."""
    check = {"port": "web", "kind": "http", "path": path}
    assert _bad(_order(ports=["web"], checks=[check])) == (
        r"invalid PlaceOrder: Expected `str` matching regex '^[^\\x00-\\x1f\\x7f-\\x9f]*$'"
        " - at `$.checks[0].path`"
    )


def test_a_check_path_may_be_percent_encoded_or_unicode() -> None:
    checks = [{"port": "web", "kind": "http", "path": p} for p in ("/a%0D%0Ab?q=1", "/café")]
    order = decode(_order(ports=["web"], checks=checks), PlaceOrder)
    assert [c.path for c in order.checks] == ["/a%0D%0Ab?q=1", "/café"]


@pytest.mark.parametrize(
    "resources",
    [{"cpus": 1, "memory_mb": 1}, {"cpus": MAX_CPUS, "memory_mb": MAX_MEMORY_MB}],
)
def test_resource_bounds_inclusive(resources: dict[str, int]) -> None:
    msg = decode(_order(resources=resources), PlaceOrder)
    assert msg.resources == Resources(**resources)


@pytest.mark.parametrize("deadline_ms", [1, MAX_DEADLINE_MS])
def test_deadline_bounds_inclusive(deadline_ms: int) -> None:
    assert decode(_order(deadline_ms=deadline_ms), PlaceOrder).deadline_ms == deadline_ms


def test_bid_hold_ms_bounds() -> None:
    bid = json.loads(encode(SAMPLES[1]))
    bid["hold_ms"] = 0
    assert _bad(json.dumps(bid).encode(), Bid) == (
        "invalid Bid: Expected `int` >= 1 - at `$.hold_ms`"
    )
    bid["hold_ms"] = 60_001
    assert _bad(json.dumps(bid).encode(), Bid) == (
        "invalid Bid: Expected `int` <= 60000 - at `$.hold_ms`"
    )


def test_offer_score_bounds() -> None:
    offer = json.loads(encode(SAMPLES[2]))
    offer["score"] = 1.0000001
    assert _bad(json.dumps(offer).encode(), Offer) == (
        "invalid Offer: Expected `float` <= 1.0 - at `$.score`"
    )


def test_rejected_reason_enum() -> None:
    raw = json.loads(encode(SAMPLES[5]))
    raw["reason"] = "busy"
    text = _bad(json.dumps(raw).encode(), Rejected)
    assert text.startswith("invalid Rejected: Invalid enum value 'busy'")
    assert text.endswith("- at `$.reason`")


def test_machine_id_pattern() -> None:
    text = _bad(b'{"machine_id": "no-tilde"}', MachineRequest)
    assert text == (
        "invalid MachineRequest: Expected `str` matching regex"
        " '^[a-z0-9][a-z0-9-]{0,62}~[A-Za-z0-9]{1,64}$' - at `$.machine_id`"
    )


# -- malformed payloads ------------------------------------------------------------------------


def test_malformed_json() -> None:
    assert _bad(b'{"type": "PlaceOrder"') == "malformed JSON: Input data was truncated"


def test_not_utf8() -> None:
    assert _bad(b"\xff\xfe").startswith("malformed JSON: ")


def test_json_not_an_object() -> None:
    assert _bad(b"[1, 2]") == "invalid PlaceOrder: Expected `object`, got `array`"
    assert _bad(b"null") == "invalid PlaceOrder: Expected `object`, got `null`"


def test_empty_payload() -> None:
    assert _bad(b"") == "empty payload: expected a JSON PlaceOrder object"
    assert _bad(b"", ALL_TYPES) == "empty payload: expected a JSON Placed | Unfilled | Error object"


def test_payload_over_limit() -> None:
    data = _order()
    data += b" " * (MAX_PAYLOAD_BYTES + 1 - len(data))
    assert len(data) == MAX_PAYLOAD_BYTES + 1
    assert _bad(data) == "payload of 65537 bytes exceeds the limit of 65536 bytes"


def test_payload_at_limit_is_parsed() -> None:
    data = _order()
    data += b" " * (MAX_PAYLOAD_BYTES - len(data))
    assert len(data) == MAX_PAYLOAD_BYTES
    assert decode(data, PlaceOrder).order_id == "order-1"


def test_bad_message_is_value_error() -> None:
    assert issubclass(BadMessage, ValueError)
    with pytest.raises(ValueError, match=r"\$\.resources\.cpus"):
        decode(_order(resources={"cpus": 0, "memory_mb": 1}), PlaceOrder)


def test_decode_does_not_leak_msgspec_errors() -> None:
    for data in (b"{", b"[]", _order(region=1)):
        with pytest.raises(BadMessage) as info:
            decode(data, PlaceOrder)
        assert not isinstance(info.value, msgspec.MsgspecError)
        assert info.value.__suppress_context__ is True


# -- subjects ----------------------------------------------------------------------------------


def test_default_subjects() -> None:
    s = Subjects()
    assert s.prefix == DEFAULT_PREFIX == "bourse"
    assert s.root == "bourse.v1"
    assert s.order("mad") == "bourse.v1.order.mad"
    assert s.order_all == "bourse.v1.order.*"
    assert s.bid("mad") == "bourse.v1.bid.mad"
    assert s.region_release("mad") == "bourse.v1.release.mad"
    assert s.status("mad") == "bourse.v1.status.mad"
    assert s.worker_all("mad-1") == "bourse.v1.worker.mad-1.>"
    assert s.commit("mad-1") == "bourse.v1.worker.mad-1.commit"
    assert s.release("mad-1") == "bourse.v1.worker.mad-1.release"
    assert s.worker_machine("mad-1", "start") == "bourse.v1.worker.mad-1.machine.start"
    assert s.machine("list") == "bourse.v1.machine.list"
    assert s.machine_all == "bourse.v1.machine.*"
    assert s.event("mad", "mad-1", "placed") == "bourse.v1.event.mad.mad-1.placed"
    assert s.events() == "bourse.v1.event.*.*.*"
    assert s.events("mad") == "bourse.v1.event.mad.*.*"
    assert s.events(kind="destroyed") == "bourse.v1.event.*.*.destroyed"


def test_custom_prefix() -> None:
    s = Subjects("acme.market_2")
    assert s.root == "acme.market_2.v1"
    assert s.root_tokens == 3
    assert s.order("mad") == "acme.market_2.v1.order.mad"
    assert s.commit("w1") == "acme.market_2.v1.worker.w1.commit"
    assert s.event("mad", "w1", "started") == "acme.market_2.v1.event.mad.w1.started"


@pytest.mark.parametrize("prefix", ["", "bad prefix", "a..b", ".a", "a.", "a.*", "a.>", "ü"])
def test_invalid_prefix(prefix: str) -> None:
    with pytest.raises(ValueError, match="invalid subject prefix") as info:
        Subjects(prefix)
    assert repr(prefix) in str(info.value)


def test_tail() -> None:
    s = Subjects()
    assert s.root_tokens == 2
    assert s.tail("bourse.v1.worker.mad-1.machine.start", 1) == ["mad-1", "machine", "start"]
    assert s.tail("bourse.v1.worker.mad-1.machine.start", 2) == ["machine", "start"]
    assert s.tail("bourse.v1.machine.get", 1) == ["get"]
    assert s.tail("bourse.v1.order.mad", 0) == ["order", "mad"]
    custom = Subjects("a.b")
    assert custom.tail(custom.worker_machine("w1", "stop"), 1) == ["w1", "machine", "stop"]


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ("mad", True),
        ("mad-1", True),
        ("0", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("", False),
        ("-mad", False),
        ("Mad", False),
        ("mad.1", False),
        ("mad_1", False),
    ],
)
def test_is_valid_id(value: str, ok: bool) -> None:
    assert is_valid_id(value) is ok


# -- anchoring: `$` also matches before a trailing newline -------------------------------------


def test_region_with_trailing_newline_rejected() -> None:
    text = _bad(_order(region="mad\n"))
    assert text.endswith("- at `$.region`")


def test_is_valid_id_rejects_trailing_newline() -> None:
    assert is_valid_id("mad\n") is False


def test_a_sampled_bid_goes_to_the_images_home_shard_and_others_from_the_order_id() -> None:
    import zlib

    from bourse.wire.subjects import sampled_shards

    home = zlib.crc32(b"web") % 10
    got = sampled_shards("order-1", "web", 10, 3)
    assert got[0] == home and len(set(got)) == 3 and all(0 <= s < 10 for s in got)
    assert sampled_shards("order-1", "web", 10, 3) == got  # a retry asks the same shards
    draws = {tuple(sampled_shards(f"order-{i}", "web", 10, 2)) for i in range(50)}
    assert {d[0] for d in draws} == {home} and len({d[1] for d in draws}) > 5
    assert sorted(sampled_shards("o", "web", 3, 5)) == [0, 1, 2]  # never more than exist


def test_decoded_messages_are_not_tracked_by_the_cyclic_gc() -> None:
    import gc

    from bourse.wire.messages import Machine, Resources

    m = Machine(
        machine_id="w~1", order_id="o", worker_id="w", region="r", state="reserved",
        resources=Resources(cpus=1, memory_mb=1), image="i", metadata={"a": "b"}, score=0.5,
        created_at_ms=1, updated_at_ms=1,
    )  # fmt: skip
    assert not gc.is_tracked(m) and not gc.is_tracked(m.resources)


def test_exec_chunks_are_bounded() -> None:
    """An exec chunk over 32 KiB is refused, naming the field; one at the bound fits the
    payload limit as base64."""
    at_bound = ExecOutput(session="s1", offset=0, data=b"x" * (32 * 1024))
    assert len(encode(at_bound)) < MAX_PAYLOAD_BYTES
    over = encode(ExecOutput(session="s1", offset=0, data=b"x" * (32 * 1024 + 1)))
    assert "$.data" in _bad(over, ExecOutput)
