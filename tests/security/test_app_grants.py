"""Apps under the generated auth config, from the attacker's side: a tenant keeps its own
app's record and secrets (under its name) and reaches no other tenant's; nobody but a
supplier gets a secret's value back, the shared buyer key and the tenants included; and a
tenant deploys its app with the real programs, each on its own key."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from bourse.client.apps import spec as spec_mod
from bourse.client.apps.store import AppChanged, AppRecord, AppStore, SecretStore
from bourse.nats.connection import flush_all
from bourse.nats.jetstream import apps_bucket_name, secrets_bucket_name
from supplier.secrets import read
from tests.security.conftest import PREFIX, Secured
from tests.security.test_end_to_end import run_buyer, start_market

APPS = apps_bucket_name(PREFIX)
SECRETS = secrets_bucket_name(PREFIX)
SPEC = 'app = "web"\nimage = "web"\nregions = ["mad"]\n[resources]\ncpus = 1\nmemory_mb = 64\n'


def _record(app: str = "web") -> AppRecord:
    spec = spec_mod.parse(SPEC.replace('"web"\nimage', f'"{app}"\nimage'))
    return AppRecord(spec=spec, generation=1, digest=spec.digest())


async def _set_up(secured: Secured) -> None:
    """The operator's set-up makes the buckets; bob keeps an app with a secret."""
    operator, _ = await secured.connect("operator")
    await AppStore.open(operator, PREFIX)
    await SecretStore.open(operator, PREFIX)
    bob, _ = await secured.connect("buyer:bob")
    bobs = await AppStore.open(bob, PREFIX, tenant="bob")
    await bobs.write("web", _record(), 0)
    await (await SecretStore.open(bob, PREFIX, tenant="bob")).set("web", {"TOKEN": "b0b"})


async def test_a_tenant_keeps_its_own_app_and_reaches_no_other(secured_js: Secured) -> None:
    await _set_up(secured_js)
    alice, violations = await secured_js.connect("buyer:alice")
    apps = await AppStore.open(alice, PREFIX, tenant="alice")
    assert await apps.names() == []  # bob's app is not hers to list
    assert await apps.get("web") is None
    revision = await apps.write("web", _record(), 0)
    secrets = await SecretStore.open(alice, PREFIX, tenant="alice")
    named = await secrets.set("web", {"TOKEN": "al1ce"})
    await apps.change("web", lambda r: msgspec.structs.replace(r, secrets=named))
    assert await apps.names() == ["web"]
    got = await apps.get("web")
    assert got is not None and got.secrets == named
    with pytest.raises(AppChanged, match="changed while this deploy ran"):
        await apps.write("web", _record(), revision, by="deploy")  # moved by the change
    assert violations.none_yet()

    # bob's keys, his bucket's listing and look-up, any secret's value: each refused
    bobs_key = f"$KV.{APPS}.bob.web"
    attempts = [
        (f"$JS.API.DIRECT.GET.KV_{APPS}.{bobs_key}", b""),
        (f"$JS.API.STREAM.MSG.GET.KV_{APPS}", b'{"last_by_subj": "%s"}' % bobs_key.encode()),
        (bobs_key, b"{}"),
        (f"$KV.{SECRETS}.bob.web.TOKEN", b"stolen"),
        (f"$JS.API.CONSUMER.CREATE.KV_{APPS}.x.$KV.{APPS}.bob.>", b"{}"),
        (f"$JS.API.CONSUMER.CREATE.KV_{APPS}", b"{}"),
        (f"$JS.API.STREAM.INFO.KV_{APPS}", b'{"subjects_filter": ">"}'),
        (f"$JS.API.STREAM.INFO.KV_{SECRETS}", b'{"subjects_filter": ">"}'),
        (f"$JS.API.DIRECT.GET.KV_{SECRETS}", b'{"multi_last": ["$KV.%s.>"]}' % SECRETS.encode()),
        (f"$JS.API.DIRECT.GET.KV_{SECRETS}.$KV.{SECRETS}.alice.web.TOKEN", b""),
    ]
    for subject, body in attempts:
        await alice.publish(subject, body, reply=alice.new_inbox())
    await flush_all(alice)
    assert violations.denied() == {s.lower() for s, _ in attempts}

    # what bob kept is as he left it
    bob, _ = await secured_js.connect("buyer:bob")
    bobs = await AppStore.open(bob, PREFIX, tenant="bob")
    assert await bobs.names() == ["web"]
    supplier, _ = await secured_js.connect("supplier:mad-1")
    assert await read(supplier, SECRETS, "bob.web") == {"TOKEN": "b0b"}
    assert await read(supplier, SECRETS, "alice.web") == {"TOKEN": "al1ce"}


async def test_the_shared_buyer_key_writes_secrets_and_reads_none_back(
    secured_js: Secured,
) -> None:
    await _set_up(secured_js)
    buyer, violations = await secured_js.connect("buyer")
    await (await SecretStore.open(buyer, PREFIX)).set("web", {"TOKEN": "sh4red"})
    attempts = [
        f"$JS.API.DIRECT.GET.KV_{SECRETS}",
        f"$JS.API.DIRECT.GET.KV_{SECRETS}.$KV.{SECRETS}.web.TOKEN",
        f"$JS.API.STREAM.MSG.GET.KV_{SECRETS}",
        f"$JS.API.CONSUMER.CREATE.KV_{SECRETS}",
        f"$JS.API.CONSUMER.CREATE.KV_{SECRETS}.x.$KV.{SECRETS}.web.TOKEN",
    ]
    for subject in attempts:
        await buyer.publish(subject, b"{}", reply=buyer.new_inbox())
    await flush_all(buyer)
    assert violations.denied() == {s.lower() for s in attempts}


async def test_the_shared_buyer_key_lists_every_tenants_apps(secured_js: Secured) -> None:
    """As docs/security.md says: it reads every record (it lists every machine). Issue 36
    found `apps list --json` showing `{"apps": []}` while two tenants had apps."""
    await _set_up(secured_js)  # bob's web
    alice, _ = await secured_js.connect("buyer:alice")
    await (await AppStore.open(alice, PREFIX, tenant="alice")).write("web", _record(), 0)
    shared, _ = await secured_js.connect("buyer")
    await (await AppStore.open(shared, PREFIX)).write("api", _record("api"), 0)
    code, out, err = await run_buyer(secured_js, "buyer", "apps", "list", "--json")
    assert code == 0, err
    rows = [(a["tenant"], a["app"], a["generation"]) for a in json.loads(out)["apps"]]
    assert rows == [("", "api", 1), ("alice", "web", 1), ("bob", "web", 1)]
    code, out, err = await run_buyer(secured_js, "buyer:alice", "apps", "list", "--json")
    assert code == 0 and [a["app"] for a in json.loads(out)["apps"]] == ["web"], err


@pytest.mark.slow
async def test_a_tenant_deploys_its_app_and_another_sees_none_of_it(
    secured: Secured, tmp_path: Path
) -> None:
    """alice sets a secret and deploys ``web`` (its machine started: the supplier read the
    secret under alice's scope); bob lists no app, no secret, no status of hers."""
    operator, _ = await secured.connect("operator")
    await AppStore.open(operator, PREFIX)  # the operator's set-up makes the buckets
    await SecretStore.open(operator, PREFIX)
    programs = await start_market(secured, tmp_path)
    try:
        code, out, err = await run_buyer(secured, "buyer:alice", "apps", "secrets", "set", "web",
                                      "TOKEN=al1ce")  # fmt: skip
        assert code == 0, err
        deploy = ["deploy", "--app", "web", "--region", "mad", "--cpus", "1"]
        deploy += ["--memory-mb", "256", "--image", "web", "--json"]
        code, out, err = await run_buyer(secured, "buyer:alice", *deploy)
        assert code == 0, out + err
        [slot] = json.loads(out)["slots"]
        assert slot["result"] == "done" and slot["order_id"] == "web.g1.mad.0", slot
        code, out, err = await run_buyer(secured, "buyer:alice", "apps", "list", "--json")
        listed = [(a["tenant"], a["app"]) for a in json.loads(out)["apps"]]
        assert code == 0 and listed == [("alice", "web")], err
        code, out, err = await run_buyer(secured, "buyer:alice", "apps", "status", "web", "--json")
        assert code == 0 and [m["state"] for m in json.loads(out)["machines"]] == ["started"]
        code, out, _ = await run_buyer(secured, "buyer:alice", "apps", "secrets", "list", "web")
        assert out.split() == ["TOKEN"]

        code, out, err = await run_buyer(secured, "buyer:bob", "apps", "list", "--json")
        assert code == 0 and json.loads(out)["apps"] == [], err
        code, out, err = await run_buyer(secured, "buyer:bob", "apps", "secrets", "list", "web")
        assert code == 0 and out == "", err
        code, out, err = await run_buyer(secured, "buyer:bob", "apps", "status", "web")
        assert code == 1 and "no app 'web'" in err, out + err
    finally:
        codes = [await p.stop() for p in reversed(programs)]
    assert codes == [0, 0, 0]
    for p in programs:
        assert "permissions violation" not in p.log.lower(), p.log
        assert "al1ce" not in p.log
