"""Endpoint limits: the in-flight cap and the message-size cap answer RESOURCE_EXHAUSTED, and
every request still gets exactly one response."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from tests.conftest import infer_input, serve
from xlaserve._proto import grpc_service_pb2 as pb


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
