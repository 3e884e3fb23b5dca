"""A machine's change as its worker's records hold it (supplier/machines/records.py): told
to the state stream's hook (``published``) once it is durable, whether or not whoever queued
it has looked yet (a start looks at its ``starting`` record only after its launch, a pull
included), once; a write the store refuses is told to nobody."""

from __future__ import annotations

from typing import Any, cast

import anyio
import pytest

from bourse.wire.messages import Machine, Resources
from supplier.machines.records import Records
from supplier.store import Store, StoreError


def nothing(*_: Any) -> None:
    return None


def records(store: Store, told: list[Machine], heard: anyio.Event | None = None) -> Records:
    r = Records("mad-1", store, cast(Any, None), cast(Any, nothing), nothing, nothing, nothing,
                nothing, nothing)  # fmt: skip

    def published(m: Machine) -> None:
        told.append(m)
        if heard is not None:
            heard.set()

    r.published = published
    return r


M = Machine(machine_id="mad-1~M1", order_id="o1", worker_id="mad-1", region="mad",
            state="stopped", resources=Resources(cpus=1, memory_mb=64), image="web")  # fmt: skip


async def test_a_change_is_told_once_durable_before_whoever_queued_it_looks(store: Store) -> None:
    told: list[Machine] = []
    heard = anyio.Event()
    r = records(store, told, heard)
    starting = r.queued(M, "starting", "start")
    with anyio.fail_after(10):
        await heard.wait()  # the store's answer, on the event loop: nobody awaits done()
    assert [m.state for m in told] == ["starting"]
    assert r.by_id[M.machine_id].state == "starting"  # memory as the store has it
    assert (await starting.done()).state == "starting"
    assert len(told) == 1  # told once, not again when looked at


async def test_a_change_the_store_refuses_is_told_to_nobody(store: Store) -> None:
    told: list[Machine] = []
    r = records(store, told)
    store.close()
    with pytest.raises(StoreError):
        await r.queued(M, "starting", "start").done()
    assert told == [] and M.machine_id not in r.by_id
