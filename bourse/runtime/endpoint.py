"""The metrics endpoint: ``--metrics-addr HOST:PORT`` parsed, and the HTTP server that
answers ``GET /metrics`` with a program's registry (bourse/runtime/metrics.py).

:class:`MetricsServer` is a task of the program's task group: it stops with the program.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from dataclasses import dataclass

import anyio
import anyio.abc
import structlog

from bourse.errors import BourseError
from bourse.runtime.metrics import Metrics

log = structlog.get_logger("bourse.metrics")

ENV_ADDR = "BOURSE_METRICS_ADDR"
DEFAULT_PORT = 9464  # the port range Prometheus's exporter list gives OpenTelemetry/Prometheus
OFF = ("", "off", "none")
# An HTTP request to the endpoint: its head must fit in this and arrive within this.
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_S = 5.0
# What an endpoint that cannot bind its address says (a launcher that picked the port
# tries another: ops/market.py).
CANNOT_LISTEN = "cannot listen"


class MetricsAddrError(BourseError, ValueError):
    """--metrics-addr is not HOST:PORT (or off)."""


def parse_addr(text: str | None) -> tuple[str, int] | None:
    """``"127.0.0.1:9464"`` -> ("127.0.0.1", 9464); ``"[::1]:9464"`` -> ("::1", 9464);
    ``""``, ``"off"``, ``None`` -> None (no endpoint). Port 0: any free port."""
    text = (text or "").strip()
    if text.lower() in OFF:
        return None
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise MetricsAddrError(
            f"--metrics-addr {text!r}: expected HOST:PORT (e.g. 127.0.0.1:{DEFAULT_PORT}, "
            "port 0 for any free one) or 'off'"
        )
    return host, int(port)


def format_addr(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_port(host: str, start: int, taken: Iterable[int] = ()) -> int:
    """The first port from ``start`` up that nothing listens on (and not in ``taken``)."""
    skip = set(taken)
    for port in range(start, min(start + 1000, 65536)):
        if port in skip:
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise MetricsAddrError(f"no free port on {host} from {start} up")


async def start_endpoint(
    tasks: anyio.abc.TaskGroup, metrics: Metrics, addr: tuple[str, int]
) -> MetricsServer:
    """Serve ``metrics`` on ``addr`` in ``tasks`` (the program's group); returns once it
    listens. Raises MetricsAddrError if it cannot."""
    server = MetricsServer(metrics, *addr)
    await tasks.start(server.run)
    return server


@dataclass
class MetricsServer:
    """The HTTP endpoint: ``GET /metrics`` (or ``/``) answers the registry in Prometheus's
    text format. A task of the program's task group (anyio), so it stops with the program;
    a scrape is rendered in a worker thread, so formatting a big fleet's series (~70 ms for
    a thousand workers) never stalls the event loop for long: the GIL hands it back every
    few ms. Collectors only read plain attributes there (immutable tuples, ints, len() of a
    dict): no lock is needed, at worst one gauge is read a moment before another."""

    metrics: Metrics
    host: str
    port: int
    address: str = ""  # HOST:PORT once bound (port 0 -> the one the system gave)

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled; ``started`` once listening (``address`` is then set)."""
        try:
            listener = await anyio.create_tcp_listener(local_host=self.host, local_port=self.port)
        except OSError as exc:
            raise MetricsAddrError(
                f"--metrics-addr {format_addr(self.host, self.port)}: {CANNOT_LISTEN}: "
                f"{exc.strerror or exc}"
            ) from None
        async with listener:
            sockname = listener.listeners[0].extra(anyio.abc.SocketAttribute.local_address)
            self.address = format_addr(self.host, int(sockname[1]))
            log.info("metrics_serving", url=self.url, program=self.metrics.program)
            task_status.started()
            await listener.serve(self._handle)

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    async def _handle(self, stream: anyio.abc.SocketStream) -> None:
        """One request. Nothing a client does (hang up, dawdle, send junk) ends the server."""
        async with stream:
            with anyio.move_on_after(REQUEST_TIMEOUT_S):
                try:
                    head = await _read_head(stream)
                    await stream.send(await anyio.to_thread.run_sync(self._respond, head))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                    pass

    def _respond(self, head: bytes) -> bytes:
        method, _, rest = head.partition(b" ")
        path = rest.split(b" ", 1)[0].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _response(b"405 Method Not Allowed", b"text/plain", b"use GET\n")
        if path not in (b"/metrics", b"/"):
            return _response(b"404 Not Found", b"text/plain", b"metrics are at /metrics\n")
        try:
            body, content_type = self.metrics.render(_header(head, b"accept"))
        except Exception as exc:  # a collector's bug: say so, keep serving
            log.exception("metrics_render_failed")
            return _response(b"500 Internal Server Error", b"text/plain", repr(exc).encode())
        return _response(b"200 OK", content_type.encode(), body, head=method == b"HEAD")


async def _read_head(stream: anyio.abc.SocketStream) -> bytes:
    """The request's head (up to the blank line); what a scraper sends has no body."""
    data = b""
    while b"\r\n\r\n" not in data and len(data) < MAX_REQUEST_BYTES:
        try:
            data += await stream.receive(MAX_REQUEST_BYTES)
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            break
    return data


def _header(head: bytes, name: bytes) -> str:
    """The value of header ``name`` (lower case) in a request head, or ""."""
    for line in head.split(b"\r\n")[1:]:
        key, sep, val = line.partition(b":")
        if sep and key.strip().lower() == name:
            return val.strip().decode("latin-1")
    return ""


def _response(status: bytes, ctype: bytes, body: bytes, *, head: bool = False) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
        + b"\r\nContent-Length: " + str(len(body)).encode()
        + b"\r\nConnection: close\r\n\r\n" + (b"" if head else body)
    )  # fmt: skip
