"""The worker as the frontend sees it: one frozen :class:`WorkerPort`.

The gRPC services (:mod:`xlaserve.frontend.kserve`, :mod:`xlaserve.frontend.control`) hold a
port and nothing else of the worker. It names exactly what they use: read-only views of the
model table, the statistics, the scheduler's policies and the weight cache, and the few
operations they may ask for (submit or cancel an inference, load or unload a model, change a
policy or a residency, compact memory). The port is defined here, on the frontend's side, and
filled by the worker's composition root (:mod:`xlaserve.app.compose`), the one module that
knows both sides; no frontend module imports the worker's wiring.

The views are :class:`typing.Protocol` types, so a test can serve the frontend from small
stand-ins. Everything is called on the Trio thread.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from xlaserve.frontend.bridge import Bridge

if TYPE_CHECKING:   # the value types the views hand out; the frontend only reads them
    from xlaserve.frontend.shm import SharedMemoryRegistry
    from xlaserve.metrics import RequestTally
    from xlaserve.worker.inference import HookThreads
    from xlaserve.runtime.residency import Floor
    from xlaserve.runtime.weights import CacheSnapshot
    from xlaserve.worker.inference import ClientRequest
    from xlaserve.worker.policy import CostSnapshot
    from xlaserve.worker.registry import ModelEntry
    from xlaserve.worker.scheduler import ModelPolicy
    from xlaserve.worker.stats import ModelStats


class ModelTableView(Protocol):
    """The model table, read-only (``worker/registry.py``'s ``ModelTable``)."""

    @property
    def snapshot(self) -> Mapping[str, ModelEntry]:
        """Every model the worker knows, by name: an immutable mapping, replaced (never changed)
        when a model's state changes, so one read is one consistent view."""

    def ready(self) -> bool:
        """The worker's readiness (``ServerReady``, ``/readyz``)."""


class SchedulingView(Protocol):
    """The scheduler's policies and queues (``worker/scheduler.py``'s ``Scheduler``)."""

    def policy(self, model: str) -> ModelPolicy:
        """A model's effective scheduling settings."""

    def depth(self, model: str) -> int:
        """How many requests of ``model`` are queued."""

    def costs(self) -> tuple[CostSnapshot, ...]:
        """The learned execution time of every (model, compiled batch size) measured so far."""

    def set_policy(self, model: str, weight: float | None = None, max_batch_size: int | None = None,
                   batch_delay_seconds: float | None = None,
                   batch_target_rows: int | None = None) -> ModelPolicy:
        """Override a model's settings (None: unchanged); raises ValueError for a bad value."""


class WeightsView(Protocol):
    """The weight cache (``runtime/weights.py``'s ``WeightCache``)."""

    def snapshot(self) -> CacheSnapshot:
        """The whole cache as a frozen value."""

    def floor_of(self, name: str) -> Floor:
        """A model's residency floor now."""

    def set_residency(self, model_name: str, floor: str) -> None:
        """Change a model's floor from now on (ValueError for an unknown floor)."""

    async def compact(self) -> tuple[str, int]:
        """Defragment device memory (evicts nothing): what was done, and the bytes freed."""


@dataclass(frozen=True, slots=True)
class WorkerPort:
    """What the frontend may read and ask of the worker. Built once, by the composition root."""

    worker_name: str                      #: the worker's name (``WorkerControl`` status)
    backend: str                          #: the device's PJRT backend, e.g. ``cpu``
    models: ModelTableView                #: model lookup and readiness
    statistics: Callable[[str], ModelStats]   #: a model's cumulative statistics, as a frozen value
    scheduling: SchedulingView
    weights: WeightsView
    #: Hand a decoded, admitted request to the worker; its ``reply`` is called exactly once.
    submit: Callable[[ClientRequest], None]
    #: The client of the request submitted with this ticket went away: take it out of its queue
    #: if it is still there (it is still answered once).
    cancel: Callable[[Hashable], None]
    #: Replies from any thread to the Trio thread (:class:`~xlaserve.frontend.bridge.Bridge`).
    bridge: Bridge
    #: Load, reload or unload a model by name; raise an XlaserveError saying why not (a static
    #: model set, a busy lifecycle actor, a bundle that failed).
    load_model: Callable[[str], Awaitable[None]]
    unload_model: Callable[[str], Awaitable[None]]
    #: Count one answered inference request: model, status name (``OK``, ``NOT_FOUND``...), seconds.
    observe_request: Callable[[str, str, float], None]
    #: Start a task in the worker's own nursery (``spawn(async_fn, *args)``), for work a client
    #: that hangs up must not cancel halfway.
    spawn: Callable[..., None]
    #: Set when the worker starts draining: a call that would never end on its own (a status
    #: stream) ends then. The frontend only waits on it.
    draining: trio.Event
    #: Client shared-memory regions, or None when ``endpoints.allow_client_shm`` is off.
    shared_memory: SharedMemoryRegistry | None = None
    #: The scheduler's ``discipline`` (``WorkerControl`` status: a gateway checks it).
    discipline: str = "fair"
    #: A model's requests as counted since the worker started (latency buckets, rejections by
    #: reason), as a frozen value; None: not counted (the status says zeros).
    tally: Callable[[str], RequestTally] | None = None
    #: Seconds since the worker started; None: unknown (the status says 0).
    uptime: Callable[[], float] | None = None
    #: Compiled-executable cache lookups so far by result (``hit``, ``miss``, ``rejected``), a
    #: copy; None: no cache.
    executable_cache: Callable[[], Mapping[str, int]] | None = None
    #: The hook and meta thread pools now (a frozen ``HookThreads``); None: not known (zeros).
    hook_threads: Callable[[], HookThreads] | None = None
