"""An app's spec: TOML (``app.toml``) parsed into a frozen :class:`AppSpec`, pure.

One error line names the key that is wrong (``app.toml: [checks][0].port: 'web2' is not a
declared port``); unknown keys are refused like bad values. What needs the market (regions
a worker serves, an image the store knows) is checked when the spec is applied.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from typing import Annotated, Any

import msgspec

from bourse.errors import BourseError
from bourse.runtime.words import did_you_mean, in_words
from bourse.wire.limits import ID_PATTERN
from bourse.wire.messages import Check, Env, Image, Labels, Ports, Region, Resources
from bourse.wire.metadata import RESERVED, RESTART_POLICIES
from bourse.wire.resources import cpu_fields, parse_cpus

CHECK_KINDS = ("http", "tcp")
# Metadata keys an app's machines carry for the app itself (a spec may not set them).
RESERVED_METADATA = RESERVED
MAX_PER_REGION = 64

AppName = Annotated[str, msgspec.Meta(pattern=ID_PATTERN)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_PER_REGION)]


class SpecError(BourseError, ValueError):
    """A spec that cannot be applied: one line naming the file, the key and the problem."""


MAX_IDLE_S = 7 * 24 * 3600
# A named port, or "" (``http`` where a machine has one, else its first).
ServicePort = Annotated[str, msgspec.Meta(pattern=r"^([A-Za-z_][A-Za-z0-9_]{0,31})?\Z")]
Limit = Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]


class AppService(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How the edge serves the app (docs/protocol.md §4.19, docs/edge.md): the named port
    its HTTP goes to ("": ``http`` where a machine has one, else its first); whether a
    request starts a stopped machine (``auto_start``), whether a machine idle for
    ``idle_s`` is stopped (``auto_stop``), never below ``min_machines_running`` started
    machines in a region; requests per machine an edge sends past which it prefers others
    (``soft_limit``) and never exceeds (``hard_limit``), 0: none. None of it is what a
    machine is made from: a change rolls no machine (it is left out of the digest)."""

    port: ServicePort = ""
    auto_start: bool = True
    auto_stop: bool = False
    idle_s: Annotated[float, msgspec.Meta(ge=1, le=MAX_IDLE_S)] = 300.0
    min_machines_running: Count = 0
    soft_limit: Limit = 0
    hard_limit: Limit = 0


class AppSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an app is: its machines (image, resources, env, named ports, checks, restart
    policy, worker labels, metadata) and where they run (``count`` started and ``spares``
    placed but not started in each region)."""

    app: AppName
    image: Image
    regions: Annotated[list[Region], msgspec.Meta(min_length=1, max_length=32)]
    resources: Resources
    count: Count = 1
    spares: Count = 0
    env: Env = {}
    ports: Ports = []
    checks: Annotated[list[Check], msgspec.Meta(max_length=16)] = []
    restart: str = ""
    labels: Labels = {}
    metadata: dict[str, str] = {}
    service: AppService = AppService()

    def digest(self, secrets_revision: str = "") -> str:
        """The canonical digest of what the machines are made from (the generation changes
        when it does): the spec's canonical JSON but its service section (how the edge
        serves it: no machine is made from it) and the secrets' revision."""
        made_of = {k: v for k, v in canonical(self).items() if k != "service"}
        doc = msgspec.json.encode(made_of)
        return hashlib.sha256(doc + b"|" + secrets_revision.encode()).hexdigest()


def canonical(spec: AppSpec) -> dict[str, Any]:
    """The spec as plain data with sorted keys (the same spec, the same bytes)."""
    return _sort(msgspec.to_builtins(spec))


def _sort(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _sort(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sort(v) for v in value]
    return value


# ``Expected `int` >= 0 - at `$.checks[0].port` `` -> the message and the path.
_AT = re.compile(r"^(?P<msg>.*?) - at `(?P<key>key` in `)?\$(?P<path>[^`]*)`$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<key>[^`]+)`")
_MISSING = re.compile(r"^Object missing required field `(?P<key>[^`]+)`")


def key_name(path: str) -> str:
    """``.checks[0].port`` -> ``[checks][0].port`` (the file's sections, as TOML names them)."""
    first, _, rest = path.lstrip(".").partition(".")
    head, bracket, index = first.partition("[")
    return f"[{head}]" + (bracket + index if bracket else "") + ("." + rest if rest else "")


def _explain(exc: msgspec.ValidationError) -> tuple[str, str]:
    text = str(exc)
    m = _AT.match(text)
    msg, path = (m.group("msg"), m.group("path")) if m else (text, "")
    if m and m.group("key"):
        msg = f"a key: {msg}"
    if u := _UNKNOWN.match(msg):
        nearest = did_you_mean(u.group("key"), AppSpec.__struct_fields__) if not path else ""
        path, msg = f"{path}.{u.group('key')}", f"unknown key{nearest}"
    elif u := _MISSING.match(msg):
        path, msg = f"{path}.{u.group('key')}", "missing"
    return (key_name(path) if path else "(top)"), in_words(msg)


# The wire's structs take unknown fields (a newer peer's); a spec file may not.
_NESTED = {"resources": frozenset(Resources.__struct_fields__) - {"cpu_millis"}}
_CHECK_KEYS = frozenset(Check.__struct_fields__)


def _known_keys(raw: dict[str, Any], where: str) -> None:
    for section, keys in _NESTED.items():
        value = raw.get(section)
        if isinstance(value, dict) and (extra := sorted(set(value) - keys)):
            nearest = did_you_mean(extra[0], keys)
            raise SpecError(f"{where}: [{section}].{extra[0]}: unknown key{nearest}")
    checks = raw.get("checks")
    for i, c in enumerate(checks if isinstance(checks, list) else []):
        if isinstance(c, dict) and (extra := sorted(set(c) - _CHECK_KEYS)):
            nearest = did_you_mean(extra[0], _CHECK_KEYS)
            raise SpecError(f"{where}: [checks][{i}].{extra[0]}: unknown key{nearest}")


def _cpus(raw: dict[str, Any], where: str) -> None:
    """``cpus`` as people write it (2, 0.5, "250m") -> the wire's fields."""
    res = raw.get("resources")
    if not isinstance(res, dict) or "cpus" not in res:
        return
    try:
        millis = parse_cpus(res["cpus"])
    except ValueError as exc:
        raise SpecError(f"{where}: [resources].cpus: {exc}") from None
    rest = {k: v for k, v in res.items() if k not in ("cpus", "cpu_millis")}
    raw["resources"] = {**rest, **cpu_fields(millis)}


def parse(text: str, where: str = "app.toml") -> AppSpec:
    """The spec in ``text`` (TOML), or :class:`SpecError` naming ``where`` and the key."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{where}: not TOML: {exc}") from None
    return from_dict(raw, where)


def from_dict(raw: dict[str, Any], where: str = "app.toml") -> AppSpec:
    """A spec from plain data (a TOML document, or the flags of ``buyer deploy``)."""
    raw = dict(raw)
    _known_keys(raw, where)
    _cpus(raw, where)
    try:
        spec = msgspec.convert(raw, AppSpec, strict=True)
    except msgspec.ValidationError as exc:
        key, msg = _explain(exc)
        raise SpecError(f"{where}: {key}: {msg}") from None
    _check(spec, where)
    return spec


def _check(spec: AppSpec, where: str) -> None:
    """What the types cannot say: one error line for the first problem."""
    if len(set(spec.regions)) != len(spec.regions):
        twice = next(r for r in spec.regions if spec.regions.count(r) > 1)
        raise SpecError(f"{where}: [regions]: {twice!r} is named twice")
    if len(set(spec.ports)) != len(spec.ports):
        twice = next(p for p in spec.ports if spec.ports.count(p) > 1)
        raise SpecError(f"{where}: [ports]: {twice!r} is named twice")
    if spec.count + spec.spares == 0:
        raise SpecError(f"{where}: [count]: count and spares are both 0 (nothing to run)")
    for i, c in enumerate(spec.checks):
        if c.port not in spec.ports:
            raise SpecError(f"{where}: [checks][{i}].port: {c.port!r} is not a declared port")
        if c.kind not in CHECK_KINDS:
            raise SpecError(f"{where}: [checks][{i}].kind: {c.kind!r} is not http or tcp")
        if c.kind == "http" and not c.path.startswith("/"):
            raise SpecError(f"{where}: [checks][{i}].path: an http check needs a path from /")
    if spec.restart and spec.restart not in RESTART_POLICIES:
        raise SpecError(
            f"{where}: [restart]: {spec.restart!r} is not a restart policy: use no, "
            "on-failure or always"
        )
    svc = spec.service
    if svc.port and svc.port not in spec.ports:
        raise SpecError(f"{where}: [service].port: {svc.port!r} is not a declared port")
    if svc.soft_limit and svc.hard_limit and svc.soft_limit > svc.hard_limit:
        raise SpecError(f"{where}: [service].soft_limit: more than hard_limit")
    if reserved := sorted(RESERVED_METADATA & set(spec.metadata)):
        raise SpecError(f"{where}: [metadata].{reserved[0]}: reserved for the app's own use")
    if len(spec.metadata) > 32:
        raise SpecError(f"{where}: [metadata]: at most 32 keys")
    for k, v in spec.metadata.items():
        if not 0 < len(k) <= 64 or len(v) > 1024:
            raise SpecError(f"{where}: [metadata].{k}: keys 1-64 characters, values <= 1024")
