"""One owner per state directory: the lock is real (flock across processes), names its
holder, and dies with it (kill -9 leaves nothing stale)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bourse.runtime.statedir import LOCK_NAME, StateDirBusy, lock_state_dir

HOLDER = """
import sys, time
from pathlib import Path
from bourse.runtime.statedir import lock_state_dir
lock = lock_state_dir(Path(sys.argv[1]))
print("locked", flush=True)
sys.stdin.read()  # hold until the test closes stdin, or kills us
"""


def hold_in_child(directory: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "locked\n"
    return child  # a context manager: closes its pipes and waits


def test_a_second_owner_is_refused_with_the_holders_pid(tmp_path: Path) -> None:
    with hold_in_child(tmp_path / "state") as child:
        with pytest.raises(StateDirBusy) as err:
            lock_state_dir(tmp_path / "state")
        assert str(err.value) == (
            f"state directory {tmp_path / 'state'} is in use by pid {child.pid}: stop it"
            " first, or pass another --data-dir"
        )
        child.kill()


def test_kill_9_of_the_owner_frees_the_directory(tmp_path: Path) -> None:
    with hold_in_child(tmp_path) as child:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    with lock_state_dir(tmp_path):  # the lock file is still there, its lock is not
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"


def test_release_hands_the_directory_over(tmp_path: Path) -> None:
    first = lock_state_dir(tmp_path / "new" / "dir")  # created if missing
    with pytest.raises(StateDirBusy):
        lock_state_dir(tmp_path / "new" / "dir")  # also within one process (own descriptor)
    first.release()
    first.release()  # idempotent
    lock_state_dir(tmp_path / "new" / "dir").release()


def test_children_do_not_inherit_the_lock(tmp_path: Path) -> None:
    lock = lock_state_dir(tmp_path)
    # a child started while the lock is held outlives its parent's release...
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    ) as child:
        lock.release()
        # ...and does not keep the directory locked
        lock_state_dir(tmp_path).release()
        child.kill()
