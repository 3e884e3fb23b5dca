"""Raw TCP services: the edge listens on a service's address and passes each connection
to a machine of its app (on the machine's port of the service's name), bytes both ways as
they come. A connection counts as one outstanding request on its machine while it lasts.
Connecting is retried on another machine (at most the proxy's ``attempts``), and a machine
that refused is skipped until its next passing probe, as for HTTP. A connection no machine
can take is held as an HTTP request is (edge/starts.py): one of the app's stopped machines
started for it, or a machine that may take it soon awaited, until the start timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection
from typing import Any

import structlog

from edge.proxy import Proxy
from edge.requests import PENDING_MAX, reason_of
from edge.routing import UNKNOWN_APP, Choice, Service

log = structlog.get_logger("bourse.edge")


class TcpClient(asyncio.Protocol):
    """A client's connection to a service."""

    def __init__(self, proxy: Proxy, service: Service) -> None:
        self.proxy = proxy
        self.service = service
        self.transport: Any = None
        self.up: TcpUpstream | None = None
        self.early: list[bytes] = []
        self.early_bytes = 0
        self.eof = False
        self.closed = False
        self.machine_id = ""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.proxy.clients.add(self)
        self.proxy.tasks.spawn(self._connect())

    async def _connect(self) -> None:
        proxy, service = self.proxy, self.service
        tried: list[str] = []
        error = ""
        deadline: float | None = None
        while len(tried) < proxy.config.attempts and not self.closed:
            choice = proxy.router.pick(service.app, port=service.port, exclude=tried)
            if not isinstance(choice, Choice):
                if choice.reason != UNKNOWN_APP and proxy.starts is not None:
                    deadline = deadline or time.monotonic() + self._timeout_s()
                    why = await self._held(tried, deadline)
                    if why is None:
                        continue  # a machine was started, or one may take it now
                    error = why or error
                error = error or choice.detail
                break
            mid = choice.backend.machine_id
            tried.append(mid)
            proxy.router.begin(mid)
            try:
                async with asyncio.timeout(proxy.config.connect_timeout_s):
                    _, up = await proxy.loop.create_connection(
                        lambda: TcpUpstream(self), *choice.address
                    )
            except (OSError, TimeoutError) as exc:
                proxy.router.end(mid)
                proxy.router.failed(mid, choice.address)
                error = f"connect to {mid}: {reason_of(exc)}"
                if proxy.metrics is not None:
                    proxy.metrics.upstream_error(service.app)
                    proxy.metrics.retry(service.app)
                continue
            self.machine_id = mid
            if self.closed:
                up.close()
                return
            self.up = up
            for chunk in self.early:
                up.transport.write(chunk)
            self.early = []
            if self.eof and up.transport.can_write_eof():
                up.transport.write_eof()
            self.transport.resume_reading()
            return
        log.info("service_refused", app=service.app, port=service.port, error=error)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.up is not None:
            self.up.transport.write(data)
            return
        self.early.append(data)
        self.early_bytes += len(data)
        if self.early_bytes > PENDING_MAX:
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        self.eof = True
        if self.up is not None and self.up.transport.can_write_eof():
            self.up.transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.proxy.clients.discard(self)
        if self.up is not None:
            self.up.transport.close()
            self.up = None
        if self.machine_id:
            self.proxy.router.end(self.machine_id)
            self.machine_id = ""

    def pause_writing(self) -> None:
        if self.up is not None:
            self.up.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None:
            self.up.transport.resume_reading()

    def _timeout_s(self) -> float:
        starts = self.proxy.starts
        return starts.timeout_s if starts is not None else 0.0

    async def _held(self, tried: list[str], deadline: float) -> str | None:
        """No machine takes the connection now: held as an HTTP request is (one of the
        app's stopped machines started, or a machine that may take it awaited) until
        ``deadline``: None to pick again (``tried`` forgotten), else why not."""
        starts = self.proxy.starts
        if starts is None or time.monotonic() >= deadline:
            return ""
        answer: asyncio.Future[str | None] = self.proxy.loop.create_future()

        def release(why: str | None) -> None:
            if not answer.done():
                answer.set_result(why)

        why = starts.hold(self.service.app, release, deadline)
        if why is not None:
            return why
        got = await answer
        if got is None:
            tried.clear()
        return got

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def cut(self, dead: Collection[str]) -> None:
        if self.machine_id in dead:
            self.abort()  # its client connects again, to another machine


class TcpUpstream(asyncio.Protocol):
    """The connection to the machine, paired with its client's."""

    def __init__(self, client: TcpClient) -> None:
        self.client = client
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def close(self) -> None:
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        self.client.transport.write(data)

    def eof_received(self) -> bool:
        transport = self.client.transport
        if transport.can_write_eof():
            transport.write_eof()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.client.closed:
            self.client.transport.close()

    def pause_writing(self) -> None:
        self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        self.client.transport.resume_reading()
