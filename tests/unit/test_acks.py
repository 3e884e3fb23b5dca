"""A publish's answer read from its reply (bourse/nats/acks.py): stored (a duplicate or
not), refused by the stream, or taken by no stream."""

from __future__ import annotations

import pytest

from bourse.nats.acks import Answer, answer_of


@pytest.mark.parametrize(
    ("data", "status", "want"),
    [
        (b'{"stream":"S","seq":7}', None, Answer(True)),
        (b'{"stream":"S","seq":7,"duplicate":true}', None, Answer(True, duplicate=True)),
        (b"", "503", Answer(False, no_stream=True, error="503")),
        (b"", None, Answer(False, error=None)),
        (
            b'{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 3"}}',
            None,
            Answer(
                False,
                error={"code": 400, "err_code": 10071, "description": "wrong last sequence: 3"},
            ),
        ),
        (b'{"error": not json', None, Answer(False, error='{"error": not json')),
    ],
)
def test_an_answer_says_stored_refused_or_no_stream(
    data: bytes, status: str | None, want: Answer
) -> None:
    assert answer_of(data, status) == want
