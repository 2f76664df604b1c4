"""Where does an xlaserve worker's CPU go under load? py-spy samples, grouped by layer.

    python -m benchmarks.profile_xlaserve [--model mlp] [--concurrency 32] [--seconds 8] [--raw FILE]

Needs ``py-spy`` on PATH or beside the interpreter (``pip install py-spy``). Serves the example
bundle (compiled sizes 1..32), drives it with :mod:`xlaserve.bench.loadgen` and samples every
thread of the server (idle time excluded) at 200 Hz. Each sample is charged to the innermost
frame that belongs to a known layer; the table shows each layer's share of the samples and of
one core, and the heaviest leaf functions.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks._servers import export_mlp_as, xlaserve
from benchmarks.peers_bench import INPUTS
from xlaserve.bench import loadgen

# innermost match wins; order only breaks ties within one frame
LAYERS = [
    ("device execution (XLA, jax)", ("xlaserve/runtime/pjrt.py", "jax/", "jaxlib/")),
    ("executor: assemble/split (numpy)", ("xlaserve/worker/executor.py", "numpy/")),
    ("scheduler + stats + metrics", ("xlaserve/worker/scheduler.py", "xlaserve/worker/policy.py",
                                     "xlaserve/worker/batching.py", "xlaserve/worker/stats.py",
                                     "xlaserve/metrics.py", "prometheus_client/")),
    ("KServe codec + service", ("xlaserve/codec.py", "xlaserve/frontend/kserve.py", "xlaserve/_proto/",
                                "google/protobuf", "xlaserve/worker/inference.py")),
    ("bridge, Trio scheduling, sockets, threads", ("xlaserve/frontend/bridge.py", "trio/", "outcome/",
                                                   "threading.py", "selectors.py")),
    ("HTTP/2 + gRPC (grpc_server, http2)", ("xlaserve/frontend/grpc_server.py", "xlaserve/http2/")),
]


def layer_of(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, needles in LAYERS:
            if any(n in frame for n in needles):
                return name
    return "other"


def py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy not found: pip install py-spy")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp", choices=sorted(INPUTS))
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=float, default=8.0)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--raw", type=Path, help="also keep py-spy's raw samples (collapsed stacks) in this file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        export_mlp_as(repo, args.model, (1, 2, 4, 8, 16, 32))
        raw = Path(tmp) / "raw.txt"
        with xlaserve(repo) as (url, pid):
            plans = [loadgen.ClientPlan(lambda: args.model) for _ in range(args.concurrency)]
            inputs = {args.model: INPUTS[args.model]}
            asyncio.run(loadgen.run_level(url, plans, inputs, duration=1, warmup=1))
            spy = subprocess.Popen([py_spy(), "record", "-p", str(pid), "-d", str(int(args.seconds)), "-r", "200",
                                    "--format", "raw", "-o", str(raw), "--nonblocking", "--threads"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            result = asyncio.run(loadgen.run_level(url, plans, inputs, duration=args.seconds, warmup=0.5))
            spy.wait()
        if args.raw:
            shutil.copyfile(raw, args.raw)
        layers, leaves, threads, total = Counter(), Counter(), Counter(), 0
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            frames = stack.split(";")
            n = int(count)
            total += n
            layers[layer_of(frames)] += n
            leaves[frames[-1]] += n
            thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread (") else "?"
            threads["main (Trio)" if thread == "MainThread" else "other threads (device, hooks)"] += n
    row = result.rows()[0]
    print(f"{args.model} c={args.concurrency}: {row['throughput_rps']:.0f} req/s, p99 {row['p99_ms']:.1f} ms; "
          f"{total} samples = {total / 200 / args.seconds:.2f} cores busy")
    print(f"{'layer':<46} {'samples':>8} {'share':>7}")
    for name, n in layers.most_common():
        print(f"{name:<46} {n:>8} {n / total:>7.1%}")
    print("\nby thread:")
    for name, n in threads.most_common():
        print(f"{name:<46} {n:>8} {n / 200 / args.seconds:>6.2f} cores")
    print("\nheaviest leaf functions:")
    for frame, n in leaves.most_common(args.top):
        print(f"{n / total:>6.1%}  {frame[:110]}")


if __name__ == "__main__":
    main()
