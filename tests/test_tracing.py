"""Tracing's pure parts without a server: W3C traceparent parsing, sampling, a request's spans
through the export thread into the SDK's in-memory exporter, the JSON-lines exporter, and what
happens when tracing is off or the SDK is missing."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, StatusCode

from xlaserve.config import TracingConfig
from xlaserve.tracing import (Execution, TraceParent, Tracing, format_traceparent, open_tracing, parse_traceparent,
                              sampled)
from xlaserve.tracing.export import FAST_SPANS, SpanExport, fast_spans_match, public_span

from tests.conftest import ROOT

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
GOOD = f"00-{TRACE}-{SPAN}-01"


# ---- traceparent ----------------------------------------------------------------------------

def test_a_valid_traceparent_is_read():
    assert parse_traceparent({"traceparent": GOOD}) == TraceParent(int(TRACE, 16), int(SPAN, 16), True)
    assert parse_traceparent({"traceparent": f"00-{TRACE}-{SPAN}-00"}).sampled is False
    # any flags byte: only the sampled bit counts
    assert parse_traceparent({"traceparent": f"00-{TRACE}-{SPAN}-03"}).sampled is True
    assert parse_traceparent({"traceparent": f"00-{TRACE}-{SPAN}-02"}).sampled is False


def test_bytes_values_and_surrounding_blanks_are_read():
    # an HTTP/1.1 library may give header values as bytes, with optional white space
    assert parse_traceparent({"traceparent": GOOD.encode()}).trace_id == int(TRACE, 16)
    assert parse_traceparent({"traceparent": f" \t{GOOD} "}).span_id == int(SPAN, 16)


def test_a_later_version_may_carry_more_fields():
    assert parse_traceparent({"traceparent": f"01-{TRACE}-{SPAN}-01-what-comes-next"}).sampled is True


@pytest.mark.parametrize("value", [
    "", "garbage", GOOD.upper(), f"ff-{TRACE}-{SPAN}-01", f"00-{'0' * 32}-{SPAN}-01", f"00-{TRACE}-{'0' * 16}-01",
    f"00-{TRACE}-{SPAN}-01-extra", f"00-{TRACE[:-1]}-{SPAN}-01", f"00-{TRACE}-{SPAN[:-1]}-01", f"00-{TRACE}-{SPAN}-1",
    f"0-{TRACE}-{SPAN}-01", f"00_{TRACE}_{SPAN}_01", f"00-{TRACE}-{SPAN}-zz", f"00-{TRACE}x-{SPAN}-01",
    GOOD + "\n", "00-" + "g" * 32 + f"-{SPAN}-01", GOOD + "-" + "x" * 600, b"\xff\xfe", 42, None, ["00"],
])
def test_a_malformed_traceparent_is_ignored(value):
    assert parse_traceparent({"traceparent": value}) is None


def test_no_traceparent_is_none_and_other_headers_are_not_read():
    assert parse_traceparent({}) is None
    assert parse_traceparent({"tracestate": "a=b", "Traceparent": "x"}) is None


def test_random_text_never_raises():
    rng = random.Random(27)
    alphabet = "0123456789abcdefABCDEF-xff \t\n\x00é"
    for _ in range(3000):
        n = rng.randrange(0, 70)
        text = "".join(rng.choice(alphabet) for _ in range(n))
        result = parse_traceparent({"traceparent": text})
        assert result is None or (result.trace_id and result.span_id)


def test_format_traceparent_round_trips():
    parent = TraceParent(int(TRACE, 16), int(SPAN, 16), True)
    assert parent.header() == GOOD
    assert parse_traceparent({"traceparent": format_traceparent(5, 7, False)}) == TraceParent(5, 7, False)


# ---- sampling -------------------------------------------------------------------------------

def test_sampling_follows_the_callers_decision():
    sampled_parent = TraceParent(1, 1, True)
    unsampled_parent = TraceParent(1, 1, False)
    assert sampled(1 << 100, sampled_parent, 0.0)
    assert not sampled(1, unsampled_parent, 1.0)


def test_sampling_without_a_parent_is_the_sdks_trace_id_ratio():
    rng = random.Random(5)
    ids = [rng.getrandbits(128) or 1 for _ in range(4000)]
    for ratio in (0.0, 0.01, 0.25, 0.5, 1.0):
        sdk = ParentBased(TraceIdRatioBased(ratio))
        ours = [sampled(i, None, ratio) for i in ids]
        theirs = [sdk.should_sample(None, i, "x").decision.is_sampled() for i in ids]
        assert ours == theirs
    assert not any(sampled(i, None, 0.0) for i in ids)
    assert all(sampled(i, None, 1.0) for i in ids)
    share = sum(sampled(i, None, 0.25) for i in ids) / len(ids)
    assert 0.22 < share < 0.28


def test_tracing_at_ratio_zero_traces_only_sampled_callers():
    tracing = Tracing(0.0, _NoExport())
    assert tracing.start("r", {}, 0) is None
    assert tracing.start("r", {"traceparent": f"00-{TRACE}-{SPAN}-00"}, 0) is None
    trace = tracing.start("r", {"traceparent": GOOD}, 0)
    assert trace is not None and trace.trace_id == int(TRACE, 16) and trace.parent_id == int(SPAN, 16)


def test_tracing_samples_new_traces_as_the_sampling_rule_says():
    tracing = Tracing(0.25, _NoExport())
    random.seed(27)
    ids = [random.getrandbits(128) or 1 for _ in range(2000)]
    random.seed(27)                 # start() draws the same trace ids
    traces = [tracing.start("r", {}, 0) for _ in ids]
    assert [t is not None for t in traces] == [sampled(i, None, 0.25) for i in ids]
    assert [t.trace_id for t in traces if t is not None] == [i for i in ids if sampled(i, None, 0.25)]
    assert 400 < sum(t is not None for t in traces) < 600


def test_an_unsampled_caller_passes_on_a_traceparent_that_says_so():
    tracing = Tracing(0.0, _NoExport())
    assert tracing.unsampled_traceparent({"traceparent": GOOD}) is None    # the caller's goes on unchanged
    made = parse_traceparent({"traceparent": tracing.unsampled_traceparent({})})
    assert made is not None and made.sampled is False


class _NoExport:
    def wake(self, queued_spans: int) -> None:
        pass

    def close(self) -> None:
        pass


# ---- spans into the SDK's in-memory exporter ------------------------------------------------

def _export(memory: InMemorySpanExporter, max_queued_spans: int = 2048) -> tuple[Tracing, SpanExport]:
    """Tracing into ``memory``, exported when the test flushes or closes (no export thread)."""
    config = TracingConfig(enabled=True, service_name="svc", max_queued_spans=max_queued_spans)
    export = SpanExport.from_config(config, "worker7", memory)
    tracing = Tracing(1.0, export, max_queued_spans)
    export.start(tracing, thread=False)
    return tracing, export


def test_a_request_trace_becomes_sdk_spans_with_its_parentage_and_times():
    memory = InMemorySpanExporter()
    tracing, _ = _export(memory)
    before = time.time_ns()
    t0 = time.perf_counter_ns()
    trace = tracing.start("xlaserve.infer", {"traceparent": GOOD}, t0, {"xlaserve.model": "m"})
    trace.record("xlaserve.admission", t0, t0 + 1000, {"xlaserve.rows": 2})
    call = trace.child("xlaserve.meta.call", {"xlaserve.model": "sub"})
    call.record("xlaserve.execute", t0 + 2000, t0 + 5000, {"xlaserve.batch.compiled_size": 4})
    call.finish("NOT_FOUND: no such model")
    trace.finish(None, {"rpc.grpc.status_code": 0})
    tracing.close()
    after = time.time_ns()
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert set(spans) == {"xlaserve.infer", "xlaserve.admission", "xlaserve.meta.call", "xlaserve.execute"}
    root = spans["xlaserve.infer"]
    assert {s.context.trace_id for s in spans.values()} == {int(TRACE, 16)}
    assert root.parent.span_id == int(SPAN, 16) and root.parent.is_remote
    assert root.kind is SpanKind.SERVER
    assert dict(root.attributes) == {"xlaserve.model": "m", "rpc.grpc.status_code": 0}
    assert root.resource.attributes["service.name"] == "svc"
    assert root.resource.attributes["service.instance.id"] == "worker7"
    assert spans["xlaserve.admission"].parent.span_id == root.context.span_id
    assert not spans["xlaserve.admission"].parent.is_remote
    assert spans["xlaserve.meta.call"].parent.span_id == root.context.span_id
    assert spans["xlaserve.execute"].parent.span_id == spans["xlaserve.meta.call"].context.span_id
    assert spans["xlaserve.meta.call"].status.status_code is StatusCode.ERROR
    assert spans["xlaserve.meta.call"].status.description == "NOT_FOUND: no such model"
    assert root.status.status_code is StatusCode.UNSET
    execute = spans["xlaserve.execute"]
    assert execute.end_time - execute.start_time == 3000
    assert before - 10**6 <= root.start_time <= execute.start_time < execute.end_time <= root.end_time <= after + 10**6
    assert len({s.context.span_id for s in spans.values()}) == 4


def _execution(started: int, weights_ns: int, done: int, error: str | None = None, batch_id: int = 1) -> Execution:
    return Execution(started, weights_ns, done, error, {"xlaserve.model": "m", "xlaserve.batch.id": batch_id},
                     {"xlaserve.weights.bytes": 64, "xlaserve.batch.id": batch_id},
                     {"xlaserve.batch.size": 3, "xlaserve.batch.requests": 2, "xlaserve.batch.id": batch_id})


def test_requests_coalesced_into_one_execution_each_get_their_own_stage_spans():
    memory = InMemorySpanExporter()
    tracing, _ = _export(memory)
    t0 = time.perf_counter_ns()
    shared = _execution(t0 + 100, t0 + 200, t0 + 500)
    traces = []
    for i, enqueued in enumerate((t0 + 10, t0 + 60)):
        trace = tracing.start("xlaserve.infer", {}, t0, {"xlaserve.request_id": f"r{i}"})
        trace.admitted(1 + i)
        trace.enqueued_ns = enqueued
        trace.execution = shared            # what the scheduler's dispatch records, once for the batch
        traces.append(trace)
    for trace in traces:
        trace.finish(None, {"rpc.grpc.status_code": 0})
    tracing.close()
    spans = memory.get_finished_spans()
    assert len(spans) == 10
    assert len({s.context.span_id for s in spans}) == 10
    for i, trace in enumerate(traces):
        mine = [s for s in spans if s.context.trace_id == trace.trace_id]
        (root,) = [s for s in mine if s.name == "xlaserve.infer"]
        assert root.parent is None
        assert dict(root.attributes) == {"xlaserve.request_id": f"r{i}", "rpc.grpc.status_code": 0}
        stages = {s.name: s for s in mine if s is not root}
        assert set(stages) == {"xlaserve.admission", "xlaserve.queue", "xlaserve.weights", "xlaserve.execute"}
        assert all(s.parent.span_id == root.context.span_id and not s.parent.is_remote for s in stages.values())
        assert dict(stages["xlaserve.admission"].attributes) == {"xlaserve.rows": 1 + i}
        queue, weights, execute = stages["xlaserve.queue"], stages["xlaserve.weights"], stages["xlaserve.execute"]
        assert queue.end_time - queue.start_time == 100 - (10, 60)[i]       # each its own wait
        assert (weights.end_time - weights.start_time, execute.end_time - execute.start_time) == (100, 300)
        assert weights.end_time == execute.start_time and queue.end_time == weights.start_time
        assert dict(execute.attributes)["xlaserve.batch.requests"] == 2
        assert dict(queue.attributes) == {"xlaserve.model": "m", "xlaserve.batch.id": 1}
        assert all(s.status.status_code is StatusCode.UNSET for s in mine)


def test_a_batch_whose_weights_failed_ends_at_an_erroneous_weights_span():
    memory = InMemorySpanExporter()
    tracing, _ = _export(memory)
    t0 = time.perf_counter_ns()
    trace = tracing.start("xlaserve.infer", {}, t0)
    trace.enqueued_ns = t0 + 5
    trace.execution = _execution(t0 + 10, 0, t0 + 40, "UNAVAILABLE: no room for the weights")
    trace.finish("UNAVAILABLE: no room for the weights")
    tracing.close()
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert set(spans) == {"xlaserve.infer", "xlaserve.queue", "xlaserve.weights"}    # no admission recorded, no run
    weights = spans["xlaserve.weights"]
    assert weights.end_time - weights.start_time == 30
    assert weights.status.status_code is StatusCode.ERROR
    assert weights.status.description == "UNAVAILABLE: no room for the weights"
    assert spans["xlaserve.queue"].status.status_code is StatusCode.UNSET


def test_the_queued_span_count_is_what_the_export_makes():
    # the bound on queued spans counts a trace's spans before they exist: hooks, a meta model's
    # sub-calls (each with its own stages) and the shared execution included
    memory = InMemorySpanExporter()
    tracing, export = _export(memory)
    t0 = time.perf_counter_ns()
    trace = tracing.start("xlaserve.infer", {}, t0)
    trace.admitted(1)
    trace.record("xlaserve.run", t0, t0 + 50)
    for model, loaded in (("a", t0 + 20), ("b", 0)):
        call = trace.child("xlaserve.meta.call", {"xlaserve.model": model})
        call.record("xlaserve.preprocess", t0 + 1, t0 + 2)
        call.enqueued_ns = t0 + 3
        call.execution = _execution(t0 + 10, loaded, t0 + 30)
        call.finish()
    trace.finish()
    assert trace.span_count() == 1 + 1 + 1 + 2 * (1 + 1 + 1 + 1) + 1   # root, admission, run, 2 calls: 10 + 1
    export.flush()
    spans = memory.get_finished_spans()
    assert len(spans) == trace.span_count() == 12
    calls = [s for s in spans if s.name == "xlaserve.meta.call"]
    for call in calls:
        kids = {s.name for s in spans if s.parent is not None and s.parent.span_id == call.context.span_id}
        loaded = dict(call.attributes)["xlaserve.model"] == "a"
        assert kids == {"xlaserve.preprocess", "xlaserve.queue", "xlaserve.weights"} | (
            {"xlaserve.execute"} if loaded else set())
    tracing.close()


def test_the_export_maps_the_kinds_the_records_name():
    from xlaserve import tracing
    from xlaserve.tracing import export
    assert export.INTERNAL == tracing.INTERNAL
    assert [export._KINDS[k] for k in (tracing.INTERNAL, tracing.SERVER, tracing.CLIENT)] == [
        SpanKind.INTERNAL, SpanKind.SERVER, SpanKind.CLIENT]


def test_the_export_makes_its_spans_as_the_sdks_public_constructors_do():
    # the fast path (a ReadableSpan subclass, SpanContext by tuple.__new__) holds on this SDK, and
    # what it makes reads, property by property, like the spans the public constructors make
    assert FAST_SPANS and fast_spans_match()
    memory = InMemorySpanExporter()
    tracing, export = _export(memory)
    t0 = time.perf_counter_ns()
    trace = tracing.start("xlaserve.infer", {"traceparent": GOOD}, t0, {"xlaserve.model": "m"})
    trace.record("xlaserve.preprocess", t0, t0 + 5, None, "INTERNAL: the hook raised")
    trace.finish()
    export.flush()
    for span in memory.get_finished_spans():
        public = public_span(span.name, span.context.trace_id, span.context.span_id, span.parent, span.resource,
                             span.attributes or None, span.kind, span.status, span.start_time, span.end_time)
        assert isinstance(span, type(public))
        assert span.to_json() == public.to_json()
        assert (span.context, span.parent, span.events, span.links, span.instrumentation_scope) == (
            public.context, public.parent, public.events, public.links, public.instrumentation_scope)
    tracing.close()


def _shapes(tracing: Tracing) -> list:
    """Finished traces of every shape the export knows, each flushed by the caller."""
    t0 = time.perf_counter_ns()
    shared = _execution(t0 + 100, t0 + 200, t0 + 500)
    traces = []
    plain = tracing.start("xlaserve.infer", {}, t0, {"xlaserve.request_id": "plain"})
    plain.admitted(3)
    plain.enqueued_ns = t0 + 50
    plain.execution = shared
    traces.append(plain)
    parented = tracing.start("xlaserve.infer", {"traceparent": GOOD}, t0 + 1, {"xlaserve.model": "m"})
    parented.admitted(1)
    parented.execution = shared                 # not enqueued: its queue span starts at the dispatch
    parented.traceparent()                      # its id made while it ran, passed on to a callee
    traces.append(parented)
    failed = tracing.start("xlaserve.infer", {}, t0 + 2)
    failed.admitted(2)
    failed.enqueued_ns = t0 + 3
    failed.execution = _execution(t0 + 10, t0 + 20, t0 + 40, "INTERNAL: execution at batch size 4 failed")
    traces.append(failed)
    no_weights = tracing.start("xlaserve.infer", {}, t0 + 3)
    no_weights.enqueued_ns = t0 + 4
    no_weights.execution = _execution(t0 + 10, 0, t0 + 30, "UNAVAILABLE: no room for the weights")
    traces.append(no_weights)
    traces.append(tracing.start("xlaserve.infer", {}, t0 + 4))      # refused before admission
    hooked = tracing.start("xlaserve.infer", {}, t0 + 5)
    hooked.admitted(1)
    hooked.record("xlaserve.preprocess", t0 + 6, t0 + 7, None, "INTERNAL: the hook raised")
    call = hooked.child("xlaserve.meta.call", {"xlaserve.model": "a"})
    call.enqueued_ns = t0 + 8
    call.execution = shared
    call.finish()
    traces.append(hooked)
    errors = ("UNAVAILABLE: the batch failed", "UNAVAILABLE: no room for the weights", "UNAVAILABLE: refused",
              None, "INTERNAL: the hook raised")
    for trace, error in zip(traces, (None,) + errors):
        trace.finish(error, {"rpc.grpc.status_code": 0 if error is None else 14})
    return traces


def test_the_one_pass_export_makes_the_spans_the_walk_makes_with_the_public_constructors(monkeypatch):
    # build_spans (the request's common spans in one pass, stage classes, tuple-made contexts)
    # against walk + public_span: the same spans in the same order, ids drawn alike, every public
    # property equal; traces with hooks or meta sub-calls go through the walk in both
    from xlaserve.tracing import export as module
    tracing, export = _export(InMemorySpanExporter())
    traces = _shapes(tracing)
    assert tracing.take() == traces
    faces = []
    for fast in (True, False):
        monkeypatch.setattr(module, "FAST_SPANS", fast)
        random.seed(31)
        spans = export.spans(traces)
        assert len(spans) == sum(t.span_count() for t in traces) == 5 + 5 + 5 + 3 + 1 + 7
        faces.append([module._public_face(span) for span in spans])
        if fast:
            assert {type(span).__name__ for span in spans} >= {"QueueSpan", "WeightsSpan", "ExecuteSpan"}
        else:
            assert {type(span) for span in spans} == {module.ReadableSpan}
    tracing.close()
    assert faces[0] == faces[1]
    fast_spans = faces[0]
    assert [face[0] for face in fast_spans[:5]] == ["xlaserve.infer", "xlaserve.admission", "xlaserve.queue",
                                                     "xlaserve.weights", "xlaserve.execute"]
    assert fast_spans[5][4].span_id == int(SPAN, 16) and fast_spans[5][4].is_remote     # the caller's span
    assert fast_spans[14][0] == "xlaserve.execute" and fast_spans[14][10] is StatusCode.ERROR
    assert fast_spans[17][0] == "xlaserve.weights" and fast_spans[17][10] is StatusCode.ERROR


def test_traces_past_the_queue_limit_are_dropped_and_counted():
    memory = InMemorySpanExporter()
    tracing, export = _export(memory, max_queued_spans=3)
    for _ in range(3):
        trace = tracing.start("r", {}, time.perf_counter_ns())
        trace.record("a", 0, 1)
        trace.finish()          # two spans each: the second and third do not fit beside the first
    assert tracing.dropped_spans == 4
    export.flush()
    assert len(memory.get_finished_spans()) == 2
    trace = tracing.start("r", {}, time.perf_counter_ns())
    trace.finish()              # the queue emptied: room again
    tracing.close()
    assert len(memory.get_finished_spans()) == 3


def test_an_exporter_that_raises_loses_its_batch_only():
    class Failing(InMemorySpanExporter):
        def export(self, spans):
            raise RuntimeError("collector down")
    tracing, export = _export(Failing())
    tracing.start("r", {}, time.perf_counter_ns()).finish()
    export.flush()              # logged, not raised
    tracing.start("r", {}, time.perf_counter_ns()).finish()
    tracing.close()


def test_the_json_lines_exporter_writes_one_object_a_span(tmp_path):
    path = tmp_path / "spans.jsonl"
    config = TracingConfig(enabled=True, exporter="file", file=path, export_interval_seconds=60.0)
    tracing = open_tracing(config, "gw")
    trace = tracing.start("xlaserve.gateway.forward", {"traceparent": GOOD}, time.perf_counter_ns(),
                          {"xlaserve.worker": "w0"}, kind=2)
    trace.record("inner", trace.start_ns, trace.start_ns + 10, None, "boom")
    trace.finish()
    tracing.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    by_name = {line["name"]: line for line in lines}
    assert set(by_name) == {"xlaserve.gateway.forward", "inner"}
    forward = by_name["xlaserve.gateway.forward"]
    assert forward["trace_id"] == TRACE and forward["parent_span_id"] == SPAN and forward["kind"] == "CLIENT"
    assert forward["attributes"] == {"xlaserve.worker": "w0"} and forward["status"] == "OK"
    assert forward["resource"]["service.instance.id"] == "gw"
    inner = by_name["inner"]
    assert inner["parent_span_id"] == forward["span_id"]
    assert inner["status"] == "ERROR" and inner["status_message"] == "boom"
    assert inner["end_time_ns"] - inner["start_time_ns"] == 10


def test_the_json_lines_exporter_writes_any_attribute_value_as_json_does(tmp_path):
    path = tmp_path / "spans.jsonl"
    tracing = open_tracing(TracingConfig(enabled=True, exporter="file", file=path), "w")
    attributes = {"text": 'quote " back \\ newline \n é \u2028', "count": -7, "big": 10**30, "yes": True, "no": False,
                  "ratio": 0.25, "many": ["a", 1], "é key": "v"}
    trace = tracing.start("xlaserve.infer", {}, time.perf_counter_ns(), dict(attributes))
    trace.record("xlaserve.preprocess", trace.start_ns, trace.start_ns + 1, None, 'INTERNAL: "boom" é')
    trace.finish()
    tracing.close()
    raw = path.read_text()
    assert raw.isascii()            # as json.dumps writes it: non-ASCII escaped
    lines = {line["name"]: line for line in map(json.loads, raw.splitlines())}
    assert lines["xlaserve.infer"]["attributes"] == attributes
    assert json.dumps(attributes, separators=(",", ":")) in raw
    assert lines["xlaserve.preprocess"]["attributes"] == {}
    assert lines["xlaserve.preprocess"]["status_message"] == 'INTERNAL: "boom" é'


def test_an_unwritable_trace_file_is_an_os_error(tmp_path):
    config = TracingConfig(enabled=True, exporter="file", file=tmp_path / "missing" / "spans.jsonl")
    with pytest.raises(OSError):
        open_tracing(config, "w")


# ---- off, and without the SDK ---------------------------------------------------------------

def test_tracing_off_is_none():
    assert open_tracing(TracingConfig(), "w") is None


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_request_path_does_not_import_opentelemetry():
    done = _python("import sys\n"
                   "import xlaserve.app.compose, xlaserve.gateway.run, xlaserve.cli\n"
                   "from xlaserve.config import TracingConfig\n"
                   "from xlaserve.tracing import open_tracing\n"
                   "assert open_tracing(TracingConfig(), 'w') is None\n"
                   "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_tracing_enabled_without_the_sdk_logs_one_error_and_serves_untraced():
    # the interpreter is made to lack the SDK: importing opentelemetry fails as when the extra is absent
    done = _python("import logging, sys\n"
                   "sys.modules['opentelemetry'] = None\n"
                   "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
                   "from xlaserve.config import TracingConfig\n"
                   "from xlaserve.tracing import open_tracing\n"
                   "print(open_tracing(TracingConfig(enabled=True), 'w'))\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
    errors = [line for line in done.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1
    assert "tracing.enabled is true but the OpenTelemetry SDK is not installed" in errors[0]
    assert "pip install 'xlaserve[otel]'" in errors[0]
