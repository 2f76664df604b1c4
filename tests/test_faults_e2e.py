"""Faults stay where they happen (issue 24), end to end: absurd shapes are INVALID_ARGUMENT and give
their admission slot back, and a seeded subset of the fault-injection suite
(``benchmarks/fault_suite.py``) runs against a real worker, a standalone gateway with two workers,
a two-worker ``xlaserve run`` node and a TLS worker."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from benchmarks import fault_suite
from examples import reference
from tests.conftest import infer_input, serve


def _gauge(server, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", server.get("/metrics")[1], re.M)
    assert m, f"no {name} in /metrics"
    return float(m.group(1))


@pytest.mark.parametrize("shape, data", [
    ([2**55, 512], False),          # np.prod wraps to 0 and matched an empty payload
    ([2**55, 512], True),
    ([2**62, 512], False),
    ([4, 2**40], False),            # a fixed axis that is wrong
    ([-3, 512], False),
    ([2**31, 512], False),          # no overflow, just past the largest compiled batch size
])
def test_absurd_shapes_are_invalid_argument_and_give_their_admission_slot_back(examples_repo, tmp_path, shape, data):
    """With endpoints.max_concurrent_requests 4, twelve absurd requests (three times the cap) are
    each answered INVALID_ARGUMENT naming the tensor; then eight requests, four at a time, are all served
    (before, an overflowing shape was INTERNAL and kept its slot: 0 of 8 were served), and the
    in-flight and held-bytes gauges are back to 0."""
    with serve(tmp_path, examples_repo, {"endpoints": {"max_concurrent_requests": 4}}) as server:
        channel = grpc.insecure_channel(server.url)
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        request = service_pb2.ModelInferRequest(model_name="mlp")
        request.inputs.add(name="input", datatype="FP32", shape=shape)
        if data:
            request.raw_input_contents.append(b"\0" * 2048)
        for _ in range(12):
            with pytest.raises(grpc.RpcError) as info:
                stub.ModelInfer(request, timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert info.value.details().startswith("input 'input': "), info.value.details()
        channel.close()

        client = grpcclient.InferenceServerClient(server.url)
        xs = [np.full((1, 512), i / 10, np.float32) for i in range(8)]
        with ThreadPoolExecutor(4) as pool:
            ys = list(pool.map(lambda x: client.infer("mlp", [infer_input("input", x, "FP32")]).as_numpy("output"),
                               xs))
        for x, y in zip(xs, ys):
            np.testing.assert_allclose(y, reference.mlp_ref(x), rtol=1e-5, atol=1e-5)
        assert _gauge(server, "xlaserve_requests_in_flight") == 0
        assert _gauge(server, "xlaserve_held_request_bytes") == 0
        assert "Traceback" not in server.log()


# ---- the seeded subset of the fault-injection suite ---------------------------------------------------
CASES = 1000       # per target: 4,000 cases, about 9,000 requests, in about 40 s on two cores


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    with fault_suite.targets_running(["worker", "gateway", "node", "tls"], tmp_path_factory.mktemp("faults")) as t:
        yield {target.name: target for target in t}
    codes = [p.proc.returncode for target in t for p in target.processes]
    assert codes == [0] * len(codes), f"exit statuses after SIGTERM: {codes}"


@pytest.mark.parametrize("name", ["worker", "gateway", "node", "tls"])
def test_seeded_fault_cases_leave_every_process_alive_every_request_answered_once_and_no_leak(targets, name):
    target = targets[name]
    report = fault_suite.run_target(target, CASES, seed=24, round_size=50, threads=8)
    fault_suite.print_report(report)
    assert not report.failed(), "\n".join(report.examples)
    assert report.cases == CASES and report.deaths == 0
    assert report.unanswered == report.twice == report.wrong == report.leaks == report.log_records == 0
    # the faults fired: malformed requests were refused, user code failed, and good requests were served
    assert report.statuses[3] > 50                      # INVALID_ARGUMENT
    assert report.statuses[0] > 50                      # OK
    if name != "tls":
        assert report.statuses[13] > 10                 # INTERNAL: hooks that raise or return junk
        assert report.by_family["conn"] > 100
    else:
        assert report.by_family["tls"] > 50
