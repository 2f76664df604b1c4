"""Export the zoo (examples/torch_zoo.py through ``export --torch``'s defaults, examples/flax_zoo.py
through the JAX path) and print, for each model: the lowering route that made the bundle, whether
it verified, its worst error against the framework as a fraction of the output's scale, export
time, bundle size, and batch-1 and batch-8 latency of the compiled module against the framework.

    python -m benchmarks.torch_zoo_export_bench [--models bert,convnext] [--batch-sizes 1,8]
        [--rounds 5] [--no-latency] [--torch-threads N]

Each model is built (seed 0), then exported to a temporary directory at the given compiled sizes
with the default verification (seed 0): export time is that call's wall time (torch.export,
lowering, writing, loading, compiling and verifying every module). The error columns are the
verification's worst output: its largest absolute error, the output's scale
(``max(1, max |reference|)``) and their ratio, which the default f32 tolerance holds to 1e-5.
Size is the bundle directory's bytes (modules, manifest, weights).

Latency is measured in this process, not through a server: the bundle loaded as the server loads
it (:func:`xlaserve.bundle.load_bundle`, its weights put on the device once), each compiled size
run by ``Device.execute`` on seeded inputs held on the host (their transfer and the outputs'
return to the host included), against the model in eager PyTorch under ``torch.no_grad`` (a Flax
model: its function under ``jax.jit``, compiled before the clock starts). The two are measured
alternately, ``--rounds`` rounds of enough calls for about 0.2 s each, and the medians of the
rounds' per-call means are printed, with their ratio (compiled / framework: below 1 is faster).
A bundle that fails its verification is written all the same, and measured: its row says "**no**"
under verified, with its error. One row per model as it finishes, then the table as Markdown.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from examples import torch_zoo  # noqa: E402
from xlaserve.export import VerificationError, sample_inputs  # noqa: E402


def _flax_models() -> dict:
    try:
        from examples import flax_zoo
    except ImportError:                 # no flax here: the torch models only
        return {}
    return flax_zoo.MODELS


def _per_call(fn: Callable[[], object], seconds: float = 0.2) -> tuple[Callable[[], float], int]:
    started = time.perf_counter()
    fn()
    once = max(time.perf_counter() - started, 1e-6)
    calls = max(3, int(seconds / once))

    def round_() -> float:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) / calls
    return round_, calls


def alternate(compiled: Callable[[], object], framework: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median per-call seconds of ``compiled`` and ``framework``, measured in alternating rounds."""
    for fn in (compiled, framework):            # warm both
        fn()
    a, _ = _per_call(compiled)
    b, _ = _per_call(framework)
    first, second = [], []
    for _ in range(rounds):
        first.append(a())
        second.append(b())
    return statistics.median(first), statistics.median(second)


def _bundle_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(name: str, sizes: list[int], out: Path, rounds: int = 5, latency: bool = True) -> dict:
    flax = name in _flax_models()
    factory, inputs = (_flax_models() if flax else torch_zoo.MODELS)[name]
    built = factory()
    started = time.perf_counter()
    try:
        if flax:
            from xlaserve.export import export_flax
            model, variables = built
            result = export_flax(out / name, model, variables, inputs=inputs, compiled_batch_sizes=sizes)
        else:
            from xlaserve.export import export_torch
            result = export_torch(out / name, built, inputs=inputs, compiled_batch_sizes=sizes)
    except VerificationError as exc:            # written but outside the tolerance: measured all the same
        result, verification = None, exc.verification
    except Exception as exc:                    # reported as a row: the table is what failed
        return {"model": name, "ok": False, "error": " ".join(f"{type(exc).__name__}: {exc}".split())[:240],
                "seconds": time.perf_counter() - started,
                "route": "jax" if flax else "-"}
    else:
        verification = result.verification
    seconds = time.perf_counter() - started
    worst = max(verification.checks, key=lambda c: c.max_abs_error / c.scale)
    # a bundle that failed verification has no TorchExport to say its route: "?" in the table
    route = "jax" if flax else (result.route if result is not None else "?")
    row = {"model": name, "ok": verification.ok, "seconds": seconds, "output": worst.output,
           "max_abs_error": worst.max_abs_error, "scale": worst.scale,
           "ratio": worst.max_abs_error / worst.scale, "bytes": _bundle_bytes(out / name), "route": route}
    if latency:
        row["latency"] = _latency(out / name, built, flax, inputs, sizes, rounds)
    return row


def _latency(bundle: Path, built, flax: bool, inputs, sizes: list[int], rounds: int) -> dict[int, tuple[float, float]]:
    from xlaserve.bundle import load_bundle
    from xlaserve.runtime.pjrt import Device

    device = Device("cpu")
    loaded = load_bundle(bundle, 1, device)
    weights = list(device.put_weights(list(loaded.weights.read()))) if loaded.weights is not None else []
    specs = loaded.manifest.executable_inputs
    if flax:
        import jax
        from xlaserve.export import flax_function
        fn, params = flax_function(*built)
        jitted = jax.jit(fn)

        def framework_for(arrays):
            return lambda: jax.block_until_ready(jitted(params, *arrays))
    else:
        import torch

        def framework_for(arrays):
            tensors = [torch.from_numpy(a) for a in arrays]

            def run():
                with torch.no_grad():
                    return built(*tensors)
            return run
    found = {}
    for batch in sizes:
        module = loaded.modules[batch]
        arrays = sample_inputs(specs, batch, 5)
        found[batch] = alternate(lambda: device.execute(module.executable, [*weights, *arrays]),
                                 framework_for(arrays), rounds)
    return found


def served(repo: Path, names: list[str], rows_each: tuple[int, ...] = (1, 3)) -> dict[str, tuple[bool, float]]:
    """Serve every bundle of ``repo`` with the real server (``xlaserve run``), send each model
    ``rows`` rows of seeded inputs through the Triton client (3 rows run padded at a larger
    compiled size) and compare every output with the framework's on the same inputs under the
    verification's scaled tolerance. Per model: (every output matched, the worst error as a
    fraction of its output's scale)."""
    import tritonclient.grpc as grpcclient

    from tests.conftest import serve
    from xlaserve.bundle import load_bundle
    from xlaserve.export import compare, output_scale, tolerance
    from xlaserve.runtime.pjrt import Device

    device = Device("cpu")
    found: dict[str, tuple[bool, float]] = {}
    with tempfile.TemporaryDirectory(prefix="zoo-server-") as tmp, \
            serve(Path(tmp), repo, timeout=900) as server:
        client = grpcclient.InferenceServerClient(server.url)
        try:
            for name in names:
                if not (repo / name / "manifest.yaml").exists():
                    continue
                manifest = load_bundle(repo / name, 1, device).manifest
                flax = name in _flax_models()
                factory, _ = (_flax_models() if flax else torch_zoo.MODELS)[name]
                built = factory()
                ok, worst = True, 0.0
                for rows in rows_each:
                    arrays = sample_inputs(manifest.client_inputs, rows, 11)
                    want = _reference(built, flax, arrays, [o.name for o in manifest.client_outputs])
                    inputs = []
                    for spec, a in zip(manifest.client_inputs, arrays):
                        inp = grpcclient.InferInput(spec.name, list(a.shape), spec.dtype.kserve)
                        inp.set_data_from_numpy(a)
                        inputs.append(inp)
                    result = client.infer(name, inputs)
                    for output, expected in want.items():
                        got = result.as_numpy(output)
                        if got is None or got.shape != expected.shape:
                            ok = False
                            continue
                        atol, rtol = tolerance(manifest_dtype(manifest, output))
                        err, _, outside = compare(expected, got, atol, rtol)
                        ok = ok and outside == 0
                        worst = max(worst, err / output_scale(expected))
                found[name] = (ok, worst)
                print(f"served {name}: {'match' if ok else 'MISMATCH'}, worst error {worst:.2g} of scale", flush=True)
        finally:
            client.close()
    return found


def manifest_dtype(manifest, output: str) -> str:
    return next(o.dtype.code for o in manifest.client_outputs if o.name == output)


def _reference(built, flax: bool, arrays: list, names: list[str]) -> dict:
    if flax:
        import jax
        from xlaserve.export import flax_function
        fn, params = flax_function(*built)
        leaves = jax.tree_util.tree_leaves(jax.jit(fn)(params, *arrays))
        return {n: np.asarray(v) for n, v in zip(names, leaves)}
    return torch_zoo.eager(built, arrays)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join([*torch_zoo.MODELS, *_flax_models()]))
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-latency", action="store_true")
    parser.add_argument("--serve", action="store_true",
                        help="also serve every bundle with `xlaserve run` and compare through the Triton client")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch.set_num_threads for eager PyTorch (default: torch's own, the core count)")
    args = parser.parse_args(argv)
    import torch
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    print(f"eager PyTorch on {torch.get_num_threads()} thread(s)", flush=True)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="zoo-") as tmp:
        for name in args.models.split(","):
            row = measure(name, sizes, Path(tmp), args.rounds, not args.no_latency)
            rows.append(row)
            print(row, flush=True)
        if args.serve:
            for name, (ok, worst) in served(Path(tmp), [r["model"] for r in rows]).items():
                row = next(r for r in rows if r["model"] == name)
                row["served"], row["served_ratio"] = ok, worst
    shown = [b for b in (1, 8) if b in sizes] if not args.no_latency else []
    latency_heads = "".join(f" b{b} ms compiled / framework (ratio) |" for b in shown)
    serve_head = " served: match (error / scale) |" if args.serve else ""
    print(f"\n| model | route | verified | worst output | error / scale | export s (sizes {args.batch_sizes}) |"
          f" bundle MB |{latency_heads}{serve_head}")
    print("|---|---|---|---|---|---|---|" + "---|" * (len(shown) + bool(args.serve)))
    for row in rows:
        if "output" not in row:
            print(f"| {row['model']} | {row['route']} | **no**: {row['error']} | | | {row['seconds']:.1f} | |"
                  + " |" * len(shown))
            continue
        cells = "".join(
            f" {_ms(row['latency'][b][0])} / {_ms(row['latency'][b][1])} ({row['latency'][b][0] / row['latency'][b][1]:.2f}) |"
            for b in shown)
        if args.serve:
            cells += (f" {'yes' if row['served'] else '**no**'} ({row['served_ratio']:.2g}) |" if "served" in row
                      else " not served |")
        print(f"| {row['model']} | {row['route']} | {'yes' if row['ok'] else '**no**'} | {row['output']} |"
              f" {row['ratio']:.2g} | {row['seconds']:.1f} | {row['bytes'] / 1e6:.2f} |{cells}")
    return 0 if all(row["ok"] and row.get("served", True) for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
