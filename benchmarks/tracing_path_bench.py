"""The worker's own CPU per ModelInfer, in-process and without a client or sockets: the real
actors (device, weight cache, scheduler, inference service) serving the reference ``mlp``, and
the KServe service's request path called directly with decoded ``ModelInferRequest`` messages,
32 at a time (one coalesced batch), until ``--requests`` are answered. What it measures is
``time.process_time()`` per request, the CPU of every thread of the process (the export thread's
included), which another tenant's load disturbs far less than a throughput measured through
sockets (benchmarks/tracing_bench.py).

    python -m benchmarks.tracing_path_bench [--variants off,memory,file] [--rounds 3]
        [--requests 9600] [--repeats 3] [--ratio 1.0]

The variants (each a fresh set of actors, in one process):

- ``off``: no ``tracing:`` block (tracing off, the default);
- ``memory``: ``tracing.enabled``, every request traced (``--ratio``), its spans built as
  OpenTelemetry SDK ``ReadableSpan`` objects by the export thread and handed to the SDK's
  ``InMemorySpanExporter`` (emptied before each repeat): an in-process exporter;
- ``null``: as ``memory``, into an exporter that counts the spans it receives and keeps none;
- ``file``: as ``memory``, with ``exporter: file`` writing JSON lines to a temporary file.

Each round runs every variant once, the order reversed every other round (the machine is
shared and its load drifts). A variant's number in a round is the best of its ``--repeats``
(after one warm-up repeat: another tenant's load only adds to the CPU time a repeat takes); the
ratio ``off / variant`` of the same round is the throughput a CPU-bound worker keeps. Prints each
round, then per variant the median and range over rounds.

Also runs from a checkout without the variants (cwd first on ``sys.path``): ``--variants off``
works against the commit before tracing.
"""
from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import trio

from benchmarks._servers import export_mlp_as
from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.config import parse_node_config, resolve_worker
from xlaserve.frontend.bridge import Bridge
from xlaserve.frontend.kserve import KServeService
from xlaserve.worker.compose import run_actors, worker_port

BATCH = 32
MAX_QUEUED_SPANS = 8192
"""tracing.max_queued_spans of the traced variants: above the default (2048), so that an export
thread held up by other tenants' load drops nothing (a dropped span is CPU not spent, a number
that flatters tracing); a run that drops some says so."""


class _Stream:
    """What the request path reads of a call: its metadata, deadline and peer."""

    def __init__(self, metadata: dict) -> None:
        self.metadata = metadata
        self.deadline = None
        self.peer = None


def _request(i: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="mlp", id=str(i))
    request.inputs.add(name="input", datatype="FP32", shape=[1, 512])
    request.raw_input_contents.append(bytes(2048))
    return request


class _CountingExporter:
    """An in-process exporter that receives every SDK span and keeps none (``null``)."""

    def __init__(self) -> None:
        self.spans = 0

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def clear(self) -> None:
        pass


def _exporter(variant: str):
    if variant == "memory":
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        return InMemorySpanExporter()
    if variant == "null":
        return _CountingExporter()
    return None


async def measure(repo: Path, requests: int, repeats: int, tracing: dict | None,
                  span_exporter=None) -> list[float]:
    node = {"model_repo": str(repo), "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"},
            "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "static", "cache_dir": None}}
    if tracing is not None:
        node["tracing"] = tracing
    config = resolve_worker(parse_node_config(node, repo))
    timings = []
    async with trio.open_nursery() as nursery:
        options = {} if span_exporter is None else {"span_exporter": span_exporter}
        actors = await nursery.start(functools.partial(run_actors, config, **options))
        await actors.table.startup_done.wait()
        port = worker_port(actors, Bridge(trio.lowlevel.current_trio_token()), draining=trio.Event(),
                           shared_memory=None)
        extra = (actors.tracing,) if hasattr(actors, "tracing") else ()       # the checkout before tracing
        service = KServeService(port, config.endpoints, *extra)
        stream = _Stream({"te": "trailers", "content-type": "application/grpc"})
        messages = [_request(i) for i in range(BATCH)]
        for repeat in range(repeats + 1):           # the first is warm-up
            if span_exporter is not None:
                span_exporter.clear()
            started = time.process_time()
            answered = 0
            while answered < requests:
                done = trio.Event()
                left = [BATCH]

                def finish(outcome, done=done, left=left) -> None:
                    if not isinstance(outcome, pb.ModelInferResponse):
                        raise RuntimeError(f"a request failed: {outcome}")
                    left[0] -= 1
                    if not left[0]:
                        done.set()
                for message in messages:
                    service._start_infer(message, stream, finish)
                await done.wait()
                answered += BATCH
            if repeat:
                timings.append((time.process_time() - started) / answered * 1e6)
        nursery.cancel_scope.cancel()
    dropped = getattr(getattr(actors, "tracing", None), "dropped_spans", 0)
    if dropped:     # spans not exported are CPU not spent: such a run's numbers flatter tracing
        print(f"warning: {dropped} spans were dropped (tracing.max_queued_spans)")
    return timings


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="off,memory,file", help="which of off, memory, null, file to run")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=9_600)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ratio", type=float, default=1.0, help="tracing.sampling_ratio of the traced variants")
    args = p.parse_args()
    variants = args.variants.split(",")
    unknown = set(variants) - {"off", "memory", "null", "file"}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; expected off, memory, null or file")
    results: dict[str, list[float]] = {v: [] for v in variants}
    ratios: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        spans = Path(tmp) / "spans.jsonl"
        for round_ in range(args.rounds):
            order = variants if round_ % 2 == 0 else variants[::-1]
            this_round = {}
            for variant in order:
                tracing = None
                if variant != "off":
                    tracing = {"enabled": True, "sampling_ratio": args.ratio, "exporter": "file", "file": str(spans),
                               "max_queued_spans": MAX_QUEUED_SPANS}
                    spans.write_bytes(b"")
                timings = trio.run(measure, repo, args.requests, args.repeats, tracing, _exporter(variant))
                this_round[variant] = min(timings)
                print(f"round {round_} {variant:6s} cpu us/request: " + " ".join(f"{t:.1f}" for t in timings),
                      flush=True)
            for variant in variants:
                results[variant].append(this_round[variant])
                if "off" in this_round:
                    ratios[variant].append(this_round["off"] / this_round[variant])
    print(f"{'variant':8s} {'cpu us/request: median (range)':34s} {'off/variant: median (range)':28s}")
    for variant in variants:
        us, r = results[variant], ratios[variant]
        ratio = f"{statistics.median(r):.3f} ({min(r):.3f}..{max(r):.3f})" if r else "-"
        print(f"{variant:8s} {statistics.median(us):6.1f} ({min(us):.1f}..{max(us):.1f}){'':14s} {ratio}")


if __name__ == "__main__":
    main()
