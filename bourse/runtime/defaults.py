"""Defaults a command line shows in its ``--help``, kept where help can read them: the
modules that use them (bourse/client) load nats-py and the auction when imported, and
printing help loads none of that (tests/integration/test_cli_start.py). A leaf: each is
defined here once, and those modules import it."""

# A machine's health checks (``--check``), like Nomad's: a check every 10 s, given 2 s to
# answer (bourse/client/orderflags.py).
DEFAULT_CHECK_INTERVAL_S = 10.0
DEFAULT_CHECK_TIMEOUT_S = 2.0
# How long a deploy waits for a new machine's checks to pass (bourse/client/apps/apply.py).
DEFAULT_CHECK_WAIT_S = 60.0
# How long `place --start` watches a started machine whose checks have not passed yet: it
# must run this long without ending (bourse/client/starting.py).
DEFAULT_START_UP_S = 2.0
