"""A view's keeper (bourse/view/keeper.py, ``buyer view keep``): started by an invocation
that found none, it catches the view up when the next one asks, which then answers without
nats-py; it answers its own user only, runs once a view, and ends when idle, on
``buyer view stop`` and on SIGTERM. A keeper that cannot catch up leaves the invocation to
say why, as it would without one.

Every test turns keepers on (tests/conftest.py turns them off for the rest) and ends the
ones it started."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process

from bourse.nats.embedded import EmbeddedNats
from bourse.view.cache import locked, view_path
from bourse.view.keeper import ENV_KEEPER_S, STOP, KeeperError, NoKeeper, ask, keeper_s
from bourse.view.schema import SCHEMA_VERSION
from bourse.wire.subjects import Subjects
from tests.integration.test_cli_start import _a_worker_beats, loaded, run
from tests.market import wait_until


@pytest.fixture
def keepers(tmp_path: Path) -> Iterator[list[int]]:
    """Keepers on, with this test's cache directory; the pids the test learns are killed at
    its end if they still run."""
    pids: list[int] = []
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
        env.setenv(ENV_KEEPER_S, "60")
        env.setenv("BOURSE_VIEW_FRESH_MS", "0")  # every answer caught up first
        yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def _keep(url: str, prefix: str, log: Path, *args: str) -> Process:
    """``buyer view keep`` as a child of the test, its lines into ``log``."""
    argv = [sys.executable, "-m", "buyer_cli", "--nats", url, "--prefix", prefix, "view", "keep"]
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        return await anyio.open_process([*argv, *args], stdout=out, stderr=out)
    finally:
        os.close(out)


async def _exit_code(p: Process, within_s: float) -> int | None:
    with anyio.fail_after(within_s):
        return await p.wait()


def _answers(path: Path) -> bool:
    try:
        ask(path, timeout_s=10.0)
    except NoKeeper:
        return False
    return True


def _listening(path: Path) -> bool:
    """Whether a keeper listens (asked what it does not know: no catch-up)."""
    try:
        ask(path, b"hello\n", timeout_s=10.0)
    except NoKeeper:
        return False
    except KeeperError as exc:
        return str(exc) == "unknown request"  # its answer (not a silence: that raises)
    return True


def _pid_of_keeper(path: Path) -> int:
    found = re.findall(
        r"view_keeper_started.* pid=(\d+)", path.with_suffix(".keeper.log").read_text()
    )
    return int(found[0])


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def test_the_next_answer_is_caught_up_by_the_keeper_the_first_one_started(
    tmp_path: Path, nats_server: EmbeddedNats, subjects: Subjects, keepers: list[int]
) -> None:
    """The first listing catches up by itself and starts the view's keeper; the next ones,
    each caught up first (BOURSE_VIEW_FRESH_MS=0), are caught up by the keeper: no nats-py
    in them, and a row published between two is in the second. `buyer view stop` ends
    it, and the next answer catches up by itself again."""
    await _a_worker_beats(nats_server, subjects)
    args = ["machines", "list", "--json", "--nats", nats_server.url, "--prefix", subjects.prefix]
    path = view_path([nats_server.url], subjects.prefix)
    code, out, err, modules = run(tmp_path, "buyer", *args)
    assert code == 0, err
    assert "nats.aio.client" in modules and json.loads(out)["view"]["seq"] == 3
    await wait_until(lambda: _answers(path))
    keepers.append(_pid_of_keeper(path))

    code, out, err, modules = run(tmp_path, "buyer", *args)
    assert code == 0, err
    assert "nats.aio.client" not in modules and json.loads(out)["view"]["seq"] == 3
    await _a_worker_beats(nats_server, subjects)  # the worker's row and heartbeat again
    code, out, err, modules = run(tmp_path, "buyer", *args)
    assert code == 0, err
    assert "nats.aio.client" not in modules and json.loads(out)["view"]["seq"] == 5
    # a query, its rows as a table: through the keeper too, and the table's printing loads
    # nothing of the client (bourse.client's names are imported when first asked for)
    sql = ["query", "SELECT worker_id FROM workers", *args[3:]]
    code, out, err, modules = run(tmp_path, "buyer", *sql)
    assert code == 0 and "mad-1" in out and "view: as of seq 5" in err, (out, err)
    assert loaded(modules, ("nats", "bourse.client.client")) == []

    code, out, err, _ = run(tmp_path, "buyer", "view", "stop", *args[3:])
    assert (code, out.strip()) == (0, "stopped"), err
    await wait_until(lambda: not _alive(keepers[0]))
    code, out, err, _ = run(tmp_path, "buyer", "view", "stop", *args[3:])
    assert (code, out.strip()) == (0, "no keeper runs for this view"), err
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV_KEEPER_S, "0")  # none started again: nothing to end
        code, out, err, modules = run(tmp_path, "buyer", *args)
    assert code == 0 and "nats.aio.client" in modules, err


async def test_one_keeper_a_view_and_each_ends_on_sigterm_or_when_idle(
    tmp_path: Path, nats_server: EmbeddedNats, subjects: Subjects, keepers: list[int]
) -> None:
    """A second keeper of the same view exits at once (0); SIGTERM ends the first (0)
    promptly; one given --idle-s ends by itself once that passed without a request."""
    await _a_worker_beats(nats_server, subjects)
    path = view_path([nats_server.url], subjects.prefix)
    log = tmp_path / "keepers.log"
    first = await _keep(nats_server.url, subjects.prefix, log)
    keepers.append(first.pid)
    await wait_until(lambda: _answers(path))
    second = await _keep(nats_server.url, subjects.prefix, log)
    keepers.append(second.pid)
    assert await _exit_code(second, 30) == 0
    assert "another keeper serves this view" in log.read_text()
    first.send_signal(signal.SIGTERM)
    assert await _exit_code(first, 5) == 0
    with pytest.raises(NoKeeper):
        ask(path)

    idle = await _keep(nats_server.url, subjects.prefix, log, "--idle-s", "0.5")
    keepers.append(idle.pid)
    await wait_until(lambda: _answers(path))  # a request: idle from its answer on
    assert await _exit_code(idle, 30) == 0
    assert "view_keeper_idle" in log.read_text()


async def test_a_keeper_of_another_versions_tables_stops_when_asked_by_this_one(
    tmp_path: Path, nats_server: EmbeddedNats, subjects: Subjects, keepers: list[int]
) -> None:
    """An upgrade leaves the old keeper running: asked by an invocation of other tables
    (here a version before them), it answers so and exits, and the next one starts anew."""
    await _a_worker_beats(nats_server, subjects)
    path = view_path([nats_server.url], subjects.prefix)
    keeper = await _keep(nats_server.url, subjects.prefix, tmp_path / "keeper.log")
    keepers.append(keeper.pid)
    await wait_until(lambda: _listening(path))
    with pytest.raises(KeeperError, match="another version"):
        ask(path, b"sync %d\n" % (SCHEMA_VERSION - 1))
    assert await _exit_code(keeper, 5) == 0


async def test_a_keeper_waits_for_the_views_lock_and_answers_meanwhile(
    tmp_path: Path, nats_server: EmbeddedNats, subjects: Subjects, keepers: list[int]
) -> None:
    """Another invocation writes the view (holds its lock: a `query --watch` does while it
    follows): the keeper's catch-up waits for it without blocking the keeper, which answers
    another request meanwhile, and catches up once the lock is let go."""
    await _a_worker_beats(nats_server, subjects)
    path = view_path([nats_server.url], subjects.prefix)
    keeper = await _keep(nats_server.url, subjects.prefix, tmp_path / "keeper.log")
    keepers.append(keeper.pid)
    await wait_until(lambda: _answers(path))
    lock = str(path.with_suffix(".lock"))

    def waits_for_the_lock() -> bool:  # the keeper holds the lock file open: it tries it
        fds = Path(f"/proc/{keeper.pid}/fd")
        return any(os.path.realpath(fd) == lock for fd in fds.iterdir())

    answered: list[str] = []

    async def sync() -> None:
        answered.append(await anyio.to_thread.run_sync(ask, path))

    with contextlib.ExitStack() as held:
        held.enter_context(locked(path))
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(sync)
            await wait_until(waits_for_the_lock)
            assert _listening(path)  # answered at once (within ask's bound) ...
            assert answered == []  # ... while the sync waits
            held.close()  # the lock let go: the keeper's catch-up goes on
    assert answered == ["3"]
    keeper.send_signal(signal.SIGTERM)
    assert await _exit_code(keeper, 5) == 0


async def test_a_keeper_that_cannot_catch_up_leaves_the_invocation_to_say_why(
    tmp_path: Path, nats_server: EmbeddedNats, subjects: Subjects, keepers: list[int]
) -> None:
    """No state stream: the keeper answers the error, and the invocation, catching up by
    itself, says it as it does without a keeper (exit 1)."""
    path = view_path([nats_server.url], subjects.prefix)
    keeper = await _keep(nats_server.url, subjects.prefix, tmp_path / "keeper.log")
    keepers.append(keeper.pid)
    await wait_until(lambda: _listening(path))
    with pytest.raises(KeeperError, match="no state stream"):
        ask(path)
    args = ["machines", "list", "--nats", nats_server.url, "--prefix", subjects.prefix]
    code, _, err, _ = run(tmp_path, "buyer", *args)
    assert code == 1 and "no state stream" in err, err
    keeper.send_signal(signal.SIGTERM)
    assert await _exit_code(keeper, 5) == 0


@pytest.mark.skipif(os.getuid() != 0, reason="another user's process needs root to make")
async def test_another_users_process_is_hung_up_on(
    tmp_path: Path, nats_server: EmbeddedNats, subjects: Subjects, keepers: list[int]
) -> None:
    """A process of another user (here nobody, 65534) reaches the socket (the abstract
    namespace has no file modes) and is hung up on without an answer."""
    await _a_worker_beats(nats_server, subjects)
    path = view_path([nats_server.url], subjects.prefix)
    keeper = await _keep(nats_server.url, subjects.prefix, tmp_path / "keeper.log")
    keepers.append(keeper.pid)
    await wait_until(lambda: _answers(path))
    pid = os.fork()
    if pid == 0:  # the child: nobody asks
        try:
            os.setgid(65534)
            os.setuid(65534)
            ask(path, STOP, timeout_s=10.0)
            os._exit(0)  # answered: wrong
        except KeeperError:
            os._exit(3)  # hung up on
        except BaseException:
            os._exit(4)
    _, status = await anyio.to_thread.run_sync(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 3
    assert _answers(path)  # its stop was not heard: the keeper serves on
    keeper.send_signal(signal.SIGTERM)
    assert await _exit_code(keeper, 5) == 0


@pytest.mark.parametrize(
    ("given", "seconds"),
    [(None, 300.0), ("", 300.0), ("0", 0.0), ("2.5", 2.5), (" 60 ", 60.0)],
)
def test_the_keepers_idle_time_from_the_environment(given: str | None, seconds: float) -> None:
    environ = {} if given is None else {ENV_KEEPER_S: given}
    assert keeper_s(environ) == seconds


@pytest.mark.parametrize("given", ["soon", "-1", "nan"])
def test_an_idle_time_that_is_no_number_of_seconds_is_refused(given: str) -> None:
    with pytest.raises(ValueError, match=f"{ENV_KEEPER_S} must be a number of seconds"):
        keeper_s({ENV_KEEPER_S: given})
