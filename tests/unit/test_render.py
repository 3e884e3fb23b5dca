"""Tables as plain aligned columns (stdout not a terminal): nothing cut, markup gone; text
from the wire shown with its control characters escaped, and exact in JSON."""

from __future__ import annotations

import io

import msgspec
import pytest
import typer
from rich.console import Console
from rich.table import Table

from bourse.client import render
from bourse.client.fleet import fleet, fleet_rows
from bourse.client.render import plain
from bourse.runtime.cli import fail
from bourse.wire.messages import Machine, Resources

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
    [_head, row] = plain(fleet([s]))
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


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain text, é, 名前, 🚀", "plain text, é, 名前, 🚀"),
        ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),  # clear the screen, cursor home
        ("a\nb\r\tc", "a\\nb\\r\\tc"),
        ("\x00\x07\x08\x7f", "\\x00\\x07\\x08\\x7f"),  # NUL, bell, backspace, DEL
        ("\x9b2J\x85", "\\x9b2J\\x85"),  # C1: CSI, next line
        ("\u202egnp.exe\u2028x\u2066", "\\u202egnp.exe\\u2028x\\u2066"),  # bidi, separators
    ],
)
def test_visible_writes_every_control_character_as_an_escape(text: str, shown: str) -> None:
    assert render.visible(text) == shown


def _listed(app: str) -> Machine:
    return Machine(
        machine_id="mad-1~01ABC",
        order_id="o1",
        worker_id="mad-1",
        region="mad",
        state="started",
        resources=Resources(cpus=1, memory_mb=256),
        image="web",
        score=0.5,
        created_at_ms=1,
        updated_at_ms=1,
        metadata={"app": app},
    )


FORGED = "\x1b[2J\x1b[Hshop\nmad-9~01FORGED  mad-9  mad  started"


def test_text_from_the_wire_cannot_forge_a_row_or_reach_the_terminal() -> None:
    lines = plain(render.machine_listing([_listed(FORGED)], now=2))
    assert len(lines) == 2  # the header and the one machine: no forged row
    assert "\x1b" not in "".join(lines) and "\\x1b[2J\\x1b[Hshop\\nmad-9~01FORGED" in lines[1]
    assert [line.split()[0] for line in lines[1:]] == ["mad-1~01ABC"]  # awk '{print $1}'
    # JSON keeps the text exactly
    assert msgspec.json.decode(render.as_json(_listed(FORGED)))["metadata"]["app"] == FORGED


def test_markup_in_wire_text_is_shown_as_written() -> None:
    [_head, row] = plain(render.machine_listing([_listed("[/][bold]x[/bold]")], now=2))
    assert row.endswith("[/][bold]x[/bold]")


def test_an_error_line_shows_control_characters_and_json_keeps_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(typer.Exit):
        fail("worker says: \x1b[31mred\nerror: forged")
    assert capsys.readouterr().err == "error: worker says: \\x1b[31mred\\nerror: forged\n"


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
    [head, row] = plain(fleet([s]))
    assert head.split()[7:9] == ["cache", "images"]  # after "mem MiB", two words
    assert row.split()[6:8] == ["1.5G/20G", "web,sha256:0123456789ab"]


def test_subscores_show_whole_numbers_whole() -> None:
    shown = render.subscores(
        {"cpus": 0.875, "image": 1.0, "pull_bytes": 104857600.0, "pull_s": 2.0}
    )
    assert shown == "cpus=0.875 image=1 pull_bytes=104857600 pull_s=2"


def test_fleet_shows_each_workers_driver_and_runtime() -> None:
    from bourse.wire.messages import Amount, WorkerStatus

    def status(driver: str, runtime: str) -> WorkerStatus:
        return WorkerStatus(
            worker_id="w1",
            region="mad",
            labels={},
            capacity=Amount(cpus=2, memory_mb=1024),
            committed=Amount(cpus=0, memory_mb=0),
            held=Amount(cpus=0, memory_mb=0),
            images=[],
            machines=0,
            draining=False,
            driver=driver,
            runtime=runtime,
        )

    rows = plain(fleet([status("oci", "runc 1.1.5"), status("", "")]))
    assert "driver" in rows[0].split()
    assert "oci (runc 1.1.5)" in rows[1]
    assert rows[2].split()[-3] == "-"  # a worker that does not say: driver, confined, js


def test_fleet_from_the_view_shows_how_each_worker_isolates_its_machines() -> None:
    from bourse.wire.messages import Amount, WorkerRow

    def row(wid: str, isolation: str) -> WorkerRow:
        return WorkerRow(
            worker_id=wid, region="mad", beat="w1", capacity=Amount(cpus=2, memory_mb=1024),
            free=Amount(cpus=2, memory_mb=1024), isolation=isolation,  # type: ignore[arg-type]
        )  # fmt: skip

    rows = plain(fleet_rows([row("w1", "users,network"), row("w2", "")], {}))
    header = rows[0].split()
    assert header[-2:] == ["isolated", "version"]
    assert rows[1].split()[-2] == "users,network"
    assert rows[2].split()[-2] == "-"  # a worker that does not say
