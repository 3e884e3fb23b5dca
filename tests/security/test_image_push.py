"""Who may push images, under the generated permissions (docs/security.md): the operator's
key writes the store; a tenant pushes through the exchange, under its own names only,
and cannot write the store, tag outside its prefix, replace a stored blob, or push through
another tenant's subjects. From the attacker's side, on a real nats-server with the
generated config and a real exchange on the exchange's key."""

from __future__ import annotations

import base64
import hashlib
import json
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NATS

from bourse.client import ClientError
from bourse.client.images import ImageClient
from bourse.images import ImageStore, RunSpec
from bourse.images import store as store_module
from bourse.images.bounds import Bounds
from bourse.images.build import write_layer
from bourse.images.importer import Blob
from bourse.images.oci import OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, Descriptor
from bourse.images.reference import Reference, tag_key
from bourse.images.staging import Staging, staging_name
from bourse.nats.connection import flush_all
from bourse.wire.codec import decode, encode
from bourse.wire.messages import Error, ImagePush, ImageReply, ImageTagged
from exchange.service import ExchangeService
from tests.images import bomb, hand_layer
from tests.market import Market
from tests.security.conftest import PREFIX, Secured

RUN = RunSpec(cmd=("./serve",), architecture="amd64")
CONFIG = b'{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}'


@pytest.fixture
async def market(secured_js: Secured, tmp_path: Path) -> AsyncIterator[Market]:
    """An exchange on its own key (it makes the image store and the staging stream)."""
    async with Market(secured_js.url, secured_js.subjects, tmp_path) as m:
        nc, _ = await secured_js.connect("exchange")
        await m.serve(ExchangeService(nc, secured_js.subjects))
        yield m


async def client(secured: Secured, user: str) -> ImageClient:
    nc, _ = await secured.connect(user)
    return ImageClient(nc, secured.subjects, tenant=user.partition(":")[2])


async def operator_store(secured: Secured) -> ImageStore:
    nc, _ = await secured.connect("operator")
    return await ImageStore.open(nc, PREFIX)


def tree(top: Path, body: bytes) -> Path:
    top.mkdir(parents=True)
    (top / "serve").write_bytes(body)
    return top


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


async def staged_messages(secured: Secured) -> int:
    operator, _ = await secured.connect("operator")
    info = await operator.jetstream().stream_info(staging_name(PREFIX))
    return info.state.messages


async def stage(
    staging: Staging, tenant: str, upload: str, layers: list[tuple[Descriptor, bytes]]
) -> Descriptor:
    """Stage an image by hand (config, the layers' bytes as given, manifest): what a
    client of the tenant's own may send. The manifest's descriptor."""
    config = Descriptor(media_type=OCI_CONFIG, digest=sha(CONFIG), size=len(CONFIG))
    doc = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": OCI_CONFIG, "digest": config.digest, "size": config.size},
            "layers": [
                {"mediaType": d.media_type, "digest": d.digest, "size": d.size} for d, _ in layers
            ],
        }
    ).encode()
    manifest = Descriptor(media_type=OCI_MANIFEST, digest=sha(doc), size=len(doc))
    for descriptor, data in [*layers, (config, CONFIG), (manifest, doc)]:
        await staging.upload(tenant, upload, Blob(descriptor, data))
    return manifest


async def ask_push(nc: NATS, secured: Secured, ref: str, upload: str, m: Descriptor) -> object:
    req = ImagePush(reference=ref, upload=upload, manifest=m.digest, manifest_size=m.size)
    subject = secured.subjects.tenant_image("alice", "push")
    reply: ImageTagged | Error = decode(
        (await nc.request(subject, encode(req), timeout=10)).data, ImageReply
    )
    return reply


async def test_a_tenant_pushes_its_own_names_through_the_exchange(
    secured_js: Secured, market: Market, tmp_path: Path
) -> None:
    alice = await client(secured_js, "buyer:alice")
    done = await alice.push(tree(tmp_path / "a", b"mine"), "alice/web:v1", RUN)
    assert done.uploaded_bytes == done.size > 0 and done.reused_bytes == 0
    store = await operator_store(secured_js)
    assert await store.lookup("alice/web:v1") == done.digest
    assert (await store.inspect("alice/web:v1")).cmd == ("./serve",)
    assert await staged_messages(secured_js) == 0  # the upload is cleared

    again = await alice.push(tmp_path / "a", "alice/web:v2", RUN)
    assert (again.digest, again.uploaded_bytes, again.reused_bytes) == (done.digest, 0, done.size)
    tagged = await alice.tag("alice/web:v1", "alice/web:stable")
    assert tagged.digest == done.digest and await store.lookup("alice/web:stable") == done.digest
    assert (await alice.remove("alice/web:stable")).digest == done.digest
    assert [r.reference for r in await alice.ls()] == ["alice/web:v1", "alice/web:v2"]


async def test_a_tenant_cannot_push_tag_or_remove_outside_its_prefix(
    secured_js: Secured, market: Market, tmp_path: Path
) -> None:
    bob = await client(secured_js, "buyer:bob")
    theirs = await bob.push(tree(tmp_path / "b", b"bob's"), "bob/web:v1", RUN)
    alice = await client(secured_js, "buyer:alice")
    for attempt in (  # the exchange's refusals
        alice.tag("bob/web:v1", "bob/web:latest"),
        alice.tag("bob/web:v1", "web:latest"),  # no prefix at all
        alice.remove("bob/web:v1"),
    ):
        with pytest.raises(ClientError) as refused:
            await attempt
        assert refused.value.code == "bad_request"
        assert "is not under tenant 'alice''s own names (alice/…)" in str(refused.value)
    nc, _ = await secured_js.connect("buyer:alice")
    staged = await stage(Staging(nc, secured_js.subjects), "alice", "01MINE", [])
    refused_push = await ask_push(nc, secured_js, "bob/web:v1", "01MINE", staged)
    assert isinstance(refused_push, Error) and refused_push.code == "bad_request"
    assert "is not under tenant 'alice''s own names" in refused_push.detail
    with pytest.raises(ClientError, match="not under tenant 'alice'"):  # said before sending
        await alice.push(tree(tmp_path / "a", b"alice's"), "bob/web:v1", RUN)
    store = await operator_store(secured_js)
    assert [t.reference for t in await store.ls()] == ["bob/web:v1"]
    assert await store.lookup("bob/web:v1") == theirs.digest
    assert await staged_messages(secured_js) == 0  # refused pushes leave nothing staged


async def test_a_tenant_cannot_write_the_store_nor_another_tenants_subjects(
    secured_js: Secured, market: Market
) -> None:
    s = secured_js.subjects
    nc, violations = await secured_js.connect("buyer:alice")
    blobs, tags = f"{PREFIX.upper()}_IMAGES", f"{PREFIX.upper()}_IMAGE_TAGS"
    name = base64.urlsafe_b64encode(b"sha256:" + b"0" * 64).decode()
    attempts = [
        s.tenant_image("bob", "push"),  # bob's push subject
        s.tenant_image("bob", "tag"),
        s.stage("bob", "01UPLOAD", "0" * 64),  # bob's staging subject
        f"$O.{blobs}.M.{name}",  # a blob's meta in the store
        f"$O.{blobs}.C.chunk",  # a blob's chunks
        f"$KV.{tags}.{tag_key(Reference.parse('bob/web:v1'))}",  # a tag
        f"$JS.API.STREAM.PURGE.OBJ_{blobs}",  # delete a blob
        f"$JS.API.STREAM.PURGE.{staging_name(PREFIX)}",  # clear someone's upload
        f"$JS.API.DIRECT.GET.{staging_name(PREFIX)}",  # read someone's upload
    ]
    for subject in attempts:
        await nc.publish(subject, b"{}", reply=nc.new_inbox())
    await flush_all(nc)
    assert violations.denied() == {a.lower() for a in attempts}


async def test_a_tenant_cannot_replace_a_stored_blob(
    secured_js: Secured, market: Market, tmp_path: Path
) -> None:
    """alice knows bob's layer's digest: she stages other bytes under it and pushes a
    manifest naming it. The store keeps bob's bytes (a stored blob is never written
    again); her own new blob whose bytes do not match its digest is refused, nothing is
    stored or tagged."""
    bob = await client(secured_js, "buyer:bob")
    theirs = await bob.push(tree(tmp_path / "b", b"bob's code"), "bob/web:v1", RUN)
    store = await operator_store(secured_js)
    [layer] = (await store.inspect("bob/web:v1")).layers
    target = Descriptor(media_type=layer.media_type, digest=layer.digest, size=layer.size)

    nc, _ = await secured_js.connect("buyer:alice")
    staging = Staging(nc, secured_js.subjects)
    forged = await stage(staging, "alice", "01FORGED", [(target, b"x" * target.size)])
    taken = await ask_push(nc, secured_js, "alice/evil:v1", "01FORGED", forged)
    assert isinstance(taken, ImageTagged) and taken.reused_bytes >= target.size
    await store.fetch_blob(target, tmp_path / "fetched")  # bob's bytes: checked by digest
    assert await store.lookup("bob/web:v1") == theirs.digest

    lie = Descriptor(media_type=OCI_LAYER_GZIP, digest=sha(b"promised"), size=8)
    liar = await stage(staging, "alice", "01LIE", [(lie, b"replaced")])
    refused = await ask_push(nc, secured_js, "alice/lie:v1", "01LIE", liar)
    assert isinstance(refused, Error) and refused.code == "bad_request", refused
    assert f"{lie.digest}: the 8 bytes staged have digest {sha(b'replaced')}" in refused.detail
    assert await store.stat_blob(lie.digest) is None
    assert "alice/lie:v1" not in [t.reference for t in await store.ls()]
    assert await staged_messages(secured_js) == 0


async def test_the_shared_buyer_key_reads_the_store_and_cannot_write_it(
    secured_js: Secured, market: Market, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A denied write gets no answer from the server: the client says what that means
    (once the store's request timeout, shortened here, is out)."""
    monkeypatch.setattr(store_module, "API_TIMEOUT_S", 1.0)
    alice = await client(secured_js, "buyer:alice")
    done = await alice.push(tree(tmp_path / "a", b"alice's"), "alice/web:v1", RUN)
    buyer = await client(secured_js, "buyer")
    assert [(r.reference, r.digest) for r in await buyer.ls()] == [("alice/web:v1", done.digest)]
    assert (await buyer.inspect("alice/web:v1")).digest == done.digest
    for attempt in (
        buyer.push(tree(tmp_path / "b", b"shared"), "web:v1", RUN),
        buyer.tag("alice/web:v1", "alice/web:stolen"),
    ):
        with pytest.raises(ClientError, match="this key may not write it"):
            await attempt
    store = await operator_store(secured_js)
    assert [t.reference for t in await store.ls()] == ["alice/web:v1"]


async def test_a_tenants_bomb_or_unsafe_layer_is_refused_by_the_exchange_nothing_stored(
    secured_js: Secured, tmp_path: Path
) -> None:
    """Issue 36's bomb, pushed by a tenant: the exchange reads each layer it would store
    once, within its own --max-image-mb (1 here), and refuses naming the layer; an entry
    that climbs out of the root is refused naming the entry; a layer it stores has its
    uncompressed size recorded beside it."""
    async with Market(secured_js.url, secured_js.subjects, tmp_path) as m:
        exchange, _ = await secured_js.connect("exchange")
        await m.serve(ExchangeService(exchange, secured_js.subjects, image_bounds=Bounds.of_mb(1)))
        nc, _ = await secured_js.connect("buyer:alice")
        staging = Staging(nc, secured_js.subjects)
        store = await operator_store(secured_js)

        built, data = bomb()
        staged = await stage(staging, "alice", "01BOMB", [(built.descriptor, data)])
        refused = await ask_push(nc, secured_js, "alice/bomb:v1", "01BOMB", staged)
        assert isinstance(refused, Error) and refused.code == "bad_request", refused
        assert refused.detail == (
            f"image_too_big: layer {built.descriptor.digest} passed {1 << 20} bytes unpacked "
            "(max_image_mb 1 for the whole image, 0 bytes before it)"
        )
        assert await store.stat_blob(built.descriptor.digest) is None

        link = tarfile.TarInfo("app/link")
        link.type, link.linkname = tarfile.SYMTYPE, "../../etc"
        unsafe, packed = hand_layer([(link, b"")])
        staged = await stage(staging, "alice", "01LINK", [(unsafe.descriptor, packed)])
        refused = await ask_push(nc, secured_js, "alice/link:v1", "01LINK", staged)
        assert isinstance(refused, Error) and refused.code == "bad_request", refused
        assert refused.detail == "layer entry 'app/link': symlink to '../../etc' escapes the root"
        assert await store.stat_blob(unsafe.descriptor.digest) is None
        assert await staged_messages(secured_js) == 0
        assert await store.ls() == []

        alice = await client(secured_js, "buyer:alice")
        await alice.push(tree(tmp_path / "a", b"mine"), "alice/web:v1", RUN)
        [layer] = (await store.inspect("alice/web:v1")).layers
        with (tmp_path / "layer").open("wb") as out:
            assert write_layer(tmp_path / "a", out).descriptor.digest == layer.digest
        assert await store.unpacked_size(layer.digest) == 10240  # one tar record
