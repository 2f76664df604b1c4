"""The scheduler actor: per-model bounded queues and the one dispatch loop of a worker.

Requests arrive on an inbox channel. Whenever the device is free the dispatch loop asks the
policy which model goes next, takes that model's queued requests (same version, never split)
up to the best compiled batch size, makes its weights resident and runs one execution.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import trio

from xlaserve.config import SchedulerConfig
from xlaserve.errors import InternalError, QueueFull
from xlaserve.runtime.weights import WeightCache
from xlaserve.worker.batching import choose_batch
from xlaserve.worker.executor import Executor
from xlaserve.worker.messages import DropModel, InferRequest, InferResult, SchedulerMessage
from xlaserve.worker.stats import StatsBook

log = logging.getLogger("xlaserve.scheduler")


@dataclass(frozen=True, slots=True)
class Queued:
    request: InferRequest
    seq: int                 # admission order across all models
    admitted_at: float       # trio.current_time()


class Policy(Protocol):
    def pick(self, queues: Mapping[str, deque[Queued]], now: float) -> str:
        """The model to dispatch next; ``queues`` holds only non-empty queues."""


class FifoPolicy:
    """The model of the oldest queued request goes next."""

    def pick(self, queues: Mapping[str, deque[Queued]], now: float) -> str:
        return min(queues, key=lambda name: queues[name][0].seq)


@dataclass(frozen=True, slots=True)
class QueueSnapshot:
    model: str
    depth: int
    rows: int


class Scheduler:
    def __init__(self, config: SchedulerConfig, executor: Executor, weights: WeightCache,
                 stats: StatsBook, metrics=None, policy: Policy | None = None) -> None:
        self._config = config
        self._executor = executor
        self._weights = weights
        self._stats = stats
        self._metrics = metrics
        self._policy = policy or FifoPolicy()
        self._queues: dict[str, deque[Queued]] = {}
        self._seq = itertools.count()
        self._wakeup = trio.Event()
        self._closing = False

    # ---- introspection (snapshots) -------------------------------------------------------
    def queues(self) -> tuple[QueueSnapshot, ...]:
        return tuple(QueueSnapshot(n, len(q), sum(x.request.rows for x in q)) for n, q in self._queues.items())

    def depth(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    # ---- the actor ---------------------------------------------------------------------
    async def run(self, inbox: trio.MemoryReceiveChannel[SchedulerMessage], *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``inbox`` closes, then finish what is queued and return."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._dispatch_loop)
            task_status.started()
            async with inbox:
                async for message in inbox:
                    match message:
                        case InferRequest():
                            self._admit(message)
                        case DropModel(name=name, error=error):
                            for queued in self._queues.pop(name, ()):
                                self._fail(queued.request, error)
            self._closing = True
            self._wakeup.set()

    def _admit(self, request: InferRequest) -> None:
        name = request.model.name
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = deque()
        limit = self._config.max_queue_depth
        if len(queue) >= limit:
            self._fail(request, QueueFull(f"model '{name}' has {len(queue)} requests queued, the limit "
                                          f"(scheduler.max_queue_depth) is {limit}; retry later"))
            return
        queue.append(Queued(request, next(self._seq), trio.current_time()))
        self._wakeup.set()

    def _fail(self, request: InferRequest, error) -> None:
        self._stats.record_failure(request.model.name, time.perf_counter_ns() - request.received_ns)
        request.reply(error)

    async def _dispatch_loop(self) -> None:
        while True:
            backlog = {n: q for n, q in self._queues.items() if q}
            if not backlog:
                if self._closing:
                    return
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                continue
            name = self._policy.pick(backlog, trio.current_time())
            await self._dispatch(backlog[name])

    async def _dispatch(self, queue: deque[Queued]) -> None:
        model = queue[0].request.model
        same_version = itertools.takewhile(lambda q: q.request.model is model, queue)
        rows = [q.request.rows for q in same_version]
        cap = self._config.for_model(model.name).max_batch_size
        count, size = choose_batch(rows, model.compiled_batch_sizes, cap)
        batch = [queue.popleft() for _ in range(count)]
        started_ns = time.perf_counter_ns()
        try:
            weights = await self._weights.ensure_resident(model)
            result = await self._executor.run(model, size, weights, [q.request.inputs for q in batch],
                                              [q.request.rows for q in batch])
        except Exception as exc:  # an XLA runtime failure fails this batch only
            log.exception("model %s: execution at batch size %d failed", model.name, size)
            error = InternalError(f"model '{model.name}': execution failed: {type(exc).__name__}: {exc}")
            for q in batch:
                self._fail(q.request, error)
            return
        total_rows = sum(rows[:count])
        self._stats.record_execution(model.name, size, total_rows, result.compute_input_ns,
                                     result.compute_infer_ns, result.compute_output_ns)
        if self._metrics is not None:
            self._metrics.observe_execution(model.name, size, total_rows)
        done_ns = time.perf_counter_ns()
        now_ms = time.time_ns() // 1_000_000
        for q, outputs in zip(batch, result.per_request):
            request = q.request
            queue_ns = max(0, started_ns - request.received_ns)
            self._stats.record_success(model.name, done_ns - request.received_ns, queue_ns,
                                       result.compute_input_ns, result.compute_infer_ns,
                                       result.compute_output_ns, now_ms)
            request.reply(InferResult(outputs, size, queue_ns, result.compute_input_ns,
                                      result.compute_infer_ns, result.compute_output_ns))
