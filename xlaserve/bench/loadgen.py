"""``xlaserve bench``: a closed-loop load generator for any KServe V2 gRPC server (Triton too).

    xlaserve bench --url 127.0.0.1:8001 -m mlp -c 1,8,32 -d 10
    xlaserve bench --url HOST:PORT -m a -m b -m c --mix zipf --zipf-s 1.1 -c 64 --timeout-ms 50

Each of C clients sends one request, waits for its answer and sends the next (like
``perf_analyzer --concurrency-range``). With several models, each request picks its model from
the traffic mix: ``uniform``, or ``zipf`` (the k-th model listed is chosen with probability
proportional to 1/k^s). Inputs are random tensors of ``--batch`` rows (default 1), shaped from
the model's metadata: the first variable dimension (-1) of an input is its batch axis, any other
is 1. ``-i [MODEL/]NAME:DTYPE:DIMS`` (``input:FP32:1x512``) gives them explicitly for servers
whose metadata is vague. ``--timeout-ms`` attaches a deadline to every request, both as Triton's
``timeout`` parameter and as the gRPC deadline.

Rows per request are the size of the batch axis of the first input that has one, where the
model's metadata places it (with ``-i``, the first dimension unless the metadata says otherwise);
a model none of whose inputs has a batch axis takes one row per request.

Before measuring, one request per model checks the inputs. Any error from the server there (an
unknown model, a wrong shape, a server that is not up) ends the run with one line on stderr,
``xlaserve bench: STATUS: message``, and exit status 2, as do inputs the load generator cannot
make. Errors during the levels are counted, not fatal.

After ``--warmup`` seconds, answers that arrive inside the ``--duration`` window are counted.
Progress goes to stderr while a level runs; at the end a table (stderr) and one JSON line per
level and model (stdout, with ``"model": "*"`` for the total) report throughput (requests/s and
rows/s), latency p50/p90/p99/max in ms and errors by gRPC status.

The Triton client (``tritonclient[grpc]``) is an extra: ``pip install 'xlaserve[bench]'``. It
finds the inputs and checks them, and by default sends the measured requests too. ``--client
native`` sends those with xlaserve's own HTTP/2 client instead (:mod:`xlaserve.bench.native`): the
same requests for about a third of the CPU, which matters where the load generator shares the
cores with the servers it measures.

The module is also a library: :func:`run_level` drives any list of :class:`ClientPlan` (the
fairness benchmark pins clients to models that way).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from collections.abc import Callable, Sequence

import numpy as np

# ClientPlan, InputSpec and LevelResult are this module's API too (the benchmarks use them from here)
from xlaserve.bench.level import _NUMPY, ClientPlan, InputSpec, LevelResult, Window, random_tensor, rows_per_request

__all__ = ["BenchError", "ClientPlan", "InputSpec", "LevelResult", "add_arguments", "check_inputs", "format_table",
           "main", "measure", "parse_input", "run_level"]


class BenchError(Exception):
    """A run that cannot go on; ``main`` prints it as ``xlaserve bench: <message>`` and exits 2."""


def parse_input(text: str) -> tuple[str | None, InputSpec]:
    """``[MODEL/]NAME:DTYPE:DIMS`` (DIMS like ``1x512``) -> (model or None, spec). The first
    dimension is taken as the batch axis until the model's metadata says otherwise."""
    model, _, rest = text.rpartition("/")
    try:
        name, datatype, dims = rest.split(":")
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError:
        raise BenchError(f"--input {text!r}: expected [MODEL/]NAME:DTYPE:DIMS such as input:FP32:1x512") from None
    if datatype.upper() not in _NUMPY:
        raise BenchError(f"--input {text!r}: datatype {datatype!r} is not one of {', '.join(_NUMPY)}")
    return model or None, InputSpec(name, datatype.upper(), shape)


def status_name(exc: Exception) -> str:
    """The gRPC status name of a tritonclient ``InferenceServerException`` (``NOT_FOUND``)."""
    return (exc.status() or "UNKNOWN").replace("StatusCode.", "")


def server_error(exc: Exception) -> str:
    """``STATUS: message`` of a tritonclient ``InferenceServerException``, on one line."""
    message = " ".join(str(exc.message() or "").splitlines())
    return f"{status_name(exc)}: {message}" if message else status_name(exc)


def model_mix(models: Sequence[str], mix: str, s: float, seed: int) -> Callable[[], str]:
    """A chooser of the next request's model: uniform, or Zipf with exponent ``s``."""
    rng = random.Random(seed)
    if len(models) == 1:
        only = models[0]
        return lambda: only
    if mix == "uniform":
        return lambda: rng.choice(models)
    weights = [1.0 / (k ** s) for k in range(1, len(models) + 1)]
    return lambda: rng.choices(models, weights)[0]


def _batch_axis(dims: Sequence[int]) -> int | None:
    """The batch axis of a metadata shape: its first variable (-1) dimension, or None."""
    return next((i for i, d in enumerate(dims) if d < 0), None)


async def discover_inputs(client, model: str, batch: int) -> list[InputSpec]:
    """The model's inputs from its metadata: the batch axis (the first -1) set to ``batch``,
    any other -1 to 1. A tensor without a -1 has no batch axis and keeps its shape."""
    meta = await client.get_model_metadata(model)
    specs = []
    for t in meta.inputs:
        dims = [int(d) for d in t.shape]
        axis = _batch_axis(dims)
        shape = [(batch if i == axis else 1) if d < 0 else d for i, d in enumerate(dims)]
        if t.datatype not in _NUMPY:
            raise BenchError(f"model {model!r}: input {t.name!r} has datatype {t.datatype}, which the load "
                             f"generator cannot make up; pass -i {model}/{t.name}:DTYPE:DIMS")
        specs.append(InputSpec(t.name, t.datatype, tuple(shape), axis))
    if not specs:
        raise BenchError(f"model {model!r}: its metadata lists no inputs; pass them with -i")
    return specs


async def place_batch_axes(client, model: str, specs: Sequence[InputSpec]) -> list[InputSpec]:
    """Explicit ``-i`` inputs with their batch axes where the model's metadata puts them (a tensor
    of the same name and rank). Without usable metadata they keep the first dimension."""
    from tritonclient.utils import InferenceServerException
    try:
        meta = await client.get_model_metadata(model)
    except InferenceServerException:
        return list(specs)          # the check request reports a server that cannot answer
    declared = {t.name: [int(d) for d in t.shape] for t in meta.inputs}
    out = []
    for spec in specs:
        dims = declared.get(spec.name)
        if dims is not None and len(dims) == len(spec.shape):
            spec = InputSpec(spec.name, spec.datatype, spec.shape, _batch_axis(dims))
        out.append(spec)
    return out


def _prepare(aio, specs: Sequence[InputSpec], rng: np.random.Generator) -> list:
    tensors = []
    for spec in specs:
        t = aio.InferInput(spec.name, list(spec.shape), spec.datatype)
        t.set_data_from_numpy(random_tensor(spec, rng))
        tensors.append(t)
    return tensors


async def check_inputs(url: str, inputs: dict[str, list[InputSpec]]) -> None:
    """Send one request per model; the first error the server answers propagates (as tritonclient's
    ``InferenceServerException``)."""
    import tritonclient.grpc.aio as aio
    rng = np.random.default_rng(0)
    async with aio.InferenceServerClient(url) as c:
        for model, specs in inputs.items():
            await c.infer(model, _prepare(aio, specs, rng))


async def run_level(url: str, plans: Sequence[ClientPlan], inputs: dict[str, list[InputSpec]], *,
                    duration: float, warmup: float, timeout_ms: float | None = None,
                    progress: Callable[[float, int, int], None] | None = None,
                    think_ms: float = 0.0) -> LevelResult:
    """Run ``plans`` (one closed-loop client each) against ``url``; count the window after warm-up.
    ``think_ms``: each client pauses that long after an answer before its next request."""
    import tritonclient.grpc.aio as aio
    from tritonclient.utils import InferenceServerException

    rng = np.random.default_rng(0)
    prepared = {model: (_prepare(aio, specs, rng), rows_per_request(specs)) for model, specs in inputs.items()}
    kwargs = {}
    if timeout_ms is not None:
        kwargs = {"timeout": int(timeout_ms * 1000), "client_timeout": timeout_ms / 1000}
    loop = asyncio.get_running_loop()
    start = loop.time()
    window = Window(inputs, start, warmup, duration, think_ms)

    async def client(plan: ClientPlan, c) -> None:
        while True:
            model = plan.choose()
            tensors, rows = prepared[model]
            t0 = loop.time()
            status = None
            try:
                await c.infer(model, tensors, **kwargs)
            except InferenceServerException as exc:
                status = status_name(exc)
            pause = window.count(model, rows, t0, loop.time(), status)
            if pause is None:
                return
            if pause:
                await asyncio.sleep(pause)

    async def report() -> None:
        while progress is not None:
            await asyncio.sleep(1.0)
            progress(loop.time() - start, window.ok, window.failed)

    # one channel per 16 clients: one HTTP/2 connection serializes more than it should
    channels = [aio.InferenceServerClient(url) for _ in range((len(plans) + 15) // 16)]
    reporter = asyncio.ensure_future(report())
    try:
        await asyncio.gather(*[client(p, channels[i % len(channels)]) for i, p in enumerate(plans)])
    finally:
        reporter.cancel()
        for c in channels:
            await c.close()
    return window.result(len(plans), duration)


def measure(url: str, plans: Sequence[ClientPlan], inputs: dict[str, list[InputSpec]], *, client: str = "triton",
            **level) -> LevelResult:
    """One level, synchronously, on ``client``: ``"triton"`` (:func:`run_level`, the Triton gRPC
    aio client) or ``"native"`` (:func:`xlaserve.bench.native.run_level`, xlaserve's own HTTP/2
    client). ``level``: :func:`run_level`'s keyword arguments."""
    if client == "native":
        from xlaserve.bench import native
        return native.run_level(url, plans, inputs, **level)
    if client != "triton":
        raise BenchError(f"client {client!r}: expected triton or native")
    return asyncio.run(run_level(url, plans, inputs, **level))


def format_table(results: Sequence[LevelResult]) -> str:
    head = f"{'c':>4} {'model':<16} {'req/s':>10} {'rows/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} " \
           f"{'max ms':>8}  errors"
    lines = [head, "-" * len(head)]
    for result in results:
        for r in result.rows():
            errors = ", ".join(f"{k}={v}" for k, v in r["errors"].items()) or "-"
            cells = [f"{r[k]:>8.2f}" if r[k] is not None else f"{'-':>8}" for k in ("p50_ms", "p90_ms", "p99_ms",
                                                                                  "max_ms")]
            lines.append(f"{r['concurrency']:>4} {r['model'][:16]:<16} {r['throughput_rps']:>10.1f} "
                         f"{r['throughput_rows_s']:>10.1f} {' '.join(cells)}  {errors}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC address HOST:PORT (default 127.0.0.1:8001)")
    p.add_argument("-m", "--model", action="append", required=True,
                   help="model to load; repeat for a catalog (the order matters for --mix zipf)")
    p.add_argument("-i", "--input", action="append", default=[],
                   help="[MODEL/]NAME:DTYPE:DIMS, e.g. input:FP32:1x512 (default: from the model metadata)")
    p.add_argument("-b", "--batch", type=int, default=1, help="rows per request when shapes come from metadata")
    p.add_argument("-c", "--concurrency", default="1,8,32", help="comma-separated client counts (default 1,8,32)")
    p.add_argument("-d", "--duration", type=float, default=10.0, help="measured seconds per level (default 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each level (default 2)")
    p.add_argument("--mix", choices=["uniform", "zipf"], default="uniform", help="traffic mix over the models")
    p.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent s (default 1.0)")
    p.add_argument("--timeout-ms", type=float, help="deadline per request, in ms (default: none)")
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="each client pauses this long after an answer before its next request (default 0)")
    p.add_argument("--client", choices=["triton", "native"], default="triton",
                   help="what sends the measured requests: the Triton gRPC aio client (default), or xlaserve's "
                        "own HTTP/2 client, which costs about a third of its CPU a request (plain TCP only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def main(args: argparse.Namespace) -> int:
    """``xlaserve bench``: 0 after the last level; 2, after one line on stderr, when the Triton
    client is missing or the run cannot start (see the module's docstring)."""
    try:
        import tritonclient.grpc.aio  # noqa: F401 - only to say early and plainly that it is missing
        from tritonclient.utils import InferenceServerException
    except ImportError as exc:
        print(f"xlaserve bench: needs the Triton client ({exc}); install it with: pip install 'xlaserve[bench]'",
              file=sys.stderr)
        return 2
    try:
        return _run(args)
    except BenchError as exc:
        print(f"xlaserve bench: {exc}", file=sys.stderr)
    except InferenceServerException as exc:
        print(f"xlaserve bench: {server_error(exc)}", file=sys.stderr)
    return 2


def _run(args: argparse.Namespace) -> int:
    levels = [int(c) for c in str(args.concurrency).split(",") if c.strip()]
    explicit: dict[str | None, list[InputSpec]] = {}
    for text in args.input:
        model, spec = parse_input(text)
        explicit.setdefault(model, []).append(spec)

    async def resolve() -> dict[str, list[InputSpec]]:
        import tritonclient.grpc.aio as aio
        out = {}
        async with aio.InferenceServerClient(args.url) as c:
            for m in args.model:
                given = explicit.get(m) or explicit.get(None)
                out[m] = await place_batch_axes(c, m, given) if given else await discover_inputs(c, m, args.batch)
        return out

    def progress(label: str):
        tty = sys.stderr.isatty()

        def show(elapsed: float, ok: int, errors: int) -> None:
            if args.quiet:
                return
            phase = "warm-up" if elapsed < args.warmup else f"{elapsed - args.warmup:5.1f}/{args.duration:.0f} s"
            line = f"  {label}: {phase}  {ok} ok  {errors} errors"
            if tty:
                print("\r" + line.ljust(70), end="", file=sys.stderr, flush=True)
            elif int(elapsed) % 5 == 0:
                print(line, file=sys.stderr, flush=True)
        return show

    inputs = asyncio.run(resolve())
    asyncio.run(check_inputs(args.url, inputs))
    results = []
    for conc in levels:
        plans = [ClientPlan(model_mix(args.model, args.mix, args.zipf_s, args.seed + i)) for i in range(conc)]
        result = measure(args.url, plans, inputs, client=args.client, duration=args.duration, warmup=args.warmup,
                         timeout_ms=args.timeout_ms, progress=progress(f"c={conc}"), think_ms=args.think_ms)
        if not args.quiet and sys.stderr.isatty():
            print(file=sys.stderr)
        results.append(result)
        for row in result.rows():
            print(json.dumps(row), flush=True)
    print(format_table(results), file=sys.stderr)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m xlaserve.bench.loadgen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
