"""ModelStreamInfer, and a call forwarded to every worker, through the real gateway in front of
fake workers (those of tests/test_gateway_hostile_worker.py) that hold or fail each call, called
by grpclib's client: a stream that ends early takes its forwarded requests back from the workers,
an error answered on the stream names the request it belongs to, and a shared-memory
registration some workers refuse is undone on the others."""
from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import trio
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.test_gateway_hostile_worker import GatewayOverFakes, Request, WorkerConn, _fake_worker_serving_mlp
from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve._proto.grpc_service_grpc import GRPCInferenceServiceStub

TIMEOUT = 30.0


def _request(model: str, request_id: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    request.inputs.add(name="input", datatype="FP32", shape=[1, 512])
    request.raw_input_contents.append(np.full((1, 512), 0.5, np.float32).tobytes())
    return request


def _gateway(on_infer) -> GatewayOverFakes:
    """The real gateway over two fake workers serving mlp, each answering ModelInfer with ``on_infer``."""
    gateway = GatewayOverFakes(_fake_worker_serving_mlp("worker0", on_infer),
                               _fake_worker_serving_mlp("worker1", on_infer))
    gateway.wait_ready(models=1)
    return gateway


def _in_flight(gateway: GatewayOverFakes) -> int:
    return trio.from_thread.run_sync(lambda: gateway.gateway.service.in_flight, trio_token=gateway.token)


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_stream_reset_by_its_client_takes_its_requests_back_from_the_workers():
    # The attack: open a stream, send a window of slow requests, reset it, open the next. Before,
    # the forwards ran on to the end: the workers did the work for nobody and the gateway's
    # in-flight cap (max_concurrent_requests_per_worker x workers) stayed full, refusing others.
    held: list[int] = []

    async def hold(conn: WorkerConn, req: Request) -> None:
        held.append(req.sid)            # never answered

    gateway = _gateway(hold)
    try:
        async def reset_after_four() -> None:
            async with Channel("127.0.0.1", gateway.port) as channel:
                stream = GRPCInferenceServiceStub(channel).ModelStreamInfer.open()
                await stream.__aenter__()
                for i in range(4):
                    await stream.send_message(_request("mlp", str(i)))
                await asyncio.to_thread(_wait_until, lambda: len(held) == 4, "the workers got the 4 requests")
                assert _in_flight(gateway) == 4
                await stream.cancel()
        asyncio.run(reset_after_four())
        _wait_until(lambda: _in_flight(gateway) == 0, "the gateway's in-flight count returned to 0")
        _wait_until(lambda: sum(len(conn.resets) for conns in gateway.connections for conn in conns) == 4,
                    "each worker stream of the reset client stream was reset")
        assert all(code == 8 for conns in gateway.connections for conn in conns for code in conn.resets.values())  # CANCEL
    finally:
        gateway.stop()


def test_an_error_on_the_stream_echoes_its_requests_id_and_the_stream_goes_on():
    async def fail(conn: WorkerConn, req: Request) -> None:
        request = pb.ModelInferRequest.FromString(req.body[5:])
        if request.id == "bad-tensor":
            await conn.reply(req.sid, b"", Status.INVALID_ARGUMENT, "input 'input': expected FP32")
        else:
            await conn.reply(req.sid, pb.ModelInferResponse(model_name="mlp", id=request.id).SerializeToString())

    gateway = _gateway(fail)
    try:
        async def stream_of_three() -> list[pb.ModelStreamInferResponse]:
            async with Channel("127.0.0.1", gateway.port) as channel:
                async with GRPCInferenceServiceStub(channel).ModelStreamInfer.open() as stream:
                    for model, request_id in (("mlp", "first"), ("nope", "unknown-model"), ("mlp", "bad-tensor"),
                                              ("mlp", "last")):
                        await stream.send_message(_request(model, request_id))
                    await stream.end()
                    return [response async for response in stream]
        responses = asyncio.run(stream_of_three())
        assert [r.infer_response.id for r in responses] == ["first", "unknown-model", "bad-tensor", "last"]
        assert [bool(r.error_message) for r in responses] == [False, True, True, False]
        assert "'nope' is not served by any worker" in responses[1].error_message
        assert responses[2].error_message == "input 'input': expected FP32"
        assert _in_flight(gateway) == 0
    finally:
        gateway.stop()


def test_an_answer_past_max_send_msg_bytes_is_that_requests_error_and_the_stream_goes_on():
    # A worker's reply within the gateway's limit grows by the ModelStreamInferResponse around it;
    # one past max_send_msg_bytes ended the whole stream (RESOURCE_EXHAUSTED) with every request
    # after it unanswered.
    async def answer(conn: WorkerConn, req: Request) -> None:
        request = pb.ModelInferRequest.FromString(req.body[5:])
        reply = pb.ModelInferResponse(model_name="mlp", id=request.id)
        reply.raw_output_contents.append(b"\0" * (3000 if request.id == "big" else 10))
        await conn.reply(req.sid, reply.SerializeToString())

    gateway = _gateway(answer)
    try:
        def shrink() -> None:
            gateway.gateway.server.max_send_bytes = 2000
        trio.from_thread.run_sync(shrink, trio_token=gateway.token)

        async def stream_of_three() -> list[pb.ModelStreamInferResponse]:
            async with Channel("127.0.0.1", gateway.port) as channel:
                async with GRPCInferenceServiceStub(channel).ModelStreamInfer.open() as stream:
                    for request_id in ("first", "big", "last"):
                        await stream.send_message(_request("mlp", request_id))
                    await stream.end()
                    return [response async for response in stream]
        responses = asyncio.run(stream_of_three())
        assert [r.infer_response.id for r in responses] == ["first", "big", "last"]
        assert [bool(r.error_message) for r in responses] == [False, True, False]
        assert re.fullmatch(r"the response message is 30\d\d bytes; the limit \(gateway.grpc.max_send_msg_bytes\) "
                            r"is 2000", responses[1].error_message), responses[1].error_message
        assert _in_flight(gateway) == 0
    finally:
        gateway.stop()


def test_a_region_one_worker_refuses_is_unregistered_from_the_workers_that_took_it():
    # A registration is forwarded to every worker. When one refused it, the others kept it: the
    # call failed, but a client that retried was told "already registered" by them for good.
    calls: dict[str, list[str]] = {"worker0": [], "worker1": []}

    def shm(name: str, refuse: bool):
        async def on_other(conn: WorkerConn, req: Request) -> None:
            method = req.path.rsplit("/", 1)[1]
            if "SharedMemory" in method:          # (discovery asks for ModelConfig too)
                calls[name].append(method)
            if method == "SystemSharedMemoryRegister" and refuse:
                await conn.reply(req.sid, b"", Status.INVALID_ARGUMENT, "no shared-memory object 'k' exists")
            else:
                await conn.reply(req.sid, b"")
        return on_other

    async def answer(conn: WorkerConn, req: Request) -> None:
        await conn.reply(req.sid, pb.ModelInferResponse(model_name="mlp").SerializeToString())

    gateway = GatewayOverFakes(_fake_worker_serving_mlp("worker0", answer, shm("worker0", False)),
                               _fake_worker_serving_mlp("worker1", answer, shm("worker1", True)))
    gateway.wait_ready(models=1)
    try:
        async def register():
            async with Channel("127.0.0.1", gateway.port) as channel:
                stub = GRPCInferenceServiceStub(channel)
                try:
                    await stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(
                        name="r", key="/k", byte_size=64))
                except GRPCError as exc:
                    return exc
        error = asyncio.run(register())
        assert error is not None and error.status is Status.INVALID_ARGUMENT
        assert error.message == ("worker1: no shared-memory object 'k' exists; undone on worker0, where it had "
                                 "succeeded"), error.message
        assert calls == {"worker0": ["SystemSharedMemoryRegister", "SystemSharedMemoryUnregister"],
                         "worker1": ["SystemSharedMemoryRegister"]}
    finally:
        gateway.stop()
