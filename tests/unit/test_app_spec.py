"""The app spec (bourse/client/apps/spec.py): a good file parses; each bad key is one
error line naming it."""

from __future__ import annotations

import msgspec
import pytest

from bourse.client.apps.spec import AppSpec, SpecError, from_dict, parse
from bourse.errors import BourseError
from bourse.wire.messages import Check, Resources

GOOD = """
app = "hello"
image = "hello:latest"
regions = ["mad", "ams"]
count = 1
spares = 1
ports = ["web"]
restart = "on-failure"

[resources]
cpus = 0.5
memory_mb = 256

[env]
GREETING = "hi"

[[checks]]
port = "web"
kind = "http"
path = "/healthz"
interval_s = 1

[labels]
tier = "a"

[metadata]
team = "core"
"""


def test_a_good_spec_parses() -> None:
    spec = parse(GOOD)
    assert (spec.app, spec.image, spec.regions) == ("hello", "hello:latest", ["mad", "ams"])
    assert (spec.count, spec.spares, spec.restart) == (1, 1, "on-failure")
    assert spec.resources == Resources(cpus=1, cpu_millis=500, memory_mb=256)
    assert spec.env == {"GREETING": "hi"} and spec.ports == ["web"]
    assert spec.checks == [Check(port="web", kind="http", path="/healthz", interval_s=1.0)]
    assert (spec.labels, spec.metadata) == ({"tier": "a"}, {"team": "core"})


def test_the_digest_is_canonical() -> None:
    """The same spec written otherwise has the same digest; another value or secrets'
    revision another one."""
    spec = parse(GOOD)
    reordered = parse(GOOD.replace("count = 1\nspares = 1", "spares = 1\ncount = 1"))
    assert spec.digest() == reordered.digest()
    assert spec.digest() != parse(GOOD.replace("256", "512")).digest()
    assert spec.digest() != spec.digest(secrets_revision="ab12")


SERVICE = """
[service]
port = "web"
auto_stop = true
idle_s = 60
min_machines_running = 1
soft_limit = 20
hard_limit = 25
"""


def test_the_service_section_parses_and_rolls_no_machine() -> None:
    """The service section (how the edge serves the app) is kept, defaulted when absent,
    and left out of the digest: changing it is the same generation."""
    spec = parse(GOOD + SERVICE)
    svc = spec.service
    assert (svc.port, svc.auto_start, svc.auto_stop, svc.idle_s) == ("web", True, True, 60.0)
    assert (svc.min_machines_running, svc.soft_limit, svc.hard_limit) == (1, 20, 25)
    plain = parse(GOOD)
    assert (plain.service.auto_start, plain.service.auto_stop, plain.service.port) == (
        True,
        False,
        "",
    )
    assert spec.digest() == plain.digest()
    # the record's JSON comes back (a section without a port: "")
    for one in (spec, plain):
        assert msgspec.json.decode(msgspec.json.encode(one), type=AppSpec) == one


def _edit(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new)


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (GOOD + '[[checks]]\nport = "web2"\nkind = "tcp"\n',
         "app.toml: [checks][1].port: 'web2' is not a declared port"),
        (_edit("count = 1", "count = -1"), "app.toml: [count]: Expected `int` >= 0"),
        (_edit("spares = 1", "spares = 1\nspare = 2"),
         "app.toml: [spare]: unknown key (did you mean 'spares'?)"),
        (_edit("regions =", "region ="),
         "app.toml: [region]: unknown key (did you mean 'regions'?)"),
        (GOOD + "[volumes]\n", "app.toml: [volumes]: unknown key"),
        (_edit("memory_mb = 256", "memory_mb = 256\nmem = 1"),
         "app.toml: [resources].mem: unknown key"),  # nothing near enough to suggest
        (_edit("memory_mb = 256", "memroy_mb = 256"),
         "app.toml: [resources].memroy_mb: unknown key (did you mean 'memory_mb'?)"),
        (_edit('path = "/healthz"', 'path = "/healthz"\ngrace = 1'),
         "app.toml: [checks][0].grace: unknown key"),
        (_edit("memory_mb = 256", "memory_mb = 0"),
         "app.toml: [resources].memory_mb: Expected `int` >= 1"),
        (_edit("cpus = 0.5", 'cpus = "lots"'),
         "app.toml: [resources].cpus: 'lots' is not a CPU amount: use a number of CPUs (2, 0.5)"
         " or of millicores (250m)"),
        (_edit('app = "hello"', ""), "app.toml: [app]: missing"),
        (_edit('app = "hello"', 'app = "Hello World"'),
         "app.toml: [app]: expected 1 to 63 characters: lowercase letters, digits and '-', the "
         "first a lowercase letter or a digit"),
        (_edit('["mad", "ams"]', '["mad", "mad"]'), "app.toml: [regions]: 'mad' is named twice"),
        (_edit('["mad", "ams"]', "[]"), "app.toml: [regions]: Expected `array` of length >= 1"),
        (_edit('["web"]', '["web", "web"]'), "app.toml: [ports]: 'web' is named twice"),
        (_edit('kind = "http"', 'kind = "grpc"'),
         "app.toml: [checks][0].kind: 'grpc' is not http or tcp"),
        (_edit('path = "/healthz"', ""),
         "app.toml: [checks][0].path: an http check needs a path from /"),
        (_edit('"on-failure"', '"sometimes"'),
         "app.toml: [restart]: 'sometimes' is not a restart policy: use no, on-failure or always"),
        (_edit('team = "core"', 'role = "x"'),
         "app.toml: [metadata].role: reserved for the app's own use"),
        (_edit('GREETING = "hi"', '"1X" = "hi"'),
         "app.toml: [env]: a key: expected 1 to 128 characters: letters, digits and '_', the "
         "first a letter or '_'"),
        (_edit("count = 1\nspares = 1", "count = 0\nspares = 0"),
         "app.toml: [count]: count and spares are both 0 (nothing to run)"),
        ("app = ", "app.toml: not TOML: Invalid value (at end of document)"),
        (GOOD + SERVICE.replace('"web"', '"api"'),
         "app.toml: [service].port: 'api' is not a declared port"),
        (GOOD + SERVICE.replace("idle_s = 60", "idle_s = 60\nidle = 1"),
         "app.toml: [service].idle: unknown key"),
        (GOOD + SERVICE.replace("= 20", "= 30"),
         "app.toml: [service].soft_limit: more than hard_limit"),
        (GOOD + SERVICE.replace("idle_s = 60", "idle_s = 0"),
         "app.toml: [service].idle_s: Expected `float` >= 1.0"),
    ],
)  # fmt: skip
def test_each_bad_key_is_one_line_naming_it(text: str, error: str) -> None:
    with pytest.raises(SpecError) as info:
        parse(text)
    assert str(info.value) == error
    assert isinstance(info.value, BourseError) and "\n" not in str(info.value)


def test_flags_build_a_whole_spec() -> None:
    spec = from_dict(
        {"app": "web", "image": "web", "regions": ["mad"], "resources": {"cpus": "250m",
         "memory_mb": 64}, "count": 2},
        where="flags",
    )  # fmt: skip
    assert spec.resources == Resources(cpus=1, cpu_millis=250, memory_mb=64)
    assert (spec.count, spec.spares, spec.env, spec.checks) == (2, 0, {}, [])


def test_the_generation_changes_only_when_the_spec_or_secrets_do() -> None:
    from bourse.client.apps.store import AppRecord, next_generation, revision_of

    spec = parse(GOOD)
    assert next_generation(None, spec, "") == (1, spec.digest())
    kept = AppRecord(spec=spec, generation=4, digest=spec.digest())
    assert next_generation(kept, parse(GOOD), "") == (4, spec.digest())  # the same: the same
    assert next_generation(kept, parse(GOOD.replace("256", "512")), "")[0] == 5
    rev = revision_of({"TOKEN": 7, "DB": 3})
    assert rev == revision_of({"DB": 3, "TOKEN": 7}) != revision_of({"DB": 3, "TOKEN": 8})
    assert revision_of({}) == "" and next_generation(kept, spec, rev)[0] == 5
