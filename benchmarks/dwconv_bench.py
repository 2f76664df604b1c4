"""Depthwise convolutions on the cpu: XLA's paths for ``feature_group_count`` convolutions, and
the rewrite xlaserve applies (:func:`xlaserve.runtime.pjrt.rewrite_depthwise_convolutions`),
against eager PyTorch on the same number of threads.

    python -m benchmarks.dwconv_bench [--threads 2] [--rounds 5] [--calls 10] [--part layers,network]

``layers``: single depthwise convolutions (NCHW input, OIHW kernel, as torch-mlir writes them),
each lowered with jax and compiled under each variant: the module as it is with xlaserve's
compile options (YNNPACK for dots only: ``dots``), with YNNPACK also taking convolutions
(``ynn-conv``), with XLA's defaults (``xla-default``), with XNNPACK or oneDNN asked to take
individual convolutions (``xnn-conv``, ``onednn-conv``); the module transposed to NHWC around
the convolution (``nhwc``); and the module after xlaserve's rewrite (``rewritten``).
``network``: examples/torch_zoo.py's EfficientNet-like network exported with
``xlaserve export --torch`` at batch 1 and 8 and loaded as the server loads it (``rewritten``,
today's default), or with the rewrite switched off (``as exported``), against the same model in
eager PyTorch under ``torch.inference_mode``.

Each measurement is the median over ``--rounds`` rounds of the median of ``--calls`` calls (after
one warm-up call); within a round the sides alternate in the same process, so that a busy shared
machine slows them alike. Prints one JSON line per (case, variant) with the time and its ratio
to eager PyTorch, then Markdown tables.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import numpy as np  # noqa: E402

YNN = "xla_cpu_experimental_ynn_fusion_type"
DOTS = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"
OPTIONS = {
    "dots": ((YNN, DOTS),),
    "ynn-conv": ((YNN, DOTS + ",LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"),),
    "xla-default": (),
    "xnn-conv": ((YNN, DOTS), ("xla_cpu_experimental_xnn_fusion_type", "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION")),
    "onednn-conv": ((YNN, DOTS),
                    ("xla_cpu_experimental_onednn_fusion_type", "LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION")),
}
# (batch, channels, size, kernel, stride): MobileNet/EfficientNet layer shapes
LAYERS = ((1, 96, 56, 3, 1), (8, 96, 56, 3, 1), (1, 144, 28, 5, 1), (8, 144, 28, 5, 1), (1, 96, 56, 3, 2),
          (8, 96, 56, 3, 2), (1, 480, 14, 5, 1), (8, 480, 14, 5, 1))


def _median_call(call, calls: int) -> float:
    call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _race(sides: dict, rounds: int, calls: int) -> dict[str, float]:
    """The median over rounds of each side's median call; the sides alternate within a round."""
    got: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, call in sides.items():
            got[name].append(_median_call(call, calls))
    return {name: statistics.median(times) for name, times in got.items()}


def _report(case: str, times: dict[str, float], errors: dict[str, float], rows: list) -> None:
    eager = times["eager torch"]
    for name, seconds in times.items():
        row = {"case": case, "variant": name, "ms": round(1e3 * seconds, 3), "x_eager": round(seconds / eager, 2)}
        if name in errors:
            row["max_abs_error"] = float(f"{errors[name]:.2g}")
        rows.append(row)
        print(json.dumps(row), flush=True)


def layers(rounds: int, calls: int, rows: list) -> None:
    import jax
    import torch
    from jax import lax
    from jax._src.lib import xla_client  # the benchmark compiles with options the server does not

    from xlaserve.runtime.pjrt import Device, rewrite_depthwise_convolutions

    device = Device("cpu")
    client, devices = device._client, device._device_list

    def compile_with(text: bytes, options) -> object:
        compile_options = xla_client.CompileOptions()
        compile_options.env_option_overrides = list(options)
        return client.compile_and_load(text, devices, compile_options)

    rng = np.random.default_rng(0)
    for batch, channels, size, k, stride in LAYERS:
        pad = [(k // 2, k // 2)] * 2

        def nchw(x, w):
            return (lax.conv_general_dilated(x, w, (stride, stride), pad, dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                             feature_group_count=channels),)

        def nhwc(x, w):
            y = lax.conv_general_dilated(x.transpose(0, 2, 3, 1), w.transpose(2, 3, 1, 0), (stride, stride), pad,
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=channels)
            return (y.transpose(0, 3, 1, 2),)

        x = rng.standard_normal((batch, channels, size, size)).astype(np.float32)
        w = rng.standard_normal((channels, 1, k, k)).astype(np.float32)
        conv = torch.nn.Conv2d(channels, channels, k, stride, k // 2, groups=channels, bias=False)
        with torch.no_grad():
            conv.weight.copy_(torch.from_numpy(w))
        tx = torch.from_numpy(x)
        with torch.inference_mode():
            reference = conv(tx).numpy()
        text = jax.jit(nchw).lower(x, w).as_text().encode()
        variants = {name: compile_with(text, options) for name, options in OPTIONS.items()}
        variants["nhwc"] = compile_with(jax.jit(nhwc).lower(x, w).as_text().encode(), OPTIONS["dots"])
        variants["rewritten"] = compile_with(rewrite_depthwise_convolutions(text), OPTIONS["dots"])
        args = [device._put(x), device._put(w)]
        errors = {name: float(np.abs(device.execute(exe, args)[0] - reference).max()) for name, exe in variants.items()}

        def run_torch():
            with torch.inference_mode():
                conv(tx)
        sides = {"eager torch": run_torch}
        sides.update({name: (lambda exe=exe: device.execute(exe, args)) for name, exe in variants.items()})
        _report(f"depthwise {k}x{k}/{stride}, {channels}ch {size}x{size}, batch {batch}",
                _race(sides, rounds, calls), errors, rows)


def network(rounds: int, calls: int, rows: list) -> None:
    import torch

    from examples import torch_zoo
    from xlaserve import bundle as bundle_module
    from xlaserve.export_torch import export_torch
    from xlaserve.runtime.pjrt import Device

    factory, inputs = torch_zoo.MODELS["efficientnet"]
    model = factory()
    device = Device("cpu")
    with tempfile.TemporaryDirectory(prefix="dwconv-") as tmp:
        out = export_torch(Path(tmp) / "efficientnet", model, inputs=inputs, compiled_batch_sizes=[1, 8],
                           verify=False).bundle
        rewritten = bundle_module.load_bundle(out, 1, device)

        class AsExported(Device):
            rewrites_depthwise = False
        plain_device = AsExported("cpu")
        plain = bundle_module.load_bundle(out, 1, plain_device)
        loaded = {"rewritten": (device, rewritten), "as exported": (plain_device, plain)}
        weights = {name: list(dev.put_weights(list(m.weights.read()))) for name, (dev, m) in loaded.items()}
        for batch in (1, 8):
            x = torch_zoo.sample("efficientnet", batch)[0]
            tx = torch.from_numpy(x)
            with torch.inference_mode():
                reference = model(tx).numpy()

            def run_torch():
                with torch.inference_mode():
                    model(tx)
            sides = {"eager torch": run_torch}
            errors = {}
            for name, (dev, m) in loaded.items():
                exe = m.modules[batch].executable
                args = [*weights[name], dev._put(x)]
                errors[name] = float(np.abs(dev.execute(exe, args)[0] - reference).max())
                sides[name] = (lambda dev=dev, exe=exe, args=args: dev.execute(exe, args))
            _report(f"EfficientNet-like (examples/torch_zoo.py), batch {batch}", _race(sides, rounds, calls),
                    errors, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="PyTorch intra-op threads (XLA's cpu client "
                        "uses one per core)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--part", default="layers,network")
    args = parser.parse_args(argv)
    import os

    import torch
    torch.set_num_threads(args.threads)
    print(json.dumps({"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                      "load_average": os.getloadavg()}), flush=True)
    rows: list = []
    parts = args.part.split(",")
    if "layers" in parts:
        layers(args.rounds, args.calls, rows)
    if "network" in parts:
        network(args.rounds, args.calls, rows)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for case in cases:
        print(f"\n{case}\n\n| variant | ms | × eager | max abs error |\n|---|---|---|---|")
        for r in rows:
            if r["case"] == case:
                print(f"| {r['variant']} | {r['ms']} | {r['x_eager']} | {r.get('max_abs_error', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
