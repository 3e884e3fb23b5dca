"""Hypothesis strategies for VALID messages with extreme-but-legal values: longest ids and
images, most labels and metadata, largest resources, deadlines and holds, payloads of
exactly the 64 KiB limit, unknown fields (ignored by design), unicode and NUL in free text.

``UNIQ`` in an order id is replaced at send time by a token unique in the session, so a
replayed or shrunk example never meets an order id an earlier one used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from bourse.wire.limits import (
    MAX_CPUS,
    MAX_DEADLINE_MS,
    MAX_DISK_MB,
    MAX_GPUS,
    MAX_HOLD_MS,
    MAX_MEMORY_MB,
    MAX_PAYLOAD_BYTES,
)
from tests.property.strategies import (
    CAPACITY,
    LABELS,
    MID,
    REGION,
    SETUP_ORDER,
    SUBJECTS,
    W1,
    WORKERS,
    dump,
)

UNIQ = "U" * 12


def order_id() -> st.SearchStrategy[str]:
    """UNIQ plus up to the 128-character maximum of legal characters."""
    return st.integers(0, 128 - len(UNIQ)).flatmap(
        lambda n: st.sampled_from("aZ9._:-").map(lambda c: UNIQ + c * n)
    )


free_text = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", "\x00", "a\x00b", "😀" * 10, "\u202e\u200b", "\\\"'", "\n\t"]),
)
images = st.one_of(
    st.just("web"),
    st.integers(1, 255).map(lambda n: ("w" + "eb/:@+-._" * 40)[:n]),
)
legal_ids = st.one_of(
    st.sampled_from(list(WORKERS)),
    st.integers(1, 63).map(lambda n: ("z" + "9-" * 40)[:n]),
    st.from_regex(r"\A[a-z0-9][a-z0-9-]{0,10}\Z"),
)


def _amount(lo: int, mx: int, cap: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.sampled_from(sorted({lo, max(lo, 1), cap // 4, cap, min(cap + 1, mx), mx})),
        st.integers(lo, mx),
    )


resources = st.fixed_dictionaries(
    {
        "cpus": _amount(1, MAX_CPUS, CAPACITY["cpus"]),
        "memory_mb": _amount(1, MAX_MEMORY_MB, CAPACITY["memory_mb"]),
    },
    optional={
        "disk_mb": _amount(0, MAX_DISK_MB, CAPACITY["disk_mb"]),
        "gpus": _amount(0, MAX_GPUS, CAPACITY["gpus"]),
    },
)
small_resources = st.fixed_dictionaries(
    {"cpus": st.integers(1, 4), "memory_mb": st.integers(1, 8192)},
    optional={"disk_mb": st.integers(0, 1000), "gpus": st.integers(0, 1)},
)
constraints: st.SearchStrategy[dict[str, str]] = st.one_of(
    st.just({}),
    st.sampled_from([{"disk": "ssd"}, {"zone": "a"}, dict(LABELS), {"disk": ""}]),
    # up to the 64-entry maximum of 63-character keys and 128-character values: no worker
    # has such labels
    st.integers(1, 64).map(
        lambda n: {f"k{i:02d}" + "x" * 60: ("v/:._-" * 30)[:128] for i in range(n)}
    ),
)


def _big_metadata(t: tuple[int, str]) -> dict[str, str]:
    """n entries of 64-character keys and values as long as fits in ~58 KB (at most 1024)."""
    n, char = t
    per_char = len(json.dumps(char)) - 2
    length = max(0, min(1024, (58_000 // n - 72) // per_char))
    return {f"{i:02d}" + "k" * 62: char * length for i in range(n)}


def _big_exclude(n: int) -> list[str]:
    """n distinct worker ids, as long as fits in ~58 KB (at most 63 characters)."""
    length = max(6, min(63, 58_000 // n - 3))
    return [(f"x{i}-" + "y" * 63)[:length] for i in range(n)]


metadata = st.sampled_from(["none", "some", "big"]).flatmap(
    lambda kind: {
        "none": st.just({}),
        "some": st.dictionaries(st.text(min_size=1, max_size=64), free_text, max_size=8),
        "big": st.tuples(st.integers(1, 64), st.sampled_from("aé😀\x00")).map(_big_metadata),
    }[kind]
)
exclude = st.sampled_from(["none", "some", "big"]).flatmap(
    lambda kind: {
        "none": st.just([]),
        "some": st.lists(legal_ids, max_size=8),
        "big": st.integers(1, 1024).map(_big_exclude),
    }[kind]
)
KNOWN_FIELDS = {
    *("type", "order_id", "region", "resources", "image", "constraints", "exclude_workers"),
    *("min_score", "deadline_ms", "metadata", "hold_ms", "auction_id", "wait_ms", "worker_id"),
    *("machine_id", "tail", "include_destroyed", "abort_commit", "retry"),
}
unknown = st.dictionaries(  # fields this version does not know: ignored (protocol §3.2)
    st.text(min_size=1, max_size=10).filter(lambda k: k not in KNOWN_FIELDS),
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda k: st.lists(k, max_size=3) | st.dictionaries(st.text(max_size=3), k, max_size=3),
        max_leaves=10,
    ),
    max_size=3,
)


def fit_to_limit(body: dict[str, Any], exact: bool) -> bytes | None:
    """The body as JSON; ``exact``: padded with an unknown field to exactly the 64 KiB limit.
    None if it is over the limit already (not a valid message then)."""
    data = dump(body)
    if exact:
        head = dump({**body, "zz_pad": ""})
        if len(head) <= MAX_PAYLOAD_BYTES:
            data = head[:-2] + b"p" * (MAX_PAYLOAD_BYTES - len(head)) + b'"}'
            assert len(data) == MAX_PAYLOAD_BYTES
    return data if len(data) <= MAX_PAYLOAD_BYTES else None


@dataclass(frozen=True)
class Valid:
    subject: str
    payload: bytes
    body: dict[str, Any]
    expect: str  # the reply type that must come back ("" = a publish, nothing comes back)
    label: str = ""

    def __repr__(self) -> str:
        body = self.payload if len(self.payload) <= 400 else self.payload[:400] + b"..."
        return (
            f"Valid({self.label}, {self.subject}, {len(self.payload)} B, {self.expect}, {body!r})"
        )


@st.composite
def extreme_order(draw: st.DrawFn) -> Valid:
    body: dict[str, Any] = {"region": REGION, "image": draw(images)}
    body["order_id"] = draw(order_id())
    body["resources"] = draw(st.sampled_from([resources, small_resources]).flatmap(lambda s: s))
    opt = {
        "constraints": constraints,
        "exclude_workers": exclude,
        "min_score": st.one_of(st.sampled_from([0.0, 1.0, 0, 1, 5e-324]), st.floats(0, 1)),
        "deadline_ms": st.sampled_from([1, 2, 300, 2000, MAX_DEADLINE_MS]),
        "metadata": metadata,
        "type": st.just("PlaceOrder"),
    }
    for k, strat in opt.items():
        if draw(st.booleans()):
            body[k] = draw(strat)
    body.update({k: v for k, v in draw(unknown).items() if k not in body})
    how = draw(
        st.sampled_from(["as is", "padded", "metadata to the limit", "exclusions to the limit"])
    )
    if how.endswith("to the limit"):
        body.pop("metadata", None)
        body.pop("exclude_workers", None)
        body = _to_the_limit(body, "metadata" if how.startswith("metadata") else "exclude_workers")
    data = fit_to_limit(body, how == "padded")
    if data is None:  # too big for one message: keep the body, shorten its long lists
        body.pop("exclude_workers", None)
        body.pop("metadata", None)
        data = fit_to_limit(body, False)
        assert data is not None
    return Valid(SUBJECTS.order(REGION), data, body, "Placed|Unfilled", f"order {how}")


def _to_the_limit(body: dict[str, Any], name: str) -> dict[str, Any]:
    """Grow one field (1024-character metadata values, or 63-character excluded worker
    ids) until the order is exactly MAX_PAYLOAD_BYTES long (sizes added up, not re-encoded)."""
    room = MAX_PAYLOAD_BYTES - len(dump({**body, name: {} if name == "metadata" else []}))
    grown: Any
    if name == "metadata":
        grown, next_min = {}, 1 + 66 + 1 + 2  # , "key": ""
        for i in range(64):
            key = f"{i:02d}" + "k" * 62
            cost = (1 if grown else 0) + len(key) + 2 + 1 + 2
            n = min(1024, room - cost)
            if n < 0:
                break
            left = room - cost - n
            if 0 < left < next_min:  # leave room for one more entry, to end exactly
                n -= next_min - left
            grown[key] = "a" * n
            room -= cost + n
            if room == 0:
                break
    else:
        grown, next_min = [], 1 + 2 + 7  # , "x1023-y"
        for i in range(1024):
            prefix = f"x{i}-"
            cost = (1 if grown else 0) + 2
            n = min(63, room - cost)
            if n <= len(prefix):
                break
            left = room - cost - n
            if 0 < left < next_min:
                n -= next_min - left
            grown.append((prefix + "y" * 63)[:n])
            room -= cost + n
            if room == 0:
                break
    body = {**body, name: grown}
    assert len(dump(body)) <= MAX_PAYLOAD_BYTES
    return body


@st.composite
def extreme_bid(draw: st.DrawFn) -> Valid:
    body: dict[str, Any] = {
        "type": "Bid",
        "order_id": draw(order_id()),
        "region": REGION,
        "resources": draw(st.one_of(resources, small_resources)),
        "image": draw(images),
        "hold_ms": draw(st.sampled_from([1000, 5000, MAX_HOLD_MS])),
    }
    for k, strat in {
        "constraints": constraints,
        "exclude_workers": exclude,
        "auction_id": st.one_of(free_text.map(lambda s: s[:64]), st.just("é" * 64)),
        "wait_ms": st.sampled_from([0, 1, MAX_DEADLINE_MS]),
    }.items():
        if draw(st.booleans()):
            body[k] = draw(strat)
    data = fit_to_limit(body, draw(st.integers(0, 9)) == 0)
    if data is None:
        body.pop("exclude_workers")
        data = fit_to_limit(body, False)
        assert data is not None
    shards = [SUBJECTS.bid(REGION), *(SUBJECTS.bid_shard(REGION, s) for s in _shards())]
    return Valid(draw(st.sampled_from(shards)), data, body, "Offer", "bid")


def _shards() -> list[int]:
    from tests.property.strategies import SHARDS

    return sorted(set(SHARDS))


@st.composite
def harmless(draw: st.DrawFn) -> Valid:
    """Valid requests that must not change anything: reads of every kind, a repeated commit
    of the machine's order, a commit without a hold, releases of orders nobody holds."""
    s = SUBJECTS
    kind = draw(st.integers(0, 7))
    extra = {k: v for k, v in draw(unknown).items()}
    if kind == 0:
        verb = draw(st.sampled_from(["get", "logs"]))
        body = {"machine_id": MID, **extra}
        if verb == "logs" and draw(st.booleans()):
            body["tail"] = draw(st.sampled_from([1, 1000]))
        subject = draw(st.sampled_from([s.worker_machine(W1, verb), s.machine(verb)]))
        expect = "Machine" if verb == "get" else "MachineLogs"
    elif kind == 1:
        body = {**extra, "include_destroyed": draw(st.booleans())}
        if draw(st.booleans()):
            body["worker_id"] = W1
        subject, expect = s.worker_machine(W1, "list"), "MachineList"
    elif kind == 2:
        body = {"worker_id": draw(st.sampled_from(WORKERS)), **extra}
        subject, expect = s.machine("list"), "MachineList"
    elif kind == 3:
        body = {"type": "StatusRequest", **extra}
        subject, expect = s.status(REGION), "WorkerStatus"
    elif kind == 4:  # the order already has its machine: re-reported, nothing new
        body = {
            "order_id": SETUP_ORDER,
            "worker_id": W1,
            "resources": draw(resources),
            "image": draw(images),
            "metadata": draw(metadata),
            **extra,
        }
        subject, expect = s.commit(W1), "Placed"
    elif kind == 5:  # no hold for it
        body = {
            "order_id": draw(order_id()),
            "worker_id": W1,
            "resources": draw(resources),
            "image": draw(images),
            **extra,
        }
        subject, expect = s.commit(W1), "Rejected"
    else:  # releases of orders nobody holds (worker form, even with abort_commit; region form)
        body = {
            "order_id": draw(order_id()),
            "auction_id": draw(free_text.map(lambda t: t[:64])),
            "abort_commit": draw(st.booleans()),
            **extra,
        }
        if kind == 6:
            body["worker_id"] = draw(st.sampled_from([W1, ""]))
            subject = s.release(W1)
        else:
            subject = s.region_release(REGION)
        expect = ""
    data = fit_to_limit(body, draw(st.integers(0, 5)) == 0)
    if data is None:
        body.pop("metadata", None)
        data = fit_to_limit(body, False)
        assert data is not None
    if kind in (1, 3) and not extra and draw(st.booleans()):
        data = draw(st.sampled_from([b"", b" ", b"\n\t ", b"{}"]))  # "no parameters"
    return Valid(subject, data, body, expect, f"harmless-{kind}")


def canonical(v: Any) -> Any:
    return json.loads(json.dumps(v))
