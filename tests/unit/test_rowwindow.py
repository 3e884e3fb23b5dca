"""Which rows a supplier sends now (supplier/rowwindow.py): at once while the window has
room, one in flight a key (a key changed meanwhile goes as its latest once answered), a row
not stored marked again unless a newer one is, sends given up after their timeout."""

from __future__ import annotations

import pytest

from supplier.rowwindow import RowWindow


def test_a_marked_row_goes_at_once_without_waiting_for_the_answers_before_it() -> None:
    w: RowWindow[str, int] = RowWindow(limit=8)
    w.mark("a", 1)
    assert w.due(now=0.0) == [("a", 1, 1)]
    w.mark("b", 1)
    w.mark("c", 1)
    assert w.due(now=0.1) == [("b", 1, 2), ("c", 1, 3)]  # "a" not answered yet
    assert (w.backlog, list(w.flying)) == (3, ["a", "b", "c"])
    assert w.acked("b", 2) and not w.acked("b", 2)
    assert w.backlog == 2


def test_a_key_changed_while_its_row_is_in_flight_goes_once_answered_as_its_latest() -> None:
    w: RowWindow[str, int] = RowWindow(limit=8)
    w.mark("a", 1)
    assert w.due(0.0) == [("a", 1, 1)]
    w.mark("a", 2)
    w.mark("a", 3)  # coalesced: one message for both changes
    assert not w.waiting() and w.due(0.0) == []
    assert w.acked("a", 1)
    assert w.waiting() and w.due(0.0) == [("a", 3, 2)]


def test_the_window_bounds_the_rows_in_flight() -> None:
    w: RowWindow[str, int] = RowWindow(limit=2)
    for key in "abcd":
        w.mark(key, 0)
    assert [k for k, _, _ in w.due(0.0)] == ["a", "b"]
    assert not w.waiting() and w.due(0.0) == []
    w.acked("a", 1)
    assert [k for k, _, _ in w.due(0.0)] == ["c"]
    assert w.backlog == 3  # b, c in flight; d marked


def test_a_row_not_stored_is_marked_again_unless_a_newer_one_is() -> None:
    w: RowWindow[str, int] = RowWindow(limit=8)
    w.mark("a", 1)
    w.mark("b", 1)
    w.due(0.0)
    w.mark("b", 2)  # b changed while its row was in flight
    assert w.failed("a", 1) and w.failed("b", 2)
    assert w.marked == {"a": 1, "b": 2}  # a's row again; b's newer one, not the failed
    assert not w.failed("a", 1)  # given up already
    w.again("a", 0)  # every row again: a newer marked one stays
    w.again("c", 0)
    assert w.marked == {"a": 1, "b": 2, "c": 0}


def test_sends_not_answered_in_time_are_given_up_oldest_first() -> None:
    w: RowWindow[str, int] = RowWindow(limit=8)
    w.mark("a", 1)
    w.due(0.0)
    w.mark("b", 1)
    w.due(1.0)
    assert w.expired(now=4.9, timeout_s=5.0) == []
    assert w.expired(now=5.5, timeout_s=5.0) == [("a", 1)]
    assert w.failed("a", 1)
    assert not w.acked("a", 1)  # its answer, too late: the row is marked again
    assert [k for k, _, _ in w.due(6.0)] == ["a"]
    assert w.expired(now=20.0, timeout_s=5.0) == [("b", 2), ("a", 3)]
    w.acked("b", 2)
    w.acked("a", 3)
    assert w.backlog == 0


def test_a_window_holds_at_least_one_row() -> None:
    with pytest.raises(ValueError):
        RowWindow[str, int](limit=0)
