"""The auctioneer's memory of the supplier processes that answer (docs/protocol.md §4.4.3,
§5.3a): who is expected, and who is forgotten after RESPONDER_MEMORY_S."""

from __future__ import annotations

from bourse.auction.core import Tally
from bourse.auction.driver import RESPONDER_MEMORY_S, _RecentPerShard, _remember, _Seen

M = RESPONDER_MEMORY_S


def test_a_process_not_heard_for_the_memory_is_forgotten_when_others_answer() -> None:
    seen: dict[str, _Seen] = {}
    tally = Tally(batching={"p1"})
    _remember(seen, {"p1", "p2"}, tally, now=0.0)
    assert seen == {"p1": _Seen(0.0, True), "p2": _Seen(0.0, False)}
    _remember(seen, {"p1"}, tally, now=M - 0.1)  # p2 still remembered
    assert set(seen) == {"p1", "p2"}
    _remember(seen, {"p1"}, tally, now=M + 0.1)  # p2 gone quiet (restarted under a new name)
    assert set(seen) == {"p1"}


def test_each_shard_expects_its_recent_processes_and_is_absent_without() -> None:
    shards = {
        0: {"p1": _Seen(100.0, False), "p2": _Seen(100.0 - M - 1, False)},  # p2 too old
        1: {"p3": _Seen(100.0 - M - 1, False)},  # nobody recent
        2: {"p4": _Seen(99.0, False), "p5": _Seen(99.5, False)},
    }
    expected = _RecentPerShard(shards, now=100.0)
    assert expected.get(0) == {"p1"} and expected.get(2) == {"p4", "p5"}
    assert expected.get(1) is None and expected.get(7) is None
    assert dict(expected) == {0: {"p1"}, 2: {"p4", "p5"}}
