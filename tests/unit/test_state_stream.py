"""The state stream's settings and sizing rule (bourse/nats/state.py, docs/operations.md):
one row per subject, per-message TTL, direct gets, a refused new row rather than a dropped
live one; the rule counts a row per live machine and worker and the destroyed machines'
rows of the retention window."""

from __future__ import annotations

import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from bourse.nats import state
from bourse.wire.subjects import Subjects


@pytest.mark.parametrize(
    ("machines", "workers", "destroyed_per_s", "stored"),
    [
        (0, 0, 0.0, 0),
        (100_000, 10_000, 10.0, 147_264_000),  # the default: 1024 x 136,000 + 800 x 10,000
        (1_000, 1_000, 0.0, 1_824_000),
        (10_000, 1_000, 1000.0, 3_697_440_000),  # churn dominates: 3.6 M rows of the hour
    ],
)
def test_the_rule_gives_the_documented_figures(
    machines: int, workers: int, destroyed_per_s: float, stored: int
) -> None:
    assert state.state_stream_bytes(machines, workers, destroyed_per_s) == stored


def test_the_stream_keeps_one_row_per_subject_and_refuses_rather_than_drops() -> None:
    c = state.StateStream.of(Subjects("eu.m"), replicas=3).config()
    assert c.name == "EU_M_STATE" and c.subjects == ["eu.m.v1.state.>"]
    assert c.max_msgs_per_subject == 1 and c.discard == DiscardPolicy.NEW
    assert c.allow_msg_ttl and c.allow_direct and not c.max_age
    assert c.max_bytes == state.DEFAULT_MAX_BYTES and c.num_replicas == 3
    assert state.unfit(c) == ""


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"max_msgs_per_subject": 5}, "more than one message per subject"),
        ({"allow_msg_ttl": False}, "per-message TTL"),
        ({"allow_direct": None}, "direct gets"),
    ],
)
def test_a_stream_made_otherwise_is_said_unfit(change: dict[str, object], why: str) -> None:
    c = state.StateStream.of(Subjects("bourse")).config().as_dict() | change
    assert why in state.unfit(StreamConfig.from_response(dict(c)))
