"""The image store on a real nats-server with JetStream (each test its own buckets, by its
subject prefix): push and resolve, a tag followed as it moves, blobs that do not match
their digest refused with nothing left behind, a stalled fetch bounded, gc never removing
what is tagged or in use, and a 100 MB image pushed and pulled."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import cast

import anyio
import pytest
from nats.js.kv import KeyValue

from bourse.images import (
    BadImage,
    BadReference,
    DigestMismatch,
    ImageCache,
    ImageNotFound,
    ImageStore,
    Limits,
    PullTimeout,
    Reference,
    RunSpec,
    StoreUnavailable,
)
from bourse.images.oci import Descriptor
from bourse.images.reference import tag_key
from bourse.images.tags import TagIndex
from bourse.nats.connection import connect
from bourse.nats.embedded import EmbeddedNats
from tests.market import Market

RUN = RunSpec(cmd=("/bin/app",), env=("MODE=test",), workdir="/srv", architecture="amd64")


@pytest.fixture
async def store(market: Market) -> AsyncIterator[ImageStore]:
    yield await ImageStore.open(await market.connect("images"), market.subjects.prefix)


def tree(top: Path, **files: bytes) -> Path:
    for name, data in files.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_bytes(data)
    return top


async def layer_of(store: ImageStore, ref: str) -> Descriptor:
    info = await store.inspect(ref)
    (layer,) = info.layers
    return Descriptor(media_type=layer.media_type, digest=layer.digest, size=layer.size)


async def test_a_pushed_directory_is_resolved_inspected_and_listed(
    store: ImageStore, tmp_path: Path
) -> None:
    source = tree(tmp_path / "app", **{"bin/app": b"#!/bin/sh\n", "srv/data": b"x" * 5000})
    pushed = await store.push_directory(source, "acme/web:v1", RUN)
    assert (pushed.reference, pushed.layers, pushed.reused_bytes) == ("acme/web:v1", 1, 0)
    again = await store.push_directory(source, "acme/web:v2", RUN)
    assert again.digest == pushed.digest  # deterministic: same tree, same image
    assert (again.uploaded_bytes, again.reused_bytes) == (0, pushed.size)  # nothing re-sent

    async with store.watch_tags() as index:
        assert index.resolve("acme/web:v1") == index.resolve("acme/web:v2") == pushed.digest
        assert index.resolve(f"acme/web@{pushed.digest}") == pushed.digest
        with pytest.raises(ImageNotFound, match="no image tagged acme/web:latest"):
            index.resolve("acme/web")
    assert await store.lookup("acme/web:v1") == pushed.digest

    info = await store.inspect("acme/web:v1")
    assert (info.digest, info.size, info.platform) == (pushed.digest, pushed.size, "linux/amd64")
    assert (info.cmd, info.env, info.workdir, info.entrypoint) == (
        ("/bin/app",),
        ("MODE=test",),
        "/srv",
        (),
    )
    assert [row.reference for row in await store.ls()] == ["acme/web:v1", "acme/web:v2"]
    # nothing expires by age: blobs go by gc, tags by remove_tag
    assert not (await store.objects.status()).ttl and not (await store.tags.status()).ttl
    assert {(row.digest, row.size) for row in await store.ls()} == {(pushed.digest, pushed.size)}


async def test_the_tag_index_follows_a_tag_as_it_moves_and_goes(
    store: ImageStore, tmp_path: Path
) -> None:
    first = await store.push_directory(tree(tmp_path / "a", f=b"1"), "web", RUN)
    async with store.watch_tags() as index:
        assert index.resolve("web:latest") == first.digest
        second = await store.push_directory(tree(tmp_path / "b", f=b"2"), "web", RUN)
        with anyio.fail_after(5):
            await index.wait_until(lambda i: i.resolve("web") == second.digest)
        # a value someone else wrote that is no tag record: skipped, the index goes on
        await store.tags.put(tag_key(Reference.parse("junk:x")), b"not json")
        with pytest.raises(BadImage, match="tag junk:x holds no tag record"):
            await store.lookup("junk:x")
        await store.tag("web", "web:stable")
        with anyio.fail_after(5):
            await index.wait_until(lambda i: i.get(Reference.parse("web:stable")) is not None)
        assert [e.reference.tagged for e in index.entries()] == ["web:latest", "web:stable"]
        assert await store.remove_tag("web") == second.digest
        with anyio.fail_after(5):
            await index.wait_until(lambda i: i.get(Reference.parse("web")) is None)
        with pytest.raises(ImageNotFound):
            index.resolve("web")
        assert index.resolve("web:stable") == second.digest
    with pytest.raises(ImageNotFound, match="no image tagged web:latest"):
        async with store.watch_tags() as index:  # an error of the block comes out as itself
            index.resolve("web")


class _MarkerFirst:
    """The tag bucket (``kv``), whose watches say their replay is done before any entry:
    what nats-py sends when its set-up asks how many entries are left after the server
    sent them all but before they arrive (nats.py#842), made certain. The rest is the
    real watch."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def status(self) -> KeyValue.BucketStatus:
        return await self.kv.status()

    async def watchall(self) -> _Prepended:
        return _Prepended(await self.kv.watchall())


class _Prepended:
    """A watch that yields None, then what ``watcher`` yields."""

    def __init__(self, watcher: KeyValue.KeyWatcher) -> None:
        self.watcher, self.first = watcher, True

    def __aiter__(self) -> _Prepended:
        return self

    async def __anext__(self) -> KeyValue.Entry | None:
        if self.first:
            self.first = False
            return None
        return await self.watcher.__anext__()

    async def stop(self) -> None:
        await self.watcher.stop()


async def test_a_watch_starts_with_every_tag_when_the_end_of_its_replay_comes_first(
    store: ImageStore, tmp_path: Path
) -> None:
    """Started on that end marker alone, the copy would lack the tags (an ``image ls``
    listing nothing, a gc finding nothing tagged); an empty bucket's watch still starts."""
    with anyio.fail_after(5):
        async with TagIndex.watching(cast(KeyValue, _MarkerFirst(store.tags))) as index:
            assert index.entries() == []
    await store.push_directory(tree(tmp_path / "a", f=b"1"), "app:1", RUN)
    for ref in ("app:2", "app:3"):
        await store.tag("app:1", ref)
    with anyio.fail_after(5):
        async with TagIndex.watching(cast(KeyValue, _MarkerFirst(store.tags))) as index:
            assert [e.reference.tagged for e in index.entries()] == ["app:1", "app:2", "app:3"]


async def test_tags_are_named_by_tag_and_removed_only_if_there(
    store: ImageStore, tmp_path: Path
) -> None:
    pushed = await store.push_directory(tree(tmp_path / "a", f=b"1"), "app:1", RUN)
    assert await store.tag(f"app@{pushed.digest}", "app:2") == pushed.digest
    with pytest.raises(BadImage, match="names a digest: a tag is name"):
        await store.tag("app:1", f"app@{pushed.digest}")
    with pytest.raises(ImageNotFound, match="no image tagged app:3"):
        await store.remove_tag("app:3")
    with pytest.raises(ImageNotFound, match=f"manifest sha256:{'0' * 64} is not in the image"):
        await store.tag(f"app@sha256:{'0' * 64}", "app:4")


@pytest.mark.parametrize("spoil", ["corrupt", "truncate"])
async def test_a_blob_that_does_not_match_is_refused_and_nothing_stays(
    store: ImageStore, tmp_path: Path, spoil: str
) -> None:
    await store.push_directory(tree(tmp_path / "a", f=os.urandom(300_000)), "img", RUN)
    layer = await layer_of(store, "img")
    dest, tmp = tmp_path / "blob", tmp_path / "tmp"
    tmp.mkdir()
    good = tmp_path / "good"
    await store.fetch_blob(layer, good, tmp_dir=tmp)
    data = good.read_bytes()
    # written straight into the bucket under the layer's name: the object store's own
    # digest matches these bytes, only the name says otherwise
    bad = data[:1000] + bytes([data[1000] ^ 1]) + data[1001:] if spoil == "corrupt" else data[:-7]
    await store.objects.put(layer.digest, bad)
    says = "fetched 300" if spoil == "corrupt" else f"the store holds {len(bad)} bytes"
    with pytest.raises(DigestMismatch, match=says) as caught:
        await store.fetch_blob(layer, dest, tmp_dir=tmp)
    assert caught.value.digest == layer.digest
    assert not dest.exists() and list(tmp.iterdir()) == []
    assert await store.stat_blob(layer.digest) is None  # a push would send it again


async def test_a_corrupt_manifest_is_refused_when_read(store: ImageStore, tmp_path: Path) -> None:
    pushed = await store.push_directory(tree(tmp_path / "a", f=b"1"), "img", RUN)
    manifest = await store.read_blob(pushed.digest)
    await store.objects.put(pushed.digest, manifest.replace(b"schemaVersion", b"schemaversion"))
    with pytest.raises(DigestMismatch, match=f"{pushed.digest}: blob {pushed.digest}: its bytes"):
        await store.inspect("img")


async def test_a_fetch_that_stalls_ends_at_its_bound_and_leaves_nothing(
    store: ImageStore, tmp_path: Path
) -> None:
    await store.push_directory(tree(tmp_path / "a", f=os.urandom(200_000)), "img", RUN)
    layer = await layer_of(store, "img")
    info = await store.objects.get_info(layer.digest)
    # the chunks go, the object's record stays: a fetch would wait for chunks forever
    await store.js.purge_stream(f"OBJ_{store.bucket}", subject=f"$O.{store.bucket}.C.{info.nuid}")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    started = time.monotonic()
    with pytest.raises(PullTimeout, match=f"blob {layer.digest}: not fetched within 0.5 s"):
        await store.fetch_blob(layer, tmp_path / "blob", tmp_dir=tmp, timeout_s=0.5)
    assert time.monotonic() - started < 5
    assert list(tmp.iterdir()) == [] and not (tmp_path / "blob").exists()
    forged = Descriptor(media_type=layer.media_type, digest="sha256:../../x", size=1)
    with pytest.raises(BadReference, match="is not sha256:<64 lowercase hex>"):
        await store.fetch_blob(forged, tmp_path / "blob", tmp_dir=tmp)


async def test_gc_removes_only_what_no_tag_or_use_keeps(store: ImageStore, tmp_path: Path) -> None:
    tagged = await store.push_directory(tree(tmp_path / "a", f=b"tagged"), "keep", RUN)
    dropped = await store.push_directory(tree(tmp_path / "b", f=b"dropped"), "drop", RUN)
    used = await store.push_directory(tree(tmp_path / "c", f=b"in use"), "used", RUN)
    await store.remove_tag("drop")
    await store.remove_tag("used")  # untagged, but a machine runs it

    young = await store.gc(in_use=[used.digest])  # the default grace spares fresh blobs
    assert (young.removed, young.young) == ((), 3)

    dry = await store.gc(in_use=[used.digest], grace_s=0, dry_run=True)
    assert {b.digest for b in dry.removed} == set(await _blobs_of(store, dropped.digest))
    assert await store.stat_blob(dropped.digest) is not None  # a dry run removes nothing

    swept = await store.gc(in_use=[used.digest], grace_s=0)
    assert {b.digest for b in swept.removed} == {b.digest for b in dry.removed}
    assert swept.kept == 6 and swept.removed_bytes == dropped.size
    for digest in [tagged.digest, used.digest]:
        for blob in await _blobs_of(store, digest):
            assert await store.stat_blob(blob) is not None
    assert await store.stat_blob(dropped.digest) is None


async def _blobs_of(store: ImageStore, manifest: str) -> list[str]:
    info = await store.inspect(Reference("x", "", manifest))
    return [manifest, info.config_digest, *(layer.digest for layer in info.layers)]


async def test_without_jetstream_the_store_says_so(tmp_path: Path) -> None:
    with EmbeddedNats(workdir=tmp_path / "nats", jetstream=False) as server:
        nc = await connect(server.url, name="images", service=False)
        try:
            with pytest.raises(StoreUnavailable, match="has no JetStream: the image store"):
                await ImageStore.open(nc, "nojs")
        finally:
            await nc.close()


async def test_a_reader_opens_the_store_without_making_it(market: Market, tmp_path: Path) -> None:
    nc = await market.connect("reader")
    with pytest.raises(ImageNotFound, match=r"no image store yet .*: push an image"):
        await ImageStore.open(nc, market.subjects.prefix, create=False)
    writer = await ImageStore.open(nc, market.subjects.prefix)
    await writer.push_directory(tree(tmp_path / "a", f=b"1"), "img", RUN)
    reader = await ImageStore.open(nc, market.subjects.prefix, create=False)
    assert await reader.lookup("img") == await writer.lookup("img")


@pytest.mark.slow
async def test_a_100_mb_image_is_pushed_and_pulled(
    store: ImageStore, tmp_path: Path, record_property: pytest.RecordProperty
) -> None:
    size = 100 * 1024 * 1024 + 1
    source = tmp_path / "big"
    source.mkdir()
    with (source / "blob").open("wb") as f:
        for _ in range(100):
            f.write(os.urandom(1024 * 1024))  # incompressible, as a real layer mostly is
        f.write(b"!")
    started = time.perf_counter()
    pushed = await store.push_directory(source, "big", RUN, compresslevel=1)
    push_s = time.perf_counter() - started
    cache = ImageCache.open(tmp_path / "cache", store, Limits(budget_bytes=1 << 30))
    started = time.perf_counter()
    root = await cache.prepare(pushed.digest)
    pull_s = time.perf_counter() - started
    assert (root / "blob").stat().st_size == size
    assert cache.stats().pulled_bytes == (await layer_of(store, "big")).size
    record_property("push_s", round(push_s, 2))
    record_property("pull_s", round(pull_s, 2))
    print(f"100 MiB image: push {push_s:.2f} s, pull (fetch + unpack) {pull_s:.2f} s")
