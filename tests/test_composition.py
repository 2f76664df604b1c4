"""One composition root: the frontend reaches the worker through a frozen port only, no
frontend module imports the worker's wiring, the package's imports have no cycle, and the
services work from a port filled with stand-ins (no device, no actors, no sockets)."""
from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import pytest
import trio
import trio.testing
from grpclib.const import Status
from grpclib.exceptions import GRPCError

import xlaserve
from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve._proto import xlaserve_control_pb2 as cpb
from xlaserve.config import EndpointsConfig
from xlaserve.errors import FailedPrecondition, Unavailable
from xlaserve.frontend.bridge import Bridge
from xlaserve.frontend.control import WorkerControlService
from xlaserve.frontend.grpc_server import GrpcServer
from xlaserve.frontend.kserve import KServeService
from xlaserve.frontend.rest_api import RestApi
from xlaserve.gateway.router import Router
from xlaserve.gateway.service import GatewayService
from xlaserve.frontend.port import WorkerPort
from xlaserve.runtime.residency import Floor
from xlaserve.runtime.weights import CacheSnapshot, ModelResidency
from xlaserve.app.compose import _ModelControl
from xlaserve.worker.lifecycle import LoadModel, UnloadModel
from xlaserve.worker.policy import CostSnapshot
from xlaserve.worker.registry import ModelEntry, ModelState
from xlaserve.worker.scheduler import ModelPolicy
from xlaserve.worker.stats import Duration, ModelStats

PACKAGE = Path(xlaserve.__file__).parent


# ---- the import graph ------------------------------------------------------------------------
def _module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The xlaserve modules ``name`` imports anywhere: at the top, inside functions, and under
    ``TYPE_CHECKING`` (a cycle there is still a cycle for a reader and a type checker)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in modules and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _module_names()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None."""
    state: dict[str, int] = {}       # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_import_graph_is_read_as_python_reads_it(graph):
    """The checks below are only as good as the graph: it sees function-level, TYPE_CHECKING and
    package-relative imports."""
    assert "xlaserve.app.compose" in graph["xlaserve.app.server"]
    assert "xlaserve.frontend.port" in graph["xlaserve.frontend.kserve"]
    assert "xlaserve.worker.scheduler" in graph["xlaserve.frontend.port"]            # under TYPE_CHECKING
    assert "xlaserve.worker.executor" in graph["xlaserve.app.compose"]               # inside run_actors
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_the_package_has_no_import_cycle(graph):
    assert _cycle(graph) is None


def test_the_node_file_is_a_layer_below_the_frontend(graph):
    """The schema validates the access keys against the tables the frontend enforces; those
    tables live in config/access.py, so no config module imports the frontend (which imports
    the config)."""
    for module, deps in graph.items():
        if module.startswith("xlaserve.config"):
            assert not any(dep.startswith("xlaserve.frontend") for dep in deps), module
    assert "xlaserve.config.access" in graph["xlaserve.frontend.access"]


def test_reading_the_node_file_loads_no_frontend_module():
    """As Python runs it, not only as the graph reads it: importing the schema (and the package
    face that imports every config module) leaves xlaserve.frontend unloaded."""
    code = ("import sys, xlaserve.config.schema, xlaserve.config.gateway; "
            "print(sorted(m for m in sys.modules if m.startswith('xlaserve.frontend')))")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=PACKAGE.parent)
    assert found.stdout.strip() == "[]"


def test_the_worker_process_is_a_room_above_both_the_worker_and_the_frontend(graph):
    """xlaserve/app/ (preflight, the composition root, the process) imports both; neither the
    worker's actors nor the frontend imports anything of it, and the actors import no frontend
    module (the frontend imports the actors' message and value types, one way)."""
    assert {"xlaserve.app.compose", "xlaserve.app.server", "xlaserve.app.preflight"} <= set(graph)
    for module, deps in graph.items():
        if module.startswith(("xlaserve.frontend", "xlaserve.worker")):
            assert not any(dep.startswith("xlaserve.app") for dep in deps), module
        if module.startswith("xlaserve.worker"):
            assert not any(dep.startswith("xlaserve.frontend") for dep in deps), module


def test_the_composition_root_is_the_only_place_that_knows_both_sides(graph):
    outside = {module for module, deps in graph.items() if not module.startswith("xlaserve.frontend")
               and any(dep.startswith("xlaserve.frontend") for dep in deps)}
    # One more module reads a frontend module that is pure standard library: the TLS files are
    # loaded at start-up before jax is imported. The gateway serves clients with the frontend's
    # transport and speaks it to the workers (its own service, never the worker's).
    gateway = {m for m in outside if m.startswith("xlaserve.gateway.")}
    assert gateway == {"xlaserve.gateway.upstream", "xlaserve.gateway.run", "xlaserve.gateway.service"}
    assert not any(dep.startswith("xlaserve.frontend") for dep in graph["xlaserve.gateway.control"])
    assert not any(dep in {"xlaserve.frontend.kserve", "xlaserve.frontend.control", "xlaserve.frontend.port"}
                   for m in gateway for dep in graph[m])
    # The admin HTTP port accepts its connections through the frontend's guarded accept loop (one
    # guard for every port, not two), and takes nothing else from the frontend.
    assert outside - gateway == {"xlaserve.app.compose", "xlaserve.app.preflight", "xlaserve.admin"}
    assert graph["xlaserve.admin"] & {m for m in graph if m.startswith("xlaserve.frontend")} == {
        "xlaserve.frontend.guard"}
    assert graph["xlaserve.app.preflight"] & {m for m in graph if m.startswith("xlaserve.frontend")} == {
        "xlaserve.frontend.tls"}
    assert {module for module, deps in graph.items() if "xlaserve.app.compose" in deps} == {"xlaserve.app.server"}
    assert "xlaserve.frontend.kserve" not in graph["xlaserve.frontend.control"]


# ---- the services, served from a port of stand-ins -------------------------------------------
class _Table:
    def __init__(self, *entries: ModelEntry, ready: bool = True) -> None:
        self.snapshot = MappingProxyType({e.name: e for e in entries})
        self.is_ready = ready
        self.changed = trio.Event()

    def publish(self, entry: ModelEntry) -> None:      # as ModelTable's: a change is announced
        self.snapshot = MappingProxyType({**self.snapshot, entry.name: entry})
        changed, self.changed = self.changed, trio.Event()
        changed.set()

    def ready(self) -> bool:
        return self.is_ready


class _Scheduling:
    def __init__(self) -> None:
        self.policies = {"mlp": ModelPolicy("mlp", 1.0, 8), "cnn": ModelPolicy("cnn", 2.0, None)}
        self.depths = {"mlp": 3}

    def policy(self, model: str) -> ModelPolicy:
        return self.policies[model]

    def depth(self, model: str) -> int:
        return self.depths.get(model, 0)

    def costs(self) -> tuple[CostSnapshot, ...]:
        return (CostSnapshot("mlp", 8, 0.002, 5),)

    def set_policy(self, model, weight=None, max_batch_size=None, batch_delay_seconds=None, batch_target_rows=None):
        if weight is not None:
            self.policies[model] = dataclasses.replace(self.policies[model], weight=weight)
        return self.policies[model]


class _Weights:
    def __init__(self) -> None:
        self.floors = {"mlp": Floor.DEVICE}

    def snapshot(self) -> CacheSnapshot:
        return CacheSnapshot(1000, 400, 400, 2000, 100, True, "pinned_host",
                             (ModelResidency("mlp", 1, "device", 400, 400, 400, 1, 9, 0),))

    def floor_of(self, name: str) -> Floor:
        return self.floors.get(name, Floor.SYSTEM)

    def set_residency(self, model_name: str, floor: str) -> None:
        self.floors[model_name] = Floor.parse(floor)

    async def compact(self) -> tuple[str, int]:
        await trio.lowlevel.checkpoint()
        return "2 buffers moved", 300


class _Stream:
    """A grpclib-shaped stream in memory: one request in, the replies collected."""

    deadline = None
    metadata: dict[str, str] = {}

    def __init__(self, request) -> None:
        self._requests = [request]
        self.sent: list = []

    async def recv_message(self):
        return self._requests.pop(0) if self._requests else None

    async def send_message(self, message) -> None:
        self.sent.append(message)


async def _call(method, request):
    stream = _Stream(request)
    await method(stream)
    (reply,) = stream.sent
    return reply


def _port(nursery: trio.Nursery, **fields) -> WorkerPort:
    """A port on stand-ins; must be built on the Trio thread (the bridge remembers it)."""
    async def nothing(name: str) -> None:
        pass
    defaults = dict(
        worker_name="w0", backend="cpu",
        models=_Table(ModelEntry("cnn", ModelState.UNAVAILABLE, "weights.safetensors is missing"),
                      ModelEntry("mlp", ModelState.READY)),
        statistics=lambda name: ModelStats(success=Duration(4, 4000), inference_count=4 if name == "mlp" else 0),
        scheduling=_Scheduling(), weights=_Weights(),
        submit=lambda request: None, cancel=lambda ticket: None,
        bridge=Bridge(trio.lowlevel.current_trio_token()), load_model=nothing, unload_model=nothing,
        observe_request=lambda model, status, seconds: None, spawn=nursery.start_soon, draining=trio.Event())
    defaults.update(fields)
    return WorkerPort(**defaults)


def test_the_port_is_frozen():
    async def main():
        async with trio.open_nursery() as nursery:
            port = _port(nursery)
            with pytest.raises(dataclasses.FrozenInstanceError):
                port.submit = print
            with pytest.raises((AttributeError, TypeError)):    # slotted: no attribute can be added
                port.scheduler = object()
    trio.run(main)


def test_modelinfer_is_served_task_free_by_both_transports_for_both_services():
    """The worker's and the gateway's ModelInfer handlers in ``__mapping__()`` are there for the
    request type only: gRPC and REST both take the service's task-free entry, ``infer_now``, so
    the handler is never called, and says so (INTERNAL) if a server ever did."""
    infer = "/inference.GRPCInferenceService/ModelInfer"

    async def main():
        async with trio.open_nursery() as nursery:
            for service in (KServeService(_port(nursery), EndpointsConfig()), GatewayService({}, Router([]))):
                assert GrpcServer([service]).fast[infer] == service.infer_now
                assert RestApi(service)._fast[infer] == service.infer_now
                with pytest.raises(GRPCError) as called:
                    await service.__mapping__()[infer].func(None)
                assert called.value.status is Status.INTERNAL and "task-free entry" in called.value.message
    trio.run(main)


def test_kserve_reads_the_worker_through_the_port():
    async def main():
        async with trio.open_nursery() as nursery:
            table = _Table(ModelEntry("mlp", ModelState.READY), ready=False)
            kserve = KServeService(_port(nursery, models=table), EndpointsConfig())
            assert not (await _call(kserve.ServerReady, pb.ServerReadyRequest())).ready
            table.is_ready = True
            assert (await _call(kserve.ServerReady, pb.ServerReadyRequest())).ready

            kserve = KServeService(_port(nursery), EndpointsConfig())
            index = await _call(kserve.RepositoryIndex, pb.RepositoryIndexRequest())
            assert [(m.name, m.state, m.reason) for m in index.models] == [
                ("cnn", "UNAVAILABLE", "weights.safetensors is missing"), ("mlp", "READY", "")]
            stats = await _call(kserve.ModelStatistics, pb.ModelStatisticsRequest(name="mlp"))
            (mlp,) = stats.model_stats
            assert (mlp.name, mlp.inference_count, mlp.inference_stats.success.ns) == ("mlp", 4, 4000)
            with pytest.raises(GRPCError) as missing:
                await _call(kserve.ModelStatistics, pb.ModelStatisticsRequest(name="mpl"))
            assert missing.value.status is Status.NOT_FOUND and "known models: cnn, mlp" in missing.value.message
    trio.run(main)


def test_repository_load_and_unload_go_through_the_port():
    asked: list[tuple[str, str]] = []

    async def load(name: str) -> None:
        asked.append(("load", name))
        raise FailedPrecondition(f"cannot load '{name}': model_control_mode is static")

    async def unload(name: str) -> None:
        asked.append(("unload", name))

    async def main():
        async with trio.open_nursery() as nursery:
            kserve = KServeService(_port(nursery, load_model=load, unload_model=unload), EndpointsConfig())
            with pytest.raises(GRPCError) as refused:
                await _call(kserve.RepositoryModelLoad, pb.RepositoryModelLoadRequest(model_name="mlp"))
            assert (refused.value.status, refused.value.message) == (
                Status.FAILED_PRECONDITION, "cannot load 'mlp': model_control_mode is static")
            await _call(kserve.RepositoryModelUnload, pb.RepositoryModelUnloadRequest(model_name="cnn"))
            # what tritonclient's load_model(config=..., files=...) sends; loading the bundle as it is
            # on disk would answer OK for a model the client did not ask for
            overrides = pb.RepositoryModelLoadRequest(model_name="mlp", parameters={
                "config": pb.ModelRepositoryParameter(string_param='{"max_batch_size": 64}'),
                "file:1/model.b1.mlir": pb.ModelRepositoryParameter(bytes_param=b"module {}")})
            with pytest.raises(GRPCError) as refused:
                await _call(kserve.RepositoryModelLoad, overrides)
            assert (refused.value.status, refused.value.message) == (
                Status.INVALID_ARGUMENT, "cannot load 'mlp' with 'config', 'file:1/model.b1.mlir': xlaserve does not "
                "override a model's configuration at load time (its bundle's manifest and compiled batch sizes fix "
                "it); load it without them")
            # a worker serves one repository: a load or unload naming another would act on this one
            for rpc, request in ((kserve.RepositoryModelLoad, pb.RepositoryModelLoadRequest),
                                 (kserve.RepositoryModelUnload, pb.RepositoryModelUnloadRequest),
                                 (kserve.RepositoryIndex, pb.RepositoryIndexRequest)):
                fields = {"model_name": "mlp"} if request is not pb.RepositoryIndexRequest else {}
                with pytest.raises(GRPCError) as refused:
                    await _call(rpc, request(repository_name="staging", **fields))
                assert (refused.value.status, refused.value.message) == (
                    Status.NOT_FOUND, "repository 'staging' is unknown; this worker serves one repository (leave "
                    "repository_name empty)")
    trio.run(main)
    assert asked == [("load", "mlp"), ("unload", "cnn")]


def test_worker_control_reads_and_changes_the_worker_through_the_port():
    async def main():
        async with trio.open_nursery() as nursery:
            port = _port(nursery)
            control = WorkerControlService(port)
            status = await _call(control.ModelControlStatus, cpb.ModelControlStatusRequest())
            assert (status.worker, status.backend, status.budget_bytes, status.resident_bytes) == ("w0", "cpu", 1000, 400)
            mlp = {m.name: m for m in status.models}["mlp"]
            assert (mlp.residency, mlp.resident_bytes, mlp.queue_depth, mlp.max_batch_size, mlp.requests) == \
                ("device", 400, 3, 8, 4)
            assert dict(mlp.learned_cost_seconds) == {8: 0.002}
            # the figures a dashboard needs beyond ModelStatistics': zeros without a tally,
            # the cache's loads and evictions, the bucket bounds
            assert (mlp.weight_loads, mlp.evictions, mlp.in_flight) == (1, 0, 0)
            assert list(mlp.latency_bucket_counts) == [0] * (len(status.latency_bucket_bounds) + 1)
            assert (status.uptime_seconds, dict(status.executable_cache)) == (0.0, {})

            await _call(control.SetModelPolicy, cpb.SetModelPolicyRequest(model="cnn", weight=5.0))
            assert port.scheduling.policy("cnn").weight == 5.0
            await _call(control.SetModelResidency, cpb.SetModelResidencyRequest(model="cnn", residency="unpinned"))
            assert port.weights.floor_of("cnn") is Floor.UNPINNED
            with pytest.raises(GRPCError) as bad:
                await _call(control.SetModelResidency, cpb.SetModelResidencyRequest(model="cnn", residency="disk"))
            assert bad.value.status is Status.INVALID_ARGUMENT
            compacted = await _call(control.CompactMemory, cpb.CompactMemoryRequest())
            assert (compacted.message, compacted.freed_bytes) == ("2 buffers moved", 300)
            # a request naming another worker (meant for a gateway) is refused, naming both
            for method, request in ((control.SetModelResidency, cpb.SetModelResidencyRequest(
                    model="cnn", residency="device", worker="w1")),
                    (control.SetModelPolicy, cpb.SetModelPolicyRequest(model="cnn", weight=1.0, worker="w1")),
                    (control.CompactMemory, cpb.CompactMemoryRequest(worker="w1"))):
                with pytest.raises(GRPCError) as elsewhere:
                    await _call(method, request)
                assert elsewhere.value.status is Status.INVALID_ARGUMENT
                assert "this is worker 'w0', the request names worker 'w1'" in elsewhere.value.message
            assert port.weights.floor_of("cnn") is Floor.UNPINNED        # nothing changed
            await _call(control.CompactMemory, cpb.CompactMemoryRequest(worker="w0"))   # its own name: fine
    trio.run(main)


def test_worker_control_refuses_to_pin_a_model_with_no_version_serving():
    """A pin on a model still loading (or failed) cannot be checked against the budget: accepted,
    it answered OK and then failed the load when the version's weights did not fit. Other floors
    apply to its later versions as before."""
    async def main():
        async with trio.open_nursery() as nursery:
            port = _port(nursery)
            control = WorkerControlService(port)
            for state in (ModelState.LOADING, ModelState.UNAVAILABLE):
                port.models.publish(ModelEntry("cnn", state))
                with pytest.raises(GRPCError) as refused:
                    await _call(control.SetModelResidency,
                                cpb.SetModelResidencyRequest(model="cnn", residency="device"))
                assert refused.value.status is Status.FAILED_PRECONDITION
                assert refused.value.message.startswith(
                    f"cannot pin model 'cnn' (residency device): it is {state.value} with no version serving")
                assert port.weights.floor_of("cnn") is Floor.SYSTEM        # nothing changed
            await _call(control.SetModelResidency, cpb.SetModelResidencyRequest(model="cnn", residency="unpinned"))
            assert port.weights.floor_of("cnn") is Floor.UNPINNED
    trio.run(main)


def test_worker_control_reports_the_tally_in_flight_device_time_and_uptime():
    from xlaserve.frontend.admission import Admission
    from xlaserve.metrics import LATENCY_BUCKETS, Metrics
    from xlaserve.worker.stats import BatchStats

    metrics = Metrics()
    for seconds in (0.0004, 0.0015, 0.0015, 40.0):
        metrics.observe_request("mlp", "OK", seconds)
    metrics.observe_request("mlp", "NOT_FOUND", 1.0)            # not answered OK: no bucket
    metrics.observe_rejection("mlp", "queue_full")
    metrics.observe_rejection("mlp", "queue_full")
    metrics.observe_rejection("mlp", "deadline_expired")
    admission = Admission(0, 1 << 20)
    for name in ("mlp", "mlp", "cnn"):
        admission.enter()
        admission.found(name)
    admission.leave(0)
    admission.lost("cnn")
    stats = ModelStats(batches=MappingProxyType({8: BatchStats(Duration(1, 1_000_000), Duration(2, 2_000_000),
                                                              Duration(1, 500_000))}))

    async def main():
        async with trio.open_nursery() as nursery:
            port = _port(nursery, tally=metrics.tally, uptime=lambda: 12.5,
                         executable_cache=lambda: {"hit": 3, "miss": 1, "rejected": 0},
                         statistics=lambda name: stats)
            status = await _call(WorkerControlService(port, admission).ModelControlStatus,
                                 cpb.ModelControlStatusRequest())
            assert list(status.latency_bucket_bounds) == list(LATENCY_BUCKETS)
            assert (status.uptime_seconds, dict(status.executable_cache), status.in_flight) == (
                12.5, {"hit": 3, "miss": 1, "rejected": 0}, 2)
            models = {m.name: m for m in status.models}
            mlp, cnn = models["mlp"], models["cnn"]
            counts = list(mlp.latency_bucket_counts)
            assert counts[0] == 1 and counts[LATENCY_BUCKETS.index(0.002)] == 2 and counts[-1] == 1
            assert sum(counts) == 4
            assert dict(mlp.rejections) == {"queue_full": 2, "deadline_expired": 1}
            assert (mlp.in_flight, cnn.in_flight) == (2, 0)
            assert mlp.device_seconds == pytest.approx(0.0035)
            assert admission.by_model == {"mlp": 2}             # a model with none in flight leaves
    trio.run(main)


def test_watch_status_ends_when_the_worker_drains():
    async def main():
        async with trio.open_nursery() as nursery:
            port = _port(nursery)
            stream = _Stream(cpb.WatchStatusRequest(interval_seconds=1.0))
            ended = trio.Event()

            async def watch():
                await WorkerControlService(port).WatchStatus(stream)
                ended.set()
            nursery.start_soon(watch)
            await trio.sleep(2.5)           # snapshots at 0, 1 and 2 s
            assert len(stream.sent) == 3 and not ended.is_set()
            port.draining.set()
            with trio.fail_after(0.1):
                await ended.wait()          # at once, not at the next interval
            assert len(stream.sent) == 3
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_watch_status_sends_a_model_change_at_once_and_at_most_one_per_min_interval():
    """A model becoming ready is sent at once (a gateway routes to it without waiting out the
    interval); a burst of changes costs at most one snapshot per MIN_WATCH_INTERVAL."""
    from xlaserve.frontend.control import MIN_WATCH_INTERVAL

    async def main():
        async with trio.open_nursery() as nursery:
            port = _port(nursery)
            stream = _Stream(cpb.WatchStatusRequest(interval_seconds=10.0))
            nursery.start_soon(WorkerControlService(port).WatchStatus, stream)
            await trio.sleep(1)
            assert len(stream.sent) == 1
            port.models.publish(ModelEntry("cnn", ModelState.LOADING))
            await trio.sleep(0.001)
            assert len(stream.sent) == 2
            assert {m.name: m.state for m in stream.sent[-1].models}["cnn"] == "LOADING"
            for i in range(20):                 # a burst within 0.02 s
                port.models.publish(ModelEntry("cnn", ModelState.READY if i % 2 else ModelState.LOADING))
                await trio.sleep(0.001)
            assert len(stream.sent) == 2        # the next one waits for MIN_WATCH_INTERVAL
            await trio.sleep(MIN_WATCH_INTERVAL)
            assert len(stream.sent) == 3
            assert {m.name: m.state for m in stream.sent[-1].models}["cnn"] == "READY"
            await trio.sleep(5)
            assert len(stream.sent) == 3        # nothing changed: the interval (10 s) paces it
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_watch_status_streams_are_bounded_and_a_closed_one_frees_its_place():
    """Each WatchStatus stream costs the worker's Trio thread a snapshot every 0.05 s: 800 from one
    client took it whole. Past the limit one more is refused, naming the limit and what to do;
    a stream that ends (cancelled, or by an error) gives its place back."""
    async def main():
        async with trio.open_nursery() as nursery:
            port = _port(nursery)
            control = WorkerControlService(port, max_watch_streams=2)
            scopes = []
            for _ in range(2):
                scope = trio.CancelScope()
                scopes.append(scope)

                async def watch(scope=scope):
                    with scope:
                        await control.WatchStatus(_Stream(cpb.WatchStatusRequest(interval_seconds=0.05)))
                nursery.start_soon(watch)
            await trio.sleep(1)
            with pytest.raises(GRPCError) as refused:
                await control.WatchStatus(_Stream(cpb.WatchStatusRequest()))
            assert refused.value.status is Status.RESOURCE_EXHAUSTED
            assert refused.value.message.startswith("this worker serves at most 2 WatchStatus streams at once")
            scopes[0].cancel()                  # the client hung up
            await trio.sleep(0.001)
            stream = _Stream(cpb.WatchStatusRequest(interval_seconds=1.0))
            nursery.start_soon(control.WatchStatus, stream)
            await trio.sleep(0.5)
            assert len(stream.sent) == 1        # served
            nursery.cancel_scope.cancel()
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


# ---- load and unload, as the composition root sends them to the lifecycle actor --------------
def test_model_control_asks_the_lifecycle_actor_and_raises_its_answer():
    async def main():
        bridge = Bridge(trio.lowlevel.current_trio_token())
        to_lifecycle, inbox = trio.open_memory_channel(4)
        control = _ModelControl("explicit", to_lifecycle, bridge)
        async with trio.open_nursery() as nursery:
            async def lifecycle():
                async for message in inbox:
                    seen.append(message)
                    message.reply(Unavailable("'cnn' failed to load") if message.name == "cnn" else None)
            seen: list = []
            nursery.start_soon(lifecycle)
            await control.load("mlp")
            with pytest.raises(Unavailable, match="'cnn' failed to load"):
                await control.load("cnn")
            await control.unload("mlp")
            assert [(type(m), m.name) for m in seen] == [(LoadModel, "mlp"), (LoadModel, "cnn"), (UnloadModel, "mlp")]
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_model_control_refuses_in_static_mode_and_when_the_actor_is_busy():
    async def main():
        bridge = Bridge(trio.lowlevel.current_trio_token())
        to_lifecycle, inbox = trio.open_memory_channel(0)     # nobody receives: always busy
        with pytest.raises(FailedPrecondition, match="model_control_mode is static"):
            await _ModelControl("static", to_lifecycle, bridge).load("mlp")
        with pytest.raises(Unavailable, match="lifecycle actor is busy"):
            await _ModelControl("explicit", to_lifecycle, bridge).unload("mlp")
        with pytest.raises(trio.WouldBlock):
            inbox.receive_nowait()                              # the static refusal sent nothing
    trio.run(main)


def test_request_path_metrics_are_plain_counts_made_into_families_when_scraped():
    """Requests, latencies, executions, batch rows and sizes, queue waits and depths: counted as
    plain numbers, exposed as the Prometheus counters, gauges and histograms they were (the
    same names, labels and values; a bound is inclusive)."""
    from prometheus_client.parser import text_string_to_metric_families

    from xlaserve.metrics import Metrics
    metrics = Metrics()
    metrics.observe_request("mlp", "OK", 0.002)                 # on the 0.002 bound: in its bucket
    metrics.observe_request("mlp", "OK", 0.5)
    metrics.observe_request("mlp", "UNAVAILABLE", 0.1)           # counted, no latency
    metrics.observe_dispatch("mlp", 8, 5, [1_000_000, 3_000_000], 4_000_000)
    metrics.set_queue_depth("mlp", 7)
    metrics.set_queue_depth("mlp", 3)
    got = {}
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for sample in family.samples:
            got[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    mlp = (("model", "mlp"),)
    assert got[("xlaserve_requests_total", (("model", "mlp"), ("status", "OK")))] == 2
    assert got[("xlaserve_requests_total", (("model", "mlp"), ("status", "UNAVAILABLE")))] == 1
    assert got[("xlaserve_request_duration_seconds_bucket", (("le", "0.001"), *mlp))] == 0
    assert got[("xlaserve_request_duration_seconds_bucket", (("le", "0.002"), *mlp))] == 1
    assert got[("xlaserve_request_duration_seconds_bucket", (("le", "+Inf"), *mlp))] == 2
    assert got[("xlaserve_request_duration_seconds_sum", mlp)] == 0.502
    assert got[("xlaserve_executions_total", (("batch_size", "8"), *mlp))] == 1
    assert got[("xlaserve_batch_rows_sum", mlp)] == 5 and got[("xlaserve_batch_size_sum", mlp)] == 8
    assert got[("xlaserve_batch_rows_bucket", (("le", "4.0"), *mlp))] == 0
    assert got[("xlaserve_batch_rows_bucket", (("le", "8.0"), *mlp))] == 1
    assert got[("xlaserve_queue_duration_seconds_count", mlp)] == 2
    assert got[("xlaserve_queue_duration_seconds_sum", mlp)] == 0.004
    assert got[("xlaserve_queue_duration_seconds_bucket", (("le", "0.002"), *mlp))] == 1
    assert got[("xlaserve_compute_duration_seconds_bucket", (("le", "0.005"), *mlp))] == 1
    assert got[("xlaserve_queue_depth", mlp)] == 3                 # a gauge: the last value set
    assert metrics.tally("mlp").latency_counts[2] == 1            # the status snapshot reads the same counts
