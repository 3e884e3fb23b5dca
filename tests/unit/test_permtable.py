"""The permission tables in the docs are the ones the server config is generated from
(bourse/nats/permtable.py renders them; regenerate with ``python -m bourse.nats.permtable
docs/security.md docs/protocol.md``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bourse.nats import grants, permtable

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("doc", "tables"),
    [("security.md", {"subjects", "jetstream", "verbs"}), ("protocol.md", {"subjects"})],
)
def test_the_docs_show_the_tables_as_generated(doc: str, tables: set[str]) -> None:
    text = (ROOT / "docs" / doc).read_text()
    assert {m.group("name") for m in permtable._BLOCK.finditer(text)} == tables
    assert permtable.rewrite(text) == text, (
        f"docs/{doc} differs from the generated permission tables: run "
        "python -m bourse.nats.permtable docs/security.md docs/protocol.md"
    )


def _admin_on(role: str, resource: grants.Resource, admin: set[str]) -> tuple[set[str], set[str]]:
    """The admin verbs ``role`` may use on ``resource``, and on every other resource."""
    elsewhere = {v for r in grants.RESOURCES if r is not resource for v in grants.granted(role, r)}
    return set(grants.granted(role, resource)) & admin, elsewhere & admin


def test_no_key_but_the_operators_may_change_delete_or_purge_a_stream_or_bucket() -> None:
    """Deny by default: the exchange may only make what is missing, and empty only the
    uploads tenants staged once it published them; no supplier, buyer or tenant may make,
    change or empty anything, nor use a consumer it did not make (a supplier makes and pulls
    its own workers' consumers of the command stream only, never another worker's); a buyer
    writes keys of the apps' buckets only (its apps' specs and secrets)."""
    admin = {"update", "delete", "purge", "erase", "consumers", "pull", "others"}
    own = {"consumers own", "pull own"}  # a supplier's, for its own workers only
    for role in grants.ROLES:
        used = {v for r in grants.RESOURCES for v in grants.granted(role, r)}
        if role == grants.ROLE_OPERATOR:
            assert admin - {"others"} <= used and "others" not in used
        elif role == grants.ROLE_EXCHANGE:
            assert _admin_on(role, grants.STAGING, admin) == ({"purge"}, set())
        elif role == grants.ROLE_SUPPLIER:
            # its own workers' durable consumers of the command stream, and nothing else
            assert _admin_on(role, grants.COMMANDS, admin | own) == (own, set())
            assert "create" not in used and "write" not in used
        else:
            assert not used & (admin | own | {"create"}), role
            writes = {r.key for r in grants.RESOURCES if "write" in grants.granted(role, r)}
            assert writes <= {grants.APPS.key, grants.APP_SECRETS.key}, role
