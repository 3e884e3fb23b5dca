"""The host's side of machines' networks, beneath supplier/machines/host/network.py: network
namespaces made, entered and read without forking the supplier, nftables scripts, sysctls.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from bourse.errors import BourseError
from supplier.machines.host import nftables

CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class NetworkError(BourseError, RuntimeError):
    """A machine's network could not be made or removed (the reason named)."""


def available() -> str:
    """Why machines cannot have networks of their own here, or ""."""
    if os.geteuid() != 0:
        return "not root"
    try:
        import pyroute2  # noqa: F401 - whether it is there
    except ImportError:
        return "pyroute2 is not installed"
    if not nftables.installed():
        return "nftables is not installed (apt-get install nftables)"
    return ""


def host_networks() -> list[ipaddress.IPv4Network]:
    """The networks the host's own addresses are in (never given to a worker)."""
    from pyroute2 import IPRoute

    nets = []
    with IPRoute() as ipr:
        for a in ipr.get_addr(family=2):
            addr = a.get_attr("IFA_ADDRESS")
            if addr:
                nets.append(ipaddress.IPv4Network(f"{addr}/{a['prefixlen']}", strict=False))
    return nets


def in_namespace(path: str | None, work: Callable[[int], T]) -> T:
    """``work(host)`` run in a network namespace (``path``'s, or a new one when None) by a
    thread made for it, ``host`` an open descriptor of the host's namespace (blocking).

    A thread, not a process: pyroute2's own ways into a namespace (NetNS, netns.create) fork
    the supplier and stop the child with SIGTERM, which the child's inherited signal
    handling reports to the supplier's event loop as its own SIGTERM. A thread's namespace
    is its own (setns, unshare); the thread ends with its work, so no other work ever runs
    in the machine's namespace."""
    out: list[T] = []
    failed: list[BaseException] = []

    def run() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        host = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            if path is None:
                entered = libc.unshare(CLONE_NEWNET)
            else:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    entered = libc.setns(fd, CLONE_NEWNET)
                finally:
                    os.close(fd)
            if entered != 0:
                raise OSError(ctypes.get_errno(), f"cannot enter network namespace {path or 'new'}")
            out.append(work(host))
        except BaseException as exc:
            failed.append(exc)
        finally:
            os.close(host)

    thread = threading.Thread(target=run, name="bourse-netns", daemon=True)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return out[0]


def make(name: str, veth: str, bridge: str) -> None:
    """A namespace ``/run/netns/<name>``: its loopback and ``eth0`` up (no address yet:
    :func:`address_it`); the other end of the pair, ``veth``, an isolated port of
    ``bridge`` on the host (blocking; nothing left on failure)."""
    from pyroute2 import IPRoute, netns

    def inside(host: int) -> None:
        netns.attach(name, "thread-self")  # the thread's new namespace, named
        with IPRoute() as ns:
            ns.link("add", ifname="eth0", kind="veth", peer={"ifname": veth, "net_ns_fd": host})
            ns.link("set", index=ns.link_lookup(ifname="eth0")[0], state="up")
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")

    try:
        in_namespace(None, inside)
        with IPRoute() as ipr:
            index = ipr.link_lookup(ifname=veth)[0]
            ipr.link("set", index=index, master=ipr.link_lookup(ifname=bridge)[0], state="up")
        Path(f"/sys/class/net/{veth}/brport/isolated").write_text("1")
    except BaseException:
        remove(name)
        with contextlib.suppress(Exception), IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=veth):
                ipr.link("del", index=index)
        raise


def address_it(path: str, address: str, gateway: str, prefix: int) -> None:
    """The namespace at ``path``'s ``eth0`` gets ``address``/``prefix`` and a default route
    through ``gateway`` (blocking)."""
    from pyroute2 import IPRoute

    def inside(host: int) -> None:
        with IPRoute() as ns:
            eth0 = ns.link_lookup(ifname="eth0")[0]
            ns.addr("add", index=eth0, address=address, prefixlen=prefix)
            ns.route("add", dst="default", gateway=gateway)

    in_namespace(path, inside)


def forget_neighbour(bridge: str, address: str) -> None:
    """The host forgets which link-layer address ``address`` had on ``bridge`` (blocking):
    a machine's address moves to a new namespace, with a new MAC, at each of its runs, and
    the old entry would black-hole traffic to it until it went stale (tens of seconds)."""
    from pyroute2 import IPRoute

    with contextlib.suppress(Exception), IPRoute() as ipr:
        index = ipr.link_lookup(ifname=bridge)[0]
        ipr.neigh("del", dst=address, ifindex=index)


def remove(name: str) -> bool:
    """The namespace ``bn…`` removed with its veth pair: the host's end ``bv…`` deleted
    first, which takes the pair away at once (a namespace's own end would go only when the
    kernel's cleanup of the namespace gets to it, a moment after its last process ended)."""
    from pyroute2 import IPRoute, netns

    with contextlib.suppress(Exception), IPRoute() as ipr:
        for index in ipr.link_lookup(ifname="bv" + name[2:]):
            ipr.link("del", index=index)
    try:
        netns.remove(name)
    except Exception:
        return False
    return True


def listed(prefix: str) -> list[str]:
    """The host's named network namespaces whose names begin with ``prefix``."""
    from pyroute2 import netns

    return sorted(n for n in netns.listnetns() if n.startswith(prefix))


def address(path: str) -> str:
    """The address of ``eth0`` in the namespace at ``path`` ("" when it has none)."""
    from pyroute2 import IPRoute

    def read(host: int) -> str:
        with IPRoute() as ns:
            eth0 = ns.link_lookup(ifname="eth0")[0]
            return str(ns.get_addr(index=eth0)[0].get_attr("IFA_ADDRESS") or "")

    try:
        return in_namespace(path, read)
    except Exception:
        return ""


def sysctl(key: str, value: str) -> None:
    Path("/proc/sys", key).write_text(value)
