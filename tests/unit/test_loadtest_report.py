"""The load-test report's pure parts: the latency axis's ticks and the per-placement
figures."""

from __future__ import annotations

import pytest

from loadtest.report import cpu_vs_nats_server, ms_label, ms_ticks, per_placement
from loadtest.runner import Measured, ProcessStats


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
