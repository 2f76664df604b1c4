"""Faults of one connection stay inside that connection's guard (issue 24, part 1).

The rule: a root nursery is cancelled only by a stop signal. Whatever happens while one connection
is accepted, set up or served (a reset in the accept queue, a peer address that is gone, an
``accept`` that runs out of descriptors, a bug) closes that connection, logs one line (at most one
a second), and the server goes on serving the others. Each case here starts the real server on
loopback, injects the fault, and then has a well-behaved client served on another connection.
"""
from __future__ import annotations

import errno
import logging
import socket
import struct
import threading
import urllib.request

import pytest
import trio
from trio.testing import MockClock

from tests.test_grpc_server import ServerThread, make_server, request  # noqa: F401  (fixture)
from tests.trio_thread import TrioServerThread
from xlaserve.admin import serve_admin
from xlaserve.frontend.guard import LineLimiter

RESETS = 1200
THREADS = 4


def connect_and_reset(port: int, count: int) -> None:
    """``count`` TCP connections that connect and at once close with SO_LINGER 0 (an RST):
    what load balancers' TCP health checks and port scanners do. Many are reset while they
    wait in the server's accept queue."""
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        try:
            s.connect(("127.0.0.1", port))
        except OSError:
            pass
        s.close()


def reset_flood(port: int) -> None:
    threads = [threading.Thread(target=connect_and_reset, args=(port, RESETS // THREADS)) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def served(server: ServerThread) -> None:
    """A well-behaved client on a new connection is answered."""
    client = server.connect()
    assert client.call(1, "/test.Echo/Unary", request("after")).replies()[0].id == "after"


def test_connect_and_reset_flood_leaves_the_grpc_server_serving(make_server):
    server = make_server()
    reset_flood(server.port)
    served(server)
    assert server._thread.is_alive() and server._error is None


class AdminThread(TrioServerThread):
    """serve_admin with one route that works and one that raises, from trio.run in a thread."""

    def __init__(self) -> None:
        super().__init__()

    async def _serve(self, nursery: trio.Nursery) -> int:
        def broken():
            raise KeyError("a bug in a route")
        routes = {"/healthz": lambda: (200, "text/plain", b"ok\n"), "/broken": broken}
        return await nursery.start(serve_admin, "127.0.0.1", 0, routes)

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def stop(self) -> None:
        trio.from_thread.run_sync(self._nursery.cancel_scope.cancel, trio_token=self.token)
        self._thread.join(5)
        assert not self._thread.is_alive()


@pytest.fixture
def admin():
    thread = AdminThread()
    yield thread
    thread.stop()
    assert thread._error is None


def test_connect_and_reset_flood_leaves_the_admin_port_serving(admin):
    reset_flood(admin.port)
    assert admin.get("/healthz") == (200, b"ok\n")
    assert admin._thread.is_alive()


def test_admin_route_that_raises_is_answered_500_and_the_port_goes_on(admin, caplog):
    with caplog.at_level(logging.ERROR, logger="xlaserve.admin"):
        status, body = admin.get("/broken")
    assert status == 500 and b"KeyError" in body
    assert any("the admin route /broken failed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert admin.get("/healthz") == (200, b"ok\n")


def test_admin_peer_that_sends_garbage_and_resets_costs_its_connection_only(admin):
    for payload in (b"\xff\xfe\x00garbage\r\n\r\n", b"GET /healthz HTTP/1.1\r\n", b"x" * 20000):
        s = socket.create_connection(("127.0.0.1", admin.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.sendall(payload)
        s.close()
    assert admin.get("/healthz") == (200, b"ok\n")


# --- deterministic faults in set-up -----------------------------------------------------------

class FaultyListener:
    """Wraps a real listener: its first accepts yield the faults queued in ``faults`` (an
    exception to raise, or a stream to hand over), then it accepts for real."""

    def __init__(self, real: trio.SocketListener, faults: list) -> None:
        self.real = real
        self.socket = real.socket
        self.faults = faults
        self.accepted_faults = 0

    async def accept(self):
        if self.faults:
            fault = self.faults.pop(0)
            self.accepted_faults += 1
            if isinstance(fault, BaseException):
                raise fault
            return fault
        return await self.real.accept()

    async def aclose(self) -> None:
        await self.real.aclose()


class FaultyServer(ServerThread):
    def __init__(self, faults_factory) -> None:
        self.faults_factory = faults_factory
        super().__init__()

    async def _serve(self, nursery: trio.Nursery) -> int:
        real = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        self.listener = FaultyListener(real, self.faults_factory())
        return await nursery.start(lambda task_status: self.server.serve(listeners=[self.listener],
                                                                        task_status=task_status))


@pytest.fixture
def faulty():
    servers: list[FaultyServer] = []

    def start(faults_factory) -> FaultyServer:
        servers.append(FaultyServer(faults_factory))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_a_connection_whose_peer_address_is_gone_is_contained(faulty, caplog):
    """A socket that is not connected (as one reset in the accept queue is by the time it is
    served): getpeername raises ENOTCONN in Connection's set-up."""
    def faults():
        return [trio.SocketStream(trio.socket.socket()) for _ in range(3)]
    with caplog.at_level(logging.INFO, logger="xlaserve.grpc"):
        server = faulty(faults)
        served(server)
    assert server.listener.accepted_faults == 3
    lines = [r.getMessage() for r in caplog.records if "gRPC connection ended" in r.getMessage()]
    assert lines and "ENOTCONN" in lines[0], lines
    assert len(lines) == 1, lines           # three faults within a second: one line
    assert server._error is None


def test_accept_out_of_descriptors_backs_off_and_goes_on(faulty, caplog):
    def faults():
        return [OSError(errno.EMFILE, "Too many open files") for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="xlaserve.grpc"):
        server = faulty(faults)
        served(server)          # after 0.1 + 0.2 + 0.4 s of back-off
    assert server.listener.accepted_faults == 3
    lines = [r.getMessage() for r in caplog.records if "cannot accept" in r.getMessage()]
    assert len(lines) == 1 and "EMFILE" in lines[0] and "retrying in 0.1 s" in lines[0], lines
    assert server._error is None


def test_an_unexpected_accept_error_is_retried_not_fatal(faulty, caplog):
    def faults():
        return [OSError(errno.EPERM, "blocked"), RuntimeError("a listener bug")]
    with caplog.at_level(logging.WARNING, logger="xlaserve.grpc"):
        server = faulty(faults)
        served(server)
    assert server.listener.accepted_faults == 2
    assert server._error is None


def test_a_bug_in_a_connection_is_logged_once_with_its_traceback(make_server, caplog, monkeypatch):
    """An exception no peer should be able to cause (a bug in the reader) closes that
    connection only: its traceback is logged the first time, later ones are one line."""
    import xlaserve.frontend.grpc_server as grpc_server_module

    server = make_server()
    original = grpc_server_module.Connection._on_settings

    def broken(self, flags, sid, payload):
        if payload == b"\x00\x63\x00\x00\x00\x01":     # an unknown setting 0x63 marks the victims
            raise ZeroDivisionError("a bug")
        return original(self, flags, sid, payload)
    monkeypatch.setattr(grpc_server_module.Connection, "_on_settings", broken)
    with caplog.at_level(logging.ERROR, logger="xlaserve.grpc"):
        for _ in range(3):
            victim = server.connect({0x63: 1})
            victim.expect_eof()
        served(server)
    failures = [r for r in caplog.records if "gRPC connection failed" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert "ZeroDivisionError" in failures[0].getMessage()


def test_line_limiter_counts_what_it_left_out():
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
    logger = logging.getLogger("tests.limiter")
    logger.addHandler(Collect())
    logger.setLevel(logging.INFO)
    limiter = LineLimiter(logger)

    async def main():
        for _ in range(5):
            limiter.line(logging.INFO, "fault %d", 1)
        await trio.sleep(1.0)
        limiter.line(logging.INFO, "fault %d", 2)
    trio.run(main, clock=MockClock(autojump_threshold=0))
    assert records == ["fault 1", "fault 2 (4 more such lines left out since the last)"]
