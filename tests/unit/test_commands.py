"""The pure core of the commands kept for a worker (supplier/commands.py): a command, the
worker it reached and that worker's machine -> apply, nothing to do, or drop."""

from __future__ import annotations

import pytest

from bourse.nats.commands import command_stream_bytes, command_stream_name, consumer_name
from bourse.wire.messages import Machine, MachineCommand, Resources
from supplier.commands import decide, detail_of

MID = "w1~01J0000000000000000000000A"


def command(verb: str = "stop", by: str = "exchange", **kw: str) -> MachineCommand:
    fields = {"machine_id": MID, "worker_id": "w1", **kw}
    return MachineCommand(
        command_id="01J0000000000000000000000C",
        verb=verb,  # type: ignore[arg-type]
        requested_by=by,
        reason="failover",
        **fields,
    )


def machine(state: str = "started", order_id: str = "acme:web.g1.mad.0") -> Machine:
    return Machine(
        machine_id=MID,
        order_id=order_id,
        worker_id="w1",
        region="mad",
        state=state,  # type: ignore[arg-type]
        resources=Resources(cpus=1, memory_mb=64),
        image="x",
    )


@pytest.mark.parametrize(
    ("cmd", "shown", "action", "why"),
    [
        # the worker applies what it should, as a direct request would
        (command("stop"), machine("started"), "apply", "exchange: failover"),
        (command("stop"), machine("starting"), "apply", "exchange: failover"),
        (command("destroy"), machine("stopped"), "apply", "exchange: failover"),
        (command("destroy"), machine("reserved"), "apply", "exchange: failover"),
        (command("destroy", "operator"), machine("failed"), "apply", "operator: failover"),
        # idempotent: nothing left to do is not an error
        (command("stop"), machine("stopped"), "nothing", "it is stopped already"),
        (command("stop"), machine("failed"), "nothing", "it is failed already"),
        (command("stop"), machine("reserved"), "nothing", "reserved: it does not run"),
        (command("destroy"), machine("destroyed"), "nothing", f"no live machine {MID}"),
        (command("destroy"), None, "nothing", f"no live machine {MID}"),
        (command("stop"), None, "nothing", f"no live machine {MID}"),
        # a tenant's command acts on its own machines only
        (command("stop", "tenant:acme"), machine(), "apply", "tenant:acme: failover"),
        (command("stop", "tenant:bob"), machine(), "drop", "is not one of 'bob'"),
        (command("stop", "tenant:ac"), machine(), "drop", "is not one of 'ac'"),
        # another worker's command, or a machine of another worker, is dropped
        (command(worker_id="w2"), machine(), "drop", "names worker w2's machine"),
        (
            command(machine_id="w2~01J0000000000000000000000A"),
            None,
            "drop",
            "names worker w1's machine w2~",
        ),
    ],
)
def test_decide(cmd: MachineCommand, shown: Machine | None, action: str, why: str) -> None:
    d = decide(cmd, "w1", shown)
    assert d.action == action
    assert why in d.detail


def test_the_event_says_what_was_done() -> None:
    cmd = command("stop")
    assert detail_of(cmd, decide(cmd, "w1", machine())) == "stop applied (exchange: failover)"
    assert detail_of(cmd, decide(cmd, "w1", None)).startswith("stop: nothing to do (no live")
    assert detail_of(cmd, decide(cmd, "w2", None)).startswith("stop dropped: names worker w1's")


def test_names_and_the_sizing_rule() -> None:
    assert command_stream_name("bourse") == "BOURSE_COMMANDS"
    assert command_stream_name("t.x") == "T_X_COMMANDS"
    assert consumer_name("mad-1") == "cmd-mad-1"
    # two commands (a stop, a destroy) of 640 B per machine of every worker away
    assert command_stream_bytes(1000, 50) == 64_000_000
    assert command_stream_bytes(1, 1) == 1280
