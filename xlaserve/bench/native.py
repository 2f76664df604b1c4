"""``xlaserve bench --client native``: the closed loops on xlaserve's own HTTP/2 client.

The Triton gRPC aio client costs about 60 us of CPU a request (grpcio's asyncio layer, the
request built and the reply turned into numpy each time). On a machine where the load generator
shares the cores with the servers it measures, that cost is taken from them: on the project's
2-core machine it was the largest single consumer behind a gateway (docs/benchmarks.md, "The
load generator's own cost"). This client sends the same ``ModelInfer`` requests, serialized once
per model, over :class:`xlaserve.gateway.upstream.Upstream` (the gateway's connection to a worker:
the sans-IO HTTP/2 engine, every limit of it) and parses each reply as a ``ModelInferResponse``,
for about 25 us a request.

What it sends is what the Triton client sends: the inputs as ``raw_input_contents``, and with a
timeout both Triton's ``timeout`` parameter (microseconds) and the gRPC deadline. Plain TCP only
(``h2c``, as the Triton client without ``ssl``). Discovery and the inputs' check still go through
the Triton client (:func:`xlaserve.bench.loadgen.check_inputs`); this module runs the measured
levels only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np
import trio

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.bench.level import ClientPlan, InputSpec, LevelResult, Window, random_tensor, rows_per_request
from xlaserve.gateway.upstream import Upstream, UpstreamError, status_named

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
CLIENTS_PER_CONNECTION = 16      # as the Triton path's channels: one connection per 16 clients
CONNECT_SECONDS = 10.0
UNBOUNDED_STREAMS = 1 << 30      # the server's SETTINGS_MAX_CONCURRENT_STREAMS is the limit


def request_message(model: str, specs: Sequence[InputSpec], rng: np.random.Generator,
                    timeout_ms: float | None = None) -> bytes:
    """One serialized ``ModelInferRequest`` for ``model``: random inputs of ``specs`` as raw
    contents, and Triton's ``timeout`` parameter (us) when ``timeout_ms`` is given."""
    request = pb.ModelInferRequest(model_name=model)
    for spec in specs:
        request.inputs.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
        request.raw_input_contents.append(np.ascontiguousarray(random_tensor(spec, rng)).tobytes())
    if timeout_ms is not None:
        request.parameters["timeout"].int64_param = int(timeout_ms * 1000)
    return request.SerializeToString()


def outcome_status(outcome) -> str | None:
    """None for an answered request whose reply parses; else the gRPC status name of what went
    wrong (a reply that is not a ``ModelInferResponse`` is ``INTERNAL``)."""
    if isinstance(outcome, UpstreamError):
        return outcome.status.name
    if outcome.status != 0:
        return status_named(outcome.status).name
    messages = outcome.messages()
    if len(messages) != 1:
        return "INTERNAL"
    try:
        pb.ModelInferResponse.FromString(messages[0])
    except Exception:           # protobuf's DecodeError, whichever implementation raises it
        return "INTERNAL"
    return None


def run_level(url: str, plans: Sequence[ClientPlan], inputs: dict[str, list[InputSpec]], *,
              duration: float, warmup: float, timeout_ms: float | None = None,
              progress: Callable[[float, int, int], None] | None = None,
              think_ms: float = 0.0) -> LevelResult:
    """:func:`xlaserve.bench.loadgen.run_level` on this client, synchronously (its own Trio run)."""
    host, _, port = url.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--url {url!r}: expected HOST:PORT")
    rng = np.random.default_rng(0)
    prepared = {model: (request_message(model, specs, rng, timeout_ms), rows_per_request(specs))
                for model, specs in inputs.items()}
    timeout = timeout_ms / 1000 if timeout_ms is not None else None
    # the Upstream logs a lost connection as the gateway's; the end of a level is not one
    quiet = logging.getLogger("xlaserve.gateway")
    level_before = quiet.level
    quiet.setLevel(logging.ERROR)

    async def main() -> LevelResult:
        connections = [Upstream(f"bench-{i}", host.strip("[]"), int(port), max_streams=UNBOUNDED_STREAMS)
                       for i in range((len(plans) + CLIENTS_PER_CONNECTION - 1) // CLIENTS_PER_CONNECTION)]
        async with trio.open_nursery() as nursery:
            for up in connections:
                nursery.start_soon(up.run)
            with trio.move_on_after(CONNECT_SECONDS):
                for up in connections:
                    await up.connected.wait()
            start = trio.current_time()
            window = Window(inputs, start, warmup, duration, think_ms)

            async def client(plan: ClientPlan, up: Upstream) -> None:
                while True:
                    model = plan.choose()
                    message, rows = prepared[model]
                    t0 = trio.current_time()
                    status = outcome_status(await up.request(MODEL_INFER, message, timeout=timeout))
                    pause = window.count(model, rows, t0, trio.current_time(), status)
                    if pause is None:
                        return
                    if pause:
                        await trio.sleep(pause)

            async def report() -> None:
                while True:
                    await trio.sleep(1.0)
                    progress(trio.current_time() - start, window.ok, window.failed)

            if progress is not None:
                nursery.start_soon(report)
            async with trio.open_nursery() as clients:
                for i, plan in enumerate(plans):
                    clients.start_soon(client, plan, connections[i % len(connections)])
            nursery.cancel_scope.cancel()
        return window.result(len(plans), duration)

    try:
        return trio.run(main)
    finally:
        quiet.setLevel(level_before)
