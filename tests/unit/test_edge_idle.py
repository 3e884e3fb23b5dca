"""Stopped when idle (edge/idle.py): the decision, pure (which started machines are idle
for their app's idle time, the longest idle first, never below min_machines_running in a
region; apps without auto_stop untouched), and who decides (the smallest live edge id)."""

from __future__ import annotations

from bourse.client.apps.spec import AppService
from bourse.wire.messages import EdgeActivity
from edge.idle import Running, decider, edge_id, idle_stops, shares

NOW = 1_800_000_100_000
SINCE = 1_800_000_000_000  # the deciding edge started 100 s ago


def r(mid: str, key: str = "web", region: str = "mad", updated: int = 0) -> Running:
    return Running(mid, key, region, updated)


def test_idle_machines_down_to_the_minimum_longest_idle_first() -> None:
    services = {"web": AppService(auto_stop=True, idle_s=30, min_machines_running=1)}
    machines = [r("m1"), r("m2"), r("m3"), r("f1", region="fra")]
    last = {"m1": NOW - 40_000, "m2": NOW - 90_000, "m3": NOW - 5_000}
    # m3 busy 5 s ago; m2 idle longest, then m1 (mad keeps m3); fra's only one kept
    assert idle_stops(machines, services, last, NOW, SINCE) == ["m2", "m1"]
    # with all three idle, one is kept: the most recently busy
    last_all = last | {"m3": NOW - 35_000}
    assert idle_stops(machines, services, last_all, NOW, SINCE) == ["m2", "m1"]
    two = {"web": AppService(auto_stop=True, idle_s=30)}  # no minimum
    assert idle_stops(machines, two, last, NOW, SINCE) == ["f1", "m2", "m1"]


def test_what_keeps_a_machine_from_idling() -> None:
    services = {"web": AppService(auto_stop=True, idle_s=30)}
    # its row changed 10 s ago (just started), the decider started 10 s ago
    assert idle_stops([r("m1", updated=NOW - 10_000)], services, {}, NOW, SINCE) == []
    assert idle_stops([r("m1")], services, {}, NOW, NOW - 10_000) == []
    assert idle_stops([r("m1")], services, {}, NOW, SINCE) == ["m1"]
    # no auto_stop, or no section: never
    off = {"web": AppService(idle_s=30)}
    assert idle_stops([r("m1")], off, {}, NOW, SINCE) == []
    assert idle_stops([r("m1", key="api")], services, {}, NOW, SINCE) == []


def test_the_smallest_live_edge_decides() -> None:
    heard = {"e1": 100.0, "e2": 100.0}
    assert decider(heard, "e1", 100.5, 1.0) and not decider(heard, "e2", 100.5, 1.0)
    # e1 silent for more than 3 intervals: gone, e2 decides
    assert decider(heard | {"e2": 104.0}, "e2", 104.5, 1.0)
    assert decider({}, "e9", 0.0, 1.0)  # alone
    a, b = edge_id(), edge_id()
    assert a != b and a.startswith("e") and len(a) <= 63


def test_a_report_is_cut_into_each_tenants_share() -> None:
    """Each tenant hears the edge's report of its own machines only (§4.23); machines of no
    tenant, or that the edge no longer routes, are in no share."""
    report = EdgeActivity(
        edge="e1", at_ms=5000, machines={"a1": 4000, "a2": 5000, "b1": 3000, "x": 2000, "y": 1}
    )
    owners = {"a1": "acme", "a2": "acme", "b1": "bee", "x": ""}
    got = shares(report, owners)
    assert {t: dict(a.machines) for t, a in got.items()} == {
        "acme": {"a1": 4000, "a2": 5000},
        "bee": {"b1": 3000},
    }
    assert all((a.edge, a.at_ms, a.interval_ms) == ("e1", 5000, 1000) for a in got.values())
    assert shares(EdgeActivity(edge="e1", at_ms=1, machines={"x": 1}), owners) == {}
