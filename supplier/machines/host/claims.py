"""What the suppliers of one host claim of it, so that no two take the same: a worker's port
range and its subnet, a machine's block of user ids.

One home for every kind of claim: a file per claim in a directory only root may read or
write (``BOURSE_CLAIMS_DIR``; default ``/run/bourse/claims`` for root, else a directory of
the user's own), read and written under one lock (``flock`` on ``.lock``). A claim names
its kind, its key (the range, the subnet, the block), its owner (a supplier's data dir,
hashed: supplier/machines/host/confine.py ``owner_of``) and its holder (a worker, a
machine), and whether the owner's machines use it (``held``).

A claim lasts while its owner holds it: while the owner's supplier runs (it holds
``owners/<owner>`` locked for its whole life: the kernel drops the lock when the process
ends, however it ends) or while the owner's data dir records machines that use it (``held``,
set by the owner as its machines come and go, and the data dir still there: the owner's
file names it). A claim neither is stale: another supplier may take the thing over. So a
supplier killed with machines running keeps their ports, subnet and user ids for its next
run, whoever starts meanwhile, and a supplier whose data dir was removed for good gives
them back.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from bourse.errors import BourseError

LOCK = ".lock"
OWNERS = "owners"
_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,128}")


class ClaimError(BourseError, RuntimeError):
    """The claims directory cannot be used (its path says why)."""


def default_directory() -> Path:
    """Where this host's claims are kept: root's in ``/run/bourse/claims`` (a tmpfs: a
    reboot ends every claim, as it ends every machine), another user's in a directory of
    its own; ``BOURSE_CLAIMS_DIR`` names another (each test session its own)."""
    given = os.environ.get("BOURSE_CLAIMS_DIR")
    if given:
        return Path(given)
    if os.geteuid() == 0:
        return Path("/run/bourse/claims")
    runtime = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(runtime) / f"bourse-claims-{os.geteuid()}"


@dataclass(frozen=True, slots=True)
class Claim:
    kind: str  # "ports", "uids", "subnet"
    key: str
    owner: str
    holder: str
    held: bool = False  # the owner's machines use it
    value: str = ""  # what the key stands for, as its kind writes it (a range, a subnet)


@cache
def host_claims() -> HostClaims:
    """This process's view of the host's claims (one: an owner's lock is held once)."""
    return HostClaims()


class HostClaims:
    """This host's claims (see the module doc), for one owner at a time."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or default_directory()
        self._alive: dict[str, int] = {}  # owner -> its lock's descriptor (while it runs)

    def _ready(self) -> None:
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            (self.directory / OWNERS).mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise ClaimError(f"cannot use the claims directory {self.directory}: {exc}") from None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One supplier of the host looks and claims at a time."""
        self._ready()
        fd = os.open(self.directory / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def live(self, owner: str, home: Path | None = None) -> None:
        """``owner``'s supplier runs (this process): its claims are its own while it does.
        ``home``: its data dir (its held claims last while it is there)."""
        if owner in self._alive:
            return
        self._ready()
        fd = os.open(self.directory / OWNERS / owner, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ClaimError(f"owner {owner} is served by another process already") from None
        if home is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, os.fsencode(home.absolute()), 0)
        self._alive[owner] = fd

    def gone(self, owner: str) -> None:
        """``owner``'s supplier stops: its claims last only while its machines hold them."""
        fd = self._alive.pop(owner, None)
        if fd is not None:
            os.close(fd)

    def _owner_runs(self, owner: str) -> bool:
        if owner in self._alive:
            return True
        try:
            fd = os.open(self.directory / OWNERS / owner, os.O_RDONLY)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def _home_gone(self, owner: str) -> bool:
        """Whether the owner's data dir, as its file names it, is gone for good (a held
        claim of a data dir removed while its supplier was away is stale)."""
        try:
            home = (self.directory / OWNERS / owner).read_bytes()
        except OSError:
            return False
        return bool(home) and not Path(os.fsdecode(home)).is_dir()

    def _path(self, kind: str, key: str) -> Path:
        if not (_KEY.fullmatch(kind) and _KEY.fullmatch(key)):
            raise ClaimError(f"not a claim: {kind}/{key}")
        return self.directory / f"{kind}.{key}.claim"

    def all(self, kind: str) -> list[Claim]:
        """Every claim of ``kind`` on the host, live or stale (call under :meth:`locked`)."""
        found = []
        for path in sorted(self.directory.glob(f"{kind}.*.claim")):
            with contextlib.suppress(OSError, ValueError, TypeError):
                found.append(Claim(**json.loads(path.read_bytes())))
        return found

    def standing(self, kind: str) -> list[Claim]:
        """The claims of ``kind`` that last (their owner runs, or its machines hold them);
        stale ones are removed (call under :meth:`locked`)."""
        kept = []
        for c in self.all(kind):
            if self._owner_runs(c.owner) or (c.held and not self._home_gone(c.owner)):
                kept.append(c)
            else:
                self.remove(kind, c.key)
        return kept

    def take(self, claim: Claim) -> bool:
        """Write ``claim`` unless another owner's stands there (call under :meth:`locked`,
        after :meth:`standing`); whether it is this owner's now."""
        path = self._path(claim.kind, claim.key)
        if path.exists():
            with contextlib.suppress(OSError, ValueError, TypeError):
                there = Claim(**json.loads(path.read_bytes()))
                if there.owner != claim.owner and (there.held or self._owner_runs(there.owner)):
                    return False
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_bytes(json.dumps(asdict(claim)).encode())
        tmp.chmod(0o600)
        os.replace(tmp, path)
        return True

    def remove(self, kind: str, key: str) -> None:
        """The claim's file removed, whoever's (call under :meth:`locked`)."""
        with contextlib.suppress(OSError):
            self._path(kind, key).unlink()

    def hold(self, kind: str, key: str, owner: str, held: bool) -> None:
        """Say whether the owner's machines use the claim (it outlives the owner then)."""
        with self.locked():
            path = self._path(kind, key)
            with contextlib.suppress(OSError, ValueError, TypeError):
                c = Claim(**json.loads(path.read_bytes()))
                if c.owner == owner and c.held != held:
                    self.take(Claim(c.kind, c.key, c.owner, c.holder, held, c.value))

    def drop(self, kind: str, key: str, owner: str) -> None:
        """Give the claim back (if it is this owner's)."""
        with self.locked():
            path = self._path(kind, key)
            with contextlib.suppress(OSError, ValueError, TypeError):
                if Claim(**json.loads(path.read_bytes())).owner == owner:
                    path.unlink()

    def owned(self, kind: str, owner: str) -> list[Claim]:
        """The owner's claims of ``kind``."""
        with self.locked():
            return [c for c in self.all(kind) if c.owner == owner]
