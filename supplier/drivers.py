"""The driver a worker's config asks for, and what its machines get of their own.

A worker (supplier/worker.py) asks for its driver once, when it is made: ``sim`` runs
nothing; ``process`` and ``oci`` run machines through the shims (supplier/machines/runner.py)
of the kind they name, confined as the host allows and, for a root supplier, isolated (a
uid block and a network namespace each: supplier/machines/host/)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from supplier.config import WorkerConfig
from supplier.machines.api import Driver
from supplier.machines.host.claims import host_claims
from supplier.machines.host.confine import Confiner, owner_of
from supplier.machines.host.ids import UidBlocks
from supplier.machines.host.isolation import Isolation, keep_private
from supplier.machines.host.network import WorkerNetwork, resolv_conf
from supplier.machines.oci.kind import ContainerKind
from supplier.machines.oci.runtime import detect
from supplier.machines.process import ProcessKind
from supplier.machines.runner import Kind, Runner
from supplier.machines.shim.forks import ForkServer
from supplier.machines.sim import SimDriver


def make_driver(cfg: WorkerConfig, data_dir: Path, size_mb: Callable[[str], int]) -> Driver:
    """The driver a worker's config asks for: machine logs go to <data_dir>/machines/<id>/,
    their shims to <data_dir>/shims/<id>/ (forked by the fork server of
    <data_dir>/forkserver/), the working directories of its process machines of images to
    <data_dir>/work/<id>/, its containers below <data_dir>/containers/<id>/;
    machines are confined as the host allows (supplier/machines/host/confine.py; containers
    by their runtime), in cgroups of the supplier that owns ``data_dir``. ``size_mb``: an
    image's size, for sim's pulls. A worker set to ``oci`` on a host without a runtime:
    RuntimeUnavailable."""
    if cfg.driver == "sim":
        return SimDriver(cfg.pull_mb_per_s, size_mb)
    owner = owner_of(data_dir)
    confiner, _ = Confiner.probe(
        cfg.confine,
        cfg.worker_id,
        owner=owner,
        pids_max=cfg.pids_max,
        cgroup_parent=cfg.cgroup_parent,
    )
    isolation = isolation_of(cfg, owner, data_dir)
    kind: Kind
    if cfg.driver == "oci":
        kind = ContainerKind.make(
            detect(cfg.runtimes), data_dir, owner, confiner, cfg.cgroup_parent, isolation
        )
    else:
        kind = ProcessKind(confiner, cfg.catalog, data_dir / "work" / cfg.worker_id, isolation)
    return Runner(
        kind,
        confiner,
        data_dir / "machines" / cfg.worker_id,
        data_dir / "shims" / cfg.worker_id,
        keep_machines=bool(cfg.keep_machines),
        log_caps=cfg.log_caps,
        forks=ForkServer.of(data_dir / "forkserver"),
    )


def isolation_of(cfg: WorkerConfig, owner: str, data_dir: Path) -> Isolation:
    """What a worker's machines get of their own here: their users and a network each (a
    root supplier's, unless the config says ``isolate = "off"``); the network only where
    the host has what it takes (known when the driver starts: Isolation.start)."""
    if cfg.isolate == "off" or os.geteuid() != 0:
        return Isolation()
    keep_private(data_dir)
    claims = host_claims()
    claims.live(owner, data_dir)
    network = WorkerNetwork(claims, owner, cfg.worker_id, cfg.machine_net)
    return Isolation(UidBlocks(claims, owner), network, resolv_conf(data_dir / "network"))
