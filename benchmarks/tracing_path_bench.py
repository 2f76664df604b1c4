"""The worker's own CPU per ModelInfer, in-process and without a client or sockets: the real
actors (device, weight cache, scheduler, inference service) serving the reference ``mlp``, and
the KServe service's request path called directly with decoded ``ModelInferRequest`` messages,
32 at a time (one coalesced batch; ``--batch`` sets how many). What it measures is ``time.process_time()`` per request,
the CPU of every thread of the process (the export thread's included), which another tenant's
load disturbs far less than a throughput measured through sockets (benchmarks/tracing_bench.py).

    python -m benchmarks.tracing_path_bench [--variants off,memory,null,file,records] [--rounds 20]
        [--requests 2400] [--ratio 1.0] [--batch 32]

The variants, each its own set of actors, all started in this one process:

- ``off``: no ``tracing:`` block (tracing off, the default);
- ``memory``: ``tracing.enabled``, every request traced (``--ratio``), its spans built as
  OpenTelemetry SDK ``ReadableSpan`` objects and handed to the SDK's ``InMemorySpanExporter``
  (which keeps them: emptied after each window): an in-process exporter;
- ``null``: as ``memory``, into an exporter that counts the spans it receives and keeps none;
- ``file``: as ``memory``, with ``exporter: file`` writing JSON lines to a temporary file;
- ``records``: as ``memory``, but the export takes the finished records and drops them, building
  no spans: what tracing costs the request path alone (``off / records``); what building and
  exporting the spans adds is the rest (not in the default set).

The machine is shared and its load drifts, so the variants take turns in short windows: in each
round every variant serves ``--requests`` requests, the order reversed every other round (one
warm-up window each first). A traced window ends by exporting what its requests left queued, in
the window (the export thread's share is in it either way). The ratio ``off / variant`` of the
same round is the throughput a CPU-bound worker keeps; printed per round, then per variant the
median and range over rounds.

From the checkout before this benchmark's variants or before tracing (cwd first on
``sys.path``), ``--variants off`` (and the traced ones where tracing exists) still run.
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
from xlaserve.app.compose import run_actors, worker_port

BATCH = 32
MAX_QUEUED_SPANS = 16384
"""tracing.max_queued_spans of the traced variants: above the spans of a window (12,000 at the
default --requests), so that an export thread held up by other tenants' load drops nothing (a
dropped span is CPU not spent, a number that flatters tracing); a run that drops some says so."""


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
    if variant in ("null", "records"):
        return _CountingExporter()
    return None


class Variant:
    """One variant's worker: its actors (started in the caller's nursery), the KServe service
    over them, and its tracing (None: off) and in-process exporter (None: none, or ``file``)."""

    def __init__(self, name: str, service: KServeService, tracing, exporter, batch: int = BATCH) -> None:
        self.name = name
        self.service = service
        self.tracing = tracing
        self.exporter = exporter
        self.stream = _Stream({"te": "trailers", "content-type": "application/grpc"})
        self.messages = [_request(i) for i in range(batch)]
        self.batch = batch

    async def window(self, requests: int) -> float:
        """Serve ``requests`` (``batch`` at a time) and export their spans: CPU microseconds a request."""
        started = time.process_time()
        answered = 0
        while answered < requests:
            done = trio.Event()
            left = [self.batch]

            def finish(outcome, done=done, left=left) -> None:
                if not isinstance(outcome, pb.ModelInferResponse):
                    raise RuntimeError(f"a request failed: {outcome}")
                left[0] -= 1
                if not left[0]:
                    done.set()
            for message in self.messages:
                self.service._start_infer(message, self.stream, finish)
            await done.wait()
            answered += self.batch
        if self.tracing is not None:
            # what is still queued is exported inside the window that made it, by this thread
            flush = getattr(self.tracing, "flush", None) or self.tracing._exporter.flush    # or: before this API
            flush()
        cpu = time.process_time() - started
        if self.exporter is not None:
            self.exporter.clear()
        return cpu / answered * 1e6


async def start_variant(nursery: trio.Nursery, repo: Path, name: str, ratio: float, spans: Path,
                        batch: int = BATCH) -> Variant:
    node = {"model_repo": str(repo), "listen": {"grpc": "127.0.0.1:0", "http": "127.0.0.1:0"},
            "global": {"runtime": {"backend": "cpu"}, "model_control_mode": "static", "cache_dir": None}}
    if name != "off":
        node["tracing"] = {"enabled": True, "sampling_ratio": ratio, "exporter": "file", "file": str(spans),
                           "max_queued_spans": MAX_QUEUED_SPANS}
    config = resolve_worker(parse_node_config(node, repo))
    exporter = _exporter(name)
    options = {} if exporter is None else {"span_exporter": exporter}
    actors = await nursery.start(functools.partial(run_actors, config, **options))
    await actors.table.startup_done.wait()
    port = worker_port(actors, Bridge(trio.lowlevel.current_trio_token()), draining=trio.Event(), shared_memory=None)
    tracing = getattr(actors, "tracing", None)
    if name == "records":       # the export thread (and a window's flush) only takes and drops the records
        tracing._exporter.flush = tracing.take
    extra = (tracing,) if hasattr(actors, "tracing") else ()       # the checkout before tracing
    return Variant(name, KServeService(port, config.endpoints, *extra), tracing, exporter, batch)


async def measure(repo: Path, names: list[str], rounds: int, requests: int, ratio: float,
                  spans: Path, batch: int = BATCH) -> dict[str, list[float]]:
    """Each variant's CPU per request in each round (the first window of each is warm-up)."""
    results: dict[str, list[float]] = {name: [] for name in names}
    async with trio.open_nursery() as nursery:
        variants = [await start_variant(nursery, repo, name, ratio, spans, batch) for name in names]
        for variant in variants:
            await variant.window(requests)
        for round_ in range(rounds):
            order = variants if round_ % 2 == 0 else variants[::-1]
            for variant in order:
                results[variant.name].append(await variant.window(requests))
            print(f"round {round_:2d} " + "  ".join(f"{name} {results[name][-1]:6.1f}" for name in names), flush=True)
        for variant in variants:
            dropped = getattr(variant.tracing, "dropped_spans", 0)
            if dropped:     # spans not exported are CPU not spent: such numbers flatter tracing
                print(f"warning: {variant.name}: {dropped} spans were dropped (tracing.max_queued_spans)")
        nursery.cancel_scope.cancel()
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="off,memory,null,file",
                   help="which of off, memory, null, file, records to run")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--requests", type=int, default=2_400, help="requests a variant serves in a round")
    p.add_argument("--ratio", type=float, default=1.0, help="tracing.sampling_ratio of the traced variants")
    p.add_argument("--batch", type=int, default=BATCH,
                   help="requests handed over at once, without yielding (one burst; the largest compiled size is 32)")
    args = p.parse_args()
    if not 1 <= args.batch <= 32:
        p.error(f"--batch {args.batch}: expected 1 to 32")
    names = args.variants.split(",")
    unknown = set(names) - {"off", "memory", "null", "file", "records"}
    if unknown or len(set(names)) != len(names):
        p.error(f"variants {names}: expected each of off, memory, null, file or records at most once")
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        repo.mkdir()
        export_mlp_as(repo, "mlp", (1, 2, 4, 8, 16, 32))
        results = trio.run(measure, repo, names, args.rounds, args.requests // args.batch * args.batch, args.ratio,
                           Path(tmp) / "spans.jsonl", args.batch)
    print(f"{'variant':8s} {'cpu us/request: median (range)':32s} off/variant in the same round: median (range)")
    for name in names:
        us = results[name]
        line = f"{name:8s} {statistics.median(us):6.1f} ({min(us):.1f}..{max(us):.1f})"
        if "off" in results:
            ratios = [off / mine for off, mine in zip(results["off"], us)]
            line += f"{'':12s} {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})"
        print(line)


if __name__ == "__main__":
    main()
