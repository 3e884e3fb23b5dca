"""TLS with a self-made CA (`bourse auth init --tls`): a client that does not trust the CA
cannot connect, one that does can; with --tls-clients the server also demands a client
certificate; and a real order is placed with every program over TLS."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from bourse.client import BourseClient
from bourse.nats.authdir import AuthFiles
from bourse.nats.connection import connect, flush_all
from bourse.nats.embedded import EmbeddedNats
from bourse.nats.tls import TLS_CONF, TlsError, TlsFiles, client_context, write_tls_dir
from bourse.wire.messages import Placed
from bourse.wire.subjects import Subjects
from tests.market import order, wait_until
from tests.security.conftest import PREFIX, Secured, make_auth_dir
from tests.security.test_end_to_end import start_market


@pytest.fixture(params=[False, True], ids=["server-tls", "mutual-tls"])
def tls_setup(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[tuple[AuthFiles, TlsFiles, EmbeddedNats]]:
    files = make_auth_dir(tmp_path / "auth", extra_includes=[TLS_CONF])
    mutual = request.param
    tls = write_tls_dir(
        tmp_path / "auth", clients=["buyer"] if mutual else [], verify_clients=mutual
    )
    srv = EmbeddedNats(workdir=tmp_path / "nats", config=files.server_conf).start()
    yield files, tls, srv
    srv.stop()


async def _connect(files: AuthFiles, srv: EmbeddedNats, **tls: str) -> None:
    nc = await connect(
        srv.url,
        name="tls-test",
        creds=str(files.seed_file("buyer")),
        service=False,
        allow_reconnect=False,
        **tls,
    )
    try:
        assert nc.is_connected
        await flush_all(nc)
    finally:
        await nc.close()


async def test_connect_needs_the_ca_and_with_mutual_tls_a_client_certificate(
    tls_setup: tuple[AuthFiles, TlsFiles, EmbeddedNats],
) -> None:
    files, tls, srv = tls_setup
    with pytest.raises(ssl.SSLCertVerificationError, match="certificate verify failed"):
        await _connect(files, srv)  # the system's CAs do not know ours
    if tls.clients:
        # TLS 1.3: the refusal reaches the client as an alert or as a reset, depending on
        # timing; the server's log says why
        with pytest.raises(OSError):
            await _connect(files, srv, tls_ca=str(tls.ca))
        await wait_until(lambda: "didn't provide a certificate" in srv.log_path.read_text())
        cert, key = tls.clients["buyer"]
        await _connect(files, srv, tls_ca=str(tls.ca), tls_cert=str(cert), tls_key=str(key))
    else:
        await _connect(files, srv, tls_ca=str(tls.ca))


def test_tls_files_and_their_errors(tmp_path: Path) -> None:
    tls = write_tls_dir(tmp_path, clients=["supplier:mad-1"], hosts=["localhost", "10.1.2.3"])
    assert tls.ca_key.stat().st_mode & 0o777 == 0o600
    assert tls.server_key.stat().st_mode & 0o777 == 0o600
    assert tls.clients["supplier:mad-1"][0].name == "supplier-mad-1.pem"
    conf = tls.conf.read_text()
    assert f'cert_file: "{tls.server_cert.resolve()}"' in conf and "verify: false" in conf
    with pytest.raises(TlsError, match="--tls-cert and --tls-key go together"):
        client_context(tls.ca, cert=tls.clients["supplier:mad-1"][0])
    with pytest.raises(TlsError, match="cannot use CA file"):
        client_context(tmp_path / "missing.pem")
    assert client_context(None) is None


@pytest.fixture
async def tls_market(tmp_path: Path) -> AsyncIterator[tuple[Secured, TlsFiles]]:
    files = make_auth_dir(tmp_path / "auth", extra_includes=[TLS_CONF])
    tls = write_tls_dir(tmp_path / "auth")
    srv = EmbeddedNats(workdir=tmp_path / "nats", config=files.server_conf, jetstream=True).start()
    secured = Secured(srv, files, Subjects(PREFIX))
    try:
        yield secured, tls
    finally:
        for nc in secured.conns:
            await nc.close()
        srv.stop()


async def test_an_order_is_placed_over_tls(
    tls_market: tuple[Secured, TlsFiles], tmp_path: Path
) -> None:
    secured, tls = tls_market
    programs = await start_market(secured, tmp_path, "--tls-ca", str(tls.ca))
    try:
        nc, violations = await secured.connect("buyer", tls_ca=str(tls.ca))
        r = await BourseClient(nc, secured.subjects).place(order(region="fra", order_id="tls-1"))
        assert isinstance(r, Placed) and r.region == "fra", r
        assert violations.none_yet()
    finally:
        codes = [await p.stop() for p in reversed(programs)]
    assert codes == [0, 0, 0]
