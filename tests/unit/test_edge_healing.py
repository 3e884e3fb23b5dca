"""The controller's decision (edge/healing.py ``decide``), pure over the view's rows: a
running machine whose worker is gone or whose check is critical is replaced by the slot's
spare while fewer machines serve than the app wants; every controller decides the same
spare and the same new spare's order id; nothing when the spare already serves."""

from __future__ import annotations

from edge.healing import Member, Replace, decide, replaced, suffix_of, unreachable


def m(mid: str, role: str = "primary", state: str = "started", **kw: object) -> Member:
    base: dict[str, object] = {
        "order_id": f"o-{mid}", "tenant": "", "app": "web", "region": "mad",
        "worker_id": f"w-{mid}", "state": state, "role": role,
    }  # fmt: skip
    return Member(mid, **(base | kw))  # type: ignore[arg-type]


def pairs(got: list[Replace]) -> list[tuple[str, str]]:
    return [(r.failed.machine_id, r.spare.machine_id) for r in got]


def test_a_primary_whose_worker_is_gone_is_replaced_by_the_first_spare() -> None:
    rows = [
        m("p0", gone=True),
        m("p1"),
        m("s1", "spare", "stopped", slot=1),
        m("s0", "spare", "reserved", slot=0),
        m("s2", "spare", "reserved", slot=0, gone=True),  # its worker gone too: not it
    ]
    got = decide(rows, {})
    assert pairs(got) == [("p0", "s0")]
    assert got[0].suffix == suffix_of(rows[0]) and got[0].suffix.startswith("heal-")
    assert got[0].used == {"w-p0", "w-p1", "w-s0", "w-s1", "w-s2"}
    # the same rows, another controller: the same decision
    assert decide(list(reversed(rows)), {}) == got


def test_a_critical_check_is_a_failure_too() -> None:
    rows = [m("p0", health="critical"), m("s0", "spare", "stopped")]
    assert pairs(decide(rows, {})) == [("p0", "s0")]


def test_nothing_while_enough_machines_serve() -> None:
    # the spare already starting in place of the gone primary: done (another controller)
    rows = [m("p0", gone=True), m("s0", "spare", "starting"), m("s1", "spare", "stopped")]
    assert decide(rows, {}) == []
    # the spec wants two serving: one more failover
    assert pairs(decide(rows, {("", "web", "mad"): 2})) == [("p0", "s1")]


def test_a_stopped_machine_is_not_a_failure_and_no_spare_no_failover() -> None:
    assert decide([m("p0", state="stopped", gone=True), m("s0", "spare", "stopped")], {}) == []
    assert decide([m("p0", gone=True)], {}) == []  # no spare left: said by no decision


def test_the_new_spares_order_id_differs_per_failure() -> None:
    a, b = m("p0", gone=True), m("p0", gone=True, generation=2)
    assert suffix_of(a) != suffix_of(b) != suffix_of(m("p1", gone=True))
    # the same machine failing again in its generation, its row changed since (started
    # again): another new spare, not the first failure's (destroyed by then, maybe)
    first, again = m("p0", gone=True, changed_ms=1000), m("p0", gone=True, changed_ms=9000)
    assert suffix_of(first) != suffix_of(again)
    assert suffix_of(first) == suffix_of(m("p0", health="critical", changed_ms=1000))


def test_a_machine_this_edge_cannot_reach_on_a_late_worker_is_a_failure() -> None:
    """The edge's own evidence: unreachable (its router's) and its worker's heartbeat late,
    both: failed before the view says the worker gone; either alone is not."""
    rows = [m("p0"), m("s0", "spare", "stopped")]
    assert pairs(decide(unreachable(rows, {"p0"}, {"w-p0"}), {})) == [("p0", "s0")]
    assert decide(unreachable(rows, {"p0"}, set()), {}) == []  # its worker beats: not it
    assert decide(unreachable(rows, set(), {"w-p0"}), {}) == []  # reachable: a late beat


def test_a_tenants_app_is_healed_with_its_own_spare_only() -> None:
    """Two tenants' apps of one name (and one of no tenant) are three apps: each failed
    primary is replaced by its own app's spare, never another tenant's."""
    rows = [
        m("a0", tenant="acme", order_id="acme:web.g1.mad.0", gone=True),
        m("b0", tenant="bolt", order_id="bolt:web.g1.mad.0", gone=True),
        m("bs", "spare", "stopped", tenant="bolt"),
        m("s0", "spare", "stopped"),
        m("as", "spare", "reserved", tenant="acme"),
    ]
    got = decide(rows, {})
    assert pairs(got) == [("a0", "as"), ("b0", "bs")]
    assert [r.failed.tenant for r in got] == ["acme", "bolt"]
    assert got[0].used == {"w-a0", "w-as"}


def test_a_failed_machine_already_replaced_is_not_failed_over_again() -> None:
    """After a failover (its new spare placed under the failed machine's heal order id)
    the app stopped its machines when idle: the dead primary, still started in the view
    while its worker is away, is due no second failover (the edge's requests start the
    spares); another failure is."""
    dead = m("p0", gone=True, changed_ms=5)
    healed = [
        dead,
        m("s0", "spare", "stopped"),
        m("n0", "spare", "reserved", order_id=f"web.spare-0.mad.{suffix_of(dead)}"),
    ]
    assert replaced(healed) == {"p0"}
    assert decide(healed, {("", "web", "mad"): 1}) == []
    unhealed = healed[:2]
    assert replaced(unhealed) == set()
    assert pairs(decide(unhealed, {("", "web", "mad"): 1})) == [("p0", "s0")]
