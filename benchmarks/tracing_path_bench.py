"""The worker's own CPU per ModelInfer, in-process and without a client or sockets: the real
actors (device, weight cache, scheduler, inference service) serving the reference ``mlp``, and
the KServe service's request path called directly with decoded ``ModelInferRequest`` messages,
32 at a time (one coalesced batch), until ``--requests`` are answered. What it measures is
``time.process_time()`` per request, the CPU of every thread of the process (the export thread's
included), which another tenant's load disturbs far less than a throughput measured through
sockets (benchmarks/tracing_bench.py).

    python -m benchmarks.tracing_path_bench [--requests 20000] [--repeats 5] [--tracing off|on] [--ratio 1.0]

Run it from two checkouts in turn (cwd first on ``sys.path``), the commit before tracing and
this one, alternating: ``--tracing on`` traces requests (``--ratio``, default every one) with the
file exporter writing to a temporary file. Prints the CPU microseconds per request of each repeat, then the
best and the median.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import trio

from benchmarks._servers import export_mlp_as
from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.config import parse_node_config, resolve_worker
from xlaserve.frontend.bridge import Bridge
from xlaserve.frontend.kserve import KServeService
from xlaserve.app.compose import run_actors, worker_port

BATCH = 32


class _Stream:
    """What the request path reads of a call: its metadata, deadline and peer."""

    def __init__(self, metadata: dict) -> None:
        self.metadata = metadata
        self.deadline = None
        self.peer = None


def _request(i: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="mlp", id=str(i))
    request.inputs.add(name="input", datatype="FP32", shape=[1, 512])
    request.raw_input_contents.append(bytes(2048))
    return request


async def measure(repo: Path, requests: int, repeats: int, tracing: dict | None) -> list[float]:
    node = {"model_repo": str(repo), "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"},
            "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "static", "cache_dir": None}}
    if tracing is not None:
        node["tracing"] = tracing
    config = resolve_worker(parse_node_config(node, repo))
    timings = []
    async with trio.open_nursery() as nursery:
        actors = await nursery.start(functools.partial(run_actors, config))
        await actors.table.startup_done.wait()
        port = worker_port(actors, Bridge(trio.lowlevel.current_trio_token()), draining=trio.Event(),
                           shared_memory=None)
        extra = (actors.tracing,) if hasattr(actors, "tracing") else ()       # the checkout before tracing
        service = KServeService(port, config.endpoints, *extra)
        stream = _Stream({"te": "trailers", "content-type": "application/grpc"})
        messages = [_request(i) for i in range(BATCH)]
        for repeat in range(repeats + 1):           # the first is warm-up
            started = time.process_time()
            answered = 0
            while answered < requests:
                done = trio.Event()
                left = [BATCH]

                def finish(outcome, done=done, left=left) -> None:
                    if not isinstance(outcome, pb.ModelInferResponse):
                        raise RuntimeError(f"a request failed: {outcome}")
                    left[0] -= 1
                    if not left[0]:
                        done.set()
                for message in messages:
                    service._start_infer(message, stream, finish)
                await done.wait()
                answered += BATCH
            if repeat:
                timings.append((time.process_time() - started) / answered * 1e6)
        nursery.cancel_scope.cancel()
    return timings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tracing", choices=("off", "on"), default="off")
    p.add_argument("--ratio", type=float, default=1.0, help="tracing.sampling_ratio with --tracing on")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        tracing = None
        if args.tracing == "on":
            tracing = {"enabled": True, "sampling_ratio": args.ratio, "exporter": "file",
                       "file": str(Path(tmp) / "spans")}
        timings = trio.run(measure, repo, args.requests, args.repeats, tracing)
    print("cpu us/request:", " ".join(f"{t:.1f}" for t in timings))
    print(f"best {min(timings):.1f}  median {statistics.median(timings):.1f}")


if __name__ == "__main__":
    main()
