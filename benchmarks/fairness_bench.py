"""Fair sharing of one device: a heavy tenant against four light ones, under ``fair`` and ``fifo``.

    python -m benchmarks.fairness_bench [--duration 10] [--depth 8] [--disciplines fair,fifo]
        [--light-think-ms 0] [--heavy-nice 0]

Five models with the same code (``tanh(x @ W)`` applied ``--depth`` times, FP32 [b, 512],
compiled sizes 1..32; depth makes the device, not the gRPC frontend, the bottleneck):

1. *light alone*: ``light1`` with 1 client, nothing else running: its p99 is the reference.
2. *mix*: ``heavy`` with 28 clients and ``light1..4`` with 1 client each. Goal under ``fair``:
   each light model's p99 within 2x of the reference. Each tenant runs its own load-generator
   process (``--shared-client``: all in one, where a light answer also waits for the client to
   work through the heavy tenant's answers). With ``--light-think-ms T`` each light client
   pauses T ms between an answer and its next request (alone too): a tenant whose demand is
   bounded, rather than one whose closed loop asks for as much device as it is given. With
   ``--heavy-nice N`` the heavy tenant's load generator runs at niceness N, so that on a small
   machine it does not keep the light tenants' client processes off the cores.
3. *shares*: all five backlogged (12 clients each, ``max_batch_size: 4`` so that one dispatch
   never drains a queue) with weights heavy=1, light1=1, light2=2,
   light3=2, light4=4. Device time per model (compute durations of every execution, from
   ModelStatistics batch_stats) divided by the total, against the weight share. Goal under
   ``fair``: within 10% (relative) of each weight share.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import tritonclient.grpc as grpcclient

from benchmarks._servers import batch_device_seconds, xlaserve
from xlaserve.bench import loadgen

MODELS = ("heavy", "light1", "light2", "light3", "light4")
WEIGHTS = {"heavy": 1.0, "light1": 1.0, "light2": 2.0, "light3": 2.0, "light4": 4.0}


def export_deep(repo: Path, name: str, depth: int) -> None:
    import jax.numpy as jnp
    from examples import reference
    from xlaserve.export import TensorSpec, export_bundle

    def deep(w, x):
        h = x
        for _ in range(depth):
            h = jnp.tanh(jnp.matmul(h, w))
        return (h,)
    features = {"f": reference.MLP_HIDDEN}
    export_bundle(repo / name, deep, inputs=[TensorSpec("input", "f32", "fn", features)],
                  outputs=[TensorSpec("output", "f32", "fn", features)], weights=reference.mlp_weights(),
                  compiled_batch_sizes=(1, 2, 4, 8, 16, 32))


def device_seconds(url: str) -> dict[str, float]:
    c = grpcclient.InferenceServerClient(url)
    return {s.name: batch_device_seconds(s) for s in c.get_inference_statistics("").model_stats}


def queue_ms(url: str) -> dict[str, tuple[int, float]]:
    """Per model: (requests, total ms spent in the scheduler's queue), from ModelStatistics."""
    c = grpcclient.InferenceServerClient(url)
    return {s.name: (s.inference_stats.queue.count, s.inference_stats.queue.ns / 1e6)
            for s in c.get_inference_statistics("").model_stats}


def drive(url: str, clients: dict[str, int], duration: float, warmup: float,
          think_ms: float = 0.0) -> loadgen.LevelResult:
    inputs = {m: [loadgen.InputSpec("input", "FP32", (1, 512))] for m in clients}
    plans = [loadgen.ClientPlan(lambda m=m: m) for m, n in clients.items() for _ in range(n)]
    return asyncio.run(loadgen.run_level(url, plans, inputs, duration=duration, warmup=warmup, think_ms=think_ms))


def drive_tenants(url: str, clients: dict[str, int], duration: float, warmup: float,
                  think_ms: dict[str, float] | None = None, nice: dict[str, int] | None = None) -> dict[str, dict]:
    """Each tenant (model) driven by its own load-generator process, as separate tenants would
    be: one tenant's answers never queue behind another's in a shared client. ``nice``: a
    tenant's process runs at this niceness (see --heavy-nice). Rows by model."""
    think_ms = think_ms or {}
    nice = nice or {}
    procs = {m: subprocess.Popen([sys.executable, "-m", "xlaserve.bench.loadgen", "--url", url, "-m", m,
                                  "-i", "input:FP32:1x512", "-c", str(n), "-d", str(duration),
                                  "--warmup", str(warmup), "--think-ms", str(think_ms.get(m, 0.0)), "--quiet"],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                 preexec_fn=(lambda n=nice[m]: os.nice(n)) if nice.get(m) else None)
             for m, n in clients.items()}
    rows = {}
    for m, proc in procs.items():
        out, _ = proc.communicate(timeout=duration + warmup + 120)
        if proc.returncode != 0:
            raise RuntimeError(f"load generator for {m} exited with {proc.returncode}")
        rows[m] = json.loads(out.strip().splitlines()[-1])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--disciplines", default="fair,fifo")
    p.add_argument("--light-think-ms", type=float, default=0.0,
                   help="each light client pauses this long between an answer and its next request, alone "
                        "and in the mix (default 0: back to back, as the heavy clients)")
    p.add_argument("--shared-client", action="store_true",
                   help="mix: drive all tenants from one load-generator process (default: one process per "
                        "tenant)")
    p.add_argument("--heavy-nice", type=int, default=0,
                   help="mix: run the heavy tenant's load generator at this niceness (e.g. 19), so that on a "
                        "small machine the light tenants' own client processes are not kept off the cores by it")
    args = p.parse_args()
    if args.shared_client and (args.light_think_ms or args.heavy_nice):
        p.error("--light-think-ms and --heavy-nice need one load-generator process per tenant "
                "(drop --shared-client)")
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        for name in MODELS:
            export_deep(repo, name, args.depth)
        for discipline in args.disciplines.split(","):
            sched = {"discipline": discipline,
                     "models": {m: {"weight": w} for m, w in WEIGHTS.items()}}
            with xlaserve(repo, sched) as (url, _):
                alone = drive(url, {"light1": 1}, args.duration, args.warmup, args.light_think_ms).rows()[0]
                q0 = queue_ms(url)
                tenants = {"heavy": 28, **{f"light{i}": 1 for i in range(1, 5)}}
                if args.shared_client:
                    mix = {r["model"]: r for r in drive(url, tenants, args.duration, args.warmup).rows()}
                else:
                    mix = drive_tenants(url, tenants, args.duration, args.warmup,
                                        {m: args.light_think_ms for m in MODELS[1:]}, {"heavy": args.heavy_nice})
                q1 = queue_ms(url)
                mix_queue = {m: round((q1[m][1] - q0.get(m, (0, 0))[1]) / max(1, q1[m][0] - q0.get(m, (0, 0))[0]), 2)
                             for m in MODELS}
            # a model stays backlogged only while it has more clients than one batch takes
            sched["models"] = {m: {"weight": w, "max_batch_size": 4} for m, w in WEIGHTS.items()}
            with xlaserve(repo, sched) as (url, _):
                drive(url, {m: 4 for m in MODELS}, 1, 1)           # learn every model's cost first
                before = device_seconds(url)
                shares_run = drive(url, {m: 12 for m in MODELS}, args.duration, args.warmup)
                after = device_seconds(url)
            busy = {m: after.get(m, 0) - before.get(m, 0) for m in MODELS}
            total_busy = sum(busy.values())
            total_weight = sum(WEIGHTS.values())
            shares = {m: {"device_share": round(busy[m] / total_busy, 4),
                          "weight_share": round(WEIGHTS[m] / total_weight, 4),
                          "relative_error": round((busy[m] / total_busy) / (WEIGHTS[m] / total_weight) - 1, 3),
                          "rps": next(r["throughput_rps"] for r in shares_run.rows() if r["model"] == m)}
                      for m in MODELS}
            result = {"discipline": discipline, "light_think_ms": args.light_think_ms, "heavy_nice": args.heavy_nice,
                      "light_alone_p99_ms": alone["p99_ms"],
                      "light_alone_rps": alone["throughput_rps"],
                      "mix": {m: {k: mix[m][k] for k in ("throughput_rps", "p50_ms", "p99_ms", "errors")}
                              for m in MODELS},
                      "mix_mean_queue_ms": mix_queue,
                      "light_p99_ratio": {m: round(mix[m]["p99_ms"] / alone["p99_ms"], 2) for m in MODELS[1:]},
                      "shares": shares}
            summary[discipline] = result
            print(json.dumps(result), flush=True)
    for discipline, r in summary.items():
        print(f"\n== {discipline} (depth {args.depth}, light think time {args.light_think_ms:g} ms) ==")
        print(f"light1 alone: p99 {r['light_alone_p99_ms']:.2f} ms, {r['light_alone_rps']:.0f} req/s")
        print(f"{'model':<8} {'clients':>7} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'p99/alone':>9} "
              f"{'queue ms (mean, server)':>24}")
        for m in MODELS:
            mm = r["mix"][m]
            ratio = r["light_p99_ratio"].get(m)
            print(f"{m:<8} {28 if m == 'heavy' else 1:>7} {mm['throughput_rps']:>8.1f} {mm['p50_ms']:>8.2f} "
                  f"{mm['p99_ms']:>8.2f} {ratio if ratio is not None else '-':>9} "
                  f"{r['mix_mean_queue_ms'][m]:>24.2f}")
        print(f"all backlogged, 12 clients each, max_batch_size 4: {'model':<8} {'weight':>6} {'share':>7} {'target':>7} {'rel err':>8}")
        for m in MODELS:
            s = r["shares"][m]
            print(f"{'':>51}{m:<8} {WEIGHTS[m]:>6.1f} {s['device_share']:>7.3f} {s['weight_share']:>7.3f} "
                  f"{s['relative_error']:>+8.1%}")


if __name__ == "__main__":
    main()
