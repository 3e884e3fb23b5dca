"""The apps' service sections (docs/protocol.md §4.19: ``[service]`` of an app's spec), as
the edge follows them: a watch of the apps bucket ``<PREFIX>_APPS`` (each app's record, its
spec as last deployed), kept by app key (``web``, a tenant's ``web.acme``). The routes take
an app's port and limits from it, and its ``draining`` machines (a deploy drains them
before it destroys them: no new request); the starts its ``auto_start`` (and a placement
the whole record: its spec, generation and slots), the idle stops its ``auto_stop``,
``idle_s`` and ``min_machines_running``. An app without a record (placed by hand) has
none: the edge's own options say (``--port``, ``--soft-limit``...; started by its
requests, never stopped when idle).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import msgspec
import structlog

from bourse.client.apps.spec import AppService
from bourse.client.apps.store import AppRecord, AppStore
from edge.routing import app_key

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS
    from nats.js.kv import KeyValue

log = structlog.get_logger("bourse.edge")

RETRY_S = 5.0  # no apps bucket yet (nothing deployed): looked for again this often
STOP_TIMEOUT_S = 2.0
KV_DEL, KV_PURGE = "DEL", "PURGE"


def key_of(bucket_key: str) -> str:
    """The bucket's key (``web``, a tenant's ``acme.web``) -> the edge's app key (``web``,
    ``web.acme``)."""
    tenant, sep, app = bucket_key.partition(".")
    return app_key(app, tenant) if sep else bucket_key


def record_of(value: bytes) -> AppRecord | None:
    """A record's JSON with its spec (None: no spec, or not a record)."""
    try:
        record = msgspec.json.decode(value, type=AppRecord)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return record if record.spec is not None else None


class AppServices:
    """Each app's service section, followed (see the module doc); ``observers`` are told
    after each change."""

    def __init__(self, nc: NATS, prefix: str) -> None:
        self.nc = nc
        self.prefix = prefix
        self.services: dict[str, AppService] = {}
        self.records: dict[str, AppRecord] = {}  # the whole record (a placement reads it)
        self.draining: frozenset[str] = frozenset()  # every app's draining machines
        self.observers: list[Callable[[], None]] = []

    def get(self, key: str) -> AppService | None:
        return self.services.get(key)

    def auto_start(self, key: str) -> bool:
        """Whether a request may start a machine of app ``key`` (no section: it may)."""
        svc = self.services.get(key)
        return svc is None or svc.auto_start

    def wanted(self, key: str, region: str) -> int | None:
        """The machines app ``key`` wants running in ``region`` (its spec's count there, 0
        where it does not run; None: no spec)."""
        record = self.records.get(key)
        if record is None or record.spec is None:
            return None
        return record.spec.count if region in record.spec.regions else 0

    @property
    def all(self) -> Mapping[str, AppService]:
        return self.services

    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Replay the bucket, say started, then follow it until cancelled (no bucket yet:
        started at once, looked for every RETRY_S)."""
        started = False
        while True:
            try:
                store = await AppStore.open(self.nc, self.prefix, create=False)
            except Exception as exc:  # no JetStream, refused: the edge routes without
                log.warning("services_unavailable", error=str(exc))
                store = None
            kv = store.kv if store is not None else None
            if kv is not None:
                await self._follow(kv, task_status if not started else None)
                return
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(RETRY_S)  # a look for the bucket, not a synchronisation

    async def _follow(self, kv: KeyValue, task_status: anyio.abc.TaskStatus[None] | None) -> None:
        watcher = await kv.watchall()
        try:
            async for entry in watcher:
                if entry is not None:
                    self._apply(entry.key, entry.value, entry.operation)
                if task_status is not None and (
                    (entry is not None and entry.delta == 0)
                    or (entry is None and (await kv.status()).values == 0)
                ):
                    task_status.started()
                    task_status = None
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_TIMEOUT_S):
                await watcher.stop()

    def _apply(self, bucket_key: str, value: bytes | None, operation: str | None) -> None:
        key = key_of(bucket_key)
        record = None if operation in (KV_DEL, KV_PURGE) else record_of(value or b"")
        service = record.spec.service if record is not None and record.spec is not None else None
        if record is None:
            self.records.pop(key, None)
        else:
            self.records[key] = record
        draining = frozenset(m for r in self.records.values() for m in r.draining)
        drained, self.draining = self.draining != draining, draining
        if drained:
            log.info("draining", app=key, machines=record.draining if record else [])
        if not self._service(key, service) and not drained:
            return
        for observe in self.observers:
            observe()

    def _service(self, key: str, service: AppService | None) -> bool:
        """Keep app ``key``'s section: whether it changed."""
        if service is None:
            if self.services.pop(key, None) is None:
                return False
        elif self.services.get(key) == service:
            return False
        else:
            self.services[key] = service
        log.info("service", app=key, service=msgspec.to_builtins(service) if service else None)
        return True
