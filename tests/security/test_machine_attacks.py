"""Attacks from inside a machine (issue 36), each tried by a machine of tenant alice on both
drivers (a process worker and an oci worker of one region, tests/security/machines.py)
against what is tenant bob's (his machines on both workers) or the suppliers'. Each must be
refused, nothing of bob's or the suppliers' may change, and both workers stay up. The
attempts are shell scripts run by alice's machine; each line of its output says what one
attempt got (``GOT``) or why it was refused (``NO``). docs/security.md's threat table lists
each with its test here."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import pytest_asyncio

from supplier.machines.oci.bundle import runtime_id
from supplier.machines.shim.contract import PLAN, SOCKET, STATE
from supplier.machines.shim.spawn import SHARED_DIRS
from supplier.ports import default_host
from tests.security.machines import (
    DRIVERS,
    Arena,
    Attacker,
    arena,
    attack,
    get,
    unharmed,
)

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.slow]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def a(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Arena]:
    async with arena(tmp_path_factory.mktemp("arena")) as made:
        yield made


def words(*items: object) -> str:
    return " ".join(str(x) for x in items)


def nothing_got(attacker: Attacker, *tried: str) -> None:
    """No attempt managed, and each of ``tried`` was made (and refused)."""
    said = "\n".join(attacker.lines)
    assert attacker.got == [], said
    for what in tried:
        assert attacker.refused(what), f"{what} not tried:\n{said}"


def shim_dirs(a: Arena) -> list[Path]:
    return [
        w.data / "shims" / w.id / v.web.machine_id
        for w, v in ((a.workers[d], a.victims[d]) for d in DRIVERS)
    ]


# -- bob's environment --------------------------------------------------------------------------
ENVIRON = """
for p in $PIDS; do
  t "environ of $p" cat /proc/$p/environ
  t "command line of $p" cat /proc/$p/cmdline
  t "root of $p" ls /proc/$p/root/
  t "cwd of $p" ls /proc/$p/cwd/
done
for f in $FILES; do t "read $f" cat "$f"; done
"""


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_machine_cannot_read_another_machines_environment(a: Arena, driver: str) -> None:
    """bob's web machines' env (his secret) through /proc/<pid>/environ, their command
    lines (a secret passed as an argument), roots and working directories through /proc, a
    container's runtime spec (its bundle's config.json) and the shims' plans (each holds
    its machine's env)."""
    pids = [p for v in a.victims.values() for p in v.pids]
    bundles = [
        p
        for v in a.victims.values()
        for p in Path("/run/bourse/bundles").glob(f"*/{runtime_id(v.web.machine_id)}/config.json")
    ]
    assert len(bundles) == 1, bundles  # bob's container's
    files = [*bundles, *(d / PLAN for d in shim_dirs(a))]
    async with attack(a, driver, ENVIRON, PIDS=words(*pids), FILES=words(*files)) as alice:
        tried = [*(f"environ of {p}" for p in pids), *(f"command line of {p}" for p in pids)]
        nothing_got(alice, *tried, *(f"read {f}" for f in files))
        assert not any(a.secret in x for x in alice.lines)
    await unharmed(a)


# -- the supplier's files -----------------------------------------------------------------------
SUPPLIER = """
for d in $DIRS; do t "list $d" ls "$d"; done
for f in $FILES; do t "read $f" head -c 200 "$f"; done
"""


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_machine_cannot_read_the_suppliers_files(a: Arena, driver: str) -> None:
    """Both suppliers' data dirs (their store, which holds every machine's env), their keys
    (by path, and through /proc/<supplier pid>/cwd), their environment, bob's machines' logs,
    their shims' directories, states and sockets, the market's other keys."""
    dirs: list[Path] = []
    files: list[Path] = []
    for w in a.workers.values():
        dirs += [w.data, w.data / "shims" / w.id, w.data / "machines" / w.id]
        files += [w.data / "supplier.db", w.seed, Path(f"/proc/{w.pid}/cwd/{w.seed.name}")]
        files += [Path(f"/proc/{w.pid}/environ")]
        for v in a.victims.values():
            files.append(w.data / "machines" / w.id / f"{v.web.machine_id}.log")
    for d in shim_dirs(a):
        dirs.append(d)
        files += [d / STATE, d / SOCKET]
    files += [a.files.seed_file(user) for user in ("operator", "exchange", "buyer:bob")]
    files = [f for f in files if not f.name.endswith(".log") or f.exists()]
    env = {"DIRS": words(*dirs), "FILES": words(*files)}
    async with attack(a, driver, SUPPLIER, **env) as alice:
        nothing_got(alice, *(f"list {d}" for d in dirs), *(f"read {f}" for f in files))
    await unharmed(a)


# -- bob's image ---------------------------------------------------------------------------------
IMAGE_ROOT = """
for f in $ROOTS; do t "write $f" sh -c 'echo TAMPERED > "$1"' - "$f"; done
for f in $ROOTS; do t "remove $f" rm "$f"; done
"""


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_machine_cannot_rewrite_another_machines_cached_image(
    a: Arena, driver: str
) -> None:
    """alice runs the image bob's web machines run (the same digest: the same root in each
    worker's cache) and writes its page: through the host's path of each worker's root, and
    where her machine sees its image (a process machine: the read-only root; a container:
    its own writable layer, its copy alone). bob's machines serve the image's page still."""
    roots = list(a.roots)
    mine = "www/index.html"
    async with attack(a, driver, IMAGE_ROOT, ROOTS=words(*roots, mine)) as alice:
        nothing_got(alice, *(f"write {f}" for f in roots), *(f"remove {f}" for f in roots))
        if driver == "process":  # its image, read-only
            assert alice.refused(f"write {mine}"), alice.lines
    await unharmed(a)


# -- bob's machine stopped ---------------------------------------------------------------------
STOP = r"""
for s in $SOCKETS; do
  t "stop through $s" python3 -c '
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
s.sendall(b"{\"op\": \"stop\", \"grace_s\": 0}\n")
print(s.recv(4096))
' "$s"
done
for p in $PIDS; do t "kill $p" kill -9 $p; done
"""


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_machine_cannot_stop_another_machine(a: Arena, driver: str) -> None:
    """bob's web machines stopped through their shims' sockets ({"op": "stop"}), or killed
    (their processes, their shims, the suppliers)."""
    sockets = [d / SOCKET for d in shim_dirs(a)]
    shims = [int(_state(d)["shim_pid"]) for d in shim_dirs(a)]
    pids = [p for v in a.victims.values() for p in v.pids]
    pids += [*shims, *(w.pid for w in a.workers.values())]
    env = {"SOCKETS": words(*sockets), "PIDS": words(*pids)}
    async with attack(a, driver, STOP, **env) as alice:
        nothing_got(alice, *(f"stop through {s}" for s in sockets), *(f"kill {p}" for p in pids))
    await unharmed(a)


def _state(directory: Path) -> dict[str, object]:
    return dict(json.loads((directory / STATE).read_text()))


# -- its cgroup ---------------------------------------------------------------------------------
CGROUP = """
me=$$
for d in /sys/fs/cgroup/* /sys/fs/cgroup; do
  for f in "$d/tasks" "$d/cgroup.procs" "$d/bourse/tasks" "$d/bourse/cgroup.procs"; do
    [ -e "$f" ] || continue
    t "join $f" sh -c 'echo "$2" > "$1"' - "$f" "$me"
  done
done
"""


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_machine_cannot_leave_its_cgroup(a: Arena, driver: str) -> None:
    """alice's machine writes its pid into the host's root cgroups and Bourse's subtree
    (cgroup v1: each controller's; cgroup2: the unified one); its processes stay in its own
    cgroups (the host's /proc/<pid>/cgroup names its machine id in every hierarchy it was
    put in)."""
    async with attack(a, driver, CGROUP) as alice:
        assert alice.got == [], alice.lines
        assert any(x.startswith("NO join ") for x in alice.lines), alice.lines
        tail = alice.machine.machine_id.split("~", 1)[1]
        assert alice.pids
        for pid in alice.pids:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
            for controller in ("pids", "memory"):
                [line] = [x for x in lines if controller in x.split(":")[1].split(",")] or [
                    x for x in lines if x.startswith("0::")
                ]
                assert tail in line, lines
    await unharmed(a)


# -- ports ---------------------------------------------------------------------------------------
PORTS = """
mkdir -p /tmp/evil && echo alice > /tmp/evil/index.html
for p in $PORTS; do t "bind $p" httpd -p "$p" -h /tmp/evil; done
"""


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_machine_cannot_take_another_machines_port(a: Arena, driver: str) -> None:
    """alice's machine serves its own page on every port of bob's (his running web
    machines' and his reserved spares'): it may bind them in its own network, and none of
    bob's addresses serves it: a running one serves bob's machine, a reserved one nothing."""
    ports = [
        int(addr.rsplit(":", 1)[1])
        for v in a.victims.values()
        for m in (v.web, v.spare)
        for addr in m.addresses.values()
    ]
    async with attack(a, driver, PORTS, PORTS=words(*ports)):
        for v in a.victims.values():
            [spare] = v.spare.addresses.values()
            assert b"alice" not in get(spare), spare
            assert get(spare).startswith(b"error"), spare
        await unharmed(a)


# -- the host's listeners and other machines -----------------------------------------------------
REACH = """
gw=$(ip route | awk '/^default/ {print $3}')
mkdir -p /tmp/reach
for hp in $TARGETS "$gw:$NATS_PORT" "$gw:$METRICS_PORT"; do
  t "connect $hp" nc -w 2 "${hp%:*}" "${hp##*:}" </dev/null >"/tmp/reach/$hp" &
done
wait
cat /tmp/reach/*
"""


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_machine_cannot_reach_the_hosts_listeners_or_other_machines(
    a: Arena, driver: str
) -> None:
    """NATS and both suppliers' /metrics on the host's addresses (its own, and its worker's
    gateway), and bob's web machines' private addresses on both workers: each of which the
    host reaches."""
    ip = default_host()
    targets = [f"{ip}:{a.nats_port}"]
    targets += [f"{ip}:{w.metrics.rsplit(':', 1)[1]}" for w in a.workers.values()]
    for v in a.victims.values():
        [addr] = v.web.addresses.values()
        targets.append(f"{v.private}:{addr.rsplit(':', 1)[1]}")
    env = {
        "TARGETS": words(*targets),
        "NATS_PORT": str(a.nats_port),
        "METRICS_PORT": a.workers[driver].metrics.rsplit(":", 1)[1],
    }
    for target in targets:
        assert await anyio.to_thread.run_sync(reachable, target), target
    async with attack(a, driver, REACH, **env) as alice:
        nothing_got(alice, *(f"connect {t}" for t in targets))
    await unharmed(a)


def reachable(target: str) -> bool:
    """Whether this process (the host) connects to ``host:port``."""
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


# -- the host's shared directories ---------------------------------------------------------------
SHARED = """
for d in $DIRS; do
  t "write $d" sh -c 'echo alice > "$1/alice-$2" && cat "$1/alice-$2"' - "$d" "$BOURSE_MACHINE_ID"
done
"""


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_machine_writes_nothing_into_the_hosts_shared_directories(
    a: Arena, driver: str
) -> None:
    """The host's /tmp, /var/tmp, /dev/shm and /run/lock are any user's: what alice's machine
    writes there is its own (a process machine: a tmpfs of its own each; a container: its
    root), and none of it reaches the host's, where another machine would read it, or the
    next machine of its user ids find it, or which it could fill."""
    dirs = [d for d in SHARED_DIRS if Path(d).is_dir()]
    async with attack(a, driver, SHARED, DIRS=words(*dirs)) as alice:
        if driver == "process":  # its own, each
            assert all(alice.lines_of(f"GOT write {d}: alice") for d in dirs), alice.lines
        mine = f"alice-{alice.machine.machine_id}"
        assert [d for d in dirs if Path(d, mine).exists()] == []
    await unharmed(a)
