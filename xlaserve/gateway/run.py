"""The gateway as a Trio actor tree: one :class:`~xlaserve.gateway.upstream.Upstream` and one
discovery task per worker, the KServe V2 service on the worker's gRPC server, and the admin HTTP
port (``/healthz``, ``/readyz``, ``/metrics``).

Discovery: once a worker's connection is up, the gateway opens the worker's ``WatchStatus``
stream (xlaserve's control API), which sends the worker's whole catalog every
``DISCOVERY_INTERVAL`` seconds; each snapshot replaces what the router knows of that worker. When
the connection is lost the worker is routed around at once, and when it comes back (a restart)
the stream is opened again, so the gateway re-discovers it without being told. A worker whose
stream falls silent for ``STALE_AFTER`` seconds with its connection open (stopped, hung) is routed
around until it speaks again; its requests in flight end with DEADLINE_EXCEEDED at their timeout.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from xlaserve._proto import xlaserve_control_pb2 as cpb
from xlaserve.admin import serve_admin
from xlaserve.frontend.grpc_server import GrpcServer
from xlaserve.gateway.router import ModelOnWorker, Router
from xlaserve.gateway.service import GatewayService
from xlaserve.gateway.upstream import Reply, Upstream, UpstreamError

log = logging.getLogger("xlaserve.gateway")

__all__ = ["WorkerAddress", "GatewaySettings", "Gateway", "DISCOVERY_INTERVAL"]

WATCH = "/xlaserve.control.WorkerControl/WatchStatus"
DISCOVERY_INTERVAL = 0.5       # seconds between a worker's catalog snapshots
STALE_AFTER = 2.0              # a worker silent this long is routed around (it may be stopped)


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """A worker the gateway fronts: its name (logs, metrics, reasons) and gRPC address."""

    name: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The gateway's knobs (the ``gateway:`` block; see docs/gateway.md)."""

    mode: str = "round_robin"
    max_concurrent_requests_per_worker: int = 64     # inbound cap: this x workers; 0 uncapped
    max_concurrent_streams: int = 32                 # outbound, per worker
    request_timeout_seconds: float = 60.0
    connect_timeout_seconds: float = 5.0
    max_recv_msg_bytes: int = 256 * 1024 * 1024
    max_send_msg_bytes: int = 256 * 1024 * 1024


class Gateway:
    """The gateway over ``workers``. :meth:`run` serves until cancelled (or :meth:`close`)."""

    def __init__(self, workers: list[WorkerAddress], settings: GatewaySettings = GatewaySettings()) -> None:
        self.settings = settings
        self.upstreams: dict[str, Upstream] = {}
        self.router = Router([], settings.mode, outstanding=lambda name: self.upstreams[name].outstanding)
        self.service = GatewayService(self.upstreams, self.router,
                                      max_per_worker=settings.max_concurrent_requests_per_worker)
        self.server = GrpcServer([self.service], max_recv_bytes=settings.max_recv_msg_bytes,
                                 max_send_bytes=settings.max_send_msg_bytes)
        self.registry = CollectorRegistry()
        self._routed = Counter("xlaserve_gateway_requests_routed", "ModelInfer requests routed, by worker and model",
                               ["worker", "model"], registry=self.registry)
        self._in_flight = Gauge("xlaserve_gateway_in_flight", "requests in flight to each worker",
                                ["worker"], registry=self.registry)
        self._up = Gauge("xlaserve_gateway_worker_up", "1 when the gateway's connection to the worker is up",
                         ["worker"], registry=self.registry)
        self._errors = Gauge("xlaserve_gateway_errors", "requests failed at the gateway, by cause",
                             ["cause"], registry=self.registry)
        self._replicas = Gauge("xlaserve_gateway_replicas", "workers with the model READY",
                               ["model"], registry=self.registry)
        self.service.on_routed = lambda worker, model: self._routed.labels(worker, model).inc()
        self.grpc_port = 0
        self.http_port = 0
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[str, trio.CancelScope] = {}
        for worker in workers:
            self.add_worker(worker)

    def add_worker(self, worker: WorkerAddress) -> None:
        """Front ``worker`` too (routed to once discovery has seen it ready)."""
        if worker.name in self.upstreams:
            return
        s = self.settings
        self.upstreams[worker.name] = Upstream(worker.name, worker.host, worker.port,
                                               max_streams=s.max_concurrent_streams,
                                               request_timeout=s.request_timeout_seconds,
                                               connect_timeout=s.connect_timeout_seconds)
        self.router.add_worker(worker.name)
        if self._nursery is not None:
            self._nursery.start_soon(self._worker_tasks, worker.name)

    def remove_worker(self, name: str) -> None:
        """Stop fronting worker ``name``: nothing more is routed to it; its calls in flight fail
        UNAVAILABLE."""
        if name not in self.upstreams:
            return
        self.router.remove_worker(name)
        scope = self._scopes.pop(name, None)
        if scope is not None:
            scope.cancel()
        del self.upstreams[name]
        log.info("gateway: worker %s removed", name)

    async def _worker_tasks(self, name: str) -> None:
        upstream = self.upstreams[name]
        with trio.CancelScope() as scope:
            self._scopes[name] = scope
            async with trio.open_nursery() as nursery:
                nursery.start_soon(upstream.run)
                nursery.start_soon(self._discover, name, upstream)

    async def run(self, grpc_host: str = "127.0.0.1", grpc_port: int = 0, http_host: str = "127.0.0.1",
                  http_port: int = 0, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for name in list(self.upstreams):
                nursery.start_soon(self._worker_tasks, name)
            self.grpc_port = await nursery.start(self.server.serve, grpc_host, grpc_port)
            self.http_port = await nursery.start(serve_admin, http_host, http_port, self.routes())
            log.info("gateway: KServe V2 gRPC on %s:%d, HTTP on %s:%d, %d worker(s), routing %s", grpc_host,
                     self.grpc_port, http_host, self.http_port, len(self.upstreams), self.router.mode)
            task_status.started((self.grpc_port, self.http_port))

    def close(self) -> None:
        """Stop accepting and drain (in-flight calls finish; see GrpcServer.close)."""
        self.server.close()

    async def _discover(self, name: str, upstream: Upstream) -> None:
        request = cpb.WatchStatusRequest(interval_seconds=DISCOVERY_INTERVAL).SerializeToString()
        while True:
            await upstream.connected.wait()
            ended = trio.Event()
            box: list = []
            heard = [trio.Event()]

            def on_message(data: bytes) -> None:
                status = cpb.ModelControlStatusResponse.FromString(data)
                was_up = self.router.is_up(name)
                self.router.worker_up(name, [ModelOnWorker(m.name, m.state, int(m.version), m.reason)
                                             for m in status.models])
                heard[0].set()
                if not was_up:
                    log.info("gateway: worker %s is routed to: %d model(s) ready", name,
                             sum(1 for m in status.models if m.state == "READY"))

            def on_done(outcome: Reply | UpstreamError) -> None:
                box.append(outcome)
                ended.set()
                heard[0].set()
                if self.router.is_up(name):
                    self.router.worker_down(name)     # at once: no request may pick it meanwhile
            upstream.start(WATCH, request, on_done, timeout=math.inf, on_message=on_message)
            while not ended.is_set():
                # A worker that stops sending its status (SIGSTOP, a hung process) keeps its
                # connection open: it is routed around after STALE_AFTER of silence, and back
                # as soon as it speaks again.
                with trio.move_on_after(STALE_AFTER):
                    await heard[0].wait()
                    heard[0] = trio.Event()
                    continue
                if not ended.is_set() and self.router.is_up(name):
                    self.router.worker_down(name)
                    log.warning("gateway: worker %s sent no status for %.1f s; routing around it until it "
                                "answers again", name, STALE_AFTER)
            if self.router.is_up(name):
                self.router.worker_down(name)
            outcome = box[0]
            if upstream.up:
                # the stream ended with the connection still up: the worker is stopping (its
                # WatchStatus ends when it drains) or refuses the control API
                why = outcome.message if isinstance(outcome, (UpstreamError, Reply)) else ""
                log.warning("gateway: worker %s ended its status stream (%s); routing around it", name,
                            why or "it is draining")
                await trio.sleep(DISCOVERY_INTERVAL)

    # ---- admin port --------------------------------------------------------------------------
    def ready_reason(self) -> tuple[bool, str]:
        """Ready when every model some worker serves is READY on at least one reachable worker
        (and at least one model is)."""
        models = self.router.models()
        down = [w for w, u in self.upstreams.items() if not u.up]
        if not models:
            reachable = len(self.upstreams) - len(down)
            return False, f"no model is served yet ({reachable} of {len(self.upstreams)} worker(s) reachable)"
        missing = sorted(m for m in models if not self.router.replicas(m))
        if missing:
            return False, "; ".join(self.router.why_not(m) for m in missing[:5])
        return True, (f"ready: {len(models)} model(s) on {len(self.upstreams) - len(down)} of "
                      f"{len(self.upstreams)} worker(s)")

    def routes(self) -> Mapping[str, object]:
        def healthz():
            return 200, "text/plain", b"ok\n"

        def readyz():
            ok, why = self.ready_reason()
            return (200 if ok else 503), "text/plain", f"{why}\n".encode()

        def metrics():
            for name, upstream in self.upstreams.items():
                self._in_flight.labels(name).set(upstream.outstanding)
                self._up.labels(name).set(1 if upstream.up else 0)
            for cause, n in self.service.errors.items():
                self._errors.labels(cause).set(n)
            for model in self.router.models():
                self._replicas.labels(model).set(len(self.router.replicas(model)))
            return 200, "text/plain; version=0.0.4; charset=utf-8", generate_latest(self.registry)
        return {"/healthz": healthz, "/readyz": readyz, "/metrics": metrics}
