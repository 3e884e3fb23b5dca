"""Host ports for machines (supplier/ports.py, docs/protocol.md §4.2a): ranges, the
allocator, the ranges of a host's workers, a machine's run environment; and ports through a
real worker: the ledger counts them, ``fits`` says so, a commit assigns them (skipping a port
busy on the host), a destroy gives them back, a restart keeps them."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import msgspec
import pytest

from bourse.auction.claims import fingerprint
from bourse.wire.messages import (
    Amount,
    Bid,
    Check,
    Commit,
    Machine,
    Placed,
    PlaceOrder,
    Rejected,
    Resources,
)
from supplier.candidates import BidGroup
from supplier.config import ConfigError, WorkerConfig, check_workers
from supplier.desk import Desk
from supplier.feasible import INSUFFICIENT, every_failure, fits, wanted
from supplier.ledger import Ledger
from supplier.machines.host.claims import HostClaims
from supplier.ports import (
    Allocator,
    NoPort,
    PortClaims,
    PortError,
    PortRange,
    RangeClaim,
    Wanted,
    WorkerPorts,
    address,
    choose,
    held_twice,
    host_ranges,
    port_of,
    run_env,
)
from supplier.status import worker_status
from supplier.store import Store
from supplier.worker import Worker

WID = "mad-1"
DESK: Desk[Worker] = Desk()


def always(port: int) -> bool:
    return True


@pytest.fixture(autouse=True)
def every_default_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host's default blocks from the first (not a test session's slice of them)."""
    monkeypatch.delenv("BOURSE_PORT_BLOCKS", raising=False)


# -- ranges -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("20000", "write it FIRST-LAST"),
        ("a-b", "write it FIRST-LAST"),
        ("20999-20000", "1 <= FIRST <= LAST"),
        ("0-10", "1 <= FIRST <= LAST"),
        ("60000-70000", "1 <= FIRST <= LAST"),
    ],
)
def test_a_bad_range_is_one_clear_error(text: str, error: str) -> None:
    with pytest.raises(PortError, match=error):
        PortRange.parse(text)


def test_a_range_parses_and_counts_its_ports() -> None:
    r = PortRange.parse(" 20000 - 20009 ")
    assert (r.lo, r.hi, r.size, str(r)) == (20000, 20009, 10, "20000-20009")
    assert 20009 in r and 20010 not in r


def test_workers_of_one_fleet_with_overlapping_ranges_are_refused() -> None:
    def w(wid: str, ports: str) -> WorkerConfig:
        return WorkerConfig(
            worker_id=wid, region="mad", capacity=Amount(cpus=1, memory_mb=64), ports=ports
        )

    check_workers([w("a", "20000-20099"), w("b", "20100-20199")])
    with pytest.raises(ConfigError) as err:
        check_workers([w("a", "20000-20099"), w("b", "20050-20149")])
    assert str(err.value) == (
        "workers a and b: port ranges 20000-20099 and 20050-20149 overlap: "
        "workers of one host need ranges apart"
    )
    with pytest.raises(ConfigError, match="worker a: port range '20000'"):
        check_workers([w("a", "20000")])


def test_a_host_refuses_a_range_a_live_supplier_serves_and_gives_defaults_apart() -> None:
    live = [RangeClaim("x", "o1", PortRange(20000, 20099))]
    with pytest.raises(PortError) as err:
        choose([Wanted("a", PortRange(20050, 20060))], live)
    assert str(err.value) == (
        "worker a: its range 20050-20060 overlaps worker x (of another supplier, owner o1)'s "
        "port range 20000-20099 on this host: give one of them another range"
    )
    got = choose(
        [Wanted("a", None, default=True), Wanted("b", PortRange(20100, 20199)), Wanted("c", None)],
        live,
    )
    assert got == {"b": PortRange(20100, 20199), "a": PortRange(20200, 20299)}


def test_a_default_range_is_kept_across_restarts_unless_another_supplier_took_it() -> None:
    kept = PortRange(20500, 20599)
    assert choose([Wanted("a", None, default=True, kept=kept)], []) == {"a": kept}
    live = [RangeClaim("x", "o1", kept)]  # taken while this worker's supplier was away
    assert choose([Wanted("a", None, default=True, kept=kept)], live) == {
        "a": PortRange(20000, 20099)
    }


# -- the allocator ------------------------------------------------------------------------------
def test_the_allocator_skips_busy_ports_and_moves_on() -> None:
    a = Allocator(PortRange(20000, 20003))
    assert a.take("m1", ["http", "admin"], lambda p: p != 20000) == {"http": 20001, "admin": 20002}
    assert a.take("m2", ["http"], always) == {"http": 20003}
    assert a.take("m3", ["http"], always) == {"http": 20000}  # wrapped around
    assert a.take("m4", ["http"], always) is None  # all held: nothing taken
    assert "m4" not in a.of
    assert a.give_back("m1") == 2
    assert a.take("m4", ["http"], always) == {"http": 20001}


def test_worker_ports_say_why_none_can_be_given() -> None:
    none = WorkerPorts(None, Ledger((1000, 64, 0, 0, 0)), "h")
    with pytest.raises(NoPort, match="the worker has no port range"):
        none.take("m1", ["http"])
    busy = WorkerPorts(PortRange(20000, 20001), Ledger((1000, 64, 0, 0, 2)), "h", lambda p: False)
    with pytest.raises(NoPort, match="no bindable port"):
        busy.take("m1", ["http"])


def test_addresses_name_the_host_and_the_port() -> None:
    assert address("10.0.0.5", 20001) == "10.0.0.5:20001"
    assert address("::1", 20001) == "[::1]:20001"
    assert port_of("[::1]:20001") == 20001


def test_the_run_env_puts_bourse_variables_above_the_orders() -> None:
    m = Machine(
        machine_id="mad-1~m1",
        order_id="o1",
        worker_id=WID,
        region="mad",
        state="reserved",
        resources=Resources(cpus=1, memory_mb=64),
        image="web",
        addresses={"http": "10.0.0.5:20001", "admin": "10.0.0.5:20002"},
    )
    assert run_env(m, {"GREETING": "hi", "PORT": "1"}) == {
        "GREETING": "hi",
        "PORT": "20001",
        "BOURSE_PORT_HTTP": "20001",
        "BOURSE_ADDR_HTTP": "10.0.0.5:20001",
        "BOURSE_PORT_ADMIN": "20002",
        "BOURSE_ADDR_ADMIN": "10.0.0.5:20002",
        "BOURSE_MACHINE_ID": "mad-1~m1",
        "BOURSE_ORDER_ID": "o1",
    }


# -- the order's fingerprint --------------------------------------------------------------------
def test_the_fingerprint_counts_ports_env_and_checks_only_when_present() -> None:
    base = PlaceOrder(
        order_id="o1", region="mad", resources=Resources(cpus=1, memory_mb=64), image="web"
    )
    # the digest of an order without them is the one §5.3c gave it before they existed
    old = [base.region, base.resources, base.image, {}, {}]
    data = msgspec.json.encode(old, order="deterministic")
    assert fingerprint(base) == hashlib.blake2b(data, digest_size=12).hexdigest()
    with_ports = PlaceOrder(**{**_fields(base), "ports": ["http"]})
    with_env = PlaceOrder(**{**_fields(base), "env": {"A": "1"}})
    with_check = PlaceOrder(
        **{**_fields(base), "ports": ["http"], "checks": [Check(port="http", kind="tcp")]}
    )
    digests = {fingerprint(o) for o in (base, with_ports, with_env, with_check)}
    assert len(digests) == 4


def _fields(o: PlaceOrder) -> dict[str, object]:
    return {f: getattr(o, f) for f in o.__struct_fields__}


# -- through a worker ---------------------------------------------------------------------------
def ported_worker(store: Store, size: int = 2, busy: frozenset[int] = frozenset()) -> Worker:
    w = Worker(
        WorkerConfig(
            worker_id=WID,
            region="mad",
            capacity=Amount(cpus=8, memory_mb=8192),
            images=["web"],
            ports=f"20000-{20000 + size - 1}",
            advertise_host="10.0.0.5",
        ),
        store,
        lambda e: None,
    )
    w.ports.can_bind = lambda p: p not in busy  # a port busy on the host
    w.recover()
    return w


def bid(order_id: str, ports: list[str]) -> Bid:
    return Bid(
        order_id=order_id,
        region="mad",
        resources=Resources(cpus=1, memory_mb=64),
        image="web",
        hold_ms=1000,
        auction_id=f"auc-{order_id}",
        ports=ports,
    )


def commit(order_id: str, ports: list[str]) -> Commit:
    return Commit(
        order_id=order_id,
        worker_id=WID,
        resources=Resources(cpus=1, memory_mb=64),
        image="web",
        auction_id=f"auc-{order_id}",
        ports=ports,
        env={"GREETING": "hi"},
    )


async def place(w: Worker, order_id: str, ports: list[str]) -> Placed | Rejected:
    ans = DESK.answer(bid(order_id, ports), "inbox", time.monotonic(), BidGroup([w]))
    assert len(ans.replies) == 1, ans
    reply = await w.commits.commit(commit(order_id, ports))
    assert isinstance(reply, Placed | Rejected), reply
    return reply


async def test_a_commit_gives_ports_the_ledger_counts_and_a_destroy_gives_them_back(
    store: Store,
) -> None:
    w = ported_worker(store, size=3, busy=frozenset({20000}))
    assert w.ledger.capacity[4] == 3
    p = await place(w, "o1", ["http", "admin"])
    assert isinstance(p, Placed)
    assert p.addresses == {"http": "10.0.0.5:20001", "admin": "10.0.0.5:20002"}
    assert w.ledger.committed[4] == 2
    m = w.machines[p.machine_id]
    assert m.addresses == p.addresses and m.env_keys == ["GREETING"]
    assert store.load_specs(WID)[m.machine_id].env == {"GREETING": "hi"}
    status = worker_status(w)
    assert (status.capacity.ports, status.committed.ports) == (3, 2)
    assert (status.port_range, status.advertise_host) == ("20000-20002", "10.0.0.5")
    await w.transition("destroy", p.machine_id)
    assert w.ledger.committed[4] == 0 and w.ports.allocator.holder == {}
    assert p.machine_id not in store.load_specs(WID)


async def test_a_restart_keeps_a_machines_ports(store: Store) -> None:
    w = ported_worker(store)
    p = await place(w, "o1", ["http"])
    assert isinstance(p, Placed)
    again = ported_worker(store)
    assert again.ledger.committed[4] == 1
    assert again.ports.allocator.of == {p.machine_id: {"http": 20000}}
    assert again.ports.problems() == []


async def test_a_second_copy_gets_its_own_port_and_a_third_none(store: Store) -> None:
    w = ported_worker(store)
    one, two = await place(w, "o1", ["http"]), await place(w, "o2", ["http"])
    assert isinstance(one, Placed) and isinstance(two, Placed)
    assert one.addresses["http"] != two.addresses["http"]
    reasons = every_failure(
        [fits], w, bid("o3", ["http"]), wanted(bid("o3", ["http"])), w.ledger.free
    )
    assert [(r.code, r.resource) for r in reasons] == [(INSUFFICIENT, "ports")]
    assert reasons[0].detail == "ports: wants 1, free 0 (capacity 2, committed 2, held 0)"


def test_a_worker_without_a_range_declines_an_order_with_ports(store: Store) -> None:
    w = Worker(
        WorkerConfig(worker_id=WID, region="mad", capacity=Amount(cpus=8, memory_mb=8192)),
        store,
        lambda e: None,
    )
    reasons = every_failure(
        [fits], w, bid("o1", ["http"]), wanted(bid("o1", ["http"])), w.ledger.free
    )
    assert [(r.code, r.resource) for r in reasons] == [(INSUFFICIENT, "ports")]
    assert reasons[0].detail.endswith(": the worker has no port range")


async def test_ports_busy_on_the_host_make_the_commit_insufficient(store: Store) -> None:
    w = ported_worker(store, size=1, busy=frozenset({20000}))
    r = await place(w, "o1", ["http"])
    assert isinstance(r, Rejected) and r.reason == "insufficient"
    assert "no bindable port" in r.detail
    assert w.ledger.held[4] == 0 and w.ledger.committed[4] == 0


def test_the_claims_of_a_host_refuse_a_live_overlap_and_forget_a_released_one(
    tmp_path: Path,
) -> None:
    first, second = PortClaims(HostClaims(tmp_path)), PortClaims(HostClaims(tmp_path))
    home = tmp_path / "data"
    try:
        got = first.claim(
            [Wanted("a", PortRange(20000, 20099)), Wanted("d", None, True)], "o1", home
        )
        assert got == {"a": PortRange(20000, 20099), "d": PortRange(20100, 20199)}
        with pytest.raises(PortError, match=r"worker b: its range 20050-20060 overlaps worker a"):
            second.claim([Wanted("b", PortRange(20050, 20060))], "o2", home)
        # a default block goes around the live claims
        assert second.claim([Wanted("e", None, True)], "o2", home) == {"e": PortRange(20200, 20299)}
        first.release()
        first.claims.gone("o1")  # (as its process's end does)
        assert second.claim([Wanted("b", PortRange(20050, 20060))], "o2", home) == {
            "b": PortRange(20050, 20060)
        }
    finally:
        first.release()
        second.release()


def test_a_range_whose_machines_hold_ports_outlives_its_supplier_not_its_data_dir(
    tmp_path: Path,
) -> None:
    """A supplier killed while its worker's machines hold ports (its claim held): another
    supplier goes around its range, and it starts again on that range; once its data dir is
    removed for good, the range is free."""
    home = tmp_path / "data"
    home.mkdir()
    first = PortClaims(HostClaims(tmp_path / "claims"))
    assert first.claim([Wanted("d", None, True)], "o1", home) == {"d": PortRange(20000, 20099)}
    first.hold("d", True)
    first.claims.gone("o1")  # killed: release() never ran
    second = PortClaims(HostClaims(tmp_path / "claims"))
    assert second.claim([Wanted("e", None, True)], "o2", tmp_path) == {"e": PortRange(20100, 20199)}
    with pytest.raises(PortError, match=r"overlaps worker d \(of another supplier, owner o1\)"):
        second.claim([Wanted("e", PortRange(20000, 20000))], "o2", tmp_path)
    again = PortClaims(HostClaims(tmp_path / "claims"))
    kept = Wanted("d", None, True, kept=PortRange(20000, 20099))
    assert again.claim([kept], "o1", home) == {"d": PortRange(20000, 20099)}
    again.hold("d", False)  # its machines destroyed: the range lasts while it runs
    again.claims.gone("o1")
    assert second.claim([Wanted("e", PortRange(20000, 20000))], "o2", tmp_path) == {
        "e": PortRange(20000, 20000)
    }
    second.release()
    again = PortClaims(HostClaims(tmp_path / "claims"))
    again.claim([kept], "o1", home)
    again.hold("d", True)
    again.claims.gone("o1")
    home.rmdir()  # its data dir removed for good
    assert second.claim([Wanted("e", PortRange(20000, 20000))], "o2", tmp_path) == {
        "e": PortRange(20000, 20000)
    }


def test_a_test_session_draws_default_blocks_from_its_own_slice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BOURSE_PORT_BLOCKS", "2-3")
    got = choose([Wanted("a", None, True), Wanted("b", None, True)], [])
    assert got == {"a": PortRange(20200, 20299), "b": PortRange(20300, 20399)}
    with pytest.raises(PortError, match="every default port range is taken"):
        choose([Wanted(w, None, True) for w in "abc"], [])


def test_a_port_held_on_two_workers_of_one_host_is_named() -> None:
    a = WorkerPorts(PortRange(20000, 20009), Ledger((1000, 64, 0, 0, 10)), "h")
    b = WorkerPorts(PortRange(20000, 20009), Ledger((1000, 64, 0, 0, 10)), "h")
    # the allocators alone: each worker's own check says its ledger does not count them
    assert a.allocator.take("m1", ["http"], always) == {"http": 20000}
    assert held_twice({"a": a, "b": b}) == ["a: 1 ports held, the ledger commits 0"]
    assert b.allocator.take("m2", ["http"], always) == {"http": 20000}
    assert "port 20000 held by m1 and m2" in held_twice({"a": a, "b": b})


def test_a_kept_range_is_preferred_when_the_host_is_chosen_without_claims() -> None:
    got = host_ranges([Wanted("a", None, default=True)], {"a": "20500-20599"}, None, "o", Path())
    assert got == {"a": PortRange(20500, 20599)}
