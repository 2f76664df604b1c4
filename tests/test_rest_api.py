"""The REST routes over a grpclib-shaped service, without sockets: statuses, endpoints.restricted,
a gateway's raw-bytes handlers, and what a request is translated into."""
from __future__ import annotations

import json
from types import SimpleNamespace

import trio
import trio.testing
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.frontend.access import AccessPolicy
from xlaserve.frontend.http1 import HttpRequest
from xlaserve.frontend.rest_api import RestApi
from xlaserve.gateway.service import RawMessage

SERVICE = "/inference.GRPCInferenceService/"
RPCS = ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelConfig",
        "ModelStatistics", "ModelInfer", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
        "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
        "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister", "TraceSetting",
        "LogSettings", "ModelStreamInfer")


class Fake:
    """Records what each RPC received; ModelInfer echoes INPUT0 as OUTPUT0; ``raw``: the
    handlers take and give serialized bytes, as the gateway's do."""

    def __init__(self, raw: bool = False) -> None:
        self.raw = raw
        self.seen: list[tuple[str, object, object]] = []

    def __mapping__(self):
        def handler(name):
            async def run(stream):
                request = await stream.recv_message()
                if self.raw:
                    assert isinstance(request, RawMessage)
                    request = getattr(pb, f"{name}Request").FromString(request.data)
                self.seen.append((name, request, stream.peer))
                if name == "ModelMetadata" and request.name == "missing":
                    raise GRPCError(Status.NOT_FOUND, "Request for unknown model: 'missing' is not found")
                if name == "ModelInfer":
                    reply = pb.ModelInferResponse(model_name=request.model_name, model_version="3", id=request.id)
                    reply.outputs.add(name="OUTPUT0", datatype="INT32", shape=list(request.inputs[0].shape))
                    reply.raw_output_contents.append(request.raw_input_contents[0])
                elif name == "ServerReady":
                    reply = pb.ServerReadyResponse(ready=False)
                elif name == "ServerLive":
                    reply = pb.ServerLiveResponse(live=True)
                else:
                    reply = getattr(pb, f"{name}Response")()
                await stream.send_message(RawMessage(reply.SerializeToString()) if self.raw else reply)
            request_type = RawMessage if self.raw else getattr(pb, f"{name}Request", None)
            return Handler(run, Cardinality.UNARY_UNARY, request_type, None)
        return {SERVICE + name: handler(name) for name in RPCS}


def call(api, method, path, body=b"", headers=None):
    request = HttpRequest(method, path, "", headers or {}, body, "127.0.0.1")
    return trio.run(api, request)


def test_infer_is_translated_to_model_infer_and_back_for_raw_and_typed_handlers():
    for raw in (False, True):
        fake = Fake(raw)
        api = RestApi(fake)
        body = json.dumps({"id": "q", "inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [2],
                                                  "data": [7, 8]}], "parameters": {"timeout": 99}}).encode()
        response = call(api, "POST", "/v2/models/m%2Fx/versions/3/infer", body, {"x-trace": "t"})
        assert response.status == 200
        assert json.loads(response.body)["outputs"][0]["data"] == [7, 8]
        name, request, peer = fake.seen[-1]
        assert (name, request.model_name, request.model_version, request.id) == ("ModelInfer", "m/x", "3", "q")
        assert request.parameters["timeout"].int64_param == 99 and peer == "127.0.0.1"


def test_statuses_follow_the_grpc_status_and_readiness_is_200_or_400():
    api = RestApi(Fake())
    live, ready = call(api, "GET", "/v2/health/live"), call(api, "GET", "/v2/health/ready")
    # the body too, as KServe's server writes it: KServe's InferenceRESTClient reads it
    assert (live.status, json.loads(live.body), live.content_type) == (200, {"live": True}, "application/json")
    assert (ready.status, json.loads(ready.body)) == (400, {"ready": False})
    missing = call(api, "GET", "/v2/models/missing")
    assert missing.status == 404 and json.loads(missing.body) == {
        "error": "Request for unknown model: 'missing' is not found"}
    wrong = call(api, "DELETE", "/v2/models/m")
    assert wrong.status == 405 and ("allow", "GET") in wrong.headers
    assert call(api, "HEAD", "/v2").status == 200
    bad = call(api, "POST", "/v2/repository/index", b"[1]")
    assert bad.status == 400 and "must be a JSON object" in json.loads(bad.body)["error"]


def test_restricted_groups_need_their_header_over_rest_too():
    policy = AccessPolicy.from_config([SimpleNamespace(groups=("model-repository", "inference"),
                                                       header="x-admin", value="s3cret")])
    fake = Fake()
    api = RestApi(fake, policy)
    denied = call(api, "POST", "/v2/repository/models/m/unload")
    assert denied.status == 403
    message = json.loads(denied.body)["error"]
    assert "'model-repository' API group is restricted" in message and "x-admin" in message and "s3cret" not in message
    assert call(api, "POST", "/v2/repository/models/m/unload", headers={"x-admin": "wrong"}).status == 403
    assert call(api, "POST", "/v2/repository/models/m/unload", headers={"x-admin": "s3cret"}).status == 200
    assert call(api, "GET", "/v2/models/m").status == 200            # metadata is not restricted
    assert [name for name, _, _ in fake.seen] == ["RepositoryModelUnload", "ModelMetadata"]


def test_a_response_past_the_send_limit_is_429_naming_the_key():
    api = RestApi(Fake(), max_send_bytes=100)
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [64], "data": [1] * 64}],
                       "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    response = call(api, "POST", "/v2/models/m/infer", body)
    assert response.status == 429
    assert "endpoints.max_send_msg_bytes) is 100" in json.loads(response.body)["error"]


def test_json_past_its_limit_is_413_before_it_is_parsed_and_binary_data_does_not_count():
    # a parse costs about 13x the JSON's size and holds the worker's thread: a 256 MiB body of
    # numbers (the body limit) would take ~3.4 GB and seconds
    fake = Fake()
    api = RestApi(fake, max_json_bytes=2048)
    doc = {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1000], "data": [1] * 1000}]}
    body = json.dumps(doc).encode()
    refused = call(api, "POST", "/v2/models/m/infer", body)
    assert refused.status == 413 and json.loads(refused.body)["error"].startswith(
        f"the inference request's JSON is {len(body)} bytes, the limit (endpoints.rest_max_json_bytes) is 2048; "
        "send large tensors as binary data")
    header = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [600],
                                     "parameters": {"binary_data_size": 2400}}]}).encode()
    served = call(api, "POST", "/v2/models/m/infer", header + bytes(2400), {"inference-header-content-length":
                                                                          str(len(header))})
    assert served.status == 200         # 2,400 bytes of binary data past a small header
    big = call(api, "POST", "/v2/repository/index", b" " * 3000 + b"{}")
    assert big.status == 413 and "the request's JSON is 3002 bytes" in json.loads(big.body)["error"]
    assert [name for name, _, _ in fake.seen] == ["ModelInfer"]


def test_a_load_with_a_configuration_override_is_refused_not_ignored():
    fake = Fake()
    api = RestApi(fake)
    refused = call(api, "POST", "/v2/repository/models/m/load", b'{"parameters": {"config": "{\\"max_batch_size\\": 16}"}}')
    assert refused.status == 400 and "does not override a model's configuration" in json.loads(refused.body)["error"]
    assert call(api, "POST", "/v2/repository/models/m/load", b"").status == 200
    malformed = call(api, "POST", "/v2/repository/models/m/load", b'{"parameters": [1]}')      # was loaded, 200
    assert malformed.status == 400 and json.loads(malformed.body)["error"] == (
        "the load request's 'parameters' must be a JSON object of parameter names, got an array")
    assert [name for name, _, _ in fake.seen] == ["RepositoryModelLoad"]


def test_a_cancelled_rest_inference_aborts_the_request_through_the_task_free_entry():
    aborted = []

    class Slow(Fake):
        def __fast_unary__(self):
            def infer_now(call, request):
                call.on_cancel = lambda: aborted.append(request.model_name)
            return {SERVICE + "ModelInfer": infer_now}

    api = RestApi(Slow())
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1], "data": [1]}]}).encode()

    async def main():
        with trio.move_on_after(5):     # the HTTP client went away meanwhile
            await api(HttpRequest("POST", "/v2/models/slow/infer", "", {}, body, None))
        assert aborted == ["slow"]
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
