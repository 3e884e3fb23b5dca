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


def test_fleet_and_machines_show_fractional_cpus_as_people_write_them() -> None:
    from bourse.wire.messages import Amount, Machine, Resources, WorkerStatus

    s = WorkerStatus(
        worker_id="w1",
        region="mad",
        labels={},
        capacity=Amount(cpus=2, memory_mb=1024, cpu_millis=1500),
        committed=Amount(cpus=1, memory_mb=256, cpu_millis=500),
        held=Amount(cpus=1, memory_mb=256, cpu_millis=250),
        images=[],
        machines=1,
        draining=False,
    )
    [_head, row] = plain(render.fleet([s]))
    assert row.split()[2:5] == ["0.5/1.5", "256/1024", "0.25"]
    assert row.split()[6] == "-"  # a worker that does not say its image cache
    m = Machine(
        machine_id="w1~01",
        order_id="o1",
        worker_id="w1",
        region="mad",
        state="started",
        resources=Resources(cpus=1, memory_mb=256, cpu_millis=250),
        image="web",
        score=0.5,
        created_at_ms=1,
        updated_at_ms=1,
    )
    [_head, row] = plain(render.machines([m]))
    assert row.split()[3] == "0.25"


def test_fleet_shows_each_workers_image_cache_and_the_images_it_holds() -> None:
    from bourse.wire.messages import Amount, WorkerStatus

    digest = "sha256:" + "0123456789ab" + "f" * 52
    s = WorkerStatus(
        worker_id="w1",
        region="mad",
        labels={},
        capacity=Amount(cpus=2, memory_mb=1024),
        committed=Amount(cpus=0, memory_mb=0),
        held=Amount(cpus=0, memory_mb=0),
        images=["web"],
        machines=0,
        draining=False,
        cache_bytes=1536 * 1024 * 1024,
        cache_budget_bytes=20 * 1024**3,
        image_digests=[digest],
    )
    [head, row] = plain(render.fleet([s]))
    assert head.split()[7:9] == ["cache", "images"]  # after "mem MiB", two words
    assert row.split()[6:8] == ["1.5G/20G", "web,sha256:0123456789ab"]


def test_subscores_show_whole_numbers_whole() -> None:
    shown = render.subscores(
        {"cpus": 0.875, "image": 1.0, "pull_bytes": 104857600.0, "pull_s": 2.0}
    )
    assert shown == "cpus=0.875 image=1 pull_bytes=104857600 pull_s=2"
