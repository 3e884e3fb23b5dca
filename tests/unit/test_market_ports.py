"""The demo market's metrics ports (ops/market.py ``MetricsPorts``) and what a program that
exited before it was ready is said as (bourse/runtime/launcher.py ``ProgramFailed``)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from bourse.runtime.endpoint import free_port
from bourse.runtime.launcher import ProgramFailed, last_reason
from ops.market import MetricsPorts

HOST = "127.0.0.1"


@pytest.fixture
def busy() -> Iterator[int]:
    """A port something listens on (as a first ``bourse up``'s exchange would)."""
    with socket.socket() as s:
        s.bind((HOST, free_port(HOST, 29600)))
        s.listen()
        yield s.getsockname()[1]


def test_a_taken_port_is_skipped(busy: int) -> None:
    ports = MetricsPorts((HOST, busy))
    picked = [ports.pick() for _ in range(3)]
    assert f"{HOST}:{busy}" not in picked
    assert len(set(picked)) == 3
    assert all(int(a.rsplit(":", 1)[1]) > busy for a in picked)


def test_a_program_that_could_not_listen_gets_another_port(busy: int, tmp_path: Path) -> None:
    ports = MetricsPorts((HOST, busy - 1))
    first = ports.pick()
    failed = ProgramFailed(
        "exchange", 1, f"--metrics-addr {first}: cannot listen: Address in use", tmp_path
    )
    again = ports.again(failed)
    assert again is not None and again not in (first, f"{HOST}:{busy}")
    # another reason to fail is not the port's: no retry
    assert ports.again(ProgramFailed("exchange", 1, "no NATS", tmp_path)) is None
    # port 0 (each program its own free one) and no metrics at all never retry
    assert MetricsPorts((HOST, 0)).again(failed) is None
    assert MetricsPorts(None).again(failed) is None
    assert [MetricsPorts(None).pick(), MetricsPorts((HOST, 0)).pick()] == ["off", f"{HOST}:0"]


def test_a_program_that_failed_is_one_line_with_its_own_error(tmp_path: Path) -> None:
    said = "--metrics-addr 127.0.0.1:9464: cannot listen: Address already in use"
    reason = last_reason(f"2026-11-28 started\nerror: {said}\nexiting\n\n")
    assert reason == said
    failed = ProgramFailed("exchange", 1, reason, tmp_path / "exchange.log")
    assert str(failed) == (
        f"exchange exited with code 1: {reason} (its log: {tmp_path / 'exchange.log'})"
    )
    assert "\n" not in str(failed)
    # without an error line: its last line; an empty log: the code alone
    assert last_reason("starting\nKilled\n") == "Killed"
    assert str(ProgramFailed("supplier", -9, last_reason(""), tmp_path)).startswith(
        "supplier exited with code -9 (its log: "
    )
