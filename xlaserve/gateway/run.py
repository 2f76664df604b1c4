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

import functools
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import trio
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve._proto import xlaserve_control_pb2 as cpb
from xlaserve.admin import reused, serve_admin
from xlaserve.app.preflight import BoundAddress, bind
from xlaserve.bundle import bundle_name_ok
from xlaserve.config.gateway import GatewayConfig
from xlaserve.errors import StartupError
from xlaserve.frontend.grpc_server import GrpcServer
from xlaserve.frontend.http1 import Http1Server, HttpLimits
from xlaserve.frontend.rest_api import RestApi
from xlaserve.gateway.control import GatewayControlService, StatusBoard
from xlaserve.gateway.placement import Placement, Rebalancer, WorkerBudget, residency_for
from xlaserve.gateway.router import ModelOnWorker, Router
from xlaserve.gateway.service import GatewayService
from xlaserve.gateway.upstream import Reply, Upstream, UpstreamError
from xlaserve.tracing import open_tracing

log = logging.getLogger("xlaserve.gateway")

__all__ = ["WorkerAddress", "Gateway", "serve_gateway", "embedded_gateway", "DISCOVERY_INTERVAL"]

DISCOVERY_INTERVAL = 0.5       # seconds between a worker's catalog snapshots
STATUS_GAP = 0.1               # a worker's statuses are applied at most this often
CAPACITY_RETRY_SECONDS = 10.0  # a model's ModelConfig that failed is asked again after this
STALE_AFTER = 2.0              # a worker silent this long is routed around (it may be stopped)
SCRAPE_INTERVAL = 5.0          # seconds between scrapes of each worker's /metrics
PLACEMENT_CHECK = 1.0          # lpt_packing: seconds between looks at the measured work
SERVICE = "/inference.GRPCInferenceService/"
CONTROL = "/xlaserve.control.WorkerControl/"
WATCH = CONTROL + "WatchStatus"


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """A worker the gateway fronts: its name (logs, metrics, reasons) and gRPC address."""

    name: str
    host: str
    port: int


class _RoutedCollector:
    """``xlaserve_gateway_requests_routed_total``, read from the service's own tally when scraped,
    so routing a request does no metric work."""

    def __init__(self, service: GatewayService) -> None:
        self.service = service

    def collect(self):
        family = CounterMetricFamily("xlaserve_gateway_requests_routed", "ModelInfer requests routed, by worker "
                                     "and model", labels=["worker", "model"])
        for (worker, model), n in sorted(self.service.routed.items()):
            family.add_metric([worker, model], n)
        yield family


class Gateway:
    """The gateway over ``workers``. :meth:`run` serves until cancelled (or :meth:`close`)."""

    def __init__(self, workers: list[WorkerAddress], config: GatewayConfig = GatewayConfig(), *,
                 metrics_names: list[str] | None = None, span_exporter=None) -> None:
        """``span_exporter``: an OpenTelemetry SDK span exporter to use instead of the one
        ``config.tracing`` names (when tracing is enabled)."""
        self.config = config
        #: config.metrics_endpoints' worker labels (the endpoint itself when not given)
        self._metrics_names = metrics_names or list(config.metrics_endpoints)
        self._scraped: dict[str, str] = {}
        #: the workers' pages last merged (the very strings) and the merge: merged again only
        #: when a scrape brought a new page (an 8 MB page took 0.2-0.3 s to merge)
        self._merged: tuple[dict[str, str], bytes] = ({}, b"")
        scheduling = config.scheduling
        self.upstreams: dict[str, Upstream] = {}
        self.router = Router([], scheduling.mode, outstanding=lambda name: self.upstreams[name].outstanding,
                             fill_factor=scheduling.routing_fill_factor, policy=scheduling.routing_policy)
        self.placement: Placement | None = None
        self._budgets: dict[str, int] = {}                   # worker -> its weight budget (bytes)
        self._weight_bytes: dict[str, int] = {}              # model -> its weights (bytes)
        self._capacity_asked: set[str] = set()
        self._residency: dict[tuple[str, str], str] = {}     # (worker, model) -> as WatchStatus says
        self._refused: set[str] = set()                      # lpt_packing: workers that run fair
        self._negative_sizes: set[str] = set()               # workers warned of a byte count below 0
        self._bad_names: set[str] = set()                    # workers warned of model names no bundle has
        try:
            self.tracing = open_tracing(config.tracing, "gateway", span_exporter=span_exporter)
        except OSError as exc:
            raise StartupError(f"tracing.file: cannot write spans to {config.tracing.file}: "
                               f"{exc.strerror or exc}; give a writable file or another tracing.exporter") from None
        self.service = GatewayService(self.upstreams, self.router,
                                      max_per_worker=config.grpc.max_concurrent_requests_per_worker,
                                      shm_peers=config.grpc.client_shm_peers, tracing=self.tracing)
        #: each worker's latest status, as discovery receives it: the gateway's WorkerControl
        #: service streams it to dashboards (xlaserve top) without a subscription of its own
        self.board = StatusBoard()
        self._draining = trio.Event()
        self.control = GatewayControlService(self.upstreams, self.board, self._draining)
        self.server = GrpcServer([self.service, self.control], max_recv_bytes=config.grpc.max_recv_msg_bytes,
                                 max_send_bytes=config.grpc.max_send_msg_bytes,
                                 too_large_response=lambda size, limit: (
                                     f"the response message is {size} bytes; the limit "
                                     f"(gateway.grpc.max_send_msg_bytes) is {limit}"))
        self.registry = CollectorRegistry()
        self.registry.register(_RoutedCollector(self.service))
        self._in_flight = Gauge("xlaserve_gateway_in_flight", "requests in flight to each worker (the gateway's own "
                                "status stream to it not counted)",
                                ["worker"], registry=self.registry)
        self._up = Gauge("xlaserve_gateway_worker_up", "1 when the gateway's connection to the worker is up",
                         ["worker"], registry=self.registry)
        self._errors = Gauge("xlaserve_gateway_errors", "requests failed at the gateway, by cause",
                             ["cause"], registry=self.registry)
        self._replicas = Gauge("xlaserve_gateway_replicas", "workers with the model READY",
                               ["model"], registry=self.registry)
        self._placed = Gauge("xlaserve_gateway_placed", "lpt_packing: 1 where the placement puts the model",
                             ["model", "worker"], registry=self.registry)
        self._placed_load = Gauge("xlaserve_gateway_placed_load", "lpt_packing: measured device-seconds per "
                                  "second placed on the worker", ["worker"], registry=self.registry)
        self._placed_bytes = Gauge("xlaserve_gateway_placed_bytes", "lpt_packing: weight bytes placed on the "
                                   "worker", ["worker"], registry=self.registry)
        self.grpc_port = 0
        self.http_port = 0
        self.rest_port: int | None = None
        #: the REST port's server (``listen.rest``), once :meth:`run` serves one
        self.rest: Http1Server | None = None
        #: /healthz: (healthy, why); the embedded gateway adds the supervisor's view
        self.health: Callable[[], tuple[bool, str]] = lambda: (True, "ok")
        self._nursery: trio.Nursery | None = None
        self._scopes: dict[str, trio.CancelScope] = {}
        for worker in workers:
            self.add_worker(worker)

    def add_worker(self, worker: WorkerAddress) -> None:
        """Front ``worker`` too (routed to once discovery has seen it ready)."""
        if worker.name in self.upstreams:
            return
        client = self.config.worker_client
        self.upstreams[worker.name] = Upstream(worker.name, worker.host, worker.port,
                                               max_streams=client.max_concurrent_streams,
                                               request_timeout=client.request_timeout_seconds,
                                               connect_timeout=client.connect_timeout_seconds,
                                               max_reply_bytes=self.config.grpc.max_send_msg_bytes,
                                               server=self.server)
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
        self.board.forget(name)
        log.info("gateway: worker %s removed", name)

    async def _worker_tasks(self, name: str) -> None:
        upstream = self.upstreams[name]
        with trio.CancelScope() as scope:
            self._scopes[name] = scope
            async with trio.open_nursery() as nursery:
                nursery.start_soon(upstream.run)
                nursery.start_soon(self._discover, name, upstream)

    async def run(self, grpc_host: str = "127.0.0.1", grpc_port: int = 0, http_host: str = "127.0.0.1",
                  http_port: int = 0, rest: tuple[str, int] | None = None, *, http_key: str = "listen.metrics",
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve gRPC and the admin HTTP port, and REST on ``rest`` (host, port) when given;
        reports (gRPC port, HTTP port) once serving (:attr:`rest_port` holds the REST one). All
        three are bound first: one that cannot be (in use, not an address of this machine) raises
        :class:`~xlaserve.errors.StartupError` naming its key (``listen.grpc``, ``http_key``,
        ``listen.rest``) and address, with nothing served."""
        try:
            await self._run(grpc_host, grpc_port, http_host, http_port, rest, http_key, task_status)
        finally:
            if self.tracing is not None:
                self.tracing.close()        # what is queued is exported before the gateway stops

    async def _run(self, grpc_host: str, grpc_port: int, http_host: str, http_port: int,
                   rest: tuple[str, int] | None, http_key: str, task_status) -> None:
        grpc, http, rest_address = _claim_listen(grpc_host, grpc_port, http_key, http_host, http_port, rest)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for name in list(self.upstreams):
                nursery.start_soon(self._worker_tasks, name)
            if self.router.mode == "lpt_packing":
                nursery.start_soon(self._placement_loop)
            for name, endpoint in zip(self._metrics_names, self.config.metrics_endpoints):
                nursery.start_soon(self._scrape_loop, name, endpoint)
            self.grpc_port = await nursery.start(functools.partial(self.server.serve,
                                                                   listeners=grpc.trio_listeners()))
            self.http_port = await nursery.start(functools.partial(serve_admin, http_host, http_port, self.routes(),
                                                                   listeners=http.trio_listeners()))
            rest_line = ""
            if rest_address is not None:        # (bound exactly when rest was given)
                listeners = rest_address.trio_listeners()
                self.rest = Http1Server(RestApi(self.service, max_send_bytes=self.config.grpc.max_send_msg_bytes,
                                                send_limit_key="gateway.grpc.max_send_msg_bytes",
                                                json_limit_key="the default of endpoints.rest_max_json_bytes"),
                                        _rest_limits(self.config), what="REST")
                self.rest_port = await nursery.start(self.rest.serve, listeners)
                rest_line = f", KServe V2 REST on {rest[0]}:{self.rest_port}"
            log.info("gateway: KServe V2 gRPC on %s:%d%s, HTTP on %s:%d, %d worker(s), routing %s", grpc_host,
                     self.grpc_port, rest_line, http_host, self.http_port, len(self.upstreams), self.router.mode)
            task_status.started((self.grpc_port, self.http_port))

    def close(self) -> None:
        """Stop accepting and drain (in-flight calls finish; see GrpcServer.close). Status
        streams end, as a worker's do when it drains."""
        self._draining.set()
        self.server.close()
        if self.rest is not None:
            self.rest.close()

    async def drain(self, seconds: float) -> None:
        """:meth:`close`, then wait until every client connection has finished its calls and
        closed, for at most ``seconds``."""
        self.close()
        with trio.move_on_after(seconds):
            await self.server.wait_closed()
            if self.rest is not None:
                await self.rest.wait_closed()

    async def _discover(self, name: str, upstream: Upstream) -> None:
        request = cpb.WatchStatusRequest(interval_seconds=DISCOVERY_INTERVAL).SerializeToString()
        while True:
            await upstream.connected.wait()
            ended = trio.Event()
            box: list = []
            heard = [trio.Event()]

            applied = [-math.inf]           # when the last status was applied
            pending: list = [None]          # a status that came sooner than STATUS_GAP after it

            def on_message(data: bytes) -> None:
                status = cpb.ModelControlStatusResponse.FromString(data)
                # A worker that sends faster than it was asked (a message per microsecond) is
                # not followed message by message: applying a status costs the gateway time in
                # the size of the catalog, and it held up every other worker's requests. The
                # latest one is applied STATUS_GAP after the last.
                if trio.current_time() - applied[0] < STATUS_GAP:
                    pending[0] = status
                    heard[0].set()
                    return
                apply(status)

            def apply(status: cpb.ModelControlStatusResponse) -> None:
                applied[0], pending[0] = trio.current_time(), None
                named = [m for m in status.models if bundle_name_ok(m.name)]
                if len(named) < len(status.models):
                    # no worker serves such a name (a bundle's is a plain directory name); from a
                    # broken or hostile one it would reach log lines (a newline fakes a line),
                    # metrics labels and dashboards: its models are not routed to
                    if name not in self._bad_names:
                        self._bad_names.add(name)
                        log.warning("gateway: worker %s reports %d model name(s) no bundle can have (control "
                                    "characters, '/', longer than 255 bytes; %s first): not routed to",
                                    name, len(status.models) - len(named),
                                    ascii(next(m.name for m in status.models if not bundle_name_ok(m.name))[:80]))
                    del status.models[:]
                    status.models.extend(named)
                self.board.publish(name, status)
                if self.router.mode == "lpt_packing" and status.discipline == "fair":
                    # the gateway places and balances; a worker sharing its device fair-ly on
                    # its own would undo that: refused (the embedded gateway refuses at start-up)
                    if name not in self._refused:
                        self._refused.add(name)
                        log.error("gateway: worker %s runs scheduler.discipline fair; lpt_packing needs fifo or "
                                  "edf (the gateway places the models and balances the workers): it is not routed "
                                  "to until it runs fifo or edf", name)
                    self.router.worker_down(name, "refused: it runs scheduler.discipline fair, lpt_packing needs "
                                                  "fifo or edf")
                    heard[0].set()
                    return
                self._refused.discard(name)
                # A byte count below 0 is no size at all (a broken or hostile worker): the
                # packer refuses one, and its error ended the whole gateway. A budget below 0
                # counts as 0 (nothing fits there); a model's size below 0 as not reported.
                negative = [m.name for m in status.models if m.weight_bytes < 0]
                if (status.budget_bytes < 0 or negative) and name not in self._negative_sizes:
                    self._negative_sizes.add(name)
                    log.warning("gateway: worker %s reports byte counts below 0 (budget_bytes %d; weight_bytes of "
                                "%d model(s), %.200r first): a budget below 0 is taken as 0, a size below 0 as "
                                "not reported", name, status.budget_bytes, len(negative), negative[0] if negative else "")
                self._budgets[name] = max(0, status.budget_bytes)
                for m in status.models:
                    self._residency[(name, m.name)] = m.residency
                    if m.weight_bytes > 0:
                        self._weight_bytes[m.name] = m.weight_bytes
                    if m.state == "READY" and m.name not in self._capacity_asked and self._nursery is not None:
                        self._capacity_asked.add(m.name)
                        self._nursery.start_soon(self._learn_capacity, name, m.name, m.max_batch_size)
                was_up = self.router.is_up(name)
                self.router.worker_up(name, [ModelOnWorker(m.name, m.state, int(m.version), m.reason)
                                             for m in status.models])
                self._forget_gone_models(name, status)
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
                    if pending[0] is not None and not ended.is_set():
                        await trio.sleep_until(applied[0] + STATUS_GAP)
                        if pending[0] is not None and not ended.is_set():
                            try:
                                apply(pending[0])
                            except Exception:
                                # (on_message's apply fails the watch call alone; here, in the
                                # gateway's nursery, a bug must not end the gateway either)
                                log.exception("gateway: applying a status of worker %s failed; routing around "
                                              "it until its next status", name)
                                if self.router.is_up(name):
                                    self.router.worker_down(name)
                    continue
                if not ended.is_set() and self.router.is_up(name):
                    self.router.worker_down(name)
                    log.warning("gateway: worker %s sent no status for %.1f s; routing around it until it "
                                "answers again", name, STALE_AFTER)
            if self.router.is_up(name):
                self.router.worker_down(name)
            self.board.forget(name)
            outcome = box[0]
            if upstream.up:
                # the stream ended with the connection still up: the worker is stopping (its
                # WatchStatus ends when it drains) or refuses the control API
                why = outcome.message if isinstance(outcome, (UpstreamError, Reply)) else ""
                log.warning("gateway: worker %s ended its status stream (%s); routing around it", name,
                            why or "it is draining")
                await trio.sleep(DISCOVERY_INTERVAL)

    def _forget_gone_models(self, worker: str, status: cpb.ModelControlStatusResponse) -> None:
        """Forget what the gateway keeps per model for models no worker reports any more (and
        ``worker``'s residencies of models it no longer lists): a worker that reports new names
        in every status, broken or hostile, grew these tables by its whole catalog each
        DISCOVERY_INTERVAL, for as long as it ran."""
        listed = {m.name for m in status.models}
        for key in [k for k in self._residency if k[0] == worker and k[1] not in listed]:
            del self._residency[key]
        known = self.router.models()
        for model in [m for m in self._weight_bytes if m not in known]:
            del self._weight_bytes[model]
        self._capacity_asked &= known.keys()
        self.router.forget_models_except(known)

    # ---- lpt_packing -------------------------------------------------------------------------
    async def _learn_capacity(self, worker: str, model: str, cap: int) -> None:
        """The model's largest compiled batch size (its ModelConfig's max_batch_size, within
        the worker's max_batch_size cap when one is set): what filling a replica means."""
        try:
            reply = await self.upstreams[worker].unary(
                SERVICE + "ModelConfig", pb.ModelConfigRequest(name=model), pb.ModelConfigResponse)
        except (UpstreamError, KeyError) as exc:
            log.debug("gateway: ModelConfig of %s from %s failed (%s); asked again in %g s", model, worker, exc,
                      CAPACITY_RETRY_SECONDS)
            # not at the next status (every DISCOVERY_INTERVAL): a worker whose ModelConfig fails
            # for a catalog of READY models drew one call per model per status
            await trio.sleep(CAPACITY_RETRY_SECONDS)
            self._capacity_asked.discard(model)
            return
        largest = reply.config.max_batch_size or 1
        self.router.set_capacity(model, min(largest, cap) if cap else largest)

    async def _device_seconds(self) -> dict[tuple[str, str], float]:
        """Device seconds each (worker, model) has executed so far: the compute durations of
        every batch size in the worker's ModelStatistics."""
        out: dict[tuple[str, str], float] = {}

        async def one(worker: str, upstream: Upstream) -> None:
            try:
                reply = await upstream.unary(SERVICE + "ModelStatistics", pb.ModelStatisticsRequest(),
                                             pb.ModelStatisticsResponse)
            except UpstreamError:
                return
            for stats in reply.model_stats:
                seconds = sum(b.compute_input.ns + b.compute_infer.ns + b.compute_output.ns
                              for b in stats.batch_stats) / 1e9
                out[(worker, stats.name)] = out.get((worker, stats.name), 0.0) + seconds
        async with trio.open_nursery() as nursery:
            for worker, upstream in list(self.upstreams.items()):
                if upstream.up:
                    nursery.start_soon(one, worker, upstream)
        return out

    async def _enforce(self, workers: tuple[str, ...]) -> None:
        """Make each worker hold host copies of the models placed on it only: a model placed
        elsewhere becomes ``unpinned`` there (its host RAM is freed; a stray request reads it from
        disk), one placed there again goes back to ``system``. A model the operator pinned
        (``device``) is left as it is."""
        async def one(worker: str) -> None:
            changed = []
            for model in sorted(self.placement.workers_of):     # a model not placed yet: left as it is
                wanted = residency_for(worker, model, self._residency.get((worker, model)), self.placement.workers_of)
                if wanted is None:
                    continue
                try:
                    await self.upstreams[worker].unary(
                        CONTROL + "SetModelResidency", cpb.SetModelResidencyRequest(model=model, residency=wanted),
                        cpb.SetModelResidencyResponse)
                except (UpstreamError, KeyError) as exc:
                    log.warning("gateway: cannot set %s's residency to %s on %s: %s", model, wanted, worker,
                                getattr(exc, "message", exc))
                    continue
                self._residency[(worker, model)] = wanted
                changed.append(f"{model}: {wanted}")
            if changed:
                log.info("gateway: placement enforced on %s: %s", worker, ", ".join(changed))
        async with trio.open_nursery() as nursery:
            for worker in workers:
                nursery.start_soon(one, worker)

    async def _placement_loop(self) -> None:
        """Place the models (``lpt_packing``) when the :class:`~xlaserve.gateway.placement.Rebalancer`
        decides to, from what the workers report (which are up, their budgets, the models ready
        and their sizes, the device seconds they executed), then route by the placement and
        make each worker hold what it was given (:meth:`_enforce`)."""
        settings = self.config.scheduling
        rebalancer = Rebalancer(settings.rebalance_compute_seconds, settings.default_replicas,
                                settings.replicas_for, now=trio.current_time())
        warned: tuple = ()
        while True:
            await trio.sleep(PLACEMENT_CHECK)
            workers = tuple(w for w in self.router.workers if self.router.is_up(w) and w in self._budgets)
            # Models ready somewhere, whose weight sizes the workers have reported: a model still
            # loading (a worker lists its whole start-up set at once, LOADING) has no size yet,
            # and placing it as if it weighed nothing put every model on one worker.
            models = self.router.ready_models()
            if not workers or not models:
                continue
            measured = await self._device_seconds()
            decided = rebalancer.decide([WorkerBudget(w, self._budgets[w]) for w in workers], models,
                                        self._weight_bytes, measured, trio.current_time())
            if decided is None:
                continue
            self.placement = decided.placement
            self.router.set_placement(self.placement.workers_of, self.placement.load_of)
            log.info("gateway: placement (%s): %s", "by size" if decided.by_size else
                     f"by {decided.measured_seconds:.1f} s of measured device time",
                     "; ".join(f"{w}: {', '.join(self.placement.models_on(w)) or '-'} (load {self.placement.load_of[w]:.3f})"
                               for w in workers))
            await self._enforce(workers)
            over = tuple((o.worker, o.models, o.placed_bytes) for o in self.placement.over_budget)
            if over and over != warned:
                log.warning("gateway: the placed weights exceed a worker's budget, so it will load and evict "
                            "weights as requests come: %s. Lower replicas, or add workers",
                            "; ".join(f"{o.worker}: {', '.join(o.models)} = {o.placed_bytes} bytes > budget "
                                      f"{o.budget_bytes} bytes" for o in self.placement.over_budget))
            warned = over

    # ---- the workers' metrics ------------------------------------------------------------------
    async def _scrape_loop(self, name: str, endpoint: str) -> None:
        """Fetch worker ``name``'s /metrics every SCRAPE_INTERVAL seconds; the gateway's own
        page serves the last one with a ``worker`` label (a worker that cannot be scraped
        drops out of it, and its up gauge says why it is missing)."""
        from xlaserve.config.schema import split_address
        from xlaserve.gateway.scrape import scrape
        host, port = split_address(endpoint)
        failing = False
        while True:
            try:
                self._scraped[name] = await scrape(host, port)
                failing = False
            except (OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:     # a reset is not an OSError
                self._scraped.pop(name, None)
                if not failing:
                    log.warning("gateway: cannot scrape %s's metrics at %s: %s", name, endpoint, exc or "timed out")
                failing = True
            await trio.sleep(1.0 if failing else SCRAPE_INTERVAL)   # a worker still starting: look again soon

    # ---- admin port --------------------------------------------------------------------------
    def ready_reason(self) -> tuple[bool, str]:
        """Ready when every model some worker serves is READY on at least one reachable worker
        (and at least one model is)."""
        models = self.router.models()
        down = [w for w, u in self.upstreams.items() if not u.up]
        if not models:
            reachable = len(self.upstreams) - len(down)
            refused = f"; refused (they run scheduler.discipline fair): {', '.join(sorted(self._refused))}" \
                if self._refused else ""
            return False, f"no model is served yet ({reachable} of {len(self.upstreams)} worker(s) reachable{refused})"
        missing = sorted(m for m in models if not self.router.replicas(m))
        if missing:
            return False, "; ".join(self.router.why_not(m) for m in missing[:5])
        return True, (f"ready: {len(models)} model(s) on {len(self.upstreams) - len(down)} of "
                      f"{len(self.upstreams)} worker(s)")

    def routes(self) -> Mapping[str, object]:
        def healthz():
            ok, why = self.health()
            return (200 if ok else 503), "text/plain", f"{why}\n".encode()

        def readyz():
            ok, why = self.ready_reason()
            return (200 if ok else 503), "text/plain", f"{why}\n".encode()

        def metrics():
            for name, upstream in self.upstreams.items():
                # requests: the long-lived status stream of discovery is not one
                self._in_flight.labels(name).set(upstream.outstanding - upstream.streaming)
                self._up.labels(name).set(1 if upstream.up else 0)
            for cause, n in self.service.errors.items():
                self._errors.labels(cause).set(n)
            self._replicas.clear()      # a model no worker reports any more leaves the page
            for model in self.router.models():
                self._replicas.labels(model).set(len(self.router.replicas(model)))
            if self.placement is not None:
                self._placed.clear()
                for model, workers in self.placement.workers_of.items():
                    for worker in workers:
                        self._placed.labels(model, worker).set(1)
                for worker, load in self.placement.load_of.items():
                    self._placed_load.labels(worker).set(load)
                    self._placed_bytes.labels(worker).set(self.placement.bytes_of[worker])
            page = generate_latest(self.registry)
            return 200, "text/plain; version=0.0.4; charset=utf-8", page + self._merged_pages()
        return {"/healthz": healthz, "/readyz": readyz, "/metrics": reused(metrics)}

    def _merged_pages(self) -> bytes:
        """The workers' scraped pages as one exposition, merged again only when they changed."""
        pages, merged = self._merged
        if pages.keys() != self._scraped.keys() or any(self._scraped[k] is not v for k, v in pages.items()):
            from xlaserve.gateway.scrape import relabel
            pages = dict(self._scraped)
            self._merged = pages, relabel(pages).encode() if pages else b""
        return self._merged[1]


def _claim_listen(grpc_host: str, grpc_port: int, http_key: str, http_host: str, http_port: int,
                  rest: tuple[str, int] | None) -> tuple[BoundAddress, BoundAddress, BoundAddress | None]:
    """The gateway's addresses, bound; StartupError naming the key and address of the first one
    that cannot be, with those already bound closed."""
    grpc = bind("listen.grpc", grpc_host, grpc_port)
    bound = [grpc]
    try:
        http = bind(http_key, http_host, http_port)
        bound.append(http)
        rest_address = bind("listen.rest", rest[0], rest[1]) if rest is not None else None
    except BaseException:
        for address in bound:
            address.close()
        raise
    return grpc, http, rest_address


async def serve_gateway(config: GatewayConfig, workers: list[WorkerAddress] | None = None, *,
                        ready_file: str | None = None, drain_seconds: float = 30.0) -> None:
    """Serve a gateway until SIGTERM or SIGINT, then stop accepting, let the calls in flight
    finish (at most ``drain_seconds``) and return. ``workers`` given (the embedded gateway of a
    node): those. Else the standalone gateway follows ``config.endpoints``, resolving DNS names
    again every ``endpoint_refresh_seconds`` and adding and removing workers as they change.
    ``ready_file``: the bound ports as JSON (``grpc_port``, ``http_port``) once serving."""
    import signal

    from xlaserve.config.schema import split_address
    from xlaserve.gateway.endpoints import follow
    from xlaserve.supervisor import ready_writer

    gateway = Gateway(workers or [], config)
    grpc_host, grpc_port = split_address(config.listen.grpc)
    http_host, http_port = split_address(config.listen.metrics)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            if workers is None:
                changes_send, changes = trio.open_memory_channel(16)
                first = await nursery.start(follow, config.endpoints, config.endpoint_refresh_seconds, changes_send)
                for e in first:
                    gateway.add_worker(WorkerAddress(e.name, e.address, e.port))
                nursery.start_soon(_apply_changes, gateway, changes)
            grpc_port, http_port = await nursery.start(gateway.run, grpc_host, grpc_port, http_host, http_port,
                                                       _rest_address(config))
            if ready_file:
                ready_writer(ready_file)(grpc_port, http_port, gateway.rest_port)
            async for signum in signals:
                log.info("gateway: %s: draining (no new calls; up to %g s for those in flight)",
                         signal.Signals(signum).name, drain_seconds)
                await gateway.drain(drain_seconds)
                nursery.cancel_scope.cancel()
                break
    log.info("gateway stopped")


async def _apply_changes(gateway: Gateway, changes) -> None:
    async for change in changes:
        for e in change.removed:
            gateway.remove_worker(e.name)
        for e in change.added:
            gateway.add_worker(WorkerAddress(e.name, e.address, e.port))


def embedded_gateway(config: GatewayConfig, workers: list[WorkerAddress], *, ready_file: str | None = None,
                     drain_seconds: float = 30.0):
    """The gateway of a multi-worker node, as :func:`~xlaserve.supervisor.supervise` runs it
    (``gateway=``): it serves the node's ``listen`` addresses in front of ``workers``, drains
    before the supervisor signals the workers, reconnects to a worker as soon as the supervisor
    reports it ready again after a restart, and answers ``/healthz`` 503 once the node stops."""
    from xlaserve.config.schema import split_address
    from xlaserve.supervisor import WorkerReady, ready_writer

    async def run(supervisor) -> None:
        gateway = Gateway(workers, config, metrics_names=[w.name for w in workers])
        gateway.health = lambda: (not supervisor.stopping, "stopping" if supervisor.stopping else "ok")

        supervisor.add_before_stop(lambda: gateway.drain(drain_seconds))
        events = supervisor.subscribe()
        grpc_host, grpc_port = split_address(config.listen.grpc)
        http_host, http_port = split_address(config.listen.metrics)
        async with trio.open_nursery() as nursery:
            ports = await nursery.start(functools.partial(gateway.run, grpc_host, grpc_port, http_host, http_port,
                                                          _rest_address(config), http_key="listen.http"))
            if ready_file:
                ready_writer(ready_file)(*ports, gateway.rest_port)
            async with events:
                async for event in events:
                    if isinstance(event, WorkerReady) and event.name in gateway.upstreams:
                        gateway.upstreams[event.name].reconnect_now()
    return run


def _rest_address(config: GatewayConfig) -> tuple[str, int] | None:
    from xlaserve.config.schema import split_address
    return split_address(config.listen.rest) if config.listen.rest else None


def _rest_limits(config: GatewayConfig) -> HttpLimits:
    """The gateway's REST port: the body is bounded as its gRPC messages are; the other limits
    are the defaults of a worker's ``endpoints.rest_*`` keys."""
    size = config.grpc.max_recv_msg_bytes
    return HttpLimits(max_body_bytes=size, max_inflate_bytes=min(size, 16 * 1024 * 1024),
                      keys={"max_body_bytes": "gateway.grpc.max_recv_msg_bytes",
                            "max_inflate_bytes": "gateway.grpc.max_recv_msg_bytes"})
