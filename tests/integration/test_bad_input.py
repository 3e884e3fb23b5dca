"""I6: malformed input on every subject gets an Error naming the problem, and every
process keeps serving afterwards."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import pytest

from bourse.wire.codec import decode
from bourse.wire.limits import MAX_PAYLOAD_BYTES
from bourse.wire.messages import Error, Machine, Placed
from bourse.wire.subjects import Subjects
from tests.market import Market, order, worker

GOOD_ORDER = {
    "type": "PlaceOrder",
    "region": "mad",
    "resources": {"cpus": 1, "memory_mb": 64},
    "image": "web",
}


def _order(**patch: object) -> bytes:
    body = json.loads(json.dumps(GOOD_ORDER))
    for path, value in patch.items():
        *parents, leaf = path.split("__")
        node = body
        for p in parents:
            node = node[p]
        node[leaf] = value
    return json.dumps(body).encode()


S = Callable[[Subjects], str]
CASES: list[tuple[str, S, bytes, str, str]] = [
    # (case id, subject, payload, expected code, expected text in the detail)
    ("order-malformed-json", lambda s: s.order("mad"), b"{nope", "bad_request", "malformed JSON"),
    ("order-empty", lambda s: s.order("mad"), b"", "bad_request", "empty payload"),
    ("order-array", lambda s: s.order("mad"), b"[1,2]", "bad_request", "Expected `object`"),
    ("order-wrong-tag", lambda s: s.order("mad"), b'{"type":"Bid"}', "bad_request", "$.type"),
    (
        "order-cpus-string",
        lambda s: s.order("mad"),
        _order(resources__cpus="2"),
        "bad_request",
        "$.resources.cpus",
    ),
    (
        "order-cpus-zero",
        lambda s: s.order("mad"),
        _order(resources__cpus=0),
        "bad_request",
        ">= 1 - at `$.resources.cpus`",
    ),
    (
        "order-memory-negative",
        lambda s: s.order("mad"),
        _order(resources__memory_mb=-5),
        "bad_request",
        "$.resources.memory_mb",
    ),
    (
        "order-cpus-huge",
        lambda s: s.order("mad"),
        _order(resources__cpus=10**12),
        "bad_request",
        "<= 4096 - at `$.resources.cpus`",
    ),
    (
        "order-disk-float",
        lambda s: s.order("mad"),
        _order(resources__disk_mb=1.5),
        "bad_request",
        "$.resources.disk_mb",
    ),
    (
        "order-missing-image",
        lambda s: s.order("mad"),
        b'{"region":"mad","resources":{"cpus":1,"memory_mb":1}}',
        "bad_request",
        "image",
    ),
    (
        "order-deadline-too-long",
        lambda s: s.order("mad"),
        _order(deadline_ms=30001),
        "bad_request",
        "$.deadline_ms",
    ),
    (
        "order-min-score",
        lambda s: s.order("mad"),
        _order(min_score=1.5),
        "bad_request",
        "$.min_score",
    ),
    (
        "order-bad-region-syntax",
        lambda s: s.order("MAD"),
        _order(region="MAD"),
        "bad_request",
        "$.region",
    ),
    (
        "order-region-mismatch",
        lambda s: s.order("fra"),
        _order(),
        "bad_request",
        "does not match the subject's region 'fra'",
    ),
    (
        "order-bad-label",
        lambda s: s.order("mad"),
        _order(constraints={"bad key!": "x"}),
        "bad_request",
        "$.constraints",
    ),
    (
        "order-oversize",
        lambda s: s.order("mad"),
        b"{" + b" " * (MAX_PAYLOAD_BYTES + 10) + b"}",
        "bad_request",
        "exceeds the limit",
    ),
    (
        "machine-unknown-verb",
        lambda s: s.machine("explode"),
        b"{}",
        "unknown_subject",
        "unknown machine verb 'explode'",
    ),
    (
        "machine-bad-id",
        lambda s: s.machine("get"),
        b'{"machine_id":"nope"}',
        "bad_request",
        "$.machine_id",
    ),
    ("machine-list-no-worker", lambda s: s.machine("list"), b"{}", "bad_request", "worker_id"),
    (
        "machine-unknown-worker",
        lambda s: s.machine("get"),
        b'{"machine_id":"ghost~01ARZ3NDEKTSV4RRFFQ69G5FAV"}',
        "bad_request",
        "not reachable",
    ),
    ("bid-malformed", lambda s: s.bid("mad"), b"\xff\xfe", "bad_request", "malformed JSON"),
    (
        "bid-negative",
        lambda s: s.bid("mad"),
        b'{"order_id":"o","region":"mad","resources":'
        b'{"cpus":-1,"memory_mb":1},"image":"x","hold_ms":10}',
        "bad_request",
        "$.resources.cpus",
    ),
    ("status-garbage", lambda s: s.status("mad"), b"garbage", "bad_request", "malformed JSON"),
    ("region-release-garbage", lambda s: s.region_release("mad"), b"{}", "bad_request", "order_id"),
    ("commit-malformed", lambda s: s.commit("mad-1"), b"{", "bad_request", "malformed JSON"),
    (
        "commit-wrong-types",
        lambda s: s.commit("mad-1"),
        b'{"order_id":1}',
        "bad_request",
        "$.order_id",
    ),
    (
        "commit-other-worker",
        lambda s: s.commit("mad-1"),
        b'{"order_id":"o","worker_id":"x","resources":{"cpus":1,"memory_mb":1},"image":"x"}',
        "bad_request",
        "sent to worker",
    ),
    (
        "release-wrong-worker",
        lambda s: s.release("mad-1"),
        b'{"order_id":"o","worker_id":"x"}',
        "bad_request",
        "sent to worker 'mad-1'",
    ),
    (
        "worker-unknown-subject",
        lambda s: f"{s.root}.worker.mad-1.reboot",
        b"{}",
        "unknown_subject",
        "unknown subject",
    ),
    (
        "worker-machine-not-found",
        lambda s: s.worker_machine("mad-1", "start"),
        b'{"machine_id":"mad-1~01ARZ3NDEKTSV4RRFFQ69G5FAV"}',
        "bad_request",
        "no machine",
    ),
    (
        "worker-machine-foreign",
        lambda s: s.worker_machine("mad-1", "get"),
        b'{"machine_id":"other~01ARZ3NDEKTSV4RRFFQ69G5FAV"}',
        "bad_request",
        "does not belong to worker mad-1",
    ),
    (
        "worker-exec-without-session",
        lambda s: s.worker_machine("mad-1", "exec"),
        b'{"machine_id":"mad-1~01ARZ3NDEKTSV4RRFFQ69G5FAV","command":["id"]}',
        "bad_request",
        "needs a session and a reply subject",
    ),
    (
        "exec-no-command",
        lambda s: s.machine("exec"),
        b'{"machine_id":"mad-1~01ARZ3NDEKTSV4RRFFQ69G5FAV","command":[]}',
        "bad_request",
        "$.command",
    ),
    (
        "worker-oversize",
        lambda s: s.commit("mad-1"),
        b"x" * (MAX_PAYLOAD_BYTES * 2),
        "bad_request",
        "exceeds the limit",
    ),
]


@pytest.mark.parametrize(
    ("subject", "payload", "code", "text"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
async def test_bad_input_gets_a_named_error_and_everyone_keeps_serving(
    market: Market, subject: S, payload: bytes, code: str, text: str
) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    buyer = await market.client()
    reply = await buyer.nc.request(subject(market.subjects), payload, timeout=5)
    err = decode(reply.data, Error)
    assert err.code == code
    assert text in err.detail
    # Still serving: a valid order is placed, through the same exchange and supplier.
    r = await buyer.place(order())
    assert isinstance(r, Placed)


async def test_exchange_region_allowlist_names_the_unknown_region(market: Market) -> None:
    from exchange.service import ExchangeService

    await market.host(worker("mad-1"))
    svc = ExchangeService(await market.connect("ex"), market.subjects, regions={"mad"})
    await market.serve(svc)
    market.exchanges.append(svc)
    buyer = await market.client()
    reply = await buyer.nc.request(market.subjects.order("xyz"), _order(region="xyz"), timeout=5)
    err = decode(reply.data, Error)
    assert err.code == "bad_request"
    assert "unknown region 'xyz'" in err.detail and "['mad']" in err.detail


async def test_a_flood_of_garbage_does_not_stop_placements(market: Market) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    buyer = await market.client()
    for i in range(300):
        await buyer.nc.publish(market.subjects.order("mad"), bytes([i % 256]) * (i + 1))
        await buyer.nc.publish(market.subjects.bid("mad"), b"{" * i)
        await buyer.nc.publish(market.subjects.commit("mad-1"), b"null")
    r = await buyer.place(order())
    assert isinstance(r, Placed)


async def test_an_overloaded_exchange_refuses_at_once_and_recovers(market: Market) -> None:
    import asyncio

    from bourse.client import ClientError
    from exchange.service import ExchangeService

    await market.host(worker("mad-1", cpus=64, memory_mb=65536))
    svc = ExchangeService(await market.connect("ex"), market.subjects, max_order_backlog=2)
    await market.serve(svc)
    market.exchanges.append(svc)
    buyer = await market.client()
    results = await asyncio.gather(
        *(buyer.place(order(order_id=f"burst-{i}")) for i in range(60)), return_exceptions=True
    )
    refused = [r for r in results if isinstance(r, ClientError)]
    placed = [r for r in results if isinstance(r, Placed)]
    assert refused and placed and len(refused) + len(placed) == 60
    assert all("exchange overloaded" in str(r) and "queued" in str(r) for r in refused)
    assert svc.responder.counts["shed"] == len(refused)
    assert isinstance(await buyer.place(order(order_id="after")), Placed)  # serving again


async def test_a_bug_in_a_spawned_request_still_answers_the_requester(market: Market) -> None:
    import pytest

    from bourse.client import ClientError

    host = await market.host(worker("mad-1"))
    await market.exchange()
    buyer = await market.client()
    r = await buyer.place(order())
    assert isinstance(r, Placed)

    async def broken(verb: str, machine_id: str) -> Machine | Error:  # fault injection: a bug
        raise RuntimeError("boom")

    host.workers["mad-1"].keeper.transition = broken  # type: ignore[method-assign]  # a planted bug
    for client in (buyer, await market.client(direct=True)):  # via the exchange, and direct
        with pytest.raises(ClientError) as err:
            await asyncio.wait_for(client.machine("start", r.machine_id), 5)
        assert err.value.code == "internal" and "RuntimeError: boom" in str(err.value)
    # the worker still serves everything else
    assert isinstance(await buyer.place(order()), Placed)
