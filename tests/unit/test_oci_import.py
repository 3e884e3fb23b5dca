"""Reading images as docker, podman, skopeo and buildah write them (written here by hand;
tests/integration/test_image_import.py uses the real tools): an OCI layout as a directory
or a tar, Docker 25's save (index.json first), the older docker save; which manifest of
several, and every document checked against its digest."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from bourse.images.errors import BadImage, DigestMismatch
from bourse.images.importer import Plan, reading
from bourse.images.oci import (
    OCI_CONFIG,
    OCI_INDEX,
    OCI_LAYER,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
    REF_NAME,
    decode_manifest,
)


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_of(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Layout:
    """An OCI layout being written: blobs by digest, then index.json."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}'}

    def blob(self, data: bytes, media_type: str, **extra: object) -> dict[str, object]:
        self.files[f"blobs/sha256/{sha(data)[7:]}"] = data
        return {"mediaType": media_type, "digest": sha(data), "size": len(data), **extra}

    def image(
        self, content: bytes = b"hello", layer_type: str = OCI_LAYER_GZIP, **extra: object
    ) -> dict[str, object]:
        plain = tar_of({"hello.txt": content})
        layer = self.blob(gzip.compress(plain, mtime=0), layer_type)
        config = json.dumps(
            {
                "architecture": "amd64",
                "os": "linux",
                "rootfs": {"type": "layers", "diff_ids": [sha(plain)]},
            }
        ).encode()
        manifest = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": self.blob(config, OCI_CONFIG),
            "layers": [layer],
        }
        return self.blob(json.dumps(manifest).encode(), OCI_MANIFEST, **extra)

    def index(self, *manifests: dict[str, object]) -> dict[str, object]:
        doc = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": list(manifests)}
        self.files["index.json"] = json.dumps(doc).encode()
        return doc

    def write_dir(self, top: Path) -> Path:
        for name, data in self.files.items():
            (top / name).parent.mkdir(parents=True, exist_ok=True)
            (top / name).write_bytes(data)
        return top

    def write_tar(self, path: Path, extra: dict[str, bytes] | None = None) -> Path:
        path.write_bytes(tar_of({f"./{n}": d for n, d in {**self.files, **(extra or {})}.items()}))
        return path


def plan_of(path: Path, pick: str = "") -> Plan:
    with reading(path, pick) as plan:
        for blob in plan.layers:  # every layer can be opened while the source is
            assert blob.open is not None
            with blob.open() as f:
                assert len(f.read()) == blob.descriptor.size
        return plan


def test_an_oci_layout_directory_and_archive_give_the_same_image(tmp_path: Path) -> None:
    layout = Layout()
    manifest = layout.image()
    layout.index(manifest)
    from_dir = plan_of(layout.write_dir(tmp_path / "layout"))
    from_tar = plan_of(layout.write_tar(tmp_path / "image.oci.tar"))
    assert from_dir.descriptor.digest == from_tar.descriptor.digest == manifest["digest"]
    assert from_dir.note == f"{manifest['digest']}: the only manifest"
    kinds = [b.descriptor.media_type for b in from_dir.blobs()]
    assert kinds == [OCI_LAYER_GZIP, OCI_CONFIG, OCI_MANIFEST]  # the manifest last


def test_docker_25s_save_is_read_by_its_index_first(tmp_path: Path) -> None:
    layout = Layout()
    manifest = layout.image(annotations={"io.containerd.image.name": "docker.io/library/app:1"})
    layout.index(manifest)
    # the manifest.json beside is not read at all when index.json is there
    saved = layout.write_tar(tmp_path / "save.tar", {"manifest.json": b"not even json"})
    assert plan_of(saved).descriptor.digest == manifest["digest"]
    named = plan_of(saved, pick="docker.io/library/app:1")
    assert named.note.endswith("named 'docker.io/library/app:1'")


def test_an_index_of_platforms_gives_linux_amd64_nested_indexes_followed(tmp_path: Path) -> None:
    layout = Layout()
    arm = layout.image(b"arm", platform={"os": "linux", "architecture": "arm64"})
    amd = layout.image(b"amd", platform={"os": "linux", "architecture": "amd64"})
    nested = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [arm, amd]}
    layout.index(layout.blob(json.dumps(nested).encode(), OCI_INDEX))
    plan = plan_of(layout.write_dir(tmp_path / "l"))
    assert plan.descriptor.digest == amd["digest"]
    assert plan.note.endswith("linux/amd64, of 2 manifests")


def test_several_unnamed_images_are_refused_listing_them(tmp_path: Path) -> None:
    layout = Layout()
    layout.index(
        layout.image(b"a", annotations={REF_NAME: "a"}),
        layout.image(b"b", annotations={REF_NAME: "b"}),
    )
    top = layout.write_dir(tmp_path / "l")
    with pytest.raises(
        BadImage, match=r"2 manifests and no single linux/amd64 one: a \(no platform"
    ):
        plan_of(top)
    assert plan_of(top, pick="b").note.endswith("named 'b'")


def old_docker_save(tmp_path: Path, images: dict[str, bytes]) -> Path:
    """A docker save in the older format, skopeo's way: ``<hex>.json`` configs, layers as
    ``<diff_id hex>.tar`` with ``<id>/layer.tar`` symlinked to them."""
    buf = io.BytesIO()
    entries = []
    with tarfile.open(fileobj=buf, mode="w") as tar:

        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for tag, content in images.items():
            layer = tar_of({"file": content})
            config = json.dumps({"os": "linux", "rootfs": {"diff_ids": [sha(layer)]}}).encode()
            add(f"{sha(config)[7:]}.json", config)
            add(f"{sha(layer)[7:]}.tar", layer)
            link = tarfile.TarInfo(f"{tag.replace(':', '_')}/layer.tar")
            link.type, link.linkname = tarfile.SYMTYPE, f"../{sha(layer)[7:]}.tar"
            tar.addfile(link)
            entries.append(
                {
                    "Config": f"{sha(config)[7:]}.json",
                    "RepoTags": [f"docker.io/library/{tag}"],
                    "Layers": [f"{tag.replace(':', '_')}/layer.tar"],
                }
            )
        add("manifest.json", json.dumps(entries).encode())
    path = tmp_path / "docker-save.tar"
    path.write_bytes(buf.getvalue())
    return path


def test_an_older_docker_save_becomes_an_oci_manifest_around_its_config(tmp_path: Path) -> None:
    path = old_docker_save(tmp_path, {"app:1": b"one"})
    plan = plan_of(path)
    manifest = decode_manifest(plan.manifest, "m")
    layer = tar_of({"file": b"one"})
    assert [(x.media_type, x.digest, x.size) for x in manifest.layers] == [
        (OCI_LAYER, sha(layer), len(layer))
    ]
    assert manifest.config.digest == sha(plan.config)  # docker's image id
    assert plan.note == "docker save image docker.io/library/app:1"


def test_an_older_docker_save_of_several_images_needs_a_name(tmp_path: Path) -> None:
    path = old_docker_save(tmp_path, {"app:1": b"one", "app:2": b"two"})
    with pytest.raises(
        BadImage,
        match=re.escape(
            "2 images (name one of its RepoTags); it has: docker.io/library/app:1; "
            "docker.io/library/app:2"
        ),
    ):
        plan_of(path)
    assert plan_of(path, pick="app:2").note == "docker save image docker.io/library/app:2"


@pytest.mark.parametrize(
    ("spoil", "error", "says"),
    [
        ("tamper-manifest", DigestMismatch, "manifest: its bytes have digest"),
        ("drop-layer", BadImage, "is missing from the layout"),
        ("zstd", BadImage, "is zstd-compressed"),
        ("no-index", BadImage, "not an OCI layout, oci-archive or docker save"),
    ],
)
def test_a_broken_layout_is_refused_naming_the_blob(
    tmp_path: Path, spoil: str, error: type[Exception], says: str
) -> None:
    layout = Layout()
    manifest = layout.image(layer_type=OCI_LAYER + "+zstd" if spoil == "zstd" else OCI_LAYER_GZIP)
    layout.index(manifest)
    name = f"blobs/sha256/{str(manifest['digest'])[7:]}"
    if spoil == "tamper-manifest":
        layout.files[name] = layout.files[name].replace(b"schemaVersion", b"schemaversion")
    elif spoil == "drop-layer":
        layer = json.loads(layout.files[name])["layers"][0]["digest"]
        del layout.files[f"blobs/sha256/{layer[7:]}"]
    elif spoil == "no-index":
        del layout.files["index.json"]
    with pytest.raises(error, match=re.escape(says)):
        plan_of(layout.write_dir(tmp_path / "l"))


def test_a_docker_save_naming_a_path_outside_it_is_refused(tmp_path: Path) -> None:
    entries = [{"Config": "../../etc/passwd", "Layers": []}]
    (tmp_path / "save").mkdir()
    (tmp_path / "save/manifest.json").write_text(json.dumps(entries))
    with pytest.raises(BadImage, match=re.escape("path '../../etc/passwd' leaves the image")):
        plan_of(tmp_path / "save")


def test_what_is_not_an_image_is_refused(tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(b"junk" * 100)
    with pytest.raises(BadImage, match="is not a tar archive"):
        plan_of(tmp_path / "junk")
    with pytest.raises(BadImage, match="no such file or directory"):
        plan_of(tmp_path / "absent")
