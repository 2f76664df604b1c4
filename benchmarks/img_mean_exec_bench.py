"""The example ``img_mean``'s execution as the worker runs it (batch assembly, device put,
execution, outputs on the host): the model's three formulations in one process.

    python -m benchmarks.img_mean_exec_bench [--rounds 7] [--batches 1/1,8/8,32/32,32/24]

``int32``: one int32 reduction over each image (the first example). ``reduce``: uint16 partial
sums of 256 pixels by a reduce over the rows, then int32 (the example before the tree).
``tree``: examples/export_examples.py's ``img_mean`` (the rows added pairwise in uint16, then
int32). All three go through :func:`xlaserve.worker.executor.assemble` (one copy into 64-byte-
aligned memory the client wraps in place) and give bit-identical outputs (checked). Each request
is its own ``bytes`` object (as protobuf hands the codec ``raw_input_contents``), ``B/N`` is a
compiled batch of B filled with N requests (the rest zero-padded). Within a round they
alternate, so a busy shared machine slows them alike. Prints CPU time of the whole process
(XLA's threads included) and wall time per request: medians over the rounds and the range of
the CPU time.
"""
from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np

from examples import reference
from examples.export_examples import img_mean
from xlaserve.runtime.pjrt import Device
from xlaserve.worker.executor import assemble


def img_mean_int32(x):
    """The first example: one int32 reduction over each image."""
    b = x.shape[0]
    total = jnp.sum(x.reshape(b, -1).astype(jnp.int32), axis=1)
    return ((total.astype(jnp.float32) / jnp.float32(x[0].size)).reshape(b, 1),)


def img_mean_reduce(x):
    """The example before the tree: uint16 partial sums of 256 pixels by a reduce over the rows."""
    b = x.shape[0]
    rows = x.reshape(b, 256, x[0].size // 256).astype(jnp.uint16)
    total = jnp.sum(jnp.sum(rows, axis=1).astype(jnp.int32), axis=1)
    return ((total.astype(jnp.float32) / jnp.float32(x[0].size)).reshape(b, 1),)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--batches", default="1/1,8/8,32/32,32/24", help="compiled size/requests, comma-separated")
    args = p.parse_args()
    device = Device("cpu")
    decl = SimpleNamespace(name="input", batch_axis=0, dtype=SimpleNamespace(numpy=np.dtype(np.uint8)))
    model = SimpleNamespace(manifest=SimpleNamespace(executable_inputs=[decl]))
    rng = np.random.default_rng(0)
    names = ("int32", "reduce", "tree")
    print("| batch / requests | " + " | ".join(f"{n} CPU µs/req" for n in names) + " | tree/reduce "
          "| reduce wall µs/req | tree wall µs/req |")
    print("|---" * (len(names) + 4) + "|")
    for item in args.batches.split(","):
        size, n = (int(v) for v in item.split("/"))
        pixels = int(np.prod(reference.IMG_SHAPE))
        requests = [{"input": np.frombuffer(rng.integers(0, 256, pixels, dtype=np.uint8).tobytes(), np.uint8)
                     .reshape(1, *reference.IMG_SHAPE)} for _ in range(n)]

        def compiled(fn):
            spec = jax.ShapeDtypeStruct((size, *reference.IMG_SHAPE), jnp.uint8)
            return device.compile(jax.jit(fn).lower(spec).as_text(dialect="stablehlo").encode())

        def run_on(executable):
            return device.execute(executable, assemble(model, requests, size))
        sides = {name: partial(run_on, compiled(fn)) for name, fn in
                 zip(names, (img_mean_int32, img_mean_reduce, img_mean))}
        if not all(np.array_equal(sides["int32"]()[0], run()[0]) for run in sides.values()):
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
        cells = " | ".join("{:.1f} ({:.1f}-{:.1f})".format(*cpu(name)) for name in names)
        print(f"| {size} / {n} | {cells} | {cpu('tree')[0] / cpu('reduce')[0]:.2f} "
              f"| {wall('reduce'):.1f} | {wall('tree'):.1f} |", flush=True)


if __name__ == "__main__":
    main()
