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
