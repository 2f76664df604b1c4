"""The gateway's ``xlaserve.control.WorkerControl`` service: its workers' status and their control
API, through the gateway's own port, so that ``xlaserve top`` pointed at a gateway shows every
worker.

- **WatchStatus** streams each worker's ``ModelControlStatusResponse``, with ``worker`` set to the
  gateway's name for it, as the one entry of a message's ``workers`` (so a client knows a
  gateway's stream from a worker's by its first message): every worker's latest at once, then
  each worker's next as discovery receives it, at most one per worker per ``interval_seconds``.
  The snapshots are the ones discovery already subscribes to (:class:`StatusBoard`, fed by
  :class:`~xlaserve.gateway.run.Gateway`'s discovery), serialized once per snapshot, so a
  dashboard adds no stream to the workers and costs the gateway one send per worker snapshot.
- **ModelControlStatus** answers ``workers``: the latest status of each worker.
- **SetModelResidency**, **SetModelPolicy** go to the worker the request's ``worker`` field names,
  or, when it is empty, to every worker whose latest status lists the model; **CompactMemory** to
  the named worker or every reachable one. The first failure, naming its worker, fails the call.

A worker whose discovery stream ends (it drains, it is lost, it is removed) leaves the board: its
last status is not sent again, and a dashboard sees it go silent.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import trio
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError

from xlaserve._proto import xlaserve_control_pb2 as cpb
from xlaserve.gateway.service import RawMessage, raise_first_failure
from xlaserve.gateway.upstream import Reply, Upstream, UpstreamError, status_named

log = logging.getLogger("xlaserve.gateway")

__all__ = ["StatusBoard", "GatewayControlService"]

CONTROL = "/xlaserve.control.WorkerControl/"
DEFAULT_WATCH_INTERVAL = 1.0
MIN_WATCH_INTERVAL = 0.05         # as a worker's: no dashboard asks for more than 20 a second


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker's latest status on the board: the message, a stream message carrying it
    (``workers=[status]``) serialized, and the board's generation when it arrived (a stream sends
    a worker again when its generation changed)."""

    worker: str
    status: cpb.ModelControlStatusResponse
    data: bytes
    generation: int


class StatusBoard:
    """The latest status of each worker, as the gateway's discovery receives them, and a wake-up
    for those who wait for the next. Trio thread only."""

    def __init__(self) -> None:
        self._latest: dict[str, WorkerStatus] = {}
        self._generation = 0
        self._changed = trio.Event()

    def publish(self, worker: str, status: cpb.ModelControlStatusResponse) -> None:
        """``worker``'s status now (discovery's parsed snapshot); labelled with ``worker``, the
        gateway's name for it, which may differ from the worker's own."""
        status.worker = worker
        self._generation += 1
        data = cpb.ModelControlStatusResponse(workers=[status]).SerializeToString()
        self._latest[worker] = WorkerStatus(worker, status, data, self._generation)
        self._wake()

    def forget(self, worker: str) -> None:
        """``worker``'s status stream ended: its last status is no longer current."""
        if self._latest.pop(worker, None) is not None:
            self._generation += 1
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @property
    def generation(self) -> int:
        """Goes up with every change."""
        return self._generation

    def latest(self) -> Mapping[str, WorkerStatus]:
        """Each worker's latest status, by worker name (a copy)."""
        return dict(self._latest)

    async def changed_after(self, generation: int) -> None:
        """Return once the board has changed since it was at ``generation``."""
        while self._generation == generation:
            await self._changed.wait()


def _interval(request: cpb.WatchStatusRequest) -> float:
    interval = request.interval_seconds if request.interval_seconds > 0 else DEFAULT_WATCH_INTERVAL
    return max(interval, MIN_WATCH_INTERVAL)


class GatewayControlService:
    """``WorkerControl`` over ``upstreams`` (worker name -> :class:`Upstream`, shared with the
    gateway, which adds and removes workers) and the ``board`` discovery fills. ``draining`` set:
    the status streams end (with OK), as a worker's do when it drains."""

    def __init__(self, upstreams: Mapping[str, Upstream], board: StatusBoard, draining: trio.Event) -> None:
        self.upstreams = upstreams
        self.board = board
        self.draining = draining

    def __mapping__(self) -> dict[str, Handler]:
        unary = Cardinality.UNARY_UNARY
        return {
            CONTROL + "ModelControlStatus": Handler(self._status, unary, cpb.ModelControlStatusRequest,
                                                    cpb.ModelControlStatusResponse),
            CONTROL + "SetModelResidency": Handler(self._per_model("SetModelResidency", cpb.SetModelResidencyResponse),
                                                   unary, cpb.SetModelResidencyRequest, cpb.SetModelResidencyResponse),
            CONTROL + "SetModelPolicy": Handler(self._per_model("SetModelPolicy", cpb.SetModelPolicyResponse),
                                                unary, cpb.SetModelPolicyRequest, cpb.SetModelPolicyResponse),
            CONTROL + "CompactMemory": Handler(self._compact, unary, cpb.CompactMemoryRequest,
                                               cpb.CompactMemoryResponse),
            CONTROL + "WatchStatus": Handler(self._watch, Cardinality.UNARY_STREAM, cpb.WatchStatusRequest, RawMessage),
        }

    # ---- status --------------------------------------------------------------------------
    async def _status(self, stream) -> None:
        await stream.recv_message()
        latest = self.board.latest()
        await stream.send_message(cpb.ModelControlStatusResponse(
            workers=[latest[w].status for w in sorted(latest)]))

    async def _watch(self, stream) -> None:
        interval = _interval(await stream.recv_message())
        sent: dict[str, int] = {}          # worker -> generation of the status last sent
        with trio.CancelScope() as scope:
            async def end_on_drain() -> None:
                await self.draining.wait()
                scope.cancel()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(end_on_drain)
                while True:
                    seen = self.board.generation
                    for worker, entry in sorted(self.board.latest().items()):
                        if sent.get(worker) != entry.generation:
                            sent[worker] = entry.generation
                            await stream.send_message(RawMessage(entry.data))
                    # pace: the next round no sooner than one interval on, and only once
                    # something changed (a worker that went quiet is not sent again)
                    await trio.sleep(interval)
                    await self.board.changed_after(seen)

    # ---- changes -------------------------------------------------------------------------
    def _per_model(self, method: str, reply_type):
        """A handler that sends the request to its ``worker``, or to every worker whose latest
        status lists its model; the first worker's reply answers it."""
        async def handler(stream) -> None:
            request = await stream.recv_message()
            if request.worker:
                workers = [self._named(request.worker)]
            else:
                latest = self.board.latest()
                workers = sorted(w for w, entry in latest.items()
                                 if any(m.name == request.model for m in entry.status.models))
                if not workers:
                    known = sorted({m.name for entry in latest.values() for m in entry.status.models})
                    raise GRPCError(Status.NOT_FOUND, f"no worker reports model '{request.model}' (known models: "
                                                      f"{', '.join(known) or 'none'})")
            replies = await self._gather(method, request, reply_type, workers)
            await stream.send_message(next(iter(replies.values())))
        return handler

    async def _compact(self, stream) -> None:
        request = await stream.recv_message()
        if request.worker:
            workers = [self._named(request.worker)]
        else:
            workers = sorted(w for w, u in self.upstreams.items() if u.up)
            if not workers:
                raise GRPCError(Status.UNAVAILABLE, "no worker is reachable")
        replies = await self._gather("CompactMemory", request, cpb.CompactMemoryResponse, workers)
        await stream.send_message(cpb.CompactMemoryResponse(
            message="; ".join(f"{w}: {r.message}" for w, r in replies.items()),
            freed_bytes=sum(r.freed_bytes for r in replies.values())))

    def _named(self, worker: str) -> str:
        if worker not in self.upstreams:
            raise GRPCError(Status.NOT_FOUND, f"the gateway fronts no worker '{worker}' (its workers: "
                                              f"{', '.join(sorted(self.upstreams)) or 'none'})")
        return worker

    async def _gather(self, method: str, request, reply_type, workers: list[str]) -> dict[str, object]:
        """``method`` on each of ``workers`` at once, with ``worker`` cleared (the gateway's name
        for a worker need not be the worker's own): worker -> parsed reply, in ``workers``'
        order. Any failure fails the call, naming its worker and where it succeeded."""
        data = _without_worker(request).SerializeToString()
        outcomes: dict[str, object] = {}

        async def one(worker: str) -> None:
            upstream = self.upstreams.get(worker)
            if upstream is None:
                outcomes[worker] = GRPCError(Status.UNAVAILABLE, "removed from the gateway")
                return
            outcome = await upstream.request(CONTROL + method, data, timeout=upstream.request_timeout)
            outcomes[worker] = _parse(outcome, reply_type)
        async with trio.open_nursery() as nursery:
            for worker in workers:
                nursery.start_soon(one, worker)
        replies = {w: outcomes[w] for w in workers}
        raise_first_failure(replies)
        log.info("gateway: %s%s on %s", method, f" of {request.model}" if hasattr(request, "model") else "",
                 ", ".join(workers))
        return replies


def _without_worker(request):
    copy = type(request)()
    copy.CopyFrom(request)
    copy.worker = ""
    return copy


def _parse(outcome: Reply | UpstreamError, reply_type):
    """The worker's reply parsed, or the GRPCError it comes to."""
    if isinstance(outcome, UpstreamError):
        return GRPCError(outcome.status, outcome.message)
    if outcome.status != 0:
        return GRPCError(status_named(outcome.status), outcome.message)
    messages = outcome.messages()
    try:
        return reply_type.FromString(messages[0] if messages else b"")
    except Exception as exc:
        return GRPCError(Status.INTERNAL, f"its reply is not a {reply_type.DESCRIPTOR.full_name}: {exc}")

