"""What is kept of apps in JetStream KV: each app's record (``<PREFIX>_APPS``, one key per
app: its applied spec, generation and slots, and its secrets' names), and its secrets'
values (``<PREFIX>_APP_SECRETS``, one key per app and name). A tenant's keys are under its
name (``<tenant>.<app>``), and a tenant reaches no other key (bourse/nats/grants.py).

Values are written here, never read: the secrets' bucket is write-only for buyers and
tenants, so what a command shows or compares of secrets (their names, their revision) is
kept in the app's record, updated by the same command that writes the values. Suppliers
read the values by key (supplier/secrets.py).

Records are written revision-checked: a record that changed since it was read (another
deploy, a secret set meanwhile) is :class:`AppChanged`, never overwritten.

The generation changes only when what the machines are made from does: the canonical
digest of the spec and the secrets' revision (:func:`next_generation`, pure).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import ClassVar, Self

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    KeyValueConfig,
    StorageType,
)
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE, KeyValue
from nats.nuid import NUID

from bourse.client.apps.slots import SlotRecord
from bourse.client.apps.spec import AppSpec
from bourse.errors import BourseError
from bourse.nats.jetstream import apps_bucket_name, secrets_bucket_name
from bourse.wire.limits import ENV_KEY_PATTERN

API_TIMEOUT_S = 10.0
_ENV_KEY = re.compile(ENV_KEY_PATTERN)
# How often a change of the secrets' names is tried again over a record that moved meanwhile.
RECORD_TRIES = 5
# A listing's consumer is the server's to remove this long after nobody reads it (a tenant
# may not delete consumers: their names are not under its own).
LISTING_INACTIVE_S = 5.0


class AppStoreError(BourseError, RuntimeError):
    """The apps' buckets cannot be used (no JetStream, no such bucket, refused)."""


class AppChanged(BourseError, RuntimeError):
    """The app's record changed since it was read (another deploy, secrets set meanwhile)."""


class AppRecord(msgspec.Struct, frozen=True, kw_only=True):
    """An app's record: its spec as last applied (None: secrets set before its first
    deploy), the generation and the digest it is of, the secrets' revision it was applied
    with, its slots, its secrets now (name -> the KV revision of its value; no value), and
    the machines a deploy is draining (the edges send them no new request) before it stops
    and destroys them."""

    spec: AppSpec | None = None
    generation: int = 0
    digest: str = ""
    secrets_revision: str = ""
    slots: dict[str, SlotRecord] = {}
    secrets: dict[str, int] = {}
    draining: list[str] = []

    @property
    def secrets_now(self) -> str:
        """The revision of the secrets as they are now (what a deploy applies)."""
        return revision_of(self.secrets)


def next_generation(
    previous: AppRecord | None, spec: AppSpec, secrets_revision: str
) -> tuple[int, str]:
    """The generation ``spec`` is applied under (the same as before when its digest is) and
    that digest."""
    digest = spec.digest(secrets_revision)
    if previous is None:
        return 1, digest
    if previous.digest == digest:
        return previous.generation, digest
    return previous.generation + 1, digest


def check_secret_name(name: str) -> str:
    """A secret's name is the variable the machine gets it as."""
    if not _ENV_KEY.match(name):
        raise BourseError(
            f"{name!r} is not a valid variable name for a secret: letters, digits and _, "
            "not starting with a digit (at most 128)"
        )
    return name


def revision_of(revisions: dict[str, int]) -> str:
    """The digest of the names and their KV revisions (never of the values)."""
    if not revisions:
        return ""
    doc = ",".join(f"{k}={v}" for k, v in sorted(revisions.items()))
    return hashlib.sha256(doc.encode()).hexdigest()[:12]


async def _bucket(
    nc: NATS, name: str, what: str, *, create: bool, replicas: int = 1
) -> KeyValue | None:
    js = nc.jetstream(timeout=API_TIMEOUT_S)
    try:
        return await js.key_value(name)
    except nats.js.errors.BucketNotFoundError:
        if not create:
            return None
    except nats.errors.NoRespondersError:
        raise AppStoreError(f"the NATS server has no JetStream: {what} need it") from None
    config = KeyValueConfig(
        bucket=name,
        description=f"Bourse {what}",
        history=1,
        storage=StorageType.FILE,
        replicas=replicas,
        # keys read by subject from any replica: how a tenant reads its own keys and a
        # supplier an app's secrets (several keys in one request)
        direct=True,
    )
    try:
        return await js.create_key_value(config)
    except nats.js.errors.APIError as exc:
        raise AppStoreError(f"cannot make the {what} bucket {name}: {exc}") from None


def _unlooked(nc: NATS, name: str) -> KeyValue:
    """The bucket as a tenant uses it: not looked up (a bucket's info would show every
    tenant's keys, so a tenant may not ask for it), its keys reached directly."""
    js = nc.jetstream(timeout=API_TIMEOUT_S)
    return KeyValue(name=name, stream=f"KV_{name}", pre=f"$KV.{name}.", js=js, direct=True)


def _scoped(tenant: str, app: str) -> str:
    return f"{tenant}.{app}" if tenant else app


class _KvStore:
    """A bucket of the apps (``kv`` None: absent, opened without ``create``: empty), seen
    as a tenant (its keys under its name) or as the operator."""

    WHAT: ClassVar[str]

    @staticmethod
    def bucket_name(prefix: str) -> str:
        """The bucket's name for a subject prefix."""
        raise NotImplementedError

    def __init__(
        self, kv: KeyValue | None, tenant: str = "", nc: NATS | None = None, name: str = ""
    ) -> None:
        self.kv = kv
        self.tenant = tenant
        self.nc = nc
        self.name = name

    @classmethod
    async def open(
        cls, nc: NATS, prefix: str, *, tenant: str = "", create: bool = True, replicas: int = 1
    ) -> Self:
        """The store of ``prefix``; its bucket made on first use with ``create`` (where
        the key may; ``replicas``: the operator's set-up). A tenant's is made by the
        operator's set-up: it is used without a look-up."""
        name = cls.bucket_name(prefix)
        if tenant:
            return cls(_unlooked(nc, name), tenant, nc, name)
        kv = await _bucket(nc, name, cls.WHAT, create=create, replicas=replicas)
        return cls(kv, tenant, nc, name)

    def _missing(self) -> AppStoreError:
        return AppStoreError(
            f"the {self.WHAT} bucket {self.name} is missing: the operator makes it "
            "(bourse jetstream init)"
        )


class AppStore(_KvStore):
    """The apps' records: one key per app."""

    WHAT = "apps' specs"
    bucket_name = staticmethod(apps_bucket_name)

    async def read(self, app: str) -> tuple[AppRecord | None, int]:
        """The app's record (None: never applied, or destroyed) and its KV revision (0:
        no key, or the revision of its deletion: what a revision-checked write names)."""
        return await self._read_key(_scoped(self.tenant, app))

    async def _read_key(self, key: str) -> tuple[AppRecord | None, int]:
        if self.kv is None:
            return None, 0
        try:
            entry = await self.kv.get(key)
        except nats.js.errors.KeyNotFoundError as exc:
            return None, (exc.entry.revision or 0) if exc.entry is not None else 0
        except nats.errors.NoRespondersError:
            raise self._missing() from None
        return msgspec.json.decode(entry.value or b"", type=AppRecord), entry.revision or 0

    async def get(self, app: str) -> AppRecord | None:
        """The app's record (None: never applied, or destroyed)."""
        return (await self.read(app))[0]

    async def write(self, app: str, record: AppRecord, last: int, by: str = "command") -> int:
        """Keep ``record`` as the app's if its key is still at revision ``last`` (0: none);
        its new revision. Moved meanwhile: :class:`AppChanged` (``by``: what says so)."""
        assert self.kv is not None, "a store opened with create=False writes nothing"
        key, value = _scoped(self.tenant, app), msgspec.json.encode(record)
        try:
            return await self.kv.update(key, value, last=last)
        except nats.js.errors.KeyWrongLastSequenceError:
            raise AppChanged(f"app {app!r} changed while this {by} ran: run it again") from None
        except nats.errors.NoRespondersError:
            raise self._missing() from None

    async def change(self, app: str, how: Callable[[AppRecord], AppRecord]) -> AppRecord:
        """Write ``how`` of the app's record (an empty one when there is none), read again
        and redone while another command changes it meanwhile."""
        for _ in range(RECORD_TRIES - 1):
            try:
                return await self._change_once(app, how)
            except AppChanged:
                continue
        return await self._change_once(app, how)

    async def _change_once(self, app: str, how: Callable[[AppRecord], AppRecord]) -> AppRecord:
        record, last = await self.read(app)
        new = how(record or AppRecord())
        await self.write(app, new, last)
        return new

    async def retire(self, app: str) -> None:
        """Forget the app's spec, slots and secrets (its machines are destroyed first), and
        keep its generation: a deploy of the same name later is a new generation, so its
        slots' order ids are new and no claim hands back a destroyed machine."""
        await self.change(app, lambda r: AppRecord(generation=r.generation))

    async def listed(self) -> list[tuple[str, AppRecord]]:
        """Every app this key sees, with a spec, as (its tenant, its record): a tenant's
        own (its name); the shared key's, every tenant's too ("" for those of no tenant:
        it reads every record, as it lists every machine), by tenant, then app."""
        out = []
        for key in sorted(await self._keys(), key=lambda k: k.rpartition(".")[::2]):
            record, _ = await self._read_key(key)
            if record is not None and record.spec is not None:
                out.append((key.rpartition(".")[0], record))
        return out

    async def names(self) -> list[str]:
        """The apps kept (this tenant's, or those of no tenant)."""
        scope = f"{self.tenant}." if self.tenant else ""
        keys = await self._keys()
        return sorted(
            k.removeprefix(scope) for k in keys if k.startswith(scope) and (scope or "." not in k)
        )

    async def _keys(self) -> list[str]:
        """The keys this store sees: a tenant's own (``<tenant>.<app>``), or every key."""
        if self.kv is None:
            return []
        if self.tenant:
            return await self._own_keys()
        try:
            return await self.kv.keys()
        except nats.js.errors.NoKeysError:
            return []

    async def _own_keys(self) -> list[str]:
        """The tenant's keys: a consumer of the bucket's stream whose filter, its keys'
        subjects, is in the subject that makes it (what the tenant's grant allows), headers
        only, the last of each key."""
        assert self.kv is not None and self.nc is not None
        pre = f"$KV.{self.name}."
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox)
        config = ConsumerConfig(
            name=NUID().next().decode(),
            deliver_subject=inbox,
            filter_subject=f"{pre}{self.tenant}.>",
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=AckPolicy.NONE,
            headers_only=True,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=LISTING_INACTIVE_S,
        )
        keys: list[str] = []
        try:
            js = self.nc.jetstream(timeout=API_TIMEOUT_S)
            try:
                info = await js.add_consumer(f"KV_{self.name}", config)
            except nats.errors.NoRespondersError:
                raise self._missing() from None
            pending = info.num_pending or 0
            while pending > 0:
                msg = await sub.next_msg(timeout=API_TIMEOUT_S)
                pending = int(msg.reply.rsplit(".", 1)[-1])
                if (msg.headers or {}).get(KV_OP) not in (KV_DEL, KV_PURGE):
                    keys.append(msg.subject.removeprefix(pre))
        finally:
            await sub.unsubscribe()
        return keys


class SecretStore(_KvStore):
    """The apps' secrets' values: one key per app and name, written, never read here (the
    names are the app's record's; suppliers read values: supplier/secrets.py)."""

    WHAT = "apps' secrets"
    bucket_name = staticmethod(secrets_bucket_name)

    def _key(self, app: str, name: str) -> str:
        return f"{_scoped(self.tenant, app)}.{check_secret_name(name)}"

    async def set(self, app: str, values: dict[str, str]) -> dict[str, int]:
        """Write ``values``; each name's new KV revision."""
        assert self.kv is not None, "a store opened with create=False writes nothing"
        out = {}
        try:
            for name, value in values.items():
                out[name] = await self.kv.put(self._key(app, name), value.encode())
        except nats.errors.NoRespondersError:
            raise self._missing() from None
        return out

    async def unset(self, app: str, names: list[str]) -> None:
        """Remove ``names`` (the app's record says which it has)."""
        if self.kv is None:
            return
        try:
            for name in names:
                await self.kv.delete(self._key(app, name))
        except nats.errors.NoRespondersError:
            raise self._missing() from None
