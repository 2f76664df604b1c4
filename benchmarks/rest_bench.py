"""REST against gRPC on one xlaserve worker: the reference ``mlp`` (FP32 [1, 512] in and out) at
several concurrencies, through the gRPC port (``xlaserve bench``'s load generator, the Triton
gRPC aio client) and through the REST port with Triton's binary tensor data and with JSON.

    python -m benchmarks.rest_bench [--duration 5] [--warmup 1] [--concurrency 1,8,32] [--rounds 1]
    python -m benchmarks.rest_bench --triton [--rounds 3] [--modes rest-binary,rest-json]
    python -m benchmarks.rest_bench --baseline CHECKOUT [--rounds 3]
    python -m benchmarks.rest_bench --idle 1000

``--idle N`` measures instead what N slowloris connections cost: each sends half a request head
and stops; the script prints the server's RSS before and with them open, the latency of a normal
request meanwhile, and how many the server has closed after its header timeout.

The REST clients are a closed loop of raw HTTP/1.1 keep-alive connections (asyncio streams) that
send pre-built bodies and read each response whole, so the client costs little next to the
server; each level reports requests/s, p50/p99 and the server's CPU time per request (its
process's user+system seconds over the window), the figure least disturbed by sharing the
machine's cores with the client. Modes alternate within each round.

``--triton`` compares xlaserve's REST port with Triton's own HTTP endpoint instead: Triton 2.51
is started through ../shared/peers/run_triton.sh (which installs it into $PEERS_ROOT on first
use; the same ``mlp``, python backend with dynamic batching, HTTP port = its gRPC port - 1)
beside xlaserve, both answers are checked once against the numpy reference
(peer_models.py), and each round drives, for every mode (binary tensor data, JSON) and
concurrency, xlaserve then Triton (the order reversed every other round) with the same client
and the same request bytes. It ends with a table of per-round medians and ranges, and the
ratio xlaserve / Triton of each round's requests/s. ``--baseline CHECKOUT`` does the same with
xlaserve run from another checkout (an earlier commit's ``git archive``) in Triton's place, so a
change to the REST path is measured against what it changed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import yaml

from benchmarks._servers import PEERS, ROOT, export_mlp_as, peer, stop, tree_cpu_seconds, wait_ready
from xlaserve.bench import loadgen

MODES = ("grpc", "rest-binary", "rest-json")


@contextmanager
def server(repo: Path, source: Path = ROOT):
    """``xlaserve run`` over ``repo`` with gRPC and REST on loopback, from the checkout ``source``;
    yields (grpc url, rest port, pid)."""
    work = Path(tempfile.mkdtemp(prefix="xlaserve-rest-bench-"))
    node = {"model_repo": str(repo),
            "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"},
            "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "static"}}
    (work / "node.yaml").write_text(yaml.safe_dump(node))
    ready = work / "ready.json"
    log = open(work / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "xlaserve", "--log-level", "warning", "run",
                             str(work / "node.yaml"), "--ready-file", str(ready)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=source)
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


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """One HTTP/1.1 response framed by Content-Length: (status line, lower-case headers, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"content-length" not in headers:
        raise RuntimeError(f"a response without Content-Length: {head[:300]!r}")
    return lines[0], headers, await reader.readexactly(int(headers[b"content-length"]))


async def _rest_client(port: int, request: bytes, stop_at: float, count_from: float, latencies: list,
                       answered: list) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    errors = 0
    try:
        while (now := time.perf_counter()) < stop_at:
            writer.write(request)
            status, _, _ = await read_response(reader)
            answered[0] += 1
            if not status.startswith(b"HTTP/1.1 200"):
                errors += 1
            if now >= count_from:
                latencies.append(time.perf_counter() - now)
    finally:
        writer.close()
    return errors


def rest_request(mode: str, x: np.ndarray) -> bytes:
    """The whole HTTP/1.1 request (head and body) of one ``mlp`` inference."""
    body, headers = rest_body(mode, x)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (f"POST /v2/models/mlp/infer HTTP/1.1\r\nhost: bench\r\ncontent-length: {len(body)}\r\n{head}\r\n"
            .encode() + body)


def decode_output(headers: dict[bytes, bytes], body: bytes) -> np.ndarray:
    """The ``output`` tensor of an inference response, JSON or binary."""
    length = headers.get(b"inference-header-content-length")
    doc = json.loads(body[:int(length)] if length is not None else body)
    offset = int(length) if length is not None else 0
    for out in doc["outputs"]:
        size = (out.get("parameters") or {}).get("binary_data_size")
        if out["name"] == "output":
            if size is not None:
                return np.frombuffer(body[offset:offset + size], np.float32).reshape(out["shape"])
            return np.asarray(out["data"], np.float32).reshape(out["shape"])
        offset += size or 0
    raise RuntimeError(f"no 'output' in {doc}")


async def check_answer(port: int, mode: str, x: np.ndarray) -> np.ndarray:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(rest_request(mode, x))
        status, headers, body = await read_response(reader)
    finally:
        writer.close()
    if not status.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{mode} on port {port}: {status!r} {body[:300]!r}")
    return decode_output(headers, body)


async def rest_level(port: int, mode: str, conc: int, duration: float, warmup: float) -> dict:
    x = np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32)
    request = rest_request(mode, x)
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


def check_peers(ports: dict[str, int], modes) -> None:
    """Both servers' answers, in each mode, against the numpy reference of ../shared/peers."""
    sys.path.insert(0, str(PEERS))
    import peer_models
    x = np.random.default_rng(1).standard_normal((1, 512)).astype(np.float32)
    want = peer_models.mlp(x)
    for name, port in ports.items():
        for mode in modes:
            got = asyncio.run(check_answer(port, mode, x))
            if got.shape != want.shape:
                raise RuntimeError(f"{name} {mode}: output shape {got.shape}, the reference's is {want.shape}")
            if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"{name} {mode}: the answer differs from the reference by up to "
                                   f"{float(np.max(np.abs(got - want)))}")
            print(json.dumps({"check": name, "mode": mode, "max_abs_diff": float(np.max(np.abs(got - want)))}),
                  flush=True)


@contextmanager
def other_server(args, repo: Path):
    """The server compared with: Triton's HTTP endpoint, or xlaserve from ``--baseline``;
    yields (name, REST port, pid)."""
    if args.baseline is not None:
        with server(repo, Path(args.baseline).resolve()) as (_, rest_port, pid):
            yield "baseline", rest_port, pid
        return
    logs = Path(tempfile.mkdtemp(prefix="rest-bench-triton-"))
    try:
        with peer("triton", logs) as (triton_url, triton_pid):
            wait_ready(triton_url, time.monotonic() + 300, models=("mlp",))
            yield "triton", int(triton_url.rsplit(":", 1)[1]) - 1, triton_pid
    finally:
        shutil.rmtree(logs, ignore_errors=True)


def against(rest_port: int, pid: int, args, levels: list[int], repo: Path) -> None:
    modes = args.modes.split(",")
    rows: list[dict] = []
    with other_server(args, repo) as (other, other_port, other_pid):
        servers = {"xlaserve": (rest_port, pid), other: (other_port, other_pid)}
        check_peers({k: v[0] for k, v in servers.items()}, modes)
        for rnd in range(args.rounds):
            for mode in modes:
                for conc in levels:
                    order = ("xlaserve", other) if rnd % 2 == 0 else (other, "xlaserve")
                    for name in order:
                        port, server_pid = servers[name]
                        cpu = tree_cpu_seconds(server_pid)
                        row = asyncio.run(rest_level(port, mode, conc, args.duration, args.warmup))
                        spent = tree_cpu_seconds(server_pid) - cpu
                        row["server_cpu_us_per_req"] = spent / max(row.pop("answered"), 1) * 1e6
                        row = {"round": rnd, "server": name, "mode": mode, "concurrency": conc,
                               "load1": round(os.getloadavg()[0], 2), **row}
                        rows.append(row)
                        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                              flush=True)
    print_comparison(rows, modes, levels, args.rounds, other)


def print_comparison(rows: list[dict], modes, levels, rounds: int, other: str = "triton") -> None:
    def span(values, fmt):
        return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"
    print(f"\nmedian (min-max) of {rounds} round(s); ratio: xlaserve req/s / {other} req/s within each round")
    print(f"{'mode':<12} {'c':>3} {'server':<9} {'req/s':>22} {'p50 ms':>20} {'p99 ms':>20} {'cpu us/req':>10} "
          f"{'errors':>6}")
    for mode in modes:
        for conc in levels:
            mine = {name: [r for r in rows if r["server"] == name and r["mode"] == mode and r["concurrency"] == conc]
                    for name in ("xlaserve", other)}
            for name, rs in mine.items():
                if not rs:
                    continue
                print(f"{mode:<12} {conc:>3} {name:<9} {span([r['throughput_rps'] for r in rs], '{:.0f}'):>22} "
                      f"{span([r['p50_ms'] for r in rs], '{:.2f}'):>20} {span([r['p99_ms'] for r in rs], '{:.2f}'):>20} "
                      f"{statistics.median(r['server_cpu_us_per_req'] for r in rs):>10.0f} "
                      f"{sum(r['errors'] for r in rs):>6}")
            ratios = [x["throughput_rps"] / t["throughput_rps"] for x, t in zip(mine["xlaserve"], mine[other])
                      if t["throughput_rps"]]
            if ratios:
                print(f"{mode:<12} {conc:>3} {'ratio':<9} {span(ratios, '{:.2f}'):>22}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--idle", type=int, default=0, help="measure N slowloris connections instead")
    p.add_argument("--triton", action="store_true",
                   help="compare the REST port with Triton's HTTP endpoint (../shared/peers/run_triton.sh)")
    p.add_argument("--baseline", help="compare the REST port with xlaserve run from this checkout instead")
    p.add_argument("--modes", default="rest-binary,rest-json",
                   help="with --triton or --baseline: the REST modes to compare")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        with server(repo) as (url, rest_port, pid):
            if args.idle:
                print(json.dumps(idle_connections(rest_port, pid, args.idle)), flush=True)
                return
            if args.triton or args.baseline:
                against(rest_port, pid, args, levels, repo)
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
