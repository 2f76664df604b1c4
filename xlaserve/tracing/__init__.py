"""OpenTelemetry traces of each request's stages, opt-in (the node file's ``tracing:`` block).

Off, nothing here runs: whoever would trace holds ``None`` instead of a :class:`Tracing`, so a
request pays an ``is None`` check or two and OpenTelemetry is never imported.

On, the request path records plain numbers only, into one flat :class:`RequestTrace` per
request: ``time.perf_counter_ns()`` readings taken where each stage happened (the frontend, the
hook threads, the scheduler's dispatch loop) as its fields, with a tuple only for the spans few
requests have (hooks, a meta model's ``run``) and a child record per meta sub-call. The worker
coalesces requests into one execution, so the dispatch records an :class:`Execution` (times and
attributes) once per batch and each traced request of the batch references it. No span ids,
span objects or locks per stage: ids are made at export, except the one a ``traceparent``
passes on. A finished trace is queued (bounded: past ``max_queued_spans`` it is dropped and
counted); the export thread (:mod:`xlaserve.tracing.export`, the one module that imports the
OpenTelemetry SDK) turns each record into its spans, each traced request getting its own
``xlaserve.queue``, ``xlaserve.weights`` and ``xlaserve.execute`` spans with the shared batch's
attributes and its ``xlaserve.batch.id`` (docs/tracing.md).

W3C trace context: :func:`parse_traceparent` reads a ``traceparent`` from any mapping of
lower-case header names (gRPC metadata, HTTP headers); a malformed one is ignored, never an
error. Sampling is OpenTelemetry's ``ParentBased(TraceIdRatioBased(ratio))``
(:func:`sampled`), so every process of a trace decides alike.
"""
from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("xlaserve.tracing")

__all__ = ["RequestTrace", "TraceParent", "Tracing", "open_tracing", "parse_traceparent", "sampled"]

MAX_ATTRIBUTE = 256
"""Characters kept of a span attribute the client chose (a request id, a model name): a trace
costs bounded bytes whatever the client sends."""
MAX_ERROR = 1024
"""Characters kept of a failed span's status message."""
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
EXTRA = "otel"
"""The install extra that brings the OpenTelemetry SDK and its OTLP exporter."""

# version-trace_id-parent_id-flags, lower-case hex (W3C Trace Context, level 1 and 2)
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\Z", re.DOTALL)
_TRACE_ID_LIMIT = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class TraceParent:
    """The caller's span, as a W3C ``traceparent`` names it."""

    trace_id: int
    span_id: int
    sampled: bool

    def header(self) -> str:
        """This span as a ``traceparent`` value (version 00)."""
        return format_traceparent(self.trace_id, self.span_id, self.sampled)


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def parse_traceparent(headers: Mapping[str, Any]) -> TraceParent | None:
    """The ``traceparent`` of ``headers`` (header name -> value; names in lower case, as HTTP/2,
    gRPC metadata and HTTP/1.1 headers give them; a value may be ``str`` or ``bytes``), or None when there is
    none or it is malformed: a trace context is advice, and a bad one starts a new trace rather
    than failing the request. Follows W3C Trace Context: version ``ff`` and all-zero ids are
    invalid; version ``00`` has exactly four fields; a later version may carry more after a
    ``-``, which is ignored."""
    value = headers.get(TRACEPARENT)
    return None if value is None else _parse_traceparent(value)


def _parse_traceparent(value: Any) -> TraceParent | None:
    """:func:`parse_traceparent` of a header's value."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(value, str) or len(value) > 512:
        return None
    match = _TRACEPARENT.match(value.strip(" \t"))
    if match is None:
        return None
    version, trace_hex, span_hex, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    trace_id, span_id = int(trace_hex, 16), int(span_hex, 16)
    if not trace_id or not span_id:
        return None
    return TraceParent(trace_id, span_id, bool(int(flags, 16) & 1))


def sampled(trace_id: int, parent: TraceParent | None, ratio: float) -> bool:
    """Whether a request is traced: as its caller decided when it names one (``parent``), else
    when the low 64 bits of its trace id fall below ``ratio`` of their range (OpenTelemetry's
    ``ParentBased(TraceIdRatioBased(ratio))``)."""
    if parent is not None:
        return parent.sampled
    return (trace_id & _TRACE_ID_LIMIT) < round(ratio * (_TRACE_ID_LIMIT + 1))


def _new_id(bits: int) -> int:
    return random.getrandbits(bits) or 1      # W3C: an all-zero id is invalid


#: a span's kind, as the export maps it to OpenTelemetry's SpanKind
INTERNAL, SERVER, CLIENT = 0, 1, 2
_FIRST_SPAN = threading.Lock()


class Execution:
    """One dispatch of the scheduler as the traces of its requests see it: the weight load from
    ``started_ns`` to ``weights_ns`` (0: it failed, at ``done_ns``), the execution from there to
    ``done_ns``, ``error`` when the batch failed, and the attributes of the ``xlaserve.queue``,
    ``xlaserve.weights`` and ``xlaserve.execute`` spans. Recorded once per batch and shared by
    the traces of the requests coalesced into it (each gets its own three spans at export);
    read-only once made."""

    __slots__ = ("started_ns", "weights_ns", "done_ns", "error", "queue_attributes", "weights_attributes",
                 "execute_attributes")

    def __init__(self, started_ns: int, weights_ns: int, done_ns: int, error: str | None, queue_attributes: dict,
                 weights_attributes: dict, execute_attributes: dict) -> None:
        self.started_ns = started_ns
        self.weights_ns = weights_ns
        self.done_ns = done_ns
        self.error = error
        self.queue_attributes = queue_attributes
        self.weights_attributes = weights_attributes
        self.execute_attributes = execute_attributes


class RequestTrace:
    """One request's spans while it runs (or one stage with children of its own, such as a meta
    model's sub-call: :meth:`child`), as one flat record: the span's own fields, the stages every
    request has as plain numbers (:meth:`admitted`; ``enqueued_ns``, set when its executable
    inputs are handed to the scheduler; ``execution``, the shared :class:`Execution` of its
    batch), and ``spans``, the others: ``(name, start, end, attributes, error)`` tuples
    (:meth:`record`) and finished children. Span ids are made at export, except the one
    :meth:`traceparent` passes on. Any thread may record; the root queues the whole trace for
    export when it finishes."""

    # What most requests leave as it starts is the class's: __init__ sets only what it is given.
    #: 0 until :meth:`traceparent` or the export needs it
    span_id = 0
    end_ns = 0
    error: str | None = None
    #: the admission span: from ``start_ns`` to ``admitted_ns`` (0: none), with ``rows``
    admitted_ns = 0
    rows = 0
    #: the queue span's start; the rest of it, and the weights and execute spans: ``execution``
    enqueued_ns = 0
    execution: Execution | None = None
    #: None until a span is recorded (most requests have none: one object less to collect)
    spans: list | None = None

    def __init__(self, tracing: "Tracing", trace_id: int, parent_id: int, name: str, kind: int, start_ns: int,
                 attributes: dict | None, parent: "RequestTrace | None" = None) -> None:
        self._tracing = tracing
        self._parent = parent
        self.trace_id = trace_id
        #: the caller's span (a root's parent is remote: a ``traceparent``); 0: none, or a child
        self.parent_id = parent_id
        self.name = name
        self.kind = kind
        self.start_ns = start_ns
        #: this span's own attributes; the request path may add to them until it finishes
        self.attributes = attributes if attributes is not None else {}

    def traceparent(self) -> str:
        """This span as the ``traceparent`` a callee continues the trace from."""
        if not self.span_id:
            self.span_id = _new_id(64)
        return format_traceparent(self.trace_id, self.span_id, True)

    def admitted(self, rows: int) -> None:
        """The admission span ends now: the request, of ``rows`` rows, is handed to the worker."""
        self.admitted_ns = time.perf_counter_ns()
        self.rows = rows

    def record(self, name: str, start_ns: int, end_ns: int, attributes: dict | None = None,
               error: str | None = None) -> None:
        """A finished child span of this one."""
        self._add((name, start_ns, end_ns, attributes, error))

    def _add(self, span) -> None:
        spans = self.spans
        if spans is None:
            with _FIRST_SPAN:       # a meta model's sub-calls may finish at once, in their threads
                if self.spans is None:
                    self.spans = []
                spans = self.spans
        spans.append(span)

    def child(self, name: str, attributes: dict | None = None) -> "RequestTrace":
        """A child span starting now, whose own children :meth:`record` adds; ``finish`` it."""
        return RequestTrace(self._tracing, self.trace_id, 0, name, INTERNAL, time.perf_counter_ns(), attributes, self)

    def span_count(self) -> int:
        """How many spans this one and its children are."""
        n = 2 if self.admitted_ns else 1
        execution = self.execution
        if execution is not None:
            n += 3 if execution.weights_ns else 2       # queue, weights (and execute, when they were loaded)
        if self.spans is not None:
            for span in self.spans:
                n += 1 if span.__class__ is tuple else span.span_count()
        return n

    def finish(self, error: str | None = None, attributes: dict | None = None) -> None:
        """End this span now (``error``: it failed, and why; ``attributes``: more of its own); a
        root queues its trace, a child joins its parent's spans."""
        self.end_ns = time.perf_counter_ns()
        self.error = error
        if attributes:
            self.attributes.update(attributes)
        if self._parent is None:
            self._tracing._queue(self)
        else:
            self._parent._add(self)


class Tracing:
    """The tracing of one process: sampling, ids, and the bounded queue of finished traces that
    ``exporter`` (a :class:`~xlaserve.tracing.export.SpanExport`, or any object with
    ``wake(queued_spans)``, ``flush()`` and ``close()``) drains; it is woken when half of
    ``max_queued_spans`` wait."""

    def __init__(self, ratio: float, exporter, max_queued_spans: int = 2048) -> None:
        self.ratio = ratio
        self._threshold = round(ratio * (_TRACE_ID_LIMIT + 1))      # sampled(): without a parent
        self._exporter = exporter
        self._max_spans = max_queued_spans
        self._wake_at = max(1, max_queued_spans // 2)
        self._lock = threading.Lock()
        self._queued: list[RequestTrace] = []
        self._queued_spans = 0
        self.dropped_spans = 0

    def start(self, name: str, headers: Mapping[str, Any] | None, start_ns: int, attributes: dict | None = None,
              kind: int = SERVER) -> RequestTrace | None:
        """A request's trace, continuing the ``traceparent`` of ``headers`` when it has a valid
        one; None when sampling leaves the request untraced."""
        value = headers.get(TRACEPARENT) if headers else None       # most requests have none
        parent = None if value is None else _parse_traceparent(value)
        if parent is None:
            trace_id = random.getrandbits(128) or 1
            if trace_id & _TRACE_ID_LIMIT >= self._threshold:      # sampled(trace_id, None, ratio)
                return None
            return RequestTrace(self, trace_id, 0, name, kind, start_ns, attributes)
        if not parent.sampled:
            return None
        return RequestTrace(self, parent.trace_id, parent.span_id, name, kind, start_ns, attributes)

    def unsampled_traceparent(self, headers: Mapping[str, Any] | None) -> str | None:
        """What a caller passes on for a request it does not trace: the incoming ``traceparent``
        unchanged (None: keep the one it has), else a new one that says "not sampled", so that
        the callee does not sample the request on its own."""
        if headers and parse_traceparent(headers) is not None:
            return None
        return format_traceparent(_new_id(128), _new_id(64), False)

    def _queue(self, trace: RequestTrace) -> None:
        if trace.spans is None:         # most requests: span_count() without its calls
            execution = trace.execution
            n = (2 if trace.admitted_ns else 1) + (0 if execution is None else 3 if execution.weights_ns else 2)
        else:
            n = trace.span_count()
        with self._lock:
            if self._queued_spans + n > self._max_spans:
                self.dropped_spans += n
                return
            self._queued.append(trace)
            self._queued_spans = queued = self._queued_spans + n
        if queued >= self._wake_at > queued - n:     # once, as the queue crosses the mark
            self._exporter.wake(queued)

    def take(self) -> list[RequestTrace]:
        """The finished traces queued so far (the exporter's side)."""
        with self._lock:
            taken, self._queued, self._queued_spans = self._queued, [], 0
        return taken

    def flush(self) -> None:
        """Export what is queued now, in the calling thread (blocking; the export thread goes on)."""
        self._exporter.flush()

    def close(self) -> None:
        """Export what is queued and stop the exporter (blocking; at shutdown)."""
        self._exporter.close()
        if self.dropped_spans:
            log.warning("tracing: %d spans were dropped because more than tracing.max_queued_spans (%d) waited "
                        "for export", self.dropped_spans, self._max_spans)


def open_tracing(config, process: str, *, span_exporter=None) -> Tracing | None:
    """The tracing of one process (``process``: the worker's name, or ``gateway``) as ``config``
    (a :class:`~xlaserve.config.TracingConfig`) asks, or None when it is off. ``span_exporter``:
    an OpenTelemetry SDK ``SpanExporter`` to use instead of the configured one (tests use the
    SDK's ``InMemorySpanExporter``).

    Tracing enabled without the OpenTelemetry SDK installed is logged as one error naming the
    extra, and the process serves untraced (None). A ``file`` exporter whose file cannot be
    opened raises OSError."""
    if not config.enabled:
        return None
    try:
        from xlaserve.tracing.export import SpanExport
    except ImportError as exc:
        log.error("tracing.enabled is true but the OpenTelemetry SDK is not installed (%s); serving without "
                  "traces. Install the extra: pip install 'xlaserve[%s]'", exc, EXTRA)
        return None
    try:
        export = SpanExport.from_config(config, process, span_exporter)
    except ImportError as exc:
        log.error("tracing.exporter is otlp but its OTLP exporter is not installed (%s); serving without "
                  "traces. Install the extra: pip install 'xlaserve[%s]'", exc, EXTRA)
        return None
    tracing = Tracing(config.sampling_ratio, export, config.max_queued_spans)
    export.start(tracing)
    log.info("tracing: sampling %g of requests without a sampled parent, exporting with %s", config.sampling_ratio,
             export.describe())
    return tracing
