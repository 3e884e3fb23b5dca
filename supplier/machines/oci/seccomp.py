"""The seccomp filter of every container: Docker's default profile, resolved for this host
and the container's capabilities into the runtime spec's ``linux.seccomp``.

The profile is ``seccomp.json`` beside this module: moby's ``profiles/seccomp/default.json``
(github.com/moby/profiles, seccomp v0.2.3) byte for byte, under its Apache 2.0 licence
(``seccomp.json.license`` says where it came from). Kept as the data file it is upstream,
so that an update is a copy and a diff.

What it does to a container: a system call it does not list fails with EPERM; the calls a
program needs are allowed, some only with the capability that gives them a use (``mount``,
``unshare``, ``setns``, ``bpf``, ``perf_event_open`` with ``CAP_SYS_ADMIN``, which no
container here holds: supplier/machines/oci/bundle.py ``CAPABILITIES``); ``clone`` only
without namespace flags, ``clone3`` fails with ENOSYS (its flags are out of the filter's
reach: libc falls back to ``clone``); ``keyctl``, ``add_key``, ``userfaultfd``, ``io_uring``
and the like are not listed. So a container cannot make a user namespace, in which it
would hold every capability and reach kernel code no container reaches otherwise, nor use
the kernel's keyrings. runc compiles it to BPF at each start; unknown system call names
are skipped by runc.

One change to Docker's: the filter names this host's architecture only, not its 32-bit
companions (``SCMP_ARCH_X86`` and ``SCMP_ARCH_X32`` beside ``SCMP_ARCH_X86_64``), unless
``compat``. A system call through a 32-bit entry (``int $0x80``, the x32 ABI) then kills
its caller with SIGSYS, where Docker would run it under the same rules. Each architecture
is a copy of the rules runc compiles at every start: measured here (runc 1.1.5,
libseccomp 2.5.4, ``runc run`` of a busybox ``true``, 80 runs each, medians on a loaded
2-core machine) no filter took 24.2 ms of CPU, this one 27.8 ms, Docker's three
architectures 37.8 ms (wall 47, 52 and 81 ms). An image is pulled for the worker's platform,
so its programs have no use for the 32-bit entries, and those are kernel surface a
container can do without.

Podman ships a profile generated from the same source with other choices: unknown calls
fail with ENOSYS, and ``mount``, ``unshare``, ``keyctl`` and others are allowed to every
container (Podman relies on its user namespace and capabilities for those). Docker's is
the stricter, and what Bourse runs.

Resolving it follows moby's ``setupSeccomp`` (profiles/seccomp/seccomp_linux.go):

- ``architectures``: the ``archMap`` entry of this host's architecture (x86_64:
  ``SCMP_ARCH_X86_64``), with its sub-architectures when ``compat`` (``SCMP_ARCH_X86``,
  ``SCMP_ARCH_X32``), as Docker has them;
- a rule with ``excludes`` is dropped when this architecture is among its ``arches``, any
  of its ``caps`` is in the container's bounding set, or the kernel is at least its
  ``minKernel``;
- a rule with ``includes`` is kept only when this architecture is among its ``arches`` (if
  it names any), all of its ``caps`` are in the bounding set, and the kernel is at least
  its ``minKernel`` (``<major>.<minor>``; the rest of a release string is ignored);
- the rest of a rule (its names, action, errno, argument conditions) goes as it is.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from collections.abc import Collection
from pathlib import Path

import msgspec

PROFILE = Path(__file__).with_name("seccomp.json")
# A host's machine name (uname -m) -> the profile's name for it and libseccomp's
# (moby's goToNative and nativeToSeccomp tables, for the machines Python names).
ARCHES = {
    "x86_64": ("amd64", "SCMP_ARCH_X86_64"),
    "i686": ("x86", "SCMP_ARCH_X86"),
    "aarch64": ("arm64", "SCMP_ARCH_AARCH64"),
    "armv7l": ("arm", "SCMP_ARCH_ARM"),
    "ppc64le": ("ppc64le", "SCMP_ARCH_PPC64LE"),
    "s390x": ("s390x", "SCMP_ARCH_S390X"),
    "riscv64": ("riscv64", "SCMP_ARCH_RISCV64"),
    "loongarch64": ("loong64", "SCMP_ARCH_LOONGARCH64"),
}
_KERNEL = re.compile(r"(\d+)\.(\d+)")


class SeccompError(ValueError):
    """The profile cannot be read or resolved (a data file that is not a profile)."""


# -- the spec's linux.seccomp (OCI runtime spec 1.0) ----------------------------------------
class SyscallArg(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    index: int
    value: int
    op: str
    value_two: int = 0


class Syscall(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    names: list[str]
    action: str
    errno_ret: int | None = None
    args: list[SyscallArg] | None = None


class Seccomp(msgspec.Struct, frozen=True, kw_only=True, rename="camel", omit_defaults=True):
    """``linux.seccomp`` of a runtime spec."""

    default_action: str
    default_errno_ret: int | None = None
    architectures: list[str] = []
    syscalls: list[Syscall] = []


# -- the profile as Docker writes it --------------------------------------------------------
class Filter(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    caps: list[str] = []
    arches: list[str] = []
    min_kernel: str = ""


class Rule(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    names: list[str]
    action: str
    errno_ret: int | None = None
    args: list[SyscallArg] | None = None
    comment: str = ""
    includes: Filter | None = None
    excludes: Filter | None = None


class ArchMap(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    architecture: str
    sub_architectures: list[str] | None = None


class Profile(msgspec.Struct, frozen=True, kw_only=True, rename="camel"):
    default_action: str
    default_errno_ret: int | None = None
    arch_map: list[ArchMap] = []
    syscalls: list[Rule] = []


@functools.cache
def load(path: Path = PROFILE) -> Profile:
    """The profile in ``path`` (read once)."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=Profile)
    except (OSError, msgspec.DecodeError) as exc:
        raise SeccompError(f"the seccomp profile {path} cannot be read: {exc}") from None


def kernel_of(release: str) -> tuple[int, int]:
    """A kernel's ``(major, minor)`` from its release string (``6.18.44-fc`` -> (6, 18))."""
    found = _KERNEL.match(release)
    if found is None:
        raise SeccompError(f"kernel release {release!r} has no <major>.<minor>")
    return int(found[1]), int(found[2])


def _at_least(kernel: tuple[int, int], minimum: str) -> bool:
    return kernel >= kernel_of(minimum)


def _excluded(rule: Rule, arch: str, caps: Collection[str], kernel: tuple[int, int]) -> bool:
    f = rule.excludes
    if f is None:
        return False
    return (
        arch in f.arches
        or any(c in caps for c in f.caps)
        or bool(f.min_kernel and _at_least(kernel, f.min_kernel))
    )


def _included(rule: Rule, arch: str, caps: Collection[str], kernel: tuple[int, int]) -> bool:
    f = rule.includes
    if f is None:
        return True
    return (
        (not f.arches or arch in f.arches)
        and all(c in caps for c in f.caps)
        and (not f.min_kernel or _at_least(kernel, f.min_kernel))
    )


def resolve(
    profile: Profile,
    machine: str,
    caps: Collection[str],
    kernel: tuple[int, int],
    compat: bool = False,
) -> Seccomp:
    """``profile`` for a host of ``machine`` (``uname -m``) and ``kernel``, and a container
    whose bounding set is ``caps`` (see the module doc); ``compat``: its 32-bit
    sub-architectures too. A machine the table does not know gets no architectures (the
    runtime's native one only) and no arch-specific rule."""
    arch, scmp = ARCHES.get(machine, ("", ""))
    architectures: list[str] = []
    for entry in profile.arch_map:
        if entry.architecture == scmp:
            subs = (entry.sub_architectures or []) if compat else []
            architectures = [entry.architecture, *subs]
            break
    syscalls = [
        Syscall(names=rule.names, action=rule.action, errno_ret=rule.errno_ret, args=rule.args)
        for rule in profile.syscalls
        if not _excluded(rule, arch, caps, kernel) and _included(rule, arch, caps, kernel)
    ]
    return Seccomp(
        default_action=profile.default_action,
        default_errno_ret=profile.default_errno_ret,
        architectures=architectures,
        syscalls=syscalls,
    )


@functools.cache
def for_container(caps: tuple[str, ...]) -> Seccomp:
    """The filter of a container of bounding set ``caps`` on this host (resolved once per
    set: a start pays nothing for it but its share of ``config.json``)."""
    return resolve(load(), platform.machine(), caps, kernel_of(os.uname().release))
