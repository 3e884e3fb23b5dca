"""What a container's process holds, applied by hand to a command entered into the
container (supplier/machines/shim/enter.py): its capability sets (bounding, effective,
permitted, inheritable, ambient) and its seccomp filter, compiled from the runtime spec's
``linux.seccomp`` by libseccomp as runc compiles it. Used only where the runtime's own
``exec`` cannot enter (runc 1.1 joins a container's user namespace before its network
namespace, which the host's user namespace owns: EPERM).

Standard library only (ctypes), loaded in the enter helper alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno as _errno
import os

# Linux's capabilities, by number (linux/capability.h).
CAP_NAMES = (
    *("CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID"),
    *("SETUID", "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST"),
    *("NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO"),
    *("SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE"),
    *("SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE"),
    *("AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM"),
    *("BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE"),
)
PR_SET_KEEPCAPS = 8
PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_RAISE = 2
CAPABILITY_VERSION_3 = 0x20080522

# libseccomp's actions and comparisons (seccomp.h), by the runtime spec's names.
ACTIONS = {
    "SCMP_ACT_KILL": 0x00000000,
    "SCMP_ACT_KILL_THREAD": 0x00000000,
    "SCMP_ACT_KILL_PROCESS": 0x80000000,
    "SCMP_ACT_TRAP": 0x00030000,
    "SCMP_ACT_LOG": 0x7FFC0000,
    "SCMP_ACT_ALLOW": 0x7FFF0000,
}
ERRNO_ACTION = 0x00050000  # | errno
TRACE_ACTION = 0x7FF00000  # | message
COMPARE = {
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}
SCMP_FLTATR_CTL_NNP = 3


class PrivilegeError(OSError):
    """A set or a filter that could not be applied (the command is then not run)."""


def cap_numbers(names: list[str]) -> list[int]:
    """``CAP_*`` names as numbers (PrivilegeError for one this table lacks)."""
    out = []
    for name in names:
        short = name.removeprefix("CAP_")
        if short not in CAP_NAMES:
            raise PrivilegeError(_errno.EINVAL, f"unknown capability {name}")
        out.append(CAP_NAMES.index(short))
    return out


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise PrivilegeError(err, f"{what}: {os.strerror(err)}")


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _words(caps: list[int]) -> tuple[int, int]:
    bits = 0
    for c in caps:
        bits |= 1 << c
    return bits & 0xFFFFFFFF, bits >> 32


class Privileges:
    """The libraries and facts it takes, loaded on the host before the command enters the
    container (whose root holds neither Python's libraries nor the host's libseccomp)."""

    def __init__(self, seccomp: bool) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/sys/kernel/cap_last_cap") as f:
            self.last_cap = int(f.read())
        self.lib: ctypes.CDLL | None = None
        if seccomp:
            path = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
            self.lib = _seccomp_library(path)

    def drop_bounding(self, names: list[str]) -> None:
        """Every capability outside ``names`` dropped from the bounding set (for good)."""
        keep = set(cap_numbers(names))
        for cap in range(self.last_cap + 1):
            if cap not in keep:
                done = self.libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
                _check(done, f"drop CAP_{CAP_NAMES[cap]}")

    def keep_caps(self, on: bool) -> None:
        """Keep the permitted set across a change of user (set before, cleared after)."""
        _check(self.libc.prctl(PR_SET_KEEPCAPS, int(on), 0, 0, 0), "keep capabilities")

    def set_capabilities(self, sets: dict[str, list[str]]) -> None:
        """Effective, permitted and inheritable exactly as ``sets`` says, then its ambient."""
        eff = _words(cap_numbers(sets.get("effective", [])))
        perm = _words(cap_numbers(sets.get("permitted", [])))
        inh = _words(cap_numbers(sets.get("inheritable", [])))
        header = _Header(CAPABILITY_VERSION_3, 0)
        data = (_Data * 2)(_Data(eff[0], perm[0], inh[0]), _Data(eff[1], perm[1], inh[1]))
        _check(self.libc.capset(ctypes.byref(header), data), "set capabilities")
        for cap in cap_numbers(sets.get("ambient", [])):
            done = self.libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0)
            _check(done, "raise an ambient capability")

    def no_new_privileges(self) -> None:
        _check(self.libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no new privileges")

    def load_seccomp(self, profile: dict[str, object]) -> None:
        """The filter loaded (see :func:`load_seccomp`)."""
        if self.lib is None:
            raise PrivilegeError(_errno.EINVAL, "libseccomp was not loaded")
        load_seccomp(self.lib, profile)


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _action(name: str, ret: object) -> int:
    value = int(str(ret)) if ret is not None else _errno.EPERM
    if name == "SCMP_ACT_ERRNO":
        return ERRNO_ACTION | (value & 0xFFFF)
    if name == "SCMP_ACT_TRACE":
        return TRACE_ACTION | (value & 0xFFFF)
    if name not in ACTIONS:
        raise PrivilegeError(_errno.EINVAL, f"seccomp action {name} is not supported")
    return ACTIONS[name]


def _seccomp_library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path, use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(_ArgCmp),
    ]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def load_seccomp(lib: ctypes.CDLL, profile: dict[str, object]) -> None:
    """The runtime spec's ``linux.seccomp`` compiled and loaded (as runc does: calls
    unknown to this host are skipped, a rule with the default action is left out, rules
    comparing one argument twice are split)."""
    default = _action(str(profile["defaultAction"]), profile.get("defaultErrnoRet"))
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise PrivilegeError(_errno.EINVAL, "seccomp_init failed")
    try:
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_NNP, 0)  # no_new_privs is the spec's say
        for arch in _strings(profile.get("architectures")):
            token = lib.seccomp_arch_resolve_name(arch.removeprefix("SCMP_ARCH_").lower().encode())
            if token:
                done = lib.seccomp_arch_add(ctx, token)
                if done not in (0, -_errno.EEXIST):
                    raise PrivilegeError(-done, f"seccomp architecture {arch}")
        for rule in profile.get("syscalls") or []:  # type: ignore[attr-defined]
            _add_rule(lib, ctx, default, rule)
        done = lib.seccomp_load(ctx)
        if done != 0:
            raise PrivilegeError(-done, f"load the seccomp filter: {os.strerror(-done)}")
    finally:
        lib.seccomp_release(ctx)


def _strings(value: object) -> list[str]:
    return [str(v) for v in value] if isinstance(value, list) else []


def _add_rule(lib: ctypes.CDLL, ctx: int, default: int, rule: dict[str, object]) -> None:
    action = _action(str(rule["action"]), rule.get("errnoRet"))
    if action == default:
        return
    args = rule.get("args") or []
    comparisons = [
        _ArgCmp(
            int(a["index"]),
            COMPARE[str(a["op"])],
            int(a["value"]),
            int(a.get("valueTwo", 0)),
        )
        for a in args  # type: ignore[attr-defined]
    ]
    indexes = [c.arg for c in comparisons]
    groups = [comparisons] if len(set(indexes)) == len(indexes) else [[c] for c in comparisons]
    for name in _strings(rule.get("names")):
        nr = lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            continue  # not a call of this host's
        for group in groups:
            array = (_ArgCmp * max(1, len(group)))(*group)
            done = lib.seccomp_rule_add_array(ctx, action, nr, len(group), array)
            if done != 0:
                raise PrivilegeError(-done, f"seccomp rule for {name}: {os.strerror(-done)}")
