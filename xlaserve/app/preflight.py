"""What a worker checks and claims before it opens its device: the model repository is a
directory, the TLS files (``endpoints.tls``) load into a server context, and both of its
addresses are bound and listening.

Both run before JAX is imported and before anything is logged, so a mistake costs a fraction
of a second and is reported as one line naming the node-file key, its value and the cause
(``listen.grpc 0.0.0.0:8001: address already in use``). Binding early also means the log's
effective configuration can show the ports actually bound (a port of 0 resolved).
"""
from __future__ import annotations

import errno
import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from xlaserve.config import WorkerConfig
from xlaserve.errors import StartupError

# The listen backlog trio.open_tcp_listeners would use (its default: as large as the OS allows).
_BACKLOG = 0xFFFF


@dataclass(frozen=True, slots=True)
class BoundAddress:
    """One address a worker listens on: the node-file key it came from, the host, the port
    actually bound, and the listening sockets (one per address family the host resolves to)."""

    key: str
    host: str
    port: int
    sockets: tuple[socket.socket, ...]

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def trio_listeners(self) -> list:
        """The sockets as Trio listeners (call inside the worker's Trio run)."""
        import trio
        return [trio.SocketListener(trio.socket.from_stdlib_socket(s)) for s in self.sockets]

    def close(self) -> None:
        for s in self.sockets:
            s.close()


@dataclass(frozen=True, slots=True)
class Claimed:
    """The worker's two bound addresses: KServe gRPC and the admin HTTP port; and the SSL
    context of the gRPC endpoint when ``endpoints.tls`` is set (the HTTP port stays cleartext)."""

    grpc: BoundAddress
    http: BoundAddress
    ssl_context: ssl.SSLContext | None = None
    rest: BoundAddress | None = None     #: the REST port (``listen.rest``), when the worker serves one
    rest_ssl_context: ssl.SSLContext | None = None   #: the REST port's (ALPN http/1.1), with endpoints.tls

    def close(self) -> None:
        self.grpc.close()
        self.http.close()
        if self.rest is not None:
            self.rest.close()


def address_keys(config: WorkerConfig) -> tuple[str, str]:
    """The node-file keys the worker's gRPC and HTTP addresses come from, for messages."""
    if config.worker_count == 1:
        grpc = "listen.grpc" if config.endpoints.port is None else "endpoints.port"
        return grpc, "listen.http"
    grpc = "endpoints.port" if config.endpoints.port is not None else f"base_port + {config.index}"
    return grpc, f"metrics_base_port + {config.index}"


def check_model_repo(path: Path) -> None:
    """Raise :class:`StartupError` unless ``path`` is a directory this process can list. An
    empty directory is fine: the worker serves it (and is not ready until a model is)."""
    if not path.exists():
        raise StartupError(f"model_repo {path}: does not exist (expected a directory holding one "
                           "subdirectory per bundle)")
    if not path.is_dir():
        raise StartupError(f"model_repo {path}: is not a directory (expected a directory holding one "
                           "subdirectory per bundle)")
    try:
        next(os.scandir(path), None)
    except OSError as exc:
        raise StartupError(f"model_repo {path}: cannot list it: {_cause(exc)}") from None


def claim(config: WorkerConfig) -> Claimed:
    """Check ``model_repo``, load ``endpoints.tls``'s files, and bind the worker's gRPC and HTTP
    addresses. Raises :class:`StartupError` (with nothing left open) when one cannot be done."""
    check_model_repo(Path(config.model_repo))
    ssl_context = None
    if config.endpoints.tls is not None:
        from xlaserve.frontend.tls import server_context
        ssl_context = server_context(config.endpoints.tls)
    rest_ssl_context = None
    if config.rest_port is not None and config.endpoints.tls is not None:
        from xlaserve.frontend.tls import server_context
        rest_ssl_context = server_context(config.endpoints.tls, alpn=("http/1.1",))
    grpc_key, http_key = address_keys(config)
    grpc = bind(grpc_key, config.grpc_host, config.grpc_port)
    bound = [grpc]
    try:
        http = bind(http_key, config.http_host, config.http_port)
        bound.append(http)
        rest = None
        if config.rest_port is not None:
            rest = bind("listen.rest", config.rest_host or "", config.rest_port)
    except BaseException:
        for address in bound:
            address.close()
        raise
    return Claimed(grpc, http, ssl_context, rest, rest_ssl_context)


def bind(key: str, host: str, port: int) -> BoundAddress:
    """Listen on every address ``host`` resolves to (like ``trio.open_tcp_listeners``: IPv6
    sockets are IPv6-only, SO_REUSEADDR is set). Port 0 takes a free port."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise StartupError(f"{key} {shown}: cannot resolve host {host!r}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, sockaddr in dict.fromkeys((i[0], i[1], i[2], i[4]) for i in infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(sockaddr)
            sock.listen(_BACKLOG)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise StartupError(f"{key} {shown}: {_cause(exc, port)}") from None
    bound = sockets[0].getsockname()[1]
    return BoundAddress(key, host, bound, tuple(sockets))


def _cause(exc: OSError, port: int | None = None) -> str:
    text = (exc.strerror or os.strerror(exc.errno or 0) or str(exc)).lower()
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{text} (the host is not an address of this machine)"
    if exc.errno == errno.EACCES and port is not None and 0 < port < 1024:
        return f"{text} (ports below 1024 need privileges)"
    return text
