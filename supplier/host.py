"""The supplier daemon's NATS side: one connection, one store, one or many workers.

Per region the host has ONE subscription each for bids, region releases and status, and
fans a message out to its workers of that region in-process, so a thousand virtual workers
cost a thousand dict entries rather than a thousand deliveries. Each worker has its own
subscription for what is addressed to it (``<root>.worker.<id>.>``).

This is the NATS shell: it decodes, asks the desk (supplier/desk.py) how to answer a bid
and sends what the desk returns, each reply after its delay, through the outbox. It makes
no market decision itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Iterable

import anyio
import anyio.abc
import msgspec
import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.errors import BourseError
from bourse.nats.auth import is_inbox
from bourse.nats.connection import flush_all
from bourse.nats.jetstream import EventStream
from bourse.nats.responder import Responder, subject_region_mismatch
from bourse.runtime.metrics import SupplierMetrics, WorkerSample
from bourse.runtime.supervise import cleanup_scope
from bourse.wire.codec import BadMessage, decode, encode
from bourse.wire.limits import MAX_BATCH_ITEMS, MAX_BATCH_OFFERS, MAX_HOLD_MS
from bourse.wire.messages import (
    MACHINE_VERBS,
    Answers,
    Batch,
    Bid,
    Commit,
    Event,
    ExplainRequest,
    ListMachines,
    Machine,
    MachineRequest,
    Offer,
    Offers,
    Placed,
    ReclaimCheck,
    ReclaimReply,
    ReclaimVerdict,
    ReclaimVerdicts,
    Release,
    StatusRequest,
    Waiting,
    now_ms,
    worker_of_machine,
)
from bourse.wire.signing import OfferSigner
from bourse.wire.subjects import Subjects, shard_of
from supplier.candidates import DEFAULT_QUOTE_SAMPLE, BidGroup
from supplier.config import WorkerConfig, check_workers
from supplier.desk import DEFAULT_MAX_OFFERS, Desk, Send, explanation_pages
from supplier.images import ImageListener
from supplier.outbox import AT_MOST_ONCE_KINDS, EventOutbox, Outbox
from supplier.reclaim import DEFAULT_AFTER_S as DEFAULT_RECLAIM_AFTER_S
from supplier.reclaim import check_every
from supplier.store import Store, StoreError
from supplier.worker import Worker

log = structlog.get_logger("bourse.supplier")

SWEEP_INTERVAL_S = 0.05
# Bids queued beyond this many on one subscription are shed (answered by nobody here).
DEFAULT_MAX_BID_BACKLOG = 64
CLAIM_CHECK_S = 0.5
RECLAIM_TIMEOUT_S = 2.0  # a ReclaimCheck: one KV read per machine at the exchange
# A region release can overtake its own bid (they travel on two subscriptions). The host
# remembers released (order, auction) pairs this long and ignores such late bids.
TOMBSTONE_TTL_S = 5.0
# While the store refuses writes, probe it this often; a success lifts the drain.
STORE_PROBE_INTERVAL_S = 1.0
# A stop's bounds: the answers under way (a commit's fsync), the machines (their lifecycle
# work, then their processes: SIGTERM, SIGKILL after the grace or when this runs out), the
# outbox's last messages, and the whole stop, so SIGTERM ends the process within 2 s.
HANDLERS_S = 0.5
MACHINES_S = 0.7
OUTBOX_S = 0.3
STOP_S = 1.5


class WorkerIdInUse(BourseError, RuntimeError):
    pass


class SupplierHost:
    def __init__(
        self,
        nc: NATS,
        workers: list[WorkerConfig],
        store: Store,
        subjects: Subjects | None = None,
        max_offers: int = DEFAULT_MAX_OFFERS,
        bid_shards: int = 0,
        max_bid_backlog: int = DEFAULT_MAX_BID_BACKLOG,
        signer: OfferSigner | None = None,
        quote_sample: int = DEFAULT_QUOTE_SAMPLE,
        event_stream: EventStream | None = None,
        metrics: SupplierMetrics | None = None,
        reclaim_after_s: float = DEFAULT_RECLAIM_AFTER_S,
        reclaim_every_s: float | None = None,
    ) -> None:
        check_workers(workers)
        # Orphans (supplier/reclaim.py): reserved machines asked about after this long
        # (0: never), looked for every reclaim_every_s (default: half that, at most 5 s).
        self.reclaim_every_s = reclaim_every_s or check_every(reclaim_after_s)
        # Signs every Offer this host sends (the auction may require it: --trust).
        self.signer = signer
        # This process's name in its prompt answers (Offers.responder, §4.4.3): random per
        # start, so the auction counts each running process once.
        self.responder_id = secrets.token_hex(8)
        # How bids are answered: the pure core this shell asks (supplier/desk.py).
        self.desk: Desk[Worker] = Desk(max_offers, quote_sample)
        self.bid_shards = bid_shards
        self.max_bid_backlog = max_bid_backlog
        self.bids_shed = 0
        self.bids_refused = 0  # bids of a Batch refused one by one (wrong region, no inbox)
        self._shed_logged = 0
        self._bid_subs: dict[str, Subscription] = {}
        self.nc = nc
        self.subjects = subjects or Subjects()
        self.store = store
        self.workers: dict[str, Worker] = {}
        self.by_region: dict[str, list[Worker]] = {}
        for cfg in workers:
            w = Worker(
                cfg,
                store,
                self._emit,
                on_freed=self._freed,
                on_grew=self._grew,
                on_image=self._image_listener(cfg.worker_id),
                reclaim_after_s=reclaim_after_s,
            )
            self.workers[cfg.worker_id] = w
            self.by_region.setdefault(cfg.region, []).append(w)
        self.groups = self._bid_groups()
        # order id -> the worker here that placed it (a retry must price that one: I3)
        self.owners: dict[str, Worker] = {}
        self.released: OrderedDict[tuple[str, str], float] = OrderedDict()
        # (order, auction) -> (when, the workers asked to hold or wait for it): a region
        # release then touches those, not every worker of the region in this process.
        self.asked: OrderedDict[tuple[str, str], tuple[float, list[Worker]]] = OrderedDict()
        self._subs: list[Subscription] = []
        self.outbox = Outbox(nc)  # delayed bid replies and hold_expired, no task each
        # Events of committed changes, exactly once from the store's outbox table.
        self.events = EventOutbox(nc, store, self.subjects, event_stream)
        self._tasks: anyio.abc.TaskGroup | None = None  # run()'s: the sweeper, probe, handlers
        self.store_failing = False  # the store refused a write: every worker here drains
        self._next_probe = 0.0
        self._probing = False
        if metrics is not None:  # state is read at scrape time; only a commit is timed
            metrics.watch_workers(self._worker_samples, lambda: self.bids_shed)
            metrics.watch_outbox("publish", self.outbox.__len__)
            metrics.watch_outbox("events", lambda: self.events.backlog)  # durable, unacked
            metrics.watch_replies("supplier", self._reply_counts)
            store.on_commit = metrics.store_commit.observe

    def _worker_samples(self) -> list[WorkerSample]:
        """Every worker's ledger as the metrics scrape reads it (from the endpoint's thread:
        plain reads of immutable tuples)."""
        return [
            WorkerSample(
                w.worker_id,
                w.region,
                w.ledger.capacity,
                w.ledger.committed,
                w.ledger.held,
                len(w.ledger.holds),
                w.draining,
            )
            for w in self.workers.values()
        ]

    def _reply_counts(self) -> Counter[str]:
        responder = getattr(self, "responder", None)  # made by run()
        return responder.counts if responder is not None else Counter()

    # -- bid groups -----------------------------------------------------------------------------
    def _bid_groups(self) -> dict[str, BidGroup[Worker]]:
        """Bid subject -> the workers it reaches here, with their image index: the region's
        subject, and its shards' when bids may be sampled by shard."""
        s = self.subjects
        groups = {s.bid(region): BidGroup(ws) for region, ws in self.by_region.items()}
        by_shard: dict[tuple[str, int], list[Worker]] = {}
        for w in self.workers.values() if self.bid_shards else ():
            key = (w.region, shard_of(w.worker_id, self.bid_shards))
            by_shard.setdefault(key, []).append(w)
        groups.update(
            (s.bid_shard(region, shard), BidGroup(ws)) for (region, shard), ws in by_shard.items()
        )
        self._groups_of: dict[str, list[BidGroup[Worker]]] = {}
        for group in groups.values():
            for w in group.workers:
                self._groups_of.setdefault(w.worker_id, []).append(group)
                for image in w.images:
                    group.image_changed(w, image, True)
        return groups

    def _image_listener(self, worker_id: str) -> ImageListener:
        """Keeps the bid groups' image index current as a worker pulls and evicts."""

        def changed(image: str, cached: bool) -> None:
            w = self.workers[worker_id]
            for group in self._groups_of.get(worker_id, ()):
                group.image_changed(w, image, cached)

        return changed

    # -- life ---------------------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled: check no other process serves these workers, recover
        them from the store, subscribe, say ``started``, serve; then, shielded and bounded:
        unsubscribe, let the answers under way finish, stop the machines, send what the
        outbox holds. The outbox pump, each worker's machines (Machines.run: lifecycle work
        and the driver's supervisors), the sweeper and the store probe run in this task
        group; the handlers in the responder's tasks, which the stop ends. Raises
        WorkerIdInUse before ``started`` if a worker is taken."""
        await self._check_unclaimed()  # before any task: a taken id is one plain error
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            self.responder = Responder(self.nc, "supplier")
            await tasks.start(self.outbox.run)
            await self.events.start()  # before any write of this run: rows stay in order
            await tasks.start(self.events.run)
            try:
                await self._start(tasks)
                task_status.started()
                await anyio.sleep_forever()
            finally:
                with cleanup_scope(STOP_S):
                    await self._stop()
                tasks.cancel_scope.cancel()  # the sweeper and the probe: nothing left to do

    async def _start(self, tasks: anyio.abc.TaskGroup) -> None:
        for w in self.workers.values():
            await tasks.start(w.keeper.run)  # before anything may start or abort a machine
            w.recover()
            for order_id in w.by_order:
                self.owners[order_id] = w
        g = self.responder.guard
        s = self.subjects
        for subject in self.groups:  # the region's subject, and its shards' (sampled bids)
            sub = await self.nc.subscribe(subject, cb=g(self._on_bid))
            self._bid_subs[subject] = sub
            self._subs.append(sub)
        for region in self.by_region:
            sub = await self.nc.subscribe(s.bid_batch(region), cb=g(self._on_batch))
            self._bid_subs[s.bid_batch(region)] = sub
            self._subs.append(sub)
            self._subs.append(
                await self.nc.subscribe(s.region_release(region), cb=g(self._on_region_release))
            )
            fanout = self.responder.subscribe_fanout  # every worker here answers: bounded
            self._subs.append(await fanout(s.status(region), self._on_status))
            self._subs.append(await fanout(s.explain(region), self._on_explain))
            self._subs.append(await fanout(s.machines(region), self._on_machines))
        self._subs.append(await self.responder.subscribe_fanout(s.status_every, self._on_status))
        self._subs.append(
            await self.responder.subscribe_fanout(s.machines_every, self._on_machines)
        )
        for wid in self.workers:
            self._subs.append(await self.nc.subscribe(s.worker_all(wid), cb=g(self._on_worker)))
        await flush_all(self.nc)
        tasks.start_soon(self._sweep)
        if any(w.reclaims.after_ms > 0 for w in self.workers.values()):
            tasks.start_soon(self._reclaim_orphans)
        for w in self.workers.values():  # machines that should run are started again
            await w.keeper.resume()
        log.info("supplier_started", workers=len(self.workers), regions=sorted(self.by_region))

    async def _check_unclaimed(self) -> None:
        """Refuse to start if another process already serves one of our worker ids: two
        processes answering one worker's commits could place two machines for one order."""

        async def served(wid: str) -> bool:
            try:
                await self.nc.request(
                    self.subjects.worker_machine(wid, "list"), b"", timeout=CLAIM_CHECK_S
                )
            except nats.errors.NoRespondersError:
                return False
            except nats.errors.TimeoutError:
                # Someone subscribes but does not answer: a passive listener (a `nats sub`
                # on bourse.v1.>) rather than a supplier, which would answer machine.list.
                log.warning("worker_subject_has_silent_listener", worker_id=wid)
                return False
            return True

        ids = list(self.workers)
        taken = [w for w, t in zip(ids, await asyncio.gather(*map(served, ids)), strict=True) if t]
        if taken:
            raise WorkerIdInUse(
                f"worker id(s) {', '.join(taken[:5])} already served by another supplier process"
            )

    async def _stop(self) -> None:
        """Each step bounded, and each runs even if the one before it failed: every
        worker's Machines.run must end (it is shielded) and the outbox must be closed."""
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        try:
            await self.responder.finish(HANDLERS_S)
        finally:
            try:
                # every worker's machines at once; each close ends its Machines.run even
                # when this bound cuts it short (its driver then kills what still runs)
                with anyio.move_on_after(MACHINES_S):
                    async with anyio.create_task_group() as machines:
                        for w in self.workers.values():
                            machines.start_soon(w.keeper.close)
            finally:
                # the durable events' outbox last: what it cannot send in time stays in the
                # SQLite outbox and goes out after the restart (exactly once all the same)
                await self.outbox.close(OUTBOX_S)
                await self.events.close(OUTBOX_S)
        log.info("supplier_stopped", workers=len(self.workers))

    def _emit(self, event: Event) -> None:
        """At-most-once events go out now; the others were written to the store's outbox
        with their change and go out from there (``self.events``)."""
        if event.kind not in AT_MOST_ONCE_KINDS:
            return
        subject = self.subjects.event(event.region, event.worker_id, event.kind)
        self.outbox.post(subject, encode(event))

    def _region_of(self, msg: Msg) -> str:
        return self.subjects.tail(msg.subject, 1)[0]

    # -- bids -------------------------------------------------------------------------------------
    async def _on_bid(self, msg: Msg) -> None:
        if self._shed(msg):
            return
        bid = decode(msg.data, Bid)
        region = self.subjects.tail(msg.subject, 1)[0]
        if bid.region != region:
            raise subject_region_mismatch("bid", bid.region, region)
        if not msg.reply:
            return
        for answer in self._answer_bid(bid, msg.reply, self.groups[msg.subject]):
            self.outbox.post(msg.reply, encode(answer))

    def _shed(self, msg: Msg) -> bool:
        sub = self._bid_subs.get(msg.subject)
        if sub is not None and sub.pending_msgs > self.max_bid_backlog:
            # Overloaded: this bid waited behind a deep queue, so its auction has most
            # likely moved on. Shedding the oldest bids lets the fresh ones be answered in
            # time, instead of answering every auction too late (collapse).
            self.bids_shed += 1
            return True
        return False

    async def _on_batch(self, msg: Msg) -> None:
        """A Batch (docs/protocol.md §4.4.4): its region releases, then its bids, each as if
        it had come alone; the prompt answers go back in one Answers message when the batch
        says where (else each to its bid's reply)."""
        if self._shed(msg):
            return
        batch = decode(msg.data, Batch)
        region = self.subjects.tail(msg.subject, 1)[0]
        for rel in batch.releases:
            self._release_region(rel, region)
        group = self.groups.get(self.subjects.bid(region))
        if group is None:
            return
        to = batch.answers_to if batch.answers_to and is_inbox(batch.answers_to) else ""
        answers: list[Offers] = []
        for item in batch.bids:
            bid = item.bid
            if bid.region != region or not is_inbox(item.reply):
                self.bids_refused += 1
                if self.bids_refused <= 10 or self.bids_refused % 1000 == 0:
                    log.warning(
                        "batch_bid_refused",
                        order_id=bid.order_id,
                        region=bid.region,
                        subject=msg.subject,
                        detail="bid region does not match the subject's, or its reply is no inbox",
                    )
                continue
            out = self._answer_bid(bid, item.reply, group)
            if to:
                answers += out
            else:
                for answer in out:
                    self.outbox.post(item.reply, encode(answer))
        for i in range(0, len(answers), MAX_BATCH_ITEMS):
            self.outbox.post(to, encode(Answers(answers=answers[i : i + MAX_BATCH_ITEMS])))

    def _answer_bid(self, bid: Bid, reply: str, group: BidGroup[Worker]) -> list[Offers]:
        """Answer one bid: its delayed or Waiting replies are sent (or scheduled) here; a
        prompt bid's Offers answers (§4.4.3) are returned, for the caller to send."""
        if (bid.order_id, bid.auction_id) in self.released:
            return []
        now = time.monotonic()
        ans = self.desk.answer(bid, reply, now, group, self.owners)
        for w, holds in ans.expired:
            w.holds_expired(holds)
        self._send(ans.late, now)
        prompt = bid.batch_offers and bid.prompt_offers
        if not ans.replies:  # answered, with nothing: the auction need not wait for us
            return [self._named([], bid.auction_id)] if prompt else []
        key = (bid.order_id, bid.auction_id)
        asked = self.asked.get(key)
        if asked is None:
            asked = self.asked[key] = (now, [])
        asked[1].extend(r.worker for r in ans.replies)
        replies = ans.replies
        answers: list[Offers] = []
        if prompt:  # at once, ranked by the auction (§4.4.3)
            offers = [
                self._prompt_offer(r.reply, r.delay_s)
                for r in replies
                if isinstance(r.reply, Offer)
            ]
            for i in range(0, max(1, len(offers)), MAX_BATCH_OFFERS):
                answers.append(self._named(offers[i : i + MAX_BATCH_OFFERS], bid.auction_id))
            replies = [r for r in replies if not isinstance(r.reply, Offer)]  # Waiting notes
        elif bid.batch_offers:  # the auction takes one message for all of them (§4.4.2)
            replies = self._batch(replies, now)
        self._send(replies, now)
        return answers

    def _prompt_offer(self, offer: Offer, delay_s: float) -> Offer:
        """A prompt answer's offer: signed, with the delay it would have waited."""
        signed = self._signed(offer)
        if delay_s <= 0:
            return signed
        return msgspec.structs.replace(signed, delay_ms=round(delay_s * 1000.0, 3))

    def _named(self, offers: list[Offer], auction_id: str) -> Offers:
        """A prompt answer: this process's offers for an auction, naming the process."""
        return Offers(
            offers=offers, responder=self.responder_id, auction_id=auction_id, batches=True
        )

    def _batch(self, replies: list[Send[Worker]], t0: float) -> list[Send[Worker]]:
        """Schedule this bid's offers as Offers messages of up to MAX_BATCH_OFFERS, each at
        its best (first) offer's delay, so the spread still ranks processes by their best
        offer; returns the replies left to send one by one (a lone offer, Waiting notes)."""
        offers = [r for r in replies if isinstance(r.reply, Offer)]
        if len(offers) < 2:
            return replies
        loop = asyncio.get_running_loop()
        now = loop.time()
        skew = now - time.monotonic()
        for i in range(0, len(offers), MAX_BATCH_OFFERS):
            chunk = offers[i : i + MAX_BATCH_OFFERS]
            at = t0 + skew + chunk[0].delay_s
            if at > now:
                loop.call_at(at, self._due_batch, chunk)
            else:
                self._due_batch(chunk)
        return [r for r in replies if not isinstance(r.reply, Offer)]

    def _due_batch(self, sends: list[Send[Worker]]) -> None:
        """The offers of one batch still worth sending (a hold released meanwhile drops
        its offer), in one message; a lone one as a plain Offer."""
        due = [s for s in sends if self.desk.still_due(s)]
        if len(due) > 1:
            offers = [self._signed(s.reply) for s in due if isinstance(s.reply, Offer)]
            self.outbox.post(due[0].inbox, encode(Offers(offers=offers)))
        elif due:
            self._due(due[0])

    def _freed(self, w: Worker) -> None:
        """Capacity came back on ``w`` outside a bid: the desk answers its waiting bids."""
        now = time.monotonic()
        self._send(self.desk.freed(w, now), now)

    def _grew(self, w: Worker) -> None:
        """Committed machines grew on ``w``: the desk withdraws hopeless waiting bids."""
        self._send(self.desk.withdraw_hopeless(w), time.monotonic())

    def _send(self, sends: list[Send[Worker]], t0: float) -> None:
        """Send each reply at t0 + its delay, through the outbox (the desk put them best
        first); a delayed offer whose hold was released meanwhile is dropped when due."""
        if not sends:
            return
        loop = asyncio.get_running_loop()
        # One reading of the clock for all of them: the delays grow down the list, so once
        # one reply is scheduled every later one is too, at a later time. (Reading the clock
        # per reply let a worse offer that was already due go out before a better one still
        # scheduled a fraction of a millisecond earlier.)
        now = loop.time()
        skew = now - time.monotonic()  # t0 is time.monotonic(); the loop may keep its own
        for send in sends:
            at = t0 + skew + (0.0 if send.prompt else send.delay_s)
            if at > now:
                loop.call_at(at, self._due, send)
            else:
                self._due(send)

    def _due(self, send: Send[Worker]) -> None:
        if not self.desk.still_due(send):
            return
        if send.prompt and isinstance(send.reply, Offer):  # one of this process's answers
            offer = self._prompt_offer(send.reply, send.delay_s)
            self.outbox.post(send.inbox, encode(self._named([offer], send.auction_id)))
        else:
            self.outbox.post(send.inbox, self._wire(send.reply))

    def _wire(self, reply: Offer | Waiting) -> bytes:
        """A bid reply as sent: an Offer signed with this host's key when it has one."""
        return encode(self._signed(reply) if isinstance(reply, Offer) else reply)

    def _signed(self, offer: Offer) -> Offer:
        """The offer signed with this host's key when it has one."""
        return self.signer.sign(offer) if self.signer is not None else offer

    async def _on_region_release(self, msg: Msg) -> None:
        self._release_region(decode(msg.data, Release), self._region_of(msg))

    def _release_region(self, rel: Release, region: str) -> None:
        key = (rel.order_id, rel.auction_id)
        self.released[key] = time.monotonic()
        asked = self.asked.pop(key, None)
        # only the workers this host asked can hold for an auction; a release for any
        # auction of the order (a third party's): ask everyone
        workers: Iterable[Worker] = (
            (asked[1] if asked else ()) if rel.auction_id else self.by_region.get(region, ())
        )
        for w in workers:
            w.release(rel.order_id, rel.auction_id)

    async def _on_status(self, msg: Msg) -> None:
        if msg.data.strip():
            decode(msg.data, StatusRequest)
        if msg.subject == self.subjects.status_every:  # every region (added in v1)
            workers: Iterable[Worker] = self.workers.values()
        else:
            workers = self.by_region.get(self._region_of(msg), ())
        for w in workers:
            await self.responder.reply(msg, w.status())

    async def _on_explain(self, msg: Msg) -> None:
        """Why not (docs/protocol.md §4.15): the desk's verdict of EVERY worker of the
        region here (nothing held), sent in pages under the payload limit."""
        req = decode(msg.data, ExplainRequest)
        region = self._region_of(msg)
        if req.region != region:
            raise subject_region_mismatch("explain", req.region, region)
        if not msg.reply:
            return
        verdicts = self.desk.explain(req, time.monotonic(), self.by_region.get(region, ()))
        responder = secrets.token_hex(8)  # groups this answer's pages at the requester
        for page in explanation_pages(req.order_id, region, responder, verdicts):
            await self.responder.reply(msg, page)

    async def _on_machines(self, msg: Msg) -> None:
        """Every machine the request asks for (docs/protocol.md §4.17), of every worker of
        the region here (or of every region, or the one worker it names): each worker's in
        its own MachinePage 1..n, under the page budget, one empty page when none match."""
        req = decode(msg.data, ListMachines) if msg.data.strip() else ListMachines()
        if not msg.reply:
            return
        if msg.subject == self.subjects.machines_every:
            workers: Iterable[Worker] = self.workers.values()
        else:
            workers = self.by_region.get(self._region_of(msg), ())
        for w in workers:
            if req.worker_id and w.worker_id != req.worker_id:
                continue
            for page in w.machine_pages(req):
                await self.responder.reply(msg, page)

    # -- one worker's subjects -------------------------------------------------------------------
    async def _on_worker(self, msg: Msg) -> None:
        wid, *rest = self.subjects.tail(msg.subject, 1)
        w = self.workers[wid]
        if rest == ["commit"]:
            commit = decode(msg.data, Commit)
            self.responder.spawn(msg, self._committed(msg, w, commit))
        elif rest == ["release"]:
            rel = decode(msg.data, Release)
            if rel.worker_id and rel.worker_id != wid:
                raise BadMessage(f"release for worker {rel.worker_id!r} sent to worker {wid!r}")
            w.release(rel.order_id, rel.auction_id, rel.abort_commit)
        elif len(rest) == 2 and rest[0] == "machine" and rest[1] in MACHINE_VERBS:
            await self._machine(w, msg, rest[1])
        else:
            await self.responder.error(
                msg,
                "unknown_subject",
                f"unknown subject {msg.subject!r}: a worker answers commit, release and "
                f"machine.<{'|'.join(MACHINE_VERBS)}>",
            )

    async def _committed(self, msg: Msg, w: Worker, commit: Commit) -> None:
        result = await w.commits.commit(commit)
        if isinstance(result, Placed):
            self.owners[result.order_id] = w
        await self.responder.reply(msg, result)
        if isinstance(result, Placed) and commit.release_others and commit.auction_id:
            # every offer was this process's: the auction sends no region release (§4.6)
            self._release_region(
                Release(order_id=commit.order_id, auction_id=commit.auction_id), w.region
            )

    async def _answer(self, msg: Msg, result: Awaitable[msgspec.Struct]) -> None:
        await self.responder.reply(msg, await result)

    async def _machine(self, w: Worker, msg: Msg, verb: str) -> None:
        if verb == "list":
            req = decode(msg.data, ListMachines) if msg.data.strip() else ListMachines()
            await self.responder.reply(msg, w.list_machines(req=req))
            return
        mreq = decode(msg.data, MachineRequest)
        if worker_of_machine(mreq.machine_id) != w.worker_id:
            raise BadMessage(f"machine {mreq.machine_id} does not belong to worker {w.worker_id}")
        if verb == "get":
            await self.responder.reply(msg, w.get_machine(mreq.machine_id))
        elif verb == "logs":
            logs = await w.logs(mreq.machine_id, mreq.tail, mreq.since)
            await self.responder.reply(msg, logs)
        else:
            self.responder.spawn(msg, self._answer(msg, w.transition(verb, mreq.machine_id)))

    # -- housekeeping ---------------------------------------------------------------------------
    async def _sweep(self) -> None:
        """Expire holds (publishing hold_expired) and forget old tombstones."""
        while True:
            await anyio.sleep(SWEEP_INTERVAL_S)
            now = time.monotonic()
            for w in self.workers.values():
                if w.ledger.holds:
                    w.expire_holds(now)
                if w.waiting:
                    w.prune_waiting(now)
            self._watch_store(now)
            if self.bids_shed > self._shed_logged:
                log.warning(
                    "bids_shed", total=self.bids_shed, new=self.bids_shed - self._shed_logged
                )
                self._shed_logged = self.bids_shed
            cutoff = now - TOMBSTONE_TTL_S
            while self.released:
                key, at = next(iter(self.released.items()))
                if at > cutoff:
                    break
                del self.released[key]
            # an auction that never released (its exchange died): the holds expire by their
            # TTL, and its entry goes once no hold of it can be alive any more
            cutoff = now - MAX_HOLD_MS / 1000.0
            while self.asked:
                key, (at, _) = next(iter(self.asked.items()))
                if at > cutoff:
                    break
                del self.asked[key]

    async def _reclaim_orphans(self) -> None:
        """Every ``reclaim_every_s``: each worker asks about its machines still reserved a
        while after their commit (supplier/reclaim.py) and destroys the orphans. No exchange
        answering (a direct-mode-only market) or no claims: the machines stay."""
        while True:
            await anyio.sleep(self.reclaim_every_s)
            for w in self.workers.values():
                batch = w.reclaims.due(w.machines.values(), now_ms())
                if batch and not await self._reclaim(w, batch):
                    break  # nobody answers: try again next round

    async def _reclaim(self, w: Worker, batch: list[Machine]) -> bool:
        """Ask about ``batch`` and act on the verdicts; False if no exchange answered."""
        check = ReclaimCheck(
            worker_id=w.worker_id,
            machines=[
                Placed.of_machine(m, image_cached=m.image in w.images, elapsed_ms=0.0)
                for m in batch
            ],
        )
        verdicts: list[ReclaimVerdict] = []
        try:
            reply = await self.nc.request(
                self.subjects.reclaim(w.worker_id), encode(check), timeout=RECLAIM_TIMEOUT_S
            )
            answer: ReclaimReply = decode(reply.data, ReclaimReply)
            if isinstance(answer, ReclaimVerdicts):
                verdicts = answer.verdicts
            else:
                w.log.warning("reclaim_check_refused", detail=answer.detail)
        except nats.errors.Error:  # no responders, a timeout, a connection going away
            return False
        except BadMessage as exc:
            w.log.warning("reclaim_check_refused", detail=str(exc))
        finally:
            orphans = w.reclaims.settle(batch, verdicts)
        for v in orphans:
            try:
                await w.keeper.reclaim(w.machines[v.machine_id], v.detail)
            except StoreError as exc:  # the store refuses writes: the worker drains, and
                w.store_failed(str(exc))  # the orphan is asked about again next round
            finally:
                w.reclaims.done(v.machine_id)
        return True

    def _watch_store(self, now: float) -> None:
        """Drain every worker of this process while its store refuses writes (they share
        it): offering capacity that cannot be committed only makes auctions fail later."""
        if self.store.failure and not self.store_failing:
            self.store_failing = True
            self._next_probe = now + STORE_PROBE_INTERVAL_S
            log.error(
                "supplier_draining",
                reason=f"store refuses writes: {self.store.failure}",
                path=str(self.store.path),
                workers=len(self.workers),
            )
            for w in self.workers.values():
                w.store_failed(self.store.failure)
        if self.store_failing and now >= self._next_probe and not self._probing:
            assert self._tasks is not None, "the sweeper runs in run()'s task group"
            self._probing = True
            self._tasks.start_soon(self._probe_store)

    async def _probe_store(self) -> None:
        try:
            if await self.store.probe():
                self.store_failing = False
                resumed = sum(w.store_recovered() for w in self.workers.values())
                log.warning("supplier_resumed", reason="store takes writes again", workers=resumed)
            else:
                log.info("store_still_failing", reason=self.store.failure)
        finally:
            self._next_probe = time.monotonic() + STORE_PROBE_INTERVAL_S
            self._probing = False

    def check_invariants(self) -> list[str]:
        """I1 on every worker of this host; returns the violations found."""
        problems = []
        for w in self.workers.values():
            try:
                w.ledger.check()
            except AssertionError as exc:
                problems.append(f"{w.worker_id}: {exc}")
        return problems
