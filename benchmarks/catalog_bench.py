"""A catalog of many bundles over few architectures (issue 25, part 4):
``python -m benchmarks.catalog_bench [--archs 10] [--variants 100]``.

The catalog is ``archs`` two-layer MLPs of distinct widths (``out = tanh(x @ w1) @ w2``,
``x: f32[B, F]``, ``w1: f32[F, H]``, ``w2: f32[H, F]``), each exported once and copied into
``variants`` bundles that differ only in their weights (fine-tuned variants): ``archs x variants``
bundles whose modules are byte-identical within an architecture. The baseline is the ``archs``
distinct bundles alone (variant 0 of each).

For each repository it measures:

1. **executables** (in process): the worker's :class:`~xlaserve.worker.lifecycle.Lifecycle` loads
   the repository into a fresh process with a weight cache that admits everything and reads no
   weights, after one warm-up compile; the RSS growth over the loads is what the executables and
   the bundles' metadata cost (weights are not read until admission, so none are in it). Also the
   distinct executable objects held by the model table and the sum of their serialized sizes
   (``Device.serialize``: code and metadata as the executable cache would store them; XLA's own
   ``generated_code_size_in_bytes`` is 0 on the cpu).
2. **start-up** (the real server, ``cache_dir: null`` so every module is compiled or shared, no
   executable cache): process start to ``/readyz`` 200, then the server's RSS (weights read into
   their host copies: the default ``system`` residency; nothing is copied to the device before the
   first request).

Goals: cold start-up of the catalog <= 3x the distinct bundles', executable memory <= 1.2x, and
server RSS <= 1.1 x sum(weights) + base, where base is the distinct server's RSS less its weights.
The machine is shared: the load average is printed with the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def width_of(arch: int) -> int:
    return 64 + 16 * arch


def variant_weights(arch: int, variant: int, hidden: int) -> dict[str, np.ndarray]:
    """The weights of one variant: deterministic, different for every (arch, variant)."""
    rng = np.random.default_rng(arch * 100_003 + variant)
    f = width_of(arch)
    return {"w1": (rng.standard_normal((f, hidden)) / np.sqrt(f)).astype(np.float32),
            "w2": (rng.standard_normal((hidden, f)) / np.sqrt(hidden)).astype(np.float32)}


def reference(weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    return np.tanh(x @ weights["w1"]) @ weights["w2"]


def bundle_name(arch: int, variant: int) -> str:
    return f"a{arch:02d}v{variant:03d}"


def _mlp(w1, w2, x):
    import jax.numpy as jnp
    return (jnp.tanh(x @ w1) @ w2,)


def export_architecture(repo: Path, arch: int, hidden: int, batch_sizes) -> Path:
    """Variant 0 of ``arch``, exported with jax."""
    from xlaserve.export import TensorSpec, export_bundle
    f = width_of(arch)
    return export_bundle(repo / bundle_name(arch, 0), _mlp,
                         inputs=[TensorSpec("input", "f32", "fn", {"f": f})],
                         outputs=[TensorSpec("output", "f32", "fn", {"f": f})],
                         weights=variant_weights(arch, 0, hidden), compiled_batch_sizes=batch_sizes)


def clone_variant(source: Path, arch: int, variant: int, hidden: int) -> Path:
    """A copy of ``source`` (its modules byte for byte) named for ``variant``, with its own weights."""
    from safetensors.numpy import save_file
    target = source.parent / bundle_name(arch, variant)
    target.mkdir()
    for f in source.iterdir():
        if f.name.startswith("model."):
            shutil.copyfile(f, target / f.name)
    manifest = yaml.safe_load((source / "manifest.yaml").read_text())
    manifest["name"] = target.name
    (target / "manifest.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    save_file(variant_weights(arch, variant, hidden), str(target / "weights.safetensors"))
    return target


def export_catalog(repo: Path, archs: int, variants: int, hidden: int, batch_sizes) -> list[str]:
    repo.mkdir(parents=True, exist_ok=True)
    names = []
    for arch in range(archs):
        source = export_architecture(repo, arch, hidden, batch_sizes)
        names.append(source.name)
        for variant in range(1, variants):
            names.append(clone_variant(source, arch, variant, hidden).name)
    return names


def weight_bytes(repo: Path) -> int:
    return sum((p / "weights.safetensors").stat().st_size for p in repo.iterdir() if p.is_dir())


def settled_rss() -> int:
    """This process's RSS after a full collection and after malloc has given freed memory back
    to the system (``malloc_trim``), so compile scratch freed since is not counted."""
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc: the RSS as it is
        pass
    return rss_bytes()


def rss_bytes(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# ---- 1. executables, in process -------------------------------------------------------------

class _AdmitAll:
    """A weight cache that admits every model and reads no weights: the probe measures the loads."""

    async def admit(self, model, *, during_startup: bool = False) -> str:
        return ""

    def release(self, name: str, version: int | None = None) -> None:
        pass

    def log_budget(self) -> None:
        pass


def probe(repo: Path) -> dict:
    """Load ``repo`` with the worker's Lifecycle in this process and report what it cost."""
    import trio

    from xlaserve.config import resolve_worker
    from xlaserve.config.resolve import parse_node_config
    from xlaserve.runtime.pjrt import Device
    from xlaserve.worker.lifecycle import Lifecycle
    from xlaserve.worker.registry import ModelState, ModelTable

    config = resolve_worker(parse_node_config({"model_repo": str(repo), "global": {
        "runtime": {"backend": "cpu"}, "model_control_mode": "static", "cache_dir": None}}, repo), 0)
    device = Device("cpu")
    # One compile first, so that what XLA sets up once per process (LLVM, thread pools) is not
    # counted against the executables.
    warm = tempfile.mkdtemp(prefix="xlaserve-catalog-warm-")
    try:
        from xlaserve.bundle import load_bundle
        warm_bundle = export_architecture(Path(warm), 99, 8, (1,))
        load_bundle(warm_bundle, 1, device)
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    before = settled_rss()
    table = ModelTable()

    async def main() -> float:
        send, _receive = trio.open_memory_channel(1)
        lifecycle = Lifecycle(config, device, table, send, _AdmitAll())
        started = time.perf_counter()
        await lifecycle.load_all(lifecycle.discover())
        return time.perf_counter() - started

    seconds = trio.run(main)
    after = settled_rss()
    executables = {}
    for entry in table.snapshot.values():
        if entry.serving is not None:
            for module in entry.serving.modules.values():
                executables[id(module.executable)] = module.executable
    sizes = {k: len(device.serialize(e)) for k, e in executables.items()}
    return {"bundles": len(table.snapshot), "ready": table.state_counts()[ModelState.READY.value],
            "load_seconds": seconds, "rss_delta": after - before, "executables": len(executables),
            "serialized_bytes": sum(sizes.values())}


def run_probe(repo: Path) -> dict:
    """:func:`probe` in a fresh process (its RSS is the measurement)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.catalog_bench", "--probe", str(repo)],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"probe of {repo} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- 2. start-up, the real server --------------------------------------------------------------

def run_server(root: Path, repo: Path, label: str) -> dict:
    import urllib.request
    work = root / f"server_{label}"
    work.mkdir()
    node = work / "node.yaml"
    node.write_text(yaml.safe_dump({
        "model_repo": str(repo), "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"},
        "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "static", "cache_dir": None}}))
    ready_file = work / "ready.json"
    log_path = work / "server.log"
    with open(log_path, "w") as log:
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "xlaserve", "run", str(node), "--ready-file",
                                    str(ready_file)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 3600
            http = None
            while True:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server failed to start:\n{log_path.read_text()[-4000:]}")
                if http is None and ready_file.exists():
                    http = f"http://127.0.0.1:{json.loads(ready_file.read_text())['http_port']}"
                if http is not None:
                    try:
                        with urllib.request.urlopen(http + "/readyz", timeout=5) as r:
                            if r.status == 200:
                                break
                    except OSError:
                        pass
                time.sleep(0.05)
            seconds = time.perf_counter() - started
            time.sleep(1.0)   # let start-up's last allocations settle
            rss = rss_bytes(process.pid)
        finally:
            process.terminate()
            process.wait(120)
    text = log_path.read_text(errors="replace")
    summary = next((line.split("start-up: ", 1)[1] for line in text.splitlines()
                    if "start-up:" in line and "bundle(s) ready" in line), "?")
    return {"ready_seconds": seconds, "rss": rss, "summary": summary}


# ---- the report -----------------------------------------------------------------------------------

def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", type=int, default=10)
    parser.add_argument("--variants", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=512, help="hidden width: sets the weight bytes")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--only", choices=("probe", "server"))
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe is not None:
        print(json.dumps(probe(args.probe)))
        return
    sizes = tuple(int(s) for s in args.batch_sizes.split(","))
    root = Path(tempfile.mkdtemp(prefix="xlaserve-catalog-bench-"))
    os.chmod(root, 0o700)
    try:
        t0 = time.perf_counter()
        catalog = root / "catalog"
        names = export_catalog(catalog, args.archs, args.variants, args.hidden, sizes)
        distinct = root / "distinct"
        distinct.mkdir()
        for arch in range(args.archs):
            shutil.copytree(catalog / bundle_name(arch, 0), distinct / bundle_name(arch, 0))
        repos = {"distinct": distinct, "catalog": catalog}
        weights = {label: weight_bytes(repo) for label, repo in repos.items()}
        print(f"catalog: {len(names)} bundles = {args.archs} architectures x {args.variants} variants, batch "
              f"sizes {list(sizes)}, weights {weights['catalog'] / MB:.0f} MiB "
              f"(distinct: {args.archs} bundles, {weights['distinct'] / MB:.1f} MiB); "
              f"exported in {time.perf_counter() - t0:.1f}s")
        print(f"load average at start: {os.getloadavg()[0]:.2f} (2 cores, shared)")
        probes, servers = {}, {}
        if args.only in (None, "probe"):
            for label, repo in repos.items():
                probes[label] = p = run_probe(repo)
                print(f"executables {label:>8}: {p['ready']}/{p['bundles']} ready in {p['load_seconds']:.2f}s; "
                      f"{p['executables']} distinct executables, serialized {p['serialized_bytes'] / MB:.1f} MiB; "
                      f"RSS grew {p['rss_delta'] / MB:.1f} MiB")
        if args.only in (None, "server"):
            for label, repo in repos.items():
                servers[label] = s = run_server(root, repo, label)
                print(f"server      {label:>8}: /readyz 200 after {s['ready_seconds']:.2f}s; "
                      f"RSS {s['rss'] / MB:.0f} MiB; {s['summary']}")
        print(f"load average at end: {os.getloadavg()[0]:.2f}")
        if probes:
            d, c = probes["distinct"], probes["catalog"]
            print(f"executable memory, catalog/distinct: RSS growth {c['rss_delta'] / max(d['rss_delta'], 1):.2f}x, "
                  f"serialized {c['serialized_bytes'] / max(d['serialized_bytes'], 1):.2f}x, "
                  f"executables {c['executables']}/{d['executables']} (goal <= 1.2x)")
        if servers:
            d, c = servers["distinct"], servers["catalog"]
            base = d["rss"] - weights["distinct"]
            bound = 1.1 * weights["catalog"] + base
            print(f"cold start-up, catalog/distinct: {c['ready_seconds'] / d['ready_seconds']:.2f}x (goal <= 3x)")
            print(f"host RAM: catalog server RSS {c['rss'] / MB:.0f} MiB vs 1.1 x weights + base = "
                  f"1.1 x {weights['catalog'] / MB:.0f} + {base / MB:.0f} = {bound / MB:.0f} MiB: "
                  f"{c['rss'] / bound:.2f} of the bound (goal <= 1.0; base = distinct server RSS - its weights)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
