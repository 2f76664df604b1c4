"""Depthwise convolutions on the cpu: XLA's paths for ``feature_group_count`` convolutions, and
the rewrite xlaserve applies (:func:`xlaserve.runtime.pjrt.rewrite_depthwise_convolutions`),
against eager PyTorch on the same number of threads.

    python -m benchmarks.dwconv_bench [--threads 2] [--rounds 5] [--calls 10]
        [--part layers,grouped,zoo,transformers,convnext]

``layers``: single depthwise convolutions (NCHW input, OIHW kernel, as torch-mlir writes them),
each lowered with jax and compiled under each variant: the module as it is with xlaserve's
compile options (YNNPACK for dots only: ``dots``), with YNNPACK also taking convolutions
(``ynn-conv``), with XLA's defaults (``xla-default``), with XNNPACK or oneDNN asked to take
individual convolutions (``xnn-conv``, ``onednn-conv``); the module transposed to NHWC around
the convolution (``nhwc``); and the module after xlaserve's rewrite (``rewritten``).
``grouped``: a ResNeXt block, whose grouped convolutions the rewrite leaves, under each compile
option a trial may choose (:mod:`xlaserve.runtime.tuning`), and the one it chose.
``zoo`` and ``transformers``: examples/torch_zoo.py's EfficientNet-like network (32x32), and
transformers' MobileNetV2Model and EfficientNet-B0 encoder (224x224) from configs, exported with
``xlaserve export --torch`` at batch 1 and 8 and loaded as the server loads them (``rewritten``,
today's default), or with the rewrite switched off (``as exported``), against the same model in
eager PyTorch under ``torch.inference_mode``.
``convnext`` (not in the default parts): ConvNeXt's block taken apart at the first stage of
examples/torch_zoo.py's ``convnext`` (32 channels, 16x16): the 7x7 depthwise convolution alone,
with the LayerNorm that reads it, the LayerNorm alone, the Linear-GELU-Linear MLP, GELU alone,
the whole block, and the two zoo ConvNeXts whole, at batch 8 and 1, exported with ``xlaserve
export --torch`` and loaded as the server loads them (``rewritten``) or with the depthwise sums
as they were before they were made to be computed once (``before``), against eager PyTorch.

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


def _hf_models():
    """transformers' MobileNetV2Model and EfficientNetModel (B0's widths and depths) from configs,
    and torchvision's MobileNetV3-small (:func:`_mobilenet_v3_small`), 224x224, BatchNorm
    statistics calibrated on random images. EfficientNet is timed as its encoder followed by a
    mean over the image (its own pooler, an ``AvgPool2d`` with ``ceil_mode``, exports through
    the ``torch-mlir+rewrites`` route since, and computes the same mean)."""
    import torch
    from transformers import EfficientNetConfig, EfficientNetModel, MobileNetV2Config, MobileNetV2Model

    from examples.torch_zoo import calibrate

    class Encoder(torch.nn.Module):
        def __init__(self, model) -> None:
            super().__init__()
            self.embeddings, self.encoder = model.embeddings, model.encoder

        def forward(self, pixel_values):
            return self.encoder(self.embeddings(pixel_values)).last_hidden_state.mean((2, 3))

    def reinitialized(model):
        # transformers draws conv weights and BatchNorm scales from N(0, 0.02), under which
        # activations shrink to denormals within a few blocks (each BatchNorm multiplies by ~0.015:
        # EfficientNet-B0's output was about 1e-18, and denormal arithmetic is slow on both
        # sides); PyTorch's own init (scales of 1) keeps them in range
        torch.manual_seed(0)
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear, torch.nn.modules.batchnorm._BatchNorm)):
                module.reset_parameters()
        return calibrate(model, 224, batches=1, batch=4)

    mobilenet = reinitialized(MobileNetV2Model(MobileNetV2Config(image_size=224)))
    mobilenet_v3 = reinitialized(_mobilenet_v3_small(torch))
    efficientnet = reinitialized(Encoder(EfficientNetModel(EfficientNetConfig(
        image_size=224, width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280))))
    return {"transformers MobileNetV2Model (224x224)": mobilenet,
            "transformers EfficientNetModel B0 encoder (224x224)": efficientnet,
            "MobileNetV3-small, torchvision's layout (224x224)": mobilenet_v3}


def _mobilenet_v3_small(torch):
    """torchvision's ``mobilenet_v3_small`` (its block table, hardswish, squeeze-and-excitation
    with hardsigmoid, the classifier), written out here: torchvision does not import beside this
    project's CPU torch. Random weights (2,542,856 parameters, as torchvision's); the caller
    calibrates BatchNorm."""
    from torch import nn

    def divisible(v: float) -> int:             # to a multiple of 8, never below 90% of v
        rounded = max(8, int(v + 4) // 8 * 8)
        return rounded + 8 if rounded < 0.9 * v else rounded

    def conv_bn(cin, cout, kernel, stride=1, groups=1, act=None):
        layers = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                  nn.BatchNorm2d(cout, eps=0.001, momentum=0.01)]
        return nn.Sequential(*layers, act()) if act is not None else nn.Sequential(*layers)

    class SE(nn.Module):
        def __init__(self, channels: int) -> None:
            super().__init__()
            squeeze = divisible(channels // 4)
            self.fc1, self.fc2 = nn.Conv2d(channels, squeeze, 1), nn.Conv2d(squeeze, channels, 1)

        def forward(self, x):
            gate = x.mean((2, 3), keepdim=True)
            return x * nn.functional.hardsigmoid(self.fc2(nn.functional.relu(self.fc1(gate))))

    class Block(nn.Module):
        def __init__(self, cin, kernel, expanded, cout, se, act, stride) -> None:
            super().__init__()
            layers = [] if expanded == cin else [conv_bn(cin, expanded, 1, act=act)]
            layers.append(conv_bn(expanded, expanded, kernel, stride, groups=expanded, act=act))
            if se:
                layers.append(SE(expanded))
            layers.append(conv_bn(expanded, cout, 1))
            self.block = nn.Sequential(*layers)
            self.residual = stride == 1 and cin == cout

        def forward(self, x):
            y = self.block(x)
            return x + y if self.residual else y

    relu, hswish = nn.ReLU, nn.Hardswish
    table = [(16, 3, 16, 16, True, relu, 2), (16, 3, 72, 24, False, relu, 2), (24, 3, 88, 24, False, relu, 1),
             (24, 5, 96, 40, True, hswish, 2), (40, 5, 240, 40, True, hswish, 1), (40, 5, 240, 40, True, hswish, 1),
             (40, 5, 120, 48, True, hswish, 1), (48, 5, 144, 48, True, hswish, 1), (48, 5, 288, 96, True, hswish, 2),
             (96, 5, 576, 96, True, hswish, 1), (96, 5, 576, 96, True, hswish, 1)]

    class MobileNetV3Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(conv_bn(3, 16, 3, 2, act=hswish), *(Block(*row) for row in table),
                                          conv_bn(96, 576, 1, act=hswish))
            self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, 1000))

        def forward(self, pixel_values):
            return self.classifier(self.features(pixel_values).mean((2, 3)))

    torch.manual_seed(0)
    return MobileNetV3Small()


def network(rounds: int, calls: int, rows: list, which: str) -> None:
    import torch

    from examples import torch_zoo
    from xlaserve import bundle as bundle_module
    from xlaserve.export import TensorSpec, export_torch
    from xlaserve.runtime.executables import ExecutableTable
    from xlaserve.runtime.pjrt import Device, rewrite_depthwise_convolutions

    if which == "zoo":
        factory, inputs = torch_zoo.MODELS["efficientnet"]
        models = {"EfficientNet-like (examples/torch_zoo.py, 32x32)": factory()}
    else:
        inputs = [TensorSpec("pixel_values", "f32", "whcn", {"c": 3, "h": 224, "w": 224})]
        models = _hf_models()
    device = Device("cpu")

    class AsExported(Device):
        rewrites_depthwise = False
    plain_device = AsExported("cpu")

    class DepthwiseOnly(ExecutableTable):
        def rewrite_convolutions(self, module: bytes) -> bytes:
            return rewrite_depthwise_convolutions(module)
    rng = np.random.default_rng(3)
    for title, model in models.items():
        with tempfile.TemporaryDirectory(prefix="dwconv-") as tmp:
            started = time.perf_counter()
            out = export_torch(Path(tmp) / "model", model, inputs=inputs, compiled_batch_sizes=[1, 8],
                               verify=False).bundle
            print(json.dumps({"case": title, "export_seconds": round(time.perf_counter() - started, 1)}), flush=True)
            loaded = {"rewritten": (device, bundle_module.load_bundle(out, 1, device)),
                      "depthwise only, NCHW between": (device, bundle_module.load_bundle(
                          out, 1, device, executables=DepthwiseOnly(device))),
                      "as exported": (plain_device, bundle_module.load_bundle(out, 1, plain_device))}
            weights = {name: list(dev.put_weights(list(m.weights.read()))) for name, (dev, m) in loaded.items()}
            for batch in (1, 8):
                x = rng.standard_normal(inputs[0].row_major(batch)).astype(np.float32)
                reference, run_torch = _eager(torch, model, x)
                sides = {"eager torch": run_torch}
                errors = {}
                for name, (dev, m) in loaded.items():
                    exe = m.modules[batch].executable
                    args = [*weights[name], dev._put(x)]
                    errors[name] = float(np.abs(dev.execute(exe, args)[0] - reference).max())
                    sides[name] = (lambda dev=dev, exe=exe, args=args: dev.execute(exe, args))
                _report(f"{title}, batch {batch}", _race(sides, rounds, calls), errors, rows)


def _convnext_parts() -> dict:
    """ConvNeXt's block taken apart, at its first stage's size in examples/torch_zoo.py (32
    channels, 16x16): (torch module, input TensorSpec) by name."""
    import torch
    from torch import nn

    from examples import torch_zoo
    from xlaserve.export import TensorSpec

    nchw = TensorSpec("x", "f32", "whcn", {"c": 32, "h": 16, "w": 16})
    nhwc = TensorSpec("x", "f32", "cwhn", {"c": 32, "h": 16, "w": 16})
    wide = TensorSpec("x", "f32", "cwhn", {"c": 128, "h": 16, "w": 16})

    class Depthwise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(32, 32, 7, padding=3, groups=32)

        def forward(self, x):
            return self.conv(x)

    class DepthwiseNorm(Depthwise):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(32, eps=1e-6)

        def forward(self, x):
            return self.norm(self.conv(x).permute(0, 2, 3, 1))

    class Norm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(32, eps=1e-6)

        def forward(self, x):
            return self.norm(x.permute(0, 2, 3, 1))

    class Mlp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

        def forward(self, x):
            return self.down(nn.functional.gelu(self.up(x)))

    class Gelu(nn.Module):
        def forward(self, x):
            return nn.functional.gelu(x)

    def seeded(cls):
        torch.manual_seed(0)
        return cls().eval()
    return {"depthwise 7x7": (seeded(Depthwise), nchw),
            "depthwise 7x7 + LayerNorm": (seeded(DepthwiseNorm), nchw),
            "LayerNorm over channels (NCHW permuted)": (seeded(Norm), nchw),
            "Linear 32-128, GELU, Linear 128-32": (seeded(Mlp), nhwc),
            "GELU (erf), 128 channels": (seeded(Gelu), wide),
            "ConvNeXt block": (seeded(lambda: torch_zoo.ConvNeXtBlock(32)), nchw),
            "convnext (whole, 64x64)": (torch_zoo.MODELS["convnext"][0](), torch_zoo.MODELS["convnext"][1][0]),
            "hf_convnext (whole, 64x64)": (torch_zoo.MODELS["hf_convnext"][0](),
                                           torch_zoo.MODELS["hf_convnext"][1][0])}


def convnext(rounds: int, calls: int, rows: list, batches: tuple[int, ...] = (8, 1)) -> None:
    """ConvNeXt's pieces, each exported with ``export --torch`` and loaded as the server loads
    it (``rewritten``), or with the depthwise sums written out as they were before
    (``before``: ``computed_once=False``, so XLA computes each sum again inside every fusion
    that reads it, and reads the taps' weights strided), against eager PyTorch."""
    import torch

    from xlaserve import bundle as bundle_module
    from xlaserve.export import export_torch
    from xlaserve.runtime.executables import ExecutableTable
    from xlaserve.runtime.pjrt import Device, rewrite_depthwise_convolutions

    class Before(ExecutableTable):
        def rewrite_convolutions(self, module: bytes) -> bytes:
            return rewrite_depthwise_convolutions(module, computed_once=False)

    device = Device("cpu")
    rng = np.random.default_rng(5)
    for title, (model, spec) in _convnext_parts().items():
        with tempfile.TemporaryDirectory(prefix="convnext-") as tmp:
            out = export_torch(Path(tmp) / "part", model, inputs=[spec], compiled_batch_sizes=list(batches),
                               verify=False).bundle
            loaded = {"rewritten": bundle_module.load_bundle(out, 1, device),
                      "before": bundle_module.load_bundle(out, 1, device, executables=Before(device))}
            weights = {name: list(device.put_weights(list(m.weights.read()))) if m.weights is not None else []
                       for name, m in loaded.items()}
            for batch in batches:
                x = rng.standard_normal(spec.row_major(batch)).astype(np.float32)
                reference, run_torch = _eager(torch, model, x)
                sides = {"eager torch": run_torch}
                errors = {}
                for name, m in loaded.items():
                    exe = m.modules[batch].executable
                    args = [*weights[name], device._put(x)]
                    errors[name] = float(np.abs(device.execute(exe, args)[0] - reference).max())
                    sides[name] = (lambda exe=exe, args=args: device.execute(exe, args))
                _report(f"{title}, batch {batch}", _race(sides, rounds, calls), errors, rows)


def grouped(rounds: int, calls: int, rows: list) -> None:
    """A ResNeXt bottleneck block (1x1 256->128, 3x3 in 32 groups, 1x1 128->256, residual) at
    28x28: grouped convolutions the depthwise rewrite leaves, compiled with each compile option
    and with the option :func:`xlaserve.runtime.tuning.compile_tuned` picks."""
    import jax
    import torch
    from jax import lax

    from xlaserve.runtime.pjrt import Device
    from xlaserve.runtime.tuning import compile_tuned

    numbers = ("NCHW", "OIHW", "NCHW")

    def block(x, w1, w2, w3):
        y = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=numbers))
        y = jax.nn.relu(lax.conv_general_dilated(y, w2, (1, 1), "SAME", dimension_numbers=numbers,
                                                 feature_group_count=32))
        return (lax.conv_general_dilated(y, w3, (1, 1), "SAME", dimension_numbers=numbers) + x,)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c1 = torch.nn.Conv2d(256, 128, 1, bias=False)
            self.c2 = torch.nn.Conv2d(128, 128, 3, padding=1, groups=32, bias=False)
            self.c3 = torch.nn.Conv2d(128, 256, 1, bias=False)

        def forward(self, x):
            return self.c3(torch.relu(self.c2(torch.relu(self.c1(x))))) + x

    device = Device("cpu")
    rng = np.random.default_rng(0)
    model = Block().eval()
    weights = [(rng.standard_normal(c.weight.shape) * 0.05).astype(np.float32) for c in (model.c1, model.c2, model.c3)]
    with torch.no_grad():
        for conv, w in zip((model.c1, model.c2, model.c3), weights):
            conv.weight.copy_(torch.from_numpy(w))
    for batch in (1, 8):
        x = rng.standard_normal((batch, 256, 28, 28)).astype(np.float32)
        text = jax.jit(block).lower(x, *weights).as_text().encode()
        variants = {choice: device.compile(text, choice) for choice in device.compile_choices(text)}
        tuned = compile_tuned(device, text)
        args = [device._put(a) for a in (x, *weights)]
        tx = torch.from_numpy(x)
        with torch.inference_mode():
            reference = model(tx).numpy()
        errors = {name: float(np.abs(device.execute(exe, args)[0] - reference).max()) for name, exe in variants.items()}

        def run_torch():
            with torch.inference_mode():
                model(tx)
        sides = {"eager torch": run_torch}
        sides.update({name: (lambda exe=exe: device.execute(exe, args)) for name, exe in variants.items()})
        case = f"ResNeXt block (32 groups, 28x28), batch {batch}"
        print(json.dumps({"case": case, "trial_choice": tuned.choice, "trial_seconds": round(tuned.seconds, 2)}),
              flush=True)
        _report(case, _race(sides, rounds, calls), errors, rows)



def _eager(torch, model, x: np.ndarray):
    """Eager PyTorch's first output for ``x`` (as NumPy) and a call that runs the model again."""
    tx = torch.from_numpy(x)
    with torch.inference_mode():
        out = model(tx)
        reference = (out if isinstance(out, torch.Tensor) else out[0]).numpy()

    def run_torch():
        with torch.inference_mode():
            model(tx)
    return reference, run_torch

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="PyTorch intra-op threads (XLA's cpu client "
                        "uses one per core)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--part", default="layers,grouped,zoo,transformers")
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
    if "grouped" in parts:
        grouped(args.rounds, args.calls, rows)
    for which in ("zoo", "transformers"):
        if which in parts:
            network(args.rounds, args.calls, rows, which)
    if "convnext" in parts:
        convnext(args.rounds, args.calls, rows)
    cases = list(dict.fromkeys(r["case"] for r in rows))
    for case in cases:
        print(f"\n{case}\n\n| variant | ms | × eager | max abs error |\n|---|---|---|---|")
        for r in rows:
            if r["case"] == case:
                print(f"| {r['variant']} | {r['ms']} | {r['x_eager']} | {r.get('max_abs_error', '')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
