"""Restarts and exits a user can find (issue 13 item 4): ``buyer place/deploy --restart``,
the last exit and restart count on ``buyer machines show`` and in events, and
``buyer machines logs --follow`` (real subprocesses against a real market)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

from nats.aio.msg import Msg

from bourse.nats.connection import flush_all
from bourse.wire.codec import decode
from bourse.wire.messages import Event
from supplier.config import WorkerConfig
from supplier.machines.heartbeat import SCRIPT
from supplier.machines.host.output import CUT_AFTER, CUT_BEFORE, Logs
from supplier.machines.keeper import MAX_LOG_BYTES
from supplier.machines.runner import Runner
from tests.cli import buyer
from tests.isolation import own_worker_id
from tests.market import Market, wait_until, worker

HEARTBEAT = ["{python}", SCRIPT, "web", "--every-s", "0.2"]
CRASH = ["{python}", "-c", "import sys; print('crashing', flush=True); sys.exit(1)"]
MAD_1, MAD_2 = own_worker_id("mad-1"), own_worker_id("mad-2")  # their cgroups: the host's


def _worker(wid: str = MAD_1) -> WorkerConfig:
    catalog = {"web": {"command": HEARTBEAT}, "crash": {"command": CRASH}}
    return worker(wid, driver="process", catalog=catalog)


def _place(image: str, *extra: str) -> tuple[str, ...]:
    return (
        "place",
        "--region",
        "mad",
        "--cpus",
        "1",
        "--memory-mb",
        "64",
        "--image",
        image,
        *extra,
    )


async def test_place_restart_on_failure_shows_last_exit_restarts_and_events(
    market: Market,
) -> None:
    await market.host(_worker())
    await market.exchange()
    events: list[Event] = []

    async def on_event(msg: Msg) -> None:
        events.append(decode(msg.data, Event))

    spy = await market.connect("spy")
    await spy.subscribe(market.subjects.events(kind="restarted"), cb=on_event)
    await flush_all(spy)

    code, out, err = await buyer(market, *_place("crash", "--restart", "on-failure", "--start"))
    mid = out.split("placed ")[1].split()[0]
    # --start watched it: it ended at once, and its policy started it again
    assert code == 1, out + err
    said = rf"error: machine {mid} ended and was restarted by its restart policy \(restart \d\): "
    assert re.match(said + "last exit: code 1  at ", err), err
    await wait_until(lambda: len(events) >= 2)  # backoff 0.1 s, then 0.2 s
    assert [e.detail for e in events[:2]] == [
        "exited with code 1; restart 1",
        "exited with code 1; restart 2",
    ]
    code, out, err = await buyer(market, "machines", "show", mid, "--json")
    assert code == 0, err
    shown = json.loads(out)["machine"]
    assert shown["metadata"]["restart"] == "on-failure"
    assert shown["restarts"] >= 2 and shown["last_exit"]["reason"] == "exit"
    assert shown["last_exit"]["code"] == 1 and shown["state"] == "started"
    code, out, err = await buyer(market, "machines", "show", mid)
    assert code == 0, err
    assert "last exit: code 1" in out and "restarts: " in out


async def test_place_start_watches_the_machine_until_it_has_run_a_while(market: Market) -> None:
    """--start says started only of a machine that stays up (--start-timeout, without a
    check passing first); one that ends is exit 1 with its last exit, a script's JSON
    carrying the machine too; without --start a line says nothing runs yet."""
    await market.host(_worker())
    await market.exchange()
    code, out, err = await buyer(market, *_place("crash", "--start"))
    mid = out.split("placed ")[1].split()[0]
    assert code == 1 and f"  machine {mid} is stopped" in out.splitlines()
    assert err.startswith(f"error: machine {mid} is stopped: last exit: code 1  at ")
    assert err.endswith("  restarts: 0\n") and err.count("\n") == 1
    code, out, err = await buyer(market, *_place("crash", "--start", "--json"))
    shown = json.loads(out)
    assert code == 1 and shown["error"] == err.removeprefix("error: ").strip()
    assert (shown["outcome"], shown["machine"]["state"]) == ("placed", "stopped")
    assert shown["machine"]["last_exit"]["code"] == 1
    code, out, err = await buyer(market, *_place("web", "--start", "--start-timeout", "0.5"))
    assert (code, err) == (0, ""), out + err
    mid = out.split("placed ")[1].split()[0]
    assert out.splitlines()[-1] == f"  machine {mid} is started"
    code, out, err = await buyer(market, *_place("web"))
    mid = out.split("placed ")[1].split()[0]
    assert (code, err) == (0, "") and out.splitlines()[-1] == (
        f"  not started: buyer machines start {mid} (or place with --start)"
    )


async def test_restart_flag_is_checked_and_deploy_sends_it(market: Market) -> None:
    await market.host(_worker(MAD_1), _worker(MAD_2))
    await market.exchange()
    code, out, err = await buyer(market, *_place("web", "--restart", "sometimes"))
    assert code == 1 and out == ""
    assert err.strip().splitlines() == [
        "error: Invalid value for '--restart': 'sometimes' is not a restart policy: use no,"
        " on-failure or always"
    ]
    code, out, err = await buyer(
        market,
        "deploy",
        "--app",
        "api",
        "--region",
        "mad",
        "--cpus",
        "1",
        "--memory-mb",
        "64",
        "--image",
        "web",
        "--count",
        "2",
        "--restart",
        "always",
        "--json",
    )
    assert code == 0, err
    slots = json.loads(out)["slots"]
    for s in slots:
        _, shown, _ = await buyer(market, "machines", "show", s["machine_id"], "--json")
        assert json.loads(shown)["machine"]["metadata"]["restart"] == "always"
    assert len(slots) == 2


async def test_logs_follow_prints_new_lines_once_until_interrupted(market: Market) -> None:
    host = await market.host(_worker())
    await market.exchange()
    code, out, err = await buyer(market, *_place("web", "--start"))
    assert code == 0, err
    mid = out.split("placed ")[1].split()[0]
    d = host.workers[MAD_1].driver
    assert isinstance(d, Runner)
    log = d.log_path(mid)  # the tail the follow starts with has the program's first line
    await wait_until(lambda: log.exists() and "web up" in log.read_text())
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "buyer_cli",
        "machines",
        "logs",
        mid,
        "--follow",
        "--json",
        "--prefix",
        market.subjects.prefix,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "BOURSE_NATS_URL": market.url},
    )
    assert proc.stdout is not None
    batches = []
    try:
        # the tail, then new beats (a slow start of the buyer may find them all in the tail)
        while len(batches) < 2 or sum(len(b["lines"]) for b in batches) < 6:
            line = await asyncio.wait_for(proc.stdout.readline(), 10)
            batches.append(json.loads(line))
    finally:
        proc.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(proc.wait(), 10)
    assert code == 130  # Ctrl-C
    assert len(batches) >= 2 and any("web up" in x for x in batches[0]["lines"])
    ends = [b["end"] for b in batches]
    assert ends == sorted(set(ends))  # each batch starts where the last ended: none twice
    # together they are exactly the log's lines up to the last end
    text = Path(d.log_path(mid)).read_bytes()[: ends[-1]].decode().splitlines()
    assert [x for b in batches for x in b["lines"]] == text


def test_a_line_longer_than_a_logs_reply_comes_cut_not_left_out(tmp_path: Path) -> None:
    d = Logs(tmp_path)
    d.path("m").write_bytes(b"x" * 100_000 + b"\n")  # over the 48 KiB of a reply
    [last], truncated, end = d.read("m", 100, MAX_LOG_BYTES)
    assert last == CUT_BEFORE + "x" * (MAX_LOG_BYTES - 1) and truncated and end == 100_001
    [first], truncated, at = d.read("m", 100, MAX_LOG_BYTES, since=0)
    assert first == "x" * MAX_LOG_BYTES + CUT_AFTER and truncated and at == MAX_LOG_BYTES


def test_logs_since_returns_complete_lines_after_an_offset(tmp_path: Path) -> None:
    d = Logs(tmp_path)
    d.path("m").write_bytes(b"one\ntwo\nthr")  # a line still being written
    assert d.read("m", 100, 1024) == (["one", "two", "thr"], False, 8)
    assert d.read("m", 100, 1024, since=0) == (["one", "two"], False, 8)
    assert d.read("m", 100, 1024, since=8) == ([], False, 8)  # nothing complete yet
    with d.path("m").open("ab") as f:
        f.write(b"ee\n" + b"x" * 40 + b"\n")
    assert d.read("m", 100, 1024, since=8) == (["three", "x" * 40], False, 55)
    assert d.read("m", 100, 16, since=14) == (["x" * 16 + " [...]"], True, 30)  # cut: marked
    assert d.read("m", 100, 1024, since=999) == ([], False, 55)  # past the end: the end
    assert d.read("nope", 100, 1024, since=0) == ([], False, 0)
