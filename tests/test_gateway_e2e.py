"""The gateway end to end: two real workers (``xlaserve run`` processes on loopback), the gateway
in front of them (in a thread of the test process), and the unchanged Triton client."""
from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import ExitStack

import numpy as np
import pytest
import trio
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import infer_input, serve
from xlaserve.gateway.run import Gateway, GatewaySettings, WorkerAddress

TIMEOUT = 30.0


class GatewayThread:
    """A :class:`Gateway` run by ``trio.run`` in a daemon thread."""

    def __init__(self, workers: list[WorkerAddress], settings: GatewaySettings) -> None:
        self.gateway = Gateway(workers, settings)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)
        self._thread.start()
        assert self._ready.wait(TIMEOUT), "the gateway did not start"
        if self._error is not None:
            raise self._error
        self.url = f"127.0.0.1:{self.gateway.grpc_port}"

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.gateway.run)
            self._ready.set()

    def wait_ready(self, models: int, timeout: float = TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = trio.from_thread.run_sync(lambda: len(self.gateway.router.ready_models()) >= models
                                           and self.gateway.ready_reason()[0], trio_token=self.token)
            if ok:
                return
            time.sleep(0.05)
        raise AssertionError(f"the gateway did not see {models} ready models: "
                             f"{trio.from_thread.run_sync(self.gateway.ready_reason, trio_token=self.token)}")

    def routed(self) -> dict[tuple[str, str], int]:
        return trio.from_thread.run_sync(lambda: dict(self.gateway.service.routed), trio_token=self.token)

    def stop(self) -> None:
        trio.from_thread.run_sync(self._nursery.cancel_scope.cancel, trio_token=self.token)
        self._thread.join(TIMEOUT)


@pytest.fixture(scope="module")
def two_workers(examples_repo, tmp_path_factory):
    with ExitStack() as stack:
        servers = [stack.enter_context(serve(tmp_path_factory.mktemp(f"w{i}"), examples_repo,
                                             {"endpoints": {"allow_client_shm": True}}))
                   for i in range(2)]
        yield servers


def _mlp_input(batch: int = 1):
    return [infer_input("input", np.full((batch, 512), 0.5, np.float32), "FP32")]


@pytest.fixture
def gateway(two_workers):
    workers = [WorkerAddress(f"worker{i}", "127.0.0.1", s.grpc_port) for i, s in enumerate(two_workers)]
    g = GatewayThread(workers, GatewaySettings(mode="round_robin"))
    try:
        g.wait_ready(models=2)
        yield g
    finally:
        g.stop()


def test_infer_through_the_gateway_is_answered_like_the_worker_and_spread_round_robin(gateway, two_workers):
    direct = grpcclient.InferenceServerClient(two_workers[0].url)
    client = grpcclient.InferenceServerClient(gateway.url)
    expected = direct.infer("mlp", _mlp_input(2)).as_numpy("output")
    for _ in range(6):
        got = client.infer("mlp", _mlp_input(2)).as_numpy("output")
        np.testing.assert_array_equal(got, expected)
    routed = gateway.routed()
    assert routed[("worker0", "mlp")] == 3 and routed[("worker1", "mlp")] == 3


def test_unknown_model_and_garbage_get_precise_errors(gateway):
    client = grpcclient.InferenceServerClient(gateway.url)
    with pytest.raises(InferenceServerException) as err:
        client.infer("nope", _mlp_input())
    assert "StatusCode.NOT_FOUND" in str(err.value.status()) and "'nope' is not served by any worker" in str(err.value)
    assert "worker0: not in its repository" in str(err.value)


def test_index_statistics_metadata_and_readiness_merge_the_workers(gateway, two_workers):
    client = grpcclient.InferenceServerClient(gateway.url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
    assert not client.is_model_ready("nope")
    index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    direct = {m["name"]: m for m in grpcclient.InferenceServerClient(two_workers[0].url)
              .get_model_repository_index(as_json=True)["models"]}
    assert index.keys() == direct.keys() and index["mlp"]["state"] == "READY"
    meta = client.get_model_metadata("mlp", as_json=True)
    assert meta["name"] == "mlp" and meta["inputs"][0]["name"] == "input"
    assert client.get_model_config("mlp", as_json=True)["config"]["name"] == "mlp"
    before = [grpcclient.InferenceServerClient(s.url).get_inference_statistics("mlp", as_json=True)
              ["model_stats"][0].get("inference_count", "0") for s in two_workers]
    for _ in range(4):
        client.infer("mlp", _mlp_input())
    after = [grpcclient.InferenceServerClient(s.url).get_inference_statistics("mlp", as_json=True)
             ["model_stats"][0].get("inference_count", "0") for s in two_workers]
    merged = client.get_inference_statistics("mlp", as_json=True)["model_stats"][0]
    assert int(merged["inference_count"]) == sum(int(a) for a in after)
    assert sum(int(a) - int(b) for a, b in zip(after, before)) == 4


def test_system_shared_memory_works_through_the_gateway(gateway):
    import tritonclient.utils.shared_memory as shm
    client = grpcclient.InferenceServerClient(gateway.url)
    data = np.full((1, 512), 0.25, np.float32)
    name = f"/xlaserve-gw-{os.getpid()}"
    handle = shm.create_shared_memory_region("gw_in", name, data.nbytes)
    try:
        shm.set_shared_memory_region(handle, [data])
        client.register_system_shared_memory("gw_in", name, data.nbytes)
        status = client.get_system_shared_memory_status(as_json=True)
        assert "gw_in" in str(status)
        expected = client.infer("mlp", [infer_input("input", data, "FP32")]).as_numpy("output")
        for _ in range(2):          # both workers (round robin) read the region
            tensor = grpcclient.InferInput("input", [1, 512], "FP32")
            tensor.set_shared_memory("gw_in", data.nbytes)
            np.testing.assert_array_equal(client.infer("mlp", [tensor]).as_numpy("output"), expected)
        client.unregister_system_shared_memory("gw_in")
    finally:
        shm.destroy_shared_memory_region(handle)


def test_least_outstanding_routes_to_the_idle_worker(two_workers):
    workers = [WorkerAddress(f"worker{i}", "127.0.0.1", s.grpc_port) for i, s in enumerate(two_workers)]
    g = GatewayThread(workers, GatewaySettings(mode="least_outstanding"))
    try:
        g.wait_ready(models=2)
        client = grpcclient.InferenceServerClient(g.url)
        for _ in range(4):
            client.infer("mlp", _mlp_input())
        routed = g.routed()
        # one request at a time: nothing is outstanding, so ties alternate
        assert routed[("worker0", "mlp")] == 2 and routed[("worker1", "mlp")] == 2
    finally:
        g.stop()
