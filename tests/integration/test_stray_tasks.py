"""A program exits once ``main`` is done even if a library left a task behind that survives
one cancellation (bourse/runtime/supervise.py, ``reap_strays``).

nats-py's reconnect loop is such a task on Python 3.11: ``asyncio.wait_for`` can lose a
cancellation that races a refused connect, and the loop then tries the next server. The
asyncio runner cancels leftover tasks once and waits for them without end, so a supplier
whose nats-server died as it was told to stop never exited. Each case runs ``run`` in a
real subprocess: the old behaviour is a hang, which only a process boundary can bound.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent(
    """
    import asyncio, sys
    from bourse.runtime.supervise import run

    LOSES = int(sys.argv[1])  # cancellations the stray loses before one gets through

    async def stray(looping: asyncio.Event) -> None:
        lost = 0
        while True:
            looping.set()
            try:
                await asyncio.Event().wait()  # what the loop waits for (a connect)
            except asyncio.CancelledError:
                if lost == LOSES:
                    print("stray cancelled", flush=True)
                    raise
                lost += 1  # as a cancellation lost inside wait_for: go on looping

    async def main() -> str:
        looping = asyncio.Event()
        asyncio.get_running_loop().create_task(stray(looping))  # no owner: a library's task
        await looping.wait()  # in its loop (a task cancelled before it starts just ends)
        return "done"

    print(run(main), flush=True)
    """
)
BOUND_S = 20.0  # far beyond a normal exit (well under a second); a hang is forever


def _run(loses: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROGRAM, str(loses)],
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )


def test_a_task_that_loses_one_cancellation_does_not_hold_the_exit() -> None:
    done = _run(loses=1)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["stray cancelled", "done"]


def test_a_task_that_loses_several_cancellations_is_cancelled_until_it_ends() -> None:
    done = _run(loses=5)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["stray cancelled", "done"]
