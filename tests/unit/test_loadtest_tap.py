"""The tap's naming of messages (loadtest/tap.py): every subject kind of the protocol, and
replies named by the request they answer and the type they carry."""

from __future__ import annotations

import pytest

from bourse.wire.codec import encode
from bourse.wire.messages import Answers, Placed
from bourse.wire.subjects import Subjects
from loadtest.tap import Tally, kind_of_reply, kind_of_subject

S = Subjects("lt1")

SUBJECTS = [
    (S.order("mad"), "order"),
    (S.bid("mad"), "bid"),
    (S.bid_batch("mad"), "bid batch"),
    (S.bid_shard("mad", 3), "bid (shard)"),
    (S.region_release("mad"), "region release"),
    (S.commit("w1"), "commit"),
    (S.release("w1"), "release"),
    (S.worker_machine("w1", "destroy"), "machine destroy"),
    (f"{S.root}.event.mad.w1.placed", "event placed"),
    (S.status("mad"), "status"),
    ("$KV.LT1_ORDERS.o-1", "claim write"),
    ("$JS.API.STREAM.INFO.X", "jetstream api"),
    ("$JS.EVENT.ADVISORY.API", "jetstream advisory"),
    ("$JS.ACK.X.c.1.2.3.4.5", "jetstream consumer ack"),
    ("_INBOX.abc.def", "reply"),
    ("other.v1.order.mad", "reply"),  # another market's root: not this run's
]


@pytest.mark.parametrize(("subject", "kind"), SUBJECTS, ids=[s for s, _ in SUBJECTS])
def test_a_subject_names_its_kind(subject: str, kind: str) -> None:
    assert kind_of_subject(subject, S) == kind


PLACED = Placed(
    order_id="o",
    machine_id="w1~01M80QESDH2NAZQ4Z9ASNWXSKR",
    worker_id="w1",
    region="mad",
    score=0.5,
    image_cached=False,
    elapsed_ms=1.0,
)
REPLIES = [
    ("commit", encode(PLACED), "commit -> Placed"),
    ("claim write", b'{"stream":"KV_X","seq":7}', "claim write -> ack"),
    ("bid", b"", "bid -> status"),  # no responders
    (None, encode(PLACED), "unknown request -> Placed"),
    ("order", b"\x00\x01 not json", "order -> other"),
    (None, encode(Answers(answers=[])), "bid batch -> Answers"),
]


@pytest.mark.parametrize(("request_kind", "data", "kind"), REPLIES, ids=[k for *_, k in REPLIES])
def test_a_reply_is_named_by_its_request_and_type(
    request_kind: str | None, data: bytes, kind: str
) -> None:
    assert kind_of_reply(request_kind, data) == kind


def test_the_tally_names_replies_by_the_requests_it_saw_and_forgets_the_oldest() -> None:
    t = Tally(S, remembered=2)
    assert t.see(S.commit("w1"), "_INBOX.a.1", b"{}") == "commit"
    assert t.see("$KV.B.o", "_INBOX.a.2", b"{}") == "claim write"
    assert t.see("_INBOX.a.1", "", encode(PLACED)) == "commit -> Placed"
    assert t.see("_INBOX.a.2", "", b'{"stream":"KV_B","seq":1}') == "claim write -> ack"
    t.see(S.order("mad"), "_INBOX.a.3", b"{}")  # a third request: _INBOX.a.1 is forgotten
    assert t.see("_INBOX.a.1", "", encode(PLACED)) == "unknown request -> Placed"
    assert t.counts["commit -> Placed"] == 1 and t.counts["unknown request -> Placed"] == 1
