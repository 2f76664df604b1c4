"""The HTTP/1.1 layer alone (``xlaserve/frontend/http1.py``): its CPU time per request.

One process serves :class:`~xlaserve.frontend.http1.Http1Server` on loopback with a handler
that answers at once (a checkpoint, then a fixed 2,100-byte body: about the binary ``mlp``
reply), so what the server spends is the parser (llhttp), the connection's tasks, reads
and writes; no model, no scheduler. The client is ``rest_bench``'s: closed loops of raw
HTTP/1.1 keep-alive connections sending the binary ``mlp`` request's bytes. ``--baseline
CHECKOUT`` serves a second copy from another checkout (an earlier commit's ``git archive``) and
alternates the two within each round (the order reversed every other round); the figure to read
is the server's CPU microseconds per answered request (its process's user+system time), which
the load generator sharing the machine moves far less than requests/s.

    python -m benchmarks.http1_bench --baseline /tmp/base --rounds 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks._servers import ROOT, stop
from benchmarks.rest_bench import _rest_client, rest_request

# run as a script by the server process, with the checkout to import first as argv[1]
SERVER = """
import sys
sys.path.insert(0, sys.argv[1])
import trio
from xlaserve.frontend.http1 import Http1Server, HttpResponse

BODY = b"x" * 2100


async def handler(request):
    await trio.lowlevel.checkpoint()
    return HttpResponse(200, BODY, "application/octet-stream")


async def main():
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    async with trio.open_nursery() as nursery:
        print(await nursery.start(Http1Server(handler).serve, listeners), flush=True)

trio.run(main)
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(port: int, request: bytes, conc: int, duration: float, warmup: float) -> tuple[int, int]:
    start = time.perf_counter()
    latencies: list[float] = []
    answered = [0]
    errors = await asyncio.gather(*(_rest_client(port, request, start + warmup + duration, start + warmup,
                                                 latencies, answered) for _ in range(conc)))
    return answered[0], sum(errors)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--baseline", help="also serve the HTTP layer of this checkout, alternating")
    args = p.parse_args(argv)
    checkouts = {"xlaserve": ROOT}
    if args.baseline:
        checkouts["baseline"] = Path(args.baseline).resolve()
    servers: dict[str, tuple[subprocess.Popen, int]] = {}
    request = rest_request("rest-binary", np.random.default_rng(0).standard_normal((1, 512)).astype(np.float32))
    rows: dict[tuple[int, str], list[tuple[float, float]]] = {}
    try:
        for name, source in checkouts.items():
            proc = subprocess.Popen([sys.executable, "-c", SERVER, str(source)], stdout=subprocess.PIPE, cwd=source)
            servers[name] = (proc, int(proc.stdout.readline()))
        for rnd in range(args.rounds):
            for conc in (int(c) for c in args.concurrency.split(",")):
                names = list(servers) if rnd % 2 == 0 else list(reversed(servers))
                for name in names:
                    proc, port = servers[name]
                    before = cpu_seconds(proc.pid)
                    answered, errors = asyncio.run(drive(port, request, conc, args.duration, args.warmup))
                    per_request = (cpu_seconds(proc.pid) - before) / max(answered, 1) * 1e6
                    rps = answered / (args.duration + args.warmup)
                    rows.setdefault((conc, name), []).append((rps, per_request))
                    print(json.dumps({"round": rnd, "server": name, "concurrency": conc, "load1": os.getloadavg()[0],
                                      "throughput_rps": round(rps), "errors": errors,
                                      "server_cpu_us_per_req": round(per_request, 1)}), flush=True)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    print(f"\nmedian (min-max) of {args.rounds} round(s)")
    print(f"{'c':>3} {'server':10} {'req/s':>20} {'cpu us/req':>22}")
    for (conc, name), values in sorted(rows.items()):
        rps = [v[0] for v in values]
        cpu = [v[1] for v in values]
        print(f"{conc:>3} {name:10} {statistics.median(rps):>8.0f} ({min(rps):.0f}-{max(rps):.0f})"
              f" {statistics.median(cpu):>10.1f} ({min(cpu):.1f}-{max(cpu):.1f})")


if __name__ == "__main__":
    main()
