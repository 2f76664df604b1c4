"""The request path on the Trio side: hooks around the scheduler.

A request whose model has no hooks goes straight to the scheduler's inbox and its reply goes
straight back to the caller. A request with ``preprocess``/``postprocess`` gets a task that
runs each hook in the hooks thread pool, so the dispatch loop never waits on Python hooks.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import trio

from xlaserve._hooks import NamedTensor
from xlaserve.bundle import ModelVersion
from xlaserve.errors import InternalError, QueueFull, XlaserveError
from xlaserve.worker.messages import InferRequest, InferResult, Outcome, Reply, SchedulerMessage

log = logging.getLogger("xlaserve.inference")


@dataclass(frozen=True, slots=True)
class ClientRequest:
    """A decoded request as the client sent it (client-side tensors)."""

    model: ModelVersion
    inputs: Mapping[str, np.ndarray]
    rows: int
    request_id: str
    timeout: float | None
    reply: Reply
    received_ns: int


class InferenceService:
    def __init__(self, scheduler: trio.MemorySendChannel[SchedulerMessage], nursery: trio.Nursery,
                 hook_threads: int = 4) -> None:
        self._scheduler = scheduler
        self._nursery = nursery
        self._hooks_limiter = trio.CapacityLimiter(hook_threads)

    def submit(self, request: ClientRequest) -> None:
        """Accept one request; its reply is called exactly once. Runs on the Trio thread."""
        hooks = request.model.hooks
        if hooks is None or (hooks.preprocess is None and hooks.postprocess is None):
            self._enqueue(InferRequest(request.model, request.inputs, request.rows, request.request_id,
                                       request.timeout, request.reply, request.received_ns))
        else:
            self._nursery.start_soon(self._with_hooks, request)

    def _enqueue(self, request: InferRequest) -> None:
        try:
            self._scheduler.send_nowait(request)
        except trio.WouldBlock:
            request.reply(QueueFull("the worker's admission channel is full; retry later"))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            from xlaserve.errors import Unavailable
            request.reply(Unavailable("the worker is shutting down"))

    async def _with_hooks(self, request: ClientRequest) -> None:
        model = request.model
        hooks = model.hooks
        try:
            inputs = request.inputs
            if hooks.preprocess is not None:
                inputs = await self._run_hook(model, "preprocess", hooks.preprocess, inputs)
            outcome = await self.execute(model, inputs, request.rows, request.request_id, request.timeout,
                                         request.received_ns)
            if isinstance(outcome, InferResult) and hooks.postprocess is not None:
                outputs = await self._run_hook(model, "postprocess", hooks.postprocess, outcome.outputs)
                outcome = InferResult(outputs, outcome.batch_size, outcome.queue_ns, outcome.compute_input_ns,
                                      outcome.compute_infer_ns, outcome.compute_output_ns)
        except XlaserveError as exc:
            outcome = exc
        request.reply(outcome)

    async def execute(self, model: ModelVersion, inputs: Mapping[str, np.ndarray], rows: int,
                      request_id: str, timeout: float | None, received_ns: int | None = None) -> Outcome:
        """Queue executable inputs and wait for their outcome."""
        send, receive = trio.open_memory_channel[Outcome](1)
        self._enqueue(InferRequest(model, inputs, rows, request_id, timeout, send.send_nowait,
                                   received_ns or time.perf_counter_ns()))
        async with receive:
            return await receive.receive()

    async def _run_hook(self, model: ModelVersion, label: str, hook, tensors: Mapping[str, np.ndarray]):
        named = [NamedTensor(k, v) for k, v in tensors.items()]

        def call():
            return hook(named)

        try:
            result = await trio.to_thread.run_sync(call, limiter=self._hooks_limiter)
        except Exception as exc:
            log.warning("model %s: %s raised %s: %s", model.name, label, type(exc).__name__, exc)
            raise InternalError(f"model '{model.name}': {label} hook raised {type(exc).__name__}: {exc}") from None
        if not isinstance(result, (list, tuple)) or not all(isinstance(t, NamedTensor) for t in result):
            raise InternalError(f"model '{model.name}': {label} hook must return a list of NamedTensor, got "
                                f"{type(result).__name__}")
        return {t.name: np.asarray(t.data) for t in result}
