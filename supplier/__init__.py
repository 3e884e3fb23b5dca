"""Bourse supplier daemon: one (or many virtual) workers selling their capacity.

This module is also the supplier's library API for tools: the load-test harness
(``loadtest/``) and the operator commands (``ops/``) import the supplier only from here,
never from its modules. What it offers:

- fleet files: ``WorkerConfig`` (one worker: what it sells, how it prices), its
  ``PricingConfig``, ``load_fleet(path)`` (TOML or JSON, raising ``ConfigError``) and
  ``check_workers(workers)`` (ids unique, each worker valid);
- the default price function: ``Pricer(PricingConfig)``, the very one a worker quotes
  with, so a simulator or an oracle scores placements exactly as the suppliers do; its
  image term for an image named by content: ``image_term(pull_s, half_s)`` (expected pull
  seconds to a term in (0, 1]) and ``ImageCost`` (what a worker's image costs it: bytes it
  lacks, seconds to pull them), which ``Pricer.price`` takes;
- the catalog's image cache model a simulator replays: ``CatalogCache`` (LRU of names
  within a budget, never evicting an image in use);
- the defaults of ``supplier run``: ``DEFAULT_MAX_OFFERS`` (offers one process makes per
  bid), ``DEFAULT_QUOTE_SAMPLE`` (workers one process quotes per bid) and
  ``DEFAULT_RECLAIM_AFTER_S`` (when a reserved machine is asked about, §5.3d);
- ``heartbeat_command(name, every_s)``: a catalog command running a tiny machine program
  for demos (it prints a line now and then), one that needs no file of this checkout;
- the container runtime the ``oci`` driver would use here: ``detect_runtime()`` (its name
  and version), or ``RuntimeUnavailable`` naming what to install.

Importing it is cheap: none of the daemon's NATS side (supplier/host.py) is loaded.
"""

from supplier.candidates import DEFAULT_QUOTE_SAMPLE
from supplier.config import ConfigError, WorkerConfig, check_workers, load_fleet
from supplier.desk import DEFAULT_MAX_OFFERS
from supplier.images import CatalogCache
from supplier.machines.heartbeat import command as heartbeat_command
from supplier.machines.host.confine import moves_favored as cgroup_moves_favored
from supplier.machines.oci.runtime import RuntimeUnavailable
from supplier.machines.oci.runtime import detect as detect_runtime
from supplier.pricing import ImageCost, Pricer, PricingConfig, image_term
from supplier.reclaim import DEFAULT_AFTER_S as DEFAULT_RECLAIM_AFTER_S

__all__ = [
    "DEFAULT_MAX_OFFERS",
    "DEFAULT_QUOTE_SAMPLE",
    "DEFAULT_RECLAIM_AFTER_S",
    "CatalogCache",
    "ConfigError",
    "ImageCost",
    "Pricer",
    "PricingConfig",
    "RuntimeUnavailable",
    "WorkerConfig",
    "cgroup_moves_favored",
    "check_workers",
    "detect_runtime",
    "heartbeat_command",
    "image_term",
    "load_fleet",
]
