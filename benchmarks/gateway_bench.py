"""The gateway's overhead: one worker behind the gateway against the same worker direct.

    python -m benchmarks.gateway_bench [--rounds 3] [--duration 5] [--concurrency 1,8,32] [--client native|triton]
                                       [--cpu-policies batch,normal] [--pin]

Exports the example ``mlp`` bundle (FP32 [1,512], compiled sizes 1..32), starts one worker
(``xlaserve run``, default node settings on loopback) and one standalone gateway in front of it
(``xlaserve gateway`` with that worker as its only endpoint, in its own process), then drives
``mlp`` at each concurrency with the load generator (:mod:`xlaserve.bench.loadgen`), alternating
direct and through-the-gateway each round. The load generator's requests go out on xlaserve's own
HTTP/2 client by default (``--client native``, about 25 us of CPU a request; ``--client triton``:
the Triton gRPC aio client, about 60): on a machine where it shares the cores with the worker and
the gateway, its cost is taken from theirs. Prints a JSON line per level, then the medians: req/s,
p50/p99, the worker's CPU per request and the gateway's CPU per request (its process's CPU time
over the level divided by the answers), and the ratio gateway/direct. ``--cpu-policies`` runs one
gateway per ``cpu_policy`` value in front of the same worker, each measured in turn in every
round (docs/gateway.md, "CPU policy"). ``--pin`` holds the load generator to the first CPU and
the worker and the gateways to the others, as when the clients run elsewhere: then the gateway's
CPU, not how the cores are shared, is what the ratio shows. Gateway, worker and load
generator share this machine's cores, as the issue's goal (>= 0.75x at c=32) says.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import yaml

from benchmarks._servers import (consecutive_free_pair, export_mlp_as, free_ports, pin_threads, pin_tree, stop,
                                 tree_cpu_seconds, wait_ready, xlaserve)
from xlaserve.bench import loadgen

INPUTS = {"mlp": [loadgen.InputSpec("input", "FP32", (1, 512))]}


@contextmanager
def gateway(endpoints: list[str], work: Path, mode: str = "round_robin", timeout: float = 60,
            cpu_policy: str | None = None):
    """Run ``xlaserve gateway`` over ``endpoints`` (with ``cpu_policy`` when given, else the
    default); yields (url, pid)."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / "gateway.yaml"
    settings = {"listen": {"grpc": "127.0.0.1:0", "metrics": "127.0.0.1:0"}, "scheduling": {"mode": mode},
                "endpoints": endpoints}
    if cpu_policy is not None:
        settings["cpu_policy"] = cpu_policy
    config.write_text(yaml.safe_dump(settings))
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


def _counter(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_total") or line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def placement(args) -> int:
    """lpt_packing against round_robin on a two-worker node whose catalog's weights are
    ``--catalog-ratio`` x one worker's budget (so they fit in two): Zipf(1) traffic at
    ``--concurrency``; throughput and weight loads (cache misses) per request."""
    import urllib.request

    from benchmarks.weights_bench import build_catalog, drive
    from tests.conftest import serve
    tmp = Path(tempfile.mkdtemp(prefix="xlaserve-placement-"))
    sizes = build_catalog(tmp / "models", args.models)
    total = sum(sizes.values())
    budget = int(total / args.catalog_ratio)
    wiggle = 0.1
    arena = int(budget / (1 - wiggle))
    print(f"catalog: {len(sizes)} bundles, {total / 2**20:.1f} MiB of weights; each worker's budget "
          f"{budget / 2**20:.1f} MiB (catalog = {args.catalog_ratio}x one budget); Zipf(1), c={args.concurrency}, "
          f"{args.duration:.0f} s per mode after {args.warmup:.0f} s of warm-up")
    results = {}
    for round_ in range(args.rounds):
        for mode in (("round_robin", "lpt_packing") if round_ % 2 == 0 else ("lpt_packing", "round_robin")):
            grpc0, grpc1 = free_ports(2)
            metrics = consecutive_free_pair()
            glob = {"runtime": {"backend": "cpu", "device_memory_bytes": arena, "weight_cache_wiggle_fraction": wiggle},
                    "scheduler": {"discipline": "fifo"}}
            with serve(tmp / f"{mode}-{round_}", tmp / "models", glob, timeout=600,
                       workers=[{"name": "a", "port": grpc0}, {"name": "b", "port": grpc1}],
                       metrics_base_port=metrics, gateway={"scheduling": {"mode": mode}}) as node:
                drive(node.url, sorted(sizes), args.warmup, args.concurrency)
                before = [urllib.request.urlopen(f"http://127.0.0.1:{metrics + i}/metrics").read().decode()
                          for i in range(2)]
                result = drive(node.url, sorted(sizes), args.duration, args.concurrency)
                after = [urllib.request.urlopen(f"http://127.0.0.1:{metrics + i}/metrics").read().decode()
                         for i in range(2)]
            loads = sum(_counter(a, "xlaserve_weight_cache_misses") - _counter(b, "xlaserve_weight_cache_misses")
                        for a, b in zip(after, before))
            requests = result["rps"] * args.duration
            row = {"mode": mode, "round": round_, "rps": round(result["rps"], 1), "p50_ms": round(result["p50"], 2),
                   "p99_ms": round(result["p99"], 2), "errors": result["errors"],
                   "loads_per_request": round(loads / max(1, requests), 4)}
            print(json.dumps(row), flush=True)
            results.setdefault(mode, []).append(row)
    med = {m: {k: statistics.median(r[k] for r in rows) for k in ("rps", "loads_per_request", "p99_ms")}
           for m, rows in results.items()}
    rr, lpt = med["round_robin"], med["lpt_packing"]
    print(f"\nmedian of {args.rounds} rounds: round_robin {rr['rps']:.1f} req/s, {rr['loads_per_request']:.3f} "
          f"loads/request, p99 {rr['p99_ms']:.1f} ms; lpt_packing {lpt['rps']:.1f} req/s, "
          f"{lpt['loads_per_request']:.3f} loads/request, p99 {lpt['p99_ms']:.1f} ms")
    print(f"lpt_packing / round_robin: throughput {lpt['rps'] / rr['rps']:.2f}x, loads per request "
          f"{lpt['loads_per_request'] / max(rr['loads_per_request'], 1e-9):.2f}x")
    return 0


def replicas(args) -> int:
    """A hot model with two replicas on a two-worker node at ``--concurrency``: rows per
    execution (the workers' ModelStatistics inference_count / execution_count over the run)
    under lpt_packing (fill one replica's batch before the next) against round_robin."""
    import tritonclient.grpc as grpcclient

    from tests.conftest import serve
    tmp = Path(tempfile.mkdtemp(prefix="xlaserve-replicas-"))
    repo = tmp / "models"
    export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
    results = {}
    for round_ in range(args.rounds):
        for mode in (("round_robin", "lpt_packing") if round_ % 2 == 0 else ("lpt_packing", "round_robin")):
            grpc0, grpc1 = free_ports(2)
            metrics = consecutive_free_pair()
            gateway = {"scheduling": {"mode": mode}}
            if mode == "lpt_packing":
                gateway["scheduling"]["models"] = {"mlp": {"replicas": 2}}
            with serve(tmp / f"{mode}-{round_}", repo, {"scheduler": {"discipline": "fifo"}}, timeout=600,
                       workers=[{"name": "a", "port": grpc0}, {"name": "b", "port": grpc1}],
                       metrics_base_port=metrics, gateway=gateway) as node:
                plans = [loadgen.ClientPlan(lambda: "mlp") for _ in range(args.concurrency)]
                asyncio.run(loadgen.run_level(node.url, plans, INPUTS, duration=args.warmup, warmup=0.0))

                def counts() -> tuple[int, int]:
                    rows = execs = 0
                    for port in (grpc0, grpc1):
                        stats = grpcclient.InferenceServerClient(f"127.0.0.1:{port}").get_inference_statistics(
                            "mlp", as_json=True)["model_stats"][0]
                        rows += int(stats.get("inference_count", 0))
                        execs += int(stats.get("execution_count", 0))
                    return rows, execs
                rows0, execs0 = counts()
                result = asyncio.run(loadgen.run_level(node.url, plans, INPUTS, duration=args.duration, warmup=0.0))
                rows1, execs1 = counts()
            row = result.rows()[0]
            row.update(mode=mode, round=round_,
                       rows_per_execution=round((rows1 - rows0) / max(1, execs1 - execs0), 2))
            print(json.dumps(row), flush=True)
            results.setdefault(mode, []).append(row)
    med = {m: {k: statistics.median(r[k] for r in rows) for k in ("throughput_rps", "rows_per_execution", "p99_ms")}
           for m, rows in results.items()}
    rr, lpt = med["round_robin"], med["lpt_packing"]
    print(f"\nmedian of {args.rounds} rounds, mlp with 2 replicas at c={args.concurrency}: round_robin "
          f"{rr['rows_per_execution']:.2f} rows/execution, {rr['throughput_rps']:.0f} req/s, p99 {rr['p99_ms']:.1f} ms; "
          f"lpt_packing {lpt['rows_per_execution']:.2f} rows/execution, {lpt['throughput_rps']:.0f} req/s, "
          f"p99 {lpt['p99_ms']:.1f} ms")
    print(f"lpt_packing / round_robin: rows per execution {lpt['rows_per_execution'] / rr['rows_per_execution']:.2f}x, "
          f"throughput {lpt['throughput_rps'] / rr['throughput_rps']:.2f}x")
    return 0


def faults(args) -> int:
    """SIGKILL one of a two-worker node's workers at ``--concurrency`` (closed loop, ``mlp``)
    after a third of ``--duration``: every answer checked against the reference, hung requests
    (none answered within 30 s), failures against the requests in flight to the killed worker
    at the kill (the gateway's in-flight gauge, read just before it), and the time until the
    restarted worker is routed to again."""
    import re
    import signal
    import threading
    import urllib.request

    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    from tests.conftest import serve
    tmp = Path(tempfile.mkdtemp(prefix="xlaserve-faults-"))
    repo = tmp / "models"
    export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
    grpc0, grpc1 = free_ports(2)
    metrics = consecutive_free_pair()
    x = np.full((1, 512), 0.5, np.float32)
    with serve(tmp / "node", repo, {"scheduler": {"discipline": "fifo"}}, timeout=600,
               workers=[{"name": "a", "port": grpc0}, {"name": "b", "port": grpc1}], metrics_base_port=metrics,
               supervisor={"restart_backoff_initial_seconds": 0.1}) as node:
        def infer(client):
            tensor = grpcclient.InferInput("input", [1, 512], "FP32")
            tensor.set_data_from_numpy(x)
            return client.infer("mlp", [tensor], client_timeout=30).as_numpy("output")
        expected = infer(grpcclient.InferenceServerClient(node.url))
        outcomes: list[tuple[float, float, str]] = []
        wrong = [0]
        lock = threading.Lock()
        stop = time.monotonic() + args.duration

        def client_loop() -> None:
            client = grpcclient.InferenceServerClient(node.url)
            while time.monotonic() < stop:
                sent = time.monotonic()
                try:
                    ok = np.allclose(infer(client), expected, rtol=1e-5, atol=1e-5)
                    error = ""
                except InferenceServerException as exc:
                    ok, error = True, str(exc.status())
                with lock:
                    wrong[0] += not ok
                    outcomes.append((sent, time.monotonic(), error))
        threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        time.sleep(args.duration / 3)
        page = urllib.request.urlopen(f"{node.http}/metrics").read().decode()
        in_flight = float(re.search(r'xlaserve_gateway_in_flight\{worker="b"\} (\S+)', page).group(1))
        victim = _child(node.process.pid, ["--worker", "b"])
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        back_at = None
        routed = r'xlaserve_gateway_requests_routed_total\{model="mlp",worker="b"\} (\S+)'
        base = None
        while time.monotonic() < stop and back_at is None:
            page = urllib.request.urlopen(f"{node.http}/metrics").read().decode()
            up = re.search(r'xlaserve_gateway_worker_up\{worker="b"\} 1\.0', page)
            count = float(m.group(1)) if (m := re.search(routed, page)) else 0.0
            if base is None:
                base = count
            if up and count > base:
                back_at = time.monotonic()
            time.sleep(0.02)
        for t in threads:
            t.join(40)
        hung = sum(t.is_alive() for t in threads)
    failed = [o for o in outcomes if o[2]]
    statuses = sorted({o[2] for o in failed})
    print(json.dumps({"requests": len(outcomes), "wrong": wrong[0], "hung": hung, "failed": len(failed),
                      "failed_statuses": statuses, "in_flight_to_killed_worker": in_flight,
                      "failed_sent_after_kill": sum(1 for o in failed if o[0] > killed_at),
                      "failures_within_s_of_kill": round(max((o[1] - killed_at for o in failed), default=0.0), 3),
                      "serving_again_after_s": round(back_at - killed_at, 2) if back_at else None}))
    print(f"\nSIGKILL of worker b at c={args.concurrency}: {len(outcomes)} requests, {wrong[0]} wrong, {hung} hung, "
          f"{len(failed)} failed ({', '.join(statuses) or 'none'}; "
          f"{sum(1 for o in failed if o[0] > killed_at)} of them sent after the kill), the gateway's gauge read "
          f"{in_flight:.0f} in flight to b just before it; "
          f"b routed to again {back_at - killed_at:.2f} s after the kill" if back_at else "b not routed to again")
    return 0


def soak(args) -> int:
    """The standalone gateway in front of one worker under ``mlp`` load at ``--concurrency`` for
    ``--duration`` seconds: answers, errors and the gateway's RSS every 5 s (it must stay flat)."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        with xlaserve(repo) as (direct_url, _), gateway([direct_url], Path(tmp)) as (gw_url, gw_pid):
            wait_ready(gw_url, time.monotonic() + 60, models=("mlp",))
            plans = [loadgen.ClientPlan(lambda: "mlp") for _ in range(args.concurrency)]
            rss = []
            answered = errors = 0
            for i in range(max(1, int(args.duration // 5))):
                result = asyncio.run(loadgen.run_level(gw_url, plans, INPUTS, duration=5, warmup=0))
                answered += result.answered
                errors += sum(sum(t.errors.values()) for t in result.tallies.values())
                rss.append(_rss_mib(gw_pid))
                print(f"{5 * (i + 1):>4} s: {result.answered} answered, gateway RSS {rss[-1]} MiB", flush=True)
    growth = (rss[-1] - rss[0]) / rss[0] * 100
    print(f"\n{answered} answered, {errors} errors; gateway RSS {rss[0]} -> {rss[-1]} MiB ({growth:+.1f}% after the "
          f"first 5 s)")
    return 0 if errors == 0 and growth < 5 else 1


def _rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def _child(parent: int, args: list[str]) -> int:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")[:-1]
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and [a.decode() for a in cmdline[-len(args):]] == args:
            return int(proc.name)
    raise RuntimeError(f"no child of {parent} runs {args}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--client", choices=["native", "triton"], default="native",
                        help="the overhead levels' load generator: xlaserve's own HTTP/2 client (default; about "
                             "25 us of CPU a request) or the Triton gRPC aio client (about 60)")
    parser.add_argument("--cpu-policies", default="",
                        help="the overhead levels: one gateway for each of these cpu_policy values (comma-separated, "
                             "e.g. batch,normal), all in front of the same worker and measured in turn; default: one "
                             "gateway with the default policy")
    parser.add_argument("--pin", action="store_true",
                        help="the overhead levels with the clients elsewhere: the load generator held to the first "
                             "CPU, the worker and the gateways to the others")
    parser.add_argument("--placement", action="store_true",
                        help="instead: lpt_packing vs round_robin on a memory-bound two-worker node")
    parser.add_argument("--models", type=int, default=40, help="--placement: bundles in the catalog")
    parser.add_argument("--catalog-ratio", type=float, default=1.6,
                        help="--placement: the catalog's weights over one worker's budget")
    parser.add_argument("--replicas", action="store_true",
                        help="instead: rows per execution of a two-replica model, lpt_packing vs round_robin")
    parser.add_argument("--faults", action="store_true",
                        help="instead: SIGKILL one of two workers under load (supervisor restart)")
    parser.add_argument("--soak", action="store_true",
                        help="instead: the gateway's RSS and errors under load for --duration seconds")
    args = parser.parse_args(argv)
    if args.soak:
        args.concurrency = int(args.concurrency.split(",")[-1])
        return soak(args)
    if args.faults:
        args.concurrency = int(args.concurrency.split(",")[-1])
        return faults(args)
    if args.replicas:
        args.concurrency = int(args.concurrency.split(",")[-1])
        return replicas(args)
    if args.placement:
        args.concurrency = int(args.concurrency.split(",")[-1]) if "," in args.concurrency else int(args.concurrency)
        return placement(args)
    levels = [int(c) for c in args.concurrency.split(",")]
    policies = args.cpu_policies.split(",") if args.cpu_policies else [None]
    # one gateway per policy, each its own process in front of the same worker: "gateway" alone,
    # else "gateway[POLICY]"
    labels = ["gateway" if p is None else f"gateway[{p}]" for p in policies]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        repo = Path(tmp) / "models"
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        direct_url, worker_pid = stack.enter_context(xlaserve(repo))
        targets = {"direct": (direct_url, None)}
        for label, policy in zip(labels, policies):
            targets[label] = stack.enter_context(gateway([direct_url], Path(tmp) / label, cpu_policy=policy))
        wait_ready(direct_url, time.monotonic() + 120, models=("mlp",))
        for label in labels:
            wait_ready(targets[label][0], time.monotonic() + 60, models=("mlp",))
        servers_cpus = None
        if args.pin:
            # the clients elsewhere: the load generator on the first CPU, the servers on the rest
            cpus = sorted(os.sched_getaffinity(0))
            if len(cpus) < 2:
                raise SystemExit("--pin needs at least two CPUs")
            servers_cpus = set(cpus[1:])
            pin_threads(os.getpid(), {cpus[0]})      # this process alone: the servers are its children
        for round_ in range(args.rounds):
            order = list(targets) if round_ % 2 == 0 else list(targets)[::-1]
            for path in order:
                url, gw_pid = targets[path]
                if servers_cpus is not None:
                    for _, pid in targets.values():
                        pin_tree(pid or worker_pid, servers_cpus)
                for conc in levels:
                    plans = [loadgen.ClientPlan(lambda: "mlp") for _ in range(conc)]
                    w0, g0 = tree_cpu_seconds(worker_pid), tree_cpu_seconds(gw_pid) if gw_pid else 0.0
                    result = loadgen.measure(url, plans, INPUTS, client=args.client, duration=args.duration,
                                             warmup=args.warmup)
                    w = tree_cpu_seconds(worker_pid) - w0
                    g = tree_cpu_seconds(gw_pid) - g0 if gw_pid else 0.0
                    row = result.rows()[0]
                    n = max(1, result.answered)
                    row.update(path=path, round=round_, worker_cpu_ms_per_request=round(1e3 * w / n, 3),
                               gateway_cpu_ms_per_request=round(1e3 * g / n, 3))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(f"\nmedian of {args.rounds} rounds, {args.duration:.0f} s each (mlp, FP32 [1,512], the {args.client} client); "
          "CPU in ms per request; "
          "ratio: of the medians; paired: each round's gateway req/s over that round's direct run (median, "
          "min..max)")
    width = max(8, *(len(label) for label in labels))
    print(f"{'c':>3} {'path':<{width}} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'worker cpu':>10} "
          f"{'gateway cpu':>11} {'ratio':>6} {'paired':>17} {'errors':>6}")
    for conc in levels:
        direct_rps = None
        for path in ("direct", *labels):
            mine = [r for r in rows if r["path"] == path and r["concurrency"] == conc]
            med = {k: statistics.median(r[k] or 0 for r in mine)
                   for k in ("throughput_rps", "p50_ms", "p99_ms", "worker_cpu_ms_per_request",
                             "gateway_cpu_ms_per_request")}
            if path == "direct":
                direct_rps = med["throughput_rps"]
            ratio = med["throughput_rps"] / direct_rps if direct_rps else float("nan")
            errors = sum(sum(r["errors"].values()) for r in mine)
            paired = [g["throughput_rps"] / d["throughput_rps"] for g in mine for d in rows
                      if d["path"] == "direct" and d["concurrency"] == conc and d["round"] == g["round"]
                      and d["throughput_rps"]]
            paired_text = (f"{statistics.median(paired):.2f} {min(paired):.2f}..{max(paired):.2f}"
                           if path != "direct" and paired else "")
            print(f"{conc:>3} {path:<{width}} {med['throughput_rps']:>9.1f} {med['p50_ms']:>8.2f} {med['p99_ms']:>8.2f} "
                  f"{med['worker_cpu_ms_per_request']:>10.3f} {med['gateway_cpu_ms_per_request']:>11.3f} "
                  f"{ratio:>6.2f} {paired_text:>17} {errors:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
