"""The gateway's client of a worker (:class:`~xlaserve.gateway.upstream.Upstream`) against a
hostile worker (issue 28): a fake worker on loopback speaking raw HTTP/2 floods, sends frames past
what the gateway advertised, abuses the windows, sends bad SETTINGS, resets and goes away in the
middle of replies. Each case checks what could go wrong: the calls in flight get a clear error
naming what the worker did, the offending connection is closed (GOAWAY with the code RFC 9113
names), the gateway connects again and is served, another worker's connection is served meanwhile,
and what the gateway holds stays bounded however much the worker sends.

Timed cases run on Trio's autojump clock: a 60 s timeout passes at once, no test sleeps."""
from __future__ import annotations

import math
import struct
import tracemalloc
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio
import trio.testing
from grpclib.const import Status

from tests.h2attacks import error_name, header_frames, settings_frame
from xlaserve.frontend.grpc_protocol import RESPONSE_HEADERS, framed, trailers
from xlaserve.frontend.grpc_server import (
    ACK, CANCEL, CONTINUATION, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, INTERNAL_ERROR, PING, PREFACE,
    RST_STREAM, SETTINGS, WINDOW_UPDATE, frame,
)
from xlaserve.frontend.hpack import Decoder, encode
from xlaserve.gateway.upstream import Reply, Upstream, UpstreamError

PATH = "/test.Echo/Unary"
#: what the gateway may hold for one hostile connection, at most, while the worker sends many times that
HOLD_BOUND = 8 << 20


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
                await trio.sleep(0.01)
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
