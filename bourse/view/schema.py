"""A view's tables (``workers``, ``beats``, ``machines``, ``apps``, ``meta``) and their
indexes, and the version that names them: what bourse/view/db.py writes and
bourse/view/stored.py reads. A leaf (no NATS, no wire types): the CLI reads a view it caught
up a moment ago without either."""

from __future__ import annotations

# Bumped when the tables change: a view of another version is thrown away and rebuilt.
SCHEMA_VERSION = 2
SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY, region TEXT NOT NULL, beat TEXT NOT NULL, labels TEXT NOT NULL,
    cpu_millis INTEGER, memory_mb INTEGER, disk_mb INTEGER, gpus INTEGER, ports INTEGER,
    free_cpu_millis INTEGER, free_memory_mb INTEGER, free_disk_mb INTEGER, free_gpus INTEGER,
    free_ports INTEGER, machines INTEGER, draining INTEGER, drain_reason TEXT, driver TEXT,
    runtime TEXT, confinement TEXT, isolation TEXT, cache_bytes INTEGER,
    cache_budget_bytes INTEGER, advertise_host TEXT, port_range TEXT, version TEXT,
    at_ms INTEGER, row TEXT NOT NULL,
    gone_since_ms INTEGER, seq INTEGER NOT NULL, seen_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS workers_region ON workers (region);
CREATE TABLE IF NOT EXISTS beats (
    beat TEXT PRIMARY KEY, region TEXT NOT NULL, workers TEXT NOT NULL, at_ms INTEGER NOT NULL,
    interval_ms INTEGER NOT NULL, version TEXT, seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS machines (
    machine_id TEXT PRIMARY KEY, order_id TEXT NOT NULL, tenant TEXT NOT NULL,
    worker_id TEXT NOT NULL, region TEXT NOT NULL, state TEXT NOT NULL, app TEXT, slot INTEGER,
    role TEXT, generation INTEGER, image TEXT NOT NULL, image_digest TEXT, cpu_millis INTEGER,
    memory_mb INTEGER, disk_mb INTEGER, gpus INTEGER, addresses TEXT, health TEXT,
    health_since_ms INTEGER, restarts INTEGER, last_exit TEXT, last_exit_at_ms INTEGER,
    simulated INTEGER, created_at_ms INTEGER, updated_at_ms INTEGER, row TEXT NOT NULL,
    worker_gone_since_ms INTEGER, seq INTEGER NOT NULL, seen_ms INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS machines_listing
    ON machines (region, worker_id, created_at_ms, machine_id);
CREATE INDEX IF NOT EXISTS machines_worker ON machines (worker_id);
CREATE INDEX IF NOT EXISTS machines_app ON machines (tenant, app);
CREATE INDEX IF NOT EXISTS machines_destroyed ON machines (seen_ms) WHERE state = 'destroyed';
CREATE TABLE IF NOT EXISTS apps (
    tenant TEXT NOT NULL, app TEXT NOT NULL, generation INTEGER, regions TEXT NOT NULL,
    machines INTEGER NOT NULL, started INTEGER NOT NULL, spares INTEGER NOT NULL,
    unknown INTEGER NOT NULL, updated_at_ms INTEGER, PRIMARY KEY (tenant, app)
);
"""
TABLES = ("workers", "beats", "machines", "apps", "meta")
