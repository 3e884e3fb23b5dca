"""Tables as plain aligned columns (stdout not a terminal): nothing cut, markup gone."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.table import Table

from bourse.client import render
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


def _shown(width: int, monkeypatch: pytest.MonkeyPatch) -> str:
    out = io.StringIO()
    term = Console(file=out, force_terminal=True, width=width, soft_wrap=True, color_system=None)
    monkeypatch.setattr(render, "console", term)
    t = Table(title="machines")
    for col in ("machine", "state", "why"):
        t.add_column(col)
    t.add_row(LONG_ID, "started", "a rather long reason that may wrap on a terminal")
    render.show(t)
    return out.getvalue()


def test_a_terminal_gets_a_box_only_if_every_id_fits_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wide = _shown(80, monkeypatch)
    assert "┃ machine" in wide and f"│ {LONG_ID} │ started │" in wide  # the why column wraps
    narrow = _shown(40, monkeypatch)
    assert "│" not in narrow
    assert narrow.splitlines()[1].startswith(f"{LONG_ID}  started  a rather long reason")
