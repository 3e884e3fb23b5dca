"""How a program reaches NATS from its common options (--nats, --creds, --tls-*, defined
once in bourse/runtime/cli.py): :class:`Connection`, each option checked once, one clear
error each, before anything connects. Loads nats-py, cryptography and msgspec only when an
option is checked or a connection made (a ``--help`` loads none of them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from bourse.nats.names import ENV_URL
from bourse.runtime.cli import fail

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS


@dataclass(frozen=True)
class Connection:
    """How a command reaches NATS: the common options (--nats, --creds, --tls-*), checked
    once (one clear error each) and passed down; no module-global connection state."""

    urls: list[str]
    creds: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_options(
        cls,
        nats: list[str] | None,
        creds: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> Connection:
        urls = nats_urls(nats)
        tls = check_tls(tls_ca, tls_cert, tls_key)
        return cls(urls, creds_file(creds), tls["tls_ca"], tls["tls_cert"], tls["tls_key"])

    async def connect(self, name: str, *, service: bool = True) -> NATS:
        """bourse.nats.connection.connect with these options."""
        from bourse.nats.connection import connect

        return await connect(
            self.urls,
            name=name,
            creds=self.creds,
            service=service,
            tls_ca=self.tls_ca,
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
        )


def nats_urls(given: list[str] | None) -> list[str]:
    """The servers from --nats / $BOURSE_NATS_URL, or one clear error."""
    from bourse.nats.names import split_urls

    urls = split_urls(given)
    if not urls:
        fail(f"no NATS server given: pass --nats URL or set {ENV_URL}")
    return urls


def creds_file(given: str | None) -> str | None:
    """The --creds file, read now so that a bad one is one clear error before connecting."""
    if given:
        from bourse.nats.auth import read_credentials

        read_credentials(given)  # an AuthError says what is wrong with it
    return given or None


def check_tls(ca: str | None, cert: str | None, key: str | None) -> dict[str, str | None]:
    """The TLS options, checked now (one clear error), as connect() keyword arguments."""
    if ca or cert or key:  # the TLS module loads cryptography: only for TLS
        from bourse.nats.tls import client_context

        client_context(ca, cert, key)  # a TlsError says which file and why
    return {"tls_ca": ca, "tls_cert": cert, "tls_key": key}
