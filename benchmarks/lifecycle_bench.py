"""Model lifecycle benchmarks: ``python -m benchmarks.lifecycle_bench [--bundles 20]``.

1. Restart with N bundles x 3 compiled batch sizes, cold executable cache versus warm: the time
   from starting the process to /readyz answering 200, and the worker's own start-up line.
2. Hot reload of one model under c=16 load (half the clients on it, half on two other models):
   failed requests, and the time from the weights file changing to the first response computed
   by the new version.

Everything runs against the real server subprocess on loopback with the Triton gRPC client.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

BATCH_SIZES = (1, 4, 16)


def export_bundles(repo: Path, count: int) -> list[str]:
    """``count`` small MLP bundles, each a different width so no two share a module."""
    import jax.numpy as jnp

    from xlaserve.export import TensorSpec, export_bundle

    def mlp(w, x):
        return (jnp.tanh(x @ w),)

    names = []
    for i in range(count):
        width = 64 + 8 * i
        w = (np.random.default_rng(i).standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        name = f"m{i:02d}"
        export_bundle(repo / name, mlp, inputs=[TensorSpec("input", "f32", "fn", {"f": width})],
                      outputs=[TensorSpec("output", "f32", "fn", {"f": width})], weights={"w": w},
                      compiled_batch_sizes=BATCH_SIZES)
        names.append(name)
    return names


def export_cnn_bundles(repo: Path, count: int) -> list[str]:
    """``count`` vision bundles: the example CNN on UINT8 [b,64,64,3] images, each with a different
    first-layer width so no two share a module (XLA takes far longer to compile these than the MLPs)."""
    from examples.export_examples import CNN_WEIGHTS_ORDER, cnn
    from xlaserve.export import TensorSpec, export_bundle

    names = []
    for i in range(count):
        rng = np.random.default_rng(i)
        width = 8 + i
        shapes = {"conv1.w": (3, 3, 3, width), "conv1.b": (width,), "conv2.w": (3, 3, width, 16),
                  "conv2.b": (16,), "dense.w": (16, 10), "dense.b": (10,)}
        weights = {k: (rng.standard_normal(v) * 0.1).astype(np.float32) for k, v in shapes.items()}
        name = f"c{i:02d}"
        export_bundle(repo / name, cnn, inputs=[TensorSpec("input", "u8", "cwhn", {"c": 3, "w": 64, "h": 64})],
                      outputs=[TensorSpec("logits", "f32", "zn", {"z": 10}), TensorSpec("label", "i32", "n", {})],
                      weights=weights, weights_order=CNN_WEIGHTS_ORDER, compiled_batch_sizes=BATCH_SIZES)
        names.append(name)
    return names


class Server:
    def __init__(self, workdir: Path, repo: Path, global_: dict) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        node = workdir / "node.yaml"
        node.write_text(yaml.safe_dump({
            "model_repo": str(repo), "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"},
            "global": {"runtime": {"backend": "cpu"}, **global_}}))
        self.ready_file = workdir / "ready.json"
        self.ready_file.unlink(missing_ok=True)
        self.log_path = workdir / "server.log"
        self._log = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.process = subprocess.Popen([sys.executable, "-m", "xlaserve", "run", str(node),
                                         "--ready-file", str(self.ready_file)],
                                        stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> float:
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            self._check(deadline)
            time.sleep(0.02)
        ports = json.loads(self.ready_file.read_text())
        self.grpc = f"127.0.0.1:{ports['grpc_port']}"
        self.http = f"http://127.0.0.1:{ports['http_port']}"
        while True:
            try:
                with urllib.request.urlopen(self.http + "/readyz", timeout=5) as r:
                    if r.status == 200:
                        return time.perf_counter() - self.started
            except OSError:
                pass
            self._check(deadline)
            time.sleep(0.02)

    def _check(self, deadline: float) -> None:
        if self.process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server failed to start:\n{self.log_path.read_text()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(60)
        self._log.close()


def bench_restart(root: Path, count: int, model: str = "mlp") -> None:
    repo = root / "restart_models"
    t0 = time.perf_counter()
    (export_cnn_bundles if model == "cnn" else export_bundles)(repo, count)
    print(f"exported {count} {model} bundles x {len(BATCH_SIZES)} batch sizes in {time.perf_counter() - t0:.1f}s")
    cache = root / "cache"
    results = {}
    for label in ("cold", "warm"):
        server = Server(root / f"restart_{label}", repo, {"model_control_mode": "static", "cache_dir": str(cache)})
        seconds = server.wait_ready()
        line = re.search(r"start-up: \d+ of \d+ bundle.*", server.log())
        server.stop()
        results[label] = seconds
        print(f"restart {label}: ready in {seconds:.2f}s (process start to /readyz 200); "
              f"{line.group(0) if line else '?'}")
    print(f"warm/cold = {results['warm'] / results['cold']:.0%} (goal: at most 20%)")


def bench_reload(root: Path, clients: int, reloads: int) -> None:
    import tritonclient.grpc as grpcclient
    from safetensors.numpy import save_file
    from tritonclient.utils import InferenceServerException

    repo = root / "reload_models"
    names = export_bundles(repo, 3)
    hot = names[0]
    width = 64
    server = Server(root / "reload", repo, {"model_control_mode": "dynamic", "cache_dir": str(root / "cache2")})
    server.wait_ready()
    stop = threading.Event()
    errors: list[str] = []
    ok = [0]
    first_seen: dict[str, float] = {}

    def client_loop(i: int) -> None:
        client = grpcclient.InferenceServerClient(server.grpc)
        model = hot if i % 2 == 0 else names[1 + (i // 2) % 2]
        w = 64 + 8 * names.index(model)
        x = np.ones((1, w), np.float32)
        t = grpcclient.InferInput("input", [1, w], "FP32")
        t.set_data_from_numpy(x)
        while not stop.is_set():
            try:
                r = client.infer(model, [t])
            except InferenceServerException as exc:
                errors.append(f"{model}: {exc}")
                continue
            ok[0] += 1
            if model == hot:
                version = r.get_response().model_version
                first_seen.setdefault(version, time.perf_counter())

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    latencies = []
    for n in range(reloads):
        w = (np.random.default_rng(100 + n).standard_normal((width, width)) / 8).astype(np.float32)
        tmp = repo / f".w{n}.tmp"
        save_file({"w": w}, str(tmp))
        changed = time.perf_counter()
        os.replace(tmp, repo / hot / "weights.safetensors")
        want = str(2 + n)
        deadline = time.monotonic() + 60
        while want not in first_seen and time.monotonic() < deadline:
            time.sleep(0.01)
        latencies.append(first_seen.get(want, float("nan")) - changed)
        time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    server.stop()
    print(f"hot reload under c={clients} ({clients // 2} clients on {hot}, {clients // 2} on two others): "
          f"{ok[0]} requests ok, {len(errors)} failed")
    print("file change -> first response from the new version: "
          + ", ".join(f"{s:.2f}s" for s in latencies))
    for e in errors[:5]:
        print("  error:", e)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundles", type=int, default=20)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--reloads", type=int, default=3)
    parser.add_argument("--only", choices=("restart", "reload"))
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                        help="restart bundles: small MLPs (quick to compile) or the example CNN")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="xlaserve-lifecycle-bench-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o700)
        if args.only in (None, "restart"):
            bench_restart(root, args.bundles, args.model)
        if args.only in (None, "reload"):
            bench_reload(root, args.clients, args.reloads)


if __name__ == "__main__":
    main()
