"""REST through the gateway: ``xlaserve run`` on a two-worker node with ``listen.rest``; the
embedded gateway serves REST and routes each request to a worker over gRPC; the unchanged
``tritonclient.http`` client sees one server."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from benchmarks._servers import consecutive_free_pair, free_ports
from examples import reference
from tests.conftest import serve


def test_the_embedded_gateway_serves_rest_and_routes_it_to_the_workers(examples_repo, tmp_path):
    grpc0, grpc1 = free_ports(2)
    http0 = consecutive_free_pair()
    with serve(tmp_path, examples_repo, workers=[{"name": "a", "port": grpc0}, {"name": "b", "port": grpc1}],
               metrics_base_port=http0,
               listen={"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"}) as node:
        assert node.rest_port is not None
        c = httpclient.InferenceServerClient(node.rest)
        assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("simple")
        assert c.get_server_metadata()["name"] == "xlaserve"
        assert c.get_model_metadata("mlp")["inputs"][0]["shape"] == [-1, 512]
        assert c.get_model_config("simple")["max_batch_size"] == 8
        assert {m["name"] for m in c.get_model_repository_index()} == {"simple", "mlp", "img_mean", "cnn"}
        x = np.random.default_rng(5).standard_normal((2, 512)).astype(np.float32)
        for binary in (True, False):
            t = httpclient.InferInput("input", [2, 512], "FP32")
            t.set_data_from_numpy(x, binary_data=binary)
            r = c.infer("mlp", [t], outputs=[httpclient.InferRequestedOutput("output", binary_data=binary)])
            np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-4, atol=1e-5)
        a = np.arange(32, dtype=np.int32).reshape(2, 16)
        inputs = [httpclient.InferInput("INPUT0", [2, 16], "INT32"), httpclient.InferInput("INPUT1", [2, 16], "INT32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a, binary_data=False)
        for _ in range(4):       # round robin: both workers answer
            np.testing.assert_array_equal(c.infer("simple", inputs).as_numpy("OUTPUT0"), a + a)
        stats = c.get_inference_statistics("simple")["model_stats"]
        assert sum(s["inference_count"] for s in stats) >= 4
        try:
            c.get_model_metadata("nope")
            raise AssertionError("expected an error")
        except InferenceServerException as exc:
            assert exc.status() == "404" and "nope" in exc.message()
        body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 15},
                                      {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]})
        request = urllib.request.Request(f"http://{node.rest}/v2/models/simple/infer", data=body.encode())
        try:
            urllib.request.urlopen(request, timeout=30)
            raise AssertionError("expected 400")
        except urllib.error.HTTPError as exc:
            assert exc.code == 400
            assert "input 'INPUT0': 'data' has 15 elements" in json.loads(exc.read())["error"]
        c.close()
    assert node.process.returncode == 0, node.log()
