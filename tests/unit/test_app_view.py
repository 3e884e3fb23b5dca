"""Apps for people and scripts (bourse/client/apps/view.py): the plan's and an apply's rows."""

from __future__ import annotations

from bourse.client.apps.apply import Applied
from bourse.client.apps.plan import Plan, Step
from bourse.client.apps.rollout import Outcome
from bourse.client.apps.view import applied_json, plan_json, plan_table
from bourse.client.render import plain

UPDATE = Step(region="mad", slot=0, role="primary", action="update", machine_id="w1~OLD",
              worker_id="w1", order_id="a.g2.mad.0", fields=["image", "resources"])  # fmt: skip
KEEP = Step(region="mad", slot=1, role="spare", action="keep", machine_id="w2~S", worker_id="w2")
CREATE = Step(region="ams", slot=0, role="primary", action="create", order_id="a.g2.ams.0")
PLAN = Plan(app="a", generation=2, steps=[UPDATE, CREATE, KEEP], records={})


def test_the_plan_says_each_slot_and_what_differs() -> None:
    doc = plan_json(PLAN)
    assert (doc["generation"], doc["changes"]) == (2, 2)
    lines = plain(plan_table(PLAN))
    assert lines[0].split() == ["region", "slot", "role", "action", "machine", "order", "what"]
    assert lines[1].split() == ["mad", "0", "primary", "update", "w1~OLD", "a.g2.mad.0",
                                "fields:", "image,", "resources"]  # fmt: skip


def test_an_apply_says_what_became_of_each_step() -> None:
    done = Outcome(step=UPDATE, result="done", machine_id="w3~NEW", worker_id="w3")
    stopped = Outcome(step=CREATE, result="unfilled", detail="unfilled in ams: no_workers")
    doc = applied_json(Applied(PLAN, [done, stopped], stopped=False))
    assert doc["complete"] is False and doc["stopped"] is False
    update, create, keep = doc["slots"]  # type: ignore[misc]
    assert (update["result"], update["machine_id"], update["replaced"]) == (
        "done",
        "w3~NEW",
        "w1~OLD",
    )
    assert (create["result"], create["machine_id"], create["detail"]) == (
        "unfilled", "-", "unfilled in ams: no_workers"
    )  # fmt: skip
    assert (keep["result"], keep["machine_id"]) == ("kept", "w2~S")
