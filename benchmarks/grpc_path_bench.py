"""The server-side cost of one unary ModelInfer on the task-free path, in-process and without a
client: HEADERS and DATA frames handed straight to a connection's HTTP/2 engine (its frame
handler), the reply left in its write queue. What it measures is the engine (``xlaserve.http2``),
``grpc_server`` and ``grpc_protocol`` alone (header block to head, message cutting, the canned
reply of ``transport_bench``), without the socket, the client or the run loop, so two versions
of the layer compare within a few percent on a machine too busy for the transport benchmark to.

    python -m benchmarks.grpc_path_bench [--requests 20000] [--repeats 5]

Run it from two checkouts in turn (cwd first on ``sys.path``) to compare them; it prints the
microseconds per request of each repeat and the best.
"""
from __future__ import annotations

import argparse
import socket
import struct
import time

import hpack
import trio

from benchmarks.transport_bench import echo_service
from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.http2.frames import DATA, END_HEADERS, END_STREAM, HEADERS, SETTINGS
from xlaserve.frontend.grpc_server import Connection, GrpcServer

FIELDS = [(":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
          (":authority", "127.0.0.1:8001"), ("te", "trailers"), ("content-type", "application/grpc"),
          ("user-agent", "grpc-python/1.60"), ("grpc-accept-encoding", "identity,deflate,gzip")]


def request_body() -> bytes:
    request = pb.ModelInferRequest(model_name="mlp", id="1")
    request.inputs.add(name="input", datatype="FP32", shape=[1, 512])
    request.raw_input_contents.append(bytes(2048))
    raw = request.SerializeToString()
    return struct.pack(">BI", 0, len(raw)) + raw


async def measure(requests: int, repeats: int) -> list[float]:
    server = GrpcServer([echo_service(fast=True)])
    ours, _theirs = socket.socketpair()
    conn = Connection(server, trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
    h2 = conn.h2
    h2._frame(SETTINGS, 0, 0, b"")     # the client's first SETTINGS
    # a peer whose windows always have room: every reply is queued whole at once
    h2.send_window = 1 << 60
    h2.peer_initial_window = 1 << 30
    h2.peer_max_frame = 1 << 20
    encoder = hpack.Encoder()
    first, block = encoder.encode(FIELDS), encoder.encode(FIELDS)      # the second is all indexed
    body = memoryview(request_body())
    timings = []
    async with trio.open_nursery() as nursery:
        conn.nursery = nursery
        handle = h2._frame
        handle(HEADERS, END_HEADERS, 1, first)
        handle(DATA, END_STREAM, 1, body)
        sid = 3
        for _ in range(repeats):
            started = time.perf_counter()
            for _ in range(requests):
                handle(HEADERS, END_HEADERS, sid, block)
                handle(DATA, END_STREAM, sid, body)
                sid += 2
                if len(h2.out) > 1 << 20:
                    h2.take_output()
            timings.append((time.perf_counter() - started) / requests * 1e6)
            if conn.calls or not conn.out:
                raise RuntimeError(f"{len(conn.calls)} calls left open: the requests were not answered")
            h2.take_output()
        nursery.cancel_scope.cancel()
    return timings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    timings = trio.run(measure, args.requests, args.repeats)
    print(f"us/request: best {min(timings):.2f}  each {' '.join(f'{t:.2f}' for t in timings)}")


if __name__ == "__main__":
    main()
