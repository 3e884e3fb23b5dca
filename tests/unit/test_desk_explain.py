"""Why not, (docs/protocol.md §4.15): the desk's explanation of an order on every worker, on
a fake clock, no NATS, no sleep. Every reason with the exact numbers in its text, the score
an offer would carry (the same as the bid's), and the reply pages.

As in test_desk.py: each worker sells 8 CPUs / 8 GiB, spread preset (f(u) = 1 - u),
image_weight 0.3: score = 0.7 * utility + 0.3 * cached.
"""

from __future__ import annotations

from typing import Any

import pytest

from bourse.wire.codec import decode, encode
from bourse.wire.messages import (
    ExplainRequest,
    Explanation,
    Offer,
    Reason,
    Resources,
    WorkerVerdict,
)
from supplier.desk import IMAGE_NOT_CACHED, explanation_pages
from supplier.feasible import (
    BLOCKED,
    CANNOT_RUN,
    COMMITTING,
    CONSTRAINT_MISMATCH,
    DRAINING,
    EXCLUDED,
    INSUFFICIENT,
)
from supplier.store import Store
from tests.unit.test_desk import Bench, bid, cfg, res


def req(order_id: str = "o1", resources: Resources | None = None, **kw: Any) -> ExplainRequest:
    return ExplainRequest(
        order_id=order_id, region="mad", resources=resources or res(), image="web", **kw
    )


def explain(bench: Bench, r: ExplainRequest | None = None) -> list[WorkerVerdict]:
    return bench.desk.explain(r or req(), bench.now, bench.group.workers)


# -- offers: the score as the bid would get it ------------------------------------------------


def test_a_fitting_worker_would_offer_the_score_and_subscores_of_its_bid(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    [v] = explain(bench)
    # u = 2/8 and 2048/8192 -> 0.75 each -> utility 0.75; score 0.7 * 0.75 + 0.3 = 0.825
    assert v == WorkerVerdict(
        worker_id="w1",
        verdict="offer",
        score=0.825,
        subscores={"cpus": 0.75, "memory_mb": 0.75, "utility": 0.75, "image": 1.0},
        image_cached=True,
    )
    assert bench["w1"].ledger.holds == {}  # nothing held
    [send] = bench.answer(bid()).replies  # the real bid, same state: the same price
    assert isinstance(send.reply, Offer)
    assert (send.reply.score, send.reply.subscores) == (v.score, v.subscores)


def test_an_uncached_image_is_noted_with_what_the_image_term_costs(store: Store) -> None:
    [v] = explain(Bench(store, cfg("w1")))
    assert (v.verdict, v.score, v.image_cached) == ("offer", 0.525, False)  # 0.7 * 0.75
    assert v.reasons == [
        Reason(
            code=IMAGE_NOT_CACHED,
            detail="image 'web' not cached: the image term costs 0.3 (score 0.525, 0.825 if "
            "cached)",
            cost=0.3,
        )
    ]


# -- declines: every reason, the exact text ---------------------------------------------------


@pytest.mark.parametrize(
    ("worker", "kw", "reason"),
    [
        ({"draining": True}, {}, Reason(code=DRAINING, detail="draining: configured")),
        (
            {},
            {"exclude_workers": ["w2", "w1"]},
            Reason(code=EXCLUDED, detail="excluded by the order"),
        ),
        (
            {},
            {"constraints": {"disk": "hdd"}},
            Reason(
                code=CONSTRAINT_MISMATCH,
                detail="label disk: wants 'hdd', has 'ssd'",
                label="disk",
                expected="hdd",
                actual="ssd",
            ),
        ),
        (
            {},
            {"constraints": {"gpu": "a100"}},
            Reason(
                code=CONSTRAINT_MISMATCH,
                detail="label gpu: wants 'a100', missing",
                label="gpu",
                expected="a100",
            ),
        ),
        (
            {},
            {"resources": res(9, 1024)},
            Reason(
                code=INSUFFICIENT,
                detail="cpus: wants 9, free 8 (capacity 8, committed 0, held 0)",
                resource="cpus",
                want=9,
                free=8,
                capacity=8,
            ),
        ),
        (
            {"driver": "process", "catalog": {"db": {"command": ["x"]}}},
            {},
            Reason(code=CANNOT_RUN, detail="the driver cannot run image 'web'"),
        ),
    ],
)
def test_a_worker_that_cannot_take_the_order_says_why(
    store: Store, worker: dict[str, Any], kw: dict[str, Any], reason: Reason
) -> None:
    [v] = explain(Bench(store, cfg("w1", **worker)), req(**kw))
    assert v == WorkerVerdict(worker_id="w1", verdict="decline", reasons=[reason])


def test_the_drain_reason_is_the_workers(store: Store) -> None:
    bench = Bench(store, cfg("w1"))
    bench["w1"].set_draining("store: database or disk is full")
    [v] = explain(bench)
    assert [r.detail for r in v.reasons] == ["draining: store: database or disk is full"]


def test_every_reason_is_listed_in_the_desks_order(store: Store) -> None:
    bench = Bench(store, cfg("w1", draining=True))
    r = req(
        resources=Resources(cpus=9, memory_mb=9000),
        exclude_workers=["w1"],
        constraints={"disk": "hdd", "zone": "a"},
    )
    [v] = explain(bench, r)
    assert v.verdict == "decline"
    assert [x.detail for x in v.reasons] == [
        "draining: configured",
        "excluded by the order",
        "label disk: wants 'hdd', has 'ssd'",
        "label zone: wants 'a', missing",
        "cpus: wants 9, free 8 (capacity 8, committed 0, held 0)",
        "memory_mb: wants 9000, free 8192 (capacity 8192, committed 0, held 0)",
    ]


async def test_short_capacity_counts_committed_and_held_apart(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    await bench.place("m1", res(4, 1024))  # committed 4 cpus
    assert bench.answer(bid("o2", res(2, 1024))).replies  # o2 holds 2 cpus
    # 4 wanted, 2 free, 4 without holds: only o2's hold is in the way -> would wait
    [v] = explain(bench, req("o3", res(4, 1024)))
    assert v.verdict == "wait"
    assert v.reasons == [
        Reason(
            code=BLOCKED,
            detail="cpus: wants 4, free 2 (capacity 8, committed 4, held 2): only holds are "
            "in the way (would wait)",
            resource="cpus",
            want=4,
            free=2,
            capacity=8,
            committed=4,
            held=2,
        )
    ]
    # priced as once the holds are gone: u_cpus 8/8 -> 0, u_mem 2048/8192 -> .75
    assert (v.score, v.subscores["utility"]) == (0.5625, 0.375)
    # 5 wanted: committed machines are in the way too -> declines
    [v] = explain(bench, req("o3", res(5, 1024)))
    assert v.verdict == "decline"
    assert [(x.code, x.detail) for x in v.reasons] == [
        (INSUFFICIENT, "cpus: wants 5, free 2 (capacity 8, committed 4, held 2)")
    ]
    assert set(bench["w1"].ledger.holds) == {"o2"}  # nothing dropped or taken


def test_expired_holds_and_the_orders_own_hold_do_not_count(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    assert bench.answer(bid("o1", res(4, 1024), hold_ms=1000)).replies
    assert bench.answer(bid("o2", res(3, 1024), hold_ms=100)).replies
    # o1 asks again (a re-bid replaces its hold): free for it = 8 - 3 (o2's hold)
    [v] = explain(bench, req("o1", res(5, 1024)))
    assert v.verdict == "offer"
    bench.now += 0.1  # o2's hold has expired (the sweep has not run: the ledger still has it)
    [v] = explain(bench, req("o3", res(8, 1024)))  # o1's 4 are live: blocked, would wait
    assert (v.verdict, v.reasons[0].held) == ("wait", 4)
    bench.now += 0.9
    [v] = explain(bench, req("o3", res(8, 1024)))
    assert v.verdict == "offer"
    assert set(bench["w1"].ledger.holds) == {"o1", "o2"}  # explain drops nothing


async def test_an_existing_machine_and_a_commit_under_way(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]), cfg("w2", images=["web"]), max_offers=1)
    placed = await bench.place("o1")
    [v1, v2] = explain(bench)
    by = {v.worker_id: v for v in (v1, v2)}
    assert by[placed.worker_id] == WorkerVerdict(
        worker_id=placed.worker_id,
        verdict="existing",
        score=placed.score,
        image_cached=True,
        machine_id=placed.machine_id,
    )
    other = "w2" if placed.worker_id == "w1" else "w1"
    assert by[other].verdict == "offer"


def test_a_commit_under_way_for_the_order(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    assert bench.answer(bid("o9")).replies
    bench["w1"].ledger.holds["o9"].committing = True
    [v] = explain(bench, req("o9"))
    assert v == WorkerVerdict(
        worker_id="w1",
        verdict="decline",
        reasons=[Reason(code=COMMITTING, detail="a commit for this order is being written here")],
    )


def test_every_worker_is_explained_whatever_the_sample_and_max_offers(store: Store) -> None:
    configs = [cfg(f"w{i}", images=["web"] if i % 3 == 0 else []) for i in range(30)]
    bench = Bench(store, *configs, max_offers=1, quote_sample=2)
    verdicts = explain(bench)
    assert [v.worker_id for v in verdicts] == [f"w{i}" for i in range(30)]
    assert {v.verdict for v in verdicts} == {"offer"}
    assert sorted({v.score for v in verdicts}) == [0.525, 0.825]


# -- pages --------------------------------------------------------------------------------------


def test_ten_thousand_verdicts_fit_in_pages_under_the_limit() -> None:
    why = Reason(
        code=INSUFFICIENT, detail="cpus: wants 9, free 8 (capacity 8, committed 0, held 0)"
    )
    verdicts = [
        WorkerVerdict(worker_id=f"worker-{i:05d}", verdict="decline", reasons=[why])
        for i in range(10_000)
    ]
    pages = explanation_pages("o1", "mad", "r1", verdicts, limit_bytes=60 * 1024)
    assert 10 < len(pages) < 100
    for i, p in enumerate(pages, 1):
        data = encode(p)
        assert len(data) <= 60 * 1024
        assert (p.page, p.pages, p.last) == (i, len(pages), i == len(pages))
        assert decode(data, Explanation) == p
    assert [v for p in pages for v in p.verdicts] == verdicts


def test_no_verdicts_is_one_last_page() -> None:
    [p] = explanation_pages("o1", "mad", "r1", [])
    assert (p.page, p.pages, p.last, p.verdicts) == (1, 1, True, [])


# -- fractional CPUs: the numbers as people write them, the fields in millicores -----------------


def test_a_half_cpu_short_says_it_in_cpus_and_carries_millicores(store: Store) -> None:
    bench = Bench(store, cfg("w1", cpus=1, images=["web"]))
    half = Resources(cpus=1, cpu_millis=500, memory_mb=256)
    quarter = Resources(cpus=1, cpu_millis=250, memory_mb=256)
    assert bench.answer(bid("o1", half)).replies
    assert bench.answer(bid("o2", quarter)).replies
    [v] = explain(bench, req("o3", half))
    assert v.verdict == "wait"  # only holds are in the way
    assert v.reasons[0] == Reason(
        code=BLOCKED,
        detail="cpus: wants 0.5, free 0.25 (capacity 1, committed 0, held 0.75): only holds "
        "are in the way (would wait)",
        resource="cpu_millis",  # a number is not whole: the fields are millicores
        want=500,
        free=250,
        capacity=1000,
        held=750,
    )


def test_a_whole_cpu_short_keeps_the_v1_reason(store: Store) -> None:
    bench = Bench(store, cfg("w1", images=["web"]))
    [v] = explain(bench, req("o1", res(9, 1024)))
    assert v.reasons[0].resource == "cpus"
    assert (v.reasons[0].want, v.reasons[0].free, v.reasons[0].capacity) == (9, 8, 8)
