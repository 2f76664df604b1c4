"""End to end over REST with KServe's own client: ``kserve.InferenceRESTClient`` (the ``kserve``
package of the test extra), unchanged, against a real worker's ``listen.rest`` and through the
gateway's REST port in front of it: health, model readiness, inference with JSON and binary
tensors (as an ``InferRequest`` and as a plain dict), and the errors as the client raises them.

The client runs in its own process (tests/kserve_rest_client.py says why: ``kserve`` and
``tritonclient.grpc`` cannot share an interpreter); this test gives it the inputs and checks
what it got against the reference models."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from examples import reference
from tests.conftest import ROOT, serve
from tests.test_gateway_e2e import RestGatewayThread, addresses, config

CLIENT = ROOT / "tests" / "kserve_rest_client.py"


@pytest.fixture(scope="module")
def worker(examples_repo, tmp_path_factory):
    with serve(tmp_path_factory.mktemp("kserve_rest_worker"), examples_repo,
               listen={"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"}) as server:
        yield server
    assert server.process.returncode == 0, server.log()


def _plan() -> tuple[np.ndarray, np.ndarray, dict]:
    x = np.random.default_rng(27).standard_normal((3, 512)).astype(np.float32)
    a = np.arange(32, dtype=np.int32).reshape(2, 16) - 7
    return x, a, {"mlp": x.tolist(), "simple": a.tolist()}


def _run_kserve_client(base_url: str, plan: dict) -> dict:
    done = subprocess.run([sys.executable, str(CLIENT), base_url], input=json.dumps(plan), capture_output=True,
                          text=True, timeout=180, cwd=ROOT)
    assert done.returncode == 0, (f"KServe's client failed against {base_url} (the kserve package comes with the "
                                  f"test extra: pip install -e '.[test]'):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def _check(got: dict, x: np.ndarray, a: np.ndarray, base_url: str, unknown_model_message: str) -> None:
    assert got["live"] is True and got["ready"] is True
    assert got["model_ready"] == {"mlp": True, "simple": True, "nope": False}
    expected = reference.mlp_ref(x)
    for binary in ("false", "true"):
        response = got[f"mlp_binary_{binary}"]
        assert response["model_name"] == "mlp" and response["id"] == f"kserve-{binary.title()}"
        output = response["outputs"]["output"]
        assert output["datatype"] == "FP32" and output["shape"] == [3, 512]
        np.testing.assert_allclose(np.asarray(output["data"], np.float32), expected, rtol=1e-4, atol=1e-5)
    # only the output asked for, sent as binary data after the JSON (its length in the header)
    simple = got["simple"]
    assert simple["id"] == "kserve-simple" and list(simple["outputs"]) == ["OUTPUT1"]
    np.testing.assert_array_equal(simple["outputs"]["OUTPUT1"], a - 1)
    assert simple["content_type"] == "application/octet-stream" and int(simple["json_length"]) > 0
    s, d = reference.simple_ref(a, np.full_like(a, 2))
    np.testing.assert_array_equal(got["simple_dict"]["OUTPUT0"], s)
    np.testing.assert_array_equal(got["simple_dict"]["OUTPUT1"], d)
    # errors: httpx.HTTPStatusError with the HTTP status, and the server's message in the client's text
    errors = got["errors"]
    assert errors["unknown_model"]["type"] == "HTTPStatusError" and errors["unknown_model"]["status"] == 404
    assert errors["unknown_model"]["message"].startswith(unknown_model_message)
    assert f"'404 Not Found' for url '{base_url}/v2/models/nope/infer'" in errors["unknown_model"]["message"]
    assert errors["wrong_shape"]["status"] == 400
    assert errors["wrong_shape"]["message"].startswith(
        "input 'input': expected shape [-1,512] (-1: any batch size), got [2,7], '400 Bad Request'")


def test_kserves_rest_client_against_a_worker(worker):
    x, a, plan = _plan()
    base_url = f"http://{worker.rest}"
    got = _run_kserve_client(base_url, plan)
    _check(got, x, a, base_url, "Request for unknown model: 'nope' is not found; model 'nope' is not in the "
                                "repository (known models: cnn, img_mean, mlp, simple)")


def test_kserves_rest_client_through_the_gateway(worker):
    g = RestGatewayThread(addresses([worker]), config("round_robin"))
    try:
        g.wait_ready(models=4)
        x, a, plan = _plan()
        base_url = f"http://127.0.0.1:{g.gateway.rest_port}"
        got = _run_kserve_client(base_url, plan)
        _check(got, x, a, base_url, "model 'nope' is not served by any worker (worker0: not in its repository); "
                                    "models: cnn, img_mean, mlp, simple")
        routed = g.routed()
        # the two mlp inferences and the wrong-shape one; the two simple ones
        assert routed[("worker0", "mlp")] == 3 and routed[("worker0", "simple")] == 2
    finally:
        g.stop()
