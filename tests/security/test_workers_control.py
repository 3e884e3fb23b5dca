"""The operator's verbs on a worker (docs/protocol.md §4.22) under the generated
permissions: only the operator's key may publish on ``R.control.*`` (the shared buyer key, a
tenant, the exchange and a supplier are refused by the server); the worker's supplier hears
it and answers the operator."""

from __future__ import annotations

from pathlib import Path

from bourse.client import BourseClient
from bourse.wire.codec import encode
from bourse.wire.messages import WorkerControl
from tests.market import Market
from tests.security.conftest import Secured
from tests.security.test_commands import mad_1


async def test_only_the_operator_drains_stops_and_starts_a_worker(
    secured_js: Secured, tmp_path: Path
) -> None:
    s = secured_js.subjects
    async with Market(secured_js.url, s, tmp_path) as m:
        host = await mad_1(m, secured_js, tmp_path)
        body = encode(WorkerControl(worker_id="mad-1", action="stop"))
        for user in ("buyer", "buyer:alice", "exchange", "supplier:mad-1"):
            raw, v = await secured_js.connect(user)
            await raw.publish(s.control("mad-1"), body)
            assert f'publish to "{s.control("mad-1")}"' in await v.next(), user
        assert host.workers["mad-1"].serving  # nobody but the operator reached it
        op, v = await secured_js.connect("operator")
        operator = BourseClient(op, s)
        drained = await operator.control("mad-1", "drain")
        assert (drained.serving, drained.draining, drained.drain_reason) == (
            True, True, "operator",
        )  # fmt: skip
        assert not (await operator.control("mad-1", "stop")).serving
        assert not host.workers["mad-1"].serving
        started = await operator.control("mad-1", "start")
        assert (started.serving, started.draining) == (True, False)
        assert v.none_yet()
