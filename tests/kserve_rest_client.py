"""KServe's own REST client (``kserve.InferenceRESTClient``, V2 protocol), unchanged, against the
server at the base URL given as the first argument: what tests/test_rest_kserve_e2e.py runs.

It runs in a process of its own because the ``kserve`` package and ``tritonclient.grpc`` cannot
be imported into one interpreter: both register the V2 protocol's messages (package
``inference``, from different .proto files) in protobuf's default descriptor pool, and the second
import fails with "duplicate symbol 'inference.ServerLiveRequest'". The tests' conftest imports
tritonclient.grpc, so the test starts this script and reads what it prints.

Reads a JSON plan from stdin: ``{"mlp": [[...], ...], "simple": [[...], ...]}`` (the mlp's FP32
input rows; the simple model's INT32 INPUT0 rows, INPUT1 is sent as ones). Prints one JSON
object: the health answers, each inference's outputs and response fields, and each error's HTTP
status and message as the client raised them.
"""
from __future__ import annotations

import asyncio
import json
import sys

import httpx
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.infer_type import RequestedOutput


def _error(exc: httpx.HTTPStatusError) -> dict:
    return {"type": type(exc).__name__, "status": exc.response.status_code, "message": str(exc)}


async def _run(base_url: str, plan: dict) -> dict:
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=60))
    out: dict = {}
    try:
        out["live"] = await client.is_server_live(base_url)
        out["ready"] = await client.is_server_ready(base_url)
        out["model_ready"] = {name: await client.is_model_ready(base_url, name) for name in ("mlp", "simple", "nope")}

        x = np.asarray(plan["mlp"], dtype=np.float32)
        for binary in (False, True):       # JSON data, then the tensor as binary data after the JSON
            tensor = InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x, binary_data=binary)
            request = InferRequest(model_name="mlp", infer_inputs=[tensor], request_id=f"kserve-{binary}")
            response = await client.infer(base_url, request, model_name="mlp")
            out[f"mlp_binary_{binary}".lower()] = {
                "id": response.id, "model_name": response.model_name,
                "outputs": {o.name: {"datatype": o.datatype, "shape": list(o.shape), "data": o.as_numpy().tolist()}
                            for o in response.outputs}}

        a = np.asarray(plan["simple"], dtype=np.int32)
        inputs = [InferInput("INPUT0", list(a.shape), "INT32"), InferInput("INPUT1", list(a.shape), "INT32")]
        inputs[0].set_data_from_numpy(a, binary_data=False)
        inputs[1].set_data_from_numpy(np.ones_like(a), binary_data=True)
        # one output asked for, as binary data
        request = InferRequest(model_name="simple", infer_inputs=inputs, request_id="kserve-simple",
                               request_outputs=[RequestedOutput("OUTPUT1", {"binary_data": True})])
        headers: dict = {}
        response = await client.infer(base_url, request, model_name="simple", response_headers=headers)
        out["simple"] = {"id": response.id, "outputs": {o.name: o.as_numpy().tolist() for o in response.outputs},
                         "json_length": headers.get("inference-header-content-length"),
                         "content_type": headers.get("content-type")}
        # the same request as a plain dict (the client's other accepted form), answered as a dict-built response
        response = await client.infer(base_url, {"inputs": [
            {"name": "INPUT0", "datatype": "INT32", "shape": list(a.shape), "data": a.ravel().tolist()},
            {"name": "INPUT1", "datatype": "INT32", "shape": list(a.shape), "data": [2] * a.size}]},
            model_name="simple")
        out["simple_dict"] = {o.name: o.as_numpy().tolist() for o in response.outputs}

        errors = {}
        try:
            await client.infer(base_url, InferRequest(model_name="nope", infer_inputs=[tensor]), model_name="nope")
        except httpx.HTTPStatusError as exc:
            errors["unknown_model"] = _error(exc)
        wrong = InferInput("input", [2, 7], "FP32")
        wrong.set_data_from_numpy(np.zeros((2, 7), np.float32), binary_data=False)
        try:
            await client.infer(base_url, InferRequest(model_name="mlp", infer_inputs=[wrong]), model_name="mlp")
        except httpx.HTTPStatusError as exc:
            errors["wrong_shape"] = _error(exc)
        out["errors"] = errors
    finally:
        await client.close()
    return out


def main() -> None:
    plan = json.load(sys.stdin)
    print(json.dumps(asyncio.run(_run(sys.argv[1], plan))))


if __name__ == "__main__":
    main()
