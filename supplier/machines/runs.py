"""A worker's machines' runs followed, and the restart policy applied (the keeper's part,
supplier/machines/keeper.py ``Machines``): a started machine's run is followed to its end;
when it ends by itself, the policy (supplier/machines/restart.py) says whether it starts
again and after which backoff (a ``restarted`` record with the exit and the count), or its
exit is recorded. The same policy applies to a machine whose checks failed 3 times in a
row (supplier/machines/health.py) and to a start whose image could not be pulled: the
machine is then ``failed``, its last exit (code 125) and event say ``pull_failed: <why>``.

Each run has a number (a stop or a new start moves it on): the follower of an older run,
or a restart whose machine moved meanwhile, records nothing.
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc

from bourse.wire.messages import Event, Health, LastExit, Machine, now_ms
from bourse.wire.metadata import RestartPolicy
from supplier.checks import Verdict
from supplier.images import PullFailed
from supplier.machines.api import Driver, DriverError, Exit, LaunchFailed
from supplier.machines.events import PULL_FAILED, START_FAILED_CODE, pull_failed
from supplier.machines.restart import Backoff, Cause, decide

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from supplier.machines.health import Checking
    from supplier.machines.records import Records

# A run that could not be started again after it ended (its restart failed).
CANNOT_RUN_CODE = 127


class Runs:
    """The machines' runs followed and restarted (``Machines``' state, declared)."""

    if TYPE_CHECKING:
        driver: Driver
        records: Records
        checking: Checking
        by_id: dict[str, Machine]
        log: FilteringBoundLogger
        _closing: bool
        _timers: anyio.abc.TaskGroup | None
        _backoffs: dict[str, Backoff]
        _run_no: dict[str, int]
        _began: dict[str, float]

        def policy(self, m: Machine) -> RestartPolicy: ...
        def spawn(self, work: Coroutine[Any, Any, None]) -> None: ...
        async def _logged(self, work: Coroutine[Any, Any, None]) -> None: ...
        async def _start(self, m: Machine, resumed: bool = False) -> Machine: ...
        async def _launch(self, m: Machine) -> tuple[Event, ...]: ...

    def _follow(self, machine_id: str) -> None:
        """Follow the machine's run that just began (it replaces any earlier one)."""
        n = self._run_no[machine_id] = self._run_no.get(machine_id, 0) + 1
        self._began[machine_id] = time.monotonic()
        if self._timers is not None:
            self._timers.start_soon(
                self._logged, self._ended(machine_id, n), name=f"follow {machine_id}"
            )

    def _unfollow(self, machine_id: str) -> None:
        """The run is stopped on purpose: its end is not a restart's business."""
        self._run_no[machine_id] = self._run_no.get(machine_id, 0) + 1
        self.checking.end(machine_id)

    def _backoff(self, machine_id: str) -> Backoff:
        return self._backoffs.setdefault(machine_id, Backoff())

    async def _ended(self, machine_id: str, n: int) -> None:
        """Run ``n`` of the machine ended by itself: restart it as its policy says (after
        the backoff), or record its exit."""
        try:
            how = await self.driver.wait(machine_id)
        except DriverError:
            return  # stopped meanwhile: its stop collected it
        async with self.records.lock(machine_id):
            m = self.by_id.get(machine_id)
            if self._run_no.get(machine_id) != n or self._closing or m is None:
                return
            if m.state != "started":
                return
            ran = time.monotonic() - self._began.get(machine_id, time.monotonic())
            verdict = decide(self.policy(m), "exit", self._backoff(machine_id), how=how, ran_s=ran)
            if not verdict.restart:
                await self.records.exited(m, how)
                return
            m = await self.records.restarted(m, how)
        await self._start_again(machine_id, n, verdict.delay_s, "exit")

    async def _start_again(self, machine_id: str, n: int, delay_s: float, cause: Cause) -> None:
        """After the backoff, run the machine again, unless something moved it meanwhile."""
        await anyio.sleep(delay_s)  # the restart policy's backoff, not a synchronisation
        async with self.records.lock(machine_id):
            m = self.by_id.get(machine_id)
            if self._run_no.get(machine_id) != n or self._closing or m is None:
                return
            if m.state != ("failed" if cause == "pull" else "started"):
                return
            if cause == "pull":
                await self._start(m)  # a start as by hand: it records itself
                return
            try:
                pulled = await self._launch(m)
            except (PullFailed, LaunchFailed, DriverError) as exc:
                self.log.error("machine_restart_failed", machine_id=machine_id, error=str(exc))
                await self.records.exited(m, Exit(code=CANNOT_RUN_CODE), f"restart failed: {exc}")
                return
            if pulled:
                await self.records.record(m, "started", "pulled", pulled[0].detail, pulled)

    async def _checked(self, machine_id: str, v: Verdict) -> None:
        """A check ran: the machine's health recorded; a check failed 3 times in a row
        restarts a machine whose policy says so."""
        if await self.records.checked(machine_id, v) and v.restart:
            # not in this task: the checks' own, which the restart ends
            self.spawn(self._unhealthy(machine_id, v.health))

    async def _unhealthy(self, machine_id: str, health: Health) -> None:
        """A started machine whose check failed 3 times in a row: its policy says whether
        its run is stopped and started again (its checks from scratch), counted."""
        async with self.records.lock(machine_id):
            m = self.by_id.get(machine_id)
            if m is None or m.state != "started":
                return
            verdict = decide(self.policy(m), "check", self._backoff(machine_id))
            if not verdict.restart:
                return
            why = f"check critical: {health.detail}"
            self.log.warning("machine_unhealthy_restart", machine_id=machine_id, detail=why)
            self._unfollow(machine_id)
            n = self._run_no[machine_id]
            how = await self.driver.stop(machine_id)
            await self.records.restarted(m, how or Exit(signal=15), why)
        await self._start_again(machine_id, n, verdict.delay_s, "check")

    async def _pull_failed(self, m: Machine, exc: PullFailed) -> None:
        """Record a start whose image could not be pulled: ``failed``, its last exit and
        event saying why; its restart policy says whether it is tried again, and when."""
        why = str(exc)
        policy, backoff = self.policy(m), self._backoff(m.machine_id)
        verdict = decide(policy, "pull", backoff, permanent=exc.permanent)
        said = exc.permanent and policy != "no"  # it would have been tried again
        detail = pull_failed(f"{why} ({verdict.why})" if said else why)
        how = LastExit(reason="exit", code=START_FAILED_CODE, at_ms=now_ms(), detail=detail)
        ev = self.records.event_of("failed", m, detail)
        await self.records.record(m, "failed", PULL_FAILED, why, (ev,), last_exit=how)
        self.log.warning(
            "machine_pull_failed", machine_id=m.machine_id, image_digest=m.image_digest, error=why
        )
        if verdict.restart:
            self._unfollow(m.machine_id)
            n = self._run_no[m.machine_id]
            self.spawn(self._start_again(m.machine_id, n, verdict.delay_s, "pull"))
