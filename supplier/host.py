"""The supplier daemon's NATS side: one connection, one store, one or many workers.

Per region the host has ONE subscription each for bids, region releases and status, and
fans a message out to its workers of that region in-process, so a thousand virtual workers
cost a thousand dict entries rather than a thousand deliveries. Each worker has its own
subscription for what is addressed to it (``<root>.worker.<id>.>``).

This is the NATS shell: it decodes, asks the desk (supplier/desk.py) how to answer a bid
and performs the plan the desk returns (each message after its delay, through the outbox).
It makes no market decision itself. What runs on a timer (the sweep, reclaim, the store's
health) is supplier/upkeep.py's, status, explain and listings supplier/queries.py's, what
it takes before it serves (port ranges, worker ids) supplier/startup.py's.
"""

from __future__ import annotations

import contextlib
import functools
import secrets
import time
from collections import Counter

import anyio
import anyio.abc
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bourse.nats.auth import is_inbox
from bourse.nats.connection import flush_all
from bourse.nats.responder import Responder, subject_region_mismatch
from bourse.runtime.metrics import SupplierMetrics
from bourse.runtime.supervise import cleanup_scope
from bourse.wire.codec import decode, encode
from bourse.wire.limits import MAX_BATCH_ITEMS
from bourse.wire.messages import (
    Answers,
    Batch,
    Bid,
    Event,
    Offers,
    Release,
)
from bourse.wire.signing import OfferSigner
from bourse.wire.subjects import Subjects
from supplier.candidates import DEFAULT_QUOTE_SAMPLE, BidGroup, BidGroups
from supplier.commands import Commands
from supplier.config import WorkerConfig, check_workers
from supplier.control import WorkerControls
from supplier.desk import DEFAULT_MAX_OFFERS, Desk
from supplier.execs import ExecSessions
from supplier.images import ImageListener, StoreSource
from supplier.outbox import AT_MOST_ONCE_KINDS, EventOutbox, Outbox
from supplier.ports import PortClaims, held_twice
from supplier.queries import Queries
from supplier.reclaim import DEFAULT_AFTER_S as DEFAULT_RECLAIM_AFTER_S
from supplier.reclaim import check_every
from supplier.replies import Replies
from supplier.rows import StateRows
from supplier.scrub import Scrubbing
from supplier.startup import check_unclaimed, port_ranges
from supplier.status import worker_sample
from supplier.store import Store
from supplier.upkeep import Upkeep
from supplier.worker import Worker
from supplier.worker_subjects import WorkerSubjects

log = structlog.get_logger("bourse.supplier")

# Bids queued beyond this many on one subscription are shed (answered by nobody here).
DEFAULT_MAX_BID_BACKLOG = 64
# A stop's bounds: the answers under way (a commit's fsync), the machines (their lifecycle
# work, then their processes: SIGTERM, SIGKILL after the grace or when this runs out), the
# outbox's last messages, the state rows of the stop, and the whole stop, so SIGTERM ends
# the process within 2 s.
HANDLERS_S = 0.5
MACHINES_S = 0.7
OUTBOX_S = 0.3
ROWS_S = 0.2
STOP_S = 1.5


class SupplierHost:
    """One supplier process on NATS: its workers (one, or a fleet of virtual ones), their
    store, the desk that answers their bids; :meth:`run` serves until cancelled."""

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
        jetstream: bool = True,
        metrics: SupplierMetrics | None = None,
        reclaim_after_s: float = DEFAULT_RECLAIM_AFTER_S,
        reclaim_every_s: float | None = None,
        port_claims: PortClaims | None = None,
        advertise_host: str = "",
        scrubbing: Scrubbing = Scrubbing(),
    ) -> None:
        check_workers(workers)
        # The workers' port ranges, claimed against the host's other suppliers when
        # ``port_claims`` is given (supplier run; supplier/startup.py).
        self.port_claims = port_claims
        ranges = port_ranges(workers, store, port_claims)
        # This process's name in its prompt answers (Offers.responder, §4.4.3): random per
        # start, so the auction counts each running process once.
        self.responder_id = secrets.token_hex(8)
        # How bids are answered: the pure core this shell asks (supplier/desk.py).
        self.desk: Desk[Worker] = Desk(max_offers, quote_sample)
        self.max_bid_backlog = max_bid_backlog
        self.bids_shed = 0
        self.bids_refused = 0  # bids of a Batch refused one by one (wrong region, no inbox)
        self._bid_subs: dict[str, Subscription] = {}
        self.nc = nc
        self.subjects = subjects or Subjects()
        self.store = store
        self.workers: dict[str, Worker] = {}
        self.by_region: dict[str, list[Worker]] = {}
        # The market's image store, which the workers' content caches pull from (read only).
        self.images = StoreSource(nc, self.subjects.prefix)
        for cfg in workers:
            w = Worker(
                cfg,
                store,
                self._emit,
                on_freed=self._freed,
                on_grew=self._grew,
                on_image=self._image_listener(cfg.worker_id),
                reclaim_after_s=reclaim_after_s,
                source=self.images,
                port_range=ranges.get(cfg.worker_id),
                advertise_host=advertise_host,
            )
            if port_claims is not None and w.ports.range is not None:
                w.ports.on_held = functools.partial(port_claims.hold, cfg.worker_id)
            self.workers[cfg.worker_id] = w
            self.by_region.setdefault(cfg.region, []).append(w)
        self.groups = BidGroups(self.subjects, self.workers.values(), bid_shards)
        self._subs: list[Subscription] = []
        self.outbox = Outbox(nc)  # delayed bid replies and hold_expired, no task each
        self.replies = Replies(self.desk, self.outbox, signer, self.responder_id)
        # Events of committed changes, exactly once from the store's outbox table (with
        # JetStream; at most once in the degraded mode, ``jetstream`` False).
        self.jetstream = jetstream
        self.events = EventOutbox(nc, store, self.subjects, durable=jetstream)
        # Their rows in the state stream (supplier/rows.py; with JetStream only).
        self.rows = StateRows(nc, self.subjects, self.workers) if jetstream else None
        for w in self.workers.values():
            if self.rows is not None:
                w.on_row = self.rows.machine
        # Stops and destroys kept for these workers while they were away (supplier/commands.py).
        self.commands = Commands(nc, self.subjects, self.workers, self._announce)
        # Each worker's own subjects: commits, releases, machine verbs (one subscription a
        # worker while it serves); and the operator's verbs on it (§4.22, while this runs).
        self.worker_subjects = WorkerSubjects(
            self.subjects,
            self.workers,
            self.desk,
            lambda: self.responder,
            self._release_region,
            ExecSessions(lambda: self.responder.nc, self._announce),
        )
        self._worker_subs: dict[str, Subscription] = {}
        self.controls = WorkerControls(
            self.subjects, self.workers, lambda: self.responder, self.stop_worker, self.start_worker
        )
        # Status, explain and listings, answered for every worker here that serves.
        self.queries = Queries(
            self.subjects,
            self.workers,
            self.by_region,
            self.desk,
            lambda: self.responder,
            jetstream,
        )
        self._tasks: anyio.abc.TaskGroup | None = None  # run()'s, for a worker started again
        # Orphans (supplier/reclaim.py): reserved machines asked about after reclaim_after_s
        # (0: never), looked for every reclaim_every_s (default: half that, at most 5 s).
        every_s = reclaim_every_s or check_every(reclaim_after_s)
        # The timed work: the sweep, orphans, the store's probe, and the scrub of the
        # workers' image roots (supplier/scrub.py: ``scrubbing`` paces it).
        self.upkeep = Upkeep(
            nc,
            self.subjects,
            store,
            self.workers,
            self.desk,
            every_s,
            lambda: self.bids_shed,
            scrubbing,
        )
        if metrics is not None:  # state is read at scrape time; only a commit is timed
            metrics.watch_workers(
                lambda: [worker_sample(w) for w in self.workers.values()], lambda: self.bids_shed
            )
            metrics.watch_outbox("publish", self.outbox.__len__)
            metrics.watch_outbox("events", lambda: self.events.backlog)  # durable, unacked
            metrics.watch_event_stream(lambda: self.events.stream_missing)
            if self.rows is not None:
                rows = self.rows
                metrics.watch_outbox("rows", lambda: rows.backlog)  # marked, unacked
                metrics.watch_state_stream(lambda: rows.stream_missing)
            metrics.watch_replies("supplier", self._reply_counts)
            store.on_commit = metrics.store_commit.observe
            for w in self.workers.values():
                w.keeper.pulls.on_pull = metrics.image_pull.observe

    def _reply_counts(self) -> Counter[str]:
        responder = getattr(self, "responder", None)  # made by run()
        return responder.counts if responder is not None else Counter()

    def _image_listener(self, worker_id: str) -> ImageListener:
        """Keeps the bid groups' image index current as a worker pulls and evicts."""
        return lambda image, cached: self.groups.image_changed(
            self.workers[worker_id], image, cached
        )

    # -- life ---------------------------------------------------------------------------------
    async def run(
        self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve until cancelled: check no other process serves these workers, recover
        them from the store, subscribe, say ``started``, serve; then, shielded and bounded:
        unsubscribe, let the answers under way finish, stop the machines, send what the
        outbox holds. The outbox pump, each worker's machines (Machines.run: lifecycle work
        and the driver's supervisors) and the upkeep (supplier/upkeep.py: the sweep, reclaim,
        the store probe) run in this task group; the handlers in the responder's tasks,
        which the stop ends. Raises
        WorkerIdInUse (supplier/startup.py) before ``started`` if a worker is taken."""
        # before any task: a taken id is one plain error
        await check_unclaimed(self.nc, self.subjects, list(self.workers))
        async with anyio.create_task_group() as tasks:
            self._tasks = tasks
            self.responder = Responder(self.nc, "supplier")
            await tasks.start(self.outbox.run)
            await self.events.start()  # before any write of this run: rows stay in order
            await tasks.start(self.events.run)
            try:
                await self._start(tasks)
                if self.rows is not None:  # every row, then heartbeats and changes
                    await tasks.start(self.rows.run)
                task_status.started()
                await anyio.sleep_forever()
            finally:
                with cleanup_scope(STOP_S):
                    await self._stop()
                if self.port_claims is not None:
                    self.port_claims.release()
                tasks.cancel_scope.cancel()  # the upkeep: nothing left to do

    async def _start(self, tasks: anyio.abc.TaskGroup) -> None:
        await self.images.start()  # before a bid may ask whether a digest can be pulled
        for w in self.workers.values():
            await tasks.start(w.keeper.run)  # before anything may start or abort a machine
            w.recover()
            w.ports.tell()  # its range's claim lasts past this process while machines hold ports
            for order_id in w.by_order:
                self.desk.placed(order_id, w)
        g = self.responder.guard
        s = self.subjects
        q = self.queries
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
            self._subs.append(await fanout(s.status(region), q.on_status))
            self._subs.append(await fanout(s.explain(region), q.on_explain))
            self._subs.append(await fanout(s.machines(region), q.on_machines))
        self._subs.append(await self.responder.subscribe_fanout(s.status_every, q.on_status))
        self._subs.append(await self.responder.subscribe_fanout(s.machines_every, q.on_machines))
        for wid in self.workers:
            await self._serve_subjects(wid)
            self._subs.append(
                await self.nc.subscribe(s.control(wid), cb=g(self.controls.on_message))
            )
        await flush_all(self.nc)
        await tasks.start(self.upkeep.run)
        if self.jetstream:  # the commands kept for these workers, before any machine resumes
            await tasks.start(self.commands.run)  # (I9), then those that come
        for w in self.workers.values():  # machines that should run are started again
            await w.keeper.resume()
        log.info("supplier_started", workers=len(self.workers), regions=sorted(self.by_region))

    async def _serve_subjects(self, wid: str) -> None:
        """The worker's own subjects (commits, releases, machine verbs) answered."""
        answer = self.responder.guard(self.worker_subjects.on_message)
        self._worker_subs[wid] = await self.nc.subscribe(self.subjects.worker_all(wid), cb=answer)

    # -- one worker stopped and started by the operator (docs/protocol.md §4.22) ---------------
    async def stop_worker(self, w: Worker) -> None:
        """The worker leaves the market as if its supplier stopped: its subjects go (a
        request there gets no responders: a stop or destroy is kept for it, a failover
        finds it gone), it answers no bid, status, explain or listing, its kept commands
        wait, and its machines stop as the supplier's stop would stop them (or run on,
        let go of, with --keep-machines). Its records stay."""
        w.leave()
        if self.rows is not None:  # its heartbeat leaves it out: a view calls it gone
            self.rows.regroup()
        sub = self._worker_subs.pop(w.worker_id, None)
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.commands.pause(w.worker_id)
        await w.keeper.close()
        await w.keeper.ended()  # its driver's end too: before a start may run another
        log.warning("worker_stopped", worker_id=w.worker_id, by="operator")

    async def start_worker(self, w: Worker) -> None:
        """The worker serves again, as after its supplier's start: its machines' keeper
        runs, the commands kept for it are applied, its machines that should run resume
        (I9), then it answers again."""
        assert self._tasks is not None, "start_worker needs run() to be running"
        await self._tasks.start(w.keeper.run)
        await self.commands.resume(w.worker_id)
        await w.keeper.resume()
        w.rejoin()
        if self.rows is not None:  # named by its heartbeat again: back in a view at once
            self.rows.regroup()
        await self._serve_subjects(w.worker_id)
        await flush_all(self.nc)  # its subscriptions the server's before it says so
        log.warning("worker_started", worker_id=w.worker_id, by="operator")

    async def _stop(self) -> None:
        """Each step bounded, and each runs even if the one before it failed: every
        worker's Machines.run must end (it is shielded) and the outbox must be closed."""
        for sub in [*self._subs, *self._worker_subs.values()]:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        self._worker_subs.clear()
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
                if self.rows is not None:  # the rows of the stop, as far as time allows
                    await self.rows.close(ROWS_S)
        log.info("supplier_stopped", workers=len(self.workers))

    def _emit(self, event: Event) -> None:
        """At-most-once events go out now; the others were written to the store's outbox
        with their change and go out from there (``self.events``)."""
        if event.kind in AT_MOST_ONCE_KINDS:
            self._announce(event)

    def _announce(self, event: Event) -> None:
        """An event published at most once (not a committed change of its own)."""
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
        """Answer one bid as the desk plans it: the delayed replies are scheduled here; a
        prompt bid's answers (§4.4.3) are returned, for the caller to send."""
        now = time.monotonic()
        ans = self.desk.answer(bid, reply, now, group)
        for w, holds in ans.expired:
            w.holds_expired(holds)
        plan = self.desk.plan(bid, reply, ans)
        self.replies.schedule(plan.posts, now)
        return [self.replies.answer(post, post.sends) for post in plan.answers]  # all due

    def _freed(self, w: Worker) -> None:
        """Capacity came back on ``w`` outside a bid: the desk answers its waiting bids."""
        now = time.monotonic()
        self.replies.schedule(self.desk.late(self.desk.freed(w, now)), now)

    def _grew(self, w: Worker) -> None:
        """Committed machines grew on ``w``: the desk withdraws hopeless waiting bids."""
        self.replies.schedule(self.desk.late(self.desk.withdraw_hopeless(w)), time.monotonic())

    async def _on_region_release(self, msg: Msg) -> None:
        self._release_region(decode(msg.data, Release), self._region_of(msg))

    def _release_region(self, rel: Release, region: str) -> None:
        workers = self.by_region.get(region, ())
        self.desk.release(rel.order_id, rel.auction_id, time.monotonic(), workers)

    def check_invariants(self) -> list[str]:
        """I1 on every worker of this host, and I8 (no port held twice, by the machines of
        one worker or of two); returns the violations found."""
        problems = []
        for w in self.workers.values():
            try:
                w.ledger.check()
            except AssertionError as exc:
                problems.append(f"{w.worker_id}: {exc}")
        return problems + held_twice({wid: w.ports for wid, w in self.workers.items()})
