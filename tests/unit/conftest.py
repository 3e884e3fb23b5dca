"""Fixtures the supplier's unit tests share, and the boundary every unit test keeps: it
starts no process and connects to nothing over the network (no nats-server, no program),
so ``pytest tests/unit`` runs in seconds without NATS. A test that crosses it fails, told
to move to tests/integration."""

from __future__ import annotations

import _posixsubprocess
import os
import socket
import subprocess
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient

from supplier.store import Store

MOVE_IT = (
    "a unit test starts no process and connects to nothing over the network: "
    "move it to tests/integration"
)
_NETWORK = (socket.AF_INET, socket.AF_INET6)
_INHERITED = object()


class Boundary:
    """While entered, starting a process (subprocess, asyncio and anyio processes, fork,
    multiprocessing), a TCP/UDP connect or a NATS connection fails with :data:`MOVE_IT`.
    Every attempt is also remembered, so one that the code under test swallowed still
    fails the test on exit."""

    def __init__(self) -> None:
        self.crossed: list[str] = []
        self._undo: list[Callable[[], None]] = []

    def _refuse(self, what: str) -> None:
        self.crossed.append(what)
        pytest.fail(f"{what}: {MOVE_IT}", pytrace=True)

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        # a class's inherited attribute (socket.socket.connect) is restored by deleting
        # the override, not by copying the base's onto the subclass
        original = vars(owner).get(name, _INHERITED)
        setattr(owner, name, replacement)
        if original is _INHERITED:
            self._undo.append(lambda: delattr(owner, name))
        else:
            self._undo.append(lambda: setattr(owner, name, original))

    def _refusing(self, what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            self._refuse(what)

        return refuse

    def __enter__(self) -> Boundary:
        refuse = self._refuse

        def popen(popen_self: subprocess.Popen[Any], args: Any, *rest: Any, **kw: Any) -> None:
            refuse(f"started a process {args!r}")

        connect = socket.socket.connect
        connect_ex = socket.socket.connect_ex

        def guarded(original: Callable[..., Any]) -> Callable[..., Any]:
            def checked(sock: socket.socket, address: Any) -> Any:
                if sock.family in _NETWORK:
                    refuse(f"connected a socket to {address!r}")
                return original(sock, address)

            return checked

        self._patch(subprocess.Popen, "__init__", popen)
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            self._patch(os, name, self._refusing(f"called os.{name}"))
        # multiprocessing's spawn and forkserver start methods fork here, not via Popen
        self._patch(_posixsubprocess, "fork_exec", self._refusing("started a process"))
        self._patch(socket.socket, "connect", guarded(connect))
        self._patch(socket.socket, "connect_ex", guarded(connect_ex))
        self._patch(NatsClient, "connect", self._refusing("connected to NATS"))
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        while self._undo:
            self._undo.pop()()
        if self.crossed and exc is None:
            pytest.fail(f"{'; '.join(self.crossed)}: {MOVE_IT}", pytrace=False)


# Setup and the test itself are inside the boundary (a session fixture a unit test asks
# for, such as nats_server, too); teardown is not: the session's last test tears down
# every session fixture, the integration tests' servers included.
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, object, object]:
    with Boundary():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    with Boundary():
        return (yield)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A real store (SQLite) in the test's temp dir, closed after it."""
    s = Store(tmp_path / "supplier.db")
    try:
        yield s
    finally:
        s.close()
