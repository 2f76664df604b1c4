"""What both of ``xlaserve bench``'s clients share: the inputs and clients a level runs
(:class:`InputSpec`, :class:`ClientPlan`), how it counts answers (:class:`Window`) and what it
reports (:class:`LevelResult`). :mod:`xlaserve.bench.loadgen` (the Triton client and the command)
and :mod:`xlaserve.bench.native` (xlaserve's own HTTP/2 client) import it; neither imports the
other's module at its top."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

_NUMPY = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
          "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
          "FP32": np.float32, "FP64": np.float64}


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One input the load generator sends. ``batch_axis`` is the index in ``shape`` of the batch
    axis, or None when the tensor has none."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    batch_axis: int | None = 0


@dataclass(frozen=True, slots=True)
class ClientPlan:
    """One closed-loop client: ``choose()`` names the model of its next request."""

    choose: Callable[[], str]


@dataclass
class ModelTally:
    latencies: list[float] = field(default_factory=list)
    rows: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class LevelResult:
    concurrency: int
    duration_s: float
    tallies: dict[str, ModelTally]
    answered: int = 0        # every answer, warm-up and errors included (for CPU per request)

    def rows(self) -> list[dict]:
        """One summary per model and a total (model ``*``), as the JSON lines print them."""
        out = []
        names = sorted(self.tallies)
        total = ModelTally()
        for name in names:
            t = self.tallies[name]
            total.latencies += t.latencies
            total.rows += t.rows
            for status, n in t.errors.items():
                total.errors[status] = total.errors.get(status, 0) + n
        for name, t in [*((n, self.tallies[n]) for n in names), ("*", total)]:
            if name == "*" and len(names) == 1:
                continue
            lat = np.asarray(t.latencies) * 1e3
            row = {"concurrency": self.concurrency, "model": name if len(names) > 1 else names[0],
                   "duration_s": round(self.duration_s, 3), "requests": len(lat),
                   "throughput_rps": round(len(lat) / self.duration_s, 2),
                   "throughput_rows_s": round(t.rows / self.duration_s, 2)}
            for label, q in (("p50", 50), ("p90", 90), ("p99", 99)):
                row[f"{label}_ms"] = round(float(np.percentile(lat, q)), 3) if len(lat) else None
            row["max_ms"] = round(float(lat.max()), 3) if len(lat) else None
            row["errors"] = dict(sorted(t.errors.items()))
            out.append(row)
        return out


class Window:
    """One level's measured window, shared by both clients: :meth:`count` files each answer
    under its model (those that arrive within ``duration`` after ``warmup``) and says how long
    the client waits before its next request."""

    __slots__ = ("tallies", "opens", "closes", "think", "ok", "failed", "answered")

    def __init__(self, models, start: float, warmup: float, duration: float, think_ms: float = 0.0) -> None:
        self.tallies = {m: ModelTally() for m in models}
        self.opens = start + warmup
        self.closes = self.opens + duration
        self.think = think_ms / 1000
        self.ok = self.failed = self.answered = 0

    def count(self, model: str, rows: int, t0: float, t1: float, status: str | None) -> float | None:
        """One answer (``status`` None: OK, else the gRPC status name) of a request sent at
        ``t0``, received at ``t1``: the seconds to wait before the next request, or None once
        the window has closed (the client stops)."""
        self.answered += 1
        if t1 >= self.closes:
            return None
        if t1 >= self.opens:
            tally = self.tallies[model]
            if status is None:
                tally.latencies.append(t1 - t0)
                tally.rows += rows
                self.ok += 1
            else:
                tally.errors[status] = tally.errors.get(status, 0) + 1
                self.failed += 1
        if status in ("UNAVAILABLE", "UNKNOWN"):
            return self.think + 0.01      # the server is gone or restarting: do not spin
        return self.think

    def result(self, clients: int, duration: float) -> LevelResult:
        return LevelResult(clients, duration, self.tallies, self.answered)


def rows_per_request(specs: Sequence[InputSpec]) -> int:
    """The rows one request carries: the batch axis's size in the first input that has one, or 1
    when none has (a model without a batch axis answers one sample per request)."""
    for spec in specs:
        if spec.batch_axis is not None and spec.batch_axis < len(spec.shape):
            return spec.shape[spec.batch_axis]
    return 1


def random_tensor(spec: InputSpec, rng: np.random.Generator) -> np.ndarray:
    dtype = _NUMPY[spec.datatype]
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(spec.shape).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, spec.shape).astype(np.bool_)
    return rng.integers(0, 128, spec.shape).astype(dtype)
