"""Apps for people (tables) and scripts (JSON): a plan, an apply's outcome, an app's
status. Strings from the market are shown through ``render.safe``."""

from __future__ import annotations

from collections.abc import Mapping

from rich.table import Table

from bourse.client.apps.apply import Applied
from bourse.client.apps.plan import KEEP, Plan, Step
from bourse.client.apps.rollout import Outcome
from bourse.client.render import CHECKED_STATES, safe
from bourse.client.render import gone as state_gone
from bourse.wire.messages import Machine


def _what(s: Step) -> str:
    if s.fields:
        return "fields: " + ", ".join(s.fields)
    return s.detail


def plan_table(p: Plan) -> Table:
    """``deploy --plan``: each slot's step."""
    n = len(p.changes)
    t = Table(title=f"app {safe(p.app)} generation {p.generation}: {n} change(s)")
    for col in ("region", "slot", "role", "action", "machine", "order", "what"):
        t.add_column(col)
    for s in p.steps:
        t.add_row(
            safe(s.region),
            str(s.slot),
            safe(s.role),
            s.action,
            safe(s.machine_id or "-"),
            safe(s.order_id or "-"),
            safe(_what(s)),
        )
    return t


def plan_json(p: Plan) -> dict[str, object]:
    """``deploy --plan --json``: the generation, the number of changes and the steps."""
    return {"app": p.app, "generation": p.generation, "changes": len(p.changes), "steps": p.steps}


def applied_table(a: Applied) -> Table:
    """``deploy``: what became of each step (a kept slot: ``kept``)."""
    t = Table(title=f"app {safe(a.plan.app)} generation {a.plan.generation}")
    for col in ("region", "slot", "role", "action", "result", "machine", "worker", "detail"):
        t.add_column(col)
    keys = ("region", "slot", "role", "action", "result", "machine_id", "worker_id", "detail")
    for row in applied_rows(a):
        t.add_row(*(safe(row[k]) for k in keys))
    return t


def _row(s: Step, o: Outcome | None) -> dict[str, object]:
    kept = o is None and s.action == KEEP
    return {
        "region": s.region,
        "slot": s.slot,
        "role": s.role,
        "action": s.action,
        "fields": s.fields,
        "order_id": s.order_id,
        "result": "kept" if kept else (o.result if o else "skipped"),
        # the slot's machine now: the new one when one was made, else the one it had
        "machine_id": (o.machine_id if o and o.machine_id else s.machine_id) or "-",
        "worker_id": (o.worker_id if o and o.worker_id else s.worker_id) or "-",
        "replaced": s.machine_id if s.action == "update" and o and o.result == "done" else "",
        "detail": o.detail if o else s.detail,
    }


def applied_rows(a: Applied) -> list[dict[str, object]]:
    """One row per step, with its outcome."""
    outcome = {id(o.step): o for o in a.outcomes}  # the rollout's steps are the plan's
    return [_row(s, outcome.get(id(s))) for s in a.plan.steps]


def applied_json(a: Applied) -> dict[str, object]:
    """``deploy --json``: whether every step was done, whether the rollout stopped, and a
    row per slot."""
    return {
        "app": a.plan.app,
        "generation": a.plan.generation,
        "complete": a.complete,
        "stopped": a.stopped,
        "slots": applied_rows(a),
    }


def _check(m: Machine) -> str:
    """What a slot's checks say: ``-`` without checks or while it does not run (a spare)."""
    if not m.checks or m.state not in CHECKED_STATES:
        return "-"
    return (m.health.status if m.health is not None else "") or "pending"


def status_rows(
    machines: list[Machine],
    slots: dict[str, tuple[int, str]],
    gone: Mapping[str, int] | None = None,
) -> list[dict[str, object]]:
    """``apps status``: each machine of the app by region and slot; ``slots``: each
    machine's slot and role as the planner sees them (a spare a failover started is the
    primary; a machine placed without a slot has the one it was given); ``gone``: from a
    view, the workers gone and since when (their machines' ``worker_gone_since_ms``)."""
    gone = gone or {}
    rows = []
    for m in machines:
        slot, role = slots.get(m.machine_id, (-1, m.metadata.get("role", "-")))
        rows.append(
            {
                "region": m.region,
                "slot": slot,
                "role": role,
                "machine_id": m.machine_id,
                "worker_id": m.worker_id,
                "state": m.state,
                "address": ", ".join(f"{k}={v}" for k, v in sorted(m.addresses.items())) or "-",
                "check": _check(m),
                "image_digest": m.image_digest or "-",
                "restarts": m.restarts,
                "generation": m.metadata.get("gen", "-"),
                "worker_gone_since_ms": gone.get(m.worker_id),
            }
        )
    return sorted(rows, key=lambda r: (str(r["region"]), int(str(r["slot"]))))


STATUS_COLUMNS = ("region", "slot", "role", "machine_id", "worker_id", "state", "address",
                  "check", "image_digest", "restarts")  # fmt: skip


def status_table(app: str, rows: list[dict[str, object]]) -> Table:
    """``apps status``: a row per machine."""
    t = Table(title=f"app {safe(app)}")
    for col in STATUS_COLUMNS:
        t.add_column(col.removesuffix("_id"))
    for row in rows:
        since = row.get("worker_gone_since_ms")
        shown = row
        if isinstance(since, int):  # neither its state nor its check is known any more
            shown = {**row, "state": state_gone(since), "check": "-"}
        t.add_row(*(safe(shown[k]) for k in STATUS_COLUMNS))
    return t
