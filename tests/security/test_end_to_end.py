"""The positive path: every program as a real process on its own credentials (and the
exchange taking only signed offers), a buyer on the buyer's, real orders placed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import sys
from pathlib import Path

import pytest

from bourse.client import BourseClient
from bourse.nats.auth import tenant_of
from bourse.runtime.launcher import Program, start_program
from bourse.wire.codec import decode
from bourse.wire.messages import Event, Placed
from tests.market import order
from tests.security.conftest import FLEET_FRA, PREFIX, Secured


async def start_market(secured: Secured, tmp_path: Path, *extra: str) -> list[Program]:
    """An exchange with the trust file, a one-worker supplier (mad-1) and a fleet supplier
    (fra-1, fra-2), each with --creds of its own user."""
    common = ["--nats", secured.url, "--prefix", PREFIX, *extra]
    fleet = tmp_path / "fleet-fra.toml"
    fleet.write_text(FLEET_FRA)

    async def run(name: str, user: str, *args: str) -> Program:
        return await start_program(
            *args,
            "--creds",
            secured.creds(user),
            *common,
            log_path=tmp_path / "logs" / f"{name}.log",
            ready=f"{args[0]} ready",
        )

    one = (
        "--driver",
        "sim",
        "--worker-id",
        "mad-1",
        "--region",
        "mad",
        "--cpus",
        "8",
        "--memory-mb",
        "8192",
    )
    # The exchange first: it makes the streams, so the suppliers' rows and heartbeats are in
    # the state stream from their start (a supplier started before them finds the stream
    # with its next heartbeat, up to a second on: a view read meanwhile lacks its workers).
    specs = [
        ("exchange", "exchange", ("exchange", "serve", "--trust", str(secured.files.trust))),
        ("mad-1", "supplier:mad-1", ("supplier", "run", *one, "--data-dir", str(tmp_path / "m"))),
        (
            "fra",
            "supplier:fleet-fra",
            ("supplier", "run", "--fleet", str(fleet), "--data-dir", str(tmp_path / "f")),
        ),
    ]
    programs: list[Program] = []
    try:
        for name, user, args in specs:
            programs.append(await run(name, user, *args))
    except BaseException:
        for p in programs:
            await p.stop()
        raise
    return programs


async def run_buyer(secured: Secured, user: str, *args: str) -> tuple[int, str, str]:
    """The buyer CLI as a process of its own, on ``user``'s key."""
    common = ("--creds", secured.creds(user), "--nats", secured.url, "--prefix", PREFIX)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "buyer_cli",
        *args,
        *common,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_orders_placed_with_every_program_on_its_own_credentials(
    secured: Secured, tmp_path: Path
) -> None:
    programs = await start_market(secured, tmp_path)
    try:
        nc, violations = await secured.connect("buyer")
        events = await nc.subscribe(secured.subjects.events(kind="placed"))
        buyer = BourseClient(nc, secured.subjects)
        fra = await buyer.place(order(region="fra", cpus=2, memory_mb=1024, order_id="sec-fra"))
        assert isinstance(fra, Placed), fra
        assert fra.region == "fra" and fra.worker_id in {"fra-1", "fra-2"}
        mad = await buyer.place(order(region="mad", cpus=2, memory_mb=1024, order_id="sec-mad"))
        assert isinstance(mad, Placed) and mad.worker_id == "mad-1", mad
        # machine state through the exchange, and a status gather (one reply per worker)
        assert (await buyer.machine("get", fra.machine_id)).order_id == "sec-fra"
        statuses = await buyer.status("fra")
        assert [s.worker_id for s in statuses] == ["fra-1", "fra-2"]
        placed = {decode((await events.next_msg(timeout=5)).data, Event).order_id for _ in "ab"}
        assert placed == {"sec-fra", "sec-mad"}
        assert violations.none_yet() and not violations.other
    finally:
        codes = [await p.stop() for p in reversed(programs)]
    assert codes == [0, 0, 0]
    for p in programs:
        assert "permissions violation" not in p.log.lower(), p.log
        assert "offer_unverified" not in p.log, p.log


@pytest.mark.slow
async def test_a_tenant_key_from_auth_init_places_and_keeps_its_machines_its_own(
    secured: Secured, tmp_path: Path
) -> None:
    """`auth init --buyer alice --buyer bob` keys (the secured fixture's) with the real
    buyer CLI: alice places an order and sees her machine; bob's destroy of it is refused
    in one line (exit 1) and his listing of the worker is empty."""
    assert tenant_of(secured.creds("buyer:alice")) == "alice"
    programs = await start_market(secured, tmp_path)
    buyer = functools.partial(run_buyer, secured)
    try:
        place = ("place", "--region", "mad", "--cpus", "1", "--memory-mb", "256")
        code, out, err = await buyer("buyer:alice", *place, "--image", "web", "--json")
        assert code == 0, err
        placed = json.loads(out)["result"]
        assert placed["worker_id"] == "mad-1" and ":" not in placed["order_id"], placed
        mid = placed["machine_id"]
        listing = ("machines", "list", "--worker", "mad-1", "--json")
        code, out, err = await buyer("buyer:alice", *listing)
        assert code == 0 and mid in out, err
        code, out, err = await buyer("buyer:bob", "machines", "destroy", mid)
        assert code == 1 and f"machine {mid} is not one of 'bob'" in err, (out, err)
        code, out, err = await buyer("buyer:bob", *listing)
        assert code == 0 and mid not in out, err
        code, out, err = await buyer("buyer:bob", "watch", "--count", "1")
        assert code == 1 and "tenant 'bob' may not read events" in err, (out, err)
    finally:
        codes = [await p.stop() for p in reversed(programs)]
    assert codes == [0, 0, 0]


@pytest.mark.slow
async def test_a_tenants_view_keeper_catches_up_on_her_key_given_by_a_relative_path(
    secured: Secured, tmp_path: Path
) -> None:
    """alice lists her machines with `--creds` relative to her working directory: the
    listing starts her view's keeper (which runs in /), and the keeper catches her view up
    on her key, within her grants, for the next listing."""
    from bourse.view.cache import view_path
    from bourse.view.keeper import ENV_KEEPER_S, STOP, KeeperError, NoKeeper, ask
    from tests.integration.test_view_keeper import _answers
    from tests.market import wait_until

    programs = await start_market(secured, tmp_path)
    seed = Path(secured.creds("buyer:alice"))
    path = view_path([secured.url], PREFIX, "alice")
    try:
        place = ("place", "--region", "mad", "--cpus", "1", "--memory-mb", "256", "--json")
        code, out, err = await run_buyer(secured, "buyer:alice", *place, "--image", "web")
        assert code == 0, err
        mid = json.loads(out)["result"]["machine_id"]
        with pytest.MonkeyPatch.context() as env:
            env.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
            env.setenv(ENV_KEEPER_S, "60")
            env.setenv("BOURSE_VIEW_FRESH_MS", "0")
            path = view_path([secured.url], PREFIX, "alice")

            async def listing() -> str:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "buyer_cli", "machines", "list", "--json",
                    "--creds", seed.name, "--nats", secured.url, "--prefix", PREFIX,
                    cwd=seed.parent, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE,
                )  # fmt: skip
                out, err = await asyncio.wait_for(proc.communicate(), 60)
                assert proc.returncode == 0, err
                return out.decode()

            assert mid in await listing()
            await wait_until(lambda: _answers(path))  # it caught up on her key
            assert mid in await listing()
    finally:
        with contextlib.suppress(NoKeeper, KeeperError):
            ask(path, STOP, timeout_s=5.0)
        codes = [await p.stop() for p in reversed(programs)]
    assert codes == [0, 0, 0]
