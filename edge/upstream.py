"""One connection from the edge to a machine (:class:`Upstream`): a response parsed at a
time by httptools and handed to its client (edge/http.py) part by part; after a 101, the
tunnel's bytes passed as they come. Kept in the proxy's pool between requests
(edge/proxy.py).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

import httptools

from edge.requests import DROPPED_RESPONSE

if TYPE_CHECKING:
    from edge.requests import Request


class Receiver(Protocol):
    """What an upstream calls on its client (edge/http.py ``Client``): the response handed
    over part by part, the tunnel after a 101, the failures. A type only: upstream.py is
    below http.py, and the calls are the client's own methods (nothing in between)."""

    active: Request | None
    transport: Any

    def flush(self) -> None: ...
    def response_head(
        self, up: Upstream, status: int, reason: bytes, headers: list[bytes], framed: bool
    ) -> None: ...
    def response_body(self, body: bytes) -> None: ...
    def response_end(self, up: Upstream, keep: bool) -> None: ...
    def start_tunnel(self, up: Upstream, rest: bytes) -> None: ...
    def tunnel_closed(self, up: Upstream) -> None: ...
    def upstream_lost(self, up: Upstream, reused: bool) -> None: ...
    def upstream_failed(
        self, r: Request, error: str, *, retry: bool, skip: bool = True, sent: bool = False
    ) -> None: ...


class Upstream(asyncio.Protocol):
    """One connection to a machine: a response parsed at a time, handed to its client."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.transport: Any = None
        self.parser = httptools.HttpResponseParser(self)
        self.client: Receiver | None = None
        self.machine_id = ""
        self.reused = False
        self.closed = False
        self.got_bytes = False
        self.idle_since = 0.0
        self.headers: list[bytes] = []
        self.reason = b""
        self.length = False  # the response has a Content-Length
        self.chunked = False  # the response is chunked
        self.interim = False
        self.upgrade: bytes | None = None
        self.tunnel = False

    def attach(self, client: Receiver, r: Request, reused: bool) -> None:
        self.client = client
        self.machine_id = r.backend_id
        self.reused = reused
        self.got_bytes = False

    def detach(self) -> None:
        self.client = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        client = self.client
        if client is None:
            return
        if self.tunnel:
            client.tunnel_closed(self)
            return
        r = client.active
        if r is not None and r.up is self and r.responded and not (self.length or self.chunked):
            client.response_end(self, keep=False)  # a body that ends with the connection
            client.flush()
            return
        self.client = None
        client.upstream_lost(self, self.reused)

    def pause_writing(self) -> None:
        if self.client is not None and self.client.transport is not None:
            self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.client is not None and self.client.transport is not None:
            self.client.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        client = self.client
        if self.tunnel:
            if client is not None:
                client.transport.write(data)
            return
        if client is None:  # bytes nobody asked for on an idle connection
            self.abort()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
            client.flush()
        except httptools.HttpParserUpgrade as exc:
            self.tunnel = True
            client.start_tunnel(self, data[exc.args[0] :])
        except httptools.HttpParserError as exc:
            self.abort()
            r = client.active
            if r is not None and r.up is self:
                self.client = None
                r.up = None
                if r.responded:
                    client.upstream_lost(self, False)
                else:
                    error = f"bad response from {r.backend_id}: {exc}"
                    client.upstream_failed(r, error, retry=False)

    def eof_received(self) -> bool | None:
        if self.tunnel and self.client is not None:
            transport = self.client.transport
            if transport.can_write_eof():
                transport.write_eof()
            return True
        return None

    # -- httptools' callbacks (a response's parts) ------------------------------------------

    def on_message_begin(self) -> None:
        self.headers = []
        self.length = False
        self.chunked = False
        self.upgrade = None

    def on_status(self, reason: bytes) -> None:
        self.reason = reason

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower in DROPPED_RESPONSE:
            if lower == b"transfer-encoding":
                self.chunked = b"chunked" in value.lower()  # re-chunked to the client
            elif lower == b"upgrade":
                self.upgrade = value
            return
        if lower == b"content-length":
            self.length = True
        self.headers.append(name + b": " + value + b"\r\n")

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.interim = True  # 100 Continue and the like: the edge answered its own
            return
        client = self.client
        if client is None:
            return
        client.response_head(self, status, self.reason, self.headers, self.length)
        r = client.active
        if r is not None and r.head_only:
            # httptools cannot be told a response has no body (a HEAD's Content-Length
            # would be waited for): the answer ends here and the connection is not reused
            self.client = None
            client.response_end(self, keep=False)

    def on_body(self, body: bytes) -> None:
        if self.client is not None and not self.interim:
            self.client.response_body(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        client = self.client
        if client is None or self.parser.get_status_code() == 101:
            return
        client.response_end(self, self.parser.should_keep_alive())
