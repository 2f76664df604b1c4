"""Inline tensors versus system shared memory, for the UINT8 [b,224,224,3] image model.

    python -m benchmarks.shm_bench --server xlaserve=127.0.0.1:8001 --server triton=127.0.0.1:18701 \\
        [--model img_mean] [--batches 1,8] [--concurrency 1,8,32] [--seconds 5]

One closed loop per point: ``c`` coroutines on tritonclient's asyncio gRPC client, each sending its
next request as soon as the last one returns, for ``--seconds``. Every server is measured both
ways in the same pass (inline, then shared memory, server after server for each point) so that
the noise of a shared machine lands on all of them alike. In shared-memory mode the input batch
lives in one region that every request reads, and each coroutine has its own slot of an output
region, so what is left on the socket is the request and response headers.

Prints one JSON line per point: server, mode, batch, concurrency, requests/s, images/s, p50/p99 ms.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import numpy as np
import tritonclient.grpc.aio as aioclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Point:
    """One closed-loop measurement against one server."""

    def __init__(self, url: str, model: str, batch: int, concurrency: int, use_shm: bool) -> None:
        self.url, self.model, self.batch, self.concurrency, self.use_shm = url, model, batch, concurrency, use_shm
        self.images = np.random.default_rng(0).integers(0, 256, (batch, 224, 224, 3), dtype=np.uint8)
        self.out_bytes = batch * 4
        self.tag = f"xlsbench_{os.getpid()}_{batch}_{concurrency}"
        self.handles = []

    def _request(self, worker: int):
        inp = aioclient.InferInput("input", list(self.images.shape), "UINT8")
        out = aioclient.InferRequestedOutput("output")
        if self.use_shm:
            inp.set_shared_memory(self.tag + "_in", self.images.nbytes)
            out.set_shared_memory(self.tag + "_out", self.out_bytes, worker * self.out_bytes)
        else:
            inp.set_data_from_numpy(self.images)
        return [inp], [out]

    async def _setup(self, client) -> None:
        if not self.use_shm:
            return
        await client.unregister_system_shared_memory()
        await client.unregister_cuda_shared_memory()
        for suffix, size in (("_in", self.images.nbytes), ("_out", self.out_bytes * self.concurrency)):
            name = self.tag + suffix
            handle = shm.create_shared_memory_region(name, "/" + name, size)
            self.handles.append(handle)
            await client.register_system_shared_memory(name, "/" + name, size)
        shm.set_shared_memory_region(self.handles[0], [self.images])

    async def _teardown(self, client) -> None:
        if self.use_shm:
            await client.unregister_system_shared_memory()
        for handle in self.handles:
            shm.destroy_shared_memory_region(handle)

    async def run(self, seconds: float) -> dict:
        async with aioclient.InferenceServerClient(self.url) as client:
            await self._setup(client)
            try:
                inputs, outputs = self._request(0)
                await client.infer(self.model, inputs, outputs=outputs)          # warm-up
                latencies: list[float] = []
                errors = 0
                stop = time.perf_counter() + seconds

                async def loop(worker: int) -> None:
                    nonlocal errors
                    inputs, outputs = self._request(worker)
                    while time.perf_counter() < stop:
                        t0 = time.perf_counter()
                        try:
                            await client.infer(self.model, inputs, outputs=outputs)
                        except InferenceServerException:
                            errors += 1
                            continue
                        latencies.append(time.perf_counter() - t0)
                start = time.perf_counter()
                await asyncio.gather(*(loop(w) for w in range(self.concurrency)))
                elapsed = time.perf_counter() - start
            finally:
                await self._teardown(client)
        ms = np.array(latencies) * 1e3 if latencies else np.array([float("nan")])
        return {"requests_per_s": round(len(latencies) / elapsed, 1),
                "images_per_s": round(len(latencies) * self.batch / elapsed, 1),
                "p50_ms": round(float(np.percentile(ms, 50)), 2), "p99_ms": round(float(np.percentile(ms, 99)), 2),
                "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", action="append", required=True, help="NAME=HOST:PORT (repeatable)")
    parser.add_argument("--model", default="img_mean")
    parser.add_argument("--batches", type=_ints, default=[1, 8])
    parser.add_argument("--concurrency", type=_ints, default=[1, 8, 32])
    parser.add_argument("--modes", default="inline,shm")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    servers = [s.split("=", 1) for s in args.server]
    for batch in args.batches:
        for c in args.concurrency:
            for name, url in servers:
                for mode in args.modes.split(","):
                    result = asyncio.run(Point(url, args.model, batch, c, mode == "shm").run(args.seconds))
                    print(json.dumps({"server": name, "mode": mode, "batch": batch, "concurrency": c, **result}),
                          flush=True)


if __name__ == "__main__":
    main()
