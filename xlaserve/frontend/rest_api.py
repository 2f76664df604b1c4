"""The Open Inference Protocol's REST API (KServe V2 over HTTP, with Triton's extensions), served
by the KServe gRPC service behind it.

Each route builds the gRPC request message, calls the service's own handler for that RPC (the
worker's :class:`~xlaserve.frontend.kserve.KServeService` or the gateway's service: whatever
``__mapping__()`` serves on gRPC) through a one-message exchange, and writes the reply as JSON.
So a REST inference runs exactly the path a gRPC ModelInfer made from a task runs: admission,
the ``timeout`` parameter, coalescing, the scheduler, shared memory, hooks, meta models, and on
the gateway the routing to a worker. ``endpoints.restricted`` applies per route as per RPC (the
header travels as an HTTP header), and a gRPC status becomes the HTTP status Triton answers
with (:data:`HTTP_STATUS`), the message in ``{"error": "..."}``.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote

import orjson
import trio
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve.errors import InvalidArgument, XlaserveError
from xlaserve.frontend.access import AccessPolicy
from xlaserve.frontend.http1 import HttpRequest, HttpResponse, error_json
from xlaserve.frontend.rest_tensors import (HEADER_LENGTH, infer_request, infer_response, loads_object,
                                            mapping_json)
from xlaserve.frontend.statuses import status_of

SERVICE = "/inference.GRPCInferenceService/"

#: the HTTP status of each gRPC status (Triton's choices where it has one)
HTTP_STATUS: Mapping[Status, int] = {
    Status.INVALID_ARGUMENT: 400, Status.FAILED_PRECONDITION: 400, Status.OUT_OF_RANGE: 400,
    Status.NOT_FOUND: 404, Status.ALREADY_EXISTS: 409, Status.PERMISSION_DENIED: 403,
    Status.UNAUTHENTICATED: 401, Status.RESOURCE_EXHAUSTED: 429, Status.UNAVAILABLE: 503,
    Status.DEADLINE_EXCEEDED: 504, Status.UNIMPLEMENTED: 501, Status.CANCELLED: 499,
}

# request headers that are about this HTTP exchange, never passed to the service as metadata
_HTTP_ONLY = frozenset({"host", "connection", "keep-alive", "content-length", "content-type", "content-encoding",
                        "accept", "accept-encoding", "transfer-encoding", "expect", "te", "upgrade", "user-agent",
                        "proxy-connection", HEADER_LENGTH})

_MODEL = r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
_REGION = r"(?:/region/(?P<region>[^/]+))?"
# inference first: it is nearly every request, and no other route's pattern matches its paths
_ROUTES: list[tuple[str, re.Pattern, str]] = [(method, re.compile(pattern + r"\Z"), name) for method, pattern, name in (
    ("POST", _MODEL + r"/infer", "infer"),
    ("GET", r"/v2/health/live", "live"),
    ("GET", r"/v2/health/ready", "ready"),
    ("GET", r"/v2", "server_metadata"),
    # before model_metadata: /v2/models/stats is every model's statistics (Triton's route, which
    # tritonclient's get_inference_statistics() asks), not the metadata of a model named 'stats'
    ("GET", r"/v2/models(?:/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?)?/stats", "statistics"),
    ("GET", _MODEL, "model_metadata"),
    ("GET", _MODEL + r"/ready", "model_ready"),
    ("GET", _MODEL + r"/config", "model_config"),
    ("POST", r"/v2/repository/index", "index"),
    ("POST", r"/v2/repository/models/(?P<model>[^/]+)/load", "load"),
    ("POST", r"/v2/repository/models/(?P<model>[^/]+)/unload", "unload"),
    ("GET", r"/v2/systemsharedmemory" + _REGION + r"/status", "shm_status"),
    ("POST", r"/v2/systemsharedmemory/region/(?P<region>[^/]+)/register", "shm_register"),
    ("POST", r"/v2/systemsharedmemory" + _REGION + r"/unregister", "shm_unregister"),
    ("GET", r"/v2/cudasharedmemory" + _REGION + r"/status", "cuda_status"),
    ("POST", r"/v2/cudasharedmemory/region/(?P<region>[^/]+)/register", "cuda_register"),
    ("POST", r"/v2/cudasharedmemory" + _REGION + r"/unregister", "cuda_unregister"),
)]


class _Exchange:
    """What a grpclib-shaped handler sees of one call: one request message, one reply, the
    caller's metadata and address, no gRPC deadline (a REST request's is its ``timeout``
    parameter)."""

    __slots__ = ("_request", "reply", "metadata", "peer", "deadline")

    def __init__(self, request, metadata: Mapping[str, str], peer) -> None:
        self._request = request
        self.reply = None
        self.metadata = metadata
        self.peer = peer
        self.deadline = None

    async def recv_message(self):
        request, self._request = self._request, None
        return request

    async def send_message(self, message) -> None:
        self.reply = message


class _Call:
    """What a service's task-free ModelInfer entry (``__fast_unary__``: the worker's and the
    gateway's ``infer_now``) needs of a call: the caller's metadata and address, ``on_cancel``
    (set by the service: how to abort the request if the client goes away), and ``complete``,
    which keeps the one outcome and wakes the task waiting for it (``waiter``: parked by
    :meth:`RestApi._call_fast` without an Event of its own)."""

    __slots__ = ("metadata", "peer", "deadline", "on_cancel", "outcome", "done", "waiter", "raw_outputs")

    def __init__(self, metadata: Mapping[str, str], peer, raw_outputs: frozenset[str] | None = None) -> None:
        self.metadata = metadata
        self.peer = peer
        self.deadline = None
        #: the outputs the REST reply carries as binary data (None: all); the others go as JSON
        self.raw_outputs = raw_outputs
        self.on_cancel = None
        self.outcome = None
        self.done = False
        self.waiter: trio.lowlevel.Task | None = None

    def complete(self, outcome) -> None:
        if not self.done:
            self.outcome = outcome
            self.done = True
            waiter = self.waiter
            if waiter is not None:
                self.waiter = None
                trio.lowlevel.reschedule(waiter)


#: the JSON a REST request may carry (the inference header, or a whole JSON body): parsing it
#: holds the worker's Trio thread and about 13 times its size in memory
MAX_JSON_BYTES = 32 * 1024 * 1024


def refuse_load_overrides(model: str, parameters: Iterable[str]) -> None:
    """Triton's RepositoryModelLoad overrides (``config``, ``file:<path>``) are refused, over REST
    and gRPC alike (:class:`~xlaserve.frontend.kserve.KServeService`): loaded without them, the
    model would not be the one the client asked for, and nothing would tell it so."""
    overrides = sorted(k for k in parameters if k == "config" or k.startswith("file:"))
    if overrides:
        raise InvalidArgument(f"cannot load '{model}' with {', '.join(repr(k) for k in overrides)}: xlaserve does "
                              "not override a model's configuration at load time (its bundle's manifest and "
                              "compiled batch sizes fix it); load it without them")


def _json(doc: object, status: int = 200) -> HttpResponse:
    return HttpResponse(status, orjson.dumps(doc))


class RestApi:
    """The REST routes over ``service`` (a grpclib-shaped KServe service), with ``access``
    (``endpoints.restricted``) applied per route."""

    def __init__(self, service, access: AccessPolicy = AccessPolicy(), *, max_send_bytes: int | None = None,
                 send_limit_key: str = "endpoints.max_send_msg_bytes", max_json_bytes: int = MAX_JSON_BYTES,
                 json_limit_key: str = "endpoints.rest_max_json_bytes") -> None:
        self._handlers = service.__mapping__()
        self._max_json = max_json_bytes
        self._json_key = json_limit_key
        fast = getattr(service, "__fast_unary__", None)
        self._fast = fast() if fast is not None else {}
        self._max_send = max_send_bytes
        self._send_key = send_limit_key
        self._rules = access.for_methods(p for p in self._handlers if p.startswith(SERVICE))
        #: the methods whose request type also takes a parsed message (``accepts_parsed``: the
        #: worker's ModelInfer), which :meth:`_call` then passes as it is
        self._take_parsed = frozenset(path for path, handler in self._handlers.items()
                                      if getattr(handler.request_type, "accepts_parsed", False))
        # how ModelInfer takes a REST request's binary tensors kept as views into its body
        # (:attr:`RestInfer.raw`): the worker's request type wraps them (``parsed``: no copy), else None
        # (the gateway: they are copied into the message)
        infer = self._handlers.get(SERVICE + "ModelInfer")
        infer_type = infer.request_type if infer is not None else None
        self._infer_parsed = infer_type.parsed if getattr(infer_type, "accepts_parsed", False) else None

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        path = request.path
        allowed = []
        for method, pattern, name in _ROUTES:
            match = pattern.match(path)
            if match is None:
                continue
            if method != request.method and not (method == "GET" and request.method == "HEAD"):
                allowed.append(method)
                continue
            args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
            if name != "infer" and len(request.body) > self._max_json:     # (infer: its JSON part, below)
                return self._too_much_json(len(request.body), "the request")
            try:
                return await getattr(self, "_" + name)(request, **args)
            except GRPCError as exc:
                return self._error(HTTP_STATUS.get(exc.status, 500), exc.message or exc.status.name)
            except XlaserveError as exc:
                status, message = status_of(exc)
                return self._error(HTTP_STATUS.get(status, 500), message)
        if allowed:
            return HttpResponse(405, error_json(f"{request.method} is not allowed on {path}; use "
                                                f"{' or '.join(sorted(set(allowed)))}"),
                                headers=(("allow", ", ".join(sorted(set(allowed)))),))
        return self._error(404, f"no such endpoint: {request.method} {path} (the Open Inference Protocol's REST "
                                "endpoints are under /v2)")

    @staticmethod
    def _error(status: int, message: str) -> HttpResponse:
        return HttpResponse(status, error_json(message))

    def _too_much_json(self, size: int, what: str) -> HttpResponse:
        """413 for JSON past the limit, before it is parsed: a parse holds the Trio thread about
        17 ms a megabyte and takes about 13 times the JSON's size in memory (a 64 MB body of
        numbers: 1.1 s and 860 MB)."""
        return self._error(413, f"{what}'s JSON is {size} bytes, the limit ({self._json_key}) is {self._max_json}; "
                                "send large tensors as binary data (Inference-Header-Content-Length) or through "
                                "shared memory")

    async def _call(self, rpc: str, message, request: HttpRequest, reply_type,
                    raw_outputs: frozenset[str] | None = None):
        """Run the service's handler of ``rpc`` on ``message``; its reply as ``reply_type``.
        ``raw_outputs``: the outputs the REST reply carries as binary data (None: all)."""
        path = SERVICE + rpc
        metadata = {k: v for k, v in request.headers.items() if k not in _HTTP_ONLY}
        rule = self._rules.get(path)
        if rule is not None and (denial := rule.denial(metadata)) is not None:
            raise GRPCError(Status.PERMISSION_DENIED, denial)
        handler = self._handlers[path]
        if handler.request_type is not type(message) and path not in self._take_parsed:
            message = handler.request_type(message.SerializeToString())    # the gateway's raw bytes
        fast = self._fast.get(path)
        if fast is not None:
            reply = await self._call_fast(fast, message, metadata, request.peer, raw_outputs)
        else:
            exchange = _Exchange(message, metadata, request.peer)
            await handler.func(exchange)
            reply = exchange.reply
        if isinstance(reply, reply_type):
            return reply
        data = reply.data if hasattr(reply, "data") else bytes(reply.message)
        return reply_type.FromString(data)

    @staticmethod
    async def _call_fast(entry, message, metadata: Mapping[str, str], peer,
                         raw_outputs: frozenset[str] | None = None):
        """A call through the service's task-free entry; if this task is cancelled (the HTTP
        client went away) the request is aborted as a gRPC client's reset stream aborts it: it
        leaves its queue if it is still queued."""
        call = _Call(metadata, peer, raw_outputs)
        entry(call, message)            # a refusal before it is queued raises here
        if call.done:
            await trio.lowlevel.checkpoint()
        else:
            call.waiter = trio.lowlevel.current_task()

            def abort(_) -> trio.lowlevel.Abort:
                call.waiter = None
                return trio.lowlevel.Abort.SUCCEEDED
            try:
                await trio.lowlevel.wait_task_rescheduled(abort)
            except trio.Cancelled:
                if not call.done and call.on_cancel is not None:
                    call.on_cancel()
                raise
        outcome = call.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    # ---- health and metadata ------------------------------------------------------------------
    async def _live(self, request):
        reply = await self._call("ServerLive", pb.ServerLiveRequest(), request, pb.ServerLiveResponse)
        # the status is the answer (Triton's clients read only it); KServe's InferenceRESTClient
        # reads the body's "live" / "ready", as KServe's own server writes them
        return _json({"live": reply.live}, 200 if reply.live else 400)

    async def _ready(self, request):
        reply = await self._call("ServerReady", pb.ServerReadyRequest(), request, pb.ServerReadyResponse)
        return _json({"ready": reply.ready}, 200 if reply.ready else 400)

    async def _server_metadata(self, request):
        reply = await self._call("ServerMetadata", pb.ServerMetadataRequest(), request, pb.ServerMetadataResponse)
        return _json({"name": reply.name, "version": reply.version, "extensions": list(reply.extensions)})

    async def _model_metadata(self, request, model, version=""):
        reply = await self._call("ModelMetadata", pb.ModelMetadataRequest(name=model, version=version), request,
                                 pb.ModelMetadataResponse)

        def tensors(items):
            return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in items]
        return _json({"name": reply.name, "versions": list(reply.versions), "platform": reply.platform,
                      "inputs": tensors(reply.inputs), "outputs": tensors(reply.outputs)})

    async def _model_ready(self, request, model, version=""):
        reply = await self._call("ModelReady", pb.ModelReadyRequest(name=model, version=version), request,
                                 pb.ModelReadyResponse)
        return HttpResponse(200 if reply.ready else 400)

    async def _model_config(self, request, model, version=""):
        reply = await self._call("ModelConfig", pb.ModelConfigRequest(name=model, version=version), request,
                                 pb.ModelConfigResponse)
        return _json(mapping_json(reply.config))

    async def _statistics(self, request, model="", version=""):
        reply = await self._call("ModelStatistics", pb.ModelStatisticsRequest(name=model, version=version), request,
                                 pb.ModelStatisticsResponse)
        doc = mapping_json(reply)
        doc.setdefault("model_stats", [])
        return _json(doc)

    # ---- repository ---------------------------------------------------------------------------
    async def _index(self, request):
        doc = loads_object(request.body, "the repository index request")
        ready = doc.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidArgument("'ready' must be true or false")
        reply = await self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready=ready), request,
                                 pb.RepositoryIndexResponse)
        return _json([{k: v for k, v in (("name", m.name), ("version", m.version), ("state", m.state),
                                         ("reason", m.reason)) if v} for m in reply.models])

    async def _load(self, request, model):
        doc = loads_object(request.body, "the load request")
        parameters = doc.get("parameters")
        if parameters is None:
            parameters = {}
        elif not isinstance(parameters, dict):      # a load must not go ahead on what it did not read
            got = "an array" if isinstance(parameters, list) else type(parameters).__name__
            raise InvalidArgument(f"the load request's 'parameters' must be a JSON object of parameter names, got {got}")
        refuse_load_overrides(model, parameters)
        await self._call("RepositoryModelLoad", pb.RepositoryModelLoadRequest(model_name=model), request,
                         pb.RepositoryModelLoadResponse)
        return HttpResponse(200)

    async def _unload(self, request, model):
        loads_object(request.body, "the unload request")
        await self._call("RepositoryModelUnload", pb.RepositoryModelUnloadRequest(model_name=model), request,
                         pb.RepositoryModelUnloadResponse)
        return HttpResponse(200)

    # ---- inference ----------------------------------------------------------------------------
    async def _infer(self, request, model, version=""):
        header = request.headers.get(HEADER_LENGTH)
        header_length = None
        if header is not None:
            if not header.strip().isdigit():
                raise InvalidArgument(f"Inference-Header-Content-Length must be a byte count, got {header!r}")
            header_length = int(header)
        # (a header length past the body is infer_request's error, which names both)
        json_bytes = len(request.body) if header_length is None else min(header_length, len(request.body))
        if json_bytes > self._max_json:
            return self._too_much_json(json_bytes, "the inference request")
        wanted = infer_request(request.body, header_length, model, version)
        message = wanted.request
        if wanted.raw is not None:
            if self._infer_parsed is not None:
                message = self._infer_parsed(message, wanted.raw)     # the worker: views, no copy
            else:
                message.raw_input_contents.extend(bytes(v) for v in wanted.raw)    # the gateway forwards bytes
        # (the outputs sent as binary data: a hook's outputs are checked against the limit in
        # its thread; JSON's size is known only once it is written)
        raw_outputs = None if wanted.all_binary and not wanted.request.outputs else wanted.binary
        reply = await self._call("ModelInfer", message, request, pb.ModelInferResponse, raw_outputs)
        body, json_length = infer_response(reply, wanted)
        if self._max_send is not None and len(body) > self._max_send:
            raise GRPCError(Status.RESOURCE_EXHAUSTED, f"the response is {len(body)} bytes, the limit "
                                                       f"({self._send_key}) is {self._max_send}; ask for the outputs "
                                                       "in shared memory or raise the limit")
        if json_length is None:
            return HttpResponse(200, body)
        return HttpResponse(200, body, "application/octet-stream",
                            ((HEADER_LENGTH, str(json_length)),))

    # ---- shared memory ------------------------------------------------------------------------
    async def _shm_status(self, request, region=""):
        reply = await self._call("SystemSharedMemoryStatus", pb.SystemSharedMemoryStatusRequest(name=region), request,
                                 pb.SystemSharedMemoryStatusResponse)
        return _json([{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}
                      for r in reply.regions.values()])

    async def _shm_register(self, request, region):
        doc = loads_object(request.body, "the register request")
        key, offset, size = doc.get("key"), doc.get("offset", 0), doc.get("byte_size")
        if not isinstance(key, str) or not key:
            raise InvalidArgument("'key' must be the shared-memory object's name (a non-empty string)")
        for name, value in (("offset", offset), ("byte_size", size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"'{name}' must be a non-negative integer")
        await self._call("SystemSharedMemoryRegister", pb.SystemSharedMemoryRegisterRequest(
            name=region, key=key, offset=offset, byte_size=size), request, pb.SystemSharedMemoryRegisterResponse)
        return HttpResponse(200)

    async def _shm_unregister(self, request, region=""):
        await self._call("SystemSharedMemoryUnregister", pb.SystemSharedMemoryUnregisterRequest(name=region), request,
                         pb.SystemSharedMemoryUnregisterResponse)
        return HttpResponse(200)

    async def _cuda_status(self, request, region=""):
        reply = await self._call("CudaSharedMemoryStatus", pb.CudaSharedMemoryStatusRequest(name=region), request,
                                 pb.CudaSharedMemoryStatusResponse)
        return _json([{"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}
                      for r in reply.regions.values()])

    async def _cuda_register(self, request, region):
        doc = loads_object(request.body, "the register request")

        def number(key: str, low: int, high: int) -> int:
            # the answer is UNAVAILABLE whatever the numbers: one the message cannot hold is 0
            # (protobuf raised ValueError on it, answered 500)
            value = doc.get(key, 0)
            return value if isinstance(value, int) and low <= value <= high else 0
        await self._call("CudaSharedMemoryRegister", pb.CudaSharedMemoryRegisterRequest(
            name=region, device_id=number("device_id", -2 ** 63, 2 ** 63 - 1),
            byte_size=number("byte_size", 0, 2 ** 64 - 1)), request, pb.CudaSharedMemoryRegisterResponse)
        return HttpResponse(200)

    async def _cuda_unregister(self, request, region=""):
        await self._call("CudaSharedMemoryUnregister", pb.CudaSharedMemoryUnregisterRequest(name=region), request,
                         pb.CudaSharedMemoryUnregisterResponse)
        return HttpResponse(200)


__all__ = ["HTTP_STATUS", "RestApi"]
