"""KServe V2 ``inference.GRPCInferenceService``: decode, validate, hand a message to the actors
through the bridge, await the reply, encode (ModelInfer has no task to await in: the transport
calls :meth:`KServeService.infer_now` and the reply is encoded by whoever answers it). No model logic lives here. The handlers are
grpclib-shaped (the generated base class, ``stream.recv_message``/``send_message``) and are
served by :mod:`xlaserve.frontend.grpc_server`."""
from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping

import numpy as np

from xlaserve import __version__
from xlaserve._proto import grpc_service_pb2 as pb
from xlaserve._proto import model_config_pb2 as mc
from xlaserve._proto.grpc_service_grpc import GRPCInferenceServiceBase
from xlaserve.bundle import ModelVersion
from xlaserve.codec import decode_inputs, encode_output, int_parameter
from xlaserve.config import EndpointsConfig
from xlaserve.errors import (Cancelled, FailedPrecondition, InternalError, InvalidArgument, ModelNotFound,
                             ModelNotReady, NotFound, PermissionDenied, Unimplemented, XlaserveError,
                             describe_exception, internal_message)
from xlaserve.frontend.access import shm_peer_denial
from xlaserve.frontend.admission import Admission, output_bytes_per_row
from xlaserve.frontend.port import WorkerPort
from xlaserve.frontend.rest_api import refuse_load_overrides
from xlaserve.frontend.shm import cuda_unavailable
from xlaserve.frontend.shm import disabled as shm_disabled
from xlaserve.frontend.statuses import rpc
from xlaserve.manifest import TensorDecl
from xlaserve.tracing import MAX_ATTRIBUTE, MAX_ERROR, RequestTrace, Tracing
from xlaserve.wire import split_field
from xlaserve.worker.inference import ClientRequest, ReplyLimit
from xlaserve.worker.messages import InferResult
from xlaserve.worker.registry import ModelEntry, ModelState
from xlaserve.worker.stats import Duration

log = logging.getLogger("xlaserve.frontend")

SERVER_NAME = "xlaserve"
EXTENSIONS = ("model_repository", "model_configuration", "statistics", "system_shared_memory",
              "binary_tensor_data", "schedule_policy")
PLATFORM = "xla_stablehlo"


def request_too_large(size: int | str, limit: int) -> str:
    return (f"the request is {size} bytes, the limit (endpoints.max_recv_msg_bytes) is {limit}; send large "
            "tensors through shared memory")


def connection_buffer_full(held: int, limit: int, calls: int) -> str:
    return (f"this connection would hold {held} bytes of requests not yet fully received ({calls} calls "
            f"unfinished); the limit (endpoints.max_connection_buffer_bytes) is {limit}; send fewer large "
            "requests at once on one connection, or use shared memory")


def response_too_large(size: int, limit: int) -> str:
    return (f"the response is {size} bytes, the limit (endpoints.max_send_msg_bytes) is {limit}; ask for the "
            "outputs in shared memory or raise the limit")


def _config_dtype(decl: TensorDecl) -> int:
    name = "TYPE_STRING" if decl.dtype.kserve == "BYTES" else f"TYPE_{decl.dtype.kserve}"
    return mc.DataType.Value(name)


def _leading_batch(model: ModelVersion) -> bool:
    """True when every client tensor has its batch axis first on the wire (Triton's convention)."""
    tensors = (*model.manifest.client_inputs, *model.manifest.client_outputs)
    return all(t.batch_axis == 0 for t in tensors)


def _duration(d: Duration) -> pb.StatisticDuration:
    return pb.StatisticDuration(count=d.count, ns=d.ns)


def _request_timeout(request, stream) -> float | None:
    """Seconds the caller allows: Triton's ``timeout`` parameter (microseconds) or the gRPC deadline,
    whichever is sooner."""
    timeouts = []
    micros = int_parameter(request.parameters, "timeout", unit=" number of microseconds")
    if micros:
        timeouts.append(micros / 1e6)
    if stream.deadline is not None:
        timeouts.append(max(0.0, stream.deadline.time_remaining()))
    return min(timeouts) if timeouts else None


def finish_trace(trace: RequestTrace, outcome, model: ModelVersion | None) -> None:
    """End a request's root span with how it was answered (``outcome``: the response or the
    XlaserveError); ``model``: the version that served it, once known."""
    attributes = trace.attributes
    if model is not None:
        attributes["xlaserve.model_version"] = model.version
    if isinstance(outcome, XlaserveError):
        attributes["rpc.grpc.status_code"] = outcome.status.value
        trace.finish(f"{outcome.status.name}: {outcome}"[:MAX_ERROR])
    else:
        attributes["rpc.grpc.status_code"] = 0
        trace.finish()


INFER = "/inference.GRPCInferenceService/ModelInfer"
RAW_INPUT_CONTENTS = pb.ModelInferRequest.DESCRIPTOR.fields_by_name["raw_input_contents"].number
SPLIT_RAW_ABOVE = 64 << 10
"""A ModelInferRequest of more bytes than this keeps its ``raw_input_contents`` as views into
the received message (:func:`xlaserve.wire.split_field`): the scan costs a few microseconds,
the copies it saves (the parser's and the field's ``bytes``) about 3 us each per 150 KB hot in
the CPU's caches, several times that cold."""


class ModelInferWire:
    """A ModelInferRequest as it came off the wire: the transport's request type for ModelInfer
    (it wraps the received bytes, a view, without a copy); :meth:`parse` is the parse."""

    __slots__ = ("data", "_parsed")
    DESCRIPTOR = pb.ModelInferRequest.DESCRIPTOR
    accepts_parsed = True       # infer_now takes a parsed ModelInferRequest too (REST's)

    def __init__(self, data) -> None:
        self.data = data
        self._parsed = None

    @classmethod
    def FromString(cls, data) -> "ModelInferWire":
        return cls(data)

    @classmethod
    def parsed(cls, request: pb.ModelInferRequest, raw) -> "ModelInferWire":
        """A request already parsed whose raw contents were kept out of it (``raw``: views, in
        input order; REST's binary tensors, cut from the HTTP body)."""
        wire = cls(None)
        wire._parsed = (request, list(raw))
        return wire

    def parse(self) -> tuple[pb.ModelInferRequest, list[memoryview] | None]:
        """The message, and its ``raw_input_contents`` as views into the received bytes when it
        is large (kept out of the message), else None (the message has its own). A malformed
        message is INVALID_ARGUMENT, as the transport words it."""
        if self._parsed is not None:
            return self._parsed
        data = self.data
        try:
            if len(data) > SPLIT_RAW_ABOVE:
                split = split_field(data, RAW_INPUT_CONTENTS)
                if split is not None:
                    return pb.ModelInferRequest.FromString(split[0]), split[1]
            return pb.ModelInferRequest.FromString(data), None
        except Exception as exc:
            raise InvalidArgument(f"the request is not a valid inference.ModelInferRequest message: {exc}") from None


def _one_repository(name: str) -> None:
    """A repository request names no repository, or NotFound: a worker serves one (``model_repo``);
    a load or unload naming another would act on this one."""
    if name:
        raise NotFound(f"repository '{name}' is unknown; this worker serves one repository (leave repository_name "
                       "empty)")


class KServeService(GRPCInferenceServiceBase):
    """The KServe V2 service of one worker, reached through ``worker``; ``endpoints`` gives the
    admission limits. :attr:`admission` is public so that its counts can be exported as gauges."""

    def __init__(self, worker: WorkerPort, endpoints: EndpointsConfig, tracing: Tracing | None = None) -> None:
        self._worker = worker
        self._tracing = tracing         # None: tracing off (xlaserve.tracing)
        self.admission = Admission(endpoints.max_concurrent_requests, endpoints.max_held_request_bytes)
        self._max_recv_bytes = endpoints.max_recv_msg_bytes
        self._max_send_bytes = endpoints.max_send_msg_bytes
        self._shm_peers = endpoints.client_shm_peers
        # model name -> (the version number it was computed for, its output bytes per row and
        # fixed); numbers, not the ModelVersion, so a retired version's weights are not kept alive
        self._reply_sizes: dict[str, tuple[int, tuple[int, int]]] = {}

    # ---- model lookup --------------------------------------------------------------------
    def _entry(self, name: str, version: str = "") -> ModelEntry:
        table = self._worker.models.snapshot
        entry = table.get(name)
        if entry is None:
            raise ModelNotFound(name, list(table))
        if version and entry.serving is not None and version != str(entry.serving.version):
            raise NotFound(f"model '{name}' serves version {entry.serving.version}; version '{version}' is not "
                           "available (leave model_version empty for the current one)")
        return entry

    def _ready(self, name: str, version: str = "") -> ModelVersion:
        entry = self._entry(name, version)
        if entry.state is not ModelState.READY or entry.serving is None:
            why = f": {entry.reason}" if entry.reason else ""
            raise ModelNotReady(f"model '{name}' is {entry.state.value}{why}")
        return entry.serving

    # ---- health and metadata ---------------------------------------------------------------
    @rpc
    async def ServerLive(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(pb.ServerLiveResponse(live=True))

    @rpc
    async def ServerReady(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(pb.ServerReadyResponse(ready=self._worker.models.ready()))

    @rpc
    async def ModelReady(self, stream) -> None:
        request = await stream.recv_message()
        entry = self._worker.models.snapshot.get(request.name)
        ready = (entry is not None and entry.state is ModelState.READY and
                 (not request.version or (entry.serving is not None and request.version == str(entry.version))))
        await stream.send_message(pb.ModelReadyResponse(ready=ready))

    @rpc
    async def ServerMetadata(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(pb.ServerMetadataResponse(name=SERVER_NAME, version=__version__,
                                                            extensions=list(EXTENSIONS)))

    @rpc
    async def ModelMetadata(self, stream) -> None:
        request = await stream.recv_message()
        model = self._ready(request.name, request.version)
        m = model.manifest

        def tensors(decls):
            return [pb.ModelMetadataResponse.TensorMetadata(name=d.name, datatype=d.dtype.kserve,
                                                            shape=list(d.wire_dims())) for d in decls]
        await stream.send_message(pb.ModelMetadataResponse(
            name=model.name, versions=[str(model.version)], platform=PLATFORM,
            inputs=tensors(m.client_inputs), outputs=tensors(m.client_outputs)))

    @rpc
    async def ModelConfig(self, stream) -> None:
        request = await stream.recv_message()
        model = self._ready(request.name, request.version)
        m = model.manifest
        leading = _leading_batch(model)
        max_batch = m.max_batch_size if leading and not model.is_meta else 0

        def dims(d: TensorDecl) -> list[int]:
            shape = list(d.wire_dims())
            return shape[1:] if max_batch else shape
        config = mc.ModelConfig(
            name=model.name, platform=PLATFORM, backend="xlaserve", max_batch_size=max_batch,
            input=[mc.ModelInput(name=d.name, data_type=_config_dtype(d), dims=dims(d)) for d in m.client_inputs],
            output=[mc.ModelOutput(name=d.name, data_type=_config_dtype(d), dims=dims(d)) for d in m.client_outputs])
        if max_batch and len(m.compiled_batch_sizes) > 1:
            config.dynamic_batching.preferred_batch_size.extend(m.compiled_batch_sizes)
        await stream.send_message(pb.ModelConfigResponse(config=config))

    @rpc
    async def ModelStatistics(self, stream) -> None:
        request = await stream.recv_message()
        table = self._worker.models.snapshot
        if request.name:
            entry = self._entry(request.name, request.version)
            entries = [entry]
        else:
            entries = list(table.values())
        statistics = self._worker.statistics
        out = []
        for entry in entries:
            s = statistics(entry.name)
            out.append(pb.ModelStatistics(
                name=entry.name, version=str(entry.version or ""), last_inference=s.last_inference_ms,
                inference_count=s.inference_count, execution_count=s.execution_count,
                inference_stats=pb.InferStatistics(
                    success=_duration(s.success), fail=_duration(s.fail), queue=_duration(s.queue),
                    compute_input=_duration(s.compute_input), compute_infer=_duration(s.compute_infer),
                    compute_output=_duration(s.compute_output)),
                batch_stats=[pb.InferBatchStatistics(
                    batch_size=size, compute_input=_duration(b.compute_input),
                    compute_infer=_duration(b.compute_infer), compute_output=_duration(b.compute_output))
                    for size, b in sorted(s.batches.items())]))
        await stream.send_message(pb.ModelStatisticsResponse(model_stats=out))

    # ---- repository --------------------------------------------------------------------
    @rpc
    async def RepositoryIndex(self, stream) -> None:
        request = await stream.recv_message()
        _one_repository(request.repository_name)
        models = []
        for entry in self._worker.models.snapshot.values():
            if request.ready and entry.state is not ModelState.READY:
                continue
            models.append(pb.RepositoryIndexResponse.ModelIndex(
                name=entry.name, version=str(entry.version or ""), state=entry.state.value, reason=entry.reason))
        await stream.send_message(pb.RepositoryIndexResponse(models=models))

    @rpc
    async def RepositoryModelLoad(self, stream) -> None:
        request = await stream.recv_message()
        _one_repository(request.repository_name)
        refuse_load_overrides(request.model_name, request.parameters)
        await self._worker.load_model(request.model_name)
        await stream.send_message(pb.RepositoryModelLoadResponse())

    @rpc
    async def RepositoryModelUnload(self, stream) -> None:
        request = await stream.recv_message()
        _one_repository(request.repository_name)
        await self._worker.unload_model(request.model_name)
        await stream.send_message(pb.RepositoryModelUnloadResponse())

    # ---- inference ---------------------------------------------------------------------
    def __fast_unary__(self) -> dict:
        """ModelInfer without a task per call: :mod:`xlaserve.frontend.grpc_server` calls
        :meth:`infer_now` as soon as the request is complete; the reply is encoded and queued
        by whoever answers it (usually the dispatch loop)."""
        return {INFER: self.infer_now}

    def __mapping__(self) -> dict:
        mapping = super().__mapping__()
        infer = mapping[INFER]
        # the transport hands ModelInfer its bytes (ModelInferWire); infer_now parses them
        mapping[INFER] = type(infer)(infer.func, infer.cardinality, ModelInferWire, infer.reply_type)
        return mapping

    def infer_now(self, call, request: pb.ModelInferRequest | ModelInferWire) -> None:
        raw = None
        if type(request) is ModelInferWire:
            request, raw = request.parse()
        self._start_infer(request, call, call.complete, raw)

    @rpc
    async def ModelInfer(self, stream) -> None:
        """Never called: the servers of this service (:class:`~xlaserve.frontend.grpc_server.GrpcServer`,
        :class:`~xlaserve.frontend.rest_api.RestApi`) take ModelInfer's task-free entry,
        :meth:`infer_now`, from :meth:`__fast_unary__`. It is here because the generated base
        class declares it, and its entry in ``__mapping__()`` gives the transport the request type."""
        raise InternalError("ModelInfer is served through the task-free entry (__fast_unary__: infer_now); "
                            "this server called the grpclib-shaped handler instead")

    def _start_infer(self, request: pb.ModelInferRequest, stream, done, raw=None) -> None:
        """Validate and decode ``request``, hand it to the actors, and call ``done`` exactly once,
        on the Trio thread, with the ModelInferResponse or the XlaserveError that ends the call.

        ``stream`` is the task-free call (a :class:`~xlaserve.frontend.grpc_server.Call`, or
        REST's): when it is cancelled, the request leaves its queue if it is still queued, and a
        result that comes anyway is not encoded (the call is gone). A call whose reply carries
        only some outputs as raw bytes says which in ``raw_outputs`` (REST: those asked for as
        binary data; the others go as JSON text, of a size known only once encoded)."""
        received_ns = time.perf_counter_ns()
        worker = self._worker
        admitted = self.admission.admit()    # given back once, by finish, whatever happens
        model = wanted = None
        cancelled = False
        trace = None

        def cancel() -> None:
            nonlocal cancelled
            cancelled = True
            worker.cancel(stream)

        def finish(outcome) -> None:
            if not admitted.release():
                log.error("model '%s': request '%s' was answered twice; the second answer (%s) is dropped",
                          request.model_name, request.id, type(outcome).__name__)
                return
            try:
                stream.on_cancel = None
                if isinstance(outcome, InferResult) and cancelled:
                    outcome = Cancelled(f"model '{request.model_name}': the client cancelled the request while it "
                                        "ran; its result was dropped")
                elif isinstance(outcome, InferResult):
                    try:
                        outcome = self._response(request, model, outcome.outputs, wanted)
                    except XlaserveError as exc:
                        outcome = exc
                status = outcome.status.name if isinstance(outcome, XlaserveError) else "OK"
                # a model the worker does not have is counted under "": a label per name a client
                # sends would let any client grow /metrics (and the worker's memory) without bound
                worker.observe_request(model.name if model is not None else "", status,
                                       (time.perf_counter_ns() - received_ns) / 1e9)
            except Exception as exc:
                log.exception("model '%s': answering request '%s' failed", request.model_name, request.id)
                outcome = InternalError(f"model '{request.model_name}': "
                                        + internal_message(exc, "answering the request"))
            if trace is not None:
                finish_trace(trace, outcome, model)
            done(outcome)

        try:
            if self._tracing is not None:       # inside the guard: whatever raises, the slot is given back
                trace = self._tracing.start(
                    "xlaserve.infer", stream.metadata, received_ns,
                    {"rpc.system": "grpc", "rpc.method": "ModelInfer",
                     "xlaserve.model": request.model_name[:MAX_ATTRIBUTE],
                     "xlaserve.request_id": request.id[:MAX_ATTRIBUTE]})
            admitted.check()
            model = self._ready(request.model_name, request.model_version)
            admitted.found(model.name)
            max_rows = None if model.is_meta else model.manifest.max_batch_size
            shm = worker.shared_memory
            # the peer is checked only when an input names a region: other requests pay nothing
            read_shm = None if shm is None else functools.partial(self._read_shm_input, stream, shm)
            decoded = decode_inputs(request, model.manifest.client_inputs, max_rows, read_shm, self._max_recv_bytes,
                                    raw)
            wanted = self._requested_outputs(request, model)
            for decl, requested in wanted:
                if requested is not None and "shared_memory_region" in requested.parameters:
                    if shm is None:     # known on arrival: refused before the model runs
                        raise InvalidArgument(f"output '{decl.name}' names a shared-memory region, but client "
                                              "shared memory is not enabled on this server "
                                              "(endpoints.allow_client_shm)")
                    self._check_shm_peer("ModelInfer", stream)
                    shm.check_output(decl.name, requested.parameters)
            timeout = _request_timeout(request, stream)
            admitted.hold(self._held_bytes(model, decoded.arrays, decoded.rows))
            stream.on_cancel = cancel
            on_trio = worker.bridge.on_trio
            if trace is not None:
                trace.admitted(decoded.rows)
            hooks = model.hooks
            limit = (self._reply_limit(wanted, getattr(stream, "raw_outputs", None))
                     if model.is_meta or (hooks is not None and hooks.postprocess is not None) else None)
            worker.submit(ClientRequest(model, decoded.arrays, decoded.rows, request.id, timeout,
                                        lambda outcome: on_trio(finish, outcome), received_ns, stream, trace,
                                        limit))
        except XlaserveError as exc:
            finish(exc)
        except Exception as exc:
            # a bug, or input no check foresaw: this request's answer, never the connection's or the worker's
            log.exception("model '%s': request '%s' failed before it was queued", request.model_name, request.id)
            finish(InternalError(f"model '{request.model_name}': the request failed before it was queued: "
                                 f"{type(exc).__name__}: {describe_exception(exc)}"))

    def _held_bytes(self, model: ModelVersion, arrays: Mapping[str, np.ndarray], rows: int) -> int:
        """What holding a decoded request costs until it is answered: its input tensors and the
        fixed-size outputs its reply will carry (a BYTES tensor counts its object pointers only)."""
        n = 0
        for array in arrays.values():
            n += array.nbytes
        known = self._reply_sizes.get(model.name)
        if known is None or known[0] != model.version:
            known = self._reply_sizes[model.name] = (model.version,
                                                     output_bytes_per_row(model.manifest.client_outputs))
        per_row, fixed = known[1]
        return n + per_row * rows + fixed

    def _reply_limit(self, wanted: list, raw_outputs: frozenset[str] | None) -> ReplyLimit:
        """What the reply of a request whose outputs Python code makes (a postprocess hook, a meta
        model's run) may carry, checked in that code's thread: ``endpoints.max_send_msg_bytes``
        over the ``wanted`` outputs the reply carries as bytes (not those in shared memory, nor
        those outside ``raw_outputs`` when the call names some)."""
        inline = frozenset(decl.name for decl, requested in wanted
                           if (requested is None or "shared_memory_region" not in requested.parameters)
                           and (raw_outputs is None or decl.name in raw_outputs))
        return ReplyLimit(self._max_send_bytes, inline)

    @staticmethod
    def _requested_outputs(request, model: ModelVersion) -> list:
        if not request.outputs:
            return [(d, None) for d in model.manifest.client_outputs]
        decls = {d.name: d for d in model.manifest.client_outputs}
        out = []
        for o in request.outputs:
            decl = decls.get(o.name)
            if decl is None:
                raise InvalidArgument(f"unknown output '{o.name}' requested; the model gives "
                                      f"{', '.join(repr(n) for n in decls)}")
            if "classification" in o.parameters:
                raise InvalidArgument(f"output '{o.name}': the 'classification' extension is not supported")
            out.append((decl, o))
        return out

    def _response(self, request, model: ModelVersion, outputs: Mapping[str, np.ndarray],
                  wanted: list) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(model_name=model.name, model_version=str(model.version), id=request.id)
        shm = self._worker.shared_memory
        for decl, requested in wanted:
            array = outputs.get(decl.name)
            if array is None:
                raise FailedPrecondition(f"model '{model.name}' produced no output '{decl.name}'")
            tensor = response.outputs.add(name=decl.name, datatype=decl.dtype.kserve, shape=list(array.shape))
            if requested is not None and "shared_memory_region" in requested.parameters:
                shm.write_output(decl, array, requested.parameters, tensor)   # checked on arrival
                response.raw_output_contents.append(b"")   # Triton keeps one entry per output
                continue
            response.raw_output_contents.append(encode_output(array, decl.dtype))
        return response

    # ---- extensions ---------------------------------------------------------------------
    @rpc
    async def ModelStreamInfer(self, stream) -> None:
        raise Unimplemented("ModelStreamInfer (decoupled streaming) is not supported by xlaserve; use ModelInfer")

    def _shm_registry(self, rpc_name: str, stream):
        shm = self._worker.shared_memory
        if shm is None:
            raise shm_disabled(rpc_name)
        self._check_shm_peer(rpc_name, stream)
        return shm

    def _read_shm_input(self, stream, shm, tensor_name: str, parameters):
        self._check_shm_peer("ModelInfer", stream)
        return shm.read_input(tensor_name, parameters)

    def _check_shm_peer(self, rpc_name: str, stream) -> None:
        """PERMISSION_DENIED unless the call's peer is in ``endpoints.client_shm_peers``: a
        client elsewhere must not name (or learn of) a /dev/shm object on this host."""
        denial = shm_peer_denial(rpc_name, stream.peer, self._shm_peers)
        if denial is not None:
            raise PermissionDenied(denial)

    @rpc
    async def SystemSharedMemoryStatus(self, stream) -> None:
        request = await stream.recv_message()
        regions = self._shm_registry("SystemSharedMemoryStatus", stream).status(request.name)
        status = pb.SystemSharedMemoryStatusResponse.RegionStatus
        await stream.send_message(pb.SystemSharedMemoryStatusResponse(regions={
            r.name: status(name=r.name, key=r.key, offset=r.offset, byte_size=r.byte_size) for r in regions}))

    @rpc
    async def SystemSharedMemoryRegister(self, stream) -> None:
        request = await stream.recv_message()
        shm = self._shm_registry("SystemSharedMemoryRegister", stream)
        shm.register(request.name, request.key, request.offset, request.byte_size)
        await stream.send_message(pb.SystemSharedMemoryRegisterResponse())

    @rpc
    async def SystemSharedMemoryUnregister(self, stream) -> None:
        request = await stream.recv_message()
        self._shm_registry("SystemSharedMemoryUnregister", stream).unregister(request.name)
        await stream.send_message(pb.SystemSharedMemoryUnregisterResponse())

    # Triton's clients call CUDA Status and Unregister-all before using system shared memory, so
    # those two succeed (there are never CUDA regions); registering one says why it cannot work.
    @rpc
    async def CudaSharedMemoryStatus(self, stream) -> None:
        request = await stream.recv_message()
        if request.name:
            raise NotFound(f"CUDA shared-memory region '{request.name}' is not registered (none can be)")
        await stream.send_message(pb.CudaSharedMemoryStatusResponse())

    @rpc
    async def CudaSharedMemoryRegister(self, stream) -> None:
        await stream.recv_message()
        raise cuda_unavailable("CudaSharedMemoryRegister")

    @rpc
    async def CudaSharedMemoryUnregister(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(pb.CudaSharedMemoryUnregisterResponse())

    @rpc
    async def TraceSetting(self, stream) -> None:
        await stream.recv_message()
        raise Unimplemented("TraceSetting: Triton's trace settings are not supported; xlaserve traces requests with "
                            "OpenTelemetry, set in the node file's tracing: block (docs/tracing.md)")

    @rpc
    async def LogSettings(self, stream) -> None:
        await stream.recv_message()
        raise Unimplemented("LogSettings: xlaserve's log level is set at start-up (--log-level); it cannot be "
                            "changed at run time")
