"""The gRPC layer above HTTP/2 (xlaserve.frontend.grpc_protocol), without sockets."""
from __future__ import annotations

import gzip
import struct
import zlib
from urllib.parse import unquote
from collections import deque

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from xlaserve.frontend.grpc_protocol import (
    CONNECTION_INFLATE_KEY, MAX_GRPC_MESSAGE_BYTES, OK_TRAILERS, RESPONSE_HEADERS, SERVER_INFLATE_KEY, InflateBudget, InflatedMessage,
    Inflation, Refusal, begin_inflate, cut_messages, framed, inflate, message_end, parse_timeout, read_head,
    release_all, trailers,
)
from xlaserve.http2.hpack import Decoder

METHODS = {"/s.S/M": object()}
SERVICES = ["a.A", "s.S"]
BIG = 1 << 30


def message(payload: bytes, flag: int = 0) -> bytes:
    return struct.pack(">BI", flag, len(payload)) + payload


def too_large(size, limit) -> str:
    return f"{size} > {limit}"


def head(**fields):
    base = {":method": "POST", ":scheme": "http", ":path": "/s.S/M", "content-type": "application/grpc"}
    base.update(fields)
    return read_head(tuple(base.items()), METHODS, SERVICES)


def budgets(connection: int = BIG, server: int = BIG) -> tuple[InflateBudget, InflateBudget]:
    parent = InflateBudget(server, SERVER_INFLATE_KEY)
    return InflateBudget(connection, CONNECTION_INFLATE_KEY, parent), parent


def cut(body: bytes | bytearray, encoding: str = "identity", limit: int = 100,
        budget: InflateBudget | None = None) -> tuple[list, bytearray]:
    messages: deque = deque()
    rest = cut_messages(bytearray(body), messages, encoding, limit, budget or budgets()[0], too_large)
    return list(messages), rest


def data(m) -> bytes:
    return bytes(m.data if isinstance(m, InflatedMessage) else m)


def decoded(block: bytes) -> tuple:
    return Decoder().decode(block)


# --- the request head -----------------------------------------------------------------------------

def test_read_head_splits_pseudo_headers_content_type_and_metadata():
    h = read_head(((":method", "POST"), (":scheme", "http"), (":path", "/s.S/M"), (":authority", "x"),
                   ("content-type", "application/grpc+proto"), ("te", "trailers"), ("x-tenant", "acme"),
                   ("grpc-encoding", "gzip"), ("x-tenant", "later")), METHODS, SERVICES)
    assert (h.method, h.path, h.content_type, h.encoding) == ("POST", "/s.S/M", "application/grpc+proto", "gzip")
    assert dict(h.metadata) == {"te": "trailers", "x-tenant": "later", "grpc-encoding": "gzip"}
    assert h.verdict is None
    assert head().encoding == "identity"


def test_the_metadata_of_a_head_is_read_only():
    """One head serves every call that repeats its header block: no call may change it."""
    with pytest.raises(TypeError):
        head(**{"x-a": "1"}).metadata["x-a"] = "2"


def test_a_field_with_an_empty_name_makes_no_head():
    assert read_head(((":method", "POST"), ("", "v"), (":path", "/s.S/M")), METHODS, SERVICES) is None


@pytest.mark.parametrize("value, seconds", [("1H", 3600.0), ("2M", 120.0), ("3S", 3.0), ("1500m", 1.5),
                                            ("250u", 0.00025), ("7n", 7e-9), ("99999999S", 99999999.0),
                                            ("0S", 0.0), ("00000001m", 0.001)])
def test_parse_timeout_units(value, seconds):
    assert parse_timeout(value) == pytest.approx(seconds)
    assert head(**{"grpc-timeout": value}).verdict == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "", "1", "S", "1.5S", "-1S", "+1S", "1s", "123456789S", "\u0661S",
                                   " 1S"])
def test_parse_timeout_rejects_what_is_not_digits_and_a_unit(value):
    with pytest.raises(ValueError, match="1 to 8 digits followed by one of H M S m u n"):
        parse_timeout(value)


@pytest.mark.parametrize("fields, expected", [
    ({":method": "GET"}, Refusal(Status.INTERNAL, "gRPC calls are POST requests, not GET", 405)),
    ({":method": ""}, Refusal(Status.INTERNAL, "gRPC calls are POST requests, not missing", 405)),
    ({"content-type": "text/plain"}, Refusal(Status.INTERNAL, "content-type 'text/plain' is not application/grpc",
                                             415)),
    ({":path": "/s.S/Nope"}, Refusal(Status.UNIMPLEMENTED, "unknown method '/s.S/Nope'; this server serves a.A, s.S")),
    ({"grpc-encoding": "br"}, Refusal(Status.UNIMPLEMENTED,
                                      "grpc-encoding 'br' is not supported; use identity, gzip or deflate")),
    ({"grpc-timeout": "soon"}, Refusal(
        Status.INVALID_ARGUMENT, "grpc-timeout 'soon' is not 1 to 8 digits followed by one of H M S m u n")),
    # the first reason found is the one given
    ({":method": "PUT", "content-type": "text/html", ":path": "/x"},
     Refusal(Status.INTERNAL, "gRPC calls are POST requests, not PUT", 405)),
    ({":path": "/x", "grpc-encoding": "br"}, Refusal(Status.UNIMPLEMENTED,
                                                     "unknown method '/x'; this server serves a.A, s.S")),
], ids=["method", "no-method", "content-type", "unknown-path", "encoding", "timeout", "method-first", "path-first"])
def test_refusals(fields, expected):
    assert head(**fields).verdict == expected


@pytest.mark.parametrize("content_type", ["application/grpc", "application/grpc+proto", "application/grpc+json"])
def test_grpc_content_types_are_accepted(content_type):
    assert head(**{"content-type": content_type}).verdict is None


def test_an_http_refusal_is_a_trailers_only_response_with_its_status():
    assert decoded(Refusal(Status.INTERNAL, "not POST", 405).block()) == (
        (":status", "405"), ("content-type", "text/plain"), ("grpc-status", "13"), ("grpc-message", "not POST"))


def test_a_grpc_refusal_is_a_trailers_only_response_with_200():
    assert decoded(Refusal(Status.UNIMPLEMENTED, "100% unknown").block()) == (
        (":status", "200"), ("content-type", "application/grpc"), ("grpc-status", "12"),
        ("grpc-message", "100%25 unknown"))


# --- replies ----------------------------------------------------------------------------------------

def test_precomputed_blocks():
    assert decoded(RESPONSE_HEADERS) == ((":status", "200"), ("content-type", "application/grpc"))
    assert decoded(OK_TRAILERS) == (("grpc-status", "0"),)


def test_trailers():
    assert trailers(Status.OK, None) is OK_TRAILERS
    assert trailers(Status.OK, "") is OK_TRAILERS
    assert decoded(trailers(Status.NOT_FOUND, "model 'm' ✓\n")) == (
        ("grpc-status", "5"), ("grpc-message", "model 'm' %E2%9C%93%0A"))
    assert decoded(trailers(Status.CANCELLED, "")) == (("grpc-status", "1"),)
    assert decoded(trailers(Status.OK, "fine")) == (("grpc-status", "0"), ("grpc-message", "fine"))


@pytest.mark.parametrize("char", ["x", "✓"])
def test_a_long_message_is_cut_to_what_clients_accept_and_says_so(char):
    """A message echoing a client's 100 000-character model name: gRPC's C core refuses trailers
    past 8 KiB (RESOURCE_EXHAUSTED instead of NOT_FOUND) and grpclib's client drops the connection."""
    name = char * 100_000
    (_, (_, value)) = decoded(trailers(Status.NOT_FOUND, f"model '{name}' is not found"))
    assert MAX_GRPC_MESSAGE_BYTES - 100 < len(value) <= MAX_GRPC_MESSAGE_BYTES
    text = unquote(value)
    assert text.startswith("model '" + char * 10) and text.endswith(
        f"more characters cut: the message passed {MAX_GRPC_MESSAGE_BYTES} bytes)")
    kept = text.index("...")
    assert int(text[kept + 5:].split()[0]) == len(f"model '{name}' is not found") - kept
    # a refusal's block (its message may echo the request's path) is cut the same way
    assert len(Refusal(Status.UNIMPLEMENTED, name, 415).block()) < 2 * MAX_GRPC_MESSAGE_BYTES


def test_a_message_utf8_cannot_encode_goes_out_escaped():
    """A lone surrogate (user code's exception text): encoding the trailers raised on the Trio
    thread and the call was left without them, its client waiting for good."""
    (_, (_, value)) = decoded(trailers(Status.INTERNAL, "hook raised ValueError: bad \udc80 text ✓"))
    assert unquote(value) == "hook raised ValueError: bad \\udc80 text ✓"
    (_, (_, value)) = decoded(trailers(Status.INTERNAL, "\udc80" * 100_000))
    assert unquote(value).startswith("\\udc80" * 10) and len(value) <= MAX_GRPC_MESSAGE_BYTES


def test_framed():
    assert framed(b"abc") == b"\0\0\0\0\3abc"
    assert framed(b"") == b"\0\0\0\0\0"


# --- cutting a request body into messages -----------------------------------------------------------

def test_a_body_of_exactly_one_message_is_queued_without_a_copy():
    body = bytearray(message(b"hello"))
    messages: deque = deque()
    rest = cut_messages(body, messages, "identity", 100, budgets()[0], too_large)
    assert rest == b"" and rest is not body
    assert isinstance(messages[0], memoryview) and messages[0].obj is body and bytes(messages[0]) == b"hello"


def test_cut_two_messages_and_the_start_of_a_third():
    messages, rest = cut(message(b"a") + message(b"") + message(b"ccc")[:6])
    assert [data(m) for m in messages] == [b"a", b""]
    assert rest == message(b"ccc")[:6]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 11])
def test_messages_cut_across_chunk_boundaries(chunk):
    """However the body arrives, the messages come out whole and in order."""
    payloads = [b"first", b"", b"x" * 40, gzip.compress(b"z" * 60)]
    stream = b"".join(message(p, flag=int(i == 3)) for i, p in enumerate(payloads))
    budget, _ = budgets()
    messages: deque = deque()
    body = bytearray()
    for i in range(0, len(stream), chunk):
        body += stream[i:i + chunk]
        body = cut_messages(body, messages, "gzip", 100, budget, too_large)
        if body:
            assert message_end(body) > len(body)       # never a complete message left behind
    assert [data(m) for m in messages] == payloads[:3] + [b"z" * 60]
    assert body == b""


def test_an_incomplete_message_is_left_as_it_came_with_the_length_it_needs():
    messages, rest = cut(message(b"abcdef")[:7])
    assert messages == [] and rest == message(b"abcdef")[:7]
    assert message_end(rest) == 11 and message_end(b"\0\0") == 5


def test_a_message_over_the_limit_is_refused_from_its_prefix():
    """Only the 5-byte prefix has arrived: the server need not buffer the message to refuse it."""
    with pytest.raises(GRPCError) as caught:
        cut(struct.pack(">BI", 0, 101))
    assert (caught.value.status, caught.value.message) == (Status.RESOURCE_EXHAUSTED, "101 > 100")


def test_messages_before_a_bad_one_are_queued():
    messages: deque = deque()
    with pytest.raises(GRPCError):
        cut_messages(bytearray(message(b"ok") + struct.pack(">BI", 0, 101)), messages, "identity", 100,
                     budgets()[0], too_large)
    assert [bytes(m) for m in messages] == [b"ok"]


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_compressed_messages(encoding, compress):
    messages, _ = cut(message(compress(b"x" * 50), flag=1) + message(b"plain"), encoding)
    assert [data(m) for m in messages] == [b"x" * 50, b"plain"]
    assert isinstance(messages[0], InflatedMessage) and not isinstance(messages[1], InflatedMessage)


def test_a_message_inflating_past_the_message_limit_is_refused_without_inflating_it_all():
    bomb = gzip.compress(b"\0" * 10_000_000)            # about 10 kB on the wire
    budget, server = budgets()
    with pytest.raises(GRPCError) as caught:
        cut(message(bomb, flag=1), "gzip", 20_000, budget)
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert caught.value.message == "decompressed, more than 20000 > 20000"
    assert budget.used == server.used == 0


@pytest.mark.parametrize("encoding, payload, flag, expected", [
    ("identity", gzip.compress(b"abc"), 1, "a message is flagged compressed but the call declared no grpc-encoding"),
    ("gzip", b"not gzip", 1, "the request message is not valid gzip data: "),
    ("deflate", b"not deflate", 1, "the request message is not valid deflate data: "),
    ("gzip", gzip.compress(b"abc"), 2, "a message's compressed flag is 2; it must be 0 or 1"),
    ("identity", b"abc", 0x80, "a message's compressed flag is 128; it must be 0 or 1"),
])
def test_compressed_messages_the_call_cannot_inflate_are_invalid_argument(encoding, payload, flag, expected):
    budget, server = budgets()
    with pytest.raises(GRPCError) as caught:
        cut(message(payload, flag=flag), encoding, budget=budget)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert caught.value.message.startswith(expected)
    assert budget.used == server.used == 0


# --- the inflate budget -----------------------------------------------------------------------------

def test_an_inflated_message_holds_its_size_in_both_budgets_until_released():
    budget, server = budgets(1000, 5000)
    first = inflate(gzip.compress(b"a" * 300), "gzip", 1000, budget, too_large)
    second = inflate(zlib.compress(b"b" * 200), "deflate", 1000, budget, too_large)
    assert (first.data, first.reserved, second.reserved) == (b"a" * 300, 300, 200)
    assert budget.used == server.used == 500
    first.release()
    first.release()                                     # only the first release counts
    assert budget.used == server.used == 200
    release_all([b"plain", second, memoryview(b"x")])
    assert budget.used == server.used == 0


def test_a_message_is_inflated_only_up_to_what_the_connection_has_left():
    budget, server = budgets(1000, 5000)
    held = inflate(gzip.compress(b"a" * 700), "gzip", 10_000, budget, too_large)
    with pytest.raises(GRPCError) as caught:
        inflate(gzip.compress(b"\0" * 10_000_000), "gzip", 10_000, budget, too_large)
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert caught.value.message == (
        "decompressed, the message is more than the 300 bytes left of endpoints.max_connection_inflate_bytes "
        "(1000 bytes, 700 held by other decompressed messages on this connection); send it uncompressed or "
        "raise the limit")
    assert budget.used == server.used == 700            # the failed message's reservation is back
    assert inflate(gzip.compress(b"c" * 300), "gzip", 10_000, budget, too_large).data == b"c" * 300
    held.release()


def test_a_message_is_inflated_only_up_to_what_the_server_has_left():
    server = InflateBudget(1000, SERVER_INFLATE_KEY)
    other = InflateBudget(BIG, CONNECTION_INFLATE_KEY, server)      # another connection
    budget = InflateBudget(BIG, CONNECTION_INFLATE_KEY, server)
    inflate(gzip.compress(b"a" * 900), "gzip", 10_000, other, too_large)
    with pytest.raises(GRPCError) as caught:
        inflate(gzip.compress(b"b" * 101), "gzip", 10_000, budget, too_large)
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert caught.value.message == (
        "decompressed, the message is more than the 100 bytes left of endpoints.max_inflate_bytes "
        "(1000 bytes, 900 held by other decompressed messages on all connections); send it uncompressed "
        "or raise the limit")
    assert (budget.used, other.used, server.used) == (0, 900, 900)
    assert inflate(gzip.compress(b"b" * 100), "gzip", 10_000, budget, too_large).data == b"b" * 100


@pytest.mark.parametrize("connection, server, key, where", [
    (500, BIG, "endpoints.max_connection_inflate_bytes", "on this connection"),
    (BIG, 500, "endpoints.max_inflate_bytes", "on all connections"),
])
def test_with_nothing_left_a_message_is_refused_without_inflating(connection, server, key, where):
    """The payload is no valid gzip: inflating it would have answered INVALID_ARGUMENT."""
    budget, parent = budgets(connection, server)
    inflate(gzip.compress(b"a" * 500), "gzip", 10_000, budget, too_large)
    with pytest.raises(GRPCError) as caught:
        inflate(b"not gzip at all", "gzip", 10_000, budget, too_large)
    assert caught.value.status is Status.RESOURCE_EXHAUSTED
    assert caught.value.message == (
        f"no room to decompress this message: decompressed messages not yet handled {where} hold 500 of the "
        f"500 bytes {key} allows; retry once they are handled, or send it uncompressed")
    assert budget.used == parent.used == 500


def test_a_message_limit_below_the_budgets_is_named_as_the_message_limit():
    budget, _ = budgets(1000, 1000)
    with pytest.raises(GRPCError) as caught:
        inflate(gzip.compress(b"a" * 600), "gzip", 500, budget, too_large)
    assert caught.value.message == "decompressed, more than 500 > 500"


def test_a_message_that_fills_the_budget_exactly_fits():
    budget, server = budgets(1000, 1000)
    assert len(inflate(gzip.compress(b"a" * 1000), "gzip", 10_000, budget, too_large)) == 1000
    assert budget.left() == server.left() == 0


def test_closing_a_connections_budget_gives_the_server_back_what_it_held():
    server = InflateBudget(10_000, SERVER_INFLATE_KEY)
    budget = InflateBudget(10_000, CONNECTION_INFLATE_KEY, server)
    kept = InflateBudget(10_000, CONNECTION_INFLATE_KEY, server)
    message_a = inflate(gzip.compress(b"a" * 400), "gzip", 10_000, budget, too_large)
    inflate(gzip.compress(b"b" * 100), "gzip", 10_000, kept, too_large)
    assert server.used == 500
    budget.close()
    assert server.used == 100
    message_a.release()               # a message outliving its connection: the server is not charged twice
    budget.close()
    assert (budget.used, server.used) == (0, 100)


def test_the_budget_is_reserved_before_inflating():
    """While zlib runs, the message already holds the most it may inflate to in both budgets."""
    seen = []

    class Watching(InflateBudget):
        __slots__ = ()

        def reserve(self, size: int) -> None:
            super().reserve(size)
            seen.append((self.used, self.parent.used))

    server = InflateBudget(5000, SERVER_INFLATE_KEY)
    budget = Watching(3000, CONNECTION_INFLATE_KEY, server)
    assert inflate(gzip.compress(b"a" * 10), "gzip", 4000, budget, too_large).data == b"a" * 10
    assert seen == [(3000, 3000)]
    assert budget.used == server.used == 10


def test_cut_messages_queues_inflated_messages_that_hold_the_budget():
    budget, server = budgets(1000, 1000)
    messages, _ = cut(message(gzip.compress(b"a" * 600), flag=1) + message(b"raw"), "gzip", 1000, budget)
    assert budget.used == server.used == 600
    with pytest.raises(GRPCError) as caught:                # the first is not parsed yet
        cut(message(gzip.compress(b"b" * 600), flag=1), "gzip", 1000, budget)
    assert "the 400 bytes left of endpoints.max_connection_inflate_bytes" in caught.value.message
    release_all(messages)
    assert budget.used == server.used == 0
    assert [data(m) for m in cut(message(gzip.compress(b"b" * 600), flag=1), "gzip", 1000, budget)[0]] == [b"b" * 600]


def test_a_bomb_costs_at_most_about_its_reservation_in_memory():
    """zlib asked for N bytes at once peaks at twice N (its blocks, then the joined result); the
    inflate grows one buffer instead. The bomb is refused having used little more than the cap."""
    import tracemalloc
    bomb = gzip.compress(bytes(64 << 20))
    budget, _ = budgets(8 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(GRPCError, match="8388608 bytes left of endpoints.max_connection_inflate_bytes"):
            inflate(bomb, "gzip", 256 << 20, budget, too_large)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.3 * (8 << 20), peak
    assert budget.used == 0


def test_a_message_larger_than_one_inflate_step_comes_out_whole():
    payload = bytes(range(256)) * (3 << 12) + b"end"          # 3 MiB and a bit
    assert inflate(zlib.compress(payload), "deflate", 4 << 20, budgets()[0], too_large).data == payload


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_a_compressed_stream_cut_short_is_invalid_argument(encoding, compress):
    budget, server = budgets()
    with pytest.raises(GRPCError) as caught:
        inflate(compress(bytes(range(256)) * 40)[:-6], encoding, 100_000, budget, too_large)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert caught.value.message == (f"the request message is not valid {encoding} data: "
                                    "the compressed stream ends early")
    assert budget.used == server.used == 0


@pytest.mark.parametrize("encoding, compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_bytes_after_the_compressed_stream_are_invalid_argument(encoding, compress):
    """Inflating stops at the stream's end: a second gzip member or stray bytes were dropped unseen
    and the message parsed from the first part alone."""
    budget, server = budgets()
    second = compress(b"b" * 300)
    with pytest.raises(GRPCError) as caught:
        inflate(compress(b"a" * 300) + second, encoding, 100_000, budget, too_large)
    assert caught.value.status is Status.INVALID_ARGUMENT
    assert caught.value.message == (f"the request message is not valid {encoding} data: {len(second)} bytes follow "
                                    "the end of the compressed stream (a second gzip member, or stray bytes); send "
                                    "one gzip member or deflate stream")
    assert budget.used == server.used == 0


def test_with_inline_a_large_compressed_message_is_queued_unfinished_and_cutting_stops_there():
    big = bytes(range(256)) * 4096                              # 1 MiB
    body = message(gzip.compress(b"small"), flag=1) + message(gzip.compress(big), flag=1) + message(b"after")
    budget, server = budgets(4 << 20)
    messages: deque = deque()
    rest = cut_messages(bytearray(body), messages, "gzip", 8 << 20, budget, too_large, inline=64 * 1024)
    assert data(messages[0]) == b"small"
    inflation = messages[1]
    assert isinstance(inflation, Inflation) and len(messages) == 2
    assert rest == message(b"after")                            # not cut: it waits behind the inflation
    assert budget.used == server.used == 5 + (4 << 20) - 5      # the small one's 5, the whole rest reserved
    inflation.run()
    assert data(inflation.result()) == big
    assert budget.used == 5 + len(big)


def test_a_small_compressed_message_is_finished_inline():
    messages: deque = deque()
    cut_messages(bytearray(message(gzip.compress(b"x" * 1000), flag=1)), messages, "gzip", 8 << 20, budgets()[0],
                 too_large, inline=64 * 1024)
    assert [type(m) for m in messages] == [InflatedMessage] and data(messages[0]) == b"x" * 1000


def test_an_inflation_cancelled_gives_its_reservation_back():
    budget, server = budgets(4 << 20)
    inflation = begin_inflate(gzip.compress(bytes(8 << 20)), "gzip", 1 << 30, budget, too_large)
    assert budget.used == server.used == 4 << 20
    assert inflation.step(1 << 20) is False
    inflation.cancel()
    assert budget.used == server.used == 0


def test_inflating_stepwise_stops_past_the_reservation():
    budget, _ = budgets(3 << 20)
    inflation = begin_inflate(gzip.compress(bytes(64 << 20)), "gzip", 1 << 30, budget, too_large)
    steps = 1
    while not inflation.step(1 << 20):
        steps += 1
    assert steps == 4 and len(inflation.out) == (3 << 20) + 1  # three full steps, then one byte past
    with pytest.raises(GRPCError, match="more than the 3145728 bytes left"):
        inflation.result()
    assert budget.used == 0
