"""What the dashboard shows, computed from the worker's status snapshots: pure, no I/O.

A ``WatchStatus`` snapshot carries counters (``requests``, ``executions``) and levels (queue
depth, residency, bytes). :func:`derive` turns two consecutive snapshots and the seconds between
them into rows of rates and levels, and :func:`changes` into the event log's lines. Everything
here is a small frozen value, so the app and the tests compare snapshots, never live objects.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from xlaserve._proto import xlaserve_control_pb2 as pb

# Columns the model table shows, in order: (key, heading). A key is a ModelRow field; sorting
# by a column sorts by that field.
# What an operator looks at first comes first, so that 80 columns show it without scrolling.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("name", "model"),
    ("state", "state"),
    ("queue_depth", "queue"),
    ("in_flight", "infl"),
    ("rows_per_second", "rows/s"),
    ("p50_seconds", "p50"),
    ("p99_seconds", "p99"),
    ("device_share", "share/wt"),
    ("weight_loads", "ld/ev"),
    ("misses_per_request", "miss/req"),
    ("eviction_rank", "evict#"),
    ("rejected_per_second", "rej/s"),
    ("failures_per_second", "fail/s"),
    ("rows_per_execution", "rows/exec"),
    ("cost_seconds", "cost"),
    ("weight", "weight"),
    ("max_batch_size", "max_bs"),
    ("residency", "residency"),
    ("resident_bytes", "resident"),
    ("weight_bytes", "weights"),
    ("version", "ver"),
)
# Shown first when the dashboard watches more than one worker (a gateway).
WORKER_COLUMN = ("worker", "worker")
SORT_KEYS = tuple(key for key, _ in (WORKER_COLUMN, *COLUMNS))


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One model of one worker as the table shows it. The rates and means are over the last
    interval, from the changes of the worker's counters; ``None`` until two snapshots exist, and
    the means also when nothing was answered (or run) in the interval: ``latency_seconds`` and
    ``queue_wait_seconds`` are the mean time of the requests answered, from receipt to answer and
    queued; ``p50_seconds`` and ``p99_seconds`` their percentiles, estimated from the latency
    buckets' changes (:func:`percentile`); ``batch_mix`` is the executions of each compiled batch
    size. ``cost_seconds`` is the learned cost of the largest compiled batch size the worker has
    learned a cost for (``None`` before the first execution).

    ``device_share`` is the model's part of the device time its worker spent executing over the
    interval (``None`` when the device was idle); ``weight_share`` what its weight entitles it to
    under ``fair`` among the models that ran or waited then (``None`` for a model that did
    neither, or another discipline). ``loads_delta``/``evictions_delta`` are the weight copies
    onto the device and evictions over the interval; ``thrashing`` when both moved.
    ``weight_misses`` are the dispatches that waited for its weights since the worker started;
    ``misses_per_request`` those of the interval over the requests answered (OK or failed) in it
    (``None`` when none was). ``eviction_rank`` is where its weights stand in the order its
    worker's cache (policy ``eviction_policy``) would evict them now, 1 first; ``None`` when they
    are not evictable (not resident, pinned or being copied).
    ``rejections`` are the scheduler's since the worker started, by reason; ``rejected_per_second``
    over the interval, all reasons. ``hook_failures`` are the requests its Python code failed
    since the worker started, by hook (preprocess, postprocess, run)."""
    worker: str
    name: str
    state: str
    version: int
    reason: str
    queue_depth: int
    rows_per_second: float | None
    rows_per_execution: float | None
    latency_seconds: float | None
    queue_wait_seconds: float | None
    failures_per_second: float | None
    batch_mix: tuple[tuple[int, int], ...]
    cost_batch_size: int | None
    cost_seconds: float | None
    learned_cost_seconds: tuple[tuple[int, float], ...]
    weight: float
    max_batch_size: int
    batch_delay_seconds: float
    batch_target_rows: int
    residency: str
    resident_bytes: int
    weight_bytes: int
    requests: int
    executions: int
    successes: int
    failures: int
    in_flight: int = 0
    p50_seconds: float | None = None
    p99_seconds: float | None = None
    device_share: float | None = None
    weight_share: float | None = None
    weight_loads: int = 0
    evictions: int = 0
    loads_delta: int | None = None
    evictions_delta: int | None = None
    thrashing: bool = False
    rejections: tuple[tuple[str, int], ...] = ()
    rejected_per_second: float | None = None
    hook_failures: tuple[tuple[str, int], ...] = ()
    weight_misses: int = 0
    misses_per_request: float | None = None
    eviction_rank: int | None = None
    eviction_policy: str = ""


@dataclass(frozen=True, slots=True)
class WorkerView:
    """A worker's line: its name, backend, discipline, weight budget and the bytes of it in use,
    requests in flight, uptime, executable-cache hits of its lookups, and the rows per second
    summed over its models (``None`` until two snapshots exist)."""
    worker: str
    backend: str
    budget_bytes: int
    resident_bytes: int
    rows_per_second: float | None
    discipline: str = ""
    in_flight: int = 0
    uptime_seconds: float = 0.0
    cache_hits: int = 0
    cache_lookups: int = 0
    #: (pool, threads, busy, waiting) of its hook and meta thread pools
    hook_pools: tuple[tuple[str, int, int, int], ...] = ()


def hook_pools_text(worker: WorkerView) -> tuple[str, bool]:
    """What the worker's line says of its hook thread pools, and whether a pool is saturated
    (every thread held by user code, requests waiting: hung hooks starving its models). Only the
    pools with a thread busy are named; "" when none is."""
    parts, saturated = [], False
    for pool, threads, busy, waiting in worker.hook_pools:
        if busy:
            parts.append(f"{pool} threads {busy}/{threads} busy" + (f", {waiting} waiting" if waiting else ""))
            saturated = saturated or (busy >= threads and waiting > 0)
    return "; ".join(parts), saturated


@dataclass(frozen=True, slots=True)
class StatusEvent:
    """A model's state, version or reason changed between two snapshots, or it appeared or
    went away. ``text`` is the event log's line."""
    model: str
    text: str


def _per(delta: int, seconds: float) -> float | None:
    # A counter that went down means the worker restarted under us: no rate for this interval.
    if seconds <= 0 or delta < 0:
        return None
    return delta / seconds


def percentile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of a histogram: ``counts[i]`` observations at most
    ``bounds[i]`` (and above the previous bound), ``counts[-1]`` above the largest bound. As
    Prometheus' ``histogram_quantile``: linear within the bucket the rank falls in, from 0 for
    the first; the largest bound when it falls above it (so a figure there means "at least").
    ``None`` when there are no observations or the shapes disagree."""
    total = sum(counts)
    if total <= 0 or len(counts) != len(bounds) + 1 or any(n < 0 for n in counts):
        return None
    rank = q * total
    below = 0
    for i, n in enumerate(counts):
        if n and below + n >= rank:
            if i == len(bounds):
                return bounds[-1] if bounds else None
            lower = bounds[i - 1] if i else 0.0
            return lower + (bounds[i] - lower) * (rank - below) / n
        below += n
    return bounds[-1] if bounds else None


def _row(model: pb.ModelControl, before: pb.ModelControl | None, seconds: float | None,
         worker: str = "", bounds: Sequence[float] = (), policy: str = "") -> ModelRow:
    costs = tuple(sorted((int(k), float(v)) for k, v in model.learned_cost_seconds.items()))
    rate = per_execution = latency = queue_wait = failure_rate = None
    p50 = p99 = rejected_rate = misses_per_request = None
    loads_delta = evictions_delta = None
    mix: tuple[tuple[int, int], ...] = ()
    if before is not None and seconds is not None:
        rate = _per(model.requests - before.requests, seconds)
        failure_rate = _per(model.failures - before.failures, seconds)
        executions = model.executions - before.executions
        rows = model.requests - before.requests
        if executions > 0 and rows >= 0:
            per_execution = rows / executions
        answered = model.successes - before.successes
        if answered > 0:
            latency = (model.success_seconds - before.success_seconds) / answered
            queue_wait = (model.queue_seconds - before.queue_seconds) / answered
        ran = {int(size): count - before.executions_by_batch_size.get(size, 0)
               for size, count in model.executions_by_batch_size.items()}
        mix = tuple(sorted((size, n) for size, n in ran.items() if n > 0))
        if len(model.latency_bucket_counts) == len(before.latency_bucket_counts):
            moved = [a - b for a, b in zip(model.latency_bucket_counts, before.latency_bucket_counts)]
            p50, p99 = percentile(bounds, moved, 0.5), percentile(bounds, moved, 0.99)
        rejected_rate = _per(sum(model.rejections.values()) - sum(before.rejections.values()), seconds)
        loads_delta = model.weight_loads - before.weight_loads
        evictions_delta = model.evictions - before.evictions
        requests = model.successes + model.failures - before.successes - before.failures
        misses = model.weight_misses - before.weight_misses
        if requests > 0 and misses >= 0:
            misses_per_request = misses / requests
    return ModelRow(
        worker=worker, name=model.name, state=model.state, version=model.version, reason=model.reason,
        queue_depth=model.queue_depth, rows_per_second=rate, rows_per_execution=per_execution,
        latency_seconds=latency, queue_wait_seconds=queue_wait, failures_per_second=failure_rate,
        batch_mix=mix,
        cost_batch_size=costs[-1][0] if costs else None, cost_seconds=costs[-1][1] if costs else None,
        learned_cost_seconds=costs, weight=model.weight, max_batch_size=model.max_batch_size,
        batch_delay_seconds=model.batch_delay_seconds, batch_target_rows=model.batch_target_rows,
        residency=model.residency, resident_bytes=model.resident_bytes,
        weight_bytes=model.weight_bytes, requests=model.requests, executions=model.executions,
        successes=model.successes, failures=model.failures, in_flight=model.in_flight,
        p50_seconds=p50, p99_seconds=p99, weight_loads=model.weight_loads, evictions=model.evictions,
        loads_delta=loads_delta, evictions_delta=evictions_delta,
        # a model whose weights are copied in and evicted again within one update: its worker's
        # budget is too small for what it serves at once
        thrashing=bool(loads_delta and evictions_delta and loads_delta > 0 and evictions_delta > 0),
        rejections=tuple(sorted(model.rejections.items())), rejected_per_second=rejected_rate,
        hook_failures=tuple(sorted(model.hook_failures.items())),
        weight_misses=model.weight_misses, misses_per_request=misses_per_request,
        eviction_rank=model.eviction_rank or None, eviction_policy=policy)


def _shares(current: pb.ModelControlStatusResponse, before: dict[str, pb.ModelControl],
            rows: tuple[ModelRow, ...]) -> tuple[ModelRow, ...]:
    """``rows`` with their device-time share over the interval and, under ``fair``, the share
    their weight entitles them to among the models that ran or waited."""
    spent: dict[str, float] = {}
    for m in current.models:
        old = before.get(m.name)
        if old is not None:
            spent[m.name] = max(0.0, m.device_seconds - old.device_seconds)
    total = math.fsum(spent.values())
    busy = {m.name: m.weight for m in current.models if spent.get(m.name, 0.0) > 0 or m.queue_depth > 0}
    weights = math.fsum(busy.values())
    out = []
    for row in rows:
        share = spent[row.name] / total if total > 0 and row.name in spent else None
        entitled = (busy[row.name] / weights if current.discipline == "fair" and row.name in busy
                    and weights > 0 else None)
        out.append(replace(row, device_share=share, weight_share=entitled))
    return tuple(out)


def derive(current: pb.ModelControlStatusResponse, previous: pb.ModelControlStatusResponse | None,
           seconds: float | None) -> tuple[WorkerView, tuple[ModelRow, ...]]:
    """The worker's line and one row per model of ``current``, with rates over the ``seconds``
    since ``previous`` (pass ``None`` for both on the first snapshot). A model new in ``current``
    has no rate yet. Both snapshots are of one worker."""
    before = {m.name: m for m in previous.models} if previous is not None else {}
    bounds = tuple(current.latency_bucket_bounds)
    rows = tuple(_row(m, before.get(m.name), seconds if previous is not None else None,
                      current.worker, bounds, current.eviction_policy) for m in current.models)
    if previous is not None and seconds is not None:
        rows = _shares(current, before, rows)
    rates = [r.rows_per_second for r in rows if r.rows_per_second is not None]
    total = math.fsum(rates) if previous is not None and rates else (0.0 if previous is not None else None)
    lookups = current.executable_cache
    worker = WorkerView(worker=current.worker, backend=current.backend,
                        budget_bytes=current.budget_bytes, resident_bytes=current.resident_bytes,
                        rows_per_second=total, discipline=current.discipline, in_flight=current.in_flight,
                        uptime_seconds=current.uptime_seconds, cache_hits=lookups.get("hit", 0),
                        cache_lookups=sum(lookups.values()),
                        hook_pools=(("hook", current.hook_threads, current.hook_threads_busy,
                                     current.hook_requests_waiting),
                                    ("meta", current.meta_threads, current.meta_threads_busy,
                                     current.meta_requests_waiting)))
    return worker, rows


def changes(current: pb.ModelControlStatusResponse,
            previous: pb.ModelControlStatusResponse | None) -> tuple[StatusEvent, ...]:
    """The event log's lines for what changed from ``previous`` to ``current``: a model that
    appeared (every model, on the first snapshot), went away, or changed state, version or
    reason; its weights copied onto the device or evicted; requests the scheduler rejected, by
    reason; requests its Python hooks failed, by hook. Levels and counters that move all the time (queue depth, bytes, rows) are not
    events."""
    before = {m.name: m for m in previous.models} if previous is not None else {}
    now = {m.name: m for m in current.models}
    events: list[StatusEvent] = []
    for name, model in now.items():
        old = before.get(name)
        state = f"{model.state} v{model.version}" + (f": {model.reason}" if model.reason else "")
        if old is None:
            events.append(StatusEvent(name, f"{name}: {state}"))
        elif (old.state, old.version, old.reason) != (model.state, model.version, model.reason):
            events.append(StatusEvent(name, f"{name}: {old.state} v{old.version} -> {state}"))
        if old is not None:
            loaded, evicted = model.weight_loads - old.weight_loads, model.evictions - old.evictions
            if loaded > 0 or evicted > 0:
                events.append(StatusEvent(name, f"{name}: weights loaded onto the device {max(loaded, 0)}x, "
                                                f"evicted {max(evicted, 0)}x"))
            rejected = {r: n - old.rejections.get(r, 0) for r, n in model.rejections.items()}
            rejected = {r: n for r, n in rejected.items() if n > 0}
            if rejected:
                events.append(StatusEvent(name, f"{name}: rejected " + ", ".join(
                    f"{n} {reason}" for reason, n in sorted(rejected.items()))))
            failed = {h: n - old.hook_failures.get(h, 0) for h, n in model.hook_failures.items()}
            failed = {h: n for h, n in failed.items() if n > 0}
            if failed:
                events.append(StatusEvent(name, f"{name}: hook failures " + ", ".join(
                    f"{n} {hook}" for hook, n in sorted(failed.items()))))
    for name in sorted(before.keys() - now.keys()):
        events.append(StatusEvent(name, f"{name}: gone"))
    return tuple(events)


def visible(rows: Iterable[ModelRow], name_filter: str, sort_key: str,
            descending: bool) -> list[ModelRow]:
    """The rows whose model or worker name contains ``name_filter`` (case-insensitive), sorted by
    the column ``sort_key`` (a :data:`SORT_KEYS` entry), then by name and worker. Rows without a figure (``None``)
    sort last either way."""
    if sort_key not in SORT_KEYS:
        raise ValueError(f"unknown sort column {sort_key!r}; expected one of {', '.join(SORT_KEYS)}")
    needle = name_filter.lower()
    chosen = sorted((r for r in rows if needle in r.name.lower() or needle in r.worker.lower()),
                    key=lambda r: (r.name, r.worker))
    present = [r for r in chosen if getattr(r, sort_key) is not None]
    missing = [r for r in chosen if getattr(r, sort_key) is None]
    present.sort(key=lambda r: getattr(r, sort_key), reverse=descending)
    return present + missing


def human_bytes(count: int) -> str:
    """``1.5 GiB``-style, to one decimal place above bytes."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_seconds(seconds: float) -> str:
    """A duration at the scale that reads best: ``850us``, ``12.3ms``, ``1.20s``."""
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f}ms"
    return f"{seconds:.2f}s"


def cells(row: ModelRow) -> tuple[str, ...]:
    """The table's text for ``row``, one per :data:`COLUMNS` entry; ``-`` where there is no
    figure yet."""
    def opt(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)
    cost = "-" if row.cost_seconds is None else f"{human_seconds(row.cost_seconds)}@{row.cost_batch_size}"
    def seconds(value: float | None) -> str:
        return "-" if value is None else human_seconds(value)
    return (row.name, row.state, str(row.queue_depth), str(row.in_flight),
            opt(row.rows_per_second, ".1f"), seconds(row.p50_seconds), seconds(row.p99_seconds),
            share_text(row), loads_text(row), opt(row.misses_per_request, ".2f"),
            "-" if row.eviction_rank is None else str(row.eviction_rank), opt(row.rejected_per_second, ".1f"),
            opt(row.failures_per_second, ".1f"), opt(row.rows_per_execution, ".2f"), cost,
            f"{row.weight:g}", str(row.max_batch_size) if row.max_batch_size else "uncapped",
            row.residency, human_bytes(row.resident_bytes), human_bytes(row.weight_bytes), str(row.version))


def share_text(row: ModelRow) -> str:
    """``62%/50%``: the device time it had over the last update, and what its weight entitles
    it to under ``fair`` (``-`` where there is no figure)."""
    had = "-" if row.device_share is None else f"{row.device_share:.0%}"
    due = "-" if row.weight_share is None else f"{row.weight_share:.0%}"
    return f"{had}/{due}"


# The thrash marker: weights copied onto the device and evicted within one update.
THRASH_MARK = "!"


def loads_text(row: ModelRow) -> str:
    """``12/11!``: weight loads and evictions since the worker started, marked while thrashing."""
    return f"{row.weight_loads}/{row.evictions}" + (THRASH_MARK if row.thrashing else "")


def snapshot_dict(status: pb.ModelControlStatusResponse) -> dict[str, Any]:
    """One snapshot as plain JSON-ready data, for ``xlaserve top --once --json``: the proto's
    field names, integers as numbers (not the strings protobuf's JSON mapping gives int64), the
    learned costs as ``{"batch size": seconds}``. A gateway's answer (``workers`` set) is
    ``{"workers": [one worker's snapshot, ...]}``."""
    if status.workers:
        return {"workers": [snapshot_dict(w) for w in status.workers]}
    models = []
    for m in status.models:
        models.append({
            "name": m.name, "state": m.state, "version": m.version, "reason": m.reason,
            "residency": m.residency, "resident_bytes": m.resident_bytes,
            "weight_bytes": m.weight_bytes, "queue_depth": m.queue_depth,
            "learned_cost_seconds": {str(k): v for k, v in sorted(m.learned_cost_seconds.items())},
            "weight": m.weight, "max_batch_size": m.max_batch_size,
            "batch_delay_seconds": m.batch_delay_seconds, "batch_target_rows": m.batch_target_rows,
            "requests": m.requests, "executions": m.executions,
            "successes": m.successes, "success_seconds": m.success_seconds,
            "failures": m.failures, "queue_seconds": m.queue_seconds,
            "executions_by_batch_size": {str(k): v for k, v in sorted(m.executions_by_batch_size.items())},
            "in_flight": m.in_flight, "latency_bucket_counts": list(m.latency_bucket_counts),
            "device_seconds": m.device_seconds, "rejections": dict(sorted(m.rejections.items())),
            "weight_loads": m.weight_loads, "evictions": m.evictions,
            "hook_failures": dict(sorted(m.hook_failures.items())),
            "weight_misses": m.weight_misses, "eviction_rank": m.eviction_rank,
        })
    return {"worker": status.worker, "backend": status.backend, "discipline": status.discipline,
            "budget_bytes": status.budget_bytes, "resident_bytes": status.resident_bytes,
            "in_flight": status.in_flight, "uptime_seconds": status.uptime_seconds,
            "eviction_policy": status.eviction_policy,
            "executable_cache": dict(sorted(status.executable_cache.items())),
            "hook_threads": status.hook_threads, "hook_threads_busy": status.hook_threads_busy,
            "hook_requests_waiting": status.hook_requests_waiting, "meta_threads": status.meta_threads,
            "meta_threads_busy": status.meta_threads_busy, "meta_requests_waiting": status.meta_requests_waiting,
            "latency_bucket_bounds": list(status.latency_bucket_bounds), "models": models}


def json_ready(data: Any) -> Any:
    """:func:`snapshot_dict`'s data with every number JSON has no word for (NaN, an infinity a
    peer sent) as null, so ``--once --json`` prints JSON that strict parsers read."""
    if isinstance(data, dict):
        return {k: json_ready(v) for k, v in data.items()}
    if isinstance(data, list):
        return [json_ready(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return None
    return data


def once_text(status: pb.ModelControlStatusResponse, address: str) -> str:
    """``xlaserve top --once`` without ``--json``: for each worker (a gateway's answer has
    several) its line, then its models as a text table."""
    lines: list[str] = []
    for one in (status.workers or [status]):
        worker, rows = derive(one, None, None)
        if lines:
            lines.append("")
        cache = (f", executable cache {worker.cache_hits}/{worker.cache_lookups} hits"
                 if worker.cache_lookups else "")
        pools, _ = hook_pools_text(worker)
        lines.append(f"{worker.worker} at {address}, backend {worker.backend}, {worker.discipline or '-'}, "
                     f"budget {human_bytes(worker.resident_bytes)} / {human_bytes(worker.budget_bytes)}, "
                     f"{worker.in_flight} in flight, up {human_duration(worker.uptime_seconds)}{cache}"
                     + (f", {pools}" if pools else ""))
        table = [[heading for _, heading in COLUMNS]] + [list(cells(row)) for row in rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(COLUMNS))]
        for line in table:
            lines.append("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip())
    return "\n".join(lines)


def human_duration(seconds: float) -> str:
    """An uptime to the minute (so that a line showing it changes once a minute, not at every
    update): ``<1m``, ``12m``, ``5h02m``, ``3d04h``; ``-`` for a figure that is no time (NaN, infinite:
    the number comes from the network)."""
    if not math.isfinite(seconds):
        return "-"
    whole = int(seconds)
    if whole < 60:
        return "<1m"
    if whole < 3600:
        return f"{whole // 60}m"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


SPARK_BLOCKS = " ▁▂▃▄▅▆▇█"


def spark(values: Sequence[float]) -> str:
    """``values`` as one line of block characters, scaled to their largest (a blank for 0, a
    full block for the largest); empty when all are 0, so that an idle model draws nothing."""
    top = max(values, default=0.0)
    if top <= 0:
        return ""
    last = len(SPARK_BLOCKS) - 1
    return "".join(SPARK_BLOCKS[0 if v <= 0 else max(1, round(last * v / top))] for v in values)
