"""The permission tables of the docs, rendered from what the server config is generated
from: each role's subjects (bourse/nats/permissions.py ``permissions_for``) and its JetStream
grants (bourse/nats/grants.py). docs/security.md holds all three tables, docs/protocol.md
§2.1 the subject table, each between ``<!-- begin generated: NAME -->`` and ``<!-- end
generated: NAME -->``; ``python -m bourse.nats.permtable docs/security.md
docs/protocol.md`` rewrites them, and tests/unit/test_permtable.py checks they match.

In the tables ``R`` is ``<prefix>.v1``, ``<PREFIX>`` the prefix's token in stream and
bucket names, ``<inbox>`` the user's own inbox prefix (``_INBOX.<its public nkey>``), and
``<buyer inbox>`` (and the others) every such user's."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from pathlib import Path

from bourse.nats import grants
from bourse.nats.auth import inbox_prefix_for, new_seed
from bourse.nats.grants import (
    RESOURCES,
    ROLE_BUYER,
    ROLE_EDGE,
    ROLE_EXCHANGE,
    ROLE_OPERATOR,
    ROLE_SUPPLIER,
    ROLE_TENANT,
    ROLES,
    VERBS,
)
from bourse.nats.permissions import User, permissions_for
from bourse.wire.subjects import Subjects

PREFIX = "bourse"
NONE = "—"
# Users as the tables name them, one per role.
USERS = {
    ROLE_OPERATOR: ("operator", ()),
    ROLE_EXCHANGE: ("exchange", ()),
    ROLE_SUPPLIER: ("supplier:<name>", (("<worker>", "<region>"),)),
    ROLE_BUYER: ("buyer", ()),
    ROLE_TENANT: ("buyer:<name>", ()),
    ROLE_EDGE: ("edge", ()),
}
JETSTREAM_SUBJECTS = ("$JS.", "$KV.", "$O.")
_BLOCK = re.compile(
    r"(<!-- begin generated: (?P<name>[a-z]+) -->\n)(?:.*?\n)?(<!-- end generated: (?P=name) -->)",
    re.S,
)


def _users() -> list[User]:
    return [User(USERS[role][0], role, new_seed(), USERS[role][1]) for role in ROLES]


def _name(role: str) -> str:
    return f"`{USERS[role][0]}`" + (" (a tenant)" if role == ROLE_TENANT else "")


def _shown(subject: str, inboxes: dict[str, str]) -> str:
    """A subject as the docs write it: ``R.…``, inbox prefixes by whose, queue groups said."""
    subject, _, queue = subject.partition(" ")
    for prefix, placeholder in inboxes.items():
        subject = subject.replace(prefix, placeholder)
    subject = subject.replace(Subjects(PREFIX).root, "R")
    return f"`{subject}`" + (f" (queue group `{queue}`)" if queue else "")


def _cell(items: Iterable[str]) -> str:
    return ", ".join(items) or NONE


def subjects_table() -> str:
    """Each role's market subjects (JetStream's are the next table's)."""
    users = _users()
    s = Subjects(PREFIX)
    rows = [
        "| user | publish | subscribe | answers into |",
        "|---|---|---|---|",
    ]
    for user in users:
        inboxes = {inbox_prefix_for(u.public_key): f"<{u.role} inbox>" for u in users}
        inboxes[inbox_prefix_for(user.public_key)] = "<inbox>"
        p = permissions_for(user, s, users)
        own = [x for x in p.publish if not x.startswith((*JETSTREAM_SUBJECTS, "_INBOX."))]
        answers = [x for x in p.publish if x.startswith("_INBOX.")]
        rows.append(
            f"| {_name(user.role)} | {_cell(_shown(x, inboxes) for x in own)} "
            f"| {_cell(_shown(x, inboxes) for x in p.subscribe)} "
            f"| {_cell(_shown(x, inboxes) for x in answers)} |"
        )
    return "\n".join(rows)


def jetstream_table() -> str:
    """Each role's verbs on each of the market's streams and buckets (grants.GRANTS)."""
    head = [
        f"{r.title} `{r.bucket(PREFIX)}`" if r.kind != "account" else r.title for r in RESOURCES
    ]
    rows = [
        "| user | " + " | ".join(head).replace("BOURSE", "<PREFIX>") + " |",
        "|---" * (len(RESOURCES) + 1) + "|",
    ]
    for role in ROLES:
        cells = [
            _cell(v.name for v in VERBS if v.name in grants.granted(role, r)) for r in RESOURCES
        ]
        rows.append(f"| {_name(role)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def verbs_table() -> str:
    """What each verb is, and the API subjects it grants (``S``: the stream; ``B``: the
    bucket; ``R.state``: the state stream's rows)."""
    rows = ["| verb | what | API subjects |", "|---|---|---|"]
    for v in VERBS:
        subjects: list[str] = []
        for kind, data in (
            ("stream", ""),
            ("kv", "$KV.B"),
            ("objects", "$O.B"),
            ("state", "R.state"),
        ):
            if kind in v.kinds:
                subjects += v.allows("S", _owned(v, kind, data))
        if "account" in v.kinds:  # what no role may use is shown by what it tries
            subjects += v.allows("", "") or v.probes("", "")
        shown = _cell(f"`{x}`".replace(grants.PROBE, "<other>") for x in dict.fromkeys(subjects))
        rows.append(f"| {v.name} | {v.what} | {shown} |")
    return "\n".join(rows)


def _owned(v: grants.Verb, kind: str, data: str) -> str:
    """What a verb's subjects are shown made with: its data, a tenant's own keys (its own
    machines' rows of the state stream), or a worker's own consumer and its filter."""
    if v.own == grants.OWN_WORKER:
        return "cmd-<worker>.R.command.<worker>"
    if not v.own:
        return data
    return f"{data}.machine.<name>" if kind == "state" else f"{data}.<name>"


TABLES = {"subjects": subjects_table, "jetstream": jetstream_table, "verbs": verbs_table}


def rewrite(text: str) -> str:
    """``text`` with every generated block replaced by its table as rendered now."""
    return _BLOCK.sub(lambda m: f"{m.group(1)}{TABLES[m.group('name')]()}\n{m.group(3)}", text)


def main(paths: list[str]) -> None:
    for path in paths:
        p = Path(path)
        p.write_text(rewrite(p.read_text()))


if __name__ == "__main__":
    main(sys.argv[1:])
