"""A CLI view's keeper: a process of the user's that holds one view's NATS connection, and
the modules that catch it up, warm between the buyer's invocations, and catches the view up
when one asks. An answer that must be caught up first (bourse/view/stored.py says when)
then costs the invocation a line on a socket instead of nats-py's and asyncio's import, a
connection and a consumer (flyctl's agent, for the same reason: a CLI that answers at once).

- **Asked.** An invocation sends ``sync`` (with its tables' version: a keeper of another,
  one an upgrade left running, answers an error and exits, and the next invocation starts
  one of its own): the keeper catches the view up as an invocation
  does (bourse/view/view.py ``open_view``, under the view's lock, waited for without
  blocking the keeper, from the sequences in its file, so a view another invocation
  caught up meanwhile is resumed, not overwritten),
  stamps it (bourse/view/cache.py) and answers ``ok <seq>``, or ``error <why>``; the
  invocation then reads the view as it stands. ``stop`` ends the keeper.
- **Found.** A socket in Linux's abstract namespace named by the view's path (a path under
  a deep cache directory may be longer than a socket path may be). It answers only its own
  user (the peer's credentials): any other is hung up on.
- **Started** by an invocation that found none, after it answered (``buyer view keep``,
  detached: its own session, no terminal); one a view, the second one exits at once.
- **Ended** after ``idle_s`` without a request (ENV_KEEPER_S, default IDLE_S; 0: no keeper,
  every invocation catches up by itself), by ``buyer view stop``, by SIGTERM.

Nothing is kept in it that the view's file does not hold: each request opens the view
anew (~5 ms), so an invocation that caught up by itself meanwhile loses nothing."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bourse.view.schema import SCHEMA_VERSION

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from bourse.wire.subjects import Subjects

# How long a keeper waits for the next request before it exits, unless its environment's
# ENV_KEEPER_S says otherwise (0: no keeper).
IDLE_S = 300.0
ENV_KEEPER_S = "BOURSE_VIEW_KEEPER_S"
SYNC = b"sync %d\n" % SCHEMA_VERSION  # a keeper of another version's tables exits
STOP = b"stop\n"
# A request's line, at most (a client that sends more, or nothing, is hung up on).
LINE_MAX = 64
READ_S = 5.0


def keeper_s(environ: dict[str, str] | None = None) -> float:
    """The keeper's idle time from the environment (ENV_KEEPER_S; unset: IDLE_S); 0: none.
    ValueError names a value that is no number of seconds."""
    given = (os.environ if environ is None else environ).get(ENV_KEEPER_S, "").strip()
    if not given:
        return IDLE_S
    try:
        seconds = float(given)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:  # NaN too
        raise ValueError(
            f"{ENV_KEEPER_S} must be a number of seconds (0: no keeper), not {given!r}"
        )
    return seconds


def address(path: Path) -> str:
    """The keeper's socket of the view at ``path``: a name in the abstract namespace."""
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    return f"\0bourse-view-keeper-{digest}"


class NoKeeper(Exception):
    """No keeper listens for this view."""


class KeeperError(Exception):
    """A keeper answered, and could not catch the view up (its reason), or answered wrong."""


def ask(path: Path, request: bytes = SYNC, timeout_s: float = 30.0) -> str:
    """Send ``request`` to the keeper of the view at ``path`` and return its answer past
    ``ok`` (a sync's: the sequence the view is caught up to). NoKeeper when none listens;
    KeeperError when it answered an error, or nothing in ``timeout_s``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(address(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise NoKeeper(str(exc)) from None
        try:
            s.sendall(request)
            answer = _line(s)
        except OSError as exc:  # a timeout, a keeper gone halfway
            why = exc or type(exc).__name__
            raise KeeperError(f"the view's keeper did not answer: {why}") from None
    if not answer.startswith(b"ok"):
        why = answer.removeprefix(b"error").strip().decode(errors="replace")
        raise KeeperError(why or "the view's keeper hung up")
    return answer[2:].strip().decode()


def _line(s: socket.socket) -> bytes:
    got = b""
    while not got.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            break
        got += chunk
    return got.strip()


def peer_uid(s: socket.socket) -> int:
    """The uid of the process at the other end of a unix socket (SO_PEERCRED)."""
    creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    return int(uid)


def listen(path: Path) -> socket.socket | None:
    """The keeper's listening socket for the view at ``path``, or None when another keeper
    has it already."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(address(path))
    except OSError:  # EADDRINUSE: a keeper of this view runs
        s.close()
        return None
    s.listen(64)
    s.setblocking(False)
    return s


async def keep(
    nc: NATS, subjects: Subjects, path: Path, tenant: str, idle_s: float = IDLE_S
) -> None:
    """Serve the view at ``path`` (see the module doc) until ``idle_s`` pass without a
    request, a ``stop`` comes, or the caller cancels it."""
    import asyncio

    import structlog

    from bourse.view import ViewUnavailable, open_view
    from bourse.view.cache import locked_async, stamp

    log = structlog.get_logger("bourse.view").bind(view=path.name)
    listener = listen(path)
    if listener is None:
        log.info("view_keeper_running", detail="another keeper serves this view")
        return
    one_at_a_time = asyncio.Lock()
    done = asyncio.Event()
    last = time.monotonic()

    async def sync() -> bytes:
        async with one_at_a_time:
            try:
                async with locked_async(path), open_view(nc, subjects, path, tenant) as view:
                    stamp(path)
                    return b"ok %d\n" % view.freshness().seq
            except ViewUnavailable as exc:
                why = str(exc)
            except Exception as exc:  # the server away, the file refused: said, not raised
                why = f"{type(exc).__name__}: {exc}"
                log.warning("view_keeper_sync_failed", error=why)
            return b"error " + why.replace("\n", " ").encode()[:500] + b"\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal last
        try:
            sock = writer.get_extra_info("socket")
            if sock is None or peer_uid(sock) != os.getuid():
                return  # another user's: hung up on
            async with asyncio.timeout(READ_S):
                request = await reader.readuntil(b"\n")
            last = time.monotonic()
            if request == STOP:
                writer.write(b"ok\n")
                done.set()
            elif request == SYNC:
                writer.write(await sync())
                last = time.monotonic()
            elif request.startswith(b"sync "):  # an invocation of another version's tables
                writer.write(b"error the view's keeper is of another version: it stops\n")
                done.set()
            else:
                writer.write(b"error unknown request\n")
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_unix_server(serve, sock=listener, limit=LINE_MAX)
    log.info("view_keeper_started", idle_s=idle_s, pid=os.getpid())
    try:
        async with server:
            while not done.is_set():
                left = last + idle_s - time.monotonic()
                if left <= 0 and not one_at_a_time.locked():
                    log.info("view_keeper_idle", idle_s=idle_s)
                    break
                left = max(left, READ_S)  # a sync under way: its answer first
                try:
                    async with asyncio.timeout(left):
                        await done.wait()
                except TimeoutError:
                    pass
    finally:
        server.close()
        log.info("view_keeper_stopped")
