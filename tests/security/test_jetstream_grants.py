"""The JetStream permission table (bourse/nats/grants.py, shown in docs/security.md) found
again twice: in the ``auth.conf`` that ``bourse auth init`` writes, and on a live
nats-server with JetStream, by trying every verb on every stream and bucket of the market
(and on the account) with every user's key. Each must equal the table. And the attack
that asked for it: a supplier's key rewriting the event stream."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

import anyio
import nats.errors
import nats.js.errors
import pytest
import structlog
from nats.js.api import StreamConfig

from bourse.auction.claim_store import ClaimStore
from bourse.images import ImageStore
from bourse.nats import grants
from bourse.nats.authdir import AuthFiles
from bourse.nats.connection import flush_all
from bourse.nats.jetstream import DEFAULT_MAX_AGE_S, DEFAULT_MAX_BYTES, EventStream, ensure_stream
from bourse.nats.permissions import User
from ops.cli import app as ops_app
from tests.cli import run_cli
from tests.security.conftest import PREFIX, Secured

Table = dict[str, set[str]]
# The name a key that is no tenant's tries a tenant's own verbs under, and the worker a key
# that is no supplier's tries a worker's own verbs for.
PROBE_TENANT = "alice"
PROBE_WORKER = "mad-1"


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` one or more at the end."""
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or token not in ("*", got[i]):
            return False
    return len(got) == len(want)


def configured(auth_conf: str) -> dict[str, list[str]]:
    """Each user's publish allow list, read from the generated config."""
    users = re.findall(r"^ {4}# (\S+).*?publish: \{ allow: (\[.*?\]) \}", auth_conf, re.S | re.M)
    return {name: json.loads(allowed) for name, allowed in users}


def derive(allowed: Callable[[str], bool], tenant: str = "", worker: str = "") -> Table:
    """The table as ``allowed`` (is this subject allowed?) shows it: a verb is granted on
    a resource when every subject it uses is allowed; one allowed in part is a finding.
    A tenant's own verbs are tried under its name, a worker's own for its (first) worker
    (they are theirs only, and shown only where the verb on every key or consumer is not
    granted)."""
    table: Table = {}
    for r in grants.RESOURCES:
        for v in grants.VERBS:
            owner = {grants.OWN_TENANT: tenant, grants.OWN_WORKER: worker}.get(v.own, "")
            if not grants.applies(v, r) or (v.own and not owner):
                continue
            if v.within in table.get(r.key, set()):
                continue
            results = [allowed(p) for p in _probes(v, r, owner)]
            if all(results):
                table.setdefault(r.key, set()).add(v.name)
            elif any(results):
                table.setdefault(r.key, set()).add(f"{v.name} (in part)")
    return table


def _probes(v: grants.Verb, r: grants.Resource, owner: str) -> tuple[str, ...]:
    return v.probes(r.stream(PREFIX), v.data(r, PREFIX, owner))


def worker_of(user: User) -> str:
    """The worker a user's own verbs are tried for: a supplier's first, "" for the rest."""
    return user.workers[0][0] if user.workers else ""


def documented(role: str) -> Table:
    return {
        r.key: set(grants.granted(role, r)) for r in grants.RESOURCES if grants.granted(role, r)
    }


def test_the_generated_config_grants_exactly_the_table(auth_files: AuthFiles) -> None:
    allows = configured(auth_files.auth_conf.read_text())
    assert set(allows) == {u.name for u in auth_files.users}
    for user in auth_files.users:
        allowed = allows[user.name]
        table = derive(
            lambda subject, allowed=allowed: any(matches(p, subject) for p in allowed),
            user.tenant,
            worker_of(user),
        )
        assert table == documented(user.role), user.name


async def test_a_live_server_grants_exactly_the_table(secured: Secured) -> None:
    operator, _ = await secured.connect("operator")
    assert await ensure_stream(operator.jetstream(), EventStream.of(secured.subjects))
    assert await ClaimStore.open(operator, secured.subjects) is not None
    await ImageStore.open(operator, PREFIX)
    for user in secured.files.users:
        nc, violations = await secured.connect(user.name)
        inbox = nc.new_inbox()
        for r in grants.RESOURCES:
            for v in grants.VERBS:
                owner = user.tenant or PROBE_TENANT
                if v.own == grants.OWN_WORKER:
                    owner = worker_of(user) or PROBE_WORKER
                for subject in _probes(v, r, owner):
                    await nc.publish(subject, b"{}", reply=inbox)
        await flush_all(nc)
        denied = violations.denied()
        table = derive(
            lambda subject, denied=denied: subject.lower() not in denied,
            user.tenant,
            worker_of(user),
        )
        assert table == documented(user.role), user.name


async def test_a_supplier_key_cannot_rewrite_or_empty_the_event_stream(secured: Secured) -> None:
    """The attack: with one supplier's key, an update of the event stream to max_msgs=1
    and one region's subjects (it dropped the stored events from 6 to 1 and stopped every
    other region's events from being stored); and its delete and purge."""
    s = secured.subjects
    exchange, _ = await secured.connect("exchange")
    stream = EventStream.of(s)
    assert await ensure_stream(exchange.jetstream(), stream)  # as the exchange's start does
    writers = (("supplier:mad-1", "mad", "mad-1"), ("supplier:fleet-fra", "fra", "fra-1"))
    for user, region, wid in writers:
        nc, _ = await secured.connect(user)
        for kind in ("placed", "started", "stopped"):
            await nc.jetstream().publish(s.event(region, wid, kind), b"{}")

    attacker, violations = await secured.connect("supplier:mad-1")
    rewrite = StreamConfig(name=stream.name, subjects=[s.events("mad")], max_msgs=1)
    with pytest.raises(nats.errors.TimeoutError):  # refused: no answer comes
        await attacker.jetstream(timeout=1).update_stream(rewrite)
    for verb in ("DELETE", "PURGE"):
        await attacker.publish(f"$JS.API.STREAM.{verb}.{stream.name}", b"", reply="_INBOX.x")
    await flush_all(attacker)
    assert {f"$js.api.stream.{v}.{stream.name.lower()}" for v in ("update", "delete", "purge")} <= (
        violations.denied()
    )

    info = await exchange.jetstream().stream_info(stream.name)
    assert info.state.messages == 6
    assert info.config.subjects == list(stream.subjects) and info.config.max_msgs in (None, -1)
    fra, _ = await secured.connect("supplier:fleet-fra")
    ack = await fra.jetstream().publish(s.event("fra", "fra-2", "placed"), b"{}")
    assert ack.seq == 7  # another region's events are still stored


async def _jetstream_init(secured: Secured, user: str) -> tuple[int, str, str]:
    """``bourse jetstream init`` with ``user``'s key (in this process: the logging set-up it
    makes is undone after, so later tests see their info lines)."""
    args = ["jetstream", "init", "--nats", secured.url, "--creds", secured.creds(user)]
    args += ["--prefix", PREFIX]
    config = structlog.get_config()
    try:
        return await anyio.to_thread.run_sync(lambda: run_cli(ops_app, *args))
    finally:
        structlog.configure(**config)


async def test_the_operator_sets_the_market_up_and_no_other_key_can(secured: Secured) -> None:
    code, out, err = await _jetstream_init(secured, "supplier:mad-1")
    assert code == 1 and "error: " in err and len(err.strip().splitlines()) == 1, err
    operator, _ = await secured.connect("operator")
    js = operator.jetstream()
    streams = [r.stream(PREFIX) for r in grants.RESOURCES if r.kind != "account"]
    for name in streams:  # the supplier's attempt made nothing
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.stream_info(name)

    code, out, err = await _jetstream_init(secured, "operator")
    assert code == 0, err
    for name in streams:
        assert name in out
        await js.stream_info(name)
    events = await js.stream_info(EventStream.of(secured.subjects).name)
    assert events.config.max_bytes == DEFAULT_MAX_BYTES
    assert events.config.max_age == DEFAULT_MAX_AGE_S
    code, out, err = await _jetstream_init(secured, "operator")  # again: all kept as it is
    assert code == 0 and out.count("there (kept as it is)") == len(streams), out
