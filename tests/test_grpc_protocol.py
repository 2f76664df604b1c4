"""The gRPC layer above HTTP/2 (xlaserve.frontend.grpc_protocol), without sockets."""
from __future__ import annotations

import gzip
import struct
import zlib

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from xlaserve.frontend.grpc_protocol import (
    OK_TRAILERS, RESPONSE_HEADERS, Refusal, RequestHead, check_head, cut_messages, framed, message_end, parse_timeout, read_head,
    status_of, trailers,
)


def message(payload: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(payload)) + payload


def too_large(size, limit) -> str:
    return f"{size} > {limit}"


def head(**fields) -> RequestHead:
    base = {":method": "POST", ":path": "/s.S/M", ":scheme": "http", "content-type": "application/grpc"}
    base.update(fields)
    return read_head(tuple((k.encode(), v.encode()) for k, v in base.items()))


# --- the request head -----------------------------------------------------------------------------

def test_read_head_splits_pseudo_headers_content_type_and_metadata():
    h = read_head(((b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/s.S/M"), (b":authority", b"x"),
                   (b"content-type", b"application/grpc+proto"), (b"te", b"trailers"),
                   (b"x-tenant", b"acme"), (b"grpc-encoding", b"gzip")))
    assert (h.method, h.path, h.content_type) == ("POST", "/s.S/M", "application/grpc+proto")
    assert h.metadata == {"te": "trailers", "x-tenant": "acme", "grpc-encoding": "gzip"}
    assert h.timeout is None and head(**{"grpc-timeout": "5S"}).timeout == "5S"
    assert h.encoding == "gzip"
    assert head().encoding == "identity"


@pytest.mark.parametrize("value, seconds", [("1H", 3600.0), ("2M", 120.0), ("3S", 3.0), ("1500m", 1.5),
                                            ("250u", 0.00025), ("7n", 7e-9), ("99999999S", 99999999.0)])
def test_parse_timeout_units(value, seconds):
    assert parse_timeout(value) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "", "1", "S", "1.5S", "-1S", "1s"])
def test_parse_timeout_rejects_what_is_not_digits_and_a_unit(value):
    with pytest.raises(ValueError, match="1 to 8 digits followed by one of H M S m u n"):
        parse_timeout(value)


def test_check_head_accepts_a_grpc_post_and_returns_its_timeout():
    assert check_head(head(), True, ["s.S"]) is None
    assert check_head(head(**{"grpc-timeout": "1500m"}), True, ["s.S"]) == pytest.approx(1.5)


@pytest.mark.parametrize("fields, known, expected", [
    ({":method": "GET"}, True, Refusal(Status.INTERNAL, "gRPC calls are POST requests, not GET", 405)),
    ({"content-type": "text/plain"}, True,
     Refusal(Status.INTERNAL, "content-type 'text/plain' is not application/grpc", 415)),
    ({}, False, Refusal(Status.UNIMPLEMENTED, "unknown method '/s.S/M'; this server serves a.A, s.S")),
    ({"grpc-encoding": "br"}, True,
     Refusal(Status.UNIMPLEMENTED, "grpc-encoding 'br' is not supported; use identity, gzip or deflate")),
    ({"grpc-timeout": "soon"}, True, Refusal(
        Status.INVALID_ARGUMENT, "grpc-timeout 'soon' is not 1 to 8 digits followed by one of H M S m u n")),
], ids=["method", "content-type", "unknown-path", "encoding", "timeout"])
def test_check_head_refusals(fields, known, expected):
    assert check_head(head(**fields), known, ["a.A", "s.S"]) == expected


def test_refusal_fields():
    http = Refusal(Status.INTERNAL, "not POST", 405).fields()
    assert http == ((b":status", b"405"), (b"content-type", b"text/plain"), (b"grpc-status", b"13"),
                    (b"grpc-message", b"not POST"))
    grpc = Refusal(Status.UNIMPLEMENTED, "100% unknown").fields()
    assert grpc == RESPONSE_HEADERS + ((b"grpc-status", b"12"), (b"grpc-message", b"100%25 unknown"))


# --- replies ----------------------------------------------------------------------------------------

def test_trailers():
    assert trailers(Status.OK, None) is OK_TRAILERS
    assert trailers(Status.NOT_FOUND, "model 'm' ✓") == ((b"grpc-status", b"5"),
                                                         (b"grpc-message", b"model 'm' %E2%9C%93"))
    assert trailers(Status.CANCELLED, "") == ((b"grpc-status", b"1"),)


def test_framed():
    assert framed(b"abc") == b"\0\0\0\0\3abc"
    assert framed(b"") == b"\0\0\0\0\0"


class NotFound(Exception):
    status = Status.NOT_FOUND


def test_status_of():
    assert status_of(GRPCError(Status.ABORTED, "stop")) == (Status.ABORTED, "stop", True)
    assert status_of(NotFound("no model 'm'")) == (Status.NOT_FOUND, "no model 'm'", True)
    assert status_of(ValueError("bad")) == (Status.INTERNAL, "internal error: ValueError: bad", False)


# --- cutting a request body into messages -----------------------------------------------------------

def test_cut_exactly_one_message():
    messages, rest = cut_messages(message(b"hello"), "identity", 100, too_large)
    assert [bytes(m) for m in messages] == [b"hello"] and rest == b""


def test_cut_two_messages_and_the_start_of_a_third():
    body = message(b"a") + message(b"") + message(b"ccc")[:6]
    messages, rest = cut_messages(body, "identity", 100, too_large)
    assert [bytes(m) for m in messages] == [b"a", b""]
    assert rest == message(b"ccc")[:6]


def test_an_incomplete_message_is_left_as_it_came_with_the_length_it_needs():
    body = message(b"abcdef")[:7]
    messages, rest = cut_messages(body, "identity", 100, too_large)
    assert messages == [] and rest is body
    assert message_end(rest) == 11 and message_end(b"\0\0") == 5
    messages, rest = cut_messages(rest + message(b"abcdef")[7:], "identity", 100, too_large)
    assert [bytes(m) for m in messages] == [b"abcdef"] and not rest


def test_a_message_over_the_limit_is_refused_from_its_prefix():
    """Only the 5-byte prefix has arrived: the server need not buffer the message to refuse it."""
    with pytest.raises(GRPCError) as caught:
        cut_messages(struct.pack(">BI", 0, 101), "identity", 100, too_large)
    assert (caught.value.status, caught.value.message) == (Status.RESOURCE_EXHAUSTED, "101 > 100")


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_messages(encoding, compress):
    body = message(compress(b"x" * 50), compressed=True) + message(b"plain")
    messages, _ = cut_messages(body, encoding, 100, too_large)
    assert [bytes(m) for m in messages] == [b"x" * 50, b"plain"]


def test_a_message_inflating_past_the_limit_is_refused_without_inflating_it_all():
    bomb = gzip.compress(b"\0" * 10_000_000)            # about 10 kB on the wire
    with pytest.raises(GRPCError) as caught:
        cut_messages(message(bomb, compressed=True), "gzip", 20_000, too_large)
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert caught.value.message == "decompressed, more than 20000 > 20000"


@pytest.mark.parametrize("encoding, payload, expected", [
    ("identity", b"abc", "a message is flagged compressed but the call declared no grpc-encoding"),
    ("gzip", b"not gzip", "the request message is not valid gzip data: "),
    ("deflate", b"not deflate", "the request message is not valid deflate data: "),
])
def test_compressed_messages_the_call_cannot_inflate_are_invalid_argument(encoding, payload, expected):
    with pytest.raises(GRPCError) as caught:
        cut_messages(message(payload, compressed=True), encoding, 100, too_large)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert caught.value.message.startswith(expected)
