"""An unfilled order's detail from the region's verdicts (bourse.client.why_unfilled): each
reason told apart, the workers named, in the desk's order. Table-driven."""

from __future__ import annotations

import pytest

from bourse.client import DryRun, why_unfilled
from bourse.wire.messages import PlaceOrder, Reason, Resources, WorkerVerdict

ORDER = PlaceOrder(
    order_id="o1", region="sjc", resources=Resources(cpus=1, memory_mb=128), image="web"
)
HEAD = "no worker in 'sjc' took 1 cpus + 128 MiB of image 'web': "

CPUS = Reason(code="insufficient", detail="cpus: wants 1, free 0 (capacity 8, committed 8, held 0)")
LABEL = Reason(code="constraint_mismatch", detail="label disk: wants 'ssd', has 'hdd'")
IMAGE = Reason(code="image_not_runnable", detail="the driver cannot run image 'web'")
DRAINING = Reason(code="draining", detail="draining")
EXCLUDED = Reason(code="excluded", detail="excluded by the order")
HOLDS = Reason(code="blocked_by_holds", detail="cpus: ...: only holds are in the way (would wait)")
BIG = Reason(code="image_too_big", detail="image 'web' needs 2048 bytes in the image cache ...")


def decline(worker: str, *reasons: Reason) -> WorkerVerdict:
    return WorkerVerdict(worker_id=worker, verdict="decline", reasons=list(reasons))


def dry(*verdicts: WorkerVerdict) -> DryRun:
    return DryRun(
        order_id="o1",
        region="sjc",
        winner=None,
        verdicts=list(verdicts),
        complete=True,
        elapsed_ms=1.0,
    )


@pytest.mark.parametrize(
    ("verdicts", "detail"),
    [
        (
            [decline("sjc-1", IMAGE), decline("sjc-2", IMAGE)],
            "no worker serves image 'web'",
        ),
        (
            [decline("sjc-1", CPUS)],
            "not enough free capacity on sjc-1 "
            "(cpus: wants 1, free 0 (capacity 8, committed 8, held 0))",
        ),
        (
            [decline("sjc-1", CPUS), decline("sjc-2", CPUS)],
            "not enough free capacity on sjc-1, sjc-2 "
            "(sjc-1: cpus: wants 1, free 0 (capacity 8, committed 8, held 0))",
        ),
        (
            [decline("sjc-1", LABEL)],
            "labels do not match on sjc-1 (label disk: wants 'ssd', has 'hdd')",
        ),
        ([decline("sjc-1", DRAINING)], "draining: sjc-1"),
        ([decline("sjc-1", EXCLUDED)], "excluded by the order: sjc-1"),
        (
            # an image bigger than one worker's cache, after one the other cannot run
            [decline("sjc-1", BIG), decline("sjc-2", IMAGE), decline("sjc-3", CPUS)],
            "image 'web' is not served by sjc-2; image 'web' is bigger than the image cache of "
            "sjc-1; not enough free capacity on sjc-3 "
            "(cpus: wants 1, free 0 (capacity 8, committed 8, held 0))",
        ),
        (
            # the desk's order (§6.2) whatever the verdicts' order; one image is not "no worker"
            [decline("sjc-2", IMAGE), decline("sjc-1", EXCLUDED), decline("sjc-3", DRAINING)],
            "draining: sjc-3; excluded by the order: sjc-1; image 'web' is not served by sjc-2",
        ),
        (
            [WorkerVerdict(worker_id="sjc-1", verdict="wait", reasons=[HOLDS])],
            "capacity held by other orders on sjc-1",
        ),
        (
            [
                WorkerVerdict(worker_id="sjc-1", verdict="offer", score=0.5),
                WorkerVerdict(worker_id="sjc-2", verdict="no_answer"),
            ],
            "sjc-1 would offer now (capacity freed since); no explanation from sjc-2",
        ),
        (
            [decline(f"sjc-{i}", DRAINING) for i in range(1, 6)],
            "draining: sjc-1, sjc-2, sjc-3 and 2 more",
        ),
        (
            # a worker with two reasons is named under both
            [decline("sjc-1", LABEL, IMAGE), decline("sjc-2", IMAGE)],
            "labels do not match on sjc-1 (label disk: wants 'ssd', has 'hdd'); "
            "no worker serves image 'web'",
        ),
    ],
)
def test_each_reason_is_told_apart_with_the_workers_named(
    verdicts: list[WorkerVerdict], detail: str
) -> None:
    assert why_unfilled(ORDER, dry(*verdicts)) == HEAD + detail


def test_nobody_explained_leaves_the_auctions_detail() -> None:
    assert why_unfilled(ORDER, dry()) is None
