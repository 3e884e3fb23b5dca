"""The shim of one machine: forked by its supplier's fork server
(supplier/machines/shim/forkserver.py) or started by its command
``python -I -S supplier/machines/shim/main.py DIR [FD]`` (supplier/machines/shim/client.py),
it runs the machine, holds its output and its exit, and outlives the supplier.

Standard library only, no asyncio, and only modules that cost nothing to import: a shim
starts on every machine's start path, and one runs beside every machine (its memory is
counted per machine). The contract it keeps with its supplier (the plan it runs, the
state it records, the protocol on its socket) is supplier/machines/shim/contract.py.

Either way the shim proper is forked by a process that then exits
(supplier/machines/shim/command.py): the shim is a session of its own, nobody's child, so
it lives on when the supplier (or the fork server) stops or dies. ``FD`` is the shim's end
of a socket pair the supplier made: its first connection, on which it says the machine's
state once the machine runs (or why it could not start it, and ends). The shim then:

- runs the machine: a process (forked here: its own session, its cgroups joined and its
  rlimits set before its command is executed, ``SIGTERM`` when the shim dies) or a
  container in the foreground of its runtime (``run --keep`` of a bundle the supplier
  made); its stdout and stderr are one pipe that the shim copies into the machine's capped,
  rotated log files (supplier/machines/shim/logfiles.py);
- records ``state.json`` and listens on ``DIR/sock``;
- on ``stop`` (or SIGTERM, SIGINT to the shim: with the plan's grace): SIGTERM to the
  machine, SIGKILL after the grace (a container's runtime forwards the SIGTERM to the
  container's first process; past the grace the runtime kills the container);
- when the machine ended: removes what it held (supplier/machines/shim/teardown.py: the
  process's cgroups with what is left in them; the container's runtime state, mounts,
  loop device and box), lets its last output reach the log, records the exit in
  ``state.json`` and tells every connection;
- stays until the supplier collects the exit: it removes its directory and ends.

When the machine stops with its supplier (the plan names the supplier's pid), the shim
watches that process: when it ends, the shim stops listening (no later supplier attaches
to it), stops the machine within :data:`ORPHANED_GRACE_S` (its plan's grace, if shorter:
no supplier is there to wait for a clean stop, and its program's exit is not held up by a
machine that ignores SIGTERM), removes what it held and its directory, and
ends: the next supplier finds nothing and starts the machine again.
"""

from __future__ import annotations

import _socket
import os
import time

from supplier.machines.shim import contract, logfiles, teardown
from supplier.machines.shim.lines import Conn, Lines, say
from supplier.machines.shim.spawn import StartFailed, ended_of, now_ms, output_pipe, spawn

TYPE_CHECKING = False  # typing costs the shim an import: mypy reads this name alike
if TYPE_CHECKING:
    import signal as _signal
else:
    import _signal

CHUNK = 64 * 1024
# How long the machine's last output may take to reach the log once it ended (a process
# it left behind may hold the pipe: its cgroup is emptied first).
DRAIN_S = 1.0
# How long a container may take to die of SIGKILL before its runtime itself is killed.
KILL_WAIT_S = 5.0
# The runtime's own environment (the spec's env is the container's).
RUNTIME_ENV = {"PATH": teardown.PATH}
# A machine that stops with its supplier, which died (or was killed: bourse up's end): its
# grace, whatever its plan says (docs/operations.md).
ORPHANED_GRACE_S = 1.0


# -- the shim ---------------------------------------------------------------------------------
class Shim(Lines):
    """One machine's shim (see the module doc); :meth:`run` returns its exit status."""

    def __init__(self, directory: str, plan: contract.Plan, first: int) -> None:
        self.directory = directory
        self.plan = plan
        self.run_ = plan.run
        self.container = isinstance(plan.run, contract.ContainerRun)
        self.first = first  # the launch's connection (-1: none)
        super().__init__()
        self.state: contract.State | None = None
        self.pid = 0
        self.pidfd = -1
        self.status: int | None = None  # the machine's wait status, once it ended
        self.out = -1  # the output pipe's read end (-1: closed)
        self.logs = logfiles.LogWriter(
            plan.log_dir,
            plan.machine_id,
            plan.machine_log_mb * logfiles.MIB,
            plan.worker_log_mb * logfiles.MIB,
        )
        self.rate = logfiles.Rate(time.monotonic())
        self.paused_until = 0.0  # output not read until then (over its rate)
        self.kill_at = 0.0  # SIGKILL then (a stop's grace)
        self.killed_at = 0.0  # a container's KILL was sent then
        self.drain_until = 0.0  # the machine ended: its last output is read until then
        self.oom_before = 0
        self.oom = False  # the kernel killed it at its memory limit
        self.going_down = False  # the supplier ended: stop, remove everything, end
        self.finished = False  # the exit is recorded
        self.done = False

    # -- start -------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self._start()
        except (StartFailed, OSError) as exc:
            why = exc.args[0] if isinstance(exc, StartFailed) else f"{exc.strerror}: {exc}"
            say(f"machine {self.plan.machine_id} not started: {why}")
            contract.remove_dir(self.directory)  # before the answer: nothing is left then
            self._tell_first({"error": str(why)})
            return contract.START_FAILED
        while not self.done:
            self._turn()
        return 0

    def _start(self) -> None:
        plan, run = self.plan, self.run_
        r, w = output_pipe()
        header = f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} start\n".encode()
        self.logs.write(header)
        self.oom_before = teardown.oom_kills(run.oom_files)
        try:
            if isinstance(run, contract.ContainerRun):
                argv = [run.runtime, "--root", run.state_root, "run", "--keep"]
                argv += ["--bundle", run.bundle, run.runtime_id]
                self.pid = spawn(argv, RUNTIME_ENV, run.bundle, w)
            else:
                self.pid = spawn(
                    run.argv,
                    run.env,
                    run.cwd,
                    w,
                    run.cgroups,
                    run.rlimits,
                    uid=run.uid,
                    gid=run.gid,
                    tmp_mb=run.tmp_mb,
                    binds=run.binds,
                    netns=run.netns,
                    hide=run.hide,
                )
        except StartFailed as exc:
            os.close(r)
            self._cleanup()  # what the supplier made for it (its cgroups, its box)
            raise exc from None
        finally:
            os.close(w)  # the machine's now: the pipe ends when its processes do
        self.out = r
        self.watch(r, self._read_output)
        self.pidfd = os.pidfd_open(self.pid)
        self.watch(self.pidfd, self._machine_ended)
        me = os.getpid()
        self.state = contract.State(
            shim_pid=me,
            shim_started=contract.started_ticks(me) or 0,
            pid=self.pid,
            started_at_ms=now_ms(),
        )
        contract.write_state(self.directory, self.state)
        self.catches_signals()
        self.listen(contract.SOCKET)
        if self.first >= 0:
            self.add(_socket.socket(fileno=self.first))
        if plan.supplier_pid:
            try:
                self.watch(os.pidfd_open(plan.supplier_pid), self._supplier_gone)
            except ProcessLookupError:
                self._supplier_gone(-1)
        say(f"machine {plan.machine_id} started: pid {self.pid}")

    # -- the loop ----------------------------------------------------------------------------
    def _turn(self) -> None:
        now = time.monotonic()
        deadlines = [t for t in (self.paused_until, self.kill_at, self.drain_until) if t > 0]
        if self.killed_at:
            deadlines.append(self.killed_at + KILL_WAIT_S)
        timeout = max(0.0, min(deadlines) - now) if deadlines else -1
        self.poll(timeout)
        self._timers(time.monotonic())

    def _timers(self, now: float) -> None:
        if self.paused_until and now >= self.paused_until:
            self.paused_until = 0.0
            if self.out >= 0:
                self.watch(self.out, self._read_output)
        if self.kill_at and now >= self.kill_at:
            self.kill_at = 0.0
            self._kill()
        if self.killed_at and now >= self.killed_at + KILL_WAIT_S and self.status is None:
            say("the container did not die of SIGKILL: its runtime is killed")
            self.killed_at = 0.0
            self._signal_machine(_signal.SIGKILL)
        drained = self.out < 0 or (self.drain_until and now >= self.drain_until)
        if self.status is not None and not self.finished and drained:
            self._finish()

    # -- the machine ---------------------------------------------------------------------------
    def _signal_machine(self, sig: int) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, grace_s: float) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` (a later, shorter stop shortens it)."""
        if self.status is not None:
            return
        at = time.monotonic() + max(0.0, grace_s)
        if self.kill_at and self.kill_at <= at:
            return
        if not self.kill_at and not self.killed_at:
            say(f"stopping machine {self.plan.machine_id} (grace {grace_s}s)")
            self._signal_machine(_signal.SIGTERM)
        self.kill_at = at

    def _kill(self) -> None:
        if self.status is not None:
            return
        say(f"machine {self.plan.machine_id} killed after its grace")
        run = self.run_
        if isinstance(run, contract.ContainerRun):
            teardown.run([run.runtime, "--root", run.state_root, "kill", run.runtime_id, "KILL"])
            self.killed_at = time.monotonic()
        else:
            self._signal_machine(_signal.SIGKILL)

    def _machine_ended(self, fd: int) -> None:
        done, status = os.waitpid(self.pid, os.WNOHANG)
        if not done:
            return
        self.unwatch(fd)
        os.close(fd)
        self.status = status
        self.kill_at = self.killed_at = 0.0
        # counted before the cleanup removes the cgroup that counts them
        self.oom = teardown.oom_kills(self.run_.oom_files) > self.oom_before
        self._cleanup()  # its leftovers killed: they release the output pipe
        self.drain_until = time.monotonic() + DRAIN_S
        if self.paused_until:  # the last output is read now, whatever its rate
            self.paused_until = 0.0
            self.watch(self.out, self._read_output)

    def _cleanup(self) -> None:
        """Remove what the machine held (idempotent)."""
        run = self.run_
        if isinstance(run, contract.ContainerRun):
            left = teardown.remove_container(
                run.runtime,
                run.state_root,
                run.runtime_id,
                run.box,
                run.cgroup_dirs,
                run.run,
                bundle=run.bundle,
            )
        else:
            left = teardown.remove_cgroups(run.cgroup_dirs)
        if left:
            say(f"machine {self.plan.machine_id} left {', '.join(left)}")

    def _finish(self) -> None:
        """The machine ended and its output is in: record the exit and tell everyone."""
        assert self.status is not None and self.state is not None
        if self.out >= 0:
            self.unwatch(self.out)
            os.close(self.out)
            self.out = -1
        self.logs.close()
        ended = ended_of(self.status, self.container, self.oom)
        self.state.exit = ended
        self.finished = True
        self.drain_until = 0.0
        say(f"machine {self.plan.machine_id} ended: {ended.to_dict()}")
        if self.going_down:
            contract.remove_dir(self.directory)
            self.done = True
            return
        contract.write_state(self.directory, self.state)
        self.tell_all({"state": self.state.to_dict()})

    def _read_output(self, fd: int) -> None:
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # every writer is gone
            self.unwatch(fd)
            os.close(fd)
            self.out = -1
            return
        self.logs.write(data)
        if self.status is None:
            wait = self.rate.spend(len(data), time.monotonic())
            if wait > 0:
                self.unwatch(fd)
                self.paused_until = time.monotonic() + wait

    # -- the supplier --------------------------------------------------------------------------
    def signalled(self) -> None:
        say("stop asked by a signal")
        self.stop(self.plan.stop_grace_s)

    def _supplier_gone(self, fd: int) -> None:
        """The machine stops with its supplier, which ended."""
        if fd >= 0:
            self.unwatch(fd)
            os.close(fd)
        say(f"supplier {self.plan.supplier_pid} gone: stopping")
        self.going_down = True
        self.stop_listening(contract.SOCKET)  # no later supplier attaches to a shim going down
        if self.finished:
            contract.remove_dir(self.directory)
            self.done = True
        else:
            self.stop(min(self.plan.stop_grace_s, ORPHANED_GRACE_S))

    def greet(self, fd: int) -> None:
        assert self.state is not None
        self.tell(fd, {"state": self.state.to_dict()})

    def _tell_first(self, message: dict[str, object]) -> None:
        if self.first >= 0:
            try:
                os.write(self.first, contract.line(message))
            except OSError:
                pass

    def request(self, fd: int, conn: Conn, op: object, request: dict[str, object]) -> None:
        if op == "stop":
            grace = request.get("grace_s", 0.0)
            self.stop(float(grace) if isinstance(grace, int | float) else 0.0)
        elif op == "collect":
            if not self.finished:
                self.tell(fd, {"error": "the machine still runs"})
                return
            contract.remove_dir(self.directory)
            self.tell(fd, {"collected": True})
            self.done = True
        else:
            super().request(fd, conn, op, request)
