"""The gateway's KServe V2 service: every RPC of ``inference.GRPCInferenceService``, served to
unchanged clients by the worker's own gRPC server (:class:`~xlaserve.frontend.grpc_server.GrpcServer`)
and answered by the workers behind it.

- **ModelInfer** is routed by model name (:class:`~xlaserve.gateway.router.Router`). The
  request's bytes are forwarded as they came, without decoding its tensors: only the
  ``model_name`` field is read (:func:`model_name_of`). No task per call: the server hands the
  request over from the client connection's reader, the reply comes back on the worker
  connection's reader. A client that resets its stream resets the worker's.
- **ModelReady**, **ModelMetadata**, **ModelConfig** go to a worker that has the model READY.
- **ServerLive** is the gateway's own; **ServerReady** is true when at least one worker is
  reachable and has a model READY; **ServerMetadata** comes from a reachable worker.
- **ModelStatistics** sums the replicas (:func:`merge_statistics`); **RepositoryIndex** merges
  the workers: a model is READY when one worker has it READY, and its ``reason`` names each
  worker's state (:func:`merge_index`).
- **RepositoryModelLoad/Unload**, the system (and CUDA) shared-memory Register/Unregister,
  **TraceSetting** and **LogSettings** reach every reachable worker; the first failure, naming
  its worker, fails the call. Shared-memory **Status** comes from one worker (they all hold the
  same registrations).
- **ModelStreamInfer**: each request of the stream is routed and forwarded like a ModelInfer; the
  answers come back in request order. A stream that ends early takes back its unanswered requests.

Requests in flight through the gateway are capped at ``max_concurrent_requests_per_worker`` x
workers (RESOURCE_EXHAUSTED beyond); each worker connection carries at most its
``max_concurrent_streams`` at once, the rest wait their turn in order.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from types import SimpleNamespace

import trio
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.errors import describe_exception
from xlaserve.config.access import LOOPBACK_NETWORKS, parse_network
from xlaserve.frontend.access import shm_peer_denial
from xlaserve.frontend.grpc_server import FramedReply
from xlaserve.gateway.router import Router
from xlaserve.tracing import CLIENT, MAX_ATTRIBUTE, MAX_ERROR, TRACEPARENT, RequestTrace, Tracing
from xlaserve.gateway.upstream import Reply, Upstream, UpstreamError, status_named
from xlaserve.wire import LENGTH_DELIMITED, TooManyFields, fields

log = logging.getLogger("xlaserve.gateway")

__all__ = ["GatewayService", "RawMessage", "merge_index", "merge_statistics", "model_name_of", "raise_first_failure"]

SERVICE = "/inference.GRPCInferenceService/"
LOOPBACK = tuple(parse_network(n) for n in LOOPBACK_NETWORKS)
INFER = SERVICE + "ModelInfer"
STREAM_INFER = SERVICE + "ModelStreamInfer"
# metadata the gateway sets itself on the worker's call, or that is about the client's connection
_HOP_BY_HOP = frozenset({"content-type", "te", "grpc-timeout", "grpc-encoding", "grpc-accept-encoding",
                         "user-agent", "host", "connection", "keep-alive", "transfer-encoding", "upgrade"})


def model_name_of(data: bytes) -> str:
    """The ``model_name`` (field 1) of a serialized ModelInferRequest, read without parsing the
    rest. Raises ValueError when the bytes are not a protobuf message or have no model name."""
    if len(data) > 2 and data[0] == 0x0A and data[1] < 0x80 and data[1] + 2 <= len(data):
        # the usual encoding: field 1 first, a name shorter than 128 bytes
        return bytes(data[2:2 + data[1]]).decode("utf-8")
    try:
        for number, wire, _, value, end in fields(data):
            if number == 1 and wire == LENGTH_DELIMITED:
                return bytes(data[value:end]).decode("utf-8")
    except TooManyFields:
        # a hostile flood of tiny fields: parsed in C rather than walked in Python
        try:
            name = pb.ModelInferRequest.FromString(data).model_name
        except Exception as exc:
            raise ValueError(str(exc)) from None
        if not name:
            raise ValueError("it has no model_name")
        return name
    raise ValueError("it has no model_name")


_SHM_KEY = b"shared_memory_region"


def _names_region(data: bytes) -> bool:
    """Whether a ModelInferRequest (whose bytes contain the parameter's name) really names a
    shared-memory region for an input or an output (parsed only then: rare and cheap)."""
    try:
        request = pb.ModelInferRequest.FromString(data)
    except Exception:
        return False        # the worker answers INVALID_ARGUMENT
    return any("shared_memory_region" in t.parameters for t in (*request.inputs, *request.outputs))


STREAM_WINDOW = 64      # ModelStreamInfer requests of one stream in flight through the gateway


class _Relay:
    """What :meth:`GatewayService.infer_now` needs of a call, for a ModelInfer made from a task
    (each request of a ModelStreamInfer): the task's stream's metadata, deadline and peer, and
    ``complete`` keeping the outcome. ``cancel`` takes the forward back when the stream ends
    before its answer is sent (the client reset it or went away), as a reset ModelInfer does:
    otherwise a client could open a stream, send a window of slow requests, reset it and open
    the next, keeping the workers busy and the gateway's in-flight cap full for nothing."""

    __slots__ = ("metadata", "deadline", "peer", "on_cancel", "outcome", "done", "finished", "request", "request_id")

    def __init__(self, stream, request: RawMessage) -> None:
        self.metadata, self.deadline, self.peer = stream.metadata, stream.deadline, stream.peer
        self.on_cancel = None
        self.outcome = None
        self.done = trio.Event()
        self.finished = False       # the stream is over: no retry on another worker
        self.request = request      # kept until the outcome, for the id an error answer echoes
        self.request_id = ""

    def complete(self, outcome) -> None:
        self.on_cancel = None
        if isinstance(outcome, GRPCError) and not self.finished:
            self.request_id = request_id_of(self.request.data)
        self.request = None
        self.outcome = outcome
        self.done.set()

    def cancel(self) -> None:
        self.finished = True
        on_cancel, self.on_cancel = self.on_cancel, None
        if on_cancel is not None:
            on_cancel()


def request_id_of(data: bytes) -> str:
    """The ``id`` of a serialized ModelInferRequest, or "" when the bytes are not one (only
    for an error's answer on a stream, so a whole parse is cheap enough)."""
    try:
        return pb.ModelInferRequest.FromString(data).id
    except Exception:
        return ""


async def _served_task_free(stream) -> None:
    """ModelInfer's entry in ``__mapping__()``, there for the request type it gives the transport
    and never called: the gateway's servers (:class:`~xlaserve.frontend.grpc_server.GrpcServer`,
    :class:`~xlaserve.frontend.rest_api.RestApi`) take the task-free entry,
    :meth:`GatewayService.infer_now`, from ``__fast_unary__()``."""
    raise GRPCError(Status.INTERNAL, "ModelInfer is served through the task-free entry (__fast_unary__: "
                                     "infer_now); this server called the grpclib-shaped handler instead")


class RawMessage:
    """A request or reply kept as its serialized bytes (the gateway forwards, it does not parse)."""

    __slots__ = ("data",)
    DESCRIPTOR = SimpleNamespace(full_name="inference request")

    def __init__(self, data: bytes) -> None:
        self.data = data

    @classmethod
    def FromString(cls, data) -> "RawMessage":
        return cls(bytes(data))

    def SerializeToString(self) -> bytes:
        return self.data


def merge_statistics(replies: Mapping[str, pb.ModelStatisticsResponse]) -> pb.ModelStatisticsResponse:
    """One ModelStatisticsResponse for the workers' ``replies``: per (model, version), counts and
    durations summed, ``last_inference`` the latest, batch statistics summed per batch size."""
    merged: dict[tuple[str, str], pb.ModelStatistics] = {}
    for reply in replies.values():
        for stats in reply.model_stats:
            key = (stats.name, stats.version)
            if key not in merged:
                merged[key] = pb.ModelStatistics()
                merged[key].CopyFrom(stats)
                continue
            into = merged[key]
            into.last_inference = max(into.last_inference, stats.last_inference)
            into.inference_count += stats.inference_count
            into.execution_count += stats.execution_count
            _add_durations(into.inference_stats, stats.inference_stats)
            by_size = {b.batch_size: b for b in into.batch_stats}
            for batch in stats.batch_stats:
                if batch.batch_size in by_size:
                    _add_durations(by_size[batch.batch_size], batch)
                else:
                    into.batch_stats.add().CopyFrom(batch)
            for name, response in stats.response_stats.items():
                _add_durations(into.response_stats[name], response)
    out = pb.ModelStatisticsResponse()
    for key in sorted(merged):
        out.model_stats.add().CopyFrom(merged[key])
    return out


def _add_durations(into, other) -> None:
    """Add every StatisticDuration field of ``other`` into ``into`` (same message type)."""
    for field, value in other.ListFields():
        if field.message_type is not None and field.message_type.name == "StatisticDuration":
            target = getattr(into, field.name)
            target.count += value.count
            target.ns += value.ns


def merge_index(replies: Mapping[str, pb.RepositoryIndexResponse], down: Mapping[str, str]) -> pb.RepositoryIndexResponse:
    """One RepositoryIndexResponse for the workers' ``replies`` (worker name -> reply; ``down``:
    unreachable workers and why). A model is READY if a worker has it READY (at the highest
    version READY anywhere), else the state of the first worker that lists it; its reason names
    every worker's state when the workers disagree or a worker is down."""
    seen: dict[str, dict[str, pb.RepositoryIndexResponse.ModelIndex]] = {}
    for worker, reply in replies.items():
        for model in reply.models:
            seen.setdefault(model.name, {})[worker] = model
    out = pb.RepositoryIndexResponse()
    for name in sorted(seen):
        views = seen[name]
        ready = [m for m in views.values() if m.state == "READY"]
        first = next(iter(views.values()))
        entry = out.models.add(name=name)
        if ready:
            best = max(ready, key=lambda m: int(m.version) if m.version.isdigit() else 0)
            entry.state, entry.version = "READY", best.version
        else:
            entry.state, entry.version = first.state, first.version
        states = {m.state for m in views.values()}
        if len(states) > 1 or len(views) < len(replies) or down or any(m.reason for m in views.values()):
            parts = [f"{w}: {m.state}" + (f" v{m.version}" if m.version else "") + (f" ({m.reason})" if m.reason else "")
                     for w, m in views.items()]
            parts += [f"{w}: not in its repository" for w in replies if w not in views]
            parts += [f"{w}: unreachable ({why})" for w, why in down.items()]
            entry.reason = "; ".join(parts)
    return out


class GatewayService:
    """``inference.GRPCInferenceService`` over ``upstreams`` (worker name -> :class:`Upstream`),
    routed by ``router``. The requests in flight through the gateway are capped at
    ``max_per_worker`` x workers (0: uncapped)."""

    def __init__(self, upstreams: Mapping[str, Upstream], router: Router, *, max_per_worker: int = 0,
                 shm_peers: tuple = LOOPBACK, tracing: Tracing | None = None) -> None:
        self.upstreams = upstreams          # shared with the gateway, which adds and removes workers
        self.router = router
        self.max_per_worker = max_per_worker
        #: the workers see the gateway as the peer: the client's own address is checked here
        self.shm_peers = shm_peers
        self.in_flight = 0
        self.routed: dict[tuple[str, str], int] = {}        # (worker, model) -> requests routed
        self.errors: dict[str, int] = {}                    # cause -> requests failed at the gateway
        #: each forward's span, its traceparent passed on to the worker; None: tracing off
        self.tracing = tracing

    # ---- grpclib-shaped service ------------------------------------------------------------
    def __mapping__(self) -> dict[str, Handler]:
        unary = Cardinality.UNARY_UNARY
        forward_all = self._forward_all
        table: dict[str, tuple[Callable, type, type]] = {
            "ServerLive": (self._server_live, pb.ServerLiveRequest, pb.ServerLiveResponse),
            "ServerReady": (self._server_ready, pb.ServerReadyRequest, pb.ServerReadyResponse),
            "ModelReady": (self._model_ready, pb.ModelReadyRequest, pb.ModelReadyResponse),
            "ServerMetadata": (self._to_any("ServerMetadata"), RawMessage, RawMessage),
            "ModelMetadata": (self._to_replica("ModelMetadata", pb.ModelMetadataRequest), RawMessage, RawMessage),
            "ModelConfig": (self._to_replica("ModelConfig", pb.ModelConfigRequest), RawMessage, RawMessage),
            "ModelInfer": (_served_task_free, RawMessage, RawMessage),
            "ModelStatistics": (self._statistics, RawMessage, pb.ModelStatisticsResponse),
            "RepositoryIndex": (self._index, RawMessage, pb.RepositoryIndexResponse),
            "RepositoryModelLoad": (forward_all("RepositoryModelLoad"), RawMessage, RawMessage),
            "RepositoryModelUnload": (forward_all("RepositoryModelUnload"), RawMessage, RawMessage),
            "SystemSharedMemoryStatus": (self._to_any("SystemSharedMemoryStatus"), RawMessage, RawMessage),
            "SystemSharedMemoryRegister": (forward_all("SystemSharedMemoryRegister"), RawMessage, RawMessage),
            "SystemSharedMemoryUnregister": (forward_all("SystemSharedMemoryUnregister"), RawMessage, RawMessage),
            "CudaSharedMemoryStatus": (self._to_any("CudaSharedMemoryStatus"), RawMessage, RawMessage),
            "CudaSharedMemoryRegister": (forward_all("CudaSharedMemoryRegister"), RawMessage, RawMessage),
            "CudaSharedMemoryUnregister": (forward_all("CudaSharedMemoryUnregister"), RawMessage, RawMessage),
            "TraceSetting": (forward_all("TraceSetting"), RawMessage, RawMessage),
            "LogSettings": (forward_all("LogSettings"), RawMessage, RawMessage),
        }
        mapping = {SERVICE + name: Handler(fn, unary, req, rep) for name, (fn, req, rep) in table.items()}
        mapping[STREAM_INFER] = Handler(self._stream_infer, Cardinality.STREAM_STREAM, RawMessage, RawMessage)
        return mapping

    def __fast_unary__(self) -> dict:
        return {INFER: self.infer_now}

    # ---- ModelInfer --------------------------------------------------------------------------
    def infer_now(self, call, request: RawMessage) -> None:
        """Route and forward one ModelInfer (the server's task-free entry point)."""
        try:
            model = model_name_of(request.data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, f"the request is not a valid inference.ModelInferRequest "
                                                     f"message: {exc}") from None
        if _SHM_KEY in request.data and _names_region(request.data):
            self._check_shm_peer("ModelInfer", call)
        cap = self.max_per_worker * len(self.upstreams)
        if self.max_per_worker and self.in_flight >= cap:
            self._count("in_flight_limit")
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"the gateway has {self.in_flight} requests in flight; the "
                                                       f"limit is {cap} (grpc.max_concurrent_requests_per_worker "
                                                       f"{self.max_per_worker} x {len(self.upstreams)} workers); "
                                                       "retry later")
        self._send(call, request, model, self._pick(model), retries=1)

    def _pick(self, model: str) -> str:
        """A worker for ``model`` whose connection is up; GRPCError when there is none."""
        worker = self.router.pick(model)
        while worker is not None and not self.upstreams[worker].up:
            self.router.worker_down(worker)      # lost since discovery last spoke: route around it now
            worker = self.router.pick(model)
        if worker is None:
            self._count("no_replica")
            why = self.router.why_not(model)
            raise GRPCError(Status.NOT_FOUND if "not served by any worker" in why else Status.UNAVAILABLE, why)
        return worker

    def _send(self, call, request: RawMessage, model: str, worker: str, retries: int) -> None:
        upstream = self.upstreams[worker]
        self.in_flight += 1
        key = (worker, model)
        self.routed[key] = self.routed.get(key, 0) + 1
        router = self.router
        counted = router.counts_calls
        if counted:
            router.started(worker, model)

        answered = False
        metadata = _forwarded(call.metadata)
        trace = None
        if self.tracing is not None:
            trace, metadata = _traced(self.tracing, call.metadata, metadata, model, worker)

        def done(outcome: Reply | UpstreamError) -> None:
            nonlocal answered
            if answered:            # given back once: an upstream that reported twice is a bug, logged
                log.error("worker %s: a ModelInfer of model %s was reported done twice; the second is dropped",
                          worker, model)
                return
            answered = True
            self.in_flight -= 1
            if counted:
                router.finished(worker, model)
            if trace is not None:
                _finish_forward(trace, outcome)
            try:
                if retries and isinstance(outcome, UpstreamError) and outcome.unprocessed \
                        and not getattr(call, "finished", False):
                    # the worker did not run it (refused, stopping, never sent): another one may
                    self._count("retried")
                    try:
                        self._send(call, request, model, self._pick(model), retries - 1)
                        return
                    except GRPCError as exc:
                        call.complete(exc)
                        return
                reply = self._outcome(outcome, worker, framed=True)
            except Exception as exc:        # a bug: this call's answer, never the connection's
                log.exception("worker %s: answering a ModelInfer of model %s failed", worker, model)
                reply = GRPCError(Status.INTERNAL, f"the gateway failed to relay the answer of worker {worker}: "
                                                   f"{type(exc).__name__}: {describe_exception(exc)}")
            call.complete(reply)
        try:
            handle = upstream.start(INFER, request.data, done, metadata=metadata,
                                    timeout=_time_left(call, upstream.request_timeout))
        except Exception as exc:
            log.exception("worker %s: forwarding a ModelInfer of model %s failed", worker, model)
            done(UpstreamError(Status.INTERNAL, f"the gateway failed to forward the request to worker {worker}: "
                                                f"{type(exc).__name__}: {describe_exception(exc)}"))
            return
        if not handle.done:
            call.on_cancel = lambda: upstream.abort(handle)

    def _outcome(self, outcome: Reply | UpstreamError, worker: str, framed: bool = False):
        """What the client gets: the reply's message (a :class:`RawMessage`; with ``framed``, a
        :class:`FramedReply` when the body is one plain message), or the error (the worker's
        status and message as they are; the gateway's own, naming the worker)."""
        if isinstance(outcome, UpstreamError):
            self._count("unavailable" if outcome.status is Status.UNAVAILABLE else
                        "timeout" if outcome.status is Status.DEADLINE_EXCEEDED else "cancelled")
            return GRPCError(outcome.status, outcome.message)
        if outcome.status != 0:
            return GRPCError(status_named(outcome.status), outcome.message)
        body = outcome.body
        if framed and len(body) >= 5 and body[0] == 0 and int.from_bytes(body[1:5], "big") == len(body) - 5:
            return FramedReply(body)        # one uncompressed message: relayed as it came
        messages = outcome.messages()
        if len(messages) != 1:
            self._count("bad_reply")
            return GRPCError(Status.INTERNAL, f"worker {worker} answered a unary call with {len(messages)} messages")
        return RawMessage(messages[0])

    def _count(self, cause: str) -> None:
        self.errors[cause] = self.errors.get(cause, 0) + 1

    # ---- ModelStreamInfer ------------------------------------------------------------------
    async def _stream_infer(self, stream) -> None:
        """Each request of the stream goes to the worker its model routes to, as a ModelInfer, as
        soon as it arrives (at most STREAM_WINDOW of a stream in flight); replies come back in
        request order, wrapped as ModelStreamInferResponse (an error becomes the response's
        error_message, with the request's id in its infer_response, as Triton's streaming does).
        When the stream ends early (the client reset it, the connection went away), the requests
        not yet answered are taken back from the workers."""
        send, receive = trio.open_memory_channel[_Relay](STREAM_WINDOW)
        unanswered: deque[_Relay] = deque()     # started, their answer not yet sent, in order

        async def reply_in_order() -> None:
            async with receive:
                async for relay in receive:
                    await relay.done.wait()
                    outcome = relay.outcome
                    response = pb.ModelStreamInferResponse()
                    if isinstance(outcome, GRPCError):
                        response.error_message = outcome.message or outcome.status.name
                        response.infer_response.id = relay.request_id
                    else:
                        response.infer_response.ParseFromString(outcome.SerializeToString())
                    try:
                        await stream.send_message(response)
                    except GRPCError as exc:
                        if exc.status is not Status.RESOURCE_EXHAUSTED:
                            raise
                        # past max_send_msg_bytes (a worker's reply just under it, wrapped): that
                        # request's answer is the error, as any other is; the stream goes on
                        failed = pb.ModelStreamInferResponse(error_message=exc.message or exc.status.name)
                        failed.infer_response.id = response.infer_response.id
                        await stream.send_message(failed)
                    unanswered.popleft()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reply_in_order)
                async with send:
                    while (request := await stream.recv_message()) is not None:
                        relay = _Relay(stream, request)
                        await send.send(relay)           # waits while STREAM_WINDOW are in flight
                        unanswered.append(relay)
                        self._start_relay(relay, request)
        finally:
            for relay in unanswered:
                try:
                    relay.cancel()
                except Exception:   # a bug in taking one back must not keep the others running
                    log.exception("taking back a ModelStreamInfer request failed")

    def _start_relay(self, relay: "_Relay", request: RawMessage) -> None:
        try:
            self.infer_now(relay, request)
        except GRPCError as exc:        # refused before it was sent: the outcome at once
            relay.complete(exc)

    # ---- health and metadata ---------------------------------------------------------------
    async def _server_live(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(pb.ServerLiveResponse(live=True))

    def ready(self) -> bool:
        return bool(self.router.ready_models())

    async def _server_ready(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(pb.ServerReadyResponse(ready=self.ready()))

    async def _model_ready(self, stream) -> None:
        request = await stream.recv_message()
        workers = self.router.replicas(request.name)
        ready = False
        if workers:
            if not request.version:
                ready = True
            else:
                views = self.router.models().get(request.name, {})
                ready = any(str(views[w].version) == request.version for w in workers if w in views)
        await stream.send_message(pb.ModelReadyResponse(ready=ready))

    def _to_any(self, method: str):
        """A handler that forwards the call to the first reachable worker."""
        async def handler(stream) -> None:
            request = await stream.recv_message()
            if "SharedMemory" in method:
                self._check_shm_peer(method, stream)
            worker = next((w for w in self.router.workers if self.upstreams[w].up), None)
            if worker is None:
                raise GRPCError(Status.UNAVAILABLE, f"no worker is reachable: {self._down_text()}")
            await stream.send_message(await self._call(worker, SERVICE + method, request, stream))
        return handler

    def _to_replica(self, method: str, request_type):
        """A handler that forwards the call to a worker with the request's model READY."""
        async def handler(stream) -> None:
            request = await stream.recv_message()
            name = _parsed(request_type, request).name
            worker = self.router.pick(name)
            if worker is None:
                why = self.router.why_not(name)
                raise GRPCError(Status.NOT_FOUND if "not served by any worker" in why else Status.UNAVAILABLE, why)
            await stream.send_message(await self._call(worker, SERVICE + method, request, stream))
        return handler

    def _check_shm_peer(self, rpc: str, call) -> None:
        denial = shm_peer_denial(rpc, getattr(call, "peer", None), self.shm_peers)
        if denial is not None:
            self._count("shm_peer")
            raise GRPCError(Status.PERMISSION_DENIED, denial.replace("endpoints.client_shm_peers",
                                                                     "the gateway's grpc.client_shm_peers"))

    def _forward_all(self, method: str):
        """A handler that forwards the call to every reachable worker; the first worker's reply
        answers it, and the first failure (naming its worker) fails it."""
        async def handler(stream) -> None:
            request = await stream.recv_message()
            if "SharedMemory" in method:
                self._check_shm_peer(method, stream)
            replies = await self._gather(SERVICE + method, request, stream)
            if method == "SystemSharedMemoryRegister":
                error = await self._undo_partial_registration(request, replies, stream)
                if error is not None:
                    raise error
            raise_first_failure(replies)
            await stream.send_message(next(iter(replies.values())))
        return handler

    async def _undo_partial_registration(self, request: RawMessage, replies: Mapping[str, object],
                                         stream) -> GRPCError | None:
        """When some workers refused a region and others took it: unregister it from those that
        took it, and the call's error (None otherwise). A failed registration then leaves the
        region registered nowhere, as on one worker; before, a client that retried was told
        'already registered' by the workers that had taken it, until it thought to unregister
        first."""
        refused = [w for w, r in replies.items() if isinstance(r, GRPCError)]
        took = [w for w, r in replies.items() if not isinstance(r, GRPCError)]
        if not refused or not took:
            return None
        name = _parsed(pb.SystemSharedMemoryRegisterRequest, request).name
        undo = RawMessage(pb.SystemSharedMemoryUnregisterRequest(name=name).SerializeToString())
        undone = await self._call_each(took, SERVICE + "SystemSharedMemoryUnregister", undo, stream)
        kept = [w for w in took if isinstance(undone[w], GRPCError)]
        first = refused[0]
        error = replies[first]
        others = f" ({len(refused) - 1} other worker(s) failed too)" if len(refused) > 1 else ""
        gone = [w for w in took if w not in kept]
        note = f"; undone on {', '.join(gone)}, where it had succeeded" if gone else ""
        if kept:
            note += f"; still registered on {', '.join(kept)}: unregistering it there failed"
        return GRPCError(error.status, f"{first}: {error.message}{others}{note}")

    async def _statistics(self, stream) -> None:
        request = await stream.recv_message()
        replies = await self._gather(SERVICE + "ModelStatistics", request, stream)
        parsed = {}
        for worker, reply in replies.items():
            if isinstance(reply, GRPCError):
                if reply.status is Status.NOT_FOUND:
                    continue          # a model this worker does not have: the others may
                raise GRPCError(reply.status, f"{worker}: {reply.message}")
            parsed[worker] = pb.ModelStatisticsResponse.FromString(reply.data)
        if not parsed:
            name = _parsed(pb.ModelStatisticsRequest, request).name
            raise GRPCError(Status.NOT_FOUND, self.router.why_not(name) if name else "no worker answered")
        await stream.send_message(merge_statistics(parsed))

    async def _index(self, stream) -> None:
        request = await stream.recv_message()
        replies = await self._gather(SERVICE + "RepositoryIndex", request, stream)
        parsed, down = {}, self._down()
        for worker, reply in replies.items():
            if isinstance(reply, GRPCError):
                down[worker] = reply.message
            else:
                parsed[worker] = pb.RepositoryIndexResponse.FromString(reply.data)
        await stream.send_message(merge_index(parsed, down))

    # ---- helpers -----------------------------------------------------------------------------
    def _down(self) -> dict[str, str]:
        return {w: u.last_error or "not connected" for w, u in self.upstreams.items() if not u.up}

    def _down_text(self) -> str:
        return "; ".join(f"{w}: {why}" for w, why in self._down().items()) or "no workers"

    async def _call(self, worker: str, path: str, request: RawMessage, stream) -> RawMessage:
        outcome = await self._raw_call(worker, path, request, stream)
        if isinstance(outcome, GRPCError):
            raise outcome
        return outcome

    async def _raw_call(self, worker: str, path: str, request: RawMessage, stream):
        upstream = self.upstreams[worker]
        outcome = await upstream.request(path, request.data, metadata=_forwarded(stream.metadata),
                                         timeout=_time_left(stream, upstream.request_timeout))
        return self._outcome(outcome, worker)

    async def _gather(self, path: str, request: RawMessage, stream) -> dict[str, object]:
        """The call on every reachable worker at once: worker -> reply or GRPCError. Fails
        UNAVAILABLE when none is reachable. Under ``lpt_packing`` a RepositoryModelLoad of a
        model the placement has placed goes to the workers it is placed on only."""
        workers = [w for w in self.router.workers if self.upstreams[w].up]
        if path == SERVICE + "RepositoryModelLoad" and self.router.mode == "lpt_packing":
            placed = self.router.placed(_parsed(pb.RepositoryModelLoadRequest, request).model_name)
            workers = [w for w in workers if w in placed] or workers
        if not workers:
            raise GRPCError(Status.UNAVAILABLE, f"no worker is reachable: {self._down_text()}")
        return await self._call_each(workers, path, request, stream)

    async def _call_each(self, workers: list[str], path: str, request: RawMessage, stream) -> dict[str, object]:
        """The call on each of ``workers`` at once: worker -> reply or GRPCError, in their order."""
        replies: dict[str, object] = {}

        async def one(worker: str) -> None:
            replies[worker] = await self._raw_call(worker, path, request, stream)
        async with trio.open_nursery() as nursery:
            for worker in workers:
                nursery.start_soon(one, worker)
        return {w: replies[w] for w in workers}


def raise_first_failure(replies: Mapping[str, object]) -> None:
    """For a call sent to several workers (worker -> reply or GRPCError, in order): the first
    failure as the call's GRPCError, naming its worker, how many others failed and where the
    call succeeded; nothing when every worker answered."""
    failures = [(w, r) for w, r in replies.items() if isinstance(r, GRPCError)]
    if failures:
        worker, error = failures[0]
        others = f" ({len(failures) - 1} other worker(s) failed too)" if len(failures) > 1 else ""
        done = [w for w, r in replies.items() if not isinstance(r, GRPCError)]
        applied = f"; it succeeded on {', '.join(done)}" if done else ""
        raise GRPCError(error.status, f"{worker}: {error.message}{others}{applied}")


_FORWARDED: dict[int, tuple] = {}


def _parsed(message_type, request: RawMessage):
    """``request``'s bytes as ``message_type``; INVALID_ARGUMENT naming the type when they are not
    one (the worker would say the same; the gateway needs a field first)."""
    try:
        return message_type.FromString(request.data)
    except Exception as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, f"the request is not a valid {message_type.DESCRIPTOR.full_name} "
                                                 f"message: {exc}") from None


def _forwarded(metadata) -> tuple[tuple[str, str], ...]:
    """The client's metadata the worker gets (not the hop-by-hop fields). The server hands every
    call of a repeated header block the same read-only mapping, so the answer is kept per
    mapping (with the mapping, so that its id is not reused while it is kept)."""
    if not metadata:
        return ()
    kept = _FORWARDED.get(id(metadata))
    if kept is not None and kept[0] is metadata:
        return kept[1]
    forwarded = tuple((k, v) for k, v in metadata.items() if k not in _HOP_BY_HOP and not k.startswith(":"))
    if len(_FORWARDED) >= 1024:
        _FORWARDED.clear()
    _FORWARDED[id(metadata)] = (metadata, forwarded)
    return forwarded


def _traced(tracing: Tracing, incoming, forwarded: tuple[tuple[str, str], ...], model: str,
            worker: str) -> tuple[RequestTrace | None, tuple[tuple[str, str], ...]]:
    """The span of one forward (None when it is not sampled) and the metadata the worker gets:
    its ``traceparent`` names the forward's span, so the worker's spans are its children; an
    unsampled request passes on a ``traceparent`` that says so, and the worker follows."""
    trace = tracing.start("xlaserve.gateway.forward", incoming, time.perf_counter_ns(),
                          {"rpc.system": "grpc", "rpc.method": "ModelInfer", "xlaserve.model": model[:MAX_ATTRIBUTE],
                           "xlaserve.worker": worker}, kind=CLIENT)
    traceparent = trace.traceparent() if trace is not None else tracing.unsampled_traceparent(incoming)
    if traceparent is None:         # unsampled by the caller: its traceparent goes on unchanged
        return None, forwarded
    return trace, tuple(p for p in forwarded if p[0] != TRACEPARENT) + ((TRACEPARENT, traceparent),)


def _finish_forward(trace: RequestTrace, outcome) -> None:
    if isinstance(outcome, UpstreamError):
        trace.finish(f"{outcome.status.name}: {outcome.message}"[:MAX_ERROR],
                     {"rpc.grpc.status_code": outcome.status.value})
    elif outcome.status != 0:
        trace.finish(f"{status_named(outcome.status).name}: {outcome.message}"[:MAX_ERROR],
                     {"rpc.grpc.status_code": outcome.status})
    else:
        trace.finish(None, {"rpc.grpc.status_code": 0})


def _time_left(call, request_timeout: float) -> float | None:
    """The worker's timeout for a client's call: None when the client set no deadline (the
    gateway's request timeout then applies at the gateway alone), else what is left of it,
    at most the request timeout."""
    deadline = getattr(call, "deadline", None)
    if deadline is None:
        return None
    return min(max(deadline.time_remaining(), 0.001), request_timeout)
