"""gRPC over HTTP/2 (RFC 9113), served from Trio by xlaserve itself.

Why not grpclib: per request, grpclib's HTTP/2 stack (h2, hpack, its stream objects, one asyncio
task each) and the asyncio <-> Trio guest-run hand-offs cost about two thirds of the worker's
CPU; see "Why xlaserve speaks HTTP/2 itself" in docs/architecture.md for the numbers. This module
does only what gRPC needs, with the gRPC clients' usual traffic on a short path.

HTTP/2 itself (frames, SETTINGS, stream states, header blocks, flow control, every limit and
clock of :class:`H2Limits`) is the sans-IO engine :class:`xlaserve.http2.connection.H2Connection`
in server mode; a :class:`Connection` here is its Trio driver (sockets, tasks, buffers, write
batches, TLS) and, as the engine's handler, the gRPC call lifecycle on top of it.

- A connection is three Trio tasks: a reader that parses frames as they arrive (in turns, so that
  one busy connection cannot hold the others back), a writer that sends whatever accumulated since
  its last send in one ``send_all`` (a batch of 32 replies is one write; control frames go out the
  same way), and a watchdog for the handshake, keep-alive, idle and write timeouts.
- Every count, size and time a client can make the connection grow is bounded by
  :class:`H2Limits` (the ``endpoints:`` keys of the same names); a client past one is sent GOAWAY
  naming the key and closed, while the other connections go on (docs/security.md).
- A call gets one Trio task once its request is complete (unary input) or its headers arrive
  (streaming input). The handler sees a grpclib-shaped stream: ``recv_message``,
  ``send_message``, ``deadline``, ``metadata``; a :class:`grpclib.exceptions.GRPCError` it
  raises becomes the call's status. Services are grpclib-generated bases, routed through their
  ``__mapping__``.
- Header blocks are decoded by :mod:`xlaserve.http2.hpack` (which caches the repeated blocks
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
:mod:`xlaserve.frontend.grpc_protocol`; the HTTP/2 below it is :mod:`xlaserve.http2`.

- TLS (``GrpcServer.serve(ssl_context=...)``): a connection's stream is a ``trio.SSLStream``
  whose handshake (bounded in time, ALPN ``h2`` required) is :mod:`xlaserve.frontend.tls`'s. The
  cleartext fast path (``recv_into`` a fixed buffer, a non-blocking ``send`` from ``flush``)
  needs the raw socket; over TLS the reader uses ``receive_some`` and ``flush`` wakes the writer.

Not supported: HTTP/1.1 upgrade (h2c with prior knowledge only), server push.
"""
from __future__ import annotations

import logging
import mmap
import socket
import ssl
from collections import deque
from collections.abc import Callable, Iterable
from time import perf_counter
from typing import Any

import trio
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import Deadline

from xlaserve.frontend.access import AccessPolicy, peer_address
from xlaserve.frontend.grpc_protocol import (
    CONNECTION_INFLATE_KEY, INFLATE_INLINE, MESSAGE_PREFIX, OK_TRAILERS, RESPONSE_HEADERS, SERVER_INFLATE_KEY,
    InflateBudget, InflatedMessage, Inflation, Refusal, cut_messages, framed, read_head, release_all, trailers,
)
from xlaserve.frontend.guard import LineLimiter, serve_guarded
from xlaserve.http2.connection import HALF_CLOSED_REMOTE, OPEN, H2Connection, Handler, Stream
from xlaserve.http2.frames import (
    DATA, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, ERROR_NAMES, FRAME_HEADER, GOAWAY, HEADERS, PREFACE,
    PROTOCOL_ERROR, SETTINGS, U32, ConnectionError_, H2Limits, frame,
)
from xlaserve.frontend.sockread import read_when_ready
from xlaserve.frontend.statuses import status_of
from xlaserve.frontend.tls import handshake as tls_handshake

log = logging.getLogger("xlaserve.grpc")

# what we advertise (stream limits and header list size come from H2Limits)
OUR_STREAM_WINDOW = 4 * 1024 * 1024
OUR_CONN_WINDOW = 16 * 1024 * 1024
OUR_MAX_FRAME = 1024 * 1024
READ_BUFFER_START = 64 * 1024              # a connection's receive buffer at first...
READ_BUFFER_MAX = 4 * (OUR_MAX_FRAME + 9)  # ...grown (doubling) for big frames or full reads up to this
READ_FIRST = 4096                          # the first read (the preface), before the buffer exists
#: a connection that received nothing this long gives its read buffer's pages back to the kernel
#: (its watchdog looks at this time after the last read, and at least every READ_BUFFER_LOOK_SECONDS)
READ_BUFFER_RELEASE_SECONDS = 1.0
READ_BUFFER_LOOK_SECONDS = 5.0
_PAGE = mmap.PAGESIZE
WRITE_CHUNK = 4 * 1024 * 1024              # the writer's timeout counts per chunk: progress, not size
#: Output written inside a write batch (the replies a gateway relays from one read of a worker,
#: those of one execution) waits for the batch's end, to leave in one send per connection, but not
#: longer than this: in a long burst the first replies go while the rest is worked on, and their
#: clients send again sooner. A client connection's read batch is held whole (read_batch)
#: (docs/benchmarks.md, The gateway: mlp at c=32 through the gateway 0.76x -> 0.80x of direct,
#: and direct itself 3-8% faster).
MAX_HOLD_SECONDS = 200e-6
# a reader's turn: the engine's WORK_PER_TURN frames (+1 per 64 KiB of DATA, per 256 B of others)...
STARTS_PER_TURN = 32                       # ...and at most this many requests handed on (decoding them is the cost)
SMALL_REQUEST = 65536                      # a whole unary request up to this size skips message cutting (data_received)
FLUSH_SECONDS = 5.0                        # a closing connection's last writes
CALM_FLUSH_SECONDS = 0.5                   # ... when the peer broke a rule or a limit
DEFAULT_MAX_CONNECTIONS = 1024             # endpoints.max_connections
DEFAULT_MAX_UNDECODED = 2 * 1024**3        # endpoints.max_undecoded_request_bytes
#: request bytes a connection may take on past what it holds before it asks the server again
#: (the server's bound counts these reservations, so it is never passed by more than they hold)
UNDECODED_GRANT = 1024 * 1024
#: while connections are paused (max_undecoded_request_bytes), how often the server looks whether
#: the total fell (bytes are released in many places: counting each would cost the request path)
UNDECODED_LOOK_SECONDS = 0.1
RECLAIM_SECONDS = 0.01
_TCP_GONE = frozenset((7, 8, 9))           # TCP_CLOSE, TCP_CLOSE_WAIT, TCP_LAST_ACK (linux/tcp_states.h)
DEFAULT_MAX_CONNECTION_INFLATE = 16 * 1024 * 1024   # endpoints.max_connection_inflate_bytes
DEFAULT_MAX_INFLATE = 256 * 1024 * 1024             # endpoints.max_inflate_bytes
INFLATE_THREADS = 2


async def recv_into(raw: socket.socket, view: memoryview, turn: bool = True) -> int:
    """Read into ``view`` from the non-blocking ``raw`` socket (:func:`read_when_ready`)."""
    return await read_when_ready(raw, lambda: raw.recv_into(view), turn)


# gRPC's framing and fixed header blocks (grpc_protocol), under the names the hot path uses
_MESSAGE_PREFIX = MESSAGE_PREFIX
_RESPONSE_HEADERS = RESPONSE_HEADERS
_OK_TRAILERS = OK_TRAILERS


def _read_buffer(size: int) -> mmap.mmap:
    """A connection's read buffer of ``size`` bytes: an anonymous mapping, made at once, whose
    pages the kernel zeroes as reads first reach them, so a connection costs the pages its reads
    have used, not the buffer's size (an idle one: one page), and they can be given back
    (:func:`release_pages`). A bytearray of 4 MiB is zeroed in one go on the event loop: 11 ms
    there (8 MiB: 22 ms) while an attacker kept both cores busy, which the other clients saw as
    latency; one of 64 KiB costs 64 KiB of RSS per idle connection. Private: a shared anonymous
    mapping (mmap's default) is shared memory, whose pages MADV_DONTNEED only unmaps, not frees."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def release_pages(buffer, used: int) -> None:
    """Give the kernel back the pages of a read buffer past its first ``used`` bytes (they read
    as zeros afterwards, and cost nothing until a read reaches them again)."""
    if type(buffer) is mmap.mmap:
        first = -(-used // _PAGE) * _PAGE
        if first < len(buffer):
            buffer.madvise(mmap.MADV_DONTNEED, first, len(buffer) - first)


def room_to_read(buffer, view: memoryview, start: int, end: int, need: int, size: int, slack: int):
    """A read buffer made ready for the next read, keeping its unread bytes ``buffer[start:end]``
    (the start of a frame of ``need`` bytes): a new buffer of ``size`` bytes when that is larger,
    else the unread bytes moved to the front when the frame would not fit or fewer than ``slack``
    bytes are left to read into. Returns (buffer, view, start, end)."""
    if size > len(buffer):
        grown = _read_buffer(size)
        grown_view = memoryview(grown)
        grown_view[:end - start] = view[start:end]
        return grown, grown_view, 0, end - start
    if len(buffer) - end < max(need - (end - start), slack):
        view[:end - start] = bytes(view[start:end])
        return buffer, view, 0, end - start
    return buffer, view, start, end

# methods that take a stream of requests (client streaming)
_STREAMING_IN = frozenset(c for c in Cardinality if c.value.client_streaming)


class FramedReply:
    """A unary reply that is one uncompressed gRPC message already carrying its 5-byte length
    prefix (as a peer sent it): :meth:`Call.complete` sends ``framed`` as it is, without cutting
    and prefixing the message again. ``message`` is a view of the message without the prefix."""

    __slots__ = ("framed", "message")

    def __init__(self, framed: bytes) -> None:
        self.framed = framed
        self.message = memoryview(framed)[5:]

    def SerializeToString(self) -> bytes:
        """The message (for a path that sends it as any other reply)."""
        return bytes(self.message)


class Call(Stream):
    """One gRPC call on one HTTP/2 stream (the engine's :class:`~xlaserve.http2.connection.Stream`,
    so a request is one object); what a handler receives as its ``stream``."""

    __slots__ = ("conn", "method", "metadata", "deadline", "encoding", "body", "messages", "started",
                 "headers_sent", "finished", "reset", "arrived", "scope", "drained", "fast", "on_cancel", "zombie",
                 "streaming_in")

    def __init__(self, conn: "Connection", stream_id: int, method, metadata: dict[str, str],
                 deadline: Deadline | None, encoding: str) -> None:
        # the engine's Stream fields, set here (one call less per request)
        self.id = stream_id
        self.state = OPEN
        self.send_window = 0
        self.pending: deque = deque()
        self.unacked = 0
        self.conn = conn
        self.method = method            # grpclib.const.Handler
        self.metadata = metadata
        self.deadline = deadline
        self.encoding = encoding
        self.body = bytearray()         # request bytes not yet cut into messages
        self.messages: deque = deque()  # request payloads not yet parsed (bytes, views, InflatedMessage)
        self.started = False
        self.headers_sent = False
        self.finished = False           # trailers queued; nothing more may be sent
        self.reset = False              # the stream was reset
        self.arrived: trio.Event | None = None
        self.drained: trio.Event | None = None
        self.scope: trio.CancelScope | None = None
        self.fast = None                # the method's task-free entry point, if it has one
        self.streaming_in = False       # the method takes a stream of requests (set with method)
        #: Called once (Trio thread), with no arguments, when the call is cancelled: the client
        #: reset the stream, the server reset it, or the connection closed or broke. A task-free
        #: handler sets it to take back work it handed on; it is not called once the call ended.
        self.on_cancel: Callable[[], None] | None = None
        #: reset while work it handed on (``on_cancel``) is queued or running: it still counts
        #: against the connection's stream limit until ``complete`` says that work is over
        self.zombie = False

    @property
    def peer(self):
        """The client's IP address (``ipaddress`` object; None if not IP), from its connection."""
        return self.conn.peer

    @property
    def remote_closed(self) -> bool:
        """The client has sent all of its request (END_STREAM)."""
        return bool(self.state & HALF_CLOSED_REMOTE)

    def cancel(self) -> None:
        """The stream is reset: nothing more is sent, and a handler still running is cancelled."""
        was_finished = self.finished
        self.reset = self.finished = True
        if self.scope is not None:
            self.scope.cancel()
        on_cancel, self.on_cancel = self.on_cancel, None
        if on_cancel is not None and not was_finished:
            self.zombie = True
            self.conn.h2.zombies += 1
            try:
                on_cancel()
            except Exception:   # a bug in the layer above must not take the connection down
                log.exception("gRPC on_cancel callback failed")

    def complete(self, outcome) -> None:
        """End a task-free call (Trio thread only): ``outcome`` is the reply message or the
        exception that fails the call (answered with the status and message
        :func:`~xlaserve.frontend.statuses.status_of` gives). Ignored once the call has ended (client reset, connection gone)."""
        if self.finished:
            if self.zombie:     # the work of a reset call is over: its stream slot is free
                self.zombie = False
                self.conn.h2.zombies -= 1
            return
        if isinstance(outcome, BaseException):
            self.conn._finish(self, *status_of(outcome))
            return
        if type(outcome) is FramedReply:
            self.conn.reply_unary(self, outcome.message, outcome.framed)
            return
        self.conn.reply_unary(self, outcome.SerializeToString())

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
            if self.state & HALF_CLOSED_REMOTE and self.id not in self.conn.inflating:   # else one is on its way
                return None
            self.arrived = trio.Event()
            await self.arrived.wait()
        return self.parse(self.messages.popleft())

    async def send_message(self, message) -> None:
        self.conn.send_message(self, message.SerializeToString())
        if self.pending:   # back-pressure for streaming replies: wait until the window takes them
            self.drained = trio.Event()
            await self.drained.wait()


class Connection(Handler):
    """One client connection: the Trio driver of its HTTP/2 engine (``h2``, server mode; this
    object is the engine's handler) and the gRPC calls on top of it."""

    def __init__(self, server: "GrpcServer", stream: trio.SocketStream | trio.SSLStream, *,
                 tls: bool = False) -> None:
        self.server = server
        self.limits = limits = server.limits
        self.sock = stream
        self.tls = tls          # stream is a trio.SSLStream: no raw-socket fast paths
        tcp = stream.transport_stream.socket if tls else stream.socket
        self.peer = peer_address(tcp.getpeername())   # for endpoints.client_shm_peers
        self.out_ready = trio.Event()
        self.h2 = H2Connection(self, limits=limits, clock=trio.lowlevel.current_clock().current_time,
                               stream_window=OUR_STREAM_WINDOW,
                               conn_window=OUR_CONN_WINDOW, max_frame=OUR_MAX_FRAME)
        #: the open calls by stream id (the engine's streams: one dict)
        self.calls: dict[int, Call] = self.h2.streams
        # Request bytes held for calls (unfinished messages, messages a handler has not read)
        # are at most held_bound; the exact sum is taken only when the bound passes held_check,
        # the bytes the server has reserved for this connection (max_undecoded_request_bytes).
        self.held_bound = 0
        self.held_check = 0
        self.paused = False                         # not read: the server holds too many undecoded bytes
        self.resumed: trio.Event | None = None
        self.sending = False                        # the writer task is inside send_all
        self.in_flight = 0                          # bytes the writer task has yet to hand the socket
        self.write_progress_at = 0.0                # when the writer's current chunk began
        self.writable: trio.Event | None = None     # the reader waits on it while too much is queued
        self.raw: socket.socket | None = None       # set last (below)
        self.stopping = False                       # no more output is queued once set
        self.read_scope = trio.CancelScope()
        self.watch_scope = trio.CancelScope()
        self.closing: ConnectionError_ | None = None   # why the watchdog ended the connection
        # during a reader's turn, the task-free calls to start when it ends (None between turns)
        self.starting: list[Call] | None = None
        self.nursery: trio.Nursery | None = None
        self.read_buffer = None                     # the reader's buffer (mmap), once it has one
        self.read_end = 0                           # ...and where its unread bytes end
        #: decompressed request bytes this connection holds (messages not yet parsed)
        self.inflate = InflateBudget(server.max_connection_inflate_bytes, CONNECTION_INFLATE_KEY, server.inflate)
        #: calls whose next message is being inflated in a worker thread, by stream id
        self.inflating: dict[int, Inflation] = {}
        # The head of the last header block that opened a call: a client repeats its block, and
        # the HPACK decoder then returns the very same field tuple, so the head is read once.
        self.last_fields: tuple | None = None
        self.last_head = None
        # The same socket (same file descriptor, detached in run() before Trio closes it), for
        # flush(): a non-blocking send from whichever task replied. Never used once stopping is
        # set. None over TLS, where bytes reach the socket only through the SSLStream. Made last:
        # nothing after it can raise, so it is never left undetached (closing the descriptor twice).
        self.raw = None if tls else socket.socket(fileno=tcp.fileno())

    @property
    def out(self) -> bytearray:
        """The bytes queued to send (the engine's)."""
        return self.h2.out

    @property
    def reads(self) -> int:
        return self.h2.reads

    def _stop(self) -> None:
        """No more output is queued from here on."""
        self.stopping = self.h2.stopped = True

    # ---- tasks ---------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            if self.tls and not await tls_handshake(self.sock, self.server.handshake_lines):
                return
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                nursery.start_soon(self._write_loop)
                nursery.start_soon(self._watch)
                flush = FLUSH_SECONDS
                with self.read_scope:
                    try:
                        await self._read_loop()
                    except ConnectionError_ as exc:
                        self.closing = exc
                    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                        pass
                self.watch_scope.cancel()
                if self.closing is not None:
                    # The client broke a rule or a limit: say which, and do not wait long for it to read.
                    exc = self.closing
                    self.server.log_closing(self, exc)
                    self.h2.connection_error(exc)
                    flush = CALM_FLUSH_SECONDS
                # The peer is gone, misbehaved, or a graceful close found no call open: cancel
                # what is left, let the writer send what is queued (bounded), then close.
                for call in list(self.calls.values()):
                    call.cancel()
                self.calls.clear()
                self._stop()
                self.out_ready.set()
                nursery.cancel_scope.deadline = trio.current_time() + flush
        finally:
            self._stop()
            self.server.forget_reservation(self)
            self.inflate.close()
            # This object and its engine refer to each other (the engine's handler), so they
            # are freed only by a full garbage collection, which may come much later: what
            # they hold that is large goes now (the read buffer is up to READ_BUFFER_MAX).
            self.read_buffer = None
            self.h2.release()
            if self.raw is not None:
                self.raw.detach()
            with trio.CancelScope(shield=True):
                await self.sock.aclose()

    async def _write_loop(self) -> None:
        sock = self.sock
        h2 = self.h2
        while True:
            if not h2.out:
                if self.stopping:
                    return
                self.out_ready = trio.Event()
                await self.out_ready.wait()
                continue
            data = h2.take_output()
            self.sending = True
            self.in_flight = len(data)
            try:
                if len(data) <= WRITE_CHUNK:
                    self.write_progress_at = trio.current_time()
                    await sock.send_all(data)
                else:       # in chunks, so that the watchdog sees progress (write_timeout_seconds)
                    view = memoryview(data)
                    for i in range(0, len(data), WRITE_CHUNK):
                        self.write_progress_at = trio.current_time()
                        chunk = view[i:i + WRITE_CHUNK]
                        await sock.send_all(chunk)
                        self.in_flight -= len(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self._stop()
                self.read_scope.cancel()
                return
            finally:
                self.sending = False
                self.in_flight = 0
            self._maybe_writable()

    def _maybe_writable(self) -> None:
        """Wake the reader waiting for queued output to go out (``max_queued_reply_bytes``)."""
        if self.writable is not None and len(self.h2.out) + self.in_flight <= self.limits.max_queued_reply_bytes // 2:
            self.writable.set()
            self.writable = None

    def flush(self) -> None:
        """Send what is queued now, with one non-blocking send; whatever the socket does not
        take (or anything queued while the writer task is mid-send) is left to the writer."""
        out = self.h2.out
        if not out:
            return
        if not (self.sending or self.stopping or self.tls):
            try:
                sent = self.raw.send(out)
            except OSError:             # would block, or a broken socket: the writer finds out
                sent = 0
            if sent == len(out):
                out.clear()
                self.h2.control_queued = 0
                if self.writable is not None:
                    self._maybe_writable()
                return
            del out[:sent]
        self.out_ready.set()

    async def _watch(self) -> None:
        """The connection's clocks: the engine's (handshake, keep-alive, idle and the writer's
        progress: ``H2Connection.tick``) and the read buffer's pages. A clock that runs out ends
        the connection (``closing``, then the reader is stopped)."""
        h2 = self.h2
        write = self.limits.write_timeout_seconds
        with self.watch_scope:
            try:
                await trio.sleep_until(h2.tick())          # the handshake
                released_at_reads = -1
                while True:
                    now = trio.current_time()
                    # keep-alive not while the reader waits on the writer, or on the server's
                    # undecoded bound: the client's answer would not be read. A writer stuck past
                    # write_timeout_seconds stays in its send until the close's short flush ends it.
                    wake = h2.tick(now, self.writable is None and not self.paused,
                                   self.write_progress_at if self.sending else None)
                    if h2.idle_expired:
                        log.debug("closing a gRPC connection idle for %g s (endpoints.idle_timeout_seconds)",
                                  self.limits.idle_timeout_seconds)
                        return
                    if h2.out:
                        self.flush()                        # a keep-alive PING
                    # how often a write that began since, and the read buffer, are looked at
                    wake = min(wake, now + min(write / 2, READ_BUFFER_LOOK_SECONDS))
                    if h2.reads != released_at_reads:
                        quiet_at = h2.received_at + READ_BUFFER_RELEASE_SECONDS
                        if now >= quiet_at:
                            released_at_reads = h2.reads
                            release_pages(self.read_buffer, self.read_end)
                        else:
                            wake = min(wake, quiet_at)
                    await trio.sleep_until(wake)
            except ConnectionError_ as exc:
                self._end(exc)

    def _end(self, exc: ConnectionError_) -> None:
        """End the connection from outside the reader: GOAWAY with ``exc``, then close."""
        if self.closing is None:
            self.closing = exc
        self.read_scope.cancel()

    async def _read_loop(self) -> None:
        sock = self.sock
        buf = bytearray()
        while len(buf) < len(PREFACE):
            chunk = await sock.receive_some(READ_FIRST)
            if not chunk:
                return
            buf += chunk
        # One buffer per connection, filled with recv_into: no allocation per read. It starts at
        # 64 KiB and doubles when a frame does not fit or a read fills it (up to READ_BUFFER_MAX).
        # It is an anonymous mapping (_read_buffer): what it costs is the pages reads have used,
        # and the watchdog gives those back once the connection has been quiet for
        # READ_BUFFER_RELEASE_SECONDS (release_pages, past read_end: never the bytes not yet
        # handled). Reallocating it smaller between bursts instead cost img_mean 8% at c=8.
        # The engine hands DATA payloads on as views into it (copied once, into their call's
        # body); other frames as bytes. The preface is checked by the engine.
        size = max(READ_BUFFER_START, len(buf))
        buffer = self.read_buffer = _read_buffer(size)
        view = memoryview(buffer)
        start, end = 0, len(buf)
        buffer[:end] = buf
        filled = False                      # the last read filled the buffer
        tls_read = self._tls_recv_into if self.tls else None
        raw = self.raw
        h2 = self.h2
        receive = h2.receive
        note_read = h2.note_read
        wait_readable = trio.lowlevel.wait_readable
        checkpoint = trio.lowlevel.checkpoint
        unpack = FRAME_HEADER.unpack_from
        batch = self.server.read_batch
        queued_limit = self.limits.max_queued_reply_bytes
        while True:
            starting = self.starting = []
            with batch():       # replies, acks and window updates of one read go out in one send
                start = receive(buffer, view, start, end)
                self.starting = None
                if starting:
                    self._start_fast(starting)
            if h2.going_away and not self.calls:
                return
            if h2.spent and end - start >= 9:
                # More frames are here already, but this connection has had its turn: let the
                # other connections and the dispatch loop run before handling them.
                await checkpoint()
                continue
            if start == end:
                start = end = 0
                if filled and size < READ_BUFFER_MAX:
                    size = min(size * 2, READ_BUFFER_MAX)
                    buffer = self.read_buffer = _read_buffer(size)
                    view = memoryview(buffer)
            else:
                need = 9 + (unpack(buffer, start)[0] >> 8) if end - start >= 9 else 9
                # grown when the frame does not fit or reads are filling the buffer (a frame is at
                # most OUR_MAX_FRAME + 9: the engine refuses a longer one)
                want = min(size * 2, READ_BUFFER_MAX) if filled and size < READ_BUFFER_MAX else size
                buffer, view, start, end = room_to_read(buffer, view, start, end, need, max(want, need),
                                                        READ_BUFFER_START // 4)
                if size != len(buffer):
                    size = len(buffer)
                    self.read_buffer = buffer
            self.read_end = end             # the watchdog may give back the pages past it
            if self.paused:
                # The server holds max_undecoded_request_bytes of requests not yet decoded and this
                # connection is among those that hold the most: it is not read until the total
                # falls (GrpcServer.rebalance); flow control holds the client meanwhile.
                self.resumed = trio.Event()
                await self.resumed.wait()
            if len(h2.out) + self.in_flight > queued_limit:
                # The client is not reading what it asked for: stop reading its requests until
                # the writer has handed half of it to the socket (back-pressure, not buffering).
                self.writable = trio.Event()
                self.out_ready.set()
                await self.writable.wait()
            # recv_into (above) inlined: the buffer's pages past read_end may be given back
            # whenever this task waits, so a read that took bytes without waiting moves
            # read_end past them before it yields its turn (TLS copies in only after it waits)
            if tls_read is not None:
                n = await tls_read(view[end:])
            else:
                try:
                    n = raw.recv_into(view[end:])
                except BlockingIOError:
                    while True:
                        await wait_readable(raw)
                        try:
                            n = raw.recv_into(view[end:])
                            break
                        except BlockingIOError:
                            pass
                else:
                    self.read_end = end + n
                    await checkpoint()
            if not n:
                return
            filled = end + n == size
            end += n
            self.read_end = end
            note_read()

    async def _tls_recv_into(self, view: memoryview) -> int:
        """``recv_into`` for a TLS stream: decrypted bytes come as a new bytes object."""
        data = await self.sock.receive_some(len(view))
        view[:len(data)] = data
        return len(data)

    # ---- the engine's handler: what the client's frames mean for calls ---------------------------
    def output_ready(self) -> None:
        server = self.server
        if server.holding:
            server.hold(self)               # sent when the write batch ends (or sooner)
        else:
            self.out_ready.set()

    def quiet(self) -> None:
        """Going away and no call is left: stop reading, which ends the connection."""
        self.read_scope.cancel()

    def stream_opened(self, sid: int, headers: tuple[tuple[str, str], ...], end_stream: bool) -> None:
        if headers is self.last_fields:     # a repeated block decodes to the very same tuple
            head = self.last_head
        else:
            server = self.server
            head = read_head(headers, server.methods, server.service_names)
            if head is None:
                # a stream error; nothing of the call was registered, so a reset is all there is to do
                self.h2.glitch(f"a malformed request on stream {sid}: a field with an empty name")
                self.h2.refuse(sid, PROTOCOL_ERROR)
                return
            self.last_fields, self.last_head = headers, head
        path = head.path
        server = self.server
        method = server.methods.get(path)
        call = Call(self, sid, method, head.metadata, None, head.encoding)
        call.fast = server.fast.get(path)
        # a set lookup: the Cardinality enum's .value is a slow descriptor, once per request
        call.streaming_in = path in server.client_streaming
        self.h2.accept(call, end_stream)
        verdict = head.verdict
        if type(verdict) is Refusal and (verdict.http_status != 200 or method is None):
            self._refuse(call, verdict)         # no gRPC call, or an unknown method
            return
        rule = server.restricted.get(path)     # endpoints.restricted: before any handler runs
        if rule is not None and (denial := rule.denial(head.metadata)) is not None:
            self._fail(call, Status.PERMISSION_DENIED, denial)
            return
        if verdict is not None:
            if type(verdict) is Refusal:
                self._refuse(call, verdict)
                return
            call.deadline = Deadline.from_timeout(verdict)
        if end_stream:
            self._end_of_request(call)      # no request message at all
        elif call.streaming_in:
            self._start(call)

    def headers_received(self, call: Call, headers, end_stream: bool) -> None:
        self._end_of_request(call)          # the client's trailers (the engine checked them)

    def data_received(self, call: Call, payload, end_stream: bool) -> None:
        if not call.finished:
            length = len(payload)
            self.held_bound += length
            if self.held_bound > self.held_check and not self._may_hold(call, length):
                return
            if (end_stream and 5 <= length <= SMALL_REQUEST and not call.body and not call.messages
                    and not self.inflating and not payload[0] and int.from_bytes(payload[1:5], "big") == length - 5
                    and length - 5 <= self.server.max_recv_bytes):
                # the usual small unary request: one uncompressed message in one DATA frame that
                # ends the stream; the message is copied out of the read buffer once (cut_messages'
                # checks: its flag is 0, its prefix gives its length, which is within the limit).
                # A large one takes the general path, whose message is a view of a bytearray (its
                # tensors then writable views, as before).
                call.messages.append(bytes(payload[5:]))
                self._end_of_request(call)
                return
            call.body += payload
            self._cut_messages(call)
        if end_stream:
            self._end_of_request(call)

    def stream_reset(self, call: Call, code: int, remote: bool) -> None:
        call.cancel()

    def stream_closed(self, call: Call) -> None:
        if call.messages and self.inflate.used:
            release_all(call.messages)      # inflated messages no handler will parse
        if call.drained is not None:
            call.drained.set()

    def stream_drained(self, call: Call) -> None:
        if call.drained is not None:
            call.drained.set()

    # ---- request bytes ------------------------------------------------------------------------
    def held_exact(self) -> int:
        """The request bytes this connection's calls hold now (unfinished messages, messages not
        yet parsed); also makes it ``held_bound``."""
        held = self.held_bound = sum(len(c.body) + sum(map(len, c.messages)) for c in self.calls.values())
        return held

    def _may_hold(self, call: Call, length: int) -> bool:
        """Whether ``length`` more request bytes for ``call`` stay within the server's
        ``max_held_bytes`` for this connection; if not, the call fails with RESOURCE_EXHAUSTED
        and lets go of what it held. Without this a client could make the server buffer up to
        its stream limit times the largest message. Within it, the bytes are reserved from the
        server's ``max_undecoded_bytes`` (:meth:`GrpcServer.reserve`), which pauses this
        connection's reading when there is no room."""
        held = self.held_exact()
        self.held_bound = held + length
        limit = self.server.max_held_bytes
        if held + length <= limit:
            self.server.reserve(self, held + length)
            return True
        self.held_bound = held - len(call.body) - sum(map(len, call.messages))
        unfinished = sum(1 for c in self.calls.values() if c.body or c.messages or c is call)
        call.body = bytearray()
        release_all(call.messages)
        call.messages.clear()
        self._fail(call, Status.RESOURCE_EXHAUSTED, self.server.too_much_held(held + length, limit, unfinished))
        return False

    def left(self) -> bool:
        """Whether the client has closed its end or the socket broke (looked at while the
        connection is paused, when nothing is read that would tell): Linux's TCP state."""
        tcp = self.sock.transport_stream.socket if self.tls else self.sock.socket
        try:
            return tcp.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] in _TCP_GONE
        except (OSError, AttributeError):
            return True

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
        """The client sent all of ``call``'s request (the engine marked its stream)."""
        if call.finished:
            return                      # answered already (its stream ends as its reply goes out)
        if self.inflating and call.id in self.inflating:
            return                      # ended by _inflate_in_thread once the message is inflated
        if call.body:
            self._fail(call, Status.INVALID_ARGUMENT, f"the request ends inside a message ({len(call.body)} "
                                                      "bytes after the last complete one)")
            return
        if call.arrived is not None:
            call.arrived.set()
        if not call.started:
            if not call.streaming_in and len(call.messages) != 1:
                self._fail(call, Status.INVALID_ARGUMENT, f"a unary call carries exactly one request message; "
                                                          f"got {len(call.messages)}")
                return
            self._start(call)

    # ---- calls -----------------------------------------------------------------------------
    def _start(self, call: Call) -> None:
        call.started = True
        if call.fast is None:
            self.nursery.start_soon(self._run_call, call)
        elif self.starting is not None:
            self.starting.append(call)      # at the end of the reader's turn: _start_fast
            if len(self.starting) >= STARTS_PER_TURN:
                self.h2.spent = True        # (the turn ends after this frame)
        else:                               # outside a turn (a message inflated in a thread)
            self._start_fast((call,))

    def _start_fast(self, starting: Iterable[Call]) -> None:
        """Hand task-free calls to their entry points; at the end of a reader's turn, those whose
        requests completed in its frames, skipping the ones the client reset in the same frames:
        a rapid reset costs frame parsing, not request decoding."""
        for call in starting:
            if call.finished:
                continue
            try:
                call.fast(call, call.parse(call.messages.popleft()))
            except Exception as exc:
                self._finish(call, *status_of(exc, call.fast.__qualname__))

    async def _run_call(self, call: Call) -> None:
        status, message = Status.OK, None
        with trio.CancelScope() as scope:
            call.scope = scope
            if call.reset:
                return
            try:
                await call.method.func(call)
            except Exception as exc:
                status, message = status_of(exc, call.method.func.__qualname__)
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
        head = b""
        if not call.headers_sent:
            call.headers_sent = True
            head = frame(HEADERS, END_HEADERS, call.id, _RESPONSE_HEADERS)
        self.h2.send_data(call, framed(data), head=head)

    def reply_unary(self, call: Call, data: bytes, framed: bytes | None = None) -> None:
        """The whole answer of a unary call: HEADERS, the message, OK trailers; one write when
        the windows allow (the common case). ``framed``, when given, is ``data`` with its
        length prefix already (a :class:`FramedReply`), sent as it is."""
        n = len(data) + 5
        h2 = self.h2
        # (room for the one DATA frame, as H2Connection.send_raw needs it; else the general path)
        if (call.headers_sent or call.pending or n > call.send_window or n > h2.send_window
                or n > h2.peer_max_frame or len(data) > self.server.max_send_bytes):
            try:
                self.send_message(call, data)
            except GRPCError as exc:
                self._finish(call, exc.status, exc.message)
                return
            self._finish(call, Status.OK, None)
            return
        call.headers_sent = call.finished = True
        sid = call.id
        pack = FRAME_HEADER.pack
        h2.send_raw(call, b"".join((pack(len(_RESPONSE_HEADERS) << 8 | HEADERS, END_HEADERS, sid), _RESPONSE_HEADERS,
                                    pack(n << 8 | DATA, 0, sid),
                                    *((_MESSAGE_PREFIX.pack(0, len(data)), data) if framed is None else (framed,)),
                                    pack(len(_OK_TRAILERS) << 8 | HEADERS, END_HEADERS | END_STREAM, sid),
                                    _OK_TRAILERS)), n, True)

    def _finish(self, call: Call, status: Status, message: str | None) -> None:
        """End the call: trailers (or a trailers-only response) with its status, after the
        reply data still waiting for window."""
        if call.finished:
            return
        call.finished = True
        block = trailers(status, message)
        if not call.headers_sent:
            call.headers_sent = True
            block = _RESPONSE_HEADERS + block
        self.h2.send_end(call, block)

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
        self.h2.send_headers(call, refusal.block(), end_stream=True)

    def go_away(self) -> None:
        """Graceful close: refuse new streams, finish the open ones, then close."""
        self.h2.go_away()


class _WriteBatch:
    """:meth:`GrpcServer.write_batch` (``timed``) and :meth:`GrpcServer.read_batch`: a plain
    context manager (one of each per server; batches nest by the server's depth count), as a
    generator-based one costs a generator per read."""

    __slots__ = ("server", "timed")

    def __init__(self, server: "GrpcServer", timed: bool) -> None:
        self.server = server
        self.timed = timed

    def __enter__(self) -> None:
        server = self.server
        server.holding += 1
        if not self.timed:
            server.untimed += 1

    def __exit__(self, *exc) -> None:
        server = self.server
        server.holding -= 1
        if not self.timed:
            server.untimed -= 1
        if not server.holding and server.dirty:
            server.flush_held()


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
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, limits: H2Limits = H2Limits(),
                 access: AccessPolicy | None = None,
                 max_connection_inflate_bytes: int = DEFAULT_MAX_CONNECTION_INFLATE,
                 max_inflate_bytes: int = DEFAULT_MAX_INFLATE,
                 max_undecoded_bytes: int = DEFAULT_MAX_UNDECODED) -> None:
        self.methods: dict[str, Any] = {}
        self.fast: dict[str, Callable[[Call, Any], None]] = {}
        for service in services:
            self.methods.update(service.__mapping__())
            fast = getattr(service, "__fast_unary__", None)
            if fast is not None:
                self.fast.update(fast())
        self.service_names = sorted({path.split("/")[1] for path in self.methods})
        self.client_streaming = frozenset(path for path, handler in self.methods.items()
                                          if getattr(handler, "cardinality", None) in _STREAMING_IN)
        #: path -> the endpoints.restricted rule a call must pass; with ``access`` given, every
        #: served method must be in an API group (ValueError otherwise)
        self.restricted = access.for_methods(self.methods) if access is not None else {}
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
        #: request bytes all connections together may hold before they are handled (the sum of
        #: what max_held_bytes bounds per connection), never less than one largest message. Each
        #: connection reserves what it holds plus a grant (UNDECODED_GRANT, at most 1/64 of the
        #: bound); past the bound the connections holding the most are paused (reserve, rebalance).
        self.max_undecoded_bytes = max(max_undecoded_bytes, max_recv_bytes + 5)
        self.reserved = 0                                  # the sum of the connections' held_check
        self.paused: dict[Connection, None] = {}
        self.undecoded_grant = max(1, min(UNDECODED_GRANT, self.max_undecoded_bytes // 64))
        self._holders = 0                                  # connections holding bytes at the last reclaim
        self._reclaimed_at = -1.0
        self._paused_event = trio.Event()
        self._pauses = LineLimiter(log)
        #: open connections served at once; one more is sent SETTINGS and GOAWAY
        #: (ENHANCE_YOUR_CALM) and closed, while the open ones go on (each costs a read buffer)
        self.max_connections = max_connections
        self.limits = limits
        #: decompressed request bytes held at once (messages inflated, not yet parsed), over
        #: all connections; each connection has its own ``max_connection_inflate_bytes`` too.
        #: A compressed message may inflate only to what both have left (and the message limit).
        self.max_connection_inflate_bytes = max_connection_inflate_bytes
        self.inflate = InflateBudget(max_inflate_bytes, SERVER_INFLATE_KEY)
        #: worker threads inflating large compressed messages at once (their bytes are reserved
        #: in the budgets before they wait here)
        self.inflate_threads = trio.CapacityLimiter(INFLATE_THREADS)
        self._refusals = LineLimiter(log, interval=60.0)   # a flood of connections is when it happens
        #: one line a second for connections that fail (accept errors, resets during set-up, bugs)
        self._faults = LineLimiter(log)
        self._closings = LineLimiter(log)
        #: TLS handshakes that fail, time out or refuse ALPN: at most one line a second
        self.handshake_lines = LineLimiter(log)
        self._connections: set[Connection] = set()
        self._none_left = trio.Event()
        self.ssl_context: ssl.SSLContext | None = None     # set by serve()
        self._listen_scope = trio.CancelScope()
        self._closing = False
        self._all_closed = trio.Event()
        self.port = 0
        self.holding = 0                                   # write_batch() depth
        self.untimed = 0                                   # read_batch() depth: no early send
        self._write_batch = _WriteBatch(self, timed=True)
        self._read_batch = _WriteBatch(self, timed=False)
        self.held_since = 0.0                              # when the oldest output held was written
        self.dirty: dict[Connection, None] = {}           # connections written to while holding

    async def serve(self, host: str = "", port: int = 0, *, listeners: list[trio.SocketListener] | None = None,
                    ssl_context: ssl.SSLContext | None = None, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port``, or serve ``listeners`` already open, until :meth:`close`
        and every connection has ended. Reports the port served. With ``ssl_context``
        (:func:`xlaserve.frontend.tls.server_context`) every connection is TLS: a client gets
        ``TLS_HANDSHAKE_SECONDS`` to complete its handshake and must negotiate ALPN ``h2``."""
        self.ssl_context = ssl_context
        if listeners is None:
            listeners = await trio.open_tcp_listeners(port, host=host)
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_paused)
            try:
                with self._listen_scope:
                    task_status.started(self.port)
                    await serve_guarded(self._connection, listeners, nursery=nursery, limiter=self._faults,
                                        what="gRPC")
            finally:
                with trio.CancelScope(shield=True):
                    for listener in listeners:
                        await listener.aclose()
            await self._connections_ended()
            nursery.cancel_scope.cancel()       # the paused-connection watcher
        self._all_closed.set()

    async def _connection(self, stream: trio.SocketStream) -> None:
        """Everything about one accepted connection, run inside its guard
        (:func:`~xlaserve.frontend.guard.guarded`): the peer address, TLS, the refusal past
        ``max_connections``, the connection's life. Whatever raises closes this connection only
        (one rate-limited log line); the guard closes the stream on every path."""
        if self._closing:
            return
        if self.ssl_context is not None:
            # https_compatible: aclose() just closes (the default would first finish a handshake
            # that may never have happened, under the shield in Connection.run), and an EOF
            # without close_notify reads as EOF: HTTP/2's framing tells a cut exchange anyway
            stream = trio.SSLStream(stream, self.ssl_context, server_side=True, https_compatible=True)
        if len(self._connections) >= self.max_connections:
            await self._refuse(stream)
            return
        conn = Connection(self, stream, tls=self.ssl_context is not None)
        self._connections.add(conn)
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)
            if not self._connections:
                self._none_left.set()

    async def _connections_ended(self) -> None:
        while self._connections:
            self._none_left = trio.Event()
            await self._none_left.wait()

    # ---- the bound on undecoded request bytes over all connections -----------------------------
    def reserve(self, conn: Connection, held: int) -> None:
        """``conn`` holds ``held`` request bytes and is past its reservation: reserve them and a
        grant more within ``max_undecoded_bytes``. With no room even after taking back what the
        others reserved and do not hold, ``conn`` may still take bytes while it holds less than
        an equal share of the bound (the bound over the connections holding bytes); a connection
        at or past its share (one of those holding the most) is paused: not read until
        :meth:`rebalance` finds room or a share it is under. The bytes are here: they are
        reserved either way. So the total is at most the bound plus one share per connection:
        twice the bound."""
        want = min(self.max_held_bytes, held + self.undecoded_grant)
        if not conn.paused:
            if self.reserved - conn.held_check + want > self.max_undecoded_bytes:
                # taking back costs a pass over every call: at most once per RECLAIM_SECONDS
                holders = self._holders
                if trio.current_time() - self._reclaimed_at >= RECLAIM_SECONDS:
                    holders = self.reclaim()
                room = self.max_undecoded_bytes - (self.reserved - conn.held_check)
                if room < want:
                    share = self.max_undecoded_bytes // max(holders, 1)
                    want = max(held, min(want, max(room, share)))
                    if held >= share and held > room:
                        self._pause(conn)
            self.reserved += want - conn.held_check
            conn.held_check = want
            return
        self.reserved += held - conn.held_check
        conn.held_check = held

    def _pause(self, conn: Connection) -> None:
        conn.paused = True
        self.paused[conn] = None
        self._paused_event.set()
        self._pauses.line(logging.WARNING, "pausing reads from %s: the connections hold %d bytes of requests not "
                          "yet decoded, this one %d; the limit (endpoints.max_undecoded_request_bytes) is %d; "
                          "reading resumes as the total falls", conn.peer or "a client", self.reserved,
                          conn.held_bound, self.max_undecoded_bytes)

    def reclaim(self) -> int:
        """Take back what the connections reserved and do not hold: each one's reservation
        becomes its exact holding. Returns how many connections hold bytes."""
        total = holders = 0
        for c in self._connections:
            held = c.held_check = c.held_exact()
            total += held
            holders += held > 0
        self.reserved = total
        self._holders = holders
        self._reclaimed_at = trio.current_time()
        return holders

    def rebalance(self) -> None:
        """Resume paused connections: all of them once the total is under the bound; else those
        now under an equal share (connections closed, or others started holding bytes), those
        holding the least first. End those whose client left meanwhile."""
        holders = self.reclaim()
        for conn in list(self.paused):
            if conn.left():
                self._resume(conn)
                conn.read_scope.cancel()
        share = self.max_undecoded_bytes // max(holders, 1)
        for conn in sorted(self.paused, key=lambda c: c.held_check):
            if self.reserved + self.undecoded_grant <= self.max_undecoded_bytes:
                self.reserved += self.undecoded_grant
                conn.held_check += self.undecoded_grant
            elif conn.held_check >= share:
                break
            self._resume(conn)

    def _resume(self, conn: Connection) -> None:
        del self.paused[conn]
        conn.paused = False
        if conn.resumed is not None:
            conn.resumed.set()
            conn.resumed = None

    def forget_reservation(self, conn: Connection) -> None:
        """``conn`` closed: what it reserved is free."""
        self.reserved -= conn.held_check
        conn.held_check = 0
        self.paused.pop(conn, None)

    async def _watch_paused(self) -> None:
        """While connections are paused, look every UNDECODED_LOOK_SECONDS whether they can be
        resumed (:meth:`rebalance`)."""
        while True:
            await self._paused_event.wait()
            while self.paused:
                await trio.sleep(UNDECODED_LOOK_SECONDS)
                self.rebalance()
            self._paused_event = trio.Event()

    def log_closing(self, conn: Connection, exc: ConnectionError_) -> None:
        """Log why a connection is being ended: at most one line a second, since a flood of
        offending connections is when it happens (the next line counts those not logged)."""
        self._closings.line(logging.INFO, "closing the gRPC connection from %s: GOAWAY %s: %s",
                            conn.peer or "a client", ERROR_NAMES.get(exc.code, exc.code), exc)

    async def _refuse(self, stream: trio.SocketStream) -> None:
        """One connection too many: our preface (SETTINGS), then GOAWAY naming the limit, then
        close. Logged at most once a minute, since a flood of connections is when it happens."""
        message = f"this server serves at most {self.max_connections} connections at once (endpoints.max_connections)"
        self._refusals.line(logging.WARNING, "refusing gRPC connections: %s", message)
        with trio.move_on_after(FLUSH_SECONDS):
            try:
                await stream.send_all(frame(SETTINGS, 0, 0) + frame(
                    GOAWAY, 0, 0, U32.pack(0) + U32.pack(ENHANCE_YOUR_CALM) + message.encode()))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
        with trio.CancelScope(shield=True):
            await stream.aclose()

    def hold(self, conn) -> None:
        """Inside a write batch: send ``conn``'s output when the batch ends, or sooner, once the
        oldest output held has waited MAX_HOLD_SECONDS, unless a read batch is open
        (``conn``: anything with ``flush()``)."""
        dirty = self.dirty
        now = perf_counter()
        if not dirty:
            self.held_since = now
        dirty[conn] = None
        if now - self.held_since > MAX_HOLD_SECONDS and not self.untimed:
            self.flush_held()

    def flush_held(self) -> None:
        """Send the output held by the current write batch now (one send per connection)."""
        dirty, self.dirty = self.dirty, {}
        for conn in dirty:
            conn.flush()

    def write_batch(self) -> "_WriteBatch":
        """Writes made inside are sent when the outermost batch ends, one non-blocking send per
        connection from the current task, instead of by each connection's writer task on a
        later turn of the run loop: replies to one execution leave together, without a hop."""
        return self._write_batch

    def read_batch(self) -> "_WriteBatch":
        """A connection reader's batch over the frames of one read: a write batch held to its end
        however long it takes, so that what the frames answer (a PING's ack, say) leaves with,
        never before, the calls they started (handed on as the batch ends)."""
        return self._read_batch

    def close(self) -> None:
        """Stop accepting connections; GOAWAY to every connection (open calls finish)."""
        self._closing = True
        self._listen_scope.cancel()
        for conn in list(self._connections):
            conn.go_away()

    async def wait_closed(self) -> None:
        """Return once every connection has closed (after :meth:`close`)."""
        await self._all_closed.wait()
