"""What a process machine of a content image runs and sees (supplier/machines/process.py):
its argv and environment from the image's config, its command and PATH found inside the
image's root first, its own working directory linked to the image's files. Files in a temp
dir; no process is started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bourse.images.oci import RunConfig
from bourse.wire.messages import Machine, Resources
from supplier.machines.api import DriverError
from supplier.machines.oci.bundle import BundleError
from supplier.machines.process import launch, resolve, search_path, start_error, working_dir

DIGEST = "sha256:" + "ab" * 32
MACHINE = Machine(
    machine_id="w1~M1",
    order_id="o1",
    worker_id="w1",
    region="mad",
    state="starting",
    resources=Resources(cpus=1, memory_mb=64),
    image="app",
    image_digest=DIGEST,
)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """An unpacked image: /app with a program and data, /usr/bin/tool, /bin/sh a link to
    /bin/busybox (absolute: the image's own, not the host's)."""
    top = tmp_path / "root"
    (top / "app" / "static").mkdir(parents=True)
    (top / "app" / "serve.py").write_text("print('hi')\n")
    (top / "usr" / "bin").mkdir(parents=True)
    (top / "usr" / "bin" / "tool").write_text("#!/bin/sh\n")
    (top / "bin").mkdir()
    (top / "bin" / "busybox").write_text("")
    (top / "bin" / "sh").symlink_to("/bin/busybox")
    return top


def test_argv_is_entrypoint_then_cmd_with_an_absolute_program_found_in_the_image(
    root: Path, tmp_path: Path
) -> None:
    config = RunConfig(entrypoint=["/bin/sh", "-c"], cmd=["echo hi"])
    run = launch(MACHINE, root, config, tmp_path / "cwd")
    assert run.argv == [str(root / "bin" / "busybox"), "-c", "echo hi"]  # the link, inside
    assert run.cwd == tmp_path / "cwd"


def test_a_program_the_image_lacks_is_the_hosts_and_a_bare_name_is_searched_on_path(
    root: Path, tmp_path: Path
) -> None:
    assert launch(MACHINE, root, RunConfig(cmd=["/usr/bin/env", "x"]), tmp_path).argv == [
        "/usr/bin/env",
        "x",
    ]
    assert launch(MACHINE, root, RunConfig(cmd=["python3", "serve.py"]), tmp_path).argv == [
        "python3",
        "serve.py",
    ]
    with pytest.raises(BundleError, match="the image has no command"):
        launch(MACHINE, root, RunConfig(), tmp_path)


def test_the_environment_is_the_images_and_bourses_never_the_suppliers(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUPPLIER_SECRET", "x")
    config = RunConfig(cmd=["tool"], env=["PATH=/opt/app/bin:/usr/bin", "MODE=prod", "MODE=dev"])
    env = launch(MACHINE, root, config, tmp_path / "cwd").env
    assert env == {
        "HOME": str(tmp_path / "cwd"),
        "PATH": f"{root}/opt/app/bin:{root}/usr/bin:/usr/local/bin:/usr/bin:/bin",
        "MODE": "dev",  # a later entry wins, as in Docker
        "BOURSE_MACHINE_ID": "w1~M1",
        "BOURSE_ORDER_ID": "o1",
        "BOURSE_IMAGE_ROOT": str(root),
        "BOURSE_IMAGE_DIGEST": DIGEST,
    }
    # without a PATH of its own, the image gets Docker's default, inside its root first
    assert (
        search_path(root, "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        == (launch(MACHINE, root, RunConfig(cmd=["tool"]), tmp_path).env["PATH"])
    )
    with pytest.raises(BundleError, match="env entry 'NOVALUE' is not KEY=VALUE"):
        launch(MACHINE, root, RunConfig(cmd=["tool"], env=["NOVALUE"]), tmp_path)


@pytest.mark.parametrize(
    ("path", "found"),
    [
        ("/app/serve.py", "app/serve.py"),
        ("app//./serve.py", "app/serve.py"),
        ("/bin/sh", "bin/busybox"),  # an absolute link starts at the root
        ("/../../../bin/sh", "bin/busybox"),  # '..' stops at the root
        ("/app/../usr/bin/tool", "usr/bin/tool"),
        ("/", ""),
        ("/nowhere", None),
        ("/app/serve.py/x", None),
    ],
)
def test_a_path_resolves_inside_the_root(root: Path, path: str, found: str | None) -> None:
    assert resolve(root, path) == (None if found is None else root / found)


def test_links_that_loop_or_climb_stay_inside(root: Path) -> None:
    (root / "loop").symlink_to("loop")
    (root / "up").symlink_to("../../../../etc")  # climbs: the root's /etc (absent here)
    assert resolve(root, "/loop/x") is None
    assert resolve(root, "/up/passwd") is None
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0::/:/bin/sh\n")
    assert resolve(root, "/up/passwd") == root / "etc" / "passwd"


def test_the_working_directory_links_the_images_files_and_keeps_the_machines(
    root: Path, tmp_path: Path
) -> None:
    cwd = tmp_path / "work" / "w1~M1"
    working_dir(root, RunConfig(working_dir="/app"), cwd)
    assert sorted(os.listdir(cwd)) == ["serve.py", "static"]
    assert (cwd / "serve.py").read_text() == "print('hi')\n"
    assert (cwd / "static").resolve() == (root / "app" / "static").resolve()
    (cwd / "serve.py").unlink()
    (cwd / "serve.py").write_text("mine")  # the machine's own file from now on
    (cwd / "out.txt").write_text("written")
    working_dir(root, RunConfig(working_dir="/app"), cwd)  # a restart: nothing replaced
    assert (cwd / "serve.py").read_text() == "mine" and not (cwd / "serve.py").is_symlink()
    assert (root / "app" / "serve.py").read_text() == "print('hi')\n"
    # the whole image when it names no working directory; none at all when it lacks its own
    whole = tmp_path / "whole"
    working_dir(root, RunConfig(), whole)
    assert sorted(os.listdir(whole)) == ["app", "bin", "usr"]
    empty = tmp_path / "empty"
    working_dir(root, RunConfig(working_dir="/srv"), empty)
    assert empty.is_dir() and os.listdir(empty) == []


def test_the_working_directory_links_reach_the_image_from_a_relative_data_dir(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `bourse up` keeps its state in .bourse/up: a root named relative to the supplier's
    # directory must still be found from the machine's own working directory
    monkeypatch.chdir(tmp_path)
    relative_root = root.relative_to(tmp_path)
    cwd = Path("work") / "w1~M1"
    working_dir(relative_root, RunConfig(working_dir="/app"), cwd)
    assert os.path.isabs(os.readlink(cwd / "serve.py"))
    assert (cwd / "serve.py").read_text() == "print('hi')\n"


def test_a_start_step_run_beside_another_fails_with_itsstart_error() -> None:
    """A process machine's cgroups are made while it enters its network (ProcessKind.plan):
    what either raised comes out as the start's reason, not as a group."""
    why = DriverError("cannot confine machine m: no room")
    both = BaseExceptionGroup("steps", [ValueError("other"), ExceptionGroup("inner", [why])])
    assert start_error(both) is why
    assert isinstance(start_error(ExceptionGroup("steps", [KeyError("k")])), KeyError)
