"""Unpacking layers into a root: each unsafe entry kind refused naming the entry; symlinks
of any layer never lead a later entry out; whiteouts in layer order; setuid and setgid
dropped; nothing read from a layer whose bytes do not match its digest (I7)."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from bourse.images.errors import BadImage, DigestMismatch, UnsafeEntry
from bourse.images.unpack import LayerFile, unpack


@dataclass(frozen=True)
class E:
    """One tar entry of a test layer."""

    name: str
    type: bytes = tarfile.REGTYPE
    data: bytes = b""
    mode: int = 0o644
    link: str = ""
    uid: int = 0
    gid: int = 0


def d(name: str, mode: int = 0o755) -> E:
    return E(name, tarfile.DIRTYPE, mode=mode)


def sym(name: str, target: str) -> E:
    return E(name, tarfile.SYMTYPE, link=target, mode=0o777)


def hard(name: str, target: str) -> E:
    return E(name, tarfile.LNKTYPE, link=target)


def tar_bytes(entries: list[E]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry.name)
            info.type, info.mode, info.linkname = entry.type, entry.mode, entry.link
            info.uid, info.gid, info.mtime = entry.uid, entry.gid, 1_000_000
            info.size = len(entry.data)
            tar.addfile(info, io.BytesIO(entry.data) if entry.type == tarfile.REGTYPE else None)
    return buf.getvalue()


def layer(tmp: Path, entries: list[E], compress: bool = True) -> LayerFile:
    plain = tar_bytes(entries)
    data = gzip.compress(plain, mtime=0) if compress else plain
    path = tmp / f"layer-{hashlib.sha256(data).hexdigest()[:12]}"
    path.write_bytes(data)
    return LayerFile(path, _digest(data), _digest(plain))


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "box" / "root"  # tmp_path/box is "outside": nothing may land there
    path.mkdir(parents=True)
    return path


def tree(root: Path) -> list[str]:
    """Every path under ``root``, sorted, symlinks with their target."""
    out = []
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        out.append(f"{rel} -> {os.readlink(path)}" if path.is_symlink() else rel)
    return out


@pytest.mark.parametrize(
    ("entries", "entry", "says"),
    [
        pytest.param([E("/etc/passwd")], "/etc/passwd", "is an absolute path", id="absolute"),
        pytest.param([E("../evil")], "../evil", "has a '..' component", id="dotdot"),
        pytest.param([E("a/../../evil")], "a/../../evil", "'..' component", id="dotdot-inside"),
        pytest.param(
            [sym("link", "../../etc")], "link", "symlink to '../../etc' escapes", id="symlink"
        ),
        pytest.param(
            [d("a"), sym("a/up", "../../x")], "a/up", "escapes the root", id="symlink-deep"
        ),
        pytest.param([sym("empty", "")], "empty", "symlink to '' escapes", id="symlink-empty"),
        pytest.param(
            [hard("h", "/etc/passwd")],
            "h",
            "its hard link target '/etc/passwd' is an absolute path",
            id="hardlink-absolute",
        ),
        pytest.param([hard("h", "../../etc/passwd")], "h", "'..' component", id="hardlink-dotdot"),
        pytest.param([hard("h", "nothing")], "h", "no such file before it", id="hardlink-missing"),
        pytest.param([d("dir"), hard("h", "dir")], "h", "no such file", id="hardlink-to-dir"),
        pytest.param([E("tty", tarfile.CHRTYPE)], "tty", "character device node", id="char-device"),
        pytest.param([E("sda", tarfile.BLKTYPE)], "sda", "block device node", id="block-device"),
        pytest.param([E(".wh..")], ".wh..", "a whiteout of '.'", id="whiteout-self"),
        pytest.param([E("a/.wh...")], "a/.wh...", "a whiteout of '..'", id="whiteout-parent"),
        pytest.param([E("f"), E("f/x")], "f/x", "f is not a directory", id="parent-is-a-file"),
        pytest.param(
            [sym("a", "b"), sym("b", "a"), E("a/x")],
            "a/x",
            "too many levels of symbolic links",
            id="symlink-loop",
        ),
    ],
)
def test_an_unsafe_entry_is_refused_naming_it(
    tmp_path: Path, root: Path, entries: list[E], entry: str, says: str
) -> None:
    with pytest.raises(UnsafeEntry, match=re.escape(says)) as caught:
        unpack(root, [layer(tmp_path, entries)])
    assert caught.value.entry == entry
    assert sorted(p.name for p in root.parent.iterdir()) == ["root"]  # nothing outside


def test_symlinks_of_earlier_layers_resolve_inside_the_root(tmp_path: Path, root: Path) -> None:
    """An absolute symlink means the root's path; one that redirects an earlier directory
    to '/../..' still leads inside: later entries land under the root, never beside it."""
    layers = [
        layer(tmp_path, [d("usr"), d("usr/etc"), sym("etc", "/usr/etc"), d("d")]),
        layer(tmp_path, [sym("d", "/../../outside"), sym("top", "/")]),
        layer(tmp_path, [E("etc/conf", data=b"c"), E("d/escape", data=b"e"), E("top/t")]),
    ]
    unpack(root, layers)
    assert (root / "usr/etc/conf").read_bytes() == b"c"
    assert (root / "outside/escape").read_bytes() == b"e"
    assert (root / "t").is_file()
    assert sorted(p.name for p in root.parent.iterdir()) == ["root"]


def test_whiteouts_remove_what_lower_layers_left_in_layer_order(tmp_path: Path, root: Path) -> None:
    layers = [
        layer(
            tmp_path,
            [
                d("a"),
                E("a/1"),
                E("a/2"),
                d("b"),
                E("b/x"),
                d("o"),
                E("o/old"),
                d("o/sub"),
                E("o/sub/old2"),
                E("keep"),
            ],
        ),
        layer(
            tmp_path,
            # same-layer entries stay: o/early before the opaque marker, c with its whiteout
            [
                E(".wh.b"),
                E("a/.wh.1"),
                E("o/early"),
                E("o/.wh..wh..opq"),
                d("o/sub"),
                E("o/sub/new2"),
                E("c"),
                E(".wh.c"),
                E(".wh.missing"),
            ],
        ),
        layer(tmp_path, [E("b/again")]),  # a later layer may bring the name back
    ]
    unpack(root, layers)
    assert tree(root) == [
        *("a", "a/2", "b", "b/again", "c", "keep"),
        *("o", "o/early", "o/sub", "o/sub/new2"),
    ]


def test_setuid_and_setgid_are_dropped_and_the_sticky_bit_kept(tmp_path: Path, root: Path) -> None:
    entries = [
        E("su", mode=0o4755),
        E("sg", mode=0o2755),
        d("shared", 0o2775),
        d("tmp", 0o1777),
        E("fifo", tarfile.FIFOTYPE, mode=0o640),  # FIFOs are kept: a pipe is harmless
    ]
    unpack(root, [layer(tmp_path, entries)])
    modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in root.iterdir()}
    assert modes == {"su": 0o755, "sg": 0o755, "shared": 0o775, "tmp": 0o1777, "fifo": 0o640}
    assert stat.S_ISFIFO((root / "fifo").lstat().st_mode)


def test_entries_replace_each_other_across_layers(tmp_path: Path, root: Path) -> None:
    layers = [
        layer(tmp_path, [d("x"), E("x/inner"), E("y", data=b"file"), sym("z", "y")]),
        layer(tmp_path, [E("x", data=b"now a file"), d("y"), E("z", data=b"no link")]),
    ]
    unpack(root, layers)
    assert (root / "x").read_bytes() == b"now a file"
    assert (root / "y").is_dir() and not (root / "z").is_symlink()


def test_links_directories_and_owners_come_out_as_the_tar_says(tmp_path: Path, root: Path) -> None:
    entries = [
        d("ro", 0o555),
        E("ro/file", data=b"x", mode=0o444, uid=1234, gid=5678),
        hard("ro/twin", "ro/file"),
        sym("ro/abs", "/ro/file"),
        E("implicit/parent/file"),  # parents the tar does not list are made
    ]
    unpack(root, [layer(tmp_path, entries, compress=False)])  # an uncompressed layer too
    st = (root / "ro/file").lstat()
    assert (st.st_ino, st.st_nlink) == ((root / "ro/twin").lstat().st_ino, 2)
    assert os.readlink(root / "ro/abs") == "/ro/file"
    assert stat.S_IMODE((root / "ro").stat().st_mode) == 0o555  # set once it is filled
    assert stat.S_IMODE((root / "implicit").stat().st_mode) == 0o755
    assert int((root / "ro/file").stat().st_mtime) == 1_000_000
    if os.geteuid() == 0:  # only root may give files away
        assert (st.st_uid, st.st_gid) == (1234, 5678)


def test_nothing_is_read_from_a_layer_whose_bytes_do_not_match(tmp_path: Path, root: Path) -> None:
    good = layer(tmp_path, [E("planted", data=b"x")])
    bad = LayerFile(good.path, "sha256:" + "0" * 64, good.diff_id)
    with pytest.raises(DigestMismatch, match="nothing unpacked") as caught:
        unpack(root, [bad])
    assert caught.value.digest == bad.digest
    assert tree(root) == []


def test_a_tar_that_is_not_the_config_diff_id_is_refused(tmp_path: Path, root: Path) -> None:
    good = layer(tmp_path, [E("f")])
    with pytest.raises(DigestMismatch, match="the config says sha256:1111"):
        unpack(root, [LayerFile(good.path, good.digest, "sha256:" + "1" * 64)])


@pytest.mark.parametrize(
    ("data", "error", "says"),
    [
        (b"\x28\xb5\x2f\xfd" + b"\0" * 64, BadImage, "is zstd-compressed"),
        (b"not a tar at all" * 64, BadImage, "is not a readable tar"),
        (gzip.compress(b"x" * 1024, mtime=0)[:-20], BadImage, "is not a readable tar"),
    ],
)
def test_a_layer_that_cannot_be_read_is_refused(
    tmp_path: Path, root: Path, data: bytes, error: type[Exception], says: str
) -> None:
    path = tmp_path / "layer"
    path.write_bytes(data)
    with pytest.raises(error, match=says):
        unpack(root, [LayerFile(path, _digest(data), _digest(data))])


def test_a_tar_ending_right_after_its_last_data_is_read_whole(tmp_path: Path, root: Path) -> None:
    """umoci writes layers without the last entry's padding or the end-of-archive blocks."""
    full = tar_bytes([E("a", data=b"first"), E("b", data=b"xy")])
    cut = full[: 3 * 512 + 2]  # a's header and block, b's header, b's two bytes
    path = tmp_path / "layer"
    path.write_bytes(cut)
    unpack(root, [LayerFile(path, _digest(cut), _digest(cut))])
    assert (root / "a").read_bytes() == b"first" and (root / "b").read_bytes() == b"xy"
    short = full[: 3 * 512 + 1]  # b's data itself cut short: refused
    path.write_bytes(short)
    (tmp_path / "again").mkdir()
    with pytest.raises(BadImage, match="is not a readable tar: unexpected end of data"):
        unpack(tmp_path / "again", [LayerFile(path, _digest(short), _digest(short))])
