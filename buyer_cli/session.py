"""One ``buyer`` invocation: the common options (given before the command or after it), the
connection they make, checked once, and a command's work run on a client.

The client, nats-py and the rest are imported when a command first needs them, not with
this module: ``buyer --help`` imports none of them (bourse/runtime/cli.py)."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import typer

from bourse.runtime.connection import Connection
from bourse.wire.subjects import DEFAULT_PREFIX, Subjects

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from bourse.client import BourseClient

T = TypeVar("T")


@dataclass
class Session:
    """The common options of one invocation (bourse/runtime/cli.py: --nats, --creds,
    --tls-*, --prefix, --json): the app's callback keeps them here, and a value given after
    the command replaces the one before it (BourseGroup). The Connection is made from them
    once, at its first use, so that a bad one is one clear error."""

    nats: list[str] | None = None
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    prefix: str = DEFAULT_PREFIX
    json: bool = False
    no_jetstream: bool = False  # --direct orders: auctions without claims (the degraded mode)
    _connection: Connection | None = field(default=None, init=False, repr=False)

    def connection(self) -> Connection:
        if self._connection is None:
            self._connection = Connection.from_options(
                self.nats, self.creds, self.tls_ca, self.tls_cert, self.tls_key
            )
        return self._connection

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    def tenant(self) -> str:
        """The tenant the --creds file is for ("" for the operator's shared buyer key)."""
        creds = self.connection().creds
        if not creds:
            return ""
        from bourse.nats.auth import tenant_of

        return tenant_of(creds)

    async def connect(self, name: str) -> NATS:
        """A NATS connection for a command; one that cannot be made is a ClientError."""
        conn = self.connection()
        try:
            return await conn.connect(name, service=False)
        except Exception as exc:  # nats-py's own errors, OSError, TimeoutError: all one line
            from bourse.client import ClientError  # the client's package: only now

            urls = ", ".join(conn.urls)
            raise ClientError(
                f"cannot connect to NATS at {urls}: {exc or type(exc).__name__}", "not_connected"
            ) from None

    def stdout_bytes(self) -> Callable[[bytes], object]:
        """A writer of bytes to stdout (the buffer under it, or decoded where it has none),
        what it holds of text flushed first; the caller flushes (:meth:`flush_stdout`)."""
        out = sys.stdout
        out.flush()
        buffer = getattr(out, "buffer", None)
        if buffer is None:
            return lambda data: out.write(bytes(data).decode())
        write: Callable[[bytes], object] = buffer.write
        return write

    def flush_stdout(self) -> None:
        out = sys.stdout
        (getattr(out, "buffer", None) or out).flush()

    def echo_json(self, obj: object) -> None:
        """One JSON object on stdout. Written as it is: its text holds no terminal control
        (JSON escapes it), and echo would scan a 10,000 machines' listing (8 MB) for some;
        as bytes, where stdout has them (not decoded to be encoded again)."""
        import msgspec

        data = bytearray()
        msgspec.json.Encoder().encode_into(obj, data)
        data += b"\n"  # grown in place: 8 MB are not copied again for a line's end
        out = sys.stdout
        out.flush()
        buffer = getattr(out, "buffer", None)
        if buffer is None:
            out.write(data.decode())
            out.flush()
        else:
            buffer.write(data)
            buffer.flush()


def session(ctx: typer.Context) -> Session:
    """The invocation's options (the app's callback made them)."""
    found = ctx.find_object(Session)
    assert found is not None, "the buyer app's callback keeps a Session in ctx.obj"
    return found


def with_client(
    ctx: typer.Context,
    fn: Callable[[BourseClient], Awaitable[T]],
    *,
    direct: bool = False,
    places: bool = False,
) -> T:
    """Run ``fn`` on a client of the invocation's market (``direct``: auctions and machine
    requests without the exchange) and close it; its errors go on to the app's one line.
    ``places``: ``fn`` places orders, so in direct mode it runs auctions, whose claims need
    JetStream (refused without it, unless --no-jetstream)."""
    import asyncio

    from bourse.client import BourseClient
    from bourse.nats.jetstream import jetstream_mode
    from bourse.runtime import logs

    s = session(ctx)
    tenant = s.tenant()
    logs.configure("warning")

    async def main() -> T:
        nc = await s.connect("bourse-buyer")
        try:
            claims = True
            if direct and places:
                claims = await jetstream_mode(nc, "buyer --direct", off=s.no_jetstream)
            client = BourseClient(nc, s.subjects, direct=direct, tenant=tenant, claims=claims)
            try:
                return await fn(client)
            finally:
                await client.close()
        finally:
            await nc.drain()

    try:
        return asyncio.run(main())
    finally:  # it may have changed the market: the next answer from the view catches up
        from bourse.view.cache import unstamp, view_path

        unstamp(view_path(s.connection().urls, s.prefix, tenant))
