"""A cache's roots checked against their inventories (bourse/images/inventory.py): at the
cache's opening by a walk of each root's metadata (``adopted``), and whole, every byte, by the
owner's scrub at its pace (``due``, ``check``, ``next_due``); a root that differs leaves the
cache and is listed for its owner to announce (``take_found``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from bourse.images.cachetypes import Held, Pace, RootRecord, Tampered
from bourse.images.disk import hex_of, remove_all
from bourse.images.inventory import Hasher, Inventory, walk_check


class RootChecks:
    """The checks of the roots in ``root_dir`` that the cache holds (``roots``: manifest ->
    its entry, the cache's own table), counted in the cache's ``counts``; a root that differs
    is taken out by ``move_out`` (its paths moved into the cache's ``tmp/``, returned for
    deletion); ``paths_of`` names a root's paths."""

    def __init__(
        self,
        root_dir: Path,
        roots: dict[str, Held],
        counts: Counter[str],
        move_out: Callable[[str], list[Path]],
        paths_of: Callable[[str], list[Path]],
        clock: Callable[[], float],
        log: Any,
    ) -> None:
        self.root_dir = root_dir
        self.roots = roots
        self.counts = counts
        self.move_out = move_out
        self.paths_of = paths_of
        self.clock = clock
        self.log = log
        self.found: list[Tampered] = []  # roots removed as tampered, for the owner to announce

    def due(self, every_s: float) -> list[str]:
        """The roots not read whole for ``every_s`` (or never since the cache was opened),
        longest first."""
        now = self.clock()
        roots = [(h.checked, m) for m, h in list(self.roots.items()) if now - h.checked >= every_s]
        return [m for _, m in sorted(roots)]

    def take_found(self) -> list[Tampered]:
        """The roots removed for not matching their inventory since the last call (at the
        cache's opening, by ``check``), for the owner to announce."""
        found, self.found = self.found, []
        return found

    def next_due(self, every_s: float) -> float | None:
        """When the next root falls due (clock time), or None with no root here."""
        checked = [h.checked for h in list(self.roots.values())]
        return min(checked) + every_s if checked else None

    async def check(self, manifest: str, pace: Pace) -> str:
        """Read the root of ``manifest`` whole against its inventory: the walk of
        ``changed``, then every file's bytes in bounded steps, each in a worker thread,
        ``pace`` awaited after each. "" when it holds what it should (or left the cache
        meanwhile: an eviction is no tampering); else what differed, and the root is
        removed (made again at its next use; a machine running from it keeps only the
        files it holds open) and listed for ``take_found``."""
        held = self.roots.get(manifest)
        if held is None:
            return ""
        held.checked = self.clock()  # tried now: one that fails waits its turn again
        root = self.root_dir / hex_of(manifest)
        inventory, differences = await anyio.to_thread.run_sync(self.walked, manifest, held.files)
        if inventory is not None and not differences:
            hasher = Hasher(root, inventory.files())
            try:
                while not hasher.done and self.roots.get(manifest) is held:
                    read = await anyio.to_thread.run_sync(hasher.step)
                    self.counts["scrubbed_bytes"] += read
                    await pace(read)
            finally:
                hasher.close()
            differences = hasher.findings()
        if self.roots.get(manifest) is not held:
            return ""
        if not differences:
            return ""
        why = "; ".join(differences)
        await anyio.to_thread.run_sync(remove_all, self.drop(manifest, why, "scrub"))
        return why

    def walked(self, manifest: str, files: str) -> tuple[Inventory | None, list[str]]:
        """``walk_check`` of a root here (a worker thread, or the cache's opening)."""
        name = hex_of(manifest)
        return walk_check(self.root_dir / name, self.root_dir / f"{name}.files", files)

    def drop(self, manifest: str, why: str, found: str) -> list[Path]:
        """A root that differs from its inventory leaves the cache (its paths moved into
        ``tmp/``, returned for deletion), said in the log and in ``found``."""
        self.found.append(Tampered(manifest, why, found))
        self.counts["tampered"] += 1
        self.log.warning("image_root_tampered", manifest=manifest, found=found, why=why)
        return self.move_out(manifest)

    def adopted(self, record: RootRecord) -> bool:
        """Whether the root of ``record`` matches its inventory as a walk sees it; if not,
        it is removed (listed in ``found``), as is one made before roots had inventories."""
        manifest = record.manifest
        if not record.files:
            self.log.info("image_root_unverifiable", manifest=manifest, detail="no inventory")
            remove_all(self.paths_of(manifest))
            return False
        _, differences = self.walked(manifest, record.files)
        if not differences:
            return True
        remove_all(self.drop(manifest, "; ".join(differences), "adopted"))
        return False
