"""The scheduler end to end: the real server, the real Triton client. Concurrent requests are
coalesced and each gets exactly its own rows back; a full queue and a hopeless deadline are
answered with the right status; statistics and metrics show what happened."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import InferenceServerException

from examples import reference
from tests.conftest import infer_input, serve


@pytest.fixture(scope="module")
def edf_server(examples_repo, tmp_path_factory):
    sched = {"discipline": "edf", "max_queue_depth": 2}
    with serve(tmp_path_factory.mktemp("sched_e2e"), examples_repo,
               {"scheduler": sched, "models_include": ["mlp", "img_mean"]}) as server:
        yield server
    assert server.process.returncode == 0, server.log()


def _metric(body: str, prefix: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(prefix))


def test_coalesced_requests_each_get_their_own_rows(example_server):
    sync = grpcclient.InferenceServerClient(example_server.url)
    before = sync.get_inference_statistics("mlp").model_stats[0]
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal((int(rng.integers(1, 4)), 512)).astype(np.float32) for _ in range(48)]

    async def main():
        async with aioclient.InferenceServerClient(example_server.url) as c:
            return await asyncio.gather(*[c.infer("mlp", [infer_input("input", x, "FP32", aioclient)], request_id=str(i))
                                          for i, x in enumerate(xs)])
    results = asyncio.run(main())
    for i, (x, r) in enumerate(zip(xs, results)):
        assert r.get_response().id == str(i)
        np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-5, atol=1e-5)

    after = sync.get_inference_statistics("mlp").model_stats[0]
    rows = sum(len(x) for x in xs)
    executions = after.execution_count - before.execution_count
    assert after.inference_count - before.inference_count == rows
    assert executions < len(xs), "48 concurrent requests ran without any coalescing"
    stats = after.inference_stats
    assert stats.success.count - before.inference_stats.success.count == len(xs)
    assert stats.queue.count == stats.success.count and stats.queue.ns > before.inference_stats.queue.ns
    assert stats.compute_infer.count == stats.success.count
    assert sum(b.compute_infer.count for b in after.batch_stats) == after.execution_count
    status, body = example_server.get("/metrics")
    assert status == 200
    assert _metric(body, 'xlaserve_batch_size_count{model="mlp"}') == after.execution_count
    assert 'xlaserve_queue_depth{model="mlp"} 0.0' in body
    assert _metric(body, 'xlaserve_queue_duration_seconds_count{model="mlp"}') == stats.success.count
    assert _metric(body, 'xlaserve_compute_duration_seconds_count{model="mlp"}') == after.execution_count


def test_a_held_dispatch_gathers_its_target_rows_into_one_execution(examples_repo, tmp_path_factory):
    """batch_delay_seconds end to end: eight requests sent together run as one execution of 8,
    each with its own rows, although the first one found the device free. The delay is far
    longer than the client's timeout, so only reaching batch_target_rows can end the hold."""
    sched = {"models": {"mlp": {"batch_delay_seconds": 60.0, "batch_target_rows": 8}}}
    xs = [np.full((1, 512), i / 8, np.float32) for i in range(8)]

    async def main(url):
        async with aioclient.InferenceServerClient(url) as c:
            return await asyncio.gather(*[c.infer("mlp", [infer_input("input", x, "FP32", aioclient)],
                                                  request_id=str(i), client_timeout=20)
                                          for i, x in enumerate(xs)])
    with serve(tmp_path_factory.mktemp("held"), examples_repo,
               {"scheduler": sched, "models_include": ["mlp"]}) as server:
        results = asyncio.run(main(server.url))
        stats = grpcclient.InferenceServerClient(server.url).get_inference_statistics("mlp").model_stats[0]
    for i, (x, r) in enumerate(zip(xs, results)):
        assert r.get_response().id == str(i)
        np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-5, atol=1e-5)
    assert (stats.inference_count, stats.execution_count) == (8, 1)
    assert [(b.batch_size, b.compute_infer.count) for b in stats.batch_stats] == [(8, 1)]


def test_a_drain_dispatches_a_held_batch_at_once(examples_repo, tmp_path_factory):
    """SIGTERM while a request is held for more rows: the worker used to hold it for rows that
    could no longer come, the device idle, until its dispatch timeout less the cost (30 s); the
    drain's own 30 s limit ended first, and the request was answered UNAVAILABLE without running.
    Now the drain ends the hold: the request is answered and the worker exits at once."""
    sched = {"models": {"mlp": {"batch_delay_seconds": 1000.0, "batch_target_rows": 8}}}
    x = np.full((1, 512), 0.5, np.float32)
    with serve(tmp_path_factory.mktemp("held_drain"), examples_repo,
               {"scheduler": sched, "models_include": ["mlp"]}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        answers = []

        def infer():
            try:
                answers.append(client.infer("mlp", [infer_input("input", x, "FP32")], client_timeout=60))
            except InferenceServerException as exc:
                answers.append(exc)
        request = threading.Thread(target=infer)
        request.start()
        while _metric(server.get("/metrics")[1], 'xlaserve_queue_depth{model="mlp"}') < 1:
            time.sleep(0.01)
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(60)
        request.join(60)
        took = time.monotonic() - started
    assert server.process.returncode == 0, server.log()
    assert took < 10, f"the drain took {took:.1f} s; the request's answer: {answers}"
    np.testing.assert_allclose(answers[0].as_numpy("output"), reference.mlp_ref(x), rtol=1e-5, atol=1e-5)


def test_full_queue_answers_resource_exhausted(edf_server):
    img = np.random.default_rng(1).integers(0, 256, (8, 224, 224, 3), dtype=np.uint8)

    async def one(c):
        try:
            r = await c.infer("img_mean", [infer_input("input", img, "UINT8", aioclient)])
            np.testing.assert_allclose(r.as_numpy("output"), reference.img_mean_ref(img), rtol=1e-5)
            return None
        except InferenceServerException as exc:
            return exc

    async def main():
        async with aioclient.InferenceServerClient(edf_server.url) as c:
            return await asyncio.gather(*[one(c) for _ in range(32)])
    errors = [e for e in asyncio.run(main()) if e is not None]
    assert errors, "32 concurrent requests against a queue of 2 were all admitted"
    for e in errors:
        assert e.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "model 'img_mean' has 2 requests queued" in e.message()
        assert "scheduler.max_queue_depth" in e.message()
    _, body = edf_server.get("/metrics")
    assert _metric(body, 'xlaserve_rejections_total{model="img_mean",reason="queue_full"}') == len(errors)


def test_edf_sheds_a_request_whose_timeout_is_shorter_than_the_learned_cost(edf_server):
    c = grpcclient.InferenceServerClient(edf_server.url)
    x = np.ones((1, 512), np.float32)
    inputs = [grpcclient.InferInput("input", [1, 512], "FP32")]
    inputs[0].set_data_from_numpy(x)
    for _ in range(3):                    # learn mlp's cost at batch size 1
        c.infer("mlp", inputs)
    with pytest.raises(InferenceServerException) as info:
        c.infer("mlp", inputs, timeout=1)  # Triton's timeout parameter: 1 microsecond
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "shed without running" in info.value.message()
    # a generous timeout runs normally
    r = c.infer("mlp", inputs, timeout=10_000_000)
    np.testing.assert_allclose(r.as_numpy("output"), reference.mlp_ref(x), rtol=1e-5, atol=1e-5)
    _, body = edf_server.get("/metrics")
    assert _metric(body, 'xlaserve_rejections_total{model="mlp",reason="deadline_shed"}') == 1


def test_xlaserve_bench_reports_json_lines_per_model(example_server):
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "xlaserve", "bench", "--url", example_server.url, "-m", "mlp",
                          "-m", "simple", "--mix", "zipf", "--zipf-s", "1.2", "-c", "4", "-d", "1", "--warmup", "0.2",
                          "--timeout-ms", "5000", "--quiet"], capture_output=True, text=True, timeout=120, check=True)
    rows = {r["model"]: r for r in map(json.loads, out.stdout.splitlines())}
    assert set(rows) == {"mlp", "simple", "*"}
    assert rows["*"]["requests"] == rows["mlp"]["requests"] + rows["simple"]["requests"] > 0
    assert rows["mlp"]["requests"] > rows["simple"]["requests"]      # Zipf favours the first model
    assert rows["*"]["errors"] == {} and rows["*"]["p99_ms"] >= rows["*"]["p50_ms"] > 0
    assert "req/s" in out.stderr and "p99 ms" in out.stderr           # the table


def test_an_output_in_shared_memory_without_client_shm_is_refused_before_running(edf_server):
    """The server has no client shared memory: the request is refused on arrival, not after an
    execution that could never be answered."""
    sync = grpcclient.InferenceServerClient(edf_server.url)
    before = sync.get_inference_statistics("mlp").model_stats[0].execution_count
    out = grpcclient.InferRequestedOutput("output")
    out.set_shared_memory("nowhere", 2048)
    with pytest.raises(InferenceServerException) as e:
        sync.infer("mlp", [infer_input("input", np.zeros((1, 512), np.float32), "FP32")], outputs=[out])
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "output 'output' names a shared-memory region, but client shared memory is not enabled" in e.value.message()
    assert sync.get_inference_statistics("mlp").model_stats[0].execution_count == before
