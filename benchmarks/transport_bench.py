"""The gRPC transport alone: xlaserve's own HTTP/2 layer on Trio (``frontend/grpc_server.py``,
its task-free ModelInfer path and its task-per-call path), grpclib (asyncio, h2) and grpcio's
asyncio server (C HTTP/2), each answering every ModelInfer with a canned ``mlp``-sized response.

    python -m benchmarks.transport_bench [--rounds 2] [--duration 4] [--concurrency 1,32]
        [--transports xlaserve,xlaserve-baseline --baseline TREE]

The servers run as subprocesses of this script; rounds alternate the order. This is the
measurement behind "Why xlaserve speaks HTTP/2 itself" in docs/architecture.md.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks._servers import ROOT, free_port, stop, tree_cpu_seconds, wait_ready
from xlaserve.bench import loadgen

CANNED = np.zeros((1, 512), np.float32).tobytes()


def echo_service(fast: bool):
    """The canned ModelInfer service, grpclib-shaped: grpclib serves it, and so does xlaserve's
    grpc_server (which also uses its task-free entry when ``fast``)."""
    from xlaserve._proto import grpc_service_pb2 as pb
    from xlaserve._proto.grpc_service_grpc import GRPCInferenceServiceBase

    def answer(request):
        response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
        response.outputs.add(name="output", datatype="FP32", shape=[1, 512])
        response.raw_output_contents.append(CANNED)
        return response

    class Echo(GRPCInferenceServiceBase):
        def __fast_unary__(self):
            return {"/inference.GRPCInferenceService/ModelInfer": self.infer_now} if fast else {}

        def infer_now(self, call, request):
            call.complete(answer(request))

        async def ModelInfer(self, stream):
            await stream.send_message(answer(await stream.recv_message()))

        async def ModelReady(self, stream):
            await stream.recv_message()
            await stream.send_message(pb.ModelReadyResponse(ready=True))

        async def ServerReady(self, stream):
            await stream.recv_message()
            await stream.send_message(pb.ServerReadyResponse(ready=True))

    # Only the RPCs above are reached; the rest stay abstract.
    Echo.__abstractmethods__ = frozenset()
    return Echo()


async def serve_grpclib(port: int) -> None:
    from grpclib.server import Server

    server = Server([echo_service(fast=False)])
    await server.start("127.0.0.1", port)
    await server.wait_closed()


async def serve_grpcio(port: int) -> None:
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    class Echo(pb_grpc.GRPCInferenceServiceServicer):
        async def ModelInfer(self, request, context):
            response = pb.ModelInferResponse(model_name=request.model_name, id=request.id)
            response.outputs.add(name="output", datatype="FP32", shape=[1, 512])
            response.raw_output_contents.append(CANNED)
            return response

        async def ModelReady(self, request, context):
            return pb.ModelReadyResponse(ready=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=True)

    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(Echo(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_xlaserve(port: int, fast: bool = True) -> None:
    import trio

    from xlaserve.frontend.grpc_server import GrpcServer

    async def main():
        await GrpcServer([echo_service(fast)]).serve("127.0.0.1", port)
    trio.run(main)


ASYNCIO_SERVERS = {"grpclib": serve_grpclib, "grpcio": serve_grpcio}
SERVERS = ("xlaserve", "xlaserve-task", *ASYNCIO_SERVERS)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--transports", default=",".join(SERVERS),
                   help=f"comma-separated, from {', '.join(SERVERS)} and xlaserve-baseline")
    p.add_argument("--baseline", type=Path, metavar="TREE",
                   help="an earlier xlaserve source tree (git worktree add TREE COMMIT): transport "
                        "xlaserve-baseline is its task-free path, served from there")
    p.add_argument("--serve", nargs=2, metavar=("TRANSPORT", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        if args.serve[0].startswith("xlaserve"):
            serve_xlaserve(int(args.serve[1]), fast=args.serve[0] == "xlaserve")
        else:
            asyncio.run(ASYNCIO_SERVERS[args.serve[0]](int(args.serve[1])))
        return
    inputs = {"mlp": [loadgen.InputSpec("input", "FP32", (1, 512))]}
    print(f"{'round':>5} {'transport':<13} {'c':>3} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu ms/req':>10}")
    for round_ in range(args.rounds):
        chosen = args.transports.split(",")
        order = chosen if round_ % 2 == 0 else list(reversed(chosen))
        for name in order:
            port = free_port()
            tree, env = ROOT, None
            if name == "xlaserve-baseline":
                if args.baseline is None:
                    raise SystemExit("xlaserve-baseline needs --baseline TREE")
                tree, env, name = args.baseline, {**os.environ, "PYTHONPATH": str(args.baseline)}, "xlaserve"
            proc = subprocess.Popen([sys.executable, "-m", "benchmarks.transport_bench", "--serve", name,
                                     str(port)], cwd=tree, env=env)
            if tree != ROOT:
                name = "xlaserve-baseline"
            try:
                url = f"127.0.0.1:{port}"
                wait_ready(url, time.monotonic() + 60, proc, models=("mlp",))
                for conc in (int(c) for c in args.concurrency.split(",")):
                    plans = [loadgen.ClientPlan(lambda: "mlp") for _ in range(conc)]
                    cpu0 = tree_cpu_seconds(proc.pid)
                    result = asyncio.run(loadgen.run_level(url, plans, inputs, duration=args.duration,
                                                           warmup=1.0))
                    cpu = tree_cpu_seconds(proc.pid) - cpu0
                    row = result.rows()[0]
                    print(f"{round_:>5} {name:<13} {conc:>3} {row['throughput_rps']:>9.1f} "
                          f"{row['p50_ms']:>8.2f} {row['p99_ms']:>8.2f} "
                          f"{1e3 * cpu / max(1, result.answered):>10.3f}", flush=True)
            finally:
                stop(proc)


if __name__ == "__main__":
    main()
