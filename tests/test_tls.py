"""TLS on the gRPC endpoint (``endpoints.tls``): the node-file block, the server context checked at
start-up, the handshake (bounded in time, ALPN ``h2`` required) in-process on loopback, and end to
end with the real Triton client, mutual TLS included.

Every certificate is made here, per test session, with ``cryptography``: a CA, a server
certificate for 127.0.0.1 and localhost, a client certificate from that CA, and a client
certificate from another CA.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import ssl
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from trio.testing import MockClock
from tritonclient.utils import InferenceServerException

from examples import reference
from tests.conftest import ROOT, infer_input, serve, write_node
from xlaserve.config import ConfigError, TlsConfig, parse_node_config, resolve_worker
from xlaserve.errors import StartupError
from xlaserve.http2.frames import ACK, ENHANCE_YOUR_CALM, GOAWAY, PING, PREFACE, SETTINGS, frame
from xlaserve.frontend.grpc_server import GrpcServer
from xlaserve.frontend.tls import TLS_HANDSHAKE_SECONDS, server_context

TIMEOUT = 30.0


# --- test certificates ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Certs:
    """PEM files: ``ca`` signs ``server`` and ``client``; ``other_ca`` signs ``stranger``."""

    ca: Path
    server: Path
    server_key: Path
    client: Path
    client_key: Path
    other_ca: Path
    stranger: Path
    stranger_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key, path: Path, password: bytes | None = None) -> Path:
    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    return path


def _write_cert(cert: x509.Certificate, path: Path) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path


def _certificate(subject: str, key, issuer: tuple | None, *, ca: bool = False, server: bool = False):
    """A certificate for ``key``, signed by ``issuer`` (its certificate and key) or self-signed."""
    now = datetime.datetime.now(datetime.timezone.utc)
    issuer_cert, issuer_key = issuer if issuer else (None, key)
    builder = (x509.CertificateBuilder()
               .subject_name(_name(subject))
               .issuer_name(issuer_cert.subject if issuer_cert else _name(subject))
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                              critical=False))
    if ca:
        builder = builder.add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
            key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
            decipher_only=False), critical=True)
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(out: Path) -> Certs:
    out.mkdir(parents=True, exist_ok=True)
    keys = {name: ec.generate_private_key(ec.SECP256R1())
            for name in ("ca", "server", "client", "other_ca", "stranger")}
    ca = _certificate("xlaserve test CA", keys["ca"], None, ca=True)
    other_ca = _certificate("another CA", keys["other_ca"], None, ca=True)
    issued = {
        "server": _certificate("127.0.0.1", keys["server"], (ca, keys["ca"]), server=True),
        "client": _certificate("good client", keys["client"], (ca, keys["ca"])),
        "stranger": _certificate("stranger", keys["stranger"], (other_ca, keys["other_ca"])),
    }
    return Certs(
        ca=_write_cert(ca, out / "ca.pem"),
        server=_write_cert(issued["server"], out / "server.pem"),
        server_key=_write_key(keys["server"], out / "server.key"),
        client=_write_cert(issued["client"], out / "client.pem"),
        client_key=_write_key(keys["client"], out / "client.key"),
        other_ca=_write_cert(other_ca, out / "other_ca.pem"),
        stranger=_write_cert(issued["stranger"], out / "stranger.pem"),
        stranger_key=_write_key(keys["stranger"], out / "stranger.key"),
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def client_context(certs: Certs, *, cert: Path | None = None, key: Path | None = None,
                   alpn: list[str] | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs.ca))
    if cert is not None:
        context.load_cert_chain(cert, key)
    context.set_alpn_protocols(["h2"] if alpn is None else alpn)
    return context


# --- the node-file block --------------------------------------------------------------------------

def test_tls_is_off_by_default():
    node = parse_node_config({"model_repo": "/models"}, Path("/etc/xlaserve"))
    assert node.endpoints.tls is None
    assert resolve_worker(node, 0).endpoints.tls is None


def test_tls_block_parses_with_paths_relative_to_the_node_file():
    node = parse_node_config({"model_repo": "/models", "global": {"endpoints": {"tls": {
        "cert_file": "tls/server.pem", "key_file": "/secrets/server.key", "client_ca_file": "ca.pem"}}}},
        Path("/etc/xlaserve"))
    assert resolve_worker(node, 0).endpoints.tls == TlsConfig(
        cert_file=Path("/etc/xlaserve/tls/server.pem"), key_file=Path("/secrets/server.key"),
        client_ca_file=Path("/etc/xlaserve/ca.pem"))


def test_a_worker_entry_sets_tls_as_a_whole():
    written = {"cert_file": "/a.pem", "key_file": "/a.key", "client_ca_file": "/ca.pem"}
    node = parse_node_config({"model_repo": "/models", "global": {"endpoints": {"tls": written}},
                              "workers": [{"name": "plain", "endpoints": {"tls": None}},
                                          {"name": "other", "endpoints": {"tls": {
                                              "cert_file": "/b.pem", "key_file": "/b.key"}}}]},
                             Path("/etc/xlaserve"))
    assert resolve_worker(node, 0).endpoints.tls is None
    # the worker's block replaces the global one: its client_ca_file is not inherited
    assert resolve_worker(node, 1).endpoints.tls == TlsConfig(Path("/b.pem"), Path("/b.key"), None)


@pytest.mark.parametrize("tls, message", [
    ({"cert_file": "/a.pem"},
     "global.endpoints.tls.key_file: required (global.endpoints.tls needs cert_file and key_file)"),
    ({"key_file": "/a.key"},
     "global.endpoints.tls.cert_file: required (global.endpoints.tls needs cert_file and key_file)"),
    ("/a.pem", "global.endpoints.tls: expected a mapping or null, got '/a.pem'"),
    ({"cert_file": "/a.pem", "key_file": "/a.key", "ca_file": "/ca.pem"},
     "global.endpoints.tls.ca_file: unknown key (known: cert_file, client_ca_file, key_file)"),
    ({"cert_file": "", "key_file": "/a.key"}, "global.endpoints.tls.cert_file: expected a path, got ''"),
    ({"cert_file": "/a.pem", "key_file": "/a.key", "client_ca_file": 3},
     "global.endpoints.tls.client_ca_file: expected a path or null, got 3"),
])
def test_bad_tls_blocks_name_the_key(tls, message):
    with pytest.raises(ConfigError) as caught:
        parse_node_config({"model_repo": "/models", "global": {"endpoints": {"tls": tls}}}, Path("/etc"))
    assert str(caught.value) == message


def test_tls_cannot_be_set_from_the_environment():
    with pytest.raises(ConfigError, match="INFERENCE_SERVER_ENDPOINTS_TLS: unknown variable"):
        parse_node_config({"model_repo": "/models"}, Path("/etc"), {"INFERENCE_SERVER_ENDPOINTS_TLS": "x"})


# --- the server context, checked at start-up ------------------------------------------------------

def test_server_context_is_tls12_or_later_with_alpn_h2(certs):
    context = server_context(TlsConfig(certs.server, certs.server_key))
    assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert context.verify_mode == ssl.CERT_NONE
    ciphers = {c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"}
    assert ciphers and all("GCM" in name or "CHACHA20" in name for name in ciphers), ciphers
    assert context.options & ssl.OP_NO_RENEGOTIATION
    mutual = server_context(TlsConfig(certs.server, certs.server_key, certs.ca))
    assert mutual.verify_mode == ssl.CERT_REQUIRED


def _bad_files(certs: Certs, tmp: Path) -> dict[str, tuple[TlsConfig, str]]:
    """Each case: the block, and the start of the one-line error it must give."""
    garbage = tmp / "garbage.pem"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydGlmaWNhdGU=\n-----END CERTIFICATE-----\n")
    text = tmp / "notes.txt"
    text.write_text("hello\n")
    locked = _write_key(ec.generate_private_key(ec.SECP256R1()), tmp / "locked.key", b"secret")
    return {
        "missing cert": (TlsConfig(tmp / "nope.pem", certs.server_key),
                         f"endpoints.tls.cert_file {tmp / 'nope.pem'}: does not exist"),
        "missing key": (TlsConfig(certs.server, tmp / "nope.key"),
                        f"endpoints.tls.key_file {tmp / 'nope.key'}: does not exist"),
        "directory": (TlsConfig(tmp, certs.server_key), f"endpoints.tls.cert_file {tmp}: is a directory"),
        "cert not PEM": (TlsConfig(text, certs.server_key), f"endpoints.tls.cert_file {text}: holds no PEM certificate"),
        "cert garbage": (TlsConfig(garbage, certs.server_key),
                         f"endpoints.tls.cert_file {garbage}: not a valid PEM certificate"),
        "key not PEM": (TlsConfig(certs.server, text), f"endpoints.tls.key_file {text}: holds no PEM private key"),
        "key of another cert": (TlsConfig(certs.server, certs.client_key),
                                f"endpoints.tls.key_file {certs.client_key}: the private key does not match the "
                                f"certificate in endpoints.tls.cert_file {certs.server}"),
        "encrypted key": (TlsConfig(certs.server, locked),
                          f"endpoints.tls.key_file {locked}: the private key is encrypted"),
        "missing CA": (TlsConfig(certs.server, certs.server_key, tmp / "ca.pem"),
                       f"endpoints.tls.client_ca_file {tmp / 'ca.pem'}: does not exist"),
        "CA not PEM": (TlsConfig(certs.server, certs.server_key, text),
                       f"endpoints.tls.client_ca_file {text}: holds no PEM certificate"),
        "CA garbage": (TlsConfig(certs.server, certs.server_key, garbage),
                       f"endpoints.tls.client_ca_file {garbage}: not a valid PEM certificate"),
    }


def test_bad_tls_files_are_one_line_naming_the_key_and_the_file(certs, tmp_path):
    for case, (tls, start) in _bad_files(certs, tmp_path).items():
        with pytest.raises(StartupError) as caught:
            server_context(tls)
        message = str(caught.value)
        assert message.startswith(start), (case, message)
        assert "\n" not in message, case


def _start_node(tmp: Path, repo: Path, tls: dict) -> subprocess.CompletedProcess:
    node = write_node(tmp / "node.yaml", repo, {"endpoints": {"tls": tls}})
    return subprocess.run([sys.executable, "-m", "xlaserve", "run", str(node)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_a_bad_tls_file_stops_start_up_with_exit_2(certs, tmp_path):
    repo = tmp_path / "models"
    repo.mkdir()
    missing = _start_node(tmp_path, repo, {"cert_file": str(tmp_path / "gone.pem"), "key_file": str(certs.server_key)})
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr == (f"xlaserve: cannot start: endpoints.tls.cert_file {tmp_path / 'gone.pem'}: "
                              "does not exist\n")
    mismatch = _start_node(tmp_path, repo, {"cert_file": str(certs.server), "key_file": str(certs.client_key)})
    assert mismatch.returncode == 2, mismatch.stderr
    assert mismatch.stderr == (f"xlaserve: cannot start: endpoints.tls.key_file {certs.client_key}: the private key "
                               f"does not match the certificate in endpoints.tls.cert_file {certs.server}\n")


def test_a_node_of_several_workers_with_tls_stops_start_up_with_exit_2(certs, tmp_path):
    """Its embedded gateway has no TLS: before, the node started and never served a request."""
    repo = tmp_path / "models"
    repo.mkdir()
    tls = {"cert_file": str(certs.server), "key_file": str(certs.server_key)}
    node = write_node(tmp_path / "node.yaml", repo, {"endpoints": {"tls": tls}},
                      workers=[{"name": "w0"}, {"name": "w1"}])
    done = subprocess.run([sys.executable, "-m", "xlaserve", "run", str(node)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert ("endpoints.tls is set for w0, w1, but this node runs 2 workers behind its embedded gateway"
            in done.stderr), done.stderr


# --- the handshake, in-process on loopback (MockClock: timeouts are exact) ------------------------

def _run_with_server(certs: Certs, client, *, client_ca: Path | None = None, clock: MockClock | None = None,
                     **limits) -> None:
    """Serve (no services) over TLS on loopback and run ``client(port)`` against it. ``clock``:
    the MockClock to run under (default: one that jumps whenever every task waits)."""
    context = server_context(TlsConfig(certs.server, certs.server_key, client_ca))

    async def main() -> None:
        server = GrpcServer([], **limits)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(lambda task_status: server.serve(
                "127.0.0.1", 0, ssl_context=context, task_status=task_status))
            with trio.fail_after(TIMEOUT):
                await client(port)
            server.close()
            await server.wait_closed()

    trio.run(main, clock=clock or MockClock(autojump_threshold=0))


async def _tls_client(port: int, context: ssl.SSLContext) -> trio.SSLStream:
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(tcp, context, server_hostname="127.0.0.1", https_compatible=True)
    await stream.do_handshake()
    return stream


async def _read_until_closed(stream) -> bytes:
    data = b""
    try:
        while chunk := await stream.receive_some(65536):
            data += chunk
    except trio.BrokenResourceError:
        pass
    return data


async def _read_frame(stream, buffer: bytearray) -> tuple[int, int, bytes]:
    while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
        chunk = await stream.receive_some(65536)
        assert chunk, "the server closed the connection"
        buffer += chunk
    length = int.from_bytes(buffer[:3], "big")
    ftype, flags, payload = buffer[3], buffer[4], bytes(buffer[9:9 + length])
    del buffer[:9 + length]
    return ftype, flags, payload


def test_http2_over_tls_settings_and_ping_ack(certs):
    async def client(port: int) -> None:
        stream = await _tls_client(port, client_context(certs))
        assert stream.selected_alpn_protocol() == "h2"
        await stream.send_all(PREFACE + frame(SETTINGS, 0, 0) + frame(PING, 0, 0, b"tls-ping"))
        buffer = bytearray()
        seen = []
        while (PING, ACK, b"tls-ping") not in seen:
            seen.append(await _read_frame(stream, buffer))
        assert seen[0][0] == SETTINGS and seen[0][1] == 0      # the server's preface came first
        await stream.aclose()

    _run_with_server(certs, client)


def test_a_client_that_never_handshakes_is_closed_after_the_timeout(certs, caplog):
    async def client(port: int) -> None:
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        opened = trio.current_time()
        assert await _read_until_closed(tcp) == b""
        waited = trio.current_time() - opened
        assert TLS_HANDSHAKE_SECONDS <= waited < TLS_HANDSHAKE_SECONDS + 1, waited
        await tcp.aclose()

    with caplog.at_level(logging.INFO, logger="xlaserve.grpc"):
        _run_with_server(certs, client)
    assert f"no TLS handshake within {TLS_HANDSHAKE_SECONDS:.0f} s" in caplog.text


def test_a_client_that_does_not_negotiate_h2_is_refused_with_a_log_line(certs, caplog):
    async def client(port: int) -> None:
        stream = await _tls_client(port, client_context(certs, alpn=["http/1.1"]))
        assert stream.selected_alpn_protocol() is None
        assert await _read_until_closed(stream) == b""
        await stream.aclose()
        await trio.sleep(1.5)       # past the one-line-a-second limit on these lines
        # one that offers no ALPN at all is refused the same way
        stream = await _tls_client(port, client_context(certs, alpn=[]))
        assert await _read_until_closed(stream) == b""
        await stream.aclose()

    with caplog.at_level(logging.INFO, logger="xlaserve.grpc"):
        _run_with_server(certs, client)
    assert caplog.text.count("this endpoint speaks only HTTP/2 ('h2')") == 2


def test_a_cleartext_http2_client_is_closed_during_the_handshake(certs, caplog):
    async def client(port: int) -> None:
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        await tcp.send_all(PREFACE + frame(SETTINGS, 0, 0))
        # a TLS alert record (content type 21) or nothing, never HTTP/2 frames
        reply = await _read_until_closed(tcp)
        assert reply == b"" or reply[0] == 21, reply
        await tcp.aclose()

    with caplog.at_level(logging.INFO, logger="xlaserve.grpc"):
        _run_with_server(certs, client)
    assert "the TLS handshake failed" in caplog.text


def test_a_flood_of_failed_handshakes_logs_one_line_a_second(certs, caplog):
    """Cleartext bytes on the TLS port fail the handshake at once: a client opening connection
    after connection must not make the server write a log line for each (2,000 lines in 0.7 s
    before this limit). Under a clock that stands still, 40 failures are one line; a second
    later the next line counts the others."""
    clock = MockClock()

    async def garbage() -> None:
        tcp = await trio.open_tcp_stream("127.0.0.1", port_box[0])
        await tcp.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await _read_until_closed(tcp)
        await tcp.aclose()

    port_box: list[int] = []

    async def client(port: int) -> None:
        port_box.append(port)
        async with trio.open_nursery() as nursery:
            for _ in range(40):
                nursery.start_soon(garbage)
        clock.jump(1.5)
        await garbage()

    with caplog.at_level(logging.INFO, logger="xlaserve.grpc"):
        _run_with_server(certs, client, clock=clock)
    lines = [r.getMessage() for r in caplog.records if "the TLS handshake failed" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[1].endswith("(39 more such lines left out since the last)"), lines[1]


def test_a_connection_past_max_connections_gets_goaway_over_tls(certs):
    async def client(port: int) -> None:
        first = await _tls_client(port, client_context(certs))
        await first.send_all(PREFACE + frame(SETTINGS, 0, 0))
        buffer = bytearray()
        assert (await _read_frame(first, buffer))[0] == SETTINGS      # served: the slot is taken
        second = await _tls_client(port, client_context(certs))
        refusal = await _read_until_closed(second)
        assert refusal[3] == SETTINGS and refusal[12] == GOAWAY, refusal
        assert struct.unpack(">I", refusal[22:26])[0] == ENHANCE_YOUR_CALM
        assert b"endpoints.max_connections" in refusal
        # the first connection goes on
        await first.send_all(frame(PING, 0, 0, b"still on"))
        while await _read_frame(first, buffer) != (PING, ACK, b"still on"):
            pass
        await first.aclose()
        await second.aclose()

    _run_with_server(certs, client, max_connections=1)


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(certs, caplog):
    async def refused(port: int, context: ssl.SSLContext) -> None:
        tcp = await trio.open_tcp_stream("127.0.0.1", port)
        stream = trio.SSLStream(tcp, context, server_hostname="127.0.0.1")
        try:
            # TLS 1.2 refuses inside the handshake, TLS 1.3 right after the client's Finished
            with pytest.raises(trio.BrokenResourceError):
                await stream.do_handshake()
                await stream.receive_some(65536)
        finally:
            await tcp.aclose()

    async def client(port: int) -> None:
        await refused(port, client_context(certs))
        await trio.sleep(1.5)       # past the one-line-a-second limit on these lines
        await refused(port, client_context(certs, cert=certs.stranger, key=certs.stranger_key))
        good = await _tls_client(port, client_context(certs, cert=certs.client, key=certs.client_key))
        await good.send_all(PREFACE + frame(SETTINGS, 0, 0) + frame(PING, 0, 0, b"mutual!!"))
        buffer = bytearray()
        while await _read_frame(good, buffer) != (PING, ACK, b"mutual!!"):
            pass
        await good.aclose()

    with caplog.at_level(logging.INFO, logger="xlaserve.grpc"):
        _run_with_server(certs, client, client_ca=certs.ca)
    assert caplog.text.count("the TLS handshake failed") == 2, caplog.text
    assert "peer did not return a certificate" in caplog.text
    assert "certificate verify failed" in caplog.text


# --- end to end with the Triton client ------------------------------------------------------------

def _simple_infer(client: grpcclient.InferenceServerClient) -> None:
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.full((2, 16), 5, dtype=np.int32)
    result = client.infer("simple", [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", b, "INT32")],
                          client_timeout=TIMEOUT)
    total, difference = reference.simple_ref(a, b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), total)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), difference)


def _client(url: str, certs: Certs, cert: Path | None = None, key: Path | None = None):
    return grpcclient.InferenceServerClient(url, ssl=True, root_certificates=str(certs.ca),
                                            private_key=str(key) if key else None,
                                            certificate_chain=str(cert) if cert else None)


def test_triton_client_over_tls(certs, examples_repo, tmp_path):
    tls = {"cert_file": str(certs.server), "key_file": str(certs.server_key)}
    with serve(tmp_path, examples_repo, {"endpoints": {"tls": tls}}) as server:
        client = _client(server.url, certs)
        assert client.is_server_ready(client_timeout=TIMEOUT)
        _simple_infer(client)
        # a cleartext client on the TLS port gets an error, not a hang; the server goes on
        with pytest.raises(InferenceServerException) as cleartext:
            grpcclient.InferenceServerClient(server.url).is_server_ready(client_timeout=TIMEOUT)
        assert cleartext.value.status() == "StatusCode.UNAVAILABLE"
        _simple_infer(client)
        # health and metrics stay plain HTTP
        assert server.get("/readyz")[0] == 200
    log = server.log()
    assert server.process.returncode == 0, log
    assert "gRPC over TLS; HTTP in cleartext" in log
    assert "the TLS handshake failed" in log


def test_rest_over_tls_with_the_same_certificate(certs, examples_repo, tmp_path):
    """endpoints.tls covers listen.rest too (ALPN http/1.1): HTTPS clients are served, a
    cleartext request on the port gets no answer, and the server goes on."""
    import http.client
    import json
    tls = {"cert_file": str(certs.server), "key_file": str(certs.server_key)}
    with serve(tmp_path, examples_repo, {"endpoints": {"tls": tls}},
               listen={"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"}) as server:
        context = client_context(certs, alpn=["http/1.1"])
        body = json.dumps({"inputs": [{"name": n, "datatype": "INT32", "shape": [1, 16], "data": [2] * 16}
                                      for n in ("INPUT0", "INPUT1")]})

        def infer() -> dict:
            conn = http.client.HTTPSConnection("127.0.0.1", server.rest_port, context=context, timeout=TIMEOUT)
            try:
                conn.request("POST", "/v2/models/simple/infer", body=body)
                response = conn.getresponse()
                assert response.status == 200
                assert conn.sock.selected_alpn_protocol() == "http/1.1"
                return json.loads(response.read())
            finally:
                conn.close()
        assert infer()["outputs"][0]["data"] == [4] * 16
        plain = http.client.HTTPConnection("127.0.0.1", server.rest_port, timeout=TIMEOUT)
        with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError, http.client.BadStatusLine)):
            plain.request("GET", "/v2/health/ready")
            plain.getresponse()
        plain.close()
        assert infer()["outputs"][1]["data"] == [0] * 16
    assert server.process.returncode == 0, server.log()
    assert "KServe V2 REST over TLS on" in server.log()


def test_triton_client_with_mutual_tls(certs, examples_repo, tmp_path):
    tls = {"cert_file": str(certs.server), "key_file": str(certs.server_key), "client_ca_file": str(certs.ca)}
    with serve(tmp_path, examples_repo, {"endpoints": {"tls": tls}}) as server:
        good = _client(server.url, certs, certs.client, certs.client_key)
        assert good.is_server_ready(client_timeout=TIMEOUT)
        _simple_infer(good)
        for refused in (_client(server.url, certs),                                  # no certificate
                        _client(server.url, certs, certs.stranger, certs.stranger_key)):  # another CA's
            with pytest.raises(InferenceServerException) as caught:
                refused.is_server_ready(client_timeout=TIMEOUT)
            assert caught.value.status() == "StatusCode.UNAVAILABLE"
            with pytest.raises(InferenceServerException):
                _simple_infer(refused)
        # the good client, on its open connection and on a new one, is still served
        _simple_infer(good)
        _simple_infer(_client(server.url, certs, certs.client, certs.client_key))
    log = server.log()
    assert server.process.returncode == 0, log
    assert "gRPC over TLS, client certificates required; HTTP in cleartext" in log
    # the first refusal's line; the next, within a second, are counted on a later line (at most
    # one a second: test_a_flood_of_failed_handshakes_logs_one_line_a_second)
    assert "the TLS handshake failed: peer did not return a certificate" in log
