"""``python -m supplier.drivers.shim DIR``: the shim of one machine (supplier/drivers/shims.py
says what the supplier and its shims share, and the protocol).

Started by the supplier, the command forks the shim proper and waits for it to say
``ready`` (or why not: its last line, exit status 1). The shim is a session of its own,
not the supplier's child, so it lives on when the supplier stops or is killed; its stdin is
``/dev/null``, its stdout and stderr ``DIR/shim.log``. It then:

- starts the machine: a process through the exec wrapper (bourse/runtime/reaper.py: the
  machine's cgroups and rlimits, ``PR_SET_PDEATHSIG`` tied to the shim), or a container in
  the foreground of its runtime (supplier/drivers/oci_runtime.py); the output of either
  into the capped, rotated log files (supplier/drivers/output.py: the shim's own pump);
- records ``state.json``, listens on ``DIR/sock`` and says ``ready``;
- waits for the machine to end; then removes what it held (the process's cgroups with
  what is left in them, the container's layer, mounts and runtime state), lets its last
  output reach the log, and records the exit (code or signal, OOM, when) in
  ``state.json``, which it also tells every connection;
- on ``stop``: SIGTERM, SIGKILL after the grace (a container's first process gets SIGTERM
  only if it handles it); SIGTERM or SIGINT to the shim itself is the same stop, with the
  plan's grace;
- stays until the supplier collects the exit: it removes its directory and ends.

When the machine stops with its supplier (the plan names the supplier's pid), the shim
watches that process (a pidfd): when it ends, the shim stops listening (no later supplier
attaches to it), stops the machine within its grace, removes what it held and its
directory, and ends: the next supplier finds nothing and starts the machine again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Protocol

import anyio
import anyio.abc
import msgspec
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream

from bourse.runtime import logs
from supplier.drivers.confine import Exit, exit_of, oom_kill_count, remove_cgroups
from supplier.drivers.oci_runtime import Containers, RunningContainer, Runtime
from supplier.drivers.output import LogCaps, Logs, Pump
from supplier.drivers.shims import (
    MAX_LINE,
    PLAN,
    SHIM_LOG,
    SOCKET,
    STATE,
    ContainerRun,
    Ended,
    Notice,
    Plan,
    ProcessRun,
    Request,
    State,
    encode_line,
    remove_dir,
    started_ticks,
    write_atomically,
)

log = structlog.get_logger("bourse.shim")

READY = b"ready\n"
# How long the machine's last output may take to reach the log after it ended (a process
# it left behind holds the pipe: its cgroup is emptied first); and the pump's end.
DRAIN_S = 1.0
PUMP_CLOSE_S = 0.5
KILL_WAIT_S = 5.0


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# -- the machine ----------------------------------------------------------------------------
class Machine(Protocol):
    """What the shim runs: a process or a container."""

    @property
    def pid(self) -> int: ...

    async def wait(self) -> Exit: ...

    async def stop(self, grace_s: float) -> None: ...

    async def cleanup(self) -> None: ...


class ProcessMachine:
    """A process through the exec wrapper, in its cgroups; its OOM kills counted from its
    start."""

    def __init__(self, run: ProcessRun, proc: anyio.abc.Process, oom_before: int) -> None:
        self.run = run
        self.proc = proc
        self.oom_before = oom_before

    @classmethod
    async def start(cls, run: ProcessRun, output: int) -> ProcessMachine:
        before = _oom_kills(run.oom_file)
        confine = [a for p in run.cgroups for a in ("--cgroup", p)]
        confine += [a for r in run.rlimits for a in ("--rlimit", r)]
        # -P: the working directory (an image's files) is not put on the wrapper's path
        proc = await anyio.open_process(
            [sys.executable, "-P", "-m", "bourse.runtime.reaper", *confine, "--", *run.argv],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            env=run.env,
            cwd=run.cwd,
            start_new_session=True,
        )
        return cls(run, proc, before)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def wait(self) -> Exit:
        code = await self.proc.wait()
        return exit_of(code, _oom_kills(self.run.oom_file) - self.oom_before)

    async def stop(self, grace_s: float) -> None:
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        with anyio.move_on_after(grace_s):
            await self.proc.wait()
            return
        log.warning("machine_kill_after_grace", grace_s=grace_s)
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with anyio.move_on_after(KILL_WAIT_S):
            await self.proc.wait()

    async def cleanup(self) -> None:
        dirs = [Path(d) for d in self.run.cgroup_dirs]
        await anyio.to_thread.run_sync(remove_cgroups, dirs)


class ContainerMachine:
    """A container in the foreground of its runtime."""

    def __init__(self, container: RunningContainer) -> None:
        self.container = container

    @classmethod
    async def start(cls, machine_id: str, run: ContainerRun, output: int) -> ContainerMachine:
        runtime = Runtime(run.runtime, run.runtime_path, run.runtime_version)
        boxes = Containers(
            runtime, Path(run.directory), run.owner, run.cgroup_parent, subtree=run.subtree
        )
        c = await boxes.start(machine_id, run.spec, Path(run.image_root), run.disk_mb, output)
        return cls(c)

    @property
    def pid(self) -> int:
        return self.container.pid

    async def wait(self) -> Exit:
        return await self.container.wait()

    async def stop(self, grace_s: float) -> None:
        await self.container.stop(grace_s)

    async def cleanup(self) -> None:
        await self.container.cleanup()


def _oom_kills(path: str) -> int:
    if not path:
        return 0
    try:
        return oom_kill_count(Path(path).read_text())
    except (OSError, ValueError):
        return 0


# -- the shim ---------------------------------------------------------------------------------
class Shim:
    """One machine's shim (see the module doc); :meth:`run` returns its exit status."""

    def __init__(self, directory: Path, plan: Plan, ready_fd: int) -> None:
        self.directory = directory
        self.plan = plan
        self.ready_fd = ready_fd
        self.machine: Machine | None = None
        self.state: State | None = None
        self.ended = anyio.Event()
        self.done = anyio.Event()  # collected, or gone with the supplier
        self.clients: set[anyio.abc.SocketStream] = set()
        self.listener: anyio.abc.SocketListener | None = None
        self.logs = Logs(Path(plan.log_dir), LogCaps(plan.machine_log_mb, plan.worker_log_mb))
        self.pump = Pump(self.logs)
        self.log = log.bind(machine_id=plan.machine_id)

    async def run(self) -> int:
        self.pump.start()
        try:
            async with anyio.create_task_group() as tasks:
                if not await self._start():
                    tasks.cancel_scope.cancel()
                    return 1
                tasks.start_soon(self._wait)
                tasks.start_soon(self._serve)
                tasks.start_soon(self._signals)
                if self.plan.supplier_pid:
                    tasks.start_soon(self._watch_supplier)
                await self.done.wait()
                tasks.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.pump.close, PUMP_CLOSE_S)
        return 0

    def _say(self, text: bytes) -> None:
        """Tell the launcher (once): ready, or why not."""
        if self.ready_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self.ready_fd, text)
            os.close(self.ready_fd)
            self.ready_fd = -1

    async def _start(self) -> bool:
        """Run the machine, record it, listen; say ready (or why not: False)."""
        plan = self.plan
        header = f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} start\n".encode()
        out = self.pump.pipe(plan.machine_id, header)
        try:
            if isinstance(plan.run, ContainerRun):
                self.machine = await ContainerMachine.start(plan.machine_id, plan.run, out)
            else:
                self.machine = await ProcessMachine.start(plan.run, out)
        except Exception as exc:  # the launcher's one line says why; nothing is left
            self.log.error("machine_start_failed", error=str(exc))
            self._say(f"{exc}\n".encode())  # the supplier names the machine
            await anyio.to_thread.run_sync(remove_dir, self.directory)
            return False
        finally:
            os.close(out)  # the machine's now: the pipe ends when its processes do
        me = os.getpid()
        self.state = State(
            shim_pid=me,
            shim_started=started_ticks(me) or 0,
            pid=self.machine.pid,
            started_at_ms=now_ms(),
        )
        await self._record()
        self.listener = await anyio.create_unix_listener(SOCKET, mode=0o600)
        self.log.info("machine_started", pid=self.machine.pid)
        self._say(READY)
        return True

    async def _record(self) -> None:
        assert self.state is not None
        data = msgspec.json.encode(self.state)
        await anyio.to_thread.run_sync(write_atomically, self.directory / STATE, data)

    async def _wait(self) -> None:
        """The machine's end: what it held removed, its last output stored, its exit
        recorded and told."""
        assert self.machine is not None and self.state is not None
        how = await self.machine.wait()
        with anyio.CancelScope(shield=True):
            await self.machine.cleanup()
            await self.pump.drained(self.plan.machine_id, DRAIN_S)
            self.state = msgspec.structs.replace(self.state, exit=Ended.of(how, now_ms()))
            await self._record()
        self.log.info("machine_ended", exit=how.describe())
        self.ended.set()
        for client in list(self.clients):
            await self._tell(client, Notice(state=self.state))

    async def _stop(self, grace_s: float) -> None:
        if self.machine is not None and not self.ended.is_set():
            await self.machine.stop(grace_s)

    async def _tell(self, client: anyio.abc.SocketStream, notice: Notice) -> None:
        try:
            await client.send(encode_line(notice))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            self.clients.discard(client)

    async def _serve(self) -> None:
        assert self.listener is not None
        async with self.listener:
            await self.listener.serve(self._client)

    async def _client(self, client: anyio.abc.SocketStream) -> None:
        """One supplier's connection: the state now (and at the exit); its requests."""
        self.clients.add(client)
        lines = BufferedByteReceiveStream(client)
        try:
            async with client:
                await self._tell(client, Notice(state=self.state))
                while True:
                    line = await lines.receive_until(b"\n", MAX_LINE)
                    request = msgspec.json.decode(line, type=Request)
                    if request.op == "stop":
                        await self._stop(request.grace_s)
                    elif not self.ended.is_set():
                        await self._tell(client, Notice(error="the machine still runs"))
                    else:
                        await anyio.to_thread.run_sync(remove_dir, self.directory)
                        await self._tell(client, Notice(collected=True))
                        self.done.set()
                        return
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, OSError):
            pass  # the supplier went away: the machine runs on
        except (anyio.DelimiterNotFound, msgspec.DecodeError) as exc:
            self.log.warning("bad_request", error=str(exc))
        finally:
            self.clients.discard(client)

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                self.log.info("stop_asked", signal=signum)
                await self._stop(self.plan.stop_grace_s)

    async def _watch_supplier(self) -> None:
        """The machine stops with its supplier: once that process ends, stop it, remove
        everything, and end without a record (the next supplier starts it again)."""
        try:
            fd = os.pidfd_open(self.plan.supplier_pid)
        except ProcessLookupError:
            fd = -1
        if fd >= 0:
            try:
                await anyio.wait_readable(fd)
            finally:
                os.close(fd)
        self.log.info("supplier_gone", supplier_pid=self.plan.supplier_pid)
        with contextlib.suppress(FileNotFoundError):
            (self.directory / SOCKET).unlink()  # no supplier attaches to a shim going down
        await self._stop(self.plan.stop_grace_s)
        await self.ended.wait()
        await anyio.to_thread.run_sync(remove_dir, self.directory)
        self.done.set()


# -- the command ------------------------------------------------------------------------------
def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m supplier.drivers.shim DIR\n")
        raise SystemExit(2)
    directory = Path(argv[0]).resolve()
    try:
        plan = msgspec.json.decode((directory / PLAN).read_bytes(), type=Plan)
    except (OSError, msgspec.DecodeError) as exc:
        print(f"cannot read the shim's plan in {directory}: {exc}")
        raise SystemExit(1) from None
    # Nothing of the supplier's but stdin, stdout and stderr: a descriptor it leaked (its
    # store, its lock, its connections; an event loop may spawn without closing them) would
    # be held for the shim's life, and its stdout would not end for the supplier.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    r, w = os.pipe()
    if os.fork():  # the launcher: wait for the shim's word, and go
        os.close(w)
        said = b""
        while chunk := os.read(r, 4096):
            said += chunk
        if said == READY:
            raise SystemExit(0)
        print(said.decode(errors="replace").strip() or "the shim ended before it was ready")
        raise SystemExit(1)
    os.close(r)
    raise SystemExit(_shim(directory, plan, w))


def _shim(directory: Path, plan: Plan, ready_fd: int) -> int:
    """The shim proper: its own session, its own output, in its directory."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(directory / SHIM_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.chdir(directory)  # its socket is bound by name here (a path may be too long for one)
    logs.configure("info")
    return anyio.run(Shim(directory, plan, ready_fd).run)


if __name__ == "__main__":
    main(sys.argv[1:])
