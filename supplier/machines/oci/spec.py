"""The OCI runtime spec (1.0), the fields the oci driver sets: a bundle's ``config.json``
as types (supplier/machines/oci/bundle.py fills them)."""

from __future__ import annotations

import msgspec

from supplier.machines.oci.seccomp import Seccomp


class SpecUser(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    uid: int
    gid: int
    additional_gids: list[int] = []


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    bounding: list[str]
    effective: list[str]
    permitted: list[str]
    inheritable: list[str]
    ambient: list[str]


class Rlimit(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    hard: int
    soft: int


class Process(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    terminal: bool
    user: SpecUser
    args: list[str]
    env: list[str]
    cwd: str
    capabilities: Capabilities
    rlimits: list[Rlimit]
    no_new_privileges: bool


class Root(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    readonly: bool


class Mount(msgspec.Struct, frozen=True, kw_only=True):
    destination: str
    type: str
    source: str
    options: list[str]


class Namespace(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    type: str
    path: str = ""  # join this one (a network namespace made for the machine) instead


class IdMapping(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    container_id: int
    host_id: int
    size: int


class DeviceRule(msgspec.Struct, frozen=True, kw_only=True):
    allow: bool
    access: str


class Memory(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    limit: int
    swap: int | None = None


class Cpu(msgspec.Struct, frozen=True, kw_only=True):
    quota: int
    period: int


class Pids(msgspec.Struct, frozen=True, kw_only=True):
    limit: int


class LinuxResources(msgspec.Struct, frozen=True, kw_only=True):
    devices: list[DeviceRule]
    memory: Memory
    cpu: Cpu
    pids: Pids


class Linux(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    cgroups_path: str
    namespaces: list[Namespace]
    resources: LinuxResources
    masked_paths: list[str]
    readonly_paths: list[str]
    uid_mappings: list[IdMapping] = []
    gid_mappings: list[IdMapping] = []
    seccomp: Seccomp | None = None


class Spec(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    """A bundle's ``config.json``."""

    oci_version: str
    process: Process
    root: Root
    hostname: str
    mounts: list[Mount]
    linux: Linux


def encode(spec: Spec) -> bytes:
    """``config.json``'s bytes."""
    return msgspec.json.encode(spec)
