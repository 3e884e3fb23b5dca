"""A started machine's health checks, run by its worker: each check every ``interval_s``
(the first one interval after the start: the machine's time to begin listening), in tasks
of their own, from scratch at each start (a :class:`HealthCore` per run, supplier/checks.py),
ended when the machine is no longer started. What each run says goes to ``checked`` (the
keeper records a change of status and applies the restart policy to a machine critical 3
times in a row, supplier/machines/keeper.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
import structlog

from bourse.wire.messages import Check, Machine, now_ms
from supplier.checks import HealthCore, Verdict, probe

log = structlog.get_logger("bourse.machines")

CheckedFn = Callable[[str, Verdict], Awaitable[None]]


class Checking:
    """The checks of one worker's started machines."""

    def __init__(self, checked: CheckedFn) -> None:
        self.checked = checked
        self._scopes: dict[str, anyio.CancelScope] = {}  # machine id -> its checks' scope

    def follow(self, m: Machine, tasks: anyio.abc.TaskGroup | None) -> None:
        """Run ``m``'s checks while it is started (in ``tasks``); end them otherwise."""
        if m.state != "started":
            self.end(m.machine_id)
            return
        if not m.checks or m.machine_id in self._scopes or tasks is None:
            return
        scope = self._scopes[m.machine_id] = anyio.CancelScope()
        tasks.start_soon(self._run, m, scope)

    def forget(self) -> None:
        """The task group the checks ran in has ended: none runs; a next run follows anew."""
        self._scopes.clear()

    def end(self, machine_id: str) -> None:
        scope = self._scopes.pop(machine_id, None)
        if scope is not None:
            scope.cancel()

    async def _run(self, m: Machine, scope: anyio.CancelScope) -> None:
        core = HealthCore(len(m.checks))
        with scope:
            try:
                async with anyio.create_task_group() as tasks:
                    for i, check in enumerate(m.checks):
                        tasks.start_soon(self._loop, m, core, i, check)
            except Exception as exc:  # one machine's checks must not end the worker's work
                log.error("checks_failed", machine_id=m.machine_id, error=repr(exc))

    async def _loop(self, m: Machine, core: HealthCore, i: int, check: Check) -> None:
        address = m.addresses[check.port]
        while True:
            await anyio.sleep(check.interval_s)  # the check's period, not a synchronisation
            ok, detail = await probe(check, address)
            await self.checked(m.machine_id, core.observe(i, ok, detail, now_ms()))
