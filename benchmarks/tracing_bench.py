"""What tracing costs: the reference ``mlp`` served three ways in alternating rounds.

    python -m benchmarks.tracing_bench --baseline CHECKOUT [--rounds 4] [--duration 5]
        [--concurrency 8,32] [--spans FILE] [--variants baseline,off,on]

- ``baseline``: ``xlaserve run`` from CHECKOUT, a ``git worktree`` of the commit before tracing;
- ``off``: this checkout, no ``tracing:`` block (tracing off, the default);
- ``on``: this checkout with ``tracing: {enabled: true, sampling_ratio: 1.0, exporter: file}``:
  every request traced, its spans exported in the worker's process by the export thread, as JSON
  lines to ``--spans`` (a temporary file by default, truncated before each level; the lines
  counted after it, a check that the spans were written).

Each round starts each server in turn (the order reversed every other round), drives ``mlp``
(FP32 [1,512], compiled sizes 1..32) at each concurrency with the closed-loop load generator and
stops it. The machine is shared and noisy, so the ratios are paired within a round
(``off``/``baseline`` and ``on``/``baseline`` of the same round and level) and reported as their
median and range over the rounds. Prints JSON lines, then the table.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._servers import ROOT, export_mlp_as, tree_cpu_seconds, wait_ready, xlaserve
from xlaserve.bench import loadgen

INPUTS = {"mlp": [loadgen.InputSpec("input", "FP32", (1, 512))]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, required=True, help="a checkout of the commit before tracing")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", default="8,32")
    p.add_argument("--spans", type=Path, help="the file the 'on' server writes its spans to")
    p.add_argument("--variants", default="baseline,off,on", help="which of baseline, off, on to run")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        spans = args.spans or Path(tmp) / "spans.jsonl"
        tracing = {"tracing": {"enabled": True, "sampling_ratio": 1.0, "exporter": "file", "file": str(spans)}}
        variants = {"baseline": {"source": args.baseline}, "off": {"source": ROOT},
                    "on": {"source": ROOT, "top": tracing}}
        variants = {name: variants[name] for name in args.variants.split(",")}
        for round_ in range(args.rounds):
            order = list(variants)
            if round_ % 2:
                order.reverse()
            for name in order:
                with xlaserve(repo, log_path=Path(tmp) / f"{name}.log", **variants[name]) as (url, pid):
                    wait_ready(url, time.monotonic() + 120, models=("mlp",))
                    for conc in levels:
                        if spans.exists():
                            os.truncate(spans, 0)       # the server appends to the file it opened
                        cpu0 = tree_cpu_seconds(pid)
                        result = asyncio.run(loadgen.run_level(
                            url, [loadgen.ClientPlan(lambda: "mlp") for _ in range(conc)], INPUTS,
                            duration=args.duration, warmup=args.warmup))
                        cpu = tree_cpu_seconds(pid) - cpu0
                        row = result.rows()[0]
                        row.update(server=name, round=round_,
                                   server_cpu_ms_per_request=round(1e3 * cpu / max(1, result.answered), 3))
                        if name == "on":
                            row["span_lines"] = sum(1 for _ in spans.open()) if spans.exists() else 0
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    report(rows, levels, args.rounds, args.duration)


def report(rows: list[dict], levels: list[int], rounds: int, duration: float) -> None:
    print(f"\nmlp, {rounds} rounds of {duration:g} s a level; ratio: req/s over the same round's baseline "
          "(median, min..max)")
    print(f"{'c':>3} {'server':<9} {'req/s':>9} {'p50 ms':>8} {'cpu ms/req':>10} {'ratio':>6} {'range':>13}")
    for conc in levels:
        base = {r["round"]: r["throughput_rps"] for r in rows if r["server"] == "baseline" and r["concurrency"] == conc}
        for name in ("baseline", "off", "on"):
            mine = [r for r in rows if r["server"] == name and r["concurrency"] == conc]
            if not mine:
                continue
            ratios = [r["throughput_rps"] / base[r["round"]] for r in mine if base.get(r["round"])]
            med = {k: statistics.median(r[k] or 0 for r in mine)
                   for k in ("throughput_rps", "p50_ms", "server_cpu_ms_per_request")}
            spread = f"{min(ratios):.2f}..{max(ratios):.2f}" if ratios else "-"
            ratio = f"{statistics.median(ratios):.3f}" if ratios else "-"
            print(f"{conc:>3} {name:<9} {med['throughput_rps']:>9.1f} {med['p50_ms']:>8.2f} "
                  f"{med['server_cpu_ms_per_request']:>10.3f} {ratio:>6} {spread:>13}")


if __name__ == "__main__":
    main()
