"""The gateway's client of a worker (:class:`~xlaserve.gateway.upstream.Upstream`) against a
hostile worker (issue 28): a fake worker on loopback speaking raw HTTP/2 floods, sends frames past
what the gateway advertised, abuses the windows, sends bad SETTINGS, resets and goes away in the
middle of replies. Each case checks what could go wrong: the calls in flight get a clear error
naming what the worker did, the offending connection is closed (GOAWAY with the code RFC 9113
names), the gateway connects again and is served, another worker's connection is served meanwhile,
and what the gateway holds stays bounded however much the worker sends.

Timed cases run on Trio's autojump clock: a 60 s timeout passes at once, no test sleeps."""
from __future__ import annotations

import functools
import math
import struct
import tracemalloc
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest
import trio
import trio.testing
import tritonclient.grpc as grpcclient
from grpclib.const import Status
from tritonclient.utils import InferenceServerException

from tests.h2attacks import error_name, header_frames, settings_frame
from tests.test_gateway_e2e import GatewayThread
from tests.test_gateway_e2e import config as gateway_config
from tests.trio_thread import TrioServerThread
from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve._proto import xlaserve_control_pb2 as cpb
from xlaserve.frontend.grpc_protocol import RESPONSE_HEADERS, framed, trailers
from xlaserve.http2.frames import (
    ACK, CANCEL, CONTINUATION, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, INTERNAL_ERROR, PADDED, PING,
    PREFACE, RST_STREAM, SETTINGS, WINDOW_UPDATE, frame,
)
from xlaserve.http2.hpack import Decoder, encode
from xlaserve.gateway.run import Gateway, WorkerAddress
from xlaserve.gateway.upstream import Reply, Upstream, UpstreamError

PATH = "/test.Echo/Unary"
#: what the gateway may hold for one hostile connection, at most, while the worker sends many times that
HOLD_BOUND = 8 << 20


@contextmanager
def peak_below_hold_bound(measure: bool):
    """With ``measure``: what the process allocates at its peak while the block runs stays under
    HOLD_BOUND (asserted when the block ends); without, nothing is traced."""
    if not measure:
        yield
        return
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
        assert peak < HOLD_BOUND, f"{peak} bytes allocated at the peak"
    finally:
        tracemalloc.stop()


@dataclass
class Request:
    sid: int
    path: str
    body: bytes


@dataclass
class WorkerConn:
    """One connection from the gateway, as the fake worker sees it: it reads the gateway's frames
    (recording GOAWAY, RST_STREAM and WINDOW_UPDATE) and writes whatever a script tells it to."""

    stream: trio.SocketStream
    buffer: bytearray = field(default_factory=bytearray)
    goaway: tuple[int, int, str] | None = None          # last stream id, error code, debug data
    resets: dict[int, int] = field(default_factory=dict)    # stream id -> error code
    settings: dict[int, int] = field(default_factory=dict)  # what the gateway advertised
    eof: bool = False
    decoder: Decoder = field(default_factory=lambda: Decoder(max_header_list_size=1 << 20))
    _paths: dict[int, str] = field(default_factory=dict)
    _bodies: dict[int, bytearray] = field(default_factory=dict)
    _sending: trio.Lock = field(default_factory=trio.Lock)       # a script's tasks take turns to send

    async def read_frame(self) -> tuple[int, int, int, bytes] | None:
        """The gateway's next frame (type, flags, stream id, payload); None once it closed."""
        buffer = self.buffer
        while len(buffer) < 9 or len(buffer) < 9 + int.from_bytes(buffer[:3], "big"):
            try:
                chunk = await self.stream.receive_some(1 << 16)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                chunk = b""
            if not chunk:
                self.eof = True
                return None
            buffer += chunk
        length = int.from_bytes(buffer[:3], "big")
        ftype, flags, sid = buffer[3], buffer[4], int.from_bytes(buffer[5:9], "big") & 0x7FFFFFFF
        payload = bytes(buffer[9:9 + length])
        del buffer[:9 + length]
        if ftype == GOAWAY:
            last, code = struct.unpack_from(">II", payload)
            self.goaway = (last & 0x7FFFFFFF, code, payload[8:].decode(errors="replace"))
        elif ftype == RST_STREAM:
            self.resets[sid] = struct.unpack(">I", payload)[0]
        elif ftype == SETTINGS and not flags & ACK:
            self.settings.update(struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6))
        return ftype, flags, sid, payload

    async def handshake(self, *settings: tuple[int, int]) -> None:
        """Read the gateway's preface and SETTINGS, send ours (``settings``) and the acknowledgement."""
        while len(self.buffer) < len(PREFACE):
            chunk = await self.stream.receive_some(1 << 16)
            assert chunk, "the gateway closed before its preface"
            self.buffer += chunk
        assert self.buffer[:len(PREFACE)] == PREFACE
        del self.buffer[:len(PREFACE)]
        while (got := await self.read_frame()) is not None and not (got[0] == SETTINGS and not got[1] & ACK):
            pass
        await self.send(settings_frame(*settings) + frame(SETTINGS, ACK, 0))

    async def request(self) -> Request | None:
        """The gateway's next complete request (None once it closed)."""
        while (got := await self.read_frame()) is not None:
            ftype, flags, sid, payload = got
            if ftype == HEADERS:
                self._paths[sid] = dict(self.decoder.decode(payload))[":path"]
                self._bodies[sid] = bytearray()
            elif ftype == DATA and sid in self._bodies:
                self._bodies[sid] += payload
            if ftype in (HEADERS, DATA) and flags & END_STREAM and sid in self._paths:
                return Request(sid, self._paths.pop(sid), bytes(self._bodies.pop(sid)))
        return None

    async def send(self, data: bytes) -> None:
        async with self._sending:
            await self.stream.send_all(data)

    async def reply(self, sid: int, message: bytes, status: Status = Status.OK, text: str | None = None) -> None:
        await self.send(frame(HEADERS, END_HEADERS, sid, RESPONSE_HEADERS) + frame(DATA, 0, sid, framed(message))
                        + frame(HEADERS, END_HEADERS | END_STREAM, sid, trailers(status, text)))

    async def closed(self) -> tuple[int, int, str] | None:
        """Read until the gateway closes the connection; its GOAWAY (None if it sent none)."""
        while await self.read_frame() is not None:
            pass
        return self.goaway


async def well_behaved(conn: WorkerConn) -> None:
    """A worker that answers each request with ``echo:`` and the request's bytes."""
    await conn.handshake()
    await serve_echo(conn)


async def serve_echo(conn: WorkerConn) -> None:
    """Answer each request on ``conn`` with ``echo:`` and the request's bytes, until it closes."""
    while (req := await conn.request()) is not None:
        await conn.reply(req.sid, b"echo:" + req.body[5:])


@asynccontextmanager
async def fake_worker(*scripts):
    """A fake worker on loopback: its n-th connection runs ``scripts[n]`` (the last script runs the
    connections past them). Yields (port, the connections so far)."""
    conns: list[WorkerConn] = []

    async def handler(stream: trio.SocketStream) -> None:
        conn = WorkerConn(stream)
        conns.append(conn)
        try:
            await scripts[min(len(conns), len(scripts)) - 1](conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass                    # the gateway closed the connection: what the tests look at

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        yield listeners[0].socket.getsockname()[1], conns
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def upstream_to(*scripts, **options):
    """An :class:`Upstream` to a fake worker running ``scripts``, connected. Yields (upstream,
    the worker's connections)."""
    async with fake_worker(*scripts) as (port, conns), trio.open_nursery() as nursery:
        upstream = Upstream("w", "127.0.0.1", port, **options)
        nursery.start_soon(upstream.run)
        with trio.fail_after(30):
            await upstream.connected.wait()
        yield upstream, conns
        nursery.cancel_scope.cancel()


@dataclass
class Bystander:
    """Calls to another, well-behaved worker made while an attack runs: each must be answered."""

    answered: int = 0
    failed: list = field(default_factory=list)


@asynccontextmanager
async def bystander():
    """Another worker's upstream, called over and over while the block runs; checks at the end that
    it was served all along."""
    seen = Bystander()
    async with upstream_to(well_behaved) as (upstream, _), trio.open_nursery() as nursery:
        async def calls() -> None:
            while True:
                outcome = await upstream.request(PATH, b"still here")
                if isinstance(outcome, Reply) and outcome.messages() == [b"echo:still here"]:
                    seen.answered += 1
                else:
                    seen.failed.append(outcome)
                await trio.sleep(0.5)
        nursery.start_soon(calls)
        yield seen
        nursery.cancel_scope.cancel()
    assert not seen.failed and seen.answered >= 1, (seen.answered, seen.failed)


async def served_again(upstream: Upstream) -> None:
    """The upstream connects again and a call is answered (the fake worker's later connections
    behave)."""
    with trio.fail_after(60):
        while not upstream.up:
            await trio.sleep(0.01)
    outcome = await upstream.request(PATH, b"again")
    assert isinstance(outcome, Reply) and outcome.status == 0 and outcome.messages() == [b"echo:again"], outcome


def autojump(fn, *args) -> None:
    trio.run(fn, *args, clock=trio.testing.MockClock(autojump_threshold=0))


# ---- resets and GOAWAY in the middle of replies --------------------------------------------------
def test_rst_stream_mid_reply_fails_that_call_alone_and_the_connection_serves_the_next():
    autojump(_rst_mid_reply)


async def _rst_mid_reply() -> None:
    async def worker(conn: WorkerConn) -> None:
        await conn.handshake()
        while (req := await conn.request()) is not None:
            if req.body[5:] == b"reset me":
                await conn.send(frame(HEADERS, END_HEADERS, req.sid, RESPONSE_HEADERS)
                                + frame(DATA, 0, req.sid, framed(b"half a reply")[:8])
                                + frame(RST_STREAM, 0, req.sid, struct.pack(">I", INTERNAL_ERROR)))
            else:
                await conn.reply(req.sid, b"echo:" + req.body[5:])

    async with upstream_to(worker) as (upstream, conns):
        outcome = await upstream.request(PATH, b"reset me")
        assert isinstance(outcome, UpstreamError) and outcome.status is Status.UNAVAILABLE
        assert "reset the stream" in outcome.message and "code 2" in outcome.message
        assert not outcome.unprocessed          # it had started answering: it ran
        reply = await upstream.request(PATH, b"next")
        assert isinstance(reply, Reply) and reply.messages() == [b"echo:next"]
        assert upstream.connects == 1 and upstream.outstanding == 0 and len(conns) == 1


def test_goaway_mid_reply_answers_the_calls_below_it_and_fails_those_above_as_unprocessed():
    autojump(_goaway_mid_reply)


async def _goaway_mid_reply() -> None:
    async def stopping(conn: WorkerConn) -> None:
        await conn.handshake()
        requests = [await conn.request() for _ in range(3)]
        first = requests[0].sid
        # half of the first reply, GOAWAY naming it the last stream processed, then the rest of it
        await conn.send(frame(HEADERS, END_HEADERS, first, RESPONSE_HEADERS)
                        + frame(GOAWAY, 0, 0, struct.pack(">II", first, 0) + b"draining"))
        await conn.send(frame(DATA, 0, first, framed(b"first")) + frame(HEADERS, END_HEADERS | END_STREAM, first,
                                                                         trailers(Status.OK, None)))
        await conn.closed()

    async with upstream_to(stopping, well_behaved) as (upstream, conns):
        outcomes: list = [None] * 3
        async with trio.open_nursery() as nursery:
            for i in range(3):
                async def one(i=i) -> None:
                    outcomes[i] = await upstream.request(PATH, b"call %d" % i)
                nursery.start_soon(one)
                await trio.sleep(0)
        assert isinstance(outcomes[0], Reply) and outcomes[0].messages() == [b"first"]
        for later in outcomes[1:]:
            assert isinstance(later, UpstreamError) and later.status is Status.UNAVAILABLE and later.unprocessed
            assert "stopping" in later.message and "before running it" in later.message
        await served_again(upstream)
        assert conns[0].eof and upstream.connects == 2


def test_a_reply_trickled_byte_by_byte_ends_at_the_calls_deadline_and_its_stream_is_reset():
    autojump(_trickle)


async def _trickle() -> None:
    sent = [0]

    async def trickler(conn: WorkerConn) -> None:
        await conn.handshake()
        req = await conn.request()
        await conn.send(frame(HEADERS, END_HEADERS, req.sid, RESPONSE_HEADERS))
        message = framed(b"x" * 1000)
        while req.sid not in conn.resets:
            await conn.send(frame(DATA, 0, req.sid, message[sent[0] % len(message):][:1]))
            sent[0] += 1
            with trio.move_on_after(0.05):
                await conn.read_frame()
        await serve_echo(conn)

    async with bystander(), upstream_to(trickler) as (upstream, conns):
        started = trio.current_time()
        outcome = await upstream.request(PATH, b"slowly", timeout=2.0)
        assert isinstance(outcome, UpstreamError) and outcome.status is Status.DEADLINE_EXCEEDED
        assert "did not answer within the request's timeout" in outcome.message
        assert trio.current_time() - started == pytest.approx(2.0, abs=0.1)
        assert sent[0] >= 30                        # it was sending all along
        with trio.fail_after(1):
            while 1 not in conns[0].resets:
                await trio.sleep(0.01)
        assert conns[0].resets[1] == CANCEL
        # the same connection goes on serving
        reply = await upstream.request(PATH, b"quick")
        assert isinstance(reply, Reply) and reply.messages() == [b"echo:quick"] and upstream.connects == 1


# ---- protocol violations and floods: the connection is closed with GOAWAY ------------------------
async def _attacked(attack, code: int, words: tuple[str, ...], *, reads: bool = True, calls: int = 2,
                    measure: bool = False, **options) -> list:
    """Two calls in flight on a connection whose worker then runs ``attack(conn, requests)``
    (reading the gateway's frames meanwhile unless ``reads`` is False). Checks: every call still
    in flight fails UNAVAILABLE with a message holding one of ``words``; the gateway sent GOAWAY
    with ``code`` and closed the connection; another worker was served meanwhile; the gateway
    connects again and is served; with ``measure``, what the process allocated at its peak stayed
    under HOLD_BOUND. Returns the calls' outcomes."""
    async def attacker(conn: WorkerConn) -> None:
        await conn.handshake()
        requests = [await conn.request() for _ in range(calls)]

        async def attacking() -> None:
            try:
                await attack(conn, requests)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass                # the gateway closed the connection mid-attack
        if not reads:
            await attacking()
            await conn.closed()
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(attacking)
            await conn.closed()
            nursery.cancel_scope.cancel()

    outcomes: list = [None] * calls
    async with bystander(), upstream_to(attacker, well_behaved, **options) as (upstream, conns):
        with peak_below_hold_bound(measure):
            async with trio.open_nursery() as nursery:
                for i in range(calls):
                    async def one(i=i) -> None:
                        outcomes[i] = await upstream.request(PATH, b"victim %d" % i)
                    nursery.start_soon(one)
                    await trio.sleep(0)
            with trio.fail_after(120):
                while not conns[0].eof:
                    await trio.sleep(0.01)
        goaway = conns[0].goaway
        if reads:       # (a worker that does not read may never see the GOAWAY: its socket is full)
            assert goaway is not None, "no GOAWAY"
        if goaway is not None:
            assert error_name(goaway[1]) == error_name(code), goaway
        failed = [o for o in outcomes if isinstance(o, UpstreamError)]
        assert failed, outcomes
        for outcome in failed:
            assert outcome.status is Status.UNAVAILABLE, outcome.message
            assert any(w.lower() in outcome.message.lower() for w in words), (words, outcome.message)
            # a limit is named as the gateway's own, not as a node-file key it does not read
            assert "(endpoints." not in outcome.message, outcome.message
        assert any(w.lower() in upstream.last_error.lower() for w in words) or upstream.up
        await served_again(upstream)
    return outcomes


def _u32(value: int) -> bytes:
    return struct.pack(">I", value)


def _repeat(one: bytes, count: int, chunk: int = 1 << 20) -> list[bytes]:
    """``count`` copies of ``one`` as a few sends of about ``chunk`` bytes (one object reused)."""
    per = max(1, chunk // len(one))
    block = one * per
    out = [block] * (count // per)
    if count % per:
        out.append(one * (count % per))
    return out


async def _send_all(conn: WorkerConn, parts: list[bytes]) -> None:
    for part in parts:
        await conn.send(part)


def _settings_flood(conn, requests):
    return _send_all(conn, _repeat(frame(SETTINGS, 0, 0), 200_000))


def _ping_flood(conn, requests):
    return _send_all(conn, _repeat(frame(PING, 0, 0, b"12345678"), 1_500_000))


def _rst_flood(conn, requests):
    # the first call is reset, then its (closed) stream again and again
    return _send_all(conn, _repeat(frame(RST_STREAM, 0, requests[0].sid, _u32(CANCEL)), 200_000))


async def _empty_data_flood(conn, requests):
    await conn.send(frame(HEADERS, END_HEADERS, requests[0].sid, RESPONSE_HEADERS))
    await _send_all(conn, _repeat(frame(DATA, 0, requests[0].sid), 200_000))


async def _oversized_frame(conn, requests):
    allowed = conn.settings.get(5, 16384)               # the gateway's SETTINGS_MAX_FRAME_SIZE
    await conn.send(frame(HEADERS, END_HEADERS, requests[0].sid, RESPONSE_HEADERS)
                    + struct.pack(">IBI", (allowed + 1) << 8 | DATA, 0, requests[0].sid))
    await _send_all(conn, _repeat(b"x" * 1024, allowed // 1024 + 1))


async def _header_list_bomb(conn, requests):
    # one 4000-byte field put in the worker's dynamic table, then named 2000 times by its index:
    # a 4 KB block that decodes to an 8 MB header list
    insert = b"\x40" + bytes([len(b"x-big")]) + b"x-big" + b"\x7f" + _hpack_len(4000) + b"v" * 4000
    block = encode([(":status", "200")]) + insert + b"\xbe" * 2000        # 0xbe: index 62, the newest entry
    await conn.send(header_frames(requests[0].sid, block, conn.settings.get(5, 16384)))


def _hpack_len(value: int) -> bytes:
    """The bytes after a 7-bit prefix of 127 that encode ``value`` (RFC 7541 5.1)."""
    value -= 127
    out = bytearray()
    while value >= 128:
        out.append(value % 128 | 128)
        value //= 128
    out.append(value)
    return bytes(out)


async def _endless_continuation(conn, requests):
    await conn.send(frame(HEADERS, 0, requests[0].sid, RESPONSE_HEADERS))
    await _send_all(conn, _repeat(frame(CONTINUATION, 0, requests[0].sid, b"\x00" * 1024), 60_000))


def _window_update(sid_of, increment):
    async def attack(conn, requests):
        await conn.send(frame(WINDOW_UPDATE, 0, sid_of(requests), _u32(increment)))
    return attack


def _settings(payload: bytes):
    async def attack(conn, requests):
        await conn.send(frame(SETTINGS, 0, 0, payload))
    return attack


async def _push_promise(conn, requests):
    block = encode([(":method", "GET"), (":scheme", "http"), (":path", "/pushed"), (":authority", "x")])
    await conn.send(frame(5, END_HEADERS, requests[0].sid, _u32(2) + block))


async def _data_on_idle_stream(conn, requests):
    await conn.send(frame(DATA, 0, requests[-1].sid + 2, framed(b"for nobody")))


async def _headers_on_idle_stream(conn, requests):
    await conn.send(frame(HEADERS, END_HEADERS, requests[-1].sid + 2, RESPONSE_HEADERS))


async def _padding_past_the_frame(conn, requests):
    await conn.send(frame(HEADERS, PADDED | END_HEADERS, requests[0].sid))      # no byte for the pad length


async def _headers_on_even_stream(conn, requests):
    await conn.send(frame(HEADERS, END_HEADERS, 2, RESPONSE_HEADERS))


CONNECTION_ATTACKS = {
    # name: (attack, GOAWAY code, words one of which the calls' error holds, keyword arguments)
    "settings flood": (_settings_flood, 0xB, ("SETTINGS",), {"measure": True}),
    "ping flood, acks never read": (_ping_flood, 0xB, ("PING",), {"reads": False, "measure": True}),
    "rst_stream flood": (_rst_flood, 0xB, ("RST_STREAM", "reset"), {"measure": True}),
    "empty data flood": (_empty_data_flood, 0xB, ("empty DATA",), {"measure": True}),
    "oversized frame": (_oversized_frame, 0x6, ("frame of",), {"measure": True}),
    "header list bomb": (_header_list_bomb, 0xB, ("header list", "header block"), {"measure": True}),
    "endless continuation": (_endless_continuation, 0xB, ("CONTINUATION", "header block"), {"measure": True}),
    "window_update 0 on the connection": (_window_update(lambda r: 0, 0), 0x1, ("WINDOW_UPDATE",), {}),
    "window_update past 2^31-1 on the connection": (_window_update(lambda r: 0, 2**31 - 1), 0x3, ("window",), {}),
    "settings initial window past 2^31-1": (_settings(struct.pack(">HI", 4, 2**31)), 0x3,
                                            ("INITIAL_WINDOW_SIZE",), {}),
    "settings max frame below 16384": (_settings(struct.pack(">HI", 5, 16383)), 0x1, ("MAX_FRAME_SIZE",), {}),
    "settings max frame past 2^24-1": (_settings(struct.pack(">HI", 5, 2**24)), 0x1, ("MAX_FRAME_SIZE",), {}),
    "settings enable push from a server": (_settings(struct.pack(">HI", 2, 1)), 0x1, ("ENABLE_PUSH",), {}),
    "settings length not a multiple of 6": (_settings(b"\x00\x04\x00\x01\x00"), 0x6, ("multiple of 6",), {}),
    "push_promise": (_push_promise, 0x1, ("PUSH_PROMISE",), {}),
    "data on a stream never opened": (_data_on_idle_stream, 0x1, ("idle stream", "never opened"), {}),
    "headers on a stream never opened": (_headers_on_idle_stream, 0x1, ("idle stream", "never opened"), {}),
    "headers on an even stream": (_headers_on_even_stream, 0x1, ("stream 2",), {}),
    "headers padding past the frame": (_padding_past_the_frame, 0x1, ("padding",), {}),
}


@pytest.mark.parametrize("name", list(CONNECTION_ATTACKS))
def test_a_worker_that_breaks_http2_or_floods_gets_goaway_its_calls_a_clear_error_and_others_are_served(name):
    attack, code, words, options = CONNECTION_ATTACKS[name]
    autojump(lambda: _attacked(attack, code, words, **options))


# ---- stream errors: that call fails, the connection goes on --------------------------------------
async def _stream_attacked(attack, words: tuple[str, ...], *, status: Status = Status.UNAVAILABLE,
                           reset: int | None = None, measure: bool = False, **options) -> UpstreamError:
    """One call whose worker answers it with ``attack(conn, request)`` (reading the gateway's frames
    meanwhile) and then behaves. Checks: the call fails with ``status`` and a message holding one of
    ``words``; its stream was reset with ``reset`` (when given); the same connection serves the next
    call; with ``measure``, what the process allocated at its peak stayed under HOLD_BOUND."""
    async def attacker(conn: WorkerConn) -> None:
        await conn.handshake()
        request = await conn.request()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(attack, conn, request)
            await serve_echo(conn)
            nursery.cancel_scope.cancel()

    async with upstream_to(attacker, **options) as (upstream, conns):
        with peak_below_hold_bound(measure):
            outcome = await upstream.request(PATH, b"victim")
        assert isinstance(outcome, UpstreamError) and outcome.status is status, outcome
        assert any(w.lower() in outcome.message.lower() for w in words), (words, outcome.message)
        if reset is not None:
            with trio.fail_after(5):
                while 1 not in conns[0].resets:
                    await trio.sleep(0.01)
            assert error_name(conns[0].resets[1]) == error_name(reset)
        reply = await upstream.request(PATH, b"next")
        assert isinstance(reply, Reply) and reply.messages() == [b"echo:next"], reply
        assert upstream.connects == 1 and len(conns) == 1 and not conns[0].eof
    return outcome


async def _stream_window_update(conn, request, increment):
    await conn.send(frame(WINDOW_UPDATE, 0, request.sid, _u32(increment)))


def test_a_window_update_of_0_on_a_stream_resets_that_stream_with_protocol_error():
    autojump(lambda: _stream_attacked(lambda c, r: _stream_window_update(c, r, 0), ("WINDOW_UPDATE",), reset=0x1))


def test_a_window_update_taking_a_stream_window_past_2_31_resets_that_stream_with_flow_control_error():
    autojump(lambda: _stream_attacked(lambda c, r: _stream_window_update(c, r, 2**31 - 1), ("window",), reset=0x3))


async def _oversized_reply(conn, request):
    # a message announcing 64 MiB, sent in frames the gateway allows, for as long as it takes them
    await conn.send(frame(HEADERS, END_HEADERS, request.sid, RESPONSE_HEADERS)
                    + frame(DATA, 0, request.sid, struct.pack(">BI", 0, 64 << 20)))
    chunk = frame(DATA, 0, request.sid, b"y" * 16384)
    while request.sid not in conn.resets:
        await conn.send(chunk * 16)


def test_a_reply_larger_than_the_gateways_message_limit_is_cut_off_not_buffered():
    outcome = [None]

    async def main() -> None:
        outcome[0] = await _stream_attacked(_oversized_reply, ("max_reply_bytes", "larger than"),
                                            status=Status.RESOURCE_EXHAUSTED, reset=CANCEL, measure=True,
                                            max_reply_bytes=1 << 20)
    autojump(main)
    assert str(1 << 20) in outcome[0].message


# ---- the handshake -------------------------------------------------------------------------------
def test_a_worker_that_never_sends_its_settings_is_not_called_and_is_closed_after_the_handshake_timeout():
    autojump(_silent_worker)


async def _silent_worker() -> None:
    async def silent(conn: WorkerConn) -> None:
        await conn.closed()             # reads what the gateway sends, says nothing

    async with fake_worker(silent, well_behaved) as (port, conns), trio.open_nursery() as nursery:
        upstream = Upstream("w", "127.0.0.1", port)
        nursery.start_soon(upstream.run)
        with trio.fail_after(1):
            while not conns:
                await trio.sleep(0.01)
        await trio.sleep(1)
        assert not upstream.up and "SETTINGS" in upstream.last_error
        outcome = await upstream.request(PATH, b"too early")
        assert isinstance(outcome, UpstreamError) and outcome.status is Status.UNAVAILABLE and outcome.unprocessed
        assert "SETTINGS" in outcome.message
        with trio.fail_after(30):
            while not conns[0].eof:
                await trio.sleep(0.01)
        assert "SETTINGS" in upstream.last_error and "handshake" in upstream.last_error
        await served_again(upstream)
        nursery.cancel_scope.cancel()


# ---- the real gateway in front of hostile workers, called by the Triton client -------------------
MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
WATCH_STATUS = "/xlaserve.control.WorkerControl/WatchStatus"


def _infer_reply(worker: str) -> bytes:
    reply = pb.ModelInferResponse(model_name="mlp", model_version="1", id=worker)
    reply.outputs.add(name="output", datatype="FP32", shape=[1, 2])
    reply.raw_output_contents.append(struct.pack("<2f", 1.0, 2.0))
    return reply.SerializeToString()


def _fake_worker_serving_mlp(name: str, on_infer, on_other=None, statuses=None):
    """A fake worker's script: it reports model ``mlp`` READY on the gateway's status stream every
    0.2 s (or, with ``statuses``, ``statuses(n)`` as its n-th report) and answers ModelInfer with
    ``on_infer(conn, request)`` (which returns False to stop reading the connection); any other
    call with ``on_other(conn, request)`` when given (else UNIMPLEMENTED)."""
    if statuses is None:
        fixed = cpb.ModelControlStatusResponse(worker=name, discipline="fifo",
                                               models=[cpb.ModelControl(name="mlp", state="READY", version=1)])
        statuses = lambda n: fixed          # the same report each time

    def report_frame(n: int) -> bytes:
        return framed(statuses(n).SerializeToString())

    async def script(conn: WorkerConn) -> None:
        await conn.handshake()
        async with trio.open_nursery() as nursery:
            while (req := await conn.request()) is not None:
                if req.path == WATCH_STATUS:
                    async def report(sid=req.sid) -> None:
                        await conn.send(frame(HEADERS, END_HEADERS, sid, RESPONSE_HEADERS))
                        n = 0
                        while True:
                            await conn.send(frame(DATA, 0, sid, report_frame(n)))
                            n += 1
                            await trio.sleep(0.2)
                    nursery.start_soon(report)
                elif req.path == MODEL_INFER:
                    if await on_infer(conn, req) is False:
                        break
                elif on_other is not None:
                    await on_other(conn, req)
                else:
                    await conn.send(frame(HEADERS, END_HEADERS | END_STREAM, req.sid,
                                          trailers(Status.UNIMPLEMENTED, f"{req.path} is not faked")))
            nursery.cancel_scope.cancel()
    return script


class GatewayOverFakes(GatewayThread):
    """The real gateway (round robin) in a thread, in front of fake workers served by the same
    Trio run: worker ``i`` runs ``scripts[i]`` on each connection."""

    def __init__(self, *scripts) -> None:
        self.scripts = scripts
        self.connections: list[list[WorkerConn]] = [[] for _ in scripts]
        TrioServerThread.__init__(self)
        self.url = f"127.0.0.1:{self.port}"

    async def _serve(self, nursery: trio.Nursery) -> int:
        workers = []
        for i, script in enumerate(self.scripts):
            async def handler(stream: trio.SocketStream, script=script, conns=self.connections[i]) -> None:
                conn = WorkerConn(stream)
                conns.append(conn)
                try:
                    await script(conn)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
            workers.append(WorkerAddress(f"worker{i}", "127.0.0.1", listeners[0].socket.getsockname()[1]))
        self.gateway = Gateway(workers, gateway_config("round_robin"))
        grpc_port, _ = await nursery.start(self.gateway.run)
        return grpc_port


async def _answer(conn: WorkerConn, req: Request) -> None:
    await conn.reply(req.sid, _infer_reply("worker1"))


@contextmanager
def worker0_then_worker1(on_infer):
    """The real gateway (round robin) over two fake workers serving mlp: worker0 answers each
    ModelInfer with ``on_infer``, worker1 answers it; yields the gateway and a Triton client of it."""
    gateway = GatewayOverFakes(_fake_worker_serving_mlp("worker0", on_infer),
                               _fake_worker_serving_mlp("worker1", _answer))
    try:
        gateway.wait_ready(models=1)
        yield gateway, grpcclient.InferenceServerClient(gateway.url)
    finally:
        gateway.stop()


def _mlp_inputs():
    inputs = [grpcclient.InferInput("input", [1, 512], "FP32")]
    inputs[0].set_data_from_numpy(np.full((1, 512), 0.5, np.float32))
    return inputs


def test_through_the_gateway_a_worker_going_away_mid_call_has_its_unprocessed_calls_retried_on_another():
    async def going_away(conn: WorkerConn, req: Request) -> bool:
        # every ModelInfer is refused with GOAWAY naming the status stream (1) as the last processed
        await conn.send(frame(GOAWAY, 0, 0, struct.pack(">II", 1, 0) + b"draining")
                        + frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers(Status.OK, None)))
        return False

    with worker0_then_worker1(going_away) as (gateway, client):
        for _ in range(4):
            result = client.infer("mlp", _mlp_inputs())
            assert result.get_response().id == "worker1"
            assert result.as_numpy("output").tolist() == [[1.0, 2.0]]
        assert trio.from_thread.run_sync(lambda: gateway.gateway.service.errors.get("retried", 0),
                                         trio_token=gateway.token) >= 1


def test_through_the_gateway_a_worker_breaking_http2_mid_call_fails_that_call_clearly_and_others_are_served():
    broke: list[WorkerConn] = []

    async def breaking(conn: WorkerConn, req: Request) -> bool:
        if broke:                       # once: the connection made again behaves
            await _answer(conn, req)
            return True
        broke.append(conn)
        await conn.send(frame(WINDOW_UPDATE, 0, 0, _u32(0)))
        await conn.closed()
        return False

    with worker0_then_worker1(breaking) as (_, client):
        errors, answered = [], 0
        for _ in range(6):
            try:
                client.infer("mlp", _mlp_inputs())
                answered += 1
            except InferenceServerException as exc:
                errors.append(exc)
        assert answered == 5 and len(errors) == 1, (answered, errors)
        assert "UNAVAILABLE" in str(errors[0].status()) and "WINDOW_UPDATE" in errors[0].message(), errors[0]
        assert broke[0].goaway is not None and error_name(broke[0].goaway[1]) == "PROTOCOL_ERROR"


def test_a_connection_that_used_every_stream_id_finishes_its_calls_and_is_made_again():
    autojump(_every_stream_id_used)


async def _every_stream_id_used() -> None:
    async with upstream_to(well_behaved) as (upstream, conns):
        upstream._h2.last_stream = 2**31 - 3        # as after 2**30 calls: the next is the last id
        last, queued = [], []
        upstream.start(PATH, b"last id", last.append)
        upstream.start(PATH, b"queued", queued.append)
        with trio.fail_after(30):
            while not (last and queued):
                await trio.sleep(0.01)
        assert isinstance(last[0], Reply) and last[0].messages() == [b"echo:last id"], last
        assert isinstance(queued[0], UpstreamError) and queued[0].unprocessed, queued
        assert queued[0].status is Status.UNAVAILABLE and "every HTTP/2 stream id" in queued[0].message, queued
        assert upstream.outstanding == 0
        await served_again(upstream)
        assert len(conns) == 2


def test_a_reply_message_the_caller_cannot_take_fails_that_call_alone():
    autojump(_on_message_raises)


async def _on_message_raises() -> None:
    async with upstream_to(well_behaved) as (upstream, conns):
        def unparsable(message: bytes) -> None:
            raise ValueError(f"cannot parse {message!r}")
        streamed: list = []
        upstream.start(PATH, b"status", streamed.append, timeout=math.inf, on_message=unparsable)
        other = await upstream.request(PATH, b"other")
        with trio.fail_after(30):
            while not streamed:
                await trio.sleep(0.01)
        assert isinstance(streamed[0], UpstreamError) and streamed[0].status is Status.INTERNAL, streamed
        assert "cannot parse b'echo:status'" in streamed[0].message, streamed[0].message
        assert isinstance(other, Reply) and other.messages() == [b"echo:other"], other
        assert upstream.outstanding == 0 and upstream.up and len(conns) == 1


# ---- a worker that falls silent or stops reading ----------------------------------------------------
def test_a_silent_worker_is_pinged_and_its_connection_closed_when_nothing_answers():
    autojump(_silent_after_handshake)


async def _silent_after_handshake() -> None:
    async def mute(conn: WorkerConn) -> None:
        await conn.handshake()
        await conn.closed()         # reads (and so never answers the keep-alive PING)

    async with upstream_to(mute, well_behaved) as (upstream, conns):
        connected_at = trio.current_time()
        with trio.fail_after(200):
            while not conns[0].eof:
                await trio.sleep(1)
        # keep-alive: a PING after 60 s of silence, closed 20 s after it
        assert trio.current_time() - connected_at == pytest.approx(80, abs=2)
        assert conns[0].goaway is not None and "keep-alive PING" in conns[0].goaway[2]
        await served_again(upstream)


def test_a_worker_that_stops_reading_is_closed_when_a_write_makes_no_progress():
    autojump(_not_reading)


async def _not_reading() -> None:
    async def deaf(conn: WorkerConn) -> None:
        # windows as large as there are, so only the socket holds the gateway's request back
        await conn.handshake((4, 2**31 - 1))
        await conn.send(frame(WINDOW_UPDATE, 0, 0, _u32(2**31 - 1 - 65535)))
        await trio.sleep_forever()

    async with bystander(), upstream_to(deaf, well_behaved, request_timeout=600.0) as (upstream, conns):
        started = trio.current_time()
        outcome = await upstream.request(PATH, b"x" * (64 << 20))
        assert isinstance(outcome, UpstreamError) and outcome.status is Status.UNAVAILABLE, outcome
        assert "made no progress for 60 s" in outcome.message, outcome.message
        assert trio.current_time() - started < 100
        await served_again(upstream)
