"""A tenant's view holds only its own machines (docs/security.md): under the generated
permissions, on a live market whose suppliers publish their rows with their own keys, a
view made with a tenant's key reads the fleet's rows and its own machines' rows only (its
consumers' filters are in the subjects that make them, which its grant names); the shared
buyer key's view reads every row; and the tenant's `buyer machines list` shows its own
machines, with its own order ids."""

from __future__ import annotations

import json
from pathlib import Path

import anyio

from bourse.client import BourseClient
from bourse.nats.auth import tenant_of
from bourse.view import open_view
from buyer_cli.cli import app as buyer_app
from tests.cli import run_cli
from tests.market import order
from tests.security.conftest import PREFIX, Secured
from tests.security.test_attacks import mad_market
from tests.views import published


async def test_a_tenants_view_holds_only_its_own_machines(secured: Secured, tmp_path: Path) -> None:
    s = secured.subjects
    async with mad_market(secured, tmp_path) as m:
        placed = {}
        for name in ("alice", "bob"):
            nc, _ = await secured.connect(f"buyer:{name}")
            c = BourseClient(nc, s, tenant=tenant_of(secured.creds(f"buyer:{name}")))
            got = await c.place(order(region="mad", order_id=f"{name}-1", deadline_ms=3000))
            placed[name] = got.machine_id
        shared = await m.buyer.place(order(region="mad", order_id="ops-1", deadline_ms=3000))
        operator, _ = await secured.connect("operator")  # may read any row of the stream
        for mid in (*placed.values(), shared.machine_id):
            await published(operator, s, mid, "reserved")

        alice, violations = await secured.connect("buyer:alice")
        async with open_view(alice, s, tenant="alice") as view:
            got = view.db.db.execute("SELECT machine_id, tenant, order_id FROM machines")
            assert got.fetchall() == [(placed["alice"], "alice", "alice:alice-1")]
            workers = view.db.db.execute("SELECT worker_id FROM workers ORDER BY 1").fetchall()
            assert workers == [("mad-1",), ("mad-2",)]  # the fleet's rows: every tenant's
        assert violations.none_yet()  # nothing it asked for was refused

        async with open_view(m.buyer.nc, s) as every:
            got = every.db.db.execute("SELECT order_id FROM machines ORDER BY 1").fetchall()
            assert got == [("alice:alice-1",), ("bob:bob-1",), ("ops-1",)]

        args = ["machines", "list", "--json", "--nats", secured.url, "--prefix", PREFIX]
        args += ["--creds", secured.creds("buyer:alice")]
        code, out, err = await anyio.to_thread.run_sync(lambda: run_cli(buyer_app, *args))
        assert code == 0, err
        listed = json.loads(out)["machines"]
        assert [(x["machine_id"], x["order_id"]) for x in listed] == [
            (placed["alice"], "alice-1")  # its own order id, as the exchange answers it
        ]
