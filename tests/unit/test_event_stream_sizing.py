"""The event stream's sizing rule (docs/operations.md): bytes per stored event x events per
order x orders per second x window; the defaults are the rule at one order a second for a
week, rounded up to a GiB."""

from __future__ import annotations

import pytest

from bourse.nats import jetstream as js
from bourse.wire.subjects import Subjects

DAY_S = 86400.0


@pytest.mark.parametrize(
    ("orders_per_s", "window_s", "stored"),
    [
        (1, 7 * DAY_S, 1_016_064_000),  # the default: 1 GiB holds it
        (10, 7 * DAY_S, 10_160_640_000),
        (100, DAY_S, 14_515_200_000),
        (3000, 3600, 18_144_000_000),
        (3000, 7 * DAY_S, 3_048_192_000_000),
    ],
)
def test_the_rule_gives_the_documented_figures(
    orders_per_s: float, window_s: float, stored: int
) -> None:
    assert js.event_stream_bytes(orders_per_s, window_s) == stored


def test_the_defaults_are_the_rule_at_one_order_a_second_for_a_week() -> None:
    need = js.event_stream_bytes(js.DEFAULT_ORDERS_PER_S, js.DEFAULT_MAX_AGE_S)
    assert js.DEFAULT_MAX_AGE_S == 7 * DAY_S
    assert need <= js.DEFAULT_MAX_BYTES < need + js.GIB
    stream = js.EventStream.of(Subjects("bourse")).config()
    assert (stream.max_bytes, stream.max_age) == (js.DEFAULT_MAX_BYTES, js.DEFAULT_MAX_AGE_S)
