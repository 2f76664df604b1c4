"""Does coalescing pay? ``mlp`` at c=32 with compiled sizes [1] versus [1,2,4,8,16,32].

    python -m benchmarks.coalescing_bench [--rounds 2] [--duration 10] [--concurrency 32]
        [--delay-ms D [--target-rows T]]

Both variants are exported from the example ``mlp`` and served by one xlaserve each, in
alternating rounds. ``--delay-ms`` adds a third: [1..32] with ``batch_delay_seconds`` (and
``batch_target_rows``) set for ``mlp``. Reports throughput, p50/p99, the mean rows per
execution (inference_count / execution_count from ModelStatistics over the measured window),
device time per row (the executions' compute durations over the rows they served) and the
server's CPU time per request.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import tritonclient.grpc as grpcclient

from benchmarks._servers import batch_device_seconds, export_mlp_as, tree_cpu_seconds, xlaserve
from xlaserve.bench import loadgen

SIZES = {"[1]": (1,), "[1,2,4,8,16,32]": (1, 2, 4, 8, 16, 32)}
COLUMNS = ("throughput_rps", "p50_ms", "p99_ms", "rows_per_execution", "device_us_per_row", "server_cpu_us_per_req")


def measure(url: str, conc: int, duration: float, warmup: float, pid: int | None = None) -> dict:
    c = grpcclient.InferenceServerClient(url)
    inputs = {"mlp": [loadgen.InputSpec("input", "FP32", (1, 512))]}
    plans = [loadgen.ClientPlan(lambda: "mlp") for _ in range(conc)]
    # statistics over warm-up + window; the warm-up is short next to the window
    before = c.get_inference_statistics("mlp").model_stats[0]
    cpu_before = tree_cpu_seconds(pid) if pid else 0.0
    result = asyncio.run(loadgen.run_level(url, plans, inputs, duration=duration, warmup=warmup))
    cpu_after = tree_cpu_seconds(pid) if pid else 0.0
    after = c.get_inference_statistics("mlp").model_stats[0]
    row = result.rows()[0]
    inferences = max(1, after.inference_count - before.inference_count)
    row["rows_per_execution"] = round(inferences / max(1, after.execution_count - before.execution_count), 2)
    row["device_us_per_row"] = round((batch_device_seconds(after) - batch_device_seconds(before)) / inferences * 1e6, 1)
    row["server_cpu_us_per_req"] = round((cpu_after - cpu_before) / inferences * 1e6, 1) if pid else None
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="also run [1..32] with scheduler.models.mlp.batch_delay_seconds set to this")
    p.add_argument("--target-rows", type=int, default=None,
                   help="with --delay-ms: batch_target_rows (default: the largest compiled size)")
    args = p.parse_args()
    if args.target_rows is not None and not args.delay_ms:
        p.error("--target-rows applies to the held variant only: give --delay-ms too")
    variants: dict[str, tuple[tuple[int, ...], dict]] = {label: (sizes, {}) for label, sizes in SIZES.items()}
    if args.delay_ms:
        held = {"batch_delay_seconds": args.delay_ms / 1e3, "batch_target_rows": args.target_rows}
        variants[f"[1..32] held {args.delay_ms:g} ms/{args.target_rows or 32} rows"] = \
            (SIZES["[1,2,4,8,16,32]"], {"models": {"mlp": held}})
    with tempfile.TemporaryDirectory() as tmp:
        repos = {}
        for sizes in {v[0] for v in variants.values()}:
            repos[sizes] = Path(tmp) / "_".join(map(str, sizes))
            repos[sizes].mkdir()
            export_mlp_as(repos[sizes], "mlp", sizes)
        results: dict[str, list[dict]] = {label: [] for label in variants}
        for round_ in range(args.rounds):
            for label, (sizes, sched) in variants.items():
                with xlaserve(repos[sizes], sched) as (url, pid):
                    row = measure(url, args.concurrency, args.duration, args.warmup, pid)
                row.update(sizes=label, round=round_)
                results[label].append(row)
                print(json.dumps(row), flush=True)
    print(f"\nmlp, c={args.concurrency}, {args.rounds} alternating rounds of {args.duration:.0f} s")
    print(f"{'variant':<30} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'rows/exec':>10} {'device us/row':>14} "
          f"{'cpu us/req':>11}")
    means = {}
    for label, rows in results.items():
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in COLUMNS}
        means[label] = mean
        print(f"{label:<30} {mean['throughput_rps']:>9.1f} {mean['p50_ms']:>8.2f} {mean['p99_ms']:>8.2f} "
              f"{mean['rows_per_execution']:>10.2f} {mean['device_us_per_row']:>14.1f} "
              f"{mean['server_cpu_us_per_req']:>11.1f}")
    base = means["[1]"]["throughput_rps"]
    for label in list(variants)[1:]:
        print(f"speed-up from coalescing, {label}: {means[label]['throughput_rps'] / base:.2f}x")


if __name__ == "__main__":
    main()
