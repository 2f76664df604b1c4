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

from benchmarks._servers import consecutive_free_pair, free_ports
from benchmarks.gateway_bench import _child
from tests.conftest import infer_input, serve
from tests.trio_thread import TrioServerThread
from xlaserve.config.gateway import parse_gateway_config
from xlaserve.gateway.run import Gateway, WorkerAddress

TIMEOUT = 30.0


def config(mode: str = "round_robin", **worker_client):
    """A gateway configuration as a gateway file would give it (endpoints are passed apart)."""
    return parse_gateway_config({"scheduling": {"mode": mode}, "worker_client": worker_client,
                                 "endpoints": ["127.0.0.1:1"]})


def addresses(servers) -> list[WorkerAddress]:
    """The gateway's view of ``servers``: worker0, worker1, ... at their gRPC ports."""
    return [WorkerAddress(f"worker{i}", "127.0.0.1", s.grpc_port) for i, s in enumerate(servers)]


def gateway_over(stack: ExitStack, servers, settings) -> "GatewayThread":
    """A gateway in front of ``servers``, stopped when ``stack`` closes."""
    g = GatewayThread(addresses(servers), settings)
    stack.callback(g.stop)
    return g


class GatewayThread(TrioServerThread):
    """A :class:`Gateway` run by ``trio.run`` in a daemon thread."""

    thread_name = "gateway"

    def __init__(self, workers: list[WorkerAddress], settings) -> None:
        self.gateway = Gateway(workers, settings)
        super().__init__()
        self.url = f"127.0.0.1:{self.port}"

    async def _serve(self, nursery: trio.Nursery) -> int:
        grpc_port, _ = await nursery.start(self.gateway.run)
        return grpc_port

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
        if self._error is not None:
            raise AssertionError("the gateway stopped") from self._error
        return trio.from_thread.run_sync(lambda: dict(self.gateway.service.routed), trio_token=self.token)

    def stop(self) -> None:
        trio.from_thread.run_sync(self._nursery.cancel_scope.cancel, trio_token=self.token)
        self._thread.join(TIMEOUT)


@pytest.fixture(scope="module")
def two_workers(examples_repo, tmp_path_factory):
    with ExitStack() as stack:
        # fifo: what lpt_packing needs (the other modes do not mind)
        servers = [stack.enter_context(serve(tmp_path_factory.mktemp(f"w{i}"), examples_repo,
                                             {"endpoints": {"allow_client_shm": True},
                                              "scheduler": {"discipline": "fifo"}}))
                   for i in range(2)]
        yield servers


def _thread_policies(pid: int) -> set[int]:
    """The CPU scheduling policies of every thread of process ``pid``."""
    policies = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            policies.add(os.sched_getscheduler(int(tid)))
        except ProcessLookupError:      # a thread that ended meanwhile
            pass
    return policies


def _mlp_input(batch: int = 1):
    return [infer_input("input", np.full((batch, 512), 0.5, np.float32), "FP32")]


@pytest.fixture
def gateway(two_workers):
    g = GatewayThread(addresses(two_workers), config("round_robin"))
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
    g = GatewayThread(addresses(two_workers), config("least_outstanding"))
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


class Load:
    """``clients`` threads calling ``mlp`` through ``url`` in a closed loop; every outcome kept."""

    def __init__(self, url: str, clients: int = 6) -> None:
        self.outcomes: list[tuple[float, float, str]] = []     # (sent, answered, "" or the status)
        self.expected = grpcclient.InferenceServerClient(url).infer("mlp", _mlp_input()).as_numpy("output")
        self.wrong = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(url,), daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _loop(self, url: str) -> None:
        client = grpcclient.InferenceServerClient(url)
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                out = client.infer("mlp", _mlp_input(), client_timeout=20).as_numpy("output")
                error = ""
                # (coalesced with others, a request runs at a larger batch size: float rounding)
                if not np.allclose(out, self.expected, rtol=1e-5, atol=1e-5):
                    with self._lock:
                        self.wrong += 1
                        self.wrong_example = (out, self.expected)
            except InferenceServerException as exc:
                error = str(exc.status())
            with self._lock:
                self.outcomes.append((sent, time.monotonic(), error))

    def stop(self) -> list[tuple[float, float, str]]:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        assert not any(t.is_alive() for t in self._threads), "a request hung"
        return self.outcomes


def test_a_killed_worker_costs_only_its_in_flight_requests_and_is_used_again_after_its_restart(examples_repo, tmp_path):
    with ExitStack() as stack:
        servers = [stack.enter_context(serve(tmp_path / f"w{i}", examples_repo)) for i in range(2)]
        g = gateway_over(stack, servers, config("round_robin"))
        g.wait_ready(models=2)
        load = Load(g.url, clients=6)
        time.sleep(1.0)
        killed_at = time.monotonic()
        servers[1].process.send_signal(signal.SIGKILL)
        servers[1].process.wait()
        time.sleep(1.5)
        # the worker comes back on the same port (what the supervisor does) and is routed to again
        with serve(tmp_path / "w1-again", examples_repo,
                   listen={"grpc": f"127.0.0.1:{servers[1].grpc_port}", "http": "127.0.0.1:0"}):
            deadline = time.monotonic() + TIMEOUT
            back = g.routed().get(("worker1", "mlp"), 0)
            while time.monotonic() < deadline and g.routed().get(("worker1", "mlp"), 0) < back + 5:
                time.sleep(0.05)
            outcomes = load.stop()
        assert g.routed()[("worker1", "mlp")] >= back + 5, "the restarted worker was not routed to"
    failed = [o for o in outcomes if o[2]]
    assert load.wrong == 0, load.wrong_example
    # what was in flight to worker1 at the kill fails at once, UNAVAILABLE; so may a request sent
    # in the milliseconds its process takes to die (its connection still open); none after that
    assert len(failed) <= 2 * 6, failed
    assert all(o[2] == "StatusCode.UNAVAILABLE" and o[1] - killed_at < 1.0 for o in failed), failed
    assert not [o for o in failed if o[0] > killed_at + 0.5], failed
    assert sum(1 for o in outcomes if not o[2] and o[0] > killed_at + 0.2) > 50


def test_a_stopped_worker_times_out_its_requests_and_is_routed_around_until_it_continues(examples_repo, tmp_path):
    with ExitStack() as stack:
        servers = [stack.enter_context(serve(tmp_path / f"w{i}", examples_repo)) for i in range(2)]
        g = gateway_over(stack, servers, config("round_robin", request_timeout_seconds=1.0))
        g.wait_ready(models=2)
        load = Load(g.url, clients=4)
        time.sleep(0.5)
        stopped_at = time.monotonic()
        servers[1].process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(4.0)
            routed_while_stopped = g.routed().get(("worker1", "mlp"), 0)
            time.sleep(1.0)
            assert g.routed().get(("worker1", "mlp"), 0) == routed_while_stopped, "routed to a stopped worker"
        finally:
            servers[1].process.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and g.routed().get(("worker1", "mlp"), 0) < routed_while_stopped + 5:
            time.sleep(0.05)
        outcomes = load.stop()
        assert g.routed()[("worker1", "mlp")] >= routed_while_stopped + 5, "not routed to again after SIGCONT"
    failed = [o for o in outcomes if o[2]]
    assert load.wrong == 0 and failed
    assert all(o[2] == "StatusCode.DEADLINE_EXCEEDED" and 0.9 < o[1] - o[0] < 4.0 for o in failed), failed
    assert sum(1 for o in outcomes if not o[2] and stopped_at + 3.0 < o[0] < stopped_at + 4.0) > 20


def _rest_through_the_gateway(node) -> None:
    """The embedded gateway serves the node's listen.rest and routes REST to the workers as gRPC:
    the unchanged tritonclient.http sees one server (metadata, config, index, statistics summed
    over the replicas, binary and JSON tensors, errors with their HTTP status)."""
    import json
    import urllib.error
    import urllib.request

    import tritonclient.http as httpclient

    from examples import reference
    assert node.rest_port is not None
    c = httpclient.InferenceServerClient(node.rest)
    assert c.is_server_live() and c.is_server_ready() and c.is_model_ready("simple")
    assert c.get_server_metadata()["name"] == "xlaserve"
    assert c.get_model_metadata("mlp")["inputs"][0]["shape"] == [-1, 512]
    assert c.get_model_config("simple")["max_batch_size"] == 8
    assert {m["name"] for m in c.get_model_repository_index()} == {"simple", "mlp", "img_mean", "cnn"}
    rng = np.random.default_rng(5)
    for binary in (True, True, False):      # the second binary request's header comes from the cache
        x = rng.standard_normal((2, 512)).astype(np.float32)
        t = httpclient.InferInput("input", [2, 512], "FP32")
        t.set_data_from_numpy(x, binary_data=binary)
        r = c.infer("mlp", [t], outputs=[httpclient.InferRequestedOutput("output", binary_data=binary)])
        np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-4, atol=1e-5)
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    inputs = [httpclient.InferInput("INPUT0", [2, 16], "INT32"), httpclient.InferInput("INPUT1", [2, 16], "INT32")]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a, binary_data=False)
    for _ in range(4):
        np.testing.assert_array_equal(c.infer("simple", inputs).as_numpy("OUTPUT0"), a + a)
    assert sum(s["inference_count"] for s in c.get_inference_statistics("simple")["model_stats"]) >= 4
    with pytest.raises(InferenceServerException) as info:
        c.get_model_metadata("nope")
    assert info.value.status() == "404" and "nope" in info.value.message()
    body = json.dumps({"inputs": [{"name": "INPUT0", "datatype": "INT32", "shape": [1, 16], "data": [1] * 15},
                                  {"name": "INPUT1", "datatype": "INT32", "shape": [1, 16], "data": [1] * 16}]})
    request = urllib.request.Request(f"http://{node.rest}/v2/models/simple/infer", data=body.encode())
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(request, timeout=30)
    assert http_error.value.code == 400
    assert "input 'INPUT0': 'data' has 15 elements" in json.loads(http_error.value.read())["error"]
    c.close()


def _index_entry(client, name: str) -> dict:
    entry = next(m for m in client.get_model_repository_index(as_json=True)["models"] if m["name"] == name)
    return {"reason": "", **entry}


def test_xlaserve_run_serves_a_two_worker_node_behind_its_gateway(examples_repo, tmp_path):
    """The supervisor starts both workers; the embedded gateway serves the node's listen port;
    the unchanged Triton client sees one server; a killed worker is restarted and used again."""
    import re
    grpc0, grpc1 = free_ports(2)
    http0 = consecutive_free_pair()
    with serve(tmp_path, examples_repo, workers=[{"name": "a", "port": grpc0}, {"name": "b", "port": grpc1}],
               metrics_base_port=http0,
               supervisor={"restart_backoff_initial_seconds": 0.1},
               gateway={"scheduling": {"mode": "least_outstanding"}, "cpu_policy": "batch"},
               listen={"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"}) as node:
        client = grpcclient.InferenceServerClient(node.url)
        assert client.is_server_ready()
        index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
        assert index["mlp"]["state"] == "READY"
        out = client.infer("mlp", _mlp_input()).as_numpy("output")
        assert out.shape == (1, 10) or out.shape[0] == 1
        status, text = node.get("/metrics")
        assert status == 200 and 'xlaserve_gateway_worker_up{worker="a"} 1.0' in text
        # answered: nothing in flight, though the gateway's status stream to each worker stays open
        # (discovery's own unary calls to a worker count while they run: on a loaded machine one
        # may be under way at the scrape, so the count is read until it settles)
        settle = time.monotonic() + 10
        while 'xlaserve_gateway_in_flight{worker="a"} 0.0' not in text and time.monotonic() < settle:
            time.sleep(0.05)
            status, text = node.get("/metrics")
        assert 'xlaserve_gateway_in_flight{worker="a"} 0.0' in text, text
        assert 'xlaserve_gateway_in_flight{worker="b"} 0.0' in text, text
        deadline = time.monotonic() + TIMEOUT        # the workers' own metrics, scraped, with their names
        scraped = [re.compile(rf'^xlaserve_weight_cache\w*\{{worker="{w}"', re.MULTILINE) for w in "ab"]
        while time.monotonic() < deadline and not all(p.search(text) for p in scraped):
            time.sleep(0.2)
            text = node.get("/metrics")[1]
        assert all(p.search(text) for p in scraped), text[-2000:]
        log = node.log()
        assert "[a]" in log and "[b]" in log          # both workers' lines, prefixed
        # both workers have mlp READY (the node is ready once each model is on one worker), and
        # the gateway routes to both: its replicas gauge is its routing view
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and 'xlaserve_gateway_replicas{model="mlp"} 2.0' not in node.get("/metrics")[1]:
            time.sleep(0.05)
        assert _index_entry(client, "mlp") == {"name": "mlp", "version": "1", "state": "READY", "reason": ""}
        _rest_through_the_gateway(node)
        # the supervisor hosts the gateway: its cpu_policy (batch here); the workers it started
        # keep the node's own policy
        assert _thread_policies(node.process.pid) == {os.SCHED_BATCH}
        for name in "ab":
            assert _thread_policies(_child(node.process.pid, ["--worker", name])) == {os.SCHED_OTHER}
        # SIGKILL one worker: the supervisor restarts it, the gateway routes to it again
        deadline = time.monotonic() + TIMEOUT
        os.kill(_child(node.process.pid, ["--worker", "b"]), signal.SIGKILL)
        while time.monotonic() < deadline and 'xlaserve_gateway_worker_up{worker="b"} 0.0' not in node.get("/metrics")[1]:
            time.sleep(0.02)    # (a request sent while b's process is still dying fails UNAVAILABLE)
        for _ in range(20):
            client.infer("mlp", _mlp_input())        # answered by a meanwhile
        while time.monotonic() < deadline:
            status, text = node.get("/metrics")
            if re.search(r'xlaserve_gateway_worker_up\{worker="b"\} 1\.0', text) and "restart" in node.log():
                break
            time.sleep(0.1)
        assert re.search(r'xlaserve_gateway_worker_up\{worker="b"\} 1\.0', node.get("/metrics")[1])
        assert client.infer("mlp", _mlp_input()).as_numpy("output").shape[0] == 1
        assert _thread_policies(_child(node.process.pid, ["--worker", "b"])) == {os.SCHED_OTHER}   # restarted
    # a stop is clean: a worker that resets the gateway's metrics scrape as it goes is no crash
    assert node.process.returncode == 0, node.log()[-3000:]


def test_the_gateway_checks_client_shm_peers_itself(two_workers, tmp_path):
    """The workers see the gateway (loopback) as the peer: the gateway refuses shared memory to a
    client outside its grpc.client_shm_peers, and serves that client otherwise."""
    from tests.test_access import SourceRelay
    workers = addresses(two_workers)
    cfg = parse_gateway_config({"grpc": {"client_shm_peers": ["127.0.0.1/32"]}, "endpoints": ["127.0.0.1:1"]})
    g = GatewayThread(workers, cfg)
    try:
        g.wait_ready(models=2)
        with SourceRelay(("127.0.0.1", g.gateway.grpc_port), "127.0.0.2") as relay:
            remote = grpcclient.InferenceServerClient(f"127.0.0.1:{relay.port}")
            for call, rpc in ((lambda: remote.register_system_shared_memory("r", "/xlaserve-gw-remote", 64),
                               "SystemSharedMemoryRegister"),
                              (lambda: remote.get_system_shared_memory_status(), "SystemSharedMemoryStatus")):
                with pytest.raises(InferenceServerException) as err:
                    call()
                assert "StatusCode.PERMISSION_DENIED" in str(err.value.status())
                assert f"{rpc}: client shared memory is accepted only from peers in the gateway's " \
                       "grpc.client_shm_peers (127.0.0.1/32)" in str(err.value) and "127.0.0.2" in str(err.value)
            tensor = grpcclient.InferInput("input", [1, 512], "FP32")
            tensor.set_shared_memory("r", 2048)
            with pytest.raises(InferenceServerException, match="ModelInfer: client shared memory"):
                remote.infer("mlp", [tensor])
            assert remote.infer("mlp", _mlp_input()).as_numpy("output").shape[0] == 1
            remote.close()
    finally:
        g.stop()


class RestGatewayThread(GatewayThread):
    """The gateway with its REST port too (``listen.rest``), on a free port."""

    async def _serve(self, nursery: trio.Nursery) -> int:
        grpc_port, _ = await nursery.start(self.gateway.run, "127.0.0.1", 0, "127.0.0.1", 0, ("127.0.0.1", 0))
        return grpc_port


def test_the_gateways_rest_port_checks_client_shm_peers_and_routes_inference(two_workers):
    """REST through a gateway (as a standalone one runs it): shared memory is refused to a peer
    outside the gateway's grpc.client_shm_peers with 403 and the gateway's message; inference
    from that peer is routed to the workers."""
    import tritonclient.http as httpclient

    from tests.test_access import SourceRelay
    cfg = parse_gateway_config({"grpc": {"client_shm_peers": ["127.0.0.1/32"]}, "endpoints": ["127.0.0.1:1"]})
    g = RestGatewayThread(addresses(two_workers), cfg)
    try:
        g.wait_ready(models=2)
        with SourceRelay(("127.0.0.1", g.gateway.rest_port), "127.0.0.2") as relay:
            remote = httpclient.InferenceServerClient(f"127.0.0.1:{relay.port}")
            with pytest.raises(InferenceServerException) as err:
                remote.register_system_shared_memory("r", "/xlaserve-gw-remote", 64)
            assert err.value.status() == "403"
            assert "client shared memory is accepted only from peers in the gateway's grpc.client_shm_peers" \
                in err.value.message() and "127.0.0.2" in err.value.message()
            t = httpclient.InferInput("input", [1, 512], "FP32")
            t.set_data_from_numpy(np.full((1, 512), 0.5, np.float32))
            assert remote.infer("mlp", [t]).as_numpy("output").shape == (1, 512)
            remote.close()
        assert sum(n for (_, model), n in g.routed().items() if model == "mlp") >= 1
    finally:
        g.stop()


def test_stream_infer_goes_through_the_gateway_in_order(gateway):
    import queue
    client = grpcclient.InferenceServerClient(gateway.url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        for i in range(4):
            client.async_stream_infer("mlp", _mlp_input(), request_id=str(i))
        client.async_stream_infer("nope", _mlp_input(), request_id="bad")
        got = [results.get(timeout=TIMEOUT) for _ in range(5)]
    finally:
        client.stop_stream()
    assert [r.get_response().id for r, e in got[:4]] == ["0", "1", "2", "3"]
    assert all(e is None for _, e in got[:4])
    assert got[4][1] is not None and "'nope' is not served by any worker" in str(got[4][1])


def test_lpt_packing_places_each_model_on_one_worker_and_frees_its_host_copy_elsewhere(two_workers):
    g = GatewayThread(addresses(two_workers), config("lpt_packing"))
    try:
        g.wait_ready(models=2)
        deadline = time.monotonic() + TIMEOUT
        placement = None
        while time.monotonic() < deadline and placement is None:
            placement = trio.from_thread.run_sync(lambda: g.gateway.placement, trio_token=g.token)
            time.sleep(0.05)
        assert placement is not None
        assert all(len(ws) == 1 for ws in placement.workers_of.values())      # default_replicas 1
        client = grpcclient.InferenceServerClient(g.url)
        for _ in range(6):
            client.infer("mlp", _mlp_input())
        [home] = placement.workers_of["mlp"]
        assert g.routed().get((home, "mlp"), 0) == 6 and sum(
            n for (w, m), n in g.routed().items() if m == "mlp" and w != home) == 0
        # the worker mlp is not placed on holds no host copy of it any more
        other = two_workers[1 - int(home[-1])]
        while time.monotonic() < deadline:
            residency = _residency(other, "mlp")
            if residency == "unpinned":
                break
            time.sleep(0.1)
        assert residency == "unpinned" and _residency(two_workers[int(home[-1])], "mlp") == "system"
        page = trio.from_thread.run_sync(lambda: g.gateway.routes()["/metrics"](), trio_token=g.token)[2].decode()
        assert f'xlaserve_gateway_placed{{model="mlp",worker="{home}"}} 1.0' in page
    finally:
        g.stop()
        for server in two_workers:          # leave the shared workers as they were
            for model in ("mlp", "simple", "img_mean"):
                _set_residency(server, model, "system")


def _control(server, method: str, request, reply_type):
    import grpc
    with grpc.insecure_channel(server.url) as channel:
        call = channel.unary_unary(f"/xlaserve.control.WorkerControl/{method}",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=reply_type.FromString)
        return call(request, timeout=10)


def _residency(server, model: str) -> str:
    from xlaserve._proto import xlaserve_control_pb2 as cpb
    status = _control(server, "ModelControlStatus", cpb.ModelControlStatusRequest(), cpb.ModelControlStatusResponse)
    return next(m.residency for m in status.models if m.name == model)


def _set_residency(server, model: str, residency: str) -> None:
    from xlaserve._proto import xlaserve_control_pb2 as cpb
    try:
        _control(server, "SetModelResidency", cpb.SetModelResidencyRequest(model=model, residency=residency),
                 cpb.SetModelResidencyResponse)
    except Exception:
        pass        # a model the repository does not have


def test_a_worker_stopped_gracefully_under_load_costs_no_request(examples_repo, tmp_path):
    """SIGTERM to a worker: it sends GOAWAY and drains; the gateway stops routing to it, sends
    what the worker refused (never ran) to the other one, and every client call succeeds."""
    with ExitStack() as stack:
        servers = [stack.enter_context(serve(tmp_path / f"w{i}", examples_repo)) for i in range(2)]
        g = gateway_over(stack, servers, config("round_robin"))
        g.wait_ready(models=2)
        load = Load(g.url, clients=6)
        time.sleep(1.0)
        servers[1].process.send_signal(signal.SIGTERM)
        assert servers[1].process.wait(30) == 0
        time.sleep(1.0)
        outcomes = load.stop()
    assert load.wrong == 0
    assert [o for o in outcomes if o[2]] == []
    assert len(outcomes) > 100


def test_lpt_packing_reloads_a_placed_model_on_its_workers_only(examples_repo, tmp_path):
    """Explicit mode: the first load of a model reaches every worker (it is not placed yet); once
    placed, a load (a reload) reaches only the worker it is placed on."""
    with ExitStack() as stack:
        servers = [stack.enter_context(serve(tmp_path / f"w{i}", examples_repo, {
            "model_control_mode": "explicit", "scheduler": {"discipline": "fifo"}}, wait_ready=False)) for i in range(2)]
        workers = addresses(servers)
        g = gateway_over(stack, servers, config("lpt_packing"))
        client = grpcclient.InferenceServerClient(g.url)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and not all(
                trio.from_thread.run_sync(lambda: g.gateway.upstreams[w.name].up, trio_token=g.token) for w in workers):
            time.sleep(0.05)
        client.load_model("mlp")
        g.wait_ready(models=1)
        placement = None
        while time.monotonic() < deadline and not (placement and "mlp" in placement.workers_of):
            placement = trio.from_thread.run_sync(lambda: g.gateway.placement, trio_token=g.token)
            time.sleep(0.05)
        [home] = placement.workers_of["mlp"]
        client.load_model("mlp")
        versions = {}
        for i, server in enumerate(servers):
            index = grpcclient.InferenceServerClient(server.url).get_model_repository_index(as_json=True)
            versions[f"worker{i}"] = next(m.get("version") for m in index["models"] if m["name"] == "mlp")
        other = next(w.name for w in workers if w.name != home)
        assert versions[home] == "2" and versions[other] == "1", versions


def test_the_standalone_gateway_follows_a_dns_name_and_stops_on_sigterm(two_workers, tmp_path):
    """`xlaserve gateway FILE`: an endpoint named by DNS (localhost) resolves to the worker; the
    Triton client is served through it; SIGTERM drains and exits 0."""
    import json
    import subprocess
    import sys

    import yaml
    config_file = tmp_path / "gateway.yaml"
    config_file.write_text(yaml.safe_dump({"listen": {"grpc": "127.0.0.1:0", "metrics": "127.0.0.1:0"},
                                           "endpoints": [f"localhost:{two_workers[0].grpc_port}"],
                                           "logging": {"level": "info"}, "cpu_policy": "batch"}))
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "xlaserve", "gateway", str(config_file), "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        url = f"127.0.0.1:{json.loads(ready.read_text())['grpc_port']}"
        client = grpcclient.InferenceServerClient(url)
        while time.monotonic() < deadline and not client.is_server_ready():
            time.sleep(0.05)
        assert client.infer("mlp", _mlp_input()).as_numpy("output").shape[0] == 1
        # cpu_policy batch: every thread of the process, those started after it too
        assert _thread_policies(proc.pid) == {os.SCHED_BATCH}
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, out
    assert f"connected to worker localhost:{two_workers[0].grpc_port}@127.0.0.1" in out, out
    assert "SIGTERM: draining" in out and "gateway stopped" in out


def test_a_standalone_lpt_packing_gateway_refuses_a_worker_that_runs_fair(examples_repo, tmp_path):
    with serve(tmp_path / "fair", examples_repo) as fair:          # the default discipline: fair
        g = GatewayThread([WorkerAddress("w0", "127.0.0.1", fair.grpc_port)], config("lpt_packing"))
        try:
            deadline = time.monotonic() + TIMEOUT
            why = ""
            while time.monotonic() < deadline and "refused" not in why:
                why = trio.from_thread.run_sync(lambda: g.gateway.ready_reason()[1], trio_token=g.token)
                time.sleep(0.05)
            assert "refused (they run scheduler.discipline fair): w0" in why
            with pytest.raises(InferenceServerException) as err:
                grpcclient.InferenceServerClient(g.url).infer("mlp", _mlp_input())
            assert "w0: refused: it runs scheduler.discipline fair, lpt_packing needs fifo or edf" in str(err.value)
        finally:
            g.stop()


def test_a_malformed_metadata_request_is_invalid_argument_at_the_gateway(gateway):
    import grpc
    with grpc.insecure_channel(gateway.url) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelMetadata",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            call(b"\x0a\xff", timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid inference.ModelMetadataRequest message" in err.value.details()
    assert grpcclient.InferenceServerClient(gateway.url).is_server_live()


def _worker_connects(gateway) -> int:
    return trio.from_thread.run_sync(lambda: sum(u.connects for u in gateway.gateway.upstreams.values()),
                                     trio_token=gateway.token)


def test_metadata_that_fits_the_gateway_but_not_the_worker_fails_that_call_alone(gateway):
    """A client's header block within the gateway's limits that crosses the worker's once the
    gateway adds its own fields (``te``, a longer ``:authority``): the worker would end the
    gateway's connection to it (GOAWAY ENHANCE_YOUR_CALM), failing every client's calls on it.
    The call fails RESOURCE_EXHAUSTED naming the limit; the connection stays."""
    from tests.h2attacks import RawConnection, data_frames, grpc_message, header_frames, literal, mlp_request
    base = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
            (b":authority", b"a"), (b"content-type", b"application/grpc")]
    size = sum(len(n) + len(v) + 32 for n, v in base) + 32 + len(b"x-pad")
    cases = {"100 fields (no te)": (base + [(b"x-%d" % i, b"v") for i in range(100 - len(base))],
                                    "make 101 header fields", "endpoints.max_header_fields"),
             "a header list 1 byte under 64 KiB": (base + [(b"x-pad", b"a" * (65535 - size))],
                                                   "make a header list of 65", "endpoints.max_header_list_bytes")}
    connects = _worker_connects(gateway)
    for case, (fields, said, key) in cases.items():
        conn = RawConnection.open(("127.0.0.1", int(gateway.url.rsplit(":", 1)[1])), deadline=time.monotonic() + TIMEOUT)
        try:
            block = b"".join(literal(n, v) for n, v in fields)
            frame_size = conn.server.max_frame_size
            conn.send(header_frames(1, block, frame_size) + data_frames(1, grpc_message(mlp_request(1)), frame_size))
            assert conn.wait_for(lambda c: c.statuses, time.monotonic() + TIMEOUT), (case, conn.closed)
            assert conn.statuses == {"8": 1} and conn.closed is None, (case, conn.statuses, conn.closed)
            assert said in conn.messages[0] and key in conn.messages[0], (case, conn.messages)
        finally:
            conn.close()
    assert _worker_connects(gateway) == connects          # the workers' connections were not closed
    assert grpcclient.InferenceServerClient(gateway.url).infer("mlp", _mlp_input()).as_numpy("output").shape[0] == 1



def test_clients_that_cancel_many_calls_do_not_get_the_workers_connection_closed(examples_repo, tmp_path):
    """Each call a client resets, the gateway resets at the worker, and a worker counts every reset
    it receives against its glitch bucket (1000, refilled at 33/s): three clients each resetting 720
    calls (within the gateway's bucket for each) would empty it, and the worker would close the
    gateway's connection (GOAWAY ENHANCE_YOUR_CALM), failing every client's calls. The gateway
    paces its resets to a worker instead; the connection stays. (``mlp`` is held at the worker, so
    each call is still open there when its client resets it.)"""
    from tests.h2attacks import (RST_STREAM, RawConnection, data_frames, frame, grpc_message, header_frames,
                                 mlp_request, request_block)
    held = {"models": {"mlp": {"batch_delay_seconds": 60.0, "batch_target_rows": 32}}}
    with serve(tmp_path / "held", examples_repo, {"scheduler": held}) as worker, ExitStack() as stack:
        streams = 16        # calls open to the worker at once: fewer than the rows that end the hold
        gateway = gateway_over(stack, [worker], config(max_concurrent_streams=streams))
        gateway.wait_ready(models=4)
        connects = _worker_connects(gateway)
        address = ("127.0.0.1", int(gateway.url.rsplit(":", 1)[1]))
        block = request_block("/inference.GRPCInferenceService/ModelInfer")
        body = grpc_message(mlp_request(1))
        for _ in range(3):
            conn = RawConnection.open(address, deadline=time.monotonic() + TIMEOUT)
            try:
                size = conn.server.max_frame_size
                for first in range(1, 1 + 2 * 720, 2 * streams):    # sent, forwarded, then reset
                    sids = range(first, first + 2 * streams, 2)
                    conn.send(b"".join(header_frames(sid, block, size) + data_frames(sid, body, size) for sid in sids))
                    time.sleep(0.03)
                    conn.send(b"".join(frame(RST_STREAM, 0, sid, (8).to_bytes(4, "big")) for sid in sids))
                assert conn.closed is None, (conn.closed, conn.goaway_debug)
            finally:
                conn.close()
        assert _worker_connects(gateway) == connects, "the worker closed the gateway's connection"
        simple = [infer_input(f"INPUT{i}", np.arange(16, dtype=np.int32).reshape(1, 16), "INT32") for i in (0, 1)]
        assert grpcclient.InferenceServerClient(gateway.url).infer("simple", simple).as_numpy("OUTPUT0").shape == (1, 16)
