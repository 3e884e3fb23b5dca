"""Resolving an order's image where it enters (bourse/auction/content.py, protocol §4.3a),
without a server: a tag from the watched copy, a digest from the manifests, a catalog name
as itself; what was resolved kept until a tag changes, each manifest read once."""

from __future__ import annotations

from typing import cast

import pytest
from nats.js.kv import KV_DEL, KeyValue

from bourse.auction import content
from bourse.auction.content import CATALOG, ImageContent, Resolver
from bourse.images.errors import BadImage, BadReference, ImageNotFound
from bourse.images.oci import (
    OCI_INDEX,
    OCI_LAYER_GZIP,
    Descriptor,
    Index,
    encode,
    image_manifest,
    sha256_digest,
)
from bourse.images.reference import Reference, tag_key
from bourse.images.tags import TagIndex, TagRecord
from bourse.wire.messages import Layer


def manifest(*sizes: int) -> tuple[bytes, str, list[Layer]]:
    """An image manifest of layers of ``sizes``: its bytes, digest and layers as a bid
    carries them."""
    layers = [
        Descriptor(media_type=OCI_LAYER_GZIP, digest=f"sha256:{i:064x}", size=size)
        for i, size in enumerate(sizes, start=1)
    ]
    data, descriptor = image_manifest(b"{}", layers)
    return data, descriptor.digest, [Layer(digest=x.digest, size=x.size) for x in layers]


class Blobs:
    """Manifests by digest, counting the reads."""

    def __init__(self, *docs: bytes) -> None:
        self.docs = {sha256_digest(d): d for d in docs}
        self.reads = 0

    async def read_blob(self, digest: str) -> bytes:
        self.reads += 1
        if digest not in self.docs:
            raise ImageNotFound(f"no blob {digest}")
        return self.docs[digest]


class Lookups:
    """Tags read one request each (a resolver without a watched copy)."""

    def __init__(self, tags: dict[str, str]) -> None:
        self.tags = tags
        self.asked = 0

    async def lookup(self, ref: Reference | str) -> str:
        self.asked += 1
        tagged = ref.tagged if isinstance(ref, Reference) else Reference.parse(ref).tagged
        if tagged not in self.tags:
            raise ImageNotFound(f"no image tagged {tagged}")
        return self.tags[tagged]


def tags(**named: str) -> TagIndex:
    """A watched copy holding ``named`` (``name:tag`` -> digest; ``_`` for ``/``), fed as
    its watch would be (no server: the entries are applied as they arrive)."""
    index = TagIndex(cast(KeyValue, None))
    for ref, digest in named.items():
        tagged(index, ref.replace("_", "/"), digest)
    return index


def tagged(index: TagIndex, ref: str, digest: str | None) -> None:
    """A tag written (``digest``) or deleted (None), as the KV watch delivers it."""
    record = None if digest is None else encode(TagRecord(digest=digest))
    entry = KeyValue.Entry(
        bucket="TAGS",
        key=tag_key(Reference.parse(ref)),
        value=record,
        revision=index.version + 1,
        delta=0,
        created=0,
        operation=KV_DEL if digest is None else None,
    )
    index._apply(entry)  # what the watch's loop does with each entry


V1, D1, L1 = manifest(1000, 5)
V2, D2, L2 = manifest(7)


async def test_a_tag_resolves_to_its_manifest_and_layers() -> None:
    r = Resolver(tags(acme_app=D1), Blobs(V1))
    assert await r.resolve("acme/app") == ImageContent(D1, L1)  # ":latest" implied
    assert await r.resolve("acme/app:latest") == ImageContent(D1, L1)


@pytest.mark.parametrize(
    "image",
    [
        "web",  # a worker's catalog image
        "acme/app:v2",  # a reference the store has no tag for
        "Not-A-Reference",  # a string only a catalog can know (the sim driver runs any)
    ],
)
async def test_what_the_store_does_not_know_is_a_catalog_name(image: str) -> None:
    blobs = Blobs(V1)
    r = Resolver(tags(**{"acme_app:v1": D1}), blobs)
    assert await r.resolve(image) is CATALOG
    assert blobs.reads == 0


@pytest.mark.parametrize(
    ("image", "error", "says"),
    [
        ("app@sha256:" + "0" * 64, ImageNotFound, "the image store holds no sha256:000"),
        ("app@sha256:abc", BadReference, "digest 'sha256:abc' is not sha256:<64 lowercase hex>"),
    ],
)
async def test_a_digest_the_store_lacks_or_a_malformed_one_is_refused(
    image: str, error: type[Exception], says: str
) -> None:
    r = Resolver(tags(), Blobs(V1))
    with pytest.raises(error) as refused:
        await r.resolve(image)
    assert says in str(refused.value)


async def test_a_digest_names_an_index_or_a_tag_a_missing_manifest_refused() -> None:
    index_doc = encode(Index(schema_version=2, media_type=OCI_INDEX, manifests=[]))
    r = Resolver(tags(acme_gone=D2), Blobs(V1, index_doc))
    with pytest.raises(BadImage, match="is an index, not an image manifest"):
        await r.resolve(f"app@{sha256_digest(index_doc)}")
    with pytest.raises(ImageNotFound, match=r"\(tag acme/gone:latest\)"):
        await r.resolve("acme/gone")


async def test_without_a_store_every_name_is_a_catalog_name_and_a_digest_unknown() -> None:
    r = Resolver()
    assert await r.resolve("acme/app:v1") is CATALOG
    with pytest.raises(ImageNotFound, match="no image store here"):
        await r.resolve(f"app@{D1}")


async def test_what_was_resolved_is_a_lookup_until_a_tag_changes() -> None:
    index, blobs = tags(acme_app=D1), Blobs(V1, V2)
    r = Resolver(index, blobs)
    assert r.known("acme/app") is None and r.known("web") is None
    await r.resolve("acme/app")
    await r.resolve("web")
    assert r.known("acme/app") == ImageContent(D1, L1)
    assert r.known("web") is CATALOG  # every order of a catalog image after the first
    tagged(index, "acme/app", D2)  # the tag moved: nothing kept holds
    assert r.known("acme/app") is None and r.known("web") is None
    assert await r.resolve("acme/app") == ImageContent(D2, L2)
    tagged(index, "acme/app", None)  # removed: a catalog name again
    assert await r.resolve("acme/app") is CATALOG


async def test_a_manifest_is_read_once_per_digest_and_kept_within_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(content, "LAYERS_MAX", 1)
    blobs = Blobs(V1, V2)
    r = Resolver(tags(), blobs)
    for _ in range(3):
        await r.content(D1, "x")
    assert blobs.reads == 1
    await r.content(D2, "x")  # D1, the least recently used, goes
    await r.content(D2, "x")
    await r.content(D1, "x")
    assert blobs.reads == 3


async def test_without_a_watched_copy_a_tag_is_read_from_the_store() -> None:
    lookups = Lookups({"acme/app:v1": D1})
    r = Resolver(blobs=Blobs(V1), lookup=lookups)
    assert await r.resolve("acme/app:v1") == ImageContent(D1, L1)
    assert await r.resolve("acme/app:v2") is CATALOG
    assert lookups.asked == 2
