"""The load-test report: figures as ratios to the two references, as a table, a JSON file
and PNG plots (latency CDF, placements per second, worker utilization)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import msgspec
from hdrh.histogram import HdrHistogram
from rich.table import Table

from bourse.wire.resources import millis_of
from loadtest.oracle import OracleResult
from loadtest.runner import Ceiling, Measured
from loadtest.workload import Profile

PERCENTILES = (50.0, 90.0, 99.0, 99.9)
# Tick sequences per decade for the latency axis, coarsest first (see ms_ticks).
TICK_STEPS = (
    (1.0, 2.0, 5.0),
    (1.0, 2.0, 3.0, 5.0, 7.0),
    (1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0),
)
MIN_TICKS = 4
MAX_TICKS = 10  # past this many 1-2-5 ticks, one per decade (labels would crowd)


def _pcts(h: HdrHistogram) -> dict[str, float]:
    if h.get_total_count() == 0:
        return {f"p{p:g}": 0.0 for p in PERCENTILES}
    return {f"p{p:g}": round(h.get_value_at_percentile(p) / 1000.0, 3) for p in PERCENTILES}


def per_placement(m: Measured) -> tuple[dict[str, float] | None, dict[str, float] | None]:
    """CPU milliseconds per placement, summed over every process watched and by process
    kind, and NATS messages per placement (published into the server, delivered by it)."""
    if not m.placed:
        return None, None
    cpu: dict[str, float] = {"all": 0.0}
    for p in m.processes:
        cpu["all"] += p.cpu_s
        cpu[p.name] = cpu.get(p.name, 0.0) + p.cpu_s
    cpu_ms = {k: round(1000 * v / m.placed, 3) for k, v in cpu.items()}
    if m.nats_in_msgs is None or m.nats_out_msgs is None:
        return cpu_ms, None
    msgs = {
        "published": round(m.nats_in_msgs / m.placed, 2),
        "delivered": round(m.nats_out_msgs / m.placed, 2),
    }
    return cpu_ms, msgs


def messages_by_program(m: Measured) -> dict[str, dict[str, float]] | None:
    """NATS messages per placement that each program published and was delivered (from
    the server's per-connection counters), or None when they were not read."""
    if not m.placed or m.nats_msgs_by_program is None:
        return None
    return {
        program: {"published": round(pub / m.placed, 2), "delivered": round(got / m.placed, 2)}
        for program, (pub, got) in m.nats_msgs_by_program.items()
    }


def messages_by_kind(m: Measured) -> dict[str, float] | None:
    """With --tap: every message of the load window per placement, by kind (most first),
    JetStream's acknowledgements included (the server sends them: nats-server's in_msgs
    does not count them)."""
    if not m.placed or m.messages_by_kind is None:
        return None
    return {kind: round(n / m.placed, 3) for kind, n in m.messages_by_kind.items()}


def cpu_vs_nats_server(cpu_ms: dict[str, float] | None) -> dict[str, float] | None:
    """CPU per placement of every process kind over nats-server's in the same run."""
    unit = (cpu_ms or {}).get("nats-server")
    if not cpu_ms or not unit:
        return None
    return {k: round(v / unit, 2) for k, v in cpu_ms.items() if k != "nats-server"}


def build(
    profile: Profile, m: Measured, ceiling: Ceiling | None, oracle: OracleResult | None
) -> dict[str, Any]:
    ceiling_rps = ceiling.rps if ceiling else None
    rtt = _pcts(ceiling.rtt) if ceiling else None
    placed_ms = _pcts(m.latency_placed)
    sent_ms = _pcts(m.latency_placed_from_send)
    rate = m.placed / m.seconds if m.seconds else 0.0
    fill = m.placed / m.sent if m.sent else 0.0
    hit = m.image_hits / m.placed if m.placed else 0.0
    util = [millis_of(s.committed) / millis_of(s.capacity) for s in m.statuses if s.capacity.cpus]
    per_proc = max(1, profile.workers // max(1, profile.supplier_processes))
    suppliers = [p for p in m.processes if p.name == "supplier"]
    cpu_ms, msgs = per_placement(m)
    return {
        "profile": msgspec.to_builtins(profile),
        "offered_load": round(profile.offered_load(), 3),
        "seconds": round(m.seconds, 3),
        "orders": m.sent,
        "placed": m.placed,
        "placements_per_s": round(rate, 1),
        "fill_rate": round(fill, 4),
        "image_hit_rate": round(hit, 4),
        "unfilled": dict(m.unfilled),
        "errors": dict(m.errors),
        "unfilled_after_rejected_commits": m.commits_rejected_unfilled,
        "latency_ms_all": _pcts(m.latency_all),
        "latency_ms_placed": placed_ms,
        "latency_ms_placed_from_send": sent_ms,
        "auction_ms_placed": _pcts(m.auction_placed),
        "generator_lag_max_ms": round(m.lag_max_ms, 1),
        "utilization_cpu": {
            "mean": round(statistics.fmean(util), 4) if util else 0.0,
            "stdev": round(statistics.pstdev(util), 4) if util else 0.0,
            "min": round(min(util), 4) if util else 0.0,
            "max": round(max(util), 4) if util else 0.0,
        },
        "processes": [
            {
                "name": p.name,
                "pid": p.pid,
                "cpu_pct": round(100 * p.cpu_s / m.seconds, 1) if m.seconds else 0.0,
                "max_rss_mb": round(p.max_rss_mb, 1),
            }
            for p in m.processes
        ],
        "machine_cpu_pct": round(
            sum(100 * p.cpu_s / m.seconds for p in m.processes) if m.seconds else 0.0, 1
        ),
        # CPU time of every watched process (the generator and, when embedded, nats-server
        # included) over the load window, in ms per placement: "all" and by process kind.
        "cpu_ms_per_placement": cpu_ms,
        # nats-server's in_msgs / out_msgs (/varz) over the load window, per placement;
        # None when the server's monitoring endpoint is not known (--nats without
        # --nats-monitor).
        "messages_per_placement": msgs,
        # The same, by program (nats-server's /connz, by connection name): which program
        # publishes what. JetStream's acknowledgements come from the server itself, so the
        # programs' "published" add up to the total and their "delivered" to more than it
        # (those acknowledgements are delivered to the programs).
        "messages_per_placement_by_program": messages_by_program(m),
        # With --tap (loadtest/tap.py): the same window's messages by kind, per placement,
        # as one subscriber on ">" saw them (a reply is named by its request and type).
        "messages_per_placement_by_kind": messages_by_kind(m),
        # The same numbers with the run's own nats-server as the unit (None when it is not
        # watched: --nats). This VM's speed drifts by 20% between runs, which a ratio to a
        # process of the same run cancels; nats-server's work per placement follows the
        # messages per placement, so read it next to those (docs/performance.md).
        "cpu_vs_nats_server": cpu_vs_nats_server(cpu_ms),
        "nats_msgs": None
        if m.nats_in_msgs is None
        else {"published": m.nats_in_msgs, "delivered": m.nats_out_msgs},
        "rss_kb_per_virtual_worker": round(
            max((p.max_rss_mb for p in suppliers), default=0.0) * 1024 / per_proc, 1
        ),
        "nats_ceiling_rps": round(ceiling_rps, 1) if ceiling_rps else None,
        "vs_ceiling": round(rate / ceiling_rps, 4) if ceiling_rps else None,
        # One raw request-reply at the run's pace; a placement is 3 in a row (buyer ->
        # exchange, bid -> offer, commit -> Placed) plus an fsync, so ~3x is its floor.
        "nats_rtt_ms": rtt,
        "latency_in_round_trips": {
            k: round(placed_ms[k] / rtt[k], 2) for k in ("p50", "p99") if rtt[k]
        }
        if rtt
        else None,
        # The same ratio with both timed alike, from the request's send (the reference
        # is a request sent when its paced sleep ends; latency_ms_placed counts from due).
        "latency_in_round_trips_from_send": {
            k: round(sent_ms[k] / rtt[k], 2) for k in ("p50", "p99") if rtt[k]
        }
        if rtt
        else None,
        "oracle": None
        if oracle is None
        else {
            "fill_rate": round(oracle.fill_rate, 4),
            "image_hit_rate": round(oracle.image_hit_rate, 4),
            "fill_vs_oracle": round(fill / oracle.fill_rate, 4) if oracle.fill_rate else None,
            "image_hit_points_below_oracle": round(100 * (oracle.image_hit_rate - hit), 2),
        },
        "machines_checked": m.machines_checked,
        "violations": m.violations,
    }


def table(r: dict[str, Any]) -> Table:
    t = Table(title=f"load test: {r['profile']['name']}", show_header=False)
    t.add_column("what")
    t.add_column("figure")
    p = r["profile"]
    t.add_row(
        "fleet",
        f"{p['workers']} workers in {p['regions']} regions, "
        f"{p['supplier_processes']} supplier process(es), "
        + ("no exchange (direct)" if p.get("direct") else f"{p['exchanges']} exchange(s)"),
    )
    t.add_row(
        "load",
        f"{p['mode']} loop, {p['rate']}/s for {p['duration_s']} s "
        f"(offered load {r['offered_load']:.0%})",
    )
    t.add_row("orders / placed", f"{r['orders']} / {r['placed']}  ({r['placements_per_s']}/s)")
    if r["nats_ceiling_rps"]:
        t.add_row(
            "vs NATS req-reply ceiling",
            f"{r['vs_ceiling']:.1%} of {r['nats_ceiling_rps']:.0f} req/s",
        )
    if r.get("nats_rtt_ms"):
        rtt, x = r["nats_rtt_ms"], r["latency_in_round_trips"]
        t.add_row(
            "NATS round trip at this pace",
            f"p50 {rtt['p50']}  p99 {rtt['p99']} ms; placed p50 = {x.get('p50')}x, "
            f"p99 = {x.get('p99')}x of it",
        )
        xs = r.get("latency_in_round_trips_from_send") or {}
        t.add_row(
            "  the same, timed from the send",
            f"placed p50 = {xs.get('p50')}x, p99 = {xs.get('p99')}x of the round trip",
        )
    la, lp = r["latency_ms_all"], r["latency_ms_placed"]
    t.add_row("latency placed (ms)", "  ".join(f"{k} {v}" for k, v in lp.items()))
    ls = r.get("latency_ms_placed_from_send")
    if ls:
        t.add_row("  timed from the send (ms)", "  ".join(f"{k} {v}" for k, v in ls.items()))
    t.add_row("latency all (ms)", "  ".join(f"{k} {v}" for k, v in la.items()))
    t.add_row(
        "auction, in the exchange (ms)",
        "  ".join(f"{k} {v}" for k, v in r["auction_ms_placed"].items()),
    )
    t.add_row("fill rate", f"{r['fill_rate']:.2%}")
    t.add_row("image hit rate", f"{r['image_hit_rate']:.2%}")
    if r["oracle"]:
        o = r["oracle"]
        t.add_row("oracle fill / image hits", f"{o['fill_rate']:.2%} / {o['image_hit_rate']:.2%}")
        t.add_row("fill vs oracle", f"{o['fill_vs_oracle']:.2%}")
        t.add_row(
            "image hits vs oracle",
            f"{o['image_hit_points_below_oracle']:.2f} points below the oracle",
        )
    t.add_row("unfilled", str(r["unfilled"] or 0))
    if r["errors"]:
        t.add_row("errors", str(r["errors"]))
    u = r["utilization_cpu"]
    t.add_row(
        "cpu utilization at end",
        f"mean {u['mean']:.1%}  stdev {u['stdev']:.1%}  min {u['min']:.1%}  max {u['max']:.1%}",
    )
    for proc in r["processes"]:
        t.add_row(
            f"process {proc['name']} {proc['pid']}",
            f"cpu {proc['cpu_pct']}%  max rss {proc['max_rss_mb']} MiB",
        )
    t.add_row(
        "supplier rss / workers",
        f"{r['rss_kb_per_virtual_worker']} KiB "
        "(the interpreter included: see fleet-1k for the marginal cost)",
    )
    cpu = r.get("cpu_ms_per_placement")
    if cpu:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in cpu.items() if k != "all")
        t.add_row("CPU per placement", f"{cpu['all']:.2f} ms, all processes ({parts})")
    rel = r.get("cpu_vs_nats_server")
    if rel:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in rel.items() if k != "all")
        t.add_row("CPU / nats-server's", f"{rel['all']:.2f} x, all processes ({parts})")
    msgs = r.get("messages_per_placement")
    t.add_row(
        "NATS messages per placement",
        f"{msgs['published']} published, {msgs['delivered']} delivered"
        if msgs
        else "not measured (no monitoring endpoint: --nats-monitor)",
    )
    by_program = r.get("messages_per_placement_by_program")
    if by_program:
        t.add_row(
            "NATS messages by program",
            ", ".join(
                f"{k} {v['published']:g} published / {v['delivered']:g} delivered"
                for k, v in by_program.items()
            ),
        )
    by_kind = r.get("messages_per_placement_by_kind")
    if by_kind:
        t.add_row(
            "NATS messages by kind (--tap)",
            ", ".join(f"{k} {v:g}" for k, v in by_kind.items() if v >= 0.01),
        )
    t.add_row("generator lag (max)", f"{r['generator_lag_max_ms']} ms")
    t.add_row(
        "invariants (I1, I3, I5)",
        "[green]0 violations[/]"
        if not r["violations"]
        else f"[red]{len(r['violations'])} violations[/]: {r['violations'][:3]}",
    )
    return t


def plots(m: Measured, report: dict[str, Any], out: Path) -> list[Path]:
    """latency-cdf.png, throughput.png, utilization.png; [] when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return []
    out.mkdir(parents=True, exist_ok=True)
    made = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, h in (("placed", m.latency_placed), ("all", m.latency_all)):
        if h.get_total_count():
            qs = [p / 10 for p in range(1, 1000)]
            ax.plot([h.get_value_at_percentile(q) / 1000 for q in qs], qs, label=name)
    ax.set_xscale("log")
    lo, hi = ax.get_xlim()
    ax.xaxis.set_major_locator(matplotlib.ticker.FixedLocator(ms_ticks(lo, hi)))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: ms_label(v)))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # no "3x10^1" labels
    ax.set_xlabel("latency (ms, from when the order was due)")
    ax.set_ylabel("percentile")
    ax.set_title(f"latency CDF - {report['profile']['name']}")
    ax.legend()
    ax.grid(True, alpha=0.3)
    made.append(out / "latency-cdf.png")
    fig.savefig(made[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    secs = sorted(m.per_second)
    ax.bar(secs, [m.per_second[s] for s in secs], width=0.9)
    ax.set_xlabel("second of the run")
    ax.set_ylabel("placements")
    ax.set_title("placements per second")
    made.append(out / "throughput.png")
    fig.savefig(made[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3))
    util = [millis_of(s.committed) / millis_of(s.capacity) for s in m.statuses if s.capacity.cpus]
    ax.hist(util, bins=20, range=(0, 1))
    ax.set_xlabel("cpu utilization per worker at the end")
    ax.set_ylabel("workers")
    ax.set_title("utilization spread")
    made.append(out / "utilization.png")
    fig.savefig(made[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return made


def ms_ticks(lo: float, hi: float) -> list[float]:
    """Plain ticks for a log axis from ``lo`` to ``hi`` (ms): 1, 2, 5, 10, 20, 50, ... when
    that gives at least ``MIN_TICKS`` in range, else a finer series (1-2-3-5-7, then
    1, 1.2, 1.5, 2, 2.5, 3, 4, ... 9);
    over ``MAX_TICKS`` of them, powers of ten only."""
    lo, hi = max(lo, 1e-3), max(hi, 2e-3)
    ticks: list[float] = []
    wide = len(_series(lo, hi, TICK_STEPS[0])) > MAX_TICKS
    for steps in ((1.0,),) if wide else TICK_STEPS:
        ticks = _series(lo, hi, steps)
        if len(ticks) >= MIN_TICKS:
            break
    return ticks


def _series(lo: float, hi: float, steps: tuple[float, ...]) -> list[float]:
    """``steps`` times every power of ten, within [lo, hi]."""
    ticks: list[float] = []
    decade = 10.0 ** math.floor(math.log10(lo))
    while decade <= hi:
        for step in steps:
            v = float(f"{step * decade:.6g}")  # 0.1 * 3 is 0.30000000000000004
            if lo <= v <= hi:
                ticks.append(v)
        decade *= 10
    return ticks


def ms_label(v: float) -> str:
    """A tick's label: ``0.5``, ``20``, ``1,000``."""
    return f"{v:,.0f}" if v >= 1 else f"{v:g}"
