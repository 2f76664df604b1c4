"""Cancellation reaches the queue, end to end: the real server on loopback, raw HTTP/2 frames.

``mlp`` is held (``batch_delay_seconds`` 60, ``batch_target_rows`` 4), so requests wait in its
queue until four rows are there. A request whose stream is reset, or whose connection closes,
while it waits leaves the queue: it never executes (ModelStatistics and the batch it would have
joined say so), it is counted as ``xlaserve_rejections{reason="cancelled"}``, and the worker
holds no bytes for it afterwards.

A second server keeps its device busy with ``spin``, a model whose execution time the request
sets: a request reset while it executes runs to completion and its result is dropped, and a
``grpc-timeout`` that expires while queued is answered DEADLINE_EXCEEDED and counted as
``deadline_expired``, as any deadline passing in the queue is.
"""
from __future__ import annotations

import re
import shutil
import struct
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from examples import reference
from tests.conftest import serve
from tests.test_grpc_server import (CANCEL, DATA, END_STREAM, RST_STREAM, TIMEOUT, FrameClient, frame, grpc_body,
                                    request_headers)
from xlaserve._proto import grpc_service_pb2 as pb

INFER = "/inference.GRPCInferenceService/ModelInfer"
SPIN_STEPS = 60_000     # 0.45 s of device time on an idle 2-core machine, seconds on a busy one


@pytest.fixture(scope="module")
def held_server(examples_repo, tmp_path_factory):
    sched = {"models": {"mlp": {"batch_delay_seconds": 60.0, "batch_target_rows": 4}}}
    with serve(tmp_path_factory.mktemp("cancel_e2e"), examples_repo,
               {"scheduler": sched, "models_include": ["mlp"]}) as server:
        yield server
    assert server.process.returncode == 0, server.log()


def _x(sid: int) -> np.ndarray:
    return np.full((1, 512), sid / 100, np.float32)


def _infer(raw: FrameClient, sid: int, extra: tuple[tuple[str, str], ...] = ()) -> bytes:
    """HEADERS and DATA of one mlp ModelInfer of one row, on stream ``sid``."""
    request = pb.ModelInferRequest(model_name="mlp", id=str(sid), raw_input_contents=[_x(sid).tobytes()])
    request.inputs.add(name="input", datatype="FP32", shape=[1, 512])
    return raw.headers_frame(sid, request_headers(INFER, extra=extra)) + frame(DATA, END_STREAM, sid,
                                                                               grpc_body(request))


def _rst(sid: int) -> bytes:
    return frame(RST_STREAM, 0, sid, struct.pack(">I", CANCEL))


class Counts:
    """What the worker has counted for ``model``: statistics, rejections by reason, answers by
    status, and the admission gauges."""

    def __init__(self, server, model: str = "mlp") -> None:
        stats = grpcclient.InferenceServerClient(server.url).get_inference_statistics(model).model_stats[0]
        self.inference_count, self.execution_count = stats.inference_count, stats.execution_count
        body = server.get("/metrics")[1]
        self.rejections = {m[0]: float(m[1]) for m in re.findall(
            rf'^xlaserve_rejections_total\{{model="{model}",reason="(\w+)"\}} (\S+)$', body, re.M)}
        self.answers = {m[0]: float(m[1]) for m in re.findall(
            rf'^xlaserve_requests_total\{{model="{model}",status="(\w+)"\}} (\S+)$', body, re.M)}
        self.held_bytes = float(re.search(r"^xlaserve_held_request_bytes (\S+)$", body, re.M)[1])
        self.in_flight = float(re.search(r"^xlaserve_requests_in_flight (\S+)$", body, re.M)[1])

    def rejected(self, reason: str) -> float:
        return self.rejections.get(reason, 0.0)

    def answered(self, status: str) -> float:
        return self.answers.get(status, 0.0)


def _answered(raw: FrameClient, sids) -> None:
    """Every stream in ``sids`` got its reference answer."""
    for sid in sids:
        r = raw.response(sid)
        assert r.status == 0, (sid, r.status, r.message)
        reply = pb.ModelInferResponse.FromString(r.data[5:])
        assert reply.id == str(sid)
        y = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(1, 512)
        np.testing.assert_allclose(y, reference.mlp_ref(_x(sid)), rtol=1e-5, atol=1e-5)


def test_a_queued_request_whose_stream_is_reset_never_executes(held_server):
    """Streams 1, 3, 5 queue (3 rows: held); 3 is reset; 7 and 9 bring the queue to 4 rows
    again. One execution of 4 serves 1, 5, 7, 9; 3 was never executed, nothing was written on
    its stream after the reset, and it was counted cancelled once."""
    before = Counts(held_server)
    raw = FrameClient(held_server.grpc_port)
    try:
        raw.send(_infer(raw, 1), _infer(raw, 3), _infer(raw, 5))
        raw.ping_barrier()      # handed to the scheduler (a reset in the same read would skip that)
        raw.send(_rst(3))
        raw.send(_infer(raw, 7), _infer(raw, 9))
        _answered(raw, (1, 5, 7, 9))
        raw.ping_barrier()
        assert [f for f in raw.log if f.stream == 3] == []
    finally:
        raw.close()
    after = Counts(held_server)
    assert after.inference_count - before.inference_count == 4
    assert after.execution_count - before.execution_count == 1
    assert after.rejected("cancelled") - before.rejected("cancelled") == 1
    assert (after.held_bytes, after.in_flight) == (0, 0)


def _until(predicate, what: str) -> None:
    """Wait (polling the real server's /metrics, at most TIMEOUT) for ``predicate()``."""
    deadline = time.monotonic() + TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.02)


def test_queued_requests_of_a_closed_connection_never_execute(held_server):
    """Two requests queue (held) on one connection, which then closes: both leave the queue,
    counted cancelled, and the worker holds nothing for them. Four requests on another
    connection then make one execution of 4 rows that includes neither."""
    before = Counts(held_server)
    gone = FrameClient(held_server.grpc_port)
    gone.send(_infer(gone, 1), _infer(gone, 3))
    gone.ping_barrier()         # both decoded and handed to the scheduler
    gone.close()
    _until(lambda: Counts(held_server).rejected("cancelled") - before.rejected("cancelled") == 2,
           "the closed connection's two requests to be cancelled")
    mid = Counts(held_server)
    assert (mid.held_bytes, mid.in_flight) == (0, 0)
    raw = FrameClient(held_server.grpc_port)
    try:
        raw.send(*(_infer(raw, sid) for sid in (1, 3, 5, 7)))
        _answered(raw, (1, 3, 5, 7))
    finally:
        raw.close()
    after = Counts(held_server)
    assert after.inference_count - before.inference_count == 4
    assert after.execution_count - before.execution_count == 1
    assert after.rejected("cancelled") - before.rejected("cancelled") == 2
    assert (after.held_bytes, after.in_flight) == (0, 0)


def _spin(steps):
    """An execution whose length the request sets: ``steps`` rounds of a 64x64 matmul."""
    import jax
    import jax.numpy as jnp
    w = jnp.full((64, 64), 1.0 / 64, jnp.float32)
    a = jax.lax.fori_loop(0, steps[0], lambda i, a: jnp.tanh(a @ w), jnp.ones((64, 64), jnp.float32))
    return (jnp.broadcast_to(a[0, 0], steps.shape),)


@pytest.fixture(scope="module")
def busy_server(examples_repo, tmp_path_factory):
    """mlp and ``spin`` under fifo, nothing held: a long spin execution keeps the device busy."""
    from xlaserve.export import TensorSpec, export_bundle
    repo = tmp_path_factory.mktemp("busy_repo")
    shutil.copytree(examples_repo / "mlp", repo / "mlp")
    export_bundle(repo / "spin", _spin, inputs=[TensorSpec("steps", "i32", "n", {})],
                  outputs=[TensorSpec("y", "f32", "n", {})], weights=None, compiled_batch_sizes=[1])
    with serve(tmp_path_factory.mktemp("busy_e2e"), repo, {"scheduler": {"discipline": "fifo"}}) as server:
        yield server
    assert server.process.returncode == 0, server.log()


def _busy_client(server) -> FrameClient:
    """A frame client that waits for a reply as long as a spin may take on a loaded machine."""
    raw = FrameClient(server.grpc_port)
    raw.sock.settimeout(30)
    return raw


def _spin_request(raw: FrameClient, sid: int) -> bytes:
    spin = pb.ModelInferRequest(model_name="spin", id=str(sid),
                                raw_input_contents=[np.array([SPIN_STEPS], np.int32).tobytes()])
    spin.inputs.add(name="steps", datatype="INT32", shape=[1])
    return raw.headers_frame(sid, request_headers(INFER)) + frame(DATA, END_STREAM, sid, grpc_body(spin))


def test_a_request_reset_while_it_executes_runs_and_its_result_is_dropped(busy_server):
    """A spin is on the device (an mlp request with a 100 ms grpc-timeout sent behind it has
    expired meanwhile); its stream is reset. It runs to completion and counts as executed, is not
    counted as a cancelled rejection, its answer counts as CANCELLED, nothing is ever written on
    its stream, and the worker holds nothing for it once an mlp request queued behind it is
    answered."""
    before, spin_before = Counts(busy_server), Counts(busy_server, "spin")
    raw = _busy_client(busy_server)
    try:
        raw.send(_spin_request(raw, 1), _infer(raw, 3, extra=(("grpc-timeout", "100m"),)))
        assert raw.response(3).status == 4       # DEADLINE_EXCEEDED: the spin holds the device
        assert 1 not in raw.ended, "the spin ended before the deadline: raise SPIN_STEPS"
        raw.send(_rst(1), _infer(raw, 5))
        _answered(raw, (5,))                     # queued behind the spin: answered once it ended
        raw.ping_barrier()
        assert [f for f in raw.log if f.stream == 1] == []
    finally:
        raw.close()
    after, spin_after = Counts(busy_server), Counts(busy_server, "spin")
    assert spin_after.inference_count - spin_before.inference_count == 1
    assert spin_after.answered("CANCELLED") - spin_before.answered("CANCELLED") == 1
    assert spin_after.rejected("cancelled") == spin_before.rejected("cancelled")
    assert after.inference_count - before.inference_count == 1
    assert (after.held_bytes, after.in_flight) == (0, 0)


def test_a_grpc_timeout_expiring_in_the_queue_answers_deadline_exceeded(busy_server):
    """A spin execution of about a second holds the device; an mlp request with grpc-timeout
    100 ms, sent right behind it, expires in the queue: answered DEADLINE_EXCEEDED while the spin
    still runs, never executed, counted deadline_expired (as any deadline passing in the queue
    is; not cancelled), and the worker holds nothing for it afterwards."""
    before = Counts(busy_server)
    raw = _busy_client(busy_server)
    try:
        raw.send(_spin_request(raw, 1), _infer(raw, 3, extra=(("grpc-timeout", "100m"),)))
        late = raw.response(3)
        assert late.status == 4, (late.status, late.message)          # DEADLINE_EXCEEDED
        assert "deadline passed" in late.message and "it was not run" in late.message
        assert 1 not in raw.ended, "the spin ended before the deadline: raise SPIN_STEPS"
        assert raw.response(1).status == 0
    finally:
        raw.close()
    after = Counts(busy_server)
    assert after.inference_count == before.inference_count
    assert after.execution_count == before.execution_count
    assert after.rejected("deadline_expired") - before.rejected("deadline_expired") == 1
    assert after.rejected("cancelled") == before.rejected("cancelled")
    assert (after.held_bytes, after.in_flight) == (0, 0)
