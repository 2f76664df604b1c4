"""Does coalescing pay? ``mlp`` at c=32 with compiled sizes [1] versus [1,2,4,8,16,32].

    python -m xlaserve.bench.coalescing_bench [--rounds 2] [--duration 10] [--concurrency 32]

Both variants are exported from the example ``mlp`` (as models ``mlp_b1`` and ``mlp``) and
served by one xlaserve each, in alternating rounds. Reports throughput, p50/p99 and the mean rows
per execution (inference_count / execution_count from ModelStatistics over the measured window).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

import tritonclient.grpc as grpcclient

from xlaserve.bench import loadgen
from xlaserve.bench._servers import export_mlp_as, xlaserve

VARIANTS = {"[1]": (1,), "[1,2,4,8,16,32]": (1, 2, 4, 8, 16, 32)}


def measure(url: str, conc: int, duration: float, warmup: float) -> dict:
    c = grpcclient.InferenceServerClient(url)
    inputs = {"mlp": [loadgen.InputSpec("input", "FP32", (1, 512))]}
    plans = [loadgen.ClientPlan(lambda: "mlp") for _ in range(conc)]
    # statistics over warm-up + window; the warm-up is short next to the window
    before = c.get_inference_statistics("mlp").model_stats[0]
    result = asyncio.run(loadgen.run_level(url, plans, inputs, duration=duration, warmup=warmup))
    after = c.get_inference_statistics("mlp").model_stats[0]
    row = result.rows()[0]
    row["rows_per_execution"] = round((after.inference_count - before.inference_count)
                                      / max(1, after.execution_count - before.execution_count), 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repos = {}
        for label, sizes in VARIANTS.items():
            repos[label] = Path(tmp) / label.strip("[]").replace(",", "_")
            repos[label].mkdir()
            export_mlp_as(repos[label], "mlp", sizes)
        results: dict[str, list[dict]] = {label: [] for label in VARIANTS}
        for round_ in range(args.rounds):
            for label in VARIANTS:
                with xlaserve(repos[label]) as (url, _):
                    row = measure(url, args.concurrency, args.duration, args.warmup)
                row.update(sizes=label, round=round_)
                results[label].append(row)
                print(json.dumps(row), flush=True)
    print(f"\nmlp, c={args.concurrency}, {args.rounds} alternating rounds of {args.duration:.0f} s")
    print(f"{'compiled sizes':<18} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'rows/execution':>15}")
    means = {}
    for label, rows in results.items():
        mean = {k: sum(r[k] for r in rows) / len(rows) for k in ("throughput_rps", "p50_ms", "p99_ms",
                                                                  "rows_per_execution")}
        means[label] = mean
        print(f"{label:<18} {mean['throughput_rps']:>9.1f} {mean['p50_ms']:>8.2f} {mean['p99_ms']:>8.2f} "
              f"{mean['rows_per_execution']:>15.2f}")
    a, b = (means[k]["throughput_rps"] for k in VARIANTS)
    print(f"speed-up from coalescing: {b / a:.2f}x")


if __name__ == "__main__":
    main()
