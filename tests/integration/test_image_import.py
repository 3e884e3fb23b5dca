"""Importing what the real tools write, on a real nats-server with JetStream: an OCI layout
made by umoci from a busybox root (four layers: a whiteout and an opaque directory among
them), skopeo's oci-archive and docker-archive of it, and an older-format docker save
written here by hand. Each is pulled into a cache, and the root must be what umoci's own
unpack gives (setuid and setgid bits aside: dropped here)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bourse.images import BadImage, ImageCache, ImageStore, Limits, Reference
from tests.market import Market

PACKAGES = {"umoci": "umoci", "skopeo": "skopeo", "busybox": "busybox-static"}


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"needs {name} (Debian package {PACKAGES[name]})")
    return found


def run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """umoci's layout ``L:bb`` and its unpacked rootfs; skopeo's two archives of it."""
    umoci, skopeo = tool("umoci"), tool("skopeo")
    top = tmp_path_factory.mktemp("tools")
    root = top / "root"
    for d in ("bin", "etc", "opt/old", "tmp", "usr/bin"):
        (root / d).mkdir(parents=True)
    shutil.copy(tool("busybox"), root / "bin/busybox")
    (root / "bin/sh").symlink_to("busybox")
    (root / "bin/ls").symlink_to("busybox")
    (root / "etc/hostname").write_text("box\n")
    (root / "opt/old/a").write_text("a\n")
    (root / "tmp").chmod(0o1777)
    (root / "usr/bin/suid").write_text("s\n")
    (root / "usr/bin/suid").chmod(0o4755)
    (top / "motd").write_text("hello\n")
    (top / "newopt/new").mkdir(parents=True)
    (top / "newopt/new/n").write_text("n\n")
    layout = top / "layout"
    run(umoci, "init", "--layout", str(layout))
    image = f"{layout}:bb"
    run(umoci, "new", "--image", image)
    run(umoci, "insert", "--image", image, str(root), "/")
    run(umoci, "insert", "--image", image, str(top / "motd"), "/etc/motd")
    run(umoci, "insert", "--image", image, "--whiteout", "/bin/ls")
    run(umoci, "insert", "--image", image, "--opaque", str(top / "newopt"), "/opt")
    run(umoci, "config", "--image", image, "--config.cmd", "/bin/sh", "--config.env", "A=1")
    rootless = [] if os.geteuid() == 0 else ["--rootless"]
    run(umoci, "unpack", *rootless, "--image", image, str(top / "bundle"))
    run(skopeo, "copy", f"oci:{image}", f"oci-archive:{top / 'image.oci.tar'}")
    run(skopeo, "copy", f"oci:{image}", f"docker-archive:{top / 'docker.tar'}:bb:latest")
    return {
        "layout": layout,
        "rootfs": top / "bundle/rootfs",
        "oci-archive": top / "image.oci.tar",
        "docker-archive": top / "docker.tar",
    }


@pytest.fixture
async def store(market: Market) -> AsyncIterator[ImageStore]:
    yield await ImageStore.open(await market.connect("images"), market.subjects.prefix)


def listing(top: Path) -> list[tuple[str, str, int, str]]:
    """Each path: its kind, its mode without setuid/setgid, and its content or target."""
    rows = []
    for path in sorted(top.rglob("*")):
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            kind, what = "link", os.readlink(path)
        elif stat.S_ISDIR(st.st_mode):
            kind, what = "dir", ""
        else:
            kind, what = "file", hashlib.sha256(path.read_bytes()).hexdigest()
        mode = stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)
        rows.append((str(path.relative_to(top)), kind, mode, what))
    return rows


async def pulled(store: ImageStore, digest: str, tmp_path: Path) -> Path:
    cache = ImageCache.open(tmp_path / "cache", store, Limits(budget_bytes=1 << 30))
    return await cache.prepare(digest)


def index_digest(layout: Path) -> str:
    index = json.loads((layout / "index.json").read_text())
    return str(index["manifests"][0]["digest"])


async def test_umocis_layout_imports_and_unpacks_as_umoci_does(
    store: ImageStore, made: dict[str, Path], tmp_path: Path
) -> None:
    pushed = await store.import_image(made["layout"], "busybox:umoci")
    assert pushed.digest == index_digest(made["layout"])
    assert pushed.layers == 4 and pushed.note.endswith("the only manifest")
    info = await store.inspect("busybox:umoci")
    assert (info.cmd, info.env) == (("/bin/sh",), ("A=1",))
    root = await pulled(store, pushed.digest, tmp_path)
    assert listing(root) == listing(made["rootfs"])
    assert not (root / "bin/ls").exists() and not (root / "opt/old").exists()
    assert stat.S_IMODE((root / "usr/bin/suid").stat().st_mode) == 0o755  # setuid dropped
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777


@pytest.mark.parametrize("form", ["oci-archive", "docker-archive"])
async def test_skopeos_archives_import_to_the_same_image(
    store: ImageStore, made: dict[str, Path], tmp_path: Path, form: str
) -> None:
    layout = await store.import_image(made["layout"], "busybox:layout")
    pushed = await store.import_image(made[form], f"busybox:{form}")
    expected = await store.inspect("busybox:layout")
    info = await store.inspect(f"busybox:{form}")
    if form == "oci-archive":  # the same bytes: the same manifest
        assert pushed.digest == layout.digest
    else:  # docker's layers are uncompressed tars around the same config
        assert info.config_digest == expected.config_digest
        assert pushed.note.endswith("docker save image docker.io/library/bb:latest")
    root = await pulled(store, pushed.digest, tmp_path)
    assert listing(root) == listing(made["rootfs"])


async def test_a_layout_of_two_images_takes_the_one_named(
    store: ImageStore, made: dict[str, Path], tmp_path: Path
) -> None:
    layout = tmp_path / "two"
    shutil.copytree(made["layout"], layout)
    run(tool("umoci"), "tag", "--image", f"{layout}:bb", "other")
    run(tool("umoci"), "config", "--image", f"{layout}:other", "--config.cmd", "/bin/true")
    with pytest.raises(BadImage, match=r"2 manifests and no single linux/amd64 one: bb \("):
        await store.import_image(layout, "two")
    pushed = await store.import_image(layout, "two", pick="other")
    assert pushed.note.endswith("named 'other'")
    assert (await store.inspect(Reference("two", "", pushed.digest))).cmd == ("/bin/true",)


def old_docker_save(root: Path, path: Path) -> None:
    """``docker save`` as Docker before 25 wrote it: ``<id>/layer.tar`` (uncompressed),
    ``<id>/json``, ``<id>/VERSION``, the config as ``<hex>.json``, ``manifest.json`` and
    ``repositories``."""
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as tar:
        for item in sorted(root.rglob("*")):
            tar.add(item, arcname=str(item.relative_to(root)), recursive=False)
    diff_id = hashlib.sha256(layer.getvalue()).hexdigest()
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Cmd": ["/bin/sh", "-c", "echo hi"], "Env": ["PATH=/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        }
    ).encode()
    image_id = hashlib.sha256(config).hexdigest()
    files = {
        f"{diff_id}/layer.tar": layer.getvalue(),
        f"{diff_id}/json": b'{"id": "' + diff_id.encode() + b'"}',
        f"{diff_id}/VERSION": b"1.0",
        f"{image_id}.json": config,
        "manifest.json": json.dumps(
            [
                {
                    "Config": f"{image_id}.json",
                    "RepoTags": ["hand:made"],
                    "Layers": [f"{diff_id}/layer.tar"],
                }
            ]
        ).encode(),
        "repositories": json.dumps({"hand": {"made": diff_id}}).encode(),
    }
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


async def test_an_older_docker_save_written_by_hand_imports(
    store: ImageStore, made: dict[str, Path], tmp_path: Path
) -> None:
    old_docker_save(made["rootfs"], tmp_path / "save.tar")
    pushed = await store.import_image(tmp_path / "save.tar", "hand:made")
    assert pushed.note.endswith("docker save image hand:made")
    info = await store.inspect("hand:made")
    assert (info.cmd, info.env) == (("/bin/sh", "-c", "echo hi"), ("PATH=/bin",))
    root = await pulled(store, pushed.digest, tmp_path)
    assert listing(root) == listing(made["rootfs"])
