"""One ResNet-18 execution, without a server: the exported module on xlaserve's PJRT against the
same model in eager PyTorch, per batch size, wall and CPU time.

    python -m benchmarks.resnet_exec_bench [--batches 1,8] [--torch-threads 1] [--repeat 5]

Exports ``examples/torch_examples.py``'s ResNet-18 with the batch sizes into a temporary
directory, loads it as the server does (weights on the device once), runs each module
``--repeat`` times after one warm-up call, then runs ``torchvision``'s ResNet-18 with the same
weights under ``torch.inference_mode`` on ``--torch-threads`` intra-op threads. Prints one JSON
line per (engine, batch): mean wall and process-CPU milliseconds per call and per image.
``XLA_FLAGS`` in the environment applies to the xlaserve side (e.g.
``--xla_cpu_use_thunk_runtime=false``). Needs the ``examples-torch`` extra.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def _timed(call, repeat: int) -> tuple[float, float]:
    call()                                            # warm-up
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - wall) / repeat, (time.process_time() - cpu) / repeat


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--torch-threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    import torch

    from examples import torch_examples
    from xlaserve.bundle import load_bundle
    from xlaserve.runtime.pjrt import Device

    batches = [int(b) for b in args.batches.split(",")]

    def line(engine: str, batch: int, wall: float, cpu: float, **extra) -> None:
        print(json.dumps({"engine": engine, "batch": batch, "wall_ms": round(1e3 * wall, 1),
                          "cpu_ms": round(1e3 * cpu, 1), "wall_ms_per_image": round(1e3 * wall / batch, 1),
                          "cpu_ms_per_image": round(1e3 * cpu / batch, 1), **extra}), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        bundle = torch_examples.export("resnet18", Path(tmp), tuple(batches))
        device = Device("cpu")
        model = load_bundle(bundle, 1, device)
        weights = list(device.put_weights(list(model.weights.read())))
        for batch in batches:
            x = torch_examples.sample("resnet18", batch)
            executable = model.modules[batch].executable
            wall, cpu = _timed(lambda: device.execute(executable, [*weights, x]), args.repeat)
            line("xlaserve-pjrt", batch, wall, cpu, xla_flags=os.environ.get("XLA_FLAGS", ""))
    torch.set_num_threads(args.torch_threads)
    eager = torch_examples.resnet18()
    with torch.inference_mode():
        for batch in batches:
            x = torch.from_numpy(torch_examples.sample("resnet18", batch))
            wall, cpu = _timed(lambda: eager(x), args.repeat)
            line("eager-torch", batch, wall, cpu, threads=args.torch_threads)


if __name__ == "__main__":
    main()
