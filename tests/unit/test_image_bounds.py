"""Images bounded before they are unpacked (bourse/images/bounds.py): each layer's cap is the
tightest of the image's max_image_mb left, its ratio (or its recorded size), a cache's
budget left; a layer is read a bounded step at a time and stops the moment it passes its
cap (a bomb is never read to the end); ``scan`` checks a layer's entries as a worker would
refuse them and counts its uncompressed size; a directory built into a layer is checked
as it is written."""

from __future__ import annotations

import gzip
import io
import os
import re
import tarfile
from pathlib import Path

import pytest

from bourse.images.bounds import MIB, Bounds, Cap, ImageTooBig, Tally
from bourse.images.build import write_layer
from bourse.images.errors import DigestMismatch, UnsafeEntry
from bourse.images.unpack import LayerFile, scan, unpack
from tests.images import bomb
from tests.unit.test_oci_unpack import E, d, layer, sym, tar_bytes

SMALL = Bounds(max_image_bytes=MIB)


@pytest.mark.parametrize(
    ("bounds", "room", "used", "compressed", "recorded", "cap", "why", "permanent"),
    [
        pytest.param(
            Bounds(), None, 0, 10 * MIB, None, 1000 * MIB,
            "more than 100 times its 10485760 bytes", True, id="ratio",
        ),
        pytest.param(
            Bounds(), None, 0, 1000, None, 64 * MIB,
            "more than 100 times its 1000 bytes", True, id="ratio-floor",
        ),
        pytest.param(
            SMALL, None, 300, 1000, None, MIB - 300,
            "max_image_mb 1 for the whole image, 300 bytes before it", True, id="image-left",
        ),
        pytest.param(
            Bounds(), None, 0, 1000, 5000, 5000,
            "its size recorded in the store", True, id="recorded",
        ),
        pytest.param(  # a record is bounded by its push: the ratio is not applied again
            Bounds(), None, 0, 1000, 200 * MIB, 200 * MIB,
            "its size recorded in the store", True, id="recorded-past-ratio",
        ),
        pytest.param(
            Bounds(), Cap(4000, "budget left", permanent=False), 1000, 1000, None, 3000,
            "budget left", False, id="room-left",
        ),
    ],
)  # fmt: skip
def test_a_layers_cap_is_the_tightest_and_says_why(
    bounds: Bounds,
    room: Cap | None,
    used: int,
    compressed: int,
    recorded: int | None,
    cap: int,
    why: str,
    permanent: bool,
) -> None:
    tally = Tally(bounds, room)
    tally.used = used
    assert tally.cap(compressed, recorded) == Cap(cap, why, permanent)


def test_a_tally_counts_an_images_layers_and_refuses_the_one_past_its_cap() -> None:
    tally = Tally(SMALL)
    tally.add("sha256:a", 100, 600_000)
    tally.add("sha256:b", 100, 400_000)
    with pytest.raises(ImageTooBig) as refused:
        tally.add("sha256:c", 100, 48_577)  # one byte past the MiB
    assert str(refused.value) == (
        "image_too_big: layer sha256:c passed 48576 bytes unpacked (max_image_mb 1 for the "
        "whole image, 1000000 bytes before it)"
    )
    assert refused.value.permanent and tally.used == 1_000_000


class Consumed(io.BytesIO):
    """A layer's bytes that count how many of them a reader took."""

    taken = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.taken += len(data)
        return data


def test_a_3_mb_bomb_is_refused_within_a_bounded_amount_of_work() -> None:
    built, data = bomb()
    assert len(data) < 3_100_000  # ~3 MB of gzip that would unpack to 2.86 GiB
    raw = Consumed(data)
    tally = Tally(SMALL)
    with pytest.raises(ImageTooBig) as refused:
        scan(raw, built.descriptor.digest, tally.cap(len(data)), verify=False)
    assert refused.value.layer == built.descriptor.digest
    assert refused.value.cap.bytes == MIB
    # stopped past a MiB unpacked: a few gzip reads in, never to the end
    assert raw.taken < len(data) // 20, raw.taken


def test_without_a_small_max_image_a_bombs_ratio_stops_it() -> None:
    built, data = bomb(chunks=8)  # 128 KB of gzip, 128 MiB of zeros
    raw = Consumed(data)
    with pytest.raises(ImageTooBig) as refused:
        scan(raw, built.descriptor.digest, Tally(Bounds()).cap(len(data)), verify=False)
    assert refused.value.cap == Bounds().ratio(len(data))
    assert refused.value.cap.bytes == 64 * MIB  # the floor: 100 times 128 KB is less
    assert raw.taken < len(data) * 3 // 4, raw.taken


def test_unpacking_a_bomb_stops_at_its_cap_and_writes_no_more(tmp_path: Path) -> None:
    built, data = bomb(chunks=4)
    path = tmp_path / "bomb.layer"
    path.write_bytes(data)
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(ImageTooBig, match="passed 1048576 bytes unpacked"):
        unpack(root, [LayerFile(path, built.descriptor.digest, built.diff_id)], Tally(SMALL))
    assert (root / "bomb").stat().st_size < MIB  # the caller removes it


def test_a_layer_past_its_recorded_size_is_refused_at_it(tmp_path: Path) -> None:
    f = layer(tmp_path, [E("a", data=b"x" * 5000)])
    size = len(tar_bytes([E("a", data=b"x" * 5000)]))
    lied = LayerFile(f.path, f.digest, f.diff_id, recorded=size - 1)
    with pytest.raises(ImageTooBig, match=r"\(its size recorded in the store\)"):
        unpack(tmp_path / "r1", [lied], Tally(Bounds()))
    told = LayerFile(f.path, f.digest, f.diff_id, recorded=size)
    tally = Tally(Bounds())
    (tmp_path / "r2").mkdir()
    unpack(tmp_path / "r2", [told], tally)
    assert tally.used == size and (tmp_path / "r2" / "a").read_bytes() == b"x" * 5000


def test_a_scan_counts_the_uncompressed_tar_and_checks_the_digest(tmp_path: Path) -> None:
    entries = [d("app"), E("app/run", data=os.urandom(3000)), sym("app/lib", "/usr/lib")]
    f = layer(tmp_path, entries)
    plain = tar_bytes(entries)
    assert scan(io.BytesIO(f.path.read_bytes()), f.digest, Bounds().ratio(1)) == len(plain)
    other = gzip.compress(tar_bytes([E("x")]), mtime=0)
    with pytest.raises(DigestMismatch, match="the layer's bytes have digest sha256:"):
        scan(io.BytesIO(other), f.digest, Bounds().ratio(1))
    bare = layer(tmp_path, entries, compress=False)
    with bare.path.open("rb") as raw:
        assert scan(raw, bare.digest, Cap(len(plain), "")) == len(plain)


@pytest.mark.parametrize(
    ("entry", "says"),
    [
        pytest.param(E("../x"), "its name '../x' has a '..' component", id="dotdot"),
        pytest.param(E("/etc/x"), "its name '/etc/x' is an absolute path", id="absolute"),
        pytest.param(sym("a", "../../x"), "symlink to '../../x' escapes the root", id="symlink"),
        pytest.param(E("sda", tarfile.BLKTYPE), "a block device node is not allowed", id="blk"),
        pytest.param(E("tty", tarfile.CHRTYPE), "a character device node", id="chr"),
        pytest.param(E("h", tarfile.LNKTYPE, link="/etc/passwd"), "absolute path", id="hard"),
    ],
)
def test_a_scan_refuses_what_a_worker_would_refuse(tmp_path: Path, entry: E, says: str) -> None:
    f = layer(tmp_path, [E("ok"), entry])
    with f.path.open("rb") as raw, pytest.raises(UnsafeEntry, match=says):
        scan(raw, f.digest, Bounds().ratio(1))


def test_a_sparse_file_is_refused(tmp_path: Path) -> None:
    """A GNU sparse entry: a few bytes of tar that would unpack to a file of a GiB."""
    info = tarfile.TarInfo("sparse")
    info.type, info.size = tarfile.GNUTYPE_SPARSE, 0
    raw = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    raw[483:495] = b"%011o\0" % (1 << 30)  # the header's realsize: a GiB
    raw[148:156] = b"%06o\0 " % (sum(raw[:148]) + 8 * 32 + sum(raw[156:]))  # its checksum
    data = bytes(raw) + bytes(1024)
    with pytest.raises(UnsafeEntry, match="a sparse file is not allowed in a layer"):
        scan(io.BytesIO(data), "sha256:" + "0" * 64, Bounds().ratio(1), verify=False)


def test_a_directory_is_checked_as_it_is_built(tmp_path: Path) -> None:
    top = tmp_path / "app"
    top.mkdir()
    (top / "run").write_bytes(b"#!/bin/sh\n")
    out = io.BytesIO()
    built = write_layer(top, out)
    assert built.unpacked == len(gzip.decompress(out.getvalue())) == 10240  # a tar record
    (top / "escape").symlink_to("../../etc")
    with pytest.raises(UnsafeEntry, match=re.escape("symlink to '../../etc' escapes the root")):
        write_layer(top, io.BytesIO())
    (top / "escape").unlink()
    (top / "zeros").write_bytes(bytes(2 * MIB))
    with pytest.raises(ImageTooBig, match=f"layer of directory {top} passed 1048576 bytes"):
        write_layer(top, io.BytesIO(), max_bytes=SMALL.left(0))
