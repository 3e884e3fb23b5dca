"""``buyer machines exec ID -- CMD…``: a command run inside a started machine (docs/protocol.md
§4.24), its streams relayed through the exchange. Without ``-t`` its stdout and stderr are
this program's, apart, and its exit code is this program's; ``-i`` sends this program's
stdin; ``-t`` a terminal on the worker (this terminal in raw mode, its size followed)."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Annotated

import typer

from bourse.runtime.cli import fail
from buyer_cli.options import MachineDirectOpt, MachineIdArg
from buyer_cli.session import with_client

if TYPE_CHECKING:
    from anyio.streams.memory import MemoryObjectReceiveStream

    from bourse.client import BourseClient
    from bourse.client.execs import Ended, Input
    from bourse.wire.messages import ExecRequest

FDS = {"stdout": 1, "stderr": 2}


def exec_command(
    ctx: typer.Context,
    machine_id: MachineIdArg,
    command: Annotated[
        list[str],
        typer.Argument(help="What to run, after --: CMD [ARG...]", metavar="-- CMD [ARG...]"),
    ],
    interactive: Annotated[
        bool, typer.Option("--interactive", "-i", help="Send this program's stdin.")
    ] = False,
    tty: Annotated[
        bool,
        typer.Option("--tty", "-t", help="A terminal on the worker (with -i: a shell, say)."),
    ] = False,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", "-e", metavar="KEY=VALUE", help="Over the machine's (repeatable)."),
    ] = None,
    timeout_s: Annotated[
        int,
        typer.Option("--timeout", min=1, max=86400, metavar="S", help="Killed after S seconds."),
    ] = 3600,
    direct: MachineDirectOpt = False,
) -> None:
    """Run a command inside a started machine (as the machine runs: its user, namespaces,
    cgroups, environment and working directory). Its exit code is this command's."""
    from bourse.client.orderflags import FlagError, parse_env
    from bourse.wire.messages import ExecRequest

    if command[:1] == ["--"]:  # after the machine id every word is the command's, -- too
        command = command[1:]
    if not command:
        fail("no command: write it after --, e.g. buyer machines exec ID -- id -u")
    try:
        extra = parse_env(env)
    except FlagError as exc:
        fail(str(exc))
    if tty:
        extra.setdefault("TERM", os.environ.get("TERM", "xterm"))
    rows, cols = _size()
    req = ExecRequest(
        machine_id=machine_id,
        command=command,
        tty=tty,
        stdin=interactive,
        env=extra,
        rows=rows,
        cols=cols,
        timeout_s=timeout_s,
    )
    ended = with_client(ctx, lambda c: _run(c, req), direct=direct)
    if ended.detail:
        typer.echo(f"exec: {ended.detail}", err=True)
    raise typer.Exit(ended.status)


async def _run(c: BourseClient, req: ExecRequest) -> Ended:
    import anyio

    async def output(stream: str, data: bytes) -> None:
        await anyio.to_thread.run_sync(_write_all, FDS.get(stream, 1), data)

    with _raw(req.tty and req.stdin), _nonblocking_stdin(req.stdin) as read_input:
        async with _sizes(req.tty) as sizes:
            return await c.exec(req, output, read_input if req.stdin else None, sizes)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(sys.stdout.fileno())
    except (OSError, ValueError):
        return 24, 80
    return max(1, size.lines), max(1, size.columns)


@contextlib.contextmanager
def _raw(on: bool) -> Iterator[None]:
    """This terminal in raw mode while a remote one is used (restored after)."""
    if not on or not os.isatty(0):
        yield
        return
    import termios
    import tty

    saved = termios.tcgetattr(0)
    tty.setraw(0, termios.TCSADRAIN)  # what was typed ahead is kept, not flushed
    try:
        yield
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _nonblocking_stdin(on: bool) -> Iterator[Input]:
    """A reader of stdin that waits without a thread (a pipe or terminal made non-blocking
    meanwhile; a file read as it is)."""
    import anyio

    fd = 0
    regular = on and stat.S_ISREG(os.fstat(fd).st_mode)
    was = os.get_blocking(fd) if on and not regular else True
    if on and not regular:
        os.set_blocking(fd, False)

    async def read(n: int) -> bytes:
        while True:
            try:
                return os.read(fd, n)
            except BlockingIOError:
                await anyio.wait_readable(fd)

    try:
        yield read
    finally:
        if on and not regular:
            os.set_blocking(fd, was)


@contextlib.asynccontextmanager
async def _sizes(on: bool) -> AsyncIterator[MemoryObjectReceiveStream[tuple[int, int]] | None]:
    """The terminal's size each time it changes (SIGWINCH), while a remote one is used."""
    if not on:
        yield None
        return
    import signal

    import anyio

    send, receive = anyio.create_memory_object_stream[tuple[int, int]](8)

    async def follow() -> None:
        with anyio.open_signal_receiver(signal.SIGWINCH) as signals:
            async for _ in signals:
                with contextlib.suppress(anyio.WouldBlock):
                    send.send_nowait(_size())

    with send, receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            try:
                yield receive
            finally:
                tg.cancel_scope.cancel()
