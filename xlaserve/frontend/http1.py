"""HTTP/1.1 on Trio with httptools (the bindings of llhttp, Node.js's parser; sans-IO), for
hostile peers.

:class:`Http1Server` accepts on its listeners through :func:`~xlaserve.frontend.guard.serve_guarded`
(each connection in its own guard) and serves one request at a time per connection: llhttp
parses (:class:`_Parser`), the ``handler`` answers an :class:`HttpRequest` with an
:class:`HttpResponse`. Keep-alive is llhttp's reading of the request (HTTP/1.0, or
``Connection: close``, ends it); pipelined requests are answered one after another, in order (at
most :data:`PARSE_SLICE` bytes of them parsed ahead of their answers; while one is in the handler the
connection reads at most ``max_header_bytes`` more, so a client that sends without reading is held
back by its own socket, then closed by the write timeout). Each connection has one reader task
(:class:`_Inbox`) for its whole life: it keeps what arrives for the connection's task, which
parses and answers, and it is what notices a peer that leaves while its request is in the
handler. h11 (python-hyper's pure-Python parser) served here before: it took about 31 us of
CPU to parse a binary-data inference request, llhttp about 1 us, where the whole REST request
costs the worker under 200 us (docs/benchmarks.md, *REST against Triton's HTTP endpoint*).

Every resource a peer can make the server spend has a limit in :class:`HttpLimits`, and each
offender is answered with the status that names it (when it can still read one) and closed:

- header bytes (``max_header_bytes``, 431) and header count (``max_headers``, 431); a chunked
  body's chunk extensions and trailer fields together (``max_header_bytes`` again, 431);
- the body (``max_body_bytes``, 413 before a byte of it is read when ``Content-Length`` says
  so, else as soon as a chunked body crosses it), the bodies all connections hold until they are
  answered (``max_total_body_bytes``, 503), and what a compressed body may inflate to
  (``max_inflate_bytes``, 413, with a budget over all connections, ``max_total_inflate_bytes``);
- slow headers (``header_timeout``: a request's head must arrive within it, counted from its
  first byte or from the connection's start; 408) and slow bodies (``body_timeout``: the whole
  body within it; 408), which also ends a ``Content-Length`` that promises more than comes;
- idle keep-alive connections (``idle_timeout``, closed without a word), writes that make no
  progress (``write_timeout``), and connections (``max_connections``: one more is answered 503
  and closed);
- anything llhttp refuses (a malformed request line, header or chunk, a second
  ``Content-Length``, ``Content-Length`` with ``Transfer-Encoding``, an unknown method) is 400
  (after the answers to the requests whole before it); a transfer coding other than ``chunked``
  alone (``gzip, chunked``) is 501.

The handler's faults stay in the request: a bug is logged once and answered 500, and the
connection goes on.
"""
from __future__ import annotations

import json
import logging
import math
import re
import socket
import ssl
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus

import httptools
import trio

from xlaserve.errors import internal_message
from xlaserve.frontend.access import peer_address
from xlaserve.frontend.guard import LineLimiter, guarded, origin_form, serve_guarded
from xlaserve.frontend.sockread import read_when_ready

log = logging.getLogger("xlaserve.http")

RECEIVE_BYTES = 64 * 1024
#: a compressed body larger than this is inflated in a worker thread (two at once at most)
INFLATE_INLINE = 256 * 1024
#: responses at least this large are compressed when the client accepts gzip or deflate
COMPRESS_MIN = 1024
#: the content codings a response may be compressed with, in the server's order of preference:
#: a tie in the client's q-values goes to the first, and either goes before identity
RESPONSE_CODINGS = ("gzip", "deflate")
SERVER_HEADER = b"xlaserve"
#: what the parser is fed at once unless a body's known rest is larger: pipelined requests are
#: parsed ahead of their answers only as far as this reaches past the request being answered
PARSE_SLICE = 4096
#: the bytes of a chunk's framing without extensions: its size in hex (16 digits at most) and two
#: CRLFs. A chunked body may carry max_header_bytes of chunk extensions and trailer fields besides
#: (counted from the first slice fed after its head: up to a PARSE_SLICE more slip through).
CHUNK_FRAMING = 20


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The limits of one HTTP/1.1 server (module docstring); times in seconds."""

    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    max_body_bytes: int = 256 * 1024 * 1024
    max_inflate_bytes: int = 16 * 1024 * 1024
    max_total_inflate_bytes: int = 256 * 1024 * 1024
    max_total_body_bytes: int = 2048 * 1024 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    idle_timeout: float = 60.0
    write_timeout: float = 60.0
    max_connections: int = 1024
    #: the node-file key behind each limit, for the answers that name it
    keys: Mapping[str, str] = field(default_factory=dict)

    def key(self, name: str) -> str:
        return self.keys.get(name, name)


@dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str
    path: str                        #: the target without its query, percent-encoded as sent
    query: str
    headers: Mapping[str, str]       #: lower-case names; repeated headers joined with ", "
    body: bytes
    peer: object                     #: the peer's IP address (None when not IP)


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[HttpRequest], Awaitable[HttpResponse]]


class _Refusal(Exception):
    """Answer ``status`` with ``message`` and close the connection."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Quiet(Exception):
    """Close the connection without an answer (an idle connection, a peer that left)."""


def error_json(message: str) -> bytes:
    return json.dumps({"error": message}).encode()


class _Budget:
    """Bytes held over all connections at once (inflated bodies; received bodies)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0


class _Held:
    """The request body bytes one connection holds, counted in the server's total from the
    first byte until the request is answered (requests parsed ahead of their answers included);
    :meth:`release` gives them back."""

    __slots__ = ("budget", "bytes", "limits")

    def __init__(self, budget: _Budget, limits: HttpLimits) -> None:
        self.budget = budget
        self.limits = limits
        self.bytes = 0

    def take(self, n: int) -> None:
        budget = self.budget
        if budget.used + n > budget.limit:
            raise _Refusal(503, f"the connections hold {budget.used} bytes of request bodies not yet answered, the "
                                f"limit ({self.limits.key('max_total_body_bytes')}) is {budget.limit}; retry later")
        budget.used += n
        self.bytes += n

    def release(self, n: int | None = None) -> None:
        """Give back ``n`` bytes (an answered request's), or all of them."""
        n = self.bytes if n is None else min(n, self.bytes)
        self.budget.used -= n
        self.bytes -= n


@dataclass(frozen=True, slots=True)
class _Parsed:
    """A request whose message llhttp has read whole."""

    method: str
    target: str
    headers: dict[str, str]
    body: bytes
    keep_alive: bool        #: llhttp's reading: False for HTTP/1.0 without keep-alive, or Connection: close
    held: int               #: its body's bytes counted in the connection's held bytes


class _Parser:
    """One connection's requests as llhttp reads them (httptools' callbacks, below): the request
    being read is collected here, and each one whose message is complete waits in :attr:`ready`.
    The limits of the head and the body are checked as the bytes are parsed; a callback's
    :class:`_Refusal` ends the parse and is raised by :meth:`feed` (llhttp keeps nothing of the
    rest). Body bytes are counted in ``held`` (the server's total) as they arrive."""

    __slots__ = ("limits", "held", "parser", "ready", "url", "fields", "count", "head", "parts", "size", "headers",
                 "in_message", "head_fed", "continue_sent", "upgraded", "failed", "expected", "chunks", "chunked_fed")

    def __init__(self, limits: HttpLimits, held: _Held) -> None:
        self.limits = limits
        self.held = held
        self.parser = httptools.HttpRequestParser(self)
        self.ready: deque[_Parsed] = deque()
        self.upgraded = False       #: a request asked to switch protocols: nothing after it is HTTP
        self.failed: _Refusal | None = None     #: what ended the parse, kept for after the requests before it
        self._fresh()

    def _fresh(self) -> None:
        self.url = b""
        self.fields: list[tuple[bytes, bytes]] = []
        self.count = 0              #: header fields seen (those past max_headers are not kept)
        self.head = 0               #: bytes of the fields kept, as the head's size counts them
        self.parts: list[bytes] = []
        self.size = 0
        self.headers: dict[str, str] | None = None     #: once the head is read whole
        self.expected: int | None = None    #: the body's Content-Length, once the head is read
        self.in_message = False     #: a byte of the request being read has been parsed
        self.head_fed = 0           #: bytes fed while its head was incomplete
        self.chunks = 0             #: chunks of a chunked body begun
        self.chunked_fed = 0        #: bytes fed while a chunked body was being read (its framing included)
        self.continue_sent = False

    def feed(self, data: bytes) -> None:
        """Parse ``data``. What llhttp or a limit refuses is kept in :attr:`failed` (the parse
        ends there) when requests before it are whole, to be raised once they are answered
        (:meth:`next`), else raised now as a :class:`_Refusal`."""
        limits = self.limits
        if self.headers is None:
            self.head_fed += len(data)
        elif self.expected is None:
            self.chunked_fed += len(data)
        try:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserCallbackError as exc:
                cause = exc.__context__
                if isinstance(cause, _Refusal):
                    raise cause from None
                raise
            except httptools.HttpParserUpgrade:
                # a request that asked to switch protocols (Upgrade, or CONNECT), read whole: it
                # is answered, and the connection then closes (nothing after it is HTTP to us)
                self.upgraded = True
                return
            except httptools.HttpParserError as exc:
                raise _Refusal(400, f"the request is not valid HTTP/1.1: {exc}") from None
            if self.headers is None:
                if self.in_message and self.head_fed > limits.max_header_bytes:
                    raise _Refusal(431, f"the request's head is larger than {limits.max_header_bytes} bytes, the "
                                        f"limit ({limits.key('max_header_bytes')})")
            elif self.chunked_fed - self.size > limits.max_header_bytes + CHUNK_FRAMING * self.chunks:
                # what a chunked body carries besides its data: chunk extensions and trailer fields
                # (llhttp skips both), bounded as a head is (RFC 9112 7.1.1)
                raise _Refusal(431, f"the request's chunk extensions and trailer fields are larger than "
                                    f"{limits.max_header_bytes} bytes, the limit ({limits.key('max_header_bytes')})")
        except _Refusal as refusal:
            if not self.ready:
                raise
            self.failed = refusal       # the requests before it are answered first

    def feed_pending(self, inbox: _Inbox) -> None:
        """Parse what the reader kept (``inbox.pending``) until a request is whole, in slices of
        :data:`PARSE_SLICE` bytes (a body whose length is known in one piece): what lies past
        is kept for after its answer. llhttp parses every request a feed holds, so slices bound
        how many are parsed ahead of their answers (a burst of pipelined requests in one read)."""
        pending, inbox.pending = inbox.pending, []
        for i, data in enumerate(pending):
            view, at, n = memoryview(data), 0, len(data)
            while at < n:
                expected = self.expected        # (known once the head of the request being read is)
                step = PARSE_SLICE if expected is None else max(PARSE_SLICE, expected - self.size)
                self.feed(view[at:at + step])
                at += step
                if self.ready or self.failed is not None or self.upgraded:
                    inbox.pending = ([view[at:]] if at < n else []) + pending[i + 1:]
                    return

    def close(self) -> None:
        """Drop llhttp's parser: it holds this object's callbacks, and this object holds it (a
        cycle that would otherwise wait for the cyclic collector after each connection)."""
        self.parser = None
        self.ready.clear()

    def next(self) -> _Parsed | None:
        """The next whole request, or None; raises what :meth:`feed` kept once none is left."""
        if self.ready:
            return self.ready.popleft()
        if self.failed is not None:
            raise self.failed
        return None

    # ---- httptools' callbacks -------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.in_message = True

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # counted, and kept up to the limit (the head's bytes bound how many come: feed())
        self.count += 1
        if self.count <= self.limits.max_headers:
            self.fields.append((name, value))
            self.head += len(name) + len(value) + 4

    def on_headers_complete(self) -> None:
        limits = self.limits
        if self.count > limits.max_headers:
            raise _Refusal(431, f"the request has {self.count} header fields, the limit "
                                f"({limits.key('max_headers')}) is {limits.max_headers}")
        fields = self.fields
        head = len(self.parser.get_method()) + len(self.url) + 12 + self.head
        if head > limits.max_header_bytes:
            raise _Refusal(431, f"the request's head is larger than {limits.max_header_bytes} bytes, the limit "
                                f"({limits.key('max_header_bytes')})")
        headers: dict[str, str] = {}
        for name, value in fields:
            key = name.decode("latin-1").lower()
            text = value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            # llhttp reads any coding list that ends in chunked (gzip, chunked) as chunked alone:
            # the body would reach the handler still gzipped
            raise _Refusal(501, f"Transfer-Encoding {coding[:100]!r} is not supported: send the body with "
                                "Content-Length or 'Transfer-Encoding: chunked' alone (compress it with "
                                "Content-Encoding: gzip or deflate)")
        length = headers.get("content-length")
        expected = int(length) if length is not None and length.isascii() and length.isdigit() else None
        if expected is not None and expected > limits.max_body_bytes:
            raise _Refusal(413, f"the request body is {expected} bytes, the limit ({limits.key('max_body_bytes')}) "
                                f"is {limits.max_body_bytes}; send large tensors through shared memory")
        self.headers = headers
        self.expected = expected

    def on_chunk_header(self) -> None:
        self.chunks += 1

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        limits = self.limits
        if self.size > limits.max_body_bytes:
            raise _Refusal(413, f"the request body is more than {limits.max_body_bytes} bytes, the limit "
                                f"({limits.key('max_body_bytes')}); send large tensors through shared memory")
        self.held.take(len(body))
        self.parts.append(body)

    def on_message_complete(self) -> None:
        parts = self.parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        self.ready.append(_Parsed(self.parser.get_method().decode("latin-1"), self.url.decode("latin-1"),
                                  self.headers or {}, body, self.parser.should_keep_alive(), self.size))
        self._fresh()

    @property
    def waits_for_continue(self) -> bool:
        """Whether the request being read asked for ``100 Continue`` before its body (and has
        not had it)."""
        headers = self.headers
        return (headers is not None and not self.continue_sent and not self.size
                and headers.get("expect", "").strip().lower() == "100-continue")


#: what a connection is doing, which says what its one cancel scope's expiry or cancellation
#: means (:attr:`_Inbox.phase`): waiting for a request's first byte (closed without a word),
#: reading its head (408), reading its body (408), in the handler or writing its answer (the peer
#: left while the handler ran), or anything else (no deadline runs then)
_IDLE, _HEAD, _BODY, _HANDLER, _OTHER = range(5)


class _Inbox:
    """The one task that receives from a connection (:meth:`run`), for the connection's whole
    life: what arrives is kept in :attr:`pending` for the connection's task, which parses and
    answers, and waits for it with :meth:`receive`. It reads while that task waits for bytes, and while a request is
    in the handler (``handling``), where what arrives is the next, pipelined request, taken up to
    ``limit`` bytes (past that the connection is not read until the answer is written), and the
    end of the stream cancels the handler: the peer left. A receive error is kept and raised to
    the waiting task (the guard closes the connection and logs it as before).

    One reader for the whole connection costs a task switch per arrival; watching the peer from
    a task of its own for each request (a nursery, a receive that blocks, and its cancellation
    once answered) cost about a third of this layer's CPU time per request, measured with a
    handler that answers at once (docs/benchmarks.md, *REST against Triton's HTTP endpoint*).

    The connection's task runs inside one cancel scope for the connection's whole life
    (``scope``): its deadline is moved to each phase's (``phase``: the head's, the body's, none
    while the handler runs or the answer is written), the reader cancels it when the peer leaves
    during the handler, and :meth:`Http1Server.close` when the connection is idle (``shut``).
    Entering and leaving a scope for each wait cost about 12 µs a request (two scopes); moving a
    deadline costs about 1.4 µs."""

    __slots__ = ("stream", "raw", "pending", "limit", "waiting", "waiter", "fed", "handling", "pipelined", "ended",
                 "error", "_go", "scope", "phase", "shut", "got")

    def __init__(self, stream, limit: int, raw: socket.socket | None = None) -> None:
        self.stream = stream
        #: the connection's socket for non-blocking reads (:func:`_receive_raw`); None over TLS
        self.raw = raw
        self.pending: list[bytes] = []  #: what arrived and the connection's task has not parsed yet
        self.limit = limit
        self.waiting = False
        #: the connection's task while it waits in :meth:`receive` (rescheduled by the reader)
        self.waiter: trio.lowlevel.Task | None = None
        self.fed = 0                #: how many reads arrived
        #: whether a request is in the handler (the peer leaving then cancels ``scope``)
        self.handling = False
        self.pipelined = 0
        self.ended = False
        self.error: Exception | None = None
        self._go: trio.Event | None = None
        self.scope = trio.CancelScope()
        self.phase = _IDLE
        self.shut = False           #: close() cancelled ``scope`` between requests
        self.got = 0                #: the body bytes of the request being read (for the 408)

    def _wanted(self) -> bool:
        return self.waiting or (self.handling and self.pipelined <= self.limit)

    async def run(self) -> None:
        try:
            drained = False
            while True:
                while not self._wanted():
                    self._go = trio.Event()
                    await self._go.wait()
                raw = self.raw
                if raw is None:
                    data = await self.stream.receive_some(RECEIVE_BYTES)
                else:
                    data = await _receive_raw(raw, drained)
                if not data:
                    break
                # a read shorter than asked for most likely emptied the socket: the next read
                # waits for it to be readable first instead of failing once (EAGAIN) before
                drained = len(data) < RECEIVE_BYTES
                self.pending.append(data)
                self.fed += 1
                if self.handling:
                    self.pipelined += len(data)
                self._arrived()
        except Exception as exc:        # raised to the connection's task when it next reads
            self.error = exc
        self.ended = True
        if self.handling:
            self.scope.cancel()
        self._arrived()

    def _arrived(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            trio.lowlevel.reschedule(waiter)

    def _abort(self, _) -> trio.lowlevel.Abort:
        self.waiter = None
        return trio.lowlevel.Abort.SUCCEEDED

    def _wake(self) -> None:
        if self._go is not None:
            self._go.set()
            self._go = None

    async def receive(self) -> bool:
        """Wait until more bytes arrived (True) or the stream ended (False; a receive error is
        raised). Called when the parser needs data, so nothing that came before is missed."""
        fed = self.fed
        if not self.ended:
            self.waiting = True
            self._wake()
            self.waiter = trio.lowlevel.current_task()
            try:
                await trio.lowlevel.wait_task_rescheduled(self._abort)
            finally:
                self.waiting = False
        if self.fed != fed:
            return True
        if self.error is not None:
            raise self.error
        return False

    def watch(self) -> None:
        """The request goes to the handler: ``scope`` is cancelled if the peer leaves before it
        is answered."""
        self.handling = True
        self.phase = _HANDLER
        self.pipelined = 0
        if self.ended:
            self.scope.cancel()
        else:
            self._wake()

    def unwatch(self) -> None:
        """The handler is done (or cancelled): the peer leaving no longer cancels ``scope``. The
        phase stays ``_HANDLER`` (the next request's read moves it), so that a cancellation that
        came while the handler ran is still read as the peer's doing when it reaches
        :meth:`Http1Server._serve_requests`."""
        self.handling = False


class Http1Server:
    """Serves ``handler`` over HTTP/1.1 on the listeners given to :meth:`serve`; ``what`` names
    the port in log lines (``REST``)."""

    def __init__(self, handler: Handler, limits: HttpLimits = HttpLimits(), *, what: str = "HTTP") -> None:
        self.handler = handler
        self.limits = limits
        self.what = what
        self.port = 0
        self.connections = 0
        self._inflated = _Budget(limits.max_total_inflate_bytes)
        #: request body bytes held over all connections (received and not yet answered)
        self.bodies = _Budget(limits.max_total_body_bytes)
        self._inflate_threads = trio.CapacityLimiter(2)
        self._faults = LineLimiter(log)
        self._refusals = LineLimiter(log, 60.0)
        self._bugs = LineLimiter(log)
        self._closing = False
        self._ssl_context: ssl.SSLContext | None = None
        self._idle: set[_Inbox] = set()     #: connections between requests
        self._accepting: trio.CancelScope | None = None
        self._all_closed = trio.Event()

    # ---- life ---------------------------------------------------------------------------------
    async def serve(self, listeners: list[trio.SocketListener], *, ssl_context: ssl.SSLContext | None = None,
                    task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, or until :meth:`close` and every connection has ended. With
        ``ssl_context`` each connection is TLS; its handshake is part of the first request's
        head, so ``header_timeout`` bounds it."""
        self._ssl_context = ssl_context
        try:
            async with trio.open_nursery() as nursery:
                with trio.CancelScope() as self._accepting:
                    self.port = listeners[0].socket.getsockname()[1] if listeners else 0
                    task_status.started(self.port)
                    try:
                        await serve_guarded(self._connection, listeners, nursery=nursery, limiter=self._faults,
                                            what=self.what)
                    finally:
                        with trio.CancelScope(shield=True):
                            for listener in listeners:
                                await listener.aclose()
        finally:
            self._all_closed.set()

    def close(self) -> None:
        """Stop accepting; idle connections close now, a connection with a request in hand
        closes once it is answered."""
        self._closing = True
        if self._accepting is not None:
            self._accepting.cancel()
        for inbox in list(self._idle):
            inbox.shut = True
            inbox.scope.cancel()

    async def wait_closed(self) -> None:
        await self._all_closed.wait()

    # ---- one connection -----------------------------------------------------------------------
    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one accepted connection inside its guard (what :meth:`serve` does for each):
        whatever happens closes this connection only."""
        await guarded(stream, self._connection, self._faults, self.what)

    async def _connection(self, stream: trio.abc.Stream) -> None:
        if self._closing:
            return
        limits = self.limits
        sock = getattr(stream, "socket", None)
        if self._ssl_context is not None:
            # https_compatible: an EOF without close_notify reads as EOF (HTTP/1.1 framing tells a
            # cut exchange), and closing does not wait for a handshake that never happened
            stream = trio.SSLStream(stream, self._ssl_context, server_side=True, https_compatible=True)
        if self.connections >= limits.max_connections:
            self._refusals.line(logging.WARNING, "%s port: refused a connection: %d are open, the limit (%s) is %d",
                                self.what, self.connections, limits.key("max_connections"), limits.max_connections)
            message = (f"this server has {self.connections} {self.what} connections open, the limit "
                       f"({limits.key('max_connections')}) is {limits.max_connections}; retry later")
            with trio.move_on_after(1.0):
                await stream.send_all(_raw_response(503, message))
            return
        self.connections += 1
        try:
            try:
                peer = peer_address(sock.getpeername()) if sock is not None else None
            except OSError:
                peer = None
            await self._serve_connection(stream, peer)
        finally:
            self.connections -= 1

    async def _serve_connection(self, stream: trio.SocketStream, peer) -> None:
        # A plain TCP connection is read and written through the same socket's descriptor with
        # non-blocking calls (_receive_raw, _send): Trio's stream reads and writes each yield a
        # turn of the run loop even when the socket had the bytes or took them at once, and a
        # read of an empty socket raises and catches an exception. Detached before the stream
        # (which owns the descriptor) closes it.
        raw = socket.socket(fileno=stream.socket.fileno()) if isinstance(stream, trio.SocketStream) else None
        inbox = _Inbox(stream, self.limits.max_header_bytes, raw)
        error: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(inbox.run)
                try:
                    await self._serve_requests(stream, peer, inbox)
                except Exception as exc:        # raised as itself (not in a group) to the guard
                    error = exc
                nursery.cancel_scope.cancel()
        finally:
            if raw is not None:
                raw.detach()
        if error is not None:
            raise error

    async def _serve_requests(self, stream, peer, inbox: _Inbox) -> None:
        """Requests in turn, inside the connection's one cancel scope (:class:`_Inbox`), whose
        expiry or cancellation is answered here by what the connection was doing. One
        :class:`_Parser` reads the connection's requests; each is answered by :meth:`_respond`,
        which writes the response itself (h11 validating and framing our own few headers cost
        about 50 µs a request, a sixth of this layer's CPU time, when h11 served here)."""
        held = _Held(self.bodies, self.limits)
        parser = _Parser(self.limits, held)
        scope = inbox.scope
        refusal = None
        try:
            with scope:
                refusal = await self._serve_in_turn(stream, peer, inbox, held, parser)
        finally:
            held.release()
            parser.close()
            self._idle.discard(inbox)
        if scope.cancelled_caught and not inbox.shut:
            limits = self.limits
            phase = inbox.phase
            if phase == _HEAD:
                refusal = _Refusal(408, f"the request's head did not arrive within {limits.header_timeout:g} s "
                                        f"({limits.key('header_timeout')})")
            elif phase == _BODY:
                refusal = _Refusal(408, f"the request body did not arrive in full within {limits.body_timeout:g} "
                                        f"s ({limits.key('body_timeout')}); {inbox.got} bytes came")
            elif phase == _HANDLER:
                # the peer left before its answer (the handler was cancelled: a client that goes
                # away gets no work done for it); a reader's error that is not the peer's doing
                # goes to the guard, which logs it
                error = inbox.error
                if error is not None and not isinstance(error, (trio.BrokenResourceError,
                                                                trio.ClosedResourceError, OSError)):
                    raise error
        if refusal is not None:
            await self._refuse(stream, refusal)

    async def _serve_in_turn(self, stream, peer, inbox: _Inbox, held: _Held, parser: _Parser) -> _Refusal | None:
        """Read, answer and write each request until the connection ends; a refusal to write
        (after the connection's scope) is returned."""
        first = True
        scope = inbox.scope
        while not self._closing:
            taken = None            # what the request answered holds (None: all, the connection ends)
            try:
                try:
                    request, keep_alive, taken = await self._read_request(stream, peer, first, held, inbox, parser)
                except _Quiet:
                    return None
                except _Refusal as refusal:
                    scope.deadline = math.inf
                    inbox.phase = _OTHER
                    return refusal
                first = False
                inbox.watch()
                try:
                    response = await self._answer(request)
                finally:
                    inbox.unwatch()
                # the client's keep-alive as llhttp read it (HTTP/1.0, or Connection: close, ends
                # it); after a request that asked to switch protocols nothing more is HTTP
                close = self._closing or not keep_alive or (parser.upgraded and not parser.ready)
                await self._respond(stream, request, response, close, inbox.raw)
            finally:
                held.release(taken)     # not the bodies of requests parsed behind it
            if close:
                return None
        return None

    async def _read_request(self, stream, peer, first: bool, held: _Held, inbox: _Inbox,
                            parser: _Parser) -> tuple[HttpRequest, bool, int]:
        """The next request (inflated), whether the client keeps the connection alive, and the
        bytes it holds (its body's, and the inflated body's)."""
        parsed = await self._next_parsed(stream, first, inbox, parser)
        inbox.scope.deadline = math.inf     # no deadline while inflating, in the handler, writing
        inbox.phase = _OTHER
        headers = parsed.headers
        body = parsed.body
        taken = parsed.held
        encoding = headers.get("content-encoding")
        if encoding is not None and (encoding := encoding.strip().lower()) not in ("identity", ""):
            body = await self._inflate(body, encoding)
            held.take(len(body))            # the inflated body is held too, until answered
            taken += len(body)
        path, _, query = origin_form(parsed.target).partition("?")
        return HttpRequest(parsed.method, path, query, headers, body, peer), parsed.keep_alive, taken

    async def _next_parsed(self, stream, first: bool, inbox: _Inbox, parser: _Parser) -> _Parsed:
        """Parse what arrives until a request is whole, each wait under its phase's deadline: a
        new connection must send its first head within ``header_timeout``; a kept-alive one may be
        quiet for ``idle_timeout``, then has ``header_timeout`` from the first byte of a request
        for its head, and ``body_timeout`` from the end of the head for its body."""
        limits = self.limits
        scope = inbox.scope
        deadline = trio.current_time() + (limits.header_timeout if first else limits.idle_timeout)
        phase = _OTHER
        while True:
            if inbox.pending and not parser.ready and not parser.upgraded and parser.failed is None:
                parser.feed_pending(inbox)
            parsed = parser.next()
            if parsed is not None:
                if phase == _IDLE:
                    self._idle.discard(inbox)
                return parsed
            if parser.upgraded:         # a request that switched protocols was the last
                raise _Quiet()
            if not parser.in_message:
                if phase != _IDLE:      # no byte of the next request yet
                    phase = inbox.phase = _IDLE
                    self._idle.add(inbox)       # close() ends a connection between requests at once
                    scope.deadline = deadline
            elif parser.headers is None:
                if phase != _HEAD:
                    if phase == _IDLE:
                        self._idle.discard(inbox)
                    phase = inbox.phase = _HEAD
                    scope.deadline = min(deadline, trio.current_time() + limits.header_timeout)
            else:
                if phase != _BODY:
                    if phase == _IDLE:
                        self._idle.discard(inbox)
                    phase = inbox.phase = _BODY
                    scope.deadline = trio.current_time() + limits.body_timeout
                if parser.waits_for_continue:
                    parser.continue_sent = True
                    await self._send(stream, b"HTTP/1.1 100 Continue\r\n\r\n", inbox.raw)
                inbox.got = parser.size
            if not await inbox.receive():
                if phase == _HEAD:      # the peer ended its stream in the middle of a head
                    raise _Refusal(400, "the request is not valid HTTP/1.1: the connection ended in the middle "
                                        "of the request's head")
                raise _Quiet()          # between requests, or mid-body: the peer left

    async def _inflate(self, body: bytes, encoding: str) -> bytes:
        limits = self.limits
        if encoding == "gzip":
            wbits = 16 + zlib.MAX_WBITS
        elif encoding == "deflate":
            wbits = zlib.MAX_WBITS
        else:
            raise _Refusal(415, f"Content-Encoding '{encoding}' is not supported; use gzip, deflate or identity")
        budget = self._inflated
        room = min(limits.max_inflate_bytes, limits.max_body_bytes, budget.limit - budget.used)
        if room <= 0:
            raise _Refusal(503, f"the server is inflating {budget.used} bytes of compressed requests, the limit "
                                f"({limits.key('max_total_inflate_bytes')}) is {budget.limit}; retry later")
        budget.used += room
        try:
            if len(body) > INFLATE_INLINE:
                out = await trio.to_thread.run_sync(_inflate, body, wbits, room, limiter=self._inflate_threads)
            else:
                out = _inflate(body, wbits, room)
        finally:
            budget.used -= room
        if isinstance(out, str):
            raise _Refusal(400, f"the request body is not valid {encoding} data: {out}")
        if len(out) > room:
            raise _Refusal(413, f"the {encoding} request body inflates past {room} bytes, the limit "
                                f"({limits.key('max_inflate_bytes')} and {limits.key('max_body_bytes')}); send it "
                                "uncompressed or through shared memory")
        return out

    async def _answer(self, request: HttpRequest) -> HttpResponse:
        try:
            return await self.handler(request)
        except Exception as exc:
            self._bugs.line(logging.ERROR, "%s %s %s failed", self.what, request.method, request.path, exc=exc)
            return HttpResponse(500, error_json(internal_message(exc, f"{request.method} {request.path[:200]}")))

    async def _respond(self, stream, request: HttpRequest, response: HttpResponse, close: bool,
                       raw: socket.socket | None = None) -> None:
        """Write ``response``, framed by Content-Length (a HEAD's without its body), with
        ``Connection: close`` when the connection ends after it."""
        body = response.body
        head = _status_line(response.status)
        if response.content_type and body:
            head += b"content-type: %s\r\n" % _header_value(response.content_type)
        for name, value in response.headers:
            head += b"%s: %s\r\n" % (_header_name(name), _header_value(value))
        if len(body) >= COMPRESS_MIN and (accepting := request.headers.get("accept-encoding")) is not None:
            accepted = response_coding(accepting)
            if accepted is not None:
                body = await self._compress(body, accepted)
                head += b"content-encoding: %s\r\n" % accepted.encode()
        head += b"content-length: %d\r\n%s\r\n" % (len(body), b"connection: close\r\n" if close else b"")
        if request.method == "HEAD" or not body:
            await self._send(stream, head, raw)
        elif len(body) > RECEIVE_BYTES:     # a large body goes out as it is, not copied behind its head
            await self._send(stream, head, raw)
            await self._send(stream, body, raw)
        else:
            await self._send(stream, head + body, raw)

    async def _compress(self, body: bytes, encoding: str) -> bytes:
        if len(body) > INFLATE_INLINE:
            return await trio.to_thread.run_sync(_deflate, body, encoding, limiter=self._inflate_threads)
        return _deflate(body, encoding)

    async def _send(self, stream, data: bytes, raw: socket.socket | None = None) -> None:
        """Write ``data``; with ``raw`` (the connection's socket, not TLS) first with one
        non-blocking send, and only what it did not take through the stream, under
        ``write_timeout``."""
        if raw is not None:
            try:
                sent = raw.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise trio.BrokenResourceError(f"the write failed: {exc}") from exc
            if sent == len(data):
                await trio.lowlevel.checkpoint_if_cancelled()
                return
            data = memoryview(data)[sent:]
        with trio.move_on_after(self.limits.write_timeout) as scope:
            await stream.send_all(data)
        if scope.cancelled_caught:
            raise trio.BrokenResourceError(f"a write made no progress for {self.limits.write_timeout:g} s "
                                           f"({self.limits.key('write_timeout')})")

    async def _refuse(self, stream, refusal: _Refusal) -> None:
        self._faults.line(logging.INFO, "%s port: closing a connection: %s", self.what, refusal.message)
        try:
            await self._send(stream, _raw_response(refusal.status, refusal.message))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass


async def _receive_raw(raw: socket.socket, wait_first: bool = False) -> bytes:
    """What the non-blocking ``raw`` socket has (:func:`read_when_ready`; b"" at its end); with
    ``wait_first`` (the last read emptied it) once it is readable, without trying first. A
    socket error is the peer's doing, raised as Trio's stream raises it (BrokenResourceError)."""
    try:
        return await read_when_ready(raw, lambda: raw.recv(RECEIVE_BYTES), wait_first=wait_first)
    except OSError as exc:
        raise trio.BrokenResourceError(f"the read failed: {exc}") from exc


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Client Closed Request" if status == 499 else b""


_STATUS_LINES: dict[int, bytes] = {}
_TOKEN = re.compile(r"[-!#$%&'*+.^_`|~0-9a-zA-Z]+\Z")
_FIELD_VALUE = re.compile(r"[\t\x20-\x7e\x80-\xff]*\Z")


def _status_line(status: int) -> bytes:
    """``HTTP/1.1 <status> <reason>`` and the server header (made once per status)."""
    line = _STATUS_LINES.get(status)
    if line is None:
        if not 200 <= status <= 999:
            raise ValueError(f"a response's status must be 200-999 (1xx are not final), got {status}")
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\nserver: %s\r\n" % (status, _reason(status), SERVER_HEADER)
    return line


_HEADER_NAMES: dict[str, bytes] = {}


def _header_name(name: str) -> bytes:
    """A response header name, checked to be a token (the names seen are kept, up to 256: they
    are the handlers' own few)."""
    encoded = _HEADER_NAMES.get(name)
    if encoded is None:
        if not _TOKEN.match(name):
            raise ValueError(f"a response header name must be a token, got {name[:80]!r}")
        encoded = name.encode("ascii")
        if len(_HEADER_NAMES) < 256:
            _HEADER_NAMES[name] = encoded
    return encoded


def _header_value(value: str) -> bytes:
    """A response header value: no CR, LF or other control characters (no header injection)."""
    if not _FIELD_VALUE.match(value):
        raise ValueError(f"a response header value has control characters: {value[:80]!r}")
    return value.encode("latin-1")


def _raw_response(status: int, message: str) -> bytes:
    """A complete response that closes the connection, for a peer whose request was refused
    before or while it was parsed."""
    body = error_json(message)
    return (b"HTTP/1.1 %d %s\r\nserver: %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, _reason(status), SERVER_HEADER, len(body))) + body


def _inflate(body: bytes, wbits: int, limit: int) -> bytes | str:
    """``body`` inflated to at most ``limit + 1`` bytes (more says it is too large), or what is
    wrong with it when it is not one whole gzip member or deflate stream. Bytes after its end
    (a second gzip member, stray bytes) are an error: inflating stops at the end, so they would
    be dropped unseen and the handler would get part of what the client sent."""
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        return str(exc)
    if len(out) > limit:
        return out
    if not d.eof:
        return "the compressed stream ends early"
    if d.unused_data:
        return (f"{len(d.unused_data)} bytes follow the end of the compressed stream (a second gzip member, or "
                "stray bytes); send one gzip member or deflate stream")
    return out


def _deflate(body: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        c = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    else:
        c = zlib.compressobj(6, zlib.DEFLATED, zlib.MAX_WBITS)
    return c.compress(body) + c.flush()


# RFC 9110 section 12.4.2: a qvalue is 0 to 1 with at most three decimals
_QVALUE = re.compile(r"(?:0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?)\Z")


def accepted_codings(header: str) -> dict[str, float]:
    """An ``Accept-Encoding`` value as {coding: q} (RFC 9110 section 12.5.3), codings in lower
    case, ``x-gzip`` read as ``gzip``, ``*`` kept as it is. An element whose q is not a qvalue
    (``q=abc``, ``q=2``, ``q=0.5000``, two of them) is left out, as if the client had not sent it:
    the header comes from the peer, so a malformed one never raises. A coding listed twice keeps
    its lowest q, so that one exclusion is never outweighed by a repetition."""
    weights: dict[str, float] = {}
    for element in header.split(","):
        coding, *params = element.split(";")
        coding = coding.strip().lower()
        if not coding:
            continue
        q: float | None = 1.0
        seen_q = False
        for param in params:
            name, _, value = param.partition("=")
            if name.strip().lower() != "q":
                continue    # the grammar has no other parameter: ignored rather than refused
            value = value.strip()
            q = float(value) if not seen_q and _QVALUE.match(value) else None
            seen_q = True
        if q is None:
            continue
        coding = "gzip" if coding == "x-gzip" else coding
        weights[coding] = min(q, weights.get(coding, q))
    return weights


def response_coding(header: str) -> str | None:
    """The coding of :data:`RESPONSE_CODINGS` to compress a response with for a client that sent
    ``Accept-Encoding: header``, or None to send it as it is (identity).

    RFC 9110 section 12.5.3: a coding is acceptable with the q it is listed with, else with the
    q of ``*``, else not at all; q=0 means "not acceptable". The acceptable coding of highest q
    wins, a tie going to the server's order of preference. identity, unlisted and not
    excluded by ``*``, is acceptable but the last choice; listed (itself or through ``*``), it
    is weighed like the others and wins only with a higher q than every offered coding. When
    nothing is acceptable (``gzip;q=0, identity;q=0``, ``*;q=0``) the response goes without
    coding all the same: the RFC's advice for a response, where a 406 would only lose the
    answer."""
    weights = accepted_codings(header)
    anything = weights.get("*")
    chosen, chosen_q = None, 0.0
    for coding in RESPONSE_CODINGS:
        q = weights.get(coding, anything if anything is not None else 0.0)
        if q > chosen_q:
            chosen, chosen_q = coding, q
    identity = weights.get("identity", anything)
    if chosen is not None and identity is not None and identity > chosen_q:
        return None
    return chosen
