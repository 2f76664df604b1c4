"""gRPC over HTTP/2 (RFC 9113), served from Trio by xlaserve itself.

Why not grpclib: per request, grpclib's HTTP/2 stack (h2, hpack, its stream objects, one asyncio
task each) and the asyncio <-> Trio guest-run hand-offs cost about two thirds of the worker's
CPU; see "Why xlaserve speaks HTTP/2 itself" in docs/architecture.md for the numbers. This module
does only what gRPC needs, with the gRPC clients' usual traffic on a short path:

- A connection is two Trio tasks: a reader that parses frames as they arrive and a writer that
  sends whatever accumulated since its last send in one ``send_all`` (a batch of 32 replies is
  one write). Control frames (SETTINGS, PING, WINDOW_UPDATE acks) go out the same way.
- A call gets one Trio task once its request is complete (unary input) or its headers arrive
  (streaming input). The handler sees a grpclib-shaped stream: ``recv_message``,
  ``send_message``, ``deadline``, ``metadata``; a :class:`grpclib.exceptions.GRPCError` it
  raises becomes the call's status. Services are grpclib-generated bases, routed through their
  ``__mapping__``.
- Header blocks are decoded by :mod:`xlaserve.frontend.hpack` (which caches the repeated blocks
  gRPC clients send); responses use fixed, stateless header encodings.
- Flow control both ways: the peer's windows and frame size are honoured (a reply larger than
  the window waits for WINDOW_UPDATE); our receive windows are replenished as data is consumed.
- RST_STREAM from the client cancels the call's task (a task-free call runs its ``on_cancel``;
  so does every call of a connection that closes or breaks). :meth:`GrpcServer.close` stops accepting
  connections and sends GOAWAY; calls already started finish, new streams are refused.
- Request messages may be gzip/deflate compressed (``grpc-encoding``); replies are not.
  Decompressed bytes in flight are bounded per connection and over the server
  (:class:`~xlaserve.frontend.grpc_protocol.InflateBudget`), decided before inflating.

The gRPC layer above HTTP/2 (reading a request head and refusing what cannot be served, cutting a
body into messages, decompression, reply framing and trailers) is the sans-IO module
:mod:`xlaserve.frontend.grpc_protocol`; this module is HTTP/2 and the Trio driver around it.

Not supported: TLS, HTTP/1.1 upgrade (h2c with prior knowledge only), server push.
"""
from __future__ import annotations

import logging
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline

from xlaserve.errors import internal_message
from xlaserve.frontend.grpc_protocol import (
    CONNECTION_INFLATE_KEY, INFLATE_INLINE, MESSAGE_PREFIX, OK_TRAILERS, RESPONSE_HEADERS, SERVER_INFLATE_KEY,
    InflateBudget, InflatedMessage, Inflation, Refusal, cut_messages, framed, read_head, release_all, trailers,
)
from xlaserve.frontend.hpack import Decoder, HPACKError

log = logging.getLogger("xlaserve.grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types and flags (RFC 9113 section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20

# error codes (section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB

# settings identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384

# what we advertise
OUR_STREAMS = 4096
OUR_STREAM_WINDOW = 4 * 1024 * 1024
OUR_CONN_WINDOW = 16 * 1024 * 1024
OUR_MAX_FRAME = 1024 * 1024
OUR_HEADER_LIST = 65536
RECV_BYTES = 256 * 1024
READ_BUFFER = 4 * OUR_MAX_FRAME               # a connection's receive buffer
FLUSH_SECONDS = 5.0                        # a closing connection's last writes
DEFAULT_MAX_CONNECTIONS = 1024             # endpoints.max_connections
DEFAULT_MAX_CONNECTION_INFLATE = 16 * 1024 * 1024   # endpoints.max_connection_inflate_bytes
DEFAULT_MAX_INFLATE = 256 * 1024 * 1024             # endpoints.max_inflate_bytes
INFLATE_THREADS = 2

_FRAME_HEADER = struct.Struct(">IBI")     # length (24 bits) << 8 | type, flags, stream id
_U32 = struct.Struct(">I")
# gRPC's framing and fixed header blocks (grpc_protocol), under the names the hot path uses
_MESSAGE_PREFIX = MESSAGE_PREFIX
_RESPONSE_HEADERS = RESPONSE_HEADERS
_OK_TRAILERS = OK_TRAILERS


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME_HEADER.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


class ConnectionError_(Exception):
    """A connection error (RFC 9113 5.4.1): answered with GOAWAY, then the connection closes."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Call:
    """One gRPC call on one HTTP/2 stream; what a handler receives as its ``stream``."""

    __slots__ = ("conn", "id", "method", "metadata", "deadline", "encoding", "body", "messages",
                 "remote_closed", "started", "headers_sent", "finished", "reset", "send_window", "pending",
                 "unacked", "arrived", "scope", "drained", "fast", "on_cancel")

    def __init__(self, conn: "Connection", stream_id: int, method, metadata: dict[str, str],
                 deadline: Deadline | None, encoding: str) -> None:
        self.conn = conn
        self.id = stream_id
        self.method = method            # grpclib.const.Handler
        self.metadata = metadata
        self.deadline = deadline
        self.encoding = encoding
        self.body = bytearray()         # request bytes not yet cut into messages
        self.messages: deque = deque()  # request payloads not yet parsed (bytes, views, InflatedMessage)
        self.remote_closed = False
        self.started = False
        self.headers_sent = False
        self.finished = False           # trailers queued; nothing more may be sent
        self.reset = False              # the client reset the stream
        self.send_window = conn.peer_initial_window
        self.pending: deque = deque()   # flow-controlled output waiting for window: bytes or trailers
        self.unacked = 0                # received bytes not yet returned by WINDOW_UPDATE
        self.arrived: trio.Event | None = None
        self.drained: trio.Event | None = None
        self.scope: trio.CancelScope | None = None
        self.fast = None                # the method's task-free entry point, if it has one
        #: Called once (Trio thread), with no arguments, when the call is cancelled: the client
        #: reset the stream, the server reset it, or the connection closed or broke. A task-free
        #: handler sets it to take back work it handed on; it is not called once the call ended.
        self.on_cancel: Callable[[], None] | None = None

    def cancel(self) -> None:
        """The stream is reset: nothing more is sent, and a handler still running is cancelled."""
        was_finished = self.finished
        self.reset = self.finished = True
        self.pending.clear()
        if self.scope is not None:
            self.scope.cancel()
        on_cancel, self.on_cancel = self.on_cancel, None
        if on_cancel is not None and not was_finished:
            try:
                on_cancel()
            except Exception:   # a bug in the layer above must not take the connection down
                log.exception("gRPC on_cancel callback failed")

    def complete(self, outcome) -> None:
        """End a task-free call (Trio thread only): ``outcome`` is the reply message or the
        exception that fails the call (anything with ``status`` and a message, or any other
        exception: INTERNAL). Ignored once the call has ended (client reset, connection gone)."""
        if self.finished:
            return
        conn = self.conn
        if isinstance(outcome, BaseException):
            status = getattr(outcome, "status", None)
            if isinstance(outcome, GRPCError):
                conn._finish(self, outcome.status, outcome.message)
            elif isinstance(status, Status):
                conn._finish(self, status, str(outcome))
            else:
                conn._finish(self, Status.INTERNAL, internal_message(outcome))
            return
        conn.reply_unary(self, outcome.SerializeToString())

    def parse(self, payload) -> Any:
        """The request message ``payload`` (bytes, a view, or an
        :class:`~xlaserve.frontend.grpc_protocol.InflatedMessage`, whose reservation of
        decompressed bytes ends here) as the method's request type."""
        if type(payload) is InflatedMessage:
            try:
                return self.parse(payload.data)
            finally:
                payload.release()
        try:
            return self.method.request_type.FromString(payload)
        except Exception as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, f"the request is not a valid "
                            f"{self.method.request_type.DESCRIPTOR.full_name} message: {exc}") from None

    # ---- the grpclib-shaped handler API ----------------------------------------------------
    async def recv_message(self) -> Any:
        """The next request message, or None once the client has sent them all."""
        while not self.messages:
            if self.remote_closed and self.id not in self.conn.inflating:   # else a message is on its way
                return None
            self.arrived = trio.Event()
            await self.arrived.wait()
        return self.parse(self.messages.popleft())

    async def send_message(self, message) -> None:
        self.conn.send_message(self, message.SerializeToString())
        if self.pending:   # back-pressure for streaming replies: wait until the window takes them
            self.drained = trio.Event()
            await self.drained.wait()


class Connection:
    def __init__(self, server: "GrpcServer", stream: trio.SocketStream) -> None:
        self.server = server
        self.sock = stream
        self.decoder = Decoder(max_header_list_size=OUR_HEADER_LIST)
        self.calls: dict[int, Call] = {}
        self.last_stream = 0
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.send_window = DEFAULT_WINDOW
        self.recv_unacked = 0
        # Request bytes held for calls (unfinished messages, messages a handler has not read)
        # are at most held_bound; the exact sum is taken only when the bound nears the limit.
        self.held_bound = 0
        self.out = bytearray()
        self.out_ready = trio.Event()
        self.sending = False                        # the writer task is inside send_all
        # The same socket (same file descriptor, detached before Trio closes it), for flush():
        # a non-blocking send from whichever task replied. Never used once stopping is set.
        self.raw = socket.socket(fileno=stream.socket.fileno())
        self.going_away = False
        self.stopping = False                       # no more output is queued once set
        self.read_scope = trio.CancelScope()
        self.blocked: dict[int, Call] = {}          # calls with output waiting for window
        self.continuation: tuple[int, int, bytearray] | None = None
        self.nursery: trio.Nursery | None = None
        #: decompressed request bytes this connection holds (messages not yet parsed)
        self.inflate = InflateBudget(server.max_connection_inflate_bytes, CONNECTION_INFLATE_KEY, server.inflate)
        #: calls whose next message is being inflated in a worker thread, by stream id
        self.inflating: dict[int, Inflation] = {}
        # The head of the last header block that opened a call: a client repeats its block, and
        # the HPACK decoder then returns the very same field tuple, so the head is read once.
        self.last_fields: tuple | None = None
        self.last_head = None

    # ---- tasks ---------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._write_loop)
                with self.read_scope:
                    try:
                        await self._read_loop()
                    except ConnectionError_ as exc:
                        log.info("closing a gRPC connection: %s", exc)
                        self._write(frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(exc.code)
                                          + str(exc).encode()[:256]))
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                # The peer is gone, misbehaved, or a graceful close found no call open: cancel
                # what is left, let the writer send what is queued (bounded), then close.
                for call in list(self.calls.values()):
                    call.cancel()
                self.calls.clear()
                self.stopping = True
                self.out_ready.set()
                nursery.cancel_scope.deadline = trio.current_time() + FLUSH_SECONDS
        finally:
            self.stopping = True
            self.inflate.close()
            self.raw.detach()
            with trio.CancelScope(shield=True):
                await self.sock.aclose()

    async def _write_loop(self) -> None:
        sock = self.sock
        while True:
            if not self.out:
                if self.stopping:
                    return
                self.out_ready = trio.Event()
                await self.out_ready.wait()
                continue
            data, self.out = self.out, bytearray()
            self.sending = True
            try:
                await sock.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.stopping = True
                self.read_scope.cancel()
                return
            finally:
                self.sending = False

    def _write(self, data: bytes) -> None:
        if self.stopping:
            return
        self.out += data
        server = self.server
        if server.holding:
            server.dirty[self] = None       # sent when the write batch ends
        else:
            self.out_ready.set()

    def flush(self) -> None:
        """Send what is queued now, with one non-blocking send; whatever the socket does not
        take (or anything queued while the writer task is mid-send) is left to the writer."""
        if not self.out:
            return
        if not (self.sending or self.stopping):
            try:
                sent = self.raw.send(self.out)
            except OSError:             # would block, or a broken socket: the writer finds out
                sent = 0
            if sent == len(self.out):
                self.out.clear()
                return
            del self.out[:sent]
        self.out_ready.set()

    async def _read_loop(self) -> None:
        sock = self.sock
        buf = bytearray()
        while len(buf) < len(PREFACE):
            chunk = await sock.receive_some(RECV_BYTES)
            if not chunk:
                return
            buf += chunk
        if buf[:len(PREFACE)] != PREFACE:
            raise ConnectionError_(PROTOCOL_ERROR, "the client did not open with the HTTP/2 connection preface "
                                                   "(xlaserve serves gRPC over cleartext HTTP/2 only)")
        del buf[:len(PREFACE)]
        self._write(frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in (
            (MAX_CONCURRENT_STREAMS, OUR_STREAMS), (INITIAL_WINDOW_SIZE, OUR_STREAM_WINDOW),
            (MAX_FRAME_SIZE, OUR_MAX_FRAME), (MAX_HEADER_LIST_SIZE, OUR_HEADER_LIST))))
                    + frame(WINDOW_UPDATE, 0, 0, _U32.pack(OUR_CONN_WINDOW - DEFAULT_WINDOW)))
        # One fixed buffer per connection, filled with recv_into: no allocation per read. DATA
        # payloads are handed on as views into it (copied once, into their call's body); other
        # frames as bytes.
        buffer = bytearray(READ_BUFFER)
        view = memoryview(buffer)
        start, end = 0, len(buf)
        buffer[:end] = buf
        recv_into = sock.socket.recv_into
        unpack = _FRAME_HEADER.unpack_from
        handle = self._frame
        batch = self.server.write_batch
        while True:
            pos = start
            with batch():       # replies, acks and window updates of one read go out in one send
                while end - pos >= 9:
                    lt, flags, stream_id = unpack(buffer, pos)
                    length = lt >> 8
                    stop = pos + 9 + length
                    if length > OUR_MAX_FRAME:
                        raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes exceeds the "
                                                                 f"{OUR_MAX_FRAME} this server advertised")
                    if stop > end:
                        break
                    ftype = lt & 0xFF
                    handle(ftype, flags, stream_id & 0x7FFFFFFF,
                           view[pos + 9:stop] if ftype == DATA else bytes(view[pos + 9:stop]))
                    pos = stop
            start = pos
            if self.going_away and not self.calls:
                return
            if start == end:
                start = end = 0
            elif READ_BUFFER - end < OUR_MAX_FRAME + 9:   # make room for a whole frame
                buffer[:end - start] = bytes(view[start:end])
                start, end = 0, end - start
            n = await recv_into(view[end:])
            if not n:
                return
            end += n

    # ---- incoming frames -------------------------------------------------------------------
    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self.continuation is not None and ftype != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "a header block was interrupted by another frame")
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif ftype == PING:
            if sid != 0 or len(payload) != 8:
                raise ConnectionError_(PROTOCOL_ERROR if sid else FRAME_SIZE_ERROR, "malformed PING frame")
            if not flags & ACK:
                self._write(frame(PING, ACK, 0, payload))
        elif ftype == SETTINGS:
            self._on_settings(flags, sid, payload)
        elif ftype == RST_STREAM:
            if sid == 0 or len(payload) != 4:
                raise ConnectionError_(PROTOCOL_ERROR, "malformed RST_STREAM frame")
            if sid > self.last_stream:
                raise ConnectionError_(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            call = self.calls.get(sid)
            if call is not None:
                call.cancel()
                self._forget(call)
        elif ftype == CONTINUATION:
            if self.continuation is None or self.continuation[0] != sid:
                raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without a header block in progress")
            self.continuation[2].extend(payload)
            if flags & END_HEADERS:
                sid, first_flags, block = self.continuation
                self.continuation = None
                self._on_header_block(first_flags, sid, bytes(block))
        elif ftype == GOAWAY:
            self.going_away = True
        elif ftype == PRIORITY:
            if len(payload) != 5:
                raise ConnectionError_(FRAME_SIZE_ERROR, "PRIORITY frame is not 5 bytes")
        elif ftype == PUSH_PROMISE:
            raise ConnectionError_(PROTOCOL_ERROR, "clients must not send PUSH_PROMISE")
        # unknown frame types are ignored (section 4.1)

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS ack with a payload")
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6 bytes")
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, i)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, f"INITIAL_WINDOW_SIZE {value} is above 2^31-1")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self.calls.values():
                    call.send_window += delta
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 2**24 - 1:
                    raise ConnectionError_(PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value} is outside 16384..2^24-1")
                self.peer_max_frame = value
            elif key == ENABLE_PUSH and value > 1:
                raise ConnectionError_(PROTOCOL_ERROR, f"ENABLE_PUSH {value} is not 0 or 1")
            # HEADER_TABLE_SIZE: our encoder never uses the dynamic table; the rest are advisory
        self._write(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE is not 4 bytes")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if increment == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "the connection's send window exceeds 2^31-1")
        else:
            call = self.calls.get(sid)
            if call is None:
                return
            if increment == 0:
                self._reset(call, PROTOCOL_ERROR)
                return
            call.send_window += increment
        self._flush_blocked()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS on stream 0")
        start, stop = 0, len(payload)
        if flags & PADDED:
            pad = payload[0] if payload else 256
            start, stop = 1, stop - pad
        if flags & PRIORITY_FLAG:
            start += 5
        if stop < start:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS padding exceeds the frame")
        block = payload[start:stop]
        if flags & END_HEADERS:
            self._on_header_block(flags, sid, block)
        else:
            self.continuation = (sid, flags, bytearray(block))

    def _on_header_block(self, flags: int, sid: int, block: bytes) -> None:
        try:
            headers = self.decoder.decode(block)
        except HPACKError as exc:
            raise ConnectionError_(COMPRESSION_ERROR, f"bad header block: {exc}") from None
        if not sid & 1:
            raise ConnectionError_(PROTOCOL_ERROR, f"client stream ids are odd; got {sid}")
        call = self.calls.get(sid)
        if call is not None:                                 # trailers from the client
            if not flags & END_STREAM:
                raise ConnectionError_(PROTOCOL_ERROR, f"second HEADERS on stream {sid} without END_STREAM")
            self._end_of_request(call)
            return
        if sid <= self.last_stream:
            if flags & END_STREAM:
                return                    # trailers of a call we already answered and reset
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS opening stream {sid} after stream {self.last_stream}; "
                                                   "stream ids must increase")
        self.last_stream = sid
        if self.going_away or len(self.calls) >= OUR_STREAMS:
            self._write(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        self._new_call(flags, sid, headers)

    def _new_call(self, flags: int, sid: int, headers: tuple[tuple[str, str], ...]) -> None:
        if headers is self.last_fields:
            head = self.last_head
        else:
            server = self.server
            head = read_head(headers, server.methods, server.service_names)
            if head is None:
                # RFC 9113 8.2.1: a field with an empty name makes the request malformed, a
                # stream error; nothing of it was registered, so a reset is all there is to do
                self._write(frame(RST_STREAM, 0, sid, _U32.pack(PROTOCOL_ERROR)))
                return
            self.last_fields, self.last_head = headers, head
        path = head.path
        method = self.server.methods.get(path)
        call = Call(self, sid, method, head.metadata, None, head.encoding)
        call.fast = self.server.fast.get(path)
        self.calls[sid] = call
        if flags & END_STREAM:
            call.remote_closed = True
        verdict = head.verdict
        if verdict is not None:
            if type(verdict) is Refusal:
                self._refuse(call, verdict)
                return
            call.deadline = Deadline.from_timeout(verdict)
        if call.remote_closed:
            self._end_of_request(call)      # no request message at all
        elif method.cardinality.value.client_streaming:
            self._start(call)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if sid == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        self.recv_unacked += length
        if self.recv_unacked >= OUR_CONN_WINDOW // 2:
            self._write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.recv_unacked)))
            self.recv_unacked = 0
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_stream:
                raise ConnectionError_(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return                      # a stream we already answered or reset
        if call.remote_closed:
            self._reset(call, STREAM_CLOSED)
            return
        if flags & PADDED:
            pad = payload[0] if payload else 256
            if pad >= length:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA padding exceeds the frame")
            payload = payload[1:length - pad]
        if not call.finished:
            self.held_bound += length
            if self.held_bound > self.server.max_held_bytes and not self._may_hold(call, length):
                return
            call.body += payload
            self._cut_messages(call)
        if flags & END_STREAM:
            self._end_of_request(call)
        else:
            call.unacked += length
            if call.unacked >= OUR_STREAM_WINDOW // 2:
                self._write(frame(WINDOW_UPDATE, 0, sid, _U32.pack(call.unacked)))
                call.unacked = 0

    def _may_hold(self, call: Call, length: int) -> bool:
        """Whether ``length`` more request bytes for ``call`` stay within the server's
        ``max_held_bytes`` for this connection; if not, the call fails with RESOURCE_EXHAUSTED
        and lets go of what it held. Without this a client could make the server buffer up to
        its stream limit times the largest message."""
        held = sum(len(c.body) + sum(map(len, c.messages)) for c in self.calls.values())
        self.held_bound = held + length
        limit = self.server.max_held_bytes
        if held + length <= limit:
            return True
        self.held_bound = held - len(call.body) - sum(map(len, call.messages))
        unfinished = sum(1 for c in self.calls.values() if c.body or c.messages or c is call)
        call.body = bytearray()
        release_all(call.messages)
        call.messages.clear()
        self._fail(call, Status.RESOURCE_EXHAUSTED, self.server.too_much_held(held + length, limit, unfinished))
        return False

    def _cut_messages(self, call: Call) -> None:
        """Move complete length-prefixed messages from the call's body to its message queue
        (:func:`~xlaserve.frontend.grpc_protocol.cut_messages`); a bad one fails the call. A
        compressed message that inflates past INFLATE_INLINE bytes is finished in a worker
        thread, and the body waits behind it."""
        if self.inflating and call.id in self.inflating:
            return
        inflate = self.inflate
        inflated = inflate.used
        server = self.server
        try:
            call.body = cut_messages(call.body, call.messages, call.encoding, server.max_recv_bytes, inflate,
                                     server.too_large_request, INFLATE_INLINE)
        except GRPCError as exc:
            call.body = bytearray()
            self._fail(call, exc.status, exc.message)
        if inflate.used != inflated:                # a compressed message: its reservation is made
            self.held_bound += inflate.used - inflated       # what inflating added (an upper bound)
            messages = call.messages
            if messages and type(messages[-1]) is Inflation:
                inflation = self.inflating[call.id] = messages.pop()
                self.nursery.start_soon(self._inflate_in_thread, call, inflation)
        if call.arrived is not None and call.messages:
            call.arrived.set()

    async def _inflate_in_thread(self, call: Call, inflation: Inflation) -> None:
        """Finish a large compressed message in a worker thread (zlib lets go of the GIL while it
        inflates), so that this connection's other calls and every other connection are served
        meanwhile; then queue it and cut the rest of the call's body."""
        try:
            await trio.to_thread.run_sync(inflation.run, limiter=self.server.inflate_threads)
        except BaseException:
            inflation.cancel()
            raise
        finally:
            del self.inflating[call.id]
        if call.finished:                           # reset, failed or closed meanwhile
            inflation.cancel()
            return
        try:
            message = inflation.result()
        except GRPCError as exc:
            call.body = bytearray()
            self._fail(call, exc.status, exc.message)
            return
        call.messages.append(message)
        self._cut_messages(call)
        if call.remote_closed and not call.finished and call.id not in self.inflating:
            self._end_of_request(call)

    def _end_of_request(self, call: Call) -> None:
        call.remote_closed = True
        if call.finished:
            self._forget(call)
            return
        if self.inflating and call.id in self.inflating:
            return                      # ended by _inflate_in_thread once the message is inflated
        if call.body:
            self._fail(call, Status.INVALID_ARGUMENT, f"the request ends inside a message ({len(call.body)} "
                                                      "bytes after the last complete one)")
            return
        if call.arrived is not None:
            call.arrived.set()
        if not call.started:
            if not call.method.cardinality.value.client_streaming and len(call.messages) != 1:
                self._fail(call, Status.INVALID_ARGUMENT, f"a unary call carries exactly one request message; "
                                                          f"got {len(call.messages)}")
                return
            self._start(call)

    # ---- calls -----------------------------------------------------------------------------
    def _start(self, call: Call) -> None:
        call.started = True
        if call.fast is None:
            self.nursery.start_soon(self._run_call, call)
            return
        try:
            call.fast(call, call.parse(call.messages.popleft()))
        except GRPCError as exc:
            self._finish(call, exc.status, exc.message)
        except Exception as exc:
            log.exception("gRPC handler %s failed", call.fast.__qualname__)
            self._finish(call, Status.INTERNAL, internal_message(exc))

    async def _run_call(self, call: Call) -> None:
        status, message = Status.OK, None
        with trio.CancelScope() as scope:
            call.scope = scope
            if call.reset:
                return
            try:
                await call.method.func(call)
            except GRPCError as exc:
                status, message = exc.status, exc.message
            except Exception as exc:
                log.exception("gRPC handler %s failed", call.method.func.__qualname__)
                status, message = Status.INTERNAL, internal_message(exc)
        if scope.cancelled_caught or call.reset or self.stopping:
            return
        self._finish(call, status, message)

    def send_message(self, call: Call, data: bytes) -> None:
        """Queue one reply message of ``call`` (HEADERS first if this is the first)."""
        if call.finished:
            return
        limit = self.server.max_send_bytes
        if len(data) > limit:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, self.server.too_large_response(len(data), limit))
        message = framed(data)
        head = b""
        if not call.headers_sent:
            call.headers_sent = True
            head = frame(HEADERS, END_HEADERS, call.id, _RESPONSE_HEADERS)
        n = len(message)
        if not call.pending and n <= call.send_window and n <= self.send_window and n <= self.peer_max_frame:
            call.send_window -= n
            self.send_window -= n
            self._write(head + frame(DATA, 0, call.id, message))
            return
        if head:
            self._write(head)
        call.pending.append(message)
        self._flush_call(call)

    def reply_unary(self, call: Call, data: bytes) -> None:
        """The whole answer of a unary call: HEADERS, the message, OK trailers; one write when
        the windows allow (the common case)."""
        n = len(data) + 5
        if (call.headers_sent or call.pending or n > call.send_window or n > self.send_window
                or n > self.peer_max_frame or len(data) > self.server.max_send_bytes):
            try:
                self.send_message(call, data)
            except GRPCError as exc:
                self._finish(call, exc.status, exc.message)
                return
            self._finish(call, Status.OK, None)
            return
        call.headers_sent = call.finished = True
        call.send_window -= n
        self.send_window -= n
        sid = call.id
        pack = _FRAME_HEADER.pack
        self._write(b"".join((pack(len(_RESPONSE_HEADERS) << 8 | HEADERS, END_HEADERS, sid), _RESPONSE_HEADERS,
                              pack(n << 8 | DATA, 0, sid), _MESSAGE_PREFIX.pack(0, len(data)), data,
                              pack(len(_OK_TRAILERS) << 8 | HEADERS, END_HEADERS | END_STREAM, sid), _OK_TRAILERS)))
        if not call.remote_closed:
            self._write(frame(RST_STREAM, 0, sid, _U32.pack(NO_ERROR)))
        self._forget(call)

    def _finish(self, call: Call, status: Status, message: str | None) -> None:
        """End the call: trailers (or a trailers-only response) with its status."""
        if call.finished:
            return
        call.finished = True
        block = trailers(status, message)
        if not call.headers_sent:
            call.headers_sent = True
            block = _RESPONSE_HEADERS + block
        if call.pending:
            call.pending.append(("trailers", block))
            self._flush_call(call)
        else:
            self._send_trailers(call, block)

    def _fail(self, call: Call, status: Status, message: str) -> None:
        if call.scope is not None:
            call.scope.cancel()
        self._finish(call, status, message)

    def _refuse(self, call: Call, refusal: Refusal) -> None:
        """Answer a request its head already rules out (no handler has seen it)."""
        if refusal.http_status == 200:
            self._fail(call, refusal.status, refusal.message)
            return
        call.finished = call.headers_sent = True
        self._send_trailers(call, refusal.block())

    def _send_trailers(self, call: Call, block: bytes) -> None:
        self._write(self._header_frames(call.id, block, END_STREAM))
        if not call.remote_closed:   # answered early: the client need not send the rest
            self._write(frame(RST_STREAM, 0, call.id, _U32.pack(NO_ERROR)))
        self._forget(call)

    def _header_frames(self, sid: int, block: bytes, flags: int) -> bytes:
        size = self.peer_max_frame
        if len(block) <= size:
            return frame(HEADERS, flags | END_HEADERS, sid, block)
        parts = [frame(HEADERS, flags, sid, block[:size])]
        for i in range(size, len(block), size):
            last = i + size >= len(block)
            parts.append(frame(CONTINUATION, END_HEADERS if last else 0, sid, block[i:i + size]))
        return b"".join(parts)

    def _reset(self, call: Call, code: int) -> None:
        self._write(frame(RST_STREAM, 0, call.id, _U32.pack(code)))
        call.cancel()
        self._forget(call)

    def _forget(self, call: Call) -> None:
        if call.messages and self.inflate.used:
            release_all(call.messages)      # inflated messages no handler will parse
        self.calls.pop(call.id, None)
        self.blocked.pop(call.id, None)
        if call.drained is not None:
            call.drained.set()
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        """A closing connection with no call left stops reading, which ends it."""
        if self.going_away and not self.calls:
            self.read_scope.cancel()

    def _flush_call(self, call: Call) -> None:
        """Send as much of ``call``'s waiting output as the windows allow."""
        pending = call.pending
        while pending:
            item = pending[0]
            if isinstance(item, tuple):
                pending.popleft()
                self._send_trailers(call, item[1])
                return
            room = min(call.send_window, self.send_window, self.peer_max_frame)
            if room <= 0:
                self.blocked[call.id] = call
                return
            chunk = item[:room]
            call.send_window -= len(chunk)
            self.send_window -= len(chunk)
            self._write(frame(DATA, 0, call.id, chunk))
            if len(chunk) == len(item):
                pending.popleft()
            else:
                pending[0] = item[len(chunk):]
        self.blocked.pop(call.id, None)
        if call.drained is not None:
            call.drained.set()

    def _flush_blocked(self) -> None:
        for call in list(self.blocked.values()):
            if self.send_window <= 0:
                return
            self._flush_call(call)

    def go_away(self) -> None:
        """Graceful close: refuse new streams, finish the open ones, then close."""
        if not self.going_away:
            self.going_away = True
            self._write(frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(NO_ERROR)))
        self._maybe_idle()


class GrpcServer:
    """Serves grpclib-generated services (objects with ``__mapping__()``) on one TCP port.

    A service may also offer ``__fast_unary__()``: ``{path: fn(call, request)}`` for unary
    methods that should not cost a task per call. ``fn`` runs in the connection's reader as
    soon as the request is complete and must arrange for exactly one ``call.complete(outcome)``
    on the Trio thread (raising GRPCError from ``fn`` itself also ends the call)."""

    def __init__(self, services: Iterable[Any], *, max_recv_bytes: int = 2**31 - 1,
                 max_send_bytes: int = 2**31 - 1,
                 too_large_request: Callable[[int | str, int], str] | None = None,
                 too_large_response: Callable[[int, int], str] | None = None,
                 max_held_bytes: int = 2**30,
                 too_much_held: Callable[[int, int, int], str] | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_connection_inflate_bytes: int = DEFAULT_MAX_CONNECTION_INFLATE,
                 max_inflate_bytes: int = DEFAULT_MAX_INFLATE) -> None:
        self.methods: dict[str, Any] = {}
        self.fast: dict[str, Callable[[Call, Any], None]] = {}
        for service in services:
            self.methods.update(service.__mapping__())
            fast = getattr(service, "__fast_unary__", None)
            if fast is not None:
                self.fast.update(fast())
        self.service_names = sorted({path.split("/")[1] for path in self.methods})
        self.max_recv_bytes = max_recv_bytes
        self.max_send_bytes = max_send_bytes
        self.too_large_request = too_large_request or (
            lambda size, limit: f"the request message is {size} bytes; the limit is {limit}")
        self.too_large_response = too_large_response or (
            lambda size, limit: f"the response message is {size} bytes; the limit is {limit}")
        #: request bytes one connection may hold before they are handled (never less than
        #: one largest message): unfinished messages, and messages a streaming handler has
        #: not read yet. Past it the call whose DATA frame would cross it fails.
        self.max_held_bytes = max(max_held_bytes, max_recv_bytes + 5)
        self.too_much_held = too_much_held or (
            lambda held, limit, calls: f"this connection would hold {held} bytes of request data not yet handled "
                                       f"({calls} calls with unfinished messages); the limit is {limit}")
        #: open connections served at once; one more is sent SETTINGS and GOAWAY
        #: (ENHANCE_YOUR_CALM) and closed, while the open ones go on (each costs a read buffer)
        self.max_connections = max_connections
        #: decompressed request bytes held at once (messages inflated, not yet parsed), over
        #: all connections; each connection has its own ``max_connection_inflate_bytes`` too.
        #: A compressed message may inflate only to what both have left (and the message limit).
        self.max_connection_inflate_bytes = max_connection_inflate_bytes
        self.inflate = InflateBudget(max_inflate_bytes, SERVER_INFLATE_KEY)
        #: worker threads inflating large compressed messages at once (their bytes are reserved
        #: in the budgets before they wait here)
        self.inflate_threads = trio.CapacityLimiter(INFLATE_THREADS)
        self._refusals_logged_at: float | None = None
        self._connections: set[Connection] = set()
        self._listen_scope = trio.CancelScope()
        self._closing = False
        self._all_closed = trio.Event()
        self.port = 0
        self.holding = 0                                   # write_batch() depth
        self.dirty: dict[Connection, None] = {}           # connections written to while holding

    async def serve(self, host: str = "", port: int = 0, *, listeners: list[trio.SocketListener] | None = None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port``, or serve ``listeners`` already open, until :meth:`close`
        and every connection has ended. Reports the port served."""
        if listeners is None:
            listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            with self._listen_scope:
                task_status.started(self.port)
                await trio.serve_listeners(lambda s: self._connection(s), listeners, handler_nursery=nursery)
            for listener in listeners:
                await listener.aclose()
        self._all_closed.set()

    async def _connection(self, stream: trio.SocketStream) -> None:
        if self._closing:
            await stream.aclose()
            return
        if len(self._connections) >= self.max_connections:
            await self._refuse(stream)
            return
        conn = Connection(self, stream)
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception:   # a bug must cost this connection only, never the listener
            log.exception("a gRPC connection failed; it is closed, the server goes on")
        finally:
            self._connections.discard(conn)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """One connection too many: our preface (SETTINGS), then GOAWAY naming the limit, then
        close. Logged at most once a minute, since a flood of connections is when it happens."""
        message = f"this server serves at most {self.max_connections} connections at once (endpoints.max_connections)"
        now = trio.current_time()
        if self._refusals_logged_at is None or now - self._refusals_logged_at >= 60:
            self._refusals_logged_at = now
            log.warning("refusing gRPC connections: %s", message)
        with trio.move_on_after(FLUSH_SECONDS):
            try:
                await stream.send_all(frame(SETTINGS, 0, 0) + frame(
                    GOAWAY, 0, 0, _U32.pack(0) + _U32.pack(ENHANCE_YOUR_CALM) + message.encode()))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        with trio.CancelScope(shield=True):
            await stream.aclose()

    @contextmanager
    def write_batch(self) -> Iterator[None]:
        """Writes made inside are sent when the outermost batch ends, one non-blocking send per
        connection from the current task, instead of by each connection's writer task on a
        later turn of the run loop: replies to one execution leave together, without a hop."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
            if not self.holding and self.dirty:
                dirty, self.dirty = self.dirty, {}
                for conn in dirty:
                    conn.flush()

    def close(self) -> None:
        """Stop accepting connections; GOAWAY to every connection (open calls finish)."""
        self._closing = True
        self._listen_scope.cancel()
        for conn in list(self._connections):
            conn.go_away()

    async def wait_closed(self) -> None:
        """Return once every connection has closed (after :meth:`close`)."""
        await self._all_closed.wait()
