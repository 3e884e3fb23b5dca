"""What is kept of apps in JetStream KV: each app's applied spec, its generation and its
slots (``<PREFIX>_APPS``, one key per app), and its secrets (``<PREFIX>_APP_SECRETS``, one
key per app and name). A tenant's keys are under its name (``<tenant>.<app>``).

The generation changes only when what the machines are made from does: the canonical
digest of the spec and the secrets' revision (:func:`next_generation`, pure).
"""

from __future__ import annotations

import hashlib
import re
from typing import ClassVar, Self

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from bourse.client.apps.slots import SlotRecord
from bourse.client.apps.spec import AppSpec
from bourse.errors import BourseError
from bourse.nats.jetstream import apps_bucket_name, secrets_bucket_name
from bourse.wire.limits import ENV_KEY_PATTERN

API_TIMEOUT_S = 10.0
_NOT_ENABLED = frozenset({10039, 10076})  # JetStream's "not enabled" error codes
_ENV_KEY = re.compile(ENV_KEY_PATTERN)


class AppStoreError(BourseError, RuntimeError):
    """The apps' buckets cannot be used (no JetStream, no such bucket, refused)."""


class AppRecord(msgspec.Struct, frozen=True, kw_only=True):
    """An app as last applied: its spec, generation, the digest the generation is of, the
    secrets' revision it was applied with, and its slots."""

    spec: AppSpec
    generation: int
    digest: str
    secrets_revision: str = ""
    slots: dict[str, SlotRecord] = {}


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
    )
    try:
        return await js.create_key_value(config)
    except nats.js.errors.APIError as exc:
        raise AppStoreError(f"cannot make the {what} bucket {name}: {exc}") from None


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

    def __init__(self, kv: KeyValue | None, tenant: str = "") -> None:
        self.kv = kv
        self.tenant = tenant

    @classmethod
    async def open(
        cls, nc: NATS, prefix: str, *, tenant: str = "", create: bool = True, replicas: int = 1
    ) -> Self:
        """The store of ``prefix``; its bucket made on first use with ``create`` (where
        the key may; ``replicas``: the operator's set-up)."""
        name = cls.bucket_name(prefix)
        kv = await _bucket(nc, name, cls.WHAT, create=create, replicas=replicas)
        return cls(kv, tenant)


class AppStore(_KvStore):
    """The apps' specs, generations and slots: one key per app."""

    WHAT = "apps' specs"
    bucket_name = staticmethod(apps_bucket_name)

    async def get(self, app: str) -> AppRecord | None:
        """The app's record (None: never applied, or destroyed)."""
        if self.kv is None:
            return None
        try:
            entry = await self.kv.get(_scoped(self.tenant, app))
        except nats.js.errors.KeyNotFoundError:
            return None
        return msgspec.json.decode(entry.value or b"", type=AppRecord)

    async def put(self, record: AppRecord) -> None:
        """Keep ``record`` as the app's."""
        assert self.kv is not None, "a store opened with create=False writes nothing"
        await self.kv.put(_scoped(self.tenant, record.spec.app), msgspec.json.encode(record))

    async def delete(self, app: str) -> None:
        """Forget the app (its machines are destroyed first)."""
        if self.kv is not None:
            await self.kv.delete(_scoped(self.tenant, app))

    async def names(self) -> list[str]:
        """The apps kept (this tenant's, or those of no tenant)."""
        if self.kv is None:
            return []
        try:
            keys = await self.kv.keys()
        except nats.js.errors.NoKeysError:
            return []
        scope = f"{self.tenant}." if self.tenant else ""
        return sorted(
            k.removeprefix(scope) for k in keys if k.startswith(scope) and (scope or "." not in k)
        )


class SecretStore(_KvStore):
    """The apps' secrets: one key per app and name. Values are written, never read here
    (the names and revisions are read without them; suppliers read values: protocol §4.21)."""

    WHAT = "apps' secrets"
    bucket_name = staticmethod(secrets_bucket_name)

    def _key(self, app: str, name: str) -> str:
        return f"{_scoped(self.tenant, app)}.{check_secret_name(name)}"

    async def set(self, app: str, values: dict[str, str]) -> None:
        assert self.kv is not None, "a store opened with create=False writes nothing"
        for name, value in values.items():
            await self.kv.put(self._key(app, name), value.encode())

    async def unset(self, app: str, names: list[str]) -> list[str]:
        """Remove ``names``; the ones the app did not have are returned."""
        have = await self.revisions(app)
        for name in names:
            if name in have and self.kv is not None:
                await self.kv.delete(self._key(app, name))
        return [n for n in names if n not in have]

    async def revisions(self, app: str) -> dict[str, int]:
        """The app's secrets' names and each one's KV revision (no values)."""
        if self.kv is None:
            return {}
        scope = _scoped(self.tenant, app) + "."
        # headers only: the values never leave the server
        watcher = await self.kv.watch(scope + "*", ignore_deletes=True, meta_only=True)
        out: dict[str, int] = {}
        try:
            async for entry in watcher:
                if entry is None:  # the end of what is stored now
                    break
                out[entry.key.removeprefix(scope)] = entry.revision or 0
        finally:
            await watcher.stop()
        return out

    async def revision(self, app: str) -> str:
        """The secrets' revision: changes when a secret is set or unset ("" for none)."""
        return revision_of(await self.revisions(app))


def revision_of(revisions: dict[str, int]) -> str:
    """The digest of the names and their KV revisions (never of the values)."""
    if not revisions:
        return ""
    doc = ",".join(f"{k}={v}" for k, v in sorted(revisions.items()))
    return hashlib.sha256(doc.encode()).hexdigest()[:12]
