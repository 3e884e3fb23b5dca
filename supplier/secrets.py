"""An app's secrets given to its machine at start (docs/protocol.md §4.19): read by key
from the market's secrets bucket, never logged, evented or stored here.

A machine of an app carries the app's name in its metadata, and its owner in its order
id (a tenant's is ``<tenant>:<id>``, bourse/wire/tenancy.py), so its secrets are the keys
``<app>.*`` (a tenant's ``<tenant>.<app>.*``). They are read in one request, the last
value of each key (a batched direct get, ``multi_last``: no consumer, no listing), and
put between the order's env and Bourse's own variables.

A machine whose fingerprints say its app had no secrets when it was placed reads nothing;
any other app machine whose secrets cannot be read does not start
(:class:`SecretsUnavailable`): a machine is never started without the secrets it is owed.
One without fingerprints (placed by a failover) whose market has no secrets bucket has
none to be owed, and starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.client.apps.slots import NO_SECRETS, SECRETS, decode_fields
from bourse.nats.jetstream import secrets_bucket_name
from bourse.wire.messages import Machine
from bourse.wire.metadata import APP, FIELDS
from bourse.wire.tenancy import SEPARATOR
from supplier.machines.api import DriverError

SECRETS_UNAVAILABLE = "secrets_unavailable"
READ_TIMEOUT_S = 5.0
# The server's answers that end a batch: 204 its end, 404 nothing matched.
END_OF_BATCH = "204"
NOTHING = "404"
# A key's marker that says it was deleted (a KV delete is a put of one).
KV_OP = "KV-Operation"


class SecretsUnavailable(DriverError):
    """The app's secrets could not be read: its machine is not started."""


class NoBucket(SecretsUnavailable):
    """The market has no secrets bucket (or no JetStream)."""


def scope(m: Machine) -> str:
    """The keys' scope of ``m``'s app (``""`` for a machine of no app)."""
    app = m.metadata.get(APP, "")
    if not app:
        return ""
    tenant, sep, _ = m.order_id.partition(SEPARATOR)
    return f"{tenant}.{app}" if sep else app


def owed(m: Machine) -> str | None:
    """What ``m``'s fingerprints say of its app's secrets when it was placed: their
    revision, ``NO_SECRETS``, or None (one placed by a failover has no fingerprints; a
    machine of no app: ``NO_SECRETS``)."""
    if not scope(m):
        return NO_SECRETS
    return decode_fields(m.metadata.get(FIELDS, "")).get(SECRETS)


async def with_secrets(
    nc: NATS | None, prefix: str, m: Machine, env: Mapping[str, str]
) -> dict[str, str]:
    """``env`` with the secrets of ``m``'s app over it (``env`` itself when it has none)."""
    revision = owed(m)
    if revision == NO_SECRETS:
        return dict(env)
    if nc is None:
        raise _unavailable("no connection to the market to read them from")
    try:
        return dict(env) | await read(nc, secrets_bucket_name(prefix), scope(m))
    except NoBucket:
        if revision is None:
            return dict(env)
        raise


def _unavailable(why: str) -> SecretsUnavailable:
    return SecretsUnavailable(f"{SECRETS_UNAVAILABLE}: the app's secrets cannot be read: {why}")


async def read(nc: NATS, bucket: str, key_scope: str) -> dict[str, str]:
    """The values of ``<key_scope>.*`` in ``bucket``, by name (deleted ones left out)."""
    pre = f"$KV.{bucket}.{key_scope}."
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    out: dict[str, str] = {}
    try:
        request = json.dumps({"multi_last": [f"{pre}*"]}).encode()
        await nc.publish(f"$JS.API.DIRECT.GET.KV_{bucket}", request, reply=inbox)
        while True:
            msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
            status = _status(msg)
            if status in (END_OF_BATCH, NOTHING):
                return out
            if status:
                raise _unavailable(f"the secrets bucket {bucket} answered {status}")
            headers = msg.headers or {}
            if headers.get(KV_OP):  # deleted
                continue
            out[headers.get("Nats-Subject", "").removeprefix(pre)] = msg.data.decode()
    except nats.errors.TimeoutError:
        raise _unavailable(f"the secrets bucket {bucket} did not answer") from None
    finally:
        await sub.unsubscribe()


def _status(msg: Msg) -> str:
    """The status of a server's answer ("" for a message of the stream); no responders
    (no such bucket) is one."""
    status = (msg.headers or {}).get("Status", "")
    if status == "503":
        raise NoBucket(
            f"{SECRETS_UNAVAILABLE}: the app's secrets cannot be read: there is no secrets "
            "bucket (the operator makes it)"
        )
    return status
