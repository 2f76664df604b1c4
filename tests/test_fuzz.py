"""A seeded subset of the transport fuzzer (scripts/fuzz_transport.py) against a real server:
the same generators, a fixed seed, a few dozen cases per family. The full campaign (100,000+
cases) and its numbers are in docs/security.md.

The seed fixes the cases for a given set of loaded modules: Hypothesis also draws constants from
the local modules it finds imported, so a lone run of this file and a full-suite run may send
different cases. A failure's message carries the exact bytes sent."""
from __future__ import annotations

import socket
import time

import pytest

from examples.export_examples import export_simple
from tests.conftest import serve
from tests.trio_thread import load_fuzzer

SEED = 20261124
CASES = 60        # per family; the four families together take a few seconds


fuzz = load_fuzzer()


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    """A static-mode server over the ``simple`` bundle only (RepositoryModelLoad/Unload are fuzzed
    and must be refused; the health check infers on ``simple``)."""
    tmp = tmp_path_factory.mktemp("fuzz")
    export_simple(tmp / "models", (1, 2, 4, 8))
    with serve(tmp / "server", tmp / "models") as server:
        yield server
    assert server.process.returncode == 0, server.log()


def _fuzzer(server) -> "fuzz.Fuzzer":
    target = fuzz.Target(server.grpc_port, server.process, server.log_path)
    return fuzz.Fuzzer(target, case_timeout=2.0, check_every=0, out=None, log=lambda line: None)


def _failures(report) -> str:
    return "\n".join(f"{f.case_id}: {f.outcome}: {f.detail[:400]}\n  bytes: {f.data.hex()[:400]}"
                     for f in report.failures)


@pytest.mark.parametrize("family", ["frames", "hpack", "grpc", "protobuf"])
def test_seeded_fuzz_subset(fuzz_server, family):
    fuzzer = _fuzzer(fuzz_server)
    report = fuzzer.campaign([family], CASES, SEED, time_limit=60)
    fuzzer.health_check()
    assert report.total == CASES
    assert not report.failures, _failures(report)
    assert fuzz_server.process.poll() is None


def test_empty_header_name_is_a_protocol_error(fuzz_server):
    """The fuzzer's first find, as bytes: a HEADERS block holding a literal field with an empty
    name. RFC 9113 8.2.1 makes that a malformed request (a stream error, PROTOCOL_ERROR, or a
    connection error); the server must answer one of those, and log no traceback."""
    before = len(fuzz_server.log())
    block = fuzz.request_block(fuzz.SERVICE + "ServerLive") + fuzz.hp_literal("", b"v")
    case = fuzz.CLIENT_SETUP + fuzz.frame(fuzz.HEADERS, fuzz.END_HEADERS | fuzz.END_STREAM, 1, block)
    conn = fuzz.Connection(fuzz_server.grpc_port, 5.0)
    try:
        deadline = time.monotonic() + 5.0
        conn.send(case, deadline)
        conn.wait(lambda: conn.dead or 1 in conn.streams and conn.streams[1].rst is not None, deadline)
        refused = (conn.goaway is not None and conn.goaway[1] == 1) or \
            (1 in conn.streams and conn.streams[1].rst == 1)
    finally:
        conn.close()
    time.sleep(0.2)     # the server logs after it closes the connection
    assert refused, f"goaway={conn.goaway} closed={conn.closed} streams={conn.streams}"
    assert "Traceback" not in fuzz_server.log()[before:]


def test_fuzzer_reports_a_server_that_stops_answering(tmp_path):
    """The fuzzer is not blind: a listener that accepts and never answers is a hang."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        fuzzer = fuzz.Fuzzer(fuzz.Target(port, None, None), case_timeout=0.3, check_every=0, out=tmp_path,
                             log=lambda line: None)
        report = fuzzer.campaign(["protobuf"], 2, SEED)
    assert report.outcomes["protobuf"]["hang"] == 2
    assert [f.outcome for f in report.failures] == ["hang", "hang"]
    assert sorted(p.suffix for p in (tmp_path / "failures").iterdir()) == [".bin", ".bin", ".json", ".json"]


def test_reply_labels():
    """What a finished stream is counted as; only grpc-status 13 on a gRPC response fails."""
    def reply(*blocks, rst=None):
        return fuzz.StreamReply(headers=[list(b.items()) for b in blocks], ended=rst is None, rst=rst)
    assert fuzz.reply_label(reply({":status": "200", "grpc-status": "3"})) == ("grpc-INVALID_ARGUMENT", False)
    assert fuzz.reply_label(reply({":status": "200", "content-type": "application/grpc"},
                                  {"grpc-status": "13"})) == ("grpc-INTERNAL", True)
    assert fuzz.reply_label(reply({":status": "415", "grpc-status": "13"})) == ("http-415/grpc-INTERNAL", False)
    assert fuzz.reply_label(reply({":status": "200"})) == ("no-grpc-status", True)
    assert fuzz.reply_label(reply(rst=1)) == ("rst-PROTOCOL_ERROR", False)
    assert fuzz.reply_label(reply(rst=2)) == ("rst-INTERNAL_ERROR", True)


def test_a_lying_length_is_completed_or_half_closed():
    fuzzer = fuzz.Fuzzer(fuzz.Target(0, None, None), log=lambda line: None)
    honest = fuzz.frame(fuzz.PING, 0, 0, bytes(8))
    assert fuzzer._synced(honest)[0] == honest
    short = fuzz.frame(fuzz.DATA, 0, 1, b"abc", length=100)          # 97 bytes missing: sent as zeros
    payload, ping = fuzzer._synced(short)
    assert payload == short + bytes(97) and len(ping) == 8
    partial = honest + b"\0\0"                                       # a frame header cut short
    assert fuzzer._synced(partial)[0] == partial + bytes(7)
    huge = fuzz.frame(fuzz.DATA, 0, 1, b"abc", length=2**24 - 1)     # cannot be completed cheaply
    assert fuzzer._synced(huge) == (huge, None)


def test_tracebacks_are_grouped_by_their_innermost_frame():
    log = ('2026-11-24 03:03:23,417 ERROR xlaserve.grpc: a gRPC connection failed\n'
           '  + Exception Group Traceback (most recent call last):\n'
           '  |   File "/x/xlaserve/frontend/grpc_server.py", line 882, in _connection\n'
           '  | ExceptionGroup: Exceptions from Trio nursery (1 sub-exception)\n'
           '    |   File "/x/xlaserve/frontend/grpc_server.py", line 476, in _new_call\n'
           '    | IndexError: string index out of range\n')
    assert fuzz.signature("traceback", log) == \
        "traceback: grpc_server.py:476 in _new_call: IndexError: string index out of range"
    assert fuzz.signature("hang", "stream 1 unanswered") == "hang"


def test_each_logged_error_is_its_own_record():
    lines = ["2026-11-24 03:03:23,417 ERROR a: one", "Traceback (most recent call last):", "ValueError: x",
             "2026-11-24 03:03:23,418 ERROR b: two", "  + Exception Group Traceback (most recent call last):",
             "Traceback (most recent call last):", "KeyError: y"]
    assert [len(r) for r in fuzz.log_records(lines)] == [3, 2, 2]
