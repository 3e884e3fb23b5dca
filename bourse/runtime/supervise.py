"""How every long-running program runs: the event loop (uvloop when installed), a clean
stop on SIGINT/SIGTERM, and a settled heap once started."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Callable[[asyncio.Event], Awaitable[T]]) -> T:
    """Run ``main(stop_event)`` on uvloop if available; SIGINT/SIGTERM set the stop event."""

    async def wrapper() -> T:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        return await main(stop)

    return run_fast(wrapper())


def settle_heap() -> None:
    """Call once a program has started: every object made so far (a thousand virtual
    workers' state, a load test's trace) moves out of the cyclic GC's reach (gc.freeze), so
    the oldest-generation collections, which walk all of it, stop stalling the event loop
    for tens of milliseconds, a spike straight into the p99 latency."""
    gc.collect()
    gc.freeze()


def run_fast(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when it is installed (pip install bourse[fast])."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)
