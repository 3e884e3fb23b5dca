"""When a JetStream API error means "no JetStream here" (bourse/nats/jetstream.py
``says_none``): the one rule the detection, the claims bucket and the image store go by."""

from __future__ import annotations

import pytest
from nats.js.errors import APIError, ServiceUnavailableError

from bourse.nats.jetstream import says_none


@pytest.mark.parametrize(
    ("exc", "none"),
    [
        (APIError(code=503, err_code=10039), True),  # not enabled for the account
        (APIError(code=503, err_code=10076), True),  # not enabled on the server
        (ServiceUnavailableError(code=503), True),  # a bare 503: a core-only server
        (ServiceUnavailableError(code=503, err_code=10008), False),  # temporarily unavailable
        (APIError(code=400, err_code=10071), False),  # wrong last sequence: it is there
    ],
)
def test_only_not_enabled_or_a_bare_503_says_none(exc: APIError, none: bool) -> None:
    assert says_none(exc) is none
