"""One worker's machines: their lifecycle, driven by the worker's driver, every step in the
op log before it is reported.

    start:   reserved|stopped -> starting -> (pull the image if not cached) -> started
    stop:    started -> stopping -> stopped        (the driver stops the run)
    destroy: any live state -> destroyed           (resources go back to the market)

Each machine has its own lock, so a slow pull on one machine never delays another.

A started machine's run is followed: when it ends by itself, the restart policy
(supplier/machines/restart.py) says whether it starts again and after which backoff (a
``restarted`` record with the exit and the count), or its exit is recorded: ``failed``
when it was killed (``oom`` at its memory limit, or a signal), else ``stopped``. The same
policy applies to a machine whose checks failed 3 times in a row (supplier/machines/
health.py) and to a start whose image could not be pulled (supplier/machines/pulls.py): the
machine is then ``failed``, its last exit (code 125) and event say ``pull_failed: <why>``.

A machine of a content image (``image_digest``) pins its digest in the worker's content
cache from its commit (or its load after a restart) until its destroy, and pulls it in the
background right after its commit. Every start records a ``pulled`` event with the bytes it
fetched (0 when the image was here) and the seconds.

What happened while the store refused writes is not lost: a run that ended for good, or a
stop or destroy whose run is already gone, is kept as an unrecorded fact and written once
the store takes writes again (:meth:`Machines.record_facts`); a destroy asked while the
store refuses writes is refused before it touches the machine.

Background work (runs followed, pulls, checks, restarts) and the driver's own tasks run in
the task group of :meth:`Machines.run`, which the supplier host starts before it serves and
ends with :meth:`Machines.close` when it stops.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import structlog

from bourse.runtime.tasks import TaskSet
from bourse.wire.messages import Error, Event, Health, LastExit, Machine, MachineLogs, now_ms
from bourse.wire.metadata import RestartPolicy
from supplier.checks import Verdict
from supplier.images import PullFailed, WorkerImages
from supplier.machines.api import Driver, DriverError, Exit, ImageRun
from supplier.machines.events import (
    PULL_FAILED,
    START_FAILED_CODE,
    AnnounceFn,
    EventFn,
    Fact,
    pull_failed,
)
from supplier.machines.health import Checking
from supplier.machines.lifecycle import (
    EVENT_OF,
    INTERMEDIATE,
    SHOULD_RUN,
    InvalidTransition,
    next_state,
)
from supplier.machines.pulls import Pulls
from supplier.machines.records import Records
from supplier.machines.restart import Backoff, BadPolicy, Cause, decide, policy_of
from supplier.oplog import RunSpec
from supplier.ports import run_env
from supplier.secrets import with_secrets
from supplier.store import Store, StoreError

MAX_LOG_BYTES = 48 * 1024  # a logs reply stays well under the 64 KiB payload limit
# How long a stop waits for the lifecycle work under way (a store write each) to finish.
LIFECYCLE_S = 5.0
# A run that could not be started again after it ended (its restart failed).
CANNOT_RUN_CODE = 127


class Machines:
    def __init__(
        self,
        worker_id: str,
        store: Store,
        driver: Driver,
        images: WorkerImages,
        event: EventFn,
        announce: AnnounceFn,
        on_destroyed: Callable[[Machine], None],
        on_store_error: Callable[[str], None],
        default_policy: Callable[[Machine], str] = lambda m: "no",
    ) -> None:
        self.worker_id = worker_id
        self.store = store
        self.driver = driver
        self.images = images
        self.event = event
        self.announce = announce
        self.on_destroyed = on_destroyed
        self.on_store_error = on_store_error
        self.default_policy = default_policy  # a catalog image's own restart policy
        self.checking = Checking(self._checked)
        self.records = Records(
            worker_id,
            store,
            images,
            event,
            announce,
            lambda m: self.checking.follow(m, self._timers),
            self.checking.end,
            self._gone,
            on_store_error,
        )
        self.by_id = self.records.by_id
        self.by_order = self.records.by_order  # order id -> machine id (I3)
        self.specs = self.records.specs  # machine id -> its order's env, when it has one
        self.facts = self.records.facts  # machine id -> what the store has not recorded yet
        # The lifecycle work (an abort, a store's facts): tasks owned here, ended by run()'s end.
        self._work = TaskSet(f"machines:{worker_id}")
        self._running = False  # run() is under way (its driver started), not yet ending
        self._scope: anyio.CancelScope | None = None  # run()'s shield, cancelled by close()
        self._run_ended: anyio.Event | None = None  # set once run() and its driver ended
        self._closing = False
        self._backoffs: dict[str, Backoff] = {}  # machine id -> its restarts in a row
        # machine id -> the number of its current run (a stop or a new start moves it on:
        # the follower of an older run then records nothing) and when that run began
        self._run_no: dict[str, int] = {}
        self._began: dict[str, float] = {}
        # run()'s: runs followed, background pulls, checks, restarts; close() cuts them short
        self._timers: anyio.abc.TaskGroup | None = None
        self.pulls = Pulls(worker_id, images, driver, self.records.report_pull)
        self.log = structlog.get_logger("bourse.machines").bind(worker_id=worker_id)

    def load(self) -> list[Machine]:
        return self.records.load()

    def live(self) -> int:
        return self.records.live()

    def get(self, machine_id: str) -> Machine | Error:
        return self.records.get(machine_id)

    async def record_facts(self) -> None:
        await self.records.record_facts()

    async def abort(self, m: Machine) -> None:
        """The auction gave up on this commit: undo it so its Unfilled stays true (I4)."""
        await self.records.undo(m, "abort", "the auction gave up waiting for the commit", "aborted")

    async def reclaim(self, m: Machine, why: str) -> None:
        """An orphan (docs/protocol.md §5.3d): no buyer holds it, its order's claim says
        ``why``. Destroyed like an abort (never started, so nothing runs)."""
        await self.records.undo(m, "reclaim", why, f"reclaimed: {why}")
        self.log.warning("machine_reclaimed", machine_id=m.machine_id, order_id=m.order_id)

    def in_use(self, image: str) -> bool:
        """Whether a running machine uses the catalog LRU's entry ``image``."""
        key = self.images.key
        return any(key(m) == image and m.state in SHOULD_RUN for m in self.by_id.values())

    def policy(self, m: Machine) -> RestartPolicy:
        """``m``'s restart policy (BadPolicy for one that is none)."""
        return policy_of(m, self.default_policy(m))

    def _event(
        self, kind: str, m: Machine, detail: str = "", pulled: tuple[int, float] = (0, 0.0)
    ) -> Event:
        """An event of ``m`` (with its image's digest)."""
        return self.event(
            kind, m.order_id, m.machine_id, detail, image_digest=m.image_digest, pulled=pulled
        )

    def _gone(self, m: Machine) -> None:
        """``m`` was destroyed: its image may go, its resources go back to the market."""
        self.images.unpin(m)
        self._backoffs.pop(m.machine_id, None)
        self.specs.pop(m.machine_id, None)
        self.on_destroyed(m)

    def added(self, m: Machine, spec: RunSpec | None = None) -> None:
        """A commit placed ``m`` (already durable, with ``spec``): it pins its image and, if
        that is not here, pulls it in the background."""
        self.by_id[m.machine_id] = m
        if spec is not None and spec.env:
            self.specs[m.machine_id] = spec
        self.by_order[m.order_id] = m.machine_id
        self.images.pin(m)
        self._prefetch(m)

    def _prefetch(self, m: Machine) -> None:
        if self._running and not self._closing:
            self.pulls.prefetch(m, self._timers)

    # -- verbs ------------------------------------------------------------------------------------
    async def transition(self, verb: str, machine_id: str) -> Machine | Error:
        async with self.records.lock(machine_id):
            m = self.records.get(machine_id)
            if isinstance(m, Error):
                return m
            try:
                to = next_state(verb, machine_id, m.state)
            except InvalidTransition as exc:
                return Error(code="bad_request", detail=str(exc))
            if to == m.state:
                return m
            if verb == "destroy" and self.store.failure:  # it could not be recorded: refuse
                return Error(  # before the machine is touched
                    code="internal",
                    detail=f"cannot destroy {machine_id}: the worker's store refuses writes "
                    f"({self.store.failure}); destroy it again once the store has room",
                )
            try:
                m = await self._run(verb, m, to)
            except StoreError as exc:
                self.on_store_error(str(exc))
                return Error(code="internal", detail=f"cannot {verb} {machine_id}: {exc}")
            except DriverError as exc:
                return Error(code="internal", detail=f"cannot {verb} {machine_id}: {exc}")
        self.log.info("machine_" + EVENT_OF[verb], order_id=m.order_id, machine_id=machine_id)
        return m

    async def _run(self, verb: str, m: Machine, to: str) -> Machine:
        if verb in INTERMEDIATE:
            m = await self.records.record(m, INTERMEDIATE[verb], verb)
        if verb == "start":
            self._backoffs.pop(m.machine_id, None)  # a start by hand begins the count again
            return await self._start(m)
        self._unfollow(m.machine_id)
        if verb == "stop":
            await self.driver.stop(m.machine_id)
        else:
            await self.driver.destroy(m)
        done = self.records.event_of(EVENT_OF[verb], m)
        m = await self.records.record_fact(m, Fact(m.state, to, verb, events=(done,)))
        if to == "destroyed":
            self._gone(m)
        return m

    async def _launch(self, m: Machine) -> tuple[Event, ...]:
        """Make ``m``'s image ready and run it once; the ``pulled`` event of a pull.
        PullFailed, or DriverError naming why it could not run."""
        try:
            self.policy(m)  # checked before anything runs; applied when the run ends
        except BadPolicy as exc:
            raise DriverError(str(exc)) from None
        pulled: tuple[Event, ...] = ()
        run: ImageRun | None = None
        if m.image_digest and self.images.content is not None:
            got = await self.pulls.for_start(m)
            pulled = (self.records.pulled_event(m, got),)
            run = ImageRun(got.root, got.run)
        else:
            took = await self.pulls.catalog(m, self.in_use)
            if took is not None:
                pulled = (self.records.event_of("pulled", m, f"{m.image} in {took[1]:.3f}s", took),)
        spec, src = self.specs.get(m.machine_id), self.images.source
        env = await with_secrets(src.nc, src.prefix, m, spec.env if spec else {})
        try:
            await self.driver.start(m, run, run_env(m, env))
        except DriverError as exc:
            raise _StartFailed(exc, pulled) from None
        self._follow(m.machine_id)
        return pulled

    async def _start(self, m: Machine, resumed: bool = False) -> Machine:
        """Pull if needed, run, record started; a failure records stopped (failed when the
        image could not be pulled) and re-raises as a DriverError."""
        try:
            pulled = await self._launch(m)
        except PullFailed as exc:
            await self._pull_failed(m, exc)
            raise DriverError(pull_failed(str(exc))) from None
        except (_StartFailed, DriverError) as exc:
            pulled = exc.pulled if isinstance(exc, _StartFailed) else ()
            why = str(exc)
            stopped = self.records.event_of("stopped", m, f"start failed: {why}")
            await self.records.record(m, "stopped", "start_failed", why, (*pulled, stopped))
            raise DriverError(why) from None
        return await self.records.started(m, resumed, pulled, self.driver.inspect(m.machine_id))

    # -- runs followed, and the restart policy ------------------------------------------------
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
            except (PullFailed, _StartFailed, DriverError) as exc:
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

    # -- the keeper's own life ------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Own this worker's background work and its driver's tasks until :meth:`close`.
        Shielded from the caller's cancellation: a stop lets the work under way finish and
        stops (or lets go of) the machines (close), then this ends. It may run again after
        (the operator's start of a stopped worker, §4.22), as after a supplier's restart."""
        self._closing = False
        self._run_ended = anyio.Event()
        try:
            with anyio.CancelScope(shield=True) as self._scope:
                async with anyio.create_task_group() as tasks:
                    await tasks.start(self.driver.run)
                    self._timers = tasks
                    self._running = True
                    task_status.started()
                    await anyio.sleep_forever()  # until close() cancels the scope
        finally:
            self._running = False
            self._timers = None
            self.checking.forget()  # their tasks ended with this group
            with anyio.CancelScope(shield=True):  # what close() did not wait for ends here
                await self._work.finish(0)
            self._run_ended.set()

    async def ended(self) -> None:
        """Until :meth:`run` has ended, its driver's end included (the last run's)."""
        if self._run_ended is not None:
            await self._run_ended.wait()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Background lifecycle work (an abort, a restart), while run() runs; a failure is
        logged. Work that arrives once the worker is stopping is dropped (logged)."""
        if not self._running or self._closing:
            work.close()  # never started: no "coroutine was never awaited"
            if not self._closing:
                raise RuntimeError("Machines.spawn() needs Machines.run() to be running")
            self.log.warning("lifecycle_work_dropped", reason="the worker is stopping")
            return
        self._work.spawn(self._logged(work))

    async def _logged(self, work: Coroutine[Any, Any, None]) -> None:
        try:
            await work
        except Exception as exc:  # one failed step must not end the others (nor run())
            self.log.error("lifecycle_task_failed", error=repr(exc))

    async def resume(self) -> None:
        """After a restart: machines that should run are recovered from the runs an earlier
        supplier left (an exit meanwhile then goes through the restart policy) or started
        again; half-done stops are finished; reserved machines pull their image in the
        background again."""
        for m in list(self.by_id.values()):
            async with self.records.lock(m.machine_id):
                try:
                    if m.state in SHOULD_RUN and await self.driver.recover(m):
                        self._follow(m.machine_id)
                        await self._resumed(m)
                    elif m.state in SHOULD_RUN:
                        await self._start(m, resumed=True)
                    elif m.state == "stopping":
                        if await self.driver.recover(m):
                            await self.driver.stop(m.machine_id)
                        await self.records.record(m, "stopped", "stop")
                    elif m.state == "reserved":
                        self._prefetch(m)
                except (DriverError, StoreError) as exc:
                    self.log.error("machine_resume_failed", machine_id=m.machine_id, error=str(exc))
        await self.driver.settle()  # what an earlier run left that none of them took over

    async def _resumed(self, m: Machine) -> None:
        ev = self.event(
            "started",
            m.order_id,
            m.machine_id,
            "resumed",
            image_digest=m.image_digest,
            addresses=m.addresses,
        )
        await self.records.record(m, "started", "resume", events=(ev,))

    async def logs(self, machine_id: str, tail: int, since: int = -1) -> MachineLogs | Error:
        m = self.records.get(machine_id)
        if isinstance(m, Error):
            return m
        lines, truncated, end = self.driver.logs(machine_id, tail, MAX_LOG_BYTES, since)
        return MachineLogs(machine_id=machine_id, lines=lines, truncated=truncated, end=end)

    async def close(self, timeout_s: float = LIFECYCLE_S) -> None:
        """Stop: let the lifecycle work under way finish (for at most ``timeout_s``), then
        the driver stops every machine's run (or lets go of it: kept machines run on) with
        nothing recorded (their state still says started: the next supplier resumes them),
        then end :meth:`run`. The caller bounds the whole; run() ends even when this is cut
        short (the driver then stops what still runs)."""
        try:
            with anyio.move_on_after(timeout_s):
                await self._work.wait()
            self._closing = True
            await self.driver.close()
        finally:
            self._closing = True
            if self._scope is not None:
                self._scope.cancel()


class _StartFailed(DriverError):
    """The driver could not start the machine (after its image was pulled: ``pulled``)."""

    def __init__(self, cause: DriverError, pulled: tuple[Event, ...]) -> None:
        super().__init__(str(cause))
        self.pulled = pulled
