"""The ``process`` driver: a start runs a machine as a supervised subprocess: an image named
by digest runs its own files (entrypoint and command, its env, a working directory of its
own: supplier/drivers/image_files.py); a catalog image runs the command the worker's
catalog gives it.

- restart policy (a catalog image's spec, or the order's ``restart`` metadata; ``no`` for
  a content image without it): ``no``, ``on-failure``
  (restart on a non-zero exit), ``always``; restarts back off exponentially (0.1 s doubling
  to 10 s), and the backoff resets after a run of 30 s;
- stop: SIGTERM, then SIGKILL after the grace period;
- stdout and stderr are one pipe, copied by the worker's output pump into
  ``<log_dir>/<machine_id>.log``, capped and rotated (supplier/drivers/output.py); a
  destroyed machine's logs are deleted, and so is its working directory (a content image's,
  ``<work_dir>/<machine_id>/``);
- an exit the policy does not restart is reported through ``on_exit`` (the worker records
  the machine as stopped with the exit code, or failed when it was killed: ``oom`` at its
  memory limit, or a signal); a restart is reported through ``on_restart``;
- a command word ``{python}`` stands for the supplier's own Python interpreter;
- confinement (supplier/drivers/confine.py): each machine runs in its own cgroup(s) with the
  limits it was sold, or under rlimits, as the worker's probe found possible. The exec
  wrapper (bourse/runtime/reaper.py) joins the cgroups / sets the rlimits before it execs
  the command. A machine's cgroup lives while it runs: made at each spawn, removed (after
  killing whatever is left in it) when it stops, exits for good or is destroyed; the
  driver's start sweeps leftovers of a supplier that died, and its end removes the worker's
  empty subtree.

Each machine's supervisor (wait for the exit, restart after the backoff) is a task in the
group of :meth:`ProcessDriver.run`. A run is the driver's own child (machines that stop with
their supplier: when run() ends, a process still running is killed), or, with
``shims_dir``, a process held by a shim of its own (supplier/drivers/shims.py): then the
driver's end, or its supplier's death, leaves it running, and the next driver on the data
dir adopts it at its start (its exit meanwhile is applied then); :meth:`settle` stops the
shims no start adopted.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Protocol, cast

import anyio
import anyio.abc
import structlog

from bourse.images.cache import remove_tree
from bourse.wire.messages import Machine, Resources
from supplier.config import RESTART_POLICIES, ImageSpec, RestartPolicy
from supplier.drivers import NO_ENV, DriverError, ImageRun
from supplier.drivers.bundle import DEFAULT_PATH, BundleError
from supplier.drivers.confine import (
    ConfineError,
    Confiner,
    Exit,
    Mechanism,
    too_small,
    weaker_than_cgroups,
)
from supplier.drivers.image_files import Launch, launch, working_dir
from supplier.drivers.output import LogCaps, Logs, Pump
from supplier.drivers.shims import (
    ContainerRun,
    Plan,
    ProcessRun,
    Shim,
    ShimError,
    ShimRun,
    discover,
)
from supplier.drivers.shims import launch as launch_shim

log = structlog.get_logger("bourse.driver.process")

# A command word "{python}" is replaced by the supplier's own interpreter (portable specs).
PYTHON = "{python}"
# A content image's machine: how long a stop waits after SIGTERM (as a catalog spec's default).
IMAGE_STOP_GRACE_S = 10.0
BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 10.0
BACKOFF_RESET_AFTER_S = 30.0
# How long the driver's end waits for the processes it kills (SIGKILL cannot be ignored).
KILL_S = 1.0
# How long an exit waits for the machine's last output to be stored before it is reported
# (a process it left behind may hold its pipe open); and the driver's end, for the pump's.
DRAIN_S = 1.0
PUMP_CLOSE_S = 0.2

# (machine id, how it ended): a machine's process ended and will not be restarted.
ExitFn = Callable[[str, Exit], None]
# (machine id, how it ended, restarts so far): it ended and is being restarted.
RestartFn = Callable[[str, Exit, int], None]


def no_restart_listener(machine_id: str, how: Exit, restarts: int) -> None:
    """Nobody records restarts (a driver used alone)."""


class Running(Protocol):
    """One run of a machine: a process of the process driver, a container of the oci
    driver (supplier/drivers/oci.py)."""

    @property
    def pid(self) -> int: ...

    @property
    def running(self) -> bool: ...

    async def wait(self) -> Exit:
        """Wait for it to end by itself (or by a stop); how it ended."""
        ...

    async def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; killed also when this is cut short."""
        ...

    async def release(self) -> None:
        """It ended: kill what is left of it and remove what it held (its cgroups; a
        container's layer and runtime state). Idempotent; runs to its end (shielded)."""
        ...


class _Process:
    """A machine's process (through the exec wrapper), in the cgroups of its confiner."""

    def __init__(
        self, proc: asyncio.subprocess.Process, confiner: Confiner, machine_id: str
    ) -> None:
        self.proc = proc
        self.confiner = confiner
        self.machine_id = machine_id

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    async def wait(self) -> Exit:
        return self.confiner.exit_of(self.machine_id, await self.proc.wait())

    async def stop(self, grace_s: float) -> None:
        proc = self.proc
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        grace = anyio.move_on_after(grace_s)
        try:
            with grace:
                await proc.wait()
        finally:  # the grace passed, or this stop was cut short: kill it either way
            if proc.returncode is None:
                log.warning(
                    "machine_kill_after_grace" if grace.cancelled_caught else "machine_killed",
                    machine_id=self.machine_id,
                    grace_s=grace_s,
                )
                await self.kill()

    async def kill(self) -> None:
        """SIGKILL and reap, even while the caller is being cancelled (bounded)."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with anyio.move_on_after(KILL_S, shield=True):
            await self.proc.wait()

    async def release(self) -> None:
        if self.running:
            await self.kill()
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(_uncage, self.confiner, self.machine_id)


def _uncage(confiner: Confiner, machine_id: str) -> None:
    """The machine runs no more: kill what is left in its cgroup, and remove it (in a worker
    thread: waiting for the cgroup to empty may take a moment, a fork bomb's children)."""
    try:
        confiner.remove(machine_id)
    except (ConfineError, OSError) as exc:
        log.error("cgroup_remove_failed", machine_id=machine_id, error=str(exc))


class Supervisor:
    """One machine under a driver: what it runs, its restart policy and stop grace, its
    current run, and the task that waits for the run's end (its scope)."""

    def __init__(self, m: Machine, run: Launch, policy: RestartPolicy, stop_grace_s: float) -> None:
        self.m = m
        self.run = run  # what each (re)spawn runs: argv, environment, working directory
        self.policy = policy
        self.stop_grace_s = stop_grace_s
        self.proc: Running | None = None
        # The supervisor task's scope: made here, so a stop can cancel it before it runs.
        self.scope = anyio.CancelScope()
        self.stopping = False
        self.restarts = m.restarts  # carried across supplier restarts (the Machine record)


class ProcessDriver:
    name = "process"

    def __init__(
        self,
        catalog: dict[str, ImageSpec],
        log_dir: Path,
        on_exit: ExitFn,
        *,
        confiner: Confiner | None = None,
        on_restart: RestartFn = no_restart_listener,
        log_caps: LogCaps | None = None,
        work_dir: Path | None = None,
        shims_dir: Path | None = None,
    ) -> None:
        self.catalog = catalog
        # Machines held by shims of their own below this (they outlive the supplier), or
        # run by the driver itself (they stop with it).
        self.shims_dir = shims_dir
        self.log_caps = log_caps or LogCaps()
        self._found: dict[str, Shim] = {}  # shims an earlier supplier left, not adopted yet
        self.log_dir = log_dir
        # content images' machines: a working directory each, below this
        self.work_dir = work_dir or log_dir.parent / "work"
        self.on_exit = on_exit
        self.on_restart = on_restart
        self.confiner = confiner or Confiner("none", "")
        self.output = Logs(log_dir, self.log_caps)
        self.pump = Pump(self.output)
        self._sups: dict[str, Supervisor] = {}
        self._tasks: anyio.abc.TaskGroup | None = None  # run()'s: the supervisors

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Own the machines' supervisors until cancelled; then kill and reap any machine
        process still running (one no stop reached), so none outlives the driver."""
        c = self.confiner
        if weaker_than_cgroups(c.mechanism):
            log.warning(
                "confinement_weaker_than_cgroups",
                worker_id=c.worker_id,
                confinement=c.mechanism,
                cpu="not enforced",
                memory="RLIMIT_DATA" if c.mechanism == "rlimit" else "not enforced",
                pids="RLIMIT_NPROC (per user; root exempt)" if c.mechanism == "rlimit" else "none",
            )
        else:
            log.info("confinement", worker_id=c.worker_id, confinement=c.mechanism)
        if self.shims_dir is not None:
            self._found = await discover(self.shims_dir)
            if self._found:
                log.info("shims_found", worker_id=c.worker_id, machines=sorted(self._found))
        await self._sweep(keep=self._found)
        self.pump.start()
        try:
            async with anyio.create_task_group() as tasks:
                self._tasks = tasks
                for shim in self._found.values():
                    if shim.attached:
                        tasks.start_soon(shim.follow)
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self._tasks = None
            if self.shims_dir is None:
                await self._kill_left()
                with anyio.CancelScope(shield=True):
                    await self._sweep(at_end=True)
            else:  # the machines run on, held by their shims
                with anyio.CancelScope(shield=True):
                    await self._detach_all()
            with anyio.CancelScope(shield=True):  # the processes are gone: their pipes end
                await anyio.to_thread.run_sync(self.pump.close, PUMP_CLOSE_S)

    async def _sweep(self, at_end: bool = False, keep: Collection[str] = ()) -> None:
        """At the start, remove what a supplier that died left of this worker's machines
        but those their shims still hold (``keep``); at the end, the worker's (empty)
        cgroup subtree."""
        c = self.confiner
        swept = c.sweep(remove_base=at_end, keep=keep)
        if swept and not at_end:
            log.warning("cgroups_swept", worker_id=c.worker_id, machines=swept)

    async def _detach_all(self) -> None:
        """Let go of every machine's shim (the machines run on) and of the shims found."""
        for sup in list(self._sups.values()):
            sup.stopping = True
            sup.scope.cancel()
            if isinstance(sup.proc, ShimRun):
                await sup.proc.shim.detach()
        self._sups.clear()
        for shim in self._found.values():
            await shim.detach()

    async def settle(self) -> None:
        """The supplier resumed its machines: a shim found that no start adopted holds a
        machine its store says should not run (stopped, destroyed meanwhile): stop it."""
        found, self._found = self._found, {}
        for mid, shim in found.items():
            log.warning("shim_not_adopted", machine_id=mid)
            await ShimRun(shim).release()

    async def _kill_left(self) -> None:
        for sup in list(self._sups.values()):
            self._sups.pop(sup.m.machine_id, None)
            sup.stopping = True
            if sup.proc is not None and sup.proc.running:
                log.warning("machine_killed_at_stop", machine_id=sup.m.machine_id)
            await self._release(sup)

    @property
    def confinement(self) -> Mechanism:
        return self.confiner.mechanism

    @property
    def runtime_version(self) -> str:
        """Machines are processes started through this Python's exec wrapper."""
        return f"python {platform.python_version()}"

    def refuses(self, r: Resources) -> str:
        return too_small(r.memory_mb, self.confiner.mechanism)

    def can_run(self, image: str) -> bool:
        spec = self.catalog.get(image)
        return spec is not None and bool(spec.command)

    async def pull(self, image: str) -> tuple[int, float]:
        return 0, 0.0  # catalog commands are local: nothing to fetch

    def log_path(self, machine_id: str) -> Path:
        """The machine's current log file (the one its output goes to now)."""
        return self.output.path(machine_id)

    def is_running(self, machine_id: str) -> bool:
        sup = self._sups.get(machine_id)
        return sup is not None and sup.proc is not None and sup.proc.running

    async def start(
        self, m: Machine, image: ImageRun | None = None, env: Mapping[str, str] = NO_ENV
    ) -> None:
        if image is not None:
            run = await self._image_launch(m, image, env)
            default, grace = "no", IMAGE_STOP_GRACE_S
        else:
            spec = self.catalog.get(m.image)
            if spec is None or not spec.command:
                raise DriverError(f"image {m.image!r} is not in this worker's catalog")
            run, default, grace = _catalog_launch(m, spec, env), spec.restart, spec.stop_grace_s
        policy = m.metadata.get("restart", default)
        if policy not in RESTART_POLICIES:  # checked here, so the cast below is true
            raise DriverError(
                f"restart policy {policy!r}: use one of {', '.join(RESTART_POLICIES)}"
            )
        if self.is_running(m.machine_id):
            return
        if self._tasks is None:
            raise DriverError("the process driver is not running (ProcessDriver.run)")
        sup = Supervisor(m, run, cast(RestartPolicy, policy), grace)
        await self._spawn(sup)  # a command that cannot start fails the start itself
        self._sups[m.machine_id] = sup
        self._tasks.start_soon(self._supervise, sup, name=f"supervise {m.machine_id}")

    async def _image_launch(self, m: Machine, image: ImageRun, env: Mapping[str, str]) -> Launch:
        """A content image's process, its working directory made (linked to the image)."""
        cwd = self.work_dir / m.machine_id
        try:
            run = launch(m, image.root, image.config, cwd, env)
            await anyio.to_thread.run_sync(working_dir, image.root, image.config, cwd)
        except BundleError as exc:
            raise DriverError(f"image {m.image!r}: {exc}") from None
        except OSError as exc:
            raise DriverError(f"cannot make {m.machine_id}'s working directory: {exc}") from None
        return run

    async def _release(self, sup: Supervisor) -> None:
        """The machine's run ended (or is to end): nothing of it is left."""
        if sup.proc is not None:
            await sup.proc.release()
        else:
            await self._forget(sup.m.machine_id)

    async def _forget(self, machine_id: str) -> None:
        """What a machine that does not run may still hold (its cgroups), removed."""
        await anyio.to_thread.run_sync(_uncage, self.confiner, machine_id)

    def usage_ns(self, machine_id: str) -> int | None:
        """CPU time used by the machine's cgroup (ns), from the cgroup's own counter."""
        return self.confiner.usage_ns(machine_id)

    async def _spawn(self, sup: Supervisor) -> None:
        """Run the machine once more, its output into its log (a header line first)."""
        if self.shims_dir is not None:
            sup.proc = await self._held(sup, self.shims_dir)
            return
        header = f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} start\n".encode()
        out = self.pump.pipe(sup.m.machine_id, header)
        try:
            sup.proc = await self._launch(sup, out)
        finally:
            os.close(out)  # the machine's end now: the pipe ends when its processes do

    async def _held(self, sup: Supervisor, shims_dir: Path) -> Running:
        """The run under its shim: the one an earlier supplier left (adopted), or a new
        one."""
        mid = sup.m.machine_id
        assert self._tasks is not None
        shim = self._found.pop(mid, None)
        if shim is not None:
            log.info("machine_adopted", machine_id=mid, pid=shim.pid, ended=shim.ended.is_set())
            return ShimRun(shim)
        plan = Plan(
            machine_id=mid,
            run=await self._shim_run(sup),
            log_dir=str(self.log_dir),
            machine_log_mb=self.log_caps.machine_mb,
            worker_log_mb=self.log_caps.worker_mb,
            stop_grace_s=sup.stop_grace_s,
        )
        try:
            shim = await launch_shim(shims_dir / mid, plan)
        except ShimError as exc:
            raise DriverError(str(exc)) from None  # the caller names the machine
        self._tasks.start_soon(shim.follow)
        return ShimRun(shim)

    async def _shim_run(self, sup: Supervisor) -> ProcessRun | ContainerRun:
        """What the shim runs: the process, with its confinement."""
        cgroups, limits = await self._confine(sup)
        mid = sup.m.machine_id
        oom = self.confiner.oom_file(mid)
        return ProcessRun(
            argv=sup.run.argv,
            env=sup.run.env,
            cwd=str(sup.run.cwd or Path.cwd()),
            cgroups=cgroups,
            rlimits=limits,
            cgroup_dirs=[str(d) for d in self.confiner.dirs(mid).values()],
            oom_file=str(oom) if oom is not None else "",
        )

    async def _confine(self, sup: Supervisor) -> tuple[list[str], list[str]]:
        """The machine's cgroups made (the files to join) and its rlimits."""
        try:
            return await anyio.to_thread.run_sync(
                self.confiner.prepare, sup.m.machine_id, sup.m.resources
            )
        except (ConfineError, OSError) as exc:
            raise DriverError(f"cannot confine machine {sup.m.machine_id}: {exc}") from None

    async def _launch(self, sup: Supervisor, out: int) -> Running:
        """The process, in its cgroups, its output to ``out``."""
        cgroups, limits = await self._confine(sup)
        confine = [a for p in cgroups for a in ("--cgroup", p)]
        confine += [a for r in limits for a in ("--rlimit", r)]
        run = sup.run
        try:
            # -P: the working directory (an image's files) is not put on the wrapper's path
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-P",
                "-m",
                "bourse.runtime.reaper",
                *confine,
                "--",
                *run.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=run.env,
                cwd=run.cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise DriverError(f"cannot start {run.argv[0]!r}: {exc}") from None
        return _Process(proc, self.confiner, sup.m.machine_id)

    async def _supervise(self, sup: Supervisor) -> None:
        """Wait for the process to end; restart it as its policy says, after the backoff;
        report an exit it does not restart. A stop cancels this (sup.scope)."""
        with sup.scope:
            await self._watch(sup)

    async def _watch(self, sup: Supervisor) -> None:
        backoff = BACKOFF_FIRST_S
        mlog = log.bind(machine_id=sup.m.machine_id)
        while True:
            assert sup.proc is not None
            began = time.monotonic()
            how = await sup.proc.wait()
            if sup.stopping:
                return
            clean = how.code == 0
            if not (sup.policy == "always" or (sup.policy == "on-failure" and not clean)):
                mlog.info("machine_exited", exit=how.describe(), policy=sup.policy)
                self._sups.pop(sup.m.machine_id, None)
                await self._release(sup)
                await self.pump.drained(sup.m.machine_id, DRAIN_S)  # its last words first
                self.on_exit(sup.m.machine_id, how)
                return
            if time.monotonic() - began > BACKOFF_RESET_AFTER_S:
                backoff = BACKOFF_FIRST_S
            await self.pump.drained(sup.m.machine_id, DRAIN_S)  # before the next run's
            sup.restarts += 1
            mlog.info(
                "machine_restarting", exit=how.describe(), restarts=sup.restarts, backoff_s=backoff
            )
            self.on_restart(sup.m.machine_id, how, sup.restarts)
            await anyio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)
            if sup.stopping:
                return
            await sup.proc.release()  # what the last run held (its shim), before the next
            try:
                await self._spawn(sup)
            except DriverError as exc:
                mlog.error("machine_restart_failed", error=str(exc))
                self._sups.pop(sup.m.machine_id, None)
                await self._release(sup)
                self.on_exit(sup.m.machine_id, Exit(code=127))
                return

    def logs(
        self, machine_id: str, tail: int, max_bytes: int, since: int = -1
    ) -> tuple[list[str], bool, int]:
        return self.output.read(machine_id, tail, max_bytes, since)

    def restarts(self, machine_id: str) -> int:
        sup = self._sups.get(machine_id)
        return sup.restarts if sup else 0

    def pid(self, machine_id: str) -> int | None:
        sup = self._sups.get(machine_id)
        return sup.proc.pid if sup and sup.proc and sup.proc.running else None

    async def stop(self, m: Machine) -> None:
        """SIGTERM, then SIGKILL after the grace period; the supervisor is cancelled (it
        ends in run()'s task group)."""
        sup = self._sups.pop(m.machine_id, None)
        if sup is None:
            return
        sup.stopping = True
        try:
            if sup.proc is not None:
                await sup.proc.stop(sup.stop_grace_s)
        finally:
            sup.scope.cancel()
            await self._release(sup)

    async def destroy(self, m: Machine) -> None:
        await self.stop(m)
        await self._forget(m.machine_id)  # also when it was not running
        self.pump.remove(m.machine_id)  # its output goes with it
        cwd = self.work_dir / m.machine_id  # and its working directory (a content image's)
        await anyio.to_thread.run_sync(remove_tree, cwd)

    async def close(self) -> None:
        """Stop every process, all at once (they come back when the supplier restarts:
        their recorded state still says started); machines held by shims run on."""
        if self.shims_dir is not None:
            await self._detach_all()
            return
        async with anyio.create_task_group() as tasks:
            for sup in list(self._sups.values()):
                tasks.start_soon(self.stop, sup.m)


def _catalog_launch(m: Machine, spec: ImageSpec, env: Mapping[str, str] = NO_ENV) -> Launch:
    """A catalog image's process: its spec's command (``{python}`` the supplier's own
    interpreter) with a default ``PATH``, the spec's env, the run's and Bourse's ids (never
    the supplier's environment), in the supplier's working directory."""
    env = {
        "PATH": DEFAULT_PATH,
        **spec.env,
        **env,
        "BOURSE_MACHINE_ID": m.machine_id,
        "BOURSE_ORDER_ID": m.order_id,
    }
    command = [sys.executable if word == PYTHON else word for word in spec.command]
    return Launch(command, env, None)
