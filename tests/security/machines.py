"""An arena for attacks from inside a machine (issue 36): an authenticated market on a real
nats-server (tenants alice and bob), one region with a ``--driver process`` and a
``--driver oci`` worker as real ``supplier run`` processes on their own keys, an exchange,
and bob's machines on both workers: a started web server each (a secret in its env) and a
reserved one holding a port.

The suppliers' data dirs and the market's keys lie in a directory any user may enter, as
``/var/lib/bourse`` and ``/etc/bourse`` do: what keeps a machine out of them is the
supplier's own doing, not the test's temporary directory. Each supplier runs in the
directory of its key (``/proc/<pid>/cwd`` leads there).

alice's machine runs a shell script given in its env (:func:`attack`): the image is a static
busybox (so the same image runs as a process and as a container; a process machine also
finds the host's ``python3``), and each attempt of a script prints one line, ``GOT <what>:
<what it read>`` when it managed, ``NO <what>: <the error>`` when refused.
"""

from __future__ import annotations

import contextlib
import re
import secrets
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import anyio

from bourse.client import BourseClient
from bourse.client.follow import follow_logs
from bourse.images import ImageStore, RunSpec
from bourse.nats.authdir import AuthFiles, SupplierSpec, write_auth_dir
from bourse.nats.connection import connect
from bourse.nats.embedded import EmbeddedNats
from bourse.runtime.launcher import Program, start_program
from bourse.wire.messages import Machine, Placed, PlaceOrder, Resources
from bourse.wire.subjects import Subjects
from tests.containers import busybox_root, need_isolation, reap_kept
from tests.isolation import own_worker_id
from tests.leftovers import leftovers, processes_with

PREFIX = "atk"
DRIVERS = ("process", "oci")
IMAGE = "attacks:v1"
PAGE = b"the image's own page\n"
WAIT_S = 30.0
# The applets the scripts use, beside tests/containers.py's.
APPLETS = (
    *("cut", "head", "httpd", "ip", "kill", "nc", "printf", "ps", "sed", "tr", "wget", "xargs"),
)
# Every attack script begins with this: `t WHAT CMD...` runs CMD and says what came of it.
PRELUDE = r"""
t() {
  w=$1; shift
  if out=$("$@" 2>&1); then
    echo "GOT $w: $(printf %s "$out" | tr '\000\n' '  ' | head -c 400)"
  else
    echo "NO $w: $(printf %s "$out" | tr '\000\n' '  ' | head -c 200)"
  fi
}
"""
# bob's web machine: says its private address, then serves the image's page on its port.
# (A container's first process gets a SIGTERM only if it handles it: a stop is prompt.)
VICTIM = """
echo "private $BOURSE_PRIVATE_ADDRESS"
trap "exit 0" TERM
httpd -f -p "$PORT" -h www & wait
"""


@dataclass
class Worker:
    """One supplier process of the arena and its one worker."""

    id: str
    driver: str
    data: Path
    seed: Path
    program: Program
    metrics: str  # host:port of its /metrics

    @property
    def pid(self) -> int:
        return self.program.proc.pid  # the reaper's: it execs the supplier (same pid)


@dataclass
class Victim:
    """bob's machines on one worker: ``web`` started, ``spare`` reserved (a port held)."""

    web: Machine
    spare: Machine
    pids: list[int]  # web's processes on the host
    private: str  # web's private address


@dataclass
class Arena:
    base: Path
    nats: EmbeddedNats
    files: AuthFiles
    workers: dict[str, Worker]  # by driver
    exchange: Program
    alice: BourseClient
    bob: BourseClient
    secret: str
    victims: dict[str, Victim] = field(default_factory=dict)  # by driver
    roots: dict[Path, bytes] = field(default_factory=dict)  # a cached root's page: its bytes

    def other(self, driver: str) -> str:
        return next(w.id for d, w in self.workers.items() if d != driver)

    @property
    def nats_port(self) -> int:
        port = self.nats.port
        assert port is not None
        return port


def image_root(top: Path) -> Path:
    root = busybox_root(top)
    for applet in APPLETS:
        link = root / "bin" / applet
        if not link.exists():
            link.symlink_to("busybox")
    (root / "www").mkdir()
    (root / "www" / "index.html").write_bytes(PAGE)
    return root


@contextlib.asynccontextmanager
async def arena(tmp: Path) -> AsyncIterator[Arena]:
    """The arena (see the module doc), everything of it stopped and removed at its end."""
    need_isolation()
    # as /var/lib/bourse: any user may enter (not below /tmp or /var/tmp, which a process
    # machine sees none of: they are its own)
    base = Path(tempfile.mkdtemp(prefix="bourse-tests-attacks-", dir="/var/lib"))
    base.chmod(0o755)
    programs: list[Program] = []
    server: EmbeddedNats | None = None
    try:
        ids = {"process": own_worker_id("atk-p"), "oci": own_worker_id("atk-c")}
        subjects = Subjects(PREFIX)
        specs = [SupplierSpec(wid, ((wid, "mad"),)) for wid in ids.values()]
        files = write_auth_dir(base / "auth", subjects, specs, buyers=("alice", "bob"))
        server = EmbeddedNats(
            workdir=tmp / "nats",
            config=files.server_conf,
            jetstream=True,
            bind_loopback=False,  # every address of the host, as a market's server
            extra_args=["-a", "0.0.0.0", "-p", "-1"],
        ).start()
        common = ("--nats", server.url, "--prefix", PREFIX)
        exchange = await start_program(
            *("exchange", "serve", "--creds", str(files.seed_file("exchange"))),
            *("--trust", str(files.trust), *common),
            log_path=tmp / "exchange.log",
            ready="exchange ready",
        )
        programs.append(exchange)
        operator = await connect(
            server.url, name="operator", creds=str(files.seed_file("operator")), service=False
        )
        try:
            store = await ImageStore.open(operator, PREFIX)
            run = RunSpec(cmd=("sh", "-c", 'eval "$RUN"'), workdir="/")
            await store.push_directory(image_root(tmp / "image"), IMAGE, run)
        finally:
            await operator.close()
        workers: dict[str, Worker] = {}
        for driver, wid in ids.items():
            seed = files.seed_file(f"supplier:{wid}")
            data = base / f"data-{driver}"
            program = await start_program(
                *("supplier", "run", "--worker-id", wid, "--region", "mad", "--driver", driver),
                *("--cpus", "8", "--memory-mb", "8192", "--data-dir", str(data)),
                *("--creds", seed.name, "--metrics-addr", "0.0.0.0:0", *common),
                log_path=tmp / f"supplier-{driver}.log",
                ready="supplier ready",
                cwd=seed.parent,  # /proc/<its pid>/cwd is where its key is
            )
            programs.append(program)
            said = re.search(r"metrics on http://([0-9.]+:[0-9]+)/", program.ready_line)
            assert said is not None, program.ready_line
            workers[driver] = Worker(wid, driver, data, seed, program, said.group(1))
        clients = {}
        for tenant in ("alice", "bob"):
            creds = str(files.seed_file(f"buyer:{tenant}"))
            nc = await connect(server.url, name=tenant, creds=creds, service=False)
            clients[tenant] = BourseClient(nc, subjects, tenant=tenant)
        a = Arena(
            base,
            server,
            files,
            workers,
            exchange,
            clients["alice"],
            clients["bob"],
            secrets.token_hex(16),
        )
        try:
            for driver in DRIVERS:
                a.victims[driver] = await _victim(a, driver)
            for path in a.base.glob("data-*/images/*/roots/*/www/index.html"):
                a.roots[path] = path.read_bytes()
            assert len(a.roots) == 2, sorted(a.roots)
            yield a
            for v in a.victims.values():
                for m in (v.web, v.spare):
                    assert (await a.bob.machine("destroy", m.machine_id)).state == "destroyed"
            for w in workers.values():  # nothing of their workers left on the host
                assert await w.program.stop() == 0, w.program.log
                assert not (left := leftovers(w.data, w.id)), left
        finally:
            for client in (a.alice, a.bob):
                await client.close()
                await client.nc.close()
    finally:
        for p in reversed(programs):
            await p.stop()
        if server is not None:
            server.stop()
        reap_kept(base)
        shutil.rmtree(base, ignore_errors=True)


async def place(
    a: Arena, client: BourseClient, driver: str, env: dict[str, str], ports: list[str]
) -> Placed:
    """An order of ``client``'s for the image on ``driver``'s worker."""
    placed = await client.place(
        PlaceOrder(
            region="mad",
            resources=Resources(cpus=1, memory_mb=256),
            image=IMAGE,
            exclude_workers=[a.other(driver)],
            ports=ports,
            env=env,
            deadline_ms=5000,
        )
    )
    assert isinstance(placed, Placed), placed
    assert placed.worker_id == a.workers[driver].id
    return placed


async def _victim(a: Arena, driver: str) -> Victim:
    env = {"RUN": VICTIM, "BOB_SECRET": a.secret}
    placed = await place(a, a.bob, driver, env, ["web"])
    web = await a.bob.machine("start", placed.machine_id)
    assert web.state == "started", web
    lines = await said(a.bob, web.machine_id, "private ")
    private = next(x for x in lines if x.startswith("private ")).split()[1]
    spare_placed = await place(a, a.bob, driver, {"BOB_SECRET": a.secret}, ["web"])
    spare = await a.bob.machine("get", spare_placed.machine_id)
    assert spare.state == "reserved", spare
    pids = processes_with(f"BOURSE_MACHINE_ID={web.machine_id}")
    assert len(pids) == 2, pids  # its shell and its server
    got = await anyio.to_thread.run_sync(get, web.addresses["web"])
    assert got == PAGE, got
    return Victim(web, spare, pids, private)


async def said(client: BourseClient, machine_id: str, text: str) -> list[str]:
    """The machine's output once a line of it begins with ``text`` (its lines followed as
    they come: bourse/client/follow.py)."""
    lines: list[str] = []
    with anyio.fail_after(WAIT_S):
        async for got in follow_logs(client, machine_id, tail=500):
            lines += got.lines
            if any(x.startswith(text) for x in got.lines):
                return lines
    raise AssertionError(f"{machine_id} stopped being followed before {text!r}")


def get(address: str, path: str = "/") -> bytes:
    """What ``http://address/path`` serves, or the error's name."""
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=3) as reply:
            return bytes(reply.read())
    except (OSError, urllib.error.URLError) as exc:
        return f"error: {type(exc).__name__}".encode()


@dataclass
class Attacker:
    """alice's machine that ran one script: its id and its output's attempts."""

    machine: Machine
    lines: list[str]

    @property
    def got(self) -> list[str]:
        """The attempts that managed."""
        return [x for x in self.lines if x.startswith("GOT ")]

    def refused(self, what: str) -> list[str]:
        return [x for x in self.lines if x.startswith(f"NO {what}")]

    def lines_of(self, start: str) -> list[str]:
        return [x for x in self.lines if x.startswith(start)]

    @property
    def pids(self) -> list[int]:
        return processes_with(f"BOURSE_MACHINE_ID={self.machine.machine_id}")


@contextlib.asynccontextmanager
async def attack(a: Arena, driver: str, script: str, **env: str) -> AsyncIterator[Attacker]:
    """alice's machine on ``driver``'s worker running ``script`` (after :data:`PRELUDE`,
    ``env`` its targets); yields once the script said ``END`` (its machine running on,
    asleep), destroys it after."""
    run = f"{PRELUDE}\n{script}\necho END\ntrap 'exit 0' TERM\nsleep 3600 & wait\n"
    placed = await place(a, a.alice, driver, {"RUN": run, **env}, ["web"])
    try:
        m = await a.alice.machine("start", placed.machine_id)
        assert m.state == "started", m
        lines = await said(a.alice, m.machine_id, "END")
        yield Attacker(m, lines)
    finally:
        with anyio.CancelScope(shield=True):
            await a.alice.machine("destroy", placed.machine_id)


async def unharmed(a: Arena) -> None:
    """Nothing of bob's or the suppliers' changed: both suppliers run and answer, bob's web
    machines run the same process and serve the image's page at their addresses, his
    spares are reserved, the cached roots hold what they held."""
    for w in a.workers.values():
        assert w.program.proc.returncode is None, w.program.log
    answered = {s.worker_id for s in await a.bob.status("mad")}
    assert answered == {w.id for w in a.workers.values()}
    for v in a.victims.values():
        web = await a.bob.machine("get", v.web.machine_id)
        assert (web.state, web.restarts) == ("started", v.web.restarts), web
        assert processes_with(f"BOURSE_MACHINE_ID={v.web.machine_id}") == v.pids
        served = await anyio.to_thread.run_sync(get, v.web.addresses["web"])
        assert served == PAGE, (v.web.addresses, served)
        assert (await a.bob.machine("get", v.spare.machine_id)).state == "reserved"
    for path, page in a.roots.items():
        assert path.read_bytes() == page, path
