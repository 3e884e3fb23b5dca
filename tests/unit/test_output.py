"""A machine's output: over-long lines cut (supplier/machines/shim/logfiles.py), replies cut
by their byte budget with a marker, never a line left out whole (supplier/machines/host/
output.py), and the log files on real disk as shims write them: rotated at their cap, held
to the worker's budget, read across the rotation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from supplier.machines.host.output import CUT_AFTER, CUT_BEFORE, Logs, lines_after, tail_lines
from supplier.machines.shim.logfiles import LINE_CUT, MIB, LineCutter, LogWriter

CUT = LINE_CUT


@pytest.mark.parametrize(
    ("pieces", "stored"),
    [
        ([b"abc\n"], [b"abc\n"]),
        ([b"abcde\n"], [b"abcde\n"]),  # exactly the longest line kept
        ([b"abcdefgh\nxy\n"], [b"abcde" + CUT + b"xy\n"]),  # the rest of it left out
        ([b"abc", b"defg\nxy\n"], [b"abc", b"de" + CUT + b"xy\n"]),  # across pieces
        ([b"abcdefg", b"hij", b"k\nz\n"], [b"abcde" + CUT, b"", b"z\n"]),  # cut, then skipped
        ([b"ab\nabcdefghij\ncd\n"], [b"ab\n" + b"abcde" + CUT + b"cd\n"]),
        ([b"a\n" * 10_000], [b"a\n" * 10_000]),  # short lines: untouched
        ([b"abc", b"de", b"\n"], [b"abc", b"de", b"\n"]),  # 5 in pieces, then its newline
    ],
)
def test_a_line_longer_than_the_cap_is_cut_with_a_marker(
    pieces: list[bytes], stored: list[bytes]
) -> None:
    cutter = LineCutter(5)
    assert [cutter.feed(p) for p in pieces] == stored


@pytest.mark.parametrize(
    ("data", "start", "cut_first", "tail", "expected"),
    [
        (b"one\ntwo\nthr", 0, False, 10, (["one", "two", "thr"], False, 8)),
        (b"one\ntwo\n", 100, False, 10, (["one", "two"], True, 108)),  # older left out
        (b"ne\ntwo\n", 100, True, 10, ([CUT_BEFORE + "ne", "two"], True, 107)),
        (b"xxxxxxxx", 100, True, 10, ([CUT_BEFORE + "xxxxxxxx"], True, 100)),  # never whole
        (b"a\nb\nc\n", 0, False, 2, (["b", "c"], True, 6)),
    ],
)
def test_the_last_lines_keep_a_line_cut_by_the_window_marked(
    data: bytes,
    start: int,
    cut_first: bool,
    tail: int,
    expected: tuple[list[str], bool, int],
) -> None:
    assert tail_lines(data, start, cut_first, tail) == expected


@pytest.mark.parametrize(
    ("data", "since", "max_bytes", "expected"),
    [
        (b"one\ntwo\nthr", 0, 1024, (["one", "two"], False, 8)),  # a line still written
        (b"thr", 8, 1024, ([], False, 8)),
        (b"x" * 16, 14, 16, (["x" * 16 + CUT_AFTER], True, 30)),  # the rest follows
        (b"", 55, 16, ([], False, 55)),
    ],
)
def test_lines_after_an_offset_hand_an_over_long_line_over_cut(
    data: bytes, since: int, max_bytes: int, expected: tuple[list[str], bool, int]
) -> None:
    assert lines_after(data, since, max_bytes) == expected


def _numbered(first: int, n: int) -> bytes:
    """``n`` lines of 16 bytes each: ``line 00000042..\\n``."""
    return b"".join(f"line {i:08d}..\n".encode() for i in range(first, first + n))


class _Worker:
    """A worker's logs as its shims write them (one writer a machine) and its supplier reads
    them."""

    def __init__(self, log_dir: Path, machine_mb: int, worker_mb: int) -> None:
        self.log_dir = log_dir
        self.caps = (machine_mb * MIB, worker_mb * MIB)
        self.reader = Logs(log_dir)
        self.writers: dict[str, LogWriter] = {}
        self.read = self.reader.read
        self.path = self.reader.path

    def write(self, machine_id: str, data: bytes) -> None:
        w = self.writers.get(machine_id)
        if w is None:
            w = self.writers[machine_id] = LogWriter(str(self.log_dir), machine_id, *self.caps)
        w.write(data)

    def remove(self, machine_id: str) -> None:
        w = self.writers.pop(machine_id, None)
        if w is not None:
            w.close()
        self.reader.remove(machine_id)

    @property
    def total(self) -> int:
        """What the worker's logs take on disk."""
        return sum(p.stat().st_size for p in self.log_dir.iterdir() if p.suffix in (".log", ".1"))

    @property
    def left_out(self) -> int:
        return sum(w.left_out for w in self.writers.values())

    def close(self) -> None:
        for w in self.writers.values():
            w.close()


OPEN: list[_Worker] = []


def _logs(tmp_path: Path, machine_mb: int = 1, worker_mb: int = 1024) -> _Worker:
    logs = _Worker(tmp_path, machine_mb, worker_mb)
    OPEN.append(logs)
    return logs


@pytest.fixture(autouse=True)
def _closed() -> Iterator[None]:
    """Every Logs a test made is closed after it (its files open for appending)."""
    yield
    while OPEN:
        OPEN.pop().close()


LINES_PER_MIB = MIB // 16


def test_a_log_rotates_at_its_cap_and_reads_across_the_rotation(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    n = LINES_PER_MIB * 5 // 2  # 2.5 MiB: rotated twice, the first MiB deleted
    for first in range(0, n, 1000):
        logs.write("m", _numbered(first, min(1000, n - first)))
    path = logs.path("m")
    assert path.stat().st_size == MIB // 2
    assert path.with_name("m.log.1").stat().st_size == MIB
    assert not path.with_name("m.log.2").exists()
    assert logs.total == MIB * 3 // 2
    lines, truncated, end = logs.read("m", 3, 48 * 1024)
    assert lines == [f"line {i:08d}.." for i in range(n - 3, n)] and truncated
    assert end == n * 16  # offsets count the whole output, across rotations
    # from the start: what was rotated away is said left out; then every line kept, in order
    got, since, gone = [], 0, False
    while since < end:
        page, cut, since = logs.read("m", 100, 48 * 1024, since=since)
        gone, got = gone or cut, got + page
    assert gone and since == end
    assert got == [f"line {i:08d}.." for i in range(LINES_PER_MIB, n)]


def test_over_the_workers_budget_a_machine_loses_its_old_file_then_its_output(
    tmp_path: Path,
) -> None:
    logs = _logs(tmp_path, machine_mb=1, worker_mb=2)
    logs.write("a", b"a" * 1023 + b"\n")  # so a's lines stay whole across its files
    for _ in range(1024 + 512 - 1):
        logs.write("a", b"a" * 1023 + b"\n")
    assert logs.total == MIB * 3 // 2
    first = 0
    while not logs.left_out:  # b has no old file to give: what fits of its output is kept
        logs.write("b", _numbered(first, 1000))
        first += 1000
    assert 2 * MIB - 16_000 < logs.total <= 2 * MIB
    assert logs.left_out == 16_000  # the last 1000 lines
    # a's writer (another shim) counts the directory again, as it does every RECOUNT_BYTES
    # it writes: over the budget, it gives up its old file
    logs.writers["a"].count()
    logs.write("a", b"a" * 15_999 + b"\n")
    assert not logs.path("a").with_name("a.log.1").exists()
    logs.write("b", b"more\n")  # room again: b says what it left out, then goes on
    lines, _, _ = logs.read("b", 3, 48 * 1024)
    assert lines == [
        f"line {first - 1001:08d}..",
        "[... 16000 bytes of output left out: the worker's machine logs are at their 2 MiB]",
        "more",
    ]
    assert logs.total <= 2 * MIB


def test_a_machine_destroyed_takes_its_logs_with_it(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    logs.write("m", _numbered(0, LINES_PER_MIB + 10))
    logs.write("k", b"kept\n")
    logs.remove("m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.log"]
    assert logs.total == 5
    assert logs.read("m", 10, 1024) == ([], False, 0)


def test_counting_at_start_sees_the_last_runs_logs(tmp_path: Path) -> None:
    _logs(tmp_path).write("m", _numbered(0, LINES_PER_MIB + 10))
    writer = LogWriter(str(tmp_path), "n", MIB, 1024 * MIB)
    assert writer.total == (LINES_PER_MIB + 10) * 16


def test_a_line_longer_than_a_reply_comes_cut_both_ways(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    logs.write("m", b"x" * 100_000 + b"\n")
    [line], truncated, end = logs.read("m", 10, 48 * 1024)
    assert line == CUT_BEFORE + "x" * (48 * 1024 - 1) and truncated and end == 100_001
    first, cut, at = logs.read("m", 10, 48 * 1024, since=0)
    assert first == ["x" * 48 * 1024 + CUT_AFTER] and cut and at == 48 * 1024
    second, _, at = logs.read("m", 10, 48 * 1024, since=at)
    third, cut, at = logs.read("m", 10, 48 * 1024, since=at)
    assert len(second[0]) - len(CUT_AFTER) + len(third[0]) == 100_000 - 48 * 1024
    assert not cut and at == end


def test_a_line_longer_than_a_log_file_is_stored_cut(tmp_path: Path) -> None:
    logs = _logs(tmp_path)
    for _ in range(3):
        logs.write("m", b"y" * MIB)
    logs.write("m", b"y\nafter\n")
    lines, _, end = logs.read("m", 2, 48 * 1024)
    assert lines[0].endswith(LINE_CUT.decode().rstrip("\n")) and lines[1] == "after"
    assert end == MIB + len(LINE_CUT) + len(b"after\n")
