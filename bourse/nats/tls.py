"""TLS between every program and NATS: a self-made CA, the server's certificate, optional
client certificates (mutual TLS), the nats-server ``tls { }`` block
(``bourse auth init --tls``), and the client side's ``ssl.SSLContext``.

Keys are ECDSA P-256, written 0600; certificates are PEM. The server certificate names
``localhost`` and ``127.0.0.1`` plus any ``--tls-host``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bourse.errors import BourseError

TLS_DIR = "tls"
TLS_CONF = "tls.conf"
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
CA_DAYS = 3650
CERT_DAYS = 825


class TlsError(BourseError, ValueError):
    """TLS files that cannot be used; the message names the file and the problem."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    ca: Path
    ca_key: Path
    server_cert: Path
    server_key: Path
    conf: Path
    clients: dict[str, tuple[Path, Path]]  # name -> (cert, key)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Bourse"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _issue(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    days: int,
    *,
    ca: bool = False,
    hosts: Sequence[str] = (),
    usage: x509.ObjectIdentifier | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ca:
        b = b.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        b = b.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    if hosts:
        b = b.add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
    if usage is not None:
        b = b.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def write_tls_dir(
    out: Path,
    *,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    clients: Sequence[str] = (),
    verify_clients: bool = False,
) -> TlsFiles:
    """A CA, a server certificate for ``hosts``, a client certificate per name in
    ``clients``, and ``out/tls.conf`` (the server's ``tls { }`` block, absolute paths).
    ``verify_clients``: the server demands a client certificate signed by the CA."""
    d = out / TLS_DIR
    d.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("Bourse CA")
    ca = _issue(ca_name, ca_key, ca_name, ca_key, CA_DAYS, ca=True)
    files = TlsFiles(
        ca=d / "ca.pem",
        ca_key=d / "ca-key.pem",
        server_cert=d / "server.pem",
        server_key=d / "server-key.pem",
        conf=out / TLS_CONF,
        clients={},
    )
    _write_key(files.ca_key, ca_key)
    _write_cert(files.ca, ca)
    server_key = _key()
    server = _issue(
        _name("nats-server"),
        server_key,
        ca_name,
        ca_key,
        CERT_DAYS,
        hosts=hosts,
        usage=ExtendedKeyUsageOID.SERVER_AUTH,
    )
    _write_key(files.server_key, server_key)
    _write_cert(files.server_cert, server)
    for name in clients:
        key = _key()
        cert = _issue(
            _name(name), key, ca_name, ca_key, CERT_DAYS, usage=ExtendedKeyUsageOID.CLIENT_AUTH
        )
        stem = name.replace(":", "-")
        paths = (d / f"{stem}.pem", d / f"{stem}-key.pem")
        _write_key(paths[1], key)
        _write_cert(paths[0], cert)
        files.clients[name] = paths

    def q(p: Path) -> str:
        return json.dumps(str(p.resolve()))

    files.conf.write_text(
        "# Generated by `bourse auth init --tls`: the server's certificate and the CA that\n"
        "# signed it (and, with verify, every client's).\n"
        "tls {\n"
        f"  cert_file: {q(files.server_cert)}\n"
        f"  key_file: {q(files.server_key)}\n"
        f"  ca_file: {q(files.ca)}\n"
        f"  verify: {'true' if verify_clients else 'false'}\n"
        "  timeout: 2\n"
        "}\n"
    )
    return files


def client_context(
    ca: str | Path | None, cert: str | Path | None = None, key: str | Path | None = None
) -> ssl.SSLContext | None:
    """The client's SSLContext: trust ``ca`` (the system's CAs when None but a client
    certificate is given), present ``cert``/``key`` for mutual TLS. None: no TLS options."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise TlsError("--tls-cert and --tls-key go together (the client certificate and its key)")
    try:
        ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    except (OSError, ssl.SSLError) as exc:
        raise TlsError(f"cannot use CA file {ca}: {exc}") from None
    if cert and key:
        try:
            ctx.load_cert_chain(str(cert), str(key))
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"cannot use client certificate {cert} / key {key}: {exc}") from None
    return ctx
