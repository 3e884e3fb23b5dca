"""Images bounded before they are unpacked (issue 36 item 4), on real parts: a nats-server
with JetStream and the image store in it, ``bourse image`` in process, a supplier with the
process driver.

A bomb (3 MB of gzip that unpack to 2.86 GiB) is refused at push and at import, naming the
layer, and nothing of it is stored; a push records each layer's uncompressed size beside
its blob (the manifest's digest unchanged); a bomb written straight into the store (no
push's checks, no record) stops a worker's pull the moment it passes max_image_mb, a
record that lies, or the cache's budget left: the start fails ``pull_failed:
image_too_big: layer …`` and nothing half made stays."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bourse.images import ImageStore, RunSpec
from bourse.images.bounds import MIB
from bourse.images.build import write_layer
from bourse.images.importer import Blob
from bourse.images.oci import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST
from bourse.images.store import directory_image
from tests.images import bomb, place, push_layer, tree
from tests.integration.test_image_cli import image, one_error
from tests.integration.test_image_pull_failures import (
    cache_of,
    failed_start,
    image_worker,
    nothing_half_made,
)
from tests.market import Market
from tests.unit.test_oci_import import Layout


@pytest.fixture
async def store(market: Market) -> AsyncIterator[ImageStore]:
    await market.jetstream_init()
    yield await ImageStore.open(await market.connect("images"), market.subjects.prefix)


def bomb_layout(top: Path) -> tuple[Path, str]:
    """An OCI layout of one image whose layer is the bomb; the layer's digest."""
    built, data = bomb()
    layout = Layout()
    layer = layout.blob(data, OCI_LAYER_GZIP)
    config = json.dumps(
        {"architecture": "amd64", "os": "linux",
         "rootfs": {"type": "layers", "diff_ids": [built.diff_id]}}
    ).encode()  # fmt: skip
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": layout.blob(config, OCI_CONFIG),
        "layers": [layer],
    }
    layout.index(layout.blob(json.dumps(manifest).encode(), OCI_MANIFEST))
    return layout.write_dir(top), built.descriptor.digest


async def nothing_stored(store: ImageStore) -> None:
    assert await store.blobs() == [] and await store.ls() == []


async def test_a_bomb_is_refused_at_import_naming_its_layer_and_nothing_is_stored(
    market: Market, store: ImageStore, tmp_path: Path
) -> None:
    layout, digest = bomb_layout(tmp_path / "bomb")
    small = one_error(*await image(market, "import", "bomb:v1", str(layout), "--max-image-mb", "1"))
    assert small == (
        f"error: image_too_big: layer {digest} passed {MIB} bytes unpacked (max_image_mb 1 "
        "for the whole image, 0 bytes before it)\n"
    )
    await nothing_stored(store)
    # with the default max_image_mb (10 GiB), its ratio stops it: 100 times its 3 MB
    size = (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).stat().st_size
    default = one_error(*await image(market, "import", "bomb:v1", str(layout)))
    assert default == (
        f"error: image_too_big: layer {digest} passed {100 * size} bytes unpacked (more than "
        f"100 times its {size} bytes)\n"
    )
    await nothing_stored(store)


async def test_a_bomb_is_refused_at_push_and_nothing_is_stored(
    market: Market, store: ImageStore, tmp_path: Path
) -> None:
    top = tmp_path / "zeros"
    top.mkdir()
    with (top / "zeros").open("wb") as f:
        f.truncate(80 * MIB)  # compresses ~1000:1
    one = one_error(
        *await image(market, "push", "z:v1", str(top), "--cmd", "true", "--max-image-mb", "1")
    )
    assert one == (
        f"error: image_too_big: layer of directory {top} passed {MIB} bytes unpacked "
        "(max_image_mb 1 for the whole image, 0 bytes before it)\n"
    )
    await nothing_stored(store)
    ratio = one_error(*await image(market, "push", "z:v1", str(top), "--cmd", "true"))
    assert ratio.startswith("error: image_too_big: layer sha256:") and ratio.endswith(
        " bytes unpacked (more than 100 times its" + ratio.rsplit("its", 1)[1]
    )
    assert f"passed {64 * MIB} bytes" in ratio  # the floor: 100 times ~80 KB is less
    await nothing_stored(store)


async def test_a_push_records_each_layers_size_beside_it_and_the_digest_stays(
    market: Market, store: ImageStore, tmp_path: Path
) -> None:
    source = tree(tmp_path / "app", **{"app.py": "print('hi')\n", "data": b"x" * 300_000})
    run = RunSpec(cmd=("python3", "app.py"))
    async with directory_image(source, run) as (blobs, manifest):
        [layer, *_] = blobs
        assert layer.open is not None
        with layer.open() as f:
            unpacked = len(gzip.decompress(f.read()))
        # as an older version stored it: the same bytes, no record
        for blob in blobs:
            await store.put_blob(Blob(blob.descriptor, blob.data, blob.open))
        assert await store.unpacked_size(layer.descriptor.digest) is None

    done = await store.push_directory(source, "app:v1", run)  # the same image, checked
    assert done.digest == manifest.digest and done.reused_bytes == done.size
    assert await store.unpacked_size(layer.descriptor.digest) == unpacked  # recorded now
    assert (await store.inspect("app:v1")).layers[0].digest == layer.descriptor.digest
    with (tmp_path / "layer").open("wb") as out:
        assert write_layer(source, out).unpacked == unpacked


async def pull_fails(market: Market, store: ImageStore, ref: str, **worker: object) -> str:
    """A worker (``worker``'s settings) starts a machine of the image ``ref``: the start
    fails; the machine's last exit's detail, with nothing half made."""
    info = await store.inspect(ref)
    await market.host(image_worker(**worker))  # type: ignore[arg-type]
    buyer = await market.client(direct=True)
    placed = await place(buyer.nc, market.subjects, info, "o1")
    m = await failed_start(market, placed.machine_id)
    assert m.last_exit is not None
    nothing_half_made(cache_of(market), info.digest)
    return m.last_exit.detail


async def test_a_bomb_written_straight_into_the_store_stops_a_pull_at_max_image_mb(
    market: Market, store: ImageStore
) -> None:
    built, data = bomb()
    await push_layer(store, "bomb:v1", built, data)  # no push's checks, no record
    detail = await pull_fails(market, store, "bomb:v1", max_image_mb=1)
    assert detail == (
        f"pull_failed: image_too_big: layer {built.descriptor.digest} passed {MIB} bytes "
        "unpacked (max_image_mb 1 for the whole image, 0 bytes before it)"
    )


async def test_a_pull_stops_at_the_cache_budget_left(market: Market, store: ImageStore) -> None:
    built, data = bomb()
    await push_layer(store, "bomb:v1", built, data)
    detail = await pull_fails(market, store, "bomb:v1", image_cache_mb=32)
    left = 32 * MIB - len(data)  # the fetched layer holds its part of the budget
    assert detail == (
        f"pull_failed: image_too_big: layer {built.descriptor.digest} passed {left} bytes "
        f"unpacked (the {left} bytes left of the image cache's budget)"
    )


async def test_a_pull_stops_at_a_recorded_size_that_lies(
    market: Market, store: ImageStore, tmp_path: Path
) -> None:
    source = tree(tmp_path / "app", **{"app.py": "print('hi')\n"})
    with (tmp_path / "layer").open("wb") as out:
        built = write_layer(source, out)
    lie = Blob(built.descriptor, (tmp_path / "layer").read_bytes(), unpacked=1024)
    await store.put_blob(lie)  # a record written by a key that may write the store
    await push_layer(store, "app:v1", built, (tmp_path / "layer").read_bytes())
    assert await store.unpacked_size(built.descriptor.digest) == 1024
    detail = await pull_fails(market, store, "app:v1")
    assert detail == (
        f"pull_failed: image_too_big: layer {built.descriptor.digest} passed 1024 bytes "
        "unpacked (its size recorded in the store)"
    )
