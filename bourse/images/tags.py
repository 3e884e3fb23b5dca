"""The tags, watched: a local copy of the tag bucket that a service resolves from.

``TagIndex`` replays the tag bucket (``name:tag`` -> manifest digest) through a KV watch and
then follows it, so resolving a tag is a dictionary lookup, never a JetStream request. A
service starts it in its task group (``await tg.start(index.run)`` returns once the replay
is done); a one-shot tool uses ``async with TagIndex.watching(kv) as index``. An entry that
does not decode is logged and skipped: a bad write by someone else costs that tag, not the
index.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
import msgspec
import structlog
from anyio.abc import TaskStatus
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from bourse.images.errors import BadImage, BadReference, ImageNotFound
from bourse.images.oci import Digest
from bourse.images.reference import Reference, reference_of_key
from bourse.runtime.supervise import unwrap

log = structlog.get_logger("bourse.images")

# Bounds the unsubscribe of a watch being stopped (it runs shielded from cancellation).
STOP_TIMEOUT_S = 2.0


class TagRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The value of one tag's key."""

    digest: Digest
    tagged_ms: int = 0  # when it was written (the writer's clock)


_record = msgspec.json.Decoder(TagRecord)


def decode_record(value: bytes | None, tag: str) -> TagRecord:
    """A tag's value; ``BadImage`` when it is no tag record (someone else wrote it)."""
    try:
        return _record.decode(value or b"")
    except msgspec.DecodeError as exc:
        raise BadImage(f"tag {tag} holds no tag record: {exc}") from None


@dataclass(frozen=True, slots=True)
class TagEntry:
    """One tag: its reference, the manifest it names, its KV revision and write time."""

    reference: Reference
    digest: str
    revision: int
    tagged_ms: int


class TagIndex:
    """The tag bucket's current entries, kept up to date by a watch."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv
        self._tags: dict[str, TagEntry] = {}
        self._changed = anyio.Event()
        # Counts the changes applied: what a reader resolved under one version holds until
        # the next (a resolver keeps its answers while it is unchanged).
        self.version = 0

    @classmethod
    @contextlib.asynccontextmanager
    async def watching(cls, kv: KeyValue) -> AsyncIterator[TagIndex]:
        """An index whose replay is done, watched until the block ends. An error of the
        block is raised as itself (a task group would wrap it in an ExceptionGroup)."""
        index = cls(kv)
        error: BaseException | None = None
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(index.run)
                try:
                    yield index
                except anyio.get_cancelled_exc_class():
                    raise
                except BaseException as exc:
                    error = exc
                tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the watch itself failed
            raise unwrap(group) from None
        if error is not None:
            raise error

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Replay the bucket, say started, then follow it until cancelled."""
        watcher = await self.kv.watchall()
        started = False
        try:
            async for entry in watcher:
                if entry is not None:
                    self._apply(entry)
                if not started and await self._replayed(entry):
                    started = True
                    task_status.started()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(STOP_TIMEOUT_S):
                await watcher.stop()  # type: ignore[no-untyped-call]  # nats-py: unannotated

    async def _replayed(self, entry: KeyValue.Entry | None) -> bool:
        """Is the replay done once ``entry`` is applied: the last entry it sends (nothing
        pending after it), or nats-py's end marker (None) on a bucket with nothing to
        replay. The marker alone says too little: at the watch's start nats-py sends it
        when the server has no entry left to send, even if those it sent have not arrived
        yet (nats.py#842), and a copy started then lacks them (an ``image ls`` without
        its tags, a ``gc`` that finds nothing tagged)."""
        if entry is not None:
            return entry.delta == 0
        return (await self.kv.status()).values == 0

    def _apply(self, entry: KeyValue.Entry) -> None:
        try:
            ref = reference_of_key(entry.key)
        except BadReference as exc:
            log.warning("image_tag_key_skipped", key=entry.key, error=str(exc))
            return
        if entry.operation in (KV_DEL, KV_PURGE):
            self._tags.pop(ref.tagged, None)
        else:
            try:
                record = decode_record(entry.value, ref.tagged)
            except BadImage as exc:
                log.warning("image_tag_value_skipped", tag=ref.tagged, error=str(exc))
                return
            self._tags[ref.tagged] = TagEntry(
                ref, record.digest, entry.revision or 0, record.tagged_ms
            )
        self.version += 1
        self._changed.set()
        self._changed = anyio.Event()

    def resolve(self, ref: Reference | str) -> str:
        """The manifest digest ``ref`` names: its own digest if it has one, else its tag's
        (``ImageNotFound`` when no such tag)."""
        if isinstance(ref, str):
            ref = Reference.parse(ref)
        if ref.digest:
            return ref.digest
        entry = self._tags.get(ref.tagged)
        if entry is None:
            raise ImageNotFound(f"no image tagged {ref.tagged} in the store")
        return entry.digest

    def get(self, ref: Reference) -> TagEntry | None:
        """The entry of ``ref``'s tag, if there is one."""
        return self._tags.get(ref.tagged)

    def entries(self) -> list[TagEntry]:
        """Every tag, by name."""
        return [self._tags[k] for k in sorted(self._tags)]

    async def wait_until(self, check: Callable[[TagIndex], bool]) -> None:
        """Return once ``check(self)`` holds (tested now and after every change)."""
        while not check(self):
            await self._changed.wait()
