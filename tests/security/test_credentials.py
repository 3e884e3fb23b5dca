"""Reading a --creds file: an nkey seed file or a JWT .creds file, told apart by content."""

from __future__ import annotations

import os
from pathlib import Path

import nkeys
import pytest

from bourse.nats.auth import (
    AuthError,
    inbox_prefix_for,
    new_seed,
    public_key_of,
    read_credentials,
    signing_seed,
)

CREDS = """-----BEGIN NATS USER JWT-----
eyJ0eXAiOiJKV1QiLCJhbGciOiJlZDI1NTE5LW5rZXkifQ.e30.c2ln
------END NATS USER JWT------

************************* IMPORTANT *************************
NKEY Seed printed below can be used to sign and prove identity.

-----BEGIN USER NKEY SEED-----
{seed}
------END USER NKEY SEED------
"""


def test_a_seed_file_gives_the_seed_and_the_users_own_inbox(tmp_path: Path) -> None:
    seed = new_seed()
    f = tmp_path / "buyer.nk"
    f.write_text(f"# the buyer\n\n{seed}\n")
    assert read_credentials(f) == {
        "nkeys_seed_str": seed,
        "inbox_prefix": inbox_prefix_for(public_key_of(seed)),
    }
    assert signing_seed(f) == seed


def test_a_jwt_creds_file_is_passed_on_and_its_seed_signs(tmp_path: Path) -> None:
    seed = new_seed()
    f = tmp_path / "user.creds"
    f.write_text(CREDS.format(seed=seed))
    assert read_credentials(f) == {"user_credentials": str(f)}
    assert signing_seed(f) == seed


def test_bad_credentials_are_named(tmp_path: Path) -> None:
    f = tmp_path / "x"
    with pytest.raises(AuthError, match=f"cannot read credentials file {f}"):
        read_credentials(f)
    f.write_text(f"{new_seed()}\n{new_seed()}\n")
    with pytest.raises(AuthError, match="neither a NATS"):
        read_credentials(f)
    account = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT).decode()
    f.write_text(account)  # SA...: a seed, but not a user's
    with pytest.raises(AuthError, match="neither"):
        read_credentials(f)
    f.write_text("SU" + "A" * 56)
    with pytest.raises(AuthError, match="checksum mismatch"):
        read_credentials(f)
    f.write_text(CREDS.split("************")[0])
    with pytest.raises(AuthError, match="no USER NKEY SEED block"):
        signing_seed(f)
