"""What the edge's tests drive: a tiny HTTP/1.1 upstream server (asyncio, in the test's own
loop, on a loopback port of its own), a raw HTTP client (bytes exactly as a test writes
them, the answer parsed), the edge program as a subprocess, and a routes file."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from bourse.runtime.endpoint import free_port

READY_S = 30.0
HOST = "127.0.0.1"


def port() -> int:
    """A loopback port nothing listens on (the edge tests' range, apart from others')."""
    return free_port(HOST, 31000 + (time.monotonic_ns() // 1000) % 20000)


@dataclass
class Upstream:
    """An app's machine as the edge sees it: ``GET /`` answers its name; ``/echo`` the
    request's method, headers and body size as JSON; ``/upload`` a body's byte count;
    ``/stream`` a chunked answer whose last chunk waits for ``release``; ``/hang`` never
    answers (``hanging`` set once it is asked); ``/ws`` switches protocols (101) and
    echoes bytes. Counts the connections it accepted and the requests it read."""

    name: str
    port: int = 0
    connections: int = 0
    requests: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    hanging: asyncio.Event = field(default_factory=asyncio.Event)
    server: asyncio.Server | None = None

    async def start(self) -> Upstream:
        self.port = self.port or port()
        self.server = await asyncio.start_server(self._serve, HOST, self.port)
        return self

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with suppress(Exception):
                self.server.close_clients()  # type: ignore[attr-defined]  # 3.13+
            self.server = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                self.requests += 1
                line, *lines = head.decode("latin-1").split("\r\n")
                method, path, _ = line.split(" ", 2)
                headers = {}
                for h in lines:
                    if ":" in h:
                        k, v = h.split(":", 1)
                        headers[k.strip().lower()] = v.strip()
                body = await read_body(reader, headers)
                if not await self._answer(method, path, headers, body, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _answer(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        if path == "/hang":
            self.hanging.set()
            await asyncio.Event().wait()
        if path == "/ws":
            writer.write(
                b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                b"Connection: Upgrade\r\n\r\n"
            )
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
            return False
        if path == "/stream":
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nfirst\n\r\n")
            await writer.drain()
            await self.release.wait()
            writer.write(b"5\r\nlast\n\r\n0\r\n\r\n")
            await writer.drain()
            return True
        if path == "/echo":
            doc = {"method": method, "headers": headers, "body": len(body), "by": self.name}
            payload = json.dumps(doc).encode()
        elif path == "/upload":
            payload = json.dumps({"bytes": len(body), "by": self.name}).encode()
        else:
            payload = self.name.encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%b"
            % (len(payload), payload)
        )
        await writer.drain()
        return True


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """A message's body by its framing: Content-Length, chunked, or none."""
    if "chunked" in headers.get("transfer-encoding", ""):
        out = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return out
            out += await reader.readexactly(size)
            await reader.readexactly(2)
    length = int(headers.get("content-length", "0") or 0)
    return await reader.readexactly(length) if length else b""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict[str, object]:
        return dict(json.loads(self.body))


class Conn:
    """A client connection to the edge: requests written as given, answers parsed."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, address: str) -> Conn:
        host, p = address.rsplit(":", 1)
        return cls(*await asyncio.open_connection(host, int(p)))

    async def close(self) -> None:
        self.writer.close()
        with suppress(ConnectionError):
            await self.writer.wait_closed()

    def send(self, raw: bytes) -> None:
        self.writer.write(raw)

    def request(
        self, path: str = "/", host: str = "web.localhost", method: str = "GET", extra: str = ""
    ) -> None:
        self.send(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode())

    async def head(self) -> tuple[int, dict[str, str]]:
        with anyio.fail_after(10):
            raw = await self.reader.readuntil(b"\r\n\r\n")
        line, *lines = raw.decode("latin-1").split("\r\n")
        headers = {}
        for h in lines:
            if ":" in h:
                k, v = h.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        return int(line.split(" ")[1]), headers

    async def answer(self) -> Answer:
        status, headers = await self.head()
        with anyio.fail_after(10):
            if "content-length" in headers or "chunked" in headers.get("transfer-encoding", ""):
                body = await read_body(self.reader, headers)
            else:
                body = await self.reader.read()
        return Answer(status, headers, body)

    async def closed(self) -> bool:
        """Whether the edge closed the connection (EOF) without another byte."""
        with anyio.fail_after(10):
            return await self.reader.read(1) == b""


async def get(
    address: str, path: str = "/", host: str = "web.localhost", extra: str = ""
) -> Answer:
    """One request on a connection of its own."""
    conn = await Conn.open(address)
    try:
        conn.request(path, host, extra=extra + "Connection: close\r\n")
        return await conn.answer()
    finally:
        await conn.close()


async def answered(
    address: str, host: str, want: Callable[[Answer], bool], timeout_s: float = 10.0
) -> Answer:
    """Ask until the answer is ``want``ed: what the edge routes by changes on its own (a
    listing refreshed, a probe passed), so each try is a fresh request."""
    with anyio.fail_after(timeout_s):
        while True:
            got = await get(address, host=host)
            if want(got):
                return got
            await anyio.sleep(0.05)  # the next try, not a synchronisation


def routes_file(
    path: Path, apps: dict[str, list[tuple[str, dict[str, str]]]], **extra: object
) -> Path:
    """A routes file (JSON): ``apps`` is key -> [(machine id, {port name: address})];
    a key ``web.acme`` is tenant acme's app web. ``extra``: more top-level keys."""
    doc: dict[str, object] = {
        "apps": [
            {
                "app": key.split(".")[0],
                **({"tenant": key.split(".")[1]} if "." in key else {}),
                "machines": [
                    {"id": mid, "region": "mad", "addresses": addrs} for mid, addrs in machines
                ],
            }
            for key, machines in apps.items()
        ],
        **extra,
    }
    path.write_text(json.dumps(doc))
    return path


@dataclass
class Edge:
    """The edge program, started as ``python -m edge serve``."""

    proc: asyncio.subprocess.Process
    log_path: Path
    address: str = ""
    ready_line: str = ""

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def stop(self, sig: int = signal.SIGTERM) -> tuple[int, float]:
        t0 = time.monotonic()
        self.proc.send_signal(sig)
        with anyio.fail_after(10):
            code = await self.proc.wait()
        return code, time.monotonic() - t0


@asynccontextmanager
async def edge(tmp_path: Path, *args: str) -> AsyncIterator[Edge]:
    """``edge serve --listen 127.0.0.1:0 ARGS`` (a --listen in ARGS wins: the last is
    taken), ready (its address read from its line)."""
    log_path = tmp_path / f"edge-{time.monotonic_ns()}.log"
    with log_path.open("ab") as stderr:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edge", "serve", "--listen", f"{HOST}:0", *args,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=stderr,
        )  # fmt: skip
    e = Edge(proc, log_path)
    try:
        assert proc.stdout is not None
        with anyio.fail_after(READY_S):
            line = (await proc.stdout.readline()).decode()
        assert line.startswith("edge serving on "), f"{line!r}\n{e.log[-3000:]}"
        e.ready_line = line
        e.address = line.split()[3]
        yield e
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
