"""How a supplier reads an app's secrets when it starts the app's machine
(supplier/secrets.py), on a real nats-server: the keys' scope from the machine's metadata
and order id, the last value of each key, and a start refused when they cannot be read."""

from __future__ import annotations

import msgspec
import pytest
from nats.js.api import KeyValueConfig

from bourse.client.apps.slots import NO_SECRETS
from bourse.nats.connection import connect
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.jetstream import secrets_bucket_name
from bourse.wire.messages import Machine, Resources
from bourse.wire.subjects import Subjects
from supplier.secrets import NoBucket, SecretsUnavailable, owed, scope, with_secrets

BASE = Machine(
    machine_id="mad-1~M1",
    order_id="hello.g1.mad.0",
    worker_id="mad-1",
    region="mad",
    state="reserved",
    resources=Resources(cpus=1, memory_mb=64),
    image="web",
)


def app_machine(order_id: str = "hello.g1.mad.0", fields: str | None = "secrets=ab12") -> Machine:
    meta = {"app": "hello"} | ({"fields": fields} if fields is not None else {})
    return msgspec.structs.replace(BASE, order_id=order_id, metadata=meta)


@pytest.mark.parametrize(
    ("m", "want_scope", "want_owed"),
    [
        (BASE, "", NO_SECRETS),  # a machine of no app
        (app_machine(), "hello", "ab12"),
        (app_machine("alice:hello.g1.mad.0"), "alice.hello", "ab12"),
        (app_machine(fields="image=x,secrets=-"), "hello", NO_SECRETS),
        (app_machine(fields=None), "hello", None),  # placed by a failover
    ],
)
def test_the_keys_scope_and_what_a_machine_is_owed(
    m: Machine, want_scope: str, want_owed: str | None
) -> None:
    assert (scope(m), owed(m)) == (want_scope, want_owed)


async def test_the_last_value_of_each_key_of_the_apps_scope(
    nats_server: EmbeddedNats, subjects: Subjects
) -> None:
    nc = await connect(nats_server.url, name="t", service=False)
    try:
        prefix = subjects.prefix
        env = {"MODE": "blue", "TOKEN": "plain"}
        # no bucket: a machine owed secrets is not started, one placed by a failover is
        with pytest.raises(NoBucket, match=r"secrets_unavailable: .* no secrets bucket"):
            await with_secrets(nc, prefix, app_machine(), env)
        assert await with_secrets(nc, prefix, app_machine(fields=None), env) == env
        with pytest.raises(SecretsUnavailable, match="no connection"):
            await with_secrets(None, prefix, app_machine(), env)

        kv = await nc.jetstream().create_key_value(
            KeyValueConfig(bucket=secrets_bucket_name(prefix), direct=True)
        )
        await kv.put("hello.TOKEN", b"old")
        await kv.put("hello.TOKEN", b"s3cr3t")
        await kv.put("hello.GONE", b"x")
        await kv.delete("hello.GONE")
        await kv.put("hello2.TOKEN", b"another app's")
        await kv.put("alice.hello.TOKEN", b"alice's")
        got = await with_secrets(nc, prefix, app_machine(), env)
        assert got == {"MODE": "blue", "TOKEN": "s3cr3t"}  # the secret over the order's env
        tenant = app_machine("alice:hello.g1.mad.0")
        assert (await with_secrets(nc, prefix, tenant, {}))["TOKEN"] == "alice's"
        nothing = app_machine(fields="secrets=-")
        assert await with_secrets(nc, prefix, nothing, env) == env
    finally:
        await nc.close()
