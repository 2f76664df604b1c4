"""The gateway's client (``gateway/upstream.py``) per call, in-process and without a socket: a
batch of calls started (their HEADERS and DATA queued for the worker), then a worker's replies to
them (HEADERS, one DATA frame, OK trailers each) handed to the connection's frame handling, every
call answered. What it measures is the client alone (its HTTP/2 handling and its calls), without
the socket, the worker or the run loop, so two versions compare within a few percent on a machine
too busy for ``gateway_bench`` to.

    python -m benchmarks.upstream_bench [--calls 96000] [--batch 32] [--repeats 5]

Run it from two checkouts in turn (cwd first on ``sys.path``) to compare them; it prints the
microseconds per call of each repeat and the best. It knows both the engine-driven client
(``Upstream.headers_received``) and the one before it (``Upstream._frame``, 6fbd7ef).
"""
from __future__ import annotations

import argparse
import struct
import time

import trio

from xlaserve.frontend.grpc_protocol import OK_TRAILERS, RESPONSE_HEADERS, framed
from xlaserve.gateway import upstream as upstream_module
from xlaserve.gateway.upstream import Upstream

try:
    from xlaserve.http2.frames import DATA, END_HEADERS, END_STREAM, HEADERS, SETTINGS, WINDOW_UPDATE, frame
except ImportError:         # before the engine
    from xlaserve.frontend.grpc_server import DATA, END_HEADERS, END_STREAM, HEADERS, SETTINGS, WINDOW_UPDATE, frame

PATH = "/inference.GRPCInferenceService/ModelInfer"
MESSAGE = b"q" * 2100           # about an mlp request (FP32 [1,512])
REPLY = framed(b"r" * 2100)
ENGINE = hasattr(Upstream, "headers_received")


def _replies(sids: list[int]) -> bytes:
    """The worker's answers to ``sids``, after a WINDOW_UPDATE returning what they sent."""
    return frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", len(sids) * (len(MESSAGE) + 5))) + b"".join(
        frame(HEADERS, END_HEADERS, s, RESPONSE_HEADERS) + frame(DATA, 0, s, REPLY)
        + frame(HEADERS, END_HEADERS | END_STREAM, s, OK_TRAILERS) for s in sids)


def _handle_old(upstream, buffer: bytearray, view: memoryview) -> None:
    unpack = upstream_module._FRAME_HEADER.unpack_from
    pos = 0
    while pos < len(buffer):
        lt, flags, sid = unpack(buffer, pos)
        stop = pos + 9 + (lt >> 8)
        ftype = lt & 0xFF
        payload = view[pos + 9:stop] if ftype == DATA else bytes(view[pos + 9:stop])
        upstream._frame(ftype, flags, sid & 0x7FFFFFFF, payload)
        pos = stop
    upstream._out.clear()


async def _run(calls: int, batch: int) -> float:
    upstream = Upstream("w", "127.0.0.1", 1, max_streams=batch)
    h2 = None
    if ENGINE:
        h2 = upstream._reset_state()
        upstream._reading = True
        h2.feed(frame(SETTINGS, 0, 0, struct.pack(">HI", 4, 4 << 20)) + frame(WINDOW_UPDATE, 0, 0,
                                                                              struct.pack(">I", 16 << 20)))
        upstream._reading = False
        h2.take_output()
    else:
        upstream._reset_state()
    upstream.up = True
    upstream._timer_at = 0.0            # (no timer task here: do not wake one per call)
    answered = [0]

    def on_done(outcome) -> None:
        answered[0] += 1
    spent = 0.0
    for _ in range(calls // batch):
        started = time.perf_counter()
        handles = [upstream.start(PATH, MESSAGE, on_done) for _ in range(batch)]
        spent += time.perf_counter() - started
        if ENGINE:
            h2.take_output()
        else:
            upstream._out.clear()
        buffer = bytearray(_replies([h.id for h in handles]))
        view = memoryview(buffer)
        started = time.perf_counter()
        if ENGINE:
            upstream._reading = True
            pos = 0
            while pos < len(buffer):
                pos = h2.receive(buffer, view, pos, len(buffer))
            upstream._reading = False
            h2.take_output()
        else:
            _handle_old(upstream, buffer, view)
        spent += time.perf_counter() - started
    assert answered[0] == calls // batch * batch, answered
    return spent / answered[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=96000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    results = [trio.run(_run, args.calls, args.batch) * 1e6 for _ in range(args.repeats)]
    print(f"{'engine' if ENGINE else 'before the engine'}: " + " ".join(f"{r:.2f}" for r in results)
          + f" us per call; best {min(results):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
