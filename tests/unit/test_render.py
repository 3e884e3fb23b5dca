"""Tables as plain aligned columns (stdout not a terminal): nothing cut, markup gone."""

from __future__ import annotations

from rich.table import Table

from bourse.client.render import plain

LONG_ID = "mad-1~01M83KAXYZXYZXYZXYZXYZXYZ0"


def test_plain_columns_keep_every_id_whole_and_drop_markup() -> None:
    t = Table(title="ignored")
    for col in ("machine", "state", "why"):
        t.add_column(col)
    t.add_row(LONG_ID, "[yellow]unfilled[/]", "one\ntwo")
    t.add_row("a~1", "started", "")
    pad = " " * (len(LONG_ID) - len("machine"))
    assert plain(t) == [
        f"machine{pad}  state     why",
        f"{LONG_ID}  unfilled  one",
        " " * len(LONG_ID) + "            two",
        "a~1" + " " * (len(LONG_ID) - 3) + "  started",
    ]
