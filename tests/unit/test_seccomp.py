"""The containers' seccomp filter (supplier/machines/oci/seccomp.py): Docker's default
profile as shipped (the data file is upstream's, byte for byte), resolved as moby resolves
it for an architecture, a kernel and a capability set, and in every container's spec."""

from __future__ import annotations

import hashlib
import re

import msgspec
import pytest

from bourse.images.oci import RunConfig
from supplier.machines.host.confine import MIB, Limits
from supplier.machines.oci.bundle import CAPABILITIES, runtime_spec
from supplier.machines.oci.seccomp import (
    PROFILE,
    Seccomp,
    SeccompError,
    Syscall,
    for_container,
    kernel_of,
    load,
    resolve,
)
from supplier.machines.oci.spec import encode

KERNEL = (6, 18)
EPERM, ENOSYS = 1, 38
# What a container here must not do whatever its capabilities let it: make namespaces (a
# user namespace gives every capability inside it), mount, use keyrings, load BPF.
FORBIDDEN = ("unshare", "setns", "mount", "umount2", "keyctl", "add_key", "bpf", "pivot_root")


def _allowed(seccomp: Seccomp) -> set[str]:
    """The calls allowed whatever their arguments."""
    return {
        name
        for rule in seccomp.syscalls
        if rule.action == "SCMP_ACT_ALLOW" and not rule.args
        for name in rule.names
    }


def _rules(seccomp: Seccomp, name: str) -> list[Syscall]:
    return [rule for rule in seccomp.syscalls if name in rule.names]


def test_the_profile_is_dockers_default_byte_for_byte() -> None:
    note = PROFILE.with_name("seccomp.json.license").read_text()
    recorded = re.search(r"sha256\s+([0-9a-f]{64})", note)
    assert recorded is not None
    assert hashlib.sha256(PROFILE.read_bytes()).hexdigest() == recorded[1]
    profile = load()
    assert (profile.default_action, profile.default_errno_ret) == ("SCMP_ACT_ERRNO", EPERM)
    assert "SPDX-License-Identifier: Apache-2.0" in note


def test_a_container_of_the_default_capabilities_on_x86_64() -> None:
    seccomp = resolve(load(), "x86_64", CAPABILITIES, KERNEL)
    assert seccomp.architectures == ["SCMP_ARCH_X86_64"]  # no 32-bit entries: see the module
    compat = resolve(load(), "x86_64", CAPABILITIES, KERNEL, compat=True)
    assert compat.architectures == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    assert compat.syscalls == seccomp.syscalls  # Docker's, but for the architectures
    allowed = _allowed(seccomp)
    assert {"read", "write", "execve", "openat", "bind"} <= allowed
    assert not set(FORBIDDEN) & allowed
    assert not any(name in rule.names for rule in seccomp.syscalls for name in FORBIDDEN)
    # capabilities it holds bring their calls; arch rules of other machines are left out
    assert {"chroot", "arch_prctl", "modify_ldt", "ptrace"} <= allowed
    assert "s390_pci_mmio_read" not in allowed and "set_tls" not in allowed
    # clone only without namespace flags, clone3 ENOSYS (libc falls back to clone)
    [clone] = _rules(seccomp, "clone")
    assert clone.args is not None and clone.args[0].op == "SCMP_CMP_MASKED_EQ"
    assert clone.args[0].index == 0 and clone.args[0].value == 0x7E020000
    [clone3] = _rules(seccomp, "clone3")
    assert (clone3.action, clone3.errno_ret) == ("SCMP_ACT_ERRNO", ENOSYS)
    # socket: every family but AF_VSOCK (40)
    assert [(r.args or [])[0].value for r in _rules(seccomp, "socket")] == [38, 39, 40]


def test_sys_admin_would_bring_mount_and_namespaces_back() -> None:
    seccomp = resolve(load(), "x86_64", (*CAPABILITIES, "CAP_SYS_ADMIN"), KERNEL)
    assert {"mount", "unshare", "setns", "clone", "clone3"} <= _allowed(seccomp)
    assert _rules(seccomp, "clone3")[0].action == "SCMP_ACT_ALLOW"  # the ENOSYS rule excluded
    assert "keyctl" not in _allowed(seccomp)  # in no rule at all


def test_rules_by_kernel_and_architecture() -> None:
    old = resolve(load(), "x86_64", CAPABILITIES, (4, 7))
    assert "ptrace" not in _allowed(old)  # minKernel 4.8
    arm = resolve(load(), "aarch64", CAPABILITIES, KERNEL)
    assert arm.architectures == ["SCMP_ARCH_AARCH64"]
    assert resolve(load(), "aarch64", CAPABILITIES, KERNEL, compat=True).architectures == [
        "SCMP_ARCH_AARCH64",
        "SCMP_ARCH_ARM",
    ]
    assert {"set_tls", "cacheflush"} <= _allowed(arm) and "arch_prctl" not in _allowed(arm)
    unknown = resolve(load(), "vax", CAPABILITIES, KERNEL)
    assert unknown.architectures == [] and "arch_prctl" not in _allowed(unknown)


@pytest.mark.parametrize(
    ("release", "expected"),
    [("6.18.44-fc-v595", (6, 18)), ("3.12-1-amd64", (3, 12)), ("4.8", (4, 8))],
)
def test_kernel_of_a_release_string(release: str, expected: tuple[int, int]) -> None:
    assert kernel_of(release) == expected


def test_a_release_without_a_version_is_an_error() -> None:
    with pytest.raises(SeccompError, match=re.escape("has no <major>.<minor>")):
        kernel_of("linux")


def test_every_containers_spec_has_the_filter_of_its_capabilities() -> None:
    spec = runtime_spec(
        RunConfig(cmd=["true"]),
        Limits(millicores=500, memory_bytes=64 * MIB, pids=64),
        cgroups_path="bourse/w/m",
        hostname="box",
        bourse_env={},
    )
    assert spec.linux.seccomp == for_container(CAPABILITIES)
    linux = msgspec.json.decode(encode(spec))["linux"]
    assert linux["seccomp"]["defaultAction"] == "SCMP_ACT_ERRNO"
    assert linux["seccomp"]["defaultErrnoRet"] == EPERM
    assert {"names", "action"} <= set(linux["seccomp"]["syscalls"][0])
