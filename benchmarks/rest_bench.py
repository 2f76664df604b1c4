"""REST against gRPC on one xlaserve worker: the reference ``mlp`` (FP32 [1, 512] in and out) at
several concurrencies, through the gRPC port (``xlaserve bench``'s load generator, the Triton
gRPC aio client) and through the REST port with Triton's binary tensor data and with JSON.

    python -m benchmarks.rest_bench [--duration 5] [--warmup 1] [--concurrency 1,8,32] [--rounds 1]
    python -m benchmarks.rest_bench --idle 1000

``--idle N`` measures instead what N slowloris connections cost: each sends half a request head
and stops; the script prints the server's RSS before and with them open, the latency of a normal
request meanwhile, and how many the server has closed after its header timeout.

The REST clients are a closed loop of raw HTTP/1.1 keep-alive connections (asyncio streams) that
send pre-built bodies and read each response whole, so the client costs little next to the
server; each level reports requests/s, p50/p99 and the server's CPU time per request (its
process's user+system seconds over the window), the figure least disturbed by sharing the
machine's cores with the client. Modes alternate within each round. Triton is not installed
here, so there is no Triton column; the gRPC row is the baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import yaml

from benchmarks._servers import ROOT, export_mlp_as, stop, tree_cpu_seconds, wait_ready
from xlaserve.bench import loadgen

MODES = ("grpc", "rest-binary", "rest-json")


@contextmanager
def server(repo: Path):
    """``xlaserve run`` over ``repo`` with gRPC and REST on loopback; yields (grpc url, rest port, pid)."""
    work = Path(tempfile.mkdtemp(prefix="xlaserve-rest-bench-"))
    node = {"model_repo": str(repo),
            "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"},
            "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "static"}}
    (work / "node.yaml").write_text(yaml.safe_dump(node))
    ready = work / "ready.json"
    log = open(work / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "xlaserve", "--log-level", "warning", "run",
                             str(work / "node.yaml"), "--ready-file", str(ready)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"xlaserve did not start:\n{(work / 'server.log').read_text()}")
            time.sleep(0.1)
        ports = json.loads(ready.read_text())
        url = f"127.0.0.1:{ports['grpc_port']}"
        wait_ready(url, deadline, proc, models=("mlp",))
        yield url, ports["rest_port"], proc.pid
    finally:
        stop(proc)
        log.close()
        shutil.rmtree(work, ignore_errors=True)


def rest_body(mode: str, x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    if mode == "rest-json":
        doc = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}]}
        return json.dumps(doc).encode(), {}
    header = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(x.shape),
                                     "parameters": {"binary_data_size": x.nbytes}}],
                         "outputs": [{"name": "output", "parameters": {"binary_data": True}}]}).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


async def _rest_client(port: int, request: bytes, stop_at: float, count_from: float, latencies: list,
                       answered: list) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    errors = 0
    try:
        while (now := time.perf_counter()) < stop_at:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            answered[0] += 1
            if not head.startswith(b"HTTP/1.1 200"):
                errors += 1
            if now >= count_from:
                latencies.append(time.perf_counter() - now)
    finally:
        writer.close()
    return errors


async def rest_level(port: int, mode: str, conc: int, duration: float, warmup: float) -> dict:
    x = np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32)
    body, headers = rest_body(mode, x)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request = (f"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: bench\r\ncontent-length: {len(body)}\r\n{head}\r\n"
               .encode() + body)
    start = time.perf_counter()
    latencies: list[float] = []
    answered = [0]
    errors = await asyncio.gather(*(_rest_client(port, request, start + warmup + duration, start + warmup, latencies,
                                                 answered) for _ in range(conc)))
    return {**_row(latencies, duration, sum(errors)), "answered": answered[0]}


def _row(latencies: list[float], duration: float, errors: int) -> dict:
    ms = np.array(latencies) * 1e3 if latencies else np.zeros(1)
    return {"throughput_rps": len(latencies) / duration, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "errors": errors}


def grpc_level(url: str, conc: int, duration: float, warmup: float) -> dict:
    inputs = {"mlp": [loadgen.InputSpec("input", "FP32", (1, 512))]}
    plans = [loadgen.ClientPlan(lambda: "mlp") for _ in range(conc)]
    result = asyncio.run(loadgen.run_level(url, plans, inputs, duration=duration, warmup=warmup))
    row = result.rows()[0]
    return {"throughput_rps": row["throughput_rps"], "p50_ms": row["p50_ms"], "p99_ms": row["p99_ms"],
            "errors": sum(row["errors"].values()), "answered": result.answered}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def idle_connections(rest_port: int, pid: int, n: int) -> dict:
    import socket
    before = _rss_kib(pid)
    held = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", rest_port))
        s.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: x\r\ncontent-le")
        held.append(s)
    time.sleep(2)
    during = _rss_kib(pid)
    x = np.zeros((1, 512), np.float32)
    body, headers = rest_body("rest-binary", x)
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", rest_port, timeout=30)
    start = time.perf_counter()
    c.request("POST", "/v2/models/mlp/infer", body=body, headers=headers)
    status = c.getresponse().status
    served_ms = (time.perf_counter() - start) * 1e3
    c.close()
    time.sleep(11)          # past the default rest_header_timeout_seconds (10)
    closed = 0
    for s in held:
        s.settimeout(0.5)
        try:
            reply = s.recv(100)
            closed += reply.startswith(b"HTTP/1.1 408") or reply == b""
        except OSError:
            pass
        s.close()
    return {"idle_connections": n, "rss_before_kib": before, "rss_with_them_kib": during,
            "kib_per_connection": round((during - before) / n, 1), "other_request_status": status,
            "other_request_ms": round(served_ms, 2), "closed_by_header_timeout": closed}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--idle", type=int, default=0, help="measure N slowloris connections instead")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        with server(repo) as (url, rest_port, pid):
            if args.idle:
                print(json.dumps(idle_connections(rest_port, pid, args.idle)), flush=True)
                return
            for rnd in range(args.rounds):
                for conc in levels:
                    order = MODES if rnd % 2 == 0 else tuple(reversed(MODES))
                    for mode in order:
                        cpu = tree_cpu_seconds(pid)
                        if mode == "grpc":
                            row = grpc_level(url, conc, args.duration, args.warmup)
                        else:
                            row = asyncio.run(rest_level(rest_port, mode, conc, args.duration, args.warmup))
                        spent = tree_cpu_seconds(pid) - cpu
                        row["server_cpu_us_per_req"] = spent / max(row.pop("answered"), 1) * 1e6
                        print(json.dumps({"round": rnd, "mode": mode, "concurrency": conc,
                                          **{k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}}),
                              flush=True)


if __name__ == "__main__":
    main()
