"""Model lifecycle end to end, against the real server with the real Triton client: hot reload
under load without a failed request, a broken bundle that keeps the old version serving,
remove and re-add, explicit and static control modes, the executable cache across restarts,
and the WorkerControl service."""
from __future__ import annotations

import asyncio
import math
import os
import re
import shutil
import signal
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from safetensors.numpy import save_file
from tritonclient.utils import InferenceServerException

from examples import reference
from examples.export_examples import export_mlp, export_simple
from tests.conftest import serve
from xlaserve._proto import xlaserve_control_pb2 as cpb
from xlaserve._proto.xlaserve_control_grpc import WorkerControlStub

DYNAMIC = {"model_control_mode": "dynamic", "model_poll_seconds": 0.5}
W1 = reference.mlp_weights()["w"]


def _wait(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _index(client) -> dict[str, object]:
    return {m.name: m for m in client.get_model_repository_index().models}


def _mlp(client, x: np.ndarray):
    t = grpcclient.InferInput("input", list(x.shape), "FP32")
    t.set_data_from_numpy(x)
    r = client.infer("mlp", [t])
    return r.get_response().model_version, r.as_numpy("output")


def _simple(client):
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    ins = []
    for name in ("INPUT0", "INPUT1"):
        t = grpcclient.InferInput(name, [1, 16], "INT32")
        t.set_data_from_numpy(a)
        ins.append(t)
    return client.infer("simple", ins).as_numpy("OUTPUT0")


def _write_weights(bundle: Path, w: np.ndarray) -> None:
    """Replace the weights the way a careful operator does: write beside, rename over."""
    tmp = bundle.parent / f".{bundle.name}.weights.tmp"
    save_file({"w": np.ascontiguousarray(w)}, str(tmp))
    os.replace(tmp, bundle / "weights.safetensors")


def _metric(server, name: str, **labels) -> float:
    body = server.get("/metrics")[1]
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{want}\}} (\S+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


class Load:
    """Client threads sending requests until stopped; every outcome is kept."""

    def __init__(self, url: str, threads: int = 4) -> None:
        self.url = url
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.results: list[tuple[str, np.ndarray, np.ndarray]] = []
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, i: int) -> None:
        client = grpcclient.InferenceServerClient(self.url)
        rng = np.random.default_rng(i)
        while not self.stop.is_set():
            x = rng.standard_normal((1 + i % 3, reference.MLP_HIDDEN)).astype(np.float32)
            try:
                if i % 4 == 3:
                    _simple(client)
                else:
                    version, y = _mlp(client, x)
                    self.results.append((version, x, y))
            except InferenceServerException as exc:
                self.errors.append(str(exc))

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self._threads:
            t.join()


def _control(server, call):
    async def go():
        channel = Channel("127.0.0.1", server.grpc_port)
        try:
            return await call(WorkerControlStub(channel))
        finally:
            channel.close()
    return asyncio.run(go())


@pytest.fixture
def repo(tmp_path) -> Path:
    repo = tmp_path / "models"
    export_simple(repo, (1,))
    export_mlp(repo, (1, 4))
    return repo


def test_dynamic_reload_break_remove_and_control(tmp_path, repo):
    with serve(tmp_path / "srv", repo, {**DYNAMIC, "cache_dir": str(tmp_path / "cache")}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        assert {n: m.version for n, m in _index(client).items()} == {"mlp": "1", "simple": "1"}
        log = server.log()
        assert "start-up: loading mlp (1 of 2)" in log and "start-up: 2 of 2 bundle(s) ready" in log

        # 1. New weights under load: new outputs, no restart, no failed request, and every
        #    answer computed by the version that reports it.
        w2 = -0.5 * W1
        with Load(server.url) as load:
            _wait(lambda: len(load.results) > 10, "traffic before the change")
            _write_weights(repo / "mlp", w2)
            _wait(lambda: _index(client)["mlp"].version == "2", "mlp version 2")
            seen = len(load.results)
            _wait(lambda: len(load.results) > seen + 10, "traffic after the change")
        assert load.errors == []
        refs = {"1": W1, "2": w2}
        assert {v for v, _, _ in load.results} == {"1", "2"}
        for version, x, y in load.results:
            np.testing.assert_allclose(y, np.tanh(x @ refs[version]), rtol=1e-4, atol=1e-5)

        # 2. A half-written weights file, then a broken manifest: version 2 keeps serving, and the
        #    failure shows in the index, the log and the metrics.
        failed_before = _metric(server, "xlaserve_model_loads_total", model="mlp", outcome="failed")
        with Load(server.url) as load:
            good = (repo / "mlp" / "weights.safetensors").read_bytes()
            (repo / "mlp" / "weights.safetensors").write_bytes(good[: len(good) // 3])
            entry = _wait(lambda: (m := _index(client)["mlp"]).reason and m, "a failed reload")
            assert entry.state == "READY" and entry.version == "2"
            assert "reload failed, still serving version 2" in entry.reason and "weights.safetensors" in entry.reason
            # Break the manifest before restoring the weights: a rescan between the two writes
            # must not find a good bundle (it would serve version 3 before the fix below).
            manifest = repo / "mlp" / "manifest.yaml"
            text = manifest.read_text()
            manifest.write_text(text.replace("dims: {f: 512}", "dims: {f: 513}"))
            (repo / "mlp" / "weights.safetensors").write_bytes(good)
            _wait(lambda: "513" in _index(client)["mlp"].reason, "the manifest error in the index")
            x = np.ones((1, reference.MLP_HIDDEN), np.float32)
            version, y = _mlp(client, x)
            assert version == "2"
            np.testing.assert_allclose(y, np.tanh(x @ w2), rtol=1e-4, atol=1e-5)
            manifest.write_text(text)
            # The failed reloads used no version numbers: the fix is version 3.
            _wait(lambda: (m := _index(client)["mlp"]).reason == "" and m.version != "2",
                  "a good reload after the fix")
            assert _index(client)["mlp"].version == "3"
            assert "mlp version 3 ready" in server.log() and "mlp version 4" not in server.log()
        assert load.errors == []
        assert _metric(server, "xlaserve_model_loads_total", model="mlp", outcome="failed") >= failed_before + 2
        assert "still serving version 2" in server.log()

        # 3. Remove a bundle, then put it back.
        parked = tmp_path / "parked_simple"
        shutil.move(repo / "simple", parked)
        _wait(lambda: "simple" not in _index(client), "simple to be unloaded")
        with pytest.raises(InferenceServerException) as err:
            _simple(client)
        assert "simple" in str(err.value)
        shutil.move(parked, repo / "simple")
        _wait(lambda: (m := _index(client).get("simple")) is not None and m.state == "READY", "simple re-added")
        np.testing.assert_array_equal(_simple(client), 2 * np.arange(16).reshape(1, 16))
        assert _index(client)["simple"].version == "2"

        # 4. The control service on the same port.
        status = _control(server, lambda s: s.ModelControlStatus(cpb.ModelControlStatusRequest()))
        models = {m.name: m for m in status.models}
        assert set(models) == {"mlp", "simple"} and status.backend == "cpu"
        mlp = models["mlp"]
        assert mlp.state == "READY" and mlp.weight_bytes == W1.nbytes and mlp.requests > 0
        assert mlp.residency == "system" and mlp.weight == 1.0 and mlp.max_batch_size == 0
        assert (mlp.batch_delay_seconds, mlp.batch_target_rows) == (0.0, 0)

        async def steer(stub):
            await stub.SetModelPolicy(cpb.SetModelPolicyRequest(model="mlp", weight=3.0, max_batch_size=1,
                                                                batch_delay_seconds=0.02, batch_target_rows=4))
            await stub.SetModelResidency(cpb.SetModelResidencyRequest(model="mlp", residency="device"))
            for weight in (-1, math.inf, math.nan, 5e-324, 1e9):       # 5e-324 took every dispatch
                with pytest.raises(GRPCError) as bad:
                    await stub.SetModelPolicy(cpb.SetModelPolicyRequest(model="mlp", weight=weight))
                assert bad.value.status is Status.INVALID_ARGUMENT and "finite number > 0" in bad.value.message
            with pytest.raises(GRPCError) as bad_hold:
                await stub.SetModelPolicy(cpb.SetModelPolicyRequest(model="mlp", batch_delay_seconds=-0.5))
            assert bad_hold.value.status is Status.INVALID_ARGUMENT
            assert "batch_delay_seconds must be >= 0" in bad_hold.value.message
            with pytest.raises(GRPCError) as missing:
                await stub.SetModelResidency(cpb.SetModelResidencyRequest(model="nope", residency="device"))
            assert missing.value.status is Status.NOT_FOUND
            assert missing.value.message.startswith("Request for unknown model: 'nope' is not found; ")
            compact = await stub.CompactMemory(cpb.CompactMemoryRequest())
            snapshots = []
            async with stub.WatchStatus.open() as stream:
                await stream.send_message(cpb.WatchStatusRequest(interval_seconds=0.05), end=True)
                async for snapshot in stream:
                    snapshots.append(snapshot)
                    if len(snapshots) == 3:
                        break
                await stream.cancel()
            return compact, snapshots
        compact, snapshots = _control(server, steer)
        assert compact.message and compact.freed_bytes >= 0
        assert len(snapshots) == 3
        mlp = {m.name: m for m in snapshots[-1].models}["mlp"]
        assert (mlp.weight, mlp.max_batch_size, mlp.residency) == (3.0, 1, "device")
        assert (mlp.batch_delay_seconds, mlp.batch_target_rows) == (0.02, 4)
        _control(server, lambda s: s.SetModelPolicy(cpb.SetModelPolicyRequest(model="mlp", max_batch_size=0)))
        status = _control(server, lambda s: s.ModelControlStatus(cpb.ModelControlStatusRequest()))
        assert {m.name: m for m in status.models}["mlp"].max_batch_size == 0
    assert server.process.returncode == 0, server.log()


def test_explicit_static_and_executable_cache(tmp_path):
    repo = tmp_path / "models"
    export_simple(repo, (1, 2))
    outside = tmp_path / "outside"
    export_simple(outside, (1,))
    cache = tmp_path / "cache"
    expected = 2 * np.arange(16).reshape(1, 16)

    # explicit: nothing until asked; load, serve, unload.
    # Served but not ready until a model is loaded.
    with serve(tmp_path / "explicit", repo, {"model_control_mode": "explicit", "cache_dir": str(cache)},
               wait_ready=False, listen={"grpc": "127.0.0.1:0", "http": "127.0.0.1:0", "rest": "127.0.0.1:0"}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        assert _index(client) == {}
        _wait(lambda: server.get("/readyz")[1] != "loading models\n", "the (empty) start-up set")
        assert server.get("/readyz") == (503, "no model is loaded (model_control_mode is explicit: load one "
                                              "with RepositoryModelLoad)\n")
        assert not client.is_server_ready()
        with pytest.raises(InferenceServerException, match=r"^\[StatusCode.NOT_FOUND\] Request for unknown model: "
                                                           "'nope' is not found; model 'nope' is not in the repository"):
            client.load_model("nope")
        # a name is joined to model_repo: before the check, these loaded the bundle outside it
        # (and would have run its hooks)
        for name in (str(outside / "simple"), "../outside/simple", "simple/../../outside/simple", ".."):
            with pytest.raises(InferenceServerException, match=r"^\[StatusCode.INVALID_ARGUMENT\] model name .* is "
                                                               "not a bundle name"):
                client.load_model(name)
        # a name longer than a file name may be (NAME_MAX, 255 bytes): os.stat raised ENAMETOOLONG
        # in the lifecycle actor, and the worker exited
        with pytest.raises(InferenceServerException, match=r"^\[StatusCode.INVALID_ARGUMENT\] model name 'a{40}\.\.\.' "
                                                           r"is 256 bytes long \(UTF-8\); a bundle's directory name "
                                                           r"is at most 255 bytes"):
            client.load_model("a" * 256)
        with pytest.raises(InferenceServerException, match="is 400 bytes long") as info:
            httpclient.InferenceServerClient(server.rest).load_model("\u00e9" * 200)
        assert info.value.status() == "400"
        assert _index(client) == {}
        client.load_model("simple")
        assert client.is_model_ready("simple") and client.is_server_ready()
        assert server.get("/readyz") == (200, "ready READY=1\n")
        np.testing.assert_array_equal(_simple(client), expected)
        assert "simple version 1 ready" in server.log() and "0 of 2 module(s) from the executable cache" in server.log()
        client.unload_model("simple")
        assert not client.is_model_ready("simple") and "simple" not in _index(client)
        assert _metric(server, "xlaserve_executable_cache_total", result="miss") == 2
        # the same over REST, as NVIDIA's simple_http_model_control does it
        rest = httpclient.InferenceServerClient(server.rest)
        with pytest.raises(InferenceServerException, match="Request for unknown model: 'nope' is not found") as info:
            rest.load_model("nope")
        assert info.value.status() == "404"
        rest.load_model("simple")
        assert rest.is_model_ready("simple") and rest.is_server_ready()
        assert [m["name"] for m in rest.get_model_repository_index()] == ["simple"]
        rest.unload_model("simple")
        assert not rest.is_model_ready("simple") and not rest.is_server_ready()

    # static, after a restart: both modules come from the cache; load/unload are refused.
    with serve(tmp_path / "static", repo, {"model_control_mode": "static", "cache_dir": str(cache)}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        np.testing.assert_array_equal(_simple(client), expected)
        assert "2 module(s) from the executable cache, 0 compiled" in server.log()
        assert _metric(server, "xlaserve_executable_cache_total", result="hit") == 2
        for call in (client.load_model, client.unload_model):
            with pytest.raises(InferenceServerException, match="model_control_mode is static"):
                call("simple")
        assert client.is_model_ready("simple")

    # A corrupted entry is ignored and rebuilt; the model still serves.
    entries = sorted(p for p in cache.rglob("*.xlaexe"))
    assert len(entries) == 2
    entries[0].write_bytes(entries[0].read_bytes()[:100])
    with serve(tmp_path / "corrupt", repo, {"model_control_mode": "static", "cache_dir": str(cache)}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        np.testing.assert_array_equal(_simple(client), expected)
        assert "ignoring entry" in server.log()
        assert "1 module(s) from the executable cache, 1 compiled" in server.log()
        assert _metric(server, "xlaserve_executable_cache_total", result="rejected") == 1


def test_a_fifo_in_place_of_a_cache_entry_is_ignored_and_the_bound_trims_the_rest(tmp_path):
    """A FIFO where an entry belongs held the load in open() for good (and every later load with
    it): the worker never became ready. Now it is named, recompiled and replaced, and with
    cache_max_bytes: 1 the other entry is removed after that write."""
    repo = tmp_path / "models"
    export_simple(repo, (1, 4))
    cache = tmp_path / "cache"
    with serve(tmp_path / "fill", repo, {"cache_dir": str(cache)}):
        pass
    entries = sorted(cache.rglob("*.xlaexe"))
    assert len(entries) == 2
    entries[0].unlink()
    os.mkfifo(entries[0], 0o600)
    with serve(tmp_path / "fifo", repo, {"cache_dir": str(cache), "cache_max_bytes": 1}, timeout=60) as server:
        client = grpcclient.InferenceServerClient(server.url)
        np.testing.assert_array_equal(_simple(client), 2 * np.arange(16).reshape(1, 16))
        log = server.log()
        assert "it is a FIFO (named pipe); expected a regular file; recompiling" in log
        assert "removed 1 least recently used entry" in log and "cache_max_bytes (1 bytes)" in log
    # a bound of 1 byte keeps only the entry written last (which of the two modules that is
    # depends on the order of the keys: the other one may have been written and trimmed after)
    left = sorted(cache.rglob("*.xlaexe"))
    assert len(left) == 1 and left[0] in entries and left[0].is_file()
    assert not any(stat.S_ISFIFO(path.lstat().st_mode) for path in cache.rglob("*"))


def test_cache_dir_writable_by_others_is_refused(tmp_path):
    repo = tmp_path / "models"
    export_simple(repo, (1,))
    cache = tmp_path / "shared_cache"
    cache.mkdir()
    os.chmod(cache, 0o777)
    with serve(tmp_path / "srv", repo, {"cache_dir": str(cache)}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        np.testing.assert_array_equal(_simple(client), 2 * np.arange(16).reshape(1, 16))
        assert "executable cache: disabled" in server.log() and "writable by other users" in server.log()
    assert list(cache.iterdir()) == []


def test_start_up_lists_every_bundle_as_loading_before_its_turn():
    """While start-up loads one bundle at a time, the others are in the table (LOADING, with a
    reason saying they wait), not absent: a gateway in front says 'loading', not 'no such
    model'. Each gets a plain LOADING entry when its own load begins."""
    import trio

    from xlaserve.worker.lifecycle import QUEUED, Lifecycle
    from xlaserve.worker.registry import ModelEntry, ModelState, ModelTable

    table = ModelTable()
    seen: list[dict[str, tuple[str, str]]] = []

    class Recording(Lifecycle):
        async def load(self, name):
            seen.append({n: (e.state.value, e.reason) for n, e in table.snapshot.items()})
            entry = ModelEntry(name, ModelState.READY)
            table.publish(entry)
            return entry

    lifecycle = Recording.__new__(Recording)
    lifecycle._table = table
    trio.run(lifecycle.load_all, ["a", "b", "c"])
    assert seen[0] == {"a": ("LOADING", QUEUED), "b": ("LOADING", QUEUED), "c": ("LOADING", QUEUED)}
    assert seen[2] == {"a": ("READY", ""), "b": ("READY", ""), "c": ("LOADING", QUEUED)}
    assert {n: e.state for n, e in table.snapshot.items()} == dict.fromkeys("abc", ModelState.READY)


def test_plan_rescan_compares_fingerprints():
    from xlaserve.worker.lifecycle import RescanPlan, plan_rescan
    plan = plan_rescan({"a": "1", "b": "2", "gone": "3"}, {"a": "1", "b": "9", "new": "4"})
    assert plan == RescanPlan(added=("new",), changed=("b",), removed=("gone",))
    assert not plan_rescan({"a": "1"}, {"a": "1"})


def test_sigterm_ends_an_open_status_stream_with_ok_instead_of_waiting_out_the_drain(tmp_path, repo):
    # grpcio, not grpclib: grpclib's client drops every open stream when a GOAWAY arrives, even
    # a graceful one, so it cannot see a stream end with OK during a drain.
    import grpc
    with serve(tmp_path / "srv", repo, {"cache_dir": None}) as server:
        with grpc.insecure_channel(server.url) as channel:
            watch = channel.unary_stream("/xlaserve.control.WorkerControl/WatchStatus",
                                         request_serializer=cpb.WatchStatusRequest.SerializeToString,
                                         response_deserializer=cpb.ModelControlStatusResponse.FromString)
            # a long interval: only the drain can end the stream before the test gives up
            stream = watch(cpb.WatchStatusRequest(interval_seconds=3600), timeout=25)
            snapshots = []
            for snapshot in stream:
                snapshots.append(snapshot)
                if len(snapshots) == 1:
                    server.process.send_signal(signal.SIGTERM)
            assert stream.code() == grpc.StatusCode.OK, stream.details()
        assert len(snapshots) == 1 and {m.name for m in snapshots[0].models} == {"mlp", "simple"}
        assert server.process.wait(20) == 0
    log = server.log()
    assert "draining: no new calls" in log and "drain timed out" not in log


def test_sigterm_stops_the_worker_while_a_bundle_hangs_in_its_model_py(tmp_path, repo):
    """The load runs in a thread nothing can interrupt; unless the lifecycle abandons it when the
    worker stops, a model.py that never returns from its import held the shutdown for good."""
    (repo / "simple" / "model.py").write_text("import time\ntime.sleep(3600)\n")
    with serve(tmp_path / "srv", repo, {"model_control_mode": "explicit", "cache_dir": None},
               wait_ready=False) as server:
        client = grpcclient.InferenceServerClient(server.url)
        client.load_model("mlp")
        with pytest.raises(InferenceServerException, match="Deadline"):
            client.load_model("simple", client_timeout=1)
        assert client.is_model_ready("mlp")       # the hang holds the lifecycle, never the serving
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(20) == 0
    assert "drain timed out" not in server.log()


def test_a_model_py_hung_in_its_import_fails_its_load_and_later_loads_and_unloads_answer(tmp_path, repo):
    """A model.py that blocks at its top level (here: reading a FIFO no one writes) held the
    lifecycle actor for good: every later RepositoryModelLoad/Unload of any model waited behind
    it. Past global.model_import_timeout_seconds the load now fails naming the key, and the next
    load and unload answer; when the import finally ends, it publishes nothing."""
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    (repo / "simple" / "model.py").write_text(f"open({str(gate)!r}, 'rb').read()\n"
                                              "from xlaserve import register_model\nregister_model('simple')\n")

    def release() -> bool:
        """End the hung import: open the FIFO's writing end and close it (the read sees EOF)."""
        try:
            os.close(os.open(gate, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:          # ENXIO: no reader (the import is not there, or over)
            return False
        return True

    try:
        with serve(tmp_path / "srv", repo, {"model_control_mode": "explicit", "cache_dir": None,
                                            "model_import_timeout_seconds": 1}, wait_ready=False) as server:
            client = grpcclient.InferenceServerClient(server.url)
            with pytest.raises(InferenceServerException, match=re.escape(
                    "[StatusCode.UNAVAILABLE] model 'simple' failed to load: bundle 'simple': model.py did not finish "
                    "importing within 1 s (global.model_import_timeout_seconds); the load is abandoned")):
                client.load_model("simple", client_timeout=30)
            client.load_model("mlp", client_timeout=30)
            assert client.is_model_ready("mlp")
            client.unload_model("mlp", client_timeout=30)
            assert not client.is_model_ready("mlp")
            assert release()
            _wait(lambda: "import abandoned at model_import_timeout_seconds ended after" in server.log(),
                  "the abandoned import's end")
            assert not client.is_model_ready("simple")      # what it registered was dropped
            assert _index(client)["simple"].state == "UNAVAILABLE"
    finally:
        release()


def test_a_model_repo_deleted_then_replaced_keeps_serving_and_is_watched_again(tmp_path, repo):
    """model_repo itself gone (a volume unmounted, `rm -rf` by mistake, the moment between the
    two renames of a repository swapped for a new one) unloaded every model: each one's
    directory was gone. And inotify follows the directory, not its path: the one made in its
    place was never watched, so every later change waited for the poll. Now the loaded models
    keep serving while model_repo is missing, and the rescan that finds it back watches the new
    directory for file events."""
    poll = 8.0          # far longer than an event's reload (~0.5 s): a change seen sooner was an event
    with serve(tmp_path / "srv", repo, {**DYNAMIC, "model_poll_seconds": poll, "cache_dir": None}) as server:
        client = grpcclient.InferenceServerClient(server.url)
        x = np.ones((1, reference.MLP_HIDDEN), np.float32)
        new = tmp_path / "models.new"
        shutil.copytree(repo, new)
        shutil.rmtree(repo)
        _wait(lambda: "is gone or not a directory; the 2 loaded model(s) keep serving" in server.log(),
              "the rescan that finds model_repo gone")
        with Load(server.url) as load:
            _wait(lambda: len(load.results) > 10, "traffic while model_repo is gone")
        assert load.errors == [] and {n: m.state for n, m in _index(client).items()} == \
            {"mlp": "READY", "simple": "READY"}

        os.rename(new, repo)
        _wait(lambda: "is another directory now; watching it for file events" in server.log(),
              "the poll's rescan to find model_repo back", timeout=3 * poll)
        version = _index(client)["mlp"].version     # the copies kept their mtimes: nothing reloads
        changed = time.monotonic()
        _write_weights(repo / "mlp", 2 * W1)
        _wait(lambda: _index(client)["mlp"].version != version, "a reload by file event", timeout=poll / 2)
        assert time.monotonic() - changed < poll / 2
        np.testing.assert_allclose(_mlp(client, x)[1], np.tanh(x @ (2 * W1)), rtol=1e-4, atol=1e-5)
    assert server.process.returncode == 0, server.log()
