"""The export thread: finished traces become OpenTelemetry SDK spans and go to the exporter.

The one module that imports the OpenTelemetry SDK (the install extra ``otel``); imported only
when tracing is enabled. The request path never waits on it: every
``tracing.export_interval_seconds`` (sooner when half of ``tracing.max_queued_spans`` wait) the
thread takes what is queued, walks each request's record into its spans (:func:`walk`: span ids
made here, timestamps moved from ``perf_counter_ns`` to the epoch), builds ``ReadableSpan``
objects and calls the exporter's ``export``; the ``file`` exporter writes its JSON lines
straight from the walk instead. An exporter that fails or raises loses that batch, with one log
line a minute.

Building SDK spans is the export's cost, so it takes the short way where the installed SDK
allows it (:func:`fast_spans_match`, checked at import): a request's root and stage spans are
made in one pass over its record (:func:`build_spans`), each stage span an instance of a
``ReadableSpan`` subclass that holds what all spans of that stage share (:func:`span_classes`),
made with ``object.__new__``, and ``SpanContext`` tuples made with ``tuple.__new__``; the
spans of a request with hooks or meta sub-calls are walked through :func:`span_class`'s
constructor. Their public properties are the SDK constructors' (tests compare them).
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.span import DEFAULT_TRACE_STATE

log = logging.getLogger("xlaserve.tracing")

_KINDS = (SpanKind.INTERNAL, SpanKind.SERVER, SpanKind.CLIENT)     # by xlaserve.tracing's INTERNAL, SERVER, CLIENT
INTERNAL = 0                # a stage's kind (xlaserve.tracing.INTERNAL; importing it would be a cycle)
_KIND_NAMES = tuple(kind.name for kind in _KINDS)
_compact = json.JSONEncoder(separators=(",", ":")).encode
_quote = json.encoder.encode_basestring_ascii      # a str as json.dumps writes it (ensure_ascii)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_OK = Status(StatusCode.UNSET)
_SCOPE = InstrumentationScope("xlaserve")
_ROWS: dict[int, dict] = {}
_ROWS_KEPT = 1024


def _rows(rows: int) -> dict:
    """The admission span's attributes: one read-only mapping a row count, shared by the spans."""
    attributes = _ROWS.get(rows)
    if attributes is None:
        attributes = {"xlaserve.rows": rows}
        if len(_ROWS) < _ROWS_KEPT:
            _ROWS[rows] = attributes
    return attributes


def walk(trace, span, root_parent):
    """Turn a finished root :class:`~xlaserve.tracing.RequestTrace` into its spans, parents
    first: ``span(name, span_id, parent, start_ns, end_ns, attributes, error, kind)`` is called
    for each and returns what its children get as ``parent`` (the root gets ``root_parent``);
    ids not made while the request ran are made here."""
    _walk(trace, span, root_parent, random.getrandbits)


def _walk(node, span, parent, bits) -> None:
    me = span(node.name, node.span_id or bits(64) or 1, parent, node.start_ns, node.end_ns, node.attributes,
              node.error, node.kind)
    if node.admitted_ns:
        span("xlaserve.admission", bits(64) or 1, me, node.start_ns, node.admitted_ns, _rows(node.rows), None,
             INTERNAL)
    execution = node.execution
    if execution is not None:
        started, loaded = execution.started_ns, execution.weights_ns
        span("xlaserve.queue", bits(64) or 1, me, node.enqueued_ns or started, started, execution.queue_attributes,
             None, INTERNAL)
        if loaded:
            span("xlaserve.weights", bits(64) or 1, me, started, loaded, execution.weights_attributes, None, INTERNAL)
            span("xlaserve.execute", bits(64) or 1, me, loaded, execution.done_ns, execution.execute_attributes,
                 execution.error, INTERNAL)
        else:
            span("xlaserve.weights", bits(64) or 1, me, started, execution.done_ns, execution.weights_attributes,
                 execution.error, INTERNAL)
    for child in node.spans or ():
        if child.__class__ is tuple:
            name, start, end, attributes, error = child
            span(name, bits(64) or 1, me, start, end, attributes, error, INTERNAL)
        else:
            _walk(child, span, me, bits)


def span_class(resource: Resource) -> type[ReadableSpan]:
    """The ``ReadableSpan`` subclass one process's export makes its spans of: what all of them
    share (the resource, xlaserve's scope, no events or links) is held by the class, so that
    making a span sets only its own eight fields, a third less work than the SDK's constructor.
    Its public face is the SDK's (:func:`fast_spans_match` checks that)."""
    class Span(ReadableSpan):
        _resource = resource
        _instrumentation_scope = _SCOPE
        _instrumentation_info = None
        _events = ()
        _links = ()

        def __init__(self, name: str, context: SpanContext, parent: SpanContext | None, attributes, kind: SpanKind,
                     status: Status, start: int, end: int) -> None:    # pylint: disable=super-init-not-called
            self._name = name
            self._context = context
            self._parent = parent
            self._attributes = attributes
            self._kind = kind
            self._status = status
            self._start_time = start
            self._end_time = end
    return Span


def span_classes(resource: Resource) -> tuple[type[ReadableSpan], ...]:
    """``(Span, Admission, Queue, Weights, Execute)``: :func:`span_class` and, for each stage
    every request has, a subclass whose class also holds the stage's name, kind and status (OK):
    :func:`build_spans` makes such a span with ``object.__new__`` and sets its context, parent,
    attributes and times only (its status too when it failed), no constructor called."""
    span = span_class(resource)

    def stage(name: str) -> type[ReadableSpan]:
        return type(f"{name.rpartition('.')[2].capitalize()}Span", (span,),
                    {"_name": name, "_kind": SpanKind.INTERNAL, "_status": _OK, "__slots__": ()})
    return (span, stage("xlaserve.admission"), stage("xlaserve.queue"), stage("xlaserve.weights"),
            stage("xlaserve.execute"))


def build_spans(traces, classes: tuple[type[ReadableSpan], ...], epoch: int, append, other) -> None:
    """Append the SDK spans of finished root ``traces`` (see :func:`walk`) to a list (``append``),
    parents first, in :func:`walk`'s order and with its ids drawn in the same order: the same
    spans that :func:`walk` with :func:`public_span` makes (a test compares them, field by field),
    several times cheaper. A request's root, admission, queue, weights and execute spans are made
    here, in one pass and without a call a span: ``classes`` from :func:`span_classes`, each
    ``SpanContext`` (a tuple) with ``tuple.__new__``. A trace with spans of other kinds (a hook,
    a meta model's ``run`` or sub-calls) is handed to ``other`` instead, whole."""
    span_of, admission_of, queue_of, weights_of, execute_of = classes
    new, make, bits = tuple.__new__, object.__new__, random.getrandbits
    sampled, state, ok, kinds, error_status = _SAMPLED, DEFAULT_TRACE_STATE, _OK, _KINDS, StatusCode.ERROR
    for trace in traces:
        if trace.spans is not None:
            other(trace)
            continue
        trace_id = trace.trace_id
        start = trace.start_ns + epoch
        me = new(SpanContext, (trace_id, trace.span_id or bits(64) or 1, False, sampled, state, True))
        span = make(span_of)
        span._name = trace.name
        span._context = me
        span._parent = SpanContext(trace_id, trace.parent_id, True, sampled) if trace.parent_id else None
        span._attributes = trace.attributes
        span._kind = kinds[trace.kind]
        span._status = ok if trace.error is None else Status(error_status, trace.error)
        span._start_time = start
        span._end_time = trace.end_ns + epoch
        append(span)
        if trace.admitted_ns:
            span = make(admission_of)
            span._context = new(SpanContext, (trace_id, bits(64) or 1, False, sampled, state, True))
            span._parent = me
            span._attributes = _rows(trace.rows)
            span._start_time = start
            span._end_time = trace.admitted_ns + epoch
            append(span)
        execution = trace.execution
        if execution is None:
            continue
        started = execution.started_ns + epoch
        span = make(queue_of)
        span._context = new(SpanContext, (trace_id, bits(64) or 1, False, sampled, state, True))
        span._parent = me
        span._attributes = execution.queue_attributes
        span._start_time = (trace.enqueued_ns or execution.started_ns) + epoch
        span._end_time = started
        append(span)
        span = make(weights_of)
        span._context = new(SpanContext, (trace_id, bits(64) or 1, False, sampled, state, True))
        span._parent = me
        span._attributes = execution.weights_attributes
        span._start_time = started
        if execution.weights_ns:
            span._end_time = loaded = execution.weights_ns + epoch
            append(span)
            span = make(execute_of)
            span._context = new(SpanContext, (trace_id, bits(64) or 1, False, sampled, state, True))
            span._parent = me
            span._attributes = execution.execute_attributes
            span._start_time = loaded
        span._end_time = execution.done_ns + epoch
        if execution.error is not None:
            span._status = Status(error_status, execution.error)
        append(span)


def fast_context(trace_id: int, span_id: int) -> SpanContext:
    """A sampled, local ``SpanContext`` made with ``tuple.__new__`` (it is a tuple), skipping the
    constructor's defaults and range checks: the records' ids are valid. Half the cost."""
    return tuple.__new__(SpanContext, (trace_id, span_id, False, _SAMPLED, DEFAULT_TRACE_STATE, True))


def public_span(name: str, trace_id: int, span_id: int, parent: SpanContext | None, resource: Resource, attributes,
                kind: SpanKind, status: Status, start: int, end: int) -> ReadableSpan:
    """A span made through the SDK's public constructors, as the export makes it (fast) when
    :func:`fast_spans_match`."""
    return ReadableSpan(name=name, context=SpanContext(trace_id, span_id, False, _SAMPLED), parent=parent,
                        resource=resource, attributes=attributes, kind=kind, start_time=start, end_time=end,
                        status=status, instrumentation_scope=_SCOPE)


def _public_face(span: ReadableSpan) -> tuple:
    return (span.name, tuple(span.context), type(span.context), span.context.trace_state, span.parent, span.resource,
            dict(span.attributes), span.events, span.links, span.kind, span.status.status_code,
            span.status.description, span.start_time, span.end_time, span.instrumentation_scope,
            span.dropped_attributes, span.dropped_events, span.dropped_links, span.to_json())


def fast_spans_match() -> bool:
    """Whether :func:`span_class`, :func:`fast_context` and :func:`build_spans` make what
    :func:`public_span` makes with the installed SDK, every public property alike; else (a later
    SDK changed either) the export uses the public constructors."""
    resource = Resource.create({"service.name": "probe"})
    try:
        for parent, kind, status in ((SpanContext(7 << 100, 8, True, _SAMPLED), SpanKind.SERVER,
                                      Status(StatusCode.ERROR, "e")), (None, SpanKind.INTERNAL, _OK)):
            fast = span_class(resource)("n", fast_context(7 << 100, 9 << 40), parent, {"a": 1}, kind, status, 11, 12)
            public = public_span("n", 7 << 100, 9 << 40, parent, resource, {"a": 1}, kind, status, 11, 12)
            if _public_face(fast) != _public_face(public):
                return False
        # build_spans' stage classes, made without a constructor, against the spans they stand for
        execution = SimpleNamespace(started_ns=30, weights_ns=40, done_ns=50, error="x", queue_attributes={"q": 1},
                                    weights_attributes={"w": 2}, execute_attributes={"e": 3})
        record = SimpleNamespace(spans=None, trace_id=7 << 100, span_id=5, parent_id=0, name="n", kind=1,
                                 start_ns=10, end_ns=60, attributes={"a": 1}, error=None, admitted_ns=20, rows=4,
                                 enqueued_ns=25, execution=execution)
        made: list[ReadableSpan] = []
        build_spans([record], span_classes(resource), 0, made.append, None)
        root = SpanContext(7 << 100, 5, False, _SAMPLED)
        expected = [("n", None, {"a": 1}, SpanKind.SERVER, _OK, 10, 60),
                    ("xlaserve.admission", root, _rows(4), SpanKind.INTERNAL, _OK, 10, 20),
                    ("xlaserve.queue", root, {"q": 1}, SpanKind.INTERNAL, _OK, 25, 30),
                    ("xlaserve.weights", root, {"w": 2}, SpanKind.INTERNAL, _OK, 30, 40),
                    ("xlaserve.execute", root, {"e": 3}, SpanKind.INTERNAL, Status(StatusCode.ERROR, "x"), 40, 50)]
        if len(made) != len(expected):
            return False
        for fast, (name, parent, attributes, kind, status, start, end) in zip(made, expected):
            public = public_span(name, 7 << 100, fast.context.span_id, parent, resource, attributes, kind, status,
                                 start, end)
            if _public_face(fast) != _public_face(public):
                return False
    except Exception:
        return False
    return True


FAST_SPANS = fast_spans_match()


class JsonLinesWriter:
    """Appends each span to ``path`` as one JSON object a line: ``name``, ``trace_id``,
    ``span_id``, ``parent_span_id`` (hex; null for a span without a parent), ``kind``,
    ``start_time_ns``, ``end_time_ns`` (Unix epoch), ``attributes``, ``status`` (``OK`` or
    ``ERROR``), ``status_message`` and ``resource``. Written straight from the records (no SDK
    span objects). One ``write`` a batch on a file opened for appending, so the processes of a
    node may share one file."""

    def __init__(self, path: Path, resource: Resource) -> None:
        self._path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._resource = json.dumps(dict(resource.attributes), separators=(",", ":"))
        self._names: dict[str, str] = {}
        self._keys: dict[str, str] = {}

    def _attributes(self, attributes) -> str:
        """``attributes`` as ``json.dumps`` writes them (compact), a third of its cost: the keys'
        JSON kept (a few constants), strings and integers written here, other values by
        ``json``. ``json.dumps`` makes a new encoder a call; a span's attributes are a few."""
        keys = self._keys
        items = []
        for key, value in attributes.items():
            quoted = keys.get(key)
            if quoted is None:
                quoted = _quote(key)
                if len(keys) < 256:
                    keys[key] = quoted
            kind = value.__class__
            if kind is str:
                items.append(f"{quoted}:{_quote(value)}")
            elif kind is int:
                items.append(f"{quoted}:{value}")
            else:                   # bool, float, a sequence: as json writes them
                items.append(f"{quoted}:{_compact(value)}")
        return "{" + ",".join(items) + "}"

    def write(self, traces, epoch: int) -> bool:
        names = self._names
        # a coalesced batch's spans share their attribute mappings: each is encoded once
        encoded: dict[int, str] = {}
        lines = []
        append = lines.append
        tail = f',"resource":{self._resource}}}\n'
        head = ""

        def span(name, span_id, parent, start, end, attributes, error, kind) -> str:
            me = f'"{span_id:016x}"'
            quoted = names.get(name)
            if quoted is None:
                quoted = _quote(name)
                if len(names) < 256:        # the span names are a few constants
                    names[name] = quoted
            attrs = encoded.get(id(attributes))
            if attrs is None:
                attrs = encoded[id(attributes)] = self._attributes(attributes) if attributes else "{}"
            status = '"OK","status_message":null' if error is None else f'"ERROR","status_message":{_quote(error)}'
            append(f'{{"name":{quoted},{head},"span_id":{me},"parent_span_id":{parent},"kind":"{_KIND_NAMES[kind]}",'
                   f'"start_time_ns":{start + epoch},"end_time_ns":{end + epoch},"attributes":{attrs},'
                   f'"status":{status}{tail}')
            return me
        for trace in traces:
            head = f'"trace_id":"{trace.trace_id:032x}"'
            walk(trace, span, f'"{trace.parent_id:016x}"' if trace.parent_id else "null")
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


EXPORT_TRACES = 64
"""The traces exported in one call, at most (about 320 spans, 640 objects with their contexts):
built, handed over and let go before the garbage collector's youngest generation (700 objects)
fills, so that spans an exporter does not keep are mostly freed by reference counting instead of
being carried into older generations, whose collections cost more. (The SDK's batch processor
exports 512 spans a call by default: an OTLP collector gets batches of a similar size.)"""


MAX_RESPONSE_BYTES = 64 * 1024
"""Bytes of a collector's answer read, at most. An OTLP answer is a few bytes (a partial-success
count and message) and the exporter reads only its status and headers; ``requests`` would read a
whole body into memory, so a broken or hostile collector answering with an endless body grew the
worker's memory without bound while the export thread never finished."""


def bounded_session():
    """A ``requests`` session for the OTLP exporter that reads at most :data:`MAX_RESPONSE_BYTES`
    of an answer's body, undecoded, within the request's ``timeout`` in all (``requests``' own
    timeout bounds each read, so a body dripped a byte at a time would never end); an answer
    longer or slower than that is cut off and its connection closed, its status kept."""
    import requests

    class BoundedSession(requests.Session):
        def send(self, request, **kwargs):
            kwargs["stream"] = True
            response = super().send(request, **kwargs)
            timeout = kwargs.get("timeout")
            timeout = timeout[-1] if isinstance(timeout, tuple) else timeout
            deadline = time.monotonic() + (timeout if timeout is not None else 10.0)
            body = bytearray()
            complete = False
            try:
                while len(body) <= MAX_RESPONSE_BYTES and time.monotonic() < deadline:
                    chunk = response.raw.read1(MAX_RESPONSE_BYTES + 1 - len(body), decode_content=False)
                    if not chunk:
                        complete = True
                        break
                    body += chunk
            except Exception:       # a reset or a read timeout: the status is what matters
                pass
            response._content = bytes(body[:MAX_RESPONSE_BYTES])
            response._content_consumed = True
            if complete:
                response.raw.release_conn()
            else:
                response.close()
            return response
    return BoundedSession()


class SpanExport:
    """The export thread of one process's :class:`~xlaserve.tracing.Tracing`."""

    def __init__(self, exporter: SpanExporter | JsonLinesWriter, resource: Resource, interval: float,
                 description: str, max_queued_spans: int, shutdown_timeout: float = 10.0) -> None:
        self._exporter = exporter
        #: how long :meth:`close` waits for the last export (``tracing.otlp_timeout_seconds``)
        self._shutdown_timeout = shutdown_timeout
        self._resource = resource
        self._interval = interval
        self._description = description
        self._wake = threading.Event()
        self._stop = False
        self._tracing = None
        self._thread: threading.Thread | None = None
        # perf_counter_ns -> Unix epoch ns, taken once: a request's stages keep their order
        self._epoch = time.time_ns() - time.perf_counter_ns()
        self._failed_at = -float("inf")
        self._span_classes = span_classes(resource)
        self._span_class = self._span_classes[0]

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
            exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint, timeout=config.otlp_timeout_seconds,
                                        session=bounded_session())
            description = f"otlp {config.otlp_endpoint}"
        return cls(exporter, resource, config.export_interval_seconds, description, config.max_queued_spans,
                   config.otlp_timeout_seconds)

    def describe(self) -> str:
        return self._description

    def start(self, tracing, *, thread: bool = True) -> None:
        """Export what ``tracing`` queues; ``thread=False``: only when :meth:`flush` is called."""
        self._tracing = tracing
        if thread:
            self._thread = threading.Thread(target=self._run, name="xlaserve-trace-export", daemon=True)
            self._thread.start()

    def wake(self, queued_spans: int) -> None:
        """Export soon: ``queued_spans`` wait (half of ``max_queued_spans`` or more)."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._interval)
            self._wake.clear()
            self.flush()
        self.flush()        # closing: what was queued while the last export ran

    def flush(self) -> None:
        """Export every queued trace now (the export thread, or close). Closing, the first batch
        that fails ends it: a collector that is down or hangs would cost each batch its timeout."""
        traces = self._tracing.take()
        for at in range(0, len(traces), EXPORT_TRACES):
            if not self._export(traces[at:at + EXPORT_TRACES]) and self._stop:
                log.error("tracing: at shutdown, the spans of %d requests were not exported (the export to %s "
                          "failed)", len(traces) - at, self._description)
                return

    def _export(self, traces: list) -> bool:
        try:
            if isinstance(self._exporter, JsonLinesWriter):
                result = SpanExportResult.SUCCESS if self._exporter.write(traces, self._epoch) else "write failed"
            else:
                result = self._exporter.export(self.spans(traces))
        except Exception as exc:        # the exporter's fault loses this batch only
            result = exc
        if result is not SpanExportResult.SUCCESS and time.monotonic() - self._failed_at > 60:
            self._failed_at = time.monotonic()
            log.error("tracing: exporting the spans of %d requests with %s failed: %s", len(traces),
                      self._description, result)
        return result is SpanExportResult.SUCCESS

    def spans(self, traces) -> list[ReadableSpan]:
        """The SDK spans of finished ``traces``: a ``ReadableSpan`` each, parents first."""
        epoch = self._epoch
        resource = self._resource
        ok = _OK
        kinds = _KINDS
        out = []
        append = out.append
        trace_id = 0
        if FAST_SPANS:      # fast_context inlined: this runs for every span
            new, sampled, state, make = tuple.__new__, _SAMPLED, DEFAULT_TRACE_STATE, self._span_class

            def span(name, span_id, parent, start, end, attributes, error, kind) -> SpanContext:
                me = new(SpanContext, (trace_id, span_id, False, sampled, state, True))
                append(make(name, me, parent, attributes, kinds[kind],
                            ok if error is None else Status(StatusCode.ERROR, error), start + epoch, end + epoch))
                return me

            def other(trace) -> None:
                nonlocal trace_id
                trace_id = trace.trace_id
                walk(trace, span, SpanContext(trace_id, trace.parent_id, True, _SAMPLED) if trace.parent_id else None)
            build_spans(traces, self._span_classes, epoch, append, other)
            return out

        def public(name, span_id, parent, start, end, attributes, error, kind) -> SpanContext:
            made = public_span(name, trace_id, span_id, parent, resource, attributes, kinds[kind],
                               ok if error is None else Status(StatusCode.ERROR, error), start + epoch, end + epoch)
            append(made)
            return made.context
        for trace in traces:
            trace_id = trace.trace_id
            walk(trace, public, SpanContext(trace_id, trace.parent_id, True, _SAMPLED) if trace.parent_id else None)
        return out

    def close(self) -> None:
        """Stop the thread, export what is left and shut the exporter down, waiting at most
        ``shutdown_timeout`` seconds for the export thread (a collector that hangs must not hold
        the process's exit): what it has not sent by then is lost, and said so."""
        self._stop = True
        self._wake.set()
        if self._thread is None:
            self.flush()
        else:
            self._thread.join(self._shutdown_timeout)
            if self._thread.is_alive():
                log.error("tracing: the export to %s did not finish within %gs (tracing.otlp_timeout_seconds) of "
                          "shutdown; the spans it had not sent are lost", self._description, self._shutdown_timeout)
        try:
            self._exporter.shutdown()
        except Exception:
            log.exception("tracing: shutting the exporter down failed")
