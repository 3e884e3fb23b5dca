"""The planner (bourse/client/apps/plan.py) and the slots' order ids
(bourse/client/apps/slots.py): what converging an app takes, slot by slot."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from bourse.client.apps.plan import Plan, plan
from bourse.client.apps.slots import SlotRecord, machine_metadata, order_id
from bourse.client.apps.spec import AppSpec, from_dict
from bourse.wire.messages import Machine

SPEC = from_dict(
    {
        "app": "hello",
        "image": "hello:latest",
        "regions": ["mad", "ams"],
        "count": 1,
        "spares": 1,
        "resources": {"cpus": 1, "memory_mb": 256},
        "ports": ["web"],
        "checks": [{"port": "web", "kind": "http", "path": "/healthz"}],
    }
)
DIGEST = "sha256:" + "a" * 64


def spec(**changes: Any) -> AppSpec:
    return msgspec.structs.replace(SPEC, **changes)


_seq = iter(range(1, 10_000))


def machine(
    region: str,
    slot: int,
    role: str = "primary",
    state: str = "started",
    *,
    of: AppSpec = SPEC,
    gen: int = 1,
    secrets: str = "",
    worker: str = "",
    meta: dict[str, str] | None = None,
) -> Machine:
    n = next(_seq)
    worker = worker or f"{region}-{slot}"
    return Machine(
        machine_id=f"{worker}~M{n}",
        order_id=order_id(of.app, gen, region, slot),
        worker_id=worker,
        region=region,
        state=state,  # type: ignore[arg-type]
        resources=of.resources,
        image=of.image,
        image_digest=DIGEST,
        checks=of.checks,
        created_at_ms=n,
        metadata=machine_metadata(of, role, slot, gen, secrets) if meta is None else meta,
    )


def deployed(of: AppSpec = SPEC, gen: int = 1) -> list[Machine]:
    return [
        machine(r, i, role, state, of=of, gen=gen)
        for r in of.regions
        for i, (role, state) in enumerate([("primary", "started"), ("spare", "reserved")])
    ]


def actions(p: Plan) -> list[tuple[str, int, str, str]]:
    return [(s.action, s.slot, s.role, s.region) for s in p.steps]


def test_order_ids_are_derived_from_app_generation_region_slot_and_attempt() -> None:
    assert order_id("hello", 3, "mad", 0) == "hello.g3.mad.0"
    assert order_id("hello", 3, "mad", 1, attempt=2) == "hello.g3.mad.1.r2"
    long = order_id("a" * 63, 12, "r" * 63, 5)
    assert len(long) <= 63 and long.endswith(".g12.5")
    assert long != order_id("a" * 63, 12, "r" * 62 + "s", 5)


def test_a_new_app_creates_each_slot_primaries_first() -> None:
    p = plan(SPEC, 1, [])
    assert actions(p) == [
        ("create", 0, "primary", "mad"),
        ("create", 1, "spare", "mad"),
        ("create", 0, "primary", "ams"),
        ("create", 1, "spare", "ams"),
    ]
    assert [s.order_id for s in p.steps] == [
        "hello.g1.mad.0", "hello.g1.mad.1", "hello.g1.ams.0", "hello.g1.ams.1"
    ]  # fmt: skip
    assert p.records["mad.1"] == SlotRecord(role="spare", generation=1)


def test_a_deployed_app_is_kept_and_a_scale_keeps_its_machines() -> None:
    machines = deployed()
    p = plan(SPEC, 1, machines, image_digest=DIGEST)
    assert {s.action for s in p.steps} == {"keep"} and not p.changes
    # regions and counts are not what a machine is made of: a new generation keeps them
    p2 = plan(spec(count=2, spares=1), 2, machines)
    assert [a for a in actions(p2) if a[0] != "keep"] == [
        ("create", 2, "primary", "mad"), ("create", 2, "primary", "ams")
    ]  # fmt: skip
    assert p2.steps[0].order_id == "hello.g2.mad.2"


@pytest.mark.parametrize(
    ("changes", "secrets", "fields"),
    [
        ({"image": "hello:v2"}, "", ["image"]),
        ({"resources": msgspec.structs.replace(SPEC.resources, memory_mb=512)}, "", ["resources"]),
        ({"env": {"A": "1"}}, "", ["env"]),
        ({"ports": ["web", "admin"]}, "", ["ports"]),
        ({"checks": []}, "", ["checks"]),
        ({"restart": "always"}, "", ["restart"]),
        ({"labels": {"tier": "b"}}, "", ["labels"]),
        ({"image": "hello:v2", "env": {"A": "1"}}, "", ["image", "env"]),
        ({}, "ab12", ["secrets"]),
    ],
)
def test_an_update_names_the_fields_that_differ(
    changes: dict[str, Any], secrets: str, fields: list[str]
) -> None:
    p = plan(spec(**changes), 2, deployed(), secrets_revision=secrets)
    assert [(s.action, s.fields) for s in p.steps] == [("update", fields)] * 4
    assert [s.order_id for s in p.steps][:2] == ["hello.g2.mad.0", "hello.g2.mad.1"]


def test_a_tag_that_moved_is_an_image_update() -> None:
    p = plan(SPEC, 1, deployed(), image_digest="sha256:" + "b" * 64)
    assert {(s.action, tuple(s.fields)) for s in p.steps} == {("update", ("image",))}
    # the same generation (the spec's text is unchanged): the new machine is placed under
    # the slot's next attempt, never the old machine's own order id (its claim would give
    # the old machine back, and the rollout then destroyed it: the app left with none)
    assert [s.order_id for s in p.steps][:2] == ["hello.g1.mad.0.r1", "hello.g1.mad.1.r1"]
    assert {r.attempt for r in p.records.values()} == {1}
    again = [msgspec.structs.replace(m, order_id=m.order_id + ".r1") for m in deployed()]
    p = plan(SPEC, 1, again, image_digest="sha256:" + "c" * 64)
    assert [s.order_id for s in p.steps][:2] == ["hello.g1.mad.0.r2", "hello.g1.mad.1.r2"]


def test_a_scale_down_destroys_spares_first_then_primaries() -> None:
    two = spec(count=2, spares=2, regions=["mad"])
    machines = [
        machine("mad", 0, of=two), machine("mad", 1, of=two),
        machine("mad", 2, "spare", "reserved", of=two),
        machine("mad", 3, "spare", "reserved", of=two),
    ]  # fmt: skip
    p = plan(spec(count=1, spares=0, regions=["mad"]), 2, machines)
    assert actions(p) == [
        ("destroy", 2, "spare", "mad"),
        ("destroy", 3, "spare", "mad"),
        ("destroy", 1, "primary", "mad"),
        ("keep", 0, "primary", "mad"),
    ]
    assert set(p.records) == {"mad.0"}


def test_a_region_left_out_is_destroyed() -> None:
    p = plan(spec(regions=["mad"]), 2, deployed())
    assert sorted(a for a in actions(p) if a[0] == "destroy") == [
        ("destroy", 0, "primary", "ams"), ("destroy", 1, "spare", "ams")
    ]  # fmt: skip


def test_a_promoted_spare_is_the_primary_and_the_old_slot_a_spare() -> None:
    """Failover started the spare (its metadata says spare: written once) and the primary
    is gone with its worker: the roles swap, and a new spare fills the primary's slot."""
    spare = machine("mad", 1, "spare", "started")
    records = {
        "mad.0": SlotRecord(role="primary", generation=1, machine_id="mad-0~gone"),
        "mad.1": SlotRecord(role="spare", generation=1),
    }
    p = plan(spec(regions=["mad"]), 1, [spare], records)
    assert actions(p) == [("create", 0, "spare", "mad"), ("keep", 1, "primary", "mad")]
    # the lost machine's slot is placed again under a new attempt: never the lost one back
    assert p.steps[0].order_id == "hello.g1.mad.0.r1"
    assert p.records["mad.1"].role == "primary" and p.records["mad.0"].role == "spare"


def test_a_stopped_old_primary_is_the_spare_once_a_spare_was_started() -> None:
    old = machine("mad", 0, "primary", "stopped")
    spare = machine("mad", 1, "spare", "started")
    p = plan(spec(regions=["mad"]), 1, [old, spare])
    assert actions(p) == [("keep", 1, "primary", "mad"), ("keep", 0, "spare", "mad")]


def test_a_cut_off_create_is_started_and_a_cut_off_update_goes_on() -> None:
    placed = machine("mad", 0, "primary", "reserved")
    p = plan(spec(regions=["mad"], spares=0), 1, [placed])
    assert actions(p) == [("start", 0, "primary", "mad")]
    v2 = spec(regions=["mad"], spares=0, image="hello:v2")
    old, new = machine("mad", 0), machine("mad", 0, of=v2, gen=2, worker="mad-9")
    p = plan(v2, 2, [old, new])
    [step] = p.steps
    assert (step.action, step.machine_id, step.order_id) == ("update", old.machine_id, new.order_id)
    # placed beside the old one (or a tenant's): the new machine's own order id
    beside = msgspec.structs.replace(new, order_id="acme:" + new.order_id + ".b")
    [step] = plan(v2, 2, [old, beside]).steps
    assert step.order_id == new.order_id + ".b"


def test_machines_without_fingerprints_take_free_indices_compared_on_what_they_show() -> None:
    """A failover's new spare (or a machine deployed before apps had specs) carries no
    generation nor fingerprints: it takes a free slot and what it shows is compared."""
    meta = {"app": "hello", "role": "spare", "slot": "0"}
    legacy = machine("mad", 0, "spare", "reserved", meta=meta)
    one = spec(regions=["mad"], count=0, spares=1)
    [step] = plan(one, 1, [legacy]).steps
    assert (step.action, step.slot, step.machine_id) == ("keep", 0, legacy.machine_id)
    [step] = plan(one, 1, [legacy], secrets_revision="ab12").steps
    assert (step.action, step.fields) == ("update", ["secrets"])
    other = msgspec.structs.replace(one, image="other", restart="always")
    [step] = plan(other, 2, [legacy]).steps
    assert (step.action, step.fields) == ("update", ["image", "restart"])


def test_a_fresh_spare_is_kept_before_a_stopped_machine() -> None:
    """After a forced failover: the old primary stopped, the spare started and a new spare
    placed; the primary's slot is the spare's now, and of two spares the stopped one goes."""
    old = machine("mad", 0, "primary", "stopped")
    started = machine("mad", 1, "spare", "started")
    refill = machine(
        "mad", 1, "spare", "reserved", meta={"app": "hello", "role": "spare", "slot": "1"}
    )
    p = plan(spec(regions=["mad"]), 1, [old, started, refill])
    assert [(s.action, s.machine_id) for s in p.steps] == [
        ("destroy", old.machine_id), ("keep", started.machine_id), ("keep", refill.machine_id)
    ]  # fmt: skip


def test_a_duplicate_of_a_slot_is_destroyed() -> None:
    a, b = machine("mad", 0), machine("mad", 0, worker="mad-7")
    p = plan(spec(regions=["mad"], spares=0), 1, [a, b])
    assert [(s.action, s.machine_id) for s in p.steps] == [
        ("destroy", a.machine_id), ("keep", b.machine_id)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("restart", "state", "record", "want"),
    [
        # a machine that will not start is replaced, under a new attempt of its slot
        ("", "failed", None, ("update", "hello.g1.mad.0.r1", "failed")),
        ("no", "failed", None, ("update", "hello.g1.mad.0.r1", "failed")),
        ("", "failed", SlotRecord(role="primary", generation=1, attempt=1), (
            "update", "hello.g1.mad.0.r2", "failed")),
        # its worker starts it again itself: started like a stopped one
        ("on-failure", "failed", None, ("start", "", "")),
        ("always", "failed", None, ("start", "", "")),
        ("", "stopped", None, ("start", "", "")),
    ],
)  # fmt: skip
def test_a_failed_primary_is_replaced_unless_its_restart_policy_restarts_it(
    restart: str, state: str, record: SlotRecord | None, want: tuple[str, str, str]
) -> None:
    of = spec(regions=["mad"], spares=0, restart=restart)
    failed = machine("mad", 0, "primary", state, of=of)
    if record is not None:
        record = msgspec.structs.replace(record, machine_id=failed.machine_id)
    p = plan(of, 1, [failed], {"mad.0": record} if record else {})
    [step] = p.steps
    assert (step.action, step.order_id, step.detail) == want
    assert step.machine_id == failed.machine_id
    if step.action == "update":
        assert p.records["mad.0"].attempt == int(want[1][-1])
