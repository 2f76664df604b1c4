"""What ``xlaserve top`` costs: the server's throughput with dashboards attached, and the
dashboard's own CPU while idle.

    python -m benchmarks.top_bench [--rounds 3] [--duration 8] [--dashboards 0,1,10]
    python -m benchmarks.top_bench --idle [--duration 30]

Throughput: exports the example ``mlp`` bundle (FP32 [1,512], compiled sizes 1..32), starts one
worker (``xlaserve run``, default node settings, loopback) and drives ``mlp`` at c=32 with the
load generator (:mod:`xlaserve.bench.loadgen`), with 0, 1 and 10 dashboards attached, in an order
that alternates each round (0,1,10 then 10,1,0 ...) so that drift on a shared machine falls on
every count alike. A dashboard here is headless: a process of its own holding the ``WatchStatus``
streams at 1 update a second and doing with each snapshot what the app does before drawing
(:func:`tui.status.derive` and :func:`tui.status.changes`). Prints a JSON line per level, then per
count the median req/s, the ratio to no dashboard with its spread over the rounds (each round's
ratio to that round's own no-dashboard run), and the worker's CPU per request.

Idle: runs ``xlaserve top`` itself in a 100x30 pseudo-terminal against an idle worker of four
models for ``--duration`` seconds at 1 update a second and prints the dashboard process's CPU as
a share of one core and the bytes it drew; then the worker's CPU per snapshot (ten headless
dashboards at 20 updates a second), and the worker's CPU with ten headless dashboards at 1 update
a second and with none.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import os
import pty
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path

from benchmarks._servers import ROOT, export_mlp_as, stop, tree_cpu_seconds, xlaserve
from xlaserve.bench import loadgen

INPUTS = {"mlp": [loadgen.InputSpec("input", "FP32", (1, 512))]}
CONCURRENCY = 32


async def headless(address: str, count: int, interval: float, connected: threading.Event | None = None) -> None:
    """``count`` dashboards without a screen: each holds a ``WatchStatus`` stream and derives its
    rows and events from each snapshot, as :class:`tui.app.TopApp` does before it draws."""
    from tui import connection
    from tui.status import changes, derive

    where = connection.parse_address(address)
    heard = 0

    async def one() -> None:
        nonlocal heard
        previous, at = None, 0.0
        async for status in connection.watch_status(where, interval):
            now = time.monotonic()
            derive(status, previous, now - at if previous is not None else None)
            changes(status, previous)
            previous, at = status, now
            heard += 1
            if heard == count and connected is not None:
                connected.set()
    await asyncio.gather(*(one() for _ in range(count)))


@contextlib.contextmanager
def dashboards(address: str, count: int, interval: float = 1.0):
    """``count`` headless dashboards in a process of their own, attached until the block ends."""
    if count == 0:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.top_bench", "--headless", address,
                             "--count", str(count), "--interval", str(interval)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()     # "attached" once every stream has had a snapshot
        if line.strip() != "attached":
            raise RuntimeError(f"the headless dashboards did not attach: {line!r}")
        yield proc.pid
    finally:
        stop(proc)


def _headless_main(args: argparse.Namespace) -> int:
    attached = threading.Event()

    async def run() -> None:
        async def announce() -> None:
            await asyncio.to_thread(attached.wait)
            print("attached", flush=True)
        await asyncio.gather(headless(args.headless, args.count, args.interval, attached), announce())
    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
    return 0


def throughput(args: argparse.Namespace) -> int:
    counts = [int(c) for c in args.dashboards.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        with xlaserve(repo) as (url, pid):
            plans = [loadgen.ClientPlan(lambda: "mlp") for _ in range(CONCURRENCY)]
            asyncio.run(loadgen.run_level(url, plans, INPUTS, duration=args.warmup, warmup=0.0))   # compile, warm
            for round_ in range(args.rounds):
                for count in (counts if round_ % 2 == 0 else counts[::-1]):
                    with dashboards(url, count):
                        cpu0 = tree_cpu_seconds(pid)
                        result = asyncio.run(loadgen.run_level(url, plans, INPUTS, duration=args.duration,
                                                               warmup=args.warmup))
                        cpu = tree_cpu_seconds(pid) - cpu0
                    row = result.rows()[0]
                    row.update(dashboards=count, round=round_,
                               worker_cpu_ms_per_request=round(1e3 * cpu / max(1, result.answered), 4))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\nmlp, c={CONCURRENCY}, {args.rounds} rounds of {args.duration:g} s, alternating order; "
          f"ratio: each round's req/s over its own no-dashboard run (median, min..max)")
    print(f"{'dashboards':>10} {'req/s':>9} {'ratio':>7} {'spread':>15} {'worker cpu ms/req':>18}")
    base = {r["round"]: r["throughput_rps"] for r in rows if r["dashboards"] == 0}
    for count in counts:
        mine = [r for r in rows if r["dashboards"] == count]
        rps = statistics.median(r["throughput_rps"] for r in mine)
        ratios = [r["throughput_rps"] / base[r["round"]] for r in mine if base.get(r["round"])]
        cpu = statistics.median(r["worker_cpu_ms_per_request"] for r in mine)
        spread = f"{min(ratios):.3f}..{max(ratios):.3f}" if ratios else "-"
        ratio = f"{statistics.median(ratios):.3f}" if ratios else "-"
        print(f"{count:>10} {rps:>9.1f} {ratio:>7} {spread:>15} {cpu:>18.4f}")
    return 0


def _cpu_seconds(pid: int) -> float:
    return tree_cpu_seconds(pid)


def idle(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        for name in ("mlp", "mlp2", "mlp3", "mlp4"):      # four models, as the examples have
            export_mlp_as(repo, name, (1, 2, 4, 8, 16, 32))
        with xlaserve(repo, source=Path(args.server_source)) as (url, pid):
            # the dashboard itself, in a 100x30 pseudo-terminal, drawing at 1 update a second
            primary, secondary = pty.openpty()
            fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
            env = {**os.environ, "TERM": "xterm-256color"}
            top = subprocess.Popen([sys.executable, "-m", "xlaserve", "top", url, "--interval", "1"],
                                   stdin=secondary, stdout=secondary, stderr=secondary, cwd=ROOT, env=env,
                                   start_new_session=True)
            os.close(secondary)
            drawn = [0]

            def drain() -> None:       # the terminal's side: read what the dashboard draws
                with contextlib.suppress(OSError):
                    while chunk := os.read(primary, 65536):
                        drawn[0] += len(chunk)
            threading.Thread(target=drain, daemon=True).start()
            try:
                time.sleep(5.0)        # started, connected, first frames drawn
                c0, t0, w0 = _cpu_seconds(top.pid), time.monotonic(), _cpu_seconds(pid)
                b0 = drawn[0]
                time.sleep(args.duration)
                c1, t1, w1 = _cpu_seconds(top.pid), time.monotonic(), _cpu_seconds(pid)
                b1 = drawn[0]
            finally:
                os.write(primary, b"q")
                try:
                    top.wait(10)
                except subprocess.TimeoutExpired:
                    top.kill()
                    top.wait()
                os.close(primary)
            span = t1 - t0
            print(json.dumps({"what": "dashboard idle, 1 update/s, 100x30", "seconds": round(span, 1),
                              "dashboard_cpu_s": round(c1 - c0, 3),
                              "dashboard_core_share_pct": round(100 * (c1 - c0) / span, 2),
                              "bytes_drawn_per_s": round((b1 - b0) / span, 1),
                              "worker_cpu_s": round(w1 - w0, 3)}), flush=True)
            # the worker's CPU per snapshot: ten headless dashboards at 20 updates a second
            with dashboards(url, 10, interval=0.05):
                w0, t0 = _cpu_seconds(pid), time.monotonic()
                time.sleep(args.duration / 2)
                w1, t1 = _cpu_seconds(pid), time.monotonic()
            snapshots = 10 * (t1 - t0) / 0.05
            print(json.dumps({"what": "worker CPU per snapshot (10 streams at 0.05 s, 4 models)",
                              "seconds": round(t1 - t0, 1), "worker_cpu_s": round(w1 - w0, 3),
                              "snapshots": int(snapshots),
                              "worker_cpu_us_per_snapshot": round(1e6 * (w1 - w0) / snapshots, 1)}), flush=True)
            # the worker's CPU, idle otherwise, with ten headless dashboards and with none
            for count in (0, 10, 0, 10):
                with dashboards(url, count):
                    w0, t0 = _cpu_seconds(pid), time.monotonic()
                    time.sleep(args.duration / 2)
                    w1, t1 = _cpu_seconds(pid), time.monotonic()
                print(json.dumps({"what": "worker idle", "dashboards": count, "seconds": round(t1 - t0, 1),
                                  "worker_cpu_s": round(w1 - w0, 3),
                                  "worker_core_share_pct": round(100 * (w1 - w0) / (t1 - t0), 3)}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0, help="seconds measured per level (--idle: in all)")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--dashboards", default="0,1,10", help="dashboard counts to compare (0 first)")
    p.add_argument("--idle", action="store_true", help="instead: the dashboard's own CPU while idle")
    p.add_argument("--server-source", default=str(ROOT),
                   help="--idle: the checkout whose worker runs (e.g. an older commit's, extracted with git "
                        "archive, to compare the worker's cost per snapshot)")
    p.add_argument("--headless", metavar="ADDRESS", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.headless:
        return _headless_main(args)
    if not args.dashboards.split(",")[0] == "0":
        p.error("--dashboards must start with 0 (the runs the others are compared with)")
    return idle(args) if args.idle else throughput(args)


if __name__ == "__main__":
    sys.exit(main())
