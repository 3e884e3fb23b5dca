"""What a view makes of one state stream message (bourse/view/rows.py): the row's columns,
or why it is dropped: a subject the stream has no rows on, a body that is not the message
its subject says, a body that says more than its subject (another worker's, region's or
owner's machine; a heartbeat keyed by another worker). The stream's epoch is known, no
row."""

from __future__ import annotations

import msgspec
import pytest

from bourse.view.rows import (
    FOREIGN,
    MACHINE_COLUMNS,
    MALFORMED,
    UNKNOWN_SUBJECT,
    WORKER_COLUMNS,
    BeatOp,
    Dropped,
    EpochOp,
    MachineRowOp,
    Reader,
    WorkerRowOp,
)
from bourse.wire.codec import encode
from bourse.wire.messages import (
    Amount,
    Health,
    Heartbeat,
    LastExit,
    Machine,
    Resources,
    StateEpoch,
    WorkerRow,
)
from bourse.wire.subjects import Subjects

S = Subjects("bourse")
READER = Reader(S)


def machine(**kw: object) -> Machine:
    fields: dict[str, object] = {
        "machine_id": "mad-1~01A",
        "order_id": "shop.g2.mad.0",
        "worker_id": "mad-1",
        "region": "mad",
        "state": "started",
        "resources": Resources(cpus=1, cpu_millis=500, memory_mb=256),
        "image": "web",
        "metadata": {"app": "shop", "slot": "0", "role": "primary", "gen": "2"},
        "health": Health(status="passing", since_ms=5),
        "last_exit": LastExit(reason="exit", code=3, at_ms=9),
        "restarts": 1,
    }
    return Machine(**(fields | kw))  # type: ignore[arg-type]


def subject(m: Machine, owner: str = "_") -> str:
    return S.state_machine(owner, m.region, m.worker_id, m.machine_id)


def test_a_machines_row_has_its_columns() -> None:
    m = machine()
    op = READER.read(subject(m), encode(m))
    assert isinstance(op, MachineRowOp)
    row = dict(zip(MACHINE_COLUMNS, op.values, strict=True))
    assert row | {"row": "-"} == {
        "machine_id": "mad-1~01A", "order_id": "shop.g2.mad.0", "tenant": "",
        "worker_id": "mad-1", "region": "mad", "state": "started", "app": "shop", "slot": 0,
        "role": "primary", "generation": 2, "image": "web", "image_digest": "",
        "cpu_millis": 500, "memory_mb": 256, "disk_mb": 0, "gpus": 0, "addresses": "{}",
        "health": "passing", "health_since_ms": 5, "restarts": 1, "last_exit": "exit 3",
        "last_exit_at_ms": 9, "simulated": 0, "created_at_ms": 0, "updated_at_ms": 0,
        "row": "-",
    }  # fmt: skip
    assert msgspec.json.decode(row["row"].encode(), type=Machine) == m


def test_a_tenants_machine_is_under_its_owner_token() -> None:
    m = machine(order_id="alice:shop.g2.mad.0")
    op = READER.read(subject(m, "alice"), encode(m))
    assert isinstance(op, MachineRowOp) and op.values[MACHINE_COLUMNS.index("tenant")] == "alice"
    assert isinstance(Reader(S, "alice").read(subject(m, "alice"), encode(m)), MachineRowOp)


def test_worker_rows_and_heartbeats() -> None:
    w = WorkerRow(
        worker_id="mad-2", region="mad", beat="mad-1", labels={"disk": "ssd"},
        capacity=Amount(cpus=8, memory_mb=1024, ports=10),
        free=Amount(cpus=2, cpu_millis=1500, memory_mb=512, ports=9), isolation="users",
    )  # fmt: skip
    op = READER.read(S.state_worker("mad", "mad-2"), encode(w))
    assert isinstance(op, WorkerRowOp)
    row = dict(zip(WORKER_COLUMNS, op.values, strict=True))
    assert (
        row["beat"], row["cpu_millis"], row["free_cpu_millis"], row["free_ports"], row["isolation"]
    ) == ("mad-1", 8000, 1500, 9, "users")  # fmt: skip
    hb = Heartbeat(beat="mad-1", workers=["mad-1", "mad-2"], at_ms=1)
    assert READER.read(S.state_beat("mad", "mad-1"), encode(hb)) == BeatOp(hb, "mad")


M = machine()
W = WorkerRow(worker_id="mad-1", region="mad", beat="mad-1", capacity=Amount(), free=Amount())
HB = Heartbeat(beat="mad-1", workers=["mad-1"], at_ms=1)


@pytest.mark.parametrize(
    ("subj", "data", "reason"),
    [
        ("bourse.v1.event.mad.mad-1.placed", encode(M), UNKNOWN_SUBJECT),
        ("bourse.v1.state.machine._.mad.mad-1", encode(M), UNKNOWN_SUBJECT),  # a token short
        ("bourse.v1.state.fleet.other.mad.mad-1", encode(W), UNKNOWN_SUBJECT),
        (subject(M), b"{not json", MALFORMED),
        (subject(M), b"", MALFORMED),
        (subject(M), encode(W), MALFORMED),  # a worker row on a machine's subject
        (S.state_worker("mad", "mad-1"), b'{"type": "WorkerRow"}', MALFORMED),
        # another worker's machine on mad-2's subject (only mad-2's key may publish there)
        (S.state_machine("_", "mad", "mad-2", "mad-1~01A"), encode(M), FOREIGN),
        (S.state_machine("_", "mad", "mad-2", "mad-2~01A"), encode(M), FOREIGN),
        (S.state_machine("_", "fra", "mad-1", "mad-1~01A"), encode(M), FOREIGN),
        # a row naming another tenant than its subject's owner, or none
        (subject(M, "alice"), encode(M), FOREIGN),
        (subject(M), encode(machine(order_id="alice:x")), FOREIGN),
        (S.state_worker("mad", "mad-2"), encode(W), FOREIGN),
        (S.state_worker("fra", "mad-1"), encode(W), FOREIGN),
        (S.state_beat("mad", "mad-2"), encode(HB), FOREIGN),  # keyed by another worker
    ],
)
def test_a_row_that_says_more_than_its_subject_is_dropped(
    subj: str, data: bytes, reason: str
) -> None:
    op = READER.read(subj, data)
    assert isinstance(op, Dropped) and op.reason == reason, op


def test_the_streams_epoch_is_known_not_a_dropped_row() -> None:
    epoch = encode(StateEpoch(epoch="01KBX2W7Q4M1S8YV3D5N0RZ6TC", at_ms=1))
    assert READER.read(S.state_epoch, epoch) == EpochOp("01KBX2W7Q4M1S8YV3D5N0RZ6TC")
    assert Reader(S, "alice").read(S.state_epoch, epoch) == EpochOp("01KBX2W7Q4M1S8YV3D5N0RZ6TC")
    for bad in (encode(HB), b'{"type": "StateEpoch", "epoch": "a.b"}'):
        op = READER.read(S.state_epoch, bad)
        assert isinstance(op, Dropped) and op.reason == MALFORMED, op
    op = READER.read(f"{S.state_epoch}.x", epoch)  # a token more: no such subject
    assert isinstance(op, Dropped) and op.reason == UNKNOWN_SUBJECT


def test_a_tenants_view_drops_another_owners_row() -> None:
    m = machine(order_id="bob:x")
    op = Reader(S, "alice").read(subject(m, "bob"), encode(m))
    assert isinstance(op, Dropped) and op.reason == FOREIGN
