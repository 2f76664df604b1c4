"""Choosing which queued requests run together, and at which compiled batch size. Pure."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


def smallest_holding(sizes: Sequence[int], rows: int) -> int | None:
    """The smallest compiled size (``sizes`` ascending) that holds ``rows``, or None."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Run the queued requests at ``indices`` (ascending) together at compiled ``size``."""

    indices: tuple[int, ...]
    rows: int
    size: int

    @property
    def padding(self) -> int:
        return self.size - self.rows


def plan_batch(queued_rows: Sequence[int], sizes: Sequence[int], cap: int | None = None) -> BatchPlan:
    """The dispatch that serves the most queued rows with the least padding.

    ``queued_rows`` is each queued request's row count in queue order, ``sizes`` the compiled
    batch sizes ascending, ``cap`` the model's ``max_batch_size`` (None: uncapped). The first
    request is always taken, even when it alone exceeds ``cap`` (it then runs alone); requests
    are never split. After it, requests are taken first-fit in queue order while they fit in
    ``min(cap, largest size)`` rows, so a request too large for the room left does not stop
    smaller ones behind it from filling the batch (it is at most one dispatch from the head).
    The batch runs at the smallest compiled size that holds its rows.

    Raises ValueError when nothing is queued or the first request exceeds every compiled size.
    """
    if not queued_rows:
        raise ValueError("nothing is queued")
    largest = sizes[-1]
    limit = largest if cap is None else min(cap, largest)
    first = queued_rows[0]
    if first > largest:
        raise ValueError(f"a request of {first} rows exceeds the largest compiled batch size {largest}")
    indices = [0]
    total = first
    smallest_request = min(queued_rows) if len(queued_rows) < 64 else 1
    for i in range(1, len(queued_rows)):
        if limit - total < smallest_request:
            break                      # full: nothing queued can fit any more
        rows = queued_rows[i]
        if total + rows <= limit:
            indices.append(i)
            total += rows
    return BatchPlan(tuple(indices), total, smallest_holding(sizes, total))


def choose_batch(queued_rows: Sequence[int], sizes: Sequence[int], cap: int | None = None) -> tuple[int, int]:
    """``(count, size)`` of the longest queue prefix that :func:`plan_batch` would take.

    Kept for callers that can only take a prefix; the scheduler uses :func:`plan_batch`.
    """
    plan = plan_batch(queued_rows, sizes, cap)
    count = 0
    while count < len(plan.indices) and plan.indices[count] == count:
        count += 1
    size = smallest_holding(sizes, sum(queued_rows[:count]))
    assert size is not None
    return count, size
