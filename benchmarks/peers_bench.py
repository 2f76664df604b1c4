"""xlaserve against its peers, in one run with alternating rounds.

    python -m benchmarks.peers_bench [--peers xlaserve,triton,mlserver,kserve] [--rounds 2]
        [--duration 5] [--concurrency 1,8,32] [--models mlp,img_mean] [--compiled-sizes 1,2,4,8,16,32]
        [--baseline CHECKOUT]

``--baseline CHECKOUT`` adds the peer ``baseline``: xlaserve run from another checkout (an
earlier commit's ``git worktree``), so that a change is measured against what it changed, in the
same alternating rounds (``--peers xlaserve,baseline``).

Each round starts every server in turn (peers through ../shared/peers/run_<peer>.sh, which
install into $PEERS_ROOT on first use; xlaserve over the example ``mlp`` and ``img_mean``
bundles, compiled sizes 1..32, default node settings), checks outputs with the peers'
``check_outputs.py``, drives each model at each concurrency with the same load generator
(:mod:`xlaserve.bench.loadgen`, FP32 [1,512] / UINT8 [1,224,224,3] per request) and stops it.
Server CPU per request is the server's process tree CPU time over a level divided by the
answers it gave in that level (warm-up included). Prints JSON lines, then a table of the
per-round medians.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks._servers import PEERS, export_mlp_as, peer, tree_cpu_seconds, wait_ready, xlaserve
from xlaserve.bench import loadgen

INPUTS = {"mlp": [loadgen.InputSpec("input", "FP32", (1, 512))],
          "img_mean": [loadgen.InputSpec("input", "UINT8", (1, 224, 224, 3))]}


@contextmanager
def server(name: str, repo: Path, logs: Path, baseline: Path | None = None):
    if name == "xlaserve":
        with xlaserve(repo, log_path=logs / "xlaserve.log") as handle:
            yield handle
    elif name == "baseline":
        if baseline is None:
            raise RuntimeError("the peer 'baseline' needs --baseline CHECKOUT")
        with xlaserve(repo, log_path=logs / "baseline.log", source=baseline) as handle:
            yield handle
    else:
        with peer(name, logs) as handle:
            yield handle


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peers", default="xlaserve,triton,mlserver,kserve")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--models", default="mlp,img_mean")
    p.add_argument("--logs", default="/tmp/xlaserve-peers-bench")
    p.add_argument("--baseline", type=Path, help="a checkout of xlaserve served as the peer 'baseline'")
    p.add_argument("--compiled-sizes", default="1,2,4,8,16,32",
                   help="xlaserve's compiled batch sizes; '1' gives the no-coalescing baseline")
    args = p.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    models = args.models.split(",")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        for m in models:
            export_mlp_as(repo, m, tuple(int(n) for n in args.compiled_sizes.split(",")))
        for round_ in range(args.rounds):
            order = args.peers.split(",")
            if round_ % 2:
                order.reverse()                     # alternate who runs first
            for name in order:
                try:
                    with server(name, repo, logs, args.baseline) as (url, pid):
                        wait_ready(url, time.monotonic() + 120, models=tuple(models))
                        check_batch = min(2, max(int(n) for n in args.compiled_sizes.split(",")))
                        subprocess.run([sys.executable, str(PEERS / "check_outputs.py"), "--url", url,
                                        "--models", ",".join(models), "--batch", str(check_batch)],
                                       check=True, capture_output=True)
                        for model in models:
                            for conc in levels:
                                plans = [loadgen.ClientPlan(lambda m=model: m) for _ in range(conc)]
                                cpu0 = tree_cpu_seconds(pid)
                                client0 = _own_cpu_seconds()
                                result = asyncio.run(loadgen.run_level(
                                    url, plans, {model: INPUTS[model]}, duration=args.duration,
                                    warmup=args.warmup))
                                cpu = tree_cpu_seconds(pid) - cpu0
                                client = _own_cpu_seconds() - client0
                                row = result.rows()[0]
                                row.update(server=name, round=round_,
                                           server_cpu_ms_per_request=round(1e3 * cpu / max(1, result.answered), 3),
                                           server_cpu_util=round(cpu / (args.duration + args.warmup), 2),
                                           client_cpu_ms_per_request=round(1e3 * client / max(1, result.answered), 3))
                                rows.append(row)
                                print(json.dumps(row), flush=True)
                except (RuntimeError, subprocess.CalledProcessError) as exc:
                    print(json.dumps({"server": name, "round": round_, "error": str(exc)}), flush=True)
    print(f"\nmedian of {args.rounds} rounds, {args.duration:.0f} s each; server and load-generator CPU in ms "
          "per request")
    print(f"{'model':<9} {'c':>3} {'server':<9} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'cpu ms/req':>10} "
          f"{'client ms/req':>13} {'errors':>7}")
    for model in models:
        for conc in levels:
            for name in args.peers.split(","):
                mine = [r for r in rows if r["server"] == name and r["model"] == model and r["concurrency"] == conc]
                if not mine:
                    continue
                med = {k: statistics.median(r[k] or 0 for r in mine)
                       for k in ("throughput_rps", "p50_ms", "p99_ms", "server_cpu_ms_per_request",
                                 "client_cpu_ms_per_request")}
                errors = sum(sum(r["errors"].values()) for r in mine)
                print(f"{model:<9} {conc:>3} {name:<9} {med['throughput_rps']:>9.1f} {med['p50_ms']:>8.2f} "
                      f"{med['p99_ms']:>8.2f} {med['server_cpu_ms_per_request']:>10.3f} "
                      f"{med['client_cpu_ms_per_request']:>13.3f} {errors:>7}")


def _own_cpu_seconds() -> float:
    """CPU time of this process (the load generator) and its threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
