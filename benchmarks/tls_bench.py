"""What TLS costs on the gRPC endpoint: the Triton client, one request at a time (c=1), ModelInfer
on the ``simple`` example, against two workers started side by side from the same repository,
one cleartext and one with ``endpoints.tls`` (certificates made for the run, as in
tests/test_tls.py). Rounds alternate which is measured first.

    python -m benchmarks.tls_bench [--rounds 3] [--duration 5]

Prints one line per round and mode, then the medians: requests/s and p50/p99 latency in ms.
A new client connects per round (its handshake happens before the window). The figure is in
docs/security.md, *TLS*.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from examples.export_examples import export_simple
from tests.conftest import infer_input, serve
from tests.test_tls import make_certs


def measure(client: grpcclient.InferenceServerClient, seconds: float) -> tuple[float, float, float]:
    """Requests/s, p50 and p99 latency (ms) of back-to-back infers for ``seconds``."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", a, "INT32")]
    for _ in range(50):   # warm: connection, handshake, the model's first executions
        client.infer("simple", inputs)
    latencies = []
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        client.infer("simple", inputs)
        latencies.append(time.perf_counter() - now)
    elapsed = time.perf_counter() - start
    latencies.sort()
    return (len(latencies) / elapsed, latencies[len(latencies) // 2] * 1e3,
            latencies[int(len(latencies) * 0.99)] * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds measured per round and mode")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="xlaserve-tls-bench-") as tmp:
        work = Path(tmp)
        repo = work / "models"
        export_simple(repo, (1,))
        certs = make_certs(work / "certs")
        tls = {"cert_file": str(certs.server), "key_file": str(certs.server_key)}
        with serve(work / "plain", repo) as plain, serve(work / "tls", repo, {"endpoints": {"tls": tls}}) as secure:
            clients = {
                "cleartext": lambda: grpcclient.InferenceServerClient(plain.url),
                "tls": lambda: grpcclient.InferenceServerClient(secure.url, ssl=True,
                                                                root_certificates=str(certs.ca)),
            }
            results: dict[str, list[tuple[float, float, float]]] = {mode: [] for mode in clients}
            for round_ in range(args.rounds):
                order = list(clients) if round_ % 2 == 0 else list(reversed(clients))
                for mode in order:
                    client = clients[mode]()
                    result = measure(client, args.duration)
                    client.close()
                    results[mode].append(result)
                    print(f"round {round_ + 1} {mode:9s}: {result[0]:7.0f} req/s  p50 {result[1]:.3f} ms  "
                          f"p99 {result[2]:.3f} ms", flush=True)
        for mode, rows in results.items():
            rate, p50, p99 = (statistics.median(column) for column in zip(*rows))
            print(f"median {mode:9s}: {rate:7.0f} req/s  p50 {p50:.3f} ms  p99 {p99:.3f} ms")
        print(f"({os.cpu_count()} CPUs, python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
