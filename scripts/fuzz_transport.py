#!/usr/bin/env python3
"""Fuzz a running xlaserve worker's gRPC transport over loopback, bytes in and bytes out.

    python scripts/fuzz_transport.py --cases 2000 --seed 1 --out /tmp/fuzz
    python scripts/fuzz_transport.py --replay /tmp/fuzz/failures/<case>.bin

It exports the ``simple`` example bundle (or serves ``--repo``), starts ``python -m xlaserve run``
on loopback, and throws Hypothesis-generated inputs at its gRPC port, in four families:

- ``frames``: a valid preface, then HTTP/2 frames of any type, flags, stream id and length
  (lengths that lie included), padding, SETTINGS, WINDOW_UPDATE, PRIORITY, RST_STREAM, GOAWAY,
  CONTINUATION chains. One connection per case.
- ``hpack``: valid and invalid HPACK blocks (indices out of range, bad Huffman, table-size
  updates in odd places, integer overflows, lengths that lie) in otherwise valid HEADERS of a
  real call. One connection per case (the decoder's table is per connection).
- ``grpc``: valid HTTP/2, then gRPC framing that is not: broken or lying 5-byte prefixes,
  compressed flags without grpc-encoding, bad gzip, truncated and extra messages, bad paths,
  content-types and grpc-timeouts. Connections are reused until a case poisons one.
- ``protobuf``: valid gRPC framing carrying garbage, mutated or valid-looking-but-wrong KServe
  requests (ModelInfer with wrong shapes, dtypes and sizes, and the other methods).

The client knows nothing of the server's HTTP/2 engine: it writes frames and reads frames, so it
works unchanged on any engine. Each case is classified:

- answered: a gRPC status (``grpc-INVALID_ARGUMENT``), an HTTP-level refusal (``http-415/grpc-...``),
  a stream reset (``rst-PROTOCOL_ERROR``), a connection GOAWAY (``goaway-COMPRESSION_ERROR``), a close
  without GOAWAY (``eof``, ``reset``; ``half-closed/eof`` when the fuzzer half-closed first, after a
  frame whose lying length it could not complete), ``ping-ack`` (frames: the connection lives on);
  ``late/...`` when the answer took between 1x and 3x --case-timeout (a loaded machine can starve
  the server);
- failed: ``hang`` (no answer within 3x --case-timeout), ``internal`` (grpc-status 13 on a gRPC
  response, or HTTP/2 INTERNAL_ERROR), ``bad-reply`` (a reply this client cannot parse), ``crash``
  (the server process died), ``traceback`` (a Traceback or ERROR record in the server log after the
  case), ``health-check`` (every --check-every cases the Triton client runs a real inference and
  checks its answer).

Failures are saved under ``--out/failures`` as the exact bytes sent on one fresh connection
(preface included), replayable with ``--replay``. The exit status is 1 on any failure.
"""
from __future__ import annotations

import argparse
import base64
import gzip
import hashlib
import json
import random
import re
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import hpack
import numpy as np
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings, strategies as st
from tritonclient.grpc import service_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
# a log record as ``xlaserve run`` formats them ("%(asctime)s %(levelname)s ..."), and one at ERROR or above
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ [A-Z]+ ")
LOG_ERROR = re.compile(r"^\d{4}-\d\d-\d\d [\d:,.]+ (ERROR|CRITICAL) ", re.MULTILINE)
FAMILIES = ("frames", "hpack", "grpc", "protobuf")

# ---- HTTP/2 wire (RFC 9113) -----------------------------------------------------------------
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
ERROR_CODES = ["NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR", "SETTINGS_TIMEOUT",
               "STREAM_CLOSED", "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL", "COMPRESSION_ERROR",
               "CONNECT_ERROR", "ENHANCE_YOUR_CALM", "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED"]
INTERNAL_ERROR = 2
GRPC_STATUS = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
               "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED",
               "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"]
# What this client advertises: windows large enough that the server never waits on us.
CLIENT_STREAM_WINDOW = 1 << 24
CLIENT_CONN_WINDOW = 1 << 30
SAFE_FRAME = 16384                    # the smallest MAX_FRAME_SIZE a server may advertise

SERVICE = "/inference.GRPCInferenceService/"
# method -> (request class, a valid request for the served model)
METHODS: dict[str, tuple[type, Callable[[], object]]] = {
    "ServerLive": (pb.ServerLiveRequest, lambda: pb.ServerLiveRequest()),
    "ServerReady": (pb.ServerReadyRequest, lambda: pb.ServerReadyRequest()),
    "ModelReady": (pb.ModelReadyRequest, lambda: pb.ModelReadyRequest(name="simple")),
    "ServerMetadata": (pb.ServerMetadataRequest, lambda: pb.ServerMetadataRequest()),
    "ModelMetadata": (pb.ModelMetadataRequest, lambda: pb.ModelMetadataRequest(name="simple")),
    "ModelConfig": (pb.ModelConfigRequest, lambda: pb.ModelConfigRequest(name="simple")),
    "ModelStatistics": (pb.ModelStatisticsRequest, lambda: pb.ModelStatisticsRequest(name="simple")),
    "RepositoryIndex": (pb.RepositoryIndexRequest, lambda: pb.RepositoryIndexRequest()),
    "RepositoryModelLoad": (pb.RepositoryModelLoadRequest, lambda: pb.RepositoryModelLoadRequest(model_name="simple")),
    "RepositoryModelUnload": (pb.RepositoryModelUnloadRequest,
                              lambda: pb.RepositoryModelUnloadRequest(model_name="nonexistent")),
    "ModelInfer": (pb.ModelInferRequest, lambda: valid_infer_request(1)),
    "ModelStreamInfer": (pb.ModelInferRequest, lambda: valid_infer_request(2)),
    "SystemSharedMemoryStatus": (pb.SystemSharedMemoryStatusRequest, lambda: pb.SystemSharedMemoryStatusRequest()),
    "SystemSharedMemoryRegister": (pb.SystemSharedMemoryRegisterRequest,
                                   lambda: pb.SystemSharedMemoryRegisterRequest(name="r", key="/fuzz", byte_size=64)),
    "SystemSharedMemoryUnregister": (pb.SystemSharedMemoryUnregisterRequest,
                                     lambda: pb.SystemSharedMemoryUnregisterRequest(name="r")),
    "CudaSharedMemoryStatus": (pb.CudaSharedMemoryStatusRequest, lambda: pb.CudaSharedMemoryStatusRequest()),
    "CudaSharedMemoryRegister": (pb.CudaSharedMemoryRegisterRequest, lambda: pb.CudaSharedMemoryRegisterRequest()),
    "CudaSharedMemoryUnregister": (pb.CudaSharedMemoryUnregisterRequest,
                                   lambda: pb.CudaSharedMemoryUnregisterRequest()),
    "TraceSetting": (pb.TraceSettingRequest, lambda: pb.TraceSettingRequest()),
    "LogSettings": (pb.LogSettingsRequest, lambda: pb.LogSettingsRequest()),
}
# RepositoryModelLoad/Unload are fuzzed only against a model_control_mode: static node (the one
# this script writes), where both are refused: the fuzzer must not unload the model it checks.


METHOD_NAMES = st.sampled_from(tuple(sorted(METHODS)))
# ModelInfer most: it parses tensors. (xlaserve answers ModelStreamInfer UNIMPLEMENTED.)
PROTOBUF_METHODS = st.sampled_from(("ModelInfer",) * 12 + tuple(sorted(METHODS)))


def valid_infer_request(rows: int) -> pb.ModelInferRequest:
    a = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16)
    request = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        request.inputs.add(name=name, datatype="INT32", shape=[rows, 16])
        request.raw_input_contents.append(a.tobytes())
    return request


def frame(ftype: int, flags: int, sid: int, payload: bytes, length: int | None = None) -> bytes:
    n = len(payload) if length is None else length
    return struct.pack(">IBI", (n & 0xFFFFFF) << 8 | (ftype & 0xFF), flags & 0xFF, sid & 0xFFFFFFFF) + payload


def settings_payload(pairs) -> bytes:
    return b"".join(struct.pack(">HI", k & 0xFFFF, v & 0xFFFFFFFF) for k, v in pairs)


CLIENT_SETUP = (PREFACE + frame(SETTINGS, 0, 0, settings_payload([(2, 0), (4, CLIENT_STREAM_WINDOW)]))
                + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", CLIENT_CONN_WINDOW - 65535)))

# ---- HPACK encoding, this client's own (RFC 7541), so that it can also encode wrongly ---------
_huffman = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
# a name's lowest static index (the table repeats names: ":method" is 2 and 3)
STATIC_NAMES = {name.decode(): i + 1
                for i, (name, _) in reversed(list(enumerate(hpack.table.HeaderTable.STATIC_TABLE)))}
STATIC_PAIRS = {(n.decode(), v.decode()): i + 1 for i, (n, v) in enumerate(hpack.table.HeaderTable.STATIC_TABLE)}


def hp_int(value: int, prefix: int, first: int) -> bytes:
    """``value`` as an HPACK integer with a ``prefix``-bit prefix; ``first`` holds the high bits."""
    out = hpack.hpack.encode_integer(value, prefix)
    out[0] |= first
    return bytes(out)


def hp_str(data: bytes, huffman: bool = False) -> bytes:
    if huffman:
        data = _huffman.encode(data)
    return hp_int(len(data), 7, 0x80 if huffman else 0) + data


def hp_literal(name: str | int, value: bytes, kind: str = "plain", huffman: bool = False) -> bytes:
    """A literal field; ``name`` an index into the table or a new name. ``kind``: plain (without
    indexing), index (incremental indexing) or never (never indexed)."""
    prefix, first = {"plain": (4, 0x00), "index": (6, 0x40), "never": (4, 0x10)}[kind]
    if isinstance(name, int):
        head = hp_int(name, prefix, first)
    else:
        head = bytes([first]) + hp_str(name.encode(), huffman)
    return head + hp_str(value, huffman)


def hp_field(name: str, value: str, how: int = 0) -> bytes:
    """A valid representation of ``name: value``; ``how`` picks among several."""
    if how % 4 == 0 and (name, value) in STATIC_PAIRS:
        return hp_int(STATIC_PAIRS[name, value], 7, 0x80)
    huffman = bool(how & 4)
    if how % 2 and name in STATIC_NAMES:
        return hp_literal(STATIC_NAMES[name], value.encode(), ("plain", "never")[how >> 3 & 1], huffman)
    return hp_literal(name, value.encode(), ("plain", "never")[how >> 3 & 1], huffman)


def request_fields(path: str, content_type: str = "application/grpc", extra=()) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "127.0.0.1"),
            ("content-type", content_type), ("te", "trailers"), *extra]


def request_block(path: str, content_type: str = "application/grpc", extra=(), how: int = 0) -> bytes:
    return b"".join(hp_field(n, v, how) for n, v in request_fields(path, content_type, extra))


def grpc_message(body: bytes, flag: int = 0, length: int | None = None) -> bytes:
    return struct.pack(">BI", flag & 0xFF, (len(body) if length is None else length) & 0xFFFFFFFF) + body


# ---- cases ---------------------------------------------------------------------------------
MAIN = -1   # the case's own stream: the next unused stream id of the connection it is sent on


@dataclass(frozen=True)
class Frame:
    ftype: int
    flags: int
    sid: int
    payload: bytes
    length: int | None = None      # the length field when it lies

    def render(self, main: int) -> bytes:
        return frame(self.ftype, self.flags, main if self.sid == MAIN else self.sid, self.payload, self.length)


@dataclass(frozen=True)
class Raw:
    data: bytes

    def render(self, main: int) -> bytes:
        return self.data


@dataclass(frozen=True)
class Case:
    family: str
    parts: tuple
    answer_expected: bool      # the MAIN stream is half-closed by the client and must be answered
    fresh: bool                # needs a connection of its own
    preface: bytes = CLIENT_SETUP
    trickle: bool = False      # the client grants flow-control window only as DATA arrives

    def render(self, main: int = 1) -> bytes:
        return b"".join(p.render(main) for p in self.parts)


_ONE_IN = {n: st.sampled_from((False,) * (n - 1) + (True,)) for n in range(2, 42)}


def chance(draw, n: int) -> bool:
    """True about once in ``n`` draws. (``integers(0, n - 1) == 0`` is far likelier: Hypothesis
    favours small and boundary values.)"""
    return draw(_ONE_IN[n])


def blob(draw, max_size: int, min_size: int = 0) -> bytes:
    """Bytes up to ``max_size``: drawn directly when short, else expanded from a drawn seed (keeps
    Hypothesis's choice sequence small for big payloads)."""
    if max_size <= 64 or draw(st.booleans()):
        return draw(st.binary(min_size=min_size, max_size=min(max_size, 64)))
    size = draw(st.integers(min_size, max_size))
    return random.Random(draw(st.integers(0, 2**32))).randbytes(size)


# -- frames family --
STREAM_IDS = st.one_of(st.sampled_from((0, 1, 1, 3, 5, 2, 4, 0x7FFFFFFF, 0x80000001)), st.integers(0, 2**32 - 1))
ANY_FLAGS = st.one_of(st.sampled_from((0, END_STREAM, END_HEADERS, END_STREAM | END_HEADERS, PADDED,
                                       PADDED | END_HEADERS, PRIORITY_FLAG | END_HEADERS, 0xFF)),
                      st.integers(0, 255))
SETTING_IDS = st.one_of(st.integers(1, 6), st.integers(0, 0xFFFF), st.just(8), st.just(9))
SETTING_VALUES = st.one_of(st.sampled_from((0, 1, 2, 16383, 16384, 65535, 65536, 2**24 - 1, 2**24,
                                            2**31 - 1, 2**31, 2**32 - 1)), st.integers(0, 2**32 - 1))
# mostly streams a client may use, so that a case gets past the first frame more often than not
CLIENT_IDS = st.sampled_from((1, 3, 5, 7))
ERROR_CODE = st.one_of(st.integers(0, 14), st.integers(0, 2**32 - 1))


@st.composite
def padded(draw, body: bytes) -> tuple[int, bytes]:
    """``body`` with PADDED framing (flag, payload); the pad length may exceed the frame."""
    pad = draw(st.one_of(st.integers(0, 16), st.integers(0, 255)))
    actual = draw(st.one_of(st.just(pad), st.integers(0, 16)))
    return PADDED, bytes([pad]) + body + b"\0" * actual


FRAME_KINDS = st.sampled_from(("data", "data", "headers", "priority", "rst", "settings", "settings", "push", "ping",
                               "goaway", "window", "window", "continuation", "unknown", "chain", "call", "call",
                               "garbage", "flood", "rapid-reset"))


def wrong_length(draw, body: bytes) -> bytes:
    """``body``, or now and then one byte short, one long, or empty."""
    return draw(st.sampled_from((body[:-1], body + b"\0", b""))) if chance(draw, 4) else body


@st.composite
def any_frame(draw) -> list:
    kind = draw(FRAME_KINDS)
    sid = draw(STREAM_IDS) if chance(draw, 4) else draw(CLIENT_IDS)
    flags = draw(ANY_FLAGS)
    if kind == "data":
        body = blob(draw, 2048)
        if draw(st.booleans()):
            pad_flag, body = draw(padded(body))
            flags |= pad_flag
        out = [Frame(DATA, flags, sid, body)]
    elif kind in ("headers", "call"):
        path = SERVICE + draw(METHOD_NAMES)
        body = request_block(path, how=draw(st.integers(0, 15))) if kind == "call" or draw(st.booleans()) \
            else blob(draw, 256)
        if kind == "call":      # a real call, half-closed or not (DATA may follow on it)
            sid = draw(st.sampled_from((1, 3, 5, 7, 0x7FFFFFFF)))
            flags = END_HEADERS | draw(st.sampled_from((0, END_STREAM)))
        if flags & PRIORITY_FLAG:
            body = struct.pack(">IB", draw(STREAM_IDS), draw(st.integers(0, 255))) + body
        if draw(st.booleans()):
            pad_flag, body = draw(padded(body))
            flags |= pad_flag
        out = [Frame(HEADERS, flags, sid, body)]
    elif kind == "priority":
        body = struct.pack(">IB", draw(st.one_of(st.just(sid), STREAM_IDS)), draw(st.integers(0, 255)))
        out = [Frame(PRIORITY, flags, sid, wrong_length(draw, body))]
    elif kind == "rst":
        body = struct.pack(">I", draw(ERROR_CODE))
        out = [Frame(RST_STREAM, flags, sid, wrong_length(draw, body))]
    elif kind == "settings":
        pairs = draw(st.lists(st.tuples(SETTING_IDS, SETTING_VALUES), max_size=6))
        body = settings_payload(pairs)
        if chance(draw, 6):
            body = body[:max(0, len(body) - draw(st.integers(1, 5)))]
        out = [Frame(SETTINGS, draw(st.sampled_from((0, 0, ACK, flags))), draw(st.sampled_from((0, 0, 0, sid))), body)]
    elif kind == "push":
        out = [Frame(PUSH_PROMISE, flags, sid, struct.pack(">I", draw(STREAM_IDS)) + blob(draw, 64))]
    elif kind == "ping":
        body = draw(st.binary(min_size=8, max_size=8))
        out = [Frame(PING, draw(st.sampled_from((0, ACK, flags))), sid if chance(draw, 4) else 0,
                     wrong_length(draw, body))]
    elif kind == "goaway":
        body = struct.pack(">II", draw(STREAM_IDS), draw(ERROR_CODE)) + blob(draw, 64)
        out = [Frame(GOAWAY, flags, draw(st.sampled_from((0, 0, sid))), draw(st.sampled_from((body, body[:7]))))]
    elif kind == "window":
        inc = draw(st.one_of(st.sampled_from((0, 1, 65535, 2**31 - 1, 2**31, 2**32 - 1)), st.integers(0, 2**32 - 1)))
        body = struct.pack(">I", inc)
        out = [Frame(WINDOW_UPDATE, flags, draw(st.sampled_from((0, sid, 1))), wrong_length(draw, body))]
    elif kind == "flood":       # many small control frames: PINGs, SETTINGS, PRIORITY, empty DATA
        n = draw(st.integers(1, 2000))
        one = draw(st.sampled_from((Frame(PING, 0, 0, bytes(8)), Frame(SETTINGS, 0, 0, b""),
                                    Frame(PRIORITY, 0, 3, struct.pack(">IB", 1, 16)), Frame(DATA, 0, 1, b""),
                                    Frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", 1)))))
        out = [one] * n
    elif kind == "rapid-reset":   # open streams and cancel them at once (CVE-2023-44487's pattern)
        n = draw(st.integers(1, 500))
        block = request_block(SERVICE + draw(st.sampled_from(("ServerLive", "ModelInfer", "ModelStreamInfer"))))
        first = draw(st.sampled_from((1, 101, 1001)))
        out = []
        for i in range(n):
            sid_i = first + 2 * i
            out += [Frame(HEADERS, END_HEADERS, sid_i, block), Frame(RST_STREAM, 0, sid_i, struct.pack(">I", 8))]
    elif kind == "continuation":
        out = [Frame(CONTINUATION, flags, sid, blob(draw, 128))]
    elif kind == "unknown":
        out = [Frame(draw(st.integers(10, 255)), flags, sid, blob(draw, 256))]
    elif kind == "chain":     # a header block split over HEADERS + CONTINUATIONs, sometimes broken
        block = request_block(SERVICE + "ServerLive", how=draw(st.integers(0, 15)))
        cuts = sorted(draw(st.lists(st.integers(0, len(block)), max_size=4)))
        pieces = [block[i:j] for i, j in zip([0, *cuts], [*cuts, len(block)])]
        chain_sid = draw(st.sampled_from((1, 3, sid)))
        out = [Frame(HEADERS, END_STREAM, chain_sid, pieces[0])]
        for i, piece in enumerate(pieces[1:], 1):
            last = i == len(pieces) - 1
            out.append(Frame(CONTINUATION, END_HEADERS if last else 0, chain_sid, piece))
        if len(pieces) == 1:
            out[0] = Frame(HEADERS, END_STREAM | END_HEADERS, chain_sid, pieces[0])
        breakage = draw(st.sampled_from(("none", "none", "drop-last", "wrong-sid", "interleave", "no-end",
                                         "many-empty")))
        if breakage == "drop-last" and len(out) > 1:
            out.pop()
        elif breakage == "wrong-sid" and len(out) > 1:
            last = out[-1]
            out[-1] = Frame(CONTINUATION, last.flags, chain_sid + 2, last.payload)
        elif breakage == "interleave":
            out.insert(1, Frame(PING, 0, 0, b"\0" * 8))
        elif breakage == "no-end":
            out = [Frame(f.ftype, f.flags & ~END_HEADERS, f.sid, f.payload) for f in out]
        elif breakage == "many-empty":
            n = draw(st.integers(1, 300))
            out[-1:-1] = [Frame(CONTINUATION, 0, chain_sid, b"")] * n
    else:
        out = [Raw(blob(draw, 512))]
    if out and isinstance(out[0], Frame) and chance(draw, 20):   # a length that lies
        f = out[0]
        lie = draw(st.one_of(st.integers(0, len(f.payload) + 32), st.integers(0, 2**24 - 1)))
        out[0] = Frame(f.ftype, f.flags, f.sid, f.payload, lie)
    return out


@st.composite
def frames_case(draw) -> Case:
    parts = [p for group in draw(st.lists(any_frame(), min_size=1, max_size=6)) for p in group]
    if draw(st.booleans()):    # an open call first, so that DATA, RST_STREAM, WINDOW_UPDATE on stream 1 mean something
        parts.insert(0, Frame(HEADERS, END_HEADERS, 1, request_block(SERVICE + draw(METHOD_NAMES))))
    preface = CLIENT_SETUP
    if chance(draw, 41):     # a broken preface, now and then
        cut = draw(st.integers(0, len(PREFACE) - 1))
        preface = PREFACE[:cut] + draw(st.binary(min_size=1, max_size=8)) + CLIENT_SETUP[len(PREFACE):]
    return Case("frames", tuple(parts), answer_expected=False, fresh=True, preface=preface)


# -- hpack family --
REQUIRED = request_fields(SERVICE + "ServerLive")


@st.composite
def bad_representation(draw) -> bytes:
    kind = draw(st.sampled_from(("index0", "index-range", "name-index-range", "int-overflow", "long-string",
                                 "huge-length", "bad-huffman", "huffman-eos", "huffman-padding", "size-update",
                                 "size-update-big", "upper-name", "odd-name", "empty-name", "pseudo-unknown",
                                 "connection-header", "te-gzip", "dup-pseudo", "huge-value", "many-fields",
                                 "dynamic-ref", "random")))
    if kind == "index0":
        return b"\x80"
    if kind == "index-range":
        return hp_int(draw(st.one_of(st.integers(62, 200), st.integers(62, 2**40))), 7, 0x80)
    if kind == "name-index-range":
        return hp_int(draw(st.integers(62, 2**32)), draw(st.sampled_from((4, 6))), 0) + hp_str(b"x")
    if kind == "int-overflow":
        n = draw(st.integers(5, 24))
        return draw(st.sampled_from((b"\xff", b"\x7f", b"\x0f", b"\x3f"))) + b"\xff" * n + b"\x7f"
    if kind == "long-string":
        data = blob(draw, 64)
        return b"\x00" + hp_int(len(data) + draw(st.integers(1, 1000)), 7, 0) + data
    if kind == "huge-length":
        return b"\x00" + hp_int(draw(st.integers(2**20, 2**40)), 7, draw(st.sampled_from((0, 0x80)))) + b"ab"
    if kind == "bad-huffman":
        data = draw(st.binary(min_size=1, max_size=32))
        return b"\x00" + hp_str(b"x-fuzz") + hp_int(len(data), 7, 0x80) + data
    if kind == "huffman-eos":
        eos = b"\xff\xff\xff\xfc"    # EOS's 30 ones, then padding: a decoder must reject it
        return b"\x00" + hp_str(b"x-fuzz") + hp_int(len(eos), 7, 0x80) + eos
    if kind == "huffman-padding":
        enc = bytearray(_huffman.encode(draw(st.sampled_from((b"a", b"abc", b"trailers", b"/x")))))
        how = draw(st.sampled_from(("zero-pad", "extra-byte", "cut")))
        if how == "zero-pad":
            enc[-1] &= 0xF0
        elif how == "extra-byte":
            enc.append(0xFF)
        else:
            enc = enc[:-1] or bytearray(b"\x00")
        return b"\x00" + hp_str(b"x-fuzz") + hp_int(len(enc), 7, 0x80) + bytes(enc)
    if kind == "size-update":
        return hp_int(draw(st.integers(0, 4096)), 5, 0x20)
    if kind == "size-update-big":
        return hp_int(draw(st.one_of(st.integers(4097, 2**20), st.integers(2**20, 2**32))), 5, 0x20)
    if kind == "upper-name":
        return hp_literal("Content-Type", b"application/grpc")
    if kind == "odd-name":
        return hp_literal(draw(st.sampled_from(("x y", "x:y", "x\0y", "x\r\ny", "\xff", "é"))), b"v")
    if kind == "empty-name":
        return hp_literal("", draw(st.sampled_from((b"", b"v"))))
    if kind == "pseudo-unknown":
        return hp_literal(draw(st.sampled_from((":status", ":protocol", ":x", ":"))), b"200")
    if kind == "connection-header":
        return hp_literal(draw(st.sampled_from(("connection", "keep-alive", "transfer-encoding", "upgrade"))), b"close")
    if kind == "te-gzip":
        return hp_literal("te", b"gzip")
    if kind == "dup-pseudo":
        return hp_field(*draw(st.sampled_from(REQUIRED[:4])), draw(st.integers(0, 15)))
    if kind == "huge-value":
        return hp_literal("x-big", b"v" * draw(st.integers(4000, 70000)), draw(st.sampled_from(("plain", "index"))))
    if kind == "many-fields":
        return hp_literal("x-m", b"1") * draw(st.integers(100, 3000))
    if kind == "dynamic-ref":      # insert one entry, then refer to it and past it
        entry = hp_literal("x-dyn", b"v", "index")
        return entry + hp_int(62, 7, 0x80) + hp_int(draw(st.integers(62, 70)), 7, 0x80)
    return draw(st.binary(max_size=64))


@st.composite
def hpack_case(draw) -> Case:
    method = draw(st.sampled_from(("ServerLive", "ModelReady", "ModelInfer")))
    fields = [(n, v) for n, v in request_fields(SERVICE + method)]
    if draw(st.booleans()):
        fields = draw(st.permutations(fields))
    if chance(draw, 5) and fields:
        fields.pop(draw(st.integers(0, len(fields) - 1)))
    reps = [hp_field(n, v, draw(st.integers(0, 15))) for n, v in fields]
    if draw(st.booleans()):          # valid table use: insert with incremental indexing, then refer
        reps.append(hp_literal("x-meta", b"abc", "index", draw(st.booleans())) + hp_int(62, 7, 0x80))
    for _ in range(draw(st.integers(0, 3))):
        reps.insert(draw(st.integers(0, len(reps))), draw(bad_representation()))
    block = b"".join(reps)
    if chance(draw, 6):              # a byte-level mutation
        pos = draw(st.integers(0, max(0, len(block) - 1)))
        op = draw(st.sampled_from(("flip", "cut", "insert")))
        if op == "flip" and block:
            block = block[:pos] + bytes([block[pos] ^ (1 << draw(st.integers(0, 7)))]) + block[pos + 1:]
        elif op == "cut":
            block = block[:pos]
        else:
            block = block[:pos] + draw(st.binary(min_size=1, max_size=4)) + block[pos:]
    end_stream_on_headers = chance(draw, 4)
    # split into HEADERS + CONTINUATIONs no larger than a server must accept
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(block) - 1)), max_size=3))
                      + list(range(SAFE_FRAME, len(block), SAFE_FRAME))))
    pieces = [block[i:j] for i, j in zip([0, *cuts], [*cuts, len(block)])]
    es = END_STREAM if end_stream_on_headers else 0
    parts = [Frame(HEADERS, es | (END_HEADERS if len(pieces) == 1 else 0), 1, pieces[0])]
    parts += [Frame(CONTINUATION, END_HEADERS if i == len(pieces) - 1 else 0, 1, p) for i, p in enumerate(pieces) if i]
    if not end_stream_on_headers:
        body = METHODS[method][1]().SerializeToString(deterministic=True)
        parts.append(Frame(DATA, END_STREAM, 1, grpc_message(body)))
    return Case("hpack", tuple(parts), answer_expected=True, fresh=True)


# -- grpc family --
_GOOD_PATHS = st.sampled_from(tuple(SERVICE + m for m in METHODS))
ODD_PATHS = st.one_of(st.sampled_from(("", "/", "/inference.GRPCInferenceService", SERVICE, SERVICE + "Nope",
                                        "/other.Service/ModelInfer", "*", "//", SERVICE + "ModelInfer/x",
                                        "/inference.GRPCInferenceService/modelinfer", SERVICE + "ModelInfer?x=1")),
                       st.text(max_size=40).map(lambda s: "/" + s))
CONTENT_TYPES = st.sampled_from(("application/grpc", "application/grpc", "application/grpc+proto",
                                 "application/grpc+json", "application/grpcx", "text/plain", "", "application/json"))
TIMEOUTS = st.one_of(st.sampled_from(("1S", "100m", "5S", "1n", "0m", "99999999H", "123456789S", "1", "S", "-1S",
                                      "1.5S", "1s", "", " 1S", "１S", "10000000000u", "1M")),
                     st.from_regex(r"\A[0-9]{1,9}[HMSmun]\Z"))
ENCODINGS = st.sampled_from(("identity", "gzip", "deflate", "br", "snappy", "", "GZIP"))


@st.composite
def grpc_case(draw) -> Case:
    if chance(draw, 8):
        return draw(trickle_case())
    path = draw(ODD_PATHS) if chance(draw, 8) else draw(_GOOD_PATHS)
    method = path.rsplit("/", 1)[-1] if path.startswith(SERVICE) else None
    extra = []
    content_type = draw(CONTENT_TYPES) if chance(draw, 5) else "application/grpc"
    if draw(st.booleans()):
        extra.append(("grpc-timeout", draw(TIMEOUTS)))
    if chance(draw, 4):
        extra.append(draw(st.sampled_from((("grpc-accept-encoding", "gzip"), ("x-trace-bin", "!!notbase64"),
                                          ("x-meta-bin", base64.b64encode(b"\0\1").decode()), ("user-agent", "fuzz")))))
    fields = request_fields(path, content_type, extra)
    if chance(draw, 20):
        fields[0] = (":method", draw(st.sampled_from(("GET", "PUT", "post", ""))))
    valid = METHODS[method][1]().SerializeToString(deterministic=True) if method in METHODS else b""
    body = bytearray()
    used = set()
    for _ in range(draw(st.sampled_from((1, 1, 1, 0, 2, 3)))):
        kind = draw(st.sampled_from(("valid", "valid", "gzip", "deflate", "bad-gzip", "random", "empty")))
        payload = {"valid": valid, "gzip": gzip.compress(valid, mtime=0), "deflate": zlib.compress(valid),
                   "bad-gzip": gzip.compress(valid, mtime=0)[:draw(st.integers(0, 12))] + draw(st.binary(max_size=8)),
                   "random": blob(draw, 256), "empty": b""}[kind]
        compressed = kind in ("gzip", "deflate", "bad-gzip")
        used.add("deflate" if kind == "deflate" else "gzip" if compressed else "identity")
        flag = draw(st.integers(0, 255)) if chance(draw, 8) else int(compressed)
        length = None
        if chance(draw, 4):                 # a prefix that lies about the length
            length = draw(st.integers(0, len(payload) + 16)) if draw(st.booleans()) \
                else draw(st.sampled_from((2**31 - 1, 2**31, 2**32 - 1, 2**28 + 1)))
        body += grpc_message(payload, flag, length)
    # grpc-encoding: usually the one the messages use, sometimes none or a wrong one
    if chance(draw, 4):
        encoding = draw(st.one_of(st.none(), ENCODINGS))
    else:
        encoding = "gzip" if "gzip" in used else "deflate" if "deflate" in used else None
    if encoding is not None:
        fields.insert(draw(st.integers(4, len(fields))), ("grpc-encoding", encoding))
    block = b"".join(hp_field(n, v, draw(st.integers(0, 15))) for n, v in fields)
    if body and chance(draw, 5):
        body = body[:draw(st.integers(0, len(body) - 1))]        # a truncated message
    if chance(draw, 10):
        body += draw(st.binary(min_size=1, max_size=4))           # a broken prefix at the end
    parts: list = []
    end = draw(st.sampled_from(("data", "data", "empty-data", "trailers", "headers")))
    parts.append(Frame(HEADERS, END_HEADERS | (END_STREAM if end == "headers" else 0), MAIN, block))
    # random cuts, plus enough that no DATA frame (padding included) passes the smallest MAX_FRAME_SIZE
    cuts = sorted(set(draw(st.lists(st.integers(0, len(body)), max_size=3))
                      + list(range(SAFE_FRAME - 300, len(body), SAFE_FRAME - 300))))
    chunks = [bytes(body[i:j]) for i, j in zip([0, *cuts], [*cuts, len(body)])] if end != "headers" else []
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        flags = END_STREAM if last and end == "data" else 0
        if chance(draw, 6):
            pad = draw(st.integers(0, 255))
            flags |= PADDED
            chunk = bytes([pad]) + chunk + b"\0" * pad
        parts.append(Frame(DATA, flags, MAIN, chunk))
    if end == "empty-data" or (end == "data" and not chunks):
        parts.append(Frame(DATA, END_STREAM, MAIN, b""))
    elif end == "trailers":
        parts.append(Frame(HEADERS, END_HEADERS | END_STREAM, MAIN, hp_literal("x-trailer", b"1")))
    if chance(draw, 10):        # the client gives up at once: the server must cancel and stay well
        parts.append(Frame(RST_STREAM, 0, MAIN, struct.pack(">I", draw(st.sampled_from((8, 0, 1, 2))))))
        return Case("grpc", tuple(parts), answer_expected=False, fresh=False)
    return Case("grpc", tuple(parts), answer_expected=True, fresh=False)


TRICKLE_METHODS = st.sampled_from(("ModelInfer", "ModelMetadata", "ModelConfig", "ServerMetadata",
                                   "RepositoryIndex", "ModelStatistics"))


@st.composite
def trickle_case(draw) -> Case:
    """A valid call from a client with a tiny stream window that it reopens only as DATA arrives:
    the server must send its answer a few bytes at a time and hold the trailers until it is out."""
    method = draw(TRICKLE_METHODS)
    window = draw(st.sampled_from((1, 5, 100, 1000)))
    preface = PREFACE + frame(SETTINGS, 0, 0, settings_payload([(2, 0), (4, window)]))
    body = grpc_message(METHODS[method][1]().SerializeToString(deterministic=True))
    parts = (Frame(HEADERS, END_HEADERS, MAIN, request_block(SERVICE + method, how=draw(st.integers(0, 15)))),
             Frame(DATA, END_STREAM, MAIN, body))
    return Case("grpc", parts, answer_expected=True, fresh=True, preface=preface, trickle=True)


# -- protobuf family --
DTYPES = st.sampled_from(("INT32", "INT32", "FP32", "INT64", "INT8", "UINT8", "BOOL", "BYTES", "FP16", "BF16",
                          "FP64", "UINT64", "", "int32", "junk"))
DIMS = st.one_of(st.sampled_from((1, 1, 2, 16, 16, 4, 8, 0, -1, 17, 3)),
                 st.sampled_from((2**31, 2**32 + 16, 2**62, 2**63 - 1, -2**63, -2)), st.integers(-3, 64))


@st.composite
def infer_parameter(draw) -> pb.InferParameter:
    which = draw(st.sampled_from(("bool_param", "int64_param", "string_param", "double_param", "uint64_param")))
    value = {"bool_param": st.booleans(), "int64_param": st.integers(-2**63, 2**63 - 1),
             "string_param": st.text(max_size=16), "double_param": st.floats(allow_nan=True),
             "uint64_param": st.integers(0, 2**64 - 1)}[which]
    return pb.InferParameter(**{which: draw(value)})


PARAM_NAMES = st.sampled_from(("binary_data_size", "shared_memory_region", "shared_memory_byte_size",
                               "shared_memory_offset", "classification", "binary_data", "binary_data_output",
                               "sequence_id", "sequence_start", "sequence_end", "priority", "timeout", "x"))


def add_parameters(draw, params) -> None:
    for _ in range(draw(st.integers(0, 2))):
        params[draw(PARAM_NAMES)].CopyFrom(draw(infer_parameter()))


@st.composite
def infer_request(draw) -> pb.ModelInferRequest:
    """A ModelInferRequest that looks right and often is not: shapes, dtypes, sizes, names."""
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(("simple", "simple", "simple", "", "nope", "SIMPLE", "simple\0", "../simple",
                                         "s" * 300, "é"))),
        model_version=draw(st.sampled_from(("", "", "1", "0", "-1", "2", "99999999999999999999", "x"))),
        id=draw(st.sampled_from(("", "fuzz", "é" * 10))))
    rows = draw(st.sampled_from((1, 2, 3, 4, 8, 9, 64)))
    names = draw(st.lists(st.sampled_from(("INPUT0", "INPUT1", "INPUT0", "INPUT1", "input", "")),
                          max_size=3, unique=draw(st.booleans())))
    use_raw = draw(st.sampled_from(("raw", "raw", "typed", "mixed")))
    for name in names:
        shape = draw(st.lists(DIMS, max_size=4)) if chance(draw, 3) else [rows, 16]
        tensor = request.inputs.add(name=name, datatype=draw(DTYPES) if chance(draw, 4) else "INT32", shape=shape)
        add_parameters(draw, tensor.parameters)
        n = 1
        for d in shape:
            n *= d
        good = n * 4 if 0 <= n * 4 <= 65536 else None
        size = draw(st.integers(0, 1024)) if good is None or chance(draw, 4) else good
        if use_raw == "raw" or (use_raw == "mixed" and draw(st.booleans())):
            request.raw_input_contents.append(random.Random(draw(st.integers(0, 2**32))).randbytes(size))
        else:
            count = min(size // 4, 4096)
            kind = draw(st.sampled_from(("int_contents", "int64_contents", "fp32_contents", "bytes_contents",
                                         "bool_contents", "uint_contents")))
            value = {"int_contents": [7] * count, "int64_contents": [2**40] * count, "fp32_contents": [0.5] * count,
                     "bytes_contents": [b"ab"] * count, "bool_contents": [True] * count,
                     "uint_contents": [3] * count}[kind]
            getattr(tensor.contents, kind).extend(value)
    if chance(draw, 5):          # raw contents that no input names
        request.raw_input_contents.append(b"\0" * draw(st.integers(0, 256)))
    for _ in range(draw(st.integers(0, 3))):
        out = request.outputs.add(name=draw(st.sampled_from(("OUTPUT0", "OUTPUT1", "nope", ""))))
        add_parameters(draw, out.parameters)
    add_parameters(draw, request.parameters)
    return request


@st.composite
def wire_junk(draw) -> bytes:
    """Protobuf wire-format pieces with wrong types, overlong varints and lying lengths."""
    out = bytearray()
    for _ in range(draw(st.integers(1, 8))):
        number = draw(st.one_of(st.integers(1, 8), st.integers(0, 2**29)))
        wire = draw(st.integers(0, 7))
        key = number << 3 | wire
        out += varint(key)
        if wire == 0:
            out += draw(st.sampled_from((varint(draw(st.integers(0, 2**64 - 1))), b"\xff" * 11, b"\x80")))
        elif wire == 2:
            data = blob(draw, 128)
            out += varint(draw(st.one_of(st.just(len(data)), st.integers(0, 2**63)))) + data
        elif wire == 1:
            out += draw(st.binary(min_size=0, max_size=8))
        elif wire == 5:
            out += draw(st.binary(min_size=0, max_size=4))
    return bytes(out)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


@st.composite
def mutated(draw, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "delete", "insert", "truncate", "duplicate", "byte")))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[pos] = draw(st.sampled_from((0, 0x7F, 0x80, 0xFF, 0x0A, 0x12)))
        elif op == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "truncate":
            del data[pos:]
        else:
            data += data[pos:pos + draw(st.integers(1, 64))]
    return bytes(data)


INFER_KINDS = st.sampled_from(("shaped", "shaped", "shaped", "mutated", "mutated", "junk", "random"))
OTHER_KINDS = st.sampled_from(("mutated", "mutated", "junk", "random", "valid"))


@st.composite
def protobuf_case(draw) -> Case:
    method = draw(PROTOBUF_METHODS)
    infer = method in ("ModelInfer", "ModelStreamInfer")
    messages = []
    for _ in range(draw(st.integers(1, 3)) if method == "ModelStreamInfer" else 1):
        kind = draw(INFER_KINDS if infer else OTHER_KINDS)
        if kind == "shaped" or (kind == "valid" and infer):
            messages.append(draw(infer_request()).SerializeToString(deterministic=True))
        elif kind == "valid":
            messages.append(METHODS[method][1]().SerializeToString(deterministic=True))
        elif kind == "mutated":
            base = draw(infer_request()) if infer and draw(st.booleans()) else METHODS[method][1]()
            messages.append(draw(mutated(base.SerializeToString(deterministic=True))))
        elif kind == "junk":
            messages.append(draw(wire_junk()))
        else:
            messages.append(blob(draw, 1024))
    body = b"".join(grpc_message(m) for m in messages)
    parts: list = [Frame(HEADERS, END_HEADERS, MAIN, request_block(SERVICE + method))]
    chunks = [body[i:i + SAFE_FRAME] for i in range(0, len(body), SAFE_FRAME)] or [b""]
    parts += [Frame(DATA, END_STREAM if i == len(chunks) - 1 else 0, MAIN, c) for i, c in enumerate(chunks)]
    return Case("protobuf", tuple(parts), answer_expected=True, fresh=False)


STRATEGIES = {"frames": frames_case(), "hpack": hpack_case(), "grpc": grpc_case(), "protobuf": protobuf_case()}


# ---- the client side of a connection ---------------------------------------------------------
@dataclass
class StreamReply:
    headers: list = field(default_factory=list)    # every header block, decoded, in order
    ended: bool = False
    rst: int | None = None
    data: int = 0


class Connection:
    """One loopback connection: writes bytes, reads and parses whatever the server sends back."""

    def __init__(self, port: int, timeout: float, trickle: bool = False) -> None:
        self.trickle = trickle
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.decoder = hpack.Decoder()
        self.inbuf = bytearray()
        self.streams: dict[int, StreamReply] = {}
        self.block: tuple[int, int, bytearray] | None = None   # a header block in progress
        self.pings: set[bytes] = set()
        self.goaway: tuple[int, int, bytes] | None = None
        self.closed: str | None = None          # "eof" or "reset"
        self.bad_reply: str | None = None
        self.settings_seen = False
        self.send_window = 65535                # what the server lets us send, connection-wide
        self.stream_window = 65535              # the server's INITIAL_WINDOW_SIZE
        self.stream_credit: dict[int, int] = {}  # per stream: its WINDOW_UPDATEs less the DATA sent
        self.received = 0
        self.next_sid = 1

    def close(self) -> None:
        self.selector.close()
        self.sock.close()

    @property
    def dead(self) -> bool:
        return self.closed is not None or self.goaway is not None or self.bad_reply is not None

    def send(self, data: bytes, deadline: float) -> bool:
        """Write ``data``, reading whatever arrives meanwhile (a server may stop reading while its
        replies are unread). False if the deadline passed first; a closed connection counts as sent."""
        view = memoryview(data)
        while view and self.closed is None:
            if time.monotonic() > deadline:
                return False
            self.selector.modify(self.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
            for _, events in self.selector.select(max(0.0, deadline - time.monotonic())):
                if events & selectors.EVENT_READ:
                    self._read()
                if events & selectors.EVENT_WRITE and self.closed is None:
                    try:
                        view = view[self.sock.send(view):]
                    except BlockingIOError:
                        pass
                    except OSError:
                        self.closed = "reset"
        self.selector.modify(self.sock, selectors.EVENT_READ)
        return True

    def window(self, sid: int) -> int:
        return min(self.send_window, self.stream_window + self.stream_credit.get(sid, 0))

    def send_within_windows(self, parts, sid: int, deadline: float) -> bool:
        """Send a case's frames, each DATA frame only once the server's flow-control windows
        allow it (as a real client must: an engine may close a connection that overruns them).
        False if the deadline passed first."""
        pending = bytearray()
        for part in parts:
            if isinstance(part, Frame) and part.ftype == DATA and part.payload:
                n = len(part.payload)
                if self.window(sid) < n:
                    if not self.send(bytes(pending), deadline):
                        return False
                    pending.clear()
                    if not self.wait(lambda: self.dead or self.window(sid) >= n, deadline):
                        return False
                    if self.dead:
                        return True
                self.send_window -= n
                self.stream_credit[sid] = self.stream_credit.get(sid, 0) - n
            pending += part.render(sid)
        return self.send(bytes(pending), deadline)

    def _send_now(self, data: bytes) -> None:
        """Small control replies (SETTINGS ack, PING ack, WINDOW_UPDATE): best effort."""
        try:
            self.sock.send(data)
        except OSError:
            pass

    def wait(self, done: Callable[[], bool], deadline: float) -> bool:
        """Read until ``done()``, the connection ends, or the deadline; returns ``done()``."""
        while not done() and self.closed is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self.selector.select(remaining):
                self._read()
        return done()

    def _read(self) -> None:
        try:
            chunk = self.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            self.closed = "reset"
            return
        if not chunk:
            self.closed = "eof"
            return
        self.inbuf += chunk
        buf = self.inbuf
        pos = 0
        while len(buf) - pos >= 9:
            lt, flags, sid = struct.unpack_from(">IBI", buf, pos)
            length, ftype, sid = lt >> 8, lt & 0xFF, sid & 0x7FFFFFFF
            if len(buf) - pos - 9 < length:
                break
            self._frame(ftype, flags, sid, bytes(buf[pos + 9:pos + 9 + length]))
            pos += 9 + length
        del buf[:pos]

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if ftype == SETTINGS:
            if not flags & ACK:
                self.settings_seen = True
                for i in range(0, len(payload) - 5, 6):
                    key, value = struct.unpack_from(">HI", payload, i)
                    if key == 4:
                        self.stream_window = value
                self._send_now(frame(SETTINGS, ACK, 0, b""))
        elif ftype == PING:
            if flags & ACK:
                self.pings.add(payload)
            else:
                self._send_now(frame(PING, ACK, 0, payload))
        elif ftype == GOAWAY:
            if len(payload) >= 8:
                last, code = struct.unpack_from(">II", payload)
                self.goaway = (last & 0x7FFFFFFF, code, payload[8:])
            else:
                self.bad_reply = f"GOAWAY of {len(payload)} bytes"
        elif ftype == WINDOW_UPDATE:
            if len(payload) == 4:
                increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
                if sid == 0:
                    self.send_window += increment
                else:
                    self.stream_credit[sid] = self.stream_credit.get(sid, 0) + increment
        elif ftype == RST_STREAM:
            self.streams.setdefault(sid, StreamReply()).rst = struct.unpack(">I", payload[:4].rjust(4, b"\0"))[0]
        elif ftype == DATA:
            reply = self.streams.setdefault(sid, StreamReply())
            reply.data += len(payload)
            reply.ended |= bool(flags & END_STREAM)
            self.received += len(payload)
            if self.trickle and payload:
                increment = struct.pack(">I", len(payload))
                self._send_now((b"" if flags & END_STREAM else frame(WINDOW_UPDATE, 0, sid, increment))
                               + frame(WINDOW_UPDATE, 0, 0, increment))
            elif self.received > CLIENT_CONN_WINDOW // 2:
                self._send_now(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.received)))
                self.received = 0
        elif ftype in (HEADERS, CONTINUATION):
            if ftype == HEADERS:
                start, stop = 0, len(payload)
                if flags & PADDED:
                    start, stop = 1, stop - payload[0]
                if flags & PRIORITY_FLAG:
                    start += 5
                self.block = (sid, flags, bytearray(payload[start:stop]))
            elif self.block is None:
                self.bad_reply = "CONTINUATION without HEADERS"
                return
            else:
                self.block[2].extend(payload)
            if flags & END_HEADERS:
                sid, first_flags, block = self.block
                self.block = None
                try:
                    headers = self.decoder.decode(bytes(block))
                except Exception as exc:        # any decoding failure is the server's bad reply
                    self.bad_reply = f"undecodable header block: {exc!r}"
                    return
                reply = self.streams.setdefault(sid, StreamReply())
                reply.headers.append(headers)
                reply.ended |= bool(first_flags & END_STREAM)


def reply_label(reply: StreamReply) -> tuple[str, bool]:
    """The outcome of one answered stream and whether it is a failure (INTERNAL)."""
    if not reply.ended:
        return (f"rst-{error_name(reply.rst)}", reply.rst == INTERNAL_ERROR)
    merged = {}
    for block in reply.headers:
        merged.update(block)
    status, grpc_status = merged.get(":status"), merged.get("grpc-status")
    if grpc_status is None:
        return ("no-grpc-status" if status == "200" else f"http-{status}", status == "200")
    name = GRPC_STATUS[int(grpc_status)] if grpc_status.isdigit() and int(grpc_status) < len(GRPC_STATUS) \
        else grpc_status
    if status != "200":
        # An HTTP-level refusal of a request that is not gRPC (405, 415): its grpc-status is the
        # server's choice of mapping, not a handler failing; counted apart from INTERNAL.
        return (f"http-{status}/grpc-{name}", False)
    return (f"grpc-{name}", grpc_status == "13")


def error_name(code: int | None) -> str:
    return ERROR_CODES[code] if code is not None and code < len(ERROR_CODES) else str(code)


# ---- the server under test -------------------------------------------------------------------
@dataclass
class Target:
    port: int
    process: subprocess.Popen | None
    log_path: Path | None


def export_simple(repo: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from examples.export_examples import export_simple as export
    export(repo, (1, 2, 4, 8))


def start_server(workdir: Path, repo: Path, timeout: float = 180.0) -> tuple[Target, object]:
    """``xlaserve run`` over ``repo`` on loopback; returns the target and the open log file."""
    import yaml
    node = workdir / "node.yaml"
    node.write_text(yaml.safe_dump({"model_repo": str(repo), "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"},
                                    "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "static"}}))
    ready = workdir / "ready.json"
    ready.unlink(missing_ok=True)
    log_path = workdir / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "xlaserve", "run", str(node), "--ready-file", str(ready)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the server did not start:\n{log_path.read_text()}")
        time.sleep(0.1)
    port = json.loads(ready.read_text())["grpc_port"]
    return Target(port, proc, log_path), log


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_model_ready(target: Target, timeout: float = 180.0) -> None:
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{target.port}")
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if client.is_model_ready("simple"):
                    return
            except Exception:       # not listening yet, or not ready: try again until the deadline
                pass
            if time.monotonic() > deadline or (target.process and target.process.poll() is not None):
                raise RuntimeError("the model never became ready")
            time.sleep(0.2)
    finally:
        client.close()


# ---- the campaign ----------------------------------------------------------------------------
@dataclass
class Failure:
    family: str
    case_id: str
    outcome: str
    detail: str
    data: bytes


@dataclass
class Report:
    cases: Counter = field(default_factory=Counter)
    outcomes: dict[str, Counter] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)     # the first few of each signature
    signatures: Counter = field(default_factory=Counter)        # every failure, by signature
    health_checks: int = 0
    seconds: float = 0.0
    crashed: bool = False

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    def summary(self) -> dict:
        return {"cases": dict(self.cases), "total": self.total, "seconds": round(self.seconds, 1),
                "cases_per_second": round(self.total / self.seconds, 1) if self.seconds else None,
                "outcomes": {f: dict(sorted(c.items(), key=lambda kv: -kv[1])) for f, c in self.outcomes.items()},
                "health_checks": self.health_checks,
                "failure_count": sum(self.signatures.values()),
                "failure_signatures": dict(self.signatures.most_common()),
                "failures": [{"family": f.family, "case": f.case_id, "outcome": f.outcome, "detail": f.detail[:3000],
                              "bytes": len(f.data)} for f in self.failures]}


_TRACE_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_EXCEPTION_LINE = re.compile(r"^[\s|+]*((?!ExceptionGroup)[A-Za-z_.]*(Error|Exception|Interrupt|Exit)\b.*)$")


def log_records(lines: list[str]) -> list[list[str]]:
    """Error lines split into records: each starts at an ERROR line, or at a traceback printed
    without one (a traceback right after an ERROR line is that record's)."""
    records: list[list[str]] = []
    for line in lines:
        bare_traceback = line.startswith("Traceback") and not (records and LOG_ERROR.match(records[-1][-1]))
        if not records or LOG_ERROR.match(line) or bare_traceback:
            records.append([])
        records[-1].append(line)
    return records


def signature(outcome: str, detail: str) -> str:
    """What makes two failures the same bug: for a traceback, its innermost frame and exception."""
    if outcome != "traceback":
        return outcome
    frames = _TRACE_FRAME.findall(detail)
    exceptions = [m.group(1) for line in detail.splitlines() if (m := _EXCEPTION_LINE.match(line))]
    where = f"{Path(frames[-1][0]).name}:{frames[-1][1]} in {frames[-1][2]}" if frames else "?"
    return f"traceback: {where}: {exceptions[-1] if exceptions else detail.splitlines()[-1][:200]}"



class Fuzzer:
    """Runs cases against one server and keeps the report: ``run_case`` for one, ``campaign`` for
    many. It owns at most one connection at a time, reused by the families that allow it."""

    def __init__(self, target: Target, *, case_timeout: float = 2.0, check_every: int = 500,
                 out: Path | None = None, log: Callable[[str], None] = print, record=None) -> None:
        self.target = target
        self.case_timeout = case_timeout
        self.check_every = check_every
        self.out = out
        self.say = log
        self.report = Report()
        self.record = record         # a text file: one JSON line per case (id, outcome, bytes)
        self.conn: Connection | None = None
        self.log_offset = target.log_path.stat().st_size if target.log_path else 0
        self.since_check = 0
        self.ping_counter = 0
        self.previous: tuple[str, str, bytes] = ("", "", b"")    # family, id and bytes of the last case

    # -- one case --
    def run_case(self, case: Case, case_id: str) -> None:
        outcome, failed, detail, data = self._exchange(case)
        report = self.report
        report.cases[case.family] += 1
        report.outcomes.setdefault(case.family, Counter())[outcome] += 1
        if self.record is not None:
            self.record.write(json.dumps({"case": case_id, "outcome": outcome, "hex": data.hex()}) + "\n")
        if failed:
            self._fail(case.family, case_id, outcome, detail, data)
        if self.target.process is not None and self.target.process.poll() is not None:
            report.crashed = True
            self._fail(case.family, case_id, "crash", f"server exited with {self.target.process.returncode}; "
                                                       f"previous case {self.previous[1]}", data)
        for record in log_records(self._new_log_errors()):
            self._traceback(case.family, case_id, data, record)
        self.previous = (case.family, case_id, data)
        self.since_check += 1
        if self.check_every and self.since_check >= self.check_every and not report.crashed:
            self.since_check = 0
            self.health_check()

    def _exchange(self, case: Case) -> tuple[str, bool, str, bytes]:
        deadline = time.monotonic() + self.case_timeout
        if case.fresh:
            self._drop()
        elif self.conn is not None and self.conn.next_sid > 2**31 - 1000:
            self._drop()
        try:
            if self.conn is None:
                self.conn = Connection(self.target.port, self.case_timeout, trickle=case.trickle)
                preface = case.preface if case.fresh else CLIENT_SETUP
                if not self.conn.send(preface, deadline):
                    return self._done(("hang", True, "the preface was not taken", preface))
                if not case.fresh and not self.conn.wait(lambda: self.conn.settings_seen,
                                                         deadline + 2 * self.case_timeout):
                    return self._done(("eof", False, "", preface) if self.conn.closed
                                      else ("hang", True, "no SETTINGS after the preface", preface))
        except OSError as exc:
            self._drop()
            return ("connect-failed", True, repr(exc), b"")
        conn = self.conn
        sid = conn.next_sid
        payload = case.render(sid)
        conn.next_sid += 2
        sync = shutdown = None
        if case.fresh:
            payload, sync = self._synced(payload)
            shutdown = sync is None
        elif not case.answer_expected:     # well framed, but no answer to wait for: a PING after it
            self.ping_counter += 1
            sync = struct.pack(">Q", 0x66757A7A00000000 | self.ping_counter & 0xFFFFFFFF)
        standalone = case.preface + (payload if case.fresh else case.render(1))
        sent = conn.send(payload, deadline) if case.fresh else conn.send_within_windows(case.parts, sid, deadline)
        if not sent:
            return self._done(("hang", True, "the server stopped reading the case's bytes, or opened no "
                                             "flow-control window for them", standalone))
        if shutdown and conn.closed is None:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        elif sync is not None and conn.closed is None:
            conn.send(frame(PING, 0, 0, sync), deadline)
        if case.answer_expected:
            done = lambda: conn.dead or conn.streams.get(sid, StreamReply()).ended \
                or conn.streams.get(sid, StreamReply()).rst is not None
        elif shutdown:
            done = lambda: conn.closed is not None
        else:
            done = lambda: conn.dead or sync in conn.pings
        answered = conn.wait(done, deadline)
        late = False
        if not answered:
            # Past the bound: a hang, unless the answer comes within twice as long again (a
            # loaded machine can starve the server); then it is counted as late, not failed.
            answered = late = conn.wait(done, deadline + 2 * self.case_timeout)
        # any INTERNAL on any stream of the connection fails the case
        failed, detail = False, ""
        main = conn.streams.get(sid)
        for s, reply in list(conn.streams.items()):
            if reply.ended or reply.rst is not None:
                label, bad = reply_label(reply)
                if bad:
                    failed, detail = True, f"stream {s}: {label}: {reply.headers}"
                del conn.streams[s]      # looked at once; a late answer on it makes a new entry
        if conn.goaway and conn.goaway[1] == INTERNAL_ERROR:
            failed, detail = True, f"GOAWAY INTERNAL_ERROR: {conn.goaway[2][:200]!r}"
        if conn.bad_reply:
            return self._done(("bad-reply", True, conn.bad_reply, standalone))
        if not answered:
            what = f"stream {sid} unanswered" if case.answer_expected else "no PING ack and no close"
            return self._done(("hang", True, f"{what} after {3 * self.case_timeout} s", standalone))
        if (case.answer_expected or not case.fresh) and main is not None and (main.ended or main.rst is not None):
            label, bad = reply_label(main)
            if not case.answer_expected and not case.fresh:
                label = "client-rst/" + label         # answered before our RST_STREAM arrived
        elif conn.goaway is not None:
            label, bad = f"goaway-{error_name(conn.goaway[1])}", False
        elif conn.closed is not None:
            label, bad = ("half-closed/" if shutdown else "") + conn.closed, False
        else:
            label, bad = "client-rst/ping-ack" if not case.fresh else "ping-ack", False
        if case.trickle:
            label = "trickle/" + label
        if late:
            label = "late/" + label
        outcome = ("internal" if (failed or bad) else label, failed or bad, detail or label, standalone)
        if case.fresh or conn.dead or (case.answer_expected and main is None):
            self._drop()
        return outcome

    def _synced(self, payload: bytes) -> tuple[bytes, bytes | None]:
        """The case's bytes, completed to a frame boundary with zeros when a length lies by at most
        64 KiB, and a PING payload to send after them (the server has handled the case when it
        answers); None when the case cannot be completed: half-close and expect the server to close."""
        while True:
            pos, n = 0, len(payload)
            while n - pos >= 9:
                pos += 9 + int.from_bytes(payload[pos:pos + 3], "big")
            if pos == n:
                break
            missing = pos - n if pos > n else 9 - (n - pos)
            if missing > 65536:
                return payload, None
            payload += bytes(missing)
        self.ping_counter += 1
        return payload, struct.pack(">Q", 0x66757A7A00000000 | self.ping_counter & 0xFFFFFFFF)

    def _done(self, outcome: tuple[str, bool, str, bytes]) -> tuple[str, bool, str, bytes]:
        self._drop()
        return outcome

    def _drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    # -- checks --
    def _new_log_errors(self) -> list[str]:
        """ERROR records and tracebacks the server logged since the last call, each whole."""
        path = self.target.log_path
        if path is None:
            return []
        text = self._read_log(path)
        if not text:
            return []
        if LOG_ERROR.search(text.decode(errors="replace")) or b"Traceback (most recent call last)" in text:
            # The server writes a traceback line by line: let it finish (bounded), then read it all.
            size, settle = path.stat().st_size, time.monotonic() + 1.0
            while time.monotonic() < settle:
                time.sleep(0.05)
                if path.stat().st_size == size:
                    break
                size = path.stat().st_size
            text += self._read_log(path)
        found, keep = [], 0
        for line in text.decode(errors="replace").splitlines():
            if LOG_ERROR.match(line) or "Traceback (most recent call last)" in line:
                found.append(line)
                keep = 80                 # the traceback that follows, up to the next record
            elif keep and not LOG_RECORD.match(line):
                found.append(line)
                keep -= 1
            else:
                keep = 0
        return found

    def _read_log(self, path: Path) -> bytes:
        """The whole lines added to the log since the last read."""
        size = path.stat().st_size
        if size <= self.log_offset:
            return b""
        with open(path, "rb") as f:
            f.seek(self.log_offset)
            text = f.read(size - self.log_offset)
        text = text[:text.rfind(b"\n") + 1]       # whole lines only; the rest next time
        self.log_offset += len(text)
        return text

    def health_check(self) -> None:
        """A real inference with the Triton client, answer checked."""
        import tritonclient.grpc as grpcclient
        self.report.health_checks += 1
        a = np.arange(32, dtype=np.int32).reshape(2, 16)
        b = np.full((2, 16), 3, dtype=np.int32)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{self.target.port}")
        try:
            inputs = []
            for name, array in (("INPUT0", a), ("INPUT1", b)):
                tensor = grpcclient.InferInput(name, list(array.shape), "INT32")
                tensor.set_data_from_numpy(array)
                inputs.append(tensor)
            result = client.infer("simple", inputs, client_timeout=30)
            if not (np.array_equal(result.as_numpy("OUTPUT0"), a + b)
                    and np.array_equal(result.as_numpy("OUTPUT1"), a - b)):
                self._fail("health", f"check-{self.report.health_checks}", "health-check", "wrong answer", b"")
        except Exception as exc:       # any failure of the real client is the finding
            self._fail("health", f"check-{self.report.health_checks}", "health-check", repr(exc), b"")
        finally:
            client.close()

    def _traceback(self, family: str, case_id: str, data: bytes, lines: list[str]) -> None:
        """A traceback was logged during this case or just after the previous one (a server may log
        after it has closed the connection): replay both, alone, to name the one that causes it."""
        detail = "\n".join(lines)
        key = signature("traceback", detail)
        if self.report.signatures[key] >= 3 or self.report.crashed:
            self._fail(family, case_id, "traceback", detail, data)   # counted; no need to know which
            return
        self._drop()
        for fam, cid, candidate in ((family, case_id, data), self.previous):
            if not candidate:
                continue
            conn = Connection(self.target.port, self.case_timeout, trickle=True)   # a case may need it
            deadline = time.monotonic() + self.case_timeout
            conn.send(candidate, deadline)
            conn.wait(lambda: conn.dead, deadline)
            conn.close()
            again: list[str] = []
            settle = time.monotonic() + 2.0   # the server logs after it closes; give it time, bounded
            while not again and time.monotonic() < settle:
                time.sleep(0.05)
                again = self._new_log_errors()
            if again and signature("traceback", "\n".join(again)) == key:
                self._fail(fam, cid, "traceback", f"confirmed by replaying this case alone:\n{detail}", candidate)
                return
        self._fail(family, case_id, "traceback", f"after this case or {self.previous[1]}; replaying either alone "
                                                 f"did not repeat it:\n{detail}", data)

    def _fail(self, family: str, case_id: str, outcome: str, detail: str, data: bytes) -> None:
        key = signature(outcome, detail)
        self.report.signatures[key] += 1
        if self.report.signatures[key] > 3:      # counted; three reproducers of one bug are enough
            return
        self.report.failures.append(Failure(family, case_id, outcome, detail, data))
        self.say(f"FAILURE {family} {case_id}: {key}" if self.report.signatures[key] > 1
                 else f"FAILURE {family} {case_id}: {outcome}: {detail[:1500]}")
        if self.out is not None and data:
            directory = self.out / "failures"
            directory.mkdir(parents=True, exist_ok=True)
            name = case_id.replace("/", "-")
            (directory / f"{name}.bin").write_bytes(data)
            (directory / f"{name}.json").write_text(json.dumps(
                {"family": family, "case": case_id, "outcome": outcome, "detail": detail, "hex": data.hex()}, indent=1))

    # -- the loop --
    def campaign(self, families, cases: int, seed: int, time_limit: float | None = None,
                 batch: int = 250) -> Report:
        """About ``cases`` cases split evenly over ``families``, in rounds of ``batch`` per family,
        each batch a Hypothesis run with its own seed derived from ``seed``; stops at the time limit
        or when the server dies."""
        started = time.monotonic()
        stop_at = started + time_limit if time_limit else float("inf")
        per_family = {f: cases // len(families) + (i < cases % len(families)) for i, f in enumerate(families)}
        done = Counter()
        round_ = 0
        try:
            while any(done[f] < per_family[f] for f in families):
                for family in families:
                    n = min(batch, per_family[family] - done[family])
                    if n <= 0:
                        continue
                    batch_seed = derive_seed(seed, family, round_)
                    self._run_batch(family, batch_seed, n, stop_at)
                    done[family] += n
                    if time.monotonic() > stop_at or self.report.crashed:
                        return self.report
                round_ += 1
                self.say(f"{self.report.total} cases, {time.monotonic() - started:.0f} s, "
                         f"{sum(self.report.signatures.values())} failures")
        finally:
            self._drop()
            self.report.seconds += time.monotonic() - started
        return self.report

    def _run_batch(self, family: str, batch_seed: int, n: int, stop_at: float) -> None:
        counter = iter(range(n))

        @hypothesis_seed(batch_seed)
        @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=False)
        @given(STRATEGIES[family])
        def one(case: Case) -> None:
            i = next(counter, None)
            if i is None or time.monotonic() > stop_at or self.report.crashed:
                return
            self.run_case(case, f"{family}/{batch_seed}/{i}")

        one()


def derive_seed(seed: int, family: str, round_: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{family}/{round_}".encode()).digest()[:4], "big")


def replay(path: Path, port: int, timeout: float) -> None:
    """Send a saved case on a fresh connection and print what comes back."""
    data = path.read_bytes()
    conn = Connection(port, timeout, trickle=True)    # window granted as DATA arrives, whatever the case set
    deadline = time.monotonic() + timeout
    conn.send(data, deadline)
    conn.wait(lambda: conn.dead, deadline)
    for sid, reply in sorted(conn.streams.items()):
        print(f"stream {sid}: ended={reply.ended} rst={error_name(reply.rst) if reply.rst is not None else None} "
              f"data={reply.data} headers={reply.headers}")
    print(f"goaway={conn.goaway} closed={conn.closed} bad_reply={conn.bad_reply}")
    conn.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=1000, help="cases in all, split evenly over the families")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    p.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    p.add_argument("--out", type=Path, default=Path("fuzz-out"), help="summary.json, server.log, failures/")
    p.add_argument("--case-timeout", type=float, default=2.0,
                   help="seconds a case waits for its answer; one answered within 3x that is 'late', later a hang")
    p.add_argument("--check-every", type=int, default=500, help="cases between Triton-client health checks")
    p.add_argument("--repo", type=Path, help="a model repository with `simple` (default: export one into --out)")
    p.add_argument("--port", type=int, help="fuzz a server already listening on 127.0.0.1:PORT instead")
    p.add_argument("--record", action="store_true", help="write every case's outcome and bytes to --out/cases.jsonl")
    p.add_argument("--server-log", type=Path, help="with --port: the server's log, scanned for tracebacks")
    p.add_argument("--replay", type=Path, help="send one saved failure to --port and print the reply")
    args = p.parse_args(argv)
    if args.replay:
        if not args.port:
            p.error("--replay needs --port")
        replay(args.replay, args.port, args.case_timeout)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    proc = log = record = None
    if args.port:
        target = Target(args.port, None, args.server_log)
    else:
        repo = args.repo
        if repo is None:
            repo = args.out / "models"
            if not (repo / "simple").exists():
                export_simple(repo)
        target, log = start_server(args.out, repo.resolve())
        proc = target.process
    try:
        wait_model_ready(target)
        record = open(args.out / "cases.jsonl", "w") if args.record else None
        fuzzer = Fuzzer(target, case_timeout=args.case_timeout, check_every=args.check_every, out=args.out,
                        record=record)
        report = fuzzer.campaign(args.families, args.cases, args.seed, args.time_limit)
        if not report.crashed:
            fuzzer.health_check()
        lines = fuzzer._new_log_errors()
        if lines:
            fuzzer._fail("log", "end", "traceback", "\n".join(lines), b"")
    finally:
        if record is not None:
            record.close()
        if proc is not None:
            stop_server(proc)
            log.close()
    summary = report.summary()
    summary.update(seed=args.seed, families=args.families, command=" ".join(sys.argv))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
