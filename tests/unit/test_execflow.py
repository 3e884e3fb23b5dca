"""The exec stream's window and offsets (bourse/nats/execflow.py, docs/protocol.md §4.24)."""

from __future__ import annotations

import pytest

from bourse.nats.execflow import Inflow, StreamError, Window


def test_a_window_gives_room_back_as_it_is_acknowledged() -> None:
    w = Window(10)
    assert (w.sending(6), w.sending(4), w.room) == (0, 6, 0)
    with pytest.raises(StreamError, match="do not fit the window"):
        w.sending(1)
    assert w.ack(3) is True and w.room == 3
    assert w.ack(2) is False and w.room == 3  # an older acknowledgement changes nothing
    with pytest.raises(StreamError, match="11 bytes acknowledged, 10 sent"):
        w.ack(11)


def test_an_inflow_sees_a_lost_chunk_and_an_overflow() -> None:
    f = Inflow(8)
    f.take(0, 5)
    with pytest.raises(StreamError, match="a chunk at byte 7, 5 received: some lost"):
        f.take(7, 1)
    with pytest.raises(StreamError, match="over the window of 8"):
        f.take(5, 4)  # 9 unwritten
    f.wrote(5)
    f.take(5, 4)
    assert (f.received, f.written) == (9, 5)
