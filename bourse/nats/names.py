"""The names a person types or reads for a program's connection to NATS: the environment
variables of the common options (bourse/runtime/cli.py), and the flag of the degraded mode
with what it gives up. A leaf, importing nothing: a program's ``--help`` shows them without
loading nats-py or cryptography (tests/integration/test_cli_start.py)."""

ENV_URL = "BOURSE_NATS_URL"
ENV_CREDS = "BOURSE_NATS_CREDS"
ENV_CA = "BOURSE_NATS_TLS_CA"
ENV_CERT = "BOURSE_NATS_TLS_CERT"
ENV_KEY = "BOURSE_NATS_TLS_KEY"
# The degraded mode's flag, the same for every program (bourse/runtime/cli.py defines it).
NO_JETSTREAM_FLAG = "--no-jetstream"
DEGRADED = "no order claims, events at most once"
