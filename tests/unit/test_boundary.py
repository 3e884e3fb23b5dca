"""The unit tests' boundary (tests/unit/conftest.py): a unit test that starts a process or
connects over the network fails, told where it belongs, even when the code under test
swallows the refusal; one that does neither passes."""

from __future__ import annotations

import re

import pytest

from tests.unit.conftest import MOVE_IT

CROSSING = """
import asyncio, socket, subprocess
import pytest

def test_pure():
    assert sum([1, 2]) == 3

def test_a_subprocess():
    subprocess.run(["true"])

def test_a_connect_that_the_code_swallows():
    with socket.socket() as sock:
        try:
            sock.connect(("127.0.0.1", 1))
        except BaseException:
            pass

async def test_an_asyncio_process():
    await asyncio.create_subprocess_exec("true")

@pytest.fixture
def server():
    subprocess.Popen(["true"])

def test_a_fixture_that_starts_a_server(server):
    pass
"""


def test_a_unit_test_that_crosses_the_boundary_fails(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(
        "from tests.unit.conftest import pytest_runtest_call, pytest_runtest_setup"
    )
    pytester.makeini("[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function")
    pytester.makepyfile(test_crossing=CROSSING)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=3, errors=1)
    said = [
        f"started a process ['true']: {MOVE_IT}",  # the test itself, and its fixture
        f"connected a socket to ('127.0.0.1', 1): {MOVE_IT}",  # swallowed, still failed
        f"started a process ('true',): {MOVE_IT}",  # asyncio's
    ]
    result.stdout.re_match_lines_random([f".*{re.escape(line)}" for line in said])
