"""End to end with the unchanged Triton client: metadata, config, index, statistics, inference on
every example, and bad requests answered precisely while the server keeps serving."""
from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from examples import reference
from tests.conftest import infer_input


def test_server_metadata_and_health(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    assert c.is_server_live() and c.is_server_ready()
    meta = c.get_server_metadata()
    assert meta.name == "xlaserve"
    assert "model_repository" in meta.extensions
    assert example_server.get("/healthz")[0] == 200
    status, body = example_server.get("/readyz")
    assert status == 200 and "READY=4" in body


def test_repository_index_lists_every_example(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    index = {m.name: m for m in c.get_model_repository_index().models}
    assert set(index) == {"simple", "mlp", "img_mean", "cnn"}
    assert all(m.state == "READY" and m.version == "1" for m in index.values())


def test_model_metadata_and_config(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    meta = c.get_model_metadata("img_mean")
    assert meta.inputs[0].name == "input" and meta.inputs[0].datatype == "UINT8"
    assert list(meta.inputs[0].shape) == [-1, 224, 224, 3]
    assert list(meta.outputs[0].shape) == [-1, 1]
    config = c.get_model_config("simple").config
    assert config.max_batch_size == 8
    assert [i.name for i in config.input] == ["INPUT0", "INPUT1"]
    assert list(config.input[0].dims) == [16]
    assert config.input[0].data_type == grpcclient.model_config_pb2.TYPE_INT32 if hasattr(
        grpcclient, "model_config_pb2") else config.input[0].data_type == 8


def test_simple_sum_and_difference_with_request_id(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    a = np.arange(48, dtype=np.int32).reshape(3, 16)
    b = np.full((3, 16), 7, dtype=np.int32)
    r = c.infer("simple", [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", b, "INT32")], request_id="req-42")
    s, d = reference.simple_ref(a, b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), s)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), d)
    assert r.get_response().id == "req-42"


def test_requested_output_subset(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    a = np.ones((1, 16), np.int32)
    r = c.infer("simple", [infer_input("INPUT0", a, "INT32"), infer_input("INPUT1", a, "INT32")],
                outputs=[grpcclient.InferRequestedOutput("OUTPUT1")])
    assert r.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), np.zeros((1, 16), np.int32))


def test_typed_contents_input(example_server):
    """Inputs sent as typed InferTensorContents instead of raw bytes."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc
    import grpc
    channel = grpc.insecure_channel(example_server.url)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    req = service_pb2.ModelInferRequest(model_name="simple")
    for name, value in (("INPUT0", 5), ("INPUT1", 2)):
        t = req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        t.contents.int_contents.extend([value] * 16)
    resp = stub.ModelInfer(req)
    out0 = np.frombuffer(resp.raw_output_contents[0], np.int32)
    assert (out0 == 7).all() and resp.outputs[0].name == "OUTPUT0"
    channel.close()


def test_mlp_matches_reference_every_batch_size(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    rng = np.random.default_rng(3)
    for rows in (1, 3, 17, 32):
        x = rng.standard_normal((rows, 512)).astype(np.float32)
        out = c.infer("mlp", [infer_input("input", x, "FP32")]).as_numpy("output")
        np.testing.assert_allclose(out, reference.mlp_ref(x), rtol=1e-5, atol=1e-5)


def test_img_mean_and_cnn(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    rng = np.random.default_rng(4)
    img = rng.integers(0, 256, (5, 224, 224, 3), dtype=np.uint8)
    out = c.infer("img_mean", [infer_input("input", img, "UINT8")]).as_numpy("output")
    np.testing.assert_allclose(out, reference.img_mean_ref(img), rtol=1e-5)
    small = rng.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    r = c.infer("cnn", [infer_input("input", small, "UINT8")])
    logits, label = reference.cnn_ref(small)
    np.testing.assert_allclose(r.as_numpy("logits"), logits, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(r.as_numpy("label"), label)


def test_a_large_request_is_decoded_from_views_and_a_short_tensor_named(example_server):
    """Past 64 KiB a request's raw tensors are views into the received message (not copies):
    the same answers, and a tensor short of its shape named as before."""
    c = grpcclient.InferenceServerClient(example_server.url)
    img = np.random.default_rng(9).integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
    out = c.infer("img_mean", [infer_input("input", img, "UINT8")], request_id="big").as_numpy("output")
    np.testing.assert_allclose(out, reference.img_mean_ref(img), rtol=1e-5)
    short = grpcclient.InferInput("input", [2, 224, 224, 3], "UINT8")
    short.set_data_from_numpy(img)
    short._raw_content = short._raw_content[:150528]       # one image's bytes for two
    with pytest.raises(InferenceServerException) as info:
        c.infer("img_mean", [short])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "expected 301056 bytes for UINT8[2,224,224,3], got 150528" in info.value.message()


def test_asyncio_client_concurrent_requests(example_server):
    async def main():
        async with aioclient.InferenceServerClient(example_server.url) as c:
            xs = [np.full((1, 512), i / 10, np.float32) for i in range(12)]
            results = await asyncio.gather(*[
                c.infer("mlp", [infer_input("input", x, "FP32", aioclient)]) for x in xs])
            for x, r in zip(xs, results):
                np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-5, atol=1e-5)
    asyncio.run(main())


@pytest.mark.parametrize("case, status, fragment", [
    ("wrong_dtype", "StatusCode.INVALID_ARGUMENT", "expected datatype FP32, got 'INT32'"),
    ("wrong_shape", "StatusCode.INVALID_ARGUMENT", "expected shape [-1,512]"),
    ("byte_size", "StatusCode.INVALID_ARGUMENT", "expected 4096 bytes for FP32[2,512], got 2048"),
    ("unknown_model", "StatusCode.NOT_FOUND",
     "Request for unknown model: 'nope' is not found; model 'nope' is not in the repository"),
    ("unknown_input", "StatusCode.INVALID_ARGUMENT", "unknown input 'bogus'; the model takes 'input' FP32[B,512]"),
    ("too_big_batch", "StatusCode.INVALID_ARGUMENT", "larger than the largest compiled batch size 32"),
    ("unknown_output", "StatusCode.INVALID_ARGUMENT", "unknown output 'nah' requested"),
])
def test_bad_requests_get_precise_errors_and_server_keeps_serving(example_server, case, status, fragment):
    c = grpcclient.InferenceServerClient(example_server.url)
    x = np.zeros((2, 512), np.float32)
    model, inputs, outputs = "mlp", [infer_input("input", x, "FP32")], None
    if case == "wrong_dtype":
        inputs = [infer_input("input", x.astype(np.int32), "INT32")]
    elif case == "wrong_shape":
        inputs = [infer_input("input", np.zeros((2, 256), np.float32), "FP32")]
    elif case == "byte_size":
        t = grpcclient.InferInput("input", [2, 512], "FP32")
        t.set_data_from_numpy(x)
        t._raw_content = t._raw_content[:2048]  # what a buggy client would send
        inputs = [t]
    elif case == "unknown_model":
        model = "nope"
    elif case == "unknown_input":
        inputs = [infer_input("bogus", x, "FP32")]
    elif case == "too_big_batch":
        inputs = [infer_input("input", np.zeros((33, 512), np.float32), "FP32")]
    elif case == "unknown_output":
        outputs = [grpcclient.InferRequestedOutput("nah")]
    with pytest.raises(InferenceServerException) as info:
        c.infer(model, inputs, outputs=outputs)
    assert info.value.status() == status
    assert fragment in info.value.message()
    # ...and the server keeps serving
    ok = c.infer("mlp", [infer_input("input", np.zeros((1, 512), np.float32), "FP32")])
    assert ok.as_numpy("output").shape == (1, 512)


def test_an_unknown_model_with_a_long_name_is_not_found_for_the_triton_client(example_server):
    """Its message echoes the name: uncut, its trailers passed the 8 KiB gRPC's C core accepts,
    and the client saw RESOURCE_EXHAUSTED ("received metadata size exceeds soft limit")."""
    c = grpcclient.InferenceServerClient(example_server.url)
    with pytest.raises(InferenceServerException) as info:
        c.get_model_metadata("x" * 20_000)
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert info.value.message().startswith("Request for unknown model: 'xxxx")
    assert "characters cut" in info.value.message()
    assert c.is_model_ready("mlp")


def test_statistics_count_requests_and_executions(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    before = c.get_inference_statistics("cnn").model_stats[0]
    img = np.zeros((2, 32, 32, 3), np.uint8)
    for _ in range(3):
        c.infer("cnn", [infer_input("input", img, "UINT8")])
    after = c.get_inference_statistics("cnn").model_stats[0]
    assert after.inference_count - before.inference_count == 6
    assert after.execution_count - before.execution_count == 3
    assert after.inference_stats.success.count - before.inference_stats.success.count == 3
    assert after.inference_stats.compute_infer.ns > before.inference_stats.compute_infer.ns
    assert any(b.batch_size == 4 for b in after.batch_stats)  # 2 rows padded to compiled size 4


def test_unsupported_rpc_answers_unimplemented(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    with pytest.raises(InferenceServerException) as info:
        c.update_log_settings({"log_verbose_level": 1})
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "LogSettings" in info.value.message()


def test_metrics_endpoint_counts_requests(example_server):
    c = grpcclient.InferenceServerClient(example_server.url)
    c.infer("mlp", [infer_input("input", np.zeros((1, 512), np.float32), "FP32")])
    status, body = example_server.get("/metrics")
    assert status == 200
    assert 'xlaserve_requests_total{model="mlp",status="OK"}' in body
    assert "xlaserve_request_duration_seconds_bucket" in body
    # requests for models the worker does not have share one label: one per name a client sent
    # would let any client grow /metrics without bound
    for name in ("nope-1", "nope-2", "nope-3"):
        with pytest.raises(InferenceServerException):
            c.infer(name, [infer_input("input", np.zeros((1, 512), np.float32), "FP32")])
    body = example_server.get("/metrics")[1]
    assert "nope-" not in body
    unknown = re.search(r'^xlaserve_requests_total\{model="",status="NOT_FOUND"\} (\S+)$', body, re.M)
    assert unknown is not None and float(unknown.group(1)) >= 3, body


@pytest.mark.parametrize("call", ["infer", "get_model_metadata", "get_model_config", "get_inference_statistics"])
def test_unknown_model_is_answered_in_tritons_words(example_server, call):
    """Triton's example clients check that the message starts with (or contains) "Request for
    unknown model"; xlaserve's own explanation follows Triton's sentence."""
    c = grpcclient.InferenceServerClient(example_server.url)
    args = [[infer_input("input", np.zeros((1, 512), np.float32), "FP32")]] if call == "infer" else []
    with pytest.raises(InferenceServerException) as info:
        getattr(c, call)("nope", *args)
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert info.value.message() == ("Request for unknown model: 'nope' is not found; model 'nope' is not in the "
                                    "repository (known models: cnn, img_mean, mlp, simple)")
