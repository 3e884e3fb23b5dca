"""The chain of checks (supplier/feasible.py): each check alone, their order, and the
property that makes it one chain: on any worker and any order, a bid is offered exactly
when the explanation says it would be, and a worker that stays silent (or waits) does so
for the first reason the explanation lists. Real workers on a real temp store, a fake
monotonic clock, no NATS.

Workers sell 8 CPUs / 8 GiB with the label disk=ssd unless a row says otherwise.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bourse.images import ImageCache
from bourse.wire.messages import (
    Amount,
    Bid,
    ExplainRequest,
    Layer,
    Machine,
    Offer,
    Resources,
    Waiting,
    WorkerVerdict,
)
from bourse.wire.resources import ZERO, vec
from supplier.candidates import BidGroup
from supplier.config import ImageSpec, WorkerConfig
from supplier.desk import Desk
from supplier.feasible import (
    BLOCKED,
    CANNOT_RUN,
    CHECKS,
    COMMITTING,
    CONSTRAINT_MISMATCH,
    DRAINING,
    EXCLUDED,
    EXISTING,
    FEASIBLE,
    IMAGE_TOO_BIG,
    INSUFFICIENT,
    RECLAIMING,
    STANDING,
    TOO_SMALL,
    UNDOING,
    every_failure,
    first_failure,
    handout,
    tenant_refusal,
)
from supplier.images import MIB, StoreSource
from supplier.ledger import Hold
from supplier.machines.api import Mechanism
from supplier.machines.host.confine import Confiner
from supplier.machines.process import ProcessKind
from supplier.machines.runner import Runner
from supplier.store import Store
from supplier.worker import Worker

WID = "w1"
NOW = 1000.0  # the fake monotonic clock
# An image named by content: three layers of 1 MiB; a pull adds the layers lacking and the
# root (counted at its layers' size), 6 MiB into an empty cache.
DIGEST = "sha256:" + "ab" * 32
LAYERS = [Layer(digest=f"sha256:{i:064x}", size=MIB) for i in range(1, 4)]
CONTENT = {"image_digest": DIGEST, "layers": LAYERS}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(tmp_path_factory.mktemp("feasible") / "supplier.db")
    try:
        yield s
    finally:
        s.close()


def worker(
    store: Store,
    capacity: Amount | None = None,
    *,
    labels: dict[str, str] | None = None,
    catalog: dict[str, list[str]] | None = None,
    confine: Mechanism = "none",
    images: tuple[str, ...] = (),
    cache_mb: int = 100,
    store_there: bool = True,
) -> Worker:
    """A worker; with ``catalog`` (image -> command), a process driver that runs only those
    images, confined as ``confine`` says (rlimit: memory_mb < 4 cannot be confined), with a
    content cache of ``cache_mb`` and an image store to pull from when ``store_there``."""
    cfg = WorkerConfig(
        worker_id=WID,
        region="mad",
        capacity=capacity or Amount(cpus=8, memory_mb=8192),
        labels={"disk": "ssd"} if labels is None else labels,
        images=list(images),
        image_cache_mb=cache_mb,
    )
    driver = None
    if catalog is not None:
        specs = {image: ImageSpec(command=cmd) for image, cmd in catalog.items()}
        top, confiner = store.path.parent, Confiner(confine, WID)
        kind = ProcessKind(confiner, specs, top / "work")
        driver = Runner(kind, confiner, top / "logs", top / "shims")
    source = StoreSource()
    source.available = store_there
    return Worker(cfg, store, lambda e: None, driver=driver, source=source)


def holding(w: Worker, layers: int) -> Worker:
    """``w`` with a fresh content cache holding the first ``layers`` of LAYERS (sparse
    files of their sizes, as a restart finds layers on disk)."""
    assert w.images.content is not None
    top = Path(tempfile.mkdtemp(dir=w.store.path.parent))
    blobs = top / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for layer in LAYERS[:layers]:
        with (blobs / layer.digest.removeprefix("sha256:")).open("wb") as f:
            f.truncate(layer.size)
    limits = w.images.content.limits
    w.images.content = ImageCache.open(top, w.images.source, limits)
    return w


def order(resources: Resources | None = None, **kw: Any) -> ExplainRequest:
    return ExplainRequest(
        order_id="o1",
        region="mad",
        resources=resources or Resources(cpus=2, memory_mb=2048),
        image="web",
        **kw,
    )


def hold(w: Worker, order_id: str, want: tuple[int, int, int, int], ttl_s: float = 1.0) -> Hold:
    h = Hold(order_id, want, NOW + ttl_s, 0.5, {}, False, f"a-{order_id}")
    assert w.ledger.hold(h)
    return h


def machine(order_id: str = "o1") -> Machine:
    return Machine(
        machine_id=f"{WID}~M1",
        order_id=order_id,
        worker_id=WID,
        region="mad",
        state="reserved",
        resources=Resources(cpus=2, memory_mb=2048),
        image="web",
        score=0.75,
    )


# -- each check, alone and in the chain -----------------------------------------------------


def placed(w: Worker) -> None:
    w.keeper.added(machine())


def reclaimed(w: Worker) -> None:
    placed(w)
    w.reclaims.orders.add("o1")


def aborting(w: Worker) -> None:
    placed(w)
    w.undoing.add("o1")  # an abort of its commit decided, its destroy not yet durable


def committing(w: Worker) -> None:
    hold(w, "o1", (2000, 2048, 0, 0, 0)).committing = True


def full_of_holds(w: Worker) -> None:
    hold(w, "other", (7000, 1024, 0, 0, 0))


def full_of_machines(w: Worker) -> None:
    w.ledger.load_committed((7000, 1024, 0, 0, 0))


def held_without_the_image(store: Store) -> Worker:
    w = worker(store, catalog={"db": ["x"]})
    full_of_holds(w)
    return w


def held_with_a_small_cache(store: Store) -> Worker:
    w = worker(store, catalog={}, cache_mb=5)
    full_of_holds(w)
    return w


@dataclass(frozen=True)
class Row:
    """A worker made so, an order, the chain's first reason and every reason's code."""

    make: Callable[[Store], Worker]
    order: ExplainRequest
    first: str | None
    every: list[str]


def plain(store: Store) -> Worker:
    return worker(store)


def then(f: Callable[[Worker], None]) -> Callable[[Store], Worker]:
    def make(store: Store) -> Worker:
        w = worker(store)
        f(w)
        return w

    return make


ROWS = {
    "takes it": Row(plain, order(), None, []),
    "its machine is here": Row(then(placed), order(), EXISTING, []),
    "its machine is being reclaimed": Row(then(reclaimed), order(), RECLAIMING, [RECLAIMING]),
    "its machine is being aborted": Row(then(aborting), order(), UNDOING, [UNDOING]),
    "its commit is under way": Row(then(committing), order(), COMMITTING, [COMMITTING]),
    "draining": Row(then(lambda w: w.set_draining("maintenance")), order(), DRAINING, [DRAINING]),
    "excluded": Row(plain, order(exclude_workers=["w0", WID]), EXCLUDED, [EXCLUDED]),
    "another excluded": Row(plain, order(exclude_workers=["w0"]), None, []),
    "labels met": Row(plain, order(constraints={"disk": "ssd"}), None, []),
    "a label not met, one missing": Row(
        plain,
        order(constraints={"disk": "hdd", "zone": "a"}),
        CONSTRAINT_MISMATCH,
        [CONSTRAINT_MISMATCH, CONSTRAINT_MISMATCH],
    ),
    "exactly what is free": Row(plain, order(Resources(cpus=8, memory_mb=8192)), None, []),
    "more than the capacity": Row(
        plain, order(Resources(cpus=9, memory_mb=9000)), INSUFFICIENT, [INSUFFICIENT] * 2
    ),
    "machines in the way": Row(then(full_of_machines), order(), INSUFFICIENT, [INSUFFICIENT]),
    "only holds in the way": Row(then(full_of_holds), order(), BLOCKED, [BLOCKED]),
    "only holds in the way, and an image it cannot run: no wait": Row(
        held_without_the_image,
        order(),
        CANNOT_RUN,
        [CANNOT_RUN, BLOCKED],
    ),
    "image not in the catalog": Row(
        lambda s: worker(s, catalog={"db": ["x"]}), order(), CANNOT_RUN, [CANNOT_RUN]
    ),
    "image without a command": Row(
        lambda s: worker(s, catalog={"web": []}), order(), CANNOT_RUN, [CANNOT_RUN]
    ),
    "too small to confine": Row(
        lambda s: worker(s, catalog={"web": ["x"]}, confine="rlimit"),
        order(Resources(cpus=1, memory_mb=3)),
        TOO_SMALL,
        [TOO_SMALL],
    ),
    "small but not confined": Row(
        lambda s: worker(s, catalog={"web": ["x"]}), order(Resources(cpus=1, memory_mb=3)), None, []
    ),
    "a content image, a store to pull it from": Row(
        lambda s: worker(s, catalog={}), order(**CONTENT), None, []
    ),
    "a content image, no store": Row(
        lambda s: worker(s, catalog={}, store_there=False),
        order(**CONTENT),
        CANNOT_RUN,
        [CANNOT_RUN],
    ),
    "a content image bigger than the cache": Row(
        lambda s: worker(s, catalog={}, cache_mb=5),
        order(**CONTENT),
        IMAGE_TOO_BIG,
        [IMAGE_TOO_BIG],
    ),
    "a content image bigger than the cache, holds in the way: no wait": Row(
        held_with_a_small_cache,
        order(**CONTENT),
        IMAGE_TOO_BIG,
        [IMAGE_TOO_BIG, BLOCKED],
    ),
    "a content image a sim worker's cache could never hold": Row(
        lambda s: worker(s, cache_mb=2), order(**CONTENT), IMAGE_TOO_BIG, [IMAGE_TOO_BIG]
    ),
    # draining > excluded > constraint_mismatch > image_not_runnable > insufficient
    "everything at once": Row(
        lambda s: worker(s, catalog={"db": ["x"]}, labels={}),
        order(
            Resources(cpus=9, memory_mb=1),
            exclude_workers=[WID],
            constraints={"disk": "ssd"},
        ),
        EXCLUDED,
        [EXCLUDED, CONSTRAINT_MISMATCH, CANNOT_RUN, INSUFFICIENT],
    ),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_the_chain_on_one_worker(store: Store, row: Row) -> None:
    w = row.make(store)
    want = vec(row.order.resources)
    free = w.ledger.free
    assert first_failure(CHECKS, w, row.order, want, free) == row.first
    standing = first_failure(STANDING, w, row.order, want, free)
    if standing is None:
        assert [r.code for r in every_failure(FEASIBLE, w, row.order, want, free)] == row.every
    else:
        why: list[Any] = []
        assert first_failure(STANDING, w, row.order, want, free, why) == standing
        assert [r.code for r in why] == row.every


def test_the_stages_are_the_chain_in_its_order() -> None:
    assert STANDING + FEASIBLE == CHECKS
    assert [c.__name__ for c in CHECKS] == [
        "existing_machine",
        "commit_under_way",
        "draining",
        "excluded",
        "labels",
        "runnable",
        "confinable",
        "image_fits",
        "fits",
    ]


def test_a_short_resource_says_its_numbers(store: Store) -> None:
    w = worker(store)
    w.ledger.load_committed((4000, 0, 0, 0, 0))
    hold(w, "other", (2000, 0, 0, 0, 0))
    [short] = every_failure(
        FEASIBLE, w, order(Resources(cpus=3, memory_mb=1)), (3000, 1, 0, 0, 0), w.ledger.free
    )
    assert (short.code, short.detail) == (
        BLOCKED,
        "cpus: wants 3, free 2 (capacity 8, committed 4, held 2): only holds are in the way "
        "(would wait)",
    )
    assert (
        short.resource,
        short.want,
        short.free,
        short.capacity,
        short.committed,
        short.held,
    ) == (
        "cpus",
        3,
        2,
        8,
        4,
        2,
    )


@pytest.mark.parametrize(
    ("make", "expect"),
    [(lambda w: None, None), (placed, EXISTING), (reclaimed, RECLAIMING), (aborting, UNDOING)],
    ids=["no machine", "a machine", "a machine being reclaimed", "a machine being aborted"],
)
def test_the_existing_machine_rule(
    store: Store, make: Callable[[Worker], None], expect: str | None
) -> None:
    w = worker(store)
    make(w)
    assert handout(w, "o1") == expect
    assert handout(w, "another order") is None


def test_a_check_that_passes_says_nothing(store: Store) -> None:
    w = worker(store, catalog={"web": ["x"]}, confine="rlimit")
    o = order(constraints={"disk": "ssd"}, exclude_workers=["w0"])
    why: list[Any] = []
    assert first_failure(CHECKS, w, o, vec(o.resources), w.ledger.free, why) is None
    assert why == []
    # the same order where nothing is free: only fits speaks, once per resource asked for
    assert [r.resource for r in every_failure(CHECKS, w, o, vec(o.resources), ZERO)] == [
        "cpus",
        "memory_mb",
    ]


# -- the property: the bid and its explanation agree ------------------------------------------

ORDER_IDS = ("o1", "h1", "h2", "h3")


Vec = tuple[int, int, int, int]


@st.composite
def amounts(draw: st.DrawFn, most_cpus: int, most_mb: int, least: int = 0) -> Vec:
    """A vector: CPUs in quarters (millicores), memory (now and then a few MiB only),
    disk and GPUs."""
    return (
        draw(st.integers(least, most_cpus * 4)) * 250,
        draw(st.one_of(st.integers(least, 3), st.integers(least, most_mb))),
        draw(st.sampled_from([0, 0, 50, 100])),
        draw(st.sampled_from([0, 0, 1])),
        0,
    )


def resources(v: Vec) -> Resources:
    return Resources(
        cpus=-(-v[0] // 1000), cpu_millis=v[0], memory_mb=v[1], disk_mb=v[2], gpus=v[3]
    )


@dataclass
class Case:
    """A worker's state and an order, as drawn."""

    capacity: Vec
    committed: Vec
    labels: dict[str, str]
    drain: str
    catalog: dict[str, list[str]] | None
    confine: Mechanism
    cached: bool
    content: bool  # the order names its image by digest (CONTENT)
    layers_here: int  # of LAYERS, in a process worker's content cache
    cache_mb: int
    store_there: bool
    holds: list[tuple[str, Vec, float, bool, float | None]]  # order, want, TTL, pinned, replaced
    machine: str  # "", "placed", "reclaimed"
    want: Vec
    image: str
    constraints: dict[str, str]
    exclude: list[str]


def sometimes(value: Any, one_in: int) -> st.SearchStrategy[Any]:
    """``value`` one time in ``one_in``, else its empty value (so most workers get far)."""
    return st.sampled_from([value] + [type(value)()] * (one_in - 1))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    capacity = (
        draw(st.integers(2, 8)) * 1000,
        draw(st.integers(16, 64)) * 64,
        draw(st.sampled_from([0, 100])),
        draw(st.sampled_from([0, 1])),
        0,
    )
    hold_ = st.tuples(
        st.sampled_from(ORDER_IDS),
        amounts(4, 2048),
        st.sampled_from([-0.5, 0.0, 0.5, 0.5]),  # its TTL against now: expired, just, live
        st.sampled_from([False, False, False, True]),  # being committed
        st.sampled_from([None, None, -0.5, 0.5]),  # the TTL of a replaced hold it carries
    )
    labels = st.dictionaries(st.sampled_from(["disk", "zone"]), st.sampled_from("ab"))
    return Case(
        capacity=capacity,
        committed=draw(st.one_of(st.just(ZERO), amounts(4, 2048))),
        labels=draw(labels),
        drain=draw(st.one_of(sometimes("configured", 8), sometimes("store: disk full", 8))),
        catalog=draw(st.sampled_from([None, None, {"web": ["x"]}, {"web": []}, {"db": ["x"]}])),
        confine=draw(st.sampled_from(["none", "rlimit"])),
        cached=draw(st.booleans()),
        content=draw(st.sampled_from([False, True, True])),
        layers_here=draw(st.integers(0, 3)),
        cache_mb=draw(st.sampled_from([2, 4, 5, 100])),
        store_there=draw(st.sampled_from([True, True, False])),
        holds=draw(st.lists(hold_, max_size=3)),
        machine=draw(st.one_of(sometimes("placed", 10), sometimes("reclaimed", 10))),
        want=draw(amounts(4, 1024, least=1)),
        image=draw(st.sampled_from(["web", "web", "db"])),
        constraints=draw(st.one_of(st.just({}), labels)),
        exclude=draw(st.sampled_from([[], [], ["w0"], [WID]])),
    )


def build(store: Store, c: Case) -> Worker:
    cpus, memory_mb, disk_mb, gpus, _ = c.capacity
    w = worker(
        store,
        Amount(cpus=cpus // 1000, memory_mb=memory_mb, disk_mb=disk_mb, gpus=gpus),
        labels=c.labels,
        catalog=c.catalog,
        confine=c.confine,
        images=("web",) if c.cached else (),
        cache_mb=c.cache_mb,
        store_there=c.store_there,
    )
    if c.catalog is not None:
        holding(w, c.layers_here)
    if c.drain:
        w.set_draining(c.drain)
    w.ledger.load_committed(c.committed)
    for oid, want, ttl, pinned, replaced_ttl in c.holds:
        replaced = None
        if replaced_ttl is not None:
            replaced = Hold(oid, want, NOW + replaced_ttl, 0.5, {}, False, f"r-{oid}")
        h = Hold(oid, want, NOW + ttl, 0.5, {}, False, f"a-{oid}", replaced)
        if w.ledger.hold(h):  # only what fits (I1)
            h.committing = pinned
    if c.machine:
        placed(w)
    if c.machine == "reclaimed":
        w.reclaims.orders.add("o1")
    return w


def the_order(c: Case) -> dict[str, Any]:
    """The order's fields, as a Bid and an ExplainRequest both carry them."""
    return {
        "order_id": "o1",
        "region": "mad",
        "resources": resources(c.want),
        "image": c.image,
        "constraints": c.constraints,
        "exclude_workers": c.exclude,
        **(CONTENT if c.content else {}),
    }


def hot_outcome(desk: Desk[Worker], w: Worker, c: Case) -> tuple[str, Any]:
    """What a bid gets from the worker: an offer (its price), the existing machine, a
    Waiting note (BLOCKED), or silence with its reason."""
    bid = Bid(**the_order(c), hold_ms=1000, auction_id="bid", wait_ms=1000)
    ans = desk.answer(bid, "inbox", NOW, BidGroup([w]))
    if not ans.replies:
        return "silent", ans.silent[WID]
    [send] = ans.replies
    if isinstance(send.reply, Waiting):
        return "silent", BLOCKED
    assert isinstance(send.reply, Offer)
    if send.reply.machine_id:
        return "existing", send.reply.machine_id
    return "offer", (send.reply.score, send.reply.subscores, send.reply.image_cached)


def explained(v: WorkerVerdict) -> tuple[str, Any]:
    """The same outcome, as the explanation tells it."""
    if v.verdict == "existing":
        return "existing", v.machine_id
    if v.verdict == "offer":
        return "offer", (v.score, v.subscores, v.image_cached)
    return "silent", v.reasons[0].code


@settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(c=cases())
def test_a_bid_is_offered_exactly_when_explained_so_for_the_same_first_reason(
    store: Store, c: Case
) -> None:
    w = build(store, c)
    desk: Desk[Worker] = Desk()
    [verdict] = desk.explain(ExplainRequest(**the_order(c)), NOW, [w])  # first: it reads only
    assert hot_outcome(desk, w, c) == explained(verdict)


# (--tenant-images, the worker's driver, what its machines have of their own) -> refused?
@pytest.mark.parametrize(
    ("policy", "driver", "isolation", "refused"),
    [
        ("isolated", "process", "users,network", False),
        ("isolated", "oci", "users,network", False),
        ("isolated", "process", "users", True),  # no network of its own: ports squattable
        ("isolated", "oci", "none", True),  # a supplier that is not root
        ("isolated", "sim", "none", False),  # nothing runs
        ("oci-only", "oci", "users,network", False),
        ("oci-only", "process", "users,network", True),
        ("oci-only", "oci", "users", True),
        ("allow", "process", "none", False),
        ("allow", "oci", "none", False),
    ],
)
def test_a_tenants_order_runs_only_where_the_policy_lets_it(
    policy: str, driver: str, isolation: str, refused: bool
) -> None:
    why = tenant_refusal(policy, driver, isolation)
    assert bool(why) == refused
    if refused:
        assert why.startswith("a tenant's order: ") and policy in why
