"""The names a person types or reads for a program's connection to NATS: the environment
variables of the common options (bourse/runtime/cli.py), the flag of the degraded mode
with what it gives up, the servers a person gives, and the token a subject prefix gives the
names of its streams and buckets. A leaf, importing nothing: a program's ``--help`` shows
them without loading nats-py or cryptography (tests/integration/test_cli_start.py), and the
buyer finds its view in its cache directory without them (bourse/view/cache.py)."""

import os

ENV_URL = "BOURSE_NATS_URL"
ENV_CREDS = "BOURSE_NATS_CREDS"
ENV_CA = "BOURSE_NATS_TLS_CA"
ENV_CERT = "BOURSE_NATS_TLS_CERT"
ENV_KEY = "BOURSE_NATS_TLS_KEY"
# The degraded mode's flag, the same for every program (bourse/runtime/cli.py defines it).
NO_JETSTREAM_FLAG = "--no-jetstream"
DEGRADED = "no order claims, events at most once"


def prefix_token(prefix: str) -> str:
    """The subject prefix as it appears in stream and bucket names (which allow only
    ``[A-Za-z0-9_-]``), one to one, so two markets never share a stream or a bucket:
    ``bourse`` -> ``BOURSE``, ``t.x`` -> ``T_X``. Lower-case letters are upper-cased,
    digits and ``-`` kept, ``.`` becomes ``_``; any other character (an upper-case letter,
    ``_``) is written ``_x`` and its two hex digits (``Bourse`` -> ``_x42OURSE``,
    ``a_b`` -> ``A_x5fB``). A lower-case ``x`` or hex digit appears only in such an escape,
    so no two prefixes give one token."""
    out: list[str] = []
    for c in prefix:
        if "a" <= c <= "z":
            out.append(c.upper())
        elif c.isdigit() or c == "-":
            out.append(c)
        elif c == ".":
            out.append("_")
        else:
            out.append(f"_x{ord(c):02x}")
    return "".join(out)


def split_urls(urls: list[str] | str | None, from_env: bool = True) -> list[str]:
    """``["a,b", "c"]`` → ``["a", "b", "c"]``; falls back to $BOURSE_NATS_URL unless
    ``from_env`` is false (commands that start their own server when given none)."""
    if not urls:
        urls = os.environ.get(ENV_URL, "") if from_env else ""
    if isinstance(urls, str):
        urls = [urls]
    return [u.strip() for part in urls for u in part.split(",") if u.strip()]
