"""Hypothesis strategies for I6: malformed, truncated, oversized, wrongly typed and adversarial
messages for every subject of a market, each with what the answer must be.

Every bad case is invalid BY CONSTRUCTION (one field replaced by a value its type refuses, a
strict prefix of an object, …), so the expected answer is known without asking the code
under test: an ``Error`` with a given ``code`` whose ``detail`` starts like one of
``prefixes`` and contains every string of ``names`` (typically the JSON path of the field).

Subjects use a fixed market layout (``PREFIX``, ``REGION``, workers ``W1``/``W2``) so the
strategies can be built at import time; the harness starts processes that match it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

from bourse.wire import codec, messages
from bourse.wire.limits import (
    ID_PATTERN,
    IMAGE_PATTERN,
    MACHINE_ID_PATTERN,
    MAX_CPUS,
    MAX_DEADLINE_MS,
    MAX_DISK_MB,
    MAX_GPUS,
    MAX_HOLD_MS,
    MAX_MEMORY_MB,
    MAX_PAYLOAD_BYTES,
    ORDER_ID_PATTERN,
)
from bourse.wire.messages import MACHINE_VERBS
from bourse.wire.subjects import Subjects, shard_of

# -- the market these cases are aimed at ---------------------------------------------------------
PREFIX = f"prop{uuid.uuid4().hex[:10]}"
SUBJECTS = Subjects(PREFIX)
REGION = "pq"
BID_SHARDS = 2


def _two_workers_in_two_shards() -> tuple[str, str]:
    ids = [f"{REGION}-{i}" for i in range(1, 50)]
    first = ids[0]
    second = next(w for w in ids[1:] if shard_of(w, BID_SHARDS) != shard_of(first, BID_SHARDS))
    return first, second


W1, W2 = _two_workers_in_two_shards()
WORKERS = (W1, W2)
CAPACITY = {"cpus": 64, "memory_mb": 262144, "disk_mb": 1_000_000, "gpus": 4}  # each worker
LABELS = {"disk": "ssd", "zone": "a"}
SHARDS = tuple(shard_of(w, BID_SHARDS) for w in WORKERS)
# Replaced at send time by the id of the machine the harness placed on W1 at start-up (same
# length as a real id), so bad requests also aim at a machine that exists.
MID = f"{W1}~{'Z' * 26}"
SETUP_ORDER = "prop-setup"
OTHER_MID = "zz-9~01ARZ3NDEKTSV4RRFFQ69G5FAV"  # a worker nobody serves

ERROR_PREFIXES = ("malformed JSON", "invalid ", "empty payload", "payload of ")


@dataclass(frozen=True)
class Case:
    subject: str
    payload: bytes
    reply: bool = True  # sent as a request (else published without a reply subject)
    code: str = "bad_request"
    names: tuple[str, ...] = ()  # each must occur in Error.detail
    prefixes: tuple[str, ...] = ERROR_PREFIXES  # Error.detail starts with one of these
    label: str = ""  # which generator made it

    def __repr__(self) -> str:  # short enough for a failure report
        body = self.payload if len(self.payload) <= 300 else self.payload[:300] + b"..."
        return (
            f"Case({self.label}, {self.subject}, reply={self.reply}, {len(self.payload)} B, "
            f"code={self.code}, names={self.names}, payload={body!r})"
        )


# -- a JSON writer that can also write what json.dumps refuses -------------------------------------
@dataclass(frozen=True)
class Raw:
    """A JSON token written as is: may be invalid JSON (NaN) or invalid UTF-8."""

    data: bytes


class Pairs(list[tuple[str, Any]]):
    """An object as (key, value) pairs: keeps duplicated keys."""


def dump(v: Any) -> bytes:
    if isinstance(v, Raw):
        return v.data
    if isinstance(v, Pairs | dict):
        items = v if isinstance(v, Pairs) else v.items()
        return b"{" + b",".join(dump(k) + b":" + dump(x) for k, x in items) + b"}"
    if isinstance(v, list):
        return b"[" + b",".join(dump(x) for x in v) + b"]"
    return json.dumps(v, ensure_ascii=False).encode("utf-8", "surrogatepass")


# -- the targets: every subject, with the body type it decodes and a valid body --------------------
RESOURCES = {"cpus": 1, "memory_mb": 64, "disk_mb": 0, "gpus": 0}


@dataclass(frozen=True)
class Target:
    name: str
    subject: str
    typ: str  # the message type the receiver decodes (named in its errors)
    template: dict[str, Any]
    empty_ok: bool = False  # an empty body is a valid request here


def _targets() -> list[Target]:
    s = SUBJECTS
    order = {
        "type": "PlaceOrder",
        "order_id": "prop-1",
        "region": REGION,
        "resources": RESOURCES,
        "image": "web",
        "constraints": {"disk": "ssd"},
        "exclude_workers": ["zz-9"],
        "min_score": 0.0,
        "deadline_ms": 500,
        "metadata": {"k": "v"},
    }
    bid = {
        "type": "Bid",
        "order_id": "prop-1",
        "region": REGION,
        "resources": RESOURCES,
        "image": "web",
        "constraints": {},
        "exclude_workers": [],
        "hold_ms": 750,
        "auction_id": "a1",
        "wait_ms": 0,
    }
    commit = {
        "type": "Commit",
        "order_id": SETUP_ORDER,
        "worker_id": W1,
        "resources": RESOURCES,
        "image": "web",
        "metadata": {},
    }
    release: dict[str, Any] = {
        "type": "Release",
        "order_id": SETUP_ORDER,
        "worker_id": W1,
        "auction_id": "",
    }
    release |= {"abort_commit": True}
    mreq = {"type": "MachineRequest", "machine_id": MID, "tail": 100}
    lreq = {"type": "ListMachines", "worker_id": W1, "include_destroyed": False}
    out = [
        Target("order", s.order(REGION), "PlaceOrder", order),
        Target("bid", s.bid(REGION), "Bid", bid),
        *(Target(f"bid-shard{n}", s.bid_shard(REGION, n), "Bid", bid) for n in set(SHARDS)),
        Target("commit", s.commit(W1), "Commit", commit),
        Target("release", s.release(W1), "Release", release),
        Target("region-release", s.region_release(REGION), "Release", {**release, "worker_id": ""}),
        Target("status", s.status(REGION), "StatusRequest", {"type": "StatusRequest"}, True),
        Target("w-list", s.worker_machine(W1, "list"), "ListMachines", lreq, True),
        Target("x-list", s.machine("list"), "ListMachines", lreq),
    ]
    for verb in MACHINE_VERBS:
        if verb != "list":
            out.append(Target(f"w-{verb}", s.worker_machine(W1, verb), "MachineRequest", mreq))
            out.append(Target(f"x-{verb}", s.machine(verb), "MachineRequest", mreq))
    return out


TARGETS = _targets()

# (path, kind) of every field of every body type
_RES = [
    (("resources", "cpus"), ("int", 1, MAX_CPUS)),
    (("resources", "memory_mb"), ("int", 1, MAX_MEMORY_MB)),
    (("resources", "disk_mb"), ("int", 0, MAX_DISK_MB)),
    (("resources", "gpus"), ("int", 0, MAX_GPUS)),
]
_ORDER_ID = (("order_id",), ("str", ORDER_ID_PATTERN, 128))
_REGION = (("region",), ("str", ID_PATTERN, 63))
_IMAGE = (("image",), ("str", IMAGE_PATTERN, 255))
_OPT_ID = r"^([a-z0-9][a-z0-9-]{0,62})?\Z"
FIELDS: dict[str, list[tuple[tuple[str, ...], tuple[Any, ...]]]] = {
    "PlaceOrder": [
        _ORDER_ID,
        _REGION,
        *_RES,
        _IMAGE,
        (("constraints",), ("labels",)),
        (("exclude_workers",), ("ids",)),
        (("min_score",), ("float01",)),
        (("deadline_ms",), ("int", 1, MAX_DEADLINE_MS)),
        (("metadata",), ("metadata",)),
    ],
    "Bid": [
        _ORDER_ID,
        _REGION,
        *_RES,
        _IMAGE,
        (("constraints",), ("labels",)),
        (("exclude_workers",), ("ids",)),
        (("hold_ms",), ("int", 1, MAX_HOLD_MS)),
        (("auction_id",), ("free", 64)),
        (("wait_ms",), ("int", 0, MAX_DEADLINE_MS)),
    ],
    "Commit": [
        _ORDER_ID,
        (("worker_id",), ("str", ID_PATTERN, 63)),
        *_RES,
        _IMAGE,
        (("metadata",), ("metadata",)),
    ],
    "Release": [
        _ORDER_ID,
        (("worker_id",), ("str", _OPT_ID, 63)),
        (("auction_id",), ("free", 64)),
        (("abort_commit",), ("bool",)),
    ],
    "StatusRequest": [],
    "MachineRequest": [
        (("machine_id",), ("str", MACHINE_ID_PATTERN, 128)),
        (("tail",), ("int", 1, 1000)),
    ],
    "ListMachines": [
        (("worker_id",), ("str", _OPT_ID, 63)),
        (("include_destroyed",), ("bool",)),
    ],
}
REQUIRED: dict[str, list[tuple[str, ...]]] = {
    "PlaceOrder": [
        ("region",),
        ("resources",),
        ("image",),
        ("resources", "cpus"),
        ("resources", "memory_mb"),
    ],
    "Bid": [("order_id",), ("region",), ("resources",), ("image",), ("hold_ms",)],
    "Commit": [("order_id",), ("worker_id",), ("resources",), ("image",)],
    "Release": [("order_id",)],
    "MachineRequest": [("machine_id",)],
}
MESSAGE_NAMES = [
    "PlaceOrder",
    "Bid",
    "Offer",
    "Waiting",
    "Commit",
    "Placed",
    "Rejected",
    "Unfilled",
    "Error",
    "Release",
    "StatusRequest",
    "WorkerStatus",
    "MachineRequest",
    "ListMachines",
    "Machine",
    "MachineList",
    "MachineLogs",
    "Event",
]


def jpath(path: tuple[str, ...]) -> str:
    return "$." + ".".join(path)


# -- bad values, by kind -------------------------------------------------------------------------
_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
_json_any = st.recursive(
    _json_scalars,
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3)
    ),
    max_leaves=6,
)
_huge = st.integers(min_value=2**64, max_value=2**300)
# tokens that are not JSON at all: the whole payload becomes malformed
_not_json = st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"0x10", b"+1", b"01", b"tru"])
_bad_utf8 = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80"])


def _type_is(kind: str, v: Any) -> bool:
    """Does JSON value v have the JSON type this kind of field accepts?"""
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "float01":
        return isinstance(v, int | float) and not isinstance(v, bool)
    if kind in ("str", "free"):
        return isinstance(v, str)
    if kind == "bool":
        return isinstance(v, bool)
    if kind in ("labels", "metadata"):
        return isinstance(v, dict)
    if kind == "ids":
        return isinstance(v, list)
    raise AssertionError(kind)


@dataclass
class Bad:
    """A bad value for one field and how the error must point at it."""

    value: Any
    # field | key | value | item:<i> | none (no path: malformed JSON) | either (none or field)
    where: str = "field"
    extra: tuple[str, ...] = field(default_factory=tuple)


@st.composite
def bad_value(draw: st.DrawFn, kind: tuple[Any, ...]) -> Bad:
    k = kind[0]
    choice = draw(st.integers(0, 3))
    if choice == 0:  # a value of the wrong JSON type
        return Bad(draw(_json_any.filter(lambda v: not _type_is(k, v))))
    if choice == 1 and k not in ("labels", "metadata", "ids"):  # not JSON / not UTF-8
        if k in ("str", "free"):
            junk = draw(_bad_utf8)
            text = draw(st.text(alphabet="abc", max_size=4))
            return Bad(Raw(b'"' + text.encode() + junk + b'"'), "none", ("UTF-8",))
        # the decoder may refuse the token, or first the number it starts with (0x10 -> 0)
        return Bad(Raw(draw(_not_json)), "either")
    if k == "int":
        _, lo, hi = kind
        v = draw(
            st.one_of(
                st.integers(max_value=lo - 1),
                st.integers(min_value=hi + 1),
                _huge,
                _huge.map(lambda n: -n),
                st.just(Raw(b"1e400")),
                st.just(Raw(b"-1e400")),
            )
        )
        return Bad(v)
    if k == "float01":
        return Bad(
            draw(
                st.one_of(
                    st.floats(min_value=1.0, exclude_min=True, allow_infinity=False),
                    st.floats(max_value=-(2**-1000), allow_infinity=False),
                    st.just(Raw(b"1e400")),
                    st.just(Raw(b"-1e400")),
                    _huge.map(float),
                )
            )
        )
    if k == "bool":
        return Bad(draw(st.sampled_from([0, 1, "true", "false", "yes", 1.0])))
    if k == "str":
        _, pattern, maxlen = kind
        rx = re.compile(pattern)
        v = draw(
            st.one_of(
                st.text(max_size=24).filter(lambda s: not rx.match(s)),
                st.sampled_from(["", "\x00", "a\x00b", "pq\n", "PQ", "a b", "é", "😀", "a.b*>"]),
                st.integers(maxlen + 1, maxlen + 300).map(lambda n: "a" * n),
                st.integers(1, 40).map(lambda n: "\U0001f600" * n),
            ).filter(lambda s: not rx.match(s))
        )
        return Bad(v)
    if k == "free":
        n = draw(st.integers(kind[1] + 1, kind[1] + 200))
        return Bad(draw(st.sampled_from(["a", "é", "\x00", "😀", "\\"])) * n)
    if k == "labels":
        sub = draw(st.integers(0, 2))
        if sub == 0:
            key = draw(st.sampled_from(["", "a b", "-x", "k" * 64, "ü", "\x00", "a=b"]))
            return Bad({"disk": "ssd", key: "x"}, "key")
        if sub == 1:
            label = draw(st.sampled_from(["a b", "v" * 129, "ü", "\x00", "a\n", 5, None, ["x"]]))
            return Bad({"disk": label}, "value")
        n = draw(st.integers(65, 90))
        return Bad({f"k{i}": "v" for i in range(n)})
    if k == "metadata":
        sub = draw(st.integers(0, 2))
        if sub == 0:
            key = draw(st.sampled_from(["", "k" * 65, "é" * 65]))
            return Bad({"a": "b", key: "x"}, "key")
        if sub == 1:
            val = draw(
                st.one_of(
                    st.sampled_from([5, None, True, ["x"], {"a": "b"}, 1.5]),
                    st.integers(1025, 1600).map(lambda n: "m" * n),
                )
            )
            return Bad({"a": val}, "value")
        n = draw(st.integers(65, 90))
        return Bad({f"k{i}": "v" for i in range(n)})
    if k == "ids":
        sub = draw(st.integers(0, 1))
        if sub == 0:
            i = draw(st.integers(0, 5))
            item = draw(st.sampled_from(["", "A", "a b", "x" * 64, "-a", 7, None, ["a"]]))
            return Bad(["w1"] * i + [item] + ["w2"], f"item:{i}")
        n = draw(st.integers(1025, 1100))
        return Bad(["a"] * n)
    raise AssertionError(kind)


def _set(body: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    node = body
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return body


def _names(path: tuple[str, ...], bad: Bad) -> tuple[str, ...]:
    p = jpath(path)
    if bad.where in ("none", "either"):
        return bad.extra
    if bad.where == "key":
        return (f"in `{p}`",)
    if bad.where == "value":
        return (f"`{p}[...]`",)
    if bad.where.startswith("item:"):
        return (f"`{p}[{bad.where[5:]}]`",)
    return (f"`{p}`",)


def _prefixes(typ: str, bad: Bad | None = None) -> tuple[str, ...]:
    if bad is not None and bad.where == "none":
        return ("malformed JSON",)
    if bad is not None and bad.where == "either":
        return ("malformed JSON", f"invalid {typ}: ")
    return (f"invalid {typ}: ",)


# -- the case generators ---------------------------------------------------------------------------
targets = st.sampled_from(TARGETS)
# about one case in six is published without a reply subject (nothing must come back, and
# nothing may break)
replies = st.sampled_from([True, True, True, True, True, False])


@st.composite
def wrong_field(draw: st.DrawFn) -> Case:
    """One field (or the `type` tag) replaced by a value its type refuses; maybe as a
    duplicated key (the last one wins, so a good first copy must not hide it)."""
    t = draw(targets)
    fields = [*FIELDS[t.typ], (("type",), ("tag",))]
    path, kind = draw(st.sampled_from(fields))
    if kind[0] == "tag":
        value = draw(
            st.one_of(
                st.sampled_from([n for n in MESSAGE_NAMES if n != t.typ]),
                st.text(max_size=20).filter(lambda s: s != t.typ),
                st.sampled_from([t.typ.lower(), t.typ + " ", 1, None, [t.typ], {"a": 1}]),
            )
        )
        bad = Bad(value)
    else:
        bad = draw(bad_value(kind))
    if len(path) == 1 and draw(st.booleans()):  # duplicated key: good then bad, or bad then good
        good = t.template.get(path[0], "x")
        pairs = [(k, v) for k, v in t.template.items() if k != path[0]]
        dup = [(path[0], good), (path[0], bad.value)]
        if draw(st.booleans()):
            dup.reverse()
        body: Any = Pairs([*pairs, *dup])
    else:
        body = _set(t.template, path, bad.value)
    return Case(
        t.subject,
        dump(body),
        draw(replies),
        names=_names(path, bad),
        prefixes=_prefixes(t.typ, bad),
        label=f"wrong-field {t.name} {jpath(path)}",
    )


@st.composite
def missing_field(draw: st.DrawFn) -> Case:
    t = draw(targets.filter(lambda t: t.typ in REQUIRED))
    path = draw(st.sampled_from(REQUIRED[t.typ]))
    body = json.loads(json.dumps(t.template))
    node = body
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    names: tuple[str, ...] = (f"missing required field `{path[-1]}`",)
    if len(path) > 1:
        names += (f"`{jpath(path[:-1])}`",)
    return Case(
        t.subject, dump(body), draw(replies), names=names, prefixes=_prefixes(t.typ),
        label=f"missing {t.name} {jpath(path)}",
    )  # fmt: skip


@st.composite
def wrong_shape(draw: st.DrawFn) -> Case:
    """Valid JSON that is not an object."""
    t = draw(targets)
    value = draw(_json_any.filter(lambda v: not isinstance(v, dict)))
    return Case(
        t.subject, dump(value), draw(replies), names=("Expected `object`",),
        prefixes=_prefixes(t.typ), label=f"shape {t.name}",
    )  # fmt: skip


@st.composite
def truncated(draw: st.DrawFn) -> Case:
    """A strict prefix of a valid message (never a valid object: the closing brace is gone)."""
    t = draw(targets)
    data = dump(t.template)
    k = draw(st.integers(1 if t.empty_ok else 0, len(data) - 1))
    names = ("empty payload",) if k == 0 else ("malformed JSON",)
    return Case(t.subject, data[:k], draw(replies), names=names, label=f"truncated {t.name} {k}")


def _locally_valid(t: Target, data: bytes) -> bool:
    """Random bytes that happen to be a valid body (``{}`` on status): not a bad case."""
    if t.empty_ok and not data.strip():
        return True
    try:
        codec.decode(data, getattr(messages, t.typ))
    except codec.BadMessage:
        return False
    return True


@st.composite
def random_bytes(draw: st.DrawFn) -> Case:
    t = draw(targets)
    data = draw(
        st.one_of(
            st.binary(max_size=200),
            st.binary(max_size=40).map(lambda b: b"{" + b),
            st.text(max_size=60).map(lambda s: s.encode("utf-8", "surrogatepass")),
        ).filter(lambda d: not _locally_valid(t, d))
    )
    return Case(t.subject, data, draw(replies), label=f"random {t.name}")


@st.composite
def garbled(draw: st.DrawFn) -> Case:
    """A valid message with junk around it: a BOM, trailing garbage, a second object, bytes
    that are not UTF-8 between tokens, a NUL."""
    t = draw(targets)
    data = dump(t.template)
    how = draw(st.sampled_from(["bom", "trailing", "two", "nul", "badbyte-out"]))
    if how == "bom":
        data = b"\xef\xbb\xbf" + data
    elif how == "trailing":
        data = data + draw(st.sampled_from([b"x", b",", b"}", b"]", b"\x00", b"\xff", b"{}"]))
    elif how == "two":
        data = data + data
    elif how == "nul":
        data = b"\x00" + data
    else:
        data = data[:1] + draw(_bad_utf8) + data[1:]
    return Case(
        t.subject, data, draw(replies), names=("malformed JSON",), label=f"garbled-{how} {t.name}"
    )


@st.composite
def oversized(draw: st.DrawFn) -> Case:
    """A valid message padded (unknown field) to just over the 64 KiB limit, or far over it."""
    t = draw(targets)
    limit = codec.payload_limit(getattr(messages, t.typ))
    assert limit is not None and limit >= MAX_PAYLOAD_BYTES
    size = draw(
        st.one_of(
            st.integers(limit + 1, limit + 64),
            st.integers(limit + 65, 4 * MAX_PAYLOAD_BYTES),
        )
    )
    head = dump({**t.template, "pad": ""})
    data = head[:-2] + b"x" * (size - len(head)) + b'"}'
    assert len(data) == size
    return Case(
        t.subject, data, draw(replies), names=(f"{size} bytes exceeds the limit of {limit}",),
        prefixes=("payload of",), label=f"oversized {t.name}",
    )  # fmt: skip


@st.composite
def deeply_nested(draw: st.DrawFn) -> Case:
    """Arrays/objects nested thousands deep in an unknown field (skipped by the decoder, but
    parsed), or in a known field (refused at its first bracket)."""
    t = draw(targets)
    depth = draw(st.integers(2_000, 30_000))
    opener, closer = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
    nest = opener * depth + (b"1" if opener != b"[" else b"") + closer * depth
    head = dump(t.template)
    fields = [p for p, _ in FIELDS[t.typ] if len(p) == 1]
    if len(fields) > 0 and draw(st.booleans()):
        # arrays only: an object nested in an object field would be skipped as unknown keys
        nest = b"[" * depth + b"]" * depth
        name = draw(st.sampled_from(fields))[0]
        body = dump({k: v for k, v in t.template.items() if k != name})
        data = body[:-1] + b',"' + name.encode() + b'":' + nest + b"}"
        names: tuple[str, ...] = (f"`$.{name}",)
        prefixes = _prefixes(t.typ)
    else:
        data = head[:-1] + b',"deep":' + nest + b"}"
        names, prefixes = ("nested too deeply",), ("malformed JSON",)
    if len(data) > (codec.payload_limit(getattr(messages, t.typ)) or len(data)):
        names, prefixes = ("exceeds the limit",), ("payload of",)
    return Case(
        t.subject, data, draw(replies), names=names, prefixes=prefixes,
        label=f"nested {t.name} {depth}",
    )  # fmt: skip


# -- valid JSON sent where it does not fit, and unknown subjects ----------------------------------
ids = st.from_regex(r"\A[a-z0-9][a-z0-9-]{0,20}\Z")
verb_tokens = st.text(
    alphabet=st.characters(
        codec="utf-8", exclude_categories=("Cs", "Cc", "Zs", "Zl", "Zp"), exclude_characters=".*>"
    ),
    min_size=1,
    max_size=16,
)


@st.composite
def misplaced(draw: st.DrawFn) -> Case:
    s = SUBJECTS
    t = {x.name: x for x in TARGETS}
    kind = draw(st.integers(0, 9))
    if kind == 0:  # order for another region than its subject's
        sub_region, body_region = draw(st.lists(ids, min_size=2, max_size=2, unique=True))
        body = {**t["order"].template, "region": body_region}
        return Case(
            s.order(sub_region), dump(body), names=("does not match the subject's region",),
            prefixes=("order region",), label="order-region-mismatch",
        )  # fmt: skip
    if kind == 1:  # bid for another region
        region = draw(ids.filter(lambda r: r != REGION))
        body = {**t["bid"].template, "region": region}
        return Case(
            s.bid(REGION), dump(body), names=("does not match the subject's region",),
            prefixes=("bid region",), label="bid-region-mismatch",
        )  # fmt: skip
    if kind == 2:  # commit naming another worker
        other = draw(ids.filter(lambda w: w != W1))
        body = {**t["commit"].template, "worker_id": other}
        return Case(
            s.commit(W1), dump(body), names=(f"sent to worker '{W1}'",), prefixes=("commit for",),
            label="commit-other-worker",
        )  # fmt: skip
    if kind == 3:  # worker release naming another worker
        other = draw(ids.filter(lambda w: w != W1))
        body = {**t["release"].template, "worker_id": other}
        return Case(
            s.release(W1), dump(body), names=(f"sent to worker '{W1}'",),
            prefixes=("release for",), label="release-other-worker",
        )  # fmt: skip
    if kind == 4:  # a machine of another worker, asked of W1
        verb = draw(st.sampled_from([v for v in MACHINE_VERBS if v != "list"]))
        mid = f"{draw(ids.filter(lambda w: w != W1))}~01ARZ3NDEKTSV4RRFFQ69G5FAV"
        return Case(
            s.worker_machine(W1, verb), dump({"machine_id": mid}),
            names=(f"does not belong to worker {W1}",), prefixes=("machine ",),
            label="machine-foreign",
        )  # fmt: skip
    if kind == 5:  # a machine W1 does not have, directly or through the exchange
        verb = draw(st.sampled_from([v for v in MACHINE_VERBS if v != "list"]))
        mid = f"{W1}~{draw(st.from_regex(r'[A-Za-z0-9]{1,64}', fullmatch=True))}"
        subject = draw(st.sampled_from([s.worker_machine(W1, verb), s.machine(verb)]))
        return Case(
            subject, dump({"machine_id": mid}), names=(f"no machine {mid}",),
            prefixes=("no machine",), label="machine-unknown",
        )  # fmt: skip
    if kind == 6:  # machine.list through the exchange without a worker
        raw = draw(st.sampled_from([b"{}", b'{"worker_id":""}', b'{"include_destroyed":true}']))
        return Case(
            s.machine("list"), raw, names=("needs worker_id",), prefixes=("machine.list",),
            label="x-list-no-worker",
        )  # fmt: skip
    if kind == 7:  # through the exchange to a worker nobody serves
        verb = draw(st.sampled_from(MACHINE_VERBS))
        wid = draw(ids.filter(lambda w: w not in WORKERS))
        body = {"worker_id": wid} if verb == "list" else {"machine_id": f"{wid}~01ARZ3NDEKTSV4R"}
        return Case(
            s.machine(verb), dump(body), names=(f"worker '{wid}' is not reachable",),
            prefixes=("worker ",), label="x-unreachable",
        )  # fmt: skip
    if kind == 8:  # an unknown subject under a worker
        w = draw(st.sampled_from(WORKERS))
        tokens = draw(
            st.lists(verb_tokens, min_size=1, max_size=3).filter(
                lambda ts: (
                    ts not in (["commit"], ["release"])
                    and not (len(ts) == 2 and ts[0] == "machine" and ts[1] in MACHINE_VERBS)
                )
            )
        )
        if draw(st.booleans()):
            tokens = draw(st.sampled_from([["machine"], ["commit", "x"], ["machine", "reboot"]]))
        subject = f"{s.root}.worker.{w}." + ".".join(tokens)
        return Case(
            subject, draw(st.binary(max_size=30)), draw(replies), code="unknown_subject",
            names=(f"unknown subject {subject!r}",), prefixes=("unknown subject",),
            label="worker-unknown-subject",
        )  # fmt: skip
    verb = draw(verb_tokens.filter(lambda v: v not in MACHINE_VERBS))
    return Case(
        s.machine(verb), draw(st.binary(max_size=30)), draw(replies), code="unknown_subject",
        names=(f"unknown machine verb {verb!r}",), prefixes=("unknown machine verb",),
        label="exchange-unknown-verb",
    )  # fmt: skip


# wrong fields are the richest family: three times the weight of the other two
structured_cases = st.one_of(
    wrong_field(), wrong_field(), wrong_field(), missing_field(), wrong_shape()
)
raw_cases = st.one_of(truncated(), random_bytes(), garbled(), oversized(), deeply_nested())
misplaced_cases = misplaced()
