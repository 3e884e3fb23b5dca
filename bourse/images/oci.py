"""The OCI image format as this library reads and writes it (pure).

Manifests, indexes and configs are decoded with msgspec (unknown fields skipped: they stay
in the stored bytes, which are never rewritten, so a digest always names what was imported).
Docker's media types (``application/vnd.docker.*``) are the same documents under other
names: they are read as their OCI twins and stored as they are.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from typing import Annotated, TypeVar

import msgspec

from bourse.images.errors import BadImage, BadReference, DigestMismatch
from bourse.images.reference import check_digest

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"

MANIFEST_TYPES = frozenset({OCI_MANIFEST, DOCKER_MANIFEST})
INDEX_TYPES = frozenset({OCI_INDEX, DOCKER_LIST})
CONFIG_TYPES = frozenset({OCI_CONFIG, DOCKER_CONFIG})
# Layer types this library unpacks: plain and gzip tars, OCI's and Docker's names for them,
# the "non-distributable" and "foreign" variants included (their blob must be present).
LAYER_TYPES = frozenset(
    {
        OCI_LAYER,
        OCI_LAYER_GZIP,
        "application/vnd.oci.image.layer.nondistributable.v1.tar",
        "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
        DOCKER_LAYER,
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
    }
)
# The OCI spec's limit for a manifest, also used for configs and indexes: such a blob is
# read into memory, a layer never is.
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
# Where an index names no platform and several manifests, the one this library takes.
DEFAULT_PLATFORM = ("linux", "amd64")
REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"

_T = TypeVar("_T")
Digest = Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}$")]


class Platform(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    architecture: str = ""
    os: str = ""
    variant: str = ""

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p) or "?"


class Descriptor(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A blob by media type, digest and size (an OCI content descriptor)."""

    media_type: str = msgspec.field(name="mediaType")
    digest: Digest
    size: Annotated[int, msgspec.Meta(ge=0)]
    annotations: dict[str, str] = {}
    platform: Platform | None = None

    @property
    def hex(self) -> str:
        """The digest's hex part (a cache's file name)."""
        return self.digest.removeprefix("sha256:")


class Manifest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    schema_version: Annotated[int, msgspec.Meta(ge=2, le=2)] = msgspec.field(name="schemaVersion")
    media_type: str = msgspec.field(name="mediaType", default="")
    config: Descriptor
    layers: list[Descriptor] = []
    annotations: dict[str, str] = {}


class Index(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    schema_version: Annotated[int, msgspec.Meta(ge=2, le=2)] = msgspec.field(name="schemaVersion")
    media_type: str = msgspec.field(name="mediaType", default="")
    manifests: list[Descriptor] = []
    annotations: dict[str, str] = {}


class RunConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, rename="pascal"):
    """What the image runs: the OCI config's ``config`` object (Docker's names)."""

    user: str = ""
    env: list[str] | None = None
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    working_dir: str = ""


class RootFS(msgspec.Struct, frozen=True, kw_only=True):
    type: str = "layers"
    diff_ids: list[Digest] = []


class ImageConfig(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The OCI image config (fields this library reads or writes)."""

    created: str | None = None
    architecture: str = ""
    os: str = ""
    config: RunConfig = RunConfig()
    rootfs: RootFS = RootFS()


class _Kind(msgspec.Struct):
    """Just enough of a JSON document to tell a manifest from an index."""

    media_type: str = msgspec.field(name="mediaType", default="")
    manifests: list[object] | None = None
    config: dict[str, object] | None = None


_manifest = msgspec.json.Decoder(Manifest)
_index = msgspec.json.Decoder(Index)
_config = msgspec.json.Decoder(ImageConfig)
_kind = msgspec.json.Decoder(_Kind)


def sha256_digest(data: bytes) -> str:
    """The OCI digest of ``data``."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def digest_of_object(nats_digest: str) -> str:
    """An object store's ``SHA-256=<urlsafe base64>`` digest as ``sha256:<hex>`` (or "")."""
    algo, _, b64 = nats_digest.partition("=")
    if algo.upper() != "SHA-256" or not b64:
        return ""
    try:
        return "sha256:" + base64.urlsafe_b64decode(b64).hex()
    except ValueError:
        return ""


def encode(doc: msgspec.Struct) -> bytes:
    """A document's canonical bytes (field order as declared, defaults left out)."""
    return msgspec.json.encode(doc)


def image_manifest(config: bytes, layers: Sequence[Descriptor]) -> tuple[bytes, Descriptor]:
    """An OCI manifest naming the image config ``config`` and ``layers``: its bytes and
    its descriptor."""
    manifest = encode(
        Manifest(
            schema_version=2,
            media_type=OCI_MANIFEST,
            config=Descriptor(
                media_type=OCI_CONFIG, digest=sha256_digest(config), size=len(config)
            ),
            layers=list(layers),
        )
    )
    return manifest, Descriptor(
        media_type=OCI_MANIFEST, digest=sha256_digest(manifest), size=len(manifest)
    )


def kind_of(data: bytes, what: str) -> str:
    """``"manifest"`` or ``"index"``: what the JSON document ``data`` is, by its media type
    or, without one, its shape. ``what`` names it in errors."""
    try:
        doc = _kind.decode(data)
    except msgspec.DecodeError as exc:
        raise BadImage(f"{what} is not a JSON object: {exc}") from None
    if doc.media_type in MANIFEST_TYPES or (not doc.media_type and doc.config is not None):
        return "manifest"
    if doc.media_type in INDEX_TYPES or (not doc.media_type and doc.manifests is not None):
        return "index"
    raise BadImage(
        f"{what} is neither an image manifest nor an index (mediaType {doc.media_type!r})"
    )


def decode_manifest(data: bytes, what: str) -> Manifest:
    """An image manifest, checked: a config of an image config type, layers of types this
    library unpacks (zstd is refused by name)."""
    manifest = _decode(_manifest, data, what)
    if manifest.config.media_type not in CONFIG_TYPES:
        raise BadImage(
            f"{what} is not a container image: its config is {manifest.config.media_type!r}"
        )
    for layer in manifest.layers:
        check_layer_type(layer, what)
    return manifest


def check_layer_type(layer: Descriptor, what: str) -> None:
    """Refuse a layer this library cannot unpack, naming it and why."""
    if "zstd" in layer.media_type:
        raise BadImage(
            f"{what}: layer {layer.digest} is zstd-compressed ({layer.media_type}), which this "
            "library does not read (no zstd in Python 3.11's standard library): push the image "
            "with gzip or uncompressed layers"
        )
    if layer.media_type not in LAYER_TYPES:
        raise BadImage(f"{what}: layer {layer.digest} has unsupported type {layer.media_type!r}")


def decode_index(data: bytes, what: str) -> Index:
    return _decode(_index, data, what)


def decode_config(data: bytes, what: str) -> ImageConfig:
    return _decode(_config, data, what)


def _decode(decoder: msgspec.json.Decoder[_T], data: bytes, what: str) -> _T:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise BadImage(f"{what}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadImage(f"{what} is not valid JSON: {exc}") from None


def references(data: bytes, what: str) -> list[Descriptor]:
    """The blobs a manifest (its config and layers) or an index (its manifests) names."""
    if kind_of(data, what) == "index":
        return list(decode_index(data, what).manifests)
    manifest = _decode(_manifest, data, what)
    return [manifest.config, *manifest.layers]


def check_blob(data: bytes, digest: str, what: str) -> bytes:
    """``data`` if its digest is ``digest`` (``BadImage`` if that is no sha256 digest,
    ``DigestMismatch`` if the bytes differ)."""
    try:
        check_digest(digest, what)
    except BadReference as exc:
        raise BadImage(str(exc)) from None
    got = sha256_digest(data)
    if got != digest:
        raise DigestMismatch(digest, f"{what}: its bytes have digest {got}")
    return data


def pick_manifest(
    candidates: Sequence[Descriptor], pick: str = "", what: str = "index"
) -> tuple[Descriptor, str]:
    """The manifest to take from an index's ``candidates`` and why: the one whose ref-name
    annotation is ``pick`` (when given), else the only one, else the only linux/amd64 one;
    several or none left is an error listing them."""
    left = list(candidates)
    if pick:
        left = [
            d
            for d in left
            if pick in (d.annotations.get(REF_NAME), d.annotations.get(CONTAINERD_NAME))
        ]
        if not left:
            raise BadImage(f"{what}: no manifest named {pick!r}; it has {_listing(candidates)}")
    if len(left) == 1:
        why = f"named {pick!r}" if pick else "the only manifest"
        return left[0], why
    os_, arch = DEFAULT_PLATFORM
    native = [
        d for d in left if d.platform and (d.platform.os, d.platform.architecture) == (os_, arch)
    ]
    if len(native) == 1:
        return native[0], f"{os_}/{arch}, of {len(left)} manifests"
    if not left:
        raise BadImage(f"{what} names no image manifest")
    raise BadImage(
        f"{what} has {len(left)} manifests and no single {os_}/{arch} one: {_listing(left)}; "
        "name one (its ref name annotation)"
    )


def _listing(descriptors: Sequence[Descriptor]) -> str:
    def one(d: Descriptor) -> str:
        name = d.annotations.get(CONTAINERD_NAME) or d.annotations.get(REF_NAME) or "unnamed"
        return f"{name} ({d.platform or 'no platform'}, {d.digest[:19]})"

    return ", ".join(one(d) for d in descriptors) or "none"
