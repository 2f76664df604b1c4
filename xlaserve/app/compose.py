"""The composition root: the one module that knows both the worker's actors and the frontend.

:func:`run_actors` starts the actors (device, weight cache, scheduler, admin HTTP port,
lifecycle) and reports them as :class:`Actors`; :func:`compose_frontend` fills the frontend's
:class:`~xlaserve.frontend.port.WorkerPort` from them and builds the gRPC services and the
:class:`~xlaserve.frontend.grpc_server.GrpcServer` that serves them. The frontend holds the
port only, so it never imports the worker's wiring, and the actors never see the frontend
except through the reply callables and the scheduler's ``reply_batch``, set here.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from xlaserve.admin import reused, serve_admin
from xlaserve.config import WorkerConfig
from xlaserve.errors import FailedPrecondition, StartupError, Unavailable
from xlaserve.frontend.bridge import Bridge
from xlaserve.frontend.control import WorkerControlService
from xlaserve.frontend.access import AccessPolicy
from xlaserve.http2.frames import H2Limits
from xlaserve.frontend.grpc_server import GrpcServer
from xlaserve.frontend.http1 import Http1Server, HttpLimits
from xlaserve.frontend.kserve import KServeService, connection_buffer_full, request_too_large, response_too_large
from xlaserve.frontend.port import WorkerPort
from xlaserve.frontend.rest_api import RestApi
from xlaserve.frontend.shm import SharedMemoryRegistry
from xlaserve.frontend.tls import describe as describe_tls
from xlaserve.metrics import Metrics, WeightCacheMetrics
from xlaserve.runtime.cachetrace import TraceWriter
from xlaserve.runtime.excache import ExecutableCache, open_executable_cache
from xlaserve.runtime.pjrt import Device
from xlaserve.runtime.weights import WeightCache, budget_for
from xlaserve.tracing import Tracing, open_tracing
from xlaserve.worker.inference import InferenceService
from xlaserve.worker.lifecycle import Lifecycle, LifecycleMessage, LifecycleMetrics, LoadModel, UnloadModel
from xlaserve.worker.registry import ModelTable
from xlaserve.worker.scheduler import Scheduler
from xlaserve.worker.stats import StatsBook

log = logging.getLogger("xlaserve.worker")


@dataclass(frozen=True, slots=True)
class Actors:
    """The worker's actors once started; the composition root's view, never the frontend's."""

    config: WorkerConfig
    device: Device
    table: ModelTable
    stats: StatsBook
    metrics: Metrics
    scheduler: Scheduler
    service: InferenceService
    weights: WeightCache
    lifecycle: trio.MemorySendChannel[LifecycleMessage]   #: the lifecycle actor's inbox
    nursery: trio.Nursery                                 #: where the actors run
    http_port: int                                        #: the admin HTTP port bound
    started: float = 0.0                                  #: time.monotonic() when the worker started
    excache: ExecutableCache | None = None                #: the compiled-executable cache, if any
    tracing: Tracing | None = None                        #: OpenTelemetry tracing; None: off


@dataclass(frozen=True, slots=True)
class _ModelControl:
    """Load and unload requests to the lifecycle actor, for ``RepositoryModelLoad``/``Unload``."""

    model_control_mode: str
    lifecycle: trio.MemorySendChannel[LifecycleMessage]
    bridge: Bridge

    async def load(self, name: str) -> None:
        await self._ask("load", LoadModel, name)

    async def unload(self, name: str) -> None:
        await self._ask("unload", UnloadModel, name)

    async def _ask(self, verb: str, message, name: str) -> None:
        if self.model_control_mode == "static":
            raise FailedPrecondition(f"cannot {verb} '{name}': model_control_mode is static, so the model set is "
                                     f"fixed at start-up (use dynamic or explicit to {verb} models at run time)")
        error = await self.bridge.call(lambda reply: self._send(message(name, reply), reply))
        if error is not None:
            raise error

    def _send(self, message: LifecycleMessage, reply) -> None:
        try:
            self.lifecycle.send_nowait(message)
        except trio.WouldBlock:
            reply(Unavailable("the model lifecycle actor is busy; retry shortly"))


def _health(config: WorkerConfig, table: ModelTable, metrics: Metrics):
    """The admin HTTP port's pages: ``/healthz``, ``/readyz`` (saying why not ready) and ``/metrics``."""
    def healthz():
        return 200, "text/plain", b"ok\n"

    def readyz():
        states = {state: n for state, n in table.state_counts().items() if n}
        counts = " ".join(f"{k}={v}" for k, v in sorted(states.items()))
        if table.ready():
            return 200, "text/plain", f"ready {counts}\n".encode()
        if not table.startup_done.is_set():
            why = "loading models"
        elif states:
            why = f"no model is ready ({counts}; RepositoryIndex gives each reason)"
        elif config.model_control_mode == "explicit":
            why = "no model is loaded (model_control_mode is explicit: load one with RepositoryModelLoad)"
        else:
            named = " named in models_include" if config.models_include else ""
            why = f"no model is ready: model_repo {config.model_repo} holds no bundle{named}"
        return 503, "text/plain", f"{why}\n".encode()

    def metrics_page():
        for state, n in table.state_counts().items():
            metrics.models.labels(state).set(n)
        return 200, "text/plain; version=0.0.4; charset=utf-8", metrics.exposition()

    return {"/healthz": healthz, "/readyz": readyz, "/metrics": reused(metrics_page)}


def prefetch_for(setting: str, device) -> bool:
    """``runtime.weight_prefetch``: ``auto`` prefetches where a load is a DMA (the host is free
    while it runs), not where it is a memcpy on the cores that also execute (cpu)."""
    return device.transfers_async if setting == "auto" else setting == "on"


def weight_trace_path(config: WorkerConfig) -> Path | None:
    """Where this worker writes its weight trace: ``runtime.weight_trace`` with ``{worker}``
    replaced by the worker's name; on a node of several workers, a path without ``{worker}``
    gets ``.<worker>`` before its suffix so that the workers do not write one file."""
    path = config.runtime.weight_trace
    if path is None:
        return None
    if "{worker}" in path.name:
        return path.with_name(path.name.replace("{worker}", config.name))
    if config.worker_count > 1:
        return path.with_name(f"{path.stem}.{config.name}{path.suffix}")
    return path


def open_weight_trace(config: WorkerConfig, budget_bytes: int) -> TraceWriter | None:
    path = weight_trace_path(config)
    if path is None:
        return None
    try:
        writer = TraceWriter(path, budget_bytes, config.runtime.weight_eviction)
    except OSError as exc:
        raise StartupError(f"runtime.weight_trace: cannot write the weight trace to {path}: "
                           f"{exc.strerror or exc}; give a writable file or remove the key") from None
    log.info("weight cache: recording every reference to %s", path)
    return writer


async def run_actors(config: WorkerConfig, *, admin_listeners: list[trio.SocketListener] | None = None,
                     span_exporter=None, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The worker's actors. Reports them as :class:`Actors` once they are up (models may still
    be loading) and runs until cancelled. The admin HTTP port serves ``admin_listeners`` when
    given, else binds ``config.http_host:http_port``. ``span_exporter``: an OpenTelemetry SDK
    ``SpanExporter`` for the spans instead of ``config.tracing``'s exporter (when tracing is
    enabled; benchmarks and tests use an in-process one)."""
    started = time.monotonic()
    device = await trio.to_thread.run_sync(Device, config.runtime.backend, config.device_ordinal)
    log.info("device: %s (%s), jax PJRT %s; host copies of weights in %s memory", device.backend, device.kind,
             device.platform_version, device.host_memory_kind)
    device_limiter = trio.CapacityLimiter(1)
    table = ModelTable()
    stats = StatsBook()
    metrics = Metrics()
    budget = budget_for(config.runtime, device)
    weights = WeightCache(device, device_limiter, budget,
                          residency=lambda name: config.scheduler.for_model(name).residency,
                          metrics=WeightCacheMetrics(metrics.registry),
                          compaction_interval=config.scheduler.compaction_interval,
                          eviction=config.runtime.weight_eviction,
                          prefetch=prefetch_for(config.runtime.weight_prefetch, device),
                          miss_overhead=config.runtime.weight_miss_overhead_seconds,
                          trace=open_weight_trace(config, budget.bytes))
    from xlaserve.worker.executor import Executor
    tracing = open_request_tracing(config, span_exporter)
    scheduler = Scheduler(config.scheduler, Executor(device, device_limiter), weights, stats, metrics,
                          tracing=tracing)
    to_scheduler, scheduler_inbox = trio.open_memory_channel(65536)
    to_lifecycle, lifecycle_inbox = trio.open_memory_channel(64)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(weights.run)
            await nursery.start(scheduler.run, scheduler_inbox)
            service = InferenceService(to_scheduler, nursery, table, stats, hook_failed=metrics.observe_hook_failure,
                                       hook_starved=metrics.observe_hook_starved)
            metrics.hook_threads = service.thread_statistics
            lifecycle_metrics = LifecycleMetrics(metrics.registry)
            excache = await trio.to_thread.run_sync(
                open_executable_cache, config.cache_dir, device,
                lambda result: lifecycle_metrics.executable_cache.labels(result).inc(), config.cache_max_bytes)
            lifecycle = Lifecycle(config, device, table, to_scheduler.clone(), weights,
                                  excache.compile_module if excache else None, lifecycle_metrics)
            http_port = await nursery.start(functools.partial(
                serve_admin, config.http_host, config.http_port, _health(config, table, metrics),
                listeners=admin_listeners))
            await nursery.start(lifecycle.run, lifecycle_inbox)
            task_status.started(Actors(config, device, table, stats, metrics, scheduler, service, weights,
                                       to_lifecycle, nursery, http_port, started, excache, tracing))
    finally:
        if tracing is not None:
            tracing.close()     # what is queued is exported before the worker exits


def open_request_tracing(config: WorkerConfig, span_exporter=None) -> Tracing | None:
    try:
        return open_tracing(config.tracing, config.name, span_exporter=span_exporter)
    except OSError as exc:
        raise StartupError(f"tracing.file: cannot write spans to {config.tracing.file}: "
                           f"{exc.strerror or exc}; give a writable file or another tracing.exporter") from None


def _lookups(excache: ExecutableCache | None):
    """The executable cache's lookups by result, for the control status; None without a cache."""
    if excache is None:
        return None

    def lookups() -> dict[str, int]:
        s = excache.statistics()
        return {"hit": s.hits, "miss": s.misses, "rejected": s.rejected}
    return lookups


def worker_port(actors: Actors, bridge: Bridge, *, draining: trio.Event,
                shared_memory: SharedMemoryRegistry | None) -> WorkerPort:
    """The frontend's port onto ``actors``: each field is the one operation or read-only view
    behind it (bound methods and the actors themselves, seen through the port's protocols)."""
    control = _ModelControl(actors.config.model_control_mode, actors.lifecycle, bridge)
    return WorkerPort(
        worker_name=actors.config.name, backend=actors.device.backend, models=actors.table,
        statistics=actors.stats.get, scheduling=actors.scheduler, weights=actors.weights,
        submit=actors.service.submit, cancel=actors.service.cancel, bridge=bridge,
        load_model=control.load, unload_model=control.unload, observe_request=actors.metrics.observe_request,
        spawn=actors.nursery.start_soon, draining=draining, shared_memory=shared_memory,
        discipline=actors.config.scheduler.discipline, tally=actors.metrics.tally,
        uptime=lambda: time.monotonic() - actors.started, executable_cache=_lookups(actors.excache),
        hook_threads=actors.service.thread_statistics)


@dataclass(frozen=True, slots=True)
class Frontend:
    """A worker's servers: gRPC, and REST (HTTP/1.1) over the same KServe service when
    ``listen.rest`` is set."""

    grpc: GrpcServer
    rest: Http1Server | None


def rest_limits(endpoints) -> HttpLimits:
    """The REST port's limits from a worker's ``endpoints`` block."""
    keys = {"max_header_bytes": "endpoints.rest_max_header_bytes", "max_headers": "endpoints.rest_max_headers",
            "max_body_bytes": "endpoints.max_recv_msg_bytes",
            "max_inflate_bytes": "endpoints.max_connection_inflate_bytes",
            "max_total_inflate_bytes": "endpoints.max_inflate_bytes",
            "max_total_body_bytes": "endpoints.max_undecoded_request_bytes",
            "header_timeout": "endpoints.rest_header_timeout_seconds",
            "body_timeout": "endpoints.rest_body_timeout_seconds",
            "idle_timeout": "endpoints.rest_idle_timeout_seconds",
            "write_timeout": "endpoints.write_timeout_seconds", "max_connections": "endpoints.max_connections"}
    return HttpLimits(max_header_bytes=endpoints.rest_max_header_bytes, max_headers=endpoints.rest_max_headers,
                      max_body_bytes=endpoints.max_recv_msg_bytes,
                      max_inflate_bytes=endpoints.max_connection_inflate_bytes,
                      max_total_inflate_bytes=endpoints.max_inflate_bytes,
                      max_total_body_bytes=endpoints.max_undecoded_request_bytes,
                      header_timeout=endpoints.rest_header_timeout_seconds,
                      body_timeout=endpoints.rest_body_timeout_seconds,
                      idle_timeout=endpoints.rest_idle_timeout_seconds,
                      write_timeout=endpoints.write_timeout_seconds, max_connections=endpoints.max_connections,
                      keys=keys)


def compose_frontend(actors: Actors, *, draining: trio.Event) -> Frontend:
    """The servers of a worker whose ``actors`` run: the port, the KServe and WorkerControl
    services on it, the admission gauges, and the scheduler's replies batched per execution;
    the REST server over the same KServe service when ``config.rest_port`` is set.
    Call on the Trio thread (the bridge remembers it). ``draining`` is set by whoever starts the
    drain; the frontend only waits on it."""
    config = actors.config
    endpoints = config.endpoints
    shared_memory = SharedMemoryRegistry() if endpoints.allow_client_shm else None
    port = worker_port(actors, Bridge(trio.lowlevel.current_trio_token()), draining=draining,
                       shared_memory=shared_memory)
    kserve = KServeService(port, endpoints, actors.tracing)
    admission = kserve.admission
    actors.metrics.held_request_bytes.set_function(lambda: admission.held_bytes)
    actors.metrics.requests_in_flight.set_function(lambda: admission.in_flight)
    server = GrpcServer([kserve, WorkerControlService(port, admission)],
                        max_recv_bytes=endpoints.max_recv_msg_bytes,
                        max_send_bytes=endpoints.max_send_msg_bytes,
                        too_large_request=request_too_large, too_large_response=response_too_large,
                        max_held_bytes=endpoints.max_connection_buffer_bytes,
                        max_undecoded_bytes=endpoints.max_undecoded_request_bytes,
                        max_connections=endpoints.max_connections,
                        limits=H2Limits(**{f.name: getattr(endpoints, f.name) for f in dataclasses.fields(H2Limits)}),
                        access=AccessPolicy.from_config(endpoints.restricted),
                        max_connection_inflate_bytes=endpoints.max_connection_inflate_bytes,
                        max_inflate_bytes=endpoints.max_inflate_bytes,
                        too_much_held=connection_buffer_full)
    actors.scheduler.reply_batch = server.write_batch
    rest = None
    if config.rest_port is not None:
        rest = Http1Server(RestApi(kserve, AccessPolicy.from_config(endpoints.restricted),
                                   max_send_bytes=endpoints.max_send_msg_bytes,
                                   max_json_bytes=endpoints.rest_max_json_bytes),
                           rest_limits(endpoints), what="REST")
    return Frontend(server, rest)


def describe_endpoint(config: WorkerConfig) -> str:
    """How the gRPC endpoint is served (TLS or not), for the worker's "serving:" log line."""
    return describe_tls(config.endpoints.tls)
