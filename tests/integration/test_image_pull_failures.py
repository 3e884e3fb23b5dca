"""Bad images and failed pulls, end to end on real parts (a nats-server with JetStream and the
image store in it, a supplier with the process driver, real files): nothing runs from bytes
that did not match their digest (I7), nothing escapes an image's root, an image that could
never fit is declined, and a pull that fails leaves nothing half made and is tried again.

Each failed start is answered ``Error{internal, "cannot start …: pull_failed: …"}``; its
machine is ``failed`` with a last exit (code 125) and a ``failed`` event saying why."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from bourse.client import ClientError
from bourse.images import ImageCache, ImageInfo, ImageStore, RunSpec
from bourse.images.build import documents, write_layer
from bourse.images.importer import Blob
from bourse.images.oci import decode_manifest
from bourse.nats.embedded import EmbeddedNats
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Event, ExplainRequest, Explanation, Layer, Machine
from bourse.wire.subjects import Subjects
from supplier.config import WorkerConfig
from tests.images import RES, hand_layer, layers_of, of_machine, place, push_layer, tree
from tests.market import Market, collect, wait_until, worker


def image_worker(wid: str = "w1", **extra: object) -> WorkerConfig:
    return worker(wid, driver="process", **extra)


@pytest.fixture
async def store(market: Market) -> AsyncIterator[ImageStore]:
    await market.jetstream_init()  # the operator's set-up: the event stream, the buckets
    yield await ImageStore.open(await market.connect("images"), market.subjects.prefix)


def cache_of(market: Market, wid: str = "w1") -> ImageCache:
    content = market.hosts[0].workers[wid].images.content
    assert content is not None
    return content


def nothing_half_made(cache: ImageCache, manifest: str) -> None:
    """No temporary file, no half-made root; the image's root is not there."""
    assert list(cache.tmp.iterdir()) == []
    assert cache.root(manifest) is None
    assert list(cache.root_dir.iterdir()) == []


async def failed_start(market: Market, machine_id: str) -> Machine:
    """Start a machine whose pull fails: the answer says so; the machine as it is after."""
    buyer = market.clients[0]
    with pytest.raises(ClientError, match=f"cannot start {machine_id}: pull_failed: "):
        await buyer.machine("start", machine_id)
    m = await buyer.machine("get", machine_id)
    assert m.state == "failed" and m.last_exit is not None and m.last_exit.code == 125
    return m


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
async def test_a_damaged_blob_is_refused_never_unpacked_and_fetched_again(
    market: Market, store: ImageStore, tmp_path: Path, damage: str
) -> None:
    source = tree(tmp_path / "app", **{"app.py": "print('ran')\n", "blob": os.urandom(200_000)})
    run = RunSpec(cmd=("python3", "app.py"))
    await store.push_directory(source, "app:v1", run)
    info = await store.inspect("app:v1")
    [layer] = info.layers
    good = await store.read_blob(layer.digest, max_bytes=layer.size)
    bad = bytes(b ^ 0xFF for b in good[:4096]) + good[4096:] if damage == "corrupted" else good[:-1]
    await store.objects.put(layer.digest, bad)  # the store holds other bytes under its name
    await market.host(image_worker())
    buyer = await market.client(direct=True)
    seen = await collect(buyer.nc, market.subjects.events())
    placed = await place(buyer.nc, market.subjects, info, "o1")

    m = await failed_start(market, placed.machine_id)
    assert m.last_exit is not None
    print(f"{damage} blob: {m.last_exit.detail}")
    want = {
        "corrupted": f"pull_failed: {layer.digest}: fetched {layer.size} bytes with digest sha256:",
        "truncated": f"pull_failed: {layer.digest}: the store holds {layer.size - 1} bytes, "
        f"the descriptor says {layer.size}: not fetched",
    }[damage]
    assert m.last_exit.detail.startswith(want)
    await wait_until(lambda: bool(of_machine(decoded(seen), m.machine_id, "failed")))
    [failed] = of_machine(decoded(seen), m.machine_id, "failed")
    assert (failed.detail, failed.image_digest) == (m.last_exit.detail, info.digest)
    cache = cache_of(market)
    nothing_half_made(cache, info.digest)
    assert not (cache.blob_dir / layer.digest.removeprefix("sha256:")).exists()

    await store.push_directory(source, "app:v1", run)  # the right bytes again
    assert (await buyer.machine("start", m.machine_id)).state == "started"
    await wait_until(lambda: bool(of_machine(decoded(seen), m.machine_id, "started")))
    [pulled] = of_machine(decoded(seen), m.machine_id, "pulled")
    assert pulled.bytes == layer.size
    assert cache.root(info.digest) is not None


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


UNSAFE = {
    "a '..' in its name": (entry("../escape"), "its name '../escape' has a '..' component"),
    "an absolute name": (entry("/escape"), "its name '/escape' is an absolute path"),
    "a symlink that climbs out": (
        entry("app/link", tarfile.SYMTYPE, "../../escape"),
        "symlink to '../../escape' escapes the root",
    ),
    "a device node": (
        entry("dev/disk", tarfile.BLKTYPE),
        "a block device node is not allowed in a layer",
    ),
}


@pytest.mark.parametrize(("unsafe", "why"), UNSAFE.values(), ids=UNSAFE.keys())
async def test_an_unsafe_layer_entry_fails_the_start_naming_the_entry(
    market: Market, store: ImageStore, unsafe: tarfile.TarInfo, why: str
) -> None:
    layer, data = hand_layer(
        [(entry("app/ok.txt"), b"fine"), (unsafe, b"x" if unsafe.isreg() else b"")]
    )
    digest = await push_layer(store, "evil:v1", layer, data)
    info = await store.inspect("evil:v1")
    await market.host(image_worker())
    buyer = await market.client(direct=True)
    placed = await place(buyer.nc, market.subjects, info, "o1")
    m = await failed_start(market, placed.machine_id)
    assert m.last_exit is not None
    print(m.last_exit.detail)
    assert m.last_exit.detail == f"pull_failed: layer entry {unsafe.name!r}: {why}"
    nothing_half_made(cache_of(market), digest)
    assert not (market.tmp_path / "escape").exists()


async def test_an_image_bigger_than_the_whole_cache_is_declined(
    market: Market, store: ImageStore, tmp_path: Path
) -> None:
    source = tree(tmp_path / "big", blob=os.urandom(700_000))
    await store.push_directory(source, "big:v1", RunSpec(cmd=("/bin/true",)))
    info = await store.inspect("big:v1")
    # 1 MiB: the layer (~0.7 MB) and its root (counted at the layer's size) do not fit
    await market.host(image_worker("small", image_cache_mb=1), image_worker("roomy"))
    nc = await market.connect("dry-run")
    ask = ExplainRequest(
        order_id="o1",
        region="mad",
        resources=RES,
        image="big:v1",
        image_digest=info.digest,
        layers=layers_of(info),
    )
    reply = decode(
        (await nc.request(market.subjects.explain("mad"), encode(ask))).data, Explanation
    )
    verdicts = {v.worker_id: v for v in reply.verdicts}
    need = 2 * info.layers[0].size
    assert [(r.code, r.detail) for r in verdicts["small"].reasons] == [
        (
            "image_too_big",
            f"image 'big:v1' needs {need} bytes in the image cache here, more than its whole "
            f"budget of {1 << 20} bytes",
        )
    ]
    assert verdicts["roomy"].verdict == "offer"
    placed = await place(nc, market.subjects, info, "o1")
    assert placed.worker_id == "roomy"  # the only offer


async def two_layers(store: ImageStore, tmp_path: Path) -> tuple[ImageInfo, Path]:
    """An image of two layers (a base, then the app); the app layer's file, to put back."""
    files = []
    for name, content in (
        ("base", {"lib/blob": os.urandom(300_000)}),
        ("top", {"app.py": "print('up')\n"}),
    ):
        path = tmp_path / f"{name}.layer"
        with path.open("wb") as out:
            files.append((write_layer(tree(tmp_path / name, **content), out), path))
    for layer, path in files:
        await store.put_blob(Blob(layer.descriptor, open=lambda p=path: p.open("rb")))
    docs = documents([layer for layer, _ in files], RunSpec(cmd=("python3", "app.py")))
    await store.put_blob(Blob(decode_manifest(docs.manifest, "m").config, docs.config))
    await store.put_blob(Blob(docs.descriptor, docs.manifest))
    await store.set_tag("app:v1", docs.descriptor.digest)
    return await store.inspect("app:v1"), files[1][1]


async def test_a_pull_that_fails_midway_leaves_nothing_half_made_and_the_worker_tries_again(
    market: Market, store: ImageStore, tmp_path: Path
) -> None:
    info, top_file = await two_layers(store, tmp_path)
    base, top = info.layers
    await store.delete_blob(top.digest)  # the store lost the second layer
    await market.host(image_worker())
    buyer = await market.client(direct=True)
    seen = await collect(buyer.nc, market.subjects.events())
    meta = {"restart": "on-failure"}  # the worker itself pulls again after a failed pull
    placed = await place(buyer.nc, market.subjects, info, "o1", metadata=meta)
    m = await failed_start(market, placed.machine_id)
    assert m.last_exit is not None
    assert m.last_exit.detail == f"pull_failed: blob {top.digest} is not in the image store"
    cache = cache_of(market)
    nothing_half_made(cache, info.digest)
    assert (cache.blob_dir / base.digest.removeprefix("sha256:")).stat().st_size == base.size

    await store.put_blob(Blob(top, open=lambda: top_file.open("rb")))  # back: the retry takes it
    await wait_until(lambda: bool(of_machine(decoded(seen), m.machine_id, "started")))
    [*_, pulled] = of_machine(decoded(seen), m.machine_id, "pulled")
    assert pulled.bytes == top.size  # the base layer was kept: only the rest is fetched
    assert cache.root(info.digest) is not None and cache.stats().pulls == 2


async def test_without_jetstream_an_image_by_digest_cannot_run_and_a_catalog_image_still_does(
    tmp_path: Path,
) -> None:
    layer = Layer(digest="sha256:" + "ab" * 32, size=1 << 20)
    ask = ExplainRequest(
        order_id="o1",
        region="mad",
        resources=RES,
        image="app:v1",
        image_digest="sha256:" + "cd" * 32,
        layers=[layer],
    )
    catalog = {"web": {"command": ["/bin/true"]}}
    with EmbeddedNats(workdir=tmp_path / "nats", jetstream=False) as server:
        async with Market(server.url, Subjects(), tmp_path) as market:
            await market.host(image_worker(catalog=catalog))
            nc = await market.connect("dry-run")
            for request, verdict, reasons in (
                (ask, "decline", [("image_not_runnable", NO_STORE)]),
                (msgspec.structs.replace(ask, image="web", image_digest="", layers=[]), "offer",
                 [("image_not_cached", "image 'web' not cached: the image term costs 0.3 "
                   "(score 0.645312, 0.945312 if cached)")]),
            ):  # fmt: skip
                reply = await nc.request(market.subjects.explain("mad"), encode(request))
                [v] = decode(reply.data, Explanation).verdicts
                assert (v.verdict, [(r.code, r.detail) for r in v.reasons]) == (verdict, reasons)


NO_STORE = f"no image store here to pull image 'app:v1' (sha256:{'cd' * 32}) from (no JetStream)"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A supplier data dir whose image cache is a 1 MiB tmpfs (root only)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    data = tmp_path / "supplier"
    cache = data / "images" / "w1"
    cache.mkdir(parents=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(cache)])
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield data
    finally:
        subprocess.run(["umount", "-l", str(cache)], check=False)


async def test_a_full_disk_mid_pull_fails_the_start_and_leaves_nothing(
    small_disk: Path, market: Market, store: ImageStore, tmp_path: Path
) -> None:
    source = tree(tmp_path / "big", blob=os.urandom(3 << 20))
    await store.push_directory(source, "big:v1", RunSpec(cmd=("/bin/true",)))
    info = await store.inspect("big:v1")
    await market.host(image_worker(), data_dir=small_disk)
    buyer = await market.client(direct=True)
    placed = await place(buyer.nc, market.subjects, info, "o1")
    m = await failed_start(market, placed.machine_id)
    assert m.last_exit is not None
    assert (
        m.last_exit.detail == "pull_failed: cannot write the image cache: No space left on device"
    )
    cache = cache_of(market)
    nothing_half_made(cache, info.digest)
    assert list(cache.blob_dir.iterdir()) == []


def decoded(seen: list[Msg]) -> list[Event]:
    return [decode(m.data, Event) for m in seen]
