"""End to end: a catalog three times the device weight budget, served by the real server."""
from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from tests.conftest import serve
from tui.connection import fetch_status, parse_address
from benchmarks.weight_bundles import FEATURES, clone_weight_bundle, export_weight_bundle

MB = 1 << 20
SYSTEM = [f"w{i}" for i in range(8)]


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    """8 system models, one pinned (node-file pin map), one unpinned: 1 MiB each; 'big' 4 MiB."""
    repo = tmp_path_factory.mktemp("weights") / "models"
    first = export_weight_bundle(repo, "w0", MB, mark=0.0)
    for i, name in enumerate([*SYSTEM[1:], "pinned", "unp"], 1):
        clone_weight_bundle(first, name, mark=float(i))
    export_weight_bundle(repo, "big", 4 * MB, mark=99.0)
    return repo


MARKS = {name: float(i) for i, name in enumerate([*SYSTEM, "pinned", "unp"])}


def infer(client, name, value=1.0):
    x = np.full((1, FEATURES), value, np.float32)
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(name, [inp]).as_numpy("output")


def metric(text: str, name: str, model: str | None = None) -> float:
    label = f'{{model="{model}"}}' if model else ""
    m = re.search(rf"^{name}(?:_total)?{re.escape(label)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def eviction_ranks(text: str) -> dict[str, int]:
    return {m: int(float(v)) for m, v in re.findall(
        r'^xlaserve_weight_cache_model_eviction_rank\{model="(\w+)",version="1"\} (\S+)$', text, re.M)}


def test_catalog_three_times_the_budget(tmp_path, catalog):
    trace = tmp_path / "weights.jsonl"
    runtime = {"backend": "cpu", "device_memory_bytes": 4 * MB, "weight_cache_wiggle_fraction": 0.25,
               "weight_trace": str(trace)}
    sched = {"models": {"unp": {"residency": "unpinned"}}}
    with serve(tmp_path, catalog, {"runtime": runtime, "scheduler": sched},
               models={"pinned": ["worker0"]}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        # too big for the 3 MiB budget: UNAVAILABLE at load, with the numbers
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert index["big"].state == "UNAVAILABLE"
        assert "4.0 MiB" in index["big"].reason and "3.0 MiB (3145728 bytes)" in index["big"].reason
        assert all(index[n].state == "READY" for n in MARKS)

        # mixed traffic over ten 1 MiB models through a 3 MiB budget (one MiB of it pinned)
        rng = np.random.default_rng(0)
        names = [str(n) for n in rng.choice(list(MARKS), 120)]

        def call(i_name):
            i, name = i_name
            out = infer(client, name, float(i))
            return name, float(out[0, 0]), float(i) + MARKS[name]
        with ThreadPoolExecutor(6) as pool:
            for name, got, want in pool.map(call, enumerate(names)):
                assert got == want, name

        status, text = server.get("/metrics")
        assert status == 200
        assert metric(text, "xlaserve_weight_cache_budget_bytes") == 3 * MB
        assert 0 < metric(text, "xlaserve_weight_cache_resident_bytes") <= 3 * MB
        assert metric(text, "xlaserve_weight_cache_evictions") > 0
        assert metric(text, "xlaserve_weight_cache_misses") > 0 and metric(text, "xlaserve_weight_cache_hits") > 0
        assert metric(text, "xlaserve_weight_cache_model_evictions", "pinned") == 0
        assert metric(text, "xlaserve_weight_cache_model_resident_bytes", "pinned") == MB
        assert metric(text, "xlaserve_weight_cache_model_misses", "pinned") == 0     # loaded at admission
        assert metric(text, "xlaserve_weight_cache_model_bytes_copied", "pinned") == MB
        assert metric(text, "xlaserve_weight_cache_bytes_copied") >= MB * (1 + metric(text, "xlaserve_weight_cache_misses"))
        # what the cache would evict next, in order: every resident model but the pinned one,
        # ranked 1..n; the status stream says the same (a prefetch may still land after the
        # last answer: read until two scrapes around the status agree)
        for _ in range(100):
            status = asyncio.run(fetch_status(parse_address(server.url)))
            again = server.get("/metrics")[1]
            if eviction_ranks(again) == eviction_ranks(text):
                break
            text = again
        ranks = eviction_ranks(text)
        resident = {m for m in MARKS if metric(text, "xlaserve_weight_cache_model_resident_bytes", m) > 0}
        assert set(ranks) == resident - {"pinned"} and sorted(ranks.values()) == list(range(1, len(ranks) + 1))
        assert re.search(r'^xlaserve_weight_cache_policy_info\{policy="gdsf"\} 1\.0$', text, re.M)
        assert metric(text, "xlaserve_weight_cache_prefetches") >= (
            metric(text, "xlaserve_weight_cache_prefetches_landed") + metric(text, "xlaserve_weight_cache_prefetches_late"))
        assert metric(text, "xlaserve_weight_pool_regions") >= 1
        pool_used = metric(text, "xlaserve_weight_pool_used_bytes")
        assert metric(text, "xlaserve_weight_pool_reserved_bytes") >= pool_used > 0
        assert status.eviction_policy == "gdsf"
        assert {m.name: m.eviction_rank for m in status.models if m.eviction_rank} == ranks
        assert sum(m.weight_misses for m in status.models) == metric(text, "xlaserve_weight_cache_misses")

        # unpinned keeps no host copy: with its file gone, its next load fails; a system model
        # whose file is gone still loads from its host copy
        (catalog / "unp" / "weights.safetensors").rename(catalog / "unp.moved")
        (catalog / "w1" / "weights.safetensors").rename(catalog / "w1.moved")
        try:
            # other models until unp is evicted (under gdsf a hot unp outlasts a few one-off models)
            for i in range(400):
                infer(client, ("w2", "w3", "w4", "w1")[i % 4])
                if metric(server.get("/metrics")[1], "xlaserve_weight_cache_model_resident_bytes", "unp") == 0:
                    break
            infer(client, "w1")                                # and w1 is reloaded from its host copy
            assert float(infer(client, "w1")[0, 0]) == 1.0 + MARKS["w1"]
            with pytest.raises(InferenceServerException, match="No such file") as info:
                infer(client, "unp")
            assert info.value.status() == "StatusCode.UNAVAILABLE"
            assert "residency unpinned) cannot read its weights" in info.value.message()
            assert float(infer(client, "w2", 2.0)[0, 0]) == 2.0 + MARKS["w2"]   # and it keeps serving
        finally:
            (catalog / "unp.moved").rename(catalog / "unp" / "weights.safetensors")
            (catalog / "w1.moved").rename(catalog / "w1" / "weights.safetensors")
        assert float(infer(client, "unp")[0, 0]) == 1.0 + MARKS["unp"]
        text = server.get("/metrics")[1]
        dispatches = metric(text, "xlaserve_weight_cache_hits") + metric(text, "xlaserve_weight_cache_misses")
        misses = metric(text, "xlaserve_weight_cache_misses")
    # the worker recorded every reference of a model with weights (the pinned one's too)
    from xlaserve.runtime.cachetrace import read_trace
    header, events = read_trace(trace)
    assert header.budget_bytes == 3 * MB and header.policy == "gdsf"
    # one reference per dispatch (concurrent requests coalesce), the trace closed at shutdown
    assert len(events) == dispatches and sum(not e.hit for e in events) == misses > 0
    assert {e.model for e in events} <= set(MARKS) and any(e.hit for e in events)


def test_all_resident_catalog_that_does_not_fit_fails_start_up_with_sizes(tmp_path, catalog):
    runtime = {"backend": "cpu", "device_memory_bytes": 4 * MB, "weight_cache_fraction": 0.0,
               "weight_cache_wiggle_fraction": 0.25}
    with serve(tmp_path, catalog, {"runtime": runtime}, wait_ready=False) as server:
        assert server.process.wait(60) == 2   # a start-up error: one line, exit status 2
        log = server.log()
    assert "cannot start: weight_cache_fraction is 0" in log and "Traceback" not in log
    assert "3.0 MiB (3145728 bytes)" in log and "resident already" in log
