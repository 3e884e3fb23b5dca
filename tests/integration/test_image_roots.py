"""Image roots are verified content (issue 36, item 2), on a real nats-server with the
image store in it: a root's inventory is written as it is unpacked; a root changed
afterwards (a file rewritten, one added, one chmod'ed) is caught by the scrub and by a
supplier adopting it at its start, removed, announced (``image_tampered``) and made again
from its layers at its next use; bytes changed below the filesystem are the scrub's to
find; and a start from a root already here hashes nothing (counted, not timed)."""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from bourse.images import ImageCache, ImageStore, Limits, RunSpec
from bourse.images.cachetypes import RootRecord, Tampered
from bourse.images.inventory import FILE, STEP_BYTES, Inventory, decode, digest_of, encode
from bourse.wire.codec import decode as decode_wire
from bourse.wire.messages import Event
from supplier.scrub import TAMPERED, Scrubbing
from tests.images import place, tree
from tests.integration.test_image_cache import Counting
from tests.market import Market, collect, wait_until, worker

INDEX = b"<h1>bob's page</h1>\n"
FILES = {
    "www/index.html": INDEX,
    "bin/tool": b"#!/bin/sh\necho tool\n",
    "data/blob": os.urandom(2 * STEP_BYTES + 1000),
}


@pytest.fixture
async def store(market: Market) -> AsyncIterator[ImageStore]:
    await market.jetstream_init()
    yield await ImageStore.open(await market.connect("images"), market.subjects.prefix)


@pytest.fixture
async def image(store: ImageStore, tmp_path: Path) -> str:
    pushed = await store.push_directory(
        tree(tmp_path / "site", **FILES), "site:v1", RunSpec(cmd=("/bin/sh",))
    )
    return pushed.digest


async def _unpaced(read: int) -> None:
    """A scrub at full speed (the tests' own pace)."""


def _record(cache: ImageCache, manifest: str) -> RootRecord:
    path = cache.root_dir / f"{manifest.removeprefix('sha256:')}.json"
    return msgspec.json.decode(path.read_bytes(), type=RootRecord)


async def test_a_root_is_inventoried_as_its_layers_wrote_it_and_reads_back_clean(
    store: ImageStore, image: str, tmp_path: Path
) -> None:
    cache = ImageCache.open(tmp_path / "cache", store, Limits(budget_bytes=1 << 30))
    root = await cache.prepare(image)
    stored = root.with_name(f"{root.name}.files")
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600  # the supplier's alone
    assert _record(cache, image).files == digest_of(stored.read_bytes())
    inventory = decode(stored.read_bytes(), "here")
    digests = {e.path.decode(): e.sha256 for e in inventory.entries if e.kind == FILE}
    assert digests == {name: hashlib.sha256(data).hexdigest() for name, data in FILES.items()}
    paced: list[int] = []

    async def pace(read: int) -> None:
        paced.append(read)

    assert await cache.checks.check(image, pace) == ""
    assert sum(paced) == cache.stats().scrubbed_bytes == sum(map(len, FILES.values()))
    assert len(paced) >= 3 and max(paced) <= STEP_BYTES  # paced in bounded steps
    assert cache.checks.take_found() == [] and cache.root(image) == root


def _rewrite(root: Path) -> str:
    (root / "www/index.html").write_bytes(INDEX.replace(b"bob", b"eve"))  # the same size
    return "/www/index.html: changed since it was unpacked"


def _add(root: Path) -> str:
    (root / "www/admin.html").write_bytes(b"TAMPERED")
    return "/www/admin.html: not in the image"


def _chmod(root: Path) -> str:
    (root / "bin/tool").chmod(0o4777)
    return "/bin/tool: mode 0644 is now 4777"


TAMPERINGS = {"rewrite": _rewrite, "add": _add, "chmod": _chmod}


@pytest.mark.parametrize("found", ["scrub", "adopted"])
@pytest.mark.parametrize("how", sorted(TAMPERINGS))
async def test_a_tampered_root_is_caught_removed_and_made_again_from_its_layers(
    store: ImageStore, image: str, tmp_path: Path, how: str, found: str
) -> None:
    source = Counting(store)
    cache = ImageCache.open(tmp_path / "cache", source, Limits(budget_bytes=1 << 30))
    root = await cache.prepare(image)
    said = TAMPERINGS[how](root)
    if found == "scrub":
        why = await cache.checks.check(image, _unpaced)
    else:  # a supplier starting again on this cache
        cache = ImageCache.open(tmp_path / "cache", source, Limits(budget_bytes=1 << 30))
        why = cache.checks.take_found()[0].why if cache.checks.found else ""
    assert said in why, why
    assert cache.root(image) is None and not root.exists()
    assert sorted(p.name for p in cache.root_dir.iterdir()) == []  # record, inventory too
    if found == "scrub":
        assert cache.checks.take_found() == [Tampered(image, why, "scrub")]
    assert cache.stats().tampered == 1
    fetched = Counter(source.fetches)
    again = await cache.prepare(image)  # its next use: unpacked again from the layers here
    assert source.fetches == fetched
    assert (again / "www/index.html").read_bytes() == INDEX
    assert not (again / "www/admin.html").exists()
    assert stat.S_IMODE((again / "bin/tool").stat().st_mode) == 0o644
    assert await cache.checks.check(image, _unpaced) == ""


async def test_bytes_changed_below_the_filesystem_pass_adoption_and_the_scrub_finds_them(
    store: ImageStore, image: str, tmp_path: Path
) -> None:
    """A disk that rots changes bytes without a change time: as if the inventory had said
    other bytes for index.html (and the record named that inventory)."""
    cache = ImageCache.open(tmp_path / "cache", store, Limits(budget_bytes=1 << 30))
    root = await cache.prepare(image)
    stored = root.with_name(f"{root.name}.files")
    inventory = decode(stored.read_bytes(), "here")
    rotten = Inventory(
        [
            msgspec.structs.replace(e, sha256="0" * 64) if e.path == b"www/index.html" else e
            for e in inventory.entries
        ]
    )
    stored.write_bytes(encode(rotten))
    record = msgspec.structs.replace(_record(cache, image), files=digest_of(stored.read_bytes()))
    root.with_name(f"{root.name}.json").write_bytes(msgspec.json.encode(record))

    cache = ImageCache.open(tmp_path / "cache", store, Limits(budget_bytes=1 << 30))
    assert cache.root(image) == root and cache.checks.found == []  # the walk sees nothing
    assert (
        await cache.checks.check(image, _unpaced)
        == "/www/index.html: its bytes are not the image's"
    )
    assert cache.root(image) is None


@pytest.fixture
def hashing(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Every hashlib call from now on, counted by the module that made it."""
    calls: Counter[str] = Counter()

    def counting(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[sys._getframe(1).f_globals.get("__name__", "?")] += 1
            return original(*args, **kwargs)

        return call

    for name in ("sha256", "file_digest", "new"):
        monkeypatch.setattr(hashlib, name, counting(getattr(hashlib, name)))
    yield calls


async def test_a_pull_of_a_root_already_here_hashes_nothing(
    store: ImageStore, image: str, tmp_path: Path, hashing: Counter[str]
) -> None:
    cache = ImageCache.open(tmp_path / "cache", store, Limits(budget_bytes=1 << 30))
    await cache.prepare(image)
    assert hashing["bourse.images.unpack"] > 0  # the making of it does hash: the count works
    hashing.clear()
    for _ in range(5):
        assert (await cache.pull(image)).bytes == 0
    assert hashing == Counter()


PROGRAM = 'import pathlib; print("page:", pathlib.Path("www/index.html").read_text().strip())\n'


async def test_a_worker_announces_a_tampered_root_and_runs_the_image_again_untouched(
    market: Market, store: ImageStore, tmp_path: Path, hashing: Counter[str]
) -> None:
    """A process worker: its start from a root already here hashes nothing; a supplier
    that starts on a root changed while it was down, and its scrub (a task of the
    supplier) on a root changed while it runs, find it and say so; each next start makes
    the root again and runs bob's page."""
    files = {**FILES, "app.py": PROGRAM.encode()}
    await store.push_directory(
        tree(tmp_path / "app", **files), "app:v1", RunSpec(cmd=("python3", "app.py"))
    )
    info = await store.inspect("app:v1")
    data_dir = tmp_path / "supplier"
    w1 = worker("w1", driver="process")
    # no scrub round falls in the first supplier's life: what hashes then is the start's
    host = await market.host(w1, data_dir=data_dir, scrubbing=Scrubbing(every_s=3600))
    buyer = await market.client(direct=True)
    seen = await collect(buyer.nc, market.subjects.events())

    def events(kind: str) -> list[Event]:
        return [e for m in seen if (e := decode_wire(m.data, Event)).kind == kind]

    async def run_once() -> list[str]:
        """The machine started, to its end: its output."""
        ended = len(events("stopped"))
        await buyer.machine("start", placed.machine_id)
        await wait_until(lambda: len(events("stopped")) > ended)
        return (await buyer.logs(placed.machine_id)).lines

    placed = await place(buyer.nc, market.subjects, info, "o1", image="app:v1")
    cache = host.workers["w1"].images.content
    assert cache is not None
    await wait_until(lambda: cache.root(info.digest) is not None)  # the background pull
    root = cache.root_dir / info.digest.removeprefix("sha256:")
    hashing.clear()
    assert (await run_once())[-1] == "page: <h1>bob's page</h1>"
    assert not [m for m in hashing if m.startswith(("bourse.images", "supplier"))], hashing

    await market.stop(host)
    _add(root)
    host = await market.host(w1, data_dir=data_dir, scrubbing=Scrubbing(1 << 30, every_s=0.2))
    await wait_until(lambda: len(events(TAMPERED)) == 1)
    [adopted] = events(TAMPERED)
    assert (adopted.worker_id, adopted.image_digest) == ("w1", info.digest)
    assert adopted.detail.startswith("adopted: ") and "/www/admin.html: not in the image" in (
        adopted.detail
    )
    assert not root.exists()
    assert (await run_once())[-1] == "page: <h1>bob's page</h1>"

    _rewrite(root)
    await wait_until(lambda: len(events(TAMPERED)) == 2, timeout_s=10)
    scrubbed = events(TAMPERED)[1]
    assert scrubbed.detail.startswith("scrub: /www/index.html: changed since it was unpacked")
    lines = await run_once()
    assert lines[-1] == "page: <h1>bob's page</h1>" and "eve" not in "".join(lines)
