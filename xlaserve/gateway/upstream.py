"""The gateway's HTTP/2 client: one connection to one worker, many gRPC calls on it.

An :class:`Upstream` keeps a connection to a worker open (reconnecting with capped back-off when
it is lost) and multiplexes calls on it, at most ``max_streams`` at once; more wait in a queue,
in order. HTTP/2 itself (frame dispatch, SETTINGS, header blocks and CONTINUATION, flow control
both ways, RST_STREAM and GOAWAY, every limit) is the sans-IO engine
:class:`xlaserve.http2.connection.H2Connection` in client mode, the one the server runs: a
worker is held to the limits a client is (:data:`WORKER_LIMITS`; docs/security.md, "A worker
that misbehaves"). This module is its Trio driver (reads, writes, clocks) and the gRPC calls on
top. Header blocks are encoded with the server's stateless HPACK encoder, so a worker's decode
cache answers every repeated block with one lookup.

A call is started with :meth:`Upstream.start` and a callback, not a task: the gateway's fast
ModelInfer path hands the request's bytes on from the client connection's reader, and the
callback answers the client from this connection's reader. What a call can end with:

- the worker's reply: :class:`Reply` (gRPC status, message, the response body's bytes);
- :class:`UpstreamError` with UNAVAILABLE: the connection was lost or refused, the worker sent
  GOAWAY or RST_STREAM before answering (the call may or may not have run; it is not retried, so
  nothing runs twice, unless the worker said it did not run it: ``unprocessed``), or the worker
  broke HTTP/2 or one of its limits (the connection is closed with GOAWAY naming what it did; for
  a stream error only that stream is reset). The message says which;
- :class:`UpstreamError` with RESOURCE_EXHAUSTED: the reply grew past ``max_reply_bytes`` (it is
  cut off: the stream is reset and nothing more of it is kept);
- :class:`UpstreamError` with DEADLINE_EXCEEDED: no answer within the call's timeout (the
  stream is reset, so the worker drops the work if it has not started).

The connection counts as up (calls are sent on it) once the worker's SETTINGS have arrived; a
worker that sends none within the handshake timeout is closed and connected to again.

Flow control: requests larger than the worker's window wait for its WINDOW_UPDATEs; replies are
taken as they come (the gateway reads them at once), so this end advertises large windows and
the engine returns them as DATA arrives. What a reply can make the gateway hold is bounded by
``max_reply_bytes``, not by a window.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import socket
from collections import deque
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import ContextManager

import trio
from grpclib.const import Status

from xlaserve.frontend.grpc_protocol import MESSAGE_PREFIX
from xlaserve.frontend.grpc_server import CALM_FLUSH_SECONDS, WRITE_CHUNK, recv_into, room_to_read
from xlaserve.frontend.guard import LineLimiter, describe
from xlaserve.http2.connection import CLOSED, HALF_CLOSED_LOCAL, OPEN, H2Connection, Handler, Stream
from xlaserve.http2.frames import CANCEL, ERROR_NAMES, FRAME_HEADER, REFUSED_STREAM, ConnectionError_, H2Limits
from xlaserve.http2.hpack import encode

log = logging.getLogger("xlaserve.gateway")

__all__ = ["Reply", "UpstreamError", "Upstream", "WORKER_LIMITS", "grpc_timeout", "status_named"]

OUR_WINDOW = 2**30                  # replies are consumed at once: a large window, returned as used
READ_SIZE = 256 * 1024              # the reply buffer at first (it grows for a longer frame)
MAX_REPLY_FRAME = 1 << 20           # the longest frame this end takes (SETTINGS_MAX_FRAME_SIZE)
TURN_EVERY = 16                     # reads from a worker between turns of the run loop, at most
DEFAULT_MAX_REPLY = 256 * 1024 * 1024   # the default of gateway.grpc.max_send_msg_bytes
#: What a worker's connection may do: the server's defaults for a client (H2Limits), but no idle
#: timeout (the gateway keeps its workers' connections open; the status stream keeps them busy).
WORKER_LIMITS = H2Limits(idle_timeout_seconds=0.0)
#: how a limit's message names it: not a node-file key (the gateway's limits for a worker are fixed)
WORKER_LIMIT_NAMES = "the gateway's fixed limit for a worker; endpoints.{} is a client's"
#: The resets (RST_STREAM) the gateway sends one worker's connection: a burst, refilled at a rate.
#: A worker counts each reset it receives against its glitch bucket (endpoints.glitch_burst 1000,
#: glitches_per_second 33 by default) and ends the connection when it is empty, failing every
#: call on it: resets made for clients (cancelled calls, deadlines, replies cut off) stay within
#: half of it. Past it a reset waits, its stream open at the worker (the call is answered already).
RESET_BURST = 500
RESETS_PER_SECOND = 16.0
#: What a worker takes in one request's header block: its node file's defaults (only the header
#: list's size is advertised, and the advertised value is used). A worker configured lower than
#: these still ends the gateway's connection on a request that crosses its limit.
WORKER_REQUEST_LIMITS = H2Limits()
_PLAIN_HEAD = ((":status", "200"), ("content-type", "application/grpc"))
_OK_TRAILERS = (("grpc-status", "0"),)


def _code(code: int) -> str:
    """An HTTP/2 error code, with its name when it has one."""
    return f"{code} ({ERROR_NAMES[code]})" if code in ERROR_NAMES else str(code)


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


class _Call(Stream):
    """One call: its HTTP/2 stream (the engine's :class:`Stream`) and its gRPC state."""

    __slots__ = ("block", "data", "on_done", "deadline", "status", "message", "body", "headers_seen", "done",
                 "on_message")

    def __init__(self, block: bytes, data: bytes, on_done: Callable[[Reply | UpstreamError], None],
                 deadline: float, on_message: Callable[[bytes], None] | None) -> None:
        # Stream's fields, set here (one call less per request)
        self.id = 0
        self.state = OPEN
        self.send_window = 0
        self.pending = deque()
        self.unacked = 0
        self.block = block
        self.data = data
        self.on_done = on_done
        self.on_message = on_message
        self.deadline = deadline
        self.status: int | None = None
        self.message = ""
        self.body = bytearray()
        self.headers_seen = False
        self.done = False


class Upstream(Handler):
    """A worker as the gateway's client of it. ``name`` names it in errors and metrics.
    ``max_reply_bytes``: the largest reply message taken from it (gateway.grpc.max_send_msg_bytes);
    ``limits``: what its connection may do (:data:`WORKER_LIMITS`)."""

    def __init__(self, name: str, host: str, port: int, *, max_streams: int = 32,
                 request_timeout: float = 60.0, connect_timeout: float = 5.0,
                 backoff_initial: float = 0.1, backoff_max: float = 5.0, server=None,
                 max_reply_bytes: int = DEFAULT_MAX_REPLY, limits: H2Limits = WORKER_LIMITS) -> None:
        self.name = name
        #: the gateway's GrpcServer: the client replies completed by one read from the worker
        #: are sent together when it ends (write_batch), and requests queued while the server
        #: handles a client's read go to the worker with one send when that read is done
        self._server = server
        self._batch: Callable[[], ContextManager] = server.write_batch if server is not None else nullcontext
        self._raw: socket.socket | None = None
        self._sending = False
        self._send_since = 0.0
        self._blocks: dict[tuple, bytes] = {}      # header blocks by (path, timeout, metadata)
        self.host = host
        self.port = port
        self.max_streams = max_streams
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.max_reply_bytes = max_reply_bytes
        self._max_body = max_reply_bytes + MESSAGE_PREFIX.size     # one message and its prefix
        self.limits = limits
        self.connected = trio.Event()     # replaced when the connection is lost
        self.up = False
        self.last_error = "not connected yet"
        self.outstanding = 0              # calls started and not yet answered (queued ones too)
        self.streaming = 0                # of those, server-streaming calls (the discovery's status stream)
        self.connects = 0
        self._authority = f"{host}:{port}"
        self._stream: trio.SocketStream | None = None
        self._h2: H2Connection | None = None
        self._reading = False             # inside the engine's receive: output goes when it returns
        self._read_scope: trio.CancelScope | None = None
        self._closing: ConnectionError_ | None = None     # a clock ran out (handshake, keep-alive, write)
        self._quiet = False               # GOAWAY received and no call left: the connection ends
        self._goaway_last: int | None = None
        self._plain_head: tuple | None = None     # the decoded reply head and OK trailers last seen
        self._ok_trailers: tuple | None = None
        self._writer_wake = trio.Event()
        self._queue: deque[_Call] = deque()
        #: calls with the request timeout, in start (so deadline) order; ended ones leave the head
        self._in_order: deque[_Call] = deque()
        self._timers: list[tuple[float, int, _Call]] = []   # calls with a shorter timeout, a heap
        self._timer_at = math.inf               # when the timer task wakes next (unless woken)
        self._timer_seq = itertools.count()
        self._timer_wake = trio.Event()
        self._retry = trio.Event()
        # the resets of this connection (_reset): a token bucket, and those held back past it
        self._reset_tokens = float(RESET_BURST)
        self._reset_at = 0.0
        self._held_resets: deque[_Call] = deque()
        self._reset_wake = trio.Event()
        self._faults = LineLimiter(log)     # one line a second for connections that fail
        self._now: Callable[[], float] = trio.current_time     # the run's clock (_reset_state)

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
        too_large = None
        if block is None:
            headers = [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", self._authority),
                       ("content-type", "application/grpc"), ("te", "trailers")]
            if wire_timeout:
                headers.append(("grpc-timeout", wire_timeout))
            headers.extend(metadata)
            block = encode(headers)
            too_large = self._past_header_limits(headers, block)
            if too_large is None:
                if len(self._blocks) >= 256:       # client deadlines vary: keep the cache small
                    self._blocks.clear()
                self._blocks[key] = block
        call = _Call(block, MESSAGE_PREFIX.pack(0, len(message)) + message, on_done,
                     self._now() + timeout, on_message)
        self.outstanding += 1
        self.streaming += on_message is not None
        if too_large is not None:
            self._finish(call, UpstreamError(Status.RESOURCE_EXHAUSTED, too_large))
            return call
        if not self.up:
            self._finish(call, UpstreamError(Status.UNAVAILABLE, self._down_message(), unprocessed=True))
            return call
        if timeout != math.inf:
            if usual:       # the request timeout: deadlines come in start order, a queue keeps them sorted
                self._in_order.append(call)
            else:
                heapq.heappush(self._timers, (call.deadline, next(self._timer_seq), call))
            if call.deadline < self._timer_at:
                self._timer_wake.set()
        h2 = self._h2
        streams = len(h2.streams)       # (h2.can_open(), inlined: one call less per request)
        if streams < self.max_streams and streams < h2.peer_max_streams and not h2.going_away:
            self._open(call)
        else:
            self._queue.append(call)
        return call

    def _past_header_limits(self, headers: list[tuple[str, str]], block: bytes) -> str | None:
        """Why the worker would refuse this request's header block, or None. The worker takes one
        past its limits as a connection error (GOAWAY ENHANCE_YOUR_CALM), failing every call on
        the connection, so a client's metadata that fits the gateway's own limits but not the
        worker's, once the gateway's fields are added, fails that call alone, here."""
        fields = len(headers)
        if fields > WORKER_REQUEST_LIMITS.max_header_fields:
            return (f"the request's metadata and the gateway's own fields make {fields} header fields; worker "
                    f"{self.name} takes at most {WORKER_REQUEST_LIMITS.max_header_fields} "
                    "(endpoints.max_header_fields): send fewer metadata fields")
        limit = self._h2.peer_max_header_list if self._h2 is not None else None
        limit = WORKER_REQUEST_LIMITS.max_header_list_bytes if limit is None else limit
        size = sum(len(name) + len(value) + 32 for name, value in headers)
        if size > limit:
            return (f"the request's metadata and the gateway's own fields make a header list of {size} bytes "
                    f"(RFC 9113 sizes: name, value and 32 per field); worker {self.name} takes at most {limit} "
                    "(its SETTINGS_MAX_HEADER_LIST_SIZE, endpoints.max_header_list_bytes): send less metadata")
        if len(block) > WORKER_REQUEST_LIMITS.max_header_block_bytes:
            return (f"the request's metadata and the gateway's own fields encode to a header block of {len(block)} "
                    f"bytes; worker {self.name} takes at most {WORKER_REQUEST_LIMITS.max_header_block_bytes} "
                    "(endpoints.max_header_block_bytes): send less metadata")
        return None

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
                    # Whatever else ends this connection (a bug) ends it alone: the calls on it
                    # fail UNAVAILABLE and the connection is made again, never reaching the
                    # gateway's nursery.
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
        self._closing = None
        self._quiet = False
        self._goaway_last = None
        self.connects += 1
        self.last_error = "the worker has not sent its SETTINGS yet (the HTTP/2 handshake)"
        # the same descriptor as a plain socket, for a non-blocking send from the current task
        self._raw = socket.socket(fileno=stream.socket.fileno())
        h2 = self._reset_state()
        error: ConnectionError_ | None = None
        read_scope = self._read_scope = trio.CancelScope()     # the writer and the clocks end the reader
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer, stream)
                nursery.start_soon(self._clock, h2)
                nursery.start_soon(self._paced_resets, h2)
                h2.initiate()
                try:
                    with read_scope:
                        await self._read_loop(h2)
                except ConnectionError_ as exc:
                    error = exc
                except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    if not self.last_error or not self._quiet:
                        self.last_error = f"connection lost: {exc or type(exc).__name__}"
                error = error or self._closing
                nursery.cancel_scope.cancel()
        finally:
            raw, self._raw = self._raw, None
            raw.detach()
            self._read_scope = None
        if error is not None:
            await self._go_away(stream, h2, error)

    def _reset_state(self) -> H2Connection:
        """A new connection's HTTP/2 state (the engine, client mode)."""
        self._blocks.clear()        # checked against the last connection's advertised limit
        self._reset_tokens, self._reset_at = float(RESET_BURST), trio.current_time()
        self._held_resets.clear()
        # the run's clock, read without trio.current_time's two calls in between (one a request)
        self._now = trio.lowlevel.current_clock().current_time
        self._h2 = H2Connection(self, client=True, limits=self.limits, clock=self._now,
                                stream_window=OUR_WINDOW, conn_window=OUR_WINDOW, max_frame=MAX_REPLY_FRAME,
                                limit_names=WORKER_LIMIT_NAMES)
        return self._h2

    async def _go_away(self, stream: trio.SocketStream, h2: H2Connection, error: ConnectionError_) -> None:
        """The worker broke HTTP/2 or a limit: GOAWAY naming what it did, sent for a short while."""
        self.last_error = f"the gateway closed the connection with GOAWAY {_code(error.code)}: {error}"
        self._faults.line(logging.WARNING, "gateway: worker %s at %s: %s", self.name, self._authority,
                          self.last_error)
        self._reading = True            # no flush from the engine's write: sent here
        h2.connection_error(error)
        h2.stopped = True
        with trio.move_on_after(CALM_FLUSH_SECONDS):
            try:
                await stream.send_all(h2.take_output())
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass                    # it is gone already: nothing more to tell it

    def _lost(self) -> None:
        """The connection ended: every call on it or waiting for it fails UNAVAILABLE."""
        was_up, self.up = self.up, False
        self.connected = trio.Event()
        if was_up:
            log.warning("gateway: lost worker %s at %s (%s)", self.name, self._authority, self.last_error)
        error = UpstreamError(Status.UNAVAILABLE, f"worker {self.name} ({self._authority}): {self.last_error}; "
                                                  "the request may or may not have run")
        h2, self._h2 = self._h2, None
        calls = list(h2.streams.values()) if h2 is not None else []
        queued = list(self._queue)
        self._queue.clear()
        for call in calls:
            self._finish(call, error)
        for call in queued:          # never sent
            self._finish(call, UpstreamError(Status.UNAVAILABLE, f"worker {self.name} ({self._authority}): "
                                             f"{self.last_error}", unprocessed=True))
        self._stream = None
        self._reading = False

    def reconnect_now(self) -> None:
        """Cut the back-off short: the worker is known to be up again (its supervisor says)."""
        self._retry.set()

    async def aclose(self) -> None:
        """Close the connection (the run task reconnects unless cancelled)."""
        if self._stream is not None:
            await self._stream.aclose()

    # ---- sending ---------------------------------------------------------------------------
    def _open(self, call: _Call) -> None:
        data, call.data = call.data, b""
        if len(data) > 65536:
            # what waits for window is cut from a view, not copied over and over (a 64 MiB
            # request in 16 KiB frames would copy its rest once per frame: 128 GiB)
            data = memoryview(data)
        self._h2.open_stream(call, call.block, data)

    def output_ready(self) -> None:
        """The engine queued output: sent now (or when the server's write batch ends), or when
        the read being handled is done."""
        if not self._reading:
            server = self._server
            if server is not None and server.holding:
                server.hold(self)
            else:
                self.flush()

    def flush(self) -> None:
        """One non-blocking send of what is queued; the writer task sends what the socket does
        not take (and everything while it is mid-send)."""
        h2 = self._h2
        if h2 is None or not h2.out:
            return
        out = h2.out
        if self._raw is not None and not self._sending:
            try:
                sent = self._raw.send(out)
            except OSError:          # would block, or broken: the writer (and reader) find out
                sent = 0
            if sent == len(out):
                h2.take_output()
                return
            del out[:sent]
        self._writer_wake.set()

    async def _writer(self, stream: trio.SocketStream) -> None:
        h2 = self._h2
        try:
            while True:
                await self._writer_wake.wait()
                self._writer_wake = trio.Event()
                while h2.out:
                    data = memoryview(h2.take_output())
                    self._sending = True
                    try:
                        # in chunks, so that the write clock sees progress, not size
                        for i in range(0, len(data), WRITE_CHUNK):
                            self._send_since = trio.current_time()
                            await stream.send_all(data[i:i + WRITE_CHUNK])
                    finally:
                        self._sending = False
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if not self._quiet:
                self.last_error = f"connection lost: {exc or type(exc).__name__}"
            self._read_scope.cancel()

    async def _clock(self, h2: H2Connection) -> None:
        """The connection's clocks (the engine's): the handshake, keep-alive and the writer's
        progress (``write_timeout_seconds``; looked at every half of it at least, as a write may
        start after a tick). One that runs out ends the connection."""
        half = self.limits.write_timeout_seconds / 2
        try:
            while True:
                wake = h2.tick(writing_since=self._send_since if self._sending else None)
                await trio.sleep_until(min(wake, trio.current_time() + half))
        except ConnectionError_ as exc:
            self._closing = exc
            self._read_scope.cancel()

    # ---- receiving -------------------------------------------------------------------------
    async def _read_loop(self, h2: H2Connection) -> None:
        # One buffer, filled with recv_into (no allocation per read), grown for a frame longer
        # than it; the engine hands DATA on as views into it (copied once, into its call's body).
        raw = self._raw
        buffer = bytearray(READ_SIZE)
        view = memoryview(buffer)
        start = end = reads = 0
        unpack = FRAME_HEADER.unpack_from
        receive = h2.receive
        batch = self._batch
        while True:
            # replies go out from here, with no task in between: a read that did not wait
            # yields a turn only now and then (every TURN_EVERY), so other connections are served
            reads += 1
            n = await recv_into(raw, view[end:], turn=not reads % TURN_EVERY)
            if not n:
                raise trio.BrokenResourceError("the worker closed the connection")
            end += n
            h2.note_read()
            while True:
                self._reading = True
                try:
                    with batch():
                        start = receive(buffer, view, start, end)
                        self._reading = False       # what the frames queued goes now (or as the batch ends)
                        if h2.out:
                            self.output_ready()
                finally:
                    self._reading = False
                if self._quiet:
                    raise trio.BrokenResourceError(self.last_error)
                if not h2.spent:
                    break
                await trio.lowlevel.checkpoint()     # a turn's worth handled: let the others run
            if start == end:
                start = end = 0
                continue
            # (the engine refused a frame longer than MAX_REPLY_FRAME as soon as its header came)
            need = 9 + (unpack(buffer, start)[0] >> 8) if end - start >= 9 else 9
            # grown for a frame longer than the buffer; else room made at the end
            buffer, view, start, end = room_to_read(buffer, view, start, end, need, max(len(buffer), need), 4096)

    # the engine's calls (Handler)
    def settings_received(self) -> None:
        h2 = self._h2
        if not self.up and not h2.going_away:
            self.up = True
            self.last_error = ""
            self.connected.set()
            log.info("gateway: connected to worker %s at %s", self.name, self._authority)
        self._open_queued()

    def headers_received(self, call: _Call, headers: tuple, end_stream: bool) -> None:
        if call.done:
            return
        # A repeated block decodes to the very same tuple: the usual reply head (":status" 200)
        # and OK trailers are known by identity, not read field by field.
        if headers is self._plain_head:
            call.headers_seen = True
        elif headers is self._ok_trailers:
            call.status = 0
            call.headers_seen = True
        else:
            self._read_headers(call, headers)
        if end_stream:
            self._answered(call)

    def _read_headers(self, call: _Call, headers: tuple) -> None:
        status = call.status
        for name, value in headers:
            if name == "grpc-status":
                call.status = int(value) if value.isdigit() else Status.UNKNOWN.value
            elif name == "grpc-message":
                call.message = _percent_decode(value)
            elif name == ":status" and value != "200" and call.status is None:
                call.status = Status.UNAVAILABLE.value if value in ("502", "503", "504") else Status.UNKNOWN.value
                call.message = f"worker {self.name} answered HTTP {value}"
        call.headers_seen = True
        if headers == _PLAIN_HEAD:
            self._plain_head = headers
        elif status is None and headers == _OK_TRAILERS:
            self._ok_trailers = headers

    def data_received(self, call: _Call, data, end_stream: bool) -> None:
        if call.done:
            return
        body = call.body
        if len(body) + len(data) > self._max_body:
            self._give_up(call, UpstreamError(
                Status.RESOURCE_EXHAUSTED, f"worker {self.name}'s reply is larger than {self.max_reply_bytes} bytes "
                                           "(gateway.grpc.max_send_msg_bytes): it was cut off"))
            return
        body += data
        if call.on_message is not None:
            self._deliver(call)
        if end_stream:
            self._answered(call)

    def stream_reset(self, call: _Call, code: int, remote: bool) -> None:
        if call.done:
            return
        if not remote:      # a stream error of the worker's: the engine reset the stream
            error = UpstreamError(Status.UNAVAILABLE, f"worker {self.name} broke HTTP/2 on the call's stream "
                                                      f"({self._h2.reset_why}); the gateway reset it with "
                                                      f"{_code(code)}")
        elif code == REFUSED_STREAM and self._goaway_last is not None and call.id > self._goaway_last:
            error = UpstreamError(Status.UNAVAILABLE, f"worker {self.name} is stopping and refused the request "
                                                      "before running it", unprocessed=True)
        else:
            # REFUSED_STREAM: the worker did no work for it (RFC 9113 8.7)
            error = UpstreamError(Status.UNAVAILABLE, f"worker {self.name} reset the stream (HTTP/2 error code "
                                                      f"{_code(code)}) before answering",
                                  unprocessed=code == REFUSED_STREAM)
        self._finish(call, error)

    def stream_closed(self, call: _Call) -> None:
        if not call.done:           # (the engine resets or ends a stream before closing it)
            self._finish(call, UpstreamError(Status.UNAVAILABLE, f"worker {self.name} closed the stream"))
        if self._queue:
            self._open_queued()

    def goaway_received(self, last_stream_id: int, code: int, debug: bytes) -> None:
        self._goaway_last = last_stream_id
        self.up = False        # no new calls here; those it will still answer finish
        said = debug[:200].decode("utf-8", "replace")
        self.last_error = (f"the worker sent GOAWAY (it is stopping; HTTP/2 error code {_code(code)}"
                           f"{': ' + said if said else ''})")
        queued, self._queue = self._queue, deque()
        for call in queued:
            self._finish(call, UpstreamError(Status.UNAVAILABLE, self._down_message(), unprocessed=True))

    def quiet(self) -> None:
        """Going away and no call left: the connection ends."""
        self._quiet = True
        if not self.last_error:     # this end went away (no GOAWAY came): what the calls it queued are told
            self.last_error = ("the connection was idle" if self._h2.idle_expired
                               else "the connection used every HTTP/2 stream id") + "; connecting again"
        if not self._reading and self._read_scope is not None:
            self._read_scope.cancel()

    def _deliver(self, call: _Call) -> None:
        body = call.body
        pos = 0
        while len(body) - pos >= 5:
            _, length = MESSAGE_PREFIX.unpack_from(body, pos)
            if len(body) - pos < 5 + length:
                break
            try:
                call.on_message(bytes(body[pos + 5:pos + 5 + length]))
            except Exception as exc:
                # (a worker's message the caller cannot take, or a bug above): this call fails
                # and its stream is reset; the connection and its other calls go on
                self._faults.line(logging.ERROR, "gateway: a reply message of worker %s at %s could not be handled "
                                  "(%s)", self.name, self._authority, describe(exc), exc=exc)
                self._give_up(call, UpstreamError(Status.INTERNAL, f"the gateway could not handle a reply message "
                                                                   f"of worker {self.name}: {describe(exc)}"))
                return
            pos += 5 + length
        if pos:
            del body[:pos]

    # ---- ending calls ----------------------------------------------------------------------
    def _answered(self, call: _Call) -> None:
        """The worker ended its side of ``call``'s stream: the call's outcome."""
        error = None
        if call.status is None:
            error = UpstreamError(Status.UNKNOWN if call.headers_seen else Status.UNAVAILABLE,
                                  f"worker {self.name} ended the call without a grpc-status")
        self._finish(call, error if error is not None else Reply(call.status, call.message, bytes(call.body)))
        if call.state != CLOSED and not call.state & HALF_CLOSED_LOCAL:
            self._reset(call)               # answered before the request was all sent: the rest is not

    def _reset(self, call: _Call) -> None:
        """Reset ``call``'s stream (CANCEL), within :data:`RESET_BURST` and :data:`RESETS_PER_SECOND`:
        past them the reset waits (:meth:`_paced_resets`) and the stream stays open, counted against
        ``max_streams``, until the budget refills or the worker ends it. The engine does not count a
        reset this end asks for against ``max_queued_control_frames`` (it cannot raise); a worker
        that reads none of what this end sends is ended by the write timeout."""
        self._refill_resets()
        if self._reset_tokens >= 1.0 and not self._held_resets:
            self._reset_tokens -= 1.0
            self._h2.reset(call, CANCEL)
            return
        self._held_resets.append(call)
        self._reset_wake.set()

    def _refill_resets(self) -> None:
        """The reset budget, refilled for the time since it was last looked at (capped at the burst)."""
        now = trio.current_time()
        self._reset_tokens = min(float(RESET_BURST), self._reset_tokens + (now - self._reset_at) * RESETS_PER_SECOND)
        self._reset_at = now

    async def _paced_resets(self, h2: H2Connection) -> None:
        """Send the resets :meth:`_reset` held back, in order, as the budget refills; a stream the
        worker ended meanwhile needs none."""
        held = self._held_resets
        while True:
            while not held:
                self._reset_wake = trio.Event()
                await self._reset_wake.wait()
            self._refill_resets()
            if self._reset_tokens < 1.0:
                await trio.sleep((1.0 - self._reset_tokens) / RESETS_PER_SECOND)
                continue
            while held and self._reset_tokens >= 1.0:
                call = held.popleft()
                if h2.streams.get(call.id) is call:
                    self._reset_tokens -= 1.0
                    h2.reset(call, CANCEL)
            if h2.out:
                self.output_ready()

    def _open_queued(self) -> None:
        h2 = self._h2
        while self._queue and self.up and len(h2.streams) < self.max_streams and h2.can_open():
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
        call.data = call.block = call.body = b""
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
        h2 = self._h2
        self._finish(call, error)
        if h2 is not None and h2.streams.get(call.id) is call:
            self._reset(call)
        else:
            try:
                self._queue.remove(call)
            except ValueError:
                pass


def _percent_decode(value: str) -> str:
    """A grpc-message value (percent-encoded UTF-8) as text."""
    if "%" not in value:
        return value
    from urllib.parse import unquote
    return unquote(value, encoding="utf-8", errors="replace")
