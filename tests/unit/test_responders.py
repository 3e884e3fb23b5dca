"""Who answers a region's bids (bourse/auction/responders.py, docs/protocol.md §4.4.3,
§4.4.4, §5.3a): who is expected, who takes batches, and who is forgotten after
RESPONDER_MEMORY_S. Pure: the time is given."""

from __future__ import annotations

from bourse.auction.core import Tally
from bourse.auction.responders import RESPONDER_MEMORY_S, Responders

M = RESPONDER_MEMORY_S


def answered(*names: str, batching: tuple[str, ...] = (), anonymous: int = 0) -> Tally:
    return Tally(responders=set(names), batching=set(batching), anonymous=anonymous)


def sampled(shards: dict[int, set[str]]) -> Tally:
    names = set().union(*shards.values())
    return Tally(responders=names, shard_responders=shards)


def test_a_process_not_heard_for_the_memory_is_forgotten() -> None:
    r = Responders()
    assert r.expected("mad", 0.0) == frozenset()  # nothing known yet
    r.learn("mad", answered("p1", "p2"), now=0.0)
    assert r.expected("mad", 0.0) == {"p1", "p2"}
    r.learn("mad", answered("p1"), now=M - 0.1)
    assert r.expected("mad", M - 0.1) == {"p1", "p2"}  # p2 still remembered
    assert r.expected("mad", M + 0.1) == {"p1"}  # p2 gone quiet (restarted under a new name)
    assert r.expected("mad", 2 * M) == frozenset()  # p1 too, by then
    assert r.expected("fra", M + 0.1) == frozenset()  # per region


def test_an_answer_without_a_name_turns_the_quorum_and_batches_off_for_the_memory() -> None:
    r = Responders()
    r.learn("mad", answered("p1", batching=("p1",)), now=0.0)
    assert r.take_batches("mad", 0.0)
    r.learn("mad", answered(anonymous=1), now=1.0)
    assert r.expected("mad", 1.0) == frozenset() and not r.take_batches("mad", 1.0)
    assert r.expected_per_shard("mad", 1.0) is None
    r.learn("mad", answered("p1", batching=("p1",)), now=1.0 + M)
    assert r.expected("mad", 1.0 + M) == {"p1"} and r.take_batches("mad", 1.0 + M)


def test_batches_only_where_every_recent_process_takes_them() -> None:
    r = Responders()
    assert not r.take_batches("mad", 0.0)  # nobody known
    r.learn("mad", answered("p1", "p2", batching=("p1",)), now=0.0)
    assert not r.take_batches("mad", 0.0)  # p2 would never see a batch
    r.learn("mad", answered("p1", batching=("p1",)), now=M)
    assert r.take_batches("mad", M)  # p2 has gone quiet


def test_each_shard_expects_its_recent_processes_and_is_absent_without() -> None:
    r = Responders()
    assert r.expected_per_shard("mad", 0.0) is None  # no shard known
    r.learn("mad", sampled({0: {"p2"}, 1: {"p3"}}), now=100.0 - M - 1)  # too old by now
    r.learn("mad", sampled({0: {"p1"}}), now=100.0)
    r.learn("mad", sampled({2: {"p4", "p5"}}), now=99.5)
    expected = r.expected_per_shard("mad", now=100.0)
    assert expected is not None
    assert expected.get(0) == {"p1"} and expected.get(2) == {"p4", "p5"}
    assert expected.get(1) is None and expected.get(7) is None
    assert dict(expected) == {0: {"p1"}, 2: {"p4", "p5"}} and len(expected) == 2
