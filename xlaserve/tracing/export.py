"""The export thread: finished traces become OpenTelemetry SDK spans and go to the exporter.

The one module that imports the OpenTelemetry SDK (the install extra ``otel``); imported only
when tracing is enabled. The request path never waits on it: every
``tracing.export_interval_seconds`` (sooner when half of ``tracing.max_queued_spans`` wait) the
thread takes what is queued, builds ``ReadableSpan`` objects from the records (timestamps moved
from ``perf_counter_ns`` to the epoch) and calls the exporter's ``export``; the ``file``
exporter writes its JSON lines straight from the records instead. An exporter that fails or
raises loses that batch, with one log line a minute.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

log = logging.getLogger("xlaserve.tracing")

_KINDS = (SpanKind.INTERNAL, SpanKind.SERVER, SpanKind.CLIENT)
_KIND_NAMES = tuple(kind.name for kind in _KINDS)
_compact = json.JSONEncoder(separators=(",", ":")).encode
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)
_SCOPE = InstrumentationScope("xlaserve")


class JsonLinesWriter:
    """Appends each span to ``path`` as one JSON object a line: ``name``, ``trace_id``,
    ``span_id``, ``parent_span_id`` (hex; null for a span without a parent), ``kind``,
    ``start_time_ns``, ``end_time_ns`` (Unix epoch), ``attributes``, ``status`` (``OK`` or
    ``ERROR``), ``status_message`` and ``resource``. Written straight from the records (no SDK
    span objects: this is the exporter the cost of tracing was measured with). One ``write`` a
    batch on a file opened for appending, so the processes of a node may share one file."""

    def __init__(self, path: Path, resource: Resource) -> None:
        self._path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._resource = json.dumps(dict(resource.attributes), separators=(",", ":"))

    def write(self, traces, epoch: int) -> bool:
        dumps = _compact
        resource = self._resource
        # a coalesced batch's spans share their attribute mappings: each is encoded once
        encoded: dict[int, str] = {}
        lines = []
        for trace in traces:
            trace_id = f"{trace.trace_id:032x}"
            for name, span_id, parent_id, start, end, attributes, error, kind in trace.spans:
                parent = f'"{parent_id:016x}"' if parent_id else "null"
                status = '"OK","status_message":null' if error is None else f'"ERROR","status_message":{dumps(error)}'
                attrs = encoded.get(id(attributes))
                if attrs is None:
                    attrs = encoded[id(attributes)] = dumps(attributes or {})
                lines.append(f'{{"name":{dumps(name)},"trace_id":"{trace_id}","span_id":"{span_id:016x}",'
                             f'"parent_span_id":{parent},"kind":"{_KIND_NAMES[kind]}","start_time_ns":{start + epoch},'
                             f'"end_time_ns":{end + epoch},"attributes":{attrs},'
                             f'"status":{status},"resource":{resource}}}\n')
        data = "".join(lines).encode()
        try:
            while data:
                data = data[os.write(self._fd, data):]
        except OSError as exc:
            log.error("tracing: writing spans to %s failed: %s", self._path, exc.strerror or exc)
            return False
        return True

    def shutdown(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class SpanExport:
    """The export thread of one process's :class:`~xlaserve.tracing.Tracing`."""

    def __init__(self, exporter: SpanExporter | JsonLinesWriter, resource: Resource, interval: float,
                 description: str, max_queued_spans: int) -> None:
        self._exporter = exporter
        self._resource = resource
        self._interval = interval
        self._description = description
        self._wake_at = max(1, max_queued_spans // 2)
        self._wake = threading.Event()
        self._stop = False
        self._tracing = None
        self._thread: threading.Thread | None = None
        # perf_counter_ns -> Unix epoch ns, taken once: a request's stages keep their order
        self._epoch = time.time_ns() - time.perf_counter_ns()
        self._failed_at = -float("inf")

    @classmethod
    def from_config(cls, config, process: str, span_exporter: SpanExporter | None = None) -> "SpanExport":
        """The export ``config`` (a TracingConfig) asks for; ImportError when the OTLP exporter
        is missing, OSError when the ``file`` cannot be opened."""
        resource = Resource.create({"service.name": config.service_name, "service.instance.id": process})
        if span_exporter is not None:
            exporter, description = span_exporter, type(span_exporter).__name__
        elif config.exporter == "file":
            exporter, description = JsonLinesWriter(config.file, resource), f"file {config.file}"
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, timeout=config.otlp_timeout_seconds)
            description = f"otlp {config.otlp_endpoint}"
        return cls(exporter, resource, config.export_interval_seconds, description, config.max_queued_spans)

    def describe(self) -> str:
        return self._description

    def start(self, tracing, *, thread: bool = True) -> None:
        """Export what ``tracing`` queues; ``thread=False``: only when :meth:`flush` is called."""
        self._tracing = tracing
        if thread:
            self._thread = threading.Thread(target=self._run, name="xlaserve-trace-export", daemon=True)
            self._thread.start()

    def wake(self, queued_spans: int) -> None:
        if queued_spans >= self._wake_at:
            self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._interval)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Export every queued trace now (the export thread, or close)."""
        traces = self._tracing.take()
        if not traces:
            return
        try:
            if isinstance(self._exporter, JsonLinesWriter):
                result = SpanExportResult.SUCCESS if self._exporter.write(traces, self._epoch) else "write failed"
            else:
                result = self._exporter.export([span for trace in traces for span in self._spans(trace)])
        except Exception as exc:        # the exporter's fault loses this batch only
            result = exc
        if result is not SpanExportResult.SUCCESS and time.monotonic() - self._failed_at > 60:
            self._failed_at = time.monotonic()
            log.error("tracing: exporting the spans of %d requests with %s failed: %s", len(traces),
                      self._description, result)

    def _spans(self, trace) -> list[ReadableSpan]:
        epoch = self._epoch
        resource = self._resource
        trace_id = trace.trace_id
        out = []
        for name, span_id, parent_id, start, end, attributes, error, kind in trace.spans:
            context = SpanContext(trace_id, span_id, False, _SAMPLED)
            if parent_id:
                remote = parent_id == trace.parent_id and trace.remote_parent
                parent = SpanContext(trace_id, parent_id, remote, _SAMPLED)
            else:
                parent = None
            out.append(ReadableSpan(
                name=name, context=context, parent=parent, resource=resource, attributes=attributes,
                kind=_KINDS[kind], start_time=start + epoch, end_time=end + epoch,
                status=_OK if error is None else Status(StatusCode.ERROR, error), instrumentation_scope=_SCOPE))
        return out

    def close(self) -> None:
        """Stop the thread, export what is left and shut the exporter down."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10.0)
        self.flush()
        try:
            self._exporter.shutdown()
        except Exception:
            log.exception("tracing: shutting the exporter down failed")
