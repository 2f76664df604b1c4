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

User code is contained. Whatever a hook or ``run`` raises (``SystemExit`` and
``KeyboardInterrupt`` included: in a hook's thread they can only come from the hook itself) or
returns (checked by :func:`xlaserve._hooks.conform`, which raises nothing but
:class:`InternalError`), its own request is answered INTERNAL naming the model, the hook and
what went wrong, the traceback is logged, ``xlaserve_hook_failures_total{model,hook}`` counts it,
and the worker goes on. A request whose hook is still running (or waiting for a hook thread)
at its deadline is answered DEADLINE_EXCEEDED then; the hook's late result is dropped. Every
request gets exactly one answer (:class:`_Answer`): the first of the hook's result, the
deadline, an unexpected error (logged, INTERNAL) or the worker stopping (UNAVAILABLE).
"""
from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import trio
from grpclib.const import Status
from outcome import Error, capture

from xlaserve._hooks import NamedTensor, conform, describe_exception
from xlaserve.bundle import ModelVersion
from xlaserve.codec import encoded_size
from xlaserve.errors import (Cancelled, DeadlineExceeded, FailedPrecondition, InternalError, ModelNotFound,
                             ModelNotReady, QueueFull, ResourceExhausted, Unavailable, XlaserveError, cut_text,
                             internal_message)
from xlaserve.manifest import TensorDecl
from xlaserve.tracing import RequestTrace
from xlaserve.worker.messages import CancelRequest, InferRequest, InferResult, Outcome, Reply, SchedulerMessage
from xlaserve.worker.registry import ModelState

log = logging.getLogger("xlaserve.inference")

HOOK_THREADS = 16
"""Hooks of different requests that may run at once. Hooks that release the GIL (NumPy, I/O)
overlap with each other and with the device; pure-Python hooks share the GIL."""
META_THREADS = 64
"""Meta requests whose ``run`` may be in progress at once; each mostly waits on its sub-calls."""

FailureCounter = Callable[[str, str], None]
"""Counts one failure of a model's hook: ``(model, hook)``, hook ``preprocess``, ``postprocess``
or ``run`` (the labels of ``xlaserve_hook_failures_total``); called from any thread."""


def _uncounted(model: str, hook: str) -> None:
    pass


def _guarded_counter(counter: FailureCounter, what: str) -> FailureCounter:
    """``counter``, whose failure is logged and goes no further: it is called on the paths that
    answer a request (the deadline task, a stopping worker's), which must answer whatever it does."""
    if counter is _uncounted:
        return counter

    def count(model: str, hook: str) -> None:
        try:
            counter(model, hook)
        except Exception:
            log.exception("counting %s of model '%s' (%s) failed", what, model, hook)
    return count


@dataclass(frozen=True, slots=True)
class ReplyLimit:
    """The most bytes the reply to a request may carry (``max_bytes``, set by the node-file key
    ``key``), and which of its client outputs the reply carries as raw bytes (``outputs``; None:
    all of them; not those written to shared memory, nor those REST sends as JSON text).

    The frontend refuses a larger reply anyway, but only once it has encoded it on the Trio
    thread; what a hook or meta ``run`` returned is checked against it in the hook's own thread
    (:func:`check_reply_size`), so a postprocess returning gigabytes costs the dispatch loop
    nothing."""

    max_bytes: int
    outputs: frozenset[str] | None = None
    key: str = "endpoints.max_send_msg_bytes"


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
    trace: RequestTrace | None = None   # its spans, when it is traced (xlaserve.tracing)
    reply_limit: ReplyLimit | None = None   # checked against hook and run outputs; None: not checked


class Stages:
    """A request that runs as a task (hooks, meta): whether its client went away, and the
    tickets of its requests now in the scheduler. Trio thread only, except ``cancelled``, which
    a meta thread reads."""

    __slots__ = ("cancelled", "queued", "waiting")

    def __init__(self) -> None:
        self.cancelled = False
        self.queued: set[object] = set()
        #: its hook's work waiting in the hook pool, and what answers it if the client goes away
        #: first (taken out of the queue then: answered at once, not when a thread frees)
        self.waiting: tuple[Callable[[], None], Callable[[], None]] | None = None


class _Answer:
    """A request's one answer. The first call replies; later ones (a hook's result after the
    deadline answered, a deadline after the hook answered) are dropped. Callable from any
    thread: the one-element list's ``pop`` is atomic, so exactly one caller gets it."""

    __slots__ = ("_reply", "_left", "after")

    def __init__(self, reply: Reply) -> None:
        self._reply = reply
        self._left = [None]
        #: run once, by the call that answers, after its reply (any thread: must not raise)
        self.after: Callable[[], None] | None = None

    @property
    def done(self) -> bool:
        return not self._left

    def __call__(self, outcome: Outcome) -> bool:
        """Reply with ``outcome`` unless the request was answered; whether this call did."""
        try:
            self._left.pop()
        except IndexError:
            return False
        try:
            self._reply(outcome)
        except Exception:
            log.exception("replying to a request failed")
        if self.after is not None:
            self.after()
        return True


@dataclass(frozen=True, slots=True)
class ThreadPoolStatistics:
    """A snapshot of one pool of hook threads: the most threads it runs (``size``), how many run
    user code now (``busy``: a hook that never returns counts for good) and how many requests
    wait for one of them (``waiting``). ``busy == size`` with ``waiting > 0`` is the sign of
    hung hooks starving every hooked model."""

    size: int
    busy: int
    waiting: int


@dataclass(frozen=True, slots=True)
class HookThreads:
    """Both pools of an :class:`InferenceService`: ``hook`` runs preprocess and postprocess,
    ``meta`` a meta model's ``run``."""

    hook: ThreadPoolStatistics
    meta: ThreadPoolStatistics


class HookPool:
    """At most ``size`` daemon threads running hook work items, started as work arrives.

    A work item is a callable that handles its own errors; one that raises anyway (even
    ``SystemExit``) is logged and its thread goes on. A hook that never returns keeps its thread
    for good: the pool never grows past ``size``, so later work waits for another thread. Work
    whose request was answered while it waited is :meth:`withdraw`-n, so that what it holds (the
    request's tensors) goes with the answer: with every thread held by hung hooks, the queue
    would otherwise keep each later request's tensors for good. The threads are daemons, so such
    a thread does not hold the process open at exit.

    :meth:`statistics` says how many threads are busy and how much work waits, counted under
    the pool's lock where a thread takes and finishes work, so it holds on every path (the work
    returns, raises, is withdrawn)."""

    def __init__(self, size: int, name: str = "xlaserve-hook") -> None:
        self._size = size
        self._name = name
        self._work: collections.deque[Callable[[], None]] = collections.deque()
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._idle = 0              # threads waiting for work that no submit has woken yet
        self._busy = 0              # threads running a work item
        self.threads = 0

    def submit(self, work: Callable[[], None]) -> None:
        with self._lock:
            self._work.append(work)
            if self._idle:
                self._idle -= 1
                self._arrived.notify()
            elif self.threads < self._size:
                self.threads += 1
                threading.Thread(target=self._serve, name=f"{self._name}-{self.threads}", daemon=True).start()

    def withdraw(self, work: Callable[[], None]) -> bool:
        """Take ``work`` out of the queue unless a thread has taken it; whether this did."""
        with self._lock:
            try:
                self._work.remove(work)
            except ValueError:
                return False
            return True

    @property
    def size(self) -> int:
        """The most threads the pool runs."""
        return self._size

    def statistics(self) -> ThreadPoolStatistics:
        with self._lock:
            return ThreadPoolStatistics(self._size, self._busy, len(self._work))

    def _serve(self) -> None:
        while True:
            with self._lock:
                while not self._work:
                    self._idle += 1
                    self._arrived.wait()    # whoever wakes this thread took it off the idle count
                work = self._work.popleft()
                self._busy += 1
            try:
                work()
            except BaseException:           # a work item's bug must not end the thread
                log.exception("a hook work item failed")
            finally:
                del work
                with self._lock:
                    self._busy -= 1


class _MetaSlot:
    """One meta request's claim on the meta pool, as ``trio.to_thread.run_sync``'s limiter (it
    takes any object with these two methods): it passes both to the pool's limiter and remembers
    whether the request got a slot, so that a request answered at its deadline is told whether
    its ``run`` ran late or never started for want of a thread."""

    __slots__ = ("_limiter", "acquired")

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self._limiter = limiter
        self.acquired = False

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        await self._limiter.acquire_on_behalf_of(borrower)
        self.acquired = True

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(borrower)


class _FailureLog:
    """Logs a hook failure with its traceback. The first of each (model, hook, exception type)
    is always logged; repeats at most once per ``interval`` seconds, saying how many were not,
    so that a hook failing on every request does not flood the log."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str, str], tuple[float, int]] = {}

    def __call__(self, key: tuple[str, str, str], message: str, exc: BaseException | None) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last[0] < self.interval:
                self._last[key] = (last[0], last[1] + 1)
                return
            suppressed = last[1] if last is not None else 0
            self._last[key] = (now, 0)
        more = f" ({suppressed} more like it not logged in the last {self.interval:g} s)" if suppressed else ""
        log.warning("%s%s", message, more, exc_info=exc)


_failure_log = _FailureLog()


def hook_raised(model: str, hook: str, exc: BaseException, failed: FailureCounter) -> InternalError:
    """What a request whose ``hook`` raised ``exc`` is answered: INTERNAL naming the model, the
    hook and the exception. Counts and logs (with the traceback) the failure."""
    message = f"model '{model}': {hook} hook raised {type(exc).__name__}: {describe_exception(exc)}"
    failed(model, hook)
    _failure_log((model, hook, type(exc).__name__), message, exc)
    return InternalError(message)


def checked_outputs(result: Any, expected: Sequence[TensorDecl], *, model: str, hook: str, where: str,
                    rows: int | None, any_rows: bool, failed: FailureCounter) -> dict[str, np.ndarray]:
    """What ``hook`` returned, checked against ``expected`` (:func:`conform`); a mismatch (or a
    check that itself failed) is counted and logged and raised as :class:`InternalError`."""
    try:
        outputs, _ = conform(result, expected, where=where, rows=rows, any_rows=any_rows)
    except InternalError as exc:
        failed(model, hook)
        _failure_log((model, hook, "output"), str(exc), None)
        raise
    except BaseException as exc:        # conform raises InternalError only; belt and braces
        failed(model, hook)
        message = f"{where}: could not be checked ({type(exc).__name__}: {describe_exception(exc)})"
        _failure_log((model, hook, type(exc).__name__), message, exc)
        raise InternalError(message) from None
    return outputs


def check_reply_size(outputs: Mapping[str, np.ndarray], expected: Sequence[TensorDecl], limit: ReplyLimit | None,
                     *, model: str, hook: str) -> None:
    """Raise :class:`ResourceExhausted` (what the frontend answers a reply over its limit) when
    the outputs ``hook`` returned (checked by :func:`conform`, so plain arrays of plain bytes)
    would make a reply larger than ``limit`` allows: the reply's message holds at least their
    encoded bytes. The message names the model, the hook, the size, the largest tensor and the
    limit. Runs in the hook's thread: nothing is encoded."""
    if limit is None:
        return
    total, largest, largest_bytes = 0, "", -1
    for decl in expected:
        array = outputs.get(decl.name)
        if array is None or (limit.outputs is not None and decl.name not in limit.outputs):
            continue
        size = encoded_size(array, decl.dtype)
        total += size
        if size > largest_bytes:
            largest, largest_bytes = decl.name, size
    if total > limit.max_bytes:
        raise ResourceExhausted(
            f"model '{model}': the outputs its {hook} hook returned are {total} bytes in the response (tensor "
            f"'{largest}': {largest_bytes} bytes), the limit ({limit.key}) is {limit.max_bytes}; ask for the outputs "
            "in shared memory or raise the limit")


class SubCallError(XlaserveError):
    """A meta model's ``ctx.infer`` failed. Keeps the sub-call's status (DEADLINE_EXCEEDED,
    RESOURCE_EXHAUSTED, UNAVAILABLE, ...); the message names the meta model and the sub-model."""

    def __init__(self, message: str, cause: XlaserveError) -> None:
        super().__init__(message)
        self.status = cause.status
        self.cause = cause


class RunFailed(XlaserveError):
    """An xlaserve error that a meta model's ``run`` raised (a :class:`SubCallError` it let
    propagate, or one it made), copied in run's thread into a plain status and message.

    What ``run`` raises is user code: its class may override ``__str__`` or ``status``, and even
    one of xlaserve's own errors may carry arguments whose ``__str__`` is user code. The call's
    status and message are read on the Trio thread, where user code that blocks would hold every
    client of the worker, and one that raises leaves its call unanswered; so they are read here.
    """

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Expiry:
    """Answers DEADLINE_EXCEEDED to task-free requests (postprocess only) whose hook has not
    answered by their deadline. One task for all of them: a heap of deadlines, entries of
    requests already answered dropped when they come up (or when they outnumber the rest)."""

    def __init__(self, pool: HookPool, starved: Callable[[str, str, str], DeadlineExceeded]) -> None:
        self._pool = pool
        self._starved = starved     # (model, request id, hook): the answer to one that never got a thread
        self._heap: list[tuple[float, int, _Answer, str, str, weakref.ref]] = []
        self._seq = itertools.count()
        self._wake = trio.Event()
        self._compact_at = 1024

    def add(self, deadline: float, answer: _Answer, model: str, request_id: str, work: Callable[[], None]) -> None:
        """Answer DEADLINE_EXCEEDED at ``deadline`` unless answered, and take ``work`` (the
        request's postprocess) out of the hook pool's queue if it still waits there. ``work`` is
        held weakly: once a thread has run it (and the pool let it go), what it holds (the
        execution's outputs) goes, not when its deadline comes up here."""
        heap = self._heap
        heapq.heappush(heap, (deadline, next(self._seq), answer, model, request_id, weakref.ref(work)))
        if heap[0][0] == deadline:
            self._wake.set()
        if len(heap) >= self._compact_at:
            heap[:] = [entry for entry in heap if not entry[2].done]
            heapq.heapify(heap)
            self._compact_at = max(1024, 2 * len(heap))

    async def run(self) -> None:
        heap = self._heap
        while True:
            with trio.move_on_at(heap[0][0] if heap else math.inf):
                await self._wake.wait()
            self._wake = trio.Event()
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                self._expire(*heapq.heappop(heap))

    def _expire(self, deadline: float, seq: int, answer: _Answer, model: str, request_id: str,
                work: weakref.ref) -> None:
        if not answer.done:
            queued = work()
            never_ran = queued is not None and self._pool.withdraw(queued)
            answer(self._starved(model, request_id, "postprocess") if never_ran
                   else _late(model, request_id, "postprocess"))


_LATE = object()    # a hook stage the deadline answered


class InferenceService:
    """Accepts decoded client requests; owns the hook and meta thread pools.

    ``table`` is the model table meta models look sub-models up in; ``stats`` (optional) gets one
    success or failure per meta request (its sub-calls are counted under the sub-models);
    ``hook_failed(model, hook)`` (optional) counts each failure of user code;
    ``hook_starved(model, hook)`` (optional, Trio thread) each request answered while its hook
    still waited for a thread (:meth:`thread_statistics` says how busy the pools are).
    """

    def __init__(self, scheduler: trio.MemorySendChannel[SchedulerMessage], nursery: trio.Nursery,
                 table=None, stats=None, hook_threads: int = HOOK_THREADS,
                 meta_threads: int = META_THREADS, hook_failed: FailureCounter | None = None,
                 hook_starved: FailureCounter | None = None) -> None:
        self._scheduler = scheduler
        self._nursery = nursery
        self._table = table
        self._stats = stats
        self._hook_pool = HookPool(hook_threads)
        self._meta_limiter = trio.CapacityLimiter(meta_threads)
        self._tasks: dict[object, Stages] = {}      # by ticket: cancellable requests that run as tasks
        self.hook_failed: FailureCounter = hook_failed or _uncounted
        self.hook_starved: FailureCounter = _guarded_counter(hook_starved or _uncounted, "a starved hook")
        self._expiry: _Expiry | None = None

    def thread_statistics(self) -> HookThreads:
        """How busy the hook and meta pools are now (any thread: ``/metrics`` and the control
        status read it)."""
        meta = self._meta_limiter.statistics()
        return HookThreads(self._hook_pool.statistics(),
                           ThreadPoolStatistics(int(meta.total_tokens), meta.borrowed_tokens, meta.tasks_waiting))

    def _starved(self, model: str, request_id: str, hook: str) -> DeadlineExceeded:
        """The answer to a request whose ``hook`` never got a thread by its deadline (every one
        held by hooks that have not returned); counted, and logged at most every 10 s."""
        self.hook_starved(model, hook)
        if hook == "run":
            return _waited(model, request_id, hook, int(self._meta_limiter.total_tokens), "meta")
        return _waited(model, request_id, hook, self._hook_pool.size, "hook")

    def submit(self, request: ClientRequest) -> None:
        """Accept one request; its reply is called exactly once. Runs on the Trio thread."""
        model = request.model
        hooks = model.hooks
        deadline = math.inf if request.timeout is None else trio.current_time() + request.timeout
        if not model.is_meta and (hooks is None or (hooks.preprocess is None and hooks.postprocess is None)):
            self._enqueue(model, request.inputs, request.rows, request.request_id, deadline, request.reply,
                          request.received_ns, request.ticket, request.trace)
            return
        answer = _Answer(request.reply)
        try:
            if model.is_meta:
                self._start(self._meta, request, deadline, answer)
            elif hooks.preprocess is None:
                # Postprocess only (the common case): no task; the outcome hands the hook to the pool.
                self._enqueue(model, request.inputs, request.rows, request.request_id, deadline,
                              self._then_postprocess(request, deadline, answer,
                                                     self._stages(request.ticket, queued=True)),
                              request.received_ns, request.ticket, request.trace)
            else:
                self._start(self._with_hooks, request, deadline, answer)
        except Exception as exc:        # a bug here fails this request only
            log.exception("model '%s': accepting request '%s' failed", model.name, request.request_id)
            if request.ticket is not None:
                self._tasks.pop(request.ticket, None)
            answer(InternalError(internal_message(exc, f"model '{model.name}'")))

    def _start(self, body, request: ClientRequest, deadline: float, answer: _Answer) -> None:
        self._nursery.start_soon(self._guarded, body, request, deadline, answer, self._stages(request.ticket))

    async def _guarded(self, body, request: ClientRequest, deadline: float, answer: _Answer, stages: Stages) -> None:
        """Run one request's task; whatever it raises ends that request only, answered once."""
        name = request.model.name
        try:
            await body(request, deadline, answer, stages)
        except XlaserveError as exc:
            answer(exc)
        except Exception as exc:
            log.exception("model '%s': request '%s' failed", name, request.request_id)
            answer(InternalError(internal_message(exc, f"model '{name}'")))
        except BaseException:           # trio.Cancelled: the worker stops (or KeyboardInterrupt on this thread)
            answer(Unavailable(f"model '{name}': the worker is stopping; request '{request.request_id}' was not "
                               "finished"))
            raise
        finally:
            if request.ticket is not None:
                self._tasks.pop(request.ticket, None)

    def cancel(self, ticket: object) -> None:
        """The client of the request submitted with ``ticket`` went away (Trio thread). The
        request still gets its one reply (CANCELLED, or whatever it had already come to)."""
        stages = self._tasks.get(ticket)
        if stages is None:                      # task-free: the scheduler holds it, if anyone
            self._cancel_queued(ticket)
            return
        stages.cancelled = True
        waiting, stages.waiting = stages.waiting, None
        if waiting is not None and self._hook_pool.withdraw(waiting[0]):
            waiting[1]()        # its hook never got a thread: answered now, not once one frees
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

    def _then_postprocess(self, request: ClientRequest, deadline: float, answer: _Answer, stages: Stages) -> Reply:
        """A reply that runs the model's postprocess in the hook pool, then replies to the caller
        from that thread. Cheaper than a task per request: one pool hand-off, one wake-up. A
        deadline still to come is watched by :class:`_Expiry`."""
        model = request.model

        def finish(outcome: Outcome) -> None:     # on the Trio thread (the scheduler replies): must not raise
            try:
                ticket = request.ticket
                if ticket is not None:
                    stages.queued.discard(ticket)         # it has left the scheduler
                if isinstance(outcome, InferResult) and stages.cancelled:
                    outcome = _cancelled(model.name, request.request_id)
                if not isinstance(outcome, InferResult) or deadline <= trio.current_time():
                    if ticket is not None:
                        self._tasks.pop(ticket, None)
                    answer(outcome if not isinstance(outcome, InferResult)
                           else _late(model.name, request.request_id, "postprocess"))
                    return
                result = outcome
                if ticket is not None:
                    # Still cancellable while the hook waits for a thread: a client that went away
                    # meanwhile is answered CANCELLED there, its hook not run (it ran, holding a
                    # hook thread, for nobody). Forgotten by whichever call answers (a dict's pop
                    # is atomic, whatever thread that is).
                    answer.after = lambda: self._tasks.pop(ticket, None)

                def work() -> None:
                    if answer.done:         # the deadline answered while this waited for a thread
                        return
                    if stages.cancelled:    # the client went away while this waited for a thread
                        answer(_cancelled(model.name, request.request_id))
                        return
                    started_ns = time.perf_counter_ns()
                    try:
                        done: Outcome = postprocessed(model, result, request.rows, self.hook_failed,
                                                      request.reply_limit)
                    except XlaserveError as exc:
                        done = exc
                    except BaseException as exc:    # postprocessed raises InternalError only
                        log.exception("model '%s': postprocess of request '%s' failed", model.name,
                                      request.request_id)
                        done = InternalError(internal_message(exc, f"model '{model.name}': postprocess"))
                    if request.trace is not None:
                        _record_hook(request.trace, "postprocess", started_ns, done)
                    answer(done)            # a ClientRequest's reply is thread-safe
                if deadline < math.inf:
                    self._expiring().add(deadline, answer, model.name, request.request_id, work)
                if ticket is not None:
                    stages.waiting = (work, lambda: answer(_cancelled(model.name, request.request_id)))
                self._hook_pool.submit(work)
            except Exception as exc:
                log.exception("model '%s': request '%s' failed after its execution", model.name,
                              request.request_id)
                if request.ticket is not None:
                    self._tasks.pop(request.ticket, None)
                answer(InternalError(internal_message(exc, f"model '{model.name}'")))
        return finish

    def _expiring(self) -> _Expiry:
        if self._expiry is None:
            self._expiry = _Expiry(self._hook_pool, self._starved)
            self._nursery.start_soon(self._expiry.run, name="hook deadlines")
        return self._expiry

    def _enqueue(self, model: ModelVersion, inputs: Mapping[str, np.ndarray], rows: int, request_id: str,
                 deadline: float, reply: Reply, received_ns: int, ticket: object = None,
                 trace: RequestTrace | None = None) -> None:
        if trace is not None:
            trace.enqueued_ns = time.perf_counter_ns()
        request = InferRequest(model, inputs, rows, request_id, deadline, reply, received_ns, trio.current_time(),
                               ticket, trace)
        try:
            self._scheduler.send_nowait(request)
        except trio.WouldBlock:
            request.reply(QueueFull("the worker's admission channel is full; retry later"))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            request.reply(Unavailable("the worker is shutting down"))

    async def execute(self, model: ModelVersion, inputs: Mapping[str, np.ndarray], rows: int,
                      request_id: str, deadline: float = math.inf, received_ns: int | None = None,
                      stages: Stages | None = None, trace: RequestTrace | None = None) -> Outcome:
        """Queue executable inputs with what is left until ``deadline`` and wait for their outcome.
        With ``stages``, not queued once cancelled, and taken out of the queue if cancelled there.
        ``trace``: the span the scheduler's spans of this execution belong under."""
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
                          received_ns or time.perf_counter_ns(), ticket, trace)
            async with receive:
                return await receive.receive()
        finally:
            if stages is not None:
                stages.queued.discard(ticket)

    # ---- preprocess / postprocess -------------------------------------------------------
    async def _in_hook_pool(self, request: ClientRequest, hook: str, deadline: float, answer: _Answer,
                            stages: Stages, fn, *args):
        """``fn(*args)`` (which raises XlaserveError only) in the hook pool, the one that bounds
        how many hooks run at once, waited for without holding up other tasks. At ``deadline``
        the request is answered DEADLINE_EXCEEDED and this returns ``_LATE``; the hook, if it
        started, goes on in its thread and its result is dropped. A request whose client went
        away (``stages.cancelled``) while this waited for a thread raises CANCELLED when its turn
        comes, without running the hook."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list = []

        def work() -> None:
            if answer.done:             # answered while this waited for a thread: skip the hook
                return
            if stages.cancelled:        # the client went away meanwhile: nobody wants the hook's result
                result.append(Error(_cancelled(request.model.name, request.request_id)))
            else:
                result.append(capture(fn, *args))
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass  # the worker stopped; nobody waits for this hook any more

        def withdrawn() -> None:        # (cancel, Trio thread) the client went away before a thread took it
            result.append(Error(_cancelled(request.model.name, request.request_id)))
            done.set()
        if deadline > trio.current_time():
            stages.waiting = (work, withdrawn)
            self._hook_pool.submit(work)
            try:
                with trio.move_on_at(deadline):
                    await done.wait()
                    return result[0].unwrap()
            except trio.Cancelled:
                # the worker stops: the request is answered UNAVAILABLE (by _guarded); a hook that
                # has not started never will, and its tensors leave the queue with the answer
                if self._hook_pool.withdraw(work):
                    self.hook_starved(request.model.name, hook)
                raise
            finally:
                stages.waiting = None   # (what it holds, the hook's arguments, goes with it)
            if self._hook_pool.withdraw(work):
                answer(self._starved(request.model.name, request.request_id, hook))
                return _LATE
        answer(_late(request.model.name, request.request_id, hook))
        return _LATE

    async def _with_hooks(self, request: ClientRequest, deadline: float, answer: _Answer, stages: Stages) -> None:
        model = request.model
        hooks = model.hooks
        manifest = model.manifest
        inputs = request.inputs
        if hooks.preprocess is not None:
            inputs = await self._hook_stage(
                request, "preprocess", deadline, answer, stages, call_hook, model, "preprocess", hooks.preprocess, inputs,
                manifest.executable_inputs, request.rows, self.hook_failed)
            if inputs is _LATE:
                return
        outcome = await self.execute(model, inputs, request.rows, request.request_id, deadline,
                                     request.received_ns, stages, request.trace)
        if isinstance(outcome, InferResult) and hooks.postprocess is not None:
            if stages.cancelled:
                outcome = _cancelled(model.name, request.request_id)
            else:
                outcome = await self._hook_stage(request, "postprocess", deadline, answer, stages, postprocessed,
                                                 model, outcome, request.rows, self.hook_failed, request.reply_limit)
                if outcome is _LATE:
                    return
        answer(outcome)

    async def _hook_stage(self, request: ClientRequest, hook: str, deadline: float, answer: _Answer, stages: Stages,
                          fn, *args):
        """:meth:`_in_hook_pool`, recorded as the hook's span when the request is traced."""
        trace = request.trace
        if trace is None:
            return await self._in_hook_pool(request, hook, deadline, answer, stages, fn, *args)
        started_ns = time.perf_counter_ns()
        try:
            result = await self._in_hook_pool(request, hook, deadline, answer, stages, fn, *args)
        except XlaserveError as exc:
            _record_hook(trace, hook, started_ns, exc)
            raise
        _record_hook(trace, hook, started_ns, result)
        return result

    # ---- meta models --------------------------------------------------------------------
    async def _meta(self, request: ClientRequest, deadline: float, answer: _Answer, stages: Stages) -> None:
        ctx = MetaContext(self, request.model, request.request_id, deadline, trio.lowlevel.current_trio_token(),
                          stages, request.trace, request.reply_limit)
        try:
            await self._meta_run(ctx, request, deadline, answer, stages)
        finally:
            ctx._close()

    async def _meta_run(self, ctx: MetaContext, request: ClientRequest, deadline: float, answer: _Answer,
                        stages: Stages) -> None:
        model = request.model
        tensors = [NamedTensor(name, array) for name, array in request.inputs.items()]
        started_ns = time.perf_counter_ns()
        outcome: Outcome | None = None
        slot = _MetaSlot(self._meta_limiter)
        try:
            with trio.move_on_at(deadline):
                # abandoned at the deadline (or when the worker stops): run goes on in its thread,
                # holding its meta-pool slot until it returns; what it returns then is dropped
                result = await trio.to_thread.run_sync(ctx._run, tensors, limiter=slot, abandon_on_cancel=True)
                outcome = (result if isinstance(result, XlaserveError)
                           else InferResult(result, 0, 0, 0, time.perf_counter_ns() - started_ns, 0))
        except trio.Cancelled:
            if not slot.acquired:       # the worker stops while this waited for a meta thread
                self.hook_starved(model.name, "run")
            raise
        if outcome is None:
            outcome = (_late(model.name, request.request_id, "run") if slot.acquired
                       else self._starved(model.name, request.request_id, "run"))
        if request.trace is not None:
            request.trace.record("xlaserve.run", started_ns, time.perf_counter_ns(), None,
                                 str(outcome) if isinstance(outcome, XlaserveError) else None)
        if stages.cancelled:
            outcome = _cancelled(model.name, request.request_id)
        if self._stats is not None:
            total_ns = time.perf_counter_ns() - request.received_ns
            if isinstance(outcome, InferResult):
                self._stats.record_success(model.name, total_ns, max(0, started_ns - request.received_ns), 0,
                                           outcome.compute_infer_ns, 0, time.time_ns() // 1_000_000)
            else:
                self._stats.record_failure(model.name, total_ns)
        answer(outcome)

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


def _waited(model: str, request_id: str, hook: str, size: int, pool: str) -> DeadlineExceeded:
    """DEADLINE_EXCEEDED for a request whose ``hook`` never got one of the ``size`` threads of
    ``pool`` (``hook`` or ``meta``; every one held by hooks that have not returned), logged at
    most every 10 s: the operator's sign that hung hooks starve every hooked model."""
    message = (f"model '{model}': request '{request_id}': the deadline passed while its {hook} hook waited for a "
               f"thread: all {size} {pool} threads are busy with hooks that have not returned; it never ran")
    _failure_log(("", f"{pool} threads", "busy"), f"{pool} threads: all {size} are busy with hooks that have not "
                 f"returned; requests of hooked models wait and time out (model '{model}', {hook})", None)
    return DeadlineExceeded(message)


def _late(model: str, request_id: str, hook: str) -> DeadlineExceeded:
    """DEADLINE_EXCEEDED for a request whose ``hook`` had not returned by its deadline: it was
    running (or the deadline had passed before it was handed to the pool); one that never got a
    thread is :func:`_waited`."""
    return DeadlineExceeded(f"model '{model}': request '{request_id}': the deadline passed before its {hook} hook "
                            "returned; what it returns is dropped")


def _record_hook(trace: RequestTrace, hook: str, started_ns: int, result: Any) -> None:
    """The span of one pre/postprocess hook, ended now; ``result`` tells whether it failed."""
    if isinstance(result, XlaserveError):
        error = str(result)
    elif result is _LATE:
        error = f"the deadline passed before the {hook} hook returned"
    else:
        error = None
    trace.record(f"xlaserve.{hook}", started_ns, time.perf_counter_ns(), None, error)


def _cancelled(model: str, request_id: str) -> Cancelled:
    return Cancelled(f"model '{model}': the client cancelled request '{request_id}' (it reset the stream or closed "
                     "the connection); it stopped at a stage boundary")


def postprocessed(model: ModelVersion, result: InferResult, rows: int,
                  failed: FailureCounter = _uncounted, limit: ReplyLimit | None = None) -> InferResult:
    """``result`` with its outputs passed through the model's postprocess hook (on a hook thread),
    no larger than the reply may carry (``limit``; :func:`check_reply_size`)."""
    outputs = call_hook(model, "postprocess", model.hooks.postprocess, result.outputs,
                        model.manifest.client_outputs, rows, failed)
    check_reply_size(outputs, model.manifest.client_outputs, limit, model=model.name, hook="postprocess")
    return replace(result, outputs=outputs)


def call_hook(model: ModelVersion, label: str, hook: Callable, tensors: Mapping[str, np.ndarray],
              expected: Sequence[TensorDecl], rows: int, failed: FailureCounter = _uncounted) -> dict[str, np.ndarray]:
    """Run one pre/postprocess hook (blocking) and check what it returns against ``expected``.
    Raises :class:`InternalError` only, naming the model and the hook, whatever the hook raises
    (BaseException included) or returns; each such failure is counted by ``failed``."""
    named = [NamedTensor(name, array) for name, array in tensors.items()]
    try:
        result = hook(named)
    except BaseException as exc:        # user code: SystemExit in a hook thread ends only its request
        raise hook_raised(model.name, label, exc, failed) from None
    kind = "executable_inputs" if label == "preprocess" else "client_outputs"
    return checked_outputs(result, expected, model=model.name, hook=label, rows=rows, any_rows=False,
                           where=f"model '{model.name}': {label} hook output (checked against {kind})", failed=failed)


RUN_MESSAGE_CHARS = 4096
"""How much of the message of an xlaserve error raised by ``run`` is kept: a call's status message
goes out cut to 4 KiB anyway (``grpc-message``), and what is kept is held until the answer."""


def _passed_on(model: str, exc: XlaserveError, failed: FailureCounter) -> XlaserveError:
    """What answers a meta request whose ``run`` raised ``exc``, made in run's thread: the same
    status and message (a SubCallError keeps its sub-call's status; errors of ctx.infer were
    counted there), as a :class:`RunFailed`, which holds no user code. An error a call cannot
    end with (its ``status`` is OK, or not a status at all; reading it or its message raises) is
    the meta model's bug: INTERNAL, counted as a failure of ``run``."""
    try:
        status = exc.status
        if isinstance(status, Status) and status is not Status.OK:
            return RunFailed(status, str.__getitem__(str(exc), slice(0, RUN_MESSAGE_CHARS)))
    except BaseException:       # user code: a status property or __str__ that raises (SystemExit too)
        return hook_raised(model, "run", exc, failed)
    message = (f"model '{model}': run hook raised {type(exc).__name__} whose status, {_describe_status(status)}, "
               f"is not an error status (a grpclib.const.Status other than OK): {describe_exception(exc)}")
    failed(model, "run")
    _failure_log((model, "run", "status"), message, None)
    return InternalError(message)


def _describe_status(status: Any) -> str:
    try:
        return cut_text(repr(status), 80)
    except BaseException:       # user code
        return f"a {type(status).__name__} whose repr() raised"


class MetaContext:
    """What a meta model's ``run(tensors, ctx)`` gets: ``ctx.infer`` calls other models.

    ``ctx.infer(model, tensors)`` takes a list of :class:`NamedTensor` (or a mapping of name to
    array) matching the sub-model's client inputs, applies its preprocess, queues it in the
    scheduler with what is left of this request's deadline, applies its postprocess and returns
    a ``dict`` of the sub-model's client outputs by name. It blocks its thread only; call it from
    ``run``'s own thread or from threads ``run`` starts, to overlap several sub-calls. A failure
    raises :class:`SubCallError` (an ``XlaserveError``) carrying the sub-call's status; a
    sub-model's failing hook is INTERNAL, counted under the sub-model's hook.
    """

    def __init__(self, service: InferenceService, model: ModelVersion, request_id: str, deadline: float,
                 token: trio.lowlevel.TrioToken, stages: Stages | None = None,
                 trace: RequestTrace | None = None, reply_limit: ReplyLimit | None = None) -> None:
        self.model = model.name
        self.request_id = request_id
        self._meta = model
        self._service = service
        self._deadline = deadline
        self._token = token
        self._stages = stages or Stages()
        self._run_thread: int | None = None
        self._calls = itertools.count(1)
        self._trace = trace
        self._reply_limit = reply_limit
        self._closed: XlaserveError | None = None   # set once the request is answered (Trio thread)

    def _close(self) -> None:
        """The request has been answered (Trio thread): from now on each ``ctx.infer`` fails at
        once, and sub-calls still queued leave their queues (those of a request cancelled or out
        of time did already, or expire in the scheduler). A thread that ``run`` started and left
        running (or ``ctx`` kept in a global) would otherwise go on calling models for good, with
        no request, deadline or meta-pool slot to bound it and no client to cancel it."""
        if self._stages.cancelled:
            self._closed = _cancelled(self.model, self.request_id)
        elif self._deadline <= trio.current_time():
            self._closed = DeadlineExceeded(f"model '{self.model}': request '{self.request_id}': its deadline has "
                                            "passed")
        else:
            self._closed = FailedPrecondition(
                f"model '{self.model}': request '{self.request_id}' has been answered; ctx.infer works only until "
                "its run returns (join the threads run starts before returning)")
            for ticket in list(self._stages.queued):
                self._service._cancel_queued(ticket)

    async def _sub_call(self, sub: ModelVersion, inputs: Mapping[str, np.ndarray], rows: int, request_id: str,
                        call: RequestTrace | None) -> Outcome:
        """One sub-call's execution (Trio thread), unless the request has been answered meanwhile."""
        if self._closed is not None:
            return self._closed
        return await self._service.execute(sub, inputs, rows, request_id, self._deadline, None, self._stages, call)

    def _run(self, tensors: list[NamedTensor]) -> dict[str, np.ndarray] | XlaserveError:
        """The meta request's whole body, in a meta-pool thread: its checked outputs, or the
        error that answers it. Never raises."""
        self._run_thread = threading.get_ident()
        name = self.model
        failed = self._service.hook_failed
        try:
            result = self._meta.hooks.run(tensors, self)
        except XlaserveError as exc:
            return _passed_on(name, exc, failed)
        except trio.Cancelled:
            return Unavailable(f"model '{name}': the worker is stopping")
        except BaseException as exc:    # user code: SystemExit in run's thread ends only its request
            return hook_raised(name, "run", exc, failed)
        declared = self._meta.manifest.client_outputs
        try:
            outputs = checked_outputs(result, declared, model=name, hook="run", rows=None, any_rows=True,
                                      where=f"model '{name}': run hook output (checked against client_outputs)",
                                      failed=failed)
            check_reply_size(outputs, declared, self._reply_limit, model=name, hook="run")
        except XlaserveError as exc:
            return exc
        return outputs

    def infer(self, model: str, tensors: Sequence[NamedTensor] | Mapping[str, Any]) -> dict[str, np.ndarray]:
        if self._trace is None:
            return self._infer(model, tensors, None)
        call = self._trace.child("xlaserve.meta.call", {"xlaserve.model": model, "xlaserve.meta.model": self.model})
        try:
            outputs = self._infer(model, tensors, call)
        except BaseException as exc:
            call.finish(str(exc) or type(exc).__name__)
            raise
        call.finish()
        return outputs

    def _infer(self, model: str, tensors: Sequence[NamedTensor] | Mapping[str, Any],
               call: RequestTrace | None) -> dict[str, np.ndarray]:
        where = f"model '{self.model}': run: ctx.infer('{model}')"
        failed = self._service.hook_failed
        closed = self._closed
        if closed is None and self._stages.cancelled:
            closed = _cancelled(self.model, self.request_id)
        if closed is not None:
            raise SubCallError(f"{where}: {closed}", closed)
        try:
            sub = self._service._sub_model(self.model, model)
            manifest = sub.manifest
            inputs, rows = conform(tensors, manifest.client_inputs, where=f"{where} inputs (checked against "
                                   f"'{model}' client_inputs)", rows=None, max_rows=manifest.max_batch_size)
        except SubCallError:
            raise
        except InternalError as exc:        # the meta model's own bug: counted under its run
            failed(self.model, "run")
            _failure_log((self.model, "run", "ctx.infer"), str(exc), None)
            raise
        hooks = sub.hooks
        if hooks is not None and hooks.preprocess is not None:
            started_ns = time.perf_counter_ns()
            try:
                inputs = call_hook(sub, "preprocess", hooks.preprocess, inputs, manifest.executable_inputs, rows,
                                   failed)
            except InternalError as exc:
                if call is not None:
                    _record_hook(call, "preprocess", started_ns, exc)
                raise SubCallError(f"{where}: {exc}", exc) from None
            if call is not None:
                _record_hook(call, "preprocess", started_ns, inputs)
        request_id = f"{self.request_id}/{model}#{next(self._calls)}"
        if call is not None:
            call.attributes["xlaserve.request_id"] = request_id
        try:
            outcome = trio.from_thread.run(self._sub_call, sub, inputs, rows, request_id, call,
                                           trio_token=self._token)
        except trio.RunFinishedError:
            cause = Unavailable("the worker has stopped")
            raise SubCallError(f"{where}: {cause}", cause) from None
        if isinstance(outcome, XlaserveError):
            raise SubCallError(f"{where}: {outcome}", outcome)
        outputs = outcome.outputs
        if hooks is not None and hooks.postprocess is not None:
            started_ns = time.perf_counter_ns()
            try:
                outputs = call_hook(sub, "postprocess", hooks.postprocess, outputs, manifest.client_outputs, rows,
                                    failed)
            except InternalError as exc:
                if call is not None:
                    _record_hook(call, "postprocess", started_ns, exc)
                raise SubCallError(f"{where}: {exc}", exc) from None
            if call is not None:
                _record_hook(call, "postprocess", started_ns, outputs)
        return dict(outputs)
