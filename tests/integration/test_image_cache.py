"""A worker's image cache on a real nats-server with JetStream: concurrent pulls share each
layer's one fetch (and its failure), a cancelled pull leaves nothing, a restart rebuilds the
cache from disk and discards what a crash left half made, the budget holds with pinned
images kept, and a layer changed on disk since its fetch never reaches a root (I7)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from bourse.images import (
    CacheFull,
    Descriptor,
    DigestMismatch,
    ImageCache,
    ImageStore,
    Limits,
    RunSpec,
)
from bourse.images.build import documents, write_layer
from bourse.images.importer import Blob
from bourse.images.oci import MAX_DOCUMENT_BYTES, decode_manifest
from tests.market import Market

RUN = RunSpec(cmd=("/bin/sh",), architecture="amd64")


class Counting:
    """The real store, with the layer fetches it was asked for counted."""

    def __init__(self, store: ImageStore) -> None:
        self.store = store
        self.fetches: Counter[str] = Counter()

    async def read_blob(self, digest: str, max_bytes: int = MAX_DOCUMENT_BYTES) -> bytes:
        return await self.store.read_blob(digest, max_bytes)

    async def unpacked_size(self, digest: str) -> int | None:
        return await self.store.unpacked_size(digest)

    async def fetch_blob(
        self,
        descriptor: Descriptor,
        dest: Path,
        *,
        tmp_dir: Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.fetches[descriptor.digest] += 1
        await self.store.fetch_blob(descriptor, dest, tmp_dir=tmp_dir, timeout_s=timeout_s)


@pytest.fixture
async def store(market: Market) -> AsyncIterator[ImageStore]:
    yield await ImageStore.open(await market.connect("images"), market.subjects.prefix)


def tree(top: Path, **files: bytes) -> Path:
    for name, data in files.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_bytes(data)
    return top


async def push_layers(store: ImageStore, ref: str, *dirs: Path) -> tuple[str, list[Descriptor]]:
    """An image of one layer per directory, stored and tagged: its digest and layers."""
    layers = []
    for directory in dirs:
        path = directory.with_suffix(".layer")
        with path.open("wb") as out:
            layer = write_layer(directory, out)
        await store.put_blob(Blob(layer.descriptor, open=lambda p=path: p.open("rb")))
        layers.append(layer)
    docs = documents(layers, RUN)
    await store.put_blob(Blob(decode_manifest(docs.manifest, "m").config, docs.config))
    await store.put_blob(Blob(docs.descriptor, docs.manifest))
    await store.set_tag(ref, docs.descriptor.digest)
    return docs.descriptor.digest, [layer.descriptor for layer in layers]


@pytest.fixture
async def two_images(
    store: ImageStore, tmp_path: Path
) -> tuple[tuple[str, list[Descriptor]], tuple[str, list[Descriptor]]]:
    """Images a and b on a shared base layer; a's top layer whites out the base's old/."""
    base = tree(tmp_path / "base", **{"bin/tool": os.urandom(300_000), "old/f": b"o", "conf": b"0"})
    top_a = tree(tmp_path / "top-a", **{"conf": b"a", ".wh.old": b""})
    top_b = tree(tmp_path / "top-b", **{"conf": b"b"})
    return await push_layers(store, "a", base, top_a), await push_layers(store, "b", base, top_b)


async def test_concurrent_pulls_share_each_layers_one_fetch(
    store: ImageStore, tmp_path: Path, two_images: tuple[tuple[str, list[Descriptor]], ...]
) -> None:
    (a, a_layers), (b, b_layers) = two_images
    source = Counting(store)
    cache = ImageCache.open(tmp_path / "cache", source, Limits(budget_bytes=1 << 30))
    distinct = {x.digest: x.size for x in a_layers + b_layers}
    assert cache.lacking(a_layers + b_layers) == sum(distinct.values())  # the base once
    roots: dict[str, list[Path]] = {a: [], b: []}

    async def pull(manifest: str) -> None:
        roots[manifest].append(await cache.prepare(manifest))

    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(pull, a)
            tg.start_soon(pull, b)
    assert source.fetches == Counter(distinct.keys())  # each layer fetched once
    assert {len(set(paths)) for paths in roots.values()} == {1}
    root_a, root_b = roots[a][0], roots[b][0]
    assert (root_a / "conf").read_bytes() == b"a" and not (root_a / "old").exists()
    assert (root_b / "conf").read_bytes() == b"b" and (root_b / "old/f").exists()
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.pulls, stats.images) == (0, 12, 3, 2)
    assert stats.pulled_bytes == sum(distinct.values())
    assert cache.lacking(a_layers) == cache.lacking(b_layers, b) == 0
    assert await cache.prepare(a) == root_a and cache.stats().hits == 1


class Gated(Counting):
    """The real store, each layer fetch held until ``go`` is set (``asked`` says one is)."""

    def __init__(self, store: ImageStore) -> None:
        super().__init__(store)
        self.asked, self.go = anyio.Event(), anyio.Event()

    async def fetch_blob(
        self,
        descriptor: Descriptor,
        dest: Path,
        *,
        tmp_dir: Path | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.asked.set()
        await self.go.wait()
        await super().fetch_blob(descriptor, dest, tmp_dir=tmp_dir, timeout_s=timeout_s)


async def test_a_pull_under_way_is_not_priced_again(
    store: ImageStore, tmp_path: Path, two_images: tuple[tuple[str, list[Descriptor]], ...]
) -> None:
    """A start that would share a fetch under way adds no bytes of it (what a bid prices)."""
    (a, a_layers), (b, b_layers) = two_images
    source = Gated(store)
    cache = ImageCache.open(tmp_path / "cache", source, Limits(budget_bytes=1 << 30))
    async with anyio.create_task_group() as tg:
        tg.start_soon(cache.prepare, a)
        await source.asked.wait()  # a's first layer (the shared base) is being fetched
        assert cache.lacking(a_layers, a) == 0  # its root is being made
        base, top_b = b_layers
        assert cache.lacking(b_layers, b) == top_b.size  # the base comes with a's pull
        source.go.set()
    assert cache.lacking(b_layers, b) == top_b.size and base.digest in source.fetches


async def test_concurrent_pulls_share_a_failed_fetch_and_keep_nothing_of_it(
    store: ImageStore, tmp_path: Path, two_images: tuple[tuple[str, list[Descriptor]], ...]
) -> None:
    (a, a_layers), _ = two_images
    top = a_layers[1]
    await store.objects.put(top.digest, os.urandom(top.size))  # the bucket holds other bytes
    source = Counting(store)
    cache = ImageCache.open(tmp_path / "cache", source, Limits(budget_bytes=1 << 30))
    outcomes: list[BaseException] = []

    async def pull() -> None:
        try:
            await cache.prepare(a)
        except DigestMismatch as exc:
            outcomes.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(pull)
    assert [getattr(e, "digest", None) for e in outcomes] == [top.digest] * 4
    assert source.fetches[top.digest] == 1  # the waiters shared the one failure
    assert cache.root(a) is None and list(cache.tmp.iterdir()) == []
    assert cache.lacking(a_layers) == top.size  # the base was fetched; the top was not kept


async def test_a_cancelled_pull_leaves_no_file_and_the_next_one_fetches_again(
    store: ImageStore, tmp_path: Path
) -> None:
    manifest, (layer,) = await push_layers(store, "s", tree(tmp_path / "l", f=os.urandom(200_000)))
    info = await store.objects.get_info(layer.digest)
    # the chunks go, the object's record stays: the fetch waits until it is cancelled
    await store.js.purge_stream(f"OBJ_{store.bucket}", subject=f"$O.{store.bucket}.C.{info.nuid}")
    source = Counting(store)
    cache = ImageCache.open(tmp_path / "cache", source, Limits(budget_bytes=1 << 30))
    for attempt in (1, 2):
        with anyio.move_on_after(0.3) as scope:
            await cache.prepare(manifest)
        assert scope.cancelled_caught
        assert source.fetches[layer.digest] == attempt  # not stuck behind the cancelled one
        assert list(cache.tmp.iterdir()) == [] and cache.root(manifest) is None


async def test_a_restart_rebuilds_the_cache_and_discards_what_a_crash_left(
    store: ImageStore, tmp_path: Path, two_images: tuple[tuple[str, list[Descriptor]], ...]
) -> None:
    (a, a_layers), _ = two_images
    limits = Limits(budget_bytes=1 << 30)
    cache = ImageCache.open(tmp_path / "cache", Counting(store), limits)
    root = await cache.prepare(a)
    used = cache.stats().used_bytes
    # what a kill -9 may leave: a half-written fetch, a half-made root (read-only parts
    # included), a root whose record was never written, a record without its root
    (cache.tmp / f"{a_layers[0].hex}.1234abcd.part").write_bytes(b"half a layer")
    half = tree(cache.tmp / "root-x", **{"ro/file": b"x"})
    (half / "ro").chmod(0o555)
    tree(cache.root_dir / ("f" * 64), file=b"no record")
    (cache.root_dir / f"{'e' * 64}.json").write_bytes(b"{}")
    (cache.root_dir / f"{'d' * 64}.files").write_bytes(b"an inventory without its root")
    tree(cache.blob_dir, **{"not-a-digest": b"?"})

    source = Counting(store)
    again = ImageCache.open(tmp_path / "cache", source, limits)
    assert list(again.tmp.iterdir()) == []
    kept = [root.name, f"{root.name}.files", f"{root.name}.json"]
    assert sorted(p.name for p in again.root_dir.iterdir()) == kept
    assert sorted(p.name for p in again.blob_dir.iterdir()) == sorted(x.hex for x in a_layers)
    assert (again.stats().used_bytes, again.stats().images) == (used, 1)
    assert await again.prepare(a) == root
    assert (again.stats().hits, source.fetches) == (1, Counter())


async def test_a_pull_says_what_it_fetched_and_what_the_image_runs(
    store: ImageStore, tmp_path: Path, two_images: tuple[tuple[str, list[Descriptor]], ...]
) -> None:
    (a, a_layers), (b, b_layers) = two_images
    limits = Limits(budget_bytes=1 << 30)
    cache = ImageCache.open(tmp_path / "cache", store, limits)
    first = await cache.pull(a)
    assert (first.root, first.bytes) == (cache.root(a), sum(x.size for x in a_layers))
    assert first.run == RUN.run_config() and first.seconds > 0
    assert (await cache.pull(a)).bytes == 0  # held: nothing fetched
    assert (await cache.pull(b)).bytes == b_layers[1].size  # the shared base is here
    assert cache.images() == sorted([a, b])
    again = ImageCache.open(tmp_path / "cache", store, limits)  # a restart keeps what it runs
    assert ((await again.pull(a)).run, (await again.pull(a)).bytes) == (first.run, 0)


async def test_the_budget_holds_and_a_pinned_image_is_never_evicted(
    store: ImageStore, tmp_path: Path
) -> None:
    images = [
        await push_layers(store, name, tree(tmp_path / name, f=os.urandom(400_000)))
        for name in ("a", "b", "c")
    ]
    (a, _), (b, _), (c, _) = images
    now = [1_000_000.0]
    probe = ImageCache.open(tmp_path / "probe", store, Limits(budget_bytes=1 << 30))
    await probe.prepare(a)
    held = probe.stats().used_bytes  # one image: its layer and its root
    # room for two images: a third past the high watermark needs an eviction
    limits = Limits(budget_bytes=int(held * 2.6), delay_s=180)
    cache = ImageCache.open(tmp_path / "cache", store, limits, clock=lambda: now[0])
    await cache.prepare(a)
    cache.pin(a)  # a machine runs it
    now[0] += 10
    await cache.prepare(b)
    now[0] += 90  # b was used 90 s ago: within the delay, and a is pinned
    with pytest.raises(CacheFull, match="does not fit: the cache holds"):
        await cache.prepare(c)
    assert cache.stats().evictions == 0
    now[0] += 210  # past b's delay: b goes (its layer and its root), a stays
    await cache.prepare(c)
    assert (cache.root(a), cache.root(b)) == (cache.root_dir / a[7:], None)
    assert not any(p.name.startswith(b[7:]) for p in cache.root_dir.iterdir())  # its files too
    stats = cache.stats()
    assert stats.evictions == 2 and stats.used_bytes <= limits.budget_bytes


async def test_a_layer_changed_on_disk_since_its_fetch_never_reaches_a_root(
    store: ImageStore, tmp_path: Path, two_images: tuple[tuple[str, list[Descriptor]], ...]
) -> None:
    (a, a_layers), (b, _) = two_images
    source = Counting(store)
    cache = ImageCache.open(tmp_path / "cache", source, Limits(budget_bytes=1 << 30))
    await cache.prepare(a)
    base = cache.blob_dir / a_layers[0].hex
    data = bytearray(base.read_bytes())
    data[100] ^= 0xFF
    base.write_bytes(bytes(data))  # same size, other bytes: disk rot, or a hand
    with pytest.raises(DigestMismatch, match="the layer file holds sha256:") as caught:
        await cache.prepare(b)  # b shares the base: it is unpacked from the file on disk
    assert caught.value.digest == a_layers[0].digest
    assert cache.root(b) is None and list(cache.tmp.iterdir()) == []
    assert not base.exists()  # dropped: the next pull fetches it again
    root_b = await cache.prepare(b)
    assert source.fetches[a_layers[0].digest] == 2
    assert (root_b / "conf").read_bytes() == b"b"
