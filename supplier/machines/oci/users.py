"""Who a container's process runs as: the image's ``User`` read with the image's own
``/etc/passwd`` and ``/etc/group`` (pure), and those files read from an image root
without following a link out of it."""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from bourse.errors import BourseError

MAX_ID = 2**32 - 2  # the largest uid or gid (2**32 - 1 means "none" to the kernel)
# The image's /etc/passwd and /etc/group are read whole: more is no account file.
MAX_ETC_BYTES = 1 << 20


class UserError(BourseError, ValueError):
    """An image's user that cannot be resolved, or account files that cannot be read."""


# -- the user -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ExecUser:
    """Who the process runs as."""

    uid: int = 0
    gid: int = 0
    additional_gids: tuple[int, ...] = ()
    home: str = "/"


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    id: int
    gid: int = 0  # passwd: the primary group
    home: str = "/"
    members: tuple[str, ...] = ()  # group: its members


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _id(text: str, what: str) -> int:
    if not _number(text) or int(text) > MAX_ID:
        raise UserError(f"{what} {text!r} is not a number from 0 to {MAX_ID}")
    return int(text)


def _passwd(text: str) -> list[_Entry]:
    """``name:password:uid:gid:gecos:home:shell`` lines (others skipped, as libc does)."""
    out = []
    for line in text.splitlines():
        f = line.split(":")
        if len(f) >= 6 and _number(f[2]) and _number(f[3]):
            out.append(_Entry(f[0], int(f[2]), gid=int(f[3]), home=f[5] or "/"))
    return out


def _group(text: str) -> list[_Entry]:
    """``name:password:gid:member,member`` lines (others skipped)."""
    out = []
    for line in text.splitlines():
        f = line.split(":")
        if len(f) >= 4 and _number(f[2]):
            out.append(_Entry(f[0], int(f[2]), members=tuple(m for m in f[3].split(",") if m)))
    return out


def resolve_user(spec: str, passwd: str = "", group: str = "") -> ExecUser:
    """The image's ``User`` (``user[:group]``, each a name or a number; empty is root) read
    with the image's ``/etc/passwd`` and ``/etc/group`` text. A number not in passwd is
    still that uid (primary group 0, home ``/``); a name not there is an error."""
    user_part, _, group_part = spec.partition(":")
    users = _passwd(passwd)
    entry: _Entry | None
    if user_part == "" or _number(user_part):
        uid = _id(user_part or "0", "the image's user id")
        entry = next((e for e in users if e.id == uid), None)
    else:
        entry = next((e for e in users if e.name == user_part), None)
        if entry is None:
            raise UserError(f"user {user_part!r} is not in the image's /etc/passwd")
        uid = entry.id
    groups = _group(group)
    if group_part == "":
        gid = entry.gid if entry else 0
    elif _number(group_part):
        gid = _id(group_part, "the image's group id")
    else:
        named = next((g for g in groups if g.name == group_part), None)
        if named is None:
            raise UserError(f"group {group_part!r} is not in the image's /etc/group")
        gid = named.id
    extra: tuple[int, ...] = ()
    if entry is not None:
        extra = tuple(sorted({g.id for g in groups if entry.name in g.members} - {gid}))
    return ExecUser(uid, gid, extra, entry.home if entry else "/")


# -- files of an image root -----------------------------------------------------------------
def read_image_file(root: Path, relative: str) -> str:
    """A small text file of an image root, "" where it has none. No symbolic link is
    followed on the way (read from the host, one could lead out of the root): an image whose
    file is reached through one is an error naming it."""
    parts = [p for p in relative.split("/") if p]
    if not parts:
        raise UserError(f"{relative!r} names no file of the image")
    where = "/" + "/".join(parts)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            step = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = step
        leaf = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)  # a FIFO must not block
    except FileNotFoundError:
        return ""
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UserError(
                f"the image's {where} is reached through a symbolic link or a non-directory"
            ) from None
        raise UserError(f"cannot read the image's {where}: {exc.strerror}") from None
    finally:
        os.close(fd)
    with os.fdopen(leaf, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise UserError(f"the image's {where} is not a regular file")
        data = f.read(MAX_ETC_BYTES + 1)
    if len(data) > MAX_ETC_BYTES:
        raise UserError(f"the image's {where} is larger than {MAX_ETC_BYTES} bytes")
    return data.decode(errors="replace")


def image_files(root: Path) -> tuple[str, str]:
    """The image's ``/etc/passwd`` and ``/etc/group`` (to resolve its user by name)."""
    return read_image_file(root, "etc/passwd"), read_image_file(root, "etc/group")
