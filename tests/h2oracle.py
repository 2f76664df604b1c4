"""libnghttp2 as a differential oracle for xlaserve's hand-written HTTP/2 layer (issue 14).

The same client bytes go (a) to an in-process libnghttp2 server session through ``ngh2`` (sans-IO:
bytes in, events and bytes out, no socket) and (b) to a real :class:`GrpcServer` on loopback.
Each side's answer is reduced to a :class:`Verdict` (the connection error it sent, the streams it
reset, the requests that reached the application complete) and the two are compared by
:func:`disagreement`.

Both engines are set up alike: the same SETTINGS (xlaserve's ``OUR_*``), the same connection
window, and ``ngh2``'s own limits at their defaults unless a scenario names others. Every byte
sequence starts with what a real client sends first (the preface, its SETTINGS) and an ACK of the
server's SETTINGS: a client may send frames up to the advertised size only once it has seen them,
and libnghttp2 applies its advertised settings when they are acknowledged.

How each side is observed:

- ``ngh2``: the bytes are fed a frame at a time (the preface first), taking what the engine has
  to send after each (a client that reads its replies, and the order of its refusals exact; a
  scenario with ``client_reads=False`` feeds everything before taking anything). The RST_STREAM
  and GOAWAY frames in its output, and its request events, make the verdict. When the engine
  refuses to go on (``receive_data`` raises), the verdict is the GOAWAY the ``ngh2`` branch's
  driver sent in that case (d9ed43d: ``DenialOfServiceError`` -> ENHANCE_YOUR_CALM, any other
  connection error -> PROTOCOL_ERROR), and the exception's message is kept: it names the limit.
- xlaserve: a socket on loopback writes the bytes (reading whatever comes back meanwhile, unless
  ``client_reads=False``), half-closes, and reads until the server closes. Every request path the
  scenarios and the fuzzer's generators use is served by :class:`RecordingService`, task-free, so
  a request that arrives complete is recorded in the reader before the connection can end: the
  record is there, without any waiting, once the client has read the server's end of stream.
"""
from __future__ import annotations

import selectors
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import ngh2
import trio
from grpclib.const import Cardinality, Handler

from tests.trio_thread import TrioServerThread
from xlaserve.http2.frames import H2Limits
from xlaserve.frontend.grpc_server import OUR_CONN_WINDOW, OUR_MAX_FRAME, OUR_STREAM_WINDOW, GrpcServer

OUR_STREAMS = H2Limits().max_concurrent_streams
OUR_HEADER_LIST = H2Limits().max_header_list_bytes
OUR_HEADER_FIELDS = H2Limits().max_header_fields

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
ERROR_NAMES = ("NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR", "SETTINGS_TIMEOUT",
               "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL", "COMPRESSION_ERROR",
               "CONNECT_ERROR", "ENHANCE_YOUR_CALM", "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED")

#: what xlaserve advertises in its first SETTINGS; the ngh2 session advertises the same
SERVER_SETTINGS = {ngh2.Setting.MAX_CONCURRENT_STREAMS: OUR_STREAMS,
                   ngh2.Setting.INITIAL_WINDOW_SIZE: OUR_STREAM_WINDOW,
                   ngh2.Setting.MAX_FRAME_SIZE: OUR_MAX_FRAME,
                   ngh2.Setting.MAX_HEADER_LIST_SIZE: OUR_HEADER_LIST}
#: libnghttp2's limits at ngh2 0.3.0's defaults, but the decoded header list held to what we advertise
#: and its field count to ours (endpoints.max_header_fields)
ENGINE = ngh2.Configuration(max_inbound_header_list_size=OUR_HEADER_LIST, max_inbound_header_count=OUR_HEADER_FIELDS)
TIMEOUT = 10.0          # seconds one sequence may take on loopback before the harness gives up

SERVICE = "/inference.GRPCInferenceService/"
#: every path the scenarios and scripts/fuzz_transport.py's generators send to
PATHS = tuple(SERVICE + m for m in (
    "ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
    "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload", "ModelInfer",
    "ModelStreamInfer", "SystemSharedMemoryStatus", "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister", "CudaSharedMemoryStatus", "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister", "TraceSetting", "LogSettings"))


def error_name(code: int | None) -> str:
    if code is None:
        return "-"
    return ERROR_NAMES[code] if code < len(ERROR_NAMES) else f"0x{code:x}"


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"", length: int | None = None) -> bytes:
    """One frame; ``length`` puts a lie in its length field."""
    n = len(payload) if length is None else length
    return struct.pack(">IBI", n << 8 | ftype, flags, stream_id) + payload


def settings(*pairs: tuple[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", key, value) for key, value in pairs))


#: what every sequence starts with: preface, the client's SETTINGS, the ACK of the server's
CLIENT_START = PREFACE + settings((2, 0)) + frame(SETTINGS, ACK, 0)


def complete_last_frame(data: bytes) -> bytes:
    """``data`` with its last frame completed by zero bytes, if its length field promised more than
    came (up to the largest frame we advertise; a larger one is refused from its header alone), and a
    frame header cut short dropped. libnghttp2 checks a frame's header and decodes HPACK as bytes
    arrive, xlaserve once a frame is whole: neither order is wrong, so the oracle compares whole frames."""
    pos = len(PREFACE) if data.startswith(PREFACE) else len(data)
    while len(data) - pos >= 9:
        length = int.from_bytes(data[pos:pos + 3], "big")
        if len(data) - pos - 9 < length:
            return data + bytes(pos + 9 + length - len(data)) if length <= OUR_MAX_FRAME else data
        pos += 9 + length
    return data[:pos]


def frame_pieces(data: bytes) -> list[bytes]:
    """``data`` cut as a server reads it: the preface, then one frame at a time (by their length
    fields), then whatever is left."""
    if not data.startswith(PREFACE):
        return [data]
    pieces, pos = [PREFACE], len(PREFACE)
    while len(data) - pos >= 9:
        end = pos + 9 + int.from_bytes(data[pos:pos + 3], "big")
        pieces.append(data[pos:end])
        pos = end
    if pos < len(data):
        pieces.append(data[pos:])
    return pieces


def ends_inside_a_header_block(data: bytes) -> bool:
    """Whether the client's last header block in ``data`` never ends (no END_HEADERS)."""
    inside = False
    for piece in frame_pieces(data)[1:]:
        if len(piece) >= 9 and piece[3] in (HEADERS, CONTINUATION):
            inside = not piece[4] & END_HEADERS
    return inside


def split_grpc(body: bytes) -> bytes | None:
    """The one uncompressed gRPC message ``body`` holds, or None if it holds anything else."""
    if len(body) < 5:
        return None
    flag, size = struct.unpack_from(">BI", body)
    return body[5:] if flag == 0 and len(body) == 5 + size else None


# ---- verdicts ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Request:
    """A request that reached the application complete: its metadata (the header fields but
    pseudo-headers and content-type, the last value of a repeated name, as xlaserve's calls see
    them) and its one gRPC message (None where the body is not exactly one uncompressed message)."""

    metadata: tuple[tuple[str, str], ...]
    message: bytes | None


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one server made of one byte sequence."""

    goaway: int | None = None                   # the connection error code sent; None: none
    resets: tuple[tuple[int, int], ...] = ()    # (stream, RST_STREAM code) the server sent, but NO_ERROR
    complete: frozenset[int] = frozenset()      # streams whose request arrived whole (END_STREAM seen)
    requests: tuple[tuple[int, Request], ...] = ()  # their contents, where the server shows them
    answered_early: frozenset[int] = frozenset()  # xlaserve: answered and reset (NO_ERROR) before the request ended
    detail: str = ""                            # the engine's own words (ngh2's exception, GOAWAY debug data)
    first: tuple[str, int] | None = None        # the first refusal sent: ("stream" or "connection", code)
    #: ngh2: the bytes read before the client's GOAWAY made it stop reading (no stream left open)
    stopped_reading_at: int | None = None

    @property
    def rejected(self) -> bool:
        """The server refused something: a connection error or a stream reset."""
        return self.goaway is not None or bool(self.resets)

    def describe(self) -> str:
        resets = ", ".join(f"{sid}:{error_name(code)}" for sid, code in self.resets) or "-"
        return (f"goaway={error_name(self.goaway)} resets=[{resets}] complete={sorted(self.complete)} "
                f"early={sorted(self.answered_early)} detail={self.detail[:120]!r}")


def _server_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The complete frames in ``data`` (what a server sent), after its first SETTINGS."""
    out, pos = [], 0
    while len(data) - pos >= 9:
        lt, flags, sid = struct.unpack_from(">IBI", data, pos)
        length = lt >> 8
        if len(data) - pos - 9 < length:
            break
        out.append((lt & 0xFF, flags, sid & 0x7FFFFFFF, data[pos + 9:pos + 9 + length]))
        pos += 9 + length
    return out


def _judge_output(frames) -> tuple[int | None, dict[int, int], set[int], str, tuple[str, int] | None]:
    """GOAWAY code, RST_STREAM codes, streams given a response HEADERS, GOAWAY debug data, the
    first refusal (a GOAWAY, or a RST_STREAM other than NO_ERROR)."""
    goaway, resets, answered, detail, first = None, {}, set(), "", None
    for ftype, _flags, sid, payload in frames:
        if ftype == GOAWAY and len(payload) >= 8 and goaway is None:
            goaway = struct.unpack_from(">I", payload, 4)[0]
            detail = payload[8:].decode("utf-8", "replace")
            first = first or ("connection", goaway)
        elif ftype == RST_STREAM and len(payload) == 4:
            code = resets.setdefault(sid, struct.unpack(">I", payload)[0])
            if code != NO_ERROR:
                first = first or ("stream", code)
        elif ftype == HEADERS:
            answered.add(sid)
    return goaway, resets, answered, detail, first


def ngh2_verdict(data: bytes, config: ngh2.Configuration = ENGINE, *, client_reads: bool = True) -> Verdict:
    """What libnghttp2 (through ngh2, sans-IO) makes of a client that sends ``data``."""
    h2 = ngh2.Connection(ngh2.Role.SERVER, config)
    h2.initiate_connection(SERVER_SETTINGS)
    h2.set_local_window_size(OUR_CONN_WINDOW)
    h2.data_to_send()                       # our preface: not part of the verdict
    out = bytearray()
    events: list = []
    failure: ngh2.NGH2Error | None = None
    read = 0
    stopped_reading_at = None
    for piece in (frame_pieces(data) if client_reads else [data]):
        try:
            h2.receive_data(piece)
        except ngh2.NGH2Error as exc:
            failure = exc
            break
        read += len(piece)
        events += h2.events()
        out += h2.data_to_send()
        events += h2.events()
        if not h2.want_read:                # the engine has closed the connection
            if any(type(e) is ngh2.GoAwayReceived for e in events):
                stopped_reading_at = read
            break
    goaway, resets, _, detail, first = _judge_output(_server_frames(bytes(out)))
    if failure is not None and goaway is None:
        goaway = ENHANCE_YOUR_CALM if isinstance(failure, ngh2.DenialOfServiceError) else PROTOCOL_ERROR
        first = first or ("connection", goaway)
    if failure is not None:
        detail = f"{type(failure).__name__}: {failure}"
    complete: set[int] = set()
    fields: dict[int, tuple] = {}
    bodies: dict[int, bytearray] = {}
    for event in events:
        kind = type(event)
        if kind is ngh2.RequestReceived:
            fields[event.stream_id] = event.headers
            bodies[event.stream_id] = bytearray()
            if event.end_stream:
                complete.add(event.stream_id)
        elif kind is ngh2.DataReceived:
            if event.stream_id in bodies:
                bodies[event.stream_id] += event.data
            if event.end_stream:
                complete.add(event.stream_id)
        elif kind is ngh2.TrailersReceived:
            complete.add(event.stream_id)
    requests = []
    for sid in sorted(complete & fields.keys()):
        metadata: dict[str, str] = {}
        for name, value in fields[sid]:
            name = name.decode("latin-1")
            if not name.startswith(":") and name != "content-type":
                metadata[name] = value.decode("latin-1")
        requests.append((sid, Request(tuple(sorted(metadata.items())), split_grpc(bytes(bodies[sid])))))
    return Verdict(goaway, tuple(sorted(resets.items())), frozenset(complete), tuple(requests), frozenset(), detail,
                   first, stopped_reading_at if goaway is None else None)


# ---- xlaserve on loopback ------------------------------------------------------------------------
class RawMessage:
    """A request or reply type that is its bytes: the oracle compares bytes, not protobuf."""

    __slots__ = ("data",)

    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    @classmethod
    def FromString(cls, payload) -> "RawMessage":   # noqa: N802 (protobuf's spelling)
        return cls(bytes(payload))

    def SerializeToString(self) -> bytes:          # noqa: N802
        return self.data


class RecordingService:
    """Answers every path in :data:`PATHS` with an empty message, task-free, after recording the
    request as the application sees it (stream id, metadata, message)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, Request]] = []

    def __mapping__(self) -> dict[str, Handler]:
        async def never(stream) -> None:
            raise AssertionError("a recording method ran as a task")
        return {path: Handler(never, Cardinality.UNARY_UNARY, RawMessage, RawMessage) for path in PATHS}

    def __fast_unary__(self) -> dict[str, Callable]:
        return {path: self.record for path in PATHS}

    def record(self, call, request: RawMessage) -> None:
        self.records.append((call.id, Request(tuple(sorted(call.metadata.items())), request.data)))
        call.complete(RawMessage())


class XlaserveOracleServer(TrioServerThread):
    """A :class:`GrpcServer` serving a :class:`RecordingService` from ``trio.run`` in a thread."""

    thread_name = "h2-oracle-server"

    def __init__(self, **options) -> None:
        self.service = RecordingService()
        self.server = GrpcServer([self.service], **options)
        super().__init__()

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            with trio.fail_after(TIMEOUT):
                await self.server.wait_closed()
            self._nursery.cancel_scope.cancel()
        trio.from_thread.run(close, trio_token=self.token)
        self._thread.join(TIMEOUT)
        if self._error is not None:
            raise self._error

    def verdict(self, data: bytes, *, client_reads: bool = True) -> Verdict:
        """What the server makes of a client that sends ``data``, half-closes and reads to the end.
        One connection at a time (the recording is per server)."""
        self.service.records.clear()
        received = _exchange(self.port, data, client_reads)
        goaway, resets, answered, detail, first = _judge_output(_server_frames(received))
        records = dict(self.service.records)
        early = {sid for sid in answered if resets.get(sid) == NO_ERROR}
        complete = set(records) | (answered - early)
        resets = {sid: code for sid, code in resets.items() if code != NO_ERROR}
        return Verdict(goaway, tuple(sorted(resets.items())), frozenset(complete), tuple(sorted(records.items())),
                       frozenset(early), detail, first)


def _exchange(port: int, data: bytes, client_reads: bool) -> bytes:
    """Send ``data`` (reading meanwhile if ``client_reads``), half-close, read until the server
    closes; everything the server sent. Fails after :data:`TIMEOUT` seconds."""
    deadline = time.monotonic() + TIMEOUT
    received = bytearray()
    with socket.socket() as sock, selectors.DefaultSelector() as selector:
        if not client_reads:    # a small receive buffer: what the server sends piles up on its side
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.settimeout(TIMEOUT)
        sock.connect(("127.0.0.1", port))
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if data else 0))
        view = memoryview(data)
        closed = refused = False        # the server closed; a send failed (it closed after a GOAWAY)
        while view and not (closed or refused):
            if time.monotonic() > deadline:
                raise AssertionError(f"xlaserve did not take {len(view)} of {len(data)} bytes in {TIMEOUT}s")
            for _, mask in selector.select(deadline - time.monotonic()):
                if mask & selectors.EVENT_WRITE:
                    try:
                        view = view[sock.send(view):]
                    except BlockingIOError:
                        pass
                    except OSError:
                        refused = True
                if mask & selectors.EVENT_READ and client_reads:
                    closed = _read(sock, received) or closed
            if not client_reads:
                selector.modify(sock, selectors.EVENT_WRITE)
        if not (closed or refused):
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:             # the server has already reset the connection
                pass
        selector.modify(sock, selectors.EVENT_READ)
        while not closed:       # what the server sends until it closes (after a GOAWAY: what it sent before)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"xlaserve did not close the connection within {TIMEOUT}s")
            if selector.select(remaining):
                closed = _read(sock, received)
    return bytes(received)


def _read(sock: socket.socket, into: bytearray) -> bool:
    """One read into ``into``; True at the end of the stream."""
    try:
        chunk = sock.recv(1 << 20)
    except BlockingIOError:
        return False
    except OSError:                          # reset: what arrived before it has been read
        return True
    into += chunk
    return not chunk


def both_verdicts(server: XlaserveOracleServer, data: bytes, config: ngh2.Configuration = ENGINE, *,
                  client_reads: bool = True) -> tuple[Verdict, Verdict]:
    """xlaserve's and ngh2's verdicts on ``data``. Where the client's GOAWAY made libnghttp2 stop
    reading (it had no stream open), xlaserve gets the bytes up to there: it stops too, but only at
    the end of what it has read in one go, and what follows a client's goodbye is not compared."""
    oracle = ngh2_verdict(data, config, client_reads=client_reads)
    if oracle.stopped_reading_at is not None:
        data = data[:oracle.stopped_reading_at]
    return server.verdict(data, client_reads=client_reads), oracle


# ---- comparing ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Allowance:
    """Where RFC 9113 lets a server answer one violation in more than one way: either server may
    answer any of ``codes``, as a connection error (GOAWAY) if ``connection`` or a stream error
    (RST_STREAM) if ``stream``. The comparison then asks only that both refuse that way."""

    section: str
    codes: frozenset[int]
    connection: bool = True
    stream: bool = True
    why: str = ""


def disagreement(ours: Verdict, oracle: Verdict, allowance: Allowance | None = None) -> str | None:
    """Why ``ours`` (xlaserve) and ``oracle`` (ngh2) disagree, or None if they agree: the same
    connection error, or none; the same streams reset with the same codes; the same requests
    complete, with the same metadata and message where both show them. With ``allowance``, a
    refusal of an allowed kind and code by both is agreement, whatever else each did."""
    if allowance is not None:
        mine, theirs = ours.first, oracle.first
        for who, refusal in (("xlaserve", mine), ("ngh2", theirs)):
            if refusal is None:
                return f"{who} did not refuse ({allowance.section} requires a refusal)"
            kind, code = refusal
            if code not in allowance.codes or not getattr(allowance, kind):
                return f"{who} refused with a {kind} error {error_name(code)}, not one {allowance.section} allows"
        return None
    if ours.goaway != oracle.goaway:
        return f"connection error: xlaserve {error_name(ours.goaway)}, ngh2 {error_name(oracle.goaway)}"
    # both ended the connection with the same code: every stream ends with it, so a stream reset
    # one engine sent on its way there (libnghttp2 checks fields as it decodes them) is moot
    if ours.goaway is None and ours.resets != oracle.resets:
        return "stream resets differ"
    complete = ours.complete - ours.answered_early
    theirs = oracle.complete - ours.answered_early
    # xlaserve hands a request to the application when the reader's turn (the frames of one
    # read) ends; a connection error in that turn ends the connection first, and its calls are
    # cancelled anyway. So with a connection error, fewer complete requests is agreement.
    if complete != theirs and not (ours.goaway is not None and complete < theirs):
        return f"complete requests: xlaserve {sorted(complete)}, ngh2 {sorted(theirs)}"
    oracle_requests = dict(oracle.requests)
    for sid, request in ours.requests:
        expected = oracle_requests.get(sid)
        if expected is None:
            continue
        if request.metadata != expected.metadata:
            return f"stream {sid}: metadata xlaserve {request.metadata}, ngh2 {expected.metadata}"
        if expected.message is not None and request.message != expected.message:
            return f"stream {sid}: the request message differs"
    return None


@dataclass(frozen=True)
class Row:
    """One scenario: the bytes after :data:`CLIENT_START` and how both servers must answer them.

    ``expect`` is what ngh2 answers (asserted, so the row says what the oracle does): a
    ``"GOAWAY <CODE>"``, ``"RST <CODE>"``, or ``"accept"``. ``config`` sets ngh2's limits for the row; ``client_reads``
    False makes a client that reads nothing until it has sent everything."""

    name: str
    data: bytes
    expect: str
    config: ngh2.Configuration = ENGINE
    client_reads: bool = True
    note: str = ""

    @property
    def sequence(self) -> bytes:
        return CLIENT_START + self.data


def summary(v: Verdict) -> str:
    """A verdict in :attr:`Row.expect`'s words."""
    if v.goaway is not None:
        return f"GOAWAY {error_name(v.goaway)}"
    if v.resets:
        return f"RST {error_name(v.resets[0][1])}"
    return "accept"
