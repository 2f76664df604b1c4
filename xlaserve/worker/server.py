"""A worker process: the Trio actors, hosted as a guest of the asyncio loop that runs grpclib.

Boot order, in one place: open the device; start the scheduler, the lifecycle actor (which
loads the repository) and the admin HTTP port; then the gRPC frontend. SIGTERM or SIGINT
drains: the gRPC server stops taking calls, in-flight requests finish, then Trio is cancelled.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

import trio
from grpclib.server import Server

from xlaserve.admin import serve_admin
from xlaserve.config import WorkerConfig, effective_config_lines
from xlaserve.errors import FailedPrecondition, Unavailable
from xlaserve.frontend.bridge import Bridge
from xlaserve.metrics import Metrics, WeightCacheMetrics
from xlaserve.runtime.excache import open_executable_cache
from xlaserve.runtime.pjrt import Device
from xlaserve.runtime.weights import WeightCache, budget_for
from xlaserve.worker.inference import InferenceService
from xlaserve.worker.lifecycle import Lifecycle, LifecycleMessage, LifecycleMetrics, LoadModel, UnloadModel
from xlaserve.worker.registry import ModelState, ModelTable
from xlaserve.worker.scheduler import Scheduler
from xlaserve.worker.stats import StatsBook

log = logging.getLogger("xlaserve.worker")

DRAIN_SECONDS = 30.0


@dataclass
class WorkerHandles:
    """What the frontend may reach on the Trio side. Built once at start-up."""

    config: WorkerConfig
    device: Device
    table: ModelTable
    stats: StatsBook
    metrics: Metrics
    scheduler: Scheduler
    service: InferenceService
    lifecycle: trio.MemorySendChannel[LifecycleMessage]
    weights: WeightCache
    cancel_scope: trio.CancelScope
    token: trio.lowlevel.TrioToken
    http_port: int = 0
    bridge: Bridge | None = None
    shared_memory: Any = None
    services: list = field(default_factory=list)   # gRPC services served beside KServe

    def ready(self) -> bool:
        return self.table.startup_done.is_set()

    async def control_load(self, name: str) -> None:
        if self.config.model_control_mode == "static":
            raise FailedPrecondition(f"cannot load '{name}': model_control_mode is static, so the model set is "
                                     "fixed at start-up (use dynamic or explicit to load models at run time)")
        error = await self.bridge.call(lambda reply: self._send_lifecycle(LoadModel(name, reply), reply))
        if error is not None:
            raise error

    async def control_unload(self, name: str) -> None:
        if self.config.model_control_mode == "static":
            raise FailedPrecondition(f"cannot unload '{name}': model_control_mode is static, so the model set is "
                                     "fixed at start-up (use dynamic or explicit to unload models at run time)")
        error = await self.bridge.call(lambda reply: self._send_lifecycle(UnloadModel(name, reply), reply))
        if error is not None:
            raise error

    def _send_lifecycle(self, message, reply) -> None:
        try:
            self.lifecycle.send_nowait(message)
        except trio.WouldBlock:
            reply(Unavailable("the model lifecycle actor is busy; retry shortly"))


def _health(handles: WorkerHandles):
    def healthz():
        return 200, "text/plain", b"ok\n"

    def readyz():
        if handles.ready():
            states = {}
            for e in handles.table.snapshot.values():
                states[e.state.value] = states.get(e.state.value, 0) + 1
            body = "ready " + " ".join(f"{k}={v}" for k, v in sorted(states.items())) + "\n"
            return 200, "text/plain", body.encode()
        return 503, "text/plain", b"loading models\n"

    def metrics():
        counts = {s.value: 0 for s in ModelState}
        for e in handles.table.snapshot.values():
            counts[e.state.value] += 1
        for state, n in counts.items():
            handles.metrics.models.labels(state).set(n)
        return 200, "text/plain; version=0.0.4; charset=utf-8", handles.metrics.exposition()

    return {"/healthz": healthz, "/readyz": readyz, "/metrics": metrics}


async def trio_main(config: WorkerConfig, on_started) -> None:
    """The Trio side of a worker. Calls ``on_started(handles)`` once the actors are up (models
    may still be loading) and runs until cancelled."""
    device = await trio.to_thread.run_sync(Device, config.runtime.backend, config.gpu or 0)
    log.info("device: %s (%s), jax PJRT %s", device.backend, device.kind, device.platform_version)
    device_limiter = trio.CapacityLimiter(1)
    table = ModelTable()
    stats = StatsBook()
    metrics = Metrics()
    weights = WeightCache(device, device_limiter, budget_for(config.runtime, device),
                          residency=lambda name: config.scheduler.for_model(name).residency,
                          metrics=WeightCacheMetrics(metrics.registry),
                          compaction_interval=config.scheduler.compaction_interval)
    log.info("weight cache: %s; host copies in %s memory", weights.budget.explain(), device.host_memory_kind)
    from xlaserve.worker.executor import Executor
    scheduler = Scheduler(config.scheduler, Executor(device, device_limiter), weights, stats, metrics)
    to_scheduler, scheduler_inbox = trio.open_memory_channel(65536)
    to_lifecycle, lifecycle_inbox = trio.open_memory_channel(64)
    async with trio.open_nursery() as nursery:
        await nursery.start(weights.run)
        await nursery.start(scheduler.run, scheduler_inbox)
        service = InferenceService(to_scheduler, nursery, table, stats)
        lifecycle_metrics = LifecycleMetrics(metrics.registry)
        excache = await trio.to_thread.run_sync(
            open_executable_cache, config.cache_dir, device,
            lambda result: lifecycle_metrics.executable_cache.labels(result).inc())
        lifecycle = Lifecycle(config, device, table, to_scheduler.clone(), weights,
                              excache.compile_module if excache else None, lifecycle_metrics)
        handles = WorkerHandles(config, device, table, stats, metrics, scheduler, service, to_lifecycle,
                                weights, nursery.cancel_scope, trio.lowlevel.current_trio_token())
        handles.http_port = await nursery.start(serve_admin, config.http_host, config.http_port, _health(handles))
        from xlaserve.frontend.control import WorkerControlService
        handles.services.append(WorkerControlService(handles, nursery))
        await nursery.start(lifecycle.run, lifecycle_inbox)
        on_started(handles)


async def serve(config: WorkerConfig, *, ready_callback=None) -> None:
    """Run one worker until SIGTERM/SIGINT. ``ready_callback(grpc_port, http_port)`` is for tests."""
    log.info("effective configuration of worker %s:\n%s", config.name, "\n".join(effective_config_lines(config)))
    loop = asyncio.get_running_loop()
    started: asyncio.Future[WorkerHandles] = loop.create_future()
    finished: asyncio.Future = loop.create_future()

    def done(outcome) -> None:
        if not finished.done():
            finished.set_result(outcome)
        if not started.done():
            started.set_exception(RuntimeError("the worker stopped during start-up"))

    trio.lowlevel.start_guest_run(
        trio_main, config, lambda h: started.done() or started.set_result(h),
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        run_sync_soon_not_threadsafe=loop.call_soon,
        done_callback=done, host_uses_signal_set_wakeup_fd=True)
    try:
        handles = await started
    except RuntimeError:
        outcome = await finished
        outcome.unwrap()
        raise
    handles.bridge = Bridge(loop, handles.token)
    if config.endpoints.allow_client_shm:
        from xlaserve.frontend.shm import SharedMemoryRegistry
        handles.shared_memory = SharedMemoryRegistry()
    from xlaserve.frontend.kserve import KServeService
    server = Server([KServeService(handles), *handles.services])
    await server.start(config.grpc_host, config.grpc_port)
    grpc_port = server._server.sockets[0].getsockname()[1]
    log.info("KServe V2 gRPC on %s:%d", config.grpc_host, grpc_port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_callback is not None:
        ready_callback(grpc_port, handles.http_port)
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, finished], return_when=asyncio.FIRST_COMPLETED)
    log.info("draining: no new calls; waiting up to %.0fs for in-flight requests", DRAIN_SECONDS)
    server.close()
    try:
        await asyncio.wait_for(server.wait_closed(), DRAIN_SECONDS)
    except asyncio.TimeoutError:
        log.warning("drain timed out; cancelling what is left")
    if not finished.done():
        handles.bridge.run_soon(handles.cancel_scope.cancel)
    outcome = await finished
    waiter.cancel()
    try:
        outcome.unwrap()
    except trio.Cancelled:
        pass
    log.info("worker %s stopped", config.name)
