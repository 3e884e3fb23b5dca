"""The edge's page (``edge serve --admin``) on a real market (tests/market.py: suppliers, an
exchange, the state stream) and a real ``edge serve`` program: in a real browser (the
system's chromium, headless, driven by selenium through its chromedriver), a placed machine
appears and a stopped supplier's worker turns ``gone`` without a reload; over HTTP, who may
look (tokens, a tenant's own machines). Every wait is on what the page or the answer shows."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from bourse.client import BourseClient
from bourse.wire.messages import Placed
from tests.edgekit import HOST, Answer, edge, get
from tests.isolation import own_worker_id
from tests.market import Market, order, wait_for, worker

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WAIT_S = 30.0
OPERATOR_TOKEN = "operator-token-0123456789"
TENANT_TOKEN = "acme-token-0123456789abc"


def market_args(market: Market, *more: str) -> tuple[str, ...]:
    return ("--nats", market.url, "--prefix", market.subjects.prefix, *more)


def page_address(ready_line: str) -> str:
    """HOST:PORT of the page an edge's ready line names (``...; page on http://A/``)."""
    _, sep, rest = ready_line.partition("page on http://")
    assert sep, ready_line
    return rest.split("/", 1)[0]


class Browser:
    """A headless chromium through selenium; every call in a thread of its own (the market
    runs in this test's event loop: a blocking call would stall its heartbeats)."""

    def __init__(self, driver: Any) -> None:
        self.driver = driver

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args)

    async def until(self, what: Callable[[Any], Any], timeout_s: float = WAIT_S) -> Any:
        """Until ``what(driver)`` is truthy (selenium's wait, asking the page itself)."""
        from selenium.webdriver.support.ui import WebDriverWait

        wait = WebDriverWait(self.driver, timeout_s, poll_frequency=0.1)
        return await self.call(wait.until, what)

    async def script(self, js: str) -> Any:
        return await self.call(self.driver.execute_script, js)


@asynccontextmanager
async def browser() -> AsyncIterator[Browser]:
    if not Path(CHROMIUM).exists() or not Path(CHROMEDRIVER).exists():
        pytest.skip(
            f"no browser: {CHROMIUM} and chromedriver are Debian's chromium and "
            "chromium-driver (.ci/run installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1400"):
        options.add_argument(arg)
    driver = await anyio.to_thread.run_sync(
        lambda: webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    )
    try:
        yield Browser(driver)
    finally:
        await anyio.to_thread.run_sync(driver.quit)


def cell(selector: str, css: str) -> Callable[[Any], str]:
    """The text of ``css`` in the row ``selector`` ("" while there is none)."""

    def read(driver: Any) -> str:
        from selenium.common.exceptions import (
            NoSuchElementException,
            StaleElementReferenceException,
        )

        try:
            return str(driver.find_element("css selector", f"{selector} {css}").text)
        except (NoSuchElementException, StaleElementReferenceException):
            return ""

    return read


async def test_the_page_shows_a_placed_machine_and_a_gone_worker_without_a_reload(
    market: Market, tmp_path: Path
) -> None:
    """Two suppliers' workers and the page open in chromium: a machine placed afterwards
    appears in the machines' table and its ``placed`` event in the live list; the first
    supplier stopped, its worker's row says ``gone``; the page was never loaded again."""
    w1, w2 = own_worker_id("page1"), own_worker_id("page2")
    gone_host = await market.host(worker(w1, ports="29620-29629", advertise_host=HOST))
    await market.host(worker(w2, region="fra", ports="29630-29639", advertise_host=HOST))
    await market.exchange()
    buyer = await market.client()
    async with (
        edge(tmp_path, *market_args(market, "--admin", f"{HOST}:0")) as e,
        browser() as b,
    ):
        url = f"http://{page_address(e.ready_line)}/"
        await b.call(b.driver.get, url)
        await b.until(lambda d: cell(f'tr[data-worker="{w1}"]', ".state")(d) == "up")
        await b.until(lambda d: cell(f'tr[data-worker="{w2}"]', ".state")(d) == "up")
        await b.script("window.sameLoad = true")  # gone if the page is loaded again
        await b.until(
            lambda d: d.execute_script("return document.getElementById('live').className") == "on"
        )

        placed = await buyer.place(order(metadata={"app": "shop"}))
        assert isinstance(placed, Placed), placed
        row = f'#machines tr[data-machine="{placed.machine_id}"]'
        assert await b.until(lambda d: cell(row, ".state")(d)) == "reserved"
        assert (
            await b.until(lambda d: cell(f'#apps tr[data-machine="{placed.machine_id}"]', "td")(d))
            == "mad"
        )
        await b.until(lambda d: cell('#events li[data-kind="placed"]', ".kind")(d) == "placed")

        await market.stop(gone_host)  # its worker beats no more: gone in >= 3 s
        gone = await b.until(
            lambda d: (t := cell(f'tr[data-worker="{w1}"]', ".state")(d)).startswith("gone") and t
        )
        assert gone.startswith("gone"), gone
        assert "(worker gone)" in await b.until(lambda d: cell(row, ".state")(d))
        assert cell(f'tr[data-worker="{w2}"]', ".state")(b.driver) == "up"
        assert await b.script("return window.sameLoad === true"), "the page was loaded again"


async def fleet(address: str, extra: str = "", path: str = "/api/fleet") -> Answer:
    return await get(address, path=path, host=address, extra=extra)


async def showing(address: str, want: Callable[[Answer], bool]) -> Answer:
    """The operator's fleet once it is ``want``ed (the edge's view has the rows once it
    caught up with the stream): each try a fresh request."""
    return await wait_for(lambda: fleet(address), want, WAIT_S)


def cpu(answer: Answer) -> dict[str, float]:
    """The first worker's CPU bar."""
    workers = answer.json()["workers"]
    assert isinstance(workers, list)
    return dict(workers[0]["bars"]["cpu"])


def machine_ids(answer: Answer) -> set[str]:
    machines = answer.json()["machines"]
    assert isinstance(machines, list)
    return {m["machine_id"] for m in machines}


async def test_who_may_look_and_what_a_tenants_token_shows(market: Market, tmp_path: Path) -> None:
    """Loopback without a token: the operator's view (every machine); a tenant's token
    (bearer, or the cookie ``?token=`` sets): its own machines and apps only; a bad
    token, or a name that is not loopback's without one: 401 saying why."""
    await market.host(worker(own_worker_id("page3"), ports="29640-29649", advertise_host=HOST))
    await market.exchange()
    shared = await market.client()
    acme = BourseClient(await market.connect("acme"), market.subjects, tenant="acme")
    mine = await acme.place(order(metadata={"app": "web"}))
    theirs = await shared.place(order(metadata={"app": "shop"}))
    assert isinstance(mine, Placed) and isinstance(theirs, Placed)
    await shared.machine("start", theirs.machine_id)  # running: 1 CPU used, 1 held
    tokens = ("--admin-token", OPERATOR_TOKEN, "--admin-token", f"{TENANT_TOKEN}=acme")
    async with edge(tmp_path, *market_args(market, "--admin", f"{HOST}:0", *tokens)) as e:
        at = page_address(e.ready_line)
        both = {mine.machine_id, theirs.machine_id}
        operator = await showing(at, lambda a: machine_ids(a) == both and cpu(a)["used"] == 1)
        assert operator.json()["viewer"] == "operator"
        assert cpu(operator) == {"capacity": 8, "used": 1, "held": 1, "free": 6}

        tenant = await fleet(at, f"Authorization: Bearer {TENANT_TOKEN}\r\n")
        assert tenant.status == 200
        assert tenant.json()["viewer"] == "tenant acme"
        assert machine_ids(tenant) == {mine.machine_id}
        assert [a["app"] for a in tenant.json()["apps"]] == ["web"]  # type: ignore[index, union-attr]
        # its own machine does not run: another tenant's running one counts as held to it
        assert cpu(tenant) == {"capacity": 8, "used": 0, "held": 2, "free": 6}

        redirect = await fleet(at, path=f"/?token={TENANT_TOKEN}")
        assert (redirect.status, redirect.headers["location"]) == (303, "/")
        cookie = redirect.headers["set-cookie"].split(";", 1)[0]
        assert "HttpOnly" in redirect.headers["set-cookie"]
        by_cookie = await fleet(at, f"Cookie: {cookie}\r\n")
        assert machine_ids(by_cookie) == {mine.machine_id}

        bad = await fleet(at, "Authorization: Bearer not-a-token-of-this-edge\r\n")
        assert bad.status == 401
        assert str(bad.json()["error"]).startswith("bad admin token")
        assert bad.headers["www-authenticate"] == 'Bearer realm="bourse"'

        rebound = await get(at, path="/api/fleet", host="evil.example")
        assert rebound.status == 401
        assert "loopback address or localhost" in str(rebound.json()["error"])
