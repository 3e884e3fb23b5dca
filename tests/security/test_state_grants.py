"""One writer per row (docs/protocol.md §4.21), on a live nats-server with the generated
config: a supplier's key publishes its own workers' rows of the state stream, and nothing
else there; a tenant's key makes a view's consumers over the fleet rows and its own
machines' rows only (the filter is in the subject that makes the consumer, and the server
refuses a body that asks for more); the shared buyer key over every row. The stream's
epoch: written only by the exchange and the operator, read by every view's key."""

from __future__ import annotations

import json

import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bourse.nats.connection import flush_all
from bourse.nats.state import (
    StateStream,
    ensure_state_stream,
    make_state_stream,
    state_stream_name,
    write_epoch,
)
from bourse.view.db import ViewDB
from bourse.view.view import View
from tests.security.conftest import PREFIX, Secured


def _consumer(name: str, filters: list[str], deliver: str) -> ConsumerConfig:
    single = filters[0] if len(filters) == 1 else None
    return ConsumerConfig(
        name=name,
        filter_subject=single,
        filter_subjects=None if single else filters,
        deliver_subject=deliver,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=5.0,
    )


async def test_a_supplier_publishes_its_own_workers_rows_only(secured: Secured) -> None:
    s = secured.subjects
    exchange, _ = await secured.connect("exchange")
    assert await ensure_state_stream(exchange.jetstream(), StateStream.of(s))  # as it starts

    sup, v = await secured.connect("supplier:mad-1")
    js = sup.jetstream(timeout=2)
    own = [
        s.state_worker("mad", "mad-1"),
        s.state_beat("mad", "mad-1"),
        s.state_machine("_", "mad", "mad-1", "mad-1~A1"),
        s.state_machine("alice", "mad", "mad-1", "mad-1~A2"),  # a tenant's machine on it
    ]
    for subject in own:
        assert (await js.publish(subject, b"{}")).stream == state_stream_name(PREFIX)
    forged = [
        s.state_worker("mad", "mad-2"),  # another worker's row
        s.state_beat("mad", "mad-2"),
        s.state_machine("_", "mad", "mad-2", "mad-2~B1"),
        s.state_machine("_", "fra", "mad-1", "mad-1~B2"),  # its worker, another region
        s.state_worker("fra", "mad-1"),
        s.state_epoch,  # the stream's epoch: its makers' only
    ]
    for subject in forged:
        await sup.publish(subject, b"{}")
        assert f'publish to "{subject.lower()}"' in await v.next()
    info = await exchange.jetstream().stream_info(state_stream_name(PREFIX))
    assert info.state.messages == len(own) + 1  # and the epoch the exchange wrote

    fleet, fv = await secured.connect("supplier:fleet-fra")
    for wid in ("fra-1", "fra-2"):
        await fleet.jetstream(timeout=2).publish(s.state_worker("fra", wid), b"{}")
    await fleet.publish(s.state_worker("mad", "mad-1"), b"{}")
    assert f'publish to "{s.state_worker("mad", "mad-1")}"' in await fv.next()


async def test_a_tenants_view_reaches_the_fleet_and_its_own_machines_only(
    secured: Secured,
) -> None:
    s = secured.subjects
    stream = state_stream_name(PREFIX)
    exchange, _ = await secured.connect("exchange")
    assert await ensure_state_stream(exchange.jetstream(), StateStream.of(s))
    alice, v = await secured.connect("buyer:alice")
    js = alice.jetstream(timeout=1)
    inbox = alice.new_inbox()
    for n, want in enumerate((s.state_fleet, s.state_owned("alice"))):
        info = await js.add_consumer(stream, _consumer(f"a{n}", [want], inbox))
        assert info.config.filter_subject == want
    for n, other in enumerate((s.state_owned("bob"), s.state_owned("_"), s.state_all)):
        with pytest.raises(nats.errors.TimeoutError):  # refused: no answer comes
            await js.add_consumer(stream, _consumer(f"x{n}", [other], inbox))
        create = f"$JS.API.CONSUMER.CREATE.{stream}.x{n}.{other}"
        assert f'publish to "{create.lower()}"' in await v.next()
    # the subject says its own machines, the body asks for bob's too: the server refuses
    sneaky = _consumer("y", [s.state_owned("alice"), s.state_owned("bob")], inbox)
    subject = f"$JS.API.CONSUMER.CREATE.{stream}.y.{s.state_owned('alice')}"
    body = json.dumps({"stream_name": stream, "config": sneaky.as_dict()}).encode()
    refused = json.loads((await alice.request(subject, body, timeout=2)).data)
    assert refused["error"]["code"] == 400, refused
    await flush_all(alice)

    buyer, bv = await secured.connect("buyer")
    info = await buyer.jetstream(timeout=1).add_consumer(
        stream, _consumer("b", [s.state_all], buyer.new_inbox())
    )
    assert info.config.filter_subject == s.state_all
    await flush_all(buyer)
    assert bv.none_yet()


async def test_the_epoch_is_written_by_the_streams_makers_and_read_by_every_view(
    secured: Secured,
) -> None:
    """Only the exchange and the operator, which make the stream, may write its epoch (any
    other key could make every view rebuild); a view of any key reads it by a direct get,
    and a tenant's key reaches no other fleet row that way."""
    s = secured.subjects
    stream = StateStream.of(s)
    exchange, xv = await secured.connect("exchange")
    assert await make_state_stream(exchange.jetstream(), stream)  # as it starts: and its epoch
    epochs = set()
    for user, tenant in (("buyer", ""), ("buyer:alice", "alice")):
        nc, v = await secured.connect(user)
        epochs.add(await View(nc, s, ViewDB(":memory:"), tenant).stream_epoch())
        await nc.publish(s.state_epoch, b"{}")
        assert f'publish to "{s.state_epoch}"' in await v.next()
    assert len(epochs) == 1 and None not in epochs
    alice, av = await secured.connect("buyer:alice")
    row = f"$JS.API.DIRECT.GET.{stream.name}.{s.state_worker('mad', 'mad-1')}"
    await alice.publish(row, b"", reply=alice.new_inbox())
    assert f'publish to "{row.lower()}"' in await av.next()

    operator, ov = await secured.connect("operator")
    await operator.jetstream().purge_stream(stream.name)  # the epoch goes with the rows
    written = await write_epoch(operator.jetstream(), stream)  # as `jetstream init` does
    assert written and written not in epochs
    assert await write_epoch(exchange.jetstream(), stream) == ""  # there: the exchange's waits
    for nc in (exchange, operator):
        await flush_all(nc)
    assert xv.none_yet() and ov.none_yet()
