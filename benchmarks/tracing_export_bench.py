"""What the export thread spends to turn finished request traces into OpenTelemetry SDK spans:
``SpanExport.spans`` of this checkout against the same of ``--baseline`` (another checkout's
``xlaserve/tracing/export.py``, loaded by path), on the same records, in alternating repeats.

    python -m benchmarks.tracing_export_bench --baseline CHECKOUT [--traces 2048] [--repeats 15]

The records are what a worker serving the reference ``mlp`` leaves: requests coalesced 32 to a
batch, each with its admission, queue, weights and execute stages and the frontend's root
attributes (five spans a request). The spans are built 64 traces a call, as the export thread
does, and let go (no exporter keeps them: what an in-process exporter adds is not in these
numbers). Prints microseconds of CPU (``time.thread_time``) a request for each, per repeat, and
the median and range of the paired ratio ``this / baseline``.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

from opentelemetry.sdk.resources import Resource

from xlaserve.tracing import Execution, Tracing
from xlaserve.tracing import export as this_export

BATCH = 32


class _Held:
    """An exporter stand-in for Tracing: the traces stay queued until taken."""

    def wake(self, queued_spans: int) -> None:
        pass


def records(n: int) -> list:
    """``n`` finished request traces, as a worker serving ``mlp`` leaves them."""
    tracing = Tracing(1.0, _Held(), 1 << 30)
    t0 = time.perf_counter_ns()
    for batch in range(n // BATCH):
        started = t0 + batch * 1000
        execution = Execution(started, started + 10, started + 400, None,
                              {"xlaserve.model": "mlp", "xlaserve.batch.id": batch},
                              {"xlaserve.weights.bytes": 1 << 20, "xlaserve.batch.id": batch,
                               "xlaserve.weights.hit": True, "xlaserve.weights.outcome": "hit"},
                              {"xlaserve.batch.id": batch, "xlaserve.batch.size": BATCH,
                               "xlaserve.batch.requests": BATCH, "xlaserve.batch.compiled_size": BATCH,
                               "xlaserve.compute.input_ns": 5, "xlaserve.compute.infer_ns": 50,
                               "xlaserve.compute.output_ns": 5})
        for i in range(BATCH):
            trace = tracing.start("xlaserve.infer", {"te": "trailers"}, started - 500,
                                  {"rpc.system": "grpc", "rpc.method": "ModelInfer", "xlaserve.model": "mlp",
                                   "xlaserve.request_id": str(batch * BATCH + i)})
            trace.admitted(1)
            trace.enqueued_ns = started - 100
            trace.execution = execution
            trace.attributes["xlaserve.model_version"] = 1
            trace.attributes["rpc.grpc.status_code"] = 0
            trace.finish()
    return tracing.take()


def load_export(checkout: Path):
    """``checkout``'s xlaserve/tracing/export.py as a module of its own."""
    spec = importlib.util.spec_from_file_location("baseline_export", checkout / "xlaserve/tracing/export.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def per_request_us(export, traces: list) -> float:
    started = time.thread_time()
    for at in range(0, len(traces), this_export.EXPORT_TRACES):
        export.spans(traces[at:at + this_export.EXPORT_TRACES])
    return (time.thread_time() - started) / len(traces) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", type=Path, required=True, help="a checkout whose export to compare with")
    p.add_argument("--traces", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    traces = records(args.traces)
    resource = Resource.create({"service.name": "bench", "service.instance.id": "w0"})
    exports = {"baseline": load_export(args.baseline).SpanExport(None, resource, 1.0, "bench", 1 << 20),
               "this": this_export.SpanExport(None, resource, 1.0, "bench", 1 << 20)}
    for export in exports.values():
        per_request_us(export, traces)      # warm-up
    results: dict[str, list[float]] = {name: [] for name in exports}
    for repeat in range(args.repeats):
        order = list(exports) if repeat % 2 == 0 else list(exports)[::-1]
        for name in order:
            results[name].append(per_request_us(exports[name], traces))
        print(f"repeat {repeat:2d} " + "  ".join(f"{name} {results[name][-1]:5.2f}" for name in exports), flush=True)
    ratios = [mine / base for base, mine in zip(results["baseline"], results["this"])]
    for name, us in results.items():
        print(f"{name:8s} us of CPU a request (5 spans): median {statistics.median(us):.2f}, "
              f"min {min(us):.2f}, max {max(us):.2f}")
    print(f"this / baseline: median {statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f})")


if __name__ == "__main__":
    main()
