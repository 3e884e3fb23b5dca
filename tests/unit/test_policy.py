"""Client policy (bourse/client/policy.py): a deploy's order is tried once more when the
market was busy, never when it was unable, and always under the same order id."""

from __future__ import annotations

from typing import Any, cast

import pytest

from bourse.client import BourseClient, ClientError
from bourse.client.policy import place_patiently
from bourse.wire.messages import Placed, PlaceOrder, Resources, Unfilled

ORDER = PlaceOrder(
    order_id="shop.primary-0.mad",
    region="mad",
    resources=Resources(cpus=1, memory_mb=64),
    image="web",
)
PLACED = Placed(
    order_id=ORDER.order_id,
    machine_id="w~M1",
    worker_id="w",
    region="mad",
    score=0.5,
    image_cached=True,
    elapsed_ms=1.0,
)


def unfilled(reason: Any) -> Unfilled:
    return Unfilled(
        order_id=ORDER.order_id, region="mad", reason=reason, offers=0, commits_tried=0,
        elapsed_ms=500.0,
    )  # fmt: skip


class Script:
    """A client whose answers are scripted; it records what it was sent."""

    def __init__(self, *answers: Placed | Unfilled | ClientError) -> None:
        self.answers = list(answers)
        self.sent: list[PlaceOrder] = []

    async def place(self, order: PlaceOrder) -> Placed | Unfilled:
        self.sent.append(order)
        answer = self.answers.pop(0)
        if isinstance(answer, ClientError):
            raise answer
        return answer


@pytest.mark.parametrize(
    ("answers", "result", "sends"),
    [
        pytest.param([PLACED], PLACED, 1, id="placed: once"),
        pytest.param([unfilled("no_offers")], unfilled("no_offers"), 1, id="unable: once"),
        pytest.param([unfilled("no_workers")], unfilled("no_workers"), 1, id="nobody: once"),
        pytest.param([unfilled("deadline"), PLACED], PLACED, 2, id="busy (deadline): once more"),
        pytest.param(
            [ClientError("busy", "overloaded"), PLACED], PLACED, 2, id="overloaded: once more"
        ),
        pytest.param(
            [unfilled("deadline"), unfilled("deadline")],
            unfilled("deadline"),
            2,
            id="busy twice: the second answer stands",
        ),
    ],
)
async def test_a_busy_market_gets_one_more_try_under_the_same_id(
    answers: list[Placed | Unfilled | ClientError], result: Placed | Unfilled, sends: int
) -> None:
    client = Script(*answers)
    assert await place_patiently(cast(BourseClient, client), ORDER) == result
    assert len(client.sent) == sends
    assert {o.order_id for o in client.sent} == {ORDER.order_id}  # idempotent: one id
    assert [o.retry for o in client.sent] == [False, True][:sends]


async def test_other_errors_are_not_retried() -> None:
    client = Script(ClientError("bad region", "bad_request"))
    with pytest.raises(ClientError, match="bad region"):
        await place_patiently(cast(BourseClient, client), ORDER)
    assert len(client.sent) == 1
