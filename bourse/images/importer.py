"""Reading what docker, podman, skopeo and buildah write, as an image to store.

Three inputs, told apart by what they hold:

- an OCI image layout (a directory with ``oci-layout``, ``index.json`` and
  ``blobs/sha256/<hex>``), or the same as a tar (an oci-archive); also Docker 25's
  ``docker save``, which is such a tar with a ``manifest.json`` beside: ``index.json`` is
  read first;
- a ``docker save`` tarball in the older format (``manifest.json`` naming a config and
  ``<id>/layer.tar`` files, as ``skopeo copy … docker-archive:`` also writes), or that tar
  unpacked into a directory. Its layers are uncompressed tars whose digests are the
  config's ``diff_ids``; the manifest is made here (OCI media types) around the config's
  own bytes, so the image's config digest is docker's image id.

An index with several manifests gives the one named by ``pick`` (its ref-name annotation,
or a ``RepoTags`` entry of a docker save), else the only one, else the only linux/amd64 one
(``Plan.note`` says which and why); nested indexes are followed. Manifests, configs and
indexes are checked against their digests as they are read; layers as they are uploaded
(``ImageStore``). Docker media types are kept as they are: the stored bytes are the
imported bytes, so digests stay valid.
"""

from __future__ import annotations

import contextlib
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Protocol

import msgspec

from bourse.images.errors import BadImage
from bourse.images.oci import (
    INDEX_TYPES,
    MANIFEST_TYPES,
    MAX_DOCUMENT_BYTES,
    OCI_LAYER,
    Descriptor,
    Manifest,
    check_blob,
    decode_config,
    decode_index,
    decode_manifest,
    image_manifest,
    kind_of,
    pick_manifest,
)

# Nested indexes followed at most this deep, symlinks inside an archive this many times.
MAX_DEPTH = 4

Opener = Callable[[], contextlib.AbstractContextManager[IO[bytes]]]


@dataclass(frozen=True, slots=True)
class Blob:
    """A blob to store: its descriptor, and its bytes (small documents) or an opener; a
    layer's uncompressed size once known (checked: bourse/images/bounds.py), recorded
    beside it in the store."""

    descriptor: Descriptor
    data: bytes | None = None
    open: Opener | None = field(default=None, repr=False)
    unpacked: int | None = None


@dataclass(frozen=True, slots=True)
class Plan:
    """An image read from a source, ready to store: layers first, then config, then the
    manifest (``descriptor`` names it), so a tag never points at a missing blob."""

    descriptor: Descriptor
    manifest: bytes
    config: bytes
    layers: tuple[Blob, ...]
    note: str  # which manifest of the source and why

    def blobs(self) -> Iterator[Blob]:
        yield from self.layers
        manifest = decode_manifest(self.manifest, "manifest")
        yield Blob(manifest.config, self.config)
        yield Blob(self.descriptor, self.manifest)


class _Source(Protocol):
    label: str

    def exists(self, rel: str) -> bool: ...
    def size(self, rel: str) -> int: ...
    def open(self, rel: str) -> contextlib.AbstractContextManager[IO[bytes]]: ...


def _clean(rel: str, label: str) -> str:
    """A path inside a source, refused if it would leave it."""
    path = PurePosixPath(rel)
    if path.is_absolute() or ".." in path.parts:
        raise BadImage(f"{label}: path {rel!r} leaves the image")
    return str(path)


class _Directory:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.label = str(root)

    def _path(self, rel: str) -> Path:
        return self.root / _clean(rel, self.label)

    def exists(self, rel: str) -> bool:
        return self._path(rel).is_file()

    def size(self, rel: str) -> int:
        return self._path(rel).stat().st_size

    def open(self, rel: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        return self._path(rel).open("rb")


class _Archive:
    """A tar (an oci-archive or a docker save), its members found by name; a symlink member
    (skopeo's ``<id>/layer.tar``) is followed inside the archive."""

    def __init__(self, tar: tarfile.TarFile, label: str) -> None:
        self.tar = tar
        self.label = label
        self.members = {str(PurePosixPath(m.name)): m for m in tar.getmembers()}

    def _member(self, rel: str) -> tarfile.TarInfo | None:
        name = _clean(rel, self.label)
        for _ in range(MAX_DEPTH):
            member = self.members.get(name)
            if member is None or not member.issym():
                return member if member is not None and member.isfile() else None
            name = "/".join(_normal(str(PurePosixPath(name).parent / member.linkname)))
        return None

    def exists(self, rel: str) -> bool:
        return self._member(rel) is not None

    def size(self, rel: str) -> int:
        member = self._member(rel)
        assert member is not None  # asked after exists()
        return member.size

    @contextlib.contextmanager
    def open(self, rel: str) -> Iterator[IO[bytes]]:
        member = self._member(rel)
        data = self.tar.extractfile(member) if member is not None else None
        if data is None:
            raise BadImage(f"{self.label}: {rel} is not in the archive")
        with data:
            yield data


def _normal(name: str) -> list[str]:
    """``a/b/../c`` -> ``a/c`` (a symlink's target inside an archive)."""
    out: list[str] = []
    for part in name.split("/"):
        if part == "..":
            if out:
                out.pop()
        elif part not in ("", "."):
            out.append(part)
    return out


@contextlib.contextmanager
def reading(path: Path, pick: str = "") -> Iterator[Plan]:
    """The image at ``path`` (a layout or docker-save directory, an oci-archive or a
    docker-save tarball), open for as long as the block runs."""
    if path.is_dir():
        yield _plan(_Directory(path), pick)
        return
    if not path.is_file():
        raise BadImage(f"{path}: no such file or directory")
    with contextlib.ExitStack() as stack:
        try:
            tar = stack.enter_context(tarfile.open(path, "r:*"))
        except tarfile.TarError as exc:
            raise BadImage(f"{path} is not a tar archive: {exc}") from None
        yield _plan(_Archive(tar, str(path)), pick)


def _plan(source: _Source, pick: str) -> Plan:
    if source.exists("index.json"):
        return _from_layout(source, pick)
    if source.exists("manifest.json"):
        return _from_docker_save(source, pick)
    raise BadImage(
        f"{source.label}: not an OCI layout, oci-archive or docker save (no index.json or "
        "manifest.json)"
    )


def _read(source: _Source, rel: str) -> bytes:
    if source.size(rel) > MAX_DOCUMENT_BYTES:
        raise BadImage(f"{source.label}: {rel} is larger than {MAX_DOCUMENT_BYTES} bytes")
    with source.open(rel) as f:
        return f.read()


def _blob_path(descriptor: Descriptor) -> str:
    return f"blobs/sha256/{descriptor.hex}"


def _document(source: _Source, descriptor: Descriptor, what: str) -> bytes:
    """A small blob of a layout, checked against its descriptor."""
    rel = _blob_path(descriptor)
    if not source.exists(rel):
        raise BadImage(f"{source.label}: {what} {descriptor.digest} is missing")
    data = check_blob(_read(source, rel), descriptor.digest, f"{source.label}: {what}")
    if len(data) != descriptor.size:
        raise BadImage(
            f"{source.label}: {what} {descriptor.digest} is {len(data)} bytes, its descriptor "
            f"says {descriptor.size}"
        )
    return data


def _from_layout(source: _Source, pick: str) -> Plan:
    index = decode_index(_read(source, "index.json"), f"{source.label}: index.json")
    candidates = _manifests(source, index.manifests, {}, 0)
    chosen, why = pick_manifest(candidates, pick, f"{source.label}: index.json")
    manifest_bytes = _document(source, chosen, "manifest")
    if kind_of(manifest_bytes, "manifest") != "manifest":
        raise BadImage(f"{source.label}: {chosen.digest} is not an image manifest")
    manifest = decode_manifest(manifest_bytes, f"{source.label}: manifest {chosen.digest}")
    config = _document(source, manifest.config, "config")
    _check_layers(manifest, config, source.label)
    layers = []
    for layer in manifest.layers:
        rel = _blob_path(layer)
        if not source.exists(rel):
            raise BadImage(f"{source.label}: layer {layer.digest} is missing from the layout")
        layers.append(Blob(layer, open=_opener(source, rel)))
    descriptor = Descriptor(
        media_type=chosen.media_type, digest=chosen.digest, size=len(manifest_bytes)
    )
    return Plan(descriptor, manifest_bytes, config, tuple(layers), f"{chosen.digest}: {why}")


def _manifests(
    source: _Source, entries: list[Descriptor], inherited: dict[str, str], depth: int
) -> list[Descriptor]:
    """The image manifests an index names, nested indexes followed (a nested manifest
    without a name takes its index's)."""
    found = []
    for entry in entries:
        annotations = {**inherited, **entry.annotations}
        if entry.media_type in MANIFEST_TYPES:
            found.append(msgspec.structs.replace(entry, annotations=annotations))
        elif entry.media_type in INDEX_TYPES and depth < MAX_DEPTH:
            nested = decode_index(_document(source, entry, "index"), f"index {entry.digest}")
            found += _manifests(source, nested.manifests, annotations, depth + 1)
    return found


def _check_layers(manifest: Manifest, config: bytes, label: str) -> None:
    diff_ids = decode_config(config, f"{label}: config").rootfs.diff_ids
    if len(diff_ids) != len(manifest.layers):
        raise BadImage(
            f"{label}: the manifest has {len(manifest.layers)} layers, its config "
            f"{len(diff_ids)} diff_ids"
        )


def _opener(source: _Source, rel: str) -> Opener:
    return lambda: source.open(rel)


class _SaveEntry(msgspec.Struct, rename="pascal"):
    """One image of a docker save's ``manifest.json``."""

    config: str
    layers: list[str]
    repo_tags: list[str] | None = None


_save = msgspec.json.Decoder(list[_SaveEntry])


def _from_docker_save(source: _Source, pick: str) -> Plan:
    what = f"{source.label}: manifest.json"
    try:
        entries = _save.decode(_read(source, "manifest.json"))
    except msgspec.DecodeError as exc:
        raise BadImage(f"{what}: {exc}") from None
    entry, why = _pick_saved(entries, pick, what)
    config = _read(source, entry.config)
    _check_named(config, entry.config, source.label)
    diff_ids = decode_config(config, f"{source.label}: {entry.config}").rootfs.diff_ids
    if len(diff_ids) != len(entry.layers):
        raise BadImage(f"{what}: {len(entry.layers)} layers, the config has {len(diff_ids)}")
    layers = []
    for rel, diff_id in zip(entry.layers, diff_ids, strict=True):
        if not source.exists(rel):
            raise BadImage(f"{what}: layer {rel} is missing")
        layer = Descriptor(media_type=OCI_LAYER, digest=diff_id, size=source.size(rel))
        layers.append(Blob(layer, open=_opener(source, rel)))
    manifest, descriptor = image_manifest(config, [blob.descriptor for blob in layers])
    return Plan(descriptor, manifest, config, tuple(layers), f"docker save {why}")


def _pick_saved(entries: list[_SaveEntry], pick: str, what: str) -> tuple[_SaveEntry, str]:
    def named(e: _SaveEntry) -> bool:
        tags = e.repo_tags or []
        return any(t == pick or t.endswith(f"/{pick}") for t in tags)

    left = [e for e in entries if named(e)] if pick else entries
    if len(left) == 1:
        tags = ", ".join(left[0].repo_tags or []) or "untagged"
        return left[0], f"image {tags}"
    listing = "; ".join(", ".join(e.repo_tags or ["untagged"]) for e in entries) or "none"
    wanted = f"named {pick!r}" if pick else "(name one of its RepoTags)"
    raise BadImage(f"{what}: {len(left)} images {wanted}; it has: {listing}")


def _check_named(config: bytes, rel: str, label: str) -> None:
    """A config file named by its digest (``<hex>.json``, ``blobs/sha256/<hex>``) must
    have that digest."""
    stem = PurePosixPath(rel).name.removesuffix(".json")
    if len(stem) == 64 and all(c in "0123456789abcdef" for c in stem):
        check_blob(config, f"sha256:{stem}", f"{label}: {rel}")
