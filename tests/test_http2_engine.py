"""The sans-IO HTTP/2 engine (xlaserve.http2.connection), both modes, with no socket and no sleep:
bytes built with the frame helpers go in, the bytes it queues to send and the handler calls it
makes come out; time is a fake clock."""
from __future__ import annotations

import struct

import hpack
import pytest

from xlaserve.http2.connection import (
    CLOSED, HALF_CLOSED_LOCAL, KEEPALIVE_PING, OPEN, H2Connection, Handler, Stream,
)
from xlaserve.http2.frames import (
    ACK, CANCEL, CONTINUATION, DATA, ENABLE_PUSH, END_HEADERS, END_STREAM, ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR,
    FRAME_SIZE_ERROR, GOAWAY, HEADERS, INITIAL_WINDOW_SIZE, MAX_CONCURRENT_STREAMS, MAX_FRAME_SIZE,
    MAX_HEADER_LIST_SIZE, MAX_WINDOW, NO_ERROR, PADDED, PING, PREFACE, PROTOCOL_ERROR, PUSH_PROMISE, REFUSED_STREAM,
    RST_STREAM, SETTINGS, STREAM_CLOSED, WINDOW_UPDATE, COMPRESSION_ERROR, ConnectionError_, H2Limits, frame,
    settings_frame,
)
from xlaserve.http2.hpack import encode

REQUEST = encode([(":method", "POST"), (":scheme", "http"), (":path", "/a.B/C"), (":authority", "x"),
                  ("content-type", "application/grpc"), ("te", "trailers")])
RESPONSE = encode([(":status", "200"), ("content-type", "application/grpc")])
TRAILERS = encode([("grpc-status", "0")])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder(Handler):
    """Records every call; in server mode accepts each request as a plain Stream."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.h2: H2Connection | None = None
        self.refuse_all = False

    def stream_opened(self, sid, headers, end_stream):
        self.calls.append(("opened", sid, dict(headers), end_stream))
        if self.refuse_all:
            self.h2.refuse(sid)
        else:
            self.h2.accept(Stream(sid), end_stream)

    def headers_received(self, stream, headers, end_stream):
        self.calls.append(("headers", stream.id, dict(headers), end_stream))

    def data_received(self, stream, data, end_stream):
        self.calls.append(("data", stream.id, bytes(data), end_stream))

    def stream_reset(self, stream, code, remote):
        self.calls.append(("reset", stream.id, code, remote))

    def stream_closed(self, stream):
        self.calls.append(("closed", stream.id))

    def stream_drained(self, stream):
        self.calls.append(("drained", stream.id))

    def settings_received(self):
        self.calls.append(("settings",))

    def settings_acked(self):
        self.calls.append(("settings_acked",))

    def goaway_received(self, last, code, debug):
        self.calls.append(("goaway", last, code, debug))

    def ping_acked(self, payload):
        self.calls.append(("ping_acked", payload))

    def quiet(self):
        self.calls.append(("quiet",))

    def named(self, kind: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == kind]


def frames_of(data: bytes) -> list[tuple[int, int, int, bytes]]:
    out, pos = [], 0
    while pos < len(data):
        lt, flags, sid = struct.unpack_from(">IBI", data, pos)
        length = lt >> 8
        out.append((lt & 0xFF, flags, sid & 0x7FFFFFFF, bytes(data[pos + 9:pos + 9 + length])))
        pos += 9 + length
    assert pos == len(data)
    return out


def settings_of(payload: bytes) -> dict[int, int]:
    return dict(struct.unpack_from(">HI", payload, i) for i in range(0, len(payload), 6))


def u32(n: int) -> bytes:
    return struct.pack(">I", n)


def server(limits: H2Limits = H2Limits(), settings=(), **kw) -> tuple[H2Connection, Recorder, Clock]:
    """A server-mode engine past the handshake (its first output taken)."""
    handler, clock = Recorder(), Clock()
    h2 = handler.h2 = H2Connection(handler, limits=limits, clock=clock, **kw)
    h2.feed(PREFACE + settings_frame(settings))
    h2.take_output()
    handler.calls.clear()
    return h2, handler, clock


def client(limits: H2Limits = H2Limits(), settings=(), **kw) -> tuple[H2Connection, Recorder, Clock]:
    """A client-mode engine past the handshake."""
    handler, clock = Recorder(), Clock()
    h2 = handler.h2 = H2Connection(handler, client=True, limits=limits, clock=clock, **kw)
    h2.initiate()
    h2.feed(settings_frame(settings))
    h2.take_output()
    handler.calls.clear()
    return h2, handler, clock


def goaway(exc: pytest.ExceptionInfo, h2: H2Connection) -> tuple[int, int, bytes]:
    """The GOAWAY the driver sends for a connection error: (last stream, code, debug)."""
    h2.take_output()
    h2.connection_error(exc.value)
    ((ftype, _, sid, payload),) = frames_of(h2.data_to_send())
    assert (ftype, sid) == (GOAWAY, 0)
    last, code = struct.unpack_from(">II", payload)
    return last, code, payload[8:]


def request(sid: int, body: bytes = b"", block: bytes = REQUEST) -> bytes:
    if not body:
        return frame(HEADERS, END_HEADERS | END_STREAM, sid, block)
    return frame(HEADERS, END_HEADERS, sid, block) + frame(DATA, END_STREAM, sid, body)


# ---- the handshake ---------------------------------------------------------------------------

def test_server_answers_the_preface_with_its_settings_and_acks_the_clients():
    handler = Recorder()
    h2 = handler.h2 = H2Connection(handler, limits=H2Limits(max_concurrent_streams=7, max_header_list_bytes=999))
    h2.feed(PREFACE[:10])
    assert h2.data_to_send() == b""                     # the preface is not complete yet
    h2.feed(PREFACE[10:] + settings_frame([(INITIAL_WINDOW_SIZE, 1000)]))
    ours, update, ack = frames_of(h2.data_to_send())
    assert ours[0] == SETTINGS and settings_of(ours[3]) == {
        MAX_CONCURRENT_STREAMS: 7, INITIAL_WINDOW_SIZE: 4 << 20, MAX_FRAME_SIZE: 1 << 20, MAX_HEADER_LIST_SIZE: 999}
    assert update == (WINDOW_UPDATE, 0, 0, u32((16 << 20) - 65535))
    assert ack == (SETTINGS, ACK, 0, b"")
    assert handler.calls == [("settings",)] and h2.settled and h2.peer_initial_window == 1000


def test_server_refuses_a_connection_without_the_preface():
    h2 = H2Connection(Recorder())
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert exc.value.code == PROTOCOL_ERROR and "preface" in str(exc.value)


@pytest.mark.parametrize("first", [frame(PING, 0, 0, b"x" * 8), frame(SETTINGS, ACK, 0)])
def test_the_first_frame_must_be_settings(first):
    h2 = H2Connection(Recorder())
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(PREFACE + first)
    assert exc.value.code == PROTOCOL_ERROR and "must be SETTINGS" in str(exc.value)


def test_client_sends_the_preface_and_push_disabled():
    handler = Recorder()
    h2 = H2Connection(handler, client=True, stream_window=1 << 30, conn_window=1 << 30, max_frame=1 << 20)
    h2.initiate()
    out = h2.data_to_send()
    assert out.startswith(PREFACE)
    ours, update = frames_of(out[len(PREFACE):])
    assert settings_of(ours[3])[ENABLE_PUSH] == 0 and settings_of(ours[3])[INITIAL_WINDOW_SIZE] == 1 << 30
    assert update == (WINDOW_UPDATE, 0, 0, u32((1 << 30) - 65535))
    h2.feed(settings_frame([(MAX_CONCURRENT_STREAMS, 3)]))
    assert frames_of(h2.data_to_send()) == [(SETTINGS, ACK, 0, b"")]
    assert h2.peer_max_streams == 3 and handler.calls == [("settings",)]


# ---- SETTINGS --------------------------------------------------------------------------------

@pytest.mark.parametrize("payload, code, text", [
    (struct.pack(">HI", INITIAL_WINDOW_SIZE, 2**31), FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE"),
    (struct.pack(">HI", MAX_FRAME_SIZE, 16383), PROTOCOL_ERROR, "MAX_FRAME_SIZE 16383"),
    (struct.pack(">HI", MAX_FRAME_SIZE, 2**24), PROTOCOL_ERROR, "MAX_FRAME_SIZE 16777216"),
    (struct.pack(">HI", ENABLE_PUSH, 2), PROTOCOL_ERROR, "ENABLE_PUSH 2"),
    (b"\x00" * 5, FRAME_SIZE_ERROR, "multiple of 6"),
])
@pytest.mark.parametrize("mode", [server, client])
def test_settings_values_are_checked(mode, payload, code, text):
    h2, _, _ = mode()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(SETTINGS, 0, 0, payload))
    assert exc.value.code == code and text in str(exc.value)


def test_settings_at_the_limits_are_taken():
    h2, _, _ = server()
    h2.feed(settings_frame([(INITIAL_WINDOW_SIZE, 2**31 - 1), (MAX_FRAME_SIZE, 2**24 - 1), (ENABLE_PUSH, 1)]))
    assert (h2.peer_initial_window, h2.peer_max_frame) == (2**31 - 1, 2**24 - 1)


def test_settings_ack_with_a_payload_and_on_a_stream():
    h2, _, _ = server()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(SETTINGS, ACK, 0, b"\x00" * 6))
    assert exc.value.code == FRAME_SIZE_ERROR
    h2, _, _ = server()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(SETTINGS, 0, 1))
    assert exc.value.code == PROTOCOL_ERROR


def test_a_server_enabling_push_is_a_protocol_error_in_client_mode():
    h2, _, _ = client()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(settings_frame([(ENABLE_PUSH, 1)]))
    assert exc.value.code == PROTOCOL_ERROR and "ENABLE_PUSH 1" in str(exc.value)


def test_too_many_settings_entries_name_the_key():
    h2, _, _ = server(H2Limits(max_settings_entries=2))
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(settings_frame([(ENABLE_PUSH, 0)] * 3))
    last, code, debug = goaway(exc, h2)
    assert code == ENHANCE_YOUR_CALM and b"endpoints.max_settings_entries" in debug


def test_settings_ack_reaches_the_handler():
    h2, handler, _ = client()
    h2.feed(frame(SETTINGS, ACK, 0))
    assert handler.calls == [("settings_acked",)]


# ---- streams and ids -------------------------------------------------------------------------

def test_a_request_reaches_the_handler_and_the_answer_closes_the_stream():
    h2, handler, _ = server()
    h2.feed(request(1, b"hello"))
    assert handler.calls[0][:2] == ("opened", 1) and handler.calls[0][2][":path"] == "/a.B/C"
    assert handler.calls[1] == ("data", 1, b"hello", True)
    stream = h2.streams[1]
    h2.send_headers(stream, RESPONSE)
    h2.send_data(stream, b"reply")
    assert h2.streams[1].state == 1          # half-closed (remote)
    h2.send_end(stream, TRAILERS)
    kinds = [(f[0], f[1]) for f in frames_of(h2.data_to_send())]
    assert kinds == [(HEADERS, END_HEADERS), (DATA, 0), (HEADERS, END_HEADERS | END_STREAM)]
    assert stream.state == CLOSED and 1 not in h2.streams and handler.calls[-1] == ("closed", 1)


def test_an_early_answer_resets_the_rest_of_the_request_with_no_error():
    h2, handler, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST))
    h2.send_headers(h2.streams[1], RESPONSE + TRAILERS, end_stream=True)
    assert frames_of(h2.data_to_send())[-1] == (RST_STREAM, 0, 1, u32(NO_ERROR))
    assert 1 not in h2.streams
    h2.feed(frame(DATA, END_STREAM, 1, b"late"))          # the rest, already on its way: ignored
    assert handler.named("data") == []


@pytest.mark.parametrize("frames, text", [
    (frame(HEADERS, END_HEADERS | END_STREAM, 2, REQUEST), "odd"),
    (request(5) + frame(HEADERS, END_HEADERS, 3, REQUEST), "must increase"),
    (frame(DATA, 0, 1, b"x"), "DATA on idle stream 1"),
    (frame(DATA, 0, 0, b"x"), "DATA on stream 0"),
    (frame(RST_STREAM, 0, 3, u32(8)), "RST_STREAM on idle stream 3"),
    (frame(WINDOW_UPDATE, 0, 9, u32(1)), "WINDOW_UPDATE on idle stream 9"),
    (frame(PRIORITY := 2, 0, 0, b"\0" * 5), "PRIORITY on stream 0"),
    (frame(PING, 0, 1, b"\0" * 8), "PING on a stream"),
    (frame(GOAWAY, 0, 1, b"\0" * 8), "GOAWAY on a stream"),
])
def test_stream_id_rules_server(frames, text):
    h2, _, _ = server()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frames)
    assert exc.value.code == PROTOCOL_ERROR and text in str(exc.value)


def test_trailers_of_a_stream_already_answered_are_ignored():
    h2, handler, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST))
    h2.send_headers(h2.streams[1], TRAILERS, end_stream=True)
    h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, 1, TRAILERS))
    assert handler.named("headers") == []


def test_data_after_end_stream_resets_with_stream_closed():
    h2, handler, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, 1, REQUEST))
    h2.take_output()
    h2.feed(frame(DATA, 0, 1, b"more"))
    assert frames_of(h2.data_to_send()) == [(RST_STREAM, 0, 1, u32(STREAM_CLOSED))]
    assert handler.calls[-2:] == [("reset", 1, STREAM_CLOSED, False), ("closed", 1)]


def test_client_trailers_end_the_request():
    h2, handler, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(DATA, 0, 1, b"m")
            + frame(HEADERS, END_HEADERS | END_STREAM, 1, encode([("x-t", "1")])))
    assert handler.calls[-1] == ("headers", 1, {"x-t": "1"}, True)
    assert h2.streams[1].state == 1


def test_trailers_without_end_stream_and_malformed_trailers():
    h2, _, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST))
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(HEADERS, END_HEADERS, 1, TRAILERS))
    assert "second HEADERS" in str(exc.value)
    h2, handler, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST))
    h2.take_output()
    h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, 1, encode([(":path", "/x")])))
    assert frames_of(h2.data_to_send()) == [(RST_STREAM, 0, 1, u32(PROTOCOL_ERROR))]


def test_a_malformed_request_is_reset_before_the_handler_sees_it():
    h2, handler, _ = server()
    h2.feed(request(1, block=encode([(":method", "POST"), (":path", "/x")])))     # no :scheme, :authority
    assert frames_of(h2.data_to_send()) == [(RST_STREAM, 0, 1, u32(PROTOCOL_ERROR))]
    assert handler.calls == [] and h2.glitch_tokens == 999.0


def test_streams_past_max_concurrent_streams_are_refused():
    h2, handler, _ = server(H2Limits(max_concurrent_streams=2))
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(HEADERS, END_HEADERS, 3, REQUEST)
            + frame(HEADERS, END_HEADERS, 5, REQUEST))
    assert frames_of(h2.data_to_send()) == [(RST_STREAM, 0, 5, u32(REFUSED_STREAM))]
    assert sorted(h2.streams) == [1, 3] and len(handler.named("opened")) == 2
    h2.zombies = 1              # a reset stream whose work still runs counts too
    h2.reset(h2.streams[1], 8)
    h2.take_output()
    h2.feed(frame(HEADERS, END_HEADERS, 7, REQUEST))
    assert frames_of(h2.data_to_send()) == [(RST_STREAM, 0, 7, u32(REFUSED_STREAM))]


def test_a_peer_reset_reaches_the_handler():
    h2, handler, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(RST_STREAM, 0, 1, u32(8)))
    assert handler.calls[-2:] == [("reset", 1, 8, True), ("closed", 1)] and not h2.streams


def test_push_promise_is_refused_in_both_modes():
    for make, text in ((server, "clients must not send"), (client, "disabled server push")):
        h2, _, _ = make()
        with pytest.raises(ConnectionError_) as exc:
            h2.feed(frame(PUSH_PROMISE, END_HEADERS, 1, u32(2) + RESPONSE))
        assert exc.value.code == PROTOCOL_ERROR and text in str(exc.value)


def test_frames_larger_than_advertised_are_refused():
    h2, _, _ = server(max_frame=16384)
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(DATA, 0, 1, b"x" * 16385))
    assert exc.value.code == FRAME_SIZE_ERROR


def test_padding_is_removed_and_bad_padding_refused():
    h2, handler, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(DATA, PADDED | END_STREAM, 1, b"\x03abc\0\0\0"))
    assert handler.calls[-1] == ("data", 1, b"abc", True)
    h2, _, _ = server()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(DATA, PADDED, 1, b"\x05ab"))
    assert "padding" in str(exc.value)


# ---- header blocks -------------------------------------------------------------------------

def test_a_header_block_across_continuations():
    h2, handler, _ = server()
    h2.feed(frame(HEADERS, END_STREAM, 1, REQUEST[:5]) + frame(CONTINUATION, 0, 1, REQUEST[5:9])
            + frame(CONTINUATION, END_HEADERS, 1, REQUEST[9:]))
    assert handler.calls[0][:2] == ("opened", 1) and handler.calls[0][3]   # END_STREAM on the HEADERS


@pytest.mark.parametrize("frames, text", [
    (frame(HEADERS, 0, 1, REQUEST[:5]) + frame(PING, 0, 0, b"\0" * 8), "interrupted"),
    (frame(CONTINUATION, END_HEADERS, 1, REQUEST), "without a header block"),
    (frame(HEADERS, 0, 1, REQUEST[:5]) + frame(CONTINUATION, END_HEADERS, 3, REQUEST[5:]), "without a header block"),
])
def test_continuation_sequencing(frames, text):
    h2, _, _ = server()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frames)
    assert exc.value.code == PROTOCOL_ERROR and text in str(exc.value)


@pytest.mark.parametrize("limits, frames, key", [
    (H2Limits(max_continuation_frames=2),
     frame(HEADERS, 0, 1, REQUEST[:2]) + b"".join(frame(CONTINUATION, 0, 1, REQUEST[i:i + 1]) for i in range(2, 6)),
     "max_continuation_frames"),
    (H2Limits(max_header_block_bytes=40), frame(HEADERS, END_HEADERS, 1, REQUEST + encode([("x-big", "v" * 40)])),
     "max_header_block_bytes"),
    (H2Limits(max_header_block_bytes=40), frame(HEADERS, 0, 1, REQUEST[:20])
     + frame(CONTINUATION, END_HEADERS, 1, REQUEST[20:] + encode([("x-big", "v" * 40)])), "max_header_block_bytes"),
    (H2Limits(max_header_list_bytes=300), request(1, block=REQUEST + encode([("x-big", "v" * 300)])),
     "max_header_list_bytes"),
    (H2Limits(max_header_fields=4), request(1), "max_header_fields"),
])
def test_header_block_limits_name_their_key(limits, frames, key):
    h2, _, _ = server(limits)
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frames)
    _, code, debug = goaway(exc, h2)
    assert code == ENHANCE_YOUR_CALM and f"endpoints.{key}".encode() in debug


def test_a_bad_header_block_is_a_compression_error():
    h2, _, _ = server()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff\xff"))
    assert exc.value.code == COMPRESSION_ERROR


# ---- floods and glitches -----------------------------------------------------------------------

def test_a_ping_flood_from_a_peer_that_does_not_read():
    h2, _, _ = server(H2Limits(max_queued_control_frames=5))
    h2.feed(frame(PING, 0, 0, b"p" * 8) * 5)
    assert frames_of(h2.out)[0] == (PING, ACK, 0, b"p" * 8) and h2.control_queued == 5
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(PING, 0, 0, b"p" * 8))
    _, code, debug = goaway(exc, h2)
    assert code == ENHANCE_YOUR_CALM and b"endpoints.max_queued_control_frames" in debug


def test_taking_the_output_resets_the_control_count():
    h2, _, _ = server(H2Limits(max_queued_control_frames=5))
    for _ in range(4):
        h2.feed(frame(PING, 0, 0, b"p" * 8) * 5)
        h2.take_output()


@pytest.mark.parametrize("one, what", [
    (frame(SETTINGS, 0, 0), "a SETTINGS frame after the first"),
    (frame(DATA, 0, 1, b""), "an empty DATA frame"),
    (None, "RST_STREAM on stream"),
    (frame(CONTINUATION, 0, 1, b""), "an empty CONTINUATION frame"),
])
def test_floods_empty_the_glitch_bucket(one, what):
    h2, handler, _ = server(H2Limits(glitch_burst=10, glitches_per_second=0.0, max_continuation_frames=100))
    if what.startswith("an empty DATA"):
        h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST))
    if what.startswith("an empty CONTINUATION"):
        h2.feed(frame(HEADERS, END_STREAM, 1, REQUEST[:3]))
    with pytest.raises(ConnectionError_) as exc:
        for i in range(11):
            if one is None:
                h2.feed(frame(HEADERS, END_HEADERS, 2 * i + 1, REQUEST) + frame(RST_STREAM, 0, 2 * i + 1, u32(8)))
            else:
                h2.feed(one)
    _, code, debug = goaway(exc, h2)
    assert code == ENHANCE_YOUR_CALM and what.encode() in debug and b"endpoints.glitch_burst" in debug


def test_the_glitch_bucket_refills_with_the_clock():
    h2, _, clock = server(H2Limits(glitch_burst=2, glitches_per_second=1.0))
    for i in range(10):
        h2.feed(frame(SETTINGS, 0, 0))
        clock.now += 1.0                    # one token back per second: never empty
    with pytest.raises(ConnectionError_):
        for _ in range(3):
            h2.feed(frame(SETTINGS, 0, 0))


# ---- flow control ---------------------------------------------------------------------------

def test_data_waits_for_the_peers_stream_window():
    h2, handler, _ = server(settings=[(INITIAL_WINDOW_SIZE, 10)])
    h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, 1, REQUEST))
    stream = h2.streams[1]
    assert h2.send_data(stream, b"a" * 25) is False
    h2.send_end(stream, TRAILERS)
    assert frames_of(h2.data_to_send()) == [(DATA, 0, 1, b"a" * 10)]
    assert h2.waiting_bytes == 15 and 1 in h2.blocked
    h2.feed(frame(WINDOW_UPDATE, 0, 1, u32(10)))
    assert frames_of(h2.data_to_send()) == [(DATA, 0, 1, b"a" * 10)]
    h2.feed(frame(WINDOW_UPDATE, 0, 1, u32(100)))
    (data, trailers) = frames_of(h2.data_to_send())
    assert data == (DATA, 0, 1, b"a" * 5) and trailers[:3] == (HEADERS, END_HEADERS | END_STREAM, 1)
    assert h2.waiting_bytes == 0 and not h2.blocked and ("drained", 1) in handler.calls and stream.state == CLOSED


def test_data_waits_for_the_connection_window_and_a_settings_change():
    h2, _, _ = server(settings=[(INITIAL_WINDOW_SIZE, 1 << 20)])
    h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, 1, REQUEST))
    stream = h2.streams[1]
    h2.send_data(stream, b"b" * 70000)
    assert sum(len(f[3]) for f in frames_of(h2.data_to_send())) == 65535   # the connection's initial window
    h2.feed(frame(WINDOW_UPDATE, 0, 0, u32(1000)))
    assert sum(len(f[3]) for f in frames_of(h2.data_to_send())) == 1000
    h2, _, _ = server(settings=[(INITIAL_WINDOW_SIZE, 0)])
    h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, 1, REQUEST))
    h2.send_data(h2.streams[1], b"c" * 50)
    assert h2.data_to_send() == b""
    h2.feed(settings_frame([(INITIAL_WINDOW_SIZE, 20)]))       # opens every stream's window by 20
    assert [f for f in frames_of(h2.data_to_send()) if f[0] == DATA] == [(DATA, 0, 1, b"c" * 20)]


def test_the_peers_max_frame_size_is_honoured():
    h2, _, _ = server(settings=[(INITIAL_WINDOW_SIZE, 1 << 20)])
    h2.feed(frame(WINDOW_UPDATE, 0, 0, u32(1 << 20)) + frame(HEADERS, END_HEADERS | END_STREAM, 1, REQUEST))
    h2.send_data(h2.streams[1], b"d" * 40000)
    sizes = [len(f[3]) for f in frames_of(h2.data_to_send())]
    assert sizes == [16384, 16384, 7232]
    h2.send_headers(h2.streams[1], encode([("x-big", "v" * 40000)]), end_stream=True)
    kinds = [f[0] for f in frames_of(h2.data_to_send())]
    assert kinds == [HEADERS, CONTINUATION, CONTINUATION]   # (the request had ended: no RST_STREAM)


def test_window_update_rules():
    h2, _, _ = server()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(WINDOW_UPDATE, 0, 0, u32(0)))
    assert exc.value.code == PROTOCOL_ERROR
    h2, _, _ = server()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(WINDOW_UPDATE, 0, 0, u32(2**31 - 65535)))
    assert exc.value.code == FLOW_CONTROL_ERROR
    h2, _, _ = server()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(WINDOW_UPDATE, 0, 0, b"\0\0\0\1\0"))
    assert exc.value.code == FRAME_SIZE_ERROR
    for increment, code in ((0, PROTOCOL_ERROR), (2**31 - 65535, FLOW_CONTROL_ERROR)):
        h2, handler, _ = server()
        h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(WINDOW_UPDATE, 0, 1, u32(increment)))
        assert frames_of(h2.data_to_send()) == [(RST_STREAM, 0, 1, u32(code))]
        assert handler.calls[-2:] == [("reset", 1, code, False), ("closed", 1)]


def test_a_settings_window_that_overflows_a_stream():
    h2, _, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(WINDOW_UPDATE, 0, 1, u32(2**31 - 65536)))
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(settings_frame([(INITIAL_WINDOW_SIZE, 70000)]))
    assert exc.value.code == FLOW_CONTROL_ERROR


def test_receive_windows_are_replenished_as_data_arrives():
    h2, _, _ = server(stream_window=100, conn_window=300)
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(HEADERS, END_HEADERS, 3, REQUEST))
    h2.take_output()
    h2.feed(frame(DATA, 0, 1, b"x" * 49))
    assert h2.data_to_send() == b""
    h2.feed(frame(DATA, 0, 1, b"x"))
    assert frames_of(h2.data_to_send()) == [(WINDOW_UPDATE, 0, 1, u32(50))]
    h2.feed(frame(DATA, 0, 3, b"y" * 60) + frame(DATA, 0, 3, b"y" * 40))
    assert frames_of(h2.data_to_send()) == [(WINDOW_UPDATE, 0, 3, u32(60)), (WINDOW_UPDATE, 0, 0, u32(150))]



def test_data_past_a_streams_receive_window_resets_that_stream():
    h2, handler, _ = server(stream_window=100, conn_window=1000)
    # until the client acknowledges our SETTINGS, it may use the protocol's 65,535
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(DATA, 0, 1, b"x" * 101))
    assert [f[0] for f in frames_of(h2.data_to_send())] == [WINDOW_UPDATE]
    h2.feed(frame(SETTINGS, ACK, 0))
    h2.feed(frame(HEADERS, END_HEADERS, 3, REQUEST) + frame(DATA, 0, 3, b"y" * 49) + frame(DATA, 0, 3, b"y" * 51))
    assert frames_of(h2.data_to_send()) == [(WINDOW_UPDATE, 0, 3, u32(100))]
    handler.calls.clear()
    h2.feed(frame(HEADERS, END_HEADERS, 5, REQUEST) + frame(DATA, 0, 5, b"z" * 49) + frame(DATA, 0, 5, b"z" * 52))
    assert frames_of(h2.data_to_send()) == [(RST_STREAM, 0, 5, u32(FLOW_CONTROL_ERROR))]
    assert ("reset", 5, FLOW_CONTROL_ERROR, False) in handler.calls and 5 not in h2.streams
    assert [c for c in handler.named("data") if c[1] == 5] == [("data", 5, b"z" * 49, False)]
    assert 1 in h2.streams and 3 in h2.streams          # the others go on


def test_data_past_the_connections_receive_window_ends_the_connection():
    h2, _, _ = server(max_frame=1 << 16, conn_window=65535)
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST) + frame(HEADERS, END_HEADERS, 3, REQUEST))
    h2.feed(frame(DATA, 0, 1, b"x" * 32766))               # under half the window: nothing returned yet
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(DATA, 0, 3, b"y" * 32770))
    assert exc.value.code == FLOW_CONTROL_ERROR and "65535" in str(exc.value)


def test_a_large_reply_waiting_for_window_is_cut_from_a_view_not_copied():
    h2, _, _ = server(settings=[(INITIAL_WINDOW_SIZE, 1000)])
    h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, 1, REQUEST))
    stream = h2.streams[1]
    reply = bytes(range(256)) * 400
    assert h2.send_data(stream, reply) is False
    assert b"".join(f[3] for f in frames_of(h2.data_to_send()) if f[0] == DATA) == reply[:1000]
    rest = stream.pending[0]
    assert type(rest) is memoryview and rest.obj is reply and bytes(rest) == reply[1000:]
    h2.feed(frame(WINDOW_UPDATE, 0, 1, u32(len(reply))) + frame(WINDOW_UPDATE, 0, 0, u32(len(reply))))
    assert b"".join(f[3] for f in frames_of(h2.data_to_send()) if f[0] == DATA) == reply[1000:]


def test_only_resets_the_peer_caused_count_as_queued_control_frames():
    h2, _, _ = server(H2Limits(max_queued_control_frames=2))
    for sid in (1, 3, 5):
        h2.feed(frame(HEADERS, END_HEADERS, sid, REQUEST))
    h2.take_output()
    for sid in (1, 3, 5):                   # the layer above cancels its calls: never an error
        h2.reset(h2.streams[sid], CANCEL)
    assert [f[0] for f in frames_of(h2.data_to_send())] == [RST_STREAM] * 3
    for sid in (7, 9, 11):
        h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, sid, REQUEST))
    h2.take_output()
    h2.feed(frame(DATA, 0, 7, b"late"))     # stream errors the client caused, and it does not read
    h2.feed(frame(DATA, 0, 9, b"late"))
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(DATA, 0, 11, b"late"))
    assert exc.value.code == ENHANCE_YOUR_CALM


def test_a_limits_message_names_where_it_is_set():
    h2, _, _ = server(H2Limits(max_settings_entries=2))
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(settings_frame([(ENABLE_PUSH, 0)] * 3))
    assert "(endpoints.max_settings_entries)" in str(exc.value)
    h2, _, _ = client(H2Limits(max_settings_entries=2), limit_names="a worker's fixed {}")
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(settings_frame([(ENABLE_PUSH, 0)] * 3))
    assert str(exc.value).endswith("the limit is 2 (a worker's fixed max_settings_entries)")

# ---- turns ------------------------------------------------------------------------------------

def test_a_turn_ends_after_its_work_or_when_the_handler_says():
    h2, handler, _ = server()
    data = frame(PING, 0, 0, b"p" * 8) * 5
    pos = h2.receive(data, memoryview(data), 0, len(data), work=2)
    assert pos == 34 and h2.spent
    pos = h2.receive(data, memoryview(data), pos, len(data), work=10)
    assert pos == len(data) and not h2.spent

    class Busy(Recorder):
        def data_received(self, stream, data, end_stream):
            super().data_received(stream, data, end_stream)
            self.h2.spent = True
    busy = Busy()
    h2 = busy.h2 = H2Connection(busy)
    data = PREFACE + settings_frame(()) + request(1, b"a") + request(3, b"b")
    pos = h2.receive(data, memoryview(data), 0, len(data))
    assert h2.spent and busy.named("data") == [("data", 1, b"a", True)]
    assert h2.receive(data, memoryview(data), pos, len(data)) == len(data)


# ---- clocks -------------------------------------------------------------------------------------

def test_the_handshake_timeout():
    handler, clock = Recorder(), Clock()
    h2 = H2Connection(handler, limits=H2Limits(handshake_timeout_seconds=5), clock=clock)
    assert h2.tick() == 105.0
    clock.now = 104.9
    assert h2.tick() == 105.0
    clock.now = 105.0
    with pytest.raises(ConnectionError_) as exc:
        h2.tick()
    _, code, debug = goaway(exc, h2)
    assert code == ENHANCE_YOUR_CALM and b"endpoints.handshake_timeout_seconds" in debug


def test_keepalive_ping_and_its_timeout():
    limits = H2Limits(handshake_timeout_seconds=1, keepalive_interval_seconds=60, keepalive_timeout_seconds=20,
                      idle_timeout_seconds=0)
    h2, _, clock = server(limits)
    h2.tick()
    clock.now += 1
    h2.note_read()                          # read at 101
    assert h2.tick() == 161.0
    clock.now = 161.0
    assert h2.tick() == 181.0 and frames_of(h2.data_to_send()) == [(PING, 0, 0, KEEPALIVE_PING)]
    clock.now = 170.0
    h2.note_read()                          # the ack came: the clock starts again from this read
    assert h2.tick() == 230.0
    clock.now = 230.0
    h2.tick()
    assert frames_of(h2.data_to_send()) == [(PING, 0, 0, KEEPALIVE_PING)]
    clock.now = 249.0
    assert h2.tick(reading=False) == float("inf")       # not while the driver is not reading
    clock.now = 250.0
    with pytest.raises(ConnectionError_) as exc:
        h2.tick()
    assert b"endpoints.keepalive_timeout_seconds" in goaway(exc, h2)[2]


def test_a_write_that_makes_no_progress():
    limits = H2Limits(handshake_timeout_seconds=1, keepalive_interval_seconds=0, idle_timeout_seconds=0,
                      write_timeout_seconds=60)
    h2, _, clock = server(limits)
    assert h2.tick() == 101.0                               # the handshake's end
    clock.now = 101.0
    assert h2.tick() == float("inf")                        # nothing being written: no clock
    assert h2.tick(writing_since=101.0) == 161.0
    clock.now = 160.9
    assert h2.tick(writing_since=101.0) == 161.0
    assert h2.tick(writing_since=150.0) == 210.0            # progress: the clock starts again
    clock.now = 161.0
    with pytest.raises(ConnectionError_) as exc:
        h2.tick(writing_since=101.0)
    _, code, debug = goaway(exc, h2)
    assert code == ENHANCE_YOUR_CALM and b"endpoints.write_timeout_seconds" in debug


def test_idle_connections_go_away():
    limits = H2Limits(handshake_timeout_seconds=1, keepalive_interval_seconds=0, idle_timeout_seconds=300)
    h2, handler, clock = server(limits)
    assert h2.tick() == 101.0               # the handshake's end
    clock.now = 101.0
    assert h2.tick() == 401.0
    h2.feed(frame(HEADERS, END_HEADERS, 1, REQUEST))
    clock.now = 500.0
    h2.tick()                               # a stream is open: not idle
    h2.send_headers(h2.streams[1], TRAILERS, end_stream=True)
    clock.now = 799.0
    h2.tick()
    assert not h2.going_away
    h2.take_output()
    clock.now = 800.0
    assert h2.tick() == float("inf")
    assert frames_of(h2.data_to_send()) == [(GOAWAY, 0, 0, u32(1) + u32(NO_ERROR))]
    assert handler.calls[-1] == ("quiet",)


def test_go_away_refuses_new_streams_and_is_quiet_when_the_last_ends():
    h2, handler, _ = server()
    h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, 1, REQUEST))
    h2.go_away()
    h2.feed(request(3))
    frames = frames_of(h2.data_to_send())
    assert frames == [(GOAWAY, 0, 0, u32(1) + u32(NO_ERROR)), (RST_STREAM, 0, 3, u32(REFUSED_STREAM))]
    assert ("quiet",) not in handler.calls
    h2.send_headers(h2.streams[1], TRAILERS, end_stream=True)
    assert handler.calls[-1] == ("quiet",)


def test_stopped_drops_output():
    h2, _, _ = server()
    h2.stopped = True
    h2.feed(frame(PING, 0, 0, b"p" * 8))
    assert h2.data_to_send() == b""


# ---- client mode --------------------------------------------------------------------------------

def test_client_opens_streams_and_receives_the_response():
    h2, handler, _ = client()
    first, second = Stream(), Stream()
    assert h2.open_stream(first, REQUEST, b"body") == 1 and h2.open_stream(second, REQUEST, b"") == 3
    out = frames_of(h2.data_to_send())
    assert out == [(HEADERS, END_HEADERS, 1, REQUEST), (DATA, END_STREAM, 1, b"body"),
                   (HEADERS, END_HEADERS | END_STREAM, 3, REQUEST)]
    assert first.state == HALF_CLOSED_LOCAL
    h2.feed(frame(HEADERS, END_HEADERS, 1, RESPONSE) + frame(DATA, 0, 1, b"reply")
            + frame(HEADERS, END_HEADERS | END_STREAM, 1, TRAILERS))
    assert handler.calls == [("headers", 1, {":status": "200", "content-type": "application/grpc"}, False),
                             ("data", 1, b"reply", False), ("headers", 1, {"grpc-status": "0"}, True),
                             ("closed", 1)]
    assert first.state == CLOSED and list(h2.streams) == [3]


def test_client_request_data_waits_for_the_servers_window():
    h2, _, _ = client(settings=[(INITIAL_WINDOW_SIZE, 8)])
    stream = Stream()
    h2.open_stream(stream, REQUEST, b"0123456789abcdef")
    assert frames_of(h2.data_to_send()) == [(HEADERS, END_HEADERS, 1, REQUEST), (DATA, 0, 1, b"01234567")]
    assert stream.state == OPEN
    h2.feed(frame(WINDOW_UPDATE, 0, 1, u32(100)))
    assert frames_of(h2.data_to_send()) == [(DATA, END_STREAM, 1, b"89abcdef")]
    assert stream.state == HALF_CLOSED_LOCAL and h2.waiting_bytes == 0


def test_client_goaway_closes_the_streams_it_did_not_process():
    h2, handler, _ = client()
    for _ in range(3):
        h2.open_stream(Stream(), REQUEST, b"x")
    h2.feed(frame(GOAWAY, 0, 0, u32(3) + u32(NO_ERROR) + b"stopping"))
    assert handler.calls == [("goaway", 3, NO_ERROR, b"stopping"), ("reset", 5, REFUSED_STREAM, True),
                             ("closed", 5)]
    assert sorted(h2.streams) == [1, 3] and not h2.can_open()


def test_client_can_open_follows_the_servers_stream_limit():
    h2, _, _ = client(settings=[(MAX_CONCURRENT_STREAMS, 1)])
    assert h2.can_open()
    h2.open_stream(Stream(), REQUEST, b"x")
    assert not h2.can_open()


def test_client_the_last_stream_id_goes_away_and_is_quiet_when_its_streams_end():
    h2, handler, _ = client()
    h2.last_stream = MAX_WINDOW - 2         # as after 2**30 streams
    assert h2.open_stream(Stream(), REQUEST, b"x") == MAX_WINDOW
    assert h2.going_away and not h2.can_open()
    h2.feed(frame(HEADERS, END_HEADERS, MAX_WINDOW, RESPONSE) + frame(HEADERS, END_HEADERS | END_STREAM, MAX_WINDOW,
                                                                      TRAILERS))
    assert handler.calls[-2:] == [("closed", MAX_WINDOW), ("quiet",)]
    with pytest.raises(ConnectionError_, match="every stream id"):
        h2.open_stream(Stream(), REQUEST, b"x")


def test_client_reset_by_the_server_and_by_itself():
    h2, handler, _ = client()
    a, b = Stream(), Stream()
    h2.open_stream(a, REQUEST, b"x")
    h2.open_stream(b, REQUEST, b"x")
    h2.take_output()
    h2.feed(frame(RST_STREAM, 0, 1, u32(REFUSED_STREAM)))
    assert handler.calls == [("reset", 1, REFUSED_STREAM, True), ("closed", 1)]
    h2.reset(b, 8)                               # a timeout: this end gives up
    assert frames_of(h2.data_to_send()) == [(RST_STREAM, 0, 3, u32(8))]
    c = Stream()
    h2.open_stream(c, REQUEST, b"x")
    # The late response of the reset stream adds a field to the HPACK dynamic table, and the next
    # block refers to it by index: the ignored block must still have been decoded.
    encoder = hpack.Encoder()
    late, later = encoder.encode([(":status", "200"), ("x-worker", "w1")]), encoder.encode([("x-worker", "w1")])
    assert len(later) == 1                       # an index into the dynamic table
    h2.feed(frame(HEADERS, END_HEADERS, 3, late) + frame(DATA, END_STREAM, 3, b"late"))   # ignored
    assert handler.calls[-1] == ("closed", 3)
    h2.feed(frame(HEADERS, END_HEADERS, 5, later))
    assert handler.calls[-1] == ("headers", 5, {"x-worker": "w1"}, 0)


@pytest.mark.parametrize("frames, text", [
    (frame(HEADERS, END_HEADERS, 2, RESPONSE), "even stream 2"),
    (frame(HEADERS, END_HEADERS, 5, RESPONSE), "idle stream 5"),
    (frame(DATA, 0, 5, b"x"), "DATA on idle stream 5"),
])
def test_client_stream_id_rules(frames, text):
    h2, _, _ = client()
    h2.open_stream(Stream(), REQUEST, b"x")
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frames)
    assert exc.value.code == PROTOCOL_ERROR and text in str(exc.value)


def test_client_headers_after_the_response_ended():
    h2, _, _ = client()
    stream = Stream()
    h2.open_stream(stream, REQUEST, b"x", end_stream=False)
    h2.feed(frame(HEADERS, END_HEADERS | END_STREAM, 1, RESPONSE + TRAILERS))
    h2.take_output()
    h2.feed(frame(HEADERS, END_HEADERS, 1, TRAILERS))
    assert frames_of(h2.data_to_send()) == [(RST_STREAM, 0, 1, u32(STREAM_CLOSED))]


def test_client_pings_and_acks():
    h2, handler, _ = client()
    h2.feed(frame(PING, 0, 0, b"12345678"))
    assert frames_of(h2.data_to_send()) == [(PING, ACK, 0, b"12345678")]
    h2.ping(b"abcdefgh")
    assert frames_of(h2.data_to_send()) == [(PING, 0, 0, b"abcdefgh")]
    h2.feed(frame(PING, ACK, 0, b"abcdefgh"))
    assert handler.calls == [("ping_acked", b"abcdefgh")]


def test_client_handshake_needs_the_servers_settings():
    handler, clock = Recorder(), Clock()
    h2 = H2Connection(handler, client=True, limits=H2Limits(handshake_timeout_seconds=2), clock=clock)
    h2.initiate()
    h2.tick()
    with pytest.raises(ConnectionError_) as exc:
        h2.feed(frame(PING, 0, 0, b"12345678"))
    assert "must be SETTINGS" in str(exc.value)
    h2 = H2Connection(handler, client=True, limits=H2Limits(handshake_timeout_seconds=2), clock=clock)
    h2.tick()
    clock.now += 2
    with pytest.raises(ConnectionError_) as exc:
        h2.tick()
    assert "the server sent no connection preface" in str(exc.value)


def test_client_end_stream_alone_behind_waiting_data():
    h2, _, _ = client(settings=[(INITIAL_WINDOW_SIZE, 4)])
    stream = Stream()
    h2.open_stream(stream, REQUEST, b"", end_stream=False)
    h2.send_data(stream, b"abcdefgh")
    h2.send_end(stream)
    assert [f[:2] for f in frames_of(h2.data_to_send())] == [(HEADERS, END_HEADERS), (DATA, 0)]
    h2.feed(frame(WINDOW_UPDATE, 0, 1, u32(10)))
    assert frames_of(h2.data_to_send()) == [(DATA, 0, 1, b"efgh"), (DATA, END_STREAM, 1, b"")]
    assert stream.state == HALF_CLOSED_LOCAL


def test_the_engine_imports_no_io_and_nothing_of_the_server():
    """Sans-IO in fact: importing the engine loads no Trio, no socket layer of xlaserve."""
    import subprocess
    import sys
    code = ("import sys, xlaserve.http2.connection; "
            "bad = sorted(m for m in sys.modules if m in ('trio', 'socket', 'ssl') or m.startswith("
            "('xlaserve.frontend', 'xlaserve.gateway', 'xlaserve.worker'))); print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
