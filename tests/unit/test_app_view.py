"""Apps for people and scripts (bourse/client/apps/view.py): the plan's and an apply's rows."""

from __future__ import annotations

from bourse.client import render
from bourse.client.apps.apply import Applied
from bourse.client.apps.plan import Plan, Step
from bourse.client.apps.rollout import Outcome
from bourse.client.apps.view import (
    applied_json,
    plan_json,
    plan_table,
    status_rows,
    status_table,
)
from bourse.client.render import plain
from bourse.wire.messages import Check, Health, Machine, Resources

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


def test_a_slot_shows_its_health_only_while_it_runs() -> None:
    """A spare (placed, not started) and a stopped machine show ``-``, not ``pending`` or
    the last run's status; a started one what its checks say, ``pending`` before the first."""
    check = Check(port="http", kind="http", path="/healthz")
    passing = Health(status="passing", since_ms=1)

    def machine(mid: str, state: str, health: Health | None, checks: bool = True) -> Machine:
        return Machine(machine_id=f"w1~{mid}", order_id=mid, worker_id="w1", region="mad",
                       state=state, resources=Resources(cpus=1, memory_mb=64), image="web",
                       created_at_ms=1, checks=[check] if checks else [], health=health)  # type: ignore[arg-type]  # fmt: skip

    machines = [
        machine("A", "reserved", None),
        machine("B", "started", None),
        machine("C", "started", passing),
        machine("D", "stopped", passing),  # as a worker of an older version kept it
        machine("E", "started", None, checks=False),
    ]
    rows = status_rows(machines, {})
    assert {r["machine_id"]: r["check"] for r in rows} == {
        "w1~A": "-", "w1~B": "pending", "w1~C": "passing", "w1~D": "-", "w1~E": "-",
    }  # fmt: skip
    assert [render.health(m, now=1001) for m in machines] == [
        "-", "checking", "passing 1s", "-", "-",
    ]  # fmt: skip


def test_a_gone_workers_machine_shows_no_health_in_the_tables() -> None:
    """From a view, a machine whose worker is gone (its supplier stopped, or the operator
    stopped the worker) is unknown, and so is its health: ``-``, not its last row's
    ``passing``; the JSON keeps the row's own with ``worker_gone_since_ms`` beside them."""
    m = Machine(machine_id="w1~A", order_id="A", worker_id="w1", region="mad", state="started",
                resources=Resources(cpus=1, memory_mb=64), image="web", created_at_ms=1,
                checks=[Check(port="http", kind="http", path="/healthz")],
                health=Health(status="passing", since_ms=1))  # fmt: skip
    [row] = status_rows([m], {}, {"w1": 1000})
    assert (row["state"], row["check"], row["worker_gone_since_ms"]) == ("started", "passing", 1000)
    [_head, line] = plain(status_table("a", [row]))
    assert line.split()[5:10] == ["unknown", "(worker", "gone", "since", render.clock(1000) + ")"]
    assert line.split()[11] == "-"  # the check: after the address
    [_head, line] = plain(render.machine_listing([m], now=1001, gone={"w1": 1000}))
    assert line.split()[-3] == "-" and "passing" not in line
    [_head, line] = plain(render.machine_listing([m], now=1001))
    assert "passing 1s" in line
