"""The HTTP/1.1 server (llhttp through httptools, on Trio) against hostile peers, over in-memory streams under Trio's
MockClock: every timeout is exact and costs no wall time. Each attack checks that the offender
gets the status that names it (when it can still read one) and is closed, and that a well-behaved
connection beside it is served."""
from __future__ import annotations

import gzip
import json
import socket
import struct
import zlib

import pytest
import trio
import trio.testing

from xlaserve.frontend.http1 import (Http1Server, HttpLimits, HttpRequest, HttpResponse, accepted_codings,
                                     response_coding)

LIMITS = HttpLimits(max_header_bytes=2048, max_headers=20, max_body_bytes=1000, max_inflate_bytes=4000,
                    max_total_body_bytes=1500,
                    header_timeout=10.0, body_timeout=30.0, idle_timeout=60.0, write_timeout=5.0,
                    max_connections=4, keys={"max_body_bytes": "endpoints.max_recv_msg_bytes"})
GET = b"GET /echo HTTP/1.1\r\nhost: x\r\n\r\n"


CANCELLED: list[str] = []
WAITING: list[str] = []         # /wait requests that reached the handler


async def echo(request: HttpRequest) -> HttpResponse:
    if request.path == "/wait":
        WAITING.append(request.path)
        try:
            await trio.sleep(100)
        except trio.Cancelled:
            CANCELLED.append(request.path)
            raise
    if request.path == "/boom":
        raise ValueError("a bug in the handler")
    if request.path == "/big":
        return HttpResponse(200, b"x" * 5000, "text/plain")
    if request.path == "/huge":
        return HttpResponse(200, bytes(range(256)) * 1000, "application/octet-stream")
    if request.path == "/vast":             # more than a loopback socket's send buffer takes at once
        return HttpResponse(200, bytes(range(256)) * 64 * 1024, "application/octet-stream")
    if request.path == "/inject":
        return HttpResponse(200, b"{}", headers=(("x-note", "a\r\nset-cookie: evil"),))
    return HttpResponse(200, json.dumps({"method": request.method, "path": request.path,
                                         "body": len(request.body)}).encode())


def run(test, limits: HttpLimits = LIMITS) -> None:
    async def main():
        server = Http1Server(echo, limits, what="REST")
        async with trio.open_nursery() as nursery:
            def connect():
                client, served = trio.testing.memory_stream_pair()
                nursery.start_soon(server.serve_stream, served)
                return client
            await test(server, connect)
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def read_all(client) -> bytes:
    chunks = []
    while chunk := await client.receive_some(65536):
        chunks.append(chunk)
    return b"".join(chunks)


async def read_response(client) -> tuple[int, dict, bytes]:
    """One response of a kept-alive connection (Content-Length framed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await client.receive_some(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    length = int(headers["content-length"])
    while len(rest) < length:
        rest += await client.receive_some(65536)
    return int(lines[0].split()[1]), headers, rest[:length]


async def served(connect) -> None:
    """A well-behaved connection beside the offender is answered."""
    client = connect()
    await client.send_all(GET)
    status, _, body = await read_response(client)
    assert status == 200 and json.loads(body)["path"] == "/echo"
    await client.aclose()


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


async def pipelined_in_order(client) -> None:
    """Three requests pipelined in one write, the last closing: all answered, in order."""
    await client.send_all(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc" + GET +
                          b"GET /last HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    reply = await read_all(client)
    assert reply.count(b"HTTP/1.1 200 OK") == 3
    assert reply.index(b'"path": "/a", "body": 3') < reply.index(b'"/echo"') < reply.index(b'"/last"')


async def refused(client, status: int, *notes: bytes) -> None:
    """Reads ``client`` to its end: one reply of ``status`` whose message holds each of ``notes``."""
    reply = await read_all(client)
    assert status_of(reply) == status and all(note in reply for note in notes), reply[:300]


def test_keep_alive_serves_requests_in_turn_and_pipelined_ones_in_order():
    async def test(server, connect):
        client = connect()
        for _ in range(2):
            await client.send_all(GET)
            assert (await read_response(client))[0] == 200
        await pipelined_in_order(client)
    run(test)


def test_slow_headers_get_408_at_the_header_timeout_and_others_are_served():
    async def test(server, connect):
        slow = connect()
        await slow.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-slow: ")
        await trio.sleep(9)
        await served(connect)
        await refused(slow, 408, b"header_timeout")
        assert trio.current_time() == 10.0
    run(test)


def test_a_silent_new_connection_is_closed_at_the_header_timeout_without_a_word():
    async def test(server, connect):
        silent = connect()
        assert await read_all(silent) == b""
        assert trio.current_time() == 10.0
    run(test)


def test_an_idle_kept_alive_connection_is_closed_at_the_idle_timeout():
    async def test(server, connect):
        client = connect()
        await client.send_all(GET)
        await read_response(client)
        start = trio.current_time()
        assert await read_all(client) == b""
        assert trio.current_time() - start == 60.0
    run(test)


def test_slow_body_and_a_content_length_that_promises_more_get_408():
    async def test(server, connect):
        slow = connect()
        await slow.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n0123456789")
        await served(connect)
        await refused(slow, 408, b"10 bytes came")
        assert trio.current_time() == 30.0
    run(test)


def test_a_peer_that_leaves_mid_body_is_closed():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n0123")
        await client.send_eof()
        assert await read_all(client) == b""
        await served(connect)
    run(test)


def test_oversized_head_and_too_many_fields_are_431():
    async def test(server, connect):
        big = connect()
        await big.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 3000 + b"\r\n\r\n")
        await refused(big, 431, b"2048")
        trickle = connect()        # a head that never ends, sent in pieces: bounded as it comes
        await trickle.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\n")
        for _ in range(5):
            await trickle.send_all(b"x-a: " + b"b" * 600 + b"\r\n")
        await refused(trickle, 431)
        many = connect()
        await many.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(25)) + b"\r\n")
        await refused(many, 431, b"26 header fields")
        await served(connect)
    run(test)


def test_a_body_past_the_limit_is_413_before_it_is_read_or_as_a_chunked_one_crosses_it():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5000\r\n\r\n")
        await refused(client, 413, b"endpoints.max_recv_msg_bytes")
        chunked = connect()
        await chunked.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(3):
            await chunked.send_all(b"190\r\n" + b"z" * 400 + b"\r\n")
        await refused(chunked, 413)
        await served(connect)
    run(test)


def test_chunk_extensions_and_trailers_are_bounded_as_a_head_is():
    # llhttp skips both without a callback: before the bound, a client could stream them for as
    # long as the body timeout allowed, unbounded in bytes
    async def test(server, connect):
        head = b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        extension = connect()
        await extension.send_all(head + b"3;note=")
        await extension.send_all(b"n" * 10000)
        await refused(extension, 431, b"chunk extensions and trailer fields are larger than 2048 bytes")
        trailers = connect()
        await trailers.send_all(head + b"3\r\nabc\r\n0\r\n")
        await trailers.send_all(b"".join(b"t%d: %s\r\n" % (i, b"v" * 90) for i in range(100)))
        await refused(trailers, 431, b"chunk extensions and trailer fields")
        # a body in one-byte chunks (framing five times its data) and a few trailers are served
        patient = connect()
        await patient.send_all(head + b"1\r\nz\r\n" * 900 + b"0\r\nt: 1\r\n\r\n")
        status, _, body = await read_response(patient)
        assert status == 200 and json.loads(body)["body"] == 900
        await served(connect)
    run(test)


def test_chunked_abuse_and_conflicting_lengths_are_400():
    async def test(server, connect):
        for attack in (b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
                       b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd",
                       b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: gzip\r\n\r\n",
                       b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n"):
            client = connect()
            await client.send_all(attack)
            assert status_of(await read_all(client)) in (400, 501), attack
        await served(connect)
    run(test)


def test_a_transfer_coding_other_than_chunked_alone_is_501_naming_it():
    # llhttp takes "gzip, chunked" as chunked: without the check the body reached the handler
    # still gzip-coded, as if it were plain
    async def test(server, connect):
        for coding in (b"gzip, chunked", b"transfer-encoding: gzip\r\ntransfer-encoding: chunked"):
            field = coding if coding.startswith(b"transfer-encoding") else b"transfer-encoding: " + coding
            client = connect()
            await client.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\n" + field + b"\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
            reply = await read_all(client)
            assert status_of(reply) == 501 and b"'gzip, chunked' is not supported" in reply, reply
        client = connect()      # chunked alone, in any case and spacing, is served
        await client.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding:  Chunked \r\n"
                              b"connection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n")
        reply = await read_all(client)
        assert reply.startswith(b"HTTP/1.1 200") and b'"body": 3' in reply
    run(test)


def test_an_absolute_form_target_routes_by_its_path():
    # what a forward proxy sends (RFC 9112 3.2.2: a server accepts it); it was routed as a path
    # that began with "http:" and answered 404
    async def test(server, connect):
        client = connect()
        for target, path in ((b"http://x:8000/echo?a=1", "/echo"), (b"HTTPS://x/echo", "/echo"),
                             (b"http://x?q=1", "/"), (b"http://x", "/")):
            await client.send_all(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % target)
            status, _, body = await read_response(client)
            assert status == 200 and json.loads(body)["path"] == path, (target, body)
    run(test)


def test_a_content_length_shorter_than_the_body_makes_the_rest_a_bad_next_request():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabcdef ghi\r\n\r\n")
        reply = await read_all(client)
        assert reply.startswith(b"HTTP/1.1 200") and b'"body": 3' in reply
        assert reply.count(b"HTTP/1.1 400") == 1
    run(test)


def test_a_pipelining_client_that_never_reads_is_closed_by_the_write_timeout():
    async def test(server, connect):
        client, stream = trio.testing.lockstep_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.serve_stream, stream)
            with trio.move_on_after(1):
                await client.send_all(b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n" * 200)
            await trio.sleep(10)
            assert server.connections == 0          # closed at 1 + write_timeout, while it kept not reading
        await served(connect)
    run(test)


def test_one_connection_past_max_connections_is_answered_503_and_the_others_go_on():
    async def test(server, connect):
        held = [connect() for _ in range(4)]
        await trio.sleep(1)
        extra = connect()
        await refused(extra, 503, b"max_connections")
        assert trio.current_time() == 1.0
        await held[0].send_all(GET)
        assert (await read_response(held[0]))[0] == 200
    run(test)


def test_a_large_response_arrives_whole_and_the_connection_goes_on():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"GET /huge HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = await read_response(client)
        assert status == 200 and body == bytes(range(256)) * 1000 and headers["content-length"] == "256000"
        await client.send_all(GET)
        assert (await read_response(client))[0] == 200
    run(test)


def test_a_peer_that_leaves_before_its_answer_cancels_the_handler():
    CANCELLED.clear()

    async def test(server, connect):
        client = connect()
        await client.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
        await trio.sleep(1)
        await client.send_eof()
        assert await read_all(client) == b""
        assert CANCELLED == ["/wait"] and trio.current_time() == 1.0
        patient = connect()                 # one that waits gets its answer
        await patient.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n" + GET)
        status, _, body = await read_response(patient)
        assert status == 200 and json.loads(body)["path"] == "/wait" and trio.current_time() == 101.0
        assert (await read_response(patient))[0] == 200        # the request pipelined behind it
    run(test)


def test_a_handler_bug_is_500_and_the_connection_goes_on():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"GET /boom HTTP/1.1\r\nhost: x\r\n\r\n")
        status, _, body = await read_response(client)
        assert status == 500 and "a bug in the handler" in json.loads(body)["error"]
        await client.send_all(GET)
        assert (await read_response(client))[0] == 200
    run(test)


def test_expect_100_continue_is_answered_before_the_body_is_read():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\nexpect: 100-continue\r\n\r\n")
        assert (await client.receive_some(100)).startswith(b"HTTP/1.1 100 ")
        await client.send_all(b"abcd")
        status, _, body = await read_response(client)
        assert status == 200 and json.loads(body)["body"] == 4
    run(test)


def test_gzip_bodies_inflate_within_the_limit_and_responses_compress_when_accepted():
    async def test(server, connect):
        client = connect()
        body = gzip.compress(b"a" * 900)
        await client.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-encoding: gzip\r\naccept-encoding: gzip\r\n"
                              b"content-length: %d\r\n\r\n" % len(body) + body)
        status, headers, reply = await read_response(client)
        assert status == 200 and json.loads(reply)["body"] == 900 and "content-encoding" not in headers
        await client.send_all(b"GET /big HTTP/1.1\r\nhost: x\r\naccept-encoding: br, gzip;q=0.5\r\n\r\n")
        status, headers, reply = await read_response(client)
        assert headers["content-encoding"] == "gzip" and gzip.decompress(reply) == b"x" * 5000
        bomb = gzip.compress(b"\0" * 100_000)          # 100 kB of zeros in ~100 bytes
        await client.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-encoding: gzip\r\n"
                              b"content-length: %d\r\n\r\n" % len(bomb) + bomb)
        await refused(client, 413, b"inflates past 1000 bytes")
        bad = connect()
        await bad.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-encoding: gzip\r\ncontent-length: 5\r\n\r\nnope!")
        await refused(bad, 400)
        await served(connect)
    run(test)


@pytest.mark.parametrize("header, coding", [
    ("gzip", "gzip"),
    ("deflate;q=0.1, gzip;q=0.9", "gzip"),          # the higher q, not the first listed
    ("gzip;q=0.2, deflate;q=0.8", "deflate"),
    ("deflate, gzip", "gzip"),                      # a tie: the server's preference
    ("br, gzip;q=0.5", "gzip"),                     # identity unlisted: acceptable, the last choice
    ("gzip;q=0, identity", None),                   # q=0: not acceptable
    ("GZIP;Q=0, identity", None),                   # coding and parameter names ignore case
    ("gzip; q=0 ,deflate;q=0", None),
    ("gzip;level=9;q=0", None),                     # another parameter does not hide the q
    ("gzip;q=0.5, identity", None),                 # identity listed at 1 outweighs gzip at 0.5
    ("identity;q=0.5, deflate;q=0.5", "deflate"),
    ("*", "gzip"),
    ("*;q=0.5, gzip;q=0", "deflate"),               # the wildcard gives what is not listed its q
    ("*;q=0, deflate;q=0.3", "deflate"),
    ("*;q=0", None),                                # nothing acceptable, identity excluded: sent as it is
    ("identity;q=0", None),
    ("x-gzip;q=0.7", "gzip"),
    ("", None), (" , ;q=1, ", None), ("br, zstd", None),
    # a malformed q leaves its element out, never raises: here only the wildcard is left
    ("gzip;q=abc, *;q=0.1", "gzip"), ("gzip;q=2", None), ("gzip;q=inf", None), ("gzip;q=nan", None),
    ("gzip;q=-1", None), ("gzip;q=0.5000", None), ("gzip;q=", None), ("gzip;q=1;q=0", None),
    ("gzip;q=1.000, deflate;q=0.999", "gzip"),
    ("gzip, gzip;q=0", None),                       # listed twice: its lowest q
])
def test_response_coding_follows_rfc_9110_quality_values(header, coding):
    assert response_coding(header) == coding


def test_accepted_codings_parses_q_values_and_leaves_out_malformed_elements():
    assert accepted_codings("gzip;q=0.5, Deflate;Q=1.0, *;q=0, identity, br;q=x") == {
        "gzip": 0.5, "deflate": 1.0, "*": 0.0, "identity": 1.0}
    assert accepted_codings("gzip;q=" + "9" * 10_000) == {}
    assert accepted_codings(",;" * 10_000) == {}


def test_responses_honour_the_clients_quality_values():
    """q=0 excludes a coding and the highest q wins: 'GZIP;Q=0, identity' got a gzip body (the
    parameter name was matched in lower case only) and 'deflate;q=0.1, gzip;q=0.9' a deflate one
    (the first listed won)."""
    async def test(server, connect):
        client = connect()
        for accept, coding in ((b"GZIP;Q=0, identity", None), (b"deflate;q=0.1, gzip;q=0.9", "gzip"),
                               (b"gzip;q=0.2, deflate", "deflate"), (b"*;q=0", None), (b"gzip;q=bad", None)):
            await client.send_all(b"GET /big HTTP/1.1\r\nhost: x\r\naccept-encoding: %s\r\n\r\n" % accept)
            status, headers, reply = await read_response(client)
            assert status == 200 and headers.get("content-encoding") == coding, accept
            inflated = zlib.decompress(reply, 16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS) \
                if coding else reply
            assert inflated == b"x" * 5000
        await served(connect)
    run(test)


def test_compressed_bodies_with_bytes_after_their_end_or_cut_short_are_400_saying_so():
    # Each body was inflated up to the end of its first gzip member (or deflate stream) and the
    # rest dropped unseen: two members reached the handler as the first alone, stray bytes vanished.
    second = gzip.compress(b"b" * 300)
    cases = ((b"gzip", gzip.compress(b"a" * 300) + second,
              b"%d bytes follow the end of the compressed stream" % len(second)),
             (b"gzip", gzip.compress(b"a" * 300) + b"junk", b"4 bytes follow the end of the compressed stream"),
             (b"deflate", zlib.compress(b"a" * 300) + b"\0", b"1 bytes follow the end of the compressed stream"),
             (b"gzip", gzip.compress(b"a" * 300)[:-3], b"the compressed stream ends early"),
             (b"gzip", b"nope!", b"incorrect header check"))

    async def test(server, connect):
        for coding, body, note in cases:
            client = connect()
            await client.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-encoding: %s\r\n"
                                  b"content-length: %d\r\n\r\n" % (coding, len(body)) + body)
            await refused(client, 400, b"the request body is not valid " + coding + b" data", note)
        await served(connect)
    run(test)


def test_close_ends_idle_connections_at_once():
    async def test(server, connect):
        client = connect()
        await client.send_all(GET)
        await read_response(client)
        server.close()
        assert await read_all(client) == b""
        assert trio.current_time() == 0.0
    run(test)


def test_a_kept_alive_connections_next_head_has_the_header_timeout_from_its_first_byte():
    async def test(server, connect):
        client = connect()
        await client.send_all(GET)
        await read_response(client)
        await trio.sleep(50)                # quiet, within the idle timeout
        await client.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nx-slow: ")
        start = trio.current_time()
        await refused(client, 408, b"header_timeout")
        assert trio.current_time() - start == 10.0
    run(test)


def test_a_pipelined_request_whose_body_stalls_gets_408_at_the_body_timeout():
    async def test(server, connect):
        client = connect()
        await client.send_all(GET + b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n01234")
        assert (await read_response(client))[0] == 200
        await refused(client, 408, b"5 bytes came")
        assert trio.current_time() == 30.0
    run(test)


def test_no_deadline_runs_while_the_handler_does_and_idle_counts_from_the_answer():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")     # 100 s: past every timeout
        status, _, _ = await read_response(client)
        assert status == 200 and trio.current_time() == 100.0
        assert await read_all(client) == b""
        assert trio.current_time() == 160.0      # idle_timeout after the answer
    run(test)


def test_close_while_a_request_is_in_the_handler_answers_it_then_closes():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
        await trio.sleep(1)
        server.close()
        reply = await read_all(client)
        assert reply.startswith(b"HTTP/1.1 200 ") and b"connection: close" in reply
        assert trio.current_time() == 100.0
    run(test)


def test_bodies_held_by_all_connections_are_bounded_and_given_back_once_answered():
    async def test(server, connect):
        slow = connect()                    # holds 900 bytes, its body unfinished
        await slow.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n" + b"a" * 900)
        await trio.sleep(1)
        assert server.bodies.used == 900
        greedy = connect()                  # 700 more would make 1600 > 1500: 503, closed
        await greedy.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 700\r\n\r\n" + b"b" * 700)
        await refused(greedy, 503, b"1500", b"retry later")
        assert server.bodies.used == 900
        await slow.send_all(b"a" * 100)     # the first finishes and is answered; its bytes come back
        status, _, body = await read_response(slow)
        assert status == 200 and json.loads(body)["body"] == 1000
        assert server.bodies.used == 0
        again = connect()
        await again.send_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 700\r\n\r\n" + b"b" * 700)
        assert (await read_response(again))[0] == 200
    run(test)


def test_http10_and_connection_close_get_their_answer_with_connection_close_then_the_end():
    async def test(server, connect):
        for request in (b"GET /echo HTTP/1.0\r\n\r\n", b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"):
            client = connect()
            await client.send_all(request + GET)        # what follows a closing request is not answered
            reply = await read_all(client)
            assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and reply.count(b"HTTP/1.1") == 1
            head, _, body = reply.partition(b"\r\n\r\n")
            assert b"\r\nconnection: close" in head and json.loads(body)["path"] == "/echo"
    run(test)


def test_head_is_answered_with_the_gets_headers_and_no_body_and_the_connection_goes_on():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"HEAD /big HTTP/1.1\r\nhost: x\r\n\r\n" + GET)
        data = b""
        while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"}"):
            data += await client.receive_some(65536)
        head, _, rest = data.partition(b"\r\n\r\n")
        assert b"content-length: 5000" in head and b"connection" not in head
        assert rest.startswith(b"HTTP/1.1 200 OK\r\n") and b"x" * 10 not in rest  # no body before the next answer
    run(test)


def test_a_response_header_with_a_line_break_is_never_written_and_others_are_served():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"GET /inject HTTP/1.1\r\nhost: x\r\n\r\n")
        assert b"set-cookie" not in await read_all(client)      # the connection is closed, nothing injected
        await served(connect)
    run(test)


# ---- over loopback TCP: the non-blocking socket reads and writes (_receive_raw, _send) --------
def run_tcp(test) -> None:
    """``test(server, connect)`` with ``connect()`` opening a real TCP connection to the server on
    loopback (the plain-TCP path reads and writes the socket without Trio's stream); real clock."""
    async def main():
        server = Http1Server(echo, LIMITS, what="REST")
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, listeners)

            async def connect():
                return await trio.open_tcp_stream("127.0.0.1", port)
            with trio.fail_after(30):
                await test(server, connect)
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_over_tcp_keep_alive_and_pipelined_requests_are_answered_in_order():
    async def test(server, connect):
        client = await connect()
        for _ in range(3):
            await client.send_all(GET)
            assert (await read_response(client))[0] == 200
        await pipelined_in_order(client)
        await client.aclose()
    run_tcp(test)


def test_over_tcp_a_response_larger_than_the_socket_takes_at_once_arrives_whole():
    async def test(server, connect):
        client = await connect()
        await client.send_all(b"GET /vast HTTP/1.1\r\nhost: x\r\n\r\n")
        status, headers, body = await read_response(client)
        assert status == 200 and headers["content-length"] == str(256 * 64 * 1024)
        assert body == bytes(range(256)) * 64 * 1024
        await client.send_all(GET)
        assert (await read_response(client))[0] == 200
        await client.aclose()
    run_tcp(test)


def test_over_tcp_a_peer_that_leaves_or_resets_is_closed_and_its_handler_cancelled():
    CANCELLED.clear()
    WAITING.clear()

    async def test(server, connect):
        client = await connect()
        await client.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
        await client.send_eof()
        assert await read_all(client) == b""
        assert CANCELLED == ["/wait"]
        await client.aclose()
        reset = await connect()
        await reset.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
        while len(WAITING) < 2:             # the request reaches the handler (else the RST ends it sooner)
            await trio.sleep(0.01)
        reset.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await reset.aclose()                # an RST, not a FIN
        while len(CANCELLED) < 2:
            await trio.sleep(0.01)
        assert CANCELLED == ["/wait", "/wait"]
        client = await connect()            # and the server goes on
        await client.send_all(GET)
        assert (await read_response(client))[0] == 200
        await client.aclose()
        while server.connections:
            await trio.sleep(0.01)
    run_tcp(test)


def test_a_reader_fault_that_is_not_the_peers_doing_while_the_handler_runs_is_logged(caplog):
    CANCELLED.clear()
    WAITING.clear()

    async def main():
        server = Http1Server(echo, LIMITS, what="REST")
        async with trio.open_nursery() as nursery:
            client, served = trio.testing.memory_stream_pair()

            async def bug() -> None:         # the reader's next receive, once the handler runs
                if WAITING:
                    raise RuntimeError("a bug in the reader")
            served.receive_stream.receive_some_hook = bug
            nursery.start_soon(server.serve_stream, served)
            await client.send_all(b"GET /wait HTTP/1.1\r\nhost: x\r\n\r\n")
            assert await read_all(client) == b""
            assert CANCELLED == ["/wait"]
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert "a bug in the reader" in caplog.text


def test_a_burst_of_pipelined_requests_is_answered_in_order_and_parsed_only_a_slice_ahead(monkeypatch):
    import xlaserve.frontend.http1 as http1
    ahead: list[int] = []                   # requests parsed and waiting while one is answered
    complete = http1._Parser.on_message_complete

    def counting(self):
        complete(self)
        ahead.append(len(self.ready))
    monkeypatch.setattr(http1._Parser, "on_message_complete", counting)

    async def test(server, connect):
        client = connect()
        burst = b"".join(b"GET /r%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(400))    # ~12 KiB in one write
        await client.send_all(burst + b"GET /last HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        reply = await read_all(client)
        paths = [json.loads(part.partition(b"\r\n\r\n")[2].split(b"HTTP/1.1")[0])["path"]
                 for part in reply.split(b"HTTP/1.1 200 OK")[1:]]
        assert paths == [f"/r{i}" for i in range(400)] + ["/last"]
        # a 4 KiB slice holds at most ~140 of these 29-byte requests: never all 400 at once
        assert max(ahead) <= http1.PARSE_SLICE // len(b"GET /r0 HTTP/1.1\r\nhost: x\r\n\r\n") + 1
    run(test)


def test_an_upgrade_request_is_answered_and_the_connection_closes_after_it():
    async def test(server, connect):
        client = connect()
        await client.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
                              b"\x81\x85not http")
        reply = await read_all(client)
        assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and reply.count(b"HTTP/1.1") == 1
        assert b"\r\nconnection: close" in reply.partition(b"\r\n\r\n")[0]
    run(test)


def test_what_llhttp_refuses_is_400_naming_it():
    async def test(server, connect):
        for attack, note in ((b"GET /echo HTTP/1.1\r\nhost: x\r\nbad header: 1\r\n\r\n", b"Invalid header token"),
                             (b"GET /echo HTTP/1.1\r\nhost: x\r\nx-a: 1\r\n folded\r\n\r\n", b"not valid HTTP/1.1"),
                             (b"BREW /echo HTTP/1.1\r\nhost: x\r\n\r\n", b"Invalid method"),
                             (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999999999999999999\r\n\r\n",
                              b"Content-Length overflow")):
            client = connect()
            await client.send_all(attack)
            await refused(client, 400, note)
        await served(connect)
    run(test)


def test_bodies_parsed_ahead_stay_counted_until_their_own_answer():
    seen: list[int] = []

    async def main():
        async def handler(request: HttpRequest) -> HttpResponse:
            seen.append(server.bodies.used)         # what every connection holds now
            return HttpResponse(200, b"{}")
        server = Http1Server(handler, LIMITS, what="REST")
        async with trio.open_nursery() as nursery:
            client, served_side = trio.testing.memory_stream_pair()
            nursery.start_soon(server.serve_stream, served_side)
            await client.send_all(b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 300\r\n\r\n" + b"a" * 300 +
                                  b"POST /b HTTP/1.1\r\nhost: x\r\ncontent-length: 200\r\nconnection: close\r\n\r\n"
                                  + b"b" * 200)
            reply = await read_all(client)
            assert reply.count(b"HTTP/1.1 200 OK") == 2
            nursery.cancel_scope.cancel()
        assert server.bodies.used == 0
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    # both bodies came in one read and were parsed together: the second stays counted while the
    # first is answered, and only its own bytes once the first is
    assert seen == [500, 200]


def test_a_closed_connection_leaves_no_parser_for_the_cyclic_collector(monkeypatch):
    import gc
    import weakref

    import xlaserve.frontend.http1 as http1
    made: list[weakref.ref] = []

    class Tracked(http1._Parser):
        __slots__ = ("__weakref__",)

        def __init__(self, *args) -> None:
            super().__init__(*args)
            made.append(weakref.ref(self))
    monkeypatch.setattr(http1, "_Parser", Tracked)

    async def test(server, connect):
        for _ in range(20):
            client = connect()
            await client.send_all(b"GET /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            await read_all(client)
        await trio.sleep(1)
    gc.collect()
    gc.disable()
    try:
        run(test)
        # llhttp's parser holds the callbacks' object and it holds the parser: a connection that
        # ends breaks that cycle, so nothing waits for the collector
        assert len(made) == 20 and not any(ref() is not None for ref in made)
    finally:
        gc.enable()
