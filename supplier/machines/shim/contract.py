"""The contract between a supplier and its shims: what a shim runs, what it records, and
the protocol on its control socket. One file, read by both sides: the supplier
(supplier/machines/shim/client.py) and the shim itself (supplier/machines/shim/server.py).

Standard library only, and only modules that cost nothing to import (no ``json``,
``enum``, ``dataclasses``): the shim imports this on every machine's start path.

The supplier and one shim meet in a directory per machine, ``<shims_dir>/<machine_id>/``
(mode 0700):

- ``plan``: the supplier's, written before the shim starts (``marshal``: the shim runs
  with the supplier's own interpreter, and reading it costs no import): :class:`Plan`;
- ``state.json``: the shim's, written anew atomically (a temporary file renamed) when the
  machine started and when it ended: :class:`State`;
- ``sock``: the shim's control socket (a unix stream socket, mode 0600);
- ``shim.log``: the shim's own lines (why it could not start a machine, what it stopped).

The protocol on the socket (and on the socket pair a launch hands the shim, its first
connection) is one JSON object a line:

- the shim says ``{"state": STATE}`` to each connection at once, and again when the
  machine ended (``STATE.exit`` set); ``{"collected": true}`` once collected;
  ``{"error": "..."}`` for a request it refuses (or, on the launch's connection, a
  machine it could not start: then it ends);
- the supplier asks ``{"op": "stop", "grace_s": G}`` (SIGTERM, then SIGKILL after G
  seconds; the exit follows) and, once it recorded the exit, ``{"op": "collect"}``: the
  shim removes its directory, answers ``{"collected": true}`` and ends.

Versions: ``State.protocol`` says which protocol a shim speaks (a shim of protocol 1, the
first, wrote no such field). Every version speaks the two requests above with the same
meaning, so a supplier adopts a shim of any version from :data:`OLDEST` to
:data:`PROTOCOL`; one outside that range it stops (SIGTERM to the shim, which stops its
machine within its grace) rather than guess its protocol.
"""

from __future__ import annotations

import marshal
import os

StrPath = str | os.PathLike[str]

PROTOCOL = 2  # what this shim speaks and this supplier asks
OLDEST = 1  # the oldest protocol a supplier still adopts
# What the fork server speaks (supplier/machines/shim/forkserver.py): a supplier adopts one
# of this protocol that forks the shim code of its own files, and stops any other.
FORK_PROTOCOL = 1

PLAN = "plan"
STATE = "state.json"
SOCKET = "sock"
SHIM_LOG = "shim.log"
# The longest line either side sends (a state is a few hundred bytes).
MAX_LINE = 64 * 1024
# The shim's exit status when it could not start the machine (its reason went to the
# launch's connection and shim.log).
START_FAILED = 1


class ContractError(ValueError):
    """A plan, state or line that does not follow the contract."""


# -- what a shim runs ------------------------------------------------------------------------
class ProcessRun:
    """A process machine: its command, environment and working directory; the
    ``cgroup.procs`` files it joins and the rlimits it gets (``NAME=VALUE``) before its
    command runs; its cgroup directories (emptied and removed when it ended) and the files
    counting its OOM kills; the user it runs as, its own /tmp, and the directories bound
    where it sees them (its image, read-only; its working directory)."""

    kind = "process"
    __slots__ = (
        "argv",
        "binds",
        "cgroup_dirs",
        "cgroups",
        "cwd",
        "env",
        "gid",
        "hide",
        "netns",
        "oom_files",
        "rlimits",
        "tmp_mb",
        "uid",
    )

    def __init__(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        cgroups: list[str] | None = None,
        rlimits: list[str] | None = None,
        cgroup_dirs: list[str] | None = None,
        oom_files: list[str] | None = None,
        uid: int = -1,
        gid: int = -1,
        tmp_mb: int = 0,
        binds: list[list[str]] | None = None,
        netns: str = "",
        hide: list[str] | None = None,
    ) -> None:
        self.argv = argv
        self.env = env
        self.cwd = cwd
        self.cgroups = cgroups or []
        self.rlimits = rlimits or []
        self.cgroup_dirs = cgroup_dirs or []
        self.oom_files = oom_files or []
        self.uid = uid  # its user and group (-1: the shim's own, root)
        self.gid = gid
        self.tmp_mb = tmp_mb  # a /tmp (/var/tmp, /dev/shm, ...) of its own this big (0: the host's)
        # [source, target, "ro" | "rw"]: bound in its own mount namespace before it runs
        self.binds = binds or []
        self.netns = netns  # the network namespace it joins ("": the host's network)
        # paths it sees empty (what the host mounted there detached): the supplier's data
        # dir, other machines' roots and network namespaces
        self.hide = hide or []


class ContainerRun:
    """A container machine, its bundle made by the supplier before the shim starts
    (supplier/machines/oci/): the runtime (its binary and state root) runs it in the
    foreground (``run --keep``); ``box`` is the machine's directory (its record, writable
    layer and mounts), all of which the shim removes when it ended, with its cgroups, unless
    a later start of the machine made the box anew (``run``: the box's record says whose)."""

    kind = "container"
    __slots__ = (
        "box",
        "bundle",
        "cgroup_dirs",
        "oom_files",
        "run",
        "runtime",
        "runtime_id",
        "state_root",
    )

    def __init__(
        self,
        runtime: str,
        state_root: str,
        runtime_id: str,
        bundle: str,
        box: str,
        cgroup_dirs: list[str] | None = None,
        oom_files: list[str] | None = None,
        run: str = "",
    ) -> None:
        self.runtime = runtime
        self.state_root = state_root
        self.runtime_id = runtime_id
        self.bundle = bundle
        self.box = box
        self.cgroup_dirs = cgroup_dirs or []
        self.oom_files = oom_files or []
        self.run = run  # which start made the box: a later start's is not this run's


Run = ProcessRun | ContainerRun


class Plan:
    """What a shim runs, where the output goes (the caps of supplier/machines/host/output.py),
    how long a stop waits after SIGTERM, and the supplier's pid when the machine stops with
    its supplier (0: it runs on without one, until a supplier stops it)."""

    __slots__ = (
        "log_dir",
        "machine_id",
        "machine_log_mb",
        "run",
        "stop_grace_s",
        "supplier_pid",
        "worker_log_mb",
    )

    def __init__(
        self,
        machine_id: str,
        run: Run,
        log_dir: str,
        machine_log_mb: int,
        worker_log_mb: int,
        stop_grace_s: float,
        supplier_pid: int = 0,
    ) -> None:
        self.machine_id = machine_id
        self.run = run
        self.log_dir = log_dir
        self.machine_log_mb = machine_log_mb
        self.worker_log_mb = worker_log_mb
        self.stop_grace_s = stop_grace_s
        self.supplier_pid = supplier_pid

    def dump(self) -> bytes:
        run = {name: getattr(self.run, name) for name in self.run.__slots__}
        plan = {name: getattr(self, name) for name in self.__slots__ if name != "run"}
        return marshal.dumps({"protocol": PROTOCOL, **plan, "run": {"kind": self.run.kind, **run}})

    @classmethod
    def load(cls, data: bytes) -> Plan:
        try:
            raw = marshal.loads(data)
            run = dict(raw.pop("run"))
            kind = run.pop("kind")
            raw.pop("protocol", None)
            made: Run = ProcessRun(**run) if kind == "process" else ContainerRun(**run)
            return cls(run=made, **raw)
        except (ValueError, EOFError, TypeError, KeyError, AttributeError) as exc:
            raise ContractError(f"not a shim plan: {exc}") from None


# -- what a shim records -----------------------------------------------------------------------
class Ended:
    """How the machine ended (a code >= 0, or the signal that killed it; ``oom`` when that
    was the kernel at its memory limit), and when (ms since the epoch)."""

    __slots__ = ("at_ms", "code", "oom", "signal")

    def __init__(
        self, at_ms: int, code: int | None = None, signal: int | None = None, oom: bool = False
    ) -> None:
        self.at_ms = at_ms
        self.code = code
        self.signal = signal
        self.oom = oom

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "signal": self.signal, "oom": self.oom, "at_ms": self.at_ms}

    @classmethod
    def of(cls, raw: object) -> Ended:
        d = _dict(raw, "exit")
        return cls(
            at_ms=_int(d.get("at_ms", 0), "exit.at_ms"),
            code=_opt_int(d.get("code"), "exit.code"),
            signal=_opt_int(d.get("signal"), "exit.signal"),
            oom=bool(d.get("oom", False)),
        )


class State:
    """``state.json``: the shim (its pid, and its start time in clock ticks since boot,
    which tells it from a later process of the same pid), the protocol it speaks, the
    machine's first process (a process machine's own pid; a container's runtime process)
    and when it started; its exit once it ended."""

    __slots__ = ("exit", "pid", "protocol", "shim_pid", "shim_started", "started_at_ms")

    def __init__(
        self,
        shim_pid: int,
        shim_started: int,
        pid: int,
        started_at_ms: int,
        exit: Ended | None = None,
        protocol: int = PROTOCOL,
    ) -> None:
        self.shim_pid = shim_pid
        self.shim_started = shim_started
        self.pid = pid
        self.started_at_ms = started_at_ms
        self.exit = exit
        self.protocol = protocol

    def to_dict(self) -> dict[str, object]:
        return {
            "protocol": self.protocol,
            "shim_pid": self.shim_pid,
            "shim_started": self.shim_started,
            "pid": self.pid,
            "started_at_ms": self.started_at_ms,
            "exit": None if self.exit is None else self.exit.to_dict(),
        }

    @classmethod
    def of(cls, raw: object) -> State:
        d = _dict(raw, "state")
        ended = d.get("exit")
        return cls(
            shim_pid=_int(d.get("shim_pid"), "state.shim_pid"),
            shim_started=_int(d.get("shim_started"), "state.shim_started"),
            pid=_int(d.get("pid"), "state.pid"),
            started_at_ms=_int(d.get("started_at_ms", 0), "state.started_at_ms"),
            exit=None if ended is None else Ended.of(ended),
            protocol=_int(d.get("protocol", 1), "state.protocol"),  # 1 wrote none
        )


def adoptable(state: State) -> bool:
    """Whether a supplier of this version speaks the protocol of the shim that wrote
    ``state``."""
    return OLDEST <= state.protocol <= PROTOCOL


# -- lines: JSON out without the json module (the shim's start path) --------------------------
def dumps(value: object) -> str:
    """JSON of None, bools, ints, floats, strings, lists and string-keyed dicts."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{_string(k)}:{dumps(v)}" for k, v in value.items()) + "}"
    raise ContractError(f"cannot encode {type(value).__name__}")


_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _string(s: str) -> str:
    out = []
    for c in s:
        e = _ESCAPES.get(c)
        if e is not None:
            out.append(e)
        elif c < " " or c == "\x7f":
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def line(message: dict[str, object]) -> bytes:
    """One protocol line."""
    return dumps(message).encode() + b"\n"


def parse(data: bytes) -> dict[str, object]:
    """One protocol line back (the json module, imported when first needed: never on a
    shim's start path)."""
    import json

    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ContractError(f"not a JSON line: {exc}") from None
    return _dict(value, "line")


def _dict(raw: object, what: str) -> dict[str, object]:
    if not isinstance(raw, dict):
        raise ContractError(f"{what} is not an object")
    return raw


def _int(raw: object, what: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise ContractError(f"{what} is not an integer")
    return raw


def _opt_int(raw: object, what: str) -> int | None:
    return None if raw is None else _int(raw, what)


# -- the directory -----------------------------------------------------------------------------
# Paths are strings joined with os.path here: pathlib costs the shim an import of ``re``.
def read_plan(directory: StrPath) -> Plan:
    try:
        return Plan.load(_read(os.path.join(directory, PLAN)))
    except OSError as exc:
        raise ContractError(f"cannot read the plan in {directory}: {exc.strerror}") from None


def write_plan(directory: StrPath, plan: Plan) -> None:
    """Make the machine's directory anew (owner only) with its plan."""
    if os.path.exists(directory):
        remove_dir(directory)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    write_atomically(os.path.join(directory, PLAN), plan.dump())


def read_state(directory: StrPath) -> State | None:
    """The shim's record, or None where it has none (it died before it wrote one)."""
    try:
        return State.of(parse(_read(os.path.join(directory, STATE))))
    except (OSError, ContractError):
        return None


def write_state(directory: StrPath, state: State) -> None:
    write_atomically(os.path.join(directory, STATE), line(state.to_dict()))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_atomically(path: str, data: bytes) -> None:
    """``path`` holds ``data`` whole or its old content for any reader. Not synced: a shim
    and its machine do not outlive the host, so neither does what the shim records."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def remove_dir(directory: StrPath) -> None:
    """A shim's directory, gone (its socket, plan, state and log)."""
    for name in (SOCKET, PLAN, "plan.json", STATE, STATE + ".tmp", PLAN + ".tmp", SHIM_LOG):
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(directory)
    except OSError:
        pass  # gone already, or something else was put there: left for the sweep


def started_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is none."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[-1].split()  # the name, in parentheses, may hold spaces
    return int(fields[19]) if len(fields) > 19 else None


def alive(state: State) -> bool:
    """The shim that wrote ``state`` still runs (the same process, not a later one)."""
    return started_ticks(state.shim_pid) == state.shim_started
