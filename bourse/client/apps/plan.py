"""The plan: what converging an app to its spec takes, slot by slot. Pure.

In: the spec, its generation and secrets' revision, the image's digest where known, the
app's live machines (state, health, metadata) and the slots' records. Out: a step per slot
(and per stray machine) in the order the rollout takes them: surplus spares destroyed
first, then surplus primaries and strays, then primaries started, slots created, and
updates (which fields differ) one slot at a time; and the slots' records after.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from bourse.client.apps.slots import (
    FIELDS,
    NO_SECRETS,
    SECRETS,
    SlotRecord,
    attempt_of,
    decode_fields,
    fingerprints,
    order_id,
    slot_key,
)
from bourse.client.apps.spec import AppSpec
from bourse.wire.messages import Machine
from bourse.wire.metadata import FIELDS as FIELDS_KEY
from bourse.wire.metadata import GEN, PRIMARY, ROLE, SLOT, SPARE

CREATE, UPDATE, DESTROY, KEEP, START = "create", "update", "destroy", "keep", "start"
# The order steps are taken in (a destroy first frees room for what follows).
_ORDER = {DESTROY: 0, START: 1, CREATE: 2, UPDATE: 3, KEEP: 4}
NOT_RUNNING = frozenset({"reserved", "stopped", "stopping", "failed"})
# The restart policies under which a worker starts a failed machine again itself; under
# the others a failed primary is replaced, as a machine that will not start is.
RESTARTING = frozenset({"on-failure", "always"})


class Step(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One slot's step: ``create`` (placed under ``order_id``), ``update`` (the machine
    replaced by one placed under ``order_id``: ``fields`` say what differs), ``destroy``,
    ``start`` (a primary's machine placed but not running) or ``keep``."""

    region: str
    slot: int
    role: str
    action: str
    machine_id: str = ""
    worker_id: str = ""
    state: str = ""
    order_id: str = ""
    fields: list[str] = []
    detail: str = ""


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    """The steps, in the order they are taken, and the slots' records once they are."""

    app: str
    generation: int
    steps: list[Step]
    records: dict[str, SlotRecord]

    @property
    def changes(self) -> list[Step]:
        """The steps that change something (all but ``keep``)."""
        return [s for s in self.steps if s.action != KEEP]


@dataclass
class _Slot:
    index: int
    role: str
    machines: list[Machine] = field(default_factory=list)
    record: SlotRecord | None = None

    @property
    def running(self) -> bool:
        return any(m.state == "started" for m in self.machines)


def differing(
    machine: Machine, want: dict[str, str], image_digest: str, spec: AppSpec
) -> list[str]:
    """The fields ``machine`` was made with that differ from ``want``; the image also when
    its digest is not the one the reference names now. A machine placed without
    fingerprints (a failover's new spare) is compared on what it shows."""
    have = decode_fields(machine.metadata.get(FIELDS_KEY, ""))
    if not have:
        return _visible_diff(machine, spec, want)
    diff = [f for f in (*FIELDS, SECRETS) if have.get(f) != want[f]]
    if "image" not in diff and image_digest and machine.image_digest not in ("", image_digest):
        diff.insert(0, "image")
    return diff


def _visible_diff(m: Machine, spec: AppSpec, want: dict[str, str]) -> list[str]:
    """What a machine shows of its order (its env and ports it does not: taken as they are;
    secrets it cannot have had without fingerprints)."""
    shown = {
        "image": m.image == spec.image,
        "resources": m.resources == spec.resources,
        "checks": m.checks == spec.checks,
        "restart": (m.restart or m.metadata.get("restart", "")) == spec.restart,
        "labels": m.constraints is None or m.constraints == spec.labels,
        "metadata": all(m.metadata.get(k) == v for k, v in spec.metadata.items()),
        SECRETS: want[SECRETS] == NO_SECRETS,
    }
    return [f for f, same in shown.items() if not same]


def _index(m: Machine) -> int | None:
    slot = m.metadata.get(SLOT, "")
    return int(slot) if GEN in m.metadata and slot.isdigit() else None


def _slots(
    region: str, machines: list[Machine], records: dict[str, SlotRecord]
) -> dict[int, _Slot]:
    """The region's slots: from the records, then the machines (a machine placed without
    a slot of this kind takes the lowest free index)."""
    slots: dict[int, _Slot] = {}
    for key, rec in records.items():
        r, _, tail = key.rpartition(".")
        if r == region and tail.isdigit():
            slots[int(tail)] = _Slot(int(tail), rec.role, record=rec)
    strays: list[Machine] = []
    for m in sorted(machines, key=lambda m: (m.created_at_ms, m.machine_id)):
        idx = _index(m)
        if idx is None:
            strays.append(m)
            continue
        slot = slots.setdefault(idx, _Slot(idx, m.metadata.get(ROLE, PRIMARY)))
        slot.machines.append(m)
    named = {s.record.machine_id: i for i, s in slots.items() if s.record and s.record.machine_id}
    for m in strays:
        if (idx := named.get(m.machine_id)) is None:
            idx = next(i for i in range(len(slots) + 1) if i not in slots)
            slots[idx] = _Slot(idx, m.metadata.get(ROLE, PRIMARY))
        slots[idx].machines.append(m)
    return slots


def _promote(slots: Iterable[_Slot]) -> None:
    """A spare's slot whose machine runs while a primary's slot has none running (a
    failover started the spare): the roles swap, so the started spare is the primary."""
    listed = sorted(slots, key=lambda s: s.index)
    idle = [s for s in listed if s.role == PRIMARY and not s.running]
    for spare in (s for s in listed if s.role == SPARE and s.running):
        if not idle:
            return
        primary = idle.pop(0)
        primary.role, spare.role = SPARE, PRIMARY


def _kept(slots: list[_Slot], role: str, n: int) -> tuple[list[_Slot], list[_Slot]]:
    """The ``n`` slots of ``role`` kept (those with machines first, a spare's slot with a
    machine never started before one with a stopped machine, then by index) and the
    surplus."""

    def rank(s: _Slot) -> tuple[bool, bool, int]:
        fresh = role == SPARE and any(m.state == "reserved" for m in s.machines)
        return (not s.machines, role == SPARE and not fresh, s.index)

    mine = sorted((s for s in slots if s.role == role), key=rank)
    return mine[:n], mine[n:]


@dataclass
class _Planner:
    spec: AppSpec
    generation: int
    want: dict[str, str]
    image_digest: str
    steps: list[Step] = field(default_factory=list)
    records: dict[str, SlotRecord] = field(default_factory=dict)

    def step(
        self,
        region: str,
        slot: int,
        role: str,
        action: str,
        m: Machine | None = None,
        *,
        order_id: str = "",
        fields: list[str] | None = None,
        detail: str = "",
    ) -> None:
        """Add a step (on machine ``m`` where there is one)."""
        self.steps.append(
            Step(
                region=region,
                slot=slot,
                role=role,
                action=action,
                machine_id=m.machine_id if m else "",
                worker_id=m.worker_id if m else "",
                state=m.state if m else "",
                order_id=order_id,
                fields=fields or [],
                detail=detail,
            )
        )

    def new_id(self, region: str, slot: _Slot, failed: Machine | None = None) -> tuple[str, int]:
        """The order id a slot's new machine is placed under, and its attempt (a new one
        in place of a machine of this generation that was lost, or ``failed``)."""
        rec, attempt = slot.record, 0
        if rec is not None and rec.generation == self.generation:
            lost = rec.machine_id and all(m.machine_id != rec.machine_id for m in slot.machines)
            attempt = rec.attempt + 1 if lost or failed else rec.attempt
        elif failed is not None and failed.metadata.get(GEN) == str(self.generation):
            attempt = 1
        return order_id(self.spec.app, self.generation, region, slot.index, attempt), attempt

    def region(self, region: str, machines: list[Machine], records: dict[str, SlotRecord]) -> None:
        slots = _slots(region, machines, records)
        _promote(slots.values())
        every = list(slots.values())
        primaries, extra_p = _kept(every, PRIMARY, self.spec.count)
        spares, extra_s = _kept(every, SPARE, self.spec.spares)
        for slot in extra_s + extra_p:  # spares first
            for m in slot.machines:
                self.step(region, slot.index, slot.role, DESTROY, m, detail="scaled down")
        # new slots never take the index of one being destroyed
        free = (i for i in range(len(slots) + self.spec.count + self.spec.spares) if i not in slots)
        primaries += [_Slot(next(free), PRIMARY) for _ in range(self.spec.count - len(primaries))]
        spares += [_Slot(next(free), SPARE) for _ in range(self.spec.spares - len(spares))]
        for slot in primaries + spares:
            self.slot(region, slot)

    def slot(self, region: str, slot: _Slot) -> None:
        key = slot_key(region, slot.index)
        if not slot.machines:
            oid, attempt = self.new_id(region, slot)
            self.step(region, slot.index, slot.role, CREATE, order_id=oid)
            self.records[key] = SlotRecord(
                role=slot.role, generation=self.generation, attempt=attempt
            )
            return
        diffs = {
            m.machine_id: differing(m, self.want, self.image_digest, self.spec)
            for m in slot.machines
        }
        current = [m for m in slot.machines if not diffs[m.machine_id]]
        old = [m for m in slot.machines if diffs[m.machine_id]]
        if current:
            keep = max(current, key=lambda m: (m.state == "started", m.created_at_ms))
            for m in current:
                if m is not keep:
                    self.step(region, slot.index, slot.role, DESTROY, m, detail="duplicate")
        if old:
            # replaced by a machine of this generation (re-placed under its id if one is
            # already there: a cut-off rollout goes on from where it was)
            head = old[0]
            for m in old[1:]:
                self.step(region, slot.index, slot.role, DESTROY, m, detail="replaced")
            oid, attempt = self.new_id(region, slot)
            if current:  # the order id it was placed under (a tenant's scope taken off)
                oid = keep.order_id.rpartition(":")[2]
            else:  # old ones of this generation (only their image's tag moved): an attempt
                # past theirs, or the claim of their order id hands one of them back
                ours = [attempt_of(m.order_id.rpartition(":")[2]) for m in old
                        if m.metadata.get(GEN) == str(self.generation)]  # fmt: skip
                if ours and attempt <= max(ours):
                    attempt = max(ours) + 1
                    oid = order_id(self.spec.app, self.generation, region, slot.index, attempt)
            diff = diffs[head.machine_id]
            self.step(region, slot.index, slot.role, UPDATE, head, order_id=oid, fields=diff)
            self.records[key] = SlotRecord(
                role=slot.role, generation=self.generation, attempt=attempt
            )
            return
        if slot.role == PRIMARY and keep.state == "failed" and self.spec.restart not in RESTARTING:
            oid, attempt = self.new_id(region, slot, failed=keep)
            self.step(region, slot.index, slot.role, UPDATE, keep, order_id=oid, detail="failed")
            self.records[key] = SlotRecord(
                role=slot.role, generation=self.generation, attempt=attempt
            )
            return
        gen = int(keep.metadata.get(GEN, "0") or 0)
        rec = slot.record
        self.records[key] = SlotRecord(
            role=slot.role,
            generation=rec.generation if rec else gen,
            attempt=rec.attempt if rec else 0,
            machine_id=keep.machine_id,
        )
        action = START if slot.role == PRIMARY and keep.state in NOT_RUNNING else KEEP
        self.step(region, slot.index, slot.role, action, keep)


def plan(
    spec: AppSpec,
    generation: int,
    machines: list[Machine],
    records: dict[str, SlotRecord] | None = None,
    *,
    secrets_revision: str = "",
    image_digest: str = "",
) -> Plan:
    """What converging the app's live ``machines`` to ``spec`` takes (see the module)."""
    records = records or {}
    p = _Planner(spec, generation, fingerprints(spec, secrets_revision), image_digest)
    for m in machines:
        if m.region not in spec.regions:
            idx, role = _index(m), m.metadata.get(ROLE, "")
            gone = "region not in the spec"
            p.step(m.region, -1 if idx is None else idx, role, DESTROY, m, detail=gone)
    for region in spec.regions:
        p.region(region, [m for m in machines if m.region == region], records)
    steps = sorted(p.steps, key=lambda s: _ORDER[s.action])
    return Plan(app=spec.app, generation=generation, steps=steps, records=p.records)
