"""The programs' console scripts run in this process: ``cli_main`` (exactly what the
``buyer``, ``bourse``, ``supplier`` and ``exchange`` scripts run) under typer's CliRunner
isolation, with stdout and stderr apart. No subprocess: a test that needs the real program
(its exit status seen by a shell, a signal, a terminal) starts it instead."""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Mapping
from typing import Any, TextIO

import anyio
import structlog
import typer
from typer.testing import CliRunner

from bourse.runtime.cli import cli_main
from buyer_cli.cli import app as buyer_app
from tests.market import Market


class _Routed:
    """sys.stdout or sys.stderr while a CLI runs: what the CLI's thread writes is the
    CLI's; what any other thread writes (a market logging on the test's event loop) goes
    where it went before."""

    def __init__(self, cli: TextIO, others: TextIO) -> None:
        self._cli, self._others, self._thread = cli, others, threading.get_ident()

    def __getattr__(self, name: str) -> Any:
        here = threading.get_ident() == self._thread
        return getattr(self._cli if here else self._others, name)


def run_cli(
    app: typer.Typer, *args: str, env: Mapping[str, str | None] | None = None
) -> tuple[int, str, str]:
    """``app``'s console script with ``args``: its exit code, stdout and stderr. Logging
    is left as it was (a program configures it for the whole process)."""
    code: object = None
    before, logging = (sys.stdout, sys.stderr), structlog.get_config()
    with CliRunner().isolation(env=env) as (out, err, _):
        sys.stdout, sys.stderr = _Routed(sys.stdout, before[0]), _Routed(sys.stderr, before[1])
        try:
            cli_main(app, list(args))
        except SystemExit as done:
            code = done.code
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            structlog.configure(**logging)
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    assert isinstance(code, int), code
    return code, stdout, stderr


async def buyer(
    market: Market, *args: str, env: Mapping[str, str | None] | None = None
) -> tuple[int, str, str]:
    """``buyer args`` on the market's server and prefix (as BOURSE_NATS_URL and --prefix),
    in a worker thread: the CLI runs its own event loop while the market serves on this
    one. Until the CLI sets up its logging, the market logs to this test's stderr."""
    argv = (*args, "--prefix", market.subjects.prefix)
    environ = {"BOURSE_NATS_URL": market.url, **(env or {})}
    config, here = structlog.get_config(), sys.stderr
    structlog.configure(logger_factory=lambda *_: structlog.PrintLogger(here))
    try:
        return await anyio.to_thread.run_sync(lambda: run_cli(buyer_app, *argv, env=environ))
    finally:
        structlog.configure(**config)


async def run_module(*args: str, timeout_s: float = 60.0) -> tuple[int, str, str]:
    """``python -m args...`` as a real process: its exit code, stdout and stderr. One that
    has not ended within ``timeout_s`` (a program that serves instead of refusing) is
    killed, never left behind, and the timeout raised."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()
