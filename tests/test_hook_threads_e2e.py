"""Hook threads seen from outside, end to end: a real worker on loopback, the Triton client.
A postprocess whose outputs are larger than a reply may carry is refused RESOURCE_EXHAUSTED
naming the hook, the size and the limit (decided in the hook's thread, before anything is
encoded); with every hook thread held by hooks that do not return, ``/metrics`` shows the pool
busy and counts the requests that never got a thread, and the control status says the same."""
from __future__ import annotations

import json
import queue
import re
import shutil
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from examples.export_examples import export_simple
from tests.conftest import infer_input, serve
from xlaserve.cli import main

LIMIT = 1_000_000           # endpoints.max_send_msg_bytes
BIG = 2_000_000             # bytes per row of the postprocess' output

POST = '''
import pathlib
import time

import numpy as np
from xlaserve import NamedTensor, register_model

RELEASE = pathlib.Path({release!r})


def postprocess(tensors):
    by_name = {{t.name: t for t in tensors}}
    rows = by_name["OUTPUT0"].data.shape[0]
    if int(by_name["OUTPUT0"].data[0, 0]) < 0:              # hang until released
        deadline = time.monotonic() + 120
        while not RELEASE.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
    return [NamedTensor("big", np.zeros((rows, {big}), np.uint8))]

register_model("big_out", postprocess=postprocess)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("hook_threads")
    repo = root / "models"
    release = root / "release"
    export_simple(repo, (1,))
    bundle = shutil.copytree(repo / "simple", repo / "big_out")
    manifest = bundle / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("name: simple", "name: big_out")
                        + f"client_outputs:\n- {{name: big, dtype: u8, shape: kn, dims: {{k: {BIG}}}}}\n")
    (bundle / "model.py").write_text(POST.format(release=str(release), big=BIG))
    with serve(root / "server", repo, {"endpoints": {"max_send_msg_bytes": LIMIT}}) as running:
        running.release = release
        yield running
        release.touch()
    assert running.process.returncode == 0, running.log()


def _inputs(first: int) -> list:
    x = np.zeros((1, 16), np.int32)
    x[0, 0] = first
    return [infer_input("INPUT0", x, "INT32"), infer_input("INPUT1", np.zeros((1, 16), np.int32), "INT32")]


def _metrics(server) -> dict[str, float]:
    """The hook-thread series of the worker's /metrics, by their text up to the value."""
    status, body = server.get("/metrics")
    assert status == 200
    return {name: float(value) for name, value in
            re.findall(r'^(xlaserve_hook_(?:threads|threads_busy|requests_waiting|starved_total)\{[^}]*\}) (\S+)$',
                       body, re.M)}


def test_a_postprocess_output_larger_than_a_reply_may_carry_is_refused_naming_hook_size_and_limit(server):
    c = grpcclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException) as info:
        c.infer("big_out", _inputs(0))
    assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED", info.value
    assert info.value.message() == (
        f"model 'big_out': the outputs its postprocess hook returned are {BIG} bytes in the response (tensor 'big': "
        f"{BIG} bytes), the limit (endpoints.max_send_msg_bytes) is {LIMIT}; ask for the outputs in shared memory or "
        "raise the limit")
    assert server.process.poll() is None


def test_hook_threads_held_by_hung_hooks_show_on_metrics_and_starved_requests_are_counted(server, capsys):
    """16 hooks that do not return (yet) hold all 16 hook threads; three more requests never get
    one and are answered at their deadline. /metrics and the control status show the pool full,
    and /metrics counts the three under their model; once the hooks return, the pool is idle
    again, and their outputs (too large for the reply) are refused as in the test above."""
    before = _metrics(server)
    assert before['xlaserve_hook_threads{pool="hook"}'] == 16
    assert before['xlaserve_hook_threads_busy{pool="hook"}'] == 0
    c = grpcclient.InferenceServerClient(server.url)
    done = queue.Queue()
    try:
        for _ in range(16):
            c.async_infer("big_out", _inputs(-1), lambda result, error: done.put(error), timeout=60_000_000)
        _wait_for(lambda: _metrics(server)['xlaserve_hook_threads_busy{pool="hook"}'] == 16)
        for _ in range(3):
            with pytest.raises(InferenceServerException) as info:
                c.infer("big_out", _inputs(-1), timeout=300_000)      # Triton's timeout, in us
            assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED", info.value
            assert "waited for a thread: all 16 hook threads are busy" in info.value.message()
        during = _metrics(server)
        assert during['xlaserve_hook_threads_busy{pool="hook"}'] == 16
        assert during['xlaserve_hook_requests_waiting{pool="hook"}'] == 0
        assert during['xlaserve_hook_starved_total{hook="postprocess",model="big_out"}'] == 3
        assert during['xlaserve_hook_threads{pool="meta"}'] == 64
        assert main(["top", "--once", "--json", server.url]) == 0      # the control status, as top reads it
        status = json.loads(capsys.readouterr().out)
        assert (status["hook_threads"], status["hook_threads_busy"], status["meta_threads"]) == (16, 16, 64)
    finally:
        server.release.touch()
    _wait_for(lambda: _metrics(server)['xlaserve_hook_threads_busy{pool="hook"}'] == 0)
    errors = [done.get(timeout=30) for _ in range(16)]
    assert all(e is not None and e.status() == "StatusCode.RESOURCE_EXHAUSTED" for e in errors), errors
    assert server.process.poll() is None


def _wait_for(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
