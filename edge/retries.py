"""A client connection's request when its machine cannot take it (edge/http.py
``Client``'s part): connecting to a machine (a task: connecting is awaited), the retries
(at most ``attempts`` in all: on another machine when connecting failed, no byte having
gone upstream, and for idempotent methods when the connection ended before any response
byte came back; the machine then skipped until the prober's next passing probe), and the
hold while a stopped machine of its app starts (edge/starts.py).

A mixin of ``Client``'s: the methods run on the client's own state, with no call or lookup
added on the hot path.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from edge.requests import IDEMPOTENT, reason_of
from edge.upstream import Upstream

if TYPE_CHECKING:
    from edge.proxy import EdgeConfig, Proxy
    from edge.requests import Request


class Retries:
    """A client connection's connects, retries and holds (``Client``'s state, declared)."""

    if TYPE_CHECKING:
        proxy: Proxy
        config: EdgeConfig
        transport: Any
        active: Request | None
        closed: bool
        out: list[bytes]

        def _route(self, r: Request) -> None: ...
        def _send(self, r: Request, up: Upstream, *, reused: bool) -> None: ...
        def _respond(
            self, r: Request, status: int, detail: str, *, close: bool = False
        ) -> None: ...
        def _done(self, r: Request) -> None: ...

    def _hold(self, r: Request, detail: str) -> None:
        """No machine can take ``r``: held while a stopped machine of its app starts, or
        until one of its machines can take it (edge/starts.py; again after a release that
        found none, until the first hold's deadline), else 503 with why (502 with the
        error of a retry: the machine tried failed, and no other could take it)."""
        status, detail = (502, r.error) if r.error else (503, detail)
        starts = self.proxy.starts
        now = time.monotonic()  # the clock of Starts
        if starts is None or (r.held and now >= r.held_until):
            self._respond(r, status, detail)
            return
        if not r.held:
            r.held_until = now + starts.timeout_s
        why = starts.hold(r.app, lambda why: self._released(r, why), r.held_until)
        if why is None:
            if not r.held and self.proxy.metrics is not None:
                self.proxy.metrics.held_request(r.app)
            r.held = True
        else:
            self._respond(r, status, f"{detail}; {why}" if why else detail)

    def _released(self, r: Request, why: str | None) -> None:
        """The start ``r`` waited for answered (``why`` None: route it again, to any
        machine: the one started may be one it tried at an old address) or not."""
        if r is not self.active or self.closed or r.response_done:
            return  # the client left, or the request was answered meanwhile (413)
        if why is None:
            r.tried.clear()
            r.error = ""
            self._route(r)
        else:
            self._respond(r, 503, why)

    async def _connect(self, r: Request, address: tuple[str, int]) -> None:
        proxy = self.proxy
        try:
            async with asyncio.timeout(self.config.connect_timeout_s):
                _, up = await proxy.loop.create_connection(
                    lambda: Upstream(address), address[0], address[1]
                )
        except (OSError, TimeoutError) as exc:
            if r is self.active and not self.closed:
                self.upstream_failed(r, f"connect to {r.backend_id}: {reason_of(exc)}", retry=True)
            else:
                proxy.router.end(r.backend_id)
            return
        if r is not self.active or self.closed:  # the client left meanwhile
            up.close()
            proxy.router.end(r.backend_id)
            return
        self._send(r, up, reused=False)

    def upstream_failed(
        self, r: Request, error: str, *, retry: bool, skip: bool = True, sent: bool = False
    ) -> None:
        """The request's upstream failed before any response byte came back: skip that
        machine (unless only a kept-alive connection went stale) and send the request to
        another one when ``retry`` allows and attempts are left; else 502. ``sent``: its
        head (and body so far) went up that connection, so the body is sent again from
        what was kept of it (a retry after a send needs ``r.replay``)."""
        proxy = self.proxy
        proxy.router.end(r.backend_id)
        if skip:
            proxy.router.failed(r.backend_id, r.address)
        r.error = error
        metrics = proxy.metrics
        if metrics is not None:
            metrics.upstream_error(r.app)
        if retry and r.attempts < self.config.attempts:
            if metrics is not None:
                metrics.retry(r.app)
            if sent and r.replay is not None:
                r.pending = list(r.replay)  # every chunk received so far, sent or not
                r.pending_bytes = sum(len(c) for c in r.pending)
            if not skip:  # a stale pooled connection: the same machine may be tried again,
                r.tried.pop()  # and the attempt is not counted; the address's other idle
                r.attempts -= 1  # connections are likely as stale (its machine restarted)
                proxy.drop_pool(r.address)
            self._route(r)
        else:
            self._respond(r, 502, error)

    def upstream_lost(self, up: Upstream, reused: bool) -> None:
        """``up`` ended before its response did."""
        r = self.active
        if r is None or r.up is not up:
            return
        r.up = None
        if r.responded:  # part of the answer went out: the client's connection ends too
            self.proxy.router.end(r.backend_id)
            r.error = "upstream closed mid-response"
            if self.proxy.metrics is not None:
                self.proxy.metrics.upstream_error(r.app)
            r.response_done = True
            self._done(r)
            self.active = None
            self.out.clear()
            self.transport.abort()
            return
        retry = not up.got_bytes and r.method in IDEMPOTENT and r.replay is not None
        error = f"{r.backend_id} closed the connection before answering"
        self.upstream_failed(r, error, retry=retry, skip=not reused, sent=True)
