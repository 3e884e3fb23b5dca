"""The container example (examples/busybox-httpd): its build script makes a root of its own
from the host's static busybox, pushed as documented and placed with a port and a check on
a real oci worker (runc) whose machines are held by shims, under a data dir named relative
to the supplier's directory (as `bourse up`'s .bourse/up); it answers HTTP at its address."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import urllib.request
from pathlib import Path

import anyio
import pytest

from bourse.images import ImageStore, RunSpec
from bourse.runtime.endpoint import free_port
from bourse.wire.messages import Check, Machine, Placed
from tests.containers import need_runc
from tests.isolation import own_worker_id
from tests.market import Market, order, worker

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "busybox-httpd"
# The command the example's README pushes the image with.
CMD = 'sh -c "exec httpd -f -p $PORT -h /www"'
WAIT_S = 30.0


def _build(out: Path) -> None:
    """The example's root, or the test skipped naming the package it needs."""
    busybox = shutil.which("busybox")
    linked = subprocess.run(["ldd", busybox or "/"], capture_output=True, text=True, check=False)
    if busybox is None or "not a dynamic executable" not in linked.stdout + linked.stderr:
        pytest.skip("needs a static busybox (Debian package busybox-static)")
    subprocess.run([str(EXAMPLE / "build.sh"), str(out)], check=True)


def _passing(m: Machine) -> bool:
    return m.health is not None and m.health.status == "passing"


def _get(url: str) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=2) as reply:
        return reply.status, reply.read()


async def test_the_busybox_httpd_example_serves_http_from_a_container(
    market: Market, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_runc()
    _build(tmp_path / "root")
    assert (tmp_path / "root" / "bin" / "httpd").is_symlink()
    await market.jetstream_init()
    store = await ImageStore.open(await market.connect("images"), market.subjects.prefix)
    await store.push_directory(tmp_path / "root", "bb:v1", RunSpec(cmd=tuple(shlex.split(CMD))))
    port = free_port("127.0.0.1", 29500, [])
    monkeypatch.chdir(tmp_path)
    w = worker(
        own_worker_id("bb"),
        driver="oci",
        keep_machines=True,
        ports=f"{port}-{port}",
        advertise_host="127.0.0.1",
    )
    await market.host(w, data_dir=Path("supplier"))
    await market.exchange()
    buyer = await market.client()
    check = Check(port="http", kind="http", path="/healthz", interval_s=0.1, timeout_s=1)
    r = await buyer.place(order(image="bb:v1", memory_mb=64, ports=["http"], checks=[check]))
    assert isinstance(r, Placed), r
    assert r.addresses == {"http": f"127.0.0.1:{port}"}
    try:
        assert (await buyer.machine("start", r.machine_id)).state == "started"
        with anyio.fail_after(WAIT_S):
            while not _passing(await buyer.machine("get", r.machine_id)):  # noqa: ASYNC110 - a poll of the supplier
                await anyio.sleep(0.05)  # the poll's pace, not a synchronisation
        status, page = await anyio.to_thread.run_sync(_get, f"http://{r.addresses['http']}/")
        assert status == 200 and b"busybox httpd" in page
        assert await anyio.to_thread.run_sync(_get, f"http://127.0.0.1:{port}/healthz") == (
            200,
            b"ok\n",
        )
    finally:
        assert (await buyer.machine("destroy", r.machine_id)).state == "destroyed"
