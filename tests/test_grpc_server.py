"""GrpcServer (xlaserve.frontend.grpc_server) on loopback.

Protocol-level cases are driven by hand-built HTTP/2 frames (the ``hpack`` package, not ours,
encodes the requests' header blocks and decodes the replies'), or by ``h2`` where its flow-control
bookkeeping is the point; interop cases use the real clients: grpclib, grpcio and tritonclient.

Each test gets a fresh server in a background thread under ``trio.run``. Nothing sleeps to wait
for timed behaviour. To show that the server has *stopped* sending (a flow-control window is
exhausted, a frame was ignored), a test sends a PING and reads up to its ACK: the server handles
frames in order and writes in order, so whatever it was going to send before the ACK is there.
"""
from __future__ import annotations

import asyncio
import gc
import gzip
import hashlib
import logging
import re
import socket
import struct
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field
from urllib.parse import unquote

import grpc
import h2.config
import h2.connection
import h2.events
import hpack
import numpy as np
import pytest
import trio
import tritonclient.grpc as tritongrpc
from grpclib.client import Channel, StreamUnaryMethod, UnaryStreamMethod, UnaryUnaryMethod
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError

from tests.trio_thread import TrioServerThread
import xlaserve.frontend.grpc_server as grpc_server_module
from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.http2.frames import (
    ACK, CANCEL, COMPRESSION_ERROR, CONTINUATION, DATA, END_HEADERS, END_STREAM, FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR, GOAWAY, HEADERS, INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS, MAX_FRAME_SIZE, NO_ERROR, PADDED,
    PING, PREFACE, PRIORITY, PRIORITY_FLAG, PROTOCOL_ERROR, PUSH_PROMISE, REFUSED_STREAM, RST_STREAM, SETTINGS,
    STREAM_CLOSED, WINDOW_UPDATE, frame,
)
from xlaserve.http2.connection import H2Connection
from xlaserve.frontend.grpc_protocol import MAX_GRPC_MESSAGE_BYTES
from xlaserve.frontend.grpc_server import (
    OUR_CONN_WINDOW, OUR_MAX_FRAME, OUR_STREAM_WINDOW, Connection, GrpcServer, _OK_TRAILERS,
)

TIMEOUT = 5.0          # seconds any single wait may take before the test fails
Request = pb.ModelInferRequest
Reply = pb.ModelInferResponse


def pattern(n: int) -> bytes:
    return (bytes(range(256)) * (n // 256 + 1))[:n]


def request(id: str = "", *, reply_bytes: int = 0, count: int = 0, payload: bytes = b"") -> Request:
    """A request for the echo service: ``reply_bytes`` asks for a reply carrying that many bytes,
    ``count`` for that many streamed replies, ``payload`` travels as raw input."""
    message = Request(id=id, model_name="echo")
    if reply_bytes:
        message.parameters["reply_bytes"].int64_param = reply_bytes
    if count:
        message.parameters["count"].int64_param = count
    if payload:
        message.raw_input_contents.append(payload)
    return message


def grpc_body(*messages, compressed: bool = False) -> bytes:
    """gRPC length-prefixed messages (protobuf messages or raw bytes)."""
    out = b""
    for message in messages:
        raw = message if isinstance(message, bytes) else message.SerializeToString()
        out += struct.pack(">BI", int(compressed), len(raw)) + raw
    return out


def split_messages(data: bytes) -> list[bytes]:
    messages = []
    while data:
        compressed, size = struct.unpack_from(">BI", data)
        assert compressed == 0, "the server does not compress replies"
        assert len(data) >= 5 + size, f"a reply message is cut short: {len(data) - 5} of {size} bytes"
        messages.append(data[5:5 + size])
        data = data[5 + size:]
    return messages


def settings_payload(settings: dict[int, int]) -> bytes:
    return b"".join(struct.pack(">HI", key, value) for key, value in settings.items())


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


def request_headers(path: str, *, method: str = "POST", content_type: str = "application/grpc",
                    extra: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str]]:
    return [(":method", method), (":scheme", "http"), (":path", path), (":authority", "127.0.0.1"),
            ("content-type", content_type), ("te", "trailers"), *extra]


# --- the service under test ---------------------------------------------------------------------

class EchoService:
    """Hand-built grpclib-style service: ``__mapping__`` returns grpclib ``Handler`` tuples."""

    def __init__(self) -> None:
        self.gate = trio.Event()                 # releases Slow calls
        self.slow_started = threading.Event()
        self.slow_cancelled = threading.Event()
        self.stream_cancelled = threading.Event()
        self.gather_target = 0
        self.gathered = 0
        self.all_gathered = trio.Event()
        self.gather_connections: set[int] = set()

    def __mapping__(self) -> dict[str, Handler]:
        unary = Cardinality.UNARY_UNARY
        return {
            "/test.Echo/Unary": Handler(self.unary, unary, Request, Reply),
            "/test.Echo/Stream": Handler(self.stream, Cardinality.UNARY_STREAM, Request, Reply),
            "/test.Echo/Collect": Handler(self.collect, Cardinality.STREAM_UNARY, Request, Reply),
            "/test.Echo/Slow": Handler(self.slow, unary, Request, Reply),
            "/test.Echo/Fail": Handler(self.fail, unary, Request, Reply),
            "/test.Echo/Crash": Handler(self.crash, unary, Request, Reply),
            "/test.Echo/Gather": Handler(self.gather, unary, Request, Reply),
            "/inference.GRPCInferenceService/ServerLive": Handler(
                self.server_live, unary, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "/inference.GRPCInferenceService/ModelInfer": Handler(self.unary, unary, Request, Reply),
        }

    @staticmethod
    def echo(request: Request, stream) -> Reply:
        """The reply to ``request``: its id, the call's metadata and deadline, a digest of its
        raw input, and ``reply_bytes`` bytes of output if asked."""
        reply = Reply(id=request.id, model_name=request.model_name)
        for name, value in stream.metadata.items():
            reply.parameters[f"metadata:{name}"].string_param = value
        if stream.deadline is not None:
            reply.parameters["deadline"].double_param = stream.deadline.time_remaining()
        received = b"".join(request.raw_input_contents)
        reply.parameters["received_bytes"].int64_param = len(received)
        reply.parameters["received_sha256"].string_param = hashlib.sha256(received).hexdigest()
        if "reply_bytes" in request.parameters:
            reply.raw_output_contents.append(pattern(request.parameters["reply_bytes"].int64_param))
        return reply

    async def unary(self, stream) -> None:
        request = await stream.recv_message()
        await stream.send_message(self.echo(request, stream))

    async def stream(self, stream) -> None:
        request = await stream.recv_message()
        size = request.parameters["reply_bytes"].int64_param
        try:
            for i in range(request.parameters["count"].int64_param):
                await stream.send_message(Reply(id=f"{request.id}-{i}", raw_output_contents=[pattern(size)]))
        except trio.Cancelled:
            self.stream_cancelled.set()
            raise

    async def collect(self, stream) -> None:
        ids = []
        while (request := await stream.recv_message()) is not None:
            ids.append(request.id)
        await stream.send_message(Reply(id=",".join(ids)))

    async def slow(self, stream) -> None:
        request = await stream.recv_message()
        self.slow_started.set()
        try:
            await self.gate.wait()
        except trio.Cancelled:
            self.slow_cancelled.set()
            raise
        await stream.send_message(Reply(id=request.id))

    async def fail(self, stream) -> None:
        request = await stream.recv_message()
        raise GRPCError(Status.FAILED_PRECONDITION, request.id)

    async def crash(self, stream) -> None:
        request = await stream.recv_message()
        raise RuntimeError(f"handler bug on {request.id}")

    async def gather(self, stream) -> None:
        """Answers only once ``gather_target`` calls are in the handler at the same time."""
        request = await stream.recv_message()
        self.gather_connections.add(id(stream.conn))
        self.gathered += 1
        if self.gathered == self.gather_target:
            self.all_gathered.set()
        with trio.fail_after(TIMEOUT):
            await self.all_gathered.wait()
        await stream.send_message(Reply(id=request.id))

    async def server_live(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(pb.ServerLiveResponse(live=True))


class ModelMissing(Exception):
    """An application error that carries its gRPC status, as xlaserve's own errors do."""
    status = Status.NOT_FOUND


class FastService:
    """Unary methods served task-free through ``__fast_unary__``: ``fn(call, request)`` runs in the
    connection's reader and must see to one ``call.complete(outcome)`` on the Trio thread."""

    def __init__(self) -> None:
        self.parked: dict[str, object] = {}
        self.parked_event = threading.Event()

    def __mapping__(self) -> dict[str, Handler]:
        async def never(stream) -> None:
            raise AssertionError("a fast method ran as a task")
        unary = Cardinality.UNARY_UNARY
        return {f"/test.Fast/{name}": Handler(never, unary, Request, Reply) for name in ("Echo", "Park", "Outcome")}

    def __fast_unary__(self) -> dict:
        return {"/test.Fast/Echo": self.echo, "/test.Fast/Park": self.park, "/test.Fast/Outcome": self.outcome}

    def echo(self, call, request: Request) -> None:
        call.complete(EchoService.echo(request, call))

    def park(self, call, request: Request) -> None:
        """Completed later by the test, on the Trio thread."""
        self.parked[request.id] = call
        self.parked_event.set()

    def outcome(self, call, request: Request) -> None:
        kind = request.id
        if kind == "raise":
            raise GRPCError(Status.ABORTED, "raised by the fast handler")
        call.complete({"grpc-error": GRPCError(Status.OUT_OF_RANGE, "out of range"),
                       "status-attribute": ModelMissing("model 'm' is not loaded"),
                       "plain": ValueError("bad value")}[kind])


class ServerThread(TrioServerThread):
    """A GrpcServer serving an EchoService and a FastService from ``trio.run`` in a background thread."""

    def __init__(self, **limits) -> None:
        self.service = EchoService()
        self.fast = FastService()
        self.server = GrpcServer([self.service, self.fast], **limits)
        self.clients: list = []
        super().__init__()

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the server's Trio thread."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def release_slow_calls(self) -> None:
        self.call(self.service.gate.set)

    def close(self) -> None:
        self.call(self.server.close)

    def wait_closed(self) -> None:
        async def wait() -> None:
            with trio.fail_after(TIMEOUT):
                await self.server.wait_closed()
        trio.from_thread.run(wait, trio_token=self.token)

    def connect(self, settings: dict[int, int] | None = None, *, preface: bool = True) -> FrameClient:
        client = FrameClient(self.port, settings, preface=preface)
        self.clients.append(client)
        return client

    def h2_connect(self) -> H2Client:
        client = H2Client(self.port)
        self.clients.append(client)
        return client

    def stop(self) -> None:
        """Release, close and drain; fails the test if the server does not drain."""
        for client in self.clients:
            client.close()
        if self._thread.is_alive():
            try:
                self.release_slow_calls()
                self.close()
                self.wait_closed()
            finally:
                try:
                    self.call(self._nursery.cancel_scope.cancel)
                except trio.RunFinishedError:
                    pass
                self._thread.join(TIMEOUT)
        if self._error is not None:
            raise self._error


@pytest.fixture
def make_server():
    servers: list[ServerThread] = []

    def start(**limits) -> ServerThread:
        servers.append(ServerThread(**limits))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(make_server) -> ServerThread:
    return make_server()


# --- a frame-level HTTP/2 client --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Frame:
    type: int
    flags: int
    stream: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class GoAway:
    last_stream: int
    code: int
    debug: bytes


@dataclass
class Response:
    """What one stream received: its header blocks (decoded), DATA frames, and RST_STREAM code."""
    blocks: list[dict[str, str]]
    frames: list[Frame]
    reset: int | None = None
    data: bytes = field(init=False)

    def __post_init__(self) -> None:
        self.data = b"".join(f.payload for f in self.frames if f.type == DATA)

    @property
    def headers(self) -> dict[str, str]:
        return self.blocks[0]

    @property
    def trailers(self) -> dict[str, str]:
        return self.blocks[-1]

    @property
    def status(self) -> int:
        return int(self.trailers["grpc-status"])

    @property
    def message(self) -> str:
        return unquote(self.trailers.get("grpc-message", ""), encoding="utf-8", errors="strict")

    def replies(self, reply_type=Reply) -> list:
        return [reply_type.FromString(m) for m in split_messages(self.data)]

    def data_sizes(self) -> list[int]:
        return [len(f.payload) for f in self.frames if f.type == DATA]


class FrameClient:
    """HTTP/2 with prior knowledge over a blocking socket; every received frame is kept in ``log``."""

    def __init__(self, port: int, settings: dict[int, int] | None = None, *, preface: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder(max_header_list_size=1 << 20)
        self.buf = bytearray()
        self.log: list[Frame] = []
        self.blocks: dict[int, list[dict[str, str]]] = {}
        self.ended: set[int] = set()
        self.resets: dict[int, int] = {}
        self.eof = False
        self._partial: tuple[int, bool, bytearray] | None = None
        if preface:
            self.send(PREFACE + frame(SETTINGS, 0, 0, settings_payload(settings or {})))

    def close(self) -> None:
        self.sock.close()

    def send(self, *data: bytes) -> None:
        self.sock.sendall(b"".join(data))

    def headers_frame(self, sid: int, headers, flags: int = END_HEADERS) -> bytes:
        return frame(HEADERS, flags, sid, self.encoder.encode(headers))

    def start_call(self, sid: int, path: str, body: bytes | None, **header_options) -> None:
        """HEADERS, then ``body`` in one DATA frame with END_STREAM (``None``: END_STREAM on HEADERS)."""
        headers = request_headers(path, **header_options)
        if body is None:
            self.send(self.headers_frame(sid, headers, END_HEADERS | END_STREAM))
        else:
            self.send(self.headers_frame(sid, headers), frame(DATA, END_STREAM, sid, body))

    def call(self, sid: int, path: str, *messages, body: bytes | None = None, **header_options) -> Response:
        """One call carrying ``messages`` (or the ready-framed ``body``); its response."""
        self.start_call(sid, path, grpc_body(*messages) if body is None else body, **header_options)
        return self.response(sid)

    # ---- reading ---------------------------------------------------------------------------
    def _recv(self) -> bool:
        try:
            chunk = self.sock.recv(1 << 20)
        except ConnectionResetError:
            chunk = b""
        except TimeoutError:
            raise AssertionError(f"nothing from the server for {TIMEOUT}s; received so far: "
                                 f"{[(f.type, f.flags, f.stream, len(f.payload)) for f in self.log]}") from None
        self.buf += chunk
        return bool(chunk)

    def read_frame(self) -> Frame | None:
        """The next frame, or None at end of stream."""
        while len(self.buf) < 9 or len(self.buf) < 9 + int.from_bytes(self.buf[:3], "big"):
            if not self._recv():
                assert not self.buf, f"the connection ended inside a frame: {bytes(self.buf)!r}"
                self.eof = True
                return None
        length = int.from_bytes(self.buf[:3], "big")
        ftype, flags, sid = struct.unpack_from(">BBI", self.buf, 3)
        f = Frame(ftype, flags, sid & 0x7FFFFFFF, bytes(self.buf[9:9 + length]))
        del self.buf[:9 + length]
        self.log.append(f)
        self._track(f)
        return f

    def _track(self, f: Frame) -> None:
        if self._partial is not None:
            assert f.type == CONTINUATION and f.stream == self._partial[0], \
                f"the server interrupted a header block with {f}"
        if f.type == HEADERS:
            start, stop = 0, len(f.payload)
            if f.flags & PADDED:
                start, stop = 1, stop - f.payload[0]
            if f.flags & PRIORITY_FLAG:
                start += 5
            self._partial = (f.stream, bool(f.flags & END_STREAM), bytearray(f.payload[start:stop]))
        elif f.type == CONTINUATION:
            assert self._partial is not None, "CONTINUATION without HEADERS"
            self._partial[2].extend(f.payload)
        elif f.type == DATA and f.flags & END_STREAM:
            self.ended.add(f.stream)
        elif f.type == RST_STREAM:
            self.resets[f.stream] = struct.unpack(">I", f.payload)[0]
            self.ended.add(f.stream)
        if f.type in (HEADERS, CONTINUATION) and f.flags & END_HEADERS:
            sid, end_stream, block = self._partial
            self._partial = None
            self.blocks.setdefault(sid, []).append(dict(self.decoder.decode(bytes(block))))
            if end_stream:
                self.ended.add(sid)

    def until(self, predicate) -> Frame:
        """Read frames until one satisfies ``predicate``; return it."""
        while True:
            f = self.read_frame()
            assert f is not None, f"the server closed the connection; received: {self.log}"
            if predicate(f):
                return f

    def response(self, sid: int) -> Response:
        """Read until stream ``sid`` has ended (END_STREAM or RST_STREAM); what it received."""
        if sid not in self.ended:
            self.until(lambda f: sid in self.ended)
        return Response(self.blocks.get(sid, []), [f for f in self.log if f.stream == sid],
                        self.resets.get(sid))

    def ping_barrier(self, opaque: bytes = b"barrier!") -> list[Frame]:
        """Send PING, read up to its ACK; the frames that arrived meanwhile."""
        start = len(self.log)
        self.send(frame(PING, 0, 0, opaque))
        self.until(lambda f: f.type == PING and f.flags & ACK and f.payload == opaque)
        return self.log[start:-1]

    def goaway(self) -> GoAway:
        """Read until GOAWAY (failing on a PING ACK first: the server ignored what it should reject)."""
        f = self.until(lambda f: f.type == GOAWAY or (f.type == PING and f.flags & ACK))
        assert f.type == GOAWAY, "the server answered a PING instead of sending GOAWAY"
        last, code = struct.unpack_from(">II", f.payload)
        return GoAway(last & 0x7FFFFFFF, code, f.payload[8:])

    def expect_eof(self) -> None:
        while self.read_frame() is not None:
            pass


class H2Client:
    """An ``h2`` client connection: h2 does the flow-control bookkeeping (and enforces it)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        self.conn = h2.connection.H2Connection(
            config=h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        self.events: list = []
        self.flush()

    def close(self) -> None:
        self.sock.close()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self) -> None:
        chunk = self.sock.recv(1 << 20)
        assert chunk, "the server closed the connection"
        for event in self.conn.receive_data(chunk):
            self.events.append(event)
            if isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.flush()

    def unary(self, path: str, body: bytes) -> tuple[dict, bytes, dict]:
        """One call whose request body is sent as the windows allow; headers, data, trailers."""
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, request_headers(path))
        sent = 0
        while sent < len(body):
            room = min(self.conn.local_flow_control_window(sid), self.conn.max_outbound_frame_size,
                       len(body) - sent)
            if room <= 0:
                self.pump()
                continue
            self.conn.send_data(sid, body[sent:sent + room])
            sent += room
            self.flush()
        self.conn.end_stream(sid)
        self.flush()
        while not any(isinstance(e, h2.events.StreamEnded) and e.stream_id == sid for e in self.events):
            self.pump()
        mine = [e for e in self.events if getattr(e, "stream_id", None) == sid]
        headers = next(dict(e.headers) for e in mine if isinstance(e, h2.events.ResponseReceived))
        trailers = next(dict(e.headers) for e in mine if isinstance(e, h2.events.TrailersReceived))
        data = b"".join(e.data for e in mine if isinstance(e, h2.events.DataReceived))
        return headers, data, trailers


def grpclib_run(port: int, body):
    """``await body(channel)`` with a grpclib Channel to the server, on a fresh asyncio loop."""
    async def main():
        channel = Channel("127.0.0.1", port)
        try:
            return await body(channel)
        finally:
            channel.close()
    return asyncio.run(main())


@pytest.fixture
def grpcio_channel(server):
    channel = grpc.insecure_channel(server.url, options=[("grpc.enable_http_proxy", 0)])
    yield channel
    channel.close()


def grpcio_unary(channel, path: str):
    return channel.unary_unary(path, request_serializer=Request.SerializeToString,
                               response_deserializer=Reply.FromString)


# --- round trips with the real clients ----------------------------------------------------------

def test_unary_grpclib_sees_metadata_and_deadline(server):
    async def body(channel):
        method = UnaryUnaryMethod(channel, "/test.Echo/Unary", Request, Reply)
        return await method(request("r-1", payload=b"abc"), timeout=7.5, metadata={"x-tenant": "acme"})

    reply = grpclib_run(server.port, body)
    assert reply.id == "r-1"
    assert reply.parameters["metadata:x-tenant"].string_param == "acme"
    assert reply.parameters["received_sha256"].string_param == hashlib.sha256(b"abc").hexdigest()
    assert 6.5 < reply.parameters["deadline"].double_param <= 7.5


def test_unary_grpcio_sees_metadata_and_deadline(server, grpcio_channel):
    reply, call = grpcio_unary(grpcio_channel, "/test.Echo/Unary").with_call(
        request("r-2", payload=b"xyz"), timeout=3.0, metadata=[("x-tenant", "acme")])
    assert call.code() == grpc.StatusCode.OK
    assert reply.id == "r-2"
    assert reply.parameters["metadata:x-tenant"].string_param == "acme"
    assert reply.parameters["received_bytes"].int64_param == 3
    # grpc-core rounds the grpc-timeout it sends up to a coarser unit (3.0097 s left was seen):
    # a little over the 3 s asked, never much
    assert 2.0 < reply.parameters["deadline"].double_param <= 3.05


def test_no_grpc_timeout_means_no_deadline(server):
    reply = server.connect().call(1, "/test.Echo/Unary", request("r")).replies()[0]
    assert "deadline" not in reply.parameters


def test_raw_grpc_timeout_header(server):
    response = server.connect().call(1, "/test.Echo/Unary", request("r"), extra=(("grpc-timeout", "1500m"),))
    assert response.status == 0
    assert 0.5 < response.replies()[0].parameters["deadline"].double_param <= 1.5


def test_malformed_grpc_timeout_is_invalid_argument(server):
    response = server.connect().call(1, "/test.Echo/Unary", request("r"), extra=(("grpc-timeout", "soon"),))
    assert response.status == Status.INVALID_ARGUMENT.value
    assert "grpc-timeout" in response.message and "soon" in response.message


def test_tritonclient_server_live_and_infer(server):
    client = tritongrpc.InferenceServerClient(server.url)
    try:
        assert client.is_server_live() is True
        tensor = tritongrpc.InferInput("x", [2], "INT32")
        tensor.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
        result = client.infer("echo", [tensor], request_id="triton-7")
        assert result.get_response().id == "triton-7"
    finally:
        client.close()


def test_server_streaming_grpclib(server):
    async def body(channel):
        return await UnaryStreamMethod(channel, "/test.Echo/Stream", Request, Reply)(request("s", count=25))

    replies = grpclib_run(server.port, body)
    assert [r.id for r in replies] == [f"s-{i}" for i in range(25)]


def test_server_streaming_waits_for_window(server):
    """Ten 3000-byte replies through a 1000-byte stream window granted bit by bit: all arrive in
    order, the server never oversteps the window, and the trailers come last."""
    client = server.connect({INITIAL_WINDOW_SIZE: 1000})
    client.start_call(1, "/test.Echo/Stream", grpc_body(request("s", count=10, reply_bytes=3000)))
    granted = 1000
    for _ in range(1000):                            # bounded: a stalled server fails, not hangs
        if 1 in client.ended:
            break
        client.ping_barrier()
        received = sum(len(f.payload) for f in client.log if f.type == DATA and f.stream == 1)
        assert received <= granted
        if received == granted:
            client.send(window_update(1, 2500), window_update(0, 2500))
            granted += 2500
    assert 1 in client.ended, "the server stopped sending with window left"
    response = client.response(1)
    assert response.status == 0
    assert [r.id for r in response.replies()] == [f"s-{i}" for i in range(10)]
    assert all(r.raw_output_contents[0] == pattern(3000) for r in response.replies())
    assert response.frames[-1].type == HEADERS and response.frames[-1].flags & END_STREAM


def test_rst_stream_cancels_streaming_handler_waiting_for_window(server):
    client = server.connect({INITIAL_WINDOW_SIZE: 1000})
    client.start_call(1, "/test.Echo/Stream", grpc_body(request("s", count=10, reply_bytes=3000)))
    client.until(lambda f: f.type == DATA and f.stream == 1)
    client.send(frame(RST_STREAM, 0, 1, struct.pack(">I", CANCEL)))
    assert server.service.stream_cancelled.wait(TIMEOUT)
    client.send(window_update(1, 1 << 20))            # a late update for the reset stream is harmless
    before = len(client.log)
    assert client.call(3, "/test.Echo/Unary", request("next")).replies()[0].id == "next"
    assert [f for f in client.log[before:] if f.stream == 1] == []


def test_client_streaming_grpclib(server):
    async def body(channel):
        async with StreamUnaryMethod(channel, "/test.Echo/Collect", Request, Reply).open() as stream:
            for i in range(5):
                await stream.send_message(request(f"m{i}"))
            await stream.end()
            return await stream.recv_message()

    assert grpclib_run(server.port, body).id == "m0,m1,m2,m3,m4"


def test_concurrent_calls_on_one_connection(server):
    """100 grpclib calls on one connection (the default max_concurrent_streams is 128), all inside
    the handler at once, each answered with its own id."""
    server.service.gather_target = 100

    async def body(channel):
        method = UnaryUnaryMethod(channel, "/test.Echo/Gather", Request, Reply)
        return await asyncio.gather(*(method(request(f"c{i}"), timeout=TIMEOUT) for i in range(100)))

    replies = grpclib_run(server.port, body)
    assert [r.id for r in replies] == [f"c{i}" for i in range(100)]
    assert len(server.service.gather_connections) == 1


# --- connection-level frames -------------------------------------------------------------------

def test_settings_first_then_acks(server):
    client = server.connect({MAX_FRAME_SIZE: 32768})
    client.send(frame(PING, 0, 0, b"12345678"))
    first = client.read_frame()
    assert first.type == SETTINGS and not first.flags & ACK and first.stream == 0
    advertised = dict(struct.iter_unpack(">HI", first.payload))
    assert advertised[INITIAL_WINDOW_SIZE] == OUR_STREAM_WINDOW
    assert advertised[MAX_FRAME_SIZE] == OUR_MAX_FRAME
    assert advertised[MAX_CONCURRENT_STREAMS] >= 100
    second = client.read_frame()
    assert (second.type, second.stream) == (WINDOW_UPDATE, 0)
    assert struct.unpack(">I", second.payload)[0] == OUR_CONN_WINDOW - 65535
    rest = [client.read_frame() for _ in range(2)]
    assert Frame(SETTINGS, ACK, 0, b"") in rest
    assert Frame(PING, ACK, 0, b"12345678") in rest
    # a PING ACK from the client is not answered: the next answer is for the next PING
    client.send(frame(PING, ACK, 0, b"ignored!"))
    assert client.ping_barrier(b"87654321") == []


def test_unknown_frame_types_and_priority_are_ignored(server):
    client = server.connect()
    client.send(frame(0xFA, 0xFF, 1, b"extension"), frame(PRIORITY, 0, 1, struct.pack(">IB", 0, 15)))
    assert client.call(1, "/test.Echo/Unary", request("ok")).replies()[0].id == "ok"


@pytest.mark.parametrize("frames, code", [
    (frame(SETTINGS, 0, 1, b""), PROTOCOL_ERROR),
    (frame(SETTINGS, 0, 0, b"\0\4"), FRAME_SIZE_ERROR),
    (frame(SETTINGS, 0, 0, settings_payload({MAX_FRAME_SIZE: 1000})), PROTOCOL_ERROR),
    (frame(SETTINGS, 0, 0, settings_payload({INITIAL_WINDOW_SIZE: 2**31})), FLOW_CONTROL_ERROR),
    (frame(PING, 0, 0, b"short"), FRAME_SIZE_ERROR),
    (window_update(0, 0), PROTOCOL_ERROR),
    (window_update(0, 2**31 - 1), FLOW_CONTROL_ERROR),
    (frame(DATA, 0, 7, b"x"), PROTOCOL_ERROR),
    (frame(RST_STREAM, 0, 7, struct.pack(">I", CANCEL)), PROTOCOL_ERROR),
    (frame(PUSH_PROMISE, END_HEADERS, 1, struct.pack(">I", 2)), PROTOCOL_ERROR),
    (struct.pack(">IBI", (OUR_MAX_FRAME + 1) << 8 | DATA, 0, 1), FRAME_SIZE_ERROR),      # header only
    (frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff"), COMPRESSION_ERROR),
], ids=["settings-on-stream", "settings-length", "max-frame-size", "initial-window", "ping-length",
        "window-update-0", "window-overflow", "data-idle", "rst-idle", "push-promise", "frame-too-big", "hpack"])
def test_connection_errors(server, frames, code):
    client = server.connect()
    client.send(frames, frame(PING, 0, 0, b"probe!!!"))
    assert client.goaway().code == code
    client.expect_eof()


def test_bad_preface_goaway_then_server_still_serves(server):
    client = server.connect(preface=False)
    client.send(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    goaway = client.goaway()
    assert goaway.code == PROTOCOL_ERROR and b"preface" in goaway.debug
    client.expect_eof()
    assert server.connect().call(1, "/test.Echo/Unary", request("after")).replies()[0].id == "after"


def test_a_bug_while_reading_costs_only_that_connection(server, monkeypatch):
    """An unexpected exception in one connection's frame handling closes that connection; the
    listener and the other connections keep serving."""
    from xlaserve.frontend import grpc_server

    other = server.connect()
    assert other.call(1, "/test.Echo/Unary", request("before")).replies()[0].id == "before"

    def broken(self, flags, sid, payload):
        raise RuntimeError("a bug")
    monkeypatch.setattr(H2Connection, "_on_window_update", broken)
    victim = server.connect()
    victim.send(frame(WINDOW_UPDATE, 0, 0, (1000).to_bytes(4, "big")))
    victim.expect_eof()
    monkeypatch.undo()
    assert other.call(3, "/test.Echo/Unary", request("still")).replies()[0].id == "still"
    assert server.connect().call(1, "/test.Echo/Unary", request("new")).replies()[0].id == "new"


@pytest.mark.parametrize("bad_stream", [6, 3], ids=["even", "backwards"])
def test_bad_new_stream_id_is_protocol_error(server, bad_stream):
    """RFC 9113 5.1.1: a client stream id must be odd and larger than every earlier one."""
    client = server.connect()
    assert client.call(5, "/test.Echo/Unary", request("first")).status == 0
    client.start_call(bad_stream, "/test.Echo/Unary", grpc_body(request("bad")))
    client.send(frame(PING, 0, 0, b"probe!!!"))
    goaway = client.goaway()
    assert (goaway.code, goaway.last_stream) == (PROTOCOL_ERROR, 5)
    client.expect_eof()
    assert not client.blocks.get(bad_stream)


# --- flow control ------------------------------------------------------------------------------

def test_send_flow_control_stream_and_connection_windows(server):
    client = server.connect({INITIAL_WINDOW_SIZE: 1000})
    client.start_call(1, "/test.Echo/Unary", grpc_body(request("big", reply_bytes=100_000)))

    def received() -> int:
        return sum(len(f.payload) for f in client.log if f.type == DATA and f.stream == 1)

    client.until(lambda f: f.type == DATA and f.stream == 1)
    client.ping_barrier()
    assert received() == 1000                        # exactly the stream window, then it waits
    client.send(window_update(1, 5000))
    client.ping_barrier()
    assert received() == 6000
    client.send(window_update(1, 1 << 20))           # now the connection window (65535) binds
    client.ping_barrier()
    assert received() == 65535
    assert 1 not in client.ended
    client.send(window_update(0, 1 << 20))
    response = client.response(1)
    assert response.status == 0
    reply = response.replies()[0]
    assert reply.id == "big" and reply.raw_output_contents[0] == pattern(100_000)
    assert max(response.data_sizes()) <= 16384
    assert [f.type for f in response.frames][-1] == HEADERS        # trailers last


def test_settings_window_increase_releases_blocked_reply(server):
    """RFC 9113 6.9.2: a new INITIAL_WINDOW_SIZE changes the window of open streams."""
    client = server.connect({INITIAL_WINDOW_SIZE: 0})
    client.start_call(1, "/test.Echo/Unary", grpc_body(request("w", reply_bytes=20_000)))
    client.until(lambda f: f.type == HEADERS and f.stream == 1)
    client.ping_barrier()
    assert not [f for f in client.log if f.type == DATA]
    client.send(frame(SETTINGS, 0, 0, settings_payload({INITIAL_WINDOW_SIZE: 1 << 20})))
    response = client.response(1)
    assert response.status == 0 and response.replies()[0].raw_output_contents[0] == pattern(20_000)


def test_receive_flow_control_large_requests(server):
    """Two 10 MB requests on one h2 connection: more than the 4 MiB stream window each and more
    than the 16 MiB connection window together, so both complete only if the server keeps
    sending WINDOW_UPDATE (h2 refuses to overrun a window)."""
    client = server.h2_connect()
    for i in range(2):
        payload = pattern(10_000_000)[::-1] if i else pattern(10_000_000)
        headers, data, trailers = client.unary("/test.Echo/Unary", grpc_body(request(f"big{i}", payload=payload)))
        assert headers[":status"] == "200" and trailers["grpc-status"] == "0"
        reply = Reply.FromString(split_messages(data)[0])
        assert reply.id == f"big{i}"
        assert reply.parameters["received_bytes"].int64_param == len(payload)
        assert reply.parameters["received_sha256"].string_param == hashlib.sha256(payload).hexdigest()
    updates = [e for e in client.events if isinstance(e, h2.events.WindowUpdated)]
    assert len([e for e in updates if e.stream_id]) >= 4
    assert len([e for e in updates if e.stream_id == 0]) >= 2


def test_a_connection_holds_at_most_max_held_bytes_of_unfinished_requests(make_server):
    """Three 40 kB requests, 30 kB of each sent, fit in 105 kB; the fourth call's 30 kB would
    not, so that call alone fails with RESOURCE_EXHAUSTED. The others complete (each message
    is handed on, and its bytes let go, as soon as it is whole), and the connection keeps
    serving."""
    server = make_server(max_recv_bytes=50_000, max_held_bytes=105_000)
    client = server.connect()
    bodies = {sid: grpc_body(request(f"r{sid}", payload=pattern(40_000))) for sid in (1, 3, 5, 7)}
    for sid, body in bodies.items():
        client.send(client.headers_frame(sid, request_headers("/test.Echo/Unary")),
                    frame(DATA, 0, sid, body[:30_000]))
    refused = client.response(7)
    assert refused.status == Status.RESOURCE_EXHAUSTED.value
    assert re.fullmatch(r"this connection would hold 120000 bytes of request data not yet handled "
                        r"\(4 calls with unfinished messages\); the limit is 105000", refused.message)
    for sid in (1, 3, 5):
        client.send(frame(DATA, END_STREAM, sid, bodies[sid][30_000:]))
        reply, = client.response(sid).replies()
        assert reply.id == f"r{sid}" and reply.parameters["received_bytes"].int64_param == 40_000
    again = client.call(9, "/test.Echo/Unary", request("after", payload=pattern(45_000)))
    assert again.status == 0 and again.replies()[0].parameters["received_bytes"].int64_param == 45_000


def test_max_held_bytes_is_never_below_one_largest_message(make_server):
    server = make_server(max_recv_bytes=50_000, max_held_bytes=10)
    assert server.server.max_held_bytes == 50_005
    response = server.connect().call(1, "/test.Echo/Unary", request("big", payload=pattern(49_000)))
    assert response.status == 0


@pytest.mark.parametrize("max_frame", [None, 20_000])
def test_peer_max_frame_size_honoured(server, max_frame):
    settings = {INITIAL_WINDOW_SIZE: 1 << 20}
    if max_frame:
        settings[MAX_FRAME_SIZE] = max_frame
    client = server.connect(settings)
    client.send(window_update(0, 1 << 20))
    response = client.call(1, "/test.Echo/Unary", request("f", reply_bytes=100_000))
    assert response.status == 0
    assert max(response.data_sizes()) == (max_frame or 16384)
    assert response.replies()[0].raw_output_contents[0] == pattern(100_000)


def test_a_long_grpc_message_is_cut_to_what_clients_accept(server):
    """A 40 KB grpc-message (one echoing what a client sent) passes the 8 KiB of metadata gRPC's
    C core accepts: it is cut, saying so, and its trailers fit one HEADERS frame. (Header blocks
    larger than the peer's frames are split into CONTINUATION by the engine: test_http2_engine.)"""
    client = server.connect()
    response = client.call(1, "/test.Echo/Fail", request("x" * 40_000))
    assert response.status == Status.FAILED_PRECONDITION.value
    assert response.message.startswith("x" * 3000) and response.message.endswith(
        f"more characters cut: the message passed {MAX_GRPC_MESSAGE_BYTES} bytes)")
    assert [f.type for f in response.frames if f.type != RST_STREAM] == [HEADERS]


# --- stream lifecycle -----------------------------------------------------------------------------

def test_rst_stream_cancels_handler_connection_lives_on(server):
    client = server.connect()
    client.start_call(1, "/test.Echo/Slow", grpc_body(request("slow")))
    assert server.service.slow_started.wait(TIMEOUT)
    client.send(frame(RST_STREAM, 0, 1, struct.pack(">I", CANCEL)))
    assert server.service.slow_cancelled.wait(TIMEOUT)
    assert client.call(3, "/test.Echo/Unary", request("next")).replies()[0].id == "next"
    server.release_slow_calls()
    client.ping_barrier()
    assert [f for f in client.log if f.stream == 1] == []


def test_graceful_close(server):
    client = server.connect()
    client.start_call(1, "/test.Echo/Slow", grpc_body(request("in-flight")))
    assert server.service.slow_started.wait(TIMEOUT)
    server.close()
    goaway = client.goaway()
    assert (goaway.last_stream, goaway.code) == (1, NO_ERROR)

    client.start_call(3, "/test.Echo/Unary", grpc_body(request("too late")))
    assert client.response(3).reset == REFUSED_STREAM

    # no new connections: refused outright, or accepted and closed without a SETTINGS frame
    try:
        late = server.connect()
        late.send(frame(PING, 0, 0, b"anyone?!"))
        late.expect_eof()
        assert late.log == []
    except (ConnectionRefusedError, ConnectionResetError, BrokenPipeError):
        pass

    server.release_slow_calls()
    response = client.response(1)
    assert response.status == 0 and response.replies()[0].id == "in-flight"
    assert not server.service.slow_cancelled.is_set()
    client.expect_eof()
    server.wait_closed()


def test_close_with_no_calls_closes_idle_connections(server):
    client = server.connect()
    assert client.call(1, "/test.Echo/Unary", request("a")).status == 0
    server.close()
    assert client.goaway().code == NO_ERROR
    client.expect_eof()
    server.wait_closed()



def test_a_closed_connection_frees_its_buffers_at_once(server):
    """A connection and its engine refer to each other, so only a full garbage collection frees
    them; the read buffer (up to READ_BUFFER_MAX) and the HPACK decoder (its table and cache) must
    not wait for it. With the collector off, they are gone once the connection has ended."""
    gc.disable()
    try:
        client = server.connect()
        for sid in (1, 3):          # the second block repeats the first: it is cached
            assert client.call(sid, "/test.Echo/Unary", request("a")).status == 0
        conn = server.call(lambda: next(iter(server.server._connections)))
        buffer = weakref.ref(conn.read_buffer)
        assert buffer() is not None and conn.h2.decoder._cache       # the request's block is cached
        client.close()
        deadline = time.monotonic() + TIMEOUT
        while server.call(lambda: len(server.server._connections)) and time.monotonic() < deadline:
            time.sleep(0.01)
        # gone, though the connection itself is still here (this test holds it)
        assert buffer() is None and not conn.h2.decoder._cache and conn.h2.stopped
    finally:
        gc.enable()

# --- HTTP and gRPC errors --------------------------------------------------------------------

def test_unknown_method_is_unimplemented(server):
    response = server.connect().call(1, "/test.Echo/Nope", request("r"))
    assert response.headers[":status"] == "200"
    assert response.status == Status.UNIMPLEMENTED.value
    assert "/test.Echo/Nope" in response.message and "test.Echo" in response.message

    async def body(channel):
        with pytest.raises(GRPCError) as caught:
            await UnaryUnaryMethod(channel, "/test.Echo/Nope", Request, Reply)(request("r"))
        return caught.value

    assert grpclib_run(server.port, body).status is Status.UNIMPLEMENTED


@pytest.mark.parametrize("options, http_status", [
    ({"method": "GET"}, "405"),
    ({"content_type": "text/plain"}, "415"),
])
def test_http_errors(server, options, http_status):
    response = server.connect().call(1, "/test.Echo/Unary", request("r"), **options)
    assert response.headers[":status"] == http_status
    assert response.frames[0].flags & END_STREAM
    assert not response.data


ODD_MESSAGE = "naïve 100% ✓ — tab\there, 50%2F50"


def test_error_message_percent_encoded(server, grpcio_channel):
    response = server.connect().call(1, "/test.Echo/Fail", request(ODD_MESSAGE))
    assert response.status == Status.FAILED_PRECONDITION.value
    raw = response.trailers["grpc-message"]
    assert raw.isascii() and "%25" in raw and "\t" not in raw
    assert response.message == ODD_MESSAGE

    async def body(channel):
        with pytest.raises(GRPCError) as caught:
            await UnaryUnaryMethod(channel, "/test.Echo/Fail", Request, Reply)(request(ODD_MESSAGE))
        return caught.value

    error = grpclib_run(server.port, body)
    assert (error.status, error.message) == (Status.FAILED_PRECONDITION, ODD_MESSAGE)

    with pytest.raises(grpc.RpcError) as caught:
        grpcio_unary(grpcio_channel, "/test.Echo/Fail")(request(ODD_MESSAGE), timeout=TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details() == ODD_MESSAGE


def test_handler_exception_is_internal_and_logged(server, caplog):
    with caplog.at_level(logging.ERROR, logger="xlaserve.grpc"):
        response = server.connect().call(1, "/test.Echo/Crash", request("r-9"))
    assert response.status == Status.INTERNAL.value
    assert "RuntimeError" in response.message and "r-9" in response.message
    assert any(r.exc_info and "handler bug on r-9" in str(r.exc_info[1]) for r in caplog.records)


def test_invalid_protobuf_is_invalid_argument(server):
    response = server.connect().call(1, "/test.Echo/Unary", b"\xff\xff\xff")
    assert response.status == Status.INVALID_ARGUMENT.value
    assert "inference.ModelInferRequest" in response.message


def test_unary_with_two_messages_is_invalid_argument(server):
    response = server.connect().call(1, "/test.Echo/Unary", request("a"), request("b"))
    assert response.status == Status.INVALID_ARGUMENT.value
    assert "exactly one" in response.message and "2" in response.message


@pytest.mark.parametrize("path", ["/test.Echo/Unary", "/test.Fast/Echo"])
@pytest.mark.parametrize("body", [None, b""], ids=["headers-end-stream", "empty-data"])
def test_unary_with_no_message_is_invalid_argument(server, body, path):
    client = server.connect()
    client.start_call(1, path, body)
    response = client.response(1)
    assert response.status == Status.INVALID_ARGUMENT.value, response.message
    assert "exactly one" in response.message


def test_request_ending_inside_a_message_is_invalid_argument(server):
    response = server.connect().call(1, "/test.Echo/Unary", body=grpc_body(request("cut"))[:-2])
    assert response.status == Status.INVALID_ARGUMENT.value
    assert "ends inside a message" in response.message


# --- compression ---------------------------------------------------------------------------------

@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_request(server, encoding, compress):
    payload = b"compressible " * 2000
    message = request("z", payload=payload).SerializeToString()
    response = server.connect().call(1, "/test.Echo/Unary", body=grpc_body(compress(message), compressed=True),
                                     extra=(("grpc-encoding", encoding),))
    assert response.status == 0
    reply = response.replies()[0]
    assert reply.id == "z"
    assert reply.parameters["received_sha256"].string_param == hashlib.sha256(payload).hexdigest()


def test_grpcio_gzip_request(server, grpcio_channel):
    payload = b"compressible " * 2000
    reply = grpcio_unary(grpcio_channel, "/test.Echo/Unary")(
        request("gz", payload=payload), timeout=TIMEOUT, compression=grpc.Compression.Gzip)
    assert reply.parameters["metadata:grpc-encoding"].string_param == "gzip"
    assert reply.parameters["received_sha256"].string_param == hashlib.sha256(payload).hexdigest()


def test_unsupported_encoding_is_unimplemented(server):
    response = server.connect().call(1, "/test.Echo/Unary", body=grpc_body(b"whatever", compressed=True),
                                     extra=(("grpc-encoding", "snappy"),))
    assert response.status == Status.UNIMPLEMENTED.value and "snappy" in response.message


def test_compressed_flag_without_encoding_is_invalid_argument(server):
    response = server.connect().call(1, "/test.Echo/Unary",
                                     body=grpc_body(gzip.compress(b"x"), compressed=True))
    assert response.status == Status.INVALID_ARGUMENT.value and "grpc-encoding" in response.message


def test_corrupt_gzip_is_invalid_argument(server):
    response = server.connect().call(1, "/test.Echo/Unary", body=grpc_body(b"not gzip at all", compressed=True),
                                     extra=(("grpc-encoding", "gzip"),))
    assert response.status == Status.INVALID_ARGUMENT.value and "gzip" in response.message


def inflate_used(server: ServerThread) -> int:
    return server.call(lambda: server.server.inflate.used)


@pytest.mark.parametrize("limits, key", [
    ({"max_connection_inflate_bytes": 20_000}, "endpoints.max_connection_inflate_bytes"),
    ({"max_inflate_bytes": 20_000}, "endpoints.max_inflate_bytes"),
])
def test_a_message_inflating_past_the_inflate_budget_fails_and_the_connection_goes_on(make_server, limits, key):
    """A gzip bomb: each message inflates only to what the budgets leave (here 20,000 bytes, well
    under the message limit), then fails; the budget is whole again for the next message."""
    server = make_server(**limits)
    client = server.connect()
    bomb = gzip.compress(request("bomb", payload=bytes(10_000_000)).SerializeToString())
    for sid in (1, 3):
        response = client.call(sid, "/test.Echo/Unary", body=grpc_body(bomb, compressed=True),
                               extra=(("grpc-encoding", "gzip"),))
        assert response.status == Status.RESOURCE_EXHAUSTED.value
        assert response.message == (f"decompressed, the message is more than the 20000 bytes left of {key} (20000 "
                                    f"bytes, 0 held by other decompressed messages on "
                                    f"{'this' if 'connection' in key else 'all'} connection"
                                    f"{'' if 'connection' in key else 's'}); send it uncompressed or raise the limit")
    payload = b"compressible " * 1000
    response = client.call(5, "/test.Echo/Unary", body=grpc_body(gzip.compress(
        request("fits", payload=payload).SerializeToString()), compressed=True), extra=(("grpc-encoding", "gzip"),))
    assert response.status == 0
    assert response.replies()[0].parameters["received_sha256"].string_param == hashlib.sha256(payload).hexdigest()
    assert inflate_used(server) == 0


@pytest.mark.parametrize("path", ["/test.Echo/Collect", "/test.Fast/Echo", "/test.Echo/Unary"])
def test_inflated_messages_give_their_budget_back_however_the_call_ends(server, path):
    """Parsed, failed (two messages on a unary call), or reset before a handler read them."""
    client = server.connect()
    gz = (("grpc-encoding", "gzip"),)
    one = grpc_body(gzip.compress(request("a", payload=bytes(50_000)).SerializeToString()), compressed=True)
    assert client.call(1, path, body=one, extra=gz).status == 0
    assert client.call(3, path, body=one + one, extra=gz).status == (
        0 if path == "/test.Echo/Collect" else Status.INVALID_ARGUMENT.value)
    client.send(client.headers_frame(5, request_headers(path, extra=gz)), frame(DATA, 0, 5, one + one),
                frame(RST_STREAM, 0, 5, struct.pack(">I", CANCEL)))
    client.ping_barrier()
    assert inflate_used(server) == 0


def gzipped(message) -> bytes:
    return grpc_body(gzip.compress(message.SerializeToString()), compressed=True)


@pytest.mark.parametrize("path", ["/test.Echo/Unary", "/test.Fast/Echo"])
def test_a_large_compressed_message_is_inflated_in_a_thread_and_served(server, path):
    payload = pattern(3_000_000)              # past INFLATE_INLINE: finished in a worker thread
    response = server.connect().call(1, path, body=gzipped(request("big", payload=payload)),
                                     extra=(("grpc-encoding", "gzip"),))
    assert response.status == 0, response.message
    assert response.replies()[0].parameters["received_sha256"].string_param == hashlib.sha256(payload).hexdigest()
    assert inflate_used(server) == 0


def test_messages_behind_one_inflating_in_a_thread_keep_their_order(server):
    client = server.connect()
    body = (gzipped(request("a", payload=pattern(2_000_000))) + grpc_body(request("b"))
            + gzipped(request("c", payload=pattern(1_000_000))) + gzipped(request("d")))
    client.send(client.headers_frame(1, request_headers("/test.Echo/Collect", extra=(("grpc-encoding", "gzip"),))),
                frame(DATA, 0, 1, body[:1000]), frame(DATA, END_STREAM, 1, body[1000:]))
    response = client.response(1)
    assert response.status == 0, response.message
    assert response.replies()[0].id == "a,b,c,d"
    assert inflate_used(server) == 0


def test_a_bomb_inflated_in_a_thread_is_refused_while_the_connection_is_served(make_server):
    server = make_server(max_connection_inflate_bytes=2 << 20)
    client = server.connect()
    gz = (("grpc-encoding", "gzip"),)
    client.start_call(1, "/test.Echo/Unary", grpc_body(gzip.compress(bytes(16 << 20)), compressed=True), extra=gz)
    client.start_call(3, "/test.Echo/Unary", grpc_body(request("plain")))
    assert client.response(3).replies()[0].id == "plain"
    response = client.response(1)
    assert response.status == Status.RESOURCE_EXHAUSTED.value
    assert response.message == ("decompressed, the message is more than the 2097152 bytes left of "
                                "endpoints.max_connection_inflate_bytes (2097152 bytes, 0 held by other decompressed "
                                "messages on this connection); send it uncompressed or raise the limit")
    assert inflate_used(server) == 0


def test_a_call_reset_while_its_message_inflates_gives_the_reservation_back(server):
    client = server.connect()
    client.send(client.headers_frame(1, request_headers("/test.Echo/Unary", extra=(("grpc-encoding", "gzip"),))),
                frame(DATA, END_STREAM, 1, gzipped(request("x", payload=bytes(20_000_000)))),
                frame(RST_STREAM, 0, 1, struct.pack(">I", CANCEL)))
    client.ping_barrier()
    (conn,) = server.call(lambda: list(server.server._connections))
    server.close()
    server.wait_closed()                      # every connection task, the inflating one too, has ended
    assert conn.inflate.used == 0 and not conn.inflating
    assert inflate_used(server) == 0
    assert 1 not in client.blocks                 # the call was never answered: the client reset it


# --- size limits ----------------------------------------------------------------------------------

def too_large_request(size: int, limit: int) -> str:
    return f"request of {size} bytes is over endpoints.max_recv_msg_bytes ({limit})"


def too_large_response(size: int, limit: int) -> str:
    return f"response of {size} bytes is over endpoints.max_send_msg_bytes ({limit})"


@pytest.fixture
def limited(make_server) -> ServerThread:
    return make_server(max_recv_bytes=1000, max_send_bytes=1000, too_large_request=too_large_request,
                       too_large_response=too_large_response)


def test_request_too_large(limited):
    client = limited.connect()
    message = request("big", payload=pattern(5000))
    response = client.call(1, "/test.Echo/Unary", message)
    assert response.status == Status.RESOURCE_EXHAUSTED.value
    assert response.message == too_large_request(message.ByteSize(), 1000)
    # answered from the message prefix alone, without waiting for the (never sent) body
    client.send(client.headers_frame(3, request_headers("/test.Echo/Unary")),
                frame(DATA, 0, 3, struct.pack(">BI", 0, 100_000_000)))
    assert client.response(3).message == too_large_request(100_000_000, 1000)
    client.ping_barrier()
    assert client.resets[3] == NO_ERROR               # the client may stop sending
    assert client.call(5, "/test.Echo/Unary", request("small")).replies()[0].id == "small"


def test_client_streaming_message_too_large_fails_running_call(limited):
    client = limited.connect()
    client.send(client.headers_frame(1, request_headers("/test.Echo/Collect")),
                frame(DATA, 0, 1, grpc_body(request("fits"))),
                frame(DATA, END_STREAM, 1, grpc_body(request("big", payload=pattern(5000)))))
    response = client.response(1)
    assert response.status == Status.RESOURCE_EXHAUSTED.value
    assert response.message.startswith("request of ") and not response.data


def test_compressed_request_inflating_past_the_limit_is_resource_exhausted(limited):
    """The limit is on the message, compressed or not (grpc-go, grpc-java and grpc core all answer
    RESOURCE_EXHAUSTED for a message that inflates past the maximum)."""
    body = grpc_body(gzip.compress(bytes(100_000)), compressed=True)
    response = limited.connect().call(1, "/test.Echo/Unary", body=body, extra=(("grpc-encoding", "gzip"),))
    assert response.status == Status.RESOURCE_EXHAUSTED.value, response.message
    assert "1000" in response.message


def test_response_too_large(limited):
    response = limited.connect().call(1, "/test.Echo/Unary", request("r", reply_bytes=5000))
    assert response.status == Status.RESOURCE_EXHAUSTED.value
    match = re.fullmatch(r"response of (\d+) bytes is over endpoints.max_send_msg_bytes \(1000\)", response.message)
    assert match and int(match.group(1)) > 5000
    assert not response.data


# --- header blocks and padding -----------------------------------------------------------------

def test_header_block_across_continuation(server):
    client = server.connect()
    block = client.encoder.encode(request_headers("/test.Echo/Unary", extra=(("x-big", "b" * 30_000),)))
    third = len(block) // 3
    client.send(frame(HEADERS, 0, 1, block[:third]),
                frame(CONTINUATION, 0, 1, block[third:2 * third]),
                frame(CONTINUATION, END_HEADERS, 1, block[2 * third:]),
                frame(DATA, END_STREAM, 1, grpc_body(request("cont"))))
    response = client.response(1)
    assert response.status == 0
    reply = response.replies()[0]
    assert reply.id == "cont" and reply.parameters["metadata:x-big"].string_param == "b" * 30_000


def test_interrupted_header_block_is_protocol_error(server):
    client = server.connect()
    block = client.encoder.encode(request_headers("/test.Echo/Unary"))
    client.send(frame(HEADERS, 0, 1, block[:5]), frame(PING, 0, 0, b"12345678"),
                frame(CONTINUATION, END_HEADERS, 1, block[5:]))
    goaway = client.goaway()
    assert goaway.code == PROTOCOL_ERROR
    client.expect_eof()
    assert not [f for f in client.log if f.type == PING]


def test_padded_headers_and_data(server):
    client = server.connect()
    block = client.encoder.encode(request_headers("/test.Echo/Unary"))
    priority = struct.pack(">IB", 0, 15)
    body = grpc_body(request("pad", payload=b"padded"))
    half = len(body) // 2
    client.send(
        frame(HEADERS, END_HEADERS | PADDED | PRIORITY_FLAG, 1, bytes([7]) + priority + block + bytes(7)),
        frame(DATA, PADDED, 1, bytes([20]) + body[:half] + bytes(20)),
        frame(DATA, PADDED, 1, bytes([3]) + bytes(3)),                      # padding only
        frame(DATA, PADDED | END_STREAM, 1, bytes([0]) + body[half:]),      # pad length 0
    )
    response = client.response(1)
    assert response.status == 0
    reply = response.replies()[0]
    assert reply.id == "pad"
    assert reply.parameters["received_sha256"].string_param == hashlib.sha256(b"padded").hexdigest()


def test_client_trailers_end_the_request(server):
    """A client may end its request with a trailers HEADERS frame instead of END_STREAM on DATA."""
    client = server.connect()
    client.send(client.headers_frame(1, request_headers("/test.Echo/Unary")),
                frame(DATA, 0, 1, grpc_body(request("trailed"))),
                client.headers_frame(1, [("x-trailer", "1")], END_HEADERS | END_STREAM))
    assert client.response(1).replies()[0].id == "trailed"


def test_data_after_end_stream_resets_the_stream(server):
    client = server.connect()
    client.start_call(1, "/test.Echo/Slow", grpc_body(request("slow")))
    assert server.service.slow_started.wait(TIMEOUT)
    client.send(frame(DATA, 0, 1, grpc_body(request("extra"))))
    assert client.response(1).reset == STREAM_CLOSED
    assert server.service.slow_cancelled.wait(TIMEOUT)
    assert client.call(3, "/test.Echo/Unary", request("next")).status == 0


def test_client_goaway_lets_open_calls_finish(server):
    client = server.connect()
    client.start_call(1, "/test.Echo/Slow", grpc_body(request("last")))
    assert server.service.slow_started.wait(TIMEOUT)
    client.send(frame(GOAWAY, 0, 0, struct.pack(">II", 0, NO_ERROR)))
    client.ping_barrier()
    server.release_slow_calls()
    assert client.response(1).replies()[0].id == "last"
    client.expect_eof()


# --- task-free unary methods (__fast_unary__) ---------------------------------------------------

def test_fast_unary_round_trip(server):
    async def body(channel):
        method = UnaryUnaryMethod(channel, "/test.Fast/Echo", Request, Reply)
        return await method(request("f-1", payload=b"abc"), timeout=7.5, metadata={"x-tenant": "acme"})

    reply = grpclib_run(server.port, body)
    assert reply.id == "f-1"
    assert reply.parameters["metadata:x-tenant"].string_param == "acme"
    assert 6.5 < reply.parameters["deadline"].double_param <= 7.5
    response = server.connect().call(1, "/test.Fast/Echo", request("f-2"))
    assert [f.type for f in response.frames] == [HEADERS, DATA, HEADERS]
    assert response.status == 0 and response.replies()[0].id == "f-2"


@pytest.mark.parametrize("kind, status, message", [
    ("grpc-error", Status.OUT_OF_RANGE, "out of range"),
    ("status-attribute", Status.NOT_FOUND, "model 'm' is not loaded"),
    ("plain", Status.INTERNAL, "internal error: ValueError: bad value"),
    ("raise", Status.ABORTED, "raised by the fast handler"),
])
def test_fast_unary_failures(server, kind, status, message):
    response = server.connect().call(1, "/test.Fast/Outcome", request(kind))
    assert (response.status, response.message) == (status.value, message)
    assert not response.data


def test_fast_unary_invalid_protobuf(server):
    response = server.connect().call(1, "/test.Fast/Echo", b"\xff\xff\xff")
    assert response.status == Status.INVALID_ARGUMENT.value
    assert "inference.ModelInferRequest" in response.message


def test_fast_unary_reply_waits_for_window(server):
    client = server.connect({INITIAL_WINDOW_SIZE: 1000})
    client.start_call(1, "/test.Fast/Echo", grpc_body(request("w", reply_bytes=50_000)))
    client.until(lambda f: f.type == DATA and f.stream == 1)
    client.ping_barrier()
    assert sum(len(f.payload) for f in client.log if f.type == DATA) == 1000
    client.send(window_update(1, 1 << 20))
    response = client.response(1)
    assert response.status == 0
    assert response.replies()[0].raw_output_contents[0] == pattern(50_000)
    assert max(response.data_sizes()) <= 16384


def test_fast_unary_response_too_large(limited):
    response = limited.connect().call(1, "/test.Fast/Echo", request("r", reply_bytes=5000))
    assert response.status == Status.RESOURCE_EXHAUSTED.value
    assert response.message.startswith("response of ") and not response.data


def test_fast_unary_completion_after_reset_is_ignored(server):
    client = server.connect()
    client.start_call(1, "/test.Fast/Park", grpc_body(request("parked")))
    assert server.fast.parked_event.wait(TIMEOUT)
    client.send(frame(RST_STREAM, 0, 1, struct.pack(">I", CANCEL)))
    client.ping_barrier()
    server.call(server.fast.parked["parked"].complete, Reply(id="too late"))
    client.ping_barrier()
    assert [f for f in client.log if f.stream == 1] == []
    assert client.call(3, "/test.Fast/Echo", request("next")).replies()[0].id == "next"


def test_graceful_close_waits_for_parked_fast_call(server):
    client = server.connect()
    client.start_call(1, "/test.Fast/Park", grpc_body(request("parked")))
    assert server.fast.parked_event.wait(TIMEOUT)
    server.close()
    assert client.goaway() == GoAway(1, NO_ERROR, b"")
    server.call(server.fast.parked["parked"].complete, Reply(id="done"))
    assert client.response(1).replies()[0].id == "done"
    client.expect_eof()
    server.wait_closed()


# --- write batches: replies sent by the replying task ------------------------------------------

def _park(server, client, ids) -> dict:
    for sid, name in zip(range(1, 2 * len(ids), 2), ids):
        client.start_call(sid, "/test.Fast/Park", grpc_body(request(name)))
    client.ping_barrier()
    assert sorted(server.fast.parked) == sorted(ids)
    return server.fast.parked


def _spy_flush(monkeypatch) -> list[tuple[int, int]]:
    """Every Connection.flush: (bytes queued before, bytes left for the writer task after). A
    write batch here holds its output to its end however long it takes (the bound on holding is
    tests/test_gateway_upstream.py's)."""
    monkeypatch.setattr(grpc_server_module, "MAX_HOLD_SECONDS", float("inf"))
    seen: list[tuple[int, int]] = []
    original = Connection.flush

    def flush(conn) -> None:
        before = len(conn.out)
        original(conn)
        seen.append((before, len(conn.out)))
    monkeypatch.setattr(Connection, "flush", flush)
    return seen


def test_replies_in_a_write_batch_leave_together_from_the_replying_task(server, monkeypatch):
    client = server.connect()
    parked = _park(server, client, ["a", "b", "c"])
    flushes = _spy_flush(monkeypatch)

    def complete_all() -> None:
        with server.server.write_batch():
            for name in ("a", "b", "c"):
                parked[name].complete(Reply(id=name))
    server.call(complete_all)
    # one send for the three replies, straight from the batch: nothing was left to the writer
    assert len(flushes) == 1
    queued, left = flushes[0]
    assert left == 0 and queued > 3 * len(_OK_TRAILERS)
    assert [client.response(sid).replies()[0].id for sid in (1, 3, 5)] == ["a", "b", "c"]


def test_write_batch_leaves_what_the_socket_refuses_to_the_writer_in_order(server, monkeypatch):
    big = 16 << 20
    client = server.connect({INITIAL_WINDOW_SIZE: 2**31 - 1, MAX_FRAME_SIZE: 2**24 - 1})
    client.send(window_update(0, 2**31 - 1 - 65535))
    parked = _park(server, client, ["x", "y"])
    flushes = _spy_flush(monkeypatch)
    payloads = {name: bytes([i + 1]) * big for i, name in enumerate(("x", "y"))}

    def complete_all() -> None:
        with server.server.write_batch():
            for name, payload in payloads.items():
                parked[name].complete(Reply(id=name, raw_output_contents=[payload]))
    server.call(complete_all)            # the client reads nothing until both are queued
    assert len(flushes) == 1
    queued, left = flushes[0]
    assert queued > 2 * big and 0 < left < queued, "the socket took all 32 MiB at once; nothing to test"
    for sid, name in ((1, "x"), (3, "y")):
        reply = client.response(sid).replies()[0]
        assert reply.id == name and reply.raw_output_contents[0] == payloads[name]


def test_nested_write_batches_send_once_at_the_outermost_end(server, monkeypatch):
    client = server.connect()
    parked = _park(server, client, ["p", "q"])
    flushes = _spy_flush(monkeypatch)

    def nested() -> int:
        with server.server.write_batch():
            with server.server.write_batch():
                parked["p"].complete(Reply(id="p"))
            sent_inside = len(flushes)
            parked["q"].complete(Reply(id="q"))
        return sent_inside
    assert server.call(nested) == 0
    assert len(flushes) == 1 and flushes[0][1] == 0
    assert [client.response(sid).replies()[0].id for sid in (1, 3)] == ["p", "q"]


def test_a_connection_past_max_connections_gets_goaway_and_the_open_ones_go_on(make_server, caplog):
    server = make_server(max_connections=2)
    first, second = server.connect(), server.connect()
    # each is registered by the server once it has answered a call on it
    assert first.call(1, "/test.Echo/Unary", request("a")).replies()[0].id == "a"
    assert second.call(1, "/test.Echo/Unary", request("b")).replies()[0].id == "b"
    with caplog.at_level(logging.WARNING, logger="xlaserve.grpc"):
        third = server.connect()
        goaway = third.goaway()
        assert goaway.code == 0xB and b"at most 2 connections at once (endpoints.max_connections)" in goaway.debug
        third.expect_eof()
        fourth = server.connect()
        assert fourth.goaway().code == 0xB
        fourth.expect_eof()
    # one log line for the flood, not one per connection refused
    assert [r.getMessage() for r in caplog.records if "refusing gRPC connections" in r.getMessage()] == [
        "refusing gRPC connections: this server serves at most 2 connections at once (endpoints.max_connections)"]
    assert first.call(3, "/test.Echo/Unary", request("c")).replies()[0].id == "c"
    assert second.call(3, "/test.Echo/Unary", request("d")).replies()[0].id == "d"
