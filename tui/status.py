"""What the dashboard shows, computed from the worker's status snapshots: pure, no I/O.

A ``WatchStatus`` snapshot carries counters (``requests``, ``executions``) and levels (queue
depth, residency, bytes). :func:`derive` turns two consecutive snapshots and the seconds between
them into rows of rates and levels, and :func:`changes` into the event log's lines. Everything
here is a small frozen value, so the app and the tests compare snapshots, never live objects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from xlaserve._proto import xlaserve_control_pb2 as pb

# Columns the model table shows, in order: (key, heading). A key is a ModelRow field; sorting
# by a column sorts by that field.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("name", "model"),
    ("state", "state"),
    ("version", "ver"),
    ("queue_depth", "queue"),
    ("rows_per_second", "rows/s"),
    ("rows_per_execution", "rows/exec"),
    ("latency_seconds", "latency"),
    ("failures_per_second", "fail/s"),
    ("cost_seconds", "cost"),
    ("weight", "weight"),
    ("max_batch_size", "max_bs"),
    ("residency", "residency"),
    ("resident_bytes", "resident"),
    ("weight_bytes", "weights"),
)
SORT_KEYS = tuple(key for key, _ in COLUMNS)


@dataclass(frozen=True, slots=True)
class ModelRow:
    """One model as the table shows it. The rates and means are over the last interval, from
    the changes of the worker's counters; ``None`` until two snapshots exist, and the means also
    when nothing was answered (or run) in the interval: ``latency_seconds`` and
    ``queue_wait_seconds`` are the mean time of the requests answered, from receipt to answer and
    queued; ``batch_mix`` is the executions of each compiled batch size. ``cost_seconds`` is the
    learned cost of the largest compiled batch size the worker has learned a cost for (``None``
    before the first execution)."""
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


@dataclass(frozen=True, slots=True)
class WorkerView:
    """The worker's line: its name, backend, weight budget and the bytes of it in use, and the
    rows per second summed over its models (``None`` until two snapshots exist)."""
    worker: str
    backend: str
    budget_bytes: int
    resident_bytes: int
    rows_per_second: float | None


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


def _row(model: pb.ModelControl, before: pb.ModelControl | None, seconds: float | None) -> ModelRow:
    costs = tuple(sorted((int(k), float(v)) for k, v in model.learned_cost_seconds.items()))
    rate = per_execution = latency = queue_wait = failure_rate = None
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
    return ModelRow(
        name=model.name, state=model.state, version=model.version, reason=model.reason,
        queue_depth=model.queue_depth, rows_per_second=rate, rows_per_execution=per_execution,
        latency_seconds=latency, queue_wait_seconds=queue_wait, failures_per_second=failure_rate,
        batch_mix=mix,
        cost_batch_size=costs[-1][0] if costs else None, cost_seconds=costs[-1][1] if costs else None,
        learned_cost_seconds=costs, weight=model.weight, max_batch_size=model.max_batch_size,
        batch_delay_seconds=model.batch_delay_seconds, batch_target_rows=model.batch_target_rows,
        residency=model.residency, resident_bytes=model.resident_bytes,
        weight_bytes=model.weight_bytes, requests=model.requests, executions=model.executions,
        successes=model.successes, failures=model.failures)


def derive(current: pb.ModelControlStatusResponse, previous: pb.ModelControlStatusResponse | None,
           seconds: float | None) -> tuple[WorkerView, tuple[ModelRow, ...]]:
    """The worker's line and one row per model of ``current``, with rates over the ``seconds``
    since ``previous`` (pass ``None`` for both on the first snapshot). A model new in ``current``
    has no rate yet."""
    before = {m.name: m for m in previous.models} if previous is not None else {}
    rows = tuple(_row(m, before.get(m.name), seconds if previous is not None else None)
                 for m in current.models)
    rates = [r.rows_per_second for r in rows if r.rows_per_second is not None]
    total = math.fsum(rates) if previous is not None and rates else (0.0 if previous is not None else None)
    worker = WorkerView(worker=current.worker, backend=current.backend,
                        budget_bytes=current.budget_bytes, resident_bytes=current.resident_bytes,
                        rows_per_second=total)
    return worker, rows


def changes(current: pb.ModelControlStatusResponse,
            previous: pb.ModelControlStatusResponse | None) -> tuple[StatusEvent, ...]:
    """The event log's lines for what changed from ``previous`` to ``current``: a model that
    appeared (every model, on the first snapshot), went away, or changed state, version or
    reason. Levels and counters that move all the time (queue depth, bytes) are not events."""
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
    for name in before.keys() - now.keys():
        events.append(StatusEvent(name, f"{name}: gone"))
    return tuple(events)


def visible(rows: Iterable[ModelRow], name_filter: str, sort_key: str,
            descending: bool) -> list[ModelRow]:
    """The rows whose name contains ``name_filter`` (case-insensitive), sorted by the column
    ``sort_key`` (a :data:`SORT_KEYS` entry), then by name. Rows without a figure (``None``)
    sort last either way."""
    if sort_key not in SORT_KEYS:
        raise ValueError(f"unknown sort column {sort_key!r}; expected one of {', '.join(SORT_KEYS)}")
    needle = name_filter.lower()
    chosen = sorted((r for r in rows if needle in r.name.lower()), key=lambda r: r.name)
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
    return (row.name, row.state, str(row.version), str(row.queue_depth),
            opt(row.rows_per_second, ".1f"), opt(row.rows_per_execution, ".2f"),
            "-" if row.latency_seconds is None else human_seconds(row.latency_seconds),
            opt(row.failures_per_second, ".1f"), cost,
            f"{row.weight:g}", str(row.max_batch_size) if row.max_batch_size else "uncapped",
            row.residency, human_bytes(row.resident_bytes), human_bytes(row.weight_bytes))


def snapshot_dict(status: pb.ModelControlStatusResponse) -> dict[str, Any]:
    """One snapshot as plain JSON-ready data, for ``xlaserve top --once --json``: the proto's
    field names, integers as numbers (not the strings protobuf's JSON mapping gives int64), the
    learned costs as ``{"batch size": seconds}``."""
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
        })
    return {"worker": status.worker, "backend": status.backend,
            "budget_bytes": status.budget_bytes, "resident_bytes": status.resident_bytes,
            "models": models}
