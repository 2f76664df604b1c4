"""Traces end to end: a real worker (``xlaserve run``) with ``tracing: {exporter: file}``, the
unchanged Triton client sending a W3C ``traceparent``, and the spans the worker wrote checked one
by one; then the gateway (in this process, its spans in the SDK's InMemorySpanExporter) in front
of a traced worker, the trace continued across the hop."""
from __future__ import annotations

import json
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from tritonclient.utils import InferenceServerException

from examples import reference
from examples.export_examples import export_mlp, export_simple
from tests.conftest import infer_input, serve
from tests.test_gateway_e2e import GatewayThread, addresses
from tests.trio_thread import TrioServerThread
from xlaserve.config.gateway import parse_gateway_config
from xlaserve.gateway.run import Gateway

TRACE = "0af7651916cd43dd8448eb211c80319c"
REST_TRACE = "5" * 32
CALLER = "b7ad6b7169203331"

HOOKS = """
from xlaserve import NamedTensor, register_model

def preprocess(tensors):
    return [NamedTensor(t.name, t.data + 1) for t in tensors]

def postprocess(tensors):
    return list(tensors)

register_model("hooked", preprocess=preprocess, postprocess=postprocess)
"""

META = """
from xlaserve import register_model

def run(tensors, ctx):
    first = ctx.infer("hooked", tensors)
    ctx.infer("mlp", {"input": __import__("numpy").zeros((1, 512), "float32")})
    return [__import__("xlaserve").NamedTensor(n, a) for n, a in first.items()]

register_model("pipeline", run=run)
"""

META_MANIFEST = """format_version: "2.0"
kind: meta
client_inputs:
  - {name: INPUT0, dtype: i32, shape: xn, dims: {x: 16}}
  - {name: INPUT1, dtype: i32, shape: xn, dims: {x: 16}}
client_outputs:
  - {name: OUTPUT0, dtype: i32, shape: xn, dims: {x: 16}}
  - {name: OUTPUT1, dtype: i32, shape: xn, dims: {x: 16}}
"""


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("traced") / "models"
    export_mlp(repo, (1, 2, 4))
    hooked = export_simple(repo, (1, 2, 4)).rename(repo / "hooked")
    manifest = hooked / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("name: simple", "name: hooked"))
    (hooked / "model.py").write_text(HOOKS)
    meta = repo / "pipeline"
    meta.mkdir()
    (meta / "manifest.yaml").write_text(META_MANIFEST)
    (meta / "model.py").write_text(META)
    return repo


class TracedGatewayThread(GatewayThread):
    """The gateway in a thread of this process, its spans going to ``span_exporter``."""

    def __init__(self, workers, settings, span_exporter) -> None:
        self.gateway = Gateway(workers, settings, span_exporter=span_exporter)
        TrioServerThread.__init__(self)
        self.url = f"127.0.0.1:{self.port}"


def rest_input(name: str, x: np.ndarray) -> httpclient.InferInput:
    inp = httpclient.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return inp


def read_spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def by_trace(spans: list[dict], trace_id: str) -> list[dict]:
    return [s for s in spans if s["trace_id"] == trace_id]


def children(spans: list[dict], parent: dict) -> dict[str, dict]:
    kids = [s for s in spans if s["parent_span_id"] == parent["span_id"]]
    names = Counter(s["name"] for s in kids)
    assert all(n == 1 for n in names.values()), names
    return {s["name"]: s for s in kids}


def ex_id(span: dict) -> int:
    return span["attributes"]["xlaserve.batch.id"]


def within(child: dict, parent: dict) -> bool:
    return parent["start_time_ns"] <= child["start_time_ns"] <= child["end_time_ns"] <= parent["end_time_ns"]


@pytest.fixture(scope="module")
def traced(repo, tmp_path_factory):
    """Send the requests to a traced worker, stop it (its spans are flushed at exit) and hand
    the spans over."""
    tmp = tmp_path_factory.mktemp("traced_server")
    spans = tmp / "spans.jsonl"
    tracing = {"enabled": True, "exporter": "file", "file": str(spans), "service_name": "xlaserve-test",
               "sampling_ratio": 0.0}
    x = np.random.default_rng(3).standard_normal((2, 512)).astype(np.float32)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    with serve(tmp, repo, tracing=tracing,
               listen={"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"}) as server:
        # over REST: the traceparent header is taken as gRPC metadata is
        rest = httpclient.InferenceServerClient(server.rest)
        r = rest.infer("mlp", [rest_input("input", x)], headers={"traceparent": f"00-{REST_TRACE}-{CALLER}-01"},
                       request_id="r-rest")
        np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-4, atol=1e-5)
        rest.close()
        c = grpcclient.InferenceServerClient(server.url)
        headers = {"traceparent": f"00-{TRACE}-{CALLER}-01"}
        r = c.infer("mlp", [infer_input("input", x, "FP32")], headers=headers, request_id="r-mlp")
        np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-4, atol=1e-5)
        pair = [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", a, "INT32")]
        hooks_trace = "1" * 32
        c.infer("hooked", pair, headers={"traceparent": f"00-{hooks_trace}-{CALLER}-01"})
        meta_trace = "2" * 32
        r = c.infer("pipeline", pair, headers={"traceparent": f"00-{meta_trace}-{CALLER}-01"})
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * (a + 1))
        # sampling_ratio 0: without a traceparent, or with an unsampled one, nothing is traced
        c.infer("mlp", [infer_input("input", x, "FP32")])
        c.infer("mlp", [infer_input("input", x, "FP32")], headers={"traceparent": f"00-{'3' * 32}-{CALLER}-00"})
        # a malformed traceparent is ignored: the request is served, and (ratio 0) not traced
        c.infer("mlp", [infer_input("input", x, "FP32")], headers={"traceparent": "00-nonsense"})
        with pytest.raises(InferenceServerException):
            c.infer("no_such_model" + "x" * 2000, [infer_input("input", x, "FP32")],
                    headers={"traceparent": f"00-{'4' * 32}-{CALLER}-01"}, request_id="i" * 5000)
        c.close()
    assert server.process.returncode == 0, server.log()
    return read_spans(spans), {"hooks": hooks_trace, "meta": meta_trace}


def test_one_request_is_one_trace_continued_from_the_callers_traceparent(traced):
    spans, _ = traced
    mine = by_trace(spans, TRACE)
    (root,) = [s for s in mine if s["parent_span_id"] == CALLER]
    assert root["name"] == "xlaserve.infer" and root["kind"] == "SERVER" and root["status"] == "OK"
    assert root["attributes"] == {"rpc.system": "grpc", "rpc.method": "ModelInfer", "xlaserve.model": "mlp",
                                  "xlaserve.request_id": "r-mlp", "xlaserve.model_version": 1,
                                  "rpc.grpc.status_code": 0}
    assert root["resource"]["service.name"] == "xlaserve-test"
    assert root["resource"]["service.instance.id"] == "worker0"
    stages = children(mine, root)
    assert set(stages) == {"xlaserve.admission", "xlaserve.queue", "xlaserve.weights", "xlaserve.execute"}
    assert len(mine) == 5
    for span in stages.values():
        assert within(span, root) and span["kind"] == "INTERNAL" and span["status"] == "OK"
    admission, queue, weights, execute = (stages[f"xlaserve.{n}"] for n in ("admission", "queue", "weights",
                                                                               "execute"))
    assert admission["attributes"] == {"xlaserve.rows": 2}
    # the stages follow one another
    assert admission["end_time_ns"] <= queue["start_time_ns"] <= queue["end_time_ns"] <= weights["start_time_ns"]
    assert weights["end_time_ns"] <= execute["start_time_ns"]
    assert queue["attributes"] == {"xlaserve.model": "mlp", "xlaserve.batch.id": ex_id(execute)}
    assert weights["attributes"]["xlaserve.weights.bytes"] == reference.mlp_weights()["w"].nbytes
    assert weights["attributes"]["xlaserve.weights.outcome"] in ("hit", "miss")
    assert weights["attributes"]["xlaserve.weights.hit"] == (weights["attributes"]["xlaserve.weights.outcome"]
                                                             == "hit")
    ex = execute["attributes"]
    assert (ex["xlaserve.batch.size"], ex["xlaserve.batch.compiled_size"], ex["xlaserve.batch.requests"]) == (2, 2, 1)
    assert ex["xlaserve.batch.id"] == weights["attributes"]["xlaserve.batch.id"]
    assert ex["xlaserve.compute.infer_ns"] > 0


def test_a_rest_request_continues_the_traceparent_header(traced):
    spans, _ = traced
    mine = by_trace(spans, REST_TRACE)
    (root,) = [s for s in mine if s["parent_span_id"] == CALLER]
    assert root["name"] == "xlaserve.infer" and root["status"] == "OK"
    assert root["attributes"]["xlaserve.model"] == "mlp" and root["attributes"]["xlaserve.request_id"] == "r-rest"
    assert set(children(mine, root)) == {"xlaserve.admission", "xlaserve.queue", "xlaserve.weights",
                                         "xlaserve.execute"}


def test_hooks_get_their_own_spans(traced):
    spans, traces = traced
    mine = by_trace(spans, traces["hooks"])
    (root,) = [s for s in mine if s["parent_span_id"] == CALLER]
    stages = children(mine, root)
    assert set(stages) == {"xlaserve.admission", "xlaserve.preprocess", "xlaserve.queue", "xlaserve.weights",
                           "xlaserve.execute", "xlaserve.postprocess"}
    assert stages["xlaserve.preprocess"]["end_time_ns"] <= stages["xlaserve.queue"]["start_time_ns"]
    assert stages["xlaserve.execute"]["end_time_ns"] <= stages["xlaserve.postprocess"]["start_time_ns"]
    # simple has no weights: nothing to copy
    assert stages["xlaserve.weights"]["attributes"]["xlaserve.weights.bytes"] == 0


def test_a_meta_models_sub_calls_are_children_with_their_own_stages(traced):
    spans, traces = traced
    mine = by_trace(spans, traces["meta"])
    (root,) = [s for s in mine if s["parent_span_id"] == CALLER]
    assert root["attributes"]["xlaserve.model"] == "pipeline"
    top = [s for s in mine if s["parent_span_id"] == root["span_id"]]
    assert Counter(s["name"] for s in top) == {"xlaserve.admission": 1, "xlaserve.run": 1, "xlaserve.meta.call": 2}
    calls = sorted((s for s in top if s["name"] == "xlaserve.meta.call"), key=lambda s: s["start_time_ns"])
    assert [c["attributes"]["xlaserve.model"] for c in calls] == ["hooked", "mlp"]
    assert calls[0]["attributes"]["xlaserve.request_id"].endswith("/hooked#1")
    assert set(children(mine, calls[0])) == {"xlaserve.preprocess", "xlaserve.queue", "xlaserve.weights",
                                             "xlaserve.execute", "xlaserve.postprocess"}
    assert set(children(mine, calls[1])) == {"xlaserve.queue", "xlaserve.weights", "xlaserve.execute"}
    run = next(s for s in top if s["name"] == "xlaserve.run")
    for call in calls:
        assert within(call, run) and call["status"] == "OK"


def test_untraced_and_failed_requests(traced):
    spans, traces = traced
    known = {TRACE, REST_TRACE, traces["hooks"], traces["meta"], "4" * 32}
    # ratio 0: the request without a traceparent, the unsampled one and the malformed one made no spans
    assert {s["trace_id"] for s in spans} == known
    (failed,) = by_trace(spans, "4" * 32)
    assert failed["name"] == "xlaserve.infer" and failed["status"] == "ERROR"
    assert failed["status_message"].startswith("NOT_FOUND: ")
    assert failed["attributes"]["rpc.grpc.status_code"] == 5
    # what the client chose is kept bounded in the trace
    assert failed["attributes"]["xlaserve.request_id"] == "i" * 256
    assert failed["attributes"]["xlaserve.model"] == ("no_such_model" + "x" * 2000)[:256]
    assert len(failed["status_message"]) <= 1024


def test_the_gateway_continues_the_trace_and_the_worker_continues_the_gateways(repo, tmp_path):
    spans = tmp_path / "worker-spans.jsonl"
    memory = InMemorySpanExporter()
    settings = parse_gateway_config({"endpoints": ["127.0.0.1:1"], "tracing": {"enabled": True,
                                                                              "sampling_ratio": 0.0}})
    x = np.ones((1, 512), np.float32)
    with ExitStack() as stack:
        worker = stack.enter_context(serve(tmp_path / "w", repo, tracing={"enabled": True, "exporter": "file",
                                                                          "file": str(spans)}))
        gateway = TracedGatewayThread(addresses([worker]), settings, memory)
        stack.callback(gateway.stop)
        gateway.wait_ready(3)
        c = grpcclient.InferenceServerClient(gateway.url)
        c.infer("mlp", [infer_input("input", x, "FP32")], headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
        # gateway ratio 0, no traceparent: not traced at the gateway, and the worker (ratio 1)
        # follows the gateway's "not sampled" rather than deciding on its own
        c.infer("mlp", [infer_input("input", x, "FP32")])
        c.close()
    gateway_spans = memory.get_finished_spans()       # the gateway's tracing closed when it stopped
    (forward,) = gateway_spans
    assert forward.name == "xlaserve.gateway.forward" and forward.kind is SpanKind.CLIENT
    assert forward.context.trace_id == int(TRACE, 16)
    assert forward.parent.span_id == int(CALLER, 16) and forward.parent.is_remote
    assert dict(forward.attributes) == {"rpc.system": "grpc", "rpc.method": "ModelInfer", "xlaserve.model": "mlp",
                                        "xlaserve.worker": "worker0", "rpc.grpc.status_code": 0}
    assert forward.status.status_code is StatusCode.UNSET
    assert forward.resource.attributes["service.instance.id"] == "gateway"
    worker_spans = read_spans(spans)
    assert {s["trace_id"] for s in worker_spans} == {TRACE}
    (root,) = [s for s in worker_spans if s["name"] == "xlaserve.infer"]
    assert root["parent_span_id"] == f"{forward.context.span_id:016x}"
    assert forward.start_time <= root["start_time_ns"] <= root["end_time_ns"] <= forward.end_time + 1_000_000


def test_a_worker_with_tracing_enabled_but_without_the_sdk_serves_untraced(repo, tmp_path):
    # the server's interpreter lacks OpenTelemetry, as when the 'otel' extra is not installed
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['opentelemetry'] = None\n")
    spans = tmp_path / "spans.jsonl"
    x = np.ones((1, 512), np.float32)
    with serve(tmp_path / "w", repo, tracing={"enabled": True, "exporter": "file", "file": str(spans)},
               env={"PYTHONPATH": str(hide)}) as server:
        c = grpcclient.InferenceServerClient(server.url)
        r = c.infer("mlp", [infer_input("input", x, "FP32")], headers={"traceparent": f"00-{TRACE}-{CALLER}-01"})
        np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-4, atol=1e-5)
        c.close()
    assert server.process.returncode == 0, server.log()
    errors = [line for line in server.log().splitlines() if "OpenTelemetry SDK is not installed" in line]
    assert len(errors) == 1 and "pip install 'xlaserve[otel]'" in errors[0], server.log()
    assert not spans.exists()
