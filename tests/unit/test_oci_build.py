"""A directory as a one-layer image: the same tree gives the same digests, whatever its
files' times or where it lies; the layer's tar is sorted with numeric owners; the config
carries the layer's diff_id and what to run; unpacking it gives the tree back."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import socket
import stat
import tarfile
from pathlib import Path

import pytest

from bourse.images.build import Documents, Layer, RunSpec, documents, write_layer
from bourse.images.errors import BadImage
from bourse.images.oci import OCI_LAYER_GZIP, decode_config, decode_manifest, sha256_digest
from bourse.images.unpack import LayerFile, unpack

RUN = RunSpec(
    cmd=("/bin/app", "--port", "80"),
    entrypoint=("/bin/tini", "--"),
    env=("A=1", "EMPTY="),
    workdir="/srv",
    user="1000:1000",
    architecture="amd64",
)


def make_tree(top: Path, mtime: int = 1_700_000_000) -> Path:
    (top / "bin").mkdir(parents=True)
    (top / "srv/data").mkdir(parents=True)
    (top / "bin/app").write_bytes(b"#!/bin/sh\necho hi\n")
    (top / "bin/app").chmod(0o755)
    (top / "srv/data/z.txt").write_text("zzz")
    (top / "srv/a.txt").write_text("aaa")
    os.link(top / "srv/a.txt", top / "srv/b-hardlink.txt")
    (top / "bin/sh").symlink_to("app")
    for path in [top, *top.rglob("*")]:
        os.utime(path, (mtime, mtime), follow_symlinks=False)
    return top


def build(top: Path, run: RunSpec = RUN, keep_mtime: bool = False) -> tuple[Layer, Documents]:
    out = io.BytesIO()
    layer = write_layer(top, out, keep_mtime=keep_mtime)
    blob = out.getvalue()
    assert (layer.descriptor.digest, layer.descriptor.size) == (sha256_digest(blob), len(blob))
    assert layer.diff_id == sha256_digest(gzip.decompress(blob))
    return layer, documents([layer], run)


def test_the_same_tree_gives_the_same_image_wherever_and_whenever(tmp_path: Path) -> None:
    first = build(make_tree(tmp_path / "one", mtime=1_000))
    second = build(make_tree(tmp_path / "elsewhere/two", mtime=2_000_000_000))
    assert first == second
    assert first[1].descriptor.digest == sha256_digest(first[1].manifest)


def test_keeping_mtimes_puts_them_in_the_digest(tmp_path: Path) -> None:
    early = build(make_tree(tmp_path / "a", mtime=1_000), keep_mtime=True)
    late = build(make_tree(tmp_path / "b", mtime=2_000), keep_mtime=True)
    assert early[0].diff_id != late[0].diff_id


def test_the_layer_is_a_sorted_tar_with_numeric_owners_and_time_zero(tmp_path: Path) -> None:
    top = make_tree(tmp_path / "t")
    out = io.BytesIO()
    write_layer(top, out)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(out.getvalue()))) as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == [
        "bin",
        "bin/app",
        "bin/sh",
        "srv",
        "srv/a.txt",
        "srv/b-hardlink.txt",
        "srv/data",
        "srv/data/z.txt",
    ]
    by = {m.name: m for m in members}
    assert by["srv/b-hardlink.txt"].islnk() and by["srv/b-hardlink.txt"].linkname == "srv/a.txt"
    assert by["bin/sh"].issym() and by["bin/sh"].linkname == "app"
    assert stat.S_IMODE(by["bin/app"].mode) == 0o755
    st = (top / "bin/app").stat()
    assert {(m.uid, m.gid, m.uname, m.gname, m.mtime) for m in members} == {
        (st.st_uid, st.st_gid, "", "", 0)
    }


def test_the_config_and_manifest_say_what_runs_and_name_the_layer(tmp_path: Path) -> None:
    layer, docs = build(make_tree(tmp_path / "t"))
    config = decode_config(docs.config, "config")
    assert config.rootfs.diff_ids == [layer.diff_id]
    assert (config.os, config.architecture, config.created) == ("linux", "amd64", None)
    run = config.config
    assert (run.cmd, run.entrypoint, run.env) == (
        list(RUN.cmd),
        list(RUN.entrypoint),
        list(RUN.env),
    )
    assert (run.working_dir, run.user) == ("/srv", "1000:1000")
    manifest = decode_manifest(docs.manifest, "manifest")
    assert manifest.config.digest == sha256_digest(docs.config)
    assert [x.media_type for x in manifest.layers] == [OCI_LAYER_GZIP]
    assert b'"Cmd":["/bin/app","--port","80"]' in docs.config  # Docker's names in the JSON
    assert docs.manifest.startswith(b'{"schemaVersion":2,"mediaType":')  # OCI requires both


def test_unpacking_the_layer_gives_the_tree_back(tmp_path: Path) -> None:
    top = make_tree(tmp_path / "t")
    path = tmp_path / "layer.tar.gz"
    with path.open("wb") as out:
        layer = write_layer(top, out, keep_mtime=True)
    root = tmp_path / "root"
    root.mkdir()
    unpack(root, [LayerFile(path, layer.descriptor.digest, layer.diff_id)])

    def listing(base: Path) -> list[tuple[str, int, int, str]]:
        rows = []
        for p in sorted(base.rglob("*")):
            st = p.lstat()
            what = (
                os.readlink(p)
                if p.is_symlink()
                else hashlib.sha256(p.read_bytes() if p.is_file() else b"").hexdigest()
            )
            rows.append((str(p.relative_to(base)), st.st_mode, int(st.st_mtime), what))
        return rows

    assert listing(root) == listing(top)
    assert (root / "srv/a.txt").stat().st_ino == (root / "srv/b-hardlink.txt").stat().st_ino


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"env": ("NOEQUALS",)}, "env 'NOEQUALS' is not KEY=VALUE"),
        ({"env": ("=v",)}, "env '=v' is not KEY=VALUE"),
        ({"env": ("A-B=1",)}, "is not KEY=VALUE"),
        ({"workdir": "srv"}, "workdir 'srv' is not an absolute path"),
    ],
)
def test_a_bad_run_spec_is_refused(kwargs: dict[str, object], says: str) -> None:
    with pytest.raises(BadImage, match=says):
        RunSpec(**kwargs)  # type: ignore[arg-type]


def test_a_socket_or_a_missing_directory_cannot_become_a_layer(tmp_path: Path) -> None:
    with pytest.raises(BadImage, match="is not a directory"):
        write_layer(tmp_path / "nope", io.BytesIO())
    (tmp_path / "t").mkdir()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "t/sock"))
        with pytest.raises(BadImage, match="t/sock: a device or socket cannot go into"):
            write_layer(tmp_path / "t", io.BytesIO())
