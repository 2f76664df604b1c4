"""Choosing how many queued requests run together, and at which compiled batch size. Pure."""
from __future__ import annotations

import bisect
from collections.abc import Sequence


def smallest_holding(sizes: Sequence[int], rows: int) -> int | None:
    """The smallest compiled size (``sizes`` ascending) that holds ``rows``, or None."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


def choose_batch(queued_rows: Sequence[int], sizes: Sequence[int], cap: int | None = None) -> tuple[int, int]:
    """Return ``(count, size)``: run the first ``count`` queued requests at compiled ``size``.

    Requests are taken in queue order and never split, up to the largest compiled size and
    ``cap`` rows (the model's ``max_batch_size``); among the sizes that hold what was taken the
    smallest is used, so the batch serves the most queued rows with the least padding. The
    first request is always taken, even when it alone exceeds ``cap``.
    """
    if not queued_rows:
        raise ValueError("nothing is queued")
    limit = sizes[-1] if cap is None else min(cap, sizes[-1])
    total, count = 0, 0
    for rows in queued_rows:
        if count and total + rows > limit:
            break
        total += rows
        count += 1
    size = smallest_holding(sizes, total)
    if size is None:
        raise ValueError(f"{total} rows exceed the largest compiled batch size {sizes[-1]}")
    return count, size
