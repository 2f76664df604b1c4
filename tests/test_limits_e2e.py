"""Endpoint limits: with the defaults, load beyond the device's pace waits in the queues and is
answered; the held-bytes budget, the optional in-flight cap and the message-size cap answer
RESOURCE_EXHAUSTED naming their key, and every request still gets exactly one response."""
from __future__ import annotations

import asyncio
import re

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from examples import reference
from tests.conftest import infer_input, serve
from xlaserve._proto import grpc_service_pb2 as pb

MLP_HELD = 512 * 4 * 2   # one mlp row held: FP32[1,512] in, FP32[1,512] expected out


def _gauge(server, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", server.get("/metrics")[1], re.M)
    assert m, f"no {name} in /metrics"
    return float(m.group(1))


def test_256_client_closed_loop_with_default_limits_is_queued_not_refused(examples_repo, tmp_path):
    """256 clients, each on its own connection, send 3 mlp requests one after another (a closed
    loop four times the old fixed in-flight cap of 64) at a worker with default endpoint
    settings: nothing is refused, every answer is the reference answer, and afterwards the
    worker holds no request bytes."""
    clients, rounds = 256, 3

    async def client(url, i):
        async with aioclient.InferenceServerClient(url) as c:
            answers = []
            for r in range(rounds):
                x = np.full((1, 512), (i * rounds + r) / 1000, np.float32)
                result = await c.infer("mlp", [infer_input("input", x, "FP32", aioclient)])
                answers.append((x, result.as_numpy("output")))
            return answers

    async def closed_loop(url):
        return await asyncio.gather(*[client(url, i) for i in range(clients)], return_exceptions=True)

    with serve(tmp_path, examples_repo) as server:
        outcomes = asyncio.run(closed_loop(server.url))
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        assert not failures, f"{len(failures)} of {clients} clients failed, first: {failures[0]}"
        answers = [a for per_client in outcomes for a in per_client]
        assert len(answers) == clients * rounds
        for x, y in answers:
            np.testing.assert_allclose(y, reference.mlp_ref(x), rtol=1e-5, atol=1e-5)
        assert _gauge(server, "xlaserve_held_request_bytes") == 0
        assert _gauge(server, "xlaserve_requests_in_flight") == 0


def test_held_bytes_budget_refuses_past_it_answers_everyone_and_returns_to_zero(examples_repo, tmp_path):
    """endpoints.max_held_request_bytes set to hold two mlp rows (4096 bytes each). Eight
    requests in one TCP write are all decoded before any is answered: the first two are held
    and served, the others refused with RESOURCE_EXHAUSTED naming the key and both figures. A
    request larger than the whole budget is refused through the Triton client, one that times
    out is answered DEADLINE_EXCEEDED, the worker keeps serving, and once everything is
    answered the held-bytes gauge is back to 0."""
    from tests.test_grpc_server import DATA, END_STREAM, FrameClient, frame, grpc_body, request_headers
    budget = 2 * MLP_HELD + MLP_HELD // 2
    with serve(tmp_path, examples_repo, {"endpoints": {"max_held_request_bytes": budget}}) as server:
        raw = FrameClient(server.grpc_port)
        sids = list(range(1, 17, 2))
        xs = {sid: np.full((1, 512), sid / 100, np.float32) for sid in sids}
        try:
            burst = b""
            for sid in sids:
                request = pb.ModelInferRequest(model_name="mlp", id=str(sid),
                                               raw_input_contents=[xs[sid].tobytes()])
                request.inputs.add(name="input", datatype="FP32", shape=[1, 512])
                burst += raw.headers_frame(sid, request_headers("/inference.GRPCInferenceService/ModelInfer"))
                burst += frame(DATA, END_STREAM, sid, grpc_body(request))
            raw.send(burst)
            responses = {sid: raw.response(sid) for sid in sids}
        finally:
            raw.close()
        served = [sid for sid, r in responses.items() if r.status == 0]
        refused = [sid for sid, r in responses.items() if r.status != 0]
        assert served[:2] == sids[:2] and refused, {sid: (r.status, r.message) for sid, r in responses.items()}
        for sid in served:
            reply = pb.ModelInferResponse.FromString(responses[sid].data[5:])
            y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(1, 512)
            np.testing.assert_allclose(y, reference.mlp_ref(xs[sid]), rtol=1e-5, atol=1e-5)
        for sid in refused:
            r = responses[sid]
            assert r.status == 8, (r.status, r.message)   # RESOURCE_EXHAUSTED
            assert f"with this one ({MLP_HELD} bytes)" in r.message
            assert f"(endpoints.max_held_request_bytes) is {budget}" in r.message

        c = grpcclient.InferenceServerClient(server.url)
        with pytest.raises(InferenceServerException) as info:
            c.infer("mlp", [infer_input("input", np.zeros((3, 512), np.float32), "FP32")])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert info.value.message().startswith(f"this request needs {3 * MLP_HELD} bytes")
        assert f"(endpoints.max_held_request_bytes) of {budget}" in info.value.message()
        with pytest.raises(InferenceServerException) as late:
            c.infer("mlp", [infer_input("input", np.zeros((1, 512), np.float32), "FP32")], timeout=1)
        assert late.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        x = np.ones((2, 512), np.float32)
        ok = c.infer("mlp", [infer_input("input", x, "FP32")])
        np.testing.assert_allclose(ok.as_numpy("output"), reference.mlp_ref(x), rtol=1e-5, atol=1e-5)
        assert _gauge(server, "xlaserve_held_request_bytes") == 0
        assert _gauge(server, "xlaserve_requests_in_flight") == 0


def test_message_size_cap(examples_repo, tmp_path):
    with serve(tmp_path, examples_repo, {"endpoints": {"max_recv_msg_bytes": 100_000}}) as server:
        c = grpcclient.InferenceServerClient(server.url)
        big = np.zeros((1, 224, 224, 3), np.uint8)
        with pytest.raises(InferenceServerException) as info:
            c.infer("img_mean", [infer_input("input", big, "UINT8")])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "endpoints.max_recv_msg_bytes) is 100000" in info.value.message()
        small = c.infer("mlp", [infer_input("input", np.zeros((1, 512), np.float32), "FP32")])
        assert small.as_numpy("output").shape == (1, 512)


@pytest.mark.parametrize("key", ["max_connection_inflate_bytes", "max_inflate_bytes"])
def test_inflate_budget(examples_repo, tmp_path, key):
    """A gzip request that inflates past the budget (150 kB of zeros against 100 kB) is refused
    RESOURCE_EXHAUSTED naming the key, though the message limit (256 MiB) allows it; a small gzip
    request and the same large one uncompressed are served."""
    with serve(tmp_path, examples_repo, {"endpoints": {key: 100_000}}) as server:
        c = grpcclient.InferenceServerClient(server.url)
        big = np.zeros((1, 224, 224, 3), np.uint8)
        with pytest.raises(InferenceServerException) as info:
            c.infer("img_mean", [infer_input("input", big, "UINT8")], compression_algorithm="gzip")
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert f"the 100000 bytes left of endpoints.{key} (100000 bytes, 0 held" in info.value.message()
        x = np.full((1, 512), 0.5, np.float32)
        small = c.infer("mlp", [infer_input("input", x, "FP32")], compression_algorithm="gzip")
        np.testing.assert_allclose(small.as_numpy("output"), reference.mlp_ref(x), rtol=1e-5, atol=1e-5)
        assert c.infer("img_mean", [infer_input("input", big, "UINT8")]).as_numpy("output") is not None


def test_in_flight_cap_sheds_but_answers_everyone(examples_repo, tmp_path):
    async def burst(url):
        async with aioclient.InferenceServerClient(url) as c:
            x = np.zeros((8, 224, 224, 3), np.uint8)
            calls = [c.infer("img_mean", [infer_input("input", x, "UINT8", aioclient)]) for _ in range(16)]
            return await asyncio.gather(*calls, return_exceptions=True)

    with serve(tmp_path, examples_repo, {"endpoints": {"max_concurrent_requests": 1}}) as server:
        outcomes = asyncio.run(burst(server.url))
    assert len(outcomes) == 16
    shed = [o for o in outcomes if isinstance(o, InferenceServerException)]
    served = [o for o in outcomes if not isinstance(o, Exception)]
    assert shed and served and len(shed) + len(served) == 16
    assert all(o.status() == "StatusCode.RESOURCE_EXHAUSTED" for o in shed)
    assert "endpoints.max_concurrent_requests) is 1" in shed[0].message()


def test_connection_buffer_cap_refuses_the_call_that_crosses_it(examples_repo, tmp_path):
    """Two img_mean calls on one connection, 130 kB of each 150 kB message sent: the second
    would make the worker hold 260 kB, past endpoints.max_connection_buffer_bytes (250 kB),
    so it alone is refused; the first completes with its answer, and the worker keeps serving."""
    from tests.test_grpc_server import DATA, END_STREAM, FrameClient, frame, request_headers
    limits = {"max_recv_msg_bytes": 200_000, "max_connection_buffer_bytes": 250_000}
    with serve(tmp_path, examples_repo, {"endpoints": limits}) as server:
        image = np.full((1, 224, 224, 3), 7, np.uint8)
        request = pb.ModelInferRequest(model_name="img_mean", id="first", raw_input_contents=[image.tobytes()])
        request.inputs.add(name="input", datatype="UINT8", shape=[1, 224, 224, 3])
        message = request.SerializeToString()
        body = b"\0" + len(message).to_bytes(4, "big") + message
        raw = FrameClient(server.grpc_port)
        try:
            for sid in (1, 3):
                raw.send(raw.headers_frame(sid, request_headers("/inference.GRPCInferenceService/ModelInfer")),
                         frame(DATA, 0, sid, body[:130_000]))
            refused = raw.response(3)
            assert refused.status == 8   # RESOURCE_EXHAUSTED
            assert "would hold 260000 bytes" in refused.message
            assert "(endpoints.max_connection_buffer_bytes) is 250000" in refused.message
            raw.send(frame(DATA, END_STREAM, 1, body[130_000:]))
            first = raw.response(1)
            assert first.status == 0
            reply = pb.ModelInferResponse.FromString(first.data[5:])
            assert reply.id == "first"
            assert np.frombuffer(reply.raw_output_contents[0], np.float32).tolist() == [7.0]
        finally:
            raw.close()
        c = grpcclient.InferenceServerClient(server.url)
        small = c.infer("mlp", [infer_input("input", np.zeros((1, 512), np.float32), "FP32")])
        assert small.as_numpy("output").shape == (1, 512)
