"""TLS on the gRPC endpoint: the server's SSL context, built and checked at start-up, and the
handshake each connection goes through before its first HTTP/2 byte.

The context offers TLS 1.2 and 1.3 only, with the cipher suites HTTP/2 allows over TLS 1.2
(ephemeral key exchange, AEAD: RFC 9113 section 9.2.2) and no renegotiation (section 9.2.1),
and ALPN ``h2`` as the one protocol: a client that does not negotiate ``h2`` is closed after the
handshake with one log line. With ``client_ca_file`` every client must present a certificate
signed by one of its CAs (mutual TLS); OpenSSL refuses the others during the handshake.

:func:`server_context` runs before JAX is imported (:mod:`xlaserve.app.preflight`), so a bad
file costs a fraction of a second and is reported as one line naming the node-file key and the
file (``endpoints.tls.key_file /etc/x/key.pem: the private key does not match ...``).
"""
from __future__ import annotations

import logging
import ssl
from pathlib import Path

import trio

from xlaserve.config.schema import TlsConfig
from xlaserve.errors import StartupError
from xlaserve.frontend.guard import LineLimiter

log = logging.getLogger("xlaserve.grpc")

#: A client has this long from its TCP connection to the end of the TLS handshake; one that
#: connects and sends nothing, or trickles its handshake, is closed then.
TLS_HANDSHAKE_SECONDS = 10.0

# TLS 1.2 suites HTTP/2 may use (RFC 9113 9.2.2 forbids the CBC and static-RSA ones OpenSSL
# would otherwise offer); TLS 1.3's suites all qualify and are configured apart by OpenSSL.
_TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:DHE+AESGCM:DHE+CHACHA20"


class _EncryptedKey(Exception):
    """Raised from the password callback: without it OpenSSL would prompt on the terminal."""


def _read(key: str, path: Path) -> str:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except FileNotFoundError:
        raise StartupError(f"{key} {path}: does not exist") from None
    except IsADirectoryError:
        raise StartupError(f"{key} {path}: is a directory, not a PEM file") from None
    except OSError as exc:
        raise StartupError(f"{key} {path}: cannot read it: {(exc.strerror or str(exc)).lower()}") from None


def _reason(exc: ssl.SSLError) -> str:
    return (exc.reason or exc.strerror or str(exc)).replace("_", " ").lower()


def server_context(tls: TlsConfig, key: str = "endpoints.tls", alpn: tuple[str, ...] = ("h2",)) -> ssl.SSLContext:
    """The SSL context serving ``tls``; raises :class:`StartupError` naming ``key.<field>`` and
    the file when a file is missing, unreadable, not PEM, or the key does not match the
    certificate. ``alpn``: the protocols offered (``h2`` for gRPC, ``http/1.1`` for REST)."""
    cert_key, key_key, ca_key = f"{key}.cert_file", f"{key}.key_file", f"{key}.client_ca_file"
    cert_text = _read(cert_key, tls.cert_file)
    key_text = _read(key_key, tls.key_file)
    if "-----BEGIN CERTIFICATE-----" not in cert_text:
        raise StartupError(f"{cert_key} {tls.cert_file}: holds no PEM certificate "
                           "(expected '-----BEGIN CERTIFICATE-----' blocks)")
    if "PRIVATE KEY-----" not in key_text:
        raise StartupError(f"{key_key} {tls.key_file}: holds no PEM private key "
                           "(expected a '-----BEGIN PRIVATE KEY-----' block)")
    try:   # the certificates alone, so that a broken one is blamed on cert_file
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=cert_text)
    except ssl.SSLError as exc:
        raise StartupError(f"{cert_key} {tls.cert_file}: not a valid PEM certificate ({_reason(exc)})") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(_TLS12_CIPHERS)
    # HTTP/2 over TLS 1.2 must not renegotiate (RFC 9113 9.2.1); a client that could would also
    # have a way to make the server spend a handshake's CPU again and again on one connection
    context.options |= ssl.OP_NO_RENEGOTIATION
    context.set_alpn_protocols(list(alpn))

    def no_password() -> str:
        raise _EncryptedKey

    try:
        context.load_cert_chain(tls.cert_file, tls.key_file, password=no_password)
    except _EncryptedKey:
        raise StartupError(f"{key_key} {tls.key_file}: the private key is encrypted; xlaserve needs it "
                           "unencrypted (protect the file with its permissions)") from None
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc):
            raise StartupError(f"{key_key} {tls.key_file}: the private key does not match the certificate "
                               f"in {cert_key} {tls.cert_file}") from None
        raise StartupError(f"{key_key} {tls.key_file}: not a valid PEM private key ({_reason(exc)})") from None
    except OSError as exc:   # the files changed since they were read
        raise StartupError(f"{cert_key} {tls.cert_file}: cannot load it: {exc}") from None
    if tls.client_ca_file is not None:
        ca_text = _read(ca_key, tls.client_ca_file)
        if "-----BEGIN CERTIFICATE-----" not in ca_text:
            raise StartupError(f"{ca_key} {tls.client_ca_file}: holds no PEM certificate "
                               "(expected the CA certificates that sign client certificates)")
        try:
            context.load_verify_locations(cadata=ca_text)
        except ssl.SSLError as exc:
            raise StartupError(f"{ca_key} {tls.client_ca_file}: not a valid PEM certificate "
                               f"({_reason(exc)})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def describe(tls: TlsConfig | None) -> str:
    """How the endpoints are served, for the 'serving' log line."""
    if tls is None:
        return "gRPC and HTTP in cleartext"
    if tls.client_ca_file is not None:
        return "gRPC over TLS, client certificates required; HTTP in cleartext"
    return "gRPC over TLS; HTTP in cleartext"


async def handshake(stream: trio.SSLStream, lines: LineLimiter) -> bool:
    """Complete the TLS handshake of a new connection within :data:`TLS_HANDSHAKE_SECONDS` and
    check it chose ALPN ``h2``. False when the connection must be closed, with one line logged
    through ``lines``: a flood of clients that fail their handshakes (cleartext bytes, stalled
    hellos) is when it happens, and it must not write a line per connection."""
    peer = _peer(stream)
    with trio.move_on_after(TLS_HANDSHAKE_SECONDS) as timer:
        try:
            await stream.do_handshake()
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            cause = exc.__cause__
            why = _reason(cause) if isinstance(cause, ssl.SSLError) else "the client closed the connection"
            lines.line(logging.INFO, "closing a gRPC connection from %s: the TLS handshake failed: %s", peer, why)
            return False
    if timer.cancelled_caught:
        lines.line(logging.INFO, "closing a gRPC connection from %s: no TLS handshake within %.0f s", peer,
                   TLS_HANDSHAKE_SECONDS)
        return False
    protocol = stream.selected_alpn_protocol()
    if protocol != "h2":
        offered = f"negotiated {protocol!r}" if protocol else "offered no protocol this server speaks"
        lines.line(logging.WARNING, "refusing a gRPC connection from %s: the client %s over ALPN; this endpoint "
                   "speaks only HTTP/2 ('h2')", peer, offered)
        return False
    return True


def _peer(stream: trio.SSLStream) -> str:
    try:
        host, port = stream.transport_stream.socket.getpeername()[:2]
    except (AttributeError, OSError):
        return "an unknown peer"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
