"""The scheduler actor: per-model bounded queues and the one dispatch loop of a worker.

Requests arrive on an inbox channel and wait in their model's queue (at most
``scheduler.max_queue_depth``). Whenever the device is free the dispatch loop asks the policy
(``scheduler.discipline``) which backlogged model goes next, takes as many of that model's
queued requests as fit the best compiled batch size (same version, never split, at most the
model's ``max_batch_size`` rows), makes its weights resident and runs one execution; the
outputs are cut back into each request's own rows. By default nothing waits on purpose: while
one execution runs, the queues fill, and the next dispatch takes what has gathered. A model
with ``batch_delay_seconds`` may instead be *held* while it is the only backlogged model (never
once the worker drains): its dispatch waits until ``batch_target_rows`` rows are queued, another
model gets a request, or its oldest request has waited the delay (never past a deadline less
the learned cost).

Every queued request is due for dispatch by its own deadline when it has one (the gRPC deadline
or Triton's ``timeout`` parameter), else by hand-over + ``dispatch_timeout_seconds`` (both on
the Trio clock, from when the frontend handed it over); the expiry task answers DEADLINE_EXCEEDED
for any request still queued at that moment, so it never runs. Under ``edf`` a request that cannot finish in time
given the learned execution cost is shed early, at admission or when its batch is formed.

A request handed over with a ``ticket`` can be cancelled (:class:`CancelRequest`: its client reset
the stream or closed the connection). If it is still queued it is taken out of its queue and
answered CANCELLED at once, so it never runs; once dispatched it runs to completion.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import trio

from xlaserve.bundle import ModelVersion
from xlaserve.config import SchedulerConfig
from xlaserve.config.schema import MAX_WEIGHT, MIN_WEIGHT
from xlaserve.errors import (Cancelled, DeadlineExceeded, InternalError, QueueFull, XlaserveError,
                             describe_exception)
from xlaserve.runtime.weights import WeightCache
from xlaserve.tracing import Execution
from xlaserve.worker.batching import BatchPlan, plan_batch, smallest_holding
from xlaserve.worker.executor import Executor
from xlaserve.worker.messages import CancelRequest, DropModel, InferRequest, InferResult, SchedulerMessage
from xlaserve.worker.policy import Candidate, ColdDeferral, CostModel, CostSnapshot, Policy, make_policy
from xlaserve.worker.stats import StatsBook

log = logging.getLogger("xlaserve.scheduler")

# rejection reasons, as the ``xlaserve_rejections`` metric labels them
QUEUE_FULL = "queue_full"
DEADLINE_EXPIRED = "deadline_expired"     # the request's own deadline passed while queued
DEADLINE_SHED = "deadline_shed"           # edf: could not finish in time given the learned cost
DISPATCH_TIMEOUT = "dispatch_timeout"     # no deadline of its own; waited scheduler.dispatch_timeout_seconds
MODEL_DROPPED = "model_dropped"
EXECUTION_FAILED = "execution_failed"
WEIGHTS_UNAVAILABLE = "weights_unavailable"  # the weight cache could not make the model resident
CANCELLED = "cancelled"                   # its client went away (stream reset, connection closed) while queued
#: stale entries (requests no longer queued) the expiry heap may hold beyond its live ones before
#: it is rebuilt without them: each answered request leaves its entry behind until its
#: dispatch_by comes up, and a client's deadline may be years away (Triton's ``timeout`` of
#: 2**64-1 microseconds), so without a rebuild every such request grew the heap for good
EXPIRY_SLACK = 1024
#: turns the dispatch loop yields, at most, for a message run() holds (_message_in_hand): enough
#: for the random order of a turn's tasks, few enough that a steady stream cannot hold it up
IN_HAND_TURNS = 4


@dataclass(frozen=True, slots=True)
class Queued:
    request: InferRequest    # its deadline and enqueued_at (hand-over) are on the Trio clock
    seq: int                 # admission order across all models
    dispatch_by: float       # its deadline, or enqueued_at + dispatch_timeout_seconds without one


@dataclass(frozen=True, slots=True)
class _Planned:
    """A backlogged model's next batch, planned from its queue as it is now."""

    order: list[Queued]      # the queue in the order its batch was chosen from
    plan: BatchPlan
    candidate: Candidate     # the dispatch, were its weights resident


@dataclass(frozen=True, slots=True)
class ModelPolicy:
    """A model's effective scheduling settings (config, then run-time overrides)."""

    model: str
    weight: float
    max_batch_size: int | None
    batch_delay_seconds: float = 0.0
    batch_target_rows: int | None = None     # None: the largest compiled size (capped)


class Scheduler:
    """Owns the queues, the learned costs and the policy; nothing else touches them.

    ``executor`` needs ``await run(model, size, weights, inputs, rows) -> BatchResult``;
    ``weights`` needs ``await ensure_resident(model) -> weights`` and ``hint_next(model)`` (the
    prefetch hint). Both are used on the dispatch loop only, so tests can pass fakes that
    ``await trio.sleep(cost)``. A weight cache that also answers ``load_estimate(model) ->
    seconds`` (0 when resident) and takes ``set_queued(models)`` makes the scheduler
    cache-aware (:class:`~xlaserve.worker.policy.ColdDeferral`, ``cold_defer_dispatches``);
    without them every model counts as resident.
    """

    def __init__(self, config: SchedulerConfig, executor: Executor, weights: WeightCache,
                 stats: StatsBook, metrics=None, policy: Policy | None = None, tracing=None) -> None:
        self._config = config
        self._executor = executor
        self._weights = weights
        self._stats = stats
        self._metrics = metrics
        self._costs = CostModel(config.ema_halflife_seconds)
        self._overrides: dict[str, dict[str, float | int | None]] = {}
        self._policy = policy or make_policy(config.discipline, self._costs, self.weight)
        self._load_estimate = getattr(weights, "load_estimate", None)
        self._set_queued = getattr(weights, "set_queued", None)
        self._cold = ColdDeferral(self._policy, self._costs,
                                  config.cold_defer_dispatches if self._load_estimate is not None else 0)
        self._edf = config.discipline == "edf" and policy is None
        self._queues: dict[str, deque[Queued]] = {}             # the backlogged models' queues (never empty)
        #: each backlogged model's next batch as last planned, kept while its queue and settings
        #: stay as they were: a dispatch plans again only the models whose queues changed since
        #: the last one (those that got requests, the one dispatched), not every backlogged model
        self._plans: dict[str, _Planned] = {}
        self._queued: set[int] = set()                          # seqs still waiting
        self._tickets: dict[object, Queued] = {}                # the cancellable ones among them
        self._cancelled: dict[str, set[int]] = {}               # answered CANCELLED, still in a queue
        self._expiry: list[tuple[float, int, str]] = []         # heap of (dispatch_by, seq, model)
        self._seq = itertools.count()
        self._wakeup = trio.Event()
        self._expiry_changed = trio.Event()
        self._armed_at = math.inf
        self._closing = False
        self._draining = False       # the worker drains: no hold (see drain)
        self._inbox: trio.MemoryReceiveChannel[SchedulerMessage] | None = None
        self._answers: deque[tuple[list[Queued], list[int], int, object]] = deque()   # executed, not yet answered
        self._answers_ready = trio.Event()
        self._dispatch_done = False
        #: while a model's dispatch is held: (model, rows that end the hold, the dispatch_by before
        #: which a new request of its ends the hold sooner: the hold's end plus the cost it allowed)
        self._held: tuple[str, int, float] | None = None
        # Tracing on: each dispatch records its stages' times for the traced requests of the
        # batch (xlaserve.tracing); off, a dispatch pays this one check.
        self._tracing = tracing is not None
        self._batches = itertools.count(1)
        #: Replies to one batch are made inside ``reply_batch()``; the worker sets the gRPC
        #: server's write_batch here so that they leave in one send per connection.
        self.reply_batch: Callable[[], AbstractContextManager] = nullcontext

    # ---- policy settings -----------------------------------------------------------------
    def _setting(self, model: str, key: str):
        """A model's scheduling setting: its run-time override (set_policy), else its config."""
        override = self._overrides.get(model, {})
        return override[key] if key in override else getattr(self._config.for_model(model), key)

    def weight(self, model: str) -> float:
        return float(self._setting(model, "weight"))

    def max_batch_size(self, model: str) -> int | None:
        return self._setting(model, "max_batch_size")

    def batch_delay_seconds(self, model: str) -> float:
        return float(self._setting(model, "batch_delay_seconds"))

    def batch_target_rows(self, model: str) -> int | None:
        return self._setting(model, "batch_target_rows")

    def set_policy(self, model: str, weight: float | None = None, max_batch_size: int | None = None,
                   batch_delay_seconds: float | None = None, batch_target_rows: int | None = None) -> ModelPolicy:
        """Override a model's scheduling settings from now on (None: unchanged;
        ``batch_target_rows=0``: back to the default target).

        A new weight changes the ``fair`` shares from the next dispatch on; a new hold applies
        from the next time the dispatch loop looks at the model."""
        if weight is not None and not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise ValueError(f"weight of model '{model}' must be in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], got {weight}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size of model '{model}' must be >= 1, got {max_batch_size}")
        if batch_delay_seconds is not None and not 0 <= batch_delay_seconds < math.inf:
            raise ValueError(f"batch_delay_seconds of model '{model}' must be >= 0 and finite, "
                             f"got {batch_delay_seconds}")
        if batch_target_rows is not None and batch_target_rows < 0:
            raise ValueError(f"batch_target_rows of model '{model}' must be >= 1, or 0 for the default, "
                             f"got {batch_target_rows}")
        override = self._overrides.setdefault(model, {})
        if weight is not None:
            override["weight"] = weight
        if max_batch_size is not None:
            override["max_batch_size"] = max_batch_size
        if batch_delay_seconds is not None:
            override["batch_delay_seconds"] = batch_delay_seconds
        if batch_target_rows is not None:
            override["batch_target_rows"] = batch_target_rows or None
        self._plans.pop(model, None)    # max_batch_size bounds its next batch
        self._wakeup.set()      # a hold in progress is judged again under the new settings
        return self.policy(model)

    def drain(self) -> None:
        """The worker drains (it takes no new calls and waits for the ones in flight): from now
        on no dispatch is held for more rows. A hold waits for requests that can no longer
        come, so it would keep the requests queued, and with them the drain, waiting on an
        idle device for up to ``batch_delay_seconds`` or past the drain's limit."""
        self._draining = True
        self._wakeup.set()      # a hold in progress ends now

    def policy(self, model: str) -> ModelPolicy:
        return ModelPolicy(model, self.weight(model), self.max_batch_size(model),
                           self.batch_delay_seconds(model), self.batch_target_rows(model))

    # ---- introspection (snapshots) -------------------------------------------------------
    def depth(self, model: str) -> int:
        return len(self._queues.get(model, ()))

    def costs(self) -> tuple[CostSnapshot, ...]:
        """The learned execution time of every (model, compiled batch size) measured so far."""
        return self._costs.snapshot()

    # ---- the actor ---------------------------------------------------------------------
    async def run(self, inbox: trio.MemoryReceiveChannel[SchedulerMessage], *,
                  task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``inbox`` closes, then finish what is queued and return."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._dispatch_loop)
            nursery.start_soon(self._answer_loop)
            nursery.start_soon(self._expiry_loop)
            task_status.started()
            async with inbox:
                self._inbox = inbox
                async for message in inbox:
                    self._handle(message)
                    self._drain_inbox()
            self._closing = True
            self._wakeup.set()
            self._expiry_changed.set()

    def _handle(self, message: SchedulerMessage) -> None:
        match message:
            case InferRequest():
                self._admit(message)
            case CancelRequest(ticket=ticket):
                self._cancel(ticket)
            case DropModel(name=name, error=error):
                self._drop(name, error)

    def _drain_inbox(self) -> None:
        """Take every message already waiting, without yielding: a burst of requests that
        arrived while the device was busy is admitted whole before the next batch is formed.
        Cancelled requests leave their queues here, before any batch is planned."""
        inbox = self._inbox
        while inbox is not None:
            try:
                message = inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self._handle(message)
        if self._cancelled:
            self._remove_cancelled()

    def _message_in_hand(self) -> bool:
        """Whether :meth:`run` may hold a message it has not handled yet: the inbox is open and
        run is not waiting on it. A message sent while its receiver waits goes to that task
        directly, leaving the channel before the task runs, so a drain meanwhile takes the
        messages sent after it (the rest of a burst) and not it."""
        inbox = self._inbox
        return inbox is not None and not self._closing and inbox.statistics().tasks_waiting_receive == 0

    def _admit(self, request: InferRequest) -> None:
        name = request.model.name
        now = trio.current_time()
        queue = self._queues.get(name, ())
        limit = self._config.max_queue_depth
        if len(queue) >= limit and name in self._cancelled:   # cancelled ones hold no slot
            self._remove_cancelled()
            queue = self._queues.get(name, ())
        if len(queue) >= limit:
            self._reject(request, QUEUE_FULL, QueueFull(
                f"model '{name}' has {len(queue)} requests queued, the limit (scheduler.max_queue_depth) "
                f"is {limit}; retry later"))
            return
        deadline = request.deadline
        if self._edf and deadline < math.inf and not self._can_finish(request.model, request.rows, now, deadline):
            self._reject(request, DEADLINE_SHED, DeadlineExceeded(
                f"model '{name}': {max(0.0, deadline - now) * 1e3:.3f} ms were left before the request's deadline, "
                f"less than its learned execution time; shed without running"))
            return
        if deadline <= now:
            self._reject(request, DEADLINE_EXPIRED, DeadlineExceeded(
                f"model '{name}': the request's deadline had already passed when it was queued"))
            return
        # A client that set a deadline decided how long it waits, longer or shorter than the
        # dispatch timeout; the timeout bounds only the requests that said nothing. Counted from
        # when the frontend handed it over, like the deadline.
        dispatch_by = (deadline if deadline < math.inf
                       else request.enqueued_at + self._config.dispatch_timeout_seconds)
        seq = next(self._seq)
        queued = Queued(request, seq, dispatch_by)
        queue = self._queues.get(name)
        if queue is None:
            queue = self._queues[name] = deque()
        queue.append(queued)
        self._plans.pop(name, None)
        self._queued.add(seq)
        if request.ticket is not None:
            self._tickets[request.ticket] = queued
        heap = self._expiry
        if len(heap) > 2 * len(self._queued) + EXPIRY_SLACK:
            # in place: the expiry task holds the list; amortized, a rebuild costs O(1) per request
            heap[:] = [entry for entry in heap if entry[1] in self._queued]
            heapq.heapify(heap)
        heapq.heappush(heap, (dispatch_by, seq, name))
        if dispatch_by < self._armed_at:
            self._expiry_changed.set()
        held = self._held
        if held is None or held[0] != name or dispatch_by < held[2] or sum(q.request.rows for q in queue) >= held[1]:
            self._wakeup.set()      # (sooner than the hold's end allows for: judged again, with it)
        if self._metrics is not None:
            self._metrics.set_queue_depth(name, len(queue))

    def _can_finish(self, model: ModelVersion, rows: int, now: float, deadline: float) -> bool:
        size = smallest_holding(model.compiled_batch_sizes, rows) or model.compiled_batch_sizes[-1]
        cost = self._costs.estimate(model.name, size)
        return cost is None or now + cost <= deadline

    def _drop(self, name: str, error: XlaserveError) -> None:
        for queued in self._queues.pop(name, ()):
            if queued.seq in self._queued:          # not cancelled meanwhile
                self._unqueue(queued)
                self._reject(queued.request, MODEL_DROPPED, error)
        self._plans.pop(name, None)
        self._cancelled.pop(name, None)
        self._costs.forget(name)
        self._wakeup.set()           # a hold on this model ends with its queue
        if self._metrics is not None:
            self._metrics.set_queue_depth(name, 0)

    def _requeue(self, name: str, queue: deque[Queued]) -> None:
        """``queue`` is now the model's queue: it leaves the backlog when empty, and its next
        batch is planned again at the next dispatch."""
        if queue:
            self._queues[name] = queue
        else:
            self._queues.pop(name, None)
        self._plans.pop(name, None)

    def _unqueue(self, queued: Queued) -> None:
        """``queued`` no longer waits (dispatched or answered); its queue is the caller's to mend."""
        self._queued.discard(queued.seq)
        ticket = queued.request.ticket
        if ticket is not None:
            self._tickets.pop(ticket, None)

    def _cancel(self, ticket: object) -> None:
        """Answer the queued request of ``ticket`` CANCELLED; it leaves its queue before the next
        batch is planned (:meth:`_remove_cancelled`). Not queued (dispatched, answered): nothing."""
        queued = self._tickets.pop(ticket, None)
        if queued is None:
            return
        self._queued.discard(queued.seq)
        request = queued.request
        name = request.model.name
        self._cancelled.setdefault(name, set()).add(queued.seq)
        waited = trio.current_time() - request.enqueued_at
        self._reject(request, CANCELLED, Cancelled(
            f"model '{name}': the client cancelled request '{request.request_id}' (it reset the stream or "
            f"closed the connection) after {waited * 1e3:.1f} ms in the queue; it was not run"))

    def _remove_cancelled(self) -> None:
        cancelled, self._cancelled = self._cancelled, {}
        for name, seqs in cancelled.items():
            queue = self._queues.get(name)
            if queue is None:
                continue
            kept = deque(q for q in queue if q.seq not in seqs)
            self._requeue(name, kept)
            if self._metrics is not None:
                self._metrics.set_queue_depth(name, len(kept))
        self._wakeup.set()          # a hold is judged again without them

    def _reject_all(self, batch: Sequence[Queued], reason: str, error: XlaserveError) -> None:
        for q in batch:
            self._reject(q.request, reason, error)

    def _reject(self, request: InferRequest, reason: str, error: XlaserveError) -> None:
        self._stats.record_failure(request.model.name, time.perf_counter_ns() - request.received_ns)
        if self._metrics is not None:
            self._metrics.observe_rejection(request.model.name, reason)
        request.reply(error)

    # ---- expiry --------------------------------------------------------------------------
    async def _expiry_loop(self) -> None:
        """Answer DEADLINE_EXCEEDED for every request still queued at its ``dispatch_by``."""
        heap = self._expiry
        while True:
            while heap and heap[0][1] not in self._queued:
                heapq.heappop(heap)
            if not heap and self._closing:
                return
            self._armed_at = heap[0][0] if heap else math.inf
            if self._armed_at <= trio.current_time():
                self._expire(trio.current_time())
                continue
            self._expiry_changed = trio.Event()
            with trio.move_on_at(self._armed_at):
                await self._expiry_changed.wait()

    def _expire(self, now: float) -> None:
        heap = self._expiry
        expired: dict[str, set[int]] = {}
        while heap and heap[0][0] <= now:
            _, seq, name = heapq.heappop(heap)
            if seq in self._queued:
                self._queued.discard(seq)
                expired.setdefault(name, set()).add(seq)
        for name, seqs in expired.items():
            queue = self._queues.get(name, ())
            kept: deque[Queued] = deque()
            for queued in queue:
                if queued.seq not in seqs:
                    kept.append(queued)
                    continue
                self._unqueue(queued)
                waited = now - queued.request.enqueued_at
                if queued.request.deadline < math.inf:
                    self._reject(queued.request, DEADLINE_EXPIRED, DeadlineExceeded(
                        f"model '{name}': the request's deadline passed after {waited * 1e3:.1f} ms in the "
                        f"queue ({len(queue) - 1} others queued for this model); it was not run"))
                else:
                    self._reject(queued.request, DISPATCH_TIMEOUT, DeadlineExceeded(
                        f"model '{name}': waited {waited:.3f} s for dispatch, longer than "
                        f"scheduler.dispatch_timeout_seconds ({self._config.dispatch_timeout_seconds} s), "
                        f"which bounds requests without a deadline of their own; it was not run"))
            self._requeue(name, kept)
            if self._metrics is not None:
                self._metrics.set_queue_depth(name, len(kept))

    # ---- dispatch ------------------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        woken = False
        while True:
            # Let whatever is already runnable (requests the frontend is decoding) run before
            # the next batch is formed: a reschedule, not a wait. Skipped right after waking
            # (everything runnable ran meanwhile), and while the last batch is still to be
            # answered so that the next execution starts first and the answers are encoded
            # while it runs.
            if not woken and not self._answers:
                await trio.lowlevel.cancel_shielded_checkpoint()
            woken = False
            self._drain_inbox()
            for _ in range(IN_HAND_TURNS):
                if not self._message_in_hand():
                    break
                # run() was handed the first message of a burst and has not admitted it yet:
                # let it (Trio runs a turn's tasks in random order, so this may take more than
                # one), or that request would run alone in a batch of its own after the rest
                await trio.lowlevel.cancel_shielded_checkpoint()
                self._drain_inbox()
            backlog = self._queues
            if not backlog:
                if self._closing:
                    self._dispatch_done = True
                    self._answers_ready.set()
                    self._expiry_changed.set()
                    return
                self._wakeup = trio.Event()
                await self._wakeup.wait()
                woken = True
                continue
            now = trio.current_time()
            plans = self._plans
            candidates: dict[str, Candidate] = {}
            estimate = self._load_estimate
            for name, queue in backlog.items():
                planned = plans.get(name)
                if planned is None:
                    planned = plans[name] = self._planned(name, queue)
                candidate = planned.candidate
                if estimate is not None:
                    load = estimate(planned.order[0].request.model)
                    if load > 0:                # cold: its batch's most urgent request bounds its wait
                        order = planned.order
                        candidate = Candidate(name, candidate.size, candidate.oldest_seq,
                                              min(order[i].dispatch_by for i in planned.plan.indices), True, load)
                candidates[name] = candidate
            if len(backlog) == 1 and not self._closing and not self._draining:
                (name, queue), = backlog.items()
                until, target, cost = self._hold_until(name, queue, plans[name].plan, now)
                if until > now:     # the only backlogged model waits for more rows
                    self._held = (name, target, until + cost)
                    self._wakeup = trio.Event()
                    with trio.move_on_at(until):
                        await self._wakeup.wait()
                    self._held = None
                    woken = True
                    continue
            decision = self._cold.decide(candidates, now)
            name = decision.model
            order, plan = plans[name].order, plans[name].plan
            batch = [order[i] for i in plan.indices]
            if self._edf and self._shed(name, batch, plan.size, now):
                continue
            self._take(name, batch)
            if self._set_queued is not None:     # their device copies are evicted last
                self._set_queued([q[0].request.model for q in self._queues.values() if q])
            # (the dispatched model's plan is gone with its batch: never the hint)
            cold = plans.get(decision.next_cold) if decision.next_cold else None
            hint = cold.order[0].request.model if cold is not None else None
            await self._dispatch(name, batch, plan.size, hint)

    def _planned(self, name: str, queue: deque[Queued]) -> "_Planned":
        """Plan the model's next batch and describe it as a warm :class:`Candidate`."""
        order, plan = self._plan(name, queue)
        due = order[0].dispatch_by      # under edf, _plan ordered by dispatch_by
        return _Planned(order, plan, Candidate(name, plan.size, queue[0].seq, due))

    def _plan(self, name: str, queue: deque[Queued]) -> tuple[list[Queued], BatchPlan]:
        """The order in which ``queue`` is considered for the next batch, and the batch."""
        if self._edf:
            order = sorted(queue, key=lambda q: (q.dispatch_by, q.seq))
        else:
            order = list(itertools.islice(queue, 0, 4096))
        model = order[0].request.model
        if any(q.request.model is not model for q in order):
            order = [q for q in order if q.request.model is model]  # one version per execution
        try:
            plan = plan_batch([q.request.rows for q in order], model.compiled_batch_sizes,
                              self.max_batch_size(name))
        except ValueError:
            # the frontend bounds rows by the largest compiled size; this is a bug if it happens
            plan = BatchPlan((0,), order[0].request.rows, model.compiled_batch_sizes[-1])
        return order, plan

    def _hold_until(self, name: str, queue: deque[Queued], plan: BatchPlan,
                    now: float) -> tuple[float, int, float]:
        """(until when the model's dispatch may be held for more rows, the rows that end the
        hold, the learned cost of the batch it waits for: a request due before ``until`` plus
        that cost ends it sooner). ``until <= now``: dispatch now. See ``batch_delay_seconds``."""
        delay = self.batch_delay_seconds(name)
        if not delay:
            return -math.inf, 0, 0.0
        sizes = queue[0].request.model.compiled_batch_sizes
        target = min(self.batch_target_rows(name) or sizes[-1], self.max_batch_size(name) or sizes[-1], sizes[-1])
        if plan.rows >= target or sum(q.request.rows for q in queue) >= target:
            return -math.inf, target, 0.0   # (requests that do not pack into one batch: no hold)
        # the oldest request (queue order is admission order) waits at most the delay, and no
        # request is held past the moment it must start so as to finish by its deadline
        cost = self._costs.charge(name, smallest_holding(sizes, target) or sizes[-1])
        return min(queue[0].request.enqueued_at + delay,
                   min(q.dispatch_by for q in queue) - cost), target, cost

    def _shed(self, name: str, batch: list[Queued], size: int, now: float) -> bool:
        """edf: answer the requests of ``batch`` that cannot finish by their deadline; any shed?"""
        cost = self._costs.estimate(name, size)
        if cost is None:
            return False
        late = [q for q in batch if q.request.deadline < now + cost]
        if not late:
            return False
        self._take(name, late)
        for q in late:
            left = max(0.0, q.request.deadline - now)
            self._reject(q.request, DEADLINE_SHED, DeadlineExceeded(
                f"model '{name}': {left * 1e3:.1f} ms were left before the request's deadline but an execution "
                f"at batch size {size} takes {cost * 1e3:.1f} ms (learned); shed without running"))
        return True

    def _take(self, name: str, batch: Sequence[Queued]) -> None:
        """Remove ``batch`` from the model's queue."""
        queue = self._queues[name]
        for q in batch:
            self._unqueue(q)
        if all(queue[i] is q for i, q in enumerate(batch)):
            for _ in batch:
                queue.popleft()
        else:
            taken = {q.seq for q in batch}
            queue = deque(q for q in queue if q.seq not in taken)
        self._requeue(name, queue)
        if self._metrics is not None:
            self._metrics.set_queue_depth(name, len(queue))

    async def _dispatch(self, name: str, batch: list[Queued], size: int, hint: ModelVersion | None = None) -> None:
        """Make the weights resident, run ``batch`` at ``size`` and queue its answers. ``hint``:
        the cold model likely dispatched next, to prefetch (None: the oldest other request's)."""
        model = batch[0].request.model
        rows = [q.request.rows for q in batch]
        started_ns = time.perf_counter_ns()
        try:
            weights = await self._weights.ensure_resident(model)
        except Exception as exc:
            if isinstance(exc, XlaserveError):   # the weights cannot be made resident: say why, as is
                error = exc
            else:                                # a bug or a device failure fails this batch only
                log.exception("model %s: making its weights resident failed", model.name)
                error = InternalError(f"model '{model.name}': making its weights resident failed: "
                                      f"{type(exc).__name__}: {describe_exception(exc)}")
            if self._tracing:
                self._trace_failed(batch, size, started_ns, time.perf_counter_ns(), 0, str(error))
            self._reject_all(batch, WEIGHTS_UNAVAILABLE, error)
            return
        weights_ns = time.perf_counter_ns() if self._tracing else 0
        try:
            # Prefetch hint: the cold model the policy expects to run next, else the model of
            # the oldest other queued request.
            if hint is None:
                waiting = [q[0] for n, q in self._queues.items() if q and n != name]
                if waiting:
                    hint = min(waiting, key=lambda q: q.seq).request.model
            if hint is not None:
                self._weights.hint_next(hint)
            started = trio.current_time()
            result = await self._executor.run(model, size, weights, [q.request.inputs for q in batch], rows,
                                              backlog=bool(self._queued))
            finished = trio.current_time()
        except Exception as exc:  # an XLA runtime failure fails this batch only
            log.exception("model %s: execution at batch size %d failed", model.name, size)
            error = InternalError(
                f"model '{model.name}': execution at batch size {size} failed: {type(exc).__name__}: "
                f"{describe_exception(exc)}")
            if self._tracing:
                self._trace_failed(batch, size, started_ns, weights_ns, time.perf_counter_ns(), str(error))
            self._reject_all(batch, EXECUTION_FAILED, error)
            return
        queue_ns = [max(0, started_ns - q.request.received_ns) for q in batch]
        try:
            self._account(name, batch, size, rows, queue_ns, started_ns, weights_ns, finished - started, finished,
                          result)
        except Exception:   # a bug in the bookkeeping: logged, and the batch is still answered
            log.exception("model %s: recording the execution at batch size %d failed", name, size)
        self._answers.append((batch, queue_ns, size, result))
        if result.inline:
            # Nothing ran meanwhile, so nothing is gained by answering later: answer now
            # (and anything still pending before it), without waking the answer task.
            self._answer_pending()
        else:
            self._answers_ready.set()

    def _account(self, name: str, batch: list[Queued], size: int, rows: list[int], queue_ns: list[int],
                 started_ns: int, weights_ns: int, seconds: float, finished: float, result) -> None:
        """What an execution leaves besides its answers: the learned cost, statistics, metrics
        and the traces of its requests."""
        self._costs.observe(name, size, seconds, finished)
        total_rows = sum(rows)
        self._stats.record_execution(name, size, total_rows, result.compute_input_ns,
                                     result.compute_infer_ns, result.compute_output_ns)
        done_ns = time.perf_counter_ns()
        if self._tracing:
            self._trace_batch(batch, size, started_ns, weights_ns, done_ns, None, result)
        now_ms = time.time_ns() // 1_000_000
        if self._metrics is not None:
            compute_ns = result.compute_input_ns + result.compute_infer_ns + result.compute_output_ns
            self._metrics.observe_dispatch(name, size, total_rows, queue_ns, compute_ns)
        n = len(batch)
        self._stats.record_successes(name, n, sum(done_ns - q.request.received_ns for q in batch), sum(queue_ns),
                                     n * result.compute_input_ns, n * result.compute_infer_ns,
                                     n * result.compute_output_ns, now_ms)

    def _trace_failed(self, batch: list[Queued], size: int, started_ns: int, weights_ns: int, done_ns: int,
                      error: str) -> None:
        """:meth:`_trace_batch` for a failed batch, whose requests are rejected next whatever it raises."""
        try:
            self._trace_batch(batch, size, started_ns, weights_ns, done_ns, error)
        except Exception:
            log.exception("model %s: tracing the failed batch failed", batch[0].request.model.name)

    def _trace_batch(self, batch: list[Queued], size: int, started_ns: int, weights_ns: int, done_ns: int,
                     error: str | None, result=None) -> None:
        """The traced requests of ``batch`` share one :class:`~xlaserve.tracing.Execution`
        record: the weight load between ``started_ns`` and ``weights_ns`` (0: it failed at
        ``done_ns``), the execution up to ``done_ns``, the batch's attributes. Each request's
        queue, weights and execution spans are made from it at export. ``error``: why the batch
        failed."""
        model = batch[0].request.model
        batch_id = next(self._batches)
        loaded = weights_ns != 0
        hit = getattr(self._weights, "last_hit", None)
        weights = {"xlaserve.weights.bytes": model.weight_bytes if model.weights is not None else 0,
                   "xlaserve.batch.id": batch_id}
        if loaded and hit is not None:
            weights["xlaserve.weights.hit"] = hit
            weights["xlaserve.weights.outcome"] = "hit" if hit else "miss"
        execution = {"xlaserve.batch.id": batch_id, "xlaserve.batch.size": sum(q.request.rows for q in batch),
                     "xlaserve.batch.requests": len(batch), "xlaserve.batch.compiled_size": size}
        if result is not None:
            execution["xlaserve.compute.input_ns"] = result.compute_input_ns
            execution["xlaserve.compute.infer_ns"] = result.compute_infer_ns
            execution["xlaserve.compute.output_ns"] = result.compute_output_ns
        record = Execution(started_ns, weights_ns, done_ns, error, {"xlaserve.model": model.name,
                                                                   "xlaserve.batch.id": batch_id},
                           weights, execution)
        for q in batch:
            trace = q.request.trace
            if trace is not None:
                trace.execution = record

    def _answer_pending(self) -> None:
        """Reply to every executed batch not yet answered. Replying encodes each response (the
        frontend's part of the reply)."""
        with self.reply_batch():
            while self._answers:
                batch, queue_ns, size, result = self._answers.popleft()
                for q, waited_ns, outputs in zip(batch, queue_ns, result.per_request):
                    try:
                        q.request.reply(InferResult(outputs, size, waited_ns, result.compute_input_ns,
                                                    result.compute_infer_ns, result.compute_output_ns))
                    except Exception:  # a bug in one reply must not lose the others
                        log.exception("model %s: replying to request %r failed", q.request.model.name,
                                      q.request.request_id)

    async def _answer_loop(self) -> None:
        """Reply to batches executed on a worker thread. This runs here rather than in the
        dispatch loop so that the next execution is already on the device while the previous
        batch's responses are encoded."""
        while True:
            self._answer_pending()
            if self._closing and self._dispatch_done:
                return
            self._answers_ready = trio.Event()
            await self._answers_ready.wait()
