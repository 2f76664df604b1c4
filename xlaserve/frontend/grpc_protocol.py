"""gRPC over HTTP/2, the part above HTTP/2: no sockets, no HTTP/2 frames.

What a request's header fields say (path, ``grpc-timeout``, ``grpc-encoding``, metadata), whether
the server can take it at all (405, 415, UNIMPLEMENTED, a malformed timeout), cutting a request
body into its length-prefixed messages (with the size limit and gzip/deflate), the reply's
message framing and header fields, and the mapping from an exception to a gRPC status. The HTTP/2
engine (libnghttp2, through ``ngh2``) and the Trio driver live in
:mod:`xlaserve.frontend.grpc_server`.
"""
from __future__ import annotations

import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.metadata import decode_timeout, encode_grpc_message

from xlaserve.errors import internal_message

Fields = tuple[tuple[bytes, bytes], ...]

MESSAGE_PREFIX = struct.Struct(">BI")     # gRPC length-prefixed message: compressed flag, length
ENCODINGS = ("identity", "gzip", "deflate")

RESPONSE_HEADERS: Fields = ((b":status", b"200"), (b"content-type", b"application/grpc"))
OK_TRAILERS: Fields = ((b"grpc-status", b"0"),)


def parse_timeout(value: str) -> float:
    """Seconds in a ``grpc-timeout`` header value (``<up to 8 digits><unit>``)."""
    try:
        return decode_timeout(value)
    except ValueError:
        raise ValueError(f"grpc-timeout {value!r} is not 1 to 8 digits followed by one of H M S m u n") from None


@dataclass(slots=True)
class RequestHead:
    """What a request's header block says, for gRPC. ``fields`` are kept as they came; the
    metadata is decoded from them only if asked for (ModelInfer never asks)."""

    fields: tuple = ()
    method: str = ""                   # the HTTP method
    path: str = ""
    content_type: str = ""
    encoding: str = "identity"         # grpc-encoding
    timeout: str | None = None         # grpc-timeout, as sent

    @property
    def metadata(self) -> dict[str, str]:
        """Every field but pseudo-headers and content-type, as text."""
        return metadata_of(self.fields)


def metadata_of(fields: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in fields
            if name[0] != 58 and name != b"content-type"}          # 58: b":"


def read_head(fields: tuple[tuple[bytes, bytes], ...]) -> RequestHead:
    """The request head from decoded header fields (HTTP/2 has validated them). A field sent
    more than once counts with its last value."""
    get = dict(fields).get
    timeout = get(b"grpc-timeout")
    return RequestHead(fields, get(b":method", b"").decode("latin-1"), get(b":path", b"").decode("latin-1"),
                       get(b"content-type", b"").decode("latin-1"),
                       get(b"grpc-encoding", b"identity").decode("latin-1"),
                       None if timeout is None else timeout.decode("latin-1"))


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is answered before any handler sees it: an HTTP status other than 200
    (``http_status``), or a gRPC status."""

    status: Status
    message: str
    http_status: int = 200

    def fields(self) -> Fields:
        """The header fields of the trailers-only response that answers the request."""
        if self.http_status != 200:
            return ((b":status", str(self.http_status).encode()), (b"content-type", b"text/plain"),
                    (b"grpc-status", str(self.status.value).encode()),
                    (b"grpc-message", encode_grpc_message(self.message).encode()))
        return RESPONSE_HEADERS + trailers(self.status, self.message)


def check_head(head: RequestHead, known: bool, service_names: Iterable[str]) -> Refusal | float | None:
    """A :class:`Refusal` if the request cannot be served; else its ``grpc-timeout`` in
    seconds, or None without one. ``known``: whether a handler serves ``head.path``."""
    if head.method != "POST":
        return Refusal(Status.INTERNAL, f"gRPC calls are POST requests, not {head.method or 'missing'}", 405)
    if not head.content_type.startswith("application/grpc"):
        return Refusal(Status.INTERNAL, f"content-type {head.content_type!r} is not application/grpc", 415)
    if not known:
        return Refusal(Status.UNIMPLEMENTED, f"unknown method {head.path!r}; this server serves "
                                             f"{', '.join(service_names)}")
    if head.encoding not in ENCODINGS:
        return Refusal(Status.UNIMPLEMENTED, f"grpc-encoding {head.encoding!r} is not supported; use "
                                             "identity, gzip or deflate")
    if head.timeout is None:
        return None
    try:
        return parse_timeout(head.timeout)
    except ValueError as exc:
        return Refusal(Status.INVALID_ARGUMENT, str(exc))


def trailers(status: Status, message: str | None) -> Fields:
    """The trailer fields that end a call with ``status`` (``grpc-message`` percent-encoded)."""
    if status is Status.OK and not message:
        return OK_TRAILERS
    fields = ((b"grpc-status", str(status.value).encode()),)
    if message:
        fields += ((b"grpc-message", encode_grpc_message(message).encode()),)
    return fields


def framed(data: bytes) -> bytes:
    """One reply message, length-prefixed and uncompressed."""
    return MESSAGE_PREFIX.pack(0, len(data)) + data


def status_of(exc: BaseException) -> tuple[Status, str, bool]:
    """The status and message that end a call failed by ``exc``, and whether it was expected:
    a :class:`GRPCError`, or any exception with a ``Status`` in ``status`` (xlaserve's errors).
    Anything else is INTERNAL and a bug worth logging."""
    if isinstance(exc, GRPCError):
        return exc.status, exc.message or "", True
    status = getattr(exc, "status", None)
    if isinstance(status, Status):
        return status, str(exc), True
    return Status.INTERNAL, internal_message(exc), False


def cut_messages(body: bytes, encoding: str, limit: int,
                 too_large: Callable[[int | str, int], str]) -> tuple[list, bytes]:
    """The complete length-prefixed messages at the start of ``body`` (decompressed), and what
    is left of it. Raises GRPCError: RESOURCE_EXHAUSTED for a message over ``limit`` bytes
    (known from its prefix, before its bytes arrive, and again once decompressed),
    INVALID_ARGUMENT for a compressed message the call cannot decompress."""
    messages = []
    pos, end = 0, len(body)
    while end - pos >= 5:
        compressed, size = MESSAGE_PREFIX.unpack_from(body, pos)
        if size > limit:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, too_large(size, limit))
        stop = pos + 5 + size
        if stop > end:
            break
        payload = memoryview(body)[pos + 5:stop]
        if compressed:
            payload = decompress(payload, encoding, limit)
            if len(payload) > limit:
                raise GRPCError(Status.RESOURCE_EXHAUSTED, "decompressed, " + too_large(f"more than {limit}", limit))
        messages.append(payload)
        pos = stop
    if pos == end:
        return messages, b""
    return messages, body if pos == 0 else body[pos:]


def message_end(body: bytes) -> int:
    """How many bytes ``body`` must reach before its first message is complete (5 while its
    prefix is incomplete)."""
    if len(body) < 5:
        return 5
    return 5 + MESSAGE_PREFIX.unpack_from(body, 0)[1]


def decompress(payload, encoding: str, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``payload`` inflated: the caller refuses anything longer,
    so a small compressed message cannot make the server allocate more than that."""
    if encoding == "identity":
        raise GRPCError(Status.INVALID_ARGUMENT, "a message is flagged compressed but the call declared no "
                                                 "grpc-encoding")
    try:
        return zlib.decompressobj(31 if encoding == "gzip" else 15).decompress(payload, limit + 1)
    except zlib.error as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, f"the request message is not valid {encoding} data: {exc}") from None
