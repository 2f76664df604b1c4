"""Faults of one connection stay inside that connection's guard (issue 24, part 1).

The rule: a root nursery is cancelled only by a stop signal. Whatever happens while one connection
is accepted, set up or served (a reset in the accept queue, a peer address that is gone, an
``accept`` that runs out of descriptors, a bug) closes that connection, logs one line (at most one
a second), and the server goes on serving the others. Each case here starts the real server on
loopback, injects the fault, and then has a well-behaved client served on another connection.
"""
from __future__ import annotations

import errno
import os
import logging
import socket
import struct
import threading
import time
import urllib.request
from functools import partial

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

    def __init__(self, max_connections: int = 3) -> None:
        self.max_connections = max_connections
        super().__init__()

    async def _serve(self, nursery: trio.Nursery) -> int:
        def broken():
            raise KeyError("a bug in a route")
        routes = {"/healthz": lambda: (200, "text/plain", b"ok\n"), "/broken": broken}
        return await nursery.start(partial(serve_admin, "127.0.0.1", 0, routes, max_connections=self.max_connections))

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


def test_admin_connections_held_open_past_the_limit_close_the_oldest_and_probes_are_answered(admin):
    """A client holding max_connections open (idle, or trickling a head) kept every probe out
    for good: each new connection was answered 503 while the held ones, reopened every 10 s,
    kept their slots, and a liveness probe that fails restarts the process. Now the oldest is
    closed for the new one, and the server never holds more than the limit."""
    held = [socket.create_connection(("127.0.0.1", admin.port)) for _ in range(admin.max_connections)]
    for s in held:
        s.sendall(b"GET /healthz HTTP/1.1\r\n")     # an unfinished head: each holds its slot
    for round_ in range(2 * admin.max_connections):
        assert admin.get("/healthz") == (200, b"ok\n"), round_
    closed = []
    for s in held:      # the first probe made room by closing the oldest, unanswered; the others fit
        s.settimeout(0.5)
        try:
            closed.append(s.recv(100) == b"")
        except ConnectionResetError:
            closed.append(True)
        except TimeoutError:
            closed.append(False)
        s.close()
    assert closed == [True] + [False] * (admin.max_connections - 1)


def test_admin_route_that_raises_is_answered_500_and_the_port_goes_on(admin, caplog):
    with caplog.at_level(logging.ERROR, logger="xlaserve.admin"):
        status, body = admin.get("/broken")
    assert status == 500 and b"KeyError" in body
    assert any("the admin route /broken failed" in r.getMessage() and r.exc_info for r in caplog.records)
    assert admin.get("/healthz") == (200, b"ok\n")


def test_admin_takes_bare_lf_lines_and_a_proxys_absolute_form_target(admin):
    """A head whose lines end in a bare LF was never seen to end (no answer; closed after 10 s),
    and ``GET http://host/healthz`` (a proxy's absolute form) was 404."""
    for request in (b"GET /healthz HTTP/1.1\nHost: x\n\n", b"GET http://x:1/healthz?probe HTTP/1.1\r\nHost: x\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", admin.port), timeout=5) as s:
            s.sendall(request)
            reply = b""
            while chunk := s.recv(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and reply.endswith(b"\r\n\r\nok\n"), reply


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
    from xlaserve.http2.connection import H2Connection

    server = make_server()
    original = H2Connection._on_settings

    def broken(self, flags, sid, payload):
        if payload == b"\x00\x63\x00\x00\x00\x01":     # an unknown setting 0x63 marks the victims
            raise ZeroDivisionError("a bug")
        return original(self, flags, sid, payload)
    monkeypatch.setattr(H2Connection, "_on_settings", broken)
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


# --- what an idle connection costs ----------------------------------------------------------------

IDLE_SERVER = r'''
import sys, trio
sys.path.insert(0, ".")
from xlaserve.frontend.grpc_server import GrpcServer
from tests.test_grpc_server import EchoService
async def main():
    server = GrpcServer([EchoService()])
    async with trio.open_nursery() as n:
        print(await n.start(server.serve, "127.0.0.1", 0), flush=True)
        await trio.sleep_forever()
trio.run(main)
'''
SETTINGS_FRAME = bytes.fromhex("000000040000000000")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def idle_connections(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that send the preface and SETTINGS and then nothing; returned once
    the server has answered each (so each has been set up)."""
    from xlaserve.http2.frames import PREFACE
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(PREFACE + SETTINGS_FRAME)
        socks.append(s)
    for s in socks:
        assert len(s.recv(65536)) >= 9
    return socks


def test_an_idle_connection_costs_at_most_32_kb():
    """600 connections that send the preface and stop, against a server in its own process: the
    growth of its RSS over them, per connection. (The issue's figure is for 1,000; 600 keeps the
    test quick and under the default max_connections with the 50 that warm the server up.) Before
    issue 24 each held a 64 KiB read buffer: 78.9 KiB each; now its first page (about 21 KiB)."""
    from tests.conftest import ROOT
    import subprocess
    import sys
    server = subprocess.Popen([sys.executable, "-c", IDLE_SERVER], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        warm = idle_connections(port, 50)       # allocator arenas, code paths taken once
        before = rss_bytes(server.pid)
        socks = idle_connections(port, 600)
        per_connection = (rss_bytes(server.pid) - before) / 600
        assert per_connection <= 32_000, f"{per_connection / 1024:.1f} KiB per idle connection"
        for s in warm + socks:
            s.close()
    finally:
        server.kill()
        server.wait()
        server.stdout.close()


def test_release_pages_gives_a_read_buffers_pages_back_and_keeps_its_unread_bytes():
    from xlaserve.frontend.grpc_server import _read_buffer, release_pages
    buffer = _read_buffer(64 << 20)
    before = rss_bytes(os.getpid())
    buffer[:] = b"\xab" * len(buffer)
    touched = rss_bytes(os.getpid())
    assert touched - before > 60 << 20
    release_pages(buffer, 10_000)
    assert touched - rss_bytes(os.getpid()) > 60 << 20
    assert buffer[:10_000] == b"\xab" * 10_000                 # the unread bytes stay
    assert buffer[16384:16400] == bytes(16)                    # the rest reads as zeros


def test_a_quiet_connection_gives_its_read_buffer_back():
    """A connection sends a 1 MiB frame of an unknown type (read, then ignored): its buffer grew
    and holds those bytes. Once it has been quiet for READ_BUFFER_RELEASE_SECONDS (mock clock)
    the pages past its unread bytes are given back: they read as zeros."""
    from tests.test_h2_limits import connect, on_mock_clock
    from xlaserve.http2.frames import PING, frame
    from xlaserve.frontend.grpc_server import READ_BUFFER_LOOK_SECONDS, READ_BUFFER_RELEASE_SECONDS

    async def body(port, server):
        raw = await connect(port)
        await raw.send(frame(0x42, 0, 0, b"\xab" * (1 << 20)) + frame(PING, 0, 0, b"12345678"))
        await raw.until(PING, 1)
        (conn,) = server._connections
        buffer = conn.read_buffer
        # grown to take the frame, so the frame's bytes were read into it (the mock clock may
        # already have jumped past the quiet time while the client waited for the ack)
        assert len(buffer) > 1 << 20
        await trio.sleep(READ_BUFFER_RELEASE_SECONDS + READ_BUFFER_LOOK_SECONDS)
        nonzero = [i for i in range(0, len(buffer), 4096) if any(buffer[i:i + 4096])]
        assert conn.read_end == 0 and not nonzero, (nonzero[:5], len(nonzero), conn.reads)
    on_mock_clock(body)
