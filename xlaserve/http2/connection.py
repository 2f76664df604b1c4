"""One HTTP/2 connection as a sans-IO state machine, in server mode or client mode.

API (what a driver does, what its handler receives)
---------------------------------------------------
``H2Connection(handler, client=False, limits=H2Limits(), clock=time.monotonic, ...)`` holds
everything HTTP/2 about one connection: frame dispatch, SETTINGS both ways, stream ids and
states, header blocks (HEADERS + CONTINUATION, HPACK-decoded), flow control both ways, the limits
of :class:`~xlaserve.http2.frames.H2Limits` (glitch bucket, queued control frames, header block
sizes, concurrent streams), GOAWAY and RST_STREAM. It never touches a socket or a task.

Bytes in: the driver reads into a buffer and calls ``receive(buffer, view, pos, end)``: the
complete frames in ``buffer[pos:end]`` are handled (a server first takes the client's connection
preface there) and the position after the last one handled is returned; the rest waits for more
bytes. A call handles at most ``work`` frames' worth (a turn; DATA and large frames cost more),
or fewer once the handler sets ``spent``; ``spent`` is True after a turn that stopped early, and
the driver lets the other connections run before it calls again. ``feed(data)`` does all this
for a driver (or a test) that just has bytes. A peer that breaks the protocol or a limit makes
``receive`` raise :class:`~xlaserve.http2.frames.ConnectionError_` (its ``code`` and a message
naming the ``endpoints.`` key): the driver calls ``connection_error(exc)`` (GOAWAY with them),
sends what is queued and closes.

Bytes out: everything to send is appended to ``out`` (a bytearray), and the handler's
``output_ready()`` is called after each append. The driver sends ``out`` and empties it
(``take_output()``, or ``del out[:sent]`` after a partial send; ``data_to_send()`` for tests).
``stopped = True`` drops all later output (a connection that is closing).

Handler (any object; :class:`Handler` has no-op defaults), called from inside ``receive`` and the
sending methods (``end_stream`` is truthy when the frame carried END_STREAM):

- ``stream_opened(sid, headers, end_stream)`` (server mode): a request's header block, already
  checked (stream id order, ``max_concurrent_streams``, malformed fields). The handler registers
  its :class:`Stream` (or subclass) with ``accept(stream, end_stream)`` or turns it down with
  ``refuse(sid, code)``.
- ``headers_received(stream, headers, end_stream)``: a later header block on an open stream
  (server: the request's trailers; client: the response's headers and trailers).
- ``data_received(stream, data, end_stream)``: a DATA payload (padding removed). ``data`` may be a
  view into the driver's buffer: copy what is kept. Receive windows are replenished here, as
  data arrives (WINDOW_UPDATE at half a window, connection and stream).
- ``stream_reset(stream, code, remote)``: the peer reset the stream (``remote``), or this end did
  (a stream error, or ``reset``); ``stream_closed`` follows.
- ``stream_closed(stream)``: the stream left ``streams`` (both ends ended, or reset).
- ``stream_drained(stream)``: output that waited for window has all been sent.
- ``settings_received()``: the peer's SETTINGS were applied (windows, frame size,
  ``peer_max_streams``); ``settings_acked()``: ours were acknowledged.
- ``goaway_received(last_stream_id, code, debug)``: no new streams on this connection; in client
  mode the streams above ``last_stream_id`` were not processed (safe to retry elsewhere).
- ``ping_acked(payload)``; ``quiet()``: going away and no stream is left (the driver may close);
  ``output_ready()`` (above).

Sending: server mode ``send_headers`` / ``send_data`` / ``send_end`` (trailers), and ``send_raw``
for a whole answer framed by the caller (when its one DATA frame has room); client mode
``open_stream(stream, block, data)`` (the next odd id; ``can_open()`` says whether the peer's
stream limit and a GOAWAY allow one). DATA honours the peer's stream and connection windows and
its MAX_FRAME_SIZE: what does not fit now waits in ``stream.pending`` (``waiting_bytes`` over all
streams) and goes out as WINDOW_UPDATE or SETTINGS open the windows, then ``stream_drained``.
Ending this side of a stream whose peer has not ended its own closes it in server mode with
RST_STREAM NO_ERROR (the request need not be sent on: RFC 9113 8.1); in client mode the stream
waits half-closed for the response.

Clock: ``clock`` (injected; the Trio driver passes ``trio.current_time``) times the glitch bucket
and the read that ``note_read()`` records. ``tick(now)`` runs the handshake, keep-alive, idle and
write-progress timers: it raises ConnectionError_ when the handshake or a keep-alive PING ran out, writes a PING
when one is due, goes away (GOAWAY NO_ERROR) when idle, and returns when it wants to be called
next. Its first call starts the handshake clock. Tests drive all of it with a fake clock and
bytes, with no socket and no sleep.
"""
from __future__ import annotations

import math
import time
from collections import deque

from xlaserve.http2.frames import (
    ACK, CONTINUATION, DATA, DEFAULT_FRAME, DEFAULT_WINDOW, ENABLE_PUSH, END_HEADERS, END_STREAM,
    ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, FRAME_HEADER, FRAME_SIZE_ERROR, GOAWAY, HEADERS, INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS, MAX_FRAME_LIMIT, MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE, MAX_WINDOW, NO_ERROR, PADDED,
    PING, PREFACE, PRIORITY, PRIORITY_FLAG, PROTOCOL_ERROR, PUSH_PROMISE, REFUSED_STREAM, RST_STREAM, SETTING,
    SETTINGS, SERVER_LIMIT_NAMES, STREAM_CLOSED, U32, WINDOW_UPDATE, COMPRESSION_ERROR, ConnectionError_, H2Limits,
    calm, frame, malformed,
)
from xlaserve.http2.hpack import Decoder, HeaderListTooLarge, HPACKError, TooManyHeaderFields

__all__ = ["H2Connection", "Handler", "Stream", "OPEN", "HALF_CLOSED_REMOTE", "HALF_CLOSED_LOCAL", "CLOSED",
           "WORK_PER_TURN", "KEEPALIVE_PING", "DEFAULT_STREAM_WINDOW", "DEFAULT_CONN_WINDOW", "DEFAULT_MAX_FRAME"]

# Stream states (RFC 9113 5.1) as bits: a stream in ``streams`` is OPEN or half-closed (the end
# that sent END_STREAM); CLOSED once it has left ``streams``. (Idle and reserved streams have no
# object: idle ones are told by their id, pushes are refused.)
OPEN = 0
HALF_CLOSED_REMOTE = 1          # the peer sent END_STREAM
HALF_CLOSED_LOCAL = 2           # this end sent END_STREAM
_BOTH = 3                       # both ended: closed as soon as the engine sees it
CLOSED = 7

WORK_PER_TURN = 128     # frames (+1 per 64 KiB of DATA, per 256 B of others) one receive() handles
KEEPALIVE_PING = b"xlkeepal"
# what this end advertises unless told otherwise (the gRPC server's choices)
DEFAULT_STREAM_WINDOW = 4 * 1024 * 1024
DEFAULT_CONN_WINDOW = 16 * 1024 * 1024
DEFAULT_MAX_FRAME = 1024 * 1024

_MASK = 0x7FFFFFFF
_PLAIN_HEADERS = END_HEADERS | PADDED | PRIORITY_FLAG     # of these, a usual HEADERS frame has END_HEADERS alone
_END = ("end",)         # a pending item: END_STREAM on the DATA before it; trailers wait as (block,)


class Stream:
    """One stream's HTTP/2 state; the layer above subclasses it (adding its own slots) so that
    a request is one object (a subclass's ``__init__`` may set these five itself instead of
    calling this one: one call less per request). ``pending``: DATA (and the end) waiting for
    window."""

    __slots__ = ("id", "state", "send_window", "pending", "unacked")

    def __init__(self, stream_id: int = 0) -> None:
        self.id = stream_id
        self.state = OPEN
        self.send_window = 0        # what may be sent on it (the peer's window), set when registered
        self.pending: deque = deque()
        self.unacked = 0            # received bytes not yet returned by WINDOW_UPDATE


class Handler:
    """The calls an :class:`H2Connection` makes (see the module docstring); all do nothing."""

    def output_ready(self) -> None: pass
    def stream_opened(self, sid: int, headers: tuple, end_stream: int) -> None: pass
    def headers_received(self, stream: Stream, headers: tuple, end_stream: int) -> None: pass
    def data_received(self, stream: Stream, data, end_stream: int) -> None: pass
    def stream_reset(self, stream: Stream, code: int, remote: bool) -> None: pass
    def stream_closed(self, stream: Stream) -> None: pass
    def stream_drained(self, stream: Stream) -> None: pass
    def settings_received(self) -> None: pass
    def settings_acked(self) -> None: pass
    def goaway_received(self, last_stream_id: int, code: int, debug: bytes) -> None: pass
    def ping_acked(self, payload: bytes) -> None: pass
    def quiet(self) -> None: pass


class H2Connection:
    """One HTTP/2 connection's state, both directions (see the module docstring)."""

    def __init__(self, handler, *, client: bool = False, limits: H2Limits = H2Limits(), clock=time.monotonic,
                 stream_window: int = DEFAULT_STREAM_WINDOW, conn_window: int = DEFAULT_CONN_WINDOW,
                 max_frame: int = DEFAULT_MAX_FRAME, limit_names: str = SERVER_LIMIT_NAMES) -> None:
        self.handler = handler
        #: how a limit's message names where it is set ("endpoints.{}": a node-file key)
        self.limit_names = limit_names
        self.client = client
        self.peer_name = "server" if client else "client"
        self.limits = limits
        self.clock = clock
        # what this end advertises
        self.stream_window = stream_window
        self.conn_window = conn_window
        self.max_frame = max_frame
        self.decoder = Decoder(max_header_list_size=limits.max_header_list_bytes,
                               max_header_fields=limits.max_header_fields)
        self.streams: dict[int, Stream] = {}
        #: streams closed at the HTTP/2 level whose work the layer above still counts against
        #: max_concurrent_streams (it adds and removes them)
        self.zombies = 0
        #: the highest stream id opened (by the client: the peer in server mode, us in client mode)
        self.last_stream = 0
        self.streams_opened = 0
        # the peer's settings and our send window
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.peer_max_streams = MAX_WINDOW
        self.peer_max_header_list: int | None = None   # advertised (SETTINGS_MAX_HEADER_LIST_SIZE), if it was
        self.send_window = DEFAULT_WINDOW
        self.recv_unacked = 0                       # connection-level bytes received, not yet returned
        self._conn_half = conn_window // 2          # returned (WINDOW_UPDATE) once this much arrived...
        # What the peer may send before our WINDOW_UPDATEs return it: on the connection (the
        # protocol's 65,535 until ours raises it), on a stream (65,535 until the peer acknowledges
        # our INITIAL_WINDOW_SIZE, then that). DATA past either breaks flow control.
        self._conn_bound = max(conn_window, DEFAULT_WINDOW)
        self._stream_bound = max(stream_window, DEFAULT_WINDOW)
        self._stream_half = stream_window // 2      # ...on the connection, on a stream
        self.blocked: dict[int, Stream] = {}        # streams with output waiting for window
        self.waiting_bytes = 0                      # DATA bytes waiting for window, all streams
        self.out = bytearray()
        self.stopped = False
        self.control_queued = 0                     # control replies in ``out`` (reset when taken)
        self.preface_needed = not client
        self.settled = False                        # the peer's first SETTINGS frame arrived
        self.going_away = False                     # no new streams: GOAWAY sent or received
        self.goaway_sent = False
        self.goaway_last: int | None = None         # the last stream id of a GOAWAY received
        #: a header block in progress: stream id, its HEADERS flags, the block, CONTINUATIONs so far
        self.continuation: tuple[int, int, bytearray, int] | None = None
        self.spent = False
        now = clock()
        self.received_at = now
        self.reads = 0
        self.glitch_tokens = float(limits.glitch_burst)
        self.glitch_at = now
        self._checked: tuple | None = None          # the last request field tuple found well-formed
        # timers (tick)
        self._phase = 0                             # 0: handshake, 1: running, 2: done
        self.idle_expired = False                   # tick() went away for idle_timeout_seconds
        self._started_at: float | None = None
        self._ping_at: float | None = None
        self._reads_at_ping = 0
        self._idle_since = 0.0
        self._idle_count = -1
        # the handler's methods, looked up once
        self._output_ready = handler.output_ready
        self._stream_opened = getattr(handler, "stream_opened", None)
        self._headers_received = handler.headers_received
        self._data_received = handler.data_received
        self._stream_reset = handler.stream_reset
        self._stream_closed = handler.stream_closed
        self._stream_drained = handler.stream_drained
        self._settings_received = handler.settings_received
        self._settings_acked = handler.settings_acked
        self._goaway_received = handler.goaway_received
        self._ping_acked = handler.ping_acked
        self._quiet = handler.quiet

    # ---- output ------------------------------------------------------------------------------
    def write(self, data) -> None:
        """Queue ``data`` (frames) to send."""
        if self.stopped:
            return
        self.out += data
        self._output_ready()

    def release(self) -> None:
        """The connection has ended: nothing more is queued, and what this engine holds that can
        be large goes now (queued output, a header block in progress, the HPACK decoder's table
        and its cache of decoded blocks, up to 64 blocks of 1 KiB). The driver and its engine
        refer to each other (the handler), so without this they would wait for a full garbage
        collection, which can come much later."""
        self.stopped = True
        self.out = bytearray()
        self.continuation = None
        self._inbox = b""
        self.decoder = Decoder(max_table_size=0, max_header_list_size=0, max_header_fields=0)

    def take_output(self) -> bytearray:
        """What is queued to send, leaving nothing queued."""
        data, self.out = self.out, bytearray()
        self.control_queued = 0
        return data

    def data_to_send(self) -> bytes:
        return bytes(self.take_output())

    def _control(self, data: bytes) -> None:
        """Queue a control reply the peer's frame asked for: PING and SETTINGS acks, RST_STREAM.
        A peer that sends such frames and never reads is cut off."""
        self.control_queued += 1
        if self.control_queued > self.limits.max_queued_control_frames:
            raise self._calm(f"more than {self.limits.max_queued_control_frames} control frames (PING and SETTINGS "
                             f"acknowledgements, RST_STREAM) are queued for a {self.peer_name} that does not read them",
                             "max_queued_control_frames", self.limits.max_queued_control_frames)
        self.write(data)

    def _calm(self, what: str, key: str, limit) -> ConnectionError_:
        return calm(what, key, limit, self.limit_names)

    def glitch(self, what: str) -> None:
        """Count one wasted piece of work the peer caused (a reset stream, a refused stream, an
        empty frame, ...) against a token bucket: a burst of ``glitch_burst``, refilled at
        ``glitches_per_second``. Emptying it ends the connection (rapid reset and kin)."""
        limits = self.limits
        now = self.clock()
        tokens = min(float(limits.glitch_burst),
                     self.glitch_tokens + (now - self.glitch_at) * limits.glitches_per_second) - 1.0
        self.glitch_at = now
        self.glitch_tokens = tokens
        if tokens < 0:
            raise ConnectionError_(ENHANCE_YOUR_CALM, (
                f"too many stream resets, refused streams and wasted frames (the last: {what}); the limit is a "
                f"burst of {limits.glitch_burst} refilled at {limits.glitches_per_second:g}/s "
                f"({self.limit_names.format('glitch_burst')}, {self.limit_names.format('glitches_per_second')})"))

    # ---- the connection ---------------------------------------------------------------------
    def initiate(self) -> None:
        """Client mode: queue the connection preface and our SETTINGS (server mode sends its
        SETTINGS once the client's preface has arrived)."""
        self.write(PREFACE + self._our_settings())

    def _our_settings(self) -> bytes:
        entries = [(MAX_FRAME_SIZE, self.max_frame), (MAX_HEADER_LIST_SIZE, self.limits.max_header_list_bytes)]
        if self.stream_window != DEFAULT_WINDOW:
            entries.insert(0, (INITIAL_WINDOW_SIZE, self.stream_window))
        entries.insert(0, (ENABLE_PUSH, 0) if self.client else (MAX_CONCURRENT_STREAMS,
                                                                 self.limits.max_concurrent_streams))
        settings = frame(SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in entries))
        if self.conn_window > DEFAULT_WINDOW:
            settings += frame(WINDOW_UPDATE, 0, 0, U32.pack(self.conn_window - DEFAULT_WINDOW))
        return settings

    def note_read(self) -> None:
        """The driver read bytes from the peer (keep-alive: the peer is there)."""
        self.reads += 1
        self.received_at = self.clock()

    def connection_error(self, exc: ConnectionError_) -> None:
        """Queue GOAWAY for ``exc`` (its code and message); the driver then closes."""
        self.going_away = self.goaway_sent = True
        self.write(frame(GOAWAY, 0, 0, U32.pack(self.last_stream) + U32.pack(exc.code) + str(exc).encode()[:256]))

    def go_away(self, code: int = NO_ERROR, message: str = "") -> None:
        """Graceful close: GOAWAY (once), no new streams; the open ones finish, then ``quiet()``."""
        if not self.goaway_sent:
            self.going_away = self.goaway_sent = True
            self.write(frame(GOAWAY, 0, 0, U32.pack(self.last_stream) + U32.pack(code) + message.encode()[:256]))
        self.going_away = True
        if not self.streams:
            self._quiet()

    def ping(self, payload: bytes = KEEPALIVE_PING) -> None:
        self.write(frame(PING, 0, 0, payload))

    def tick(self, now: float | None = None, reading: bool = True, writing_since: float | None = None) -> float:
        """Run the connection's clocks at ``now`` (default: the clock): the handshake (the peer's
        SETTINGS within ``handshake_timeout_seconds`` of the first tick), keep-alive (a PING once
        nothing was read for ``keepalive_interval_seconds``, the connection closed when nothing
        follows within ``keepalive_timeout_seconds``; not while ``reading`` is False: the answer
        would not be read), the driver's write (``writing_since``: when the write it is stuck in
        last made progress, None when it is not writing; a peer that does not read is cut off after
        ``write_timeout_seconds``) and idle (no stream for ``idle_timeout_seconds``:
        :meth:`go_away`). Raises ConnectionError_ for a clock that ran out; returns when to tick
        next (inf: never)."""
        if now is None:
            now = self.clock()
        limits = self.limits
        if self._phase == 0:
            if self._started_at is None:
                self._started_at = now
            due = self._started_at + limits.handshake_timeout_seconds
            if now < due:
                return due
            if not self.settled:
                raise self._calm(f"the {self.peer_name} sent no connection preface and SETTINGS frame within "
                                 f"{limits.handshake_timeout_seconds:g} s of connecting", "handshake_timeout_seconds",
                                 f"{limits.handshake_timeout_seconds:g} s")
            self._phase = 1
            self._idle_since, self._idle_count = now, -1
        elif self._phase == 2:
            return math.inf
        wake = math.inf
        if writing_since is not None:
            write = limits.write_timeout_seconds
            if now - writing_since >= write:
                raise self._calm(f"a write to the {self.peer_name} made no progress for {write:g} s (it does not read)",
                                 "write_timeout_seconds", f"{write:g} s")
            wake = writing_since + write
        interval, answer = limits.keepalive_interval_seconds, limits.keepalive_timeout_seconds
        if interval > 0 and reading:
            if self._ping_at is not None and self.reads != self._reads_at_ping:
                self._ping_at = None                        # something arrived: the peer is there
            if self._ping_at is None:
                due = self.received_at + interval
                if now >= due:
                    self._ping_at, self._reads_at_ping = now, self.reads
                    self.ping()
                    wake = min(wake, now + answer)
                else:
                    wake = min(wake, due)
            elif now >= self._ping_at + answer:
                raise self._calm(f"no frame arrived for {answer:g} s after a keep-alive PING",
                                 "keepalive_timeout_seconds", f"{answer:g} s")
            else:
                wake = min(wake, self._ping_at + answer)
        idle = limits.idle_timeout_seconds
        if idle > 0:
            if self.streams or self.zombies or self.streams_opened != self._idle_count:
                self._idle_since, self._idle_count = now, self.streams_opened
            elif now - self._idle_since >= idle:
                self._phase = 2
                self.idle_expired = True
                self.go_away()
                return math.inf
            wake = min(wake, self._idle_since + idle)
        return wake

    # ---- bytes in ---------------------------------------------------------------------------
    def receive(self, buffer, view: memoryview, pos: int, end: int, work: int = WORK_PER_TURN) -> int:
        """Handle the complete frames in ``buffer[pos:end]`` (``view``: a memoryview of
        ``buffer``), at most a turn's ``work``; returns where the bytes not handled start."""
        if self.preface_needed:
            if end - pos < len(PREFACE):
                return pos
            if bytes(view[pos:pos + len(PREFACE)]) != PREFACE:
                raise ConnectionError_(PROTOCOL_ERROR, "the client did not open with the HTTP/2 connection preface "
                                                       "(xlaserve serves gRPC over HTTP/2 with prior knowledge)")
            pos += len(PREFACE)
            self.preface_needed = False
            self.write(self._our_settings())
        self.spent = False
        unpack = FRAME_HEADER.unpack_from
        u32 = U32.unpack_from
        handle = self._frame
        window_update = self._on_window_update
        on_data = self._on_data
        on_block = self._on_header_block
        max_frame = self.max_frame
        max_block = self.limits.max_header_block_bytes
        while end - pos >= 9:
            lt, flags, stream_id = unpack(buffer, pos)
            length = lt >> 8
            stop = pos + 9 + length
            if length > max_frame:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes exceeds the "
                                                         f"{max_frame} this {'client' if self.client else 'server'} "
                                                         "advertised")
            if stop > end:
                break
            ftype = lt & 0xFF
            # The frames of every call (DATA, a whole header block, WINDOW_UPDATE) go straight to
            # their handler once the connection is settled and no header block is open; anything
            # else, or anything unusual about them, takes _frame's checks.
            usual = self.settled and self.continuation is None
            if ftype == DATA:
                if usual:
                    on_data(flags, stream_id & _MASK, view[pos + 9:stop])
                else:
                    handle(DATA, flags, stream_id & _MASK, view[pos + 9:stop])
            elif ftype == HEADERS and usual and flags & _PLAIN_HEADERS == END_HEADERS and stream_id & 1 \
                    and length <= max_block:
                # one whole header block, neither padded nor with a priority: decoded as it is
                on_block(flags, stream_id & _MASK, bytes(view[pos + 9:stop]))
            elif ftype == WINDOW_UPDATE and length == 4 and usual:
                # a peer sends one or two per reply: taken here, without the bytes
                window_update(stream_id & _MASK, u32(buffer, pos + 9)[0] & _MASK)
            else:
                handle(ftype, flags, stream_id & _MASK, bytes(view[pos + 9:stop]))
            pos = stop
            work -= 1 + (length >> 16 if ftype == DATA else length >> 8)   # headers cost more to handle
            if work <= 0 or self.spent:
                self.spent = True
                break
        return pos

    def feed(self, data: bytes) -> None:
        """Receive ``data``: every complete frame is handled (all turns at once); the bytes of an
        incomplete one are kept for the next call. DATA reaches the handler as views of a bytes
        object, valid after the call."""
        buf = self._inbox + data if self._inbox else bytes(data)
        view = memoryview(buf)
        pos = 0
        while True:
            new = self.receive(buf, view, pos, len(buf))
            if new == pos:
                break
            pos = new
        self._inbox = buf[pos:]

    _inbox = b""
    reset_why = ""      # what the peer did wrong, while stream_reset runs for a stream error of ours

    def _frame(self, ftype: int, flags: int, sid: int, payload) -> None:
        if self.continuation is not None and ftype != CONTINUATION:
            raise ConnectionError_(PROTOCOL_ERROR, "a header block was interrupted by another frame")
        if not self.settled and (ftype != SETTINGS or flags & ACK):
            raise ConnectionError_(PROTOCOL_ERROR, "the first frame after the connection preface must be "
                                                   "SETTINGS (RFC 9113 3.4)")
        if ftype == DATA:
            self._on_data(flags, sid, payload)
        elif ftype == HEADERS:
            self._on_headers(flags, sid, payload)
        elif ftype == WINDOW_UPDATE:
            if len(payload) != 4:
                raise ConnectionError_(FRAME_SIZE_ERROR, "WINDOW_UPDATE is not 4 bytes")
            self._on_window_update(sid, U32.unpack(payload)[0] & _MASK)
        elif ftype == PING:
            if len(payload) != 8:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"PING of {len(payload)} bytes; it is 8")
            if sid != 0:
                raise ConnectionError_(PROTOCOL_ERROR, "PING on a stream")
            if flags & ACK:
                self._ping_acked(payload)
            else:
                self._control(frame(PING, ACK, 0, payload))
        elif ftype == SETTINGS:
            self._on_settings(flags, sid, payload)
        elif ftype == RST_STREAM:
            if len(payload) != 4:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"RST_STREAM of {len(payload)} bytes; it is 4")
            if sid == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if sid > self.last_stream or not sid & 1:     # even: a stream a client never opens
                raise ConnectionError_(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            self.glitch(f"RST_STREAM on stream {sid}")
            stream = self.streams.get(sid)
            if stream is not None:
                self._stream_reset(stream, U32.unpack(payload)[0], True)
                self._close(stream)
        elif ftype == CONTINUATION:
            if self.continuation is None or self.continuation[0] != sid:
                raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION without a header block in progress")
            sid, first_flags, block, count = self.continuation
            limits = self.limits
            if count >= limits.max_continuation_frames:
                raise self._calm(f"a header block spans more than {limits.max_continuation_frames} CONTINUATION frames",
                                 "max_continuation_frames", limits.max_continuation_frames)
            self._check_block(len(block) + len(payload))
            block.extend(payload)
            if flags & END_HEADERS:
                self.continuation = None
                self._on_header_block(first_flags, sid, bytes(block))
            else:
                if not payload:
                    self.glitch("an empty CONTINUATION frame")
                self.continuation = (sid, first_flags, block, count + 1)
        elif ftype == GOAWAY:
            if len(payload) < 8:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"GOAWAY of {len(payload)} bytes; it is at least 8")
            if sid != 0:
                raise ConnectionError_(PROTOCOL_ERROR, "GOAWAY on a stream")
            self.going_away = True
            last = U32.unpack_from(payload, 0)[0] & _MASK
            self.goaway_last = last if self.goaway_last is None else min(last, self.goaway_last)
            self._goaway_received(last, U32.unpack_from(payload, 4)[0], payload[8:])
            if self.client:
                # the streams above ``last`` were not processed (RFC 9113 6.8): closed as refused
                for stream in [s for s in self.streams.values() if s.id > last]:
                    self._stream_reset(stream, REFUSED_STREAM, True)
                    self._close(stream)
            if not self.streams:
                self._quiet()
        elif ftype == PRIORITY:
            if sid == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                raise ConnectionError_(FRAME_SIZE_ERROR, "PRIORITY frame is not 5 bytes")
        elif ftype == PUSH_PROMISE:
            if len(payload) < 4:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"PUSH_PROMISE of {len(payload)} bytes")
            if self.client:
                raise ConnectionError_(PROTOCOL_ERROR, "PUSH_PROMISE, but this client disabled server push "
                                                       "(SETTINGS_ENABLE_PUSH 0)")
            raise ConnectionError_(PROTOCOL_ERROR, "clients must not send PUSH_PROMISE")
        # unknown frame types are ignored (section 4.1)

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        # sizes first, then the stream: the order libnghttp2 checks them in
        if flags & ACK and payload:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS ack with a payload")
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6 bytes")
        if sid != 0:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            self._stream_bound = self.stream_window
            self._settings_acked()
            return
        entries = len(payload) // 6
        limit = self.limits.max_settings_entries
        if entries > limit:
            raise self._calm(f"a SETTINGS frame of {entries} entries", "max_settings_entries", limit)
        if self.settled:
            self.glitch("a SETTINGS frame after the first")   # peers send one or two in all
        self.settled = True
        window = self.peer_initial_window
        for i in range(0, len(payload), 6):
            key, value = SETTING.unpack_from(payload, i)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, f"INITIAL_WINDOW_SIZE {value} is above 2^31-1")
                window = value      # applied once below: the last value is the one that counts
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= MAX_FRAME_LIMIT:
                    raise ConnectionError_(PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value} is outside 16384..2^24-1")
                self.peer_max_frame = value
            elif key == ENABLE_PUSH:
                if value > 1:
                    raise ConnectionError_(PROTOCOL_ERROR, f"ENABLE_PUSH {value} is not 0 or 1")
                if value and self.client:
                    raise ConnectionError_(PROTOCOL_ERROR, "a server sent ENABLE_PUSH 1 (RFC 9113 6.5.2)")
            elif key == MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
            elif key == MAX_HEADER_LIST_SIZE:
                self.peer_max_header_list = value   # advisory: the layer above keeps to it
            # HEADER_TABLE_SIZE: our encoder never uses the dynamic table
        delta = window - self.peer_initial_window
        if delta:
            self.peer_initial_window = window
            for stream in self.streams.values():
                stream.send_window += delta
                if stream.send_window > MAX_WINDOW:     # RFC 9113 6.9.2
                    raise ConnectionError_(FLOW_CONTROL_ERROR, f"INITIAL_WINDOW_SIZE {window} takes stream "
                                                               f"{stream.id}'s send window above 2^31-1")
        self._control(frame(SETTINGS, ACK, 0))
        self._flush_blocked()
        self._settings_received()

    def _on_window_update(self, sid: int, increment: int) -> None:
        if sid == 0:
            if increment == 0:
                raise ConnectionError_(PROTOCOL_ERROR, "WINDOW_UPDATE of 0 on the connection")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "the connection's send window exceeds 2^31-1")
            if self.blocked:
                self._flush_blocked()
            return
        stream = self.streams.get(sid)
        if stream is None:
            if sid > self.last_stream or not sid & 1:
                raise ConnectionError_(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            return                  # a stream already answered (peers update those too)
        if increment == 0:
            self.reset(stream, PROTOCOL_ERROR, f"WINDOW_UPDATE of 0 on stream {sid}")
            return
        stream.send_window += increment
        if stream.send_window > MAX_WINDOW:             # RFC 9113 6.9.1: a stream error
            self.reset(stream, FLOW_CONTROL_ERROR, f"a WINDOW_UPDATE takes stream {sid}'s send window above 2^31-1")
            return
        self._flush_blocked()

    def _on_headers(self, flags: int, sid: int, payload: bytes) -> None:
        if not sid & 1:     # checked on the frame, not once its header block ends
            if self.client:
                raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on even stream {sid} (this client opens odd "
                                                       "ones and refuses pushes)")
            raise ConnectionError_(PROTOCOL_ERROR, f"client stream ids are odd; got {sid}")
        start, stop = 0, len(payload)
        if flags & PADDED:
            pad = payload[0] if payload else 256
            start, stop = 1, stop - pad
        if flags & PRIORITY_FLAG:
            # RFC 9113 5.3.1: a stream error, which libnghttp2 (and so this) makes a connection error,
            # checked as it does: on a frame opening a stream, before its header block is decoded
            if sid > self.last_stream and stop - start >= 4 and U32.unpack_from(payload, start)[0] & _MASK == sid:
                raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS making stream {sid} depend on itself")
            start += 5
        if stop < start:
            raise ConnectionError_(PROTOCOL_ERROR, "HEADERS padding exceeds the frame")
        block = payload[start:stop]
        self._check_block(len(block))
        if flags & END_HEADERS:
            self._on_header_block(flags, sid, block)
        else:
            self.continuation = (sid, flags, bytearray(block), 0)

    def _check_block(self, size: int) -> None:
        limit = self.limits.max_header_block_bytes
        if size > limit:
            raise self._calm(f"a header block of more than {limit} bytes", "max_header_block_bytes", f"{limit} bytes")

    def _on_header_block(self, flags: int, sid: int, block: bytes) -> None:
        try:
            headers = self.decoder.decode(block)       # decoded even for a stream gone: HPACK's state
        except HeaderListTooLarge as exc:
            raise self._calm(str(exc), "max_header_list_bytes", f"{self.limits.max_header_list_bytes} bytes") from None
        except TooManyHeaderFields as exc:
            raise self._calm(str(exc), "max_header_fields", self.limits.max_header_fields) from None
        except HPACKError as exc:
            raise ConnectionError_(COMPRESSION_ERROR, f"bad header block: {exc}") from None
        end_stream = flags & END_STREAM
        stream = self.streams.get(sid)
        if stream is not None:
            if self.client:
                if stream.state & HALF_CLOSED_REMOTE:
                    self.reset(stream, STREAM_CLOSED, f"HEADERS on stream {sid} after its END_STREAM")
                    return
            else:                                                  # trailers from the client
                if not end_stream:
                    raise ConnectionError_(PROTOCOL_ERROR, f"second HEADERS on stream {sid} without END_STREAM")
                if malformed(headers, trailers=True) is not None:
                    self.reset(stream, PROTOCOL_ERROR, f"malformed trailers on stream {sid}")
                    return
            if end_stream:
                stream.state |= HALF_CLOSED_REMOTE
            self._headers_received(stream, headers, end_stream)
            if stream.state == _BOTH:
                self._close(stream)
            return
        if self.client:
            if sid > self.last_stream:
                raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on idle stream {sid}")
            return                      # a stream this end reset or gave up on
        if sid <= self.last_stream:
            if end_stream:
                return                    # trailers of a call we already answered and reset
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS opening stream {sid} after stream {self.last_stream}; "
                                                   "stream ids must increase")
        self.last_stream = sid
        if self.going_away:
            self.refuse(sid)
            return
        limits = self.limits
        if len(self.streams) + self.zombies >= limits.max_concurrent_streams:
            self.glitch(f"stream {sid} past max_concurrent_streams")
            self.refuse(sid)
            return
        if self.waiting_bytes > limits.max_queued_reply_bytes:
            # Replies wait for window the client does not grant: take no new work until they
            # have gone (the client may retry a refused stream; reading goes on, so its
            # WINDOW_UPDATEs still arrive).
            self.refuse(sid)
            return
        self.streams_opened += 1
        if headers is not self._checked:        # a repeated block decodes to the very same tuple
            problem = malformed(headers)
            if problem is not None:
                # a stream error; nothing of the stream was registered, so a reset is all there is to do
                self.glitch(f"a malformed request on stream {sid}: {problem}")
                self.refuse(sid, PROTOCOL_ERROR)
                return
            self._checked = headers
        self._stream_opened(sid, headers, end_stream)

    def _on_data(self, flags: int, sid: int, payload) -> None:
        if sid == 0:
            raise ConnectionError_(PROTOCOL_ERROR, "DATA on stream 0")
        length = len(payload)
        self.recv_unacked += length
        if self.recv_unacked > self._conn_bound:
            raise ConnectionError_(FLOW_CONTROL_ERROR, (
                f"DATA past the connection's flow-control window: {self.recv_unacked} bytes since the last "
                f"WINDOW_UPDATE, the window is {self._conn_bound}"))
        if self.recv_unacked >= self._conn_half:
            self.write(frame(WINDOW_UPDATE, 0, 0, U32.pack(self.recv_unacked)))
            self.recv_unacked = 0
        stream = self.streams.get(sid)
        if stream is None:
            if sid > self.last_stream or not sid & 1:
                raise ConnectionError_(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return                      # a stream already answered or reset
        if stream.state & HALF_CLOSED_REMOTE:
            self.reset(stream, STREAM_CLOSED, f"DATA on stream {sid} after its END_STREAM")
            return
        if stream.unacked + length > self._stream_bound:
            self.reset(stream, FLOW_CONTROL_ERROR, (
                f"DATA past stream {sid}'s flow-control window: {stream.unacked + length} bytes since the "
                f"last WINDOW_UPDATE, the window is {self._stream_bound}"))
            return
        if flags & PADDED:
            pad = payload[0] if payload else 256
            if pad >= length:
                raise ConnectionError_(PROTOCOL_ERROR, "DATA padding exceeds the frame")
            payload = payload[1:length - pad]
        if flags & END_STREAM:
            stream.state |= HALF_CLOSED_REMOTE
            self._data_received(stream, payload, True)
            if stream.state == _BOTH:
                self._close(stream)
            return
        self._data_received(stream, payload, False)
        if stream.state != CLOSED:
            if not length:
                self.glitch("an empty DATA frame")
            stream.unacked += length
            if stream.unacked >= self._stream_half:
                self.write(frame(WINDOW_UPDATE, 0, sid, U32.pack(stream.unacked)))
                stream.unacked = 0

    # ---- streams ----------------------------------------------------------------------------
    def accept(self, stream: Stream, end_stream: bool) -> None:
        """Server mode, from ``stream_opened``: register ``stream`` (its ``id`` set) for the
        request whose headers arrived (``end_stream``: with END_STREAM)."""
        stream.state = HALF_CLOSED_REMOTE if end_stream else OPEN
        stream.send_window = self.peer_initial_window
        self.streams[stream.id] = stream

    def refuse(self, sid: int, code: int = REFUSED_STREAM) -> None:
        """Reset a stream that was never registered (REFUSED_STREAM: the peer may retry it)."""
        self._control(frame(RST_STREAM, 0, sid, U32.pack(code)))

    def can_open(self) -> bool:
        """Client mode: whether a stream may be opened now (no GOAWAY either way, stream ids
        left, below the peer's MAX_CONCURRENT_STREAMS)."""
        return not self.going_away and len(self.streams) < self.peer_max_streams

    def open_stream(self, stream: Stream, block: bytes, data: bytes = b"", end_stream: bool = True) -> int:
        """Client mode: open ``stream`` with the request's header ``block`` (HPACK-encoded), then
        ``data`` (flow-controlled; what does not fit waits) and END_STREAM if ``end_stream``.
        The stream gets the next odd id (returned). Check :meth:`can_open` first."""
        sid = self.last_stream + 2 if self.last_stream else 1
        if sid >= MAX_WINDOW:
            if sid > MAX_WINDOW:
                raise ConnectionError_(NO_ERROR, "this connection has used every stream id")
            # the last id (RFC 9113 5.1.1): no new streams here (can_open), and once this and the
            # others have ended, quiet(): the driver connects again for the next ones
            self.going_away = True
        self.last_stream = sid
        self.streams_opened += 1
        stream.id = sid
        stream.state = OPEN
        window = stream.send_window = self.peer_initial_window
        self.streams[sid] = stream
        n = len(data)
        if end_stream and 0 < n <= window and n <= self.send_window and n <= self.peer_max_frame \
                and len(block) <= self.peer_max_frame:
            # the usual request: HEADERS and one DATA frame that ends the stream, in one write
            # (write and _ended inlined: the stream was open, so it is half closed, not closed)
            stream.send_window -= n
            self.send_window -= n
            stream.state = HALF_CLOSED_LOCAL
            if not self.stopped:
                pack = FRAME_HEADER.pack
                self.out += b"".join((pack(len(block) << 8 | HEADERS, END_HEADERS, sid), block,
                                      pack(n << 8 | DATA, END_STREAM, sid), data))
                self._output_ready()
        elif n:
            self.write(self._header_frames(sid, block, 0))
            self.send_data(stream, data, end_stream)
        else:
            self.send_headers(stream, block, end_stream)
        return sid

    def send_headers(self, stream: Stream, block: bytes, end_stream: bool = False) -> None:
        """HEADERS on ``stream`` (with CONTINUATION past the peer's frame size), now: not behind
        data waiting for window (use :meth:`send_end` for trailers)."""
        if stream.state & HALF_CLOSED_LOCAL:
            return
        self.write(self._header_frames(stream.id, block, END_STREAM if end_stream else 0))
        if end_stream:
            self._ended(stream)

    def send_data(self, stream: Stream, data, end_stream: bool = False, head: bytes = b"") -> bool:
        """DATA on ``stream``: what the peer's windows and frame size allow now, the rest when
        they open (``stream.pending``). ``head``: frames of the caller's (the stream's HEADERS)
        to write just before, in the same write. Returns whether all of it went out now."""
        if stream.state & HALF_CLOSED_LOCAL:
            return True
        n = len(data)
        if not stream.pending and n <= stream.send_window and n <= self.send_window and n <= self.peer_max_frame:
            stream.send_window -= n
            self.send_window -= n
            self.write(head + frame(DATA, END_STREAM if end_stream else 0, stream.id, data))
            if end_stream:
                self._ended(stream)
            return True
        if head:
            self.write(head)
        if n > 16384 and type(data) is bytes:
            data = memoryview(data)     # the rest is cut from a view frame by frame, not copied each time
        stream.pending.append(data)
        self.waiting_bytes += n
        if end_stream:
            stream.pending.append(_END)
        self._flush_stream(stream)
        return not stream.pending

    def send_end(self, stream: Stream, block: bytes | None = None) -> None:
        """End this side of ``stream`` after the data waiting for window: with trailers ``block``
        (HEADERS, END_STREAM), or with None an empty DATA frame with END_STREAM."""
        if stream.state & HALF_CLOSED_LOCAL:
            return
        if stream.pending:
            stream.pending.append((block,))
            self._flush_stream(stream)
        elif block is None:
            self.write(frame(DATA, END_STREAM, stream.id))
            self._ended(stream)
        else:
            self.write(self._header_frames(stream.id, block, END_STREAM))
            self._ended(stream)

    def send_raw(self, stream: Stream, frames: bytes, flow: int, end_stream: bool) -> None:
        """Write ``frames`` the caller built for ``stream`` (say HEADERS, one DATA frame and the
        trailers), of which ``flow`` bytes are DATA, one frame the caller found room for (nothing
        in ``stream.pending``, ``flow`` within ``stream.send_window``, ``send_window`` and
        ``peer_max_frame``); ``end_stream``: they end this side."""
        stream.send_window -= flow
        self.send_window -= flow
        if not self.stopped:            # (write, inlined: the server's reply to every unary call)
            self.out += frames
            self._output_ready()
        if not end_stream:
            return
        if stream.state == HALF_CLOSED_REMOTE:
            # a reply to a whole request (the common case), closed here without more calls
            stream.state = CLOSED
            sid = stream.id
            del self.streams[sid]
            if self.blocked:
                self.blocked.pop(sid, None)
            self._stream_closed(stream)
            if self.going_away and not self.streams:
                self._quiet()
        else:
            self._ended(stream)

    def reset(self, stream: Stream, code: int, why: str = "") -> None:
        """Reset ``stream`` (RST_STREAM ``code``): ``stream_reset`` and ``stream_closed`` follow.
        ``why``: what the peer did, for a stream error (``reset_why`` holds it during ``stream_reset``);
        such a reset is a control frame the peer caused (max_queued_control_frames). Without it the
        reset is the layer above's (a cancelled call) and is not counted: it must not raise."""
        if stream.state == CLOSED:
            return
        self.reset_why = why
        if why:
            self._control(frame(RST_STREAM, 0, stream.id, U32.pack(code)))
        else:
            self.write(frame(RST_STREAM, 0, stream.id, U32.pack(code)))
        self._stream_reset(stream, code, False)
        self._close(stream)

    def _ended(self, stream: Stream) -> None:
        """END_STREAM went out on ``stream``."""
        state = stream.state = stream.state | HALF_CLOSED_LOCAL
        if state & HALF_CLOSED_REMOTE:
            self._close(stream)
        elif not self.client:
            # answered early: the client need not send the rest (RFC 9113 8.1)
            self.write(frame(RST_STREAM, 0, stream.id, U32.pack(NO_ERROR)))
            self._close(stream)

    def _close(self, stream: Stream) -> None:
        if stream.state == CLOSED:
            return
        stream.state = CLOSED
        sid = stream.id
        del self.streams[sid]
        if self.blocked:
            self.blocked.pop(sid, None)
        if stream.pending:
            self.waiting_bytes -= sum(len(item) for item in stream.pending if type(item) is not tuple)
            stream.pending.clear()
        self._stream_closed(stream)
        if self.going_away and not self.streams:
            self._quiet()

    def _header_frames(self, sid: int, block: bytes, flags: int) -> bytes:
        size = self.peer_max_frame
        if len(block) <= size:
            return frame(HEADERS, flags | END_HEADERS, sid, block)
        parts = [frame(HEADERS, flags, sid, block[:size])]
        for i in range(size, len(block), size):
            last = i + size >= len(block)
            parts.append(frame(CONTINUATION, END_HEADERS if last else 0, sid, block[i:i + size]))
        return b"".join(parts)

    def _flush_stream(self, stream: Stream) -> None:
        """Send as much of ``stream``'s waiting output as the windows allow."""
        pending = stream.pending
        sid = stream.id
        end = None
        while pending:
            item = pending[0]
            if type(item) is tuple:           # the end: trailers, or END_STREAM alone
                pending.popleft()
                end = (None,) if item is _END else item
                break
            room = min(stream.send_window, self.send_window, self.peer_max_frame)
            if room <= 0:
                self.blocked[sid] = stream
                return
            chunk = item[:room]
            n = len(chunk)
            stream.send_window -= n
            self.send_window -= n
            self.waiting_bytes -= n
            flags = 0
            if n == len(item):
                pending.popleft()
                if pending and pending[0] is _END:      # END_STREAM on the last DATA frame
                    pending.popleft()
                    end, flags = (b"",), END_STREAM
            else:
                pending[0] = item[n:]
            self.write(frame(DATA, flags, sid, chunk))
            if end is not None:
                break
        self.blocked.pop(sid, None)
        if end is not None:
            block = end[0]
            if block is None:
                self.write(frame(DATA, END_STREAM, sid))
            elif block:
                self.write(self._header_frames(sid, block, END_STREAM))
            self._ended(stream)
        self._stream_drained(stream)

    def _flush_blocked(self) -> None:
        if not self.blocked:
            return
        for stream in list(self.blocked.values()):
            if self.send_window <= 0:
                return
            self._flush_stream(stream)
