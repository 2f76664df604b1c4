"""ResNet-18 exported from PyTorch and served by xlaserve, against the same model in eager PyTorch
behind Triton's python backend, in one run with alternating rounds.

    python -m benchmarks.torch_peers_bench [--rounds 2] [--duration 10] [--concurrency 1,8]
        [--compiled-sizes 1,2,4,8] [--max-batch 8] [--queue-delay-us 1000] [--peer-threads 0]

Needs the ``examples-torch`` extra here (torchvision, to export the model). The run:

1. exports ``examples/torch_examples.py``'s ResNet-18 (torchvision, random weights, seed 0) as
   an xlaserve bundle with the compiled sizes;
2. writes a Triton model repository (python backend) whose ``model.py`` builds the same
   torchvision ResNet-18, loads the bundle's own ``weights.safetensors`` (the module's
   ``state_dict``) and runs it in eager PyTorch under ``torch.inference_mode``, with dynamic
   batching (``max_batch_size`` = --max-batch, --queue-delay-us, one CPU instance) on
   torch's default threads or ``--peer-threads``;
3. prepares the peer's venv, ``$PEERS_ROOT/venv-triton-torch`` (nvidia-pytriton 0.7.0 for the
   tritonserver binary, torch 2.14.1 and torchvision 0.29.1 for the model; once, 5-7 minutes),
   and starts Triton with ``../shared/peers/run_triton.sh`` on that repository and venv (the script
   adds its own ``mlp`` and ``img_mean`` models beside it; they stay idle);
4. each round starts each server in turn (``xlaserve-flags``: xlaserve with ``XLA_FLAGS`` set
   to --xla-flags, for comparing XLA's cpu settings in the same run), checks that a batch of 2 answers what eager PyTorch
   computes (within 1e-4), and drives ``resnet18`` with the load generator
   (:mod:`xlaserve.bench.loadgen`, one FP32 [1, 3, 224, 224] image per request) at each
   concurrency.

Prints JSON lines, then the per-round medians and xlaserve's throughput over Triton's.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from benchmarks._servers import peer, tree_cpu_seconds, wait_ready, xlaserve
from xlaserve.bench import loadgen

MODEL = "resnet18"
INPUTS = [loadgen.InputSpec("image", "FP32", (1, 3, 224, 224))]
PEERS_ROOT = Path(os.environ.get("PEERS_ROOT", "/tmp/peers"))
PEER_VENV = PEERS_ROOT / "venv-triton-torch"
PEER_PACKAGES = ["nvidia-pytriton==0.7.0", "numpy", "torch==2.14.1", "torchvision==0.29.1", "safetensors"]

CONFIG = """name: "resnet18"
backend: "python"
max_batch_size: {max_batch}
input [ {{ name: "image" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 1000 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: {delay} }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

MODEL_PY = '''"""torchvision's ResNet-18 in eager PyTorch, with the xlaserve bundle's weights."""
import os

import numpy as np
import torch
import torchvision
import triton_python_backend_utils as pb_utils
from safetensors.torch import load_file


# 0: torch's default (one intra-op thread per core); set by --peer-threads
TORCH_THREADS = {threads}


class TritonPythonModel:
    def initialize(self, args):
        if TORCH_THREADS:
            torch.set_num_threads(TORCH_THREADS)
        self.model = torchvision.models.resnet18(weights=None).eval()
        here = os.path.dirname(os.path.abspath(__file__))
        self.model.load_state_dict(load_file(os.path.join(here, "weights.safetensors")))

    def execute(self, requests):
        # The dynamic batcher's requests, concatenated along the batch, run once, split back.
        xs = [pb_utils.get_input_tensor_by_name(r, "image").as_numpy() for r in requests]
        with torch.inference_mode():
            y = self.model(torch.from_numpy(np.concatenate(xs) if len(xs) > 1 else xs[0])).numpy()
        out, off = [], 0
        for x in xs:
            t = pb_utils.Tensor("output", np.ascontiguousarray(y[off:off + len(x)]))
            out.append(pb_utils.InferenceResponse(output_tensors=[t]))
            off += len(x)
        return out
'''


def triton_repo(root: Path, bundle: Path, max_batch: int, delay_us: int, threads: int) -> Path:
    """A Triton model repository serving ``resnet18`` in eager PyTorch with ``bundle``'s weights,
    on ``threads`` intra-op threads (0: torch's default)."""
    version = root / MODEL / "1"
    version.mkdir(parents=True)
    (root / MODEL / "config.pbtxt").write_text(CONFIG.format(max_batch=max_batch, delay=delay_us))
    (version / "model.py").write_text(MODEL_PY.replace("{threads}", str(threads)))
    shutil.copy(bundle / "weights.safetensors", version / "weights.safetensors")
    return root


def ensure_peer_venv() -> None:
    python = PEER_VENV / "bin" / "python"
    check = "import pytriton, torch, torchvision, safetensors"
    if python.exists() and subprocess.run([str(python), "-c", check], capture_output=True).returncode == 0:
        return
    print(f"preparing {PEER_VENV} (once)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
    subprocess.run([str(PEER_VENV / "bin" / "pip"), "install", "--quiet", *PEER_PACKAGES], check=True)


@contextmanager
def server(name: str, repo: Path, triton: Path, logs: Path, xla_flags: str):
    if name in ("xlaserve", "xlaserve-flags"):
        # the server inherits this process's environment: XLA_FLAGS only for xlaserve-flags
        saved = os.environ.pop("XLA_FLAGS", None)
        if name == "xlaserve-flags":
            os.environ["XLA_FLAGS"] = xla_flags
        try:
            with xlaserve(repo, log_path=logs / f"{name}.log") as handle:
                yield handle
        finally:
            os.environ.pop("XLA_FLAGS", None)
            if saved is not None:
                os.environ["XLA_FLAGS"] = saved
        return
    else:
        os.environ.update(REPO=str(triton), VENV=str(PEER_VENV), PEERS_ROOT=str(PEERS_ROOT))
        with peer("triton", logs) as handle:
            yield handle


def check(url: str, expected: np.ndarray, x: np.ndarray) -> float:
    """Send ``x``; the largest absolute difference from ``expected``, or an error above 1e-4."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        tensor = grpcclient.InferInput("image", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        got = client.infer(MODEL, [tensor]).as_numpy("output")
    finally:
        client.close()
    error = float(np.abs(got - expected).max())
    if not error <= 1e-4:
        raise RuntimeError(f"{url} answered with max abs error {error} from eager PyTorch")
    return error


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default="xlaserve,triton",
                   help="of xlaserve, xlaserve-flags (xlaserve with XLA_FLAGS=--xla-flags), triton")
    p.add_argument("--xla-flags", default="--xla_cpu_use_thunk_runtime=false",
                   help="XLA_FLAGS of the xlaserve-flags server")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--compiled-sizes", default="1,2,4,8", help="xlaserve's compiled batch sizes")
    p.add_argument("--max-batch", type=int, default=8, help="Triton's max_batch_size")
    p.add_argument("--queue-delay-us", type=int, default=1000, help="Triton's max_queue_delay_microseconds")
    p.add_argument("--peer-threads", type=int, default=0,
                   help="torch.set_num_threads in Triton's model (0: torch's default, one per core)")
    p.add_argument("--logs", default="/tmp/xlaserve-torch-peers-bench")
    args = p.parse_args()
    from examples import torch_examples

    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",")]
    ensure_peer_venv()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "xlaserve"
        started = time.perf_counter()
        bundle = torch_examples.export(MODEL, repo, tuple(int(n) for n in args.compiled_sizes.split(",")))
        print(json.dumps({"exported": str(bundle), "seconds": round(time.perf_counter() - started, 1)}), flush=True)
        triton = triton_repo(Path(tmp) / "triton", bundle, args.max_batch, args.queue_delay_us,
                             args.peer_threads)
        x = torch_examples.sample(MODEL, 2)
        expected = torch_examples.eager(MODEL, torch_examples.resnet18(), x)["output"]
        for round_ in range(args.rounds):
            order = args.servers.split(",")
            if round_ % 2:
                order.reverse()                     # alternate who runs first
            for name in order:
                try:
                    with server(name, repo, triton, logs, args.xla_flags) as (url, pid):
                        wait_ready(url, time.monotonic() + 300, models=(MODEL,))
                        error = check(url, expected, x)
                        for conc in levels:
                            plans = [loadgen.ClientPlan(lambda: MODEL) for _ in range(conc)]
                            cpu0 = tree_cpu_seconds(pid)
                            result = asyncio.run(loadgen.run_level(
                                url, plans, {MODEL: INPUTS}, duration=args.duration, warmup=args.warmup))
                            cpu = tree_cpu_seconds(pid) - cpu0
                            row = result.rows()[0]
                            row.update(server=name, round=round_, max_abs_error_vs_eager=error,
                                       server_cpu_ms_per_request=round(1e3 * cpu / max(1, result.answered), 2))
                            rows.append(row)
                            print(json.dumps(row), flush=True)
                except (RuntimeError, subprocess.CalledProcessError) as exc:
                    print(json.dumps({"server": name, "round": round_, "error": str(exc)}), flush=True)
    print(f"\nmedian of {args.rounds} rounds, {args.duration:.0f} s each")
    print(f"{'c':>3} {'server':<9} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'cpu ms/req':>10} {'errors':>7}")
    medians: dict[tuple[str, int], float] = {}
    for conc in levels:
        for name in args.servers.split(","):
            mine = [r for r in rows if r["server"] == name and r["concurrency"] == conc]
            if not mine:
                continue
            med = {k: statistics.median(r[k] or 0 for r in mine)
                   for k in ("throughput_rps", "p50_ms", "p99_ms", "server_cpu_ms_per_request")}
            medians[name, conc] = med["throughput_rps"]
            errors = sum(sum(r["errors"].values()) for r in mine)
            print(f"{conc:>3} {name:<9} {med['throughput_rps']:>8.1f} {med['p50_ms']:>8.1f} {med['p99_ms']:>8.1f}"
                  f" {med['server_cpu_ms_per_request']:>10.1f} {errors:>7}")
    for conc in levels:
        for name in ("xlaserve", "xlaserve-flags"):
            if medians.get(("triton", conc)) and (name, conc) in medians:
                print(f"c={conc}: {name} / triton throughput = {medians[name, conc] / medians['triton', conc]:.2f}x")


if __name__ == "__main__":
    main()
