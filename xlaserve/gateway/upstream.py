"""The gateway's HTTP/2 client: one connection to one worker, many gRPC calls on it.

An :class:`Upstream` keeps a connection to a worker open (reconnecting with capped back-off when
it is lost) and multiplexes calls on it, at most ``max_streams`` at once; more wait in a queue,
in order. It speaks the same frames as the worker's server (:mod:`xlaserve.frontend.grpc_server`,
whose constants and ``frame`` it uses) and encodes header blocks with the same stateless HPACK
encoder, so a worker's decode cache answers every repeated block with one lookup.

A call is started with :meth:`Upstream.start` and a callback, not a task: the gateway's fast
ModelInfer path hands the request's bytes on from the client connection's reader, and the
callback answers the client from this connection's reader. What a call can end with:

- the worker's reply: :class:`Reply` (gRPC status, message, the response body's bytes);
- :class:`UpstreamError` with UNAVAILABLE: the connection was lost or refused, or the worker
  sent GOAWAY or RST_STREAM before answering (the call may or may not have run; it is not
  retried, so nothing runs twice);
- :class:`UpstreamError` with DEADLINE_EXCEEDED: no answer within the call's timeout (the
  stream is reset, so the worker drops the work if it has not started).

Flow control: requests larger than the worker's window wait for its WINDOW_UPDATEs; replies are
taken as they come (the gateway reads them at once), so this end advertises a large window and
returns it as DATA is consumed.
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import socket
import struct
from collections import deque
from collections.abc import Callable, Iterable
from typing import ContextManager
from dataclasses import dataclass

import trio
from grpclib.const import Status

from xlaserve.frontend.grpc_protocol import MESSAGE_PREFIX
from xlaserve.http2.frames import (
    ACK, CONTINUATION, DATA, DEFAULT_FRAME, DEFAULT_WINDOW, END_HEADERS, END_STREAM, ENABLE_PUSH, GOAWAY, HEADERS,
    INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS, MAX_FRAME_SIZE, PADDED, PING, PREFACE, PRIORITY_FLAG,
    REFUSED_STREAM, RST_STREAM, SETTINGS, WINDOW_UPDATE, CANCEL, frame,
)
from xlaserve.frontend.grpc_server import recv_into, room_to_read
from xlaserve.frontend.guard import LineLimiter, describe
from xlaserve.http2.hpack import Decoder, HPACKError, encode

log = logging.getLogger("xlaserve.gateway")

__all__ = ["Reply", "UpstreamError", "Upstream", "grpc_timeout", "status_named"]

OUR_WINDOW = 2**30                  # replies are consumed at once: a large window, returned as used
READ_SIZE = 256 * 1024              # the reply buffer at first (it grows for a longer frame)
MAX_REPLY_FRAME = 1 << 20           # the longest frame this end takes (SETTINGS_MAX_FRAME_SIZE)
TURN_EVERY = 16                     # reads from a worker between turns of the run loop, at most
_U32 = struct.Struct(">I")
_FRAME_HEADER = struct.Struct(">IBI")       # length (24 bits) and type, flags, stream id
_SETTING = struct.Struct(">HI")


@dataclass(slots=True)        # not frozen: made once per call, and a frozen init costs 3x
class Reply:
    """A worker's answer to one call: gRPC status and message, and the response body (the
    length-prefixed messages as sent)."""

    status: int
    message: str
    body: bytes

    def messages(self) -> list[bytes]:
        """The body cut into its messages (uncompressed; the gateway asks for no compression)."""
        out, pos = [], 0
        while pos + 5 <= len(self.body):
            _, length = MESSAGE_PREFIX.unpack_from(self.body, pos)
            out.append(self.body[pos + 5:pos + 5 + length])
            pos += 5 + length
        return out


class UpstreamError(Exception):
    """A call to a worker failed before the worker answered it (see the module docstring)."""

    def __init__(self, status: Status, message: str, *, unprocessed: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        #: the worker certainly did not run it (never sent, refused, or above a GOAWAY's last
        #: stream): safe to send to another worker
        self.unprocessed = unprocessed


def status_named(code: int) -> Status:
    """The gRPC status of a worker's ``grpc-status`` code; a code gRPC does not define is
    UNKNOWN (a client still gets exactly one answer)."""
    try:
        return Status(code)
    except ValueError:
        return Status.UNKNOWN


def grpc_timeout(seconds: float) -> str:
    """``seconds`` as a ``grpc-timeout`` header value (rounded up to the millisecond)."""
    ms = max(1, math.ceil(seconds * 1000))
    return f"{ms}m" if ms < 10**8 else f"{math.ceil(seconds)}S"


class _Call:
    __slots__ = ("id", "block", "data", "sent", "on_done", "deadline", "status", "message", "body",
                 "headers_seen", "done", "send_window", "on_message")

    def __init__(self, block: bytes, data: bytes, on_done: Callable[[Reply | UpstreamError], None],
                 deadline: float, on_message: Callable[[bytes], None] | None) -> None:
        self.id = 0
        self.block = block
        self.data = data
        self.sent = 0
        self.on_done = on_done
        self.on_message = on_message
        self.deadline = deadline
        self.status: int | None = None
        self.message = ""
        self.body = bytearray()
        self.headers_seen = False
        self.done = False
        self.send_window = 0


class Upstream:
    """A worker as the gateway's client of it. ``name`` names it in errors and metrics."""

    def __init__(self, name: str, host: str, port: int, *, max_streams: int = 32,
                 request_timeout: float = 60.0, connect_timeout: float = 5.0,
                 backoff_initial: float = 0.1, backoff_max: float = 5.0, server=None) -> None:
        self.name = name
        #: the gateway's GrpcServer: the client replies completed by one read from the worker
        #: are sent together when it ends (write_batch), and requests queued while the server
        #: handles a client's read go to the worker with one send when that read is done
        self._server = server
        self._batch: Callable[[], ContextManager] = server.write_batch if server is not None \
            else contextlib.nullcontext
        self._raw: socket.socket | None = None
        self._sending = False
        self._blocks: dict[tuple, bytes] = {}      # header blocks by (path, timeout, metadata)
        self.host = host
        self.port = port
        self.max_streams = max_streams
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.connected = trio.Event()     # replaced when the connection is lost
        self.up = False
        self.last_error = "not connected yet"
        self.outstanding = 0              # calls started and not yet answered (queued ones too)
        self.streaming = 0                # of those, server-streaming calls (the discovery's status stream)
        self.connects = 0
        self._authority = f"{host}:{port}"
        self._stream: trio.SocketStream | None = None
        self._out = bytearray()
        self._writer_wake = trio.Event()
        self._calls: dict[int, _Call] = {}
        self._queue: deque[_Call] = deque()
        self._blocked: deque[_Call] = deque()   # calls with data waiting for window
        self._next_id = 1
        self._peer_max_streams = 2**31 - 1
        self._peer_window = DEFAULT_WINDOW       # the worker's initial stream window
        self._peer_frame = DEFAULT_FRAME
        self._conn_window = DEFAULT_WINDOW       # what we may send on the connection
        self._consumed = 0                       # DATA received, not yet returned by WINDOW_UPDATE
        self._decoder = Decoder(max_header_list_size=1 << 20)
        self._header_sid = 0
        self._header_parts: list[bytes] = []
        self._header_flags = 0
        #: calls with the request timeout, in start (so deadline) order; ended ones leave the head
        self._in_order: deque[_Call] = deque()
        self._timers: list[tuple[float, int, _Call]] = []   # calls with a shorter timeout, a heap
        self._timer_at = math.inf               # when the timer task wakes next (unless woken)
        self._timer_seq = itertools.count()
        self._timer_wake = trio.Event()
        self._goaway = False
        self._retry = trio.Event()
        self._faults = LineLimiter(log)     # one line a second for connections that fail

    # ---- the caller's side ---------------------------------------------------------------
    def start(self, path: str, message: bytes, on_done: Callable[[Reply | UpstreamError], None], *,
              metadata: Iterable[tuple[str, str]] = (), timeout: float | None = None,
              on_message: Callable[[bytes], None] | None = None) -> _Call:
        """Call ``path`` with ``message`` (one serialized request message) and call
        ``on_done`` exactly once, on the Trio thread, with the outcome. ``timeout`` (seconds;
        ``math.inf`` for none) is told to the worker as ``grpc-timeout`` (a client's deadline);
        without it the upstream's request timeout applies here alone (the stream is reset when it
        passes), so that a worker's deadline-aware scheduling (``edf``) sees only the deadlines
        clients set.
        ``on_message``, for server-streaming methods, gets each response message as it arrives
        (the final :class:`Reply` then has an empty body). Returns a handle for :meth:`abort`."""
        usual = timeout is None
        if usual:
            timeout, wire_timeout = self.request_timeout, ""
        else:
            wire_timeout = "" if math.isinf(timeout) else grpc_timeout(timeout)
        metadata = tuple(metadata)
        key = (path, wire_timeout, metadata)
        block = self._blocks.get(key)
        if block is None:
            headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", self._authority),
                       ("content-type", "application/grpc"), ("te", "trailers")]
            if wire_timeout:
                headers.append(("grpc-timeout", wire_timeout))
            headers.extend(metadata)
            block = encode(headers)
            if len(self._blocks) >= 256:       # client deadlines vary: keep the cache small
                self._blocks.clear()
            self._blocks[key] = block
        call = _Call(block, MESSAGE_PREFIX.pack(0, len(message)) + message, on_done,
                     trio.current_time() + timeout, on_message)
        self.outstanding += 1
        self.streaming += on_message is not None
        if not self.up:
            self._finish(call, UpstreamError(Status.UNAVAILABLE, self._down_message(), unprocessed=True))
            return call
        if not math.isinf(timeout):
            if usual:       # the request timeout: deadlines come in start order, a queue keeps them sorted
                self._in_order.append(call)
            else:
                heapq.heappush(self._timers, (call.deadline, next(self._timer_seq), call))
            if call.deadline < self._timer_at:
                self._timer_wake.set()
        if len(self._calls) < min(self.max_streams, self._peer_max_streams):
            self._open(call)
        else:
            self._queue.append(call)
        return call

    async def request(self, path: str, message: bytes, *, metadata: Iterable[tuple[str, str]] = (),
                      timeout: float | None = None) -> Reply | UpstreamError:
        """:meth:`start` as a coroutine: the outcome. Cancelled, it resets the worker's stream."""
        done = trio.Event()
        box: list = []

        def on_done(outcome) -> None:
            box.append(outcome)
            done.set()
        handle = self.start(path, message, on_done, metadata=metadata, timeout=timeout)
        try:
            await done.wait()
        finally:
            if not handle.done:
                self.abort(handle)
        return box[0]

    async def unary(self, path: str, request, reply_type, *, timeout: float | None = None):
        """One unary call as a coroutine: the parsed reply, or UpstreamError (transport
        failures and non-OK statuses alike, with the worker's status and message)."""
        outcome = await self.request(path, request.SerializeToString(), timeout=timeout)
        if isinstance(outcome, UpstreamError):
            raise outcome
        if outcome.status != 0:
            raise UpstreamError(status_named(outcome.status), outcome.message)
        messages = outcome.messages()
        return reply_type.FromString(messages[0] if messages else b"")

    def _down_message(self) -> str:
        return f"worker {self.name} ({self._authority}) is not reachable: {self.last_error}"

    # ---- connection lifecycle ------------------------------------------------------------
    async def run(self) -> None:
        """Connect, serve the connection until it is lost, reconnect after a back-off; forever
        (cancel to stop)."""
        delay = self.backoff_initial
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._timer_loop)
            while True:
                try:
                    with trio.fail_after(self.connect_timeout):
                        stream = await trio.open_tcp_stream(self.host, self.port)
                except (OSError, trio.TooSlowError) as exc:
                    self.last_error = f"connect failed: {getattr(exc, 'strerror', None) or exc or 'timed out'}"
                    with trio.move_on_after(delay):
                        await self._retry.wait()
                    self._retry = trio.Event()
                    delay = min(delay * 2, self.backoff_max)
                    continue
                delay = self.backoff_initial
                try:
                    await self._serve(stream)
                except Exception as exc:
                    # Whatever ends this connection (a worker that sends what this end cannot
                    # parse, a bug) ends it alone: the calls on it fail UNAVAILABLE and the
                    # connection is made again, never reaching the gateway's nursery.
                    self.last_error = f"connection failed: {describe(exc)}"
                    self._faults.line(logging.ERROR, "gateway: the connection to worker %s at %s failed (%s); "
                                      "reconnecting", self.name, self._authority, describe(exc), exc=exc)
                finally:
                    self._lost()
                    with trio.CancelScope(shield=True):
                        await stream.aclose()
                await trio.sleep(self.backoff_initial)

    async def _serve(self, stream: trio.SocketStream) -> None:
        self._stream = stream
        self._reset_state()
        # the same descriptor as a plain socket, for a non-blocking send from the current task
        self._raw = socket.socket(fileno=stream.socket.fileno())
        self._out += PREFACE + frame(SETTINGS, 0, 0, b"".join(_SETTING.pack(k, v) for k, v in (
            (ENABLE_PUSH, 0), (INITIAL_WINDOW_SIZE, OUR_WINDOW), (MAX_FRAME_SIZE, MAX_REPLY_FRAME)))) \
            + frame(WINDOW_UPDATE, 0, 0, _U32.pack(OUR_WINDOW - DEFAULT_WINDOW))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer)
            self._writer_wake.set()
            self.up = True
            self.connects += 1
            self.last_error = ""
            self.connected.set()
            log.info("gateway: connected to worker %s at %s", self.name, self._authority)
            try:
                with _lost_as(self):
                    await self._read_loop()
            finally:
                nursery.cancel_scope.cancel()
                raw, self._raw = self._raw, None
                raw.detach()

    def _reset_state(self) -> None:
        self._next_id = 1
        self._peer_max_streams = 2**31 - 1
        self._peer_window = DEFAULT_WINDOW
        self._peer_frame = DEFAULT_FRAME
        self._conn_window = DEFAULT_WINDOW
        self._consumed = 0
        self._decoder = Decoder(max_header_list_size=1 << 20)
        self._header_sid = 0
        self._goaway = False
        self._out = bytearray()

    def _lost(self) -> None:
        """The connection ended: every call on it or waiting for it fails UNAVAILABLE."""
        was_up, self.up = self.up, False
        self.connected = trio.Event()
        if was_up:
            log.warning("gateway: lost worker %s at %s (%s)", self.name, self._authority, self.last_error)
        error = UpstreamError(Status.UNAVAILABLE, f"worker {self.name} ({self._authority}): {self.last_error}; "
                                                  "the request may or may not have run")
        calls, queued = list(self._calls.values()), list(self._queue)
        self._calls.clear()
        self._queue.clear()
        self._blocked.clear()
        for call in calls:
            self._finish(call, error)
        for call in queued:          # never sent
            self._finish(call, UpstreamError(Status.UNAVAILABLE, f"worker {self.name} ({self._authority}): "
                                             f"{self.last_error}", unprocessed=True))
        self._stream = None

    def reconnect_now(self) -> None:
        """Cut the back-off short: the worker is known to be up again (its supervisor says)."""
        self._retry.set()

    async def aclose(self) -> None:
        """Close the connection (the run task reconnects unless cancelled)."""
        if self._stream is not None:
            await self._stream.aclose()

    # ---- sending ---------------------------------------------------------------------------
    def _open(self, call: _Call) -> None:
        sid = call.id = self._next_id
        self._next_id += 2
        window = call.send_window = self._peer_window
        self._calls[sid] = call
        data, block = call.data, call.block
        n = len(data)
        if 0 < n <= window and n <= self._conn_window and n <= self._peer_frame:
            # the usual request: HEADERS and one DATA frame that ends the stream, in one append
            call.sent = n
            call.send_window -= n
            self._conn_window -= n
            pack = _FRAME_HEADER.pack
            self._out += b"".join((pack(len(block) << 8 | HEADERS, END_HEADERS, sid), block,
                                   pack(n << 8 | DATA, END_STREAM, sid), data))
        else:
            self._out += frame(HEADERS, END_HEADERS, sid, block)
            self._send_data(call)
        self._kick()

    def _kick(self) -> None:
        """Send what is queued: when the server's write batch ends if one is open, else now."""
        server = self._server
        if server is not None and server.holding:
            server.hold(self)
        else:
            self.flush()

    def flush(self) -> None:
        """One non-blocking send of what is queued; the writer task sends what the socket does
        not take (and everything while it is mid-send)."""
        if not self._out:
            return
        if self._raw is not None and not self._sending:
            try:
                sent = self._raw.send(self._out)
            except OSError:          # would block, or broken: the writer (and reader) find out
                sent = 0
            if sent == len(self._out):
                self._out.clear()
                return
            del self._out[:sent]
        self._writer_wake.set()

    def _send_data(self, call: _Call) -> None:
        data = call.data
        while call.sent < len(data):
            room = min(call.send_window, self._conn_window, self._peer_frame, len(data) - call.sent)
            if room <= 0:
                if call not in self._blocked:
                    self._blocked.append(call)
                return
            end = call.sent + room
            last = end == len(data)
            self._out += frame(DATA, END_STREAM if last else 0, call.id, data[call.sent:end])
            call.sent = end
            call.send_window -= room
            self._conn_window -= room
        if not data:
            self._out += frame(DATA, END_STREAM, call.id)

    async def _writer(self) -> None:
        stream = self._stream
        with _lost_as(self):
            while True:
                await self._writer_wake.wait()
                self._writer_wake = trio.Event()
                while self._out:
                    chunk, self._out = bytes(self._out), bytearray()
                    self._sending = True
                    try:
                        await stream.send_all(chunk)
                    finally:
                        self._sending = False
        await stream.aclose()           # the reader sees it and ends the connection

    # ---- receiving -------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        # One buffer, filled with recv_into (no allocation per read), grown for a frame longer
        # than it; DATA is handed on as views into it (copied once, into its call's body).
        raw = self._raw
        buffer = bytearray(READ_SIZE)
        view = memoryview(buffer)
        start = end = reads = 0
        unpack = _FRAME_HEADER.unpack_from
        handle = self._frame
        while True:
            # replies go out from here, with no task in between: a read that did not wait
            # yields a turn only now and then (every TURN_EVERY), so other connections are served
            reads += 1
            n = await recv_into(raw, view[end:], turn=not reads % TURN_EVERY)
            if not n:
                raise trio.BrokenResourceError("the worker closed the connection")
            end += n
            pos = start
            with self._batch():
                while end - pos >= 9:
                    lt, flags, sid = unpack(buffer, pos)
                    stop = pos + 9 + (lt >> 8)
                    if stop > end:
                        break
                    ftype = lt & 0xFF
                    # DATA is copied once, into its call's body; other frames become bytes
                    handle(ftype, flags, sid & 0x7FFFFFFF,
                           view[pos + 9:stop] if ftype == DATA else bytes(view[pos + 9:stop]))
                    pos = stop
                if self._out:
                    self._kick()
            if self._goaway and not self._calls:
                raise trio.BrokenResourceError("the worker sent GOAWAY (it is stopping)")
            if pos == end:
                start = end = 0
                continue
            start = pos
            need = 9 + (unpack(buffer, start)[0] >> 8) if end - start >= 9 else 9
            if need > MAX_REPLY_FRAME + 9:
                raise ValueError(f"the worker sent a frame of {need - 9} bytes; this end allows {MAX_REPLY_FRAME}")
            # grown for a frame longer than the buffer; else room made at the end
            buffer, view, start, end = room_to_read(buffer, view, start, end, need, max(len(buffer), need), 4096)

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            self._header_sid, self._header_flags, self._header_parts = sid, flags, [payload]
            if flags & END_HEADERS:
                self._on_headers()
        elif ftype == CONTINUATION:
            self._header_parts.append(payload)
            if flags & END_HEADERS:
                self._on_headers()
        elif ftype == SETTINGS:
            if not flags & ACK:
                self._on_settings(payload)
                self._out += frame(SETTINGS, ACK, 0)
        elif ftype == WINDOW_UPDATE:
            increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self._conn_window += increment
                blocked, self._blocked = self._blocked, deque()
                for call in blocked:
                    if not call.done:
                        self._send_data(call)
            else:
                call = self._calls.get(sid)
                if call is not None:
                    call.send_window += increment
                    if call in self._blocked:
                        self._blocked.remove(call)
                        self._send_data(call)
        elif ftype == PING:
            if not flags & ACK:
                self._out += frame(PING, ACK, 0, payload)
        elif ftype == RST_STREAM:
            call = self._calls.get(sid)
            if call is not None:
                code = _U32.unpack(payload)[0]
                # REFUSED_STREAM: the worker did no work for it (RFC 9113 8.7)
                self._end(call, UpstreamError(Status.UNAVAILABLE, f"worker {self.name} reset the stream "
                                                                  f"(HTTP/2 error code {code}) before answering",
                                              unprocessed=code == REFUSED_STREAM))
        elif ftype == GOAWAY:
            last = _U32.unpack_from(payload, 0)[0] & 0x7FFFFFFF
            self._goaway = True
            self.last_error = "the worker sent GOAWAY (it is stopping)"
            self.up = False        # no new calls here; those it will still answer finish
            for call in [c for s, c in self._calls.items() if s > last]:
                self._end(call, UpstreamError(Status.UNAVAILABLE, f"worker {self.name} is stopping and refused "
                                                                  "the request before running it", unprocessed=True))
            queued, self._queue = self._queue, deque()
            for call in queued:
                self._finish(call, UpstreamError(Status.UNAVAILABLE, self._down_message(), unprocessed=True))

    def _on_settings(self, payload: bytes) -> None:
        for i in range(0, len(payload) - len(payload) % 6, 6):
            key, value = _SETTING.unpack_from(payload, i)
            if key == INITIAL_WINDOW_SIZE:
                delta = value - self._peer_window
                self._peer_window = value
                for call in self._calls.values():
                    call.send_window += delta
            elif key == MAX_FRAME_SIZE:
                self._peer_frame = value
            elif key == MAX_CONCURRENT_STREAMS:
                self._peer_max_streams = value
        for call in list(self._blocked):
            self._blocked.remove(call)
            self._send_data(call)
        self._open_queued()

    def _on_headers(self) -> None:
        block = b"".join(self._header_parts)
        self._header_parts = []
        fields = self._decoder.decode(block)
        call = self._calls.get(self._header_sid)
        if call is None:
            return
        for name, value in fields:
            if name == "grpc-status":
                call.status = int(value) if value.isdigit() else Status.UNKNOWN.value
            elif name == "grpc-message":
                call.message = _percent_decode(value)
            elif name == ":status" and value != "200" and call.status is None:
                call.status = Status.UNAVAILABLE.value if value in ("502", "503", "504") else Status.UNKNOWN.value
                call.message = f"worker {self.name} answered HTTP {value}"
        call.headers_seen = True
        if self._header_flags & END_STREAM:
            self._end(call, None)

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        if flags & PADDED:
            payload = payload[1:len(payload) - payload[0]]
        self._consumed += len(payload)
        if self._consumed > OUR_WINDOW // 2:
            self._out += frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._consumed))
            self._consumed = 0
        call = self._calls.get(sid)
        if call is None:
            return
        call.body += payload
        if call.on_message is not None:
            # a stream's window is returned as its messages are taken (a unary reply never
            # comes near the 1 GiB this end advertises)
            if payload:
                self._out += frame(WINDOW_UPDATE, 0, sid, _U32.pack(len(payload)))
            self._deliver(call)
        if flags & END_STREAM:
            self._end(call, None)

    def _deliver(self, call: _Call) -> None:
        body = call.body
        pos = 0
        while len(body) - pos >= 5:
            _, length = MESSAGE_PREFIX.unpack_from(body, pos)
            if len(body) - pos < 5 + length:
                break
            call.on_message(bytes(body[pos + 5:pos + 5 + length]))
            pos += 5 + length
        if pos:
            del body[:pos]

    # ---- ending calls ----------------------------------------------------------------------
    def _end(self, call: _Call, error: UpstreamError | None) -> None:
        """``call``'s stream is over (answered, reset, timed out): free its slot, answer it."""
        if self._calls.get(call.id) is call:
            del self._calls[call.id]
        if call in self._blocked:
            self._blocked.remove(call)
        if error is None:
            if call.status is None:
                error = UpstreamError(Status.UNKNOWN if call.headers_seen else Status.UNAVAILABLE,
                                      f"worker {self.name} ended the call without a grpc-status")
        self._finish(call, error if error is not None else Reply(call.status, call.message, bytes(call.body)))
        self._open_queued()

    def _open_queued(self) -> None:
        limit = min(self.max_streams, self._peer_max_streams)
        while self._queue and len(self._calls) < limit and self.up:
            call = self._queue.popleft()
            if not call.done:
                self._open(call)

    def _finish(self, call: _Call, outcome: Reply | UpstreamError) -> None:
        if call.done:
            return
        call.done = True
        self.outstanding -= 1
        self.streaming -= call.on_message is not None
        on_done = call.on_done
        # what the call held goes now: its timer entry stays in the heap until its deadline
        # comes up or the heap is compacted
        call.data = call.block = b""
        call.body = bytearray()
        call.on_done = call.on_message = None
        in_order = self._in_order
        while in_order and in_order[0].done:
            in_order.popleft()
        # Ended calls wait in the deadline queues until they reach the front; past a bound set
        # by the calls still open (a call unanswered at the front keeps those behind it), the
        # ended ones are dropped.
        bound = 2 * self.outstanding + 2048
        if len(in_order) > bound:
            self._in_order = deque(c for c in in_order if not c.done)
        if len(self._timers) > bound:
            self._timers = [entry for entry in self._timers if not entry[2].done]
            heapq.heapify(self._timers)
        try:
            on_done(outcome)
        except Exception:     # a bug above must not take the worker's connection down
            log.exception("gateway: a call's completion callback failed")

    async def _timer_loop(self) -> None:
        """Fails calls whose timeout passed (DEADLINE_EXCEEDED; the stream is reset)."""
        while True:
            in_order = self._in_order       # (replaced when compacted)
            expired: list[_Call] = []
            now = trio.current_time()
            while in_order and (in_order[0].done or in_order[0].deadline <= now):
                expired.append(in_order.popleft())
            while self._timers and (self._timers[0][2].done or self._timers[0][0] <= now):
                expired.append(heapq.heappop(self._timers)[2])
            for call in expired:
                if not call.done:
                    self._give_up(call, UpstreamError(Status.DEADLINE_EXCEEDED, f"worker {self.name} did not "
                                                                                "answer within the request's timeout"))
            self._timer_wake = trio.Event()
            in_order = self._in_order       # (a give-up above may have compacted it)
            self._timer_at = min(in_order[0].deadline if in_order else math.inf,
                                 self._timers[0][0] if self._timers else math.inf)
            with trio.move_on_at(self._timer_at):
                await self._timer_wake.wait()

    def abort(self, call: _Call) -> None:
        """The client gave up on ``call`` (it reset its stream or hung up): reset the worker's
        stream so the worker drops the work if it has not run; ``on_done`` gets CANCELLED."""
        if not call.done:
            self._give_up(call, UpstreamError(Status.CANCELLED, "the client cancelled the request"))

    def _give_up(self, call: _Call, error: UpstreamError) -> None:
        """End ``call`` with ``error`` before the worker answered: its stream is reset (the
        worker drops the work if it has not run), or it leaves the queue."""
        if self._calls.get(call.id) is call:
            self._out += frame(RST_STREAM, 0, call.id, _U32.pack(CANCEL))
            self._kick()
            self._end(call, error)
        else:
            try:
                self._queue.remove(call)
            except ValueError:
                pass
            self._finish(call, error)


class _lost_as:
    """Within it, a broken or malformed connection is recorded as ``upstream.last_error`` and
    ends the block quietly (the caller then ends the connection)."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None or not isinstance(exc, (OSError, trio.BrokenResourceError, trio.ClosedResourceError,
                                               HPACKError, ValueError, struct.error)):
            return False
        if not self.upstream.last_error:
            self.upstream.last_error = f"connection lost: {exc or type(exc).__name__}"
        return True


def _percent_decode(value: str) -> str:
    """A grpc-message value (percent-encoded UTF-8) as text."""
    if "%" not in value:
        return value
    from urllib.parse import unquote
    return unquote(value, encoding="utf-8", errors="replace")
