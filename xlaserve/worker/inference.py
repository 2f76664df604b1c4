"""The request path on the Trio side: Python hooks and meta models around the scheduler.

A request whose model has no hooks goes straight to the scheduler's inbox and its reply goes
straight back to the caller. A request with ``preprocess``/``postprocess`` gets a task that runs
each hook in the hooks thread pool, so the dispatch loop never waits on Python: while one
request's postprocess runs, the device executes the next batch. A meta model's ``run`` gets a
task and a thread of its own (the meta pool); each ``ctx.infer`` it makes enters the scheduler
like any request, with what is left of the meta request's deadline.

A request submitted with a ``ticket`` can be cancelled (:meth:`InferenceService.cancel`, when its
client goes away). Queued in the scheduler, it leaves its queue unrun. A request with hooks stops
at its next stage boundary: no enqueue after its preprocess, no postprocess after its execution.
A meta request's next ``ctx.infer`` raises, and the sub-calls it has queued leave their queues.
A hook or execution already under way is not interrupted; its result is dropped.

Everything a hook returns is checked against the manifest (:func:`xlaserve._hooks.conform`); a
hook that raises or returns the wrong tensors fails its own request only, with INTERNAL naming
the model, the hook and what went wrong.
"""
from __future__ import annotations

import concurrent.futures
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import trio
from outcome import capture

from xlaserve._hooks import NamedTensor, conform
from xlaserve.bundle import ModelVersion
from xlaserve.errors import (Cancelled, DeadlineExceeded, InternalError, ModelNotFound, ModelNotReady, QueueFull,
                             Unavailable, XlaserveError)
from xlaserve.manifest import TensorDecl
from xlaserve.worker.messages import CancelRequest, InferRequest, InferResult, Outcome, Reply, SchedulerMessage
from xlaserve.worker.registry import ModelState

log = logging.getLogger("xlaserve.inference")

HOOK_THREADS = 16
"""Hooks of different requests that may run at once. Hooks that release the GIL (NumPy, I/O)
overlap with each other and with the device; pure-Python hooks share the GIL."""
META_THREADS = 64
"""Meta requests whose ``run`` may be in progress at once; each mostly waits on its sub-calls."""


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A decoded request as the client sent it (client-side tensors). ``reply`` is called
    exactly once and may be called from any thread (the frontend's replies are thread-safe)."""

    model: ModelVersion
    inputs: Mapping[str, np.ndarray]
    rows: int
    request_id: str
    timeout: float | None
    reply: Reply
    received_ns: int
    ticket: object = None       # what InferenceService.cancel names it by (hashable); None: not cancellable


class Stages:
    """A request that runs as a task (hooks, meta): whether its client went away, and the
    tickets of its requests now in the scheduler. Trio thread only, except ``cancelled``, which
    a meta thread reads."""

    __slots__ = ("cancelled", "queued")

    def __init__(self) -> None:
        self.cancelled = False
        self.queued: set[object] = set()


class SubCallError(XlaserveError):
    """A meta model's ``ctx.infer`` failed. Keeps the sub-call's status (DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED, UNAVAILABLE, ...); the message names the meta model and the sub-model."""

    def __init__(self, message: str, cause: XlaserveError) -> None:
        super().__init__(message)
        self.status = cause.status
        self.cause = cause


class InferenceService:
    """Accepts decoded client requests; owns the hook and meta thread pools.

    ``table`` is the model table meta models look sub-models up in; ``stats`` (optional) gets one
    success or failure per meta request (its sub-calls are counted under the sub-models).
    """

    def __init__(self, scheduler: trio.MemorySendChannel[SchedulerMessage], nursery: trio.Nursery,
                 table=None, stats=None, hook_threads: int = HOOK_THREADS,
                 meta_threads: int = META_THREADS) -> None:
        self._scheduler = scheduler
        self._nursery = nursery
        self._table = table
        self._stats = stats
        self._hook_pool = concurrent.futures.ThreadPoolExecutor(hook_threads, thread_name_prefix="xlaserve-hook")
        self._meta_limiter = trio.CapacityLimiter(meta_threads)
        self._tasks: dict[object, Stages] = {}      # by ticket: cancellable requests that run as tasks

    def submit(self, request: ClientRequest) -> None:
        """Accept one request; its reply is called exactly once. Runs on the Trio thread."""
        model = request.model
        hooks = model.hooks
        deadline = math.inf if request.timeout is None else trio.current_time() + request.timeout
        if model.is_meta:
            self._nursery.start_soon(self._meta, request, deadline, self._stages(request.ticket))
        elif hooks is None or (hooks.preprocess is None and hooks.postprocess is None):
            self._enqueue(model, request.inputs, request.rows, request.request_id, deadline, request.reply,
                          request.received_ns, request.ticket)
        elif hooks.preprocess is None:
            # Postprocess only (the common case): no task; the outcome hands the hook to the pool.
            self._enqueue(model, request.inputs, request.rows, request.request_id, deadline,
                          self._then_postprocess(request, self._stages(request.ticket, queued=True)),
                          request.received_ns, request.ticket)
        else:
            self._nursery.start_soon(self._with_hooks, request, deadline, self._stages(request.ticket))

    def cancel(self, ticket: object) -> None:
        """The client of the request submitted with ``ticket`` went away (Trio thread). The
        request still gets its one reply (CANCELLED, or whatever it had already come to)."""
        stages = self._tasks.get(ticket)
        if stages is None:                      # task-free: the scheduler holds it, if anyone
            self._cancel_queued(ticket)
            return
        stages.cancelled = True
        for queued in list(stages.queued):
            self._cancel_queued(queued)

    def _cancel_queued(self, ticket: object) -> None:
        try:
            self._scheduler.send_nowait(CancelRequest(ticket))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass    # the request runs after all; its reply is dropped by whoever holds the call

    def _stages(self, ticket: object, queued: bool = False) -> Stages:
        """A cancellable request's stages; ``queued``: it goes to the scheduler under ``ticket``."""
        stages = Stages()
        if ticket is not None:
            self._tasks[ticket] = stages
            if queued:
                stages.queued.add(ticket)
        return stages

    def _done(self, request: ClientRequest, outcome: Outcome) -> None:
        """Reply to a request that ran as a task, and forget its ticket."""
        if request.ticket is not None:
            self._tasks.pop(request.ticket, None)
        request.reply(outcome)

    def _then_postprocess(self, request: ClientRequest, stages: Stages) -> Reply:
        """A reply that runs the model's postprocess in the hook pool, then replies to the caller
        from that thread. Cheaper than a task per request: one pool hand-off, one wake-up."""
        model = request.model

        def finish(outcome: Outcome) -> None:     # on the Trio thread (the scheduler replies)
            if request.ticket is not None:
                self._tasks.pop(request.ticket, None)
            if isinstance(outcome, InferResult) and stages.cancelled:
                outcome = _cancelled(model.name, request.request_id)
            if not isinstance(outcome, InferResult):
                request.reply(outcome)
                return

            def work() -> None:
                try:
                    result: Outcome = postprocessed(model, outcome, request.rows)
                except XlaserveError as exc:
                    result = exc
                request.reply(result)   # a ClientRequest's reply is thread-safe
            self._hook_pool.submit(work)
        return finish

    def _enqueue(self, model: ModelVersion, inputs: Mapping[str, np.ndarray], rows: int, request_id: str,
                 deadline: float, reply: Reply, received_ns: int, ticket: object = None) -> None:
        request = InferRequest(model, inputs, rows, request_id, deadline, reply, received_ns, trio.current_time(),
                               ticket)
        try:
            self._scheduler.send_nowait(request)
        except trio.WouldBlock:
            request.reply(QueueFull("the worker's admission channel is full; retry later"))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            request.reply(Unavailable("the worker is shutting down"))

    async def execute(self, model: ModelVersion, inputs: Mapping[str, np.ndarray], rows: int,
                      request_id: str, deadline: float = math.inf, received_ns: int | None = None,
                      stages: Stages | None = None) -> Outcome:
        """Queue executable inputs with what is left until ``deadline`` and wait for their outcome.
        With ``stages``, not queued once cancelled, and taken out of the queue if cancelled there."""
        if stages is not None and stages.cancelled:
            return _cancelled(model.name, request_id)
        if deadline <= trio.current_time():
            return DeadlineExceeded(f"model '{model.name}': request '{request_id}' ran out of time before it "
                                    "could be queued")
        send, receive = trio.open_memory_channel[Outcome](1)
        ticket = None
        if stages is not None:
            ticket = object()
            stages.queued.add(ticket)
        try:
            self._enqueue(model, inputs, rows, request_id, deadline, send.send_nowait,
                          received_ns or time.perf_counter_ns(), ticket)
            async with receive:
                return await receive.receive()
        finally:
            if stages is not None:
                stages.queued.discard(ticket)

    # ---- preprocess / postprocess -------------------------------------------------------
    async def _in_hook_pool(self, fn, *args):
        """Run ``fn(*args)`` in the hook pool (the one that bounds how many hooks run at once)
        and wait for it without holding up other tasks."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list = []

        def work() -> None:
            result.append(capture(fn, *args))
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass  # the worker stopped; nobody waits for this hook any more
        self._hook_pool.submit(work)
        await done.wait()
        return result[0].unwrap()

    async def _with_hooks(self, request: ClientRequest, deadline: float, stages: Stages) -> None:
        model = request.model
        hooks = model.hooks
        manifest = model.manifest
        try:
            inputs = request.inputs
            if hooks.preprocess is not None:
                inputs = await self._in_hook_pool(
                    call_hook, model, "preprocess", hooks.preprocess, inputs, manifest.executable_inputs,
                    request.rows)
            outcome = await self.execute(model, inputs, request.rows, request.request_id, deadline,
                                         request.received_ns, stages)
            if isinstance(outcome, InferResult) and hooks.postprocess is not None:
                if stages.cancelled:
                    outcome = _cancelled(model.name, request.request_id)
                else:
                    outcome = await self._in_hook_pool(postprocessed, model, outcome, request.rows)
        except XlaserveError as exc:
            outcome = exc
        self._done(request, outcome)

    # ---- meta models --------------------------------------------------------------------
    async def _meta(self, request: ClientRequest, deadline: float, stages: Stages) -> None:
        model = request.model
        ctx = MetaContext(self, model, request.request_id, deadline, trio.lowlevel.current_trio_token(), stages)
        tensors = [NamedTensor(name, array) for name, array in request.inputs.items()]
        started_ns = time.perf_counter_ns()
        try:
            outputs = await trio.to_thread.run_sync(ctx._run, tensors, limiter=self._meta_limiter)
            outcome: Outcome = InferResult(outputs, 0, 0, 0, time.perf_counter_ns() - started_ns, 0)
        except XlaserveError as exc:
            outcome = exc
        if stages.cancelled:
            outcome = _cancelled(model.name, request.request_id)
        if self._stats is not None:
            total_ns = time.perf_counter_ns() - request.received_ns
            if isinstance(outcome, InferResult):
                self._stats.record_success(model.name, total_ns, max(0, started_ns - request.received_ns), 0,
                                           outcome.compute_infer_ns, 0, time.time_ns() // 1_000_000)
            else:
                self._stats.record_failure(model.name, total_ns)
        self._done(request, outcome)

    def _sub_model(self, meta: str, name: str) -> ModelVersion:
        """The version of ``name`` serving now; reads the table's immutable snapshot (any thread)."""
        table = self._table.snapshot if self._table is not None else {}
        entry = table.get(name)
        where = f"model '{meta}': run: ctx.infer('{name}')"
        if entry is None:
            cause = ModelNotFound(name, list(table))
            raise SubCallError(f"{where}: {cause}", cause)
        if entry.state is not ModelState.READY or entry.serving is None:
            cause = ModelNotReady(f"model '{name}' is {entry.state.value}")
            raise SubCallError(f"{where}: {cause}", cause)
        if entry.serving.is_meta:
            raise InternalError(f"{where}: '{name}' is a meta model; a meta model calls compiled models only")
        return entry.serving


def _cancelled(model: str, request_id: str) -> Cancelled:
    return Cancelled(f"model '{model}': the client cancelled request '{request_id}' (it reset the stream or closed "
                     "the connection); it stopped at a stage boundary")


def postprocessed(model: ModelVersion, result: InferResult, rows: int) -> InferResult:
    """``result`` with its outputs passed through the model's postprocess hook (on a hook thread)."""
    outputs = call_hook(model, "postprocess", model.hooks.postprocess, result.outputs,
                        model.manifest.client_outputs, rows)
    return replace(result, outputs=outputs)


def call_hook(model: ModelVersion, label: str, hook: Callable, tensors: Mapping[str, np.ndarray],
              expected: Sequence[TensorDecl], rows: int) -> dict[str, np.ndarray]:
    """Run one pre/postprocess hook (blocking) and check what it returns against ``expected``."""
    named = [NamedTensor(name, array) for name, array in tensors.items()]
    try:
        result = hook(named)
    except Exception as exc:
        log.warning("model '%s': %s hook raised %s: %s", model.name, label, type(exc).__name__, exc, exc_info=True)
        raise InternalError(f"model '{model.name}': {label} hook raised {type(exc).__name__}: {exc}") from None
    kind = "executable_inputs" if label == "preprocess" else "client_outputs"
    outputs, _ = conform(result, expected, where=f"model '{model.name}': {label} hook output (checked against "
                                                 f"{kind})", rows=rows)
    return outputs


class MetaContext:
    """What a meta model's ``run(tensors, ctx)`` gets: ``ctx.infer`` calls other models.

    ``ctx.infer(model, tensors)`` takes a list of :class:`NamedTensor` (or a mapping of name to
    array) matching the sub-model's client inputs, applies its preprocess, queues it in the
    scheduler with what is left of this request's deadline, applies its postprocess and returns
    a ``dict`` of the sub-model's client outputs by name. It blocks its thread only; call it from
    ``run``'s own thread or from threads ``run`` starts, to overlap several sub-calls. A failure
    raises :class:`SubCallError` (an ``XlaserveError``) carrying the sub-call's status.
    """

    def __init__(self, service: InferenceService, model: ModelVersion, request_id: str, deadline: float,
                 token: trio.lowlevel.TrioToken, stages: Stages | None = None) -> None:
        self.model = model.name
        self.request_id = request_id
        self._meta = model
        self._service = service
        self._deadline = deadline
        self._token = token
        self._stages = stages or Stages()
        self._run_thread: int | None = None
        self._calls = itertools.count(1)

    def _run(self, tensors: list[NamedTensor]) -> dict[str, np.ndarray]:
        """The meta request's whole body, in a meta-pool thread."""
        self._run_thread = threading.get_ident()
        name = self.model
        try:
            result = self._meta.hooks.run(tensors, self)
        except XlaserveError:
            raise
        except Exception as exc:
            log.warning("model '%s': run hook raised %s: %s", name, type(exc).__name__, exc, exc_info=True)
            raise InternalError(f"model '{name}': run hook raised {type(exc).__name__}: {exc}") from None
        outputs, _ = conform(result, self._meta.manifest.client_outputs,
                             where=f"model '{name}': run hook output (checked against client_outputs)",
                             rows=None, any_rows=True)
        return outputs

    def infer(self, model: str, tensors: Sequence[NamedTensor] | Mapping[str, Any]) -> dict[str, np.ndarray]:
        where = f"model '{self.model}': run: ctx.infer('{model}')"
        if self._stages.cancelled:
            cause = _cancelled(self.model, self.request_id)
            raise SubCallError(f"{where}: {cause}", cause)
        sub = self._service._sub_model(self.model, model)
        manifest = sub.manifest
        inputs, rows = conform(tensors, manifest.client_inputs, where=f"{where} inputs (checked against "
                               f"'{model}' client_inputs)", rows=None, max_rows=manifest.max_batch_size)
        hooks = sub.hooks
        if hooks is not None and hooks.preprocess is not None:
            inputs = call_hook(sub, "preprocess", hooks.preprocess, inputs, manifest.executable_inputs, rows)
        request_id = f"{self.request_id}/{model}#{next(self._calls)}"
        args = (self._service.execute, sub, inputs, rows, request_id, self._deadline, None, self._stages)
        if threading.get_ident() == self._run_thread:
            outcome = trio.from_thread.run(*args)   # in run's own task: cancelled with it
        else:
            outcome = trio.from_thread.run(*args, trio_token=self._token)
        if isinstance(outcome, XlaserveError):
            raise SubCallError(f"{where}: {outcome}", outcome)
        outputs = outcome.outputs
        if hooks is not None and hooks.postprocess is not None:
            outputs = call_hook(sub, "postprocess", hooks.postprocess, outputs, manifest.client_outputs, rows)
        return dict(outputs)
