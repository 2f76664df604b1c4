"""What Python hooks and meta models cost.

    python -m benchmarks.hooks_bench [--seconds 5] [--rounds 3] [--only hook,meta]

Starts its own server (``xlaserve run``, CPU backend, loopback) on a temporary repository and
drives it with closed loops on tritonclient's asyncio gRPC client (``c`` coroutines, each sending
its next request when the last returns). Rounds alternate between the variants compared, so the
noise of a shared machine lands on all of them alike.

- ``hook``: ``mlp`` (FP32 [1,512]) at c=16 against the same model with a 2 ms postprocess:
  ``mlp_sleep`` waits 2 ms (``time.sleep``: I/O, a remote call, native code that releases the
  GIL) and ``mlp_numpy`` computes for 2 ms in NumPy (CPU; needs a free core to overlap).
- ``meta``: ``detect_and_classify`` at c=8 (one call; detector, Python crops, classifier inside
  the server) against a client that calls ``detector``, crops and calls ``classifier`` itself.

Prints one JSON line per measurement, then a summary line per comparison (medians over rounds).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as aioclient

from benchmarks._servers import xlaserve

POSTPROCESS = """
import time
import numpy as np
from xlaserve import NamedTensor, register_model

WORK = {work}
X = np.linspace(0, 1, 10_000, dtype=np.float32)

def postprocess(outputs):
    {body}
    return [NamedTensor("output", outputs[0].data)]

register_model({name!r}, postprocess=postprocess)
"""


_X = np.linspace(0, 1, 10_000, dtype=np.float32)


def _numpy_work_per_2ms() -> int:
    """How many ``np.exp`` passes over 10,000 float32 take 2 ms on this machine (the hook's body)."""
    best = min(_timed(lambda: [np.exp(_X) for _ in range(100)]) for _ in range(20)) / 100
    return max(1, round(0.002 / best))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def build_repo(repo: Path) -> None:
    from examples import export_examples
    mlp = export_examples.export_mlp(repo, (1, 2, 4, 8, 16))
    for name, work, body in (
            ("mlp_sleep", 0, "time.sleep(0.002)"),
            ("mlp_numpy", _numpy_work_per_2ms(), "[np.exp(X) for _ in range(WORK)]")):
        copy = repo / name
        copy.mkdir()
        for f in mlp.iterdir():
            text = f.read_bytes()
            if f.name == "manifest.yaml":
                text = text.replace(b"name: mlp", f"name: {name}".encode())
            (copy / f.name).write_bytes(text)
        (copy / "model.py").write_text(POSTPROCESS.format(work=work, body=body, name=name))
    for export in export_examples.HOOK_EXPORTERS.values():
        export(repo)


async def closed_loop(url: str, concurrency: int, seconds: float,
                      one: Callable[[aioclient.InferenceServerClient, int], Awaitable[None]]) -> dict:
    async with aioclient.InferenceServerClient(url) as client:
        for i in range(concurrency):   # warm-up: every compiled path and the hook threads
            await one(client, i)
        latencies: list[float] = []
        stop = time.perf_counter() + seconds

        async def loop(worker: int) -> None:
            i = worker
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                await one(client, i)
                latencies.append(time.perf_counter() - t0)
                i += concurrency
        started = time.perf_counter()
        await asyncio.gather(*(loop(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - started
    ms = np.array(latencies) * 1e3
    return {"requests_s": round(len(latencies) / elapsed, 1), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2)}


def _input(name: str, array: np.ndarray, datatype: str) -> aioclient.InferInput:
    t = aioclient.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def mlp_request(model: str):
    x = np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32)

    async def one(client, i):
        r = await client.infer(model, [_input("input", x, "FP32")])
        assert r.as_numpy("output").shape == (1, 512)
    return one


def meta_request():
    from examples import reference
    images = reference.pipeline_images(64, seed=1)

    async def one(client, i):
        r = await client.infer("detect_and_classify", [_input("image", images[i % len(images)], "UINT8")])
        r.as_numpy("label")
    return one


def two_stage_client():
    from examples import reference
    images = reference.pipeline_images(64, seed=1)

    async def one(client, i):
        image = images[i % len(images)]
        found = await client.infer("detector", [_input("image", image[np.newaxis], "UINT8")])
        keep, crops = reference.select_and_crop(image, found.as_numpy("scores")[0], found.as_numpy("boxes")[0])
        if len(keep):
            r = await client.infer("classifier", [_input("crop", crops, "UINT8")])
            r.as_numpy("logits").argmax(axis=1)
    return one


def compare(url: str, title: str, concurrency: int, variants: dict, seconds: float, rounds: int) -> None:
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(rounds):
        for name, one in variants.items():
            point = asyncio.run(closed_loop(url, concurrency, seconds, one))
            runs[name].append(point)
            print(json.dumps({"bench": title, "variant": name, "round": r, "concurrency": concurrency, **point}),
                  flush=True)
    base = next(iter(variants))
    base_rps = statistics.median(p["requests_s"] for p in runs[base])
    summary = {"bench": title, "concurrency": concurrency, "summary": {}}
    for name, points in runs.items():
        rps = statistics.median(p["requests_s"] for p in points)
        summary["summary"][name] = {"requests_s": rps, "p99_ms": statistics.median(p["p99_ms"] for p in points),
                                    f"vs_{base}": round(rps / base_rps, 3)}
    print(json.dumps(summary), flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="hook,meta")
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    print(json.dumps({"cpus": os.cpu_count(), "python": sys.version.split()[0]}), flush=True)
    with tempfile.TemporaryDirectory(prefix="hooks_bench_") as tmp:
        repo = Path(tmp) / "models"
        build_repo(repo)
        with xlaserve(repo, log_path=Path(tmp) / "server.log") as (url, _):
            if "hook" in only:
                compare(url, "postprocess_2ms", 16, {"mlp": mlp_request("mlp"),
                                                     "mlp_sleep": mlp_request("mlp_sleep"),
                                                     "mlp_numpy": mlp_request("mlp_numpy")},
                        args.seconds, args.rounds)
            if "meta" in only:
                compare(url, "two_stage", 8, {"client_two_calls": two_stage_client(),
                                              "meta_one_call": meta_request()},
                        args.seconds, args.rounds)


if __name__ == "__main__":
    main()
