"""PyTorch -> StableHLO candidates on ResNet-18: export time and output error against eager PyTorch.

    python -m benchmarks.torch_lowering_bench --candidate torch-mlir|torchax|torch_xla [--batch 4]

Run it once per candidate, in a venv that has that candidate and torchvision. torch-mlir: this
checkout's venv with the ``examples-torch`` extra. torchax and torch_xla need torch 2.9.0 (a CUDA
download of several GB), in a venv of their own, as measured::

    python3 -m venv v29 && v29/bin/pip install torch==2.9.0 torchvision==0.24.0 torch_xla==2.9.0 \
        torchax==0.0.13 jax==0.10.2 jaxlib==0.10.2
    v29/bin/pip install --force-reinstall --no-deps torchax==0.0.13   # torch_xla overwrites it
    v29/bin/python -m benchmarks.torch_lowering_bench --candidate torchax Each run builds ``torchvision.models.resnet18(weights=None)`` with
seed 0, in eval mode, and times the whole export of one batch size (``torch.export`` plus the
lowering, a cold first call and a warm second one), then runs the lowered program on the cpu on a
seeded input and prints one JSON line: seconds, the largest absolute and relative error of the
logits against eager PyTorch, and the installed size of the candidate's own package.

- ``torch-mlir``: xlaserve's path (:mod:`xlaserve.export.from_torch`), run through xlaserve's PJRT.
- ``torchax``: ``torchax.export.exported_program_to_stablehlo``, run with ``jax.export``'s ``call``.
- ``torch_xla``: ``torch_xla.stablehlo.exported_program_to_stablehlo`` (``PJRT_DEVICE=CPU``),
  its StableHLO text run through xlaserve's PJRT with the state it names.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def _package_mb(distribution: str) -> float:
    """Installed size of a distribution's own files (its RECORD), without its dependencies."""
    files = importlib.metadata.files(distribution) or []
    return round(sum(f.size or 0 for f in files) / 2**20, 1)


def _torch_mlir(model, x):
    from xlaserve.export.from_torch import Functional, lower_module, state_weights, to_numpy

    weights = state_weights(model)
    wrapper = Functional(model, list(weights))

    def export():
        return lower_module(wrapper, list(weights.values()), [x.numpy()])

    def run(text):
        device = _pjrt().Device("cpu")
        return device.execute(device.compile(text), [*map(to_numpy, weights.values()), x.numpy()])[0]
    return export, run


def _torchax(model, x):
    import torch
    from torchax.export import exported_program_to_stablehlo

    def export():
        program = torch.export.export(model, (x,))
        return exported_program_to_stablehlo(program)

    def run(exported):
        weights, jax_export = exported
        return np.asarray(jax_export.call(weights, ([x.numpy()],))[0])
    return export, run


def _torch_xla(model, x):
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    import torch
    from torch_xla.stablehlo import VariableType, exported_program_to_stablehlo

    def export():
        program = torch.export.export(model, (x,))
        return program, exported_program_to_stablehlo(program)

    def run(exported):
        # Its module through xlaserve's PJRT, as a bundle would run: @main takes the state it
        # names (input_locations) and the input. (The returned program's own __call__ gave
        # errors near 2 even on one nn.Linear on the cpu here, so it is not what is measured.)
        program, lowered = exported
        meta = lowered._bundle.stablehlo_funcs[0].meta
        state = program.state_dict
        arguments = [x.numpy() if loc.type_ == VariableType.INPUT_ARG else state[loc.name].detach().numpy()
                     for loc in meta.input_locations]
        device = _pjrt().Device("cpu")
        text = lowered.get_stablehlo_text().encode()
        return device.execute(device.compile(text), arguments)[0]
    return export, run


def _pjrt():
    """xlaserve/runtime/pjrt.py, loaded by path: it needs only jax, so it runs in a candidate's
    venv that does not have xlaserve's other dependencies."""
    spec = importlib.util.spec_from_file_location(
        "_xlaserve_pjrt", Path(__file__).resolve().parents[1] / "xlaserve" / "runtime" / "pjrt.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CANDIDATES = {"torch-mlir": (_torch_mlir, "torch_mlir"), "torchax": (_torchax, "torchax"),
              "torch_xla": (_torch_xla, "torch_xla")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--candidate", required=True, choices=sorted(CANDIDATES))
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    import torch
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((args.batch, 3, 224, 224), np.float32))
    with torch.no_grad():
        expected = model(x).numpy()
    make, package = CANDIDATES[args.candidate]
    export, run = make(model, x)
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        exported = export()
        seconds.append(round(time.perf_counter() - started, 2))
    found = np.asarray(run(exported), dtype=np.float64)
    error = np.abs(found - expected)
    print(json.dumps({
        "candidate": args.candidate, "torch": torch.__version__, "batch": args.batch,
        "export_s_cold": seconds[0], "export_s_warm": seconds[1],
        "max_abs_error": float(error.max()), "max_abs_logit": float(np.abs(expected).max()),
        "max_rel_error": float((error / np.maximum(np.abs(expected), 1e-30)).max()),
        "package_mb": _package_mb(package),
    }))


if __name__ == "__main__":
    main()
