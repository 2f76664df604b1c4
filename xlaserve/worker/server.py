"""A worker process: one Trio run holding the actors and the gRPC frontend.

Boot order, in one place: check the model repository and bind both addresses (before JAX is
imported, see :mod:`xlaserve.worker.preflight`); log the effective configuration with the ports
bound; open the device; start the weight cache, the scheduler, the admin HTTP port and the
lifecycle actor (which loads the repository); then the gRPC frontend. SIGTERM or SIGINT drains:
the gRPC server stops taking calls (GOAWAY), in-flight calls finish (for at most
``DRAIN_SECONDS``), then the actors are cancelled.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

import trio

from xlaserve.admin import serve_admin
from xlaserve.config import WorkerConfig, effective_config_lines
from xlaserve.errors import FailedPrecondition, Unavailable
from xlaserve.frontend.bridge import Bridge
from xlaserve.frontend.grpc_server import GrpcServer
from xlaserve.metrics import Metrics, WeightCacheMetrics
from xlaserve.runtime.excache import open_executable_cache
from xlaserve.runtime.pjrt import Device
from xlaserve.runtime.weights import WeightCache, budget_for
from xlaserve.worker.inference import InferenceService
from xlaserve.worker.lifecycle import Lifecycle, LifecycleMessage, LifecycleMetrics, LoadModel, UnloadModel
from xlaserve.worker.registry import ModelTable
from xlaserve.worker.preflight import Claimed, claim
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
    # Set when SIGTERM/SIGINT starts the drain: calls that would otherwise never end on their
    # own (a WatchStatus stream) finish then, so the drain waits only for real work.
    draining: trio.Event = field(default_factory=trio.Event)

    def ready(self) -> bool:
        return self.table.ready()

    async def control_load(self, name: str) -> None:
        await self._control("load", LoadModel, name)

    async def control_unload(self, name: str) -> None:
        await self._control("unload", UnloadModel, name)

    async def _control(self, verb: str, message, name: str) -> None:
        if self.config.model_control_mode == "static":
            raise FailedPrecondition(f"cannot {verb} '{name}': model_control_mode is static, so the model set is "
                                     f"fixed at start-up (use dynamic or explicit to {verb} models at run time)")
        error = await self.bridge.call(lambda reply: self._send_lifecycle(message(name, reply), reply))
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
        states = {state: n for state, n in handles.table.state_counts().items() if n}
        counts = " ".join(f"{k}={v}" for k, v in sorted(states.items()))
        if handles.ready():
            return 200, "text/plain", f"ready {counts}\n".encode()
        if not handles.table.startup_done.is_set():
            why = "loading models"
        elif states:
            why = f"no model is ready ({counts}; RepositoryIndex gives each reason)"
        elif handles.config.model_control_mode == "explicit":
            why = "no model is loaded (model_control_mode is explicit: load one with RepositoryModelLoad)"
        else:
            named = " named in models_include" if handles.config.models_include else ""
            why = f"no model is ready: model_repo {handles.config.model_repo} holds no bundle{named}"
        return 503, "text/plain", f"{why}\n".encode()

    def metrics():
        for state, n in handles.table.state_counts().items():
            handles.metrics.models.labels(state).set(n)
        return 200, "text/plain; version=0.0.4; charset=utf-8", handles.metrics.exposition()

    return {"/healthz": healthz, "/readyz": readyz, "/metrics": metrics}


async def run_actors(config: WorkerConfig, *, admin_listeners: list[trio.SocketListener] | None = None,
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """The worker's actors. Reports their handles once they are up (models may still be
    loading) and runs until cancelled. The admin HTTP port serves ``admin_listeners`` when
    given, else binds ``config.http_host:http_port``."""
    device = await trio.to_thread.run_sync(Device, config.runtime.backend, config.gpu or 0)
    log.info("device: %s (%s), jax PJRT %s; host copies of weights in %s memory", device.backend, device.kind,
             device.platform_version, device.host_memory_kind)
    device_limiter = trio.CapacityLimiter(1)
    table = ModelTable()
    stats = StatsBook()
    metrics = Metrics()
    weights = WeightCache(device, device_limiter, budget_for(config.runtime, device),
                          residency=lambda name: config.scheduler.for_model(name).residency,
                          metrics=WeightCacheMetrics(metrics.registry),
                          compaction_interval=config.scheduler.compaction_interval)
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
        handles.http_port = await nursery.start(functools.partial(
            serve_admin, config.http_host, config.http_port, _health(handles), listeners=admin_listeners))
        from xlaserve.frontend.control import WorkerControlService
        handles.services.append(WorkerControlService(handles, nursery))
        await nursery.start(lifecycle.run, lifecycle_inbox)
        task_status.started(handles)


async def serve(config: WorkerConfig, *, claimed: Claimed | None = None, ready_callback=None) -> None:
    """Run one worker until SIGTERM/SIGINT. ``claimed`` holds its addresses already bound (see
    :mod:`xlaserve.worker.preflight`); without it they are claimed here. ``ready_callback(grpc_port,
    http_port)`` is for tests and scripts."""
    if claimed is None:
        claimed = claim(config)
    config = dataclasses.replace(config, grpc_port=claimed.grpc.port, http_port=claimed.http.port)
    log.info("effective configuration of worker %s:\n%s", config.name, "\n".join(effective_config_lines(config)))
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            handles: WorkerHandles = await nursery.start(functools.partial(
                run_actors, config, admin_listeners=claimed.http.trio_listeners()))
            handles.bridge = Bridge(handles.token)
            if config.endpoints.allow_client_shm:
                from xlaserve.frontend.shm import SharedMemoryRegistry
                handles.shared_memory = SharedMemoryRegistry()
            from xlaserve.frontend.kserve import (KServeService, connection_buffer_full, request_too_large,
                                                  response_too_large)
            endpoints = config.endpoints
            server = GrpcServer([KServeService(handles), *handles.services],
                                max_recv_bytes=endpoints.max_recv_msg_bytes,
                                max_send_bytes=endpoints.max_send_msg_bytes,
                                too_large_request=request_too_large, too_large_response=response_too_large,
                                max_held_bytes=endpoints.max_connection_buffer_bytes,
                                max_connections=endpoints.max_connections,
                                max_connection_inflate_bytes=endpoints.max_connection_inflate_bytes,
                                max_inflate_bytes=endpoints.max_inflate_bytes,
                                too_much_held=connection_buffer_full)
            handles.scheduler.reply_batch = server.write_batch
            await nursery.start(functools.partial(server.serve, listeners=claimed.grpc.trio_listeners()))
            log.info("serving: KServe V2 gRPC on %s, HTTP on %s (/healthz /readyz /metrics)",
                     claimed.grpc.address, claimed.http.address)
            if ready_callback is not None:
                ready_callback(claimed.grpc.port, claimed.http.port)
            async for _ in signals:
                break
            log.info("draining: no new calls; waiting up to %.0fs for in-flight requests", DRAIN_SECONDS)
            handles.draining.set()
            server.close()
            with trio.move_on_after(DRAIN_SECONDS) as drain:
                await server.wait_closed()
            if drain.cancelled_caught:
                log.warning("drain timed out; cancelling what is left")
            nursery.cancel_scope.cancel()
    log.info("worker %s stopped", config.name)
