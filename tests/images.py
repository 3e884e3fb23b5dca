"""Images for the supplier's tests: pushed into the market's real image store, placed by a
hand-run auction whose bid carries the image's digest and layers (as the exchange sends it
once it has resolved the order's reference, docs/protocol.md §4.3a), started, and watched
through the worker's events."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from collections.abc import Sequence
from pathlib import Path

from nats.aio.client import Client as NATS

from bourse.images import ImageInfo, ImageStore, RunSpec
from bourse.images.build import Layer as BuiltLayer
from bourse.images.build import documents
from bourse.images.importer import Blob
from bourse.images.oci import OCI_LAYER_GZIP, Descriptor, decode_manifest
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Bid, Commit, Event, Layer, Offer, Placed, Resources
from bourse.wire.subjects import Subjects

RES = Resources(cpus=1, memory_mb=256)


def tree(top: Path, **files: str | bytes) -> Path:
    """A directory of ``files`` (name -> text or bytes)."""
    for name, data in files.items():
        path = top / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            path.write_text(data)
        else:
            path.write_bytes(data)
    return top


def layers_of(info: ImageInfo) -> list[Layer]:
    """The layers a bid lists for the image."""
    return [Layer(digest=x.digest, size=x.size) for x in info.layers]


async def place(
    nc: NATS,
    subjects: Subjects,
    info: ImageInfo,
    order_id: str,
    *,
    image: str = "app",
    offers: int = 1,
    exclude: Sequence[str] = (),
    metadata: dict[str, str] | None = None,
) -> Placed:
    """An auction run by hand: one bid with the image's digest and layers, the best of the
    first ``offers`` offers committed with the digest."""
    bid = Bid(
        order_id=order_id,
        region="mad",
        resources=RES,
        image=image,
        hold_ms=5000,
        auction_id=f"a-{order_id}",
        exclude_workers=list(exclude),
        image_digest=info.digest,
        layers=layers_of(info),
    )
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(subjects.bid("mad"), encode(bid), reply=inbox)
        got = [decode((await sub.next_msg(timeout=5)).data, Offer) for _ in range(offers)]
    finally:
        await sub.unsubscribe()
    best = max(got, key=lambda o: o.score)
    commit = Commit(
        order_id=order_id,
        worker_id=best.worker_id,
        resources=RES,
        image=image,
        metadata=metadata or {},
        auction_id=bid.auction_id,
        image_digest=info.digest,
    )
    reply = await nc.request(subjects.commit(best.worker_id), encode(commit), timeout=5)
    return decode(reply.data, Placed)


def of_machine(events: Sequence[Event], machine_id: str, kind: str) -> list[Event]:
    return [e for e in events if e.machine_id == machine_id and e.kind == kind]


def hand_layer(members: Sequence[tuple[tarfile.TarInfo, bytes]]) -> tuple[BuiltLayer, bytes]:
    """A gzip layer of exactly these tar entries, however unsafe (a layer written by hand, as
    an attacker would): its descriptor, diff_id and bytes."""
    plain = io.BytesIO()
    with tarfile.open(fileobj=plain, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data else None)
    raw = plain.getvalue()
    packed = gzip.compress(raw, mtime=0)
    descriptor = Descriptor(
        media_type=OCI_LAYER_GZIP,
        digest="sha256:" + hashlib.sha256(packed).hexdigest(),
        size=len(packed),
    )
    return BuiltLayer(descriptor, "sha256:" + hashlib.sha256(raw).hexdigest()), packed


ZEROS = 16 << 20  # one gzip member of a bomb: 16 MiB of zeros, ~16 KB compressed
BOMB_CHUNKS = 183  # ~3 MB of gzip that unpack to 2.86 GiB


def bomb(chunks: int = BOMB_CHUNKS) -> tuple[BuiltLayer, bytes]:
    """A decompression bomb as an attacker writes it: a tar of one file of ``chunks`` x 16
    MiB of zeros, gzipped as many members (one compressed once, repeated: built in
    milliseconds). Its diff_id is not its tar's (that would mean hashing the GiBs): nothing
    may read it to the end."""
    info = tarfile.TarInfo("bomb")
    info.size, info.mode = chunks * ZEROS, 0o644
    header = info.tobuf(tarfile.PAX_FORMAT)
    member = gzip.compress(bytes(ZEROS), compresslevel=9, mtime=0)
    # the data ends on a block: the end-of-archive blocks follow, zeros too
    packed = gzip.compress(header, mtime=0) + member * chunks + gzip.compress(bytes(1024), mtime=0)
    descriptor = Descriptor(
        media_type=OCI_LAYER_GZIP,
        digest="sha256:" + hashlib.sha256(packed).hexdigest(),
        size=len(packed),
    )
    never = "sha256:" + hashlib.sha256(b"never read to the end").hexdigest()
    return BuiltLayer(descriptor, never), packed


async def push_layer(store: ImageStore, ref: str, layer: BuiltLayer, data: bytes) -> str:
    """Store a one-layer image of ``layer`` (its bytes ``data``), tagged ``ref``, straight
    into the store (no push's checks, no record of its size, as a store written by an older
    version holds it); its digest."""
    docs = documents([layer], RunSpec(cmd=("/bin/true",)))
    await store.put_blob(Blob(layer.descriptor, data))
    await store.put_blob(Blob(decode_manifest(docs.manifest, "m").config, docs.config))
    await store.put_blob(Blob(docs.descriptor, docs.manifest))
    await store.set_tag(ref, docs.descriptor.digest)
    return docs.descriptor.digest
