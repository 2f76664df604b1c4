"""The HTTP/2 limits of one client connection (issue 14 part 2; ``H2Limits``, the node file's
``endpoints:`` keys of the same names).

Limits that are counts are driven with hand-built frames against a GrpcServer in a background
thread (the harness of tests/test_grpc_server.py). Limits that are times run the server and a raw
client in one ``trio.run`` under ``MockClock(autojump_threshold=0)``: the clock jumps whenever both
wait, so a 300 s idle timeout takes no real time and every timing is exact to the check.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading

import hpack
import pytest
import trio
from grpclib.const import Cardinality, Handler
from trio.testing import MockClock

from tests.test_grpc_server import (
    TIMEOUT, EchoService, FrameClient, GoAway, Reply, Request, ServerThread, grpc_body, request,
    request_headers, settings_payload,
)
from xlaserve.http2.frames import (
    ACK, CONTINUATION, DATA, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, GOAWAY, HEADERS, INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS, MAX_HEADER_LIST_SIZE, NO_ERROR, PING, PREFACE, PROTOCOL_ERROR, REFUSED_STREAM,
    RST_STREAM, SETTINGS, WINDOW_UPDATE, H2Limits, frame,
)
from xlaserve.http2.connection import KEEPALIVE_PING
from xlaserve.frontend.grpc_server import GrpcServer

CANCEL = struct.pack(">I", 0x8)


class ParkService:
    """``/test.Park/Hold``: a task-free call that hands its work on (sets ``on_cancel``, as
    ModelInfer does) and is completed by the test; ``cancelled`` counts on_cancel calls."""

    def __init__(self) -> None:
        self.held: dict[str, object] = {}
        self.arrived = threading.Event()
        self.cancelled = 0

    def __mapping__(self) -> dict[str, Handler]:
        async def never(stream) -> None:
            raise AssertionError("a fast method ran as a task")
        return {"/test.Park/Hold": Handler(never, Cardinality.UNARY_UNARY, Request, Reply)}

    def __fast_unary__(self) -> dict:
        return {"/test.Park/Hold": self.hold}

    def hold(self, call, req: Request) -> None:
        def cancel() -> None:
            self.cancelled += 1
        call.on_cancel = cancel
        self.held[req.id] = call
        self.arrived.set()


class LimitedServer(ServerThread):
    def __init__(self, **limits) -> None:
        self.park = ParkService()
        super().__init__(limits=H2Limits(**limits))

    async def _main(self) -> None:
        self.server.methods.update(self.park.__mapping__())
        self.server.fast.update(self.park.__fast_unary__())
        await super()._main()


@pytest.fixture
def limited():
    servers: list[LimitedServer] = []

    def start(**limits) -> LimitedServer:
        servers.append(LimitedServer(**limits))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def calm(client: FrameClient, key: str) -> GoAway:
    """The GOAWAY ending ``client``'s connection: ENHANCE_YOUR_CALM naming ``key``; then EOF."""
    f = client.until(lambda f: f.type == GOAWAY)
    last, code = struct.unpack_from(">II", f.payload)
    goaway = GoAway(last & 0x7FFFFFFF, code, f.payload[8:])
    assert goaway.code == ENHANCE_YOUR_CALM, goaway
    assert f"endpoints.{key}".encode() in goaway.debug, goaway.debug
    client.expect_eof()
    return goaway


def still_serves(server: ServerThread) -> None:
    other = server.connect()
    assert other.call(1, "/test.Echo/Unary", request("fine")).replies()[0].id == "fine"


def advertised(client: FrameClient) -> dict[int, int]:
    f = client.until(lambda f: f.type == SETTINGS and not f.flags & ACK)
    return {key: value for key, value in struct.iter_unpack(">HI", f.payload)}


# --- header blocks ------------------------------------------------------------------------------

def test_header_fields_past_max_header_fields(limited):
    """A block of more fields than max_header_fields (the issue's attack: ~1,900 small fields per
    block, under the 64 KiB list limit, cost 13.7 s of CPU for 10 x 512 blocks) is refused at the
    field past the limit; a request at the limit is served."""
    server = limited(max_header_fields=40)
    client = server.connect()
    base = request_headers("/test.Echo/Unary")
    at_limit = base + [(f"x-m{i}", "v") for i in range(40 - len(base))]
    assert client.call(1, "/test.Echo/Unary", request("forty"), extra=tuple(at_limit[len(base):])).replies()[0].id \
        == "forty"
    many = [(f"x-m{i}", "v") for i in range(1900)]
    client.send(frame(HEADERS, END_HEADERS, 3, hpack.Encoder().encode(base + many, huffman=False)))
    goaway = calm(client, "max_header_fields")
    assert b"more than 40 header fields" in goaway.debug
    still_serves(server)


def test_max_header_fields_defaults_to_envoys_hundred(limited):
    server = limited()
    client = server.connect()
    base = request_headers("/test.Echo/Unary")
    client.send(frame(HEADERS, END_HEADERS, 1, hpack.Encoder().encode(
        base + [(f"x-m{i}", "v") for i in range(101 - len(base))], huffman=False)))
    calm(client, "max_header_fields")


def test_header_block_past_max_header_block_bytes_closes_before_decoding(limited):
    server = limited(max_header_block_bytes=4096)
    client = server.connect()
    block = hpack.Encoder().encode(request_headers("/test.Echo/Unary", extra=(("x-big", "v" * 5000),)),
                                   huffman=False)
    client.send(frame(HEADERS, END_HEADERS, 1, block))
    assert b"a header block of more than 4096 bytes" in calm(client, "max_header_block_bytes").debug
    still_serves(server)


def test_header_block_grown_by_continuation_past_the_limit(limited):
    server = limited(max_header_block_bytes=4096)
    client = server.connect()
    block = hpack.Encoder().encode(request_headers("/test.Echo/Unary"))
    client.send(frame(HEADERS, 0, 1, block), frame(CONTINUATION, 0, 1, b"\x00" * 3000),
                frame(CONTINUATION, 0, 1, b"\x00" * 3000))
    calm(client, "max_header_block_bytes")


def test_continuation_frames_past_max_continuation_frames(limited):
    server = limited(max_continuation_frames=3)
    client = server.connect()
    block = hpack.Encoder().encode(request_headers("/test.Echo/Unary"))
    # three CONTINUATIONs carrying the block in pieces are fine...
    pieces = [block[:4], block[4:8], block[8:12], block[12:]]
    client.send(frame(HEADERS, 0, 1, pieces[0]), frame(CONTINUATION, 0, 1, pieces[1]),
                frame(CONTINUATION, 0, 1, pieces[2]), frame(CONTINUATION, END_HEADERS, 1, pieces[3]),
                frame(DATA, END_STREAM, 1, grpc_body(request("pieces"))))
    assert client.response(1).replies()[0].id == "pieces"
    # ...a fourth is not
    client.send(frame(HEADERS, 0, 3, pieces[0]), *(frame(CONTINUATION, 0, 3, b"") for _ in range(4)))
    assert b"more than 3 CONTINUATION frames" in calm(client, "max_continuation_frames").debug
    still_serves(server)


def test_decoded_header_list_past_max_header_list_bytes(limited):
    server = limited(max_header_list_bytes=1024)
    client = server.connect()
    assert advertised(client)[MAX_HEADER_LIST_SIZE] == 1024
    # Huffman-coded: the block is under 1 KiB, the list it decodes to is not
    block = hpack.Encoder().encode(request_headers("/test.Echo/Unary", extra=(("x-huff", "a" * 1400),)),
                                   huffman=True)
    assert len(block) < 1024
    client.send(frame(HEADERS, END_HEADERS, 1, block))
    assert b"decodes to more than 1024 bytes" in calm(client, "max_header_list_bytes").debug


# --- SETTINGS, control replies ------------------------------------------------------------------

def test_settings_frame_with_too_many_entries(limited):
    server = limited(max_settings_entries=8)
    client = server.connect()
    client.send(frame(SETTINGS, 0, 0, settings_payload({INITIAL_WINDOW_SIZE: 70000}) * 8))
    client.until(lambda f: f.type == SETTINGS and f.flags & ACK)
    client.ping_barrier()
    client.send(frame(SETTINGS, 0, 0, settings_payload({INITIAL_WINDOW_SIZE: 70000}) * 9))
    assert b"a SETTINGS frame of 9 entries" in calm(client, "max_settings_entries").debug


def test_first_frame_must_be_settings(limited):
    server = limited()
    client = server.connect(preface=False)
    client.send(PREFACE + frame(PING, 0, 0, b"early!!!"))
    goaway = client.goaway()
    assert goaway.code == PROTOCOL_ERROR and b"must be SETTINGS" in goaway.debug


def test_control_replies_queued_past_the_limit(limited):
    server = limited(max_queued_control_frames=50)
    client = server.connect()
    client.ping_barrier()
    # a client that reads may ping as it likes: each read of the server's takes fewer than 50
    for i in range(120):
        client.ping_barrier(b"%08d" % i)
    # 60 PINGs in one write are read at once: 60 acknowledgements owed before any is sent
    client.send(frame(PING, 0, 0, b"flood!!!") * 60)
    assert b"more than 50 control frames" in calm(client, "max_queued_control_frames").debug
    still_serves(server)


# --- streams: the glitch bucket, concurrency ----------------------------------------------------

def test_resets_past_the_glitch_burst_close_the_connection(limited, caplog):
    server = limited(glitch_burst=10, glitches_per_second=0.0)
    client = server.connect()
    with caplog.at_level(logging.INFO, logger="xlaserve.grpc"):
        for i in range(10):
            sid = 2 * i + 1
            client.start_call(sid, "/test.Echo/Slow", grpc_body(request(f"r{i}")))
            client.send(frame(RST_STREAM, 0, sid, CANCEL))
        client.ping_barrier()       # ten resets: still served
        client.start_call(21, "/test.Echo/Slow", grpc_body(request("r10")))
        client.send(frame(RST_STREAM, 0, 21, CANCEL))
        debug = calm(client, "glitch_burst").debug
    assert b"too many stream resets" in debug and b"RST_STREAM on stream 21" in debug
    assert any("closing the gRPC connection from 127.0.0.1:" in r.getMessage() and "ENHANCE_YOUR_CALM" in
               r.getMessage() for r in caplog.records)
    still_serves(server)


def test_the_glitch_bucket_refills(limited):
    server = limited(glitch_burst=2, glitches_per_second=1000.0)
    client = server.connect()
    for i in range(20):         # far more than the burst, but each after a round trip
        sid = 2 * i + 1
        client.start_call(sid, "/test.Echo/Slow", grpc_body(request(f"r{i}")))
        client.send(frame(RST_STREAM, 0, sid, CANCEL))
        client.ping_barrier(b"%08d" % i)
        threading.Event().wait(0.003)
    assert client.call(41, "/test.Echo/Unary", request("after")).replies()[0].id == "after"


def test_replies_waiting_for_window_past_the_limit_refuse_new_streams(limited):
    server = limited(max_queued_reply_bytes=256 * 1024)
    client = server.connect({INITIAL_WINDOW_SIZE: 0})
    client.ping_barrier()
    for i in range(2):      # 2 x 128 KiB of replies the client grants no window for: past 256 KiB
        client.start_call(2 * i + 1, "/test.Echo/Unary", grpc_body(request(str(i), reply_bytes=128 * 1024)))
        client.ping_barrier(b"%08d" % i)
    client.start_call(5, "/test.Echo/Unary", grpc_body(request("refused")))
    assert client.response(5).reset == REFUSED_STREAM
    # the client grants window: the replies go out, and new streams are taken again
    client.send(frame(SETTINGS, 0, 0, settings_payload({INITIAL_WINDOW_SIZE: 1 << 20})),
                frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1 << 20)))
    for i in range(2):
        assert client.response(2 * i + 1).replies()[0].id == str(i)
    assert client.call(7, "/test.Echo/Unary", request("taken")).replies()[0].id == "taken"


def test_streams_past_max_concurrent_streams_are_refused(limited):
    server = limited(max_concurrent_streams=2)
    client = server.connect()
    assert advertised(client)[MAX_CONCURRENT_STREAMS] == 2
    client.start_call(1, "/test.Echo/Slow", grpc_body(request("a")))
    client.start_call(3, "/test.Echo/Slow", grpc_body(request("b")))
    client.start_call(5, "/test.Echo/Unary", grpc_body(request("c")))
    assert client.response(5).reset == REFUSED_STREAM
    server.release_slow_calls()
    assert client.response(1).replies()[0].id == "a"
    assert client.response(3).replies()[0].id == "b"
    assert client.call(7, "/test.Echo/Unary", request("d")).replies()[0].id == "d"


def test_a_reset_call_counts_until_its_work_is_over(limited):
    server = limited(max_concurrent_streams=1)
    client = server.connect()
    client.start_call(1, "/test.Park/Hold", grpc_body(request("held")))
    assert server.park.arrived.wait(TIMEOUT)
    client.send(frame(RST_STREAM, 0, 1, CANCEL))
    client.ping_barrier()
    assert server.park.cancelled == 1
    # its request is still queued or running somewhere: the slot is not free
    client.start_call(3, "/test.Echo/Unary", grpc_body(request("x")))
    assert client.response(3).reset == REFUSED_STREAM
    # the work ends (its reply is dropped): the slot is free again
    server.call(server.park.held["held"].complete, Reply(id="dropped"))
    assert client.call(5, "/test.Echo/Unary", request("y")).replies()[0].id == "y"
    assert [f for f in client.log if f.stream == 1] == []


# --- timeouts, on a mock clock --------------------------------------------------------------------

class Raw:
    """A raw client on a Trio stream: frames out, frames in (type, flags, stream, payload)."""

    opened: list["Raw"] = []        # closed by on_mock_clock when the test body ends

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()
        Raw.opened.append(self)

    async def send(self, *data: bytes) -> None:
        await self.stream.send_all(b"".join(data))

    async def frame(self) -> tuple[int, int, int, bytes] | None:
        while len(self.buf) < 9 or len(self.buf) < 9 + int.from_bytes(self.buf[:3], "big"):
            try:
                chunk = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                chunk = b""
            if not chunk:
                return None
            self.buf += chunk
        length = int.from_bytes(self.buf[:3], "big")
        ftype, flags, sid = struct.unpack_from(">BBI", self.buf, 3)
        payload = bytes(self.buf[9:9 + length])
        del self.buf[:9 + length]
        return ftype, flags, sid, payload

    async def until(self, ftype: int, flags: int = 0) -> tuple[int, int, int, bytes] | None:
        while (f := await self.frame()) is not None:
            if f[0] == ftype and f[1] & flags == flags:
                return f
        return None


def on_mock_clock(body, **limits) -> None:
    """Run ``body(port)`` (or ``body(port, server)``) against a GrpcServer serving the echo
    service, on a mock clock."""
    async def main() -> None:
        server = GrpcServer([EchoService()], limits=H2Limits(**limits))
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            try:
                with trio.fail_after(10_000):
                    await (body(port, server) if body.__code__.co_argcount == 2 else body(port))
            finally:
                for raw in Raw.opened:
                    await raw.stream.aclose()
                Raw.opened.clear()
            nursery.cancel_scope.cancel()
    trio.run(main, clock=MockClock(autojump_threshold=0))


async def connect(port: int, *, preface: bool = True) -> Raw:
    raw = Raw(await trio.open_tcp_stream("127.0.0.1", port))
    if preface:
        await raw.send(PREFACE + frame(SETTINGS, 0, 0))
    return raw


def goaway_of(f) -> tuple[int, bytes]:
    assert f is not None and f[0] == GOAWAY, f
    return struct.unpack_from(">I", f[3], 4)[0], f[3][8:]


@pytest.mark.parametrize("sent", [b"", PREFACE, PREFACE[:10]])
def test_handshake_timeout(sent):
    async def body(port):
        raw = await connect(port, preface=False)
        await raw.send(sent)
        start = trio.current_time()
        code, debug = goaway_of(await raw.until(GOAWAY))
        assert code == ENHANCE_YOUR_CALM and b"endpoints.handshake_timeout_seconds" in debug
        assert trio.current_time() - start == pytest.approx(7.0)
        assert await raw.frame() is None
    on_mock_clock(body, handshake_timeout_seconds=7.0)


def test_handshake_in_time_is_not_cut_off():
    async def body(port):
        raw = await connect(port)
        await trio.sleep(4.0)
        await raw.send(frame(PING, 0, 0, b"stillhere"[:8]))
        assert (await raw.until(PING, ACK))[3] == b"stillher"
        await trio.sleep(100.0)     # long past the handshake timeout: answering keep-alive PINGs
    on_mock_clock(body, handshake_timeout_seconds=5.0, keepalive_interval_seconds=0, idle_timeout_seconds=0)


def test_keepalive_ping_then_timeout():
    async def body(port):
        raw = await connect(port)
        start = trio.current_time()
        ping = await raw.until(PING)
        assert ping[1] == 0 and ping[3] == KEEPALIVE_PING
        assert trio.current_time() - start == pytest.approx(60.0)
        code, debug = goaway_of(await raw.until(GOAWAY))     # never answered
        assert code == ENHANCE_YOUR_CALM and b"endpoints.keepalive_timeout_seconds" in debug
        assert trio.current_time() - start == pytest.approx(80.0)
    on_mock_clock(body, keepalive_interval_seconds=60.0, keepalive_timeout_seconds=20.0, idle_timeout_seconds=0)


def test_answered_keepalive_keeps_the_connection():
    async def body(port):
        raw = await connect(port)
        start = trio.current_time()
        for _ in range(5):
            ping = await raw.until(PING)
            await raw.send(frame(PING, ACK, 0, ping[3]))
        assert trio.current_time() - start == pytest.approx(5 * 60.0, abs=1.0)
    on_mock_clock(body, keepalive_interval_seconds=60.0, keepalive_timeout_seconds=20.0, idle_timeout_seconds=0)


def test_idle_timeout_goaway_no_error_but_not_while_a_call_is_open():
    async def body(port):
        raw = await connect(port)
        block = hpack.Encoder().encode(request_headers("/test.Echo/Unary"))
        await raw.send(frame(HEADERS, END_HEADERS, 1, block),
                       frame(DATA, END_STREAM, 1, grpc_body(request("one"))))
        await raw.until(HEADERS, END_STREAM)
        answered = trio.current_time()
        f = await raw.until(GOAWAY)
        assert goaway_of(f) == (NO_ERROR, b"")
        idle = trio.current_time() - answered
        assert 100.0 <= idle <= 100.0 + 30.0        # looked at about every write_timeout / 2
        assert await raw.frame() is None
    on_mock_clock(body, idle_timeout_seconds=100.0, keepalive_interval_seconds=0)


async def wide_open(port: int) -> Raw:
    """A client with a small socket receive buffer that grants the server all the window there is."""
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    await sock.connect(("127.0.0.1", port))
    raw = Raw(trio.SocketStream(sock))
    await raw.send(PREFACE + frame(SETTINGS, 0, 0, settings_payload({INITIAL_WINDOW_SIZE: 2**31 - 1})),
                   frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 2**31 - 1 - 65535)))
    return raw


def echo_call(sid: int, req: Request) -> bytes:
    block = hpack.Encoder().encode(request_headers("/test.Echo/Unary"))
    return frame(HEADERS, END_HEADERS, sid, block) + frame(DATA, END_STREAM, sid, grpc_body(req))


def test_write_timeout_closes_a_client_that_stopped_reading():
    async def body(port):
        raw = await wide_open(port)
        await raw.send(echo_call(1, request("big", reply_bytes=32 << 20)))
        await trio.sleep(200.0)         # not reading: the server's write makes no progress
        received = 0
        while (chunk := await raw.stream.receive_some(1 << 20)):
            received += len(chunk)
        assert received < 32 << 20      # it gave up before the reply was out
    on_mock_clock(body, write_timeout_seconds=60.0, keepalive_interval_seconds=0, idle_timeout_seconds=0)


def test_a_client_that_does_not_read_is_not_read_either():
    limit = 256 * 1024

    async def body(port, server):
        raw = await wide_open(port)
        # 64 requests, one at a time, for 128 KiB replies each: 8 MiB owed, never read
        for i in range(64):
            await raw.send(echo_call(2 * i + 1, request(str(i), reply_bytes=128 * 1024)))
            await trio.sleep(0.01)      # the server has done all it will with it
        (conn,) = server._connections
        assert conn.writable is not None, "the server kept reading a client that reads nothing"
        queued = len(conn.out) + conn.in_flight
        assert queued <= 2 * (limit + 140 * 1024), queued
        assert len(conn.calls) < 64             # the later requests were never read
        # once the client reads, everything it asked for arrives
        answered = set()
        while len(answered) < 64:
            f = await raw.frame()
            assert f is not None
            if f[0] == HEADERS and f[1] & END_STREAM:
                answered.add(f[2])
        assert answered == {2 * i + 1 for i in range(64)}
    on_mock_clock(body, max_queued_reply_bytes=limit, write_timeout_seconds=10_000, keepalive_interval_seconds=0,
                  idle_timeout_seconds=0)


# --- the bound on undecoded request bytes over all connections ----------------------------------

def test_past_max_undecoded_request_bytes_the_largest_holder_is_paused_the_others_served_then_resumed():
    """endpoints.max_undecoded_request_bytes 1,000,000 (server-wide; max_recv 300,000). ``big``
    holds 500 KB of two unfinished messages, ``mid`` 250 KB, ``small`` 60 KB. ``big`` starts a
    third: 700 KB of the 1.01 MB now held are its, past its equal share (333 KB): it is paused,
    not torn down. ``small`` and ``mid`` (under their share) finish their messages and are
    answered while ``big`` waits; once the total has fallen, ``big`` is read again (its PING,
    sent while paused, is answered) and is served."""
    async def main() -> None:
        server = GrpcServer([EchoService()], max_recv_bytes=300_000, max_undecoded_bytes=1_000_000)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            try:
                with trio.fail_after(600):
                    await _undecoded_bound(server, port)
            finally:
                for raw in Raw.opened:
                    await raw.stream.aclose()
                Raw.opened.clear()
            nursery.cancel_scope.cancel()
    trio.run(main, clock=MockClock(autojump_threshold=0))


async def _undecoded_bound(server: GrpcServer, port: int) -> None:
    def body(name: str, size: int) -> bytes:
        return grpc_body(request(name, payload=b"p" * size))

    async def until(condition) -> None:
        while not condition():
            await trio.sleep(0.001)

    def connection_of(raw: Raw):
        local = raw.stream.socket.getsockname()
        (conn,) = [c for c in server._connections if c.sock.socket.getpeername() == local]
        return conn

    async def open_call(raw: Raw, encoder, sid: int, data: bytes, end: bool = False) -> None:
        block = encoder.encode(request_headers("/test.Echo/Unary"))
        await raw.send(frame(HEADERS, END_HEADERS, sid, block) + frame(DATA, END_STREAM if end else 0, sid, data))

    big, mid, small = await connect(port), await connect(port), await connect(port)
    big_h, mid_h, small_h = hpack.Encoder(), hpack.Encoder(), hpack.Encoder()
    a1, a3, a5, m1, s1 = (body(n, size) for n, size in
                          (("a1", 280_000), ("a3", 280_000), ("a5", 280_000), ("m1", 280_000), ("s1", 100_000)))
    await open_call(big, big_h, 1, a1[:250_000])
    await open_call(big, big_h, 3, a3[:250_000])
    await open_call(mid, mid_h, 1, m1[:250_000])
    await open_call(small, small_h, 1, s1[:60_000])
    await until(lambda: sum(c.held_bound for c in server._connections) >= 810_000)
    assert not server.paused
    await open_call(big, big_h, 5, a5[:200_000])
    await until(lambda: server.paused)
    b, m, s = connection_of(big), connection_of(mid), connection_of(small)
    assert list(server.paused) == [b] and b.paused and not (m.paused or s.paused)
    assert server.reserved >= 1_000_000
    await big.send(frame(PING, 0, 0, b"paused!!"))
    # small, then mid, finish their messages while big is paused: both are served
    await small.send(frame(DATA, END_STREAM, 1, s1[60_000:]))
    assert (await small.until(DATA))[2] == 1              # a reply message: answered
    assert b.paused, "big holds the most and the total has not fallen enough"
    await mid.send(frame(DATA, END_STREAM, 1, m1[250_000:]))
    assert (await mid.until(DATA))[2] == 1
    # the total fell (only big's 700 KB are held): big is read again, its PING answered
    assert (await big.until(PING, ACK))[3] == b"paused!!"
    assert not b.paused and not server.paused and b in server._connections
    await big.send(frame(DATA, END_STREAM, 1, a1[250_000:]) + frame(DATA, END_STREAM, 3, a3[250_000:])
                   + frame(DATA, END_STREAM, 5, a5[200_000:]))
    assert sorted([(await big.until(DATA))[2] for _ in range(3)]) == [1, 3, 5]
    await until(lambda: sum(c.held_exact() for c in server._connections) == 0)
