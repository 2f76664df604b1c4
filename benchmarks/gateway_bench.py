"""The gateway's overhead: one worker behind the gateway against the same worker direct.

    python -m benchmarks.gateway_bench [--rounds 3] [--duration 5] [--concurrency 1,8,32]

Exports the example ``mlp`` bundle (FP32 [1,512], compiled sizes 1..32), starts one worker
(``xlaserve run``, default node settings on loopback) and one standalone gateway in front of it
(``xlaserve gateway`` with that worker as its only endpoint, in its own process), then drives
``mlp`` at each concurrency with the load generator (:mod:`xlaserve.bench.loadgen`), alternating
direct and through-the-gateway each round. Prints a JSON line per level, then the medians: req/s,
p50/p99, the worker's CPU per request and the gateway's CPU per request (its process's CPU time
over the level divided by the answers), and the ratio gateway/direct. Gateway, worker and load
generator share this machine's cores, as the issue's goal (>= 0.75x at c=32) says.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import yaml

from benchmarks._servers import export_mlp_as, stop, tree_cpu_seconds, wait_ready, xlaserve
from xlaserve.bench import loadgen

INPUTS = {"mlp": [loadgen.InputSpec("input", "FP32", (1, 512))]}


@contextmanager
def gateway(endpoints: list[str], work: Path, mode: str = "round_robin", timeout: float = 60):
    """Run ``xlaserve gateway`` over ``endpoints``; yields (url, pid)."""
    config = work / "gateway.yaml"
    config.write_text(yaml.safe_dump({"listen": {"grpc": "127.0.0.1:0", "metrics": "127.0.0.1:0"},
                                      "scheduling": {"mode": mode}, "endpoints": endpoints}))
    ready = work / "gateway-ready.json"
    log = open(work / "gateway.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "xlaserve", "gateway", str(config), "--ready-file", str(ready)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start:\n{(work / 'gateway.log').read_text()}")
            time.sleep(0.05)
        ports = json.loads(ready.read_text())
        yield f"127.0.0.1:{ports['grpc_port']}", proc.pid
    finally:
        stop(proc)
        log.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--concurrency", default="1,8,32")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        with xlaserve(repo) as (direct_url, worker_pid), gateway([direct_url], Path(tmp)) as (gw_url, gw_pid):
            wait_ready(direct_url, time.monotonic() + 120, models=("mlp",))
            wait_ready(gw_url, time.monotonic() + 60, models=("mlp",))
            for round_ in range(args.rounds):
                order = ["direct", "gateway"] if round_ % 2 == 0 else ["gateway", "direct"]
                for path in order:
                    url = direct_url if path == "direct" else gw_url
                    for conc in levels:
                        plans = [loadgen.ClientPlan(lambda: "mlp") for _ in range(conc)]
                        w0, g0 = tree_cpu_seconds(worker_pid), tree_cpu_seconds(gw_pid)
                        result = asyncio.run(loadgen.run_level(url, plans, INPUTS, duration=args.duration,
                                                               warmup=args.warmup))
                        w, g = tree_cpu_seconds(worker_pid) - w0, tree_cpu_seconds(gw_pid) - g0
                        row = result.rows()[0]
                        n = max(1, result.answered)
                        row.update(path=path, round=round_, worker_cpu_ms_per_request=round(1e3 * w / n, 3),
                                   gateway_cpu_ms_per_request=round(1e3 * g / n, 3) if path == "gateway" else 0.0)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    print(f"\nmedian of {args.rounds} rounds, {args.duration:.0f} s each (mlp, FP32 [1,512]); CPU in ms per request")
    print(f"{'c':>3} {'path':<8} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'worker cpu':>10} {'gateway cpu':>11} "
          f"{'ratio':>6} {'errors':>6}")
    for conc in levels:
        direct_rps = None
        for path in ("direct", "gateway"):
            mine = [r for r in rows if r["path"] == path and r["concurrency"] == conc]
            med = {k: statistics.median(r[k] or 0 for r in mine)
                   for k in ("throughput_rps", "p50_ms", "p99_ms", "worker_cpu_ms_per_request",
                             "gateway_cpu_ms_per_request")}
            if path == "direct":
                direct_rps = med["throughput_rps"]
            ratio = med["throughput_rps"] / direct_rps if direct_rps else float("nan")
            errors = sum(sum(r["errors"].values()) for r in mine)
            print(f"{conc:>3} {path:<8} {med['throughput_rps']:>9.1f} {med['p50_ms']:>8.2f} {med['p99_ms']:>8.2f} "
                  f"{med['worker_cpu_ms_per_request']:>10.3f} {med['gateway_cpu_ms_per_request']:>11.3f} "
                  f"{ratio:>6.2f} {errors:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
