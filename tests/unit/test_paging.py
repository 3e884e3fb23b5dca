"""Pages under a byte budget (bourse/wire/paging.py) and machine listings in pages
(bourse/wire/listing.py): pure, no NATS."""

from __future__ import annotations

import random

import pytest

from bourse.client.render import age
from bourse.wire.codec import decode, encode
from bourse.wire.listing import cursor_page, listed, machine_pages, matches
from bourse.wire.messages import (
    ListMachines,
    Machine,
    MachineList,
    MachinePage,
    Resources,
)
from bourse.wire.paging import NATS_MAX_PAYLOAD, PAGE_BYTES, PageSet, cut

WID = "mad-1"


def machine(i: int, state: str = "started", **metadata: str) -> Machine:
    return Machine(
        machine_id=f"{WID}~{i:026d}",
        order_id=f"o-{i}",
        worker_id=WID,
        region="mad",
        state=state,  # type: ignore[arg-type]  # a str that is a MachineState
        resources=Resources(cpus=1, memory_mb=64),
        image="web",
        metadata=metadata,
        created_at_ms=1_000_000 + i,
    )


def many(n: int, seed: int = 7) -> list[Machine]:
    """Machines with metadata of random sizes (some large), so page cuts fall anywhere."""
    rnd = random.Random(seed)
    return [
        machine(i, app=f"app-{i % 5}", note="x" * rnd.choice((0, 10, 300, 3000))) for i in range(n)
    ]


def huge(i: int) -> Machine:
    """A machine larger than a page: 64 metadata values of 1024 characters (what the
    biggest PlaceOrder could carry is about this)."""
    return machine(i, **{f"k{j:02d}": "v" * 1024 for j in range(64)})


def test_no_page_exceeds_the_budget_and_the_pages_hold_every_machine_in_order() -> None:
    ms = many(3000)
    pages = machine_pages(WID, "mad", ms)
    assert 10 < len(pages) < 200
    for i, p in enumerate(pages, 1):
        data = encode(p)
        assert len(data) <= PAGE_BYTES, (i, len(data))
        assert (p.page, p.pages, p.last) == (i, len(pages), i == len(pages))
        assert decode(data, MachinePage) == p
    assert [m for p in pages for m in p.machines] == ms


def test_a_machine_bigger_than_a_page_is_sent_alone_under_the_hard_limit() -> None:
    big = huge(5)
    assert len(encode(big)) > PAGE_BYTES
    ms = [*many(40)[:5], big, *many(40)[5:]]
    pages = machine_pages(WID, "mad", ms)
    [alone] = [p for p in pages if big in p.machines]
    assert alone.machines == [big]
    assert PAGE_BYTES < len(encode(alone)) < NATS_MAX_PAYLOAD
    assert all(len(encode(p)) <= PAGE_BYTES for p in pages if p is not alone)
    assert [m for p in pages for m in p.machines] == ms


def test_no_machines_is_one_empty_last_page() -> None:
    [p] = machine_pages(WID, "mad", [])
    assert (p.page, p.pages, p.last, p.machines) == (1, 1, True, [])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_pages_arriving_in_any_order_reassemble_in_order(seed: int) -> None:
    """Two workers' pages interleaved and shuffled (a page twice, too): each worker is
    complete only once every page is in, and its machines come out in page order."""
    a = machine_pages("mad-1", "mad", many(800, seed))
    b = machine_pages("mad-2", "mad", many(500, seed + 10))
    arrivals = [*a, *b, a[0]]
    random.Random(seed).shuffle(arrivals)
    got: PageSet[Machine] = PageSet()
    for n, p in enumerate(arrivals, 1):
        got.add(p.worker_id, p.page, p.pages, p.machines)
        if n < len(arrivals) - 1:
            assert not (got.is_complete("mad-1") and got.is_complete("mad-2"))
    assert got.all_complete() and sorted(got.complete()) == ["mad-1", "mad-2"]
    assert got.items("mad-1") == [m for p in a for m in p.machines]
    assert got.items("mad-2") == [m for p in b for m in p.machines]


def test_cut_with_one_chunk_stops_early_and_empty_input_is_one_chunk() -> None:
    assert cut([], 10) == [[]]
    sizes = {i: 100 for i in range(50)}
    assert cut(list(range(50)), 0, 1000, sizes.__getitem__, max_chunks=1) == [list(range(9))]


def test_a_cursor_pages_through_every_machine_once_under_the_budget() -> None:
    ms = many(2000)
    ms.insert(700, huge(100_000))
    shuffled = ms[:]
    random.Random(3).shuffle(shuffled)  # the worker's dict order is not the id order
    cursor: str | None = ""
    seen: list[Machine] = []
    while cursor is not None:
        page = cursor_page(WID, shuffled, cursor)
        size = len(encode(page))
        assert size <= PAGE_BYTES or page.machines == [ms[700]], size
        assert size < NATS_MAX_PAYLOAD
        seen.extend(page.machines)
        assert page.next_cursor is None or page.next_cursor > cursor
        cursor = page.next_cursor
    assert [m.machine_id for m in seen] == sorted(m.machine_id for m in ms)


def test_cursor_page_of_nothing_is_the_last() -> None:
    assert cursor_page(WID, [], "") == MachineList(worker_id=WID, machines=[], next_cursor=None)


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (ListMachines(), [0, 1, 2, 3]),
        (ListMachines(include_destroyed=True), [0, 1, 2, 3, 4]),
        (ListMachines(states=["destroyed"]), [4]),
        (ListMachines(states=["stopped", "started"]), [0, 1, 2]),
        (ListMachines(app="shop"), [0, 1]),
        (ListMachines(app="shop", states=["stopped"]), [1]),
        (ListMachines(labels={"tier": "db"}), [3]),
        (ListMachines(labels={"tier": "db", "app": "shop"}), []),
        (ListMachines(labels={"app": "shop"}, include_destroyed=True), [0, 1, 4]),
        (ListMachines(app="nope"), []),
    ],
)
def test_filters(request_: ListMachines, expected: list[int]) -> None:
    ms = [
        machine(0, "started", app="shop"),
        machine(1, "stopped", app="shop"),
        machine(2, "started", app="blog"),
        machine(3, "reserved", tier="db"),
        machine(4, "destroyed", app="shop"),
    ]
    assert [m for m in ms if matches(request_, m)] == [ms[i] for i in expected]


def test_listed_sorts_by_region_worker_creation() -> None:
    a = Machine(**{**_fields(machine(2)), "region": "fra", "worker_id": "fra-1"})
    b = machine(9)
    c = machine(1)
    assert listed(ListMachines(), [b, c, a]) == [a, c, b]


def _fields(m: Machine) -> dict[str, object]:
    return {f: getattr(m, f) for f in m.__struct_fields__}


@pytest.mark.parametrize(
    ("created", "now", "shown"),
    [(0, 5, "-"), (1000, 1000, "0s"), (1000, 60_999, "59s"), (0 + 1, 3_600_001, "1h"),
     (1, 61_001, "1m"), (1, 2 * 86_400_000 + 1, "2d"), (5000, 1000, "0s")],
)  # fmt: skip
def test_age(created: int, now: int, shown: str) -> None:
    assert age(created, now) == shown
