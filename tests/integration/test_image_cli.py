"""``bourse image`` in process (tests/cli.py) against the test's nats-server: push, import,
ls, inspect, tag, rm and gc with --json shapes and their plain lines, and bad input (a
missing directory, a bad reference, an unreadable archive, no command) as one error line.
Which workers hold an image comes from their status, here a raw worker's answer."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from bourse.client.render import visible
from bourse.images import ImageStore
from bourse.nats.connection import flush_all
from bourse.wire.codec import encode
from bourse.wire.messages import Resources, WorkerStatus
from ops.cli import app as ops_app
from tests.cli import run_cli
from tests.market import Market
from tests.unit.test_oci_import import Layout

PUSH_KEYS = {"reference", "digest", "size", "layers", "uploaded_bytes", "reused_bytes"}


async def image(market: Market, *args: str) -> tuple[int, str, str]:
    """``bourse image args`` on the market's server and prefix, in a worker thread (the
    CLI runs its own event loop); its logging set-up is undone after."""
    argv = ("image", *args, "--prefix", market.subjects.prefix)
    env: Mapping[str, str | None] = {"BOURSE_NATS_URL": market.url}
    config = structlog.get_config()
    try:
        return await anyio.to_thread.run_sync(lambda: run_cli(ops_app, *argv, env=env))
    finally:
        structlog.configure(**config)


def app_dir(top: Path, body: bytes = b"print('hi')\n") -> Path:
    top.mkdir(parents=True)
    (top / "app.py").write_bytes(body)
    return top


async def pushed(market: Market, ref: str, top: Path, *more: str) -> dict[str, Any]:
    code, out, err = await image(
        market, "push", ref, str(top), "--cmd", "python3 app.py", *more, "--json"
    )
    assert (code, err) == (0, ""), err
    result: dict[str, Any] = json.loads(out)
    return result


def holding(raw: NATS, digest: str) -> Callable[[Msg], Awaitable[None]]:
    """A raw worker's answer to the status gather: its cache holds ``digest``."""

    async def status(msg: Msg) -> None:
        st = WorkerStatus(
            worker_id="w9",
            region="mad",
            labels={},
            capacity=Resources(cpus=1, memory_mb=1),
            committed=Resources(cpus=0, memory_mb=0),
            held=Resources(cpus=0, memory_mb=0),
            images=[],
            machines=0,
            draining=False,
            image_digests=[digest],
        )
        await raw.publish(msg.reply, encode(st))

    return status


def one_error(code: int, out: str, err: str) -> str:
    """The one error line (and the one JSON object, with --json) a failure prints."""
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    if out:  # the message exactly (the line shows its control characters escaped)
        message = json.loads(out)["error"]
        assert visible(message) == err.removeprefix("error: ").strip()
    return err


async def test_push_then_inspect_tag_ls_and_rm_in_json(market: Market, tmp_path: Path) -> None:
    done = await pushed(market, "acme/web:v1", app_dir(tmp_path / "a"), "--env", "MODE=prod")
    assert set(done) == PUSH_KEYS and done["reference"] == "acme/web:v1"
    assert done["layers"] == 1 and done["uploaded_bytes"] == done["size"] > 0
    store = await ImageStore.open(await market.connect("check"), market.subjects.prefix)
    assert await store.lookup("acme/web:v1") == done["digest"]

    again = await pushed(market, "acme/web:v1", tmp_path / "a", "--env", "MODE=prod")
    assert (again["digest"], again["uploaded_bytes"]) == (done["digest"], 0)  # all stored

    code, out, _ = await image(market, "inspect", "acme/web:v1", "--json")
    info = json.loads(out)["image"]
    assert code == 0 and info["digest"] == done["digest"]
    assert (info["cmd"], info["env"]) == (["python3", "app.py"], ["MODE=prod"])

    code, out, _ = await image(market, "tag", "acme/web:v1", "acme/web:stable", "--json")
    assert (code, json.loads(out)) == (
        0,
        {"reference": "acme/web:stable", "digest": done["digest"]},
    )

    code, out, _ = await image(market, "ls", "--json")
    rows = json.loads(out)["images"]
    assert [(r["reference"], r["digest"], r["cached_by"]) for r in rows] == [
        ("acme/web:stable", done["digest"], []),
        ("acme/web:v1", done["digest"], []),
    ]
    assert set(rows[0]) == {"reference", "digest", "size", "created", "cached_by"}

    code, out, _ = await image(market, "rm", "acme/web:stable", "--json")
    assert (code, json.loads(out)) == (
        0,
        {"reference": "acme/web:stable", "digest": done["digest"]},
    )
    code, out, _ = await image(market, "ls")
    assert code == 0 and "acme/web:v1" in out and "acme/web:stable" not in out


async def test_ls_says_which_workers_hold_each_image(market: Market, tmp_path: Path) -> None:
    done = await pushed(market, "acme/web:v1", app_dir(tmp_path / "a"))
    raw = await market.connect("raw-worker")

    status = holding(raw, done["digest"])  # a worker whose cache holds the image
    await raw.subscribe(market.subjects.status_every, cb=status)
    await flush_all(raw)
    code, out, _ = await image(market, "ls", "--json")
    assert code == 0 and json.loads(out)["images"][0]["cached_by"] == ["w9"]
    code, out, _ = await image(market, "ls")
    assert code == 0 and out.splitlines()[1].split()[-1] == "w9"


async def test_import_of_an_oci_layout(market: Market, tmp_path: Path) -> None:
    layout = Layout()
    layout.index(layout.image(b"from a layout"))
    top = layout.write_dir(tmp_path / "layout")
    code, out, err = await image(market, "import", "acme/imported:1", str(top), "--json")
    assert code == 0, err
    done = json.loads(out)
    assert set(done) == PUSH_KEYS and done["layers"] == 1
    code, out, _ = await image(market, "import", "acme/imported:1", str(top))
    assert code == 0 and out.startswith(f"pushed acme/imported:1 {done['digest']}\n")


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["push", "acme/web:v1", "{missing}", "--cmd", "x"], "not a directory"),
        (["push", "Acme/Web", "{dir}", "--cmd", "x"], "must be lowercase components"),
        (["push", "acme/web:v1", "{dir}"], "give --cmd (or --entrypoint)"),
        (["push", "acme/web:v1", "{dir}", "--cmd", "x", "--env", "1A=b"], "is not KEY=VALUE"),
        (["import", "acme/web:v1", "{junk}"], "junk"),
        (["import", "acme/web:v1", "{missing}"], "no such file or directory"),
        (["inspect", "acme/none:v1"], "no image tagged acme/none:v1"),
        (["tag", "acme/none:v1", "acme/web:x"], "no image tagged acme/none:v1"),
        (["rm", "web@sha256:" + "0" * 64], "names a digest"),
    ],
)
async def test_bad_input_is_one_error_line(
    market: Market, tmp_path: Path, args: list[str], says: str
) -> None:
    await ImageStore.open(await market.connect("setup"), market.subjects.prefix)
    (tmp_path / "junk").write_bytes(b"this is no archive at all")
    where = {
        "{missing}": str(tmp_path / "missing"),
        "{dir}": str(app_dir(tmp_path / "dir")),
        "{junk}": str(tmp_path / "junk"),
    }
    argv = [where.get(a, a) for a in args]
    for json_flag in ([], ["--json"]):
        err = one_error(*await image(market, *argv, *json_flag))
        assert says in err, err


async def test_gc_removes_what_no_tag_and_no_worker_keeps(market: Market, tmp_path: Path) -> None:
    kept = await pushed(market, "acme/web:v1", app_dir(tmp_path / "a", b"kept"))
    gone = await pushed(market, "acme/web:v2", app_dir(tmp_path / "b", b"gone"))
    code, out, err = await image(market, "rm", "acme/web:v2")
    assert code == 0, err
    code, out, err = await image(market, "gc", "--grace-s", "0", "--dry-run", "--json")
    dry = json.loads(out)
    assert code == 0 and dry["dry_run"] and len(dry["removed"]) == 3  # layer, config, manifest
    assert gone["digest"] in dry["removed"] and kept["digest"] not in dry["removed"]
    code, out, err = await image(market, "gc", "--grace-s", "0", "--json")
    done = json.loads(out)
    assert code == 0 and sorted(done["removed"]) == sorted(dry["removed"])
    assert set(done) == {"removed", "removed_bytes", "kept", "young", "in_use", "dry_run"}
    store = await ImageStore.open(await market.connect("check"), market.subjects.prefix)
    assert await store.stat_blob(gone["digest"]) is None
    assert await store.stat_blob(kept["digest"]) is not None
    code, out, _ = await image(market, "gc", "--grace-s", "0")
    assert code == 0 and out.startswith("removed 0 blobs")


async def test_gc_keeps_what_a_worker_holds(market: Market, tmp_path: Path) -> None:
    held = await pushed(market, "acme/web:v1", app_dir(tmp_path / "a"))
    await image(market, "rm", "acme/web:v1")
    raw = await market.connect("raw-worker")

    status = holding(raw, held["digest"])  # holds the untagged image; runs no machine

    async def machines(msg: Msg) -> None:  # its one, empty, page
        page = {"type": "MachinePage", "worker_id": "w9", "region": "mad", "machines": []}
        await raw.publish(msg.reply, json.dumps({**page, "page": 1, "pages": 1}).encode())

    await raw.subscribe(market.subjects.status_every, cb=status)
    await raw.subscribe(market.subjects.machines_every, cb=machines)
    await flush_all(raw)
    code, out, err = await image(market, "gc", "--grace-s", "0", "--json")
    assert code == 0, err
    assert json.loads(out)["removed"] == [] and json.loads(out)["in_use"] == 1
