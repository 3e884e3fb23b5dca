"""Each machine's users: a block of 65,536 host user and group ids of its own, claimed on the
host (supplier/machines/host/claims.py), held from the machine's first start to its destroy.

A process machine runs as the block's first id (its only user: no supplementary groups,
no new privileges); a container maps its users (root included) into the block through a
user namespace. So no machine shares a user with the supplier or another machine: it
cannot read another's ``/proc/<pid>/environ``, signal it, write its files, or join another
cgroup. A block is given back only once nothing of it is left: the destroy kills what
still runs as one of its ids.

Blocks start at :data:`FIRST_BLOCK` (uid 1,048,576: past the ids people and packages take,
and past the usual ``/etc/subuid`` ranges) and end below 2**31.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

from supplier.machines.host.claims import Claim, ClaimError, HostClaims

BLOCK = 65536
FIRST_BLOCK = 16
LAST_BLOCK = 32767  # ids stay below 2**31
KIND = "uids"


def block_range() -> tuple[int, int]:
    """The blocks this host's suppliers draw from: all of them, or the slice
    ``BOURSE_UID_BLOCKS`` (``FIRST-LAST``) names (a test session's own, so that two on one
    host never meet)."""
    given = os.environ.get("BOURSE_UID_BLOCKS", "")
    first, _, last = given.partition("-")
    if first.isdigit() and last.isdigit():
        return max(FIRST_BLOCK, int(first)), min(LAST_BLOCK, int(last))
    return FIRST_BLOCK, LAST_BLOCK


class NoIds(ClaimError):
    """Every block of the host is claimed."""


def block_of(uid: int) -> int:
    return uid // BLOCK


def processes_of(base: int) -> list[int]:
    """Processes running as one of the block's ids (real or effective)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    ids = [int(x) for x in line.split()[1:]]
                    if any(base <= i < base + BLOCK for i in ids):
                        found.append(int(entry.name))
                    break
        except (OSError, ValueError):
            continue
    return found


def kill_all(base: int) -> None:
    """Every process running as one of the block's ids, killed."""
    for pid in processes_of(base):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


class UidBlocks:
    """One supplier's machines' blocks (its ``owner``: its data dir)."""

    def __init__(self, claims: HostClaims, owner: str) -> None:
        self.claims = claims
        self.owner = owner
        self._bases: dict[str, int] = {}  # machine id -> its block's first id
        for c in claims.owned(KIND, owner):
            self._bases[c.holder] = int(c.key) * BLOCK

    def base(self, machine_id: str) -> int:
        """The machine's block's first id, claimed now if it has none yet."""
        have = self._bases.get(machine_id)
        if have is not None:
            return have
        with self.claims.locked():
            every = {int(c.key) for c in self.claims.all(KIND)}
            used = {int(c.key) for c in self.claims.standing(KIND)}
            first, last = block_range()
            for block in range(first, last + 1):
                if block in used:
                    continue
                claim = Claim(KIND, str(block), self.owner, machine_id, held=True)
                if self.claims.take(claim):
                    if block in every:  # a stale claim's (its data dir gone): swept first
                        kill_all(block * BLOCK)
                    self._bases[machine_id] = block * BLOCK
                    return block * BLOCK
        raise NoIds(f"no free block of {BLOCK} user ids on this host for {machine_id}")

    def get(self, machine_id: str) -> int | None:
        return self._bases.get(machine_id)

    def give_back(self, machine_id: str) -> None:
        """The machine is gone: kill what still runs as one of its ids, then give the block
        back."""
        base = self._bases.pop(machine_id, None)
        if base is None:
            return
        kill_all(base)
        self.claims.drop(KIND, str(block_of(base)), self.owner)

    def keep_only(self, machine_ids: set[str]) -> list[str]:
        """At a start: the blocks of machines no longer recorded (destroyed while the supplier
        was away) are given back; the machine ids given back."""
        gone = [m for m in self._bases if m not in machine_ids]
        for m in gone:
            self.give_back(m)
        return gone
