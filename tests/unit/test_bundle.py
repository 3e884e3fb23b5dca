"""The OCI runtime spec of a container machine (supplier/drivers/bundle.py), pure: the
command as Docker combines it, the environment's precedence, the user from the image's
account files, the CPU quota, the capability and namespace sets, runtime ids, where runc
puts a cgroup, and how runc's exit status reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bourse.images.oci import RunConfig
from supplier.machines.host.confine import MIB, Limits
from supplier.machines.oci.bundle import (
    CAPABILITIES,
    DEFAULT_PATH,
    NOFILE,
    BundleError,
    Command,
    Host,
    argv,
    cfs,
    cgroup_dirs,
    machine_id_of,
    merge_env,
    runtime_id,
    runtime_spec,
)
from supplier.machines.oci.spec import Spec, encode
from supplier.machines.oci.users import ExecUser, UserError, resolve_user

LIMITS = Limits(millicores=250, memory_bytes=64 * MIB, pids=32)

PASSWD = """\
odd:x:\u00b9:0::/:/bin/sh
root:x:0:0:root:/root:/bin/sh
daemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin
app:x:1000:1000:App:/home/app:/bin/sh
broken line without fields
nohome:x:1001:100::/:/bin/sh
"""
GROUP = """\
root:x:0:
users:x:100:app
app:x:1000:
audio:x:29:app,nohome
staff:x:50:nohome
"""


def _spec(image: RunConfig = RunConfig(cmd=["serve"]), **kw: Any) -> Spec:
    args: dict[str, Any] = {
        "cgroups_path": "bourse/w1/w1~01AB",
        "hostname": "m01ab",
        "bourse_env": {"PORT": "8080", "BOURSE_MACHINE_ID": "w1~01AB"},
    }
    args.update(kw)
    return runtime_spec(image, LIMITS, **args)


# -- the command ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("entrypoint", "cmd", "command", "expected"),
    [
        (None, ["sh", "-c", "serve"], Command(), ["sh", "-c", "serve"]),
        (["/init"], None, Command(), ["/init"]),
        (["/init"], ["--port", "80"], Command(), ["/init", "--port", "80"]),
        # the order's command replaces Cmd; the entrypoint stays
        (["/init"], ["--port", "80"], Command(cmd=("--port", "90")), ["/init", "--port", "90"]),
        (None, ["serve"], Command(cmd=("other", "x")), ["other", "x"]),
        # an empty command given is no arguments after the entrypoint
        (["/init"], ["--port", "80"], Command(cmd=()), ["/init"]),
        # the order's entrypoint drops the image's Cmd too (docker run --entrypoint)
        (["/init"], ["--port", "80"], Command(entrypoint=("/bin/sh",)), ["/bin/sh"]),
        (
            ["/init"],
            ["--port", "80"],
            Command(entrypoint=("/bin/sh",), cmd=("-c", "id")),
            ["/bin/sh", "-c", "id"],
        ),
        (None, None, Command(cmd=("run",)), ["run"]),
    ],
)
def test_argv_combines_entrypoint_and_cmd_as_docker(
    entrypoint: list[str] | None, cmd: list[str] | None, command: Command, expected: list[str]
) -> None:
    assert argv(RunConfig(entrypoint=entrypoint, cmd=cmd), command) == expected


@pytest.mark.parametrize(
    ("image", "command"),
    [
        (RunConfig(), Command()),
        (RunConfig(entrypoint=[], cmd=[]), Command()),
        (RunConfig(cmd=["serve"]), Command(entrypoint=())),
    ],
)
def test_no_command_at_all_is_an_error_naming_it(image: RunConfig, command: Command) -> None:
    with pytest.raises(BundleError, match="the image has no command"):
        argv(image, command)


def test_an_argument_with_a_nul_is_refused() -> None:
    with pytest.raises(BundleError, match="NUL"):
        argv(RunConfig(cmd=["a\0b"]))


# -- the environment ------------------------------------------------------------------------
def test_env_later_sources_win_and_nothing_else_comes_in(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOURSE_NATS_URL", "nats://secret")
    env = merge_env(
        {"PATH": "/bin", "HOME": "/"},
        ["PATH=/image/bin", "A=image", "B=image", "A=image2"],
        {"B": "order", "C": "order", "PORT": "1"},
        {"PORT": "8080", "BOURSE_MACHINE_ID": "w1~01AB"},
    )
    assert dict(e.split("=", 1) for e in env) == {
        "PATH": "/image/bin",
        "HOME": "/",
        "A": "image2",
        "B": "order",
        "C": "order",
        "PORT": "8080",
        "BOURSE_MACHINE_ID": "w1~01AB",
    }


def test_env_values_keep_their_equals_signs() -> None:
    assert merge_env({}, ["OPTS=a=b=c"], {"Q": "x=y"}, {}) == ["OPTS=a=b=c", "Q=x=y"]


@pytest.mark.parametrize(
    ("image", "order", "bourse", "message"),
    [
        (["NOEQUALS"], {}, {}, "the image's env entry 'NOEQUALS' is not KEY=VALUE"),
        (["1A=x"], {}, {}, "the image's env key '1A'"),
        ([], {"BAD-KEY": "x"}, {}, "the order's env key 'BAD-KEY'"),
        ([], {"": "x"}, {}, "the order's env key ''"),
        ([], {"K": "a\0b"}, {}, "the order's env K holds a NUL"),
        ([], {}, {"BOURSE_PORT_WEB SERVER": "1"}, "Bourse's env key"),
    ],
)
def test_bad_env_is_an_error_naming_the_key(
    image: list[str], order: dict[str, str], bourse: dict[str, str], message: str
) -> None:
    with pytest.raises(BundleError, match=message):
        merge_env({}, image, order, bourse)


def test_spec_env_has_defaults_beneath_the_image() -> None:
    env = _spec(RunConfig(cmd=["x"], env=["A=1"]), order_env={"B": "2"}).process.env
    assert env == [
        f"PATH={DEFAULT_PATH}",
        "HOME=/",
        "HOSTNAME=m01ab",
        "A=1",
        "B=2",
        "PORT=8080",
        "BOURSE_MACHINE_ID=w1~01AB",
    ]


def test_spec_home_is_the_users_unless_the_image_sets_it() -> None:
    image = RunConfig(cmd=["x"], user="app")
    assert "HOME=/home/app" in _spec(image, passwd=PASSWD, group=GROUP).process.env
    image = RunConfig(cmd=["x"], user="app", env=["HOME=/data"])
    assert "HOME=/data" in _spec(image, passwd=PASSWD, group=GROUP).process.env


# -- the user -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", ExecUser(0, 0, (), "/root")),
        ("0", ExecUser(0, 0, (), "/root")),
        ("root", ExecUser(0, 0, (), "/root")),
        ("app", ExecUser(1000, 1000, (29, 100), "/home/app")),
        ("1000", ExecUser(1000, 1000, (29, 100), "/home/app")),
        ("app:staff", ExecUser(1000, 50, (29, 100), "/home/app")),
        ("app:100", ExecUser(1000, 100, (29,), "/home/app")),
        ("nohome", ExecUser(1001, 100, (29, 50), "/")),
        # a uid not in passwd is still that uid: group 0, home /
        ("4242", ExecUser(4242, 0, (), "/")),
        ("4242:4343", ExecUser(4242, 4343, (), "/")),
        ("4242:audio", ExecUser(4242, 29, (), "/")),
    ],
)
def test_user_resolved_from_the_images_files(spec: str, expected: ExecUser) -> None:
    assert resolve_user(spec, PASSWD, GROUP) == expected


def test_user_without_account_files() -> None:
    assert resolve_user("") == ExecUser(0, 0, (), "/")
    assert resolve_user("65534:65534") == ExecUser(65534, 65534, (), "/")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("ghost", "user 'ghost' is not in the image's /etc/passwd"),
        ("app:ghosts", "group 'ghosts' is not in the image's /etc/group"),
        ("4294967295", "the image's user id '4294967295' is not a number"),
        ("1:99999999999", "the image's group id '99999999999' is not a number"),
        ("\u00b2", "user '\u00b2' is not in the image's /etc/passwd"),  # not an ASCII digit
    ],
)
def test_bad_user_is_an_error_naming_it(spec: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        resolve_user(spec, PASSWD, GROUP)


def test_spec_user_for_a_named_image_user() -> None:
    user = _spec(RunConfig(cmd=["x"], user="app"), passwd=PASSWD, group=GROUP).process.user
    assert (user.uid, user.gid, user.additional_gids) == (1000, 1000, [29, 100])


# -- the limits -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("millicores", "expected"),
    [
        (1, (1_000, 1_000_000)),  # 1 ms per second: exact, where 100 ms could not be
        (5, (5_000, 1_000_000)),
        (9, (9_000, 1_000_000)),
        (10, (1_000, 100_000)),
        (250, (25_000, 100_000)),
        (1000, (100_000, 100_000)),
        (1500, (150_000, 100_000)),
        (16000, (1_600_000, 100_000)),
    ],
)
def test_cfs_quota_is_exact(millicores: int, expected: tuple[int, int]) -> None:
    quota, period = cfs(millicores)
    assert (quota, period) == expected
    assert quota * 1000 == millicores * period  # the share, exactly
    assert quota >= 1_000 and 1_000 <= period <= 1_000_000  # the kernel's bounds


@pytest.mark.parametrize("millicores", [0, -5])
def test_cfs_refuses_no_cpu(millicores: int) -> None:
    with pytest.raises(BundleError, match="millicores must be >= 1"):
        cfs(millicores)


def test_spec_resources_hold_memory_swap_and_pids() -> None:
    res = _spec().linux.resources
    assert (res.cpu.quota, res.cpu.period) == (25_000, 100_000)
    assert (res.memory.limit, res.memory.swap) == (64 * MIB, 64 * MIB)  # no swap beyond
    assert res.pids.limit == 32
    assert [(d.allow, d.access) for d in res.devices] == [(False, "rwm")]


def test_spec_without_swap_accounting_leaves_swap_out() -> None:
    res = _spec(host=Host(swap_accounted=False)).linux.resources
    assert res.memory.swap is None
    assert (
        "swap"
        not in json.loads(encode(_spec(host=Host(swap_accounted=False))))["linux"]["resources"][
            "memory"
        ]
    )


@pytest.mark.parametrize(("nofile_max", "expected"), [(20_000, 20_000), (10**7, NOFILE)])
def test_spec_nofile_within_what_the_host_allows(nofile_max: int, expected: int) -> None:
    [limit] = _spec(host=Host(nofile_max=nofile_max)).process.rlimits
    assert (limit.type, limit.soft, limit.hard) == ("RLIMIT_NOFILE", expected, expected)


def test_spec_refuses_limits_of_nothing() -> None:
    with pytest.raises(BundleError, match="must be positive"):
        runtime_spec(
            RunConfig(cmd=["x"]),
            Limits(millicores=100, memory_bytes=0, pids=1),
            cgroups_path="a/b",
            hostname="h",
            bourse_env={},
        )


# -- isolation ------------------------------------------------------------------------------
@pytest.mark.parametrize("user", ["", "0", "root", "app", "1000:1000"])
def test_capabilities_for_root_and_non_root(user: str) -> None:
    process = _spec(RunConfig(cmd=["x"], user=user), passwd=PASSWD, group=GROUP).process
    caps = process.capabilities
    assert caps.bounding == caps.effective == caps.permitted == list(CAPABILITIES)
    assert caps.ambient == [] and caps.inheritable == []  # nothing survives a non-root exec
    assert process.no_new_privileges is True
    for dangerous in (
        "CAP_SYS_ADMIN",
        "CAP_NET_ADMIN",
        "CAP_NET_RAW",
        "CAP_NET_BIND_SERVICE",
        "CAP_SYS_PTRACE",
        "CAP_SYS_MODULE",
        "CAP_MKNOD",
        "CAP_SYS_RESOURCE",
        "CAP_DAC_READ_SEARCH",
    ):
        assert dangerous not in caps.bounding


def test_spec_isolation_has_no_network_namespace() -> None:
    spec = _spec()
    assert [n.type for n in spec.linux.namespaces] == ["pid", "mount", "ipc", "uts"]
    assert spec.process.terminal is False
    assert "/proc/kcore" in spec.linux.masked_paths
    assert "/proc/sys" in spec.linux.readonly_paths


def test_spec_mounts() -> None:
    mounts = {m.destination: m for m in _spec().mounts}
    assert list(mounts) == [
        "/proc",
        "/dev",
        "/dev/pts",
        "/dev/shm",
        "/dev/mqueue",
        "/sys",
        "/sys/fs/cgroup",
        "/etc/resolv.conf",
        "/etc/hosts",
    ]
    assert "ro" in mounts["/sys"].options and "ro" in mounts["/sys/fs/cgroup"].options
    for host_file in ("/etc/resolv.conf", "/etc/hosts"):
        m = mounts[host_file]
        assert (m.type, m.source) == ("bind", host_file)
        assert {"bind", "ro"} <= set(m.options)


def test_spec_binds_only_the_host_files_the_host_has() -> None:
    mounts = [m.destination for m in _spec(host=Host(files=("/etc/hosts",))).mounts]
    assert mounts[-2:] == ["/sys/fs/cgroup", "/etc/hosts"]


def test_spec_paths_and_json_names() -> None:
    doc = json.loads(encode(_spec(RunConfig(cmd=["x"], working_dir="/srv"))))
    assert doc["ociVersion"] == "1.0.2"
    assert doc["root"] == {"path": "rootfs", "readonly": False}
    assert doc["hostname"] == "m01ab"
    assert doc["process"]["cwd"] == "/srv"
    assert doc["process"]["noNewPrivileges"] is True
    assert doc["process"]["user"] == {"uid": 0, "gid": 0}
    assert doc["linux"]["cgroupsPath"] == "bourse/w1/w1~01AB"
    assert {"maskedPaths", "readonlyPaths", "namespaces", "resources"} <= set(doc["linux"])


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"hostname": "bad_host"}, "hostname 'bad_host'"),
        ({"hostname": "x" * 64}, "hostname"),
        ({"hostname": ""}, "hostname ''"),
        ({"cgroups_path": "a/../b"}, "cgroups path 'a/../b'"),
        ({"cgroups_path": ""}, "cgroups path ''"),
        ({"image": RunConfig(cmd=["x"], working_dir="srv")}, "working dir 'srv'"),
        ({"image": RunConfig()}, "the image has no command"),
        ({"order_env": {"A B": "1"}}, "the order's env key 'A B'"),
    ],
)
def test_bad_spec_input_is_an_error_naming_it(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(BundleError, match=message):
        _spec(**kw)


# -- what runc does with a bundle -----------------------------------------------------------
@pytest.mark.parametrize(
    ("machine_id", "rid"),
    [
        ("w1~01HX0000000000000000000000", "w1.01HX0000000000000000000000"),
        ("worker-a-1~abc", "worker-a-1.abc"),
        ("0~Z", "0.Z"),
    ],
)
def test_runtime_ids_map_one_to_one(machine_id: str, rid: str) -> None:
    assert runtime_id(machine_id) == rid
    assert machine_id_of(rid) == machine_id


@pytest.mark.parametrize("bad", ["w1", "W1~x", "w1~x/y", "../x", "w1~", "~x"])
def test_runtime_id_refuses_what_is_no_machine_id(bad: str) -> None:
    with pytest.raises(BundleError, match="is not a machine id"):
        runtime_id(bad)


@pytest.mark.parametrize("bad", ["w1", "w1.a.b", "w1~x", "x/y.z", ".."])
def test_machine_id_of_refuses_what_is_no_runtime_id(bad: str) -> None:
    with pytest.raises(BundleError, match="is not a runtime id"):
        machine_id_of(bad)


# This host's shape: v1 hierarchies (memory nested below the caller's own cgroup), a named
# one, a co-mounted pair, and a cgroup2 mount without controllers.
MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
50 23 0:40 / /tmp rw - tmpfs tmpfs rw
"""
PROC_CGROUP = """\
9:name=systemd:/
8:pids:/
4:memory:/api/abc
2:cpu,cpuacct:/
0::/
"""


def test_cgroup_dirs_relative_below_the_callers_own() -> None:
    dirs = cgroup_dirs(MOUNTINFO, PROC_CGROUP, "bourse/w1/w1~01")
    assert dirs == {
        "cpu": Path("/sys/fs/cgroup/cpu,cpuacct/bourse/w1/w1~01"),
        "cpuacct": Path("/sys/fs/cgroup/cpu,cpuacct/bourse/w1/w1~01"),
        "memory": Path("/sys/fs/cgroup/memory/api/abc/bourse/w1/w1~01"),
        "pids": Path("/sys/fs/cgroup/pids/bourse/w1/w1~01"),
        "name=systemd": Path("/sys/fs/cgroup/systemd/bourse/w1/w1~01"),
        "": Path("/sys/fs/cgroup/unified/bourse/w1/w1~01"),
    }


def test_cgroup_dirs_absolute_below_the_hierarchy_root() -> None:
    dirs = cgroup_dirs(MOUNTINFO, PROC_CGROUP, "/machines/bourse/w1/m")
    assert dirs["memory"] == Path("/sys/fs/cgroup/memory/machines/bourse/w1/m")
    assert dirs[""] == Path("/sys/fs/cgroup/unified/machines/bourse/w1/m")


def test_cgroup_dirs_skip_v1_hierarchies_the_caller_is_not_in() -> None:
    dirs = cgroup_dirs(MOUNTINFO, "4:memory:/\n0::/\n", "x")
    assert set(dirs) == {"memory", ""}
