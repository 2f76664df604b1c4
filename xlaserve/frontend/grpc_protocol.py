"""gRPC over HTTP/2, the part above HTTP/2: no sockets, no frames, no streams.

What a request's header fields say (path, ``grpc-timeout``, ``grpc-encoding``, metadata) and
whether the server can take it at all (405, 415, UNIMPLEMENTED, a malformed timeout); cutting a
request body into its length-prefixed messages, with the message size limit and gzip/deflate
inflated within an :class:`InflateBudget`; the reply's message framing and its header blocks
(response headers, trailers). HTTP/2 itself (frames, flow control, streams, HPACK decoding) and
the Trio driver live in :mod:`xlaserve.frontend.grpc_server`, which calls these functions.

The hot path (a unary ModelInfer with one uncompressed message) costs no object here beyond the
message it cuts: header blocks are precomputed bytes, a connection reuses the
:class:`RequestHead` of a header block it has seen (the HPACK decoder hands back the same field
tuple for a repeated block), and :func:`cut_messages` works on the call's own buffer and queue.
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import MappingProxyType

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import encode_grpc_message

from xlaserve.http2.hpack import encode

MESSAGE_PREFIX = struct.Struct(">BI")     # a length-prefixed message: compressed flag, length
ENCODINGS = ("identity", "gzip", "deflate")
_WBITS = {"gzip": 31, "deflate": 15}       # zlib's window bits: gzip header, zlib header

#: The header block that opens every reply (HPACK, no dynamic table: the same bytes every time).
RESPONSE_HEADERS = encode([(":status", "200"), ("content-type", "application/grpc")])
#: The trailer block of a call that ended OK without a message.
OK_TRAILERS = encode([("grpc-status", "0")])

# What a call's budget says when a message cannot be inflated; the server names the keys.
CONNECTION_INFLATE_KEY = "endpoints.max_connection_inflate_bytes"
SERVER_INFLATE_KEY = "endpoints.max_inflate_bytes"

#: The longest ``grpc-message`` value sent (percent-encoded bytes); a longer message is cut, and
#: says so. Messages echo what a client sent (a model name, a version, a path) and list the
#: repository's models, so without a cap a client could make one as long as its request: gRPC's
#: C core (Triton's clients, grpcio) refuses trailers past 8 KiB ("received metadata size
#: exceeds soft limit", RESOURCE_EXHAUSTED instead of the status), and grpclib's client drops
#: the whole connection past 64 KiB.
MAX_GRPC_MESSAGE_BYTES = 4096


_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def parse_timeout(value: str) -> float:
    """Seconds in a ``grpc-timeout`` header value: 1 to 8 ASCII digits and a unit (gRPC's
    "TimeoutValue TimeoutUnit"); anything else raises ValueError saying so."""
    digits, unit = value[:-1], value[-1:]
    if not (0 < len(digits) <= 8 and digits.isascii() and digits.isdigit()) or unit not in _TIMEOUT_UNITS:
        raise ValueError(f"grpc-timeout {value!r} is not 1 to 8 digits followed by one of H M S m u n")
    return int(digits) * _TIMEOUT_UNITS[unit]


# ---- the request head ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is answered before any handler sees it: with an HTTP status other than 200
    (``http_status``: the request is no gRPC call), or with a gRPC ``status``."""

    status: Status
    message: str
    http_status: int = 200

    def block(self) -> bytes:
        """The header block of the trailers-only response that answers the request."""
        if self.http_status != 200:
            return encode([(":status", str(self.http_status)), ("content-type", "text/plain"),
                           ("grpc-status", str(self.status.value)),
                           ("grpc-message", grpc_message_value(self.message))])
        return RESPONSE_HEADERS + trailers(self.status, self.message)


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What a request's header block says, for gRPC, and what the server makes of it.

    ``metadata`` is every field but pseudo-headers and ``content-type`` (a field sent twice
    counts with its last value), read-only: one head may serve every call that repeats its
    header block. ``verdict`` is :func:`check_head`'s answer: a :class:`Refusal`, the
    ``grpc-timeout`` in seconds, or None (no timeout)."""

    method: str                    # the HTTP method
    path: str
    content_type: str
    encoding: str                  # grpc-encoding, "identity" when absent
    metadata: MappingProxyType
    verdict: Refusal | float | None


def read_head(fields: Iterable[tuple[str, str]], methods, service_names: Iterable[str]) -> RequestHead | None:
    """The head of a request from its decoded header fields (latin-1 text, as HPACK decoded
    them), checked against ``methods`` (the paths the server serves). None if a field has an
    empty name: RFC 9113 8.2.1 makes such a request malformed, a stream error for HTTP/2 to
    answer (RST_STREAM PROTOCOL_ERROR); it never reaches gRPC."""
    method = path = content_type = ""
    metadata: dict[str, str] = {}
    for name, value in fields:
        if not name:
            return None
        if name[0] == ":":
            if name == ":path":
                path = value
            elif name == ":method":
                method = value
        elif name == "content-type":
            content_type = value
        else:
            metadata[name] = value
    encoding = metadata.get("grpc-encoding", "identity")
    verdict = check_head(method, path in methods, path, content_type, encoding, metadata.get("grpc-timeout"),
                         service_names)
    return RequestHead(method, path, content_type, encoding, MappingProxyType(metadata), verdict)


def check_head(method: str, known: bool, path: str, content_type: str, encoding: str, timeout: str | None,
               service_names: Iterable[str]) -> Refusal | float | None:
    """A :class:`Refusal` if the request cannot be served, checked in this order: not a POST
    (405), not ``application/grpc`` (415), an unknown ``path`` (``known`` False: UNIMPLEMENTED,
    listing ``service_names``), an unsupported ``grpc-encoding`` (UNIMPLEMENTED), a malformed
    ``grpc-timeout`` (INVALID_ARGUMENT). Else the timeout in seconds, or None without one."""
    if method != "POST":
        return Refusal(Status.INTERNAL, f"gRPC calls are POST requests, not {method or 'missing'}", 405)
    if not content_type.startswith("application/grpc"):
        return Refusal(Status.INTERNAL, f"content-type {content_type!r} is not application/grpc", 415)
    if not known:
        return Refusal(Status.UNIMPLEMENTED, f"unknown method {path!r}; this server serves "
                                             f"{', '.join(service_names)}")
    if encoding not in ENCODINGS:
        return Refusal(Status.UNIMPLEMENTED, f"grpc-encoding {encoding!r} is not supported; use "
                                             "identity, gzip or deflate")
    if timeout is None:
        return None
    try:
        return parse_timeout(timeout)
    except ValueError as exc:
        return Refusal(Status.INVALID_ARGUMENT, str(exc))


# ---- replies ---------------------------------------------------------------------------------------
def grpc_message_value(message: str) -> str:
    """``message`` as a ``grpc-message`` value: percent-encoded, at most
    :data:`MAX_GRPC_MESSAGE_BYTES` (a longer one keeps its start and says how much was cut).

    Never raises, whatever the text: a character UTF-8 cannot encode (a lone surrogate, which
    user code can put in an exception's message) goes out as its ``\\udcXX`` escape. This runs
    on the Trio thread as a call ends: a message that raised here left its call without trailers,
    and its client waited for good. Only the start of a long message is encoded (each character
    takes at least one byte), so a message of megabytes costs no more than one that fits."""
    head = message[:MAX_GRPC_MESSAGE_BYTES + 1]
    value = _percent_encoded(head)
    if len(head) == len(message) and len(value) <= MAX_GRPC_MESSAGE_BYTES:
        return value
    room = MAX_GRPC_MESSAGE_BYTES - 100      # for the note below
    kept = size = 0
    for char in head:
        size += len(_percent_encoded(char))
        if size > room:
            break
        kept += 1
    note = f"... ({len(message) - kept} more characters cut: the message passed {MAX_GRPC_MESSAGE_BYTES} bytes)"
    return _percent_encoded(head[:kept]) + encode_grpc_message(note)


def _percent_encoded(text: str) -> str:
    try:
        return encode_grpc_message(text)
    except UnicodeEncodeError:
        return encode_grpc_message(text.encode("utf-8", "backslashreplace").decode("utf-8"))


def trailers(status: Status, message: str | None) -> bytes:
    """The trailer block that ends a call with ``status``; ``grpc-message`` percent-encoded
    (:func:`grpc_message_value`), left out when ``message`` is empty."""
    if status is Status.OK and not message:
        return OK_TRAILERS
    fields = [("grpc-status", str(status.value))]
    if message:
        fields.append(("grpc-message", grpc_message_value(message)))
    return encode(fields)


def framed(data: bytes) -> bytes:
    """One reply message, length-prefixed and uncompressed (replies are never compressed)."""
    return MESSAGE_PREFIX.pack(0, len(data)) + data


# ---- bounded decompression ------------------------------------------------------------------------
class InflateBudget:
    """Decompressed request bytes in flight: reserved before a message is inflated, held until
    it has been parsed into its protobuf (or its call ends). One budget per connection, whose
    ``parent`` is the server's, so a message needs room in both.

    Why: a gzip message of 250 KiB inflates to 255 MiB; without a budget, a few streams of them
    cost gigabytes before any is refused. With one, a message is inflated only up to what is
    left, and refused as soon as it passes that.
    """

    __slots__ = ("limit", "used", "key", "parent", "closed")

    def __init__(self, limit: int, key: str, parent: InflateBudget | None = None) -> None:
        self.limit = limit
        self.used = 0
        self.key = key                  # the node-file key that sets ``limit``, for messages
        self.parent = parent
        self.closed = False

    def left(self) -> int:
        return self.limit - self.used

    def reserve(self, size: int) -> None:
        self.used += size
        if self.parent is not None:
            self.parent.reserve(size)

    def release(self, size: int) -> None:
        """Give back ``size`` bytes reserved here (and in the parent, unless this budget has
        been closed: :meth:`close` gave the parent back everything at once)."""
        self.used -= size
        if self.parent is not None and not self.closed:
            self.parent.release(size)

    def close(self) -> None:
        """The connection is gone: give the parent back all it still holds. Messages still
        alive may release later; that touches this budget only."""
        if not self.closed and self.parent is not None:
            self.parent.release(self.used)
        self.closed = True


class InflatedMessage:
    """A message that was decompressed, with its bytes' reservation in an :class:`InflateBudget`.
    Queued in place of the payload; :meth:`release` once it has been parsed (or dropped)."""

    __slots__ = ("data", "reserved", "budget")

    def __init__(self, data: bytearray, budget: InflateBudget) -> None:
        self.data = data
        self.reserved = len(data)
        self.budget = budget

    def __len__(self) -> int:
        return len(self.data)

    def release(self) -> None:
        """Give the reservation back; only the first call counts."""
        reserved, self.reserved = self.reserved, 0
        if reserved:
            self.budget.release(reserved)


def release_all(messages: Iterable) -> None:
    """Give back the reservations of the inflated messages among ``messages`` (a call that
    ends, or drops what it queued)."""
    for message in messages:
        if type(message) is InflatedMessage:
            message.release()


class Inflation:
    """One compressed message being inflated, within the reservation :func:`begin_inflate` made.

    Stepwise, so that the server can inflate a small message at once and hand a large one to a
    worker thread: :meth:`step` and :meth:`run` touch only this object (zlib releases the GIL
    while it inflates); :meth:`result` and :meth:`cancel` settle the reservation and must run
    where the budget lives. The output grows in one bytearray: zlib asked for N bytes at once
    builds them in blocks and then copies those into its result, twice the memory at the peak.
    """

    __slots__ = ("encoding", "limit", "cap", "budget", "tight", "too_large", "inflater", "tail", "out", "error")

    def __init__(self, payload, encoding: str, limit: int, cap: int, budget: InflateBudget,
                 tight: InflateBudget, too_large: Callable[[int | str, int], str]) -> None:
        self.encoding = encoding
        self.limit = limit
        self.cap = cap                      # reserved in ``budget`` (and its parent)
        self.budget = budget
        self.tight = tight                  # the budget that set ``cap``, unless the message limit did
        self.too_large = too_large
        self.inflater = zlib.decompressobj(_WBITS[encoding])
        self.tail = payload                 # compressed input not yet inflated
        self.out = bytearray()
        self.error: zlib.error | None = None

    def step(self, size: int) -> bool:
        """Inflate up to ``size`` more bytes; True once done: the input is used up, it is not
        valid, or the output has gone past the reservation."""
        # never 0 (zlib's "no limit"): once the output passes ``cap`` the caller stops stepping
        room = min(size, self.cap + 1 - len(self.out))
        try:
            chunk = self.inflater.decompress(self.tail, room)
        except zlib.error as exc:
            self.error = exc
            return True
        self.out += chunk
        self.tail = self.inflater.unconsumed_tail
        # zlib stops short of the room it was given only once it has used up its input
        return len(chunk) < room or len(self.out) > self.cap

    def run(self) -> None:
        """Inflate to the end (in a worker thread, or wherever)."""
        while not self.step(INFLATE_STEP):
            pass

    def result(self) -> InflatedMessage:
        """The message, holding its size in the budget (the rest of the reservation goes back).
        Raises GRPCError, with all of the reservation given back: INVALID_ARGUMENT for data that
        is not one whole ``encoding`` stream, RESOURCE_EXHAUSTED for a message that went past the
        reservation, naming the limit that set it and the figures."""
        budget, cap = self.budget, self.cap
        error = self.error
        if error is None and len(self.out) <= cap:
            if not self.inflater.eof:
                error = "the compressed stream ends early"
            elif self.inflater.unused_data:     # inflating stops at the end: they would be dropped unseen
                error = (f"{len(self.inflater.unused_data)} bytes follow the end of the compressed stream (a second "
                         "gzip member, or stray bytes); send one gzip member or deflate stream")
        if error is not None:
            budget.release(cap)
            raise GRPCError(Status.INVALID_ARGUMENT, f"the request message is not valid {self.encoding} data: "
                                                     f"{error}")
        if len(self.out) > cap:
            budget.release(cap)
            if cap == self.limit:
                raise GRPCError(Status.RESOURCE_EXHAUSTED, "decompressed, " + self.too_large(f"more than {cap}", cap))
            raise GRPCError(Status.RESOURCE_EXHAUSTED, _inflates_past(self.tight, cap))
        budget.release(cap - len(self.out))
        return InflatedMessage(self.out, budget)

    def cancel(self) -> None:
        """The call ended before the message could be used: give the reservation back."""
        self.budget.release(self.cap)


INFLATE_STEP = 1 << 20
#: what :func:`cut_messages` inflates in the caller's thread before it defers a message
INFLATE_INLINE = 256 * 1024


def begin_inflate(payload, encoding: str, limit: int, budget: InflateBudget,
                  too_large: Callable[[int | str, int], str]) -> Inflation:
    """Reserve, before inflating, the most ``payload`` may inflate to: ``limit`` (the message
    size limit) or what ``budget`` and its parent have left, whichever is least. Raises
    GRPCError: INVALID_ARGUMENT when the call declared no encoding; RESOURCE_EXHAUSTED, naming
    the budget's key and figures, when a budget has nothing left (nothing is inflated then)."""
    if encoding == "identity":
        raise GRPCError(Status.INVALID_ARGUMENT, "a message is flagged compressed but the call declared no "
                                                 "grpc-encoding")
    tight = budget                          # the budget with the least left
    parent = budget.parent
    if parent is not None and parent.left() < budget.left():
        tight = parent
    cap = min(limit, tight.left())
    if cap <= 0:
        raise GRPCError(Status.RESOURCE_EXHAUSTED, _exhausted(tight))
    budget.reserve(cap)
    return Inflation(payload, encoding, limit, cap, budget, tight, too_large)


def inflate(payload, encoding: str, limit: int, budget: InflateBudget,
            too_large: Callable[[int | str, int], str]) -> InflatedMessage:
    """``payload`` decompressed, all at once: :func:`begin_inflate`, :meth:`Inflation.run`,
    :meth:`Inflation.result` (see those for what they raise)."""
    inflation = begin_inflate(payload, encoding, limit, budget, too_large)
    inflation.run()
    return inflation.result()


def _where(budget: InflateBudget) -> str:
    return "on this connection" if budget.parent is not None else "on all connections"


def _exhausted(budget: InflateBudget) -> str:
    return (f"no room to decompress this message: decompressed messages not yet handled {_where(budget)} hold "
            f"{budget.used} of the {budget.limit} bytes {budget.key} allows; retry once they are handled, or "
            "send it uncompressed")


def _inflates_past(budget: InflateBudget, cap: int) -> str:
    """Said once the message's reservation is released: ``budget.used`` is the others'."""
    return (f"decompressed, the message is more than the {cap} bytes left of {budget.key} ({budget.limit} "
            f"bytes, {budget.used} held by other decompressed messages {_where(budget)}); send it "
            "uncompressed or raise the limit")


# ---- cutting a request body into messages --------------------------------------------------------
def cut_messages(body: bytearray, messages, encoding: str, limit: int, budget: InflateBudget,
                 too_large: Callable[[int | str, int], str], inline: int | None = None) -> bytearray:
    """Move the complete length-prefixed messages at the start of ``body`` onto ``messages``
    (a deque) and return what is left of the body: ``body`` itself, cut in place, or a new
    bytearray when ``body`` was exactly one message (the usual case: that message is then a
    view into the old one, which is never touched again, so nothing is copied). Compressed
    messages are queued as :class:`InflatedMessage`. With ``inline``, a compressed message that
    inflates to more than ``inline`` bytes is queued unfinished, as its :class:`Inflation`, and
    cutting stops there: the caller finishes it (:meth:`Inflation.run`, which may run in a
    worker thread, then :meth:`Inflation.result`) before it cuts the rest.

    Raises GRPCError, having queued the messages before the bad one: RESOURCE_EXHAUSTED for a
    message over ``limit`` bytes (known from its 5-byte prefix, before its bytes arrive;
    ``too_large(size, limit)`` words it), INVALID_ARGUMENT for a compressed flag other than 0 or
    1, and what :func:`begin_inflate` and :meth:`Inflation.result` raise. The caller then
    drops the body."""
    while len(body) >= 5:
        compressed, size = MESSAGE_PREFIX.unpack_from(body, 0)
        if size > limit:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, too_large(size, limit))
        if len(body) < 5 + size:
            return body
        if len(body) == 5 + size:
            payload = memoryview(body)[5:]
            body = bytearray()
        else:
            payload = bytes(memoryview(body)[5:5 + size])
            del body[:5 + size]
        if compressed:
            if compressed != 1:
                raise GRPCError(Status.INVALID_ARGUMENT, f"a message's compressed flag is {compressed}; "
                                                         "it must be 0 or 1")
            inflation = begin_inflate(payload, encoding, limit, budget, too_large)
            if inline is None:
                inflation.run()
            elif not inflation.step(inline):
                messages.append(inflation)
                return body
            payload = inflation.result()
        messages.append(payload)
    return body


def message_end(body: bytes) -> int:
    """How many bytes ``body`` must reach before its first message is complete (5 while its
    prefix is incomplete)."""
    if len(body) < 5:
        return 5
    return 5 + MESSAGE_PREFIX.unpack_from(body, 0)[1]
