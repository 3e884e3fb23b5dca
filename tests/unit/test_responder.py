"""Replies only to inboxes (bourse.nats.auth.is_inbox, the responder's check) and the
generated grants, as tables. The responder on a real nats-server: tests/security/
test_attacks.py."""

from __future__ import annotations

import pytest

from bourse.nats.auth import inbox_prefix_for, is_inbox, new_seed
from bourse.nats.permissions import (
    ROLE_BUYER,
    ROLE_EXCHANGE,
    ROLE_SUPPLIER,
    ROLE_TENANT,
    User,
    permissions_for,
    render_authorization,
)
from bourse.wire.subjects import Subjects


@pytest.mark.parametrize(
    ("subject", "inbox"),
    [
        ("_INBOX.abc", True),
        ("_INBOX.UABCDEF.mux.token", True),  # a per-user prefix (bourse auth init)
        ("_INBOX.", False),
        ("_INBOX", False),
        ("_INBOXES.x", False),
        ("bourse.v1.worker.mad-2.commit", False),
        ("bourse.v1.worker.mad-1.machine.destroy", False),
        ("bourse.v1.event.mad.mad-1.placed", False),
        ("x._INBOX.abc", False),
        ("_INBOX.*", False),
        ("_INBOX.>", False),
        ("$JS.API.STREAM.DELETE.x", False),
    ],
)
def test_only_inboxes_are_answered(subject: str, inbox: bool) -> None:
    assert is_inbox(subject) is inbox


S = Subjects("t")
USERS = [
    User("buyer", ROLE_BUYER, new_seed()),
    User("exchange", ROLE_EXCHANGE, new_seed()),
    User("supplier:a", ROLE_SUPPLIER, new_seed(), (("a-1", "mad"),)),
    User("supplier:b", ROLE_SUPPLIER, new_seed(), (("b-1", "mad"),)),
    User("buyer:alice", ROLE_TENANT, new_seed()),
]
BUYER, EXCHANGE, SUP_A, SUP_B, ALICE = USERS


def inbox(u: User) -> str:
    return f"{inbox_prefix_for(u.public_key)}.>"


@pytest.mark.parametrize(
    ("user", "may", "may_not"),
    [
        (BUYER, [], [BUYER, EXCHANGE, SUP_A, SUP_B, ALICE]),  # a buyer answers nothing
        (ALICE, [], [BUYER, EXCHANGE, SUP_A, SUP_B, ALICE]),  # nor does a tenant
        # the exchange answers buyers, tenants and the suppliers' reclaim checks (§5.3d)
        (EXCHANGE, [EXCHANGE, BUYER, ALICE, SUP_A, SUP_B], []),
        (SUP_A, [SUP_A, EXCHANGE, BUYER, ALICE], [SUP_B]),
        (SUP_B, [SUP_B, EXCHANGE, BUYER, ALICE], [SUP_A]),
    ],
)
def test_each_user_may_answer_into_exactly_the_inboxes_of_those_it_serves(
    user: User, may: list[User], may_not: list[User]
) -> None:
    """Explicit inbox allows instead of allow_responses, which would let a responder
    publish on any reply subject it is handed (even one its deny list names)."""
    publish = permissions_for(user, S, USERS).publish
    answers = [p for p in publish if p.startswith("_INBOX")]
    assert sorted(answers) == sorted(inbox(u) for u in may)
    assert not any(inbox(u) in publish for u in may_not)
    assert "_INBOX.>" not in publish


def test_the_server_config_grants_no_allow_responses() -> None:
    conf = render_authorization(USERS, S)
    assert "allow_responses" not in conf
    assert inbox(BUYER) in conf


def test_a_tenant_publishes_only_under_its_own_name_and_reads_no_events() -> None:
    p = permissions_for(ALICE, S, USERS)
    market = [x for x in p.publish if not x.startswith("$")]  # the rest: reading images
    assert market == [
        "t.v1.tenant.alice.order.*",
        "t.v1.tenant.alice.machine.*",
        "t.v1.tenant.alice.image.*",
        "t.v1.tenant.alice.exec.*",  # its exec sessions' input (§4.24)
        "t.v1.stage.alice.>",  # the chunks of what it pushes (its own subjects)
        "t.v1.status.*",
        "t.v1.status",
        "t.v1.explain.*",
    ]
    # its inbox, and the edges' share of its own machines' activity (§4.23): no events
    assert p.subscribe == ("t.v1.edge.activity.*.alice", inbox(ALICE))
    ex = permissions_for(EXCHANGE, S, USERS).subscribe
    assert "t.v1.tenant.*.order.* exchange" in ex and "t.v1.tenant.*.machine.* exchange" in ex
    assert "t.v1.tenant.*.image.* exchange" in ex
    assert "t.v1.tenant.*.exec.*" in ex  # a session's input: the instance relaying it alone
