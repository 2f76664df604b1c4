"""Messages between a worker's actors. Frozen and slotted; one union per inbox."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from xlaserve.bundle import ModelVersion
from xlaserve.errors import XlaserveError
from xlaserve.tracing import RequestTrace


@dataclass(frozen=True, slots=True)
class InferResult:
    """A request's own rows of every executable output, and where its time went."""

    outputs: Mapping[str, np.ndarray]
    batch_size: int           # the compiled batch size it ran at
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int


Outcome = InferResult | XlaserveError
Reply = Callable[[Outcome], None]
"""A one-shot reply: called exactly once, on the Trio thread."""


@dataclass(frozen=True, slots=True)
class InferRequest:
    """Executable inputs of one request, validated against ``model``, waiting for the device."""

    model: ModelVersion
    inputs: Mapping[str, np.ndarray]
    rows: int
    request_id: str
    deadline: float                # when the caller stops waiting, on the Trio clock; math.inf: never
    reply: Reply
    received_ns: int               # time.perf_counter_ns() when the frontend received it
    enqueued_at: float             # trio.current_time() when it was handed to the scheduler
    ticket: object = None          # what a CancelRequest names it by (hashable); None: not cancellable
    trace: RequestTrace | None = None   # its spans, when it is traced (xlaserve.tracing)


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """The caller of the request queued with ``ticket`` went away. If it is still queued it is
    taken out and answered CANCELLED, and never runs; if it was dispatched (or already answered)
    nothing changes."""

    ticket: object


@dataclass(frozen=True, slots=True)
class DropModel:
    """Answer every queued request of ``name`` with ``error`` (the model went away)."""

    name: str
    error: XlaserveError


SchedulerMessage = InferRequest | CancelRequest | DropModel
