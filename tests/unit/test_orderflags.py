"""--port, --env and --check as people write them (bourse/client/orderflags.py): what each
becomes, and each bad one as one clear error naming it."""

from __future__ import annotations

import pytest

from bourse.client.orderflags import FlagError, parse_checks, parse_env, parse_ports
from bourse.wire.messages import Check


def test_ports_keep_their_order() -> None:
    assert parse_ports(["http", "admin_2"]) == ["http", "admin_2"]
    assert parse_ports(None) == []


@pytest.mark.parametrize(
    ("names", "error"),
    [
        (["9http"], "--port '9http': a port name is a variable name"),
        (["ht-tp"], "--port 'ht-tp': a port name is a variable name"),
        (["http", "HTTP"], "--port 'HTTP' is given twice"),
        ([f"p{i}" for i in range(17)], "--port: at most 16 ports, not 17"),
    ],
)
def test_a_bad_port_is_one_error(names: list[str], error: str) -> None:
    with pytest.raises(FlagError) as err:
        parse_ports(names)
    assert str(err.value).startswith(error)


def test_env_pairs_split_at_the_first_equals_sign() -> None:
    assert parse_env(["A=1", "B=x=y", "C=", "A=2"]) == {"A": "2", "B": "x=y", "C": ""}


@pytest.mark.parametrize(
    ("pair", "error"),
    [
        ("A", "--env 'A': write it KEY=VALUE"),
        ("1A=x", "--env '1A=x': '1A' is not a variable name"),
        ("A-B=x", "--env 'A-B=x': 'A-B' is not a variable name"),
        ("=x", "--env '=x': '' is not a variable name"),
    ],
)
def test_a_bad_env_key_is_one_error(pair: str, error: str) -> None:
    with pytest.raises(FlagError) as err:
        parse_env([pair])
    assert str(err.value).startswith(error)


def test_checks_read_port_kind_and_path() -> None:
    got = parse_checks(["http:http:/healthz", "admin:tcp"], ["http", "admin"], 5, 1)
    assert got == [
        Check(port="http", kind="http", path="/healthz", interval_s=5, timeout_s=1),
        Check(port="admin", kind="tcp", interval_s=5, timeout_s=1),
    ]
    assert parse_checks(["http:tcp"], ["http"])[0].interval_s == 10.0  # Nomad's defaults
    assert parse_checks(["http:tcp"], ["http"])[0].timeout_s == 2.0


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("web:tcp", "--check 'web:tcp': port 'web' is not one of --port (http)"),
        ("http:grpc", "--check 'http:grpc': kind 'grpc': write PORT:http:/PATH or PORT:tcp"),
        ("http:http", "--check 'http:http': an http check needs a path from /"),
        ("http:http:healthz", "--check 'http:http:healthz': an http check needs a path from /"),
        ("http:tcp:/x", "--check 'http:tcp:/x': a tcp check has no path"),
        (
            "http:http:/healthz\r\nX-Injected: 1",
            "--check 'http:http:/healthz\\r\\nX-Injected: 1': its path has the control "
            "character '\\r': percent-encode it (%0D for CR, %0A for LF)",
        ),
        ("http:http:/a\x7f", "--check 'http:http:/a\\x7f': its path has the control character"),
        (
            "http:http:/" + "a" * 1024,
            f"--check 'http:http:/{'a' * 1024}': its path is longer than 1024 characters",
        ),
    ],
)
def test_a_bad_check_is_one_error(spec: str, error: str) -> None:
    with pytest.raises(FlagError) as err:
        parse_checks([spec], ["http"])
    assert str(err.value).startswith(error)


def test_a_check_without_ports_says_there_are_none() -> None:
    with pytest.raises(FlagError, match=r"is not one of --port \(none\)"):
        parse_checks(["http:tcp"], [])


def test_bad_intervals_are_refused() -> None:
    with pytest.raises(FlagError, match=r"--check-interval 0\.01: give 0\.1 to 3600 seconds"):
        parse_checks([], [], interval_s=0.01)
    with pytest.raises(FlagError, match=r"--check-timeout 700: give 0\.01 to 600 seconds"):
        parse_checks([], [], timeout_s=700)
