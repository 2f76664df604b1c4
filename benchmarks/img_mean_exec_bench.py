"""The example ``img_mean``'s execution as the worker runs it (batch assembly, device put,
execution, outputs on the host), old against new, in one process.

    python -m benchmarks.img_mean_exec_bench [--rounds 7] [--batches 1/1,8/8,32/32,32/24]

``old``: the requests' rows joined by ``np.concatenate`` (16-byte-aligned memory, which PJRT's
cpu client copies again) and the model summing pixels in one int32 reduction. ``new``:
:func:`xlaserve.worker.executor.assemble` (one copy into 64-byte-aligned memory the client
wraps in place) and examples/export_examples.py's ``img_mean`` (uint16 partial sums of 256
pixels, then int32). ``aligned``: the new assembly with the old model (what the assembly alone
changed). All give bit-identical outputs (checked). Each request is its own
``bytes`` object (as protobuf hands the codec ``raw_input_contents``), ``B/N`` is a compiled
batch of B filled with N requests (the rest zero-padded). Within a round the two alternate, so a
busy shared machine slows them alike. Prints CPU time of the whole process (XLA's threads
included) and wall time per request: medians over the rounds and the range of the CPU time.
"""
from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from examples import reference
from examples.export_examples import img_mean
from xlaserve.runtime.pjrt import Device
from xlaserve.worker.executor import assemble


def img_mean_int32(x):
    """The example before: one int32 reduction over each image."""
    b = x.shape[0]
    total = jnp.sum(x.reshape(b, -1).astype(jnp.int32), axis=1)
    return ((total.astype(jnp.float32) / jnp.float32(x[0].size)).reshape(b, 1),)


def concatenated(requests, size: int) -> list[np.ndarray]:
    """The assembly before: ``np.concatenate`` of the rows and a zero block."""
    parts = [r["input"] for r in requests]
    if len(parts) == 1 and parts[0].shape[0] == size:
        return [np.ascontiguousarray(parts[0])]
    if len(parts) < size:
        parts.append(np.zeros((size - len(parts), *reference.IMG_SHAPE), np.uint8))
    return [np.concatenate(parts)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batches", default="1/1,8/8,32/32,32/24", help="compiled size/requests, comma-separated")
    args = p.parse_args()
    device = Device("cpu")
    decl = SimpleNamespace(name="input", batch_axis=0, dtype=SimpleNamespace(numpy=np.dtype(np.uint8)))
    model = SimpleNamespace(manifest=SimpleNamespace(executable_inputs=[decl]))
    rng = np.random.default_rng(0)
    print("| batch / requests | old CPU µs/req | aligned CPU µs/req | new CPU µs/req | new/old "
          "| old wall µs/req | new wall µs/req |")
    print("|---|---|---|---|---|---|---|")
    for item in args.batches.split(","):
        size, n = (int(v) for v in item.split("/"))
        pixels = int(np.prod(reference.IMG_SHAPE))
        requests = [{"input": np.frombuffer(rng.integers(0, 256, pixels, dtype=np.uint8).tobytes(), np.uint8)
                     .reshape(1, *reference.IMG_SHAPE)} for _ in range(n)]

        def compiled(fn):
            spec = jax.ShapeDtypeStruct((size, *reference.IMG_SHAPE), jnp.uint8)
            return device.compile(jax.jit(fn).lower(spec).as_text(dialect="stablehlo").encode())
        old_ex, new_ex = compiled(img_mean_int32), compiled(img_mean)
        sides = {"old": lambda: device.execute(old_ex, concatenated(requests, size)),
                 "aligned": lambda: device.execute(old_ex, assemble(model, requests, size)),
                 "new": lambda: device.execute(new_ex, assemble(model, requests, size))}
        if not all(np.array_equal(sides["old"]()[0], run()[0]) for run in sides.values()):
            raise SystemExit(f"the outputs differ at {item}")
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        calls = max(10, 600 // size)
        for _ in range(args.rounds):
            for name, run in sides.items():
                cpu, wall = time.process_time(), time.perf_counter()
                for _ in range(calls):
                    run()
                samples[name].append(((time.process_time() - cpu) / calls / n * 1e6,
                                      (time.perf_counter() - wall) / calls / n * 1e6))

        def cpu(name):
            values = [c for c, _ in samples[name]]
            return statistics.median(values), min(values), max(values)

        def wall(name):
            return statistics.median(w for _, w in samples[name])
        (old, old_lo, old_hi), (mid, mid_lo, mid_hi), (new, new_lo, new_hi) = cpu("old"), cpu("aligned"), cpu("new")
        print(f"| {size} / {n} | {old:.1f} ({old_lo:.1f}-{old_hi:.1f}) | {mid:.1f} ({mid_lo:.1f}-{mid_hi:.1f}) "
              f"| {new:.1f} ({new_lo:.1f}-{new_hi:.1f}) | {new / old:.2f} | {wall('old'):.1f} | {wall('new'):.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
