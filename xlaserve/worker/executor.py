"""The executor: the only code that runs a model on the device.

An execution normally runs in a worker thread so that the Trio thread keeps serving the
frontend meanwhile. A thread hop costs the Trio thread about as much as a sub-millisecond
execution itself (two wake-ups and a context switch), so an execution whose last run at that
batch size took less than :data:`INLINE_BELOW_SECONDS` (by backend) of device work (as the
executor itself measures it, hop excluded) runs on the Trio thread instead; see
docs/scheduler.md for what that changed.
"""
from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import trio

from xlaserve.bundle import ModelVersion
from xlaserve.runtime.pjrt import Device
from xlaserve.runtime.pool import aligned_bytes


@dataclass(frozen=True, slots=True)
class BatchResult:
    """Each request's own rows of every executable output, in request order."""

    per_request: tuple[Mapping[str, np.ndarray], ...]
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    inline: bool = False     # ran on the Trio thread (see Executor.run)


def assemble(model: ModelVersion, requests: Sequence[Mapping[str, np.ndarray]], size: int) -> list[np.ndarray]:
    """Concatenate the requests' rows along each input's batch axis and zero-pad to ``size``.

    Several requests are copied once, into memory aligned to :data:`~xlaserve.runtime.pool.ALIGN`
    bytes, which PJRT's cpu client takes as the device buffer as it is; ``np.concatenate``'s
    result (16-byte aligned) was copied a second time by PJRT (``img_mean`` at batch 32: 2-13 µs
    of CPU a request, docs/benchmarks.md). One request that fills the batch is passed as it is
    (PJRT copies it where it is not aligned: one copy either way)."""
    arrays = []
    for decl in model.manifest.executable_inputs:
        axis = decl.batch_axis
        dtype = decl.dtype.numpy
        parts = [r[decl.name] for r in requests]
        if len(parts) == 1 and parts[0].shape[axis] == size:
            arrays.append(np.ascontiguousarray(parts[0], dtype=dtype))
            continue
        shape = list(parts[0].shape)
        shape[axis] = size
        out = aligned_empty(tuple(shape), dtype)
        index = [slice(None)] * len(shape)
        start = 0
        for part in parts:
            rows = part.shape[axis]
            index[axis] = slice(start, start + rows)
            np.copyto(out[tuple(index)], part, casting="unsafe")
            start += rows
        if start < size:
            index[axis] = slice(start, size)
            out[tuple(index)] = 0
        arrays.append(out)
    return arrays


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts at a multiple of
    :data:`~xlaserve.runtime.pool.ALIGN` bytes (unless it is empty: NumPy need not keep an empty
    array's address)."""
    dtype = np.dtype(dtype)
    return aligned_bytes(dtype.itemsize * math.prod(shape)).view(dtype).reshape(shape)


def split(model: ModelVersion, outputs: Sequence[np.ndarray], rows: Sequence[int]) -> tuple[dict[str, np.ndarray], ...]:
    """Cut each output back into the requests' own rows (views; padding is dropped)."""
    per_request: list[dict[str, np.ndarray]] = [{} for _ in rows]
    for decl, out in zip(model.manifest.executable_outputs, outputs):
        axis = decl.batch_axis
        start = 0
        for i, n in enumerate(rows):
            index = [slice(None)] * out.ndim
            index[axis] = slice(start, start + n)
            per_request[i][decl.name] = out[tuple(index)]
            start += n
    return tuple(per_request)


INLINE_BELOW_SECONDS = {"cpu": 0.005, "cuda": 0.001}
"""Executions measured to take less than this run on the Trio thread, without a thread hop. On
cpu the execution itself keeps the cores busy (XLA's own threads), so the frontend gains little
by running beside it: every execution inline measured +16% for ``img_mean`` at c=32 (1,499 ->
1,742 req/s); 5 ms bounds how long the frontend goes unserved. On a GPU the Trio thread would
sit idle while the device works, so only sub-millisecond ones."""


INLINE_WITH_BACKLOG_BELOW_SECONDS = 0.001
"""While other requests wait, an execution runs on the Trio thread only below this: a longer
one inline holds the frontend for its whole length, and the requests arriving meanwhile are
received only after it (``img_mean`` at batch 32, about 4 ms: +11% at c=128 and +7% at c=256 in a
thread, -5% at c=32, where few requests wait; docs/benchmarks.md)."""


class Executor:
    def __init__(self, device: Device, limiter: trio.CapacityLimiter) -> None:
        self.device = device
        self._limiter = limiter
        self._inline_below = INLINE_BELOW_SECONDS.get(device.backend, INLINE_BELOW_SECONDS["cuda"])
        self._last: dict[tuple[int, int], float] = {}   # (id of the executable, size) -> s

    async def run(self, model: ModelVersion, size: int, weights: tuple[object, ...],
                  requests: Sequence[Mapping[str, np.ndarray]], rows: Sequence[int],
                  backlog: bool = False) -> BatchResult:
        """Run one batch. ``backlog``: requests are waiting that this batch does not take; then
        only executions under :data:`INLINE_WITH_BACKLOG_BELOW_SECONDS` run on the Trio thread,
        so that the frontend goes on receiving and decoding the next ones while a longer one
        runs."""
        # keyed by the executable, not the model version: the bundles of one architecture share
        # it (ExecutableTable), so a catalog of a thousand fine-tuned variants is measured once
        # per architecture and size, and the table stays far below its bound
        key = (id(model.modules[size].executable), size)
        last = self._last.get(key)
        below = min(self._inline_below, INLINE_WITH_BACKLOG_BELOW_SECONDS) if backlog else self._inline_below
        if last is not None and last < below:
            # the device is still one at a time with weight copies; a free device costs no yield
            try:
                self._limiter.acquire_nowait()
            except trio.WouldBlock:
                await self._limiter.acquire()
            try:
                result = self._run(model, size, weights, requests, rows, True)
            finally:
                self._limiter.release()
        else:
            result = await trio.to_thread.run_sync(self._run, model, size, weights, requests, rows,
                                                   limiter=self._limiter)
        if len(self._last) > 4096:      # versions come and go with reloads; forget them all now and then
            self._last.clear()
        self._last[key] = (result.compute_input_ns + result.compute_infer_ns + result.compute_output_ns) / 1e9
        return result

    def _run(self, model, size, weights, requests, rows, inline: bool = False) -> BatchResult:
        t0 = time.perf_counter_ns()
        inputs = assemble(model, requests, size)
        t1 = time.perf_counter_ns()
        outputs = self.device.execute(model.modules[size].executable, [*weights, *inputs])
        t2 = time.perf_counter_ns()
        per_request = split(model, outputs, rows)
        t3 = time.perf_counter_ns()
        return BatchResult(per_request, t1 - t0, t2 - t1, t3 - t2, inline)
