"""The weight cache: every model's weights in host RAM, device copies on demand under a budget.

One object, used from the Trio thread only (the dispatch loop asks :meth:`WeightCache.ensure_resident`
before each execution; the lifecycle actor calls :meth:`admit` and :meth:`release`; the control
API calls :meth:`set_residency` and :meth:`compact`). Every transition that copies is serialized
by one lock, so the bookkeeping in :class:`~xlaserve.runtime.residency.ResidencyBook` always
matches the device arrays held here. On cpu a load copies into a :class:`~xlaserve.runtime.pool.WeightPool`
(device memory allocated once and reused). On-demand loads run under the device's capacity
limiter (one thing touches the device at a time): on the Trio thread when they are expected to
on cpu, from the host copy: in steps of :data:`LOAD_STEP_BYTES` with checkpoints between (a thread
hop would cost more than the copy of a small model); else in a thread. A prefetch's copy starts in a thread of its own the moment it
is hinted, so that it overlaps the execution that follows, even one that runs on the Trio thread.
"""
from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import outcome
import trio

from xlaserve.bundle import ModelVersion
from xlaserve.errors import FailedPrecondition, StartupError, Unavailable
from xlaserve.runtime.cachetrace import TraceWriter
from xlaserve.runtime.eviction import DEFAULT_MISS_OVERHEAD, DEFAULT_POLICY, LoadCost, make_policy
from xlaserve.runtime.pjrt import Device, weights_signature
from xlaserve.runtime.pool import PoolStats, WeightPool, packed_span
from xlaserve.runtime.residency import Budget, Floor, ResidencyBook, ThrashMonitor, fmt_bytes

log = logging.getLogger("xlaserve.weights")

Key = tuple[str, int]

LOAD_STEP_BYTES = 4 << 20
"""On cpu, an on-demand load from the host copy runs on the Trio thread, without a thread hop,
in steps of about this many bytes with a checkpoint between them (about 0.4 ms of copying each
on this machine), so that a large model does not hold the event loop for its whole copy. A hop
costs 75 us here when the machine is idle and from several hundred us to 2.5 ms when its two
cores are shared (measured: docs/weights.md), seven to thirty times the copy of a 256 KiB model."""

TRANSFER_POLL_SECONDS = 0.005
"""On a GPU with page-locked host copies, a load's DMA is started on the Trio thread and its end
is polled for at every pass of the scheduler for up to this long (a load of up to about 100 MiB
over PCIe 4), without a thread hop or a wake-up; a longer one is then waited for in a thread."""


class CatalogTooLarge(StartupError):
    """With ``weight_cache_fraction: 0`` every model must be resident, and they do not fit."""


@dataclass(frozen=True, slots=True)
class ModelResidency:
    """A snapshot of one model version in the weight cache."""

    model: str
    version: int
    floor: str               # device | system | unpinned
    weight_bytes: int
    resident_bytes: int      # on the device now (0 or weight_bytes)
    host_bytes: int          # host copy kept (0 for unpinned)
    loads: int
    hits: int
    evictions: int
    bytes_copied: int = 0    # onto the device, all loads (on demand, prefetch, pin)
    misses: int = 0          # loads a dispatch waited for (not prefetch or pin)
    eviction_rank: int = 0   # 1: the next victim of a load; 0: not evictable now (not resident, pinned, loading)


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    """A snapshot of the whole weight cache; models are listed least recently used first among
    the resident ones, then the rest by name."""

    budget_bytes: int
    resident_bytes: int
    pinned_bytes: int
    arena_bytes: int
    headroom_bytes: int
    on_demand: bool
    host_memory_kind: str
    models: tuple[ModelResidency, ...]
    policy: str = DEFAULT_POLICY
    next_victim: tuple[str, int] | None = None   # what a load would evict first now (eviction_order[0])
    prefetches: int = 0          # copies started by a hint
    prefetches_landed: int = 0   # ... done before their model was needed
    prefetches_late: int = 0     # ... still copying when their model was needed (it waited)
    pool: PoolStats | None = None    # device memory for weights (cpu), None where the allocator pools
    # What a load would evict now, in order (next victim first; a load evicts a prefix): the
    # policy's order over the resident models that are not pinned or loading, those with queued
    # work (the scheduler's set_queued) last, as ResidencyBook.plan takes them.
    eviction_order: tuple[tuple[str, int], ...] = ()

    def __iter__(self):
        """Iterating a snapshot yields its per-model entries."""
        return iter(self.models)


def budget_for(runtime, device: Device) -> Budget:
    """The budget a worker starts with, from its ``runtime:`` config (before any executable's
    activations are known). The arena is the device allocator's pool on a GPU, which
    ``mem_fraction`` already sized (``mem_fraction`` x device memory; the allocator reports the
    pool as its limit), and ``device_memory_bytes`` (default: all of the machine's RAM) on cpu."""
    if device.backend == "cpu":
        arena = runtime.device_memory_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        arena = device.memory_bytes()
        if arena is None:
            raise RuntimeError(f"the {device.backend} device does not report its memory size; "
                               "cannot size the weight budget")
    return Budget(int(arena), runtime.weight_cache_fraction, int(runtime.weight_cache_wiggle_fraction * arena))


def activation_bytes(model: ModelVersion) -> int:
    """The most device memory one execution of ``model`` needs besides its weights."""
    most = 0
    for module in model.modules.values():
        m = module.memory
        most = max(most, m.temp_bytes + m.output_bytes + max(0, m.argument_bytes - model.weight_bytes))
    return most


@dataclass(slots=True)
class _Counts:
    loads: int = 0
    hits: int = 0
    evictions: int = 0
    bytes_copied: int = 0
    misses: int = 0


class WeightCache:
    """``eviction`` names the replacement policy (:data:`~xlaserve.runtime.eviction.POLICIES`;
    ValueError otherwise); ``trace`` records every reference (:mod:`xlaserve.runtime.cachetrace`)
    and is closed when :meth:`run` ends."""

    def __init__(self, device: Device, limiter: trio.CapacityLimiter, budget: Budget | None = None, *,
                 residency: Callable[[str], str] = lambda name: "system", metrics=None,
                 compaction_interval: int = 0, prefetch: bool | None = None,
                 eviction: str = DEFAULT_POLICY, trace: TraceWriter | None = None,
                 miss_overhead: float = DEFAULT_MISS_OVERHEAD) -> None:
        self._device = device
        self._limiter = limiter
        self._budget = budget or Budget(1 << 62, 1.0, 0)
        self._budget_logged = False
        self._load_cost = LoadCost(charged_beside=miss_overhead)
        self._miss_overhead = miss_overhead
        self._host_changes = 0       # counts changes of self._host, which decides a load's source
        self._policy = make_policy(eviction, self._cost_of, self._cost_generation)
        self._book = ResidencyBook(self._budget.bytes, self._policy)
        self._trace = trace
        self._last_load_seconds = 0.0
        self._residency = residency
        self._overrides: dict[str, Floor] = {}
        #: keys whose floors a task is bringing their copies up to, and whether it was asked again
        #: meanwhile: one such task per key, so a storm of residency changes reads one host copy
        #: at a time, not one per change
        self._applying: dict[Key, bool] = {}
        self._metrics = metrics
        self._compaction_interval = compaction_interval
        # prefetch: runtime.weight_prefetch as resolved for this device (None: on).
        # XLASERVE_WEIGHT_PREFETCH=0 or 1 overrides it (a benchmarking knob).
        forced = os.environ.get("XLASERVE_WEIGHT_PREFETCH")
        self._prefetch_enabled = forced != "0" if forced in ("0", "1") else prefetch is not False
        self._lock = trio.Lock()
        self._models: dict[Key, ModelVersion] = {}
        self._versions: dict[str, set[Key]] = {}     # model name -> its keys in the book
        self._host: dict[Key, tuple] = {}
        # with the pool, key -> its host copy's layout, fixed while the copy lives: its one span
        # (packed_span; None when its tensors do not lie as a slot's) and weights_signature
        self._layouts: dict[Key, tuple[object, tuple]] = {}
        # Issue 5 (reload): a replaced version's host copy, kept for requests admitted to it
        # that have not run yet; they get a transient device copy. Re-reading by path would give
        # them the new file's weights. Kept for exactly as long as something (a request in a
        # frontend, a hook, a queue) still holds that ModelVersion: a finalizer drops it when the
        # version is collected. A newer version running first says nothing: a request resolved
        # to the old version just before the swap may reach the queue after newer ones.
        self._retired: dict[Key, tuple] = {}
        self._released: set[Key] = set()
        self._device_arrays: dict[Key, tuple] = {}
        self._counts: dict[Key, _Counts] = {}
        self._prefetching: dict[Key, trio.Event] = {}
        self._prefetched: set[Key] = set()
        self._prefetch_counts = [0, 0, 0]     # started, landed, late
        self._prefetch_copied: dict[Key, list] = {}   # key -> [outcome] once its copy thread is done
        self._pool = WeightPool(self._budget.bytes, collect=device.collect_garbage) if device.pools_weights else None
        self._current: Key | None = None
        #: whether the last ensure_resident found the weights on the device (False: it copied
        #: them; a request's trace says which)
        self.last_hit = True
        self._queued: frozenset[Key] = frozenset()   # models with queued work (the scheduler says)
        self._loads_since_compaction = 0
        self._thrash = ThrashMonitor()
        self._recent_evictions: deque[tuple[str, int]] = deque(maxlen=self._thrash.window)
        self._nursery: trio.Nursery | None = None
        watch = getattr(metrics, "watch", None)
        if watch is not None:               # the state gauges (residency, budget, order, pool) read snapshot() when scraped
            watch(self.snapshot)

    # ---- the actor's home: a nursery for prefetches ---------------------------------------
    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Host prefetch copies until cancelled. Without it the cache works, minus prefetch."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            if self._trace is not None:
                self._trace.close()

    @property
    def budget(self) -> Budget:
        return self._budget

    def _source(self, key: Key) -> str:
        """Where a load of ``key`` copies from: its host copy, or the file (unpinned)."""
        return "host" if key in self._host else "disk"

    def _cost_of(self, key: Key, nbytes: int) -> float:
        """What the replacement policy charges for missing ``key``: the learned time of its copy
        plus the fixed part of a miss that the copy's timing does not see."""
        return self._load_cost(nbytes, self._source(key)) + self._miss_overhead

    def _cost_generation(self) -> int:
        """Changes whenever :meth:`_cost_of` may answer differently: a load was timed, or a host
        copy came or went (both counters only grow, so their sum changes with either)."""
        return self._load_cost.generation + self._host_changes

    # ---- admission (lifecycle) ------------------------------------------------------------
    def floor_of(self, name: str) -> Floor:
        if not self._budget.on_demand:
            return Floor.DEVICE
        return self._overrides.get(name) or Floor.parse(self._residency(name))

    async def admit(self, model: ModelVersion, *, during_startup: bool = False) -> str:
        """Take a newly loaded version into the cache: size the activation headroom from its
        executables, check that its weights can ever fit, keep its host copy (floors
        ``system``/``device``) and pin it (``device``). Returns why the model cannot be served
        (the reason its state becomes UNAVAILABLE), or ''. With ``weight_cache_fraction: 0`` a
        catalog that does not fit raises :class:`CatalogTooLarge` during start-up."""
        key = (model.name, model.version)
        if key in self._book:
            return ""
        # A model without weights still needs its activations free on the device.
        activations = activation_bytes(model)
        refused = self._headroom_refusal(activations)
        if refused:
            reason = f"model '{model.name}' cannot be served on this device: {refused} ({self._budget.explain()})"
            if during_startup and not self._budget.on_demand:
                raise CatalogTooLarge(reason)
            return reason
        if model.weights is None:
            self._grow_headroom(activations)
            return ""
        before = self._budget
        self._grow_headroom(activations)
        floor = self.floor_of(model.name)
        refused = self._book.add(key, model.weight_bytes, floor)
        if refused:
            # a model that is not served keeps no headroom for its executables
            self._budget = before
            self._book.set_budget(before.bytes)
            reason = f"model '{model.name}' cannot be served on this device: {refused} ({self._budget.explain()})"
            if not self._budget.on_demand:
                reason = (f"weight_cache_fraction is 0 (all weights resident) and model '{model.name}' does not "
                          f"fit: {refused}; resident already: {self._describe_resident()} ({self._budget.explain()})")
                if during_startup:
                    raise CatalogTooLarge(reason)
            return reason
        self._models[key] = model
        self._versions.setdefault(model.name, set()).add(key)
        self._counts[key] = _Counts()
        try:
            if floor is not Floor.UNPINNED:
                self._keep_host(key, await trio.to_thread.run_sync(self._read_host, model))
            if floor is Floor.DEVICE:
                async with self._lock:
                    await self._make_resident(key, self._limiter, why="pin")
        except BaseException:
            # Forgotten, not released: a failed admission served nothing, and its number is the
            # next good version's (a failed load uses none). Marked released, that version,
            # admitted afresh a moment later, answered every request "its weights are gone".
            self._forget(key)
            raise
        return ""

    def _read_host(self, model: ModelVersion) -> tuple:
        return self._device.host_store(model.weights.read())

    def _keep_host(self, key: Key, host: tuple) -> None:
        """``host`` is ``key``'s host copy now; with the pool, its layout is worked out once
        here, not on every miss: its one span when its tensors lie as a slot's do (the bundle
        reads them so), which a load copies at once, and the signature a slot must match."""
        self._host[key] = host
        if self._pool is not None:
            self._layouts[key] = (packed_span(host), weights_signature(host))
        self._host_changes += 1

    def _drop_host(self, key: Key) -> None:
        self._host.pop(key, None)
        self._layouts.pop(key, None)
        self._host_changes += 1

    def log_budget(self) -> None:
        """Log the budget (at INFO, once the start-up set is admitted, so the headroom reflects
        its largest executable); from then on each change to it is logged as it happens."""
        log.info("weight cache: %s", self._budget.explain())
        self._budget_logged = True

    def _headroom_refusal(self, activations: int) -> str:
        """Why executables that need ``activations`` bytes beside their weights cannot be taken
        on, or '': keeping that much free would shrink the budget below what the pinned models
        hold, and those are never evicted to make room, so the device would hold more weights
        than the budget and an execution could run out of device memory."""
        if activations <= self._budget.activations:
            return ""
        grown = Budget(self._budget.arena, self._budget.fraction, self._budget.wiggle, activations)
        pinned = self._book.pinned_bytes()
        if pinned <= grown.bytes:
            return ""
        return (f"its executables need {fmt_bytes(activations)} of device memory beside the weights, and keeping "
                f"that free would shrink the device weight budget to {fmt_bytes(grown.bytes)}, less than the "
                f"{fmt_bytes(pinned)} that pinned models (residency: device) hold")

    def _grow_headroom(self, activations: int) -> None:
        if activations <= self._budget.activations:
            return
        self._budget = Budget(self._budget.arena, self._budget.fraction, self._budget.wiggle, activations)
        self._book.set_budget(self._budget.bytes)
        # Start-up loads grow the headroom model by model; log_budget() reports the outcome once.
        log.log(logging.INFO if self._budget_logged else logging.DEBUG, "weight cache: %s", self._budget.explain())
        # A smaller budget: evict what no longer fits (idle, unpinned models only).
        while self._book.free_bytes() < 0:
            victim = next(self._book.evictable((self._current,)), None)
            if victim is None:
                break
            self._evict(victim)

    def release(self, name: str, version: int | None = None) -> None:
        """Forget a model (all versions when ``version`` is None): device copy, host copy, state."""
        if version is not None:
            key = (name, version)
            self._released.add(key)
            model = self._models.get(key)
            if key in self._host and model is not None:
                self._retired[key] = self._host[key]
                weakref.finalize(model, self._forget_retired, key)
        else:
            for key in [k for k in self._retired if k[0] == name]:
                del self._retired[key]
            self._released.update(k for k in self._book.keys() if k[0] == name)
        for key in [k for k in self._book.keys() if k[0] == name and (version is None or k[1] == version)]:
            self._forget(key)

    def _forget(self, key: Key) -> None:
        """Drop everything the cache holds for ``key``: device copy, host copy, state."""
        self._book.remove(key)
        self._device_arrays.pop(key, None)
        self._drop_host(key)
        self._models.pop(key, None)
        versions = self._versions.get(key[0])
        if versions is not None:
            versions.discard(key)
            if not versions:
                del self._versions[key[0]]
        self._counts.pop(key, None)
        self._prefetched.discard(key)

    def _forget_retired(self, key: Key) -> None:
        """A replaced version is gone (no request holds it): drop its host copy. Runs on
        whichever thread dropped the last reference; dict.pop and set.discard are atomic."""
        if self._retired.pop(key, None) is not None:
            log.debug("%s v%d: no request holds the replaced version any more; its host copy is dropped", *key)
        self._released.discard(key)

    # ---- the dispatch loop's side ---------------------------------------------------------
    async def ensure_resident(self, model: ModelVersion) -> tuple[object, ...]:
        """The model's weights as device arrays, in binding order. A cold model costs one
        batched host-to-device copy after evicting unpinned models in the policy's order."""
        if model.weights is None:
            self.last_hit = True
            return ()
        key = (model.name, model.version)
        if key in self._released:
            host = self._retired.get(key)
            if host is None:
                raise Unavailable(f"model '{model.name}' version {model.version} was replaced or unloaded before "
                                  "this request ran and its weights are gone; retry")
            self.last_hit = False
            return await trio.to_thread.run_sync(self._device.put_weights, host, limiter=self._limiter)
        if key not in self._book:
            reason = await self.admit(model)
            if reason:
                raise Unavailable(reason)
        pending = self._prefetching.get(key)
        if pending is not None:
            # landed: the copy is done and only its bookkeeping task has not run yet
            self._prefetch_counts[1 if self._prefetch_copied.get(key) else 2] += 1
            await pending.wait()
        elif key in self._prefetched:
            self._prefetch_counts[1] += 1
        evicted = 0
        loaded: float | None = None
        if self._book.is_resident(key):
            self._hit(key)
            arrays = self._device_arrays[key]
        else:
            waited = time.perf_counter()
            lock = self._lock
            try:
                lock.acquire_nowait()       # free (the usual case): no trip through the scheduler
            except trio.WouldBlock:
                await lock.acquire()
            try:
                if self._book.is_resident(key):
                    self._hit(key)
                    arrays = self._device_arrays[key]
                else:
                    evicted, arrays = await (self._make_resident_after_prefetch(key) if self._prefetching
                                             else self._make_resident(key, self._limiter))
                    loaded = self._last_load_seconds
                    if self._metrics is not None:   # the whole miss: plan, evictions, copy, bookkeeping
                        self._metrics.missed(time.perf_counter() - waited)
            finally:
                lock.release()
        self._current = key
        self.last_hit = loaded is None
        self._book.touch(key)
        if self._trace is not None and key in self._book:
            self._trace.record(key[0], key[1], model.weight_bytes, self._book.floor(key).value,
                               loaded is None, loaded)
        if self._thrash.record(evicted > 0):
            self._warn_thrashing()
        return arrays

    def _hit(self, key: Key) -> None:
        self._counts[key].hits += 1
        prefetched = key in self._prefetched
        self._prefetched.discard(key)
        if self._metrics is not None:
            self._metrics.hit(key[0], prefetched)

    async def _make_resident_after_prefetch(self, key: Key) -> tuple[int, tuple]:
        """:meth:`_make_resident` for a dispatch; the lock is held. A prefetch under way holds
        bytes nothing may evict until its copy lands: when those are what keeps ``key`` from
        fitting, wait for it (it cannot take long: it is one model's copy, and no other prefetch
        starts while the lock is held) and plan again, rather than failing the request."""
        while True:
            try:
                return await self._make_resident(key, self._limiter)
            except Unavailable:
                pending = next(iter(self._prefetching.values()), None)
                if pending is None:
                    raise
                await pending.wait()

    async def _make_resident(self, key: Key, limiter: trio.CapacityLimiter, *, why: str = "demand",
                             protect: tuple[Key, ...] = ()) -> tuple[int, tuple]:
        """Evict what the plan says and copy ``key`` onto the device; the lock is held. Returns
        how many models were evicted and the device arrays. Raises Unavailable when it cannot
        fit now."""
        evicted = self._begin_load(key, protect)
        model = self._models[key]
        started = time.perf_counter()
        try:
            if self._copies_inline(key, limiter):
                try:
                    host = self._host[key]
                    # one step's worth: into an idle slot at once if there is one (no generator)
                    span, signature = self._layouts[key]      # (inline: the pool and a host copy)
                    small = model.weight_bytes <= LOAD_STEP_BYTES
                    arrays = self._device.load_weights_into_slot(host, self._pool, signature, span) if small else None
                    if arrays is None:      # (a small one found no idle slot just now: not looked for again)
                        arrays = await self._copy_in_steps(host, span, signature, reuse=not small)
                finally:
                    limiter.release()
            elif self._device.transfers_async and key in self._host:
                arrays = await self._transfer(self._host[key], limiter)
            else:
                arrays = await trio.to_thread.run_sync(self._copy_blocking, key, model, limiter=limiter)
        except BaseException:
            self._book.finish_load(key, ok=False)
            raise
        self._finish_load(key, model, arrays, time.perf_counter() - started, why)
        if self._compaction_interval:
            await self._maybe_compact()
        return evicted, arrays

    def _begin_load(self, key: Key, protect: tuple[Key, ...]) -> int:
        """Evict what the plan says and reserve ``key``'s bytes; returns how many were evicted.
        Raises Unavailable when it cannot fit now."""
        plan = self._book.plan(key, protect, spare=self._queued)
        if not plan.ok:
            raise Unavailable(f"model '{key[0]}' cannot be made resident now: {plan.refused}")
        for victim in plan.evict:
            self._evict(victim)
        self._book.begin_load(key)
        return len(plan.evict)

    def _copies_inline(self, key: Key, limiter: trio.CapacityLimiter) -> bool:
        """Whether this load runs on the Trio thread: a copy from the host copy into the pool,
        with the device free (then the limiter is held and must be released by the caller)."""
        if self._pool is None or key not in self._host:
            return False
        try:
            limiter.acquire_nowait()
        except trio.WouldBlock:
            return False
        return True

    async def _transfer(self, host: tuple, limiter: trio.CapacityLimiter) -> tuple:
        """A load that is a DMA from page-locked host memory (cuda): started here (PJRT enqueues
        it and returns), then polled for at each scheduler pass, so that the load costs the
        transfer, not a thread hop and two wake-ups; after :data:`TRANSFER_POLL_SECONDS` the
        rest is waited for in a thread."""
        async with limiter:
            arrays = self._device.start_weights(host)
            give_up = time.perf_counter() + TRANSFER_POLL_SECONDS
            while not self._device.weights_ready(arrays):
                if time.perf_counter() > give_up:
                    return await trio.to_thread.run_sync(self._device.wait_weights, arrays)
                await trio.sleep(0)
            return self._device.wait_weights(arrays)    # done: raises if the transfer failed

    async def _copy_in_steps(self, host: tuple, span, signature: tuple, reuse: bool = True) -> tuple:
        steps = self._device.load_weights_in_steps(host, self._pool, LOAD_STEP_BYTES, span, signature, reuse)
        try:
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    return done.value
                await trio.lowlevel.checkpoint()
        finally:
            steps.close()               # cancelled part way: the extent goes back to the pool

    def _finish_load(self, key: Key, model: ModelVersion, arrays: tuple, seconds: float, why: str) -> None:
        """The copy of ``key`` is done: it is resident (unless released meanwhile), counted and timed."""
        self._last_load_seconds = seconds
        if key not in self._book:          # released while the copy ran: usable once, not kept
            return
        self._load_cost.observe(model.weight_bytes, seconds, self._source(key))
        self._book.finish_load(key)
        self._device_arrays[key] = arrays
        counts = self._counts[key]
        counts.loads += 1
        counts.bytes_copied += model.weight_bytes
        if why == "demand":
            counts.misses += 1
        elif why == "prefetch":
            self._prefetched.add(key)
        if self._metrics is not None:
            self._metrics.load(key[0], seconds, miss=why == "demand", nbytes=model.weight_bytes)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("loaded %s v%d: %s in %.1f ms (%s)", key[0], key[1], fmt_bytes(model.weight_bytes),
                      seconds * 1e3, why)

    def _copy_blocking(self, key: Key, model: ModelVersion) -> tuple:
        host = self._host.get(key)
        if host is None:                    # unpinned: no host copy, read from disk every time
            try:
                host = model.weights.read()
            except OSError as exc:
                raise Unavailable(f"model '{model.name}' (residency unpinned) cannot read its weights from "
                                  f"{model.weights.file}: {exc.strerror or exc}") from None
        return self._device.load_weights(host, self._pool)

    def _evict(self, key: Key) -> None:
        self._book.evict(key)
        arrays = self._device_arrays.pop(key, None)
        if arrays and self._pool is not None:
            self._pool.released(arrays)
        self._counts[key].evictions += 1
        self._prefetched.discard(key)
        nbytes = self._book.nbytes(key)
        self._recent_evictions.append((key[0], nbytes))
        if self._metrics is not None:
            self._metrics.evict(key[0])

    def _warn_thrashing(self) -> None:
        sizes: dict[str, int] = {}
        for name, nbytes in self._recent_evictions:
            sizes[name] = nbytes
        listed = ", ".join(f"{n} ({fmt_bytes(b)})" for n, b in sorted(sizes.items(), key=lambda x: -x[1]))
        quiet = self._thrash.warned()
        since = (f" (and in {quiet} more window(s) of {self._thrash.window} since the last warning, not logged: "
                 f"at most one warning every {self._thrash.interval:g} s)" if quiet else "")
        log.warning("weight cache is thrashing: %.0f%% of the last %d dispatches evicted weights%s; evicted: %s; "
                    "%s. Serve fewer models on this worker, pin the hot ones (residency: device), or raise "
                    "weight_cache_fraction", 100 * self._thrash.evicting_share, self._thrash.window, since, listed,
                    self._budget.explain())

    def load_estimate(self, model: ModelVersion) -> float:
        """0.0 when a dispatch of ``model`` finds its weights on the device (or it has none),
        else the seconds its load is expected to take (the learned load cost)."""
        key = (model.name, model.version)
        if model.weights is None or self._book.is_resident(key):
            return 0.0
        return max(1e-9, self._load_cost(model.weight_bytes, self._source(key)))

    def set_queued(self, models) -> None:
        """The scheduler's models with queued work now: a load evicts them only when the other
        models do not make room, and a prefetch never does."""
        self._queued = frozenset((m.name, m.version) for m in models if m.weights is not None)

    def hint_next(self, model: ModelVersion | None) -> None:
        """The scheduler expects to dispatch ``model`` next: start copying its weights now, while
        the current model executes, unless that would evict the model in use or a pinned one.
        One prefetch at a time. The copy starts in a thread before this returns, so it overlaps
        the execution even when that runs on the Trio thread (an inline execution would
        otherwise run before a task started here had begun)."""
        if (model is None or model.weights is None or not self._prefetch_enabled or self._nursery is None
                or self._lock.locked() or self._prefetching):
            return
        key = (model.name, model.version)
        if key not in self._book or self._book.is_resident(key):
            return
        protect = ((self._current,) if self._current else ()) + tuple(self._queued)   # speculative: spare them
        if not self._book.plan(key, protect).ok:
            return
        self._begin_load(key, protect)
        done = self._prefetching[key] = trio.Event()
        self._prefetch_counts[0] += 1
        copied = trio.Event()
        result: list[outcome.Outcome] = []
        self._prefetch_copied[key] = result
        token = trio.lowlevel.current_trio_token()

        def deliver(got: outcome.Outcome) -> None:
            result.append(got)
            try:
                token.run_sync_soon(copied.set)
            except trio.RunFinishedError:
                pass                        # the server stopped while this copy ran

        started = time.perf_counter()
        trio.lowlevel.start_thread_soon(functools.partial(self._copy_blocking, key, model), deliver,
                                        name=f"xlaserve prefetch {key[0]}")
        self._nursery.start_soon(self._finish_prefetch, key, model, started, copied, result, done)

    async def _finish_prefetch(self, key: Key, model: ModelVersion, started: float, copied: trio.Event,
                               result: list, done: trio.Event) -> None:
        try:
            await copied.wait()
            arrays = result[0].unwrap()
        except BaseException as exc:
            self._book.finish_load(key, ok=False)
            if isinstance(exc, (Unavailable, OSError)):
                log.debug("prefetch of %s failed: %s", key[0], exc)
            elif isinstance(exc, Exception):
                log.exception("prefetch of %s failed", key[0])
            else:
                raise
        else:
            self._finish_load(key, model, arrays, time.perf_counter() - started, "prefetch")
        finally:
            del self._prefetching[key]
            del self._prefetch_copied[key]
            done.set()

    # ---- control API ----------------------------------------------------------------------
    def residency(self, model_name: str) -> str | None:
        """The floor set for ``model_name`` at run time or from its loaded version, or None."""
        override = self._overrides.get(model_name)
        if override is not None:
            return override.value
        keys = [k for k in self._book.keys() if k[0] == model_name]
        return self._book.floor(max(keys)).value if keys else None

    def set_residency(self, model_name: str, floor: str) -> None:
        """Change a model's residency floor now and for its later versions. The bookkeeping
        changes at once; the host copy and a pin's device copy follow in the background.
        Raises ValueError for an unknown floor and FailedPrecondition when pinning would exceed
        the budget or ``weight_cache_fraction`` is 0."""
        new = Floor.parse(floor)
        if not self._budget.on_demand and new is not Floor.DEVICE:
            raise FailedPrecondition("weight_cache_fraction is 0: every model stays resident on the device; "
                                     "set weight_cache_fraction above 0 to use on-demand residency")
        keys = [k for k in self._book.keys() if k[0] == model_name]
        previous = {k: self._book.floor(k) for k in keys}
        for key in keys:
            refused = self._book.set_floor(key, new)
            if refused:
                for k, f in previous.items():
                    self._book.set_floor(k, f)
                raise FailedPrecondition(f"cannot set model '{model_name}' to residency device: {refused}")
        self._overrides[model_name] = new
        for key in keys:
            if new is Floor.UNPINNED:
                self._drop_host(key)
        if self._nursery is not None and new is not Floor.UNPINNED:
            self._nursery.start_soon(self._apply_residency, keys)
        log.info("model %s: residency %s", model_name, new.value)

    async def _apply_residency(self, keys: list[Key]) -> None:
        """Bring host and device copies up to the keys' floors (after :meth:`set_residency`). A
        key another task is applying is left to it: that task applies the floor once more when it
        is done. (A storm of device/unpinned changes on a 1 MiB model, one task and host read
        each, held 68 MiB at its peak.)"""
        for key in keys:
            if key in self._applying:
                self._applying[key] = True
                continue
            self._applying[key] = False
            try:
                await self._apply_floor(key)
                while self._applying[key]:
                    self._applying[key] = False
                    await self._apply_floor(key)
            finally:
                del self._applying[key]

    async def _apply_floor(self, key: Key) -> None:
        """Bring ``key``'s host and device copies up to its floor now."""
        try:
            if self._book.floor(key) is not Floor.UNPINNED and key not in self._host:
                host = await trio.to_thread.run_sync(self._read_host, self._models[key])
                if key in self._book and self._book.floor(key) is not Floor.UNPINNED:
                    self._keep_host(key, host)
                del host            # not held while the pin below waits for the lock
            if key in self._book and self._book.floor(key) is Floor.DEVICE:
                async with self._lock:
                    if key in self._book and not self._book.is_resident(key):
                        await self._make_resident(key, self._limiter, why="pin")
        except KeyError:
            pass                    # released meanwhile
        except (Unavailable, OSError) as exc:
            log.error("model %s: cannot apply residency %s: %s", key[0], self._book.floor(key).value
                      if key in self._book else "?", exc)
        except Exception:           # a bug or a runtime error: this model's residency, not the worker
            log.exception("model %s: applying its residency failed", key[0])

    async def compact(self) -> tuple[str, int]:
        """Defragment device memory where the backend can. Returns a message and the bytes freed."""
        async with self._lock:
            return await self._compact_locked()

    async def _compact_locked(self) -> tuple[str, int]:
        before = self._device.memory_in_use()
        if self._pool is not None:
            freed = self._pool.trim()
            stats = self._pool.stats()
            return (f"gave {fmt_bytes(freed)} of empty weight-pool regions back to the system; the pool keeps "
                    f"{stats.regions} region(s), {fmt_bytes(stats.capacity_bytes)}" if freed else
                    "nothing to do: the weight pool has no empty region", freed)
        if self._device.backend == "cpu":
            return ("nothing to do: the cpu backend allocates each buffer from the system allocator, "
                    "so device memory does not fragment", 0)
        try:
            done = await trio.to_thread.run_sync(self._device.defragment, limiter=self._limiter)
        except Exception as exc:  # a plugin without defragmentation support
            return (f"the {self._device.backend} PJRT client cannot defragment: {type(exc).__name__}: {exc}", 0)
        after = self._device.memory_in_use()
        freed = max(0, (before or 0) - (after or 0))
        return (f"defragmented {self._device.backend} memory" if done else "nothing to do", freed)

    async def _maybe_compact(self) -> None:
        if not self._compaction_interval:
            return
        self._loads_since_compaction += 1
        if self._loads_since_compaction >= self._compaction_interval:
            self._loads_since_compaction = 0
            message, freed = await self._compact_locked()
            log.info("compaction after %d on-demand loads: %s (%s freed)", self._compaction_interval,
                     message, fmt_bytes(freed))

    # ---- introspection --------------------------------------------------------------------
    def snapshot(self) -> CacheSnapshot:
        """The cache now. Built when asked (a scrape, a status message), never per request:
        the eviction order costs one ranking of the resident models by the policy."""
        lru = self._book.lru_order()
        order = [k for k in lru if self._book.is_resident(k)] + sorted(
            k for k in self._book.keys() if not self._book.is_resident(k))
        # an on-demand load plans with nothing protected but the model it loads (dispatches are
        # serial: the model that ran last is idle by then) and the queued models spared
        evictions = self._book.eviction_order(spare=self._queued)
        rank = {key: i for i, key in enumerate(evictions, 1)}
        models = []
        for key in order:
            counts = self._counts.get(key, _Counts())
            nbytes = self._book.nbytes(key)
            models.append(ModelResidency(key[0], key[1], self._book.floor(key).value, nbytes,
                                         nbytes if self._book.is_resident(key) else 0,
                                         nbytes if key in self._host else 0,
                                         counts.loads, counts.hits, counts.evictions, counts.bytes_copied,
                                         counts.misses, rank.get(key, 0)))
        return CacheSnapshot(self._budget.bytes, self._book.resident_bytes(), self._book.pinned_bytes(),
                             self._budget.arena, self._budget.headroom, self._budget.on_demand,
                             self._device.host_memory_kind, tuple(models), self._policy.name,
                             evictions[0] if evictions else None,
                             *self._prefetch_counts, self._pool.stats() if self._pool is not None else None,
                             evictions)

    def _describe_resident(self) -> str:
        keys = [k for k in self._book.keys() if self._book.is_resident(k)]
        if not keys:
            return "none"
        return f"{len(keys)} model(s), {fmt_bytes(self._book.resident_bytes())}"

