"""A worker's images (supplier/images.py) as a bid meets them: a content image is priced by
the bytes of its layers the worker lacks over its pull throughput, a worker that could
never hold it declines (``image_too_big``), one without a store to pull from cannot run it
(``image_not_runnable``), a catalog image keeps its cached-or-not term.

Real workers (a real temp store, a content cache in a temp dir whose layer files are
sparse files of the layers' sizes, as a restart finds them), the desk on a fake clock, no
NATS. Pricing is the default: score = 0.7 * utility + 0.3 * image, image_half_s 10 s, and
the pull throughput before any pull is 50 MiB/s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from bourse.images.cachetypes import RootRecord
from bourse.images.inventory import digest_of, encode, take
from bourse.wire.messages import Bid, ExplainRequest, Layer, Machine, Offer, Resources
from supplier.candidates import BidGroup
from supplier.config import WorkerConfig
from supplier.desk import IMAGE_NOT_CACHED, Desk
from supplier.feasible import CANNOT_RUN, IMAGE_TOO_BIG
from supplier.images import MIB, StoreSource
from supplier.machines.host.confine import Confiner
from supplier.machines.process import ProcessKind
from supplier.machines.runner import Runner
from supplier.pricing import image_term
from supplier.store import Store
from supplier.worker import Worker

DIGEST = "sha256:" + "ab" * 32
LAYERS = [Layer(digest=f"sha256:{i:064x}", size=10 * MIB) for i in range(1, 11)]
RATE = 50 * MIB  # bytes/s before any pull measured one (bourse/images/policy.py)


def source(available: bool = True) -> StoreSource:
    """The market's store as the host's start-up found it (JetStream there or not); nothing
    is pulled in these tests."""
    s = StoreSource()
    s.available = available
    return s


def process_worker(
    store: Store,
    wid: str,
    *,
    here: Sequence[Layer] = (),
    root: str = "",
    cache_mb: int = 1024,
    store_there: bool = True,
) -> Worker:
    """A process worker whose content cache holds the layers ``here`` (and the root of
    ``root``) when it opens."""
    top = store.path.parent / "images" / wid
    blobs = top / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    for layer in here:
        with (blobs / layer.digest.removeprefix("sha256:")).open("wb") as f:
            f.truncate(layer.size)
    if root:
        roots, name = top / "roots", root.removeprefix("sha256:")
        (roots / name).mkdir(parents=True)
        files = encode(take(roots / name, {}).inventory)  # an empty root, as unpacked
        (roots / f"{name}.files").write_bytes(files)
        layers = [x.digest for x in here]
        record = RootRecord(manifest=root, layers=layers, size=0, files=digest_of(files))
        (roots / f"{name}.json").write_bytes(msgspec.json.encode(record))
    cfg = WorkerConfig(
        worker_id=wid,
        region="mad",
        capacity=msgspec.convert({"cpus": 8, "memory_mb": 8192}, Resources),
        image_cache_mb=cache_mb,
    )
    top, confiner = store.path.parent, Confiner("none", wid)
    kind = ProcessKind(confiner, {}, top / "work" / wid)
    driver = Runner(kind, confiner, top / "logs" / wid, top / "shims" / wid)
    return Worker(cfg, store, lambda e: None, driver=driver, source=source(store_there))


def order(**kw: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "order_id": "o1",
        "region": "mad",
        "resources": Resources(cpus=2, memory_mb=2048),
        "image": "app",
        "image_digest": DIGEST,
        "layers": LAYERS,
    }
    fields.update(kw)
    return fields


def offers(*workers: Worker, **kw: Any) -> list[Offer]:
    """What one process of these workers offers a bid for the order, best first."""
    desk: Desk[Worker] = Desk(max_offers=0)
    bid = Bid(**order(**kw), hold_ms=1000, auction_id="a1")
    ans = desk.answer(bid, "inbox", time.monotonic(), BidGroup(list(workers)))
    return [s.reply for s in ans.replies if isinstance(s.reply, Offer)]


def test_a_worker_with_nine_of_ten_layers_beats_one_with_none(store: Store) -> None:
    none = process_worker(store, "w-none")
    nine = process_worker(store, "w-nine", here=LAYERS[:9])
    best, other = offers(none, nine)
    assert (best.worker_id, other.worker_id) == ("w-nine", "w-none")
    # utility 0.75 on both (8 CPUs / 8 GiB, 2 / 2 GiB asked: f = 1 - 0.25)
    # nine: 10 MiB to pull at 50 MiB/s = 0.2 s; none: 100 MiB = 2 s
    assert best.subscores["pull_bytes"] == 10 * MIB
    assert best.subscores["pull_s"] == 0.2
    assert best.subscores["image"] == round(image_term(0.2), 6)
    assert best.score == round(0.7 * 0.75 + 0.3 * image_term(0.2), 6)
    assert (other.subscores["pull_bytes"], other.subscores["pull_s"]) == (100 * MIB, 2.0)
    assert other.score == round(0.7 * 0.75 + 0.3 * image_term(2.0), 6)
    assert not best.image_cached and not other.image_cached


def test_shared_layers_count_once_and_a_held_image_costs_nothing(store: Store) -> None:
    twice = [*LAYERS[:2], LAYERS[0]]  # a layer listed twice is pulled once
    [offer] = offers(process_worker(store, "w1", here=LAYERS[:1]), layers=twice)
    assert offer.subscores["pull_bytes"] == 10 * MIB
    held = process_worker(store, "w2", here=LAYERS, root=DIGEST)
    [offer] = offers(held)
    assert offer.image_cached and offer.subscores["image"] == 1.0
    assert (offer.subscores["pull_bytes"], offer.subscores["pull_s"]) == (0.0, 0.0)
    assert offer.score == round(0.7 * 0.75 + 0.3, 6)  # as a cached catalog image


def test_an_explanation_says_the_bytes_and_seconds_of_the_pull(store: Store) -> None:
    w = process_worker(store, "w1", here=LAYERS[:5])
    [v] = Desk[Worker]().explain(ExplainRequest(**order()), time.monotonic(), [w])
    [note] = v.reasons
    term = image_term(1.0)  # 50 MiB at 50 MiB/s
    forgone = round(0.3 * (1 - term), 6)
    assert v.verdict == "offer" and note.code == IMAGE_NOT_CACHED and note.cost == forgone
    assert note.detail == (
        f"image 'app' lacks {50 * MIB} bytes here (a pull of about 1 s): the image term costs "
        f"{forgone:g} (score {v.score:g}, {round(v.score + forgone, 6):g} if cached)"
    )


def test_an_image_that_could_never_fit_the_cache_is_declined(store: Store) -> None:
    # a pull adds the layers lacking and the root (counted at the layers' size): 200 MiB
    # without any layer, 110 MiB with nine of them, against a budget of 150 MiB
    empty = process_worker(store, "w-empty", cache_mb=150)
    nine = process_worker(store, "w-nine", here=LAYERS[:9], cache_mb=150)
    assert [o.worker_id for o in offers(empty, nine)] == ["w-nine"]
    [v] = Desk[Worker]().explain(ExplainRequest(**order()), time.monotonic(), [empty])
    assert v.verdict == "decline"
    assert [(r.code, r.detail) for r in v.reasons] == [
        (
            IMAGE_TOO_BIG,
            f"image 'app' needs {200 * MIB} bytes in the image cache here, more than its whole "
            f"budget of {150 * MIB} bytes",
        )
    ]
    held = process_worker(store, "w-held", here=LAYERS, root=DIGEST, cache_mb=150)
    assert held.image_too_big(ExplainRequest(**order())) == ""  # here already: it fits


def test_without_a_store_a_content_image_runs_only_where_it_is_held(store: Store) -> None:
    bare = process_worker(store, "w-bare", store_there=False)
    held = process_worker(store, "w-held", here=LAYERS, root=DIGEST, store_there=False)
    assert [o.worker_id for o in offers(bare, held)] == ["w-held"]
    [v] = Desk[Worker]().explain(ExplainRequest(**order()), time.monotonic(), [bare])
    assert [(r.code, r.detail) for r in v.reasons] == [
        (CANNOT_RUN, f"no image store here to pull image 'app' ({DIGEST}) from (no JetStream)")
    ]
    # a catalog image is the driver's business: this worker's catalog is empty
    assert bare.unrunnable(ExplainRequest(**order(image="web", image_digest="", layers=[])))
    assert offers(bare, image="web", image_digest="", layers=[]) == []


def test_a_sim_worker_models_a_content_image_by_its_layers(store: Store) -> None:
    cfg = WorkerConfig(
        worker_id="s1",
        region="mad",
        capacity=msgspec.convert({"cpus": 8, "memory_mb": 8192}, Resources),
        pull_mb_per_s=50,
        image_cache_mb=150,
    )
    w = Worker(cfg, store, lambda e: None)
    [offer] = offers(w, layers=LAYERS[:5])
    assert (offer.subscores["pull_bytes"], offer.subscores["pull_s"]) == (50 * MIB, 1.0)
    assert w.images.size_mb(DIGEST) == 50  # learned: a start's simulated pull takes 1 s
    # its cache holds no unpacked roots: 100 MiB of layers (a layer listed twice once) fit
    # its 150 MiB, 200 MiB do not
    assert w.image_too_big(ExplainRequest(**order(layers=LAYERS * 2))) == ""
    big = [Layer(digest=x.digest, size=20 * MIB) for x in LAYERS]
    assert w.image_too_big(ExplainRequest(**order(layers=big))).startswith("image 'app' needs")
    assert offers(w, layers=big) == []


def test_a_worker_says_what_its_cache_holds(store: Store) -> None:
    w = process_worker(store, "w1", here=LAYERS[:3], root=DIGEST, cache_mb=500)
    status = w.status()
    assert (status.cache_bytes, status.cache_budget_bytes) == (30 * MIB, 500 * MIB)
    assert status.image_digests == [DIGEST] and status.images == []
    m = Machine(
        machine_id="w1~M1",
        order_id="o1",
        worker_id="w1",
        region="mad",
        state="reserved",
        resources=Resources(cpus=1, memory_mb=1),
        image="app",
        image_digest=DIGEST,
    )
    assert w.has_image(m)
    assert not w.has_image(msgspec.structs.replace(m, image_digest="sha256:" + "cd" * 32))
    assert w.sample().cache.used_bytes == 30 * MIB
