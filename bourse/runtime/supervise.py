"""How every long-running program runs: one anyio task group at the top (asyncio backend
on uvloop, a dependency except on Windows; asyncio's own loop where it is missing), a
signal receiver in it that cancels everything on SIGINT/SIGTERM, cleanup in shielded,
time-bounded scopes, and a settled heap once started.

A program's ``main()`` serves until it is cancelled (or returns when its job is done); what
it holds is released in ``finally`` blocks under :func:`cleanup_scope`, so the program stops
whatever state it is in: connected, reconnecting, or never connected at all.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import anyio
import anyio.abc
import structlog

T = TypeVar("T")

log = structlog.get_logger("bourse.runtime")

# Exit statuses after a signal: SIGTERM is how a service manager asks for a stop (success);
# SIGINT is Ctrl-C, 130 by the shell's convention (128 + 2), as cli_main's Abort.
EXIT_STATUS = {signal.SIGTERM: 0, signal.SIGINT: 130}
# How long one program's cleanup may take before it is cut short (each step bounds itself
# more tightly; this is the outer bound the signal tests hold a program to).
CLEANUP_S = 1.5
# Tasks left running once ``main`` has cleaned up are cancelled until they end, for at most
# this long, cancelled again every STRAY_RECANCEL_S (see reap_strays).
STRAYS_S = 0.5
STRAY_RECANCEL_S = 0.02


class Stopped(SystemExit):
    """Raised by :func:`run` once ``main`` was cancelled by a signal and cleaned up: the
    process exits with the signal's conventional status (0 for SIGTERM, 130 for SIGINT)."""

    def __init__(self, signum: int) -> None:
        super().__init__(EXIT_STATUS.get(signal.Signals(signum), 128 + signum))
        self.signum = signum


@dataclass
class _Outcome(Generic[T]):
    signum: int | None = None
    result: T | None = None


def run(main: Callable[[], Awaitable[T]]) -> T:
    """Run ``main()`` under anyio until it returns or a SIGINT/SIGTERM cancels it.

    Returns what ``main`` returned; after a signal raises :class:`Stopped` (a SystemExit
    carrying the exit status), once every ``finally`` of ``main`` has run."""
    outcome: _Outcome[T] = _Outcome()
    anyio.run(supervised, main, outcome, backend="asyncio", backend_options=_backend_options())
    if outcome.signum is not None:
        raise Stopped(outcome.signum)
    return outcome.result  # type: ignore[return-value]  # set: main returned, no signal


async def supervised(main: Callable[[], Awaitable[T]], outcome: _Outcome[T]) -> None:
    """``main()`` in a task group beside a signal receiver that cancels the group; what
    ended it goes to ``outcome``. An error of ``main`` is raised as itself (a task group
    would wrap it in an ExceptionGroup), so a CLI's ``typer.Exit`` or a clear error
    reaches ``cli_main`` unchanged."""
    error: BaseException | None = None
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(_cancel_on_signal, tg.cancel_scope, outcome)
            try:
                outcome.result = await main()
            except anyio.get_cancelled_exc_class():
                raise
            except BaseException as exc:
                error = exc
            tg.cancel_scope.cancel()  # the job is done: stop listening for signals
    finally:
        await reap_strays()
    if error is not None:
        raise unwrap(error)


async def reap_strays(timeout_s: float = STRAYS_S) -> None:
    """Cancel every task still running besides this one, again and again until all have
    ended (or ``timeout_s`` passed).

    What is left once ``main`` has cleaned up are tasks a library started outside any task
    group: nats-py's reconnect loop and subscription delivery tasks, when a close was cut
    short by its bound. asyncio's runner cancels those once and then waits for them without
    end, and once is not always enough: Python 3.11's ``asyncio.wait_for`` loses a
    cancellation that races the completion of what it waits for (a refused connect, here),
    and nats-py's reconnect loop, given the connection error instead, tries the next
    server forever (service connections never stop reconnecting). A process whose server
    died as it was told to stop then never exited."""
    me = asyncio.current_task()
    strays = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    with anyio.move_on_after(timeout_s, shield=True):
        while strays:
            for task in strays:
                task.cancel()
            await asyncio.wait(strays, timeout=STRAY_RECANCEL_S)
            strays = [t for t in strays if not t.done()]
    if strays:
        log.warning("tasks_not_stopped", tasks=[t.get_name() for t in strays])


def unwrap(exc: BaseException) -> BaseException:
    """The one error inside (nested) single-error exception groups, else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def _cancel_on_signal(
    scope: anyio.CancelScope,
    outcome: _Outcome[Any],
    *,
    task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for signum in signals:
            log.info("stopping", signal=signal.Signals(signum).name)
            outcome.signum = signum
            scope.cancel()
            return


def cleanup_scope(timeout_s: float = CLEANUP_S) -> anyio.CancelScope:
    """The scope a ``finally`` block cleans up in: shielded from the cancellation that is
    stopping the program (so its awaits run), and cut short after ``timeout_s`` (so a
    server that does not answer cannot hold the stop up)."""
    return anyio.move_on_after(timeout_s, shield=True)


def settle_heap() -> None:
    """Call once a program has started: every object made so far (a thousand virtual
    workers' state, a load test's trace) moves out of the cyclic GC's reach (gc.freeze), so
    the oldest-generation collections, which walk all of it, stop stalling the event loop
    for tens of milliseconds, a spike straight into the p99 latency."""
    gc.collect()
    gc.freeze()


def _backend_options() -> dict[str, Any]:
    """uvloop when it is importable (a dependency except on Windows), else asyncio's loop."""
    return {"use_uvloop": importlib.util.find_spec("uvloop") is not None}
