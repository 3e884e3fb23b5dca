"""A root's inventory (bourse/images/inventory.py): taken from what the unpacker wrote (a
file it did not write is refused), every change made through the filesystem seen by a walk
that reads no file (changed, added, removed, chmod'ed, replaced, relinked), bytes changed
below the filesystem seen by the hasher, in steps of any size."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from bourse.images.errors import BadImage
from bourse.images.inventory import (
    FIFO,
    FILE,
    LINK,
    SHOWN,
    Hasher,
    Inventory,
    changed,
    decode,
    digest_of,
    encode,
    take,
    walk_check,
)
from bourse.images.unpack import unpack
from tests.unit.test_oci_unpack import E, d, hard, layer, sym

INDEX = b"<h1>bob's page</h1>\n"


def _unpacked(tmp_path: Path) -> tuple[Path, Inventory]:
    """A root of two layers (a file replaced by the second, a hard link, a symlink, a FIFO,
    a whiteout) and its inventory as the cache takes it."""
    base = layer(
        tmp_path,
        [
            d("www"),
            E("www/index.html", data=b"old page\n"),
            E("www/gone.txt", data=b"whited out\n"),
            E("bin/tool", data=os.urandom(5000), mode=0o755),
            hard("bin/tool-again", "bin/tool"),
            sym("bin/sh", "/bin/tool"),
            E("run/pipe", tarfile.FIFOTYPE, mode=0o600),
        ],
    )
    top = layer(tmp_path, [E("www/index.html", data=INDEX), E("www/.wh.gone.txt")])
    root = tmp_path / "root"
    root.mkdir()
    written = unpack(root, [base, top])
    return root, take(root, written).inventory


def test_an_inventory_lists_what_the_layers_wrote_with_each_files_digest(
    tmp_path: Path,
) -> None:
    root, inventory = _unpacked(tmp_path)
    paths = [e.path for e in inventory.entries]
    assert paths == [
        b"",
        b"bin",
        b"bin/sh",
        b"bin/tool",
        b"bin/tool-again",
        b"run",
        b"run/pipe",
        b"www",
        b"www/index.html",
    ]
    by_path = {e.path: e for e in inventory.entries}
    index = by_path[b"www/index.html"]
    assert (index.kind, index.size) == (FILE, len(INDEX))
    assert index.sha256 == hashlib.sha256(INDEX).hexdigest()
    tool = (root / "bin/tool").read_bytes()
    assert by_path[b"bin/tool"].sha256 == hashlib.sha256(tool).hexdigest()
    assert by_path[b"bin/tool-again"].sha256 == by_path[b"bin/tool"].sha256
    assert by_path[b"bin/tool"].mode == 0o755
    assert (by_path[b"bin/sh"].kind, by_path[b"bin/sh"].target) == (LINK, b"/bin/tool")
    assert by_path[b"run/pipe"].kind == FIFO
    assert changed(root, inventory) == []
    assert decode(encode(inventory), "here") == inventory


def test_a_root_holding_a_file_its_layers_did_not_write_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    written = unpack(root, [layer(tmp_path, [E("a.txt", data=b"a")])])
    (root / "extra.txt").write_bytes(b"slipped in")
    with pytest.raises(BadImage, match=re.escape("holds /extra.txt (10 bytes), which its layers")):
        take(root, written)
    (root / "extra.txt").unlink()
    (root / "a.txt").write_bytes(b"longer now")  # the same inode, another size
    with pytest.raises(BadImage, match=re.escape("holds /a.txt (10 bytes)")):
        take(root, written)


def _rewrite_same_size(root: Path) -> None:
    (root / "www/index.html").write_bytes(INDEX.replace(b"bob", b"eve"))


def _replace_same_bytes(root: Path) -> None:
    shutil.copy2(root / "www/index.html", root / "copy")
    os.rename(root / "copy", root / "www/index.html")


def _relink(root: Path) -> None:
    (root / "bin/sh").unlink()
    (root / "bin/sh").symlink_to("/bin/evil")


TAMPERINGS: list[tuple[str, Callable[[Path], None], str]] = [
    ("rewrite", _rewrite_same_size, "/www/index.html: changed since it was unpacked"),
    ("grow", lambda r: (r / "www/index.html").write_bytes(b"TAMPERED"), "/www/index.html: 20"),
    ("add", lambda r: (r / "www/new.html").write_bytes(b"x"), "/www/new.html: not in the image"),
    ("chmod", lambda r: (r / "bin/tool").chmod(0o4777), "/bin/tool: mode 0755 is now 4777"),
    ("remove", lambda r: (r / "bin/tool-again").unlink(), "/bin/tool-again: removed"),
    ("replace", _replace_same_bytes, "/www/index.html: replaced (another inode)"),
    ("relink", _relink, "/bin/sh: its link target changed"),
    ("mkdir", lambda r: (r / "www/sub").mkdir(), "/www/sub: not in the image"),
]


@pytest.mark.parametrize(("how", "tamper", "said"), TAMPERINGS, ids=[t[0] for t in TAMPERINGS])
def test_a_walk_sees_every_change_made_through_the_filesystem(
    tmp_path: Path, how: str, tamper: Callable[[Path], None], said: str
) -> None:
    root, inventory = _unpacked(tmp_path)
    tamper(root)
    differences = changed(root, inventory)
    assert any(x.startswith(said) for x in differences), differences


def test_a_walk_says_a_few_differences_and_counts_the_rest(tmp_path: Path) -> None:
    root, inventory = _unpacked(tmp_path)
    for i in range(SHOWN + 4):
        (root / f"added-{i}").write_bytes(b"")
    differences = changed(root, inventory)
    assert len(differences) == SHOWN + 1 and differences[-1] == "and 5 more"  # / too


def _altered(inventory: Inventory, path: bytes) -> Inventory:
    """The inventory as if ``path``'s bytes had been others when it was taken: what a walk
    cannot tell from bytes changed below the filesystem (a disk that rots)."""
    entries = [
        msgspec.structs.replace(e, sha256="0" * 64) if e.path == path else e
        for e in inventory.entries
    ]
    return Inventory(entries)


@pytest.mark.parametrize("step", [7, 4096, 1 << 20])
def test_the_hasher_finds_bytes_a_walk_cannot_see_in_steps_of_any_size(
    tmp_path: Path, step: int
) -> None:
    root, inventory = _unpacked(tmp_path)
    hasher = Hasher(root, inventory.files())
    while not hasher.done:
        assert hasher.step(step) <= max(step, 1)
    assert hasher.findings() == []
    assert hasher.read == len(INDEX) + 5000  # the hard-linked tool read once

    rotten = _altered(inventory, b"bin/tool-again")
    assert changed(root, rotten) == []
    hasher = Hasher(root, rotten.files())
    while not hasher.done:
        hasher.step(step)
    assert hasher.findings() == ["/bin/tool-again: its bytes are not the image's"]


def test_the_hasher_reads_no_link_put_in_a_files_place(tmp_path: Path) -> None:
    root, inventory = _unpacked(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(INDEX)
    (root / "www/index.html").unlink()
    (root / "www/index.html").symlink_to(secret)
    hasher = Hasher(root, inventory.files())
    while not hasher.done:
        hasher.step()
    [finding] = hasher.findings()
    assert finding.startswith("/www/index.html: cannot be read"), finding
    assert hasher.read == 5000  # the tool only


def test_an_inventory_file_is_checked_against_the_digest_its_record_keeps(
    tmp_path: Path,
) -> None:
    root, inventory = _unpacked(tmp_path)
    stored = tmp_path / "root.files"
    stored.write_bytes(encode(inventory))
    digest = digest_of(stored.read_bytes())
    assert walk_check(root, stored, digest) == (inventory, [])
    # an inventory rewritten to match a tampered root is not the recorded one
    (root / "www/new.html").write_bytes(b"x")
    stored.write_bytes(encode(Inventory([])))
    assert walk_check(root, stored, digest) == (
        None,
        ["its inventory is not the one its record names"],
    )
    stored.unlink()
    assert walk_check(root, stored, digest)[1] == [
        "its inventory cannot be read (No such file or directory)"
    ]
