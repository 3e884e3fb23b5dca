"""The OCI documents as the library reads them: which manifest an index gives (and why),
manifests refused by name (zstd, not an image), object store digests, gc's sweep."""

from __future__ import annotations

import base64
import hashlib
import json
import re

import pytest

from bourse.images.blobstore import StoredBlob
from bourse.images.errors import BadImage, DigestMismatch
from bourse.images.oci import (
    DOCKER_LAYER,
    DOCKER_MANIFEST,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_LAYER,
    OCI_MANIFEST,
    REF_NAME,
    Descriptor,
    Platform,
    check_blob,
    decode_manifest,
    digest_of_object,
    kind_of,
    pick_manifest,
    references,
)
from bourse.images.store import sweep


def digest(n: int) -> str:
    return f"sha256:{n:064x}"


def m(n: int, os_: str = "", arch: str = "", name: str = "") -> Descriptor:
    return Descriptor(
        media_type=OCI_MANIFEST,
        digest=digest(n),
        size=100,
        annotations={REF_NAME: name} if name else {},
        platform=Platform(os=os_, architecture=arch) if os_ else None,
    )


@pytest.mark.parametrize(
    ("candidates", "pick", "chosen", "why"),
    [
        ([m(1)], "", 1, "the only manifest"),
        ([m(1, "linux", "arm64"), m(2, "linux", "amd64")], "", 2, "linux/amd64, of 2 manifests"),
        ([m(1, name="a"), m(2, name="b")], "b", 2, "named 'b'"),
        (
            [m(1, "linux", "amd64", "a"), m(2, "linux", "arm64", "a"), m(3, name="b")],
            "a",
            1,
            "linux/amd64, of 2 manifests",
        ),
    ],
)
def test_an_index_gives_one_manifest_and_says_why(
    candidates: list[Descriptor], pick: str, chosen: int, why: str
) -> None:
    assert pick_manifest(candidates, pick) == (candidates[chosen - 1], why)


@pytest.mark.parametrize(
    ("candidates", "pick", "says"),
    [
        ([], "", "names no image manifest"),
        ([m(1, name="a"), m(2, name="b")], "", "2 manifests and no single linux/amd64 one: a ("),
        ([m(1, name="a")], "c", "no manifest named 'c'; it has a (no platform"),
        (
            [m(1, "linux", "amd64"), m(2, "linux", "amd64")],
            "",
            "no single linux/amd64 one",
        ),
    ],
)
def test_an_index_that_names_no_single_manifest_is_refused_listing_them(
    candidates: list[Descriptor], pick: str, says: str
) -> None:
    with pytest.raises(BadImage, match=re.escape(says)):
        pick_manifest(candidates, pick)


def manifest_json(layer_type: str, config_type: str = OCI_CONFIG, media: str = "") -> bytes:
    doc: dict[str, object] = {
        "schemaVersion": 2,
        "config": {"mediaType": config_type, "digest": digest(1), "size": 2},
        "layers": [{"mediaType": layer_type, "digest": digest(2), "size": 3}],
    }
    if media:
        doc["mediaType"] = media
    return json.dumps(doc).encode()


@pytest.mark.parametrize("layer_type", [OCI_LAYER, DOCKER_LAYER, OCI_LAYER + "+gzip"])
def test_oci_and_docker_manifests_decode_alike(layer_type: str) -> None:
    for media in ("", OCI_MANIFEST, DOCKER_MANIFEST):
        data = manifest_json(layer_type, media=media)
        assert kind_of(data, "m") == "manifest"
        assert [d.digest for d in references(data, "m")] == [digest(1), digest(2)]
        assert decode_manifest(data, "m").layers[0].media_type == layer_type


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            manifest_json(OCI_LAYER + "+zstd"),
            "is zstd-compressed (application/vnd.oci.image.layer.v1.tar+zstd)",
        ),
        (manifest_json("application/x-rar"), "has unsupported type 'application/x-rar'"),
        (
            manifest_json(OCI_LAYER, config_type="application/vnd.cncf.helm.config.v1+json"),
            "is not a container image",
        ),
        (b'{"schemaVersion": 2, "config": {"digest": "sha256:00"}}', "at `$.config"),
        (b"[1, 2]", "Expected `object`, got `array`"),
        (b"{", "is not valid JSON"),
    ],
)
def test_a_manifest_this_library_cannot_use_is_refused_by_name(data: bytes, says: str) -> None:
    with pytest.raises(BadImage, match=re.escape(says)):
        decode_manifest(data, "m")


def test_kind_tells_an_index_from_a_manifest_or_neither() -> None:
    assert kind_of(json.dumps({"manifests": []}).encode(), "x") == "index"
    assert kind_of(json.dumps({"mediaType": OCI_INDEX}).encode(), "x") == "index"
    with pytest.raises(BadImage, match="neither an image manifest nor an index"):
        kind_of(b'{"mediaType": "text/plain"}', "x")
    with pytest.raises(BadImage, match="is not a JSON object"):
        kind_of(b"\x1f\x8b binary", "x")


def test_object_store_digests_read_as_oci_digests() -> None:
    raw = hashlib.sha256(b"abc").digest()
    nats = "SHA-256=" + base64.urlsafe_b64encode(raw).decode()
    assert digest_of_object(nats) == "sha256:" + raw.hex()
    assert digest_of_object("") == digest_of_object("MD5=xyz") == ""


def test_a_blob_is_checked_against_its_digest() -> None:
    good = "sha256:" + hashlib.sha256(b"abc").hexdigest()
    assert check_blob(b"abc", good, "b") == b"abc"
    with pytest.raises(DigestMismatch, match=f"{good}: b: its bytes have digest sha256:") as e:
        check_blob(b"abd", good, "b")
    assert e.value.digest == good
    with pytest.raises(BadImage, match="is not sha256"):
        check_blob(b"abc", "md5:00", "b")


@pytest.mark.parametrize(
    ("stored", "keep", "removed"),
    [
        ([(1, 0.0), (2, 0.0)], {digest(1)}, [2]),  # unreferenced and old: removed
        ([(1, 0.0), (2, 9_000.0)], set(), [1]),  # within the grace: spared
        ([(1, 0.0)], {digest(1)}, []),  # referenced or in use: kept whatever its age
        ([(1, 6_400.0)], set(), [1]),  # exactly the grace ago: removed
    ],
)
def test_gc_sweeps_what_nothing_keeps_past_its_grace(
    stored: list[tuple[int, float]], keep: set[str], removed: list[int]
) -> None:
    blobs = [StoredBlob(digest(n), 10, mtime) for n, mtime in stored]
    swept = sweep(blobs, keep, now=10_000.0, grace_s=3_600.0)
    assert [b.digest for b in swept] == [digest(n) for n in removed]
