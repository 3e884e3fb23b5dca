"""Every NATS subject Bourse uses, built in one place.

``bourse`` is the default prefix; a deployment may choose another (``--prefix``), e.g. to run
two independent markets on one NATS account.
"""

from __future__ import annotations

import random
import re
import zlib

from bourse.wire.limits import ID_PATTERN, PROTOCOL_VERSION

DEFAULT_PREFIX = "bourse"
EXCHANGE_QUEUE = "exchange"
_ID = re.compile(ID_PATTERN)
_PREFIX = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def shard_of(worker_id: str, shards: int) -> int:
    """Which bid shard a worker is in (stable across processes and restarts)."""
    return zlib.crc32(worker_id.encode()) % shards


def sampled_shards(order_id: str, image: str, shards: int, sample: int) -> list[int]:
    """The shards a sampled bid goes to: the image's home shard (``crc32(image) mod
    shards``) first, then ``sample - 1`` others drawn by a generator seeded with the order
    id. The home shard makes image locality reinforce itself: an image's machines land
    there more often than elsewhere, so that shard's workers pull and keep the image, and
    the next bid for it finds it cached. The order-id seed makes a retry ask the same shards
    (the worker that placed it answers: I3) and lets a post-mortem replay the draw."""
    home = zlib.crc32(image.encode()) % shards
    # the others, drawn from the shards but home: index i >= home stands for shard i + 1
    drawn = random.Random(order_id).sample(range(shards - 1), min(sample, shards) - 1)
    return [home, *(i + (i >= home) for i in drawn)]


def is_valid_id(value: str) -> bool:
    """Region and worker ids: ``[a-z0-9][a-z0-9-]{0,62}``."""
    return bool(_ID.match(value))


class Subjects:
    """Subject builders for one prefix. All subjects are ``<prefix>.v1.<kind>...``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not _PREFIX.match(prefix):
            raise ValueError(f"invalid subject prefix {prefix!r}: use tokens of [A-Za-z0-9_-]")
        self.prefix = prefix
        self.root = f"{prefix}.{PROTOCOL_VERSION}"
        # Token positions, used to parse incoming subjects: root has len(prefix tokens)+1.
        self.root_tokens = self.root.count(".") + 1

    # -- orders and the auction ------------------------------------------------------------
    def order(self, region: str) -> str:
        return f"{self.root}.order.{region}"

    @property
    def order_all(self) -> str:
        return f"{self.root}.order.*"

    def bid(self, region: str) -> str:
        return f"{self.root}.bid.{region}"

    def bid_shard(self, region: str, shard: int) -> str:
        """The workers of one shard of a region."""
        return f"{self.root}.bid.{region}.{shard}"

    def bid_batch(self, region: str) -> str:
        """Batch messages (several bids and releases) to the supplier
        processes of a region that take them."""
        return f"{self.root}.bid.{region}.batch"

    def region_release(self, region: str) -> str:
        """One publish drops every worker's hold for an order in the region."""
        return f"{self.root}.release.{region}"

    def status(self, region: str) -> str:
        return f"{self.root}.status.{region}"

    def reclaim(self, worker_id: str) -> str:
        """A worker asks the exchange about its reserved machines (§5.3d)."""
        return f"{self.root}.reclaim.{worker_id}"

    @property
    def reclaim_all(self) -> str:
        return f"{self.root}.reclaim.*"

    # -- lifecycle commands kept for a worker that was away (§4.20) ---------------------------
    # Stored by the command stream; written only by the operator and the exchange.
    def command(self, worker_id: str) -> str:
        return f"{self.root}.command.{worker_id}"

    @property
    def command_all(self) -> str:
        return f"{self.root}.command.*"

    # -- the operator's verbs on one worker (§4.22) ---------------------------------------------
    # Answered by the worker's supplier whether the worker serves or is stopped.
    def control(self, worker_id: str) -> str:
        return f"{self.root}.control.{worker_id}"

    @property
    def control_all(self) -> str:
        return f"{self.root}.control.*"

    @property
    def status_every(self) -> str:
        """Status of every worker of every region (``buyer fleet`` with no
        region), answered by every supplier for all its workers."""
        return f"{self.root}.status"

    def explain(self, region: str) -> str:
        """ "Why not" for an order, answered by every worker of the region."""
        return f"{self.root}.explain.{region}"

    def machines(self, region: str) -> str:
        """Every machine of every worker of the region, in pages (§4.17)."""
        return f"{self.root}.machines.{region}"

    @property
    def machines_every(self) -> str:
        """Every machine of every worker of every region, in pages (§4.17)."""
        return f"{self.root}.machines"

    # -- one worker ---------------------------------------------------------------------------
    def worker_all(self, worker_id: str) -> str:
        """Everything addressed to one worker: commit, release, machine.<verb>, and unknowns."""
        return f"{self.root}.worker.{worker_id}.>"

    def commit(self, worker_id: str) -> str:
        return f"{self.root}.worker.{worker_id}.commit"

    def release(self, worker_id: str) -> str:
        return f"{self.root}.worker.{worker_id}.release"

    def worker_machine(self, worker_id: str, verb: str) -> str:
        return f"{self.root}.worker.{worker_id}.machine.{verb}"

    # -- machines through the exchange --------------------------------------------------------
    def machine(self, verb: str) -> str:
        return f"{self.root}.machine.{verb}"

    @property
    def machine_all(self) -> str:
        return f"{self.root}.machine.*"

    # -- one tenant's orders and machines ------------------------------
    # Only the tenant's own user may publish under R.tenant.<name>., so the exchange takes
    # the tenant's identity from the subject: the server attests it (docs/security.md).
    def tenant_order(self, tenant: str, region: str) -> str:
        return f"{self.root}.tenant.{tenant}.order.{region}"

    def tenant_machine(self, tenant: str, verb: str) -> str:
        return f"{self.root}.tenant.{tenant}.machine.{verb}"

    def exec_input(self, session: str, tenant: str = "") -> str:
        """Where a client's input to an exec session goes (§4.24): a tenant's under its name."""
        if tenant:
            return f"{self.root}.tenant.{tenant}.exec.{session}"
        return f"{self.root}.exec.{session}"

    @property
    def tenant_order_all(self) -> str:
        return f"{self.root}.tenant.*.order.*"

    @property
    def tenant_machine_all(self) -> str:
        return f"{self.root}.tenant.*.machine.*"

    def tenant_image(self, tenant: str, verb: str) -> str:
        """A tenant's image requests to the exchange: push, tag, untag (§4.18)."""
        return f"{self.root}.tenant.{tenant}.image.{verb}"

    @property
    def tenant_image_all(self) -> str:
        return f"{self.root}.tenant.*.image.*"

    # -- image staging ------------------------------------------------------------------------
    # A tenant's blobs on their way into the image store: stored by the staging stream,
    # published only by that tenant's user, read and cleared by the exchange (§4.18).
    def stage(self, tenant: str, upload: str, hex_digest: str) -> str:
        """The chunks of one blob of one upload, in order."""
        return f"{self.root}.stage.{tenant}.{upload}.{hex_digest}"

    def stage_upload(self, tenant: str, upload: str) -> str:
        return f"{self.root}.stage.{tenant}.{upload}.>"

    def stage_tenant(self, tenant: str) -> str:
        return f"{self.root}.stage.{tenant}.>"

    @property
    def stage_all(self) -> str:
        return f"{self.root}.stage.>"

    # -- the state stream (§4.21): each row published by its owner, the last one kept ----------
    # ``owner`` is a tenant's name, or SHARED_OWNER for a machine of the shared buyer key
    # (bourse/wire/tenancy.py ``owner_token``): a grant can scope a tenant to its own rows.
    @property
    def state_all(self) -> str:
        return f"{self.root}.state.>"

    @property
    def state_fleet(self) -> str:
        """Every worker row and heartbeat (what every view reads, a tenant's too)."""
        return f"{self.root}.state.fleet.>"

    @property
    def state_epoch(self) -> str:
        """The stream's epoch: written once by whoever makes it (a view tells a stream made
        again by it); under ``fleet`` so that every view's grant reaches it."""
        return f"{self.root}.state.fleet.epoch"

    def state_worker(self, region: str, worker_id: str) -> str:
        return f"{self.root}.state.fleet.worker.{region}.{worker_id}"

    def state_beat(self, region: str, beat: str) -> str:
        """A supplier process's heartbeat, keyed by its first worker (``beat``)."""
        return f"{self.root}.state.fleet.beat.{region}.{beat}"

    def state_fleet_rows(self, region: str, worker_id: str) -> str:
        """A worker's own fleet rows: its row and the heartbeat keyed by it (a grant)."""
        return f"{self.root}.state.fleet.*.{region}.{worker_id}"

    def state_machine(self, owner: str, region: str, worker_id: str, machine_id: str) -> str:
        return f"{self.root}.state.machine.{owner}.{region}.{worker_id}.{machine_id}"

    def state_machines(self, owner: str = "*", region: str = "*", worker_id: str = "*") -> str:
        """The machine rows of an owner, a region, a worker (``*``: any)."""
        return f"{self.root}.state.machine.{owner}.{region}.{worker_id}.*"

    def state_owned(self, owner: str) -> str:
        """Every machine row of one owner (a tenant's view reads these)."""
        return f"{self.root}.state.machine.{owner}.>"

    # -- the edges (§4.23) ---------------------------------------------------------------------
    def edge_activity(self, edge: str = "*") -> str:
        """An edge's requests per machine (``*``: every edge's)."""
        return f"{self.root}.edge.activity.{edge}"

    def edge_activity_of(self, tenant: str = "*", edge: str = "*") -> str:
        """An edge's requests per machine of one tenant's (``*``: every edge's, every
        tenant's): what a tenant's key may hear of the edges."""
        return f"{self.root}.edge.activity.{edge}.{tenant}"

    # -- events -------------------------------------------------------------------------------
    def event(self, region: str, worker_id: str, kind: str) -> str:
        return f"{self.root}.event.{region}.{worker_id}.{kind}"

    def events(self, region: str = "*", worker_id: str = "*", kind: str = "*") -> str:
        return f"{self.root}.event.{region}.{worker_id}.{kind}"

    def tail(self, subject: str, skip: int) -> list[str]:
        """Tokens of ``subject`` after the root and ``skip`` more tokens."""
        return subject.split(".")[self.root_tokens + skip :]
