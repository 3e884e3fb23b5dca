"""A buyer's text reaches an operator's terminal or pipe escaped (docs/security.md): an
order whose metadata holds escape sequences and a newline is placed on a real market, and
the operator's `buyer machines list` shows one row for it, no escape character, and the
same text exactly under --json."""

from __future__ import annotations

import json

from bourse.wire.messages import Placed
from tests.cli import buyer
from tests.market import Market, order, worker
from tests.views import published

# Clears the screen and homes the cursor, then starts a row of its own naming a machine
# of someone else's that a script reading the first column would act on.
FORGED = "\x1b[2J\x1b[Hshop\nmad-9~01FORGED  mad-9  mad  started"


async def test_metadata_cannot_clear_a_terminal_or_forge_a_row(market: Market) -> None:
    await market.host(worker("mad-1"))
    await market.exchange()
    client = await market.client()
    placed = await client.place(order(metadata={"app": FORGED}))
    assert isinstance(placed, Placed)
    await published(await market.connect(), market.subjects, placed.machine_id, "reserved")

    code, out, err = await buyer(market, "machines", "list")  # from the view
    assert code == 0, err
    assert "\x1b" not in out and "\x1b" not in err
    rows = out.splitlines()[1:]
    assert [row.split()[0] for row in rows] == [placed.machine_id]  # awk '{print $1}'
    assert rows[0].endswith("\\x1b[2J\\x1b[Hshop\\nmad-9~01FORGED  mad-9  mad  started")

    code, out, err = await buyer(market, "machines", "list", "--json")
    assert code == 0, err
    [machine] = json.loads(out)["machines"]
    assert machine["metadata"]["app"] == FORGED
