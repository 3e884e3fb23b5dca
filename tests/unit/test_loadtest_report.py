"""The load-test report's pure parts: the latency axis's ticks and the per-placement
figures."""

from __future__ import annotations

import pytest

from loadtest.report import (
    cpu_vs_nats_server,
    messages_by_program,
    ms_label,
    ms_ticks,
    per_placement,
)
from loadtest.runner import Measured, ProcessStats, messages_between, program_of


@pytest.mark.parametrize(
    ("lo", "hi", "ticks"),
    [
        # the usual spread of a loaded run: 1-2-5 per decade
        (0.8, 130, [1, 2, 5, 10, 20, 50, 100]),
        (0.3, 9, [0.5, 1, 2, 5]),
        # an idle run's narrow spread: the finer 1-2-3-5-7 series, still plain numbers
        (2.5, 10, [3, 5, 7, 10]),
        # narrower still: the finest series
        (40, 69, [40, 50, 60]),
        (7, 18, [7, 8, 9, 10, 12, 15]),
        # many decades: one tick per power of ten, so the labels do not crowd
        (0.05, 3000, [0.1, 1, 10, 100, 1000]),
    ],
)
def test_latency_ticks_are_plain_milliseconds(lo: float, hi: float, ticks: list[float]) -> None:
    assert ms_ticks(lo, hi) == ticks


def test_tick_labels_are_plain_numbers_never_powers() -> None:
    assert [ms_label(v) for v in (0.2, 1, 20, 500, 1000, 20000)] == [
        "0.2",
        "1",
        "20",
        "500",
        "1,000",
        "20,000",
    ]


def test_per_placement_sums_every_process_and_divides_the_messages() -> None:
    m = Measured(placed=1000, nats_in_msgs=7000, nats_out_msgs=6500)
    m.processes = [
        ProcessStats("supplier", 1, cpu_s=0.5),
        ProcessStats("supplier", 2, cpu_s=0.3),
        ProcessStats("exchange", 3, cpu_s=0.4),
        ProcessStats("loadgen", 4, cpu_s=0.2),
    ]
    cpu, msgs = per_placement(m)
    assert cpu == {"all": 1.4, "supplier": 0.8, "exchange": 0.4, "loadgen": 0.2}
    assert msgs == {"published": 7.0, "delivered": 6.5}


def test_per_placement_without_placements_or_counters() -> None:
    assert per_placement(Measured()) == (None, None)
    cpu, msgs = per_placement(Measured(placed=10))
    assert cpu == {"all": 0.0} and msgs is None


@pytest.mark.parametrize(
    ("cpu_ms", "expected"),
    [
        (
            {"all": 1.5, "supplier": 0.8, "exchange": 0.4, "nats-server": 0.2, "loadgen": 0.1},
            {"all": 7.5, "supplier": 4.0, "exchange": 2.0, "loadgen": 0.5},
        ),
        ({"all": 1.3, "supplier": 0.8}, None),  # an outside server (--nats): not watched
        ({"all": 0.0, "nats-server": 0.0}, None),  # nothing measured: no unit
        (None, None),
    ],
)
def test_cpu_is_also_given_in_the_same_runs_nats_server_units(
    cpu_ms: dict[str, float] | None, expected: dict[str, float] | None
) -> None:
    assert cpu_vs_nats_server(cpu_ms) == expected


@pytest.mark.parametrize(
    ("name", "program"),
    [
        ("bourse-supplier:r0-w0000", "supplier"),
        ("bourse-exchange", "exchange"),
        ("bourse-exchange-eu-1", "exchange"),
        ("bourse-loadgen", "loadgen"),
        ("bourse-ceiling", "other"),
        ("", "other"),
    ],
)
def test_a_connection_is_counted_for_the_program_its_name_says(name: str, program: str) -> None:
    assert program_of(name) == program


def test_messages_by_program_are_each_connections_counters_over_the_window() -> None:
    def conn(cid: int, name: str, pub: int, got: int) -> dict[str, object]:
        return {"cid": cid, "name": name, "in_msgs": pub, "out_msgs": got}

    before = [
        conn(1, "bourse-supplier:w0", 100, 200),
        conn(2, "bourse-supplier:w9", 10, 20),
        conn(3, "bourse-exchange", 50, 60),
        conn(9, "bourse-loadgen", 5, 5),  # closed during the window: not counted
    ]
    after = [
        conn(1, "bourse-supplier:w0", 400, 900),
        conn(2, "bourse-supplier:w9", 110, 120),
        conn(3, "bourse-exchange", 650, 760),
        conn(4, "bourse-loadgen", 300, 300),  # opened during the window: from zero
        conn(5, "tap", 0, 5000),
    ]
    by = messages_between(before, after)
    assert by == {
        "exchange": (600, 700),
        "loadgen": (300, 300),
        "other": (0, 5000),
        "supplier": (400, 800),
    }
    m = Measured(placed=100, nats_msgs_by_program=by)
    assert messages_by_program(m) == {
        "exchange": {"published": 6.0, "delivered": 7.0},
        "loadgen": {"published": 3.0, "delivered": 3.0},
        "other": {"published": 0.0, "delivered": 50.0},
        "supplier": {"published": 4.0, "delivered": 8.0},
    }
    assert messages_by_program(Measured(placed=100)) is None
    assert messages_by_program(Measured(nats_msgs_by_program=by)) is None  # nothing placed
