"""End to end over REST (``listen.rest``): the unchanged ``tritonclient.http`` client (the calls of
NVIDIA's simple_http_* examples), plain HTTP/1.1 JSON as curl sends it, Triton's binary tensor
data with JSON and binary tensors mixed, errors with Triton's status codes, and attacks on the
HTTP/1.1 port: the offender is closed, the others are served."""
from __future__ import annotations

import gzip
import http.client
import json
import socket
import uuid

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aiohttpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from examples import reference
from tests.conftest import serve


@pytest.fixture(scope="module")
def rest_server(examples_repo, tmp_path_factory):
    with serve(tmp_path_factory.mktemp("rest_server"), examples_repo,
               {"endpoints": {"allow_client_shm": True, "max_recv_msg_bytes": 4 * 1024 * 1024}},
               listen={"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"}) as server:
        yield server
    assert server.process.returncode == 0, server.log()


def _client(server) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.rest)


def _post(server, path: str, body: bytes | str | dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
    if isinstance(body, dict):
        body = json.dumps(body)
    conn = http.client.HTTPConnection("127.0.0.1", server.rest_port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def _get(server, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.rest_port, timeout=30)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def _simple_inputs(binary0: bool = True, binary1: bool = True, rows: int = 1):
    a = np.arange(16 * rows, dtype=np.int32).reshape(rows, 16)
    b = np.full((rows, 16), 3, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [rows, 16], "INT32"), httpclient.InferInput("INPUT1", [rows, 16], "INT32")]
    inputs[0].set_data_from_numpy(a, binary_data=binary0)
    inputs[1].set_data_from_numpy(b, binary_data=binary1)
    return a, b, inputs


# ---- tritonclient.http --------------------------------------------------------------------------

def test_health_and_metadata_as_simple_http_health_metadata(rest_server):
    c = _client(rest_server)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("simple") and c.is_model_ready("simple", "1")
    assert not c.is_model_ready("no_such_model")
    meta = c.get_server_metadata()
    assert meta["name"] == "xlaserve" and "binary_tensor_data" in meta["extensions"]
    model = c.get_model_metadata("img_mean")
    assert model["inputs"] == [{"name": "input", "datatype": "UINT8", "shape": [-1, 224, 224, 3]}]
    assert model["versions"] == ["1"]
    config = c.get_model_config("simple")
    assert config["max_batch_size"] == 8 and [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert config["input"][0]["dims"] == [16] and config["input"][0]["data_type"] == "TYPE_INT32"
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert set(index) == {"simple", "mlp", "img_mean", "cnn"} and index["mlp"]["state"] == "READY"
    with pytest.raises(InferenceServerException, match="no_such_model"):
        c.get_model_metadata("no_such_model")


@pytest.mark.parametrize("binary0,binary1,binary_out", [(True, True, True), (False, False, False),
                                                        (True, False, False), (False, True, True)])
def test_simple_infer_binary_json_and_mixed(rest_server, binary0, binary1, binary_out):
    c = _client(rest_server)
    a, b, inputs = _simple_inputs(binary0, binary1, rows=3)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0", binary_data=binary_out),
               httpclient.InferRequestedOutput("OUTPUT1", binary_data=not binary_out)]
    r = c.infer("simple", inputs, outputs=outputs, request_id="rest-7")
    s, d = reference.simple_ref(a, b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), s)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), d)
    response = r.get_response()
    assert response["id"] == "rest-7" and response["model_name"] == "simple"
    out0 = next(o for o in response["outputs"] if o["name"] == "OUTPUT0")
    assert ("binary_data_size" in out0.get("parameters", {})) == binary_out
    assert ("data" in out0) == (not binary_out)


def test_repeated_binary_requests_are_answered_from_views_of_their_bodies(rest_server):
    """The same binary header again (no id): its translation comes from the cache and the
    tensors reach the worker as views into each request's own body; every answer is its own."""
    c = _client(rest_server)
    rng = np.random.default_rng(27)
    for _ in range(3):
        img = rng.integers(0, 256, (2, 224, 224, 3), dtype=np.uint8)
        t = httpclient.InferInput("input", [2, 224, 224, 3], "UINT8")
        t.set_data_from_numpy(img, binary_data=True)
        r = c.infer("img_mean", [t], outputs=[httpclient.InferRequestedOutput("output", binary_data=True)])
        np.testing.assert_allclose(r.as_numpy("output"), reference.img_mean_ref(img), rtol=1e-5)


def test_output_selection_and_statistics(rest_server):
    c = _client(rest_server)
    a, b, inputs = _simple_inputs()
    before = c.get_inference_statistics("simple")["model_stats"][0]["inference_count"]
    r = c.infer("simple", inputs, outputs=[httpclient.InferRequestedOutput("OUTPUT1")])
    assert r.as_numpy("OUTPUT0") is None
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    stats = c.get_inference_statistics("simple")["model_stats"][0]
    assert stats["inference_count"] == before + 1
    assert stats["inference_stats"]["success"]["count"] >= 1
    # every model's (GET /v2/models/stats, as Triton routes it): this was model_metadata of a
    # model named 'stats', 404
    every = {m["name"]: m for m in c.get_inference_statistics()["model_stats"]}
    assert {"simple", "mlp", "cnn", "img_mean"} <= set(every)
    assert every["simple"]["inference_count"] == before + 1


def test_mlp_fp32_with_compression_both_ways(rest_server):
    c = _client(rest_server)
    x = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    t = httpclient.InferInput("input", [4, 512], "FP32")
    t.set_data_from_numpy(x)
    for request_algorithm, response_algorithm in (("gzip", "deflate"), ("deflate", "gzip")):
        r = c.infer("mlp", [t], request_compression_algorithm=request_algorithm,
                    response_compression_algorithm=response_algorithm)
        np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-4, atol=1e-5)


def test_async_infer_as_simple_http_async_infer_client(rest_server):
    c = httpclient.InferenceServerClient(rest_server.rest, concurrency=8)
    pending = []
    for i in range(16):
        a, b, inputs = _simple_inputs(rows=1 + i % 4)
        pending.append((a, b, c.async_infer("simple", inputs)))
    for a, b, handle in pending:
        r = handle.get_result()
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    c.close()


def test_aio_client(rest_server):
    import asyncio

    async def main():
        async with aiohttpclient.InferenceServerClient(rest_server.rest) as c:
            assert await c.is_server_ready()
            a, b, _ = _simple_inputs()
            inputs = [aiohttpclient.InferInput("INPUT0", [1, 16], "INT32"),
                      aiohttpclient.InferInput("INPUT1", [1, 16], "INT32")]
            inputs[0].set_data_from_numpy(a)
            inputs[1].set_data_from_numpy(b, binary_data=False)
            r = await c.infer("simple", inputs)
            np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    asyncio.run(main())


def test_system_shared_memory_as_simple_http_shm_client(rest_server):
    c = _client(rest_server)
    c.unregister_system_shared_memory()
    c.unregister_cuda_shared_memory()
    tag = uuid.uuid4().hex[:8]
    a, b, _ = _simple_inputs()
    handles = []
    try:
        ins = shm.create_shared_memory_region(f"in_{tag}", f"/xls_rest_in_{tag}", 128)
        outs = shm.create_shared_memory_region(f"out_{tag}", f"/xls_rest_out_{tag}", 128)
        handles = [ins, outs]
        shm.set_shared_memory_region(ins, [a, b])
        c.register_system_shared_memory(f"in_{tag}", f"/xls_rest_in_{tag}", 128)
        c.register_system_shared_memory(f"out_{tag}", f"/xls_rest_out_{tag}", 128)
        status = {r["name"]: r for r in c.get_system_shared_memory_status()}
        assert status[f"in_{tag}"]["byte_size"] == 128
        inputs = [httpclient.InferInput("INPUT0", [1, 16], "INT32"), httpclient.InferInput("INPUT1", [1, 16], "INT32")]
        inputs[0].set_shared_memory(f"in_{tag}", 64)
        inputs[1].set_shared_memory(f"in_{tag}", 64, offset=64)
        outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
        outputs[0].set_shared_memory(f"out_{tag}", 64)
        outputs[1].set_shared_memory(f"out_{tag}", 64, offset=64)
        r = c.infer("simple", inputs, outputs=outputs)
        out0 = r.get_output("OUTPUT0")
        assert out0["parameters"]["shared_memory_region"] == f"out_{tag}"
        got = shm.get_contents_as_numpy(outs, np.int32, [1, 16], offset=0)
        np.testing.assert_array_equal(got, a + b)
        got = shm.get_contents_as_numpy(outs, np.int32, [1, 16], offset=64)
        np.testing.assert_array_equal(got, a - b)
        c.unregister_system_shared_memory(f"in_{tag}")
        assert f"in_{tag}" not in {r["name"] for r in c.get_system_shared_memory_status()}
    finally:
        c.unregister_system_shared_memory()
        for h in handles:
            shm.destroy_shared_memory_region(h)


def test_model_control_in_static_mode_says_why(rest_server):
    c = _client(rest_server)
    with pytest.raises(InferenceServerException, match="model_control_mode is static") as info:
        c.unload_model("simple")
    assert info.value.status() == "400"
    assert c.is_model_ready("simple")


# ---- JSON as curl sends it --------------------------------------------------------------------

def _simple_json(data0, data1=None, shape=(1, 16), **extra) -> dict:
    data1 = data1 if data1 is not None else [1] * 16
    return {"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": list(shape), "data": data0},
                       {"name": "INPUT1", "datatype": "INT32", "shape": list(shape), "data": data1}], **extra}


def test_json_nested_and_flat_data_with_parameters_and_outputs(rest_server):
    nested = [list(range(16)), list(range(16, 32))]
    status, headers, body = _post(rest_server, "/v2/models/simple/versions/1/infer", _simple_json(
        nested, [2] * 32, shape=(2, 16), id="j1", parameters={"timeout": 10_000_000},
        outputs=[{"name": "OUTPUT0"}]))
    assert status == 200, body
    doc = json.loads(body)
    assert doc["id"] == "j1" and doc["model_version"] == "1"
    assert [o["name"] for o in doc["outputs"]] == ["OUTPUT0"]
    assert doc["outputs"][0]["shape"] == [2, 16]
    assert doc["outputs"][0]["data"] == [v + 2 for v in range(32)]
    assert headers["content-type"] == "application/json"


def test_json_binary_output_parameter_and_mixed_binary_body(rest_server):
    # INPUT0 as binary after the JSON header, INPUT1 as JSON; every output binary
    a = np.arange(16, dtype=np.int32)
    header = json.dumps({"inputs": [
        {"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "parameters": {"binary_data_size": 64}},
        {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [5] * 16}],
        "parameters": {"binary_data_output": True}}).encode()
    status, headers, body = _post(rest_server, "/v2/models/simple/infer", header + a.tobytes(),
                                  {"Inference-Header-Content-Length": str(len(header))})
    assert status == 200, body
    n = int(headers["inference-header-content-length"])
    doc = json.loads(body[:n])
    assert [o["parameters"]["binary_data_size"] for o in doc["outputs"]] == [64, 64]
    np.testing.assert_array_equal(np.frombuffer(body[n:n + 64], np.int32), a + 5)
    np.testing.assert_array_equal(np.frombuffer(body[n + 64:], np.int32), a - 5)


@pytest.mark.parametrize("body,status,message", [
    (_simple_json([1] * 15), 400, "input 'INPUT0': 'data' has 15 elements, INT32[1,16] needs 16"),
    (_simple_json([1.5] * 16), 400, "input 'INPUT0': INT32 'data' holds integers, got non-integer numbers"),
    (_simple_json([1] * 16, [2 ** 40] * 16), 400, "input 'INPUT1': a value in 'data' does not fit INT32"),
    (_simple_json([1] * 32, [1] * 32, shape=(2, 8, 2)), 400, "input 'INPUT0': expected shape [-1,16]"),
    ({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": [1] * 16}]}, 400,
     "input 'INPUT0': expected datatype INT32, got 'FP32'"),
    ({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]}, 400,
     "missing input(s) 'INPUT1'"),
    (_simple_json([1] * 16, outputs=[{"name": "OUTPUT9"}]), 400, "unknown output 'OUTPUT9'"),
    ("{not json", 400, "the inference request is not valid JSON"),
    (_simple_json([1] * 16, parameters={"timeout": "soon"}), 400, "parameter 'timeout' must be an integer"),
])
def test_json_errors_name_the_field(rest_server, body, status, message):
    got, _, text = _post(rest_server, "/v2/models/simple/infer", body)
    assert got == status, text
    assert message in json.loads(text)["error"]


@pytest.mark.parametrize("body", [
    {"raw_handle": {"b64": "AAAA"}, "device_id": 0, "byte_size": 64},
    {"device_id": 0, "byte_size": -5},                  # was 500: protobuf's ValueError
    {"device_id": 2 ** 63, "byte_size": 64},            # past int64: was 500
    {"device_id": -1, "byte_size": 2 ** 64 - 1},
    {"device_id": "0", "byte_size": 64.5},
])
def test_cuda_shared_memory_register_is_503_whatever_its_numbers(rest_server, body):
    status, _, text = _post(rest_server, "/v2/cudasharedmemory/region/c/register", body)
    assert status == 503, text
    assert "CUDA shared memory is not available" in json.loads(text)["error"]


def test_unknown_model_route_and_method(rest_server):
    status, _, body = _post(rest_server, "/v2/models/nope/infer", _simple_json([1] * 16))
    assert status == 404 and "nope" in json.loads(body)["error"]
    status, body = _get(rest_server, "/v2/models/simple/infer")
    assert status == 405 and "POST" in json.loads(body)["error"]
    status, body = _get(rest_server, "/v3")
    assert status == 404
    status, body = _get(rest_server, "/v2/models/nope/ready")
    assert status == 400


def test_gzip_body_that_inflates_past_the_limit_is_413(rest_server):
    bomb = gzip.compress(b"\0" * (5 * 1024 * 1024))
    status, _, body = _post(rest_server, "/v2/models/simple/infer", bomb, {"Content-Encoding": "gzip"})
    assert status == 413 and "inflates past" in json.loads(body)["error"]
    assert _client(rest_server).is_server_live()


# ---- attacks on the HTTP/1.1 port ------------------------------------------------------------

def test_a_coding_the_client_gives_q_0_is_never_sent(rest_server):
    """RFC 9110 quality values through the real server: 'GZIP;Q=0, identity' got a gzip body
    (the q was read only in lower case) and 'deflate;q=0.1, gzip;q=0.9' a deflate one (the
    first coding listed won, whatever its q)."""
    def get(accept: str) -> tuple[str | None, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", rest_server.rest_port, timeout=30)
        try:
            conn.request("GET", "/v2/models/stats", headers={"Accept-Encoding": accept})
            r = conn.getresponse()
            assert r.status == 200
            return r.getheader("content-encoding"), r.read()
        finally:
            conn.close()
    coding, plain = get("identity")
    assert coding is None and len(plain) >= 1024       # large enough to be compressed when accepted
    assert json.loads(plain)["model_stats"]
    coding, body = get("GZIP;Q=0, identity")
    assert coding is None and json.loads(body)["model_stats"]
    coding, body = get("deflate;q=0.1, gzip;q=0.9")
    assert coding == "gzip" and json.loads(gzip.decompress(body))["model_stats"]


def _raw(server, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", server.rest_port), timeout=10) as s:
        s.sendall(data)
        if not read:
            return b""
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_attacks_close_the_offender_and_others_are_served(rest_server):
    c = _client(rest_server)
    # oversized header block: 431 and closed
    reply = _raw(rest_server, b"GET /v2 HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20000 + b"\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 431")
    # too many header fields
    reply = _raw(rest_server, b"GET /v2 HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(150))
                 + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 431") and b"header fields" in reply
    # a body larger than max_recv_msg_bytes, refused by its Content-Length before it is sent
    reply = _raw(rest_server, b"POST /v2/models/simple/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 99999999\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 413") and b"max_recv_msg_bytes" in reply
    # chunked abuse: a chunk size that is not hex
    reply = _raw(rest_server, b"POST /v2/models/simple/infer HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                              b"zz\r\nhello\r\n0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400")
    # a Content-Length that says less than is sent: the rest is read as the next request, which is garbage
    body = json.dumps(_simple_json([1] * 16)).encode()
    reply = _raw(rest_server, b"POST /v2/models/simple/infer HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n" + body)
    assert reply.startswith(b"HTTP/1.1 400") and reply.count(b"HTTP/1.1 400") == 2
    # not HTTP at all
    assert _raw(rest_server, b"\x16\x03\x01\x02\x00garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert c.is_server_live() and c.is_model_ready("simple")


def test_pipelined_requests_are_answered_in_order(rest_server):
    one = b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\nGET /v2 HTTP/1.1\r\nhost: x\r\n\r\n"
    last = b"GET /v2/models/simple HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
    reply = _raw(rest_server, one * 50 + last)
    assert reply.count(b"HTTP/1.1 200") == 101
    assert reply.rstrip().endswith(b"}") and b'"name":"simple"' in reply.rsplit(b"HTTP/1.1", 1)[1]


def test_many_idle_connections_do_not_stop_the_others(rest_server):
    idle = [socket.create_connection(("127.0.0.1", rest_server.rest_port)) for _ in range(300)]
    try:
        c = _client(rest_server)
        a, b, inputs = _simple_inputs()
        np.testing.assert_array_equal(c.infer("simple", inputs).as_numpy("OUTPUT0"), a + b)
    finally:
        for s in idle:
            s.close()
