"""Prometheus metrics of one worker, in a registry of its own (several workers may share a
process in tests). Metric names follow the node-file vocabulary."""
from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

# public: the control status sends these bounds with its latency counts
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True, slots=True)
class RequestTally:
    """What the worker counted of one model's requests since it started, as a frozen value
    (``WorkerControl`` status reads it): the requests answered OK per latency bucket (one count
    per :data:`LATENCY_BUCKETS` bound, then one above the largest), the scheduler's
    rejections by reason, and the failures of its user code by hook (preprocess, postprocess,
    run)."""

    latency_counts: tuple[int, ...] = (0,) * (len(LATENCY_BUCKETS) + 1)
    rejections: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    hook_failures: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))


class _Tally:
    """A counter (or gauge) family kept as plain numbers, one per tuple of label values, and made
    into a Prometheus family only when the registry is collected. Counting is a dict update: no
    lock, no labelled child (``Counter.labels().inc()`` took about 0.3 us and a lock)."""

    __slots__ = ("name", "doc", "labels", "values", "_family")

    def __init__(self, name: str, doc: str, labels: tuple[str, ...] = (), gauge: bool = False) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.values: dict[tuple, float] = {}
        self._family = GaugeMetricFamily if gauge else CounterMetricFamily

    def inc(self, key: tuple, amount: float = 1) -> None:
        values = self.values
        values[key] = values.get(key, 0) + amount

    def set(self, key: tuple, value: float) -> None:
        self.values[key] = value

    def family(self, samples: bool = True):
        """The family; without ``samples`` only its name and type (what ``describe()`` gives)."""
        out = self._family(self.name, self.doc, labels=list(self.labels))
        for key, value in list(self.values.items()) if samples else ():
            out.add_metric(list(key), value)
        return out

    def total(self, name: str):
        """The sum over every label value, as an unlabelled family ``name``."""
        return self._family(name, self.doc, value=sum(list(self.values.values())))


class _Buckets:
    """A histogram family kept as plain numbers: per tuple of label values, the sum and a count
    per bound (a bound is inclusive, as Prometheus' ``le``) and one above the largest, made into
    cumulative buckets when collected. An observation is a ``bisect`` and two additions
    (``Histogram.observe`` took about 0.7 us and a lock)."""

    __slots__ = ("name", "doc", "labels", "bounds", "rows")

    def __init__(self, name: str, doc: str, bounds: tuple[float, ...], labels: tuple[str, ...] = ()) -> None:
        self.name, self.doc, self.labels, self.bounds = name, doc, labels, bounds
        self.rows: dict[tuple, list] = {}      # label values -> [sum, count per bound ..., count above]

    def row(self, key: tuple) -> list:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = [0.0] + [0] * (len(self.bounds) + 1)
        return row

    def observe(self, key: tuple, value: float) -> None:
        row = self.rows.get(key) or self.row(key)
        row[1 + bisect.bisect_left(self.bounds, value)] += 1
        row[0] += value

    def observe_each(self, key: tuple, values, divisor: float = 1.0) -> None:
        """:meth:`observe` of each of ``values`` over ``divisor``, the row looked up once (a
        batch's queue waits, in nanoseconds)."""
        row = self.rows.get(key) or self.row(key)
        bounds, at = self.bounds, bisect.bisect_left
        total = 0.0
        for value in values:
            value /= divisor
            row[1 + at(bounds, value)] += 1
            total += value
        row[0] += total

    def counts(self, key: tuple) -> tuple[int, ...] | None:
        """The count per bound and above for ``key`` (not cumulative), or None if never observed."""
        row = self.rows.get(key)
        return tuple(row[1:]) if row is not None else None

    def family(self, samples: bool = True):
        """The family; without ``samples`` only its name and type (what ``describe()`` gives)."""
        out = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        for key, row in list(self.rows.items()) if samples else ():
            out.add_metric(list(key), self._cumulative(row[1:]), row[0])
        return out

    def total(self, name: str, doc: str):
        """Every label value's observations together, as an unlabelled histogram ``name``."""
        rows = [list(row) for row in list(self.rows.values())]
        counts = [sum(column) for column in zip(*(row[1:] for row in rows))] or [0] * (len(self.bounds) + 1)
        return HistogramMetricFamily(name, doc, buckets=self._cumulative(counts),
                                     sum_value=sum(row[0] for row in rows))

    def _cumulative(self, counts) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip((*self.bounds, math.inf), counts):
            running += n
            out.append((floatToGoString(bound), running))
        return out


class Metrics:
    """A worker's metrics. What the request path and the dispatch loop count (requests,
    latencies, executions, batch rows and sizes, queue waits and depths) is kept as plain
    numbers (:class:`_Tally`, :class:`_Buckets`) and read when ``/metrics`` is scraped; the rest
    (rare events, values read at scrape time) are prometheus_client's own metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = _Tally("xlaserve_requests", "Inference requests answered, by model and gRPC status",
                                ("model", "status"))
        self._request_seconds = _Buckets("xlaserve_request_duration_seconds",
                                         "Time from receiving an inference request to answering it",
                                         LATENCY_BUCKETS, ("model",))
        self._executions = _Tally("xlaserve_executions", "Model executions on the device, by compiled batch size",
                                  ("model", "batch_size"))
        self._batch_rows = _Buckets("xlaserve_batch_rows", "Request rows coalesced into one execution",
                                    _ROW_BUCKETS, ("model",))
        self._queue_depth = _Tally("xlaserve_queue_depth", "Requests waiting in the model's queue", ("model",),
                                   gauge=True)
        self._batch_size = _Buckets("xlaserve_batch_size", "Compiled batch size of each execution", _ROW_BUCKETS,
                                    ("model",))
        self._queue_seconds = _Buckets("xlaserve_queue_duration_seconds",
                                       "Time from receiving a request to its dispatch to the device",
                                       LATENCY_BUCKETS, ("model",))
        self._compute_seconds = _Buckets("xlaserve_compute_duration_seconds",
                                         "Time of one execution (assemble inputs, run, split outputs)",
                                         LATENCY_BUCKETS, ("model",))
        r.register(self)
        self.models = Gauge("xlaserve_models", "Models in the table, by state", ["state"], registry=r)
        self.rejections = Counter("xlaserve_rejections",
                                  "Requests the scheduler answered without running them, by reason "
                                  "(queue_full, deadline_expired, deadline_shed, dispatch_timeout, "
                                  "model_dropped, weights_unavailable, execution_failed, cancelled)",
                                  ["model", "reason"], registry=r)
        self.hook_failures = Counter("xlaserve_hook_failures",
                                     "Requests failed by the model's user code, by hook (preprocess, postprocess, "
                                     "run): it raised, or returned what the manifest does not declare",
                                     ["model", "hook"], registry=r)
        # read when scraped (set_function by the frontend): no cost per request
        self.held_request_bytes = Gauge("xlaserve_held_request_bytes",
                                        "Bytes of inference requests decoded and not yet answered (input tensors "
                                        "and expected outputs), held against endpoints.max_held_request_bytes",
                                        registry=r)
        self.requests_in_flight = Gauge("xlaserve_requests_in_flight",
                                        "Inference requests accepted and not yet answered", registry=r)
        self.hook_starved = Counter("xlaserve_hook_starved",
                                    "Requests answered (at their deadline, or as the worker stopped) while their "
                                    "hook (preprocess, postprocess, run) still waited for a thread: every thread "
                                    "of its pool was held by hooks that had not returned; the hook never ran",
                                    ["model", "hook"], registry=r)
        #: the hook and meta pools' :class:`~xlaserve.worker.inference.HookThreads` now, read when
        #: scraped (set by the composition root); None: no samples
        self.hook_threads = None
        # per model, rejections by reason and hook failures by hook, for the status snapshot
        self._rejected: dict[str, dict[str, int]] = {}
        self._hook_failed: dict[str, dict[str, int]] = {}
        self._hook_lock = threading.Lock()      # hook failures are counted from hook threads

    # ---- the registry's side ----------------------------------------------------------------
    def _kept(self):
        return (self._requests, self._request_seconds, self._executions, self._batch_rows, self._queue_depth,
                self._batch_size, self._queue_seconds, self._compute_seconds)

    def describe(self):
        return [kept.family(samples=False) for kept in self._kept()] + self._thread_families(None)

    def collect(self):
        source = self.hook_threads
        return [kept.family() for kept in self._kept()] + self._thread_families(source() if source else None)

    @staticmethod
    def _thread_families(threads) -> list:
        """The hook thread pools' gauges, by pool (``hook``: preprocess and postprocess; ``meta``:
        a meta model's run), from a ``HookThreads`` snapshot (None: no samples)."""
        size = GaugeMetricFamily("xlaserve_hook_threads", "Threads the pool may run user code on at once "
                                 "(hook: preprocess and postprocess, 16; meta: a meta model's run, 64)",
                                 labels=["pool"])
        busy = GaugeMetricFamily("xlaserve_hook_threads_busy",
                                 "Threads of the pool running user code now; a hook that never returns holds its "
                                 "thread for good, and at xlaserve_hook_threads every hooked request waits",
                                 labels=["pool"])
        waiting = GaugeMetricFamily("xlaserve_hook_requests_waiting",
                                    "Requests whose hook waits for a thread of the pool", labels=["pool"])
        if threads is not None:
            for pool, stats in (("hook", threads.hook), ("meta", threads.meta)):
                size.add_metric([pool], stats.size)
                busy.add_metric([pool], stats.busy)
                waiting.add_metric([pool], stats.waiting)
        return [size, busy, waiting]

    # ---- counting ---------------------------------------------------------------------------
    def observe_request(self, model: str, status: str, seconds: float) -> None:
        self._requests.inc((model, status))
        if status == "OK":
            self._request_seconds.observe((model,), seconds)

    def tally(self, model: str) -> RequestTally:
        """``model``'s :class:`RequestTally` now (zeros for a model never seen)."""
        counts = self._request_seconds.counts((model,))
        rejected = self._rejected.get(model)
        with self._hook_lock:
            hooks = self._hook_failed.get(model)
            hooks = dict(hooks) if hooks else None
        return RequestTally(counts if counts is not None else RequestTally().latency_counts,
                            MappingProxyType(dict(rejected)) if rejected else MappingProxyType({}),
                            MappingProxyType(hooks) if hooks else MappingProxyType({}))

    def observe_execution(self, model: str, size: int, rows: int) -> None:
        self._executions.inc((model, str(size)))
        self._batch_rows.observe((model,), rows)

    def set_queue_depth(self, model: str, depth: int) -> None:
        self._queue_depth.set((model,), depth)

    def observe_dispatch(self, model: str, size: int, rows: int, queue_ns, compute_ns: int) -> None:
        """One execution at compiled ``size`` serving ``rows``; ``queue_ns`` holds each request's wait."""
        key = (model,)
        self.observe_execution(model, size, rows)
        self._batch_size.observe(key, size)
        self._compute_seconds.observe(key, compute_ns / 1e9)
        self._queue_seconds.observe_each(key, queue_ns, 1e9)

    def observe_rejection(self, model: str, reason: str) -> None:
        self.rejections.labels(model, reason).inc()
        reasons = self._rejected.setdefault(model, {})
        reasons[reason] = reasons.get(reason, 0) + 1

    def observe_hook_failure(self, model: str, hook: str) -> None:
        """One request failed by ``model``'s ``hook`` (any thread)."""
        self.hook_failures.labels(model, hook).inc()
        with self._hook_lock:
            hooks = self._hook_failed.setdefault(model, {})
            hooks[hook] = hooks.get(hook, 0) + 1

    def observe_hook_starved(self, model: str, hook: str) -> None:
        """One request of ``model`` answered while its ``hook`` waited for a thread."""
        self.hook_starved.labels(model, hook).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


_LOAD_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_WEIGHT_COUNTERS = (("hits", "Dispatches that found the weights resident"),
                    ("misses", "Dispatches that had to copy the weights onto the device"),
                    ("evictions", "Device copies evicted to make room"),
                    ("prefetch_hits", "Dispatches served by weights a prefetch copied"),
                    ("bytes_copied", "Weight bytes copied onto the device (every load)"))


class WeightCacheMetrics:
    """The weight cache's metrics (issues 4 and 25), per model and in total, in a worker's
    registry. Totals are separate unlabelled series so that dashboards need no ``sum()``.

    The dispatch loop counts into plain numbers (:class:`_Tally`, :class:`_Buckets`); they
    become Prometheus families only when the registry is collected (``/metrics``). A miss then
    pays no metric locks or labelled-child calls: on a 256 KiB model those were 6 of its ~40 us
    besides the copy."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counts = {stem: _Tally(f"xlaserve_weight_cache_model_{stem}", doc, ("model",))
                        for stem, doc in _WEIGHT_COUNTERS}
        self._hits, self._misses, self._evictions = (self._counts[k] for k in ("hits", "misses", "evictions"))
        self._prefetch_hits, self._bytes = self._counts["prefetch_hits"], self._counts["bytes_copied"]
        self._load_seconds = _Buckets("xlaserve_weight_cache_model_load_seconds",
                                      "Time of one host-to-device weight copy (on demand or prefetch)",
                                      _LOAD_BUCKETS, ("model",))
        self._miss_seconds = _Tally("xlaserve_weight_cache_miss_seconds",
                                    "Seconds dispatches spent making missing weights resident: the whole miss "
                                    "(waiting for the cache, the plan, evictions, the copy and its bookkeeping)")
        self._state = _CacheStateCollector()
        registry.register(self)
        registry.register(self._state)

    def watch(self, snapshot) -> None:
        """Read the cache's state from ``snapshot()`` (a :class:`~xlaserve.runtime.weights.CacheSnapshot`)
        when the registry is collected: the eviction order, prefetch counts and the weight pool."""
        self._state.snapshot = snapshot

    def hit(self, model: str, prefetched: bool) -> None:
        key = (model,)
        self._hits.inc(key)
        if prefetched:
            self._prefetch_hits.inc(key)

    def load(self, model: str, seconds: float, miss: bool, nbytes: int = 0) -> None:
        """One copy of ``nbytes`` onto the device; ``miss`` when a dispatch waited for it (not a
        prefetch or pin)."""
        key = (model,)
        self._load_seconds.observe(key, seconds)
        self._bytes.inc(key, nbytes)
        if miss:
            self._misses.inc(key)

    def missed(self, seconds: float) -> None:
        """A dispatch's miss took ``seconds`` from asking for the weights to having them."""
        self._miss_seconds.inc((), seconds)

    def evict(self, model: str) -> None:
        self._evictions.inc((model,))

    # ---- the registry's side ----------------------------------------------------------------
    def describe(self):
        return self._families(samples=False)

    def collect(self):
        return self._families()

    def _families(self, samples: bool = True):
        families = []
        for stem, _ in _WEIGHT_COUNTERS:
            counts = self._counts[stem]
            families += [counts.family(samples), counts.total(f"xlaserve_weight_cache_{stem}")]
        load = self._load_seconds
        families.append(load.family(samples))
        families.append(load.total("xlaserve_weight_cache_load_seconds",
                                   "Time of one host-to-device weight copy, all models"))
        families.append(self._miss_seconds.total(self._miss_seconds.name))
        return families


class _CacheStateCollector:
    """The weight cache's state, read from its snapshot when ``/metrics`` is scraped (nothing is
    kept up to date per request or per miss): the bytes resident per model and in all, the budget,
    the eviction order, the prefetch counters, the weight pool.
    Before :meth:`WeightCacheMetrics.watch` its families have no samples."""

    def __init__(self) -> None:
        self.snapshot = None

    def describe(self):
        return self._families(None)

    def collect(self):
        return self._families(self.snapshot() if self.snapshot is not None else None)

    @staticmethod
    def _families(snap):
        resident_model = GaugeMetricFamily("xlaserve_weight_cache_model_resident_bytes",
                                           "Weight bytes of the model on the device now (all its versions)",
                                           labels=["model"])
        resident_total = GaugeMetricFamily("xlaserve_weight_cache_resident_bytes",
                                           "Weight bytes on the device now, all models")
        budget = GaugeMetricFamily("xlaserve_weight_cache_budget_bytes", "The device weight budget")
        rank = GaugeMetricFamily(
            "xlaserve_weight_cache_model_eviction_rank",
            "Where the model stands in the order a load would evict resident models now: 1 is the next "
            "victim (models with queued work come last); absent: not evictable (not resident, pinned, loading)",
            labels=["model", "version"])
        policy = GaugeMetricFamily("xlaserve_weight_cache_policy_info",
                                   "The weight cache's replacement policy (runtime.weight_eviction), as a label",
                                   labels=["policy"])
        started = CounterMetricFamily("xlaserve_weight_cache_prefetches",
                                      "Weight copies started by a prefetch hint")
        landed = CounterMetricFamily("xlaserve_weight_cache_prefetches_landed",
                                     "Prefetched copies done before their model was dispatched")
        late = CounterMetricFamily("xlaserve_weight_cache_prefetches_late",
                                   "Prefetched copies still under way when their model was dispatched (it waited)")
        regions = GaugeMetricFamily("xlaserve_weight_pool_regions",
                                    "Regions of device memory the weight pool holds (cpu)")
        reserved = GaugeMetricFamily("xlaserve_weight_pool_reserved_bytes",
                                     "Bytes of device memory the weight pool holds, all regions (cpu)")
        used = GaugeMetricFamily("xlaserve_weight_pool_used_bytes",
                                 "Bytes of the weight pool held by weights: resident, and evicted ones kept as "
                                 "slots for the next model of the same layout (cpu)")
        idle = GaugeMetricFamily("xlaserve_weight_pool_idle_bytes",
                                 "Bytes of the weight pool in idle slots: evicted models' memory kept for the next "
                                 "model of the same shapes, given back when a load needs the room (cpu)")
        reused = CounterMetricFamily("xlaserve_weight_pool_slot_reuses",
                                     "Loads copied into an idle slot, without a new extent or new device arrays (cpu)")
        largest = GaugeMetricFamily("xlaserve_weight_pool_largest_free_bytes",
                                    "The largest free extent of the weight pool: the largest model that loads "
                                    "without growing it (cpu)")
        if snap is not None:
            by_model: dict[str, int] = {}
            for row in snap.models:
                by_model[row.model] = by_model.get(row.model, 0) + row.resident_bytes
            for model, nbytes in by_model.items():
                resident_model.add_metric([model], nbytes)
            resident_total.add_metric([], snap.resident_bytes)
            budget.add_metric([], snap.budget_bytes)
            for i, (model, version) in enumerate(snap.eviction_order, 1):
                rank.add_metric([model, str(version)], i)
            policy.add_metric([snap.policy], 1)
            started.add_metric([], snap.prefetches)
            landed.add_metric([], snap.prefetches_landed)
            late.add_metric([], snap.prefetches_late)
            if snap.pool is not None:
                regions.add_metric([], snap.pool.regions)
                reserved.add_metric([], snap.pool.capacity_bytes)
                used.add_metric([], snap.pool.used_bytes)
                idle.add_metric([], snap.pool.idle_bytes)
                reused.add_metric([], snap.pool.reused)
                largest.add_metric([], snap.pool.largest_free_bytes)
        return [resident_model, resident_total, budget, rank, policy, started, landed, late, regions, reserved, used,
                idle, reused, largest]
