"""One worker's machines: their lifecycle, driven by the worker's driver, every step in the
op log before it is reported.

    start:   reserved|stopped -> starting -> (pull the image if not cached) -> started
    stop:    started -> stopping -> stopped        (the driver stops the run)
    destroy: any live state -> destroyed           (resources go back to the market)

Each machine has its own lock, so a slow pull on one machine never delays another.

A started machine's run is followed to its end and the restart policy applied to its exit,
its failed checks and its failed pulls: supplier/machines/runs.py (``Runs``, a part of
``Machines``).

A content image's digest is pinned in the worker's cache from the commit to the destroy
(:meth:`Machines.added`); what happened while the store refused writes is written later
(:meth:`Machines.record_facts`).

Background work (runs followed, pulls, checks, restarts) and the driver's own tasks run in
the task group of :meth:`Machines.run`, which the supplier host starts before it serves and
ends with :meth:`Machines.close` when it stops.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import structlog

from bourse.runtime.tasks import TaskSet
from bourse.wire.messages import Error, Event, Machine, MachineLogs
from bourse.wire.metadata import RestartPolicy
from supplier.images import PullFailed, WorkerImages
from supplier.machines.api import Driver, DriverError, ImageRun, LaunchFailed
from supplier.machines.events import (
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
from supplier.machines.records import Queued, Records
from supplier.machines.restart import Backoff, BadPolicy, policy_of
from supplier.machines.runs import Runs
from supplier.oplog import RunSpec
from supplier.ports import run_env
from supplier.secrets import with_secrets
from supplier.store import Store, StoreError

MAX_LOG_BYTES = 48 * 1024  # a logs reply stays well under the 64 KiB payload limit
# How long a stop waits for the lifecycle work under way (a store write each) to finish.
LIFECYCLE_S = 5.0


class Machines(Runs):
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
        """What happened while the store refused writes (a run that ended for good, a stop
        or destroy whose run was already gone: facts kept unrecorded), written now that it
        takes writes again; a destroy asked meanwhile was refused before it touched the
        machine."""
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
        """A commit placed ``m`` (already durable, with ``spec``): it pins its image (a
        content image's digest, in the worker's cache until its destroy; also at a load after
        a restart) and, if that is not here, pulls it in the background. Every start then
        records a ``pulled`` event with the bytes it fetched (0: the image was here)."""
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
        if verb == "start":
            return await self._start_asked(m)
        if verb in INTERMEDIATE:
            m = await self.records.record(m, INTERMEDIATE[verb], verb)
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
            raise LaunchFailed(exc, pulled) from None
        self._follow(m.machine_id)
        return pulled

    async def _start_asked(self, m: Machine) -> Machine:
        """A start asked for. Its ``starting`` is written while the machine starts, not
        before: it need not be durable before the shim runs, as a supplier killed first
        finds the shim at its next start and stops it, its store saying the machine is not
        to run (Runner.settle; the asker had no answer). It is durable before the start's
        outcome is recorded."""
        self._backoffs.pop(m.machine_id, None)  # a start by hand begins the count again
        starting = self.records.queued(m, "starting", "start")
        try:
            return await self._start(starting.new, starting=starting)
        except anyio.get_cancelled_exc_class():
            await self._cut_short(starting)
            raise
        except BaseException:
            with contextlib.suppress(StoreError):
                await starting.done()  # memory as the store has it, whatever failed
            raise

    async def _start(
        self, m: Machine, resumed: bool = False, starting: Queued | None = None
    ) -> Machine:
        """Pull if needed, run, record started; a failure records stopped (failed when the
        image could not be pulled) and re-raises as a DriverError. ``starting``: the start's
        record, queued: durable before either (a run it could not be written for is
        stopped, StoreError)."""
        began = time.perf_counter()
        try:
            pulled = await self._launch(m)
        except PullFailed as exc:
            m = await _written(m, starting)
            await self._pull_failed(m, exc)
            raise DriverError(pull_failed(str(exc))) from None
        except (LaunchFailed, DriverError) as exc:
            m = await _written(m, starting)
            pulled = exc.pulled if isinstance(exc, LaunchFailed) else ()
            why = str(exc)
            stopped = self.records.event_of("stopped", m, f"start failed: {why}")
            await self.records.record(m, "stopped", "start_failed", why, (*pulled, stopped))
            raise DriverError(why) from None
        launched = time.perf_counter()
        try:
            m = await _written(m, starting)
        except StoreError:
            with anyio.CancelScope(shield=True):
                self._unfollow(m.machine_id)
                await self.driver.stop(m.machine_id)
            raise
        written = time.perf_counter()
        m = await self.records.started(m, resumed, pulled, self.driver.inspect(m.machine_id))
        done = time.perf_counter()
        self.log.info(  # where a start's time went (docs/performance.md: machine starts)
            "machine_start_steps",
            machine_id=m.machine_id,
            launch_ms=round((launched - began) * 1000, 2),
            starting_ms=round((written - launched) * 1000, 2),  # its record, after the launch
            started_ms=round((done - written) * 1000, 2),
        )
        return m

    async def _cut_short(self, starting: Queued) -> None:
        """A start asked for was cancelled (its supplier stops): the driver undid what it
        made; the machine is recorded stopped (its asker got no started machine), not left
        starting (a resumed machine's start cut short stays as it was: the next supplier
        resumes it)."""
        why = "start cut short: the worker stopped"
        m = starting.new
        stopped = self.records.event_of("stopped", m, why)
        with anyio.move_on_after(LIFECYCLE_S, shield=True):
            try:
                m = await starting.done()
                await self.records.record(m, "stopped", "start_failed", why, (stopped,))
            except StoreError as exc:
                mid = m.machine_id
                self.log.error("machine_cut_short_unrecorded", machine_id=mid, error=str(exc))

    # -- the keeper's own life ------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Own this worker's background work and its driver's tasks until :meth:`close`.
        Shielded from the caller's cancellation once started: a stop lets the work under
        way finish and stops (or lets go of) the machines (close), then this ends. A stop
        that comes while it starts ends it at once (its driver undoes its start): the
        caller, cancelled in ``start``, waits for it and calls no close. It may run again
        after (the operator's start of a stopped worker, §4.22), as after a supplier's
        restart."""
        self._closing = False
        self._run_ended = anyio.Event()
        try:
            with anyio.CancelScope() as self._scope:
                async with anyio.create_task_group() as tasks:
                    await tasks.start(self.driver.run)
                    await anyio.lowlevel.checkpoint_if_cancelled()  # stopped while starting
                    self._timers = tasks
                    self._running = True
                    self._scope.shield = True
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


async def _written(m: Machine, starting: Queued | None) -> Machine:
    """``m`` as its queued start's record made it, once durable (``m`` itself: none)."""
    return m if starting is None else await starting.done()
