#!/bin/sh
# Writes what compose.yaml mounts. Run from the repository root, with the project installed.
# The nats configs are committed (tests/test_compose.py regenerates them and compares);
# the secrets are NOT: every checkout makes its own, and git ignores deploy/compose/secrets/.
set -eu
bourse nats-config --out deploy/compose/nats --cluster bourse=nats-1@nats-1,nats-2@nats-2,nats-3@nats-3 --include /secrets/auth.conf --jetstream-dir /data/jetstream
bourse auth init --out deploy/compose/secrets --worker mad-1=mad --worker fra-1=fra
