"""Per-model statistics as Triton's ModelStatistics reports them. Written by the scheduler, and
by the inference service for meta-model requests; kept per model name for the worker's lifetime."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType
from collections.abc import Mapping


@dataclass(frozen=True, slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def plus(self, ns: int, count: int = 1) -> "Duration":
        return Duration(self.count + count, self.ns + ns)


@dataclass(frozen=True, slots=True)
class BatchStats:
    compute_input: Duration = Duration()
    compute_infer: Duration = Duration()
    compute_output: Duration = Duration()


@dataclass(frozen=True, slots=True)
class ModelStats:
    """Cumulative counts and durations of one model (version-independent)."""

    success: Duration = Duration()
    fail: Duration = Duration()
    queue: Duration = Duration()
    compute_input: Duration = Duration()
    compute_infer: Duration = Duration()
    compute_output: Duration = Duration()
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    batches: Mapping[int, BatchStats] = field(default_factory=lambda: MappingProxyType({}))


class StatsBook:
    """The scheduler's running totals; :meth:`get` hands out immutable values."""

    def __init__(self) -> None:
        self._models: dict[str, ModelStats] = {}

    def get(self, model: str) -> ModelStats:
        return self._models.get(model, ModelStats())

    def names(self) -> list[str]:
        return sorted(self._models)

    def record_success(self, model: str, total_ns: int, queue_ns: int, input_ns: int, infer_ns: int,
                       output_ns: int, now_ms: int) -> None:
        self.record_successes(model, 1, total_ns, queue_ns, input_ns, infer_ns, output_ns, now_ms)

    def record_successes(self, model: str, count: int, total_ns: int, queue_ns: int, input_ns: int,
                         infer_ns: int, output_ns: int, now_ms: int) -> None:
        """``count`` successful requests of one execution at once; durations are their sums."""
        s = self.get(model)
        self._models[model] = replace(
            s, success=s.success.plus(total_ns, count), queue=s.queue.plus(queue_ns, count),
            compute_input=s.compute_input.plus(input_ns, count), compute_infer=s.compute_infer.plus(infer_ns, count),
            compute_output=s.compute_output.plus(output_ns, count), last_inference_ms=now_ms)

    def record_failure(self, model: str, total_ns: int) -> None:
        s = self.get(model)
        self._models[model] = replace(s, fail=s.fail.plus(total_ns))

    def record_execution(self, model: str, size: int, rows: int, input_ns: int, infer_ns: int,
                         output_ns: int) -> None:
        s = self.get(model)
        b = s.batches.get(size, BatchStats())
        batches = dict(s.batches)
        batches[size] = BatchStats(b.compute_input.plus(input_ns), b.compute_infer.plus(infer_ns),
                                   b.compute_output.plus(output_ns))
        self._models[model] = replace(s, inference_count=s.inference_count + rows,
                                      execution_count=s.execution_count + 1, batches=MappingProxyType(batches))
