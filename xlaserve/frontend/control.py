"""xlaserve's own ``WorkerControl`` gRPC service (proto/xlaserve_control.proto), on the worker's
gRPC port beside the KServe service: per-model status, residency and scheduling changes at run
time, memory defragmentation (``CompactMemory``; it evicts nothing), and a status stream
(``WatchStatus``) for operators' control planes.

Handlers run as Trio tasks of the worker, so status is read straight from the actors' snapshots
(model table, queue depths, learned costs, residency) and small changes (scheduling policy) are
applied in place; longer work (compaction, residency moves) runs in a task of the worker's own
nursery, awaited through the bridge, so a client that hangs up does not cancel it halfway.
"""
from __future__ import annotations

import inspect
import logging
import math

import trio

from xlaserve._proto import xlaserve_control_pb2 as pb
from xlaserve._proto.xlaserve_control_grpc import WorkerControlBase
from xlaserve.config.schema import MAX_WEIGHT, MIN_WEIGHT
from xlaserve.errors import (FailedPrecondition, InternalError, InvalidArgument, ModelNotFound, ResourceExhausted,
                             XlaserveError, internal_message)
from xlaserve.frontend.admission import Admission
from xlaserve.frontend.port import WorkerPort
from xlaserve.frontend.statuses import rpc
from xlaserve.metrics import LATENCY_BUCKETS, RequestTally

log = logging.getLogger("xlaserve.control")

DEFAULT_WATCH_INTERVAL = 1.0
MIN_WATCH_INTERVAL = 0.05
#: WatchStatus streams served at once (a gateway opens one per worker, ``xlaserve top`` one); one
#: more is refused RESOURCE_EXHAUSTED. Each costs a snapshot every MIN_WATCH_INTERVAL at most,
#: built on the Trio thread: 800 of them, from one client, took that thread whole and inference
#: from 0.6 ms to 108 ms.
MAX_WATCH_STREAMS = 32


def status_snapshot(worker: WorkerPort, admission: Admission | None = None) -> pb.ModelControlStatusResponse:
    """One consistent snapshot of every model the worker knows (no awaits while it is built).
    ``admission``: the KServe service's, for the requests in flight (0 without it)."""
    scheduler = worker.scheduling
    weights = worker.weights
    cache = weights.snapshot()
    resident: dict[str, int] = {}
    loads: dict[str, int] = {}
    evictions: dict[str, int] = {}
    misses: dict[str, int] = {}
    rank: dict[str, int] = {}       # a model's versions: the rank of the first to go
    for r in cache.models:
        resident[r.model] = resident.get(r.model, 0) + r.resident_bytes
        loads[r.model] = loads.get(r.model, 0) + r.loads
        evictions[r.model] = evictions.get(r.model, 0) + r.evictions
        misses[r.model] = misses.get(r.model, 0) + r.misses
        if r.eviction_rank and (r.model not in rank or r.eviction_rank < rank[r.model]):
            rank[r.model] = r.eviction_rank
    in_flight = admission.by_model if admission is not None else {}
    no_tally = RequestTally()
    costs: dict[str, dict[int, float]] = {}
    for c in scheduler.costs():
        costs.setdefault(c.model, {})[c.size] = c.seconds
    models = []
    for entry in worker.models.snapshot.values():
        policy = scheduler.policy(entry.name)
        stats = worker.statistics(entry.name)
        tally = worker.tally(entry.name) if worker.tally is not None else no_tally
        device_ns = 0
        for b in stats.batches.values():
            device_ns += b.compute_input.ns + b.compute_infer.ns + b.compute_output.ns
        models.append(pb.ModelControl(
            name=entry.name, state=entry.state.value, version=entry.version or 0, reason=entry.reason,
            residency=weights.floor_of(entry.name).value, resident_bytes=resident.get(entry.name, 0),
            weight_bytes=entry.serving.weight_bytes if entry.serving else 0,
            queue_depth=scheduler.depth(entry.name), learned_cost_seconds=costs.get(entry.name, {}),
            weight=policy.weight, max_batch_size=_cap(policy.max_batch_size),
            batch_delay_seconds=policy.batch_delay_seconds, batch_target_rows=policy.batch_target_rows or 0,
            requests=stats.inference_count, executions=stats.execution_count,
            successes=stats.success.count, success_seconds=stats.success.ns / 1e9,
            failures=stats.fail.count, queue_seconds=stats.queue.ns / 1e9,
            executions_by_batch_size={size: b.compute_infer.count for size, b in stats.batches.items()},
            in_flight=in_flight.get(entry.name, 0), latency_bucket_counts=tally.latency_counts,
            device_seconds=device_ns / 1e9, rejections=tally.rejections,
            weight_loads=loads.get(entry.name, 0), evictions=evictions.get(entry.name, 0),
            hook_failures=tally.hook_failures, weight_misses=misses.get(entry.name, 0),
            eviction_rank=rank.get(entry.name, 0)))
    threads = worker.hook_threads() if worker.hook_threads is not None else None
    pools = {}
    if threads is not None:
        pools = dict(hook_threads=threads.hook.size, hook_threads_busy=threads.hook.busy,
                     hook_requests_waiting=threads.hook.waiting, meta_threads=threads.meta.size,
                     meta_threads_busy=threads.meta.busy, meta_requests_waiting=threads.meta.waiting)
    return pb.ModelControlStatusResponse(
        models=models, worker=worker.worker_name, backend=worker.backend, budget_bytes=cache.budget_bytes,
        resident_bytes=cache.resident_bytes, discipline=worker.discipline, latency_bucket_bounds=LATENCY_BUCKETS,
        uptime_seconds=worker.uptime() if worker.uptime is not None else 0.0,
        executable_cache=worker.executable_cache() if worker.executable_cache is not None else {},
        in_flight=admission.in_flight if admission is not None else 0, eviction_policy=cache.policy, **pools)


class WorkerControlService(WorkerControlBase):
    """The ``WorkerControl`` service of one worker, reached through ``worker``; ``admission``
    (the KServe service's) gives the requests in flight."""

    def __init__(self, worker: WorkerPort, admission: Admission | None = None, *,
                 max_watch_streams: int = MAX_WATCH_STREAMS) -> None:
        self._worker = worker
        self._admission = admission
        self._max_watch_streams = max_watch_streams
        self._watching = 0

    def _addressed(self, request) -> None:
        """A request naming a worker (``worker``, set for a gateway) is for this one only."""
        name = self._worker.worker_name
        if request.worker and request.worker != name:
            raise InvalidArgument(f"this is worker '{name}', the request names worker '{request.worker}' "
                                  "(leave worker empty, or send it through the gateway that fronts it)")

    def _known(self, name: str) -> None:
        table = self._worker.models.snapshot
        if name not in table:
            raise ModelNotFound(name, list(table))

    @staticmethod
    def _apply(fn):
        """``fn()``'s result; a ValueError it raises is a bad argument."""
        try:
            return fn()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None

    async def _in_trio_task(self, afn):
        """Call ``afn()`` in a Trio task of the worker, awaiting it if it is a coroutine; its result, or
        the XlaserveError it raised."""
        def start(reply):
            async def task():
                try:
                    result = afn()
                    reply(await result if inspect.isawaitable(result) else result)
                except XlaserveError as exc:
                    reply(exc)
                except ValueError as exc:
                    reply(InvalidArgument(str(exc)))
                except Exception as exc:
                    log.exception("control call failed")
                    reply(InternalError(internal_message(exc)))
            self._worker.spawn(task)
        return await self._worker.bridge.call(start)

    @rpc
    async def ModelControlStatus(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(status_snapshot(self._worker, self._admission))

    @rpc
    async def SetModelResidency(self, stream) -> None:
        request = await stream.recv_message()
        self._addressed(request)
        self._known(request.model)
        entry = self._worker.models.snapshot[request.model]
        if request.residency == "device" and entry.serving is None:
            # No version admitted yet (loading) or any more (failed): the pin cannot be checked
            # against the budget now, and one accepted here that does not fit failed the load.
            raise FailedPrecondition(
                f"cannot pin model '{request.model}' (residency device): it is {entry.state.value} with no version "
                "serving, so its weights cannot be checked against the budget yet; pin it once it is READY, or set "
                f"scheduler.models.{request.model}.residency: device in the node file")
        # an unknown floor: Floor.parse's ValueError, answered INVALID_ARGUMENT
        await self._in_trio_task(lambda: self._worker.weights.set_residency(request.model, request.residency))
        log.info("control: %s residency set to %s", request.model, request.residency)
        await stream.send_message(pb.SetModelResidencyResponse())

    @rpc
    async def SetModelPolicy(self, stream) -> None:
        request = await stream.recv_message()
        self._addressed(request)
        self._known(request.model)
        weight = request.weight if request.HasField("weight") else None
        max_batch = request.max_batch_size if request.HasField("max_batch_size") else None
        if weight is not None and not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            # as the node file's weight: an infinite one starved the rest, a tiny one took every dispatch
            raise InvalidArgument(f"weight must be a finite number > 0 in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] (a relative "
                                  f"share of device time); got {weight}")
        if max_batch is not None and max_batch < 0:
            raise InvalidArgument(f"max_batch_size must be >= 1, or 0 for uncapped; got {max_batch}")
        delay = request.batch_delay_seconds if request.HasField("batch_delay_seconds") else None
        target = request.batch_target_rows if request.HasField("batch_target_rows") else None
        if delay is not None and not 0 <= delay < math.inf:
            raise InvalidArgument(f"batch_delay_seconds must be >= 0 (0 turns the hold off); got {delay}")
        if target is not None and target < 0:
            raise InvalidArgument(f"batch_target_rows must be >= 1, or 0 for the default; got {target}")
        scheduler = self._worker.scheduling

        # 0 uncaps. Scheduler.set_policy reads None as "unchanged", so uncapped is a cap no
        # request can reach; status reports it as 0 again.
        cap = UNCAPPED_ROWS if max_batch == 0 else max_batch
        policy = self._apply(lambda: scheduler.set_policy(request.model, weight=weight, max_batch_size=cap,
                                                          batch_delay_seconds=delay, batch_target_rows=target))
        log.info("control: %s policy now weight=%g max_batch_size=%s batch_delay_seconds=%g batch_target_rows=%s",
                 request.model, policy.weight, _cap(policy.max_batch_size) or "uncapped",
                 policy.batch_delay_seconds, policy.batch_target_rows or "default")
        await stream.send_message(pb.SetModelPolicyResponse())

    @rpc
    async def CompactMemory(self, stream) -> None:
        self._addressed(await stream.recv_message())
        message, freed = await self._in_trio_task(self._worker.weights.compact)
        log.info("control: CompactMemory: %s (%d bytes freed)", message, freed)
        await stream.send_message(pb.CompactMemoryResponse(message=message, freed_bytes=freed))

    @rpc
    async def WatchStatus(self, stream) -> None:
        request = await stream.recv_message()
        interval = request.interval_seconds if request.interval_seconds > 0 else DEFAULT_WATCH_INTERVAL
        interval = max(interval, MIN_WATCH_INTERVAL)
        if self._watching >= self._max_watch_streams:
            raise ResourceExhausted(f"this worker serves at most {self._max_watch_streams} WatchStatus streams at "
                                    "once and all are open; close one, call ModelControlStatus for one snapshot, "
                                    "or watch through a gateway (one stream per worker for all its clients)")
        self._watching += 1
        try:
            await self._watch(stream, interval)
        finally:
            self._watching -= 1

    async def _watch(self, stream, interval: float) -> None:
        # Ends when the client cancels, or with OK when the worker starts draining: a status
        # stream is not work in flight, so a drain does not wait for it. A change of the model
        # table (a model loading, ready, failed, gone) is sent at once, not at the next interval,
        # so that a gateway routes to a model as soon as it is ready; at most one snapshot per
        # MIN_WATCH_INTERVAL all the same.
        draining = self._worker.draining
        table = self._worker.models
        while not draining.is_set():
            changed = table.changed         # taken before the snapshot: a later change wakes us
            sent = trio.current_time()
            await stream.send_message(status_snapshot(self._worker, self._admission))
            with trio.move_on_after(interval):
                async with trio.open_nursery() as nursery:
                    for event in (draining, changed):
                        nursery.start_soon(_cancel_when_set, event, nursery.cancel_scope)
            await trio.sleep_until(sent + MIN_WATCH_INTERVAL)


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


UNCAPPED_ROWS = 2**31 - 1


def _cap(max_batch_size: int | None) -> int:
    return 0 if max_batch_size is None or max_batch_size >= UNCAPPED_ROWS else max_batch_size
