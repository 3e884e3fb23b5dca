"""``buyer machines exec`` (docs/protocol.md §4.24) on the arena of tests/security/machines.py:
an authenticated market, a process and an oci worker as real ``supplier run`` processes, bob's
started web machine and reserved spare on each. A command bob runs in his machine runs as
the machine runs, with nothing more: its user, its namespaces (its network, its files: the
image, never the supplier's data dir), its cgroups, its environment; its streams come
through the exchange, apart; its exit code is the command's; its input is piped in. alice
cannot enter bob's machines; a supplier's key reaches no other worker's exec."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator

import anyio
import pytest
import pytest_asyncio

from bourse.client import BourseClient, ClientError
from bourse.client.execs import Ended
from bourse.nats.connection import connect
from bourse.wire.codec import encode
from bourse.wire.messages import ExecRequest
from tests.security.conftest import Violations
from tests.security.machines import DRIVERS, PAGE, PREFIX, Arena, arena

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def a(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Arena]:
    async with arena(tmp_path_factory.mktemp("arena")) as made:
        yield made


async def run(
    client: BourseClient,
    machine_id: str,
    *command: str,
    stdin: bytes | None = None,
    tty: bool = False,
) -> tuple[Ended, dict[str, bytes]]:
    """``command`` run in the machine: how it ended, and its output by stream."""
    out = {"stdout": b"", "stderr": b""}
    left = [stdin or b""]

    async def output(stream: str, data: bytes) -> None:
        out[stream] += data

    async def read_input(n: int) -> bytes:
        chunk, left[0] = left[0][:n], left[0][n:]
        return chunk

    req = ExecRequest(
        machine_id=machine_id, command=list(command), stdin=stdin is not None, tty=tty
    )
    with anyio.fail_after(30):
        ended = await client.exec(req, output, read_input if stdin is not None else None)
    return ended, out


def target(a: Arena, driver: str) -> str:
    """The machine's first process as the machine sees it (a container's is its pid 1)."""
    return str(a.victims[driver].pids[0]) if driver == "process" else "1"


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_command_runs_as_its_machine_runs(a: Arena, driver: str) -> None:
    """Its user and groups, capability sets, no-new-privileges and seccomp mode, its cgroups
    and its network are its machine's first process's (read side by side inside the
    machine: a container's pid 1 is its first process, so its pid namespace is the
    container's), its environment the machine's; it sees the machine's image and not its
    supplier's data dir."""
    v = a.victims[driver]
    mid = v.web.machine_id
    first = target(a, driver)
    fields = "'^(Uid|Gid|Groups|NoNewPrivs|Cap[A-Za-z]+|Seccomp):'"
    script = f"grep -E {fields} /proc/self/status; echo ---; grep -E {fields} /proc/{first}/status"
    ended, out = await run(a.bob, mid, "sh", "-c", script)
    assert (ended.code, out["stderr"]) == (0, b""), out["stderr"].decode()
    mine, theirs = out["stdout"].decode().split("---\n")
    assert mine == theirs and "Uid:" in mine, out
    ended, out = await run(
        a.bob, mid, "sh", "-c", f"cat /proc/self/cgroup; echo ---; cat /proc/{first}/cgroup"
    )
    mine, theirs = out["stdout"].decode().split("---\n")
    assert mine == theirs and mine, out
    ended, out = await run(a.bob, mid, "ip", "-4", "addr")
    assert ended.code == 0 and f"inet {v.private}/" in out["stdout"].decode(), out
    ended, out = await run(a.bob, mid, "sh", "-c", 'echo "$BOB_SECRET"')
    assert out["stdout"].decode().strip() == a.secret
    ended, out = await run(a.bob, mid, "sh", "-c", 'cat "${BOURSE_IMAGE_ROOT:-}/www/index.html"')
    assert (ended.code, out["stdout"]) == (0, PAGE), out
    data = a.workers[driver].data
    ended, out = await run(a.bob, mid, "ls", "-a", str(data))
    assert ended.code != 0 and out["stdout"] == b"" and out["stderr"], out
    if driver == "process":  # its user is the machine's own on the host
        ended, out = await run(a.bob, mid, "id", "-u")
        host_uid = os.stat(f"/proc/{v.pids[0]}").st_uid
        assert out["stdout"].decode().strip() == str(host_uid) != "0", out


@pytest.mark.parametrize("driver", DRIVERS)
async def test_streams_apart_exit_codes_and_input(a: Arena, driver: str) -> None:
    """stdout and stderr come apart, the exit code is the command's (a signal's as such),
    input is piped in to its end, a terminal is one."""
    mid = a.victims[driver].web.machine_id
    ended, out = await run(a.bob, mid, "sh", "-c", "echo out; echo err >&2; exit 7")
    assert (ended.code, ended.status, out) == (7, 7, {"stdout": b"out\n", "stderr": b"err\n"})
    ended, out = await run(a.bob, mid, "sh", "-c", "kill -9 $$")
    assert (ended.code, ended.signal, ended.status) == (None, 9, 137), ended
    piped = b"".join(b"line %d\n" % i for i in range(100_000))  # 1 MB: 4 windows each way
    ended, out = await run(a.bob, mid, "cat", stdin=piped)
    assert (ended.code, out["stdout"]) == (0, piped), (ended, len(out["stdout"]))
    ended, out = await run(a.bob, mid, "no-such-command")
    assert ended.code == 127 and b"no-such-command" in out["stderr"], (ended, out)
    ended, out = await run(a.bob, mid, "sh", "-c", "test -t 0 && test -t 1 && echo tty", tty=True)
    assert (ended.code, out["stdout"].strip()) == (0, b"tty"), (ended, out)


async def test_who_may_enter_which_machine(a: Arena) -> None:
    """alice cannot enter bob's machines; an unknown machine and a machine that is not
    started are refused with why."""
    for driver in DRIVERS:
        v = a.victims[driver]
        with pytest.raises(ClientError, match="is not one of 'alice''s machines"):
            await run(a.alice, v.web.machine_id, "id")
        with pytest.raises(ClientError, match=f"machine {v.spare.machine_id} is reserved: exec"):
            await run(a.bob, v.spare.machine_id, "id")
    unknown = f"{a.workers['process'].id}~01J8Y3Z6V5W4X3Y2Z1A0B9C8D7"
    with pytest.raises(ClientError, match=f"no machine {unknown}"):
        await run(a.bob, unknown, "id")
    with pytest.raises(ClientError, match="'nowhere-1' is not reachable"):
        await run(a.bob, "nowhere-1~01J8Y3Z6V5W4X3Y2Z1A0B9C8D7", "id")


async def test_a_supplier_key_reaches_no_other_worker(a: Arena) -> None:
    """The process worker's supplier key may neither ask the exchange for an exec nor
    address the oci worker's exec subject, nor feed a session: the server refuses each."""
    s = a.alice.subjects
    own = a.workers["process"]
    other = a.workers["oci"]
    v = Violations()
    nc = await connect(
        a.nats.url, name="mallory", creds=str(own.seed), service=False, error_cb=v.error_cb
    )
    try:
        body = encode(ExecRequest(machine_id=a.victims["oci"].web.machine_id, command=["id"]))
        for subject in (
            s.worker_machine(other.id, "exec"),
            s.machine("exec"),
            s.tenant_machine("bob", "exec"),
            s.exec_input("0123abcd"),
            s.exec_input("0123abcd", "bob"),
        ):
            await nc.publish(subject, body, reply=nc.new_inbox())
            assert f'publish to "{subject}"' in (await v.next()).lower(), subject
    finally:
        await nc.close()


async def test_the_cli_runs_a_command_and_exits_with_its_code(a: Arena) -> None:
    """``buyer machines exec`` with bob's key: the command's stdout and stderr are the
    CLI's, apart, its exit code the CLI's; ``-i`` pipes stdin in."""
    mid = a.victims["process"].web.machine_id
    common = [
        "--nats",
        a.nats.url,
        "--prefix",
        PREFIX,
        "--creds",
        str(a.files.seed_file("buyer:bob")),
    ]

    def cli(*args: str, stdin: bytes = b"") -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "buyer_cli", "machines", "exec", *common, *args],
            input=stdin,
            capture_output=True,
            timeout=60,
            check=False,
        )

    done = await anyio.to_thread.run_sync(
        lambda: cli(mid, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, b"out\n", b"err\n"), done
    done = await anyio.to_thread.run_sync(
        lambda: cli("-i", mid, "--", "tr", "a-z", "A-Z", stdin=b"piped in\n")
    )
    assert (done.returncode, done.stdout) == (0, b"PIPED IN\n"), done


@pytest.mark.parametrize("driver", DRIVERS)
async def test_the_cli_gives_a_terminal(a: Arena, driver: str) -> None:
    """``exec -it ID -- sh`` from a terminal: a shell on a terminal of the worker's (its
    size this terminal's), what is typed reaches it, its exit code is the CLI's."""
    import fcntl
    import pty
    import struct
    import termios

    mid = a.victims[driver].web.machine_id
    bob = str(a.files.seed_file("buyer:bob"))
    common = ["--nats", a.nats.url, "--prefix", PREFIX, "--creds", bob]
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
    argv = [sys.executable, "-m", "buyer_cli", "machines", "exec", *common, "-it", mid, "--", "sh"]
    try:
        proc = await anyio.open_process(
            argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True
        )
    finally:
        os.close(slave)
    os.set_blocking(master, False)
    os.write(master, b"stty size; echo typed-$((6*7)); exit 5\n")  # typed ahead: kept
    out = b""
    try:
        with anyio.fail_after(60):
            while True:
                try:
                    chunk = os.read(master, 4096)
                except BlockingIOError:
                    await anyio.wait_readable(master)
                    continue
                except OSError:  # EIO: the CLI and its terminal are gone
                    break
                if not chunk:
                    break
                out += chunk
            code = await proc.wait()
    finally:
        os.close(master)
        if proc.returncode is None:
            proc.kill()
    assert code == 5, out
    assert b"typed-42" in out and b"33 101" in out, out
