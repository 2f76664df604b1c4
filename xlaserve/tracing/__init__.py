"""OpenTelemetry traces of each request's stages, opt-in (the node file's ``tracing:`` block).

Off, nothing here runs: whoever would trace holds ``None`` instead of a :class:`Tracing`, so a
request pays an ``is None`` check or two and OpenTelemetry is never imported.

On, the request path records plain numbers only: a :class:`RequestTrace` per request collects
``(name, span id, parent id, start, end, attributes, error)`` records, timed with
``time.perf_counter_ns()`` where the stage happened (the frontend, the hook threads, the
scheduler's dispatch loop). A finished trace is queued (bounded: past ``max_queued_spans`` it is
dropped and counted); the export thread (:mod:`xlaserve.tracing.export`, the one module that
imports the OpenTelemetry SDK) turns the records into SDK spans and hands them to the exporter.
The worker coalesces requests into one execution: each traced request gets its own
``xlaserve.queue``, ``xlaserve.weights`` and ``xlaserve.execute`` spans, with the shared
batch's attributes and its ``xlaserve.batch.id`` (docs/tracing.md).

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
    gRPC metadata and h11 give them; a value may be ``str`` or ``bytes``), or None when there is
    none or it is malformed: a trace context is advice, and a bad one starts a new trace rather
    than failing the request. Follows W3C Trace Context: version ``ff`` and all-zero ids are
    invalid; version ``00`` has exactly four fields; a later version may carry more after a
    ``-``, which is ignored."""
    value = headers.get(TRACEPARENT)
    if value is None:
        return None
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


class RequestTrace:
    """One request's spans while it runs (or one stage with children of its own, such as a meta
    model's sub-call: :meth:`child`). ``record`` adds a finished child from two
    ``time.perf_counter_ns()`` readings; ``finish`` ends this span. Any thread may record; the
    root queues the whole trace for export when it finishes."""

    __slots__ = ("_tracing", "_root", "trace_id", "span_id", "parent_id", "remote_parent", "sampled_flag",
                 "name", "kind", "start_ns", "attributes", "spans", "enqueued_ns")

    def __init__(self, tracing: "Tracing", trace_id: int, parent_id: int, remote_parent: bool, name: str,
                 kind: int, start_ns: int, attributes: dict | None, root: "RequestTrace | None" = None) -> None:
        self._tracing = tracing
        self._root = root
        self.trace_id = trace_id
        self.span_id = _new_id(64)
        self.parent_id = parent_id
        self.remote_parent = remote_parent
        self.name = name
        self.kind = kind
        self.start_ns = start_ns
        self.attributes = attributes if attributes is not None else {}
        self.spans: list[tuple] = [] if root is None else root.spans
        #: when its executable inputs were handed to the scheduler (the queue span's start)
        self.enqueued_ns = 0

    def traceparent(self) -> str:
        """This span as the ``traceparent`` a callee continues the trace from."""
        return format_traceparent(self.trace_id, self.span_id, True)

    def record(self, name: str, start_ns: int, end_ns: int, attributes: dict | None = None,
               error: str | None = None) -> None:
        """A finished child span of this one."""
        self.spans.append((name, _new_id(64), self.span_id, start_ns, end_ns, attributes, error, INTERNAL))

    def child(self, name: str, attributes: dict | None = None) -> "RequestTrace":
        """A child span starting now, whose own children :meth:`record` adds; ``finish`` it."""
        return RequestTrace(self._tracing, self.trace_id, self.span_id, False, name, INTERNAL,
                            time.perf_counter_ns(), attributes, self._root or self)

    def finish(self, error: str | None = None, attributes: dict | None = None) -> None:
        """End this span now (``error``: it failed, and why); a root queues its trace."""
        if attributes:
            self.attributes.update(attributes)
        self.spans.append((self.name, self.span_id, self.parent_id, self.start_ns, time.perf_counter_ns(),
                           self.attributes, error, self.kind))
        if self._root is None:
            self._tracing._queue(self)


class Tracing:
    """The tracing of one process: sampling, ids, and the bounded queue of finished traces that
    ``exporter`` (a :class:`~xlaserve.tracing.export.SpanExport`, or any object with
    ``put(trace)`` and ``close()``) drains."""

    def __init__(self, ratio: float, exporter, max_queued_spans: int = 2048) -> None:
        self.ratio = ratio
        self._exporter = exporter
        self._max_spans = max_queued_spans
        self._lock = threading.Lock()
        self._queued: list[RequestTrace] = []
        self._queued_spans = 0
        self.dropped_spans = 0

    def start(self, name: str, headers: Mapping[str, Any] | None, start_ns: int, attributes: dict | None = None,
              kind: int = SERVER) -> RequestTrace | None:
        """A request's trace, continuing the ``traceparent`` of ``headers`` when it has a valid
        one; None when sampling leaves the request untraced."""
        parent = parse_traceparent(headers) if headers else None
        trace_id = parent.trace_id if parent is not None else _new_id(128)
        if not sampled(trace_id, parent, self.ratio):
            return None
        return RequestTrace(self, trace_id, 0 if parent is None else parent.span_id, parent is not None,
                            name, kind, start_ns, attributes)

    def unsampled_traceparent(self, headers: Mapping[str, Any] | None) -> str | None:
        """What a caller passes on for a request it does not trace: the incoming ``traceparent``
        unchanged (None: keep the one it has), else a new one that says "not sampled", so that
        the callee does not sample the request on its own."""
        if headers and parse_traceparent(headers) is not None:
            return None
        return format_traceparent(_new_id(128), _new_id(64), False)

    def _queue(self, trace: RequestTrace) -> None:
        n = len(trace.spans)
        with self._lock:
            if self._queued_spans + n > self._max_spans:
                self.dropped_spans += n
                return
            self._queued.append(trace)
            self._queued_spans += n
        self._exporter.wake(self._queued_spans)

    def take(self) -> list[RequestTrace]:
        """The finished traces queued so far (the exporter's side)."""
        with self._lock:
            taken, self._queued, self._queued_spans = self._queued, [], 0
        return taken

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
