"""gRPC over HTTP/2 (RFC 9113), served from Trio by xlaserve itself, HTTP/2 by libnghttp2.

Why not grpclib: per request, grpclib's HTTP/2 stack (h2, hpack, its stream objects, one asyncio
task each) and the asyncio <-> Trio guest-run hand-offs cost about two thirds of the worker's
CPU; see "Why xlaserve speaks HTTP/2 itself" in docs/architecture.md for the numbers. The
protocol engine is libnghttp2 (the engine behind curl, Apache httpd and Node.js) through the
sans-IO ``ngh2`` binding: framing, HPACK, flow control both ways, stream states and the
protocol's validation are its, including its limits on floods (PING/SETTINGS acks queued,
CONTINUATION frames, RST_STREAM and "glitch" rates). The gRPC layer above it (paths,
``grpc-timeout``, message framing, compression, status trailers) is
:mod:`xlaserve.frontend.grpc_protocol`. This module is the Trio driver between them:

- A connection is two Trio tasks: a reader that feeds what arrives to the engine and handles
  the events it reports, and a writer that sends whatever the engine has ready in one ``send``
  (a batch of 32 replies is one write), waiting only while the socket is full.
- A call gets one Trio task once its request is complete (unary input) or its headers arrive
  (streaming input). The handler sees a grpclib-shaped stream: ``recv_message``,
  ``send_message``, ``deadline``, ``metadata``; a :class:`grpclib.exceptions.GRPCError` it
  raises becomes the call's status. Services are grpclib-generated bases, routed through their
  ``__mapping__``. Methods in a service's ``__fast_unary__`` get no task at all.
- RST_STREAM from the client cancels the call's task (a task-free call runs its ``on_cancel``;
  so does every call of a connection that closes or breaks). :meth:`GrpcServer.close` stops
  accepting connections and sends GOAWAY; calls already started finish, new streams are not
  processed.
- Request messages may be gzip/deflate compressed (``grpc-encoding``); replies are not.

Not supported: TLS, HTTP/1.1 upgrade (h2c with prior knowledge only), server push.
"""
from __future__ import annotations

import logging
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ngh2
import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline
from ngh2 import (ConnectionClosed, DataReceived, GoAwayReceived, RequestReceived, Setting, StreamClosed,
                  StreamReset, TrailersReceived, WindowUpdated)

from xlaserve.frontend.grpc_protocol import (
    OK_TRAILERS, RESPONSE_HEADERS, Refusal, check_head, cut_messages, framed, message_end, metadata_of, read_head, status_of,
    trailers,
)

log = logging.getLogger("xlaserve.grpc")

NO_ERROR, PROTOCOL_ERROR, ENHANCE_YOUR_CALM = 0x0, 0x1, 0xB

# what we advertise
OUR_STREAMS = 4096
OUR_STREAM_WINDOW = 4 * 1024 * 1024
OUR_CONN_WINDOW = 16 * 1024 * 1024
OUR_MAX_FRAME = 1024 * 1024
OUR_HEADER_LIST = 65536
# One read, at most: a connection's receive buffer, reused for every read. Large, so that the
# requests that arrived together (32 img_mean requests are 4.8 MB) reach the scheduler together.
READ_BUFFER = 4 * 1024 * 1024
FLUSH_SECONDS = 5.0                        # a closing connection's last writes

SETTINGS = {Setting.MAX_CONCURRENT_STREAMS: OUR_STREAMS, Setting.INITIAL_WINDOW_SIZE: OUR_STREAM_WINDOW,
            Setting.MAX_FRAME_SIZE: OUR_MAX_FRAME, Setting.MAX_HEADER_LIST_SIZE: OUR_HEADER_LIST}
# libnghttp2's own limits keep their defaults (ngh2 0.3.0's Configuration); the decoded header list
# is held to what we advertise.
ENGINE = ngh2.Configuration(max_inbound_header_list_size=OUR_HEADER_LIST)


def goaway_bytes(code: int, message: str, last_stream: int) -> bytes:
    """A server preface and GOAWAY, for a connection whose engine has already failed (a bad
    client preface, a flood): made by a fresh engine, so even this frame is not hand-written."""
    engine = ngh2.Connection(ngh2.Role.SERVER, ENGINE)
    engine.initiate_connection()
    engine.send_goaway(code, last_stream_id=last_stream, debug_data=message.encode()[:256])
    return engine.data_to_send()


@dataclass(frozen=True, slots=True)
class Route:
    """What serves one path, looked up once per request."""

    method: Any = None                  # grpclib.const.Handler; None for a path nobody serves
    fast: Callable[["Call", Any], None] | None = None    # its task-free entry point, if it has one
    streaming_input: bool = False       # client streaming: the handler starts with the headers


NO_ROUTE = Route()


class Call:
    """One gRPC call on one HTTP/2 stream; what a handler receives as its ``stream``."""

    __slots__ = ("conn", "id", "method", "fields", "_metadata", "deadline", "encoding", "body", "held", "need",
                 "messages",
                 "remote_closed", "started", "headers_sent", "finished", "reset", "arrived", "scope",
                 "drained", "fast", "streaming_input", "on_cancel")

    def __init__(self, conn: "Connection", stream_id: int, route: Route, fields: tuple, encoding: str) -> None:
        self.conn = conn
        self.id = stream_id
        self.method = route.method      # grpclib.const.Handler
        self.fast = route.fast          # the method's task-free entry point, if it has one
        self.streaming_input = route.streaming_input
        self.fields = fields            # the request's header fields, as received
        self._metadata: dict[str, str] | None = None
        self.deadline: Deadline | None = None
        self.encoding = encoding
        # The start of a request message not complete yet, as it arrived: joined once, when the
        # ``need`` bytes its prefix announces are all here (a 150 kB message in 16 kB DATA frames
        # is copied once, not grown frame by frame).
        self.body: list = []
        self.held = 0                   # bytes in body
        self.need = 0
        self.messages: deque = deque()  # decoded-later request payloads (bytes)
        self.remote_closed = False
        self.started = False
        self.headers_sent = False
        self.finished = False           # trailers queued; nothing more may be sent
        self.reset = False              # the client reset the stream
        self.arrived: trio.Event | None = None
        self.drained: trio.Event | None = None
        self.scope: trio.CancelScope | None = None
        #: Called once (Trio thread), with no arguments, when the call is cancelled: the client
        #: reset the stream, the server reset it, or the connection closed or broke. A task-free
        #: handler sets it to take back work it handed on; it is not called once the call ended.
        self.on_cancel: Callable[[], None] | None = None

    @property
    def metadata(self) -> dict[str, str]:
        """The request's header fields but pseudo-headers and content-type (decoded when first asked)."""
        if self._metadata is None:
            self._metadata = metadata_of(self.fields)
        return self._metadata

    def cancel(self) -> None:
        """The stream is reset: nothing more is sent, and a handler still running is cancelled."""
        was_finished = self.finished
        self.reset = self.finished = True
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
        if isinstance(outcome, BaseException):
            status, message, _ = status_of(outcome)
            self.conn._finish(self, status, message)
            return
        self.conn.reply_unary(self, outcome.SerializeToString())

    def parse(self, payload) -> Any:
        try:
            return self.method.request_type.FromString(payload)
        except Exception as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, f"the request is not a valid "
                            f"{self.method.request_type.DESCRIPTOR.full_name} message: {exc}") from None

    # ---- the grpclib-shaped handler API ----------------------------------------------------
    async def recv_message(self) -> Any:
        """The next request message, or None once the client has sent them all."""
        while not self.messages:
            if self.remote_closed:
                return None
            self.arrived = trio.Event()
            await self.arrived.wait()
        return self.parse(self.messages.popleft())

    async def send_message(self, message) -> None:
        conn = self.conn
        conn.send_message(self, message.SerializeToString())
        # back-pressure for streaming replies: wait until the engine has framed this one
        if not self.finished and conn.queued(self):
            self.drained = trio.Event()
            conn.draining[self.id] = self
            await self.drained.wait()


class Connection:
    def __init__(self, server: "GrpcServer", stream: trio.SocketStream) -> None:
        self.server = server
        self.sock = stream
        self.h2 = ngh2.Connection(ngh2.Role.SERVER, ENGINE)
        self.calls: dict[int, Call] = {}
        self.last_stream = 0
        # Request bytes held for calls (unfinished messages, messages a handler has not read)
        # are at most held_bound; the exact sum is taken only when the bound nears the limit.
        self.held_bound = 0
        self.out = bytearray()                      # taken from the engine, not yet sent
        self.out_ready = trio.Event()
        self.sending = False                        # the writer task waits for a full socket
        # The same socket (same file descriptor, detached before Trio closes it), for flush():
        # a non-blocking send from whichever task replied. Never used once stopping is set.
        self.raw = socket.socket(fileno=stream.socket.fileno())
        self.going_away = False
        self.opened = False                         # the engine has taken the client's first bytes
        self.closed = False                         # the engine ended the connection (or failed)
        self.stopping = False                       # no more output is taken once set
        self.read_scope = trio.CancelScope()
        self.draining: dict[int, Call] = {}         # streaming handlers waiting for their replies to go
        self.early: list[int] = []                  # answered before the request ended: reset once sent
        self.nursery: trio.Nursery | None = None

    # ---- tasks ---------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._write_loop)
                with self.read_scope:
                    try:
                        await self._read_loop()
                    except ngh2.ConnectionStateError:
                        pass                        # the engine had already ended the connection
                    except ngh2.NGH2Error as exc:
                        # the engine failed (a bad preface, a flood): it can send nothing more
                        code = ENHANCE_YOUR_CALM if isinstance(exc, ngh2.DenialOfServiceError) else PROTOCOL_ERROR
                        message = str(exc)
                        if not self.opened and type(exc) is ngh2.ConnectionProtocolError:
                            message = ("the client did not open with the HTTP/2 connection preface (xlaserve "
                                       "serves gRPC over cleartext HTTP/2 only)")
                        log.info("closing a gRPC connection: %s", message)
                        self.closed = True
                        self.out += goaway_bytes(code, message, self.last_stream)
                        self.out_ready.set()
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                # The peer is gone, misbehaved, or a graceful close found no call open: cancel
                # what is left, let the writer send what is queued (bounded), then close.
                for call in list(self.calls.values()):
                    call.cancel()
                self.calls.clear()
                self._take()
                self.stopping = True
                self.out_ready.set()
                nursery.cancel_scope.deadline = trio.current_time() + FLUSH_SECONDS
        finally:
            self.stopping = True
            self.raw.detach()
            with trio.CancelScope(shield=True):
                await self.sock.aclose()

    def _take(self) -> None:
        """Move what the engine has ready into ``out``; then what sending it changed."""
        if self.stopping:
            return
        try:
            data = self.h2.data_to_send()
        except ngh2.NGH2Error:      # the engine has failed; run() queued the last GOAWAY itself
            return
        if data:
            self.out += data
            events = self.h2.events()       # what sending did: streams closed, the connection ended
            if events:
                self._events(events)
            if not self.h2.want_read:      # GOAWAY both ways and no stream left, or a connection error
                self.closed = True
                self.read_scope.cancel()
        if self.early or self.draining:
            self._after_send()

    def _after_send(self) -> None:
        h2 = self.h2
        if self.early:
            early, self.early = self.early, []
            for sid in early:
                if self._queued(sid):
                    self.early.append(sid)
                    continue
                try:
                    h2.reset_stream(sid, NO_ERROR)   # the client need not send the rest
                except ngh2.NGH2Error:
                    pass
            self.out += h2.data_to_send()
        for sid, call in list(self.draining.items()):
            if call.finished or not self._queued(sid):
                del self.draining[sid]
                call.drained.set()

    def _queued(self, sid: int) -> int:
        try:
            return self.h2.queued_body_size(sid)
        except ngh2.NGH2Error:
            return 0

    def queued(self, call: Call) -> int:
        """Reply bytes of ``call`` the engine has not framed yet."""
        return self._queued(call.id)

    async def _write_loop(self) -> None:
        """Send what ``out`` and the engine hold, as the socket takes it. ``sending`` is set
        only while the socket is full, so a write batch sends itself whenever it can."""
        raw = self.raw
        while True:
            if not self.out:
                self._take()
            if not self.out:
                if self.stopping:
                    return
                self.out_ready = trio.Event()
                await self.out_ready.wait()
                continue
            try:
                sent = raw.send(self.out)
            except BlockingIOError:
                sent = 0
            except OSError:             # the peer is gone
                self.stopping = True
                self.read_scope.cancel()
                return
            del self.out[:sent]
            if self.out:
                self.sending = True
                try:
                    await trio.lowlevel.wait_writable(raw)
                finally:
                    self.sending = False
            else:
                await trio.lowlevel.checkpoint()

    def _wrote(self) -> None:
        """The engine has something to send."""
        server = self.server
        if server.holding:
            server.dirty[self] = None       # sent when the write batch ends
        else:
            self.out_ready.set()

    def flush(self) -> None:
        """Send what is ready now, with one non-blocking send; whatever the socket does not
        take (or anything ready while the writer task is mid-send) is left to the writer."""
        if self.sending or self.stopping:
            self.out_ready.set()
            return
        self._take()
        if not self.out:
            return
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
        h2 = self.h2
        h2.initiate_connection(SETTINGS)
        h2.set_local_window_size(OUR_CONN_WINDOW)
        self._wrote()
        buffer = bytearray(READ_BUFFER)
        view = memoryview(buffer)
        recv_into = self.sock.socket.recv_into
        receive = h2.receive_data
        events = h2.events
        handle = self._events
        server = self.server
        while True:
            n = await recv_into(buffer)
            if not n:
                return
            # One write batch per read (server.write_batch(), spelled out: this runs per request
            # at c=1): its replies, acks and window updates go out in one send.
            server.holding += 1
            try:
                receive(view[:n])
                self.opened = True
                handle(events())
                self._wrote()
            finally:
                server.end_batch()
            if self.closed or self.going_away and not self.calls:
                return

    # ---- what the engine reports -----------------------------------------------------------
    def _events(self, events: list) -> None:
        calls = self.calls
        for event in events:
            kind = type(event)
            if kind is DataReceived:
                call = calls.get(event.stream_id)
                if call is not None:
                    if not call.finished:
                        self._take_data(call, event.data)
                    if event.end_stream:
                        self._end_of_request(call)
            elif kind is RequestReceived:
                self._on_request(event.stream_id, event.headers, event.end_stream)
            elif kind is WindowUpdated:
                pass                            # the engine sends what the window now allows
            elif kind is StreamClosed or kind is StreamReset:
                call = calls.pop(event.stream_id, None)
                if call is not None:
                    if not call.finished:
                        call.cancel()
                    elif call.scope is not None:
                        call.scope.cancel()     # answered (a failure) while its handler still ran
                    self._forget(call)
            elif kind is TrailersReceived:
                call = calls.get(event.stream_id)
                if call is not None:
                    self._end_of_request(call)
            elif kind is GoAwayReceived:
                self.going_away = True
            elif kind is ConnectionClosed:
                if event.error_code:
                    log.info("closing a gRPC connection: HTTP/2 error %d: %s", event.error_code,
                             event.debug_data.decode("utf-8", "replace"))
                self.closed = True
                return
        if self.draining:
            self._after_send()

    def _on_request(self, sid: int, fields, end_stream: bool) -> None:
        self.last_stream = sid
        head = read_head(fields)
        server = self.server
        route = server.routes.get(head.path, NO_ROUTE)
        call = Call(self, sid, route, fields, head.encoding)
        if end_stream:
            call.remote_closed = True
        self.calls[sid] = call
        checked = check_head(head, route.method is not None, server.service_names)
        if checked.__class__ is Refusal:
            self._refuse(call, checked)
            return
        if checked is not None:
            call.deadline = Deadline.from_timeout(checked)
        if call.remote_closed:
            self._end_of_request(call)      # no request message at all
        elif route.streaming_input:
            self._start(call)

    def _take_data(self, call: Call, data: bytes) -> None:
        """Add ``data`` to ``call``'s request: complete messages go to its queue; a request over
        a limit, or one the call cannot decompress, fails the call."""
        length = len(data)
        self.held_bound += length
        server = self.server
        if self.held_bound > server.max_held_bytes and not self._may_hold(call, length):
            return
        if call.held:
            call.body.append(data)
            call.held += length
            if call.held < call.need:
                return
            data = b"".join(call.body)
            call.body, call.held = [], 0
        try:
            messages, rest = cut_messages(data, call.encoding, server.max_recv_bytes, server.too_large_request)
        except GRPCError as exc:
            self._fail(call, exc.status, exc.message)
            return
        if rest:
            call.body, call.held, call.need = [rest], len(rest), message_end(rest)
        if messages:
            call.messages.extend(messages)
            if call.arrived is not None:
                call.arrived.set()

    def _may_hold(self, call: Call, length: int) -> bool:
        """Whether ``length`` more request bytes for ``call`` stay within the server's
        ``max_held_bytes`` for this connection; if not, the call fails with RESOURCE_EXHAUSTED
        and lets go of what it held. Without this a client could make the server buffer up to
        its stream limit times the largest message."""
        held = sum(c.held + sum(map(len, c.messages)) for c in self.calls.values())
        self.held_bound = held + length
        limit = self.server.max_held_bytes
        if held + length <= limit:
            return True
        self.held_bound = held - call.held - sum(map(len, call.messages))
        unfinished = sum(1 for c in self.calls.values() if c.held or c.messages or c is call)
        call.body, call.held = [], 0
        call.messages.clear()
        self._fail(call, Status.RESOURCE_EXHAUSTED, self.server.too_much_held(held + length, limit, unfinished))
        return False

    def _end_of_request(self, call: Call) -> None:
        call.remote_closed = True
        if call.finished:
            return
        if call.held:
            self._fail(call, Status.INVALID_ARGUMENT, f"the request ends inside a message ({call.held} "
                                                      "bytes after the last complete one)")
            return
        if call.arrived is not None:
            call.arrived.set()
        if not call.started:
            if not call.streaming_input and len(call.messages) != 1:
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
        except Exception as exc:
            status, message, expected = status_of(exc)
            if not expected:
                log.exception("gRPC handler %s failed", call.fast.__qualname__)
            self._finish(call, status, message)

    async def _run_call(self, call: Call) -> None:
        status, message = Status.OK, None
        with trio.CancelScope() as scope:
            call.scope = scope
            if call.finished:           # reset, or failed before its handler started
                return
            try:
                await call.method.func(call)
            except GRPCError as exc:
                status, message = exc.status, exc.message
            except Exception as exc:
                log.exception("gRPC handler %s failed", call.method.func.__qualname__)
                status, message = Status.INTERNAL, status_of(exc)[1]
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
        h2 = self.h2
        try:
            if not call.headers_sent:
                call.headers_sent = True
                h2.send_response(call.id, RESPONSE_HEADERS)
            h2.send_data(call.id, framed(data))
        except ngh2.NGH2Error:      # the stream or the connection is gone
            call.cancel()
            return
        self._wrote()

    def reply_unary(self, call: Call, data: bytes) -> None:
        """The whole answer of a unary call: HEADERS, the message, OK trailers."""
        if call.finished:
            return
        if call.headers_sent or len(data) > self.server.max_send_bytes:
            try:
                self.send_message(call, data)
            except GRPCError as exc:
                self._finish(call, exc.status, exc.message)
                return
            self._finish(call, Status.OK, None)
            return
        call.headers_sent = call.finished = True
        h2 = self.h2
        sid = call.id
        try:
            h2.send_response(sid, RESPONSE_HEADERS)
            h2.send_data(sid, framed(data))
            h2.send_trailers(sid, OK_TRAILERS)
        except ngh2.NGH2Error:
            call.cancel()
            return
        self._ended(call)

    def _finish(self, call: Call, status: Status, message: str | None) -> None:
        """End the call: trailers (or a trailers-only response) with its status."""
        if call.finished:
            return
        call.finished = True
        fields = trailers(status, message)
        h2 = self.h2
        try:
            if call.headers_sent:
                h2.send_trailers(call.id, fields)
            else:
                call.headers_sent = True
                h2.send_response(call.id, RESPONSE_HEADERS + fields, end_stream=True)
        except ngh2.NGH2Error:
            call.cancel()
            return
        self._ended(call)

    def _refuse(self, call: Call, refusal: Refusal) -> None:
        call.finished = call.headers_sent = True
        try:
            self.h2.send_response(call.id, refusal.fields(), end_stream=True)
        except ngh2.NGH2Error:
            call.cancel()
            return
        self._ended(call)

    def _fail(self, call: Call, status: Status, message: str) -> None:
        if call.scope is not None:
            call.scope.cancel()
        self._finish(call, status, message)

    def _ended(self, call: Call) -> None:
        """``call``'s answer is queued in full."""
        if call.remote_closed:
            self.calls.pop(call.id, None)
            self._forget(call)
        else:
            self.early.append(call.id)
        self._wrote()

    def _forget(self, call: Call) -> None:
        self.draining.pop(call.id, None)
        if call.drained is not None:
            call.drained.set()
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        """A closing connection with no call left stops reading, which ends it."""
        if self.going_away and not self.calls:
            self.read_scope.cancel()

    def go_away(self) -> None:
        """Graceful close: refuse new streams, finish the open ones, then close."""
        if not self.going_away:
            self.going_away = True
            try:
                self.h2.send_goaway(NO_ERROR, last_stream_id=self.last_stream)
            except ngh2.NGH2Error:
                pass
            self._wrote()
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
                 too_much_held: Callable[[int, int, int], str] | None = None) -> None:
        methods: dict[str, Any] = {}
        fast: dict[str, Callable[[Call, Any], None]] = {}
        for service in services:
            methods.update(service.__mapping__())
            offered = getattr(service, "__fast_unary__", None)
            if offered is not None:
                fast.update(offered())
        self.routes: dict[str, Route] = {
            path: Route(method, fast.get(path), method.cardinality.value.client_streaming)
            for path, method in methods.items()}
        self.service_names = sorted({path.split("/")[1] for path in methods})
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
        conn = Connection(self, stream)
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception:   # a bug must cost this connection only, never the listener
            log.exception("a gRPC connection failed; it is closed, the server goes on")
        finally:
            self._connections.discard(conn)

    @contextmanager
    def write_batch(self) -> Iterator[None]:
        """Writes made inside are sent when the outermost batch ends, one non-blocking send per
        connection from the current task, instead of by each connection's writer task on a
        later turn of the run loop: replies to one execution leave together, without a hop."""
        self.holding += 1
        try:
            yield
        finally:
            self.end_batch()

    def end_batch(self) -> None:
        """Leave one write batch (``holding`` was raised to enter it); the outermost sends."""
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
