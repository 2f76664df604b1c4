"""Prometheus metrics of one worker, in a registry of its own (several workers may share a
process in tests). Metric names follow the node-file vocabulary."""
from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
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


class _Children:
    """A metric's labelled children, each looked up once: ``labels()`` validates its arguments and
    takes a lock on every call (a few us), and the request path asks for several a request."""

    __slots__ = ("_metric", "_known")

    def __init__(self, metric) -> None:
        self._metric = metric
        self._known: dict[tuple[str, ...], object] = {}

    def __call__(self, *values: str):
        child = self._known.get(values)
        if child is None:
            child = self._known[values] = self._metric.labels(*values)
        return child


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("xlaserve_requests", "Inference requests answered, by model and gRPC status",
                                ["model", "status"], registry=r)
        self.request_seconds = Histogram("xlaserve_request_duration_seconds",
                                         "Time from receiving an inference request to answering it",
                                         ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.executions = Counter("xlaserve_executions", "Model executions on the device, by compiled batch size",
                                  ["model", "batch_size"], registry=r)
        self.batch_rows = Histogram("xlaserve_batch_rows", "Request rows coalesced into one execution",
                                    ["model"], buckets=_ROW_BUCKETS, registry=r)
        self.models = Gauge("xlaserve_models", "Models in the table, by state", ["state"], registry=r)
        self.queue_depth = Gauge("xlaserve_queue_depth", "Requests waiting in the model's queue",
                                 ["model"], registry=r)
        self.batch_size = Histogram("xlaserve_batch_size", "Compiled batch size of each execution",
                                    ["model"], buckets=_ROW_BUCKETS, registry=r)
        self.queue_seconds = Histogram("xlaserve_queue_duration_seconds",
                                       "Time from receiving a request to its dispatch to the device",
                                       ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.compute_seconds = Histogram("xlaserve_compute_duration_seconds",
                                         "Time of one execution (assemble inputs, run, split outputs)",
                                         ["model"], buckets=LATENCY_BUCKETS, registry=r)
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
        # The same counts kept as plain numbers too, so that a status snapshot reads them without
        # walking Prometheus' registry: per model, OK latencies by bucket and rejections by reason.
        self._latency: dict[str, list[int]] = {}
        self._rejected: dict[str, dict[str, int]] = {}
        self._hook_failed: dict[str, dict[str, int]] = {}
        self._hook_lock = threading.Lock()      # hook failures are counted from hook threads
        self._requests = _Children(self.requests)
        self._request_seconds = _Children(self.request_seconds)
        self._executions = _Children(self.executions)
        self._batch_rows = _Children(self.batch_rows)
        self._queue_depth = _Children(self.queue_depth)
        self._batch_size = _Children(self.batch_size)
        self._compute_seconds = _Children(self.compute_seconds)
        self._queue_seconds = _Children(self.queue_seconds)

    def observe_request(self, model: str, status: str, seconds: float) -> None:
        self._requests(model, status).inc()
        if status == "OK":
            self._request_seconds(model).observe(seconds)
            counts = self._latency.get(model)
            if counts is None:
                counts = self._latency[model] = [0] * (len(LATENCY_BUCKETS) + 1)
            # a bound is inclusive, as Prometheus' le
            counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def tally(self, model: str) -> RequestTally:
        """``model``'s :class:`RequestTally` now (zeros for a model never seen)."""
        counts = self._latency.get(model)
        rejected = self._rejected.get(model)
        with self._hook_lock:
            hooks = self._hook_failed.get(model)
            hooks = dict(hooks) if hooks else None
        return RequestTally(tuple(counts) if counts is not None else RequestTally().latency_counts,
                            MappingProxyType(dict(rejected)) if rejected else MappingProxyType({}),
                            MappingProxyType(hooks) if hooks else MappingProxyType({}))

    def observe_execution(self, model: str, size: int, rows: int) -> None:
        self._executions(model, str(size)).inc()
        self._batch_rows(model).observe(rows)

    def set_queue_depth(self, model: str, depth: int) -> None:
        self._queue_depth(model).set(depth)

    def observe_dispatch(self, model: str, size: int, rows: int, queue_ns, compute_ns: int) -> None:
        """One execution at compiled ``size`` serving ``rows``; ``queue_ns`` holds each request's wait."""
        self.observe_execution(model, size, rows)
        self._batch_size(model).observe(size)
        self._compute_seconds(model).observe(compute_ns / 1e9)
        queue = self._queue_seconds(model)
        for ns in queue_ns:
            queue.observe(ns / 1e9)

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

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


_LOAD_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


# a weight-cache row's counters (:class:`WeightCacheMetrics`)
_HITS, _MISSES, _EVICTIONS, _PREFETCH_HITS, _BYTES, _LOAD_SUM = range(6)
_COUNTERS = (("hits", _HITS, "Dispatches that found the weights resident"),
             ("misses", _MISSES, "Dispatches that had to copy the weights onto the device"),
             ("evictions", _EVICTIONS, "Device copies evicted to make room"),
             ("prefetch_hits", _PREFETCH_HITS, "Dispatches served by weights a prefetch copied"),
             ("bytes_copied", _BYTES, "Weight bytes copied onto the device (every load)"))


class WeightCacheMetrics:
    """The weight cache's metrics (issues 4 and 25), per model and in total, in a worker's
    registry. Totals are separate unlabelled series so that dashboards need no ``sum()``.

    The dispatch loop counts into plain numbers (a list per model: a hit is one ``+= 1``, a
    load's time one ``bisect`` into its bucket counts); they become Prometheus families only
    when the registry is collected (``/metrics``). A miss then pays no metric locks or
    labelled-child calls: on a 256 KiB model those were 6 of its ~40 us besides the copy."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # model -> [hits, misses, evictions, prefetch hits, bytes copied, load seconds' sum,
        #           then the load histogram's count per _LOAD_BUCKETS bound and one above]
        self._rows: dict[str, list] = {}
        self._miss_seconds = 0.0
        self._state = _CacheStateCollector()
        registry.register(self)
        registry.register(self._state)

    def watch(self, snapshot) -> None:
        """Read the cache's state from ``snapshot()`` (a :class:`~xlaserve.runtime.weights.CacheSnapshot`)
        when the registry is collected: the eviction order, prefetch counts and the weight pool."""
        self._state.snapshot = snapshot

    def _row(self, model: str) -> list:
        row = self._rows.get(model)
        if row is None:
            row = self._rows[model] = [0, 0, 0, 0, 0, 0.0] + [0] * (len(_LOAD_BUCKETS) + 1)
        return row

    def hit(self, model: str, prefetched: bool) -> None:
        row = self._rows.get(model) or self._row(model)
        row[_HITS] += 1
        if prefetched:
            row[_PREFETCH_HITS] += 1

    def load(self, model: str, seconds: float, miss: bool, nbytes: int = 0) -> None:
        """One copy of ``nbytes`` onto the device; ``miss`` when a dispatch waited for it (not a
        prefetch or pin)."""
        row = self._rows.get(model) or self._row(model)
        row[_LOAD_SUM + 1 + bisect.bisect_left(_LOAD_BUCKETS, seconds)] += 1    # le is inclusive
        row[_LOAD_SUM] += seconds
        row[_BYTES] += nbytes
        if miss:
            row[_MISSES] += 1

    def missed(self, seconds: float) -> None:
        """A dispatch's miss took ``seconds`` from asking for the weights to having them."""
        self._miss_seconds += seconds

    def evict(self, model: str) -> None:
        (self._rows.get(model) or self._row(model))[_EVICTIONS] += 1

    # ---- the registry's side ----------------------------------------------------------------
    def describe(self):
        return self._families({})

    def collect(self):
        return self._families({model: list(row) for model, row in list(self._rows.items())})

    def _families(self, rows: dict[str, list]):
        families = []
        for stem, i, doc in _COUNTERS:
            by_model = CounterMetricFamily(f"xlaserve_weight_cache_model_{stem}", doc, labels=["model"])
            for model, row in rows.items():
                by_model.add_metric([model], row[i])
            families += [by_model, CounterMetricFamily(f"xlaserve_weight_cache_{stem}", doc,
                                                       value=sum(row[i] for row in rows.values()))]
        by_model = HistogramMetricFamily("xlaserve_weight_cache_model_load_seconds",
                                         "Time of one host-to-device weight copy (on demand or prefetch)",
                                         labels=["model"])
        total = [0] * (len(_LOAD_BUCKETS) + 1)
        for model, row in rows.items():
            counts = row[_LOAD_SUM + 1:]
            by_model.add_metric([model], _buckets(counts), row[_LOAD_SUM])
            total = [a + b for a, b in zip(total, counts)]
        families.append(by_model)
        families.append(HistogramMetricFamily("xlaserve_weight_cache_load_seconds",
                                              "Time of one host-to-device weight copy, all models",
                                              buckets=_buckets(total),
                                              sum_value=sum(row[_LOAD_SUM] for row in rows.values())))
        families.append(CounterMetricFamily(
            "xlaserve_weight_cache_miss_seconds",
            "Seconds dispatches spent making missing weights resident: the whole miss (waiting for the cache, "
            "the plan, evictions, the copy and its bookkeeping)", value=self._miss_seconds))
        return families


def _buckets(counts: list[int]) -> list[tuple[str, int]]:
    """Prometheus' cumulative ``le`` buckets from a count per :data:`_LOAD_BUCKETS` bound and
    one above the largest."""
    out, running = [], 0
    for bound, n in zip((*_LOAD_BUCKETS, math.inf), counts):
        running += n
        out.append((floatToGoString(bound), running))
    return out


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
