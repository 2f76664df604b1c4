"""HTTP/2 frames (RFC 9113 section 4-7): the constants, the frame header, building a frame, the
limits a peer's connection is held to (:class:`H2Limits`), the connection error that ends one
(:class:`ConnectionError_`, :func:`calm`), and what makes a request's header fields malformed."""
from __future__ import annotations

import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types and flags (RFC 9113 section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20

# error codes (section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
ENHANCE_YOUR_CALM = 0xB
ERROR_NAMES = {0x0: "NO_ERROR", 0x1: "PROTOCOL_ERROR", 0x2: "INTERNAL_ERROR", 0x3: "FLOW_CONTROL_ERROR",
               0x5: "STREAM_CLOSED", 0x6: "FRAME_SIZE_ERROR", 0x7: "REFUSED_STREAM", 0x8: "CANCEL",
               0x9: "COMPRESSION_ERROR", 0xB: "ENHANCE_YOUR_CALM"}

# settings identifiers
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE, \
    MAX_HEADER_LIST_SIZE = range(1, 7)

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_FRAME = 16384
MAX_FRAME_LIMIT = 2**24 - 1

FRAME_HEADER = struct.Struct(">IBI")     # length (24 bits) << 8 | type, flags, stream id
U32 = struct.Struct(">I")
SETTING = struct.Struct(">HI")


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame: its 9-byte header and ``payload``."""
    return FRAME_HEADER.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


def settings_frame(entries: Iterable[tuple[int, int]]) -> bytes:
    """A SETTINGS frame of ``(identifier, value)`` entries."""
    return frame(SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in entries))


@dataclass(frozen=True, slots=True)
class H2Limits:
    """What one peer's connection may do; the node file's ``endpoints:`` keys of the same names
    (docs/node-config.md and docs/security.md say why each default). A connection that crosses
    one gets GOAWAY (ENHANCE_YOUR_CALM unless the protocol names a code) naming the key, and is
    closed; the others go on."""

    max_concurrent_streams: int = 128       # advertised; a stream reset while its work is queued counts
    max_header_list_bytes: int = 65536      # advertised; one decoded header block (RFC 9113 size)
    max_header_fields: int = 100            # fields in one header block (Envoy's max_headers_count: 100)
    max_header_block_bytes: int = 65536     # one encoded block: HEADERS + CONTINUATION payloads
    max_continuation_frames: int = 8        # CONTINUATION frames in one header block (nghttp2: 8)
    max_settings_entries: int = 32          # entries in one SETTINGS frame
    max_queued_control_frames: int = 10000  # PING/SETTINGS acks and RST_STREAMs the client has not read
    glitch_burst: int = 1000                # resets, refused streams and other waste, in a burst...
    glitches_per_second: float = 33.0       # ...refilled at this rate
    handshake_timeout_seconds: float = 5.0  # connect to the client's first SETTINGS frame
    idle_timeout_seconds: float = 300.0     # no call open this long: GOAWAY NO_ERROR (0: never)
    keepalive_interval_seconds: float = 60.0  # nothing received this long: PING (0: never)
    keepalive_timeout_seconds: float = 20.0   # ...and no frame after it this long: closed
    max_queued_reply_bytes: int = 4 * 1024 * 1024   # queued output past which the client is not read
    write_timeout_seconds: float = 60.0     # a write that makes no progress this long: closed


class ConnectionError_(Exception):
    """A connection error (RFC 9113 5.4.1): answered with GOAWAY, then the connection closes."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


SERVER_LIMIT_NAMES = "endpoints.{}"


def calm(what: str, key: str, limit, names: str = SERVER_LIMIT_NAMES) -> ConnectionError_:
    """The connection error for a peer past one of :class:`H2Limits`: ENHANCE_YOUR_CALM, with
    a message naming where the limit is set (``names``, formatted with the field's name: the
    node-file key for a server's client)."""
    return ConnectionError_(ENHANCE_YOUR_CALM, f"{what}; the limit is {limit} ({names.format(key)})")


# What makes a request's header fields malformed (RFC 9113 8.2, 8.3), as libnghttp2 reads it: names
# of lowercase token characters; values of visible characters, spaces and tabs (RFC 9110 5.5), none
# at either end; no connection-specific fields, ``te`` only as "trailers"; the request pseudo-headers
# each at most once, before the others, well-formed (RFC 3986's scheme and authority characters, a
# path of visible characters starting with "/"), :method, :scheme, :path and :authority (or host) all
# present.
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9a-z]+\Z")
_VALUE_OCTETS = b"\t" + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100))   # what a value may hold...
_EDGE = ("\t", " ")                                                             # ...but not at either end
_PSEUDO_VALUE = {":method": re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z"),
                 ":scheme": re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*\Z"),
                 ":path": re.compile(r"/[\x21-\x7e\x80-\xff]*\Z"),
                 ":authority": re.compile(r"[A-Za-z0-9\-._~%!$&'()*+,;=:@\[\]]+\Z")}
_CONNECTION_SPECIFIC = frozenset(("connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade"))
_REQUEST_PSEUDO = frozenset((":method", ":scheme", ":path", ":authority"))
_REQUIRED_PSEUDO = _REQUEST_PSEUDO


def malformed(headers: Iterable[tuple[str, str]], trailers: bool = False) -> str | None:
    """Why these request header fields (or ``trailers``, which hold no pseudo-header) make the request
    malformed (a stream error of type PROTOCOL_ERROR, RFC 9113 8.1.1), or None if they do not."""
    pseudo: set[str] = set()
    regular = False
    for name, value in headers:
        if name[:1] == ":":
            if regular or trailers:
                return f"pseudo-header {name} after a regular header field"
            if name not in _REQUEST_PSEUDO or name in pseudo:
                return f"{name} is not a request pseudo-header, or appears twice"
            if not _PSEUDO_VALUE[name].match(value):
                return f"{name} {value[:40]!r} is not well-formed"
            pseudo.add(name)
        else:
            regular = True
            if not _FIELD_NAME.match(name):
                return f"header name {name[:40]!r} is not lowercase token characters"
            if name in _CONNECTION_SPECIFIC or (name == "te" and value != "trailers"):
                return f"connection-specific header field {name}"
            if name == "host":
                pseudo.add(":authority")
        # (bytes.translate deletes the allowed octets at C speed: a 48 KiB value in 20 us)
        if value.encode("latin-1").translate(None, _VALUE_OCTETS) or value[:1] in _EDGE or value[-1:] in _EDGE:
            return f"the value of {name} holds a control character, or whitespace at an end"
    if not trailers and not _REQUIRED_PSEUDO <= pseudo:
        return "a request needs :method, :scheme, :path and :authority (or host)"
    return None
