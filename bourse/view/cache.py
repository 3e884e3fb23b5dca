"""Where the CLI keeps its view: a disposable cache under the user's cache directory
(``$XDG_CACHE_HOME/bourse/views``, else ``~/.cache/bourse/views``), one database per market
(its servers and subject prefix) and tenant, resumed by stream sequence. Deleting it costs
one rebuild. One invocation at a time writes it (a lock file beside it).

A stamp beside it says that it was caught up and that none of the buyer's own commands has
asked the market for a change since: while it is there, a view caught up a moment ago is
read as it stands (bourse/view/stored.py), without NATS. A command that may change the
market removes it when it is done (:func:`unstamp`), so the next answer catches up."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from bourse.nats.names import prefix_token


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "bourse" / "views"


def view_path(servers: list[str], prefix: str, tenant: str = "") -> Path:
    """The database of one market's view as one tenant (or the shared key) sees it."""
    key = json.dumps([sorted(servers), prefix, tenant]).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    return cache_dir() / f"{prefix_token(prefix)}-{tenant or 'all'}-{digest}.sqlite"


@contextmanager
def locked(path: Path) -> Iterator[Path]:
    """``path``'s directory made (private to the user), and ``path`` held against another
    invocation writing it at the same time (it waits)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@asynccontextmanager
async def locked_async(path: Path, pace_s: float = 0.05) -> AsyncIterator[Path]:
    """:func:`locked` in an event loop, which it never blocks: another invocation that
    writes the view (a ``query --watch`` holds it while it follows) is waited for by
    trying again every ``pace_s`` (no event says when a process lets a file lock go)."""
    import asyncio

    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lock = os.open(path.with_suffix(".lock"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                await asyncio.sleep(pace_s)  # a pace: see above
        try:
            yield path
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    finally:
        os.close(lock)


def stamp_path(path: Path) -> Path:
    return path.with_suffix(".fresh")


def stamp(path: Path) -> None:
    """Say that the view at ``path`` was caught up (its ``synced_ms`` says when)."""
    stamp_path(path).touch()


def unstamp(path: Path) -> None:
    """Say that the market may have changed since the view at ``path`` was caught up."""
    stamp_path(path).unlink(missing_ok=True)


def stamped(path: Path) -> bool:
    return stamp_path(path).exists()
